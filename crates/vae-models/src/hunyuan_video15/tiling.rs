//! The tile geometry of `AutoencoderKLHunyuanVideo15.tiled_decode` / `tiled_encode`, as the
//! planner's axis plans.
//!
//! The class keeps five attributes and derives the rest on every call: on decode, latent tiles
//! of `tile_latent_min` every `int(tile_latent_min · (1 − f))`, blended over
//! `int(tile_sample_min · f)` pixels and cut to `tile_sample_min − blend`; on encode, pixel tiles
//! of `tile_sample_min` every `int(tile_sample_min · (1 − f))`, blended over
//! `int(tile_latent_min · f)` latent pixels and cut to `tile_latent_min − blend`. The latent tile
//! is its own keyword (not the pixel tile over the ratio), and the result is never cropped to the
//! input's size: pixel and latent tiles that disagree give an output of another size, as they do
//! in diffusers.

use vae_planner::{AxisPlan, AxisTiling, MergeRule, PlanError, TileLayout2d};

use crate::{ModelError, Result};

/// The five tiling attributes of the class.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HunyuanVideo15Tiling {
    /// Pixel tile height (`tile_sample_min_height`).
    pub tile_sample_min_height: usize,
    /// Pixel tile width (`tile_sample_min_width`).
    pub tile_sample_min_width: usize,
    /// Latent tile height (`tile_latent_min_height`).
    pub tile_latent_min_height: usize,
    /// Latent tile width (`tile_latent_min_width`).
    pub tile_latent_min_width: usize,
    /// Overlap between neighbouring tiles, as a fraction of a tile (`tile_overlap_factor`).
    pub tile_overlap_factor: f64,
}

/// A geometry the planner refused, as the request's error.
fn refused(e: PlanError) -> ModelError {
    ModelError::InvalidInput(e.to_string())
}

/// One axis of a layout: input tiles of `tile` every `stride`, blended over `blend` output
/// elements and cut to `keep`.
struct Axis {
    tile: usize,
    stride: usize,
    blend: usize,
    keep: usize,
}

impl HunyuanVideo15Tiling {
    /// The class's values on a fresh model: 256-pixel tiles, latent tiles of `256 / ratio`, a
    /// quarter of a tile of overlap.
    pub fn new(spatial_ratio: usize) -> Self {
        Self {
            tile_sample_min_height: 256,
            tile_sample_min_width: 256,
            tile_latent_min_height: 256 / spatial_ratio.max(1),
            tile_latent_min_width: 256 / spatial_ratio.max(1),
            tile_overlap_factor: 0.25,
        }
    }

    /// Whether `_decode` takes the tiled path for a `h × w` latent.
    pub fn needs_tiling_decode(&self, h: usize, w: usize) -> bool {
        w > self.tile_latent_min_width || h > self.tile_latent_min_height
    }

    /// Whether `_encode` takes the tiled path for `h × w` frames.
    pub fn needs_tiling_encode(&self, h: usize, w: usize) -> bool {
        w > self.tile_sample_min_width || h > self.tile_sample_min_height
    }

    /// Refuses geometry the class would fail on or turn into nonsense: empty tiles, and an
    /// overlap outside `(0, 1)` (a factor of 1 or more makes Python's negative slice ends cut
    /// tiles from the far side).
    pub fn check(&self) -> Result<()> {
        let sizes = [
            self.tile_sample_min_height,
            self.tile_sample_min_width,
            self.tile_latent_min_height,
            self.tile_latent_min_width,
        ];
        if sizes.contains(&0) {
            return Err(ModelError::InvalidInput(format!("tile sizes must be positive, got {self:?}")));
        }
        let f = self.tile_overlap_factor;
        if !(f > 0.0 && f < 1.0) {
            return Err(ModelError::InvalidInput(format!("tile_overlap_factor must be in (0, 1), got {f}")));
        }
        Ok(())
    }

    /// `int(n · x)` as Python computes it for a non-negative product.
    fn int(n: usize, x: f64) -> usize {
        (n as f64 * x) as usize
    }

    fn axis(&self, tile: usize, other: usize, what: &str) -> Result<Axis> {
        self.check()?;
        let f = self.tile_overlap_factor;
        let stride = Self::int(tile, 1.0 - f);
        if stride == 0 {
            return Err(ModelError::InvalidInput(format!(
                "a {what} tile of {tile} with tile_overlap_factor {f} steps by int({tile} * {}) = 0",
                1.0 - f
            )));
        }
        let blend = Self::int(other, f);
        Ok(Axis { tile, stride, blend, keep: other - blend })
    }

