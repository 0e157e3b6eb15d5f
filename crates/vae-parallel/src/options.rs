//! The options of one request: [`Decode`] and [`Encode`], which share [`Options`] (the
//! parallel mode, what the pixels follow, the memory cap, where the output goes, how the ranks
//! cooperate) and differ only in what an encode returns ([`EncodeOutput`]).
//!
//! The defaults are a diffusers user's: the pixels of the untiled `vae.decode(z)`, computed in
//! parallel where the family can split the untiled computation exactly ([`ParallelMode::Auto`]
//! over shards), tiles only when asked for ([`Tiling::On`], diffusers' `enable_tiling()`).
//! The CLI keeps the reference system's flag semantics instead ([`Tiling::Reference`]).

use vae_runtime::{HaloOverlap, OutputPlacement, ParallelMode, TileMerge};

use crate::error::{Error, Result};

/// Which pixels a request computes: diffusers' untiled or tiled ones, or, as the reference
/// system (vllm-omni) does, whichever its strategy gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Tiling {
    /// diffusers without `enable_tiling()`: the untiled computation, bit for bit. Several ranks
    /// split it exactly (a spatial shard) where the family can; otherwise one rank computes it,
    /// and a warning says why.
    #[default]
    Off,
    /// diffusers after `enable_tiling()`: an input larger than a tile is tiled and blended as
    /// diffusers tiles it, the tiles spread over the ranks. (A shard mode named explicitly
    /// still computes the untiled pixels: a shard has no tiles.)
    On,
    /// The reference's `vae_use_tiling` flag, which the CLI keeps: tiling is on when `asked`
    /// or when more than one rank computes (a parallel size above 1 forces it), and `auto`
    /// may choose tiles or a shard, which give different pixels.
    Reference {
        /// `--vae-use-tiling` was given.
        asked: bool,
    },
}

impl Tiling {
    /// Whether a tile strategy on `parallel_size` ranks tiles (diffusers' `use_tiling`).
    pub fn tiles(self, parallel_size: usize) -> bool {
        match self {
            Self::Off => false,
            Self::On => true,
            Self::Reference { asked } => asked || parallel_size > 1,
        }
    }
}

/// What an encode returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EncodeOutput {
    /// The mean of the latent distribution (normalised as the pipeline's latents with
    /// [`Options::latents_normalized`]).
    #[default]
    Mean,
    /// The raw moments (mean and log-variance after `quant_conv`).
    Moments,
}

impl std::str::FromStr for EncodeOutput {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s.trim() {
            "mean" => Ok(Self::Mean),
            "moments" => Ok(Self::Moments),
            other => Err(Error::invalid_option(format!("`output` must be moments or mean, not {other:?}"))),
        }
    }
}

/// The options every request has. [`Decode`] and [`Encode`] dereference to them.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Options {
    /// How the ranks split the work (default [`ParallelMode::Auto`]: the fastest exact
    /// strategy the family and the cost model find).
    pub mode: ParallelMode,
    /// Which pixels: untiled (default) or tiled.
    pub tiling: Tiling,
    /// The latents are as the diffusion pipeline produces them (normalised): undo (decode) or
    /// apply (encode) the family's normalisation around the VAE.
    pub latents_normalized: bool,
    /// Who receives the output; `None`: the family's contract (decode: usually the owner,
    /// rank 0; encode: every rank).
    pub placement: Option<OutputPlacement>,
    /// Under [`ParallelMode::Auto`], the fastest strategy whose predicted peak memory per rank
    /// (the request's own tensors, beyond the weights and the input) fits this many bytes; an
    /// error naming the smallest predicted peak when none does.
    pub max_memory_per_rank: Option<u64>,
    /// [`ParallelMode::SpatialShard2d`]'s grid `[rows, columns]` of blocks; `None`: the
    /// factorisation of the parallel size whose blocks are closest to square.
    pub shard_grid: Option<[usize; 2]>,
    /// Ranks that compute (the reference's `vae_patch_parallel_size`); `None`: the whole
    /// group. Ranks beyond it take part in the collectives only.
    pub parallel_size: Option<usize>,
    /// How a tile-parallel 2-D tiling is merged (same bits either way).
    pub tile_merge: TileMerge,
    /// Whether shards overlap their halo exchanges with the interior's compute (same bits
    /// either way).
    pub halo_overlap: HaloOverlap,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            mode: ParallelMode::Auto,
            tiling: Tiling::Off,
            latents_normalized: false,
            placement: None,
            max_memory_per_rank: None,
            shard_grid: None,
            parallel_size: None,
            tile_merge: TileMerge::default(),
            halo_overlap: HaloOverlap::default(),
        }
    }
}

impl Options {
    /// Refuses values no request can run with, naming the option: a parallel size, grid or
    /// memory cap of zero, a grid with a mode other than the 2-D shard.
    pub fn validate(&self) -> Result<()> {
        if self.parallel_size == Some(0) {
            return Err(Error::invalid_option("`vae_patch_parallel_size` must be at least 1"));
        }
        if self.max_memory_per_rank == Some(0) {
            return Err(Error::invalid_option("`max_memory_per_rank` must be positive"));
        }
        if let Some([r, c]) = self.shard_grid {
            if r == 0 || c == 0 {
                return Err(Error::invalid_option(format!("`shard_grid` must be at least 1x1, not {r}x{c}")));
            }
            if self.mode != ParallelMode::SpatialShard2d {
                return Err(Error::invalid_option(format!(
                    "`shard_grid` applies to `vae_parallel_mode` spatial_shard_2d, not {}",
                    self.mode
                )));
            }
        }
        Ok(())
    }
}

