//! HunyuanVideo-1.5 in the registry: its class, its policy, and [`LoadedVae`] for
//! [`HunyuanVideo15Vae`].

use std::any::Any;
use std::path::Path;

use vae_planner::ShardAxis;
use vae_runtime::{ExecOutput, Job, Output, OutputPlacement, ParallelMode, Strategy, StrategyChoice};
use vae_tensor::{DType, Device, Tensor};

use super::model::{CLASS_NAME, HunyuanVideo15Vae};
use super::operators::{HunyuanVideo15Operator, HunyuanVideo15ShardOperator};
use super::tiling::HunyuanVideo15Tiling;
use crate::family::{CostNetworks, Direction, Execution, FamilySpec, LoadedVae, TileOverrides};
use crate::{ModelError, Result};

/// `AutoencoderKLHunyuanVideo15`.
pub static FAMILY: FamilySpec = FamilySpec {
    classes: &[CLASS_NAME],
    load: |dir: &Path, device: Device, dtype: DType| -> Result<Box<dyn LoadedVae>> {
        Ok(Box::new(HunyuanVideo15Vae::load_with(dir, device, dtype)?))
    },
};

impl LoadedVae for HunyuanVideo15Vae {
    fn class_name(&self) -> &'static str {
        CLASS_NAME
    }

    fn models(&self) -> &'static str {
        "HunyuanVideo-1.5"
    }

    fn device(&self) -> Device {
        HunyuanVideo15Vae::device(self)
    }

    fn dtype(&self) -> DType {
        HunyuanVideo15Vae::dtype(self)
    }

    /// Every mode but the pipeline, which cannot apply: the mid-block attention sees every
    /// frame at once, so the decoder does not run a frame at a time.
    fn check_mode(&self, mode: ParallelMode) -> Result<()> {
        match mode {
            ParallelMode::Pipeline => Err(ModelError::Unsupported(format!(
                "{CLASS_NAME} cannot decode as a pipeline over frames: its decoder's attention sees every \
                 frame of the clip at once, so it does not run a frame at a time (use tile, auto or a \
                 spatial shard mode)"
            ))),
            _ => Ok(()),
        }
    }

    /// From global quantities only, so every rank decides alike:
    ///
    /// - `spatial_shard_height` / `_width`: that axis whenever every rank gets a band of at least
    ///   one latent row (for an encode, of the pixel rows of whole latent rows); otherwise tiles,
    ///   flagged as a fallback.
    /// - `spatial_shard_2d`: the grid of blocks closest to square whose blocks hold a latent
    ///   pixel along both axes (for an encode, whole latent rows and columns of pixels);
    ///   otherwise tiles, flagged as a fallback.
    /// - `auto`: with two ranks or more, the longer axis that fits (width on ties; for an encode,
    ///   only where tiling would otherwise be used): the exact untiled result; otherwise tiles.
    /// - `tile`: tiles.
    fn strategy(&self, direction: Direction, mode: ParallelMode, dims: &[usize], ranks: usize) -> StrategyChoice {
        let (what, verb, unit) = match direction {
            Direction::Decode => ("a latent", "decoding", 1),
            Direction::Encode => ("a video", "encoding", self.spatial_ratio()),
        };
        let fits = |axis: ShardAxis| -> std::result::Result<(), String> {
            let extent = axis.dim_in(dims.len()).filter(|_| dims.len() == 5).map(|d| dims[d]).ok_or("not a video")?;
            vae_runtime::whole_bands(what, axis, extent, unit, ranks)
        };
        match mode {
            ParallelMode::Tile => StrategyChoice::chosen(Strategy::Tile, "tile mode"),
            // `check_mode` refuses it first.
            ParallelMode::Pipeline => StrategyChoice::fallback_to_tile("pipeline: not for this family; tiles"),
            ParallelMode::SpatialShardHeight | ParallelMode::SpatialShardWidth => {
                let axis = if mode == ParallelMode::SpatialShardHeight { ShardAxis::Height } else { ShardAxis::Width };
                StrategyChoice::forced_shard(mode, axis, fits(axis), dims.len() == 5, verb)
            }
            ParallelMode::SpatialShard2d => {
                StrategyChoice::forced_blocks_in_units(what, dims, 5, unit, ranks, [1, 1], verb)
            }
            ParallelMode::Auto => {
                let tile = |why: String| StrategyChoice::chosen(Strategy::Tile, format!("auto: {why}; tiles"));
                if ranks < 2 {
                    return tile("one rank".into());
                }
                let &[_, _, _, h, w] = dims else { return tile(format!("not {what}")) };
                if direction == Direction::Encode && !self.tiling().needs_tiling_encode(h, w) {
                    return tile(format!("{h}x{w} frames fit one tile"));
                }
                StrategyChoice::auto_axis(h, w, &format!("{what} of {h}x{w}"), fits)
            }
        }
    }

    /// The pipelines post-process decoded video on rank 0; the image-to-video pipeline
    /// conditions every rank on the encoded latents.
    fn default_placement(&self, direction: Direction) -> OutputPlacement {
        match direction {
            Direction::Decode => OutputPlacement::OwnerOnly,
            Direction::Encode => OutputPlacement::AllRanks,
        }
    }

    fn denormalize_latents(&self, z: &Tensor) -> Result<Tensor> {
        HunyuanVideo15Vae::denormalize_latents(self, z)
    }

    fn normalize_latents(&self, mean: &Tensor) -> Result<Tensor> {
        HunyuanVideo15Vae::normalize_latents(self, mean)
    }

    fn cost_networks(&self, direction: Direction, input_dims: &[usize]) -> Option<CostNetworks> {
        HunyuanVideo15Vae::cost_networks(self, direction, input_dims)
    }

    fn tiling_keywords(&self) -> &'static [&'static str] {
        &[
            "tile_sample_min_height",
            "tile_sample_min_width",
            "tile_latent_min_height",
            "tile_latent_min_width",
            "tile_overlap_factor",
        ]
    }

    /// `enable_tiling(tile_sample_min_height, tile_sample_min_width, tile_latent_min_height,
    /// tile_latent_min_width, tile_overlap_factor)`: keywords not given keep their values, and
    /// (as the class's `x or current` does) neither does a factor of 0. Setting the pixel tile
    /// does not change the latent tile.
    fn enable_tiling(&mut self, tiling: &TileOverrides) -> Result<()> {
        if tiling.sample_min_size.is_some() || tiling.has_stride() || tiling.has_frames() {
            return Err(ModelError::Unsupported(format!(
                "{CLASS_NAME} tiles by `tile_sample_min_height`, `tile_sample_min_width`, \
                 `tile_latent_min_height`, `tile_latent_min_width` and `tile_overlap_factor`, not by \
                 `tile_sample_min_size`, tile strides or frame tiles"
            )));
        }
        let t = *self.tiling();
        let keep = |v: Option<usize>, current: usize| v.filter(|v| *v != 0).unwrap_or(current);
        self.set_tiling(HunyuanVideo15Tiling {
            tile_sample_min_height: keep(tiling.sample_min_height, t.tile_sample_min_height),
            tile_sample_min_width: keep(tiling.sample_min_width, t.tile_sample_min_width),
            tile_latent_min_height: keep(tiling.latent_min_height, t.tile_latent_min_height),
            tile_latent_min_width: keep(tiling.latent_min_width, t.tile_latent_min_width),
            tile_overlap_factor: tiling.overlap_factor.filter(|f| *f != 0.0).unwrap_or(t.tile_overlap_factor),
        })
    }

    fn execute(&self, run: Execution<'_>) -> Result<ExecOutput> {
        let (executor, input, output) = (run.executor, run.input, Output::Placed(run.placement));
        match run.strategy {
            Strategy::Tile => {
                let op = HunyuanVideo15Operator::new(self, run.direction, run.use_tiling);
                Ok(executor.run(input, Job::tiles(&op), output)?)
            }
            Strategy::Shard(axis) => {
                let op = HunyuanVideo15ShardOperator::new(self, run.direction);
                Ok(executor.run(input, Job::bands(&op, axis), output)?)
            }
            Strategy::Pipeline => {
                Err(ModelError::Unsupported(format!("{CLASS_NAME} does not run as a pipeline over frames")))
            }
            Strategy::Shard2d(grid) => {
                let op = HunyuanVideo15ShardOperator::new(self, run.direction);
                Ok(executor.run(input, Job::blocks(&op, grid), output)?)
            }
        }
    }

    fn decode(&self, z: &Tensor) -> Result<Tensor> {
        HunyuanVideo15Vae::decode(self, z)
    }

    fn encode_moments(&self, x: &Tensor) -> Result<Tensor> {
        HunyuanVideo15Vae::encode_moments(self, x)
    }

    fn describe(&self) -> Vec<(&'static str, String)> {
        let c = self.config();
        let t = self.tiling();
        vec![
            ("channels", format!("in {}, out {}, latent {}", c.in_channels, c.out_channels, c.latent_channels)),
            (
                "layout",
                format!(
                    "block_out_channels {:?}, layers_per_block {}, {}x spatial, {}x temporal",
                    c.block_out_channels, c.layers_per_block, c.spatial_compression_ratio, c.temporal_compression_ratio
                ),
            ),
            ("scaling", format!("decode z / {}, encode mode · {}", c.scaling_factor, c.scaling_factor)),
            (
                "tiling",
                format!(
                    "tile_sample_min {}x{} px, tile_latent_min {}x{}, tile_overlap_factor {}",
                    t.tile_sample_min_height,
                    t.tile_sample_min_width,
                    t.tile_latent_min_height,
                    t.tile_latent_min_width,
                    t.tile_overlap_factor
                ),
            ),
        ]
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