    fn plan(extent: usize, a: Axis, out: impl FnMut(usize) -> usize) -> Result<AxisPlan> {
        let rule = MergeRule { blend: a.blend, keep: a.keep, final_crop: None };
        AxisPlan::with_output_fn(AxisTiling::new(extent, a.tile, a.stride).map_err(refused)?, rule, out)
            .map_err(refused)
    }

    /// `tiled_decode`'s layout on an `h × w` latent decoded `ratio` times larger.
    pub fn decode_layout(&self, h: usize, w: usize, ratio: usize) -> Result<TileLayout2d> {
        let rows = self.axis(self.tile_latent_min_height, self.tile_sample_min_height, "latent")?;
        let cols = self.axis(self.tile_latent_min_width, self.tile_sample_min_width, "latent")?;
        Ok(TileLayout2d::new(Self::plan(h, rows, |n| n * ratio)?, Self::plan(w, cols, |n| n * ratio)?))
    }

    /// `tiled_encode`'s layout on `h × w` frames encoded `ratio` times smaller; every tile must
    /// be a whole number of latent pixels (the class's reshapes fail otherwise).
    pub fn encode_layout(&self, h: usize, w: usize, ratio: usize) -> Result<TileLayout2d> {
        let rows = self.axis(self.tile_sample_min_height, self.tile_latent_min_height, "pixel")?;
        let cols = self.axis(self.tile_sample_min_width, self.tile_latent_min_width, "pixel")?;
        for (extent, a, name) in [(h, &rows, "height"), (w, &cols, "width")] {
            let tiling = AxisTiling::new(extent, a.tile, a.stride).map_err(refused)?;
            if let Some(r) = (0..tiling.count()).filter_map(|i| tiling.input_range(i)).find(|r| r.len() % ratio != 0) {
                return Err(ModelError::InvalidInput(format!(
                    "an encode tile spans {name} {r:?} ({} px), not a multiple of the {ratio}x compression; \
                     choose tiles and a frame {name} that are",
                    r.len()
                )));
            }
        }
        Ok(TileLayout2d::new(Self::plan(h, rows, |n| n / ratio)?, Self::plan(w, cols, |n| n / ratio)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiles(sh: usize, sw: usize, lh: usize, lw: usize, f: f64) -> HunyuanVideo15Tiling {
        HunyuanVideo15Tiling {
            tile_sample_min_height: sh,
            tile_sample_min_width: sw,
            tile_latent_min_height: lh,
            tile_latent_min_width: lw,
            tile_overlap_factor: f,
        }
    }

    #[test]
    fn defaults_step_by_three_quarters_of_a_tile_and_keep_the_rest() {
        let t = HunyuanVideo15Tiling::new(16);
        let layout = t.decode_layout(40, 16, 16).unwrap();
        // Latent tiles of 16 every 12: rows at 0, 12, 24, 36; outputs 256 px, kept 192.
        assert_eq!(layout.grid_shape(), [4, 2]);
        assert_eq!(layout.output_shape(), [640, 256]);
    }

    #[test]
    fn disagreeing_pixel_and_latent_tiles_give_an_uncropped_output() {
        // Latent 3 every 2 rows, pixel blend 6 and keep 18: 24 + 24 + 8 px tiles keep 18 + 18 + 8.
        let layout = tiles(24, 32, 3, 4, 0.25).decode_layout(5, 7, 8).unwrap();
        assert_eq!(layout.output_shape(), [44, 56]);
    }

    #[test]
    fn encode_tiles_must_be_whole_latent_pixels() {
        let t = tiles(32, 32, 4, 4, 0.25);
        assert_eq!(t.encode_layout(48, 56, 8).unwrap().output_shape(), [6, 7]);
        let err = t.encode_layout(44, 56, 8).unwrap_err();
        assert!(err.to_string().contains("not a multiple of the 8x"), "{err}");
    }

    #[test]
    fn a_zero_stride_or_an_overlap_outside_zero_to_one_is_an_error() {
        assert!(tiles(32, 32, 1, 4, 0.25).decode_layout(5, 7, 8).unwrap_err().to_string().contains("= 0"));
        for f in [0.0, 1.0, 1.5, f64::NAN] {
            assert!(tiles(32, 32, 4, 4, f).check().is_err(), "{f}");
        }
    }
}
