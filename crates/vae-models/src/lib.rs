//! VAE family adapters. Each family (AutoencoderKL for SD / FLUX.1 / Z-Image, FLUX.2,
//! Qwen-Image, Wan2.1/2.2) gets a module that mirrors diffusers' module tree and weight names
//! and owns the family's *policy*: which parallel modes it supports, how it picks one per
//! request, its tile geometry, and who receives the output. Shared crates below only provide
//! mechanism.
//!
//! Families: [`autoencoder_kl`] (AutoencoderKL and AutoencoderKLFlux2) and [`wan`] (Wan2.1,
//! Wan2.2 and Qwen-Image). Both load onto the CPU or a CUDA device.

pub mod autoencoder_kl;
mod error;
pub mod layers;
mod placement;
pub mod wan;
pub mod weights;

pub use error::{ModelError, Result};
use vae_runtime::OutputPlacement;

/// The VAE families vae-parallel targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Family {
    /// diffusers `AutoencoderKL`: Stable Diffusion 1.x/2.x/XL/3.x, FLUX.1, Z-Image.
    AutoencoderKl,
    /// diffusers `AutoencoderKLFlux2` (FLUX.2).
    Flux2,
    /// diffusers `AutoencoderKLQwenImage`.
    QwenImage,
    /// diffusers `AutoencoderKLWan` (Wan2.1, Wan2.2).
    Wan,
}

/// Encode or decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Latents to pixels.
    Decode,
    /// Pixels to latents.
    Encode,
}

impl Family {
    /// Every family.
    pub const ALL: [Family; 4] = [Self::AutoencoderKl, Self::Flux2, Self::QwenImage, Self::Wan];

    /// Which ranks get the result, as the reference system does it: decoded pixels go to the
    /// owner only for AutoencoderKL and Wan (the pipeline post-processes on rank 0) and to every
    /// rank for FLUX.2 and Qwen-Image; encoded latents go to every rank, because every rank
    /// conditions the diffusion model on them.
    pub fn default_placement(self, direction: Direction) -> OutputPlacement {
        match (direction, self) {
            (Direction::Encode, _) => OutputPlacement::AllRanks,
            (Direction::Decode, Self::AutoencoderKl | Self::Wan) => OutputPlacement::OwnerOnly,
            (Direction::Decode, Self::Flux2 | Self::QwenImage) => OutputPlacement::AllRanks,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placements_follow_the_reference_contract() {
        use Direction::*;
        use OutputPlacement::*;
        assert_eq!(Family::AutoencoderKl.default_placement(Decode), OwnerOnly);
        assert_eq!(Family::Wan.default_placement(Decode), OwnerOnly);
        assert_eq!(Family::Flux2.default_placement(Decode), AllRanks);
        assert_eq!(Family::QwenImage.default_placement(Decode), AllRanks);
        for f in Family::ALL {
            assert_eq!(f.default_placement(Encode), AllRanks, "{f:?}");
        }
    }
}
