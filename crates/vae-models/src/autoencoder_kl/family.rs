//! The AutoencoderKL family in the registry: its classes, and [`LoadedVae`] for
//! [`AutoencoderKl`].

use std::any::Any;
use std::path::Path;

use vae_runtime::{ExecOutput, Job, Output, OutputPlacement, ParallelMode, Strategy, StrategyChoice};
use vae_tensor::{DType, Device, Tensor};

use super::config::KlVariant;
use super::model::AutoencoderKl;
use super::operator::{KlOperator, KlShardOperator, KlTask};
use crate::family::{CostNetworks, Direction, Execution, FamilySpec, LoadedVae, TileOverrides};
use crate::{ModelError, Result};

/// `AutoencoderKL` and `AutoencoderKLFlux2`.
pub static FAMILY: FamilySpec = FamilySpec {
    classes: &[KlVariant::AutoencoderKl.class_name(), KlVariant::Flux2.class_name()],
    load: |dir: &Path, device: Device, dtype: DType| -> Result<Box<dyn LoadedVae>> {
        // The config parser reads the class again: the two classes have different defaults.
        Ok(Box::new(AutoencoderKl::load_with(dir, device, dtype)?))
    },
};

impl LoadedVae for AutoencoderKl {
    fn class_name(&self) -> &'static str {
        self.config().variant.class_name()
    }

    fn models(&self) -> &'static str {
        match self.config().variant {
            KlVariant::AutoencoderKl => "Stable Diffusion 1.x/2.x/XL/3.x, FLUX.1, Z-Image",
            KlVariant::Flux2 => "FLUX.2",
        }
    }

    fn device(&self) -> Device {
        AutoencoderKl::device(self)
    }

    fn dtype(&self) -> DType {
        AutoencoderKl::dtype(self)
    }

    fn check_mode(&self, mode: ParallelMode) -> Result<()> {
        AutoencoderKl::check_mode(self, mode)
    }

    fn strategy(&self, direction: Direction, mode: ParallelMode, input_dims: &[usize], ranks: usize) -> StrategyChoice {
        AutoencoderKl::strategy(self, direction, mode, input_dims, ranks)
    }

    fn cost_networks(&self, direction: Direction, input_dims: &[usize]) -> Option<CostNetworks> {
        AutoencoderKl::cost_networks(self, direction, input_dims)
    }

    /// Decoded pixels go to the owner for AutoencoderKL (the pipeline post-processes on rank
    /// 0) and to every rank for FLUX.2; encoded latents to every rank, which all condition the
    /// diffusion model on them.
    fn default_placement(&self, direction: Direction) -> OutputPlacement {
        match (direction, self.config().variant) {
            (Direction::Encode, _) | (Direction::Decode, KlVariant::Flux2) => OutputPlacement::AllRanks,
            (Direction::Decode, KlVariant::AutoencoderKl) => OutputPlacement::OwnerOnly,
        }
    }

    fn denormalize_latents(&self, z: &Tensor) -> Result<Tensor> {
        AutoencoderKl::denormalize_latents(self, z)
    }

    fn normalize_latents(&self, mean: &Tensor) -> Result<Tensor> {
        AutoencoderKl::normalize_latents(self, mean)
    }

    /// diffusers' `enable_tiling()` takes no keywords for this class; these are the attributes a
    /// user sets after it.
    fn tiling_keywords(&self) -> &'static [&'static str] {
        &["tile_sample_min_size", "tile_overlap_factor"]
    }

    fn enable_tiling(&mut self, tiling: &TileOverrides) -> Result<()> {
        if tiling.has_rectangular() || tiling.has_latent() || tiling.has_frames() {
            return Err(ModelError::Unsupported(format!(
                "{} tiles by `tile_sample_min_size` and `tile_overlap_factor`, not by tile height, width, \
                 stride, latent size or frames",
                self.class_name()
            )));
        }
        AutoencoderKl::set_tiling(self, tiling.sample_min_size, tiling.overlap_factor)
    }

    fn execute(&self, run: Execution<'_>) -> Result<ExecOutput> {
        let task = match run.direction {
            Direction::Decode => KlTask::Decode,
            Direction::Encode => KlTask::Encode,
        };
        let output = Output::Placed(run.placement);
        match run.strategy {
            Strategy::Tile => {
                Ok(run.executor.run(run.input, Job::tiles(&KlOperator::new(self, task, run.use_tiling)), output)?)
            }
            Strategy::Shard(axis) => {
                let op = KlShardOperator::new(self, task, run.executor.parallel_size());
                Ok(run.executor.run(run.input, Job::bands(&op, axis), output)?)
            }
            Strategy::Shard2d(grid) => {
                // Its memory check counts a block of the grid's ranks, not of the parallel size.
                let op = KlShardOperator::new(self, task, grid[0].saturating_mul(grid[1]).max(1));
                Ok(run.executor.run(run.input, Job::blocks(&op, grid), output)?)
            }
            Strategy::Pipeline => Err(ModelError::Unsupported(format!(
                "{} has no pipeline strategy (an image has no frames to pipeline)",
                self.class_name()
            ))),
        }
    }

    fn decode(&self, z: &Tensor) -> Result<Tensor> {
        AutoencoderKl::decode(self, z)
    }

    fn encode_moments(&self, x: &Tensor) -> Result<Tensor> {
        AutoencoderKl::encode_moments(self, x)
    }

    fn describe(&self) -> Vec<(&'static str, String)> {
        let c = self.config();
        let t = self.tiling();
        let stored: Vec<String> = self.stored_dtypes().iter().map(|(d, n)| format!("{n} {d}")).collect();
        let mut lines = vec![
            ("parameters", self.parameter_count().to_string()),
            ("weights", format!("stored as {}; computed in {}", stored.join(", "), AutoencoderKl::dtype(self))),
            ("channels", format!("in {}, out {}, latent {}", c.in_channels, c.out_channels, c.latent_channels)),
            (
                "encoder",
                format!("block_out_channels {:?}, layers_per_block {}", c.block_out_channels, c.layers_per_block),
            ),
            (
                "decoder",
                format!(
                    "block_out_channels {:?}, layers_per_block {}",
                    c.decoder_block_out_channels,
                    c.layers_per_block + 1
                ),
            ),
            (
                "norm",
                format!("GroupNorm, {} groups; mid-block attention {}", c.norm_num_groups, c.mid_block_add_attention),
            ),
            ("scale", format!("{0}x (latent pixel = {0} px)", c.spatial_scale())),
        ];
        if let Some(s) = c.scaling_factor {
            lines.push(("latents", format!("scaling_factor {s}, shift_factor {:?}", c.shift_factor)));
        }
        if let Some(bn) = self.latent_batch_norm() {
            lines.push(("latents", format!("batch-norm over {} patchified channels, eps {}", bn.mean.len(), bn.eps)));
        }
        lines.push((
            "tiling",
            format!(
                "{} px tiles ({} latent), overlap {}",
                t.tile_sample_min_size, t.tile_latent_min_size, t.tile_overlap_factor
            ),
        ));
        lines
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::autoencoder_kl::AutoencoderKlConfig;

    fn model(class: &str) -> AutoencoderKl {
        let json = format!(
            r#"{{"_class_name": "{class}", "block_out_channels": [8, 8], "layers_per_block": 1,
                "down_block_types": ["DownEncoderBlock2D", "DownEncoderBlock2D"],
                "up_block_types": ["UpDecoderBlock2D", "UpDecoderBlock2D"],
                "norm_num_groups": 4, "latent_channels": 4, "sample_size": 32}}"#
        );
        AutoencoderKl::synthetic(AutoencoderKlConfig::from_json(&json).unwrap(), 1).unwrap()
    }

    #[test]
    fn placements_follow_the_reference_contract() {
        use Direction::*;
        use OutputPlacement::*;
        let (kl, flux2) = (model("AutoencoderKL"), model("AutoencoderKLFlux2"));
        assert_eq!(kl.default_placement(Decode), OwnerOnly);
        assert_eq!(flux2.default_placement(Decode), AllRanks);
        for m in [&kl, &flux2] {
            assert_eq!(m.default_placement(Encode), AllRanks, "{}", m.class_name());
        }
    }

    #[test]
    fn video_tile_keywords_are_refused() {
        let mut kl = model("AutoencoderKL");
        let err =
            LoadedVae::enable_tiling(&mut kl, &TileOverrides { sample_min_height: Some(64), ..Default::default() })
                .unwrap_err();
        assert!(matches!(err, ModelError::Unsupported(_)), "{err}");
        LoadedVae::enable_tiling(&mut kl, &TileOverrides { sample_min_size: Some(64), ..Default::default() }).unwrap();
        assert_eq!(kl.tiling().tile_sample_min_size, 64);
    }
}
