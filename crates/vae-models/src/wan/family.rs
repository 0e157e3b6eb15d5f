//! The Wan family in the registry: its classes, and [`LoadedVae`] for [`WanVae`].

use std::any::Any;
use std::path::Path;

use vae_runtime::{ExecOutput, Job, Output, OutputPlacement, ParallelMode, Strategy, StrategyChoice};
use vae_tensor::{DType, Device, Tensor};

use super::model::{VideoVaeClass, WanVae};
use super::operators::{
    WanDecodeOperator, WanEncodeOperator, WanPipelineDecodeOperator, WanShardDecodeOperator, WanShardEncodeOperator,
};
use crate::family::{CostNetworks, Direction, Execution, FamilySpec, LoadedVae, TileOverrides};
use crate::{ModelError, Result};

/// `AutoencoderKLWan` and `AutoencoderKLQwenImage`.
pub static FAMILY: FamilySpec = FamilySpec {
    classes: &[VideoVaeClass::Wan.class_name(), VideoVaeClass::QwenImage.class_name()],
    load: |dir: &Path, device: Device, dtype: DType| -> Result<Box<dyn LoadedVae>> {
        Ok(Box::new(WanVae::load_with(dir, device, dtype)?))
    },
};

impl LoadedVae for WanVae {
    fn class_name(&self) -> &'static str {
        self.class().class_name()
    }

    fn models(&self) -> &'static str {
        match self.class() {
            VideoVaeClass::Wan => "Wan2.1, Wan2.2",
            VideoVaeClass::QwenImage => "Qwen-Image",
        }
    }

    fn device(&self) -> Device {
        WanVae::device(self)
    }

    fn dtype(&self) -> DType {
        WanVae::dtype(self)
    }

    fn check_mode(&self, mode: ParallelMode) -> Result<()> {
        WanVae::check_mode(self, mode)
    }

    fn cost_networks(&self, direction: Direction, input_dims: &[usize]) -> Option<CostNetworks> {
        WanVae::cost_networks(self, direction, input_dims)
    }

    fn strategy(&self, direction: Direction, mode: ParallelMode, input_dims: &[usize], ranks: usize) -> StrategyChoice {
        match direction {
            Direction::Decode => self.decode_strategy(mode, input_dims, ranks),
            Direction::Encode => self.encode_strategy(mode, input_dims, ranks),
        }
    }

    /// Decoded pixels go to the owner for Wan (the pipeline post-processes on rank 0) and to
    /// every rank for Qwen-Image; encoded latents to every rank, which all condition the
    /// diffusion model on them.
    fn default_placement(&self, direction: Direction) -> OutputPlacement {
        match (direction, self.class()) {
            (Direction::Encode, _) | (Direction::Decode, VideoVaeClass::QwenImage) => OutputPlacement::AllRanks,
            (Direction::Decode, VideoVaeClass::Wan) => OutputPlacement::OwnerOnly,
        }
    }

    fn denormalize_latents(&self, z: &Tensor) -> Result<Tensor> {
        WanVae::denormalize_latents(self, z)
    }

    fn normalize_latents(&self, mean: &Tensor) -> Result<Tensor> {
        WanVae::normalize_latents(self, mean)
    }

    fn tiling_keywords(&self) -> &'static [&'static str] {
        &["tile_sample_min_height", "tile_sample_min_width", "tile_sample_stride_height", "tile_sample_stride_width"]
    }

    /// Keywords not given keep the current geometry (diffusers' 256-pixel tiles every 192
    /// pixels on a fresh model).
    fn enable_tiling(&mut self, tiling: &TileOverrides) -> Result<()> {
        if tiling.has_square() || tiling.has_latent() || tiling.has_frames() {
            return Err(ModelError::Unsupported(format!(
                "{} tiles by `tile_sample_min_height`, `tile_sample_min_width`, `tile_sample_stride_height` and \
                 `tile_sample_stride_width`, not by `tile_sample_min_size`, `tile_overlap_factor`, \
                 `tile_latent_min_height` / `tile_latent_min_width` or frame tiles",
                self.class_name()
            )));
        }
        if !tiling.has_rectangular() {
            return Ok(());
        }
        let t = *self.tiling();
        let min = [
            tiling.sample_min_height.unwrap_or(t.tile_sample_min_height),
            tiling.sample_min_width.unwrap_or(t.tile_sample_min_width),
        ];
        let stride = [
            tiling.sample_stride_height.unwrap_or(t.tile_sample_stride_height),
            tiling.sample_stride_width.unwrap_or(t.tile_sample_stride_width),
        ];
        self.set_tiling(min, stride)
    }

    fn execute(&self, run: Execution<'_>) -> Result<ExecOutput> {
        let (executor, input, output) = (run.executor, run.input, Output::Placed(run.placement));
        Ok(match (run.direction, run.strategy) {
            (Direction::Decode, Strategy::Tile) => {
                executor.run(input, Job::tiles(&WanDecodeOperator::new(self, run.use_tiling)), output)?
            }
            (Direction::Decode, Strategy::Shard(axis)) => {
                executor.run(input, Job::bands(&WanShardDecodeOperator::new(self), axis), output)?
            }
            (Direction::Encode, Strategy::Tile) => {
                executor.run(input, Job::tiles(&WanEncodeOperator::new(self, run.use_tiling)), output)?
            }
            (Direction::Encode, Strategy::Shard(axis)) => {
                executor.run(input, Job::bands(&WanShardEncodeOperator::new(self), axis), output)?
            }
            (Direction::Decode, Strategy::Pipeline) => {
                executor.run(input, Job::pipeline(&WanPipelineDecodeOperator::new(self)), output)?
            }
            (Direction::Encode, Strategy::Pipeline) => {
                return Err(ModelError::Unsupported("the encoder does not run as a pipeline".into()));
            }
            (Direction::Decode, Strategy::Shard2d(grid)) => {
                executor.run(input, Job::blocks(&WanShardDecodeOperator::new(self), grid), output)?
            }
            (Direction::Encode, Strategy::Shard2d(grid)) => {
                executor.run(input, Job::blocks(&WanShardEncodeOperator::new(self), grid), output)?
            }
        })
    }

    fn decode(&self, z: &Tensor) -> Result<Tensor> {
        WanVae::decode(self, z)
    }

    fn decode_streaming(&self, z: &Tensor, sink: &mut dyn vae_runtime::FrameSink) -> Result<()> {
        WanVae::decode_streaming(self, z, sink)
    }

    fn streams(&self) -> bool {
        true
    }

    fn execute_streaming(
        &self,
        run: Execution<'_>,
        sink: Option<&mut dyn vae_runtime::FrameSink>,
    ) -> Result<ExecOutput> {
        match (run.direction, run.strategy) {
            (Direction::Decode, Strategy::Shard(axis)) => {
                let op = WanShardDecodeOperator::streaming(self);
                Ok(run.executor.run(run.input, Job::bands(&op, axis), Output::Streamed(sink))?)
            }
            (Direction::Decode, Strategy::Tile) => {
                let op = WanDecodeOperator::streaming(self, run.use_tiling);
                Ok(run.executor.run(run.input, Job::tiles(&op), Output::Streamed(sink))?)
            }
            (Direction::Decode, Strategy::Pipeline) => {
                let op = WanPipelineDecodeOperator::streaming(self);
                Ok(run.executor.run(run.input, Job::pipeline(&op), Output::Streamed(sink))?)
            }
            (Direction::Encode, _) => Err(ModelError::Unsupported("an encode does not stream".into())),
            (Direction::Decode, Strategy::Shard2d(grid)) => {
                let op = WanShardDecodeOperator::streaming(self);
                Ok(run.executor.run(run.input, Job::blocks(&op, grid), Output::Streamed(sink))?)
            }
        }
    }

    fn keep_only_pipeline_stage(
        &mut self,
        latent_dims: &[usize],
        ranks: usize,
        rank: usize,
    ) -> Result<std::ops::Range<usize>> {
        WanVae::keep_only_pipeline_stage(self, latent_dims, ranks, rank)
    }

    fn encode_moments(&self, x: &Tensor) -> Result<Tensor> {
        WanVae::encode_moments(self, x)
    }

    fn describe(&self) -> Vec<(&'static str, String)> {
        let c = self.config();
        let t = self.tiling();
        vec![
            ("channels", format!("in {}, out {}, latent (z_dim) {}", c.in_channels, c.out_channels, c.z_dim)),
            (
                "layout",
                format!(
                    "base_dim {}, dim_mult {:?}, num_res_blocks {}, temporal downsample {:?}",
                    c.base_dim, c.dim_mult, c.num_res_blocks, c.temperal_downsample
                ),
            ),
            (
                "tiling",
                format!(
                    "{}x{} px tiles every {}x{} px",
                    t.tile_sample_min_height,
                    t.tile_sample_min_width,
                    t.tile_sample_stride_height,
                    t.tile_sample_stride_width
                ),
            ),
        ]
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