/// The builder methods of [`Options`] on a type that dereferences to them.
macro_rules! option_setters {
    ($ty:ident) => {
        impl $ty {
            /// How the ranks split the work.
            pub fn mode(mut self, mode: ParallelMode) -> Self {
                self.options.mode = mode;
                self
            }

            /// Which pixels: [`Tiling::Off`] (default), [`Tiling::On`] or the reference's.
            pub fn tiling(mut self, tiling: Tiling) -> Self {
                self.options.tiling = tiling;
                self
            }

            /// diffusers' tiled pixels (`enable_tiling()`), the tiles spread over the ranks.
            pub fn tiled(self) -> Self {
                self.tiling(Tiling::On)
            }

            /// The latents are the diffusion pipeline's (normalised): see
            /// [`Options::latents_normalized`].
            pub fn pipeline_latents(mut self) -> Self {
                self.options.latents_normalized = true;
                self
            }

            /// Who receives the output.
            pub fn placement(mut self, placement: OutputPlacement) -> Self {
                self.options.placement = Some(placement);
                self
            }

            /// `auto`'s cap on the predicted peak memory per rank, in bytes.
            pub fn max_memory_per_rank(mut self, bytes: u64) -> Self {
                self.options.max_memory_per_rank = Some(bytes);
                self
            }

            /// The 2-D shard over a grid of `rows` × `columns` blocks (sets the mode).
            pub fn shard_grid(mut self, rows: usize, columns: usize) -> Self {
                self.options.mode = ParallelMode::SpatialShard2d;
                self.options.shard_grid = Some([rows, columns]);
                self
            }

            /// Ranks that compute (the rest of the group only takes part in collectives).
            pub fn parallel_size(mut self, ranks: usize) -> Self {
                self.options.parallel_size = Some(ranks);
                self
            }

            /// How a tile-parallel 2-D tiling is merged.
            pub fn tile_merge(mut self, merge: TileMerge) -> Self {
                self.options.tile_merge = merge;
                self
            }

            /// Whether shards overlap their halo exchanges with compute.
            pub fn halo_overlap(mut self, overlap: HaloOverlap) -> Self {
                self.options.halo_overlap = overlap;
                self
            }

            /// All the shared options at once.
            pub fn with_options(mut self, options: Options) -> Self {
                self.options = options;
                self
            }
        }

        impl std::ops::Deref for $ty {
            type Target = Options;

            fn deref(&self) -> &Options {
                &self.options
            }
        }

        impl std::ops::DerefMut for $ty {
            fn deref_mut(&mut self) -> &mut Options {
                &mut self.options
            }
        }
    };
}

/// The options of a decode: latents to pixels.
///
/// ```
/// use vae_parallel::{Decode, ParallelMode, Tiling};
///
/// let untiled = Decode::default(); // diffusers' `vae.decode(z)`, in parallel where exact
/// assert_eq!((untiled.mode, untiled.tiling), (ParallelMode::Auto, Tiling::Off));
/// let tiled = Decode::default().tiled().pipeline_latents();
/// assert!(tiled.latents_normalized && tiled.tiling == Tiling::On);
/// let blocks = Decode::default().shard_grid(2, 2);
/// assert_eq!(blocks.mode, ParallelMode::SpatialShard2d);
/// ```
#[derive(Debug, Clone, PartialEq, Default)]
#[non_exhaustive]
pub struct Decode {
    /// The shared options.
    pub options: Options,
}

option_setters!(Decode);

/// The options of an encode: pixels to latents.
#[derive(Debug, Clone, PartialEq, Default)]
#[non_exhaustive]
pub struct Encode {
    /// The shared options.
    pub options: Options,
    /// The mean (default) or the raw moments.
    pub output: EncodeOutput,
}

option_setters!(Encode);

impl Encode {
    /// What the encode returns.
    pub fn output(mut self, output: EncodeOutput) -> Self {
        self.output = output;
        self
    }

    /// Refuses what no encode can run with: [`Options::validate`], and normalised raw
    /// moments (normalisation is defined for the mean).
    pub fn validate(&self) -> Result<()> {
        self.options.validate()?;
        if self.output == EncodeOutput::Moments && self.options.latents_normalized {
            return Err(Error::invalid_option(
                "normalised output is defined for the mean, not the raw moments (use `output` mean)",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    #[test]
    fn the_reference_tiles_whenever_several_ranks_compute() {
        assert!(!Tiling::Off.tiles(4));
        assert!(Tiling::On.tiles(1));
        assert!(!Tiling::Reference { asked: false }.tiles(1));
        assert!(Tiling::Reference { asked: false }.tiles(2));
        assert!(Tiling::Reference { asked: true }.tiles(1));
    }

    #[test]
    fn invalid_options_are_refused_by_name() {
        let grid = Decode::default().mode(ParallelMode::Tile);
        let grid = Decode { options: Options { shard_grid: Some([2, 2]), ..grid.options } };
        let err = grid.validate().unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidOption);
        assert_eq!(err.to_string(), "`shard_grid` applies to `vae_parallel_mode` spatial_shard_2d, not tile");
        assert!(Decode::default().shard_grid(0, 2).validate().unwrap_err().to_string().contains("at least 1x1"));
        let moments = Encode::default().output(EncodeOutput::Moments).pipeline_latents();
        assert!(moments.validate().unwrap_err().to_string().contains("raw moments"));
        assert!("mode".parse::<EncodeOutput>().is_err());
    }
}
