//! Input checks every family shares: finite values, video frame counts and sizes the encoders
//! can fold, and whether a request can fit in memory.

use vae_tensor::Tensor;

use crate::{ModelError, Result};

/// An error naming how many values of `what` are NaN or infinite and where the first is: such
/// an input would decode to garbage without a word. A device input (a CUDA tensor lent
/// through DLPack) is not checked: reading its values would copy it to the host, which is what
/// such an input avoids (it decodes as PyTorch would, non-finite values and all).
pub(crate) fn check_finite(t: &Tensor, what: &str) -> Result<()> {
    if !t.device().is_cpu() {
        return Ok(());
    }
    let values = t.as_slice_f32()?;
    let Some(first) = values.iter().position(|v| !v.is_finite()) else { return Ok(()) };
    let count = values.iter().filter(|v| !v.is_finite()).count();
    let strides = t.shape().strides();
    let index: Vec<usize> = strides.iter().zip(t.dims()).map(|(s, n)| (first / s) % n).collect();
    Err(ModelError::InvalidInput(format!(
        "{what} has {count} non-finite value(s); the first is {} at index {index:?}",
        values[first]
    )))
}

fn human(bytes: u64) -> String {
    let units = [("GiB", 1u64 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
    match units.iter().find(|(_, size)| bytes >= *size) {
        Some((unit, size)) => format!("{:.1} {unit}", bytes as f64 / *size as f64),
        None => format!("{bytes} B"),
    }
}

/// An error before any work when a request cannot fit: `output` bytes of result on the rank
/// that assembles it plus `activation` bytes of the largest single feature map one rank holds
/// are a floor of what it needs (the real peak is higher), so a floor above the available
/// memory means the request would fail for certain. `advice` says what would shrink the
/// feature map (tiles, a shard); when the output alone does not fit, only a smaller request
/// helps, and the error says so.
pub(crate) fn ensure_fits(output: u64, activation: u64, advice: &str) -> Result<()> {
    let Some(available) = vae_tensor::memory::available_host_bytes() else { return Ok(()) };
    let needed = output.saturating_add(activation);
    if needed <= available {
        return Ok(());
    }
    let advice = if output > available {
        "the whole output is assembled on one rank: ask for fewer frames or fewer pixels"
    } else {
        advice
    };
    Err(ModelError::InvalidInput(format!(
        "this request needs at least {} ({} of output, {} for its largest feature map), and this machine has {} \
         available; {advice}",
        human(needed),
        human(output),
        human(activation),
        human(available)
    )))
}

/// An error unless `frames` is `1 + k·ratio`: what a causal video encoder whose temporal
/// downsamples pair the frames after the first can take (diffusers fails on a frame left over).
pub(crate) fn encoder_frames(frames: usize, ratio: usize) -> Result<()> {
    let r = ratio.max(1);
    if frames == 0 || !(frames - 1).is_multiple_of(r) {
        let below = 1 + frames.saturating_sub(1) / r * r;
        return Err(ModelError::InvalidInput(format!(
            "a video (or temporal tile) of {frames} frames; the encoder takes 1 + {r}k frames (e.g. {below} or {})",
            below + r
        )));
    }
    Ok(())
}

/// An error unless frames of `h × w` pixels are whole latent pixels at `ratio` (the encoders'
/// folds fail otherwise).
pub(crate) fn whole_latent_pixels(h: usize, w: usize, ratio: usize) -> Result<()> {
    let r = ratio.max(1);
    if !h.is_multiple_of(r) || !w.is_multiple_of(r) {
        return Err(ModelError::InvalidInput(format!(
            "frames of {h}x{w} pixels are not a multiple of the {r}x spatial compression"
        )));
    }
    Ok(())
}

/// Over what a request's largest feature map extends, for a family's memory check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MapExtent {
    /// The whole frame.
    Whole,
    /// One tile of this many pixels (at most the frame).
    Tile(usize),
    /// Bands of a spatial shard, over however many ranks: the output alone is counted.
    Banded,
}

impl MapExtent {
    /// The pixels of a frame of `whole` pixels that the map covers.
    pub(crate) fn pixels(self, whole: u64) -> u64 {
        match self {
            Self::Whole => whole,
            Self::Tile(p) => whole.min(p as u64),
            Self::Banded => 0,
        }
    }
}
