//! LTX-Video and LTX-2 in the registry: their classes, their policy, and [`LoadedVae`] for
//! [`LtxVae`].

use std::any::Any;
use std::path::Path;

use vae_planner::ShardAxis;
use vae_runtime::{ExecOutput, Job, Output, OutputPlacement, ParallelMode, Strategy, StrategyChoice};
use vae_tensor::{DType, Device, Tensor};

use super::config::LtxClass;
use super::model::LtxVae;
use super::operators::{LtxOperator, LtxShardOperator};
use super::tiling::LtxTiling;
use crate::family::{CostNetworks, Direction, Execution, FamilySpec, LoadedVae, TileOverrides};
use crate::{ModelError, Result};

/// `AutoencoderKLLTXVideo` and `AutoencoderKLLTX2Video`.
pub static FAMILY: FamilySpec = FamilySpec {
    classes: &[LtxClass::LtxVideo.name(), LtxClass::Ltx2.name()],
    load: |dir: &Path, device: Device, dtype: DType| -> Result<Box<dyn LoadedVae>> {
        let class = match crate::family::class_name(dir)?.as_str() {
            "AutoencoderKLLTX2Video" => LtxClass::Ltx2,
            _ => LtxClass::LtxVideo,
        };
        Ok(Box::new(LtxVae::load_with(dir, class, device, dtype)?))
    },
};

impl LoadedVae for LtxVae {
    fn class_name(&self) -> &'static str {
        self.class().name()
    }

    fn models(&self) -> &'static str {
        match self.class() {
            LtxClass::LtxVideo => "LTX-Video 0.9.5+",
            LtxClass::Ltx2 => "LTX-2",
        }
    }

    fn device(&self) -> Device {
        LtxVae::device(self)
    }

    fn dtype(&self) -> DType {
        LtxVae::dtype(self)
    }

    /// Every mode but the pipeline, which is not built for this family: its decoder is not
    /// split into frame-by-frame stages (and with the published configs' non-causal decoder,
    /// every conv reads the next frame, so it cannot run a frame at a time).
    fn check_mode(&self, mode: ParallelMode) -> Result<()> {
        match mode {
            ParallelMode::Pipeline => Err(ModelError::Unsupported(format!(
                "{} cannot decode as a pipeline over frames: {} (use tile, auto or a spatial shard mode)",
                self.class_name(),
                if self.config().decoder_causal {
                    "its decoder is not split into frame-by-frame stages"
                } else {
                    "its decoder is not causal in time (every conv reads the next frame too), so it does not \
                     run a frame at a time"
                }
            ))),
            _ => Ok(()),
        }
    }

    /// From global quantities only, so every rank decides alike:
    ///
    /// - `spatial_shard_height` / `_width`: that axis whenever every rank gets a band wide
    ///   enough (one latent row, two where the convs reflect; for an encode, of the pixel rows
    ///   of whole latent rows); otherwise tiles, flagged as a fallback.
    /// - `auto`: tiles when the frames are tiled (`use_framewise_decoding` asks for the chunked
    ///   result) or with one rank; otherwise the longer axis that fits (for an encode, only where
    ///   tiling would otherwise be used): the exact untiled result.
    /// - `tile`: tiles (over time too when framewise), balanced over the ranks.
    fn strategy(&self, direction: Direction, mode: ParallelMode, dims: &[usize], ranks: usize) -> StrategyChoice {
        let reflect = {
            let c = self.config();
            let p = if direction == Direction::Decode { c.decoder_padding } else { c.encoder_padding };
            p == super::config::SpatialPadding::Reflect
        };
        let (what, verb, unit) = match direction {
            Direction::Decode => ("a latent", "decoding", 1),
            Direction::Encode => ("a video", "encoding", self.encoder_spatial_factor()),
        };
        let fits = |axis: ShardAxis| -> std::result::Result<(), String> {
            let extent = axis.dim_in(dims.len()).filter(|_| dims.len() == 5).map(|d| dims[d]).ok_or("not a video")?;
            vae_runtime::whole_bands(what, axis, extent, unit, ranks)?;
            if reflect && !vae_planner::BandPartition::fits(extent / unit.max(1), ranks, 2) {
                return Err(format!(
                    "{what} {axis} of {extent} cannot give {ranks} rank(s) two latent rows each (its convs \
                     reflect at the edges)"
                ));
            }
            Ok(())
        };
        match mode {
            ParallelMode::Tile => StrategyChoice::chosen(Strategy::Tile, "tile mode"),
            ParallelMode::Pipeline => StrategyChoice::fallback_to_tile("pipeline: not for this family; tiles"),
            ParallelMode::SpatialShardHeight | ParallelMode::SpatialShardWidth => {
                let axis = if mode == ParallelMode::SpatialShardHeight { ShardAxis::Height } else { ShardAxis::Width };
                StrategyChoice::forced_shard(mode, axis, fits(axis), dims.len() == 5, verb)
            }
            ParallelMode::SpatialShard2d => {
                let least = if reflect { 2 } else { 1 };
                StrategyChoice::forced_blocks_in_units(what, dims, 5, unit, ranks, [least, least], verb)
            }
            ParallelMode::Auto => {
                let tile = |why: String| StrategyChoice::chosen(Strategy::Tile, format!("auto: {why}; tiles"));
                if ranks < 2 {
                    return tile("one rank".into());
                }
                let &[_, _, frames, h, w] = dims else { return tile(format!("not {what}")) };
                let t = self.tiling();
                let framewise = match direction {
                    Direction::Decode => t.tiles_frames_decode(frames),
                    Direction::Encode => t.tiles_frames_encode(frames),
                };
                if framewise {
                    return tile(format!("{frames} frames tiled in time (use_framewise_decoding)"));
                }
                if direction == Direction::Encode && !t.spatial.needs_tiling_encode(h, w) {
                    return tile(format!("{h}x{w} frames fit one tile"));
                }
                StrategyChoice::auto_axis(h, w, &format!("{what} of {h}x{w}"), fits)
            }
        }
    }

    /// The pipelines post-process decoded video on rank 0; the image-to-video pipelines
    /// condition every rank on the encoded latents.
    fn default_placement(&self, direction: Direction) -> OutputPlacement {
        match direction {
            Direction::Decode => OutputPlacement::OwnerOnly,
            Direction::Encode => OutputPlacement::AllRanks,
        }
    }

    fn denormalize_latents(&self, z: &Tensor) -> Result<Tensor> {
        LtxVae::denormalize_latents(self, z)
    }

    fn normalize_latents(&self, mean: &Tensor) -> Result<Tensor> {
        LtxVae::normalize_latents(self, mean)
    }

    fn cost_networks(&self, direction: Direction, input_dims: &[usize]) -> Option<CostNetworks> {
        LtxVae::cost_networks(self, direction, input_dims)
    }

    fn tiling_keywords(&self) -> &'static [&'static str] {
        &[
            "tile_sample_min_height",
            "tile_sample_min_width",
            "tile_sample_min_num_frames",
            "tile_sample_stride_height",
            "tile_sample_stride_width",
            "tile_sample_stride_num_frames",
        ]
    }

    /// `enable_tiling(...)` with the class's six keywords (not given, or 0 as the class's `or`
    /// reads it: keep the current value); giving either frame keyword also sets
    /// `use_framewise_decoding`, which tiles the frames of decodes and encodes.
    fn enable_tiling(&mut self, tiling: &TileOverrides) -> Result<()> {
        if tiling.has_square() || tiling.has_latent() {
            return Err(ModelError::Unsupported(format!(
                "{} tiles by `tile_sample_min_height`, `tile_sample_min_width`, `tile_sample_min_num_frames`, \
                 `tile_sample_stride_height`, `tile_sample_stride_width` and `tile_sample_stride_num_frames`, \
                 not by `tile_sample_min_size`, `tile_overlap_factor` or `tile_latent_min_height` / \
                 `tile_latent_min_width`",
                self.class_name()
            )));
        }
        let t = *self.tiling();
        let keep = |v: Option<usize>, current: usize| v.filter(|v| *v != 0).unwrap_or(current);
        let mut next = LtxTiling {
            tile_sample_min_num_frames: keep(tiling.sample_min_num_frames, t.tile_sample_min_num_frames),
            tile_sample_stride_num_frames: keep(tiling.sample_stride_num_frames, t.tile_sample_stride_num_frames),
            framewise: t.framewise || tiling.has_frames(),
            ..t
        };
        next.spatial.tile_sample_min_height = keep(tiling.sample_min_height, t.spatial.tile_sample_min_height);
        next.spatial.tile_sample_min_width = keep(tiling.sample_min_width, t.spatial.tile_sample_min_width);
        next.spatial.tile_sample_stride_height = keep(tiling.sample_stride_height, t.spatial.tile_sample_stride_height);
        next.spatial.tile_sample_stride_width = keep(tiling.sample_stride_width, t.spatial.tile_sample_stride_width);
        self.set_tiling(next)
    }

    fn set_decode_timestep(&mut self, timestep: f64) -> Result<()> {
        LtxVae::set_decode_timestep(self, timestep)
    }

    fn execute(&self, run: Execution<'_>) -> Result<ExecOutput> {
        let (executor, input, output) = (run.executor, run.input, Output::Placed(run.placement));
        match run.strategy {
            Strategy::Tile => {
                let op = LtxOperator::new(self, run.direction, run.use_tiling);
                Ok(executor.run(input, Job::tiles(&op), output)?)
            }
            Strategy::Shard(axis) => {
                let op = LtxShardOperator::new(self, run.direction);
                Ok(executor.run(input, Job::bands(&op, axis), output)?)
            }
            Strategy::Pipeline => {
                Err(ModelError::Unsupported(format!("{} does not run as a pipeline over frames", self.class_name())))
            }
            Strategy::Shard2d(grid) => {
                let op = LtxShardOperator::new(self, run.direction);
                Ok(executor.run(input, Job::blocks(&op, grid), output)?)
            }
        }
    }

    fn decode(&self, z: &Tensor) -> Result<Tensor> {
        LtxVae::decode(self, z)
    }

    fn encode_moments(&self, x: &Tensor) -> Result<Tensor> {
        LtxVae::encode_moments(self, x)
    }

    /// The whole decode, then its frames to the sink (no frame leaves early: the decoder does not
    /// run a frame at a time); with frame tiles set (`use_framewise_decoding`), the chunked
    /// decode, as the same request unstreamed gives, not [`LtxVae::decode`]'s plain one.
    fn decode_streaming(&self, z: &Tensor, sink: &mut dyn vae_runtime::FrameSink) -> Result<()> {
        let op = LtxOperator::new(self, Direction::Decode, false);
        let out = vae_runtime::execute_serial(&op, z)?;
        sink.begin(out.dims()).map_err(ModelError::Sink)?;
        sink.frames(0, out).map_err(ModelError::Sink)
    }

    fn describe(&self) -> Vec<(&'static str, String)> {
        let c = self.config();
        let t = self.tiling();
        let s = &t.spatial;
        let mut lines = vec![
            ("channels", format!("in {}, out {}, latent {}", c.in_channels, c.out_channels, c.latent_channels)),
            (
                "layout",
                format!(
                    "patch {}, encoder {} blocks, decoder {} blocks, {}x spatial, {}x temporal (config ratios {} / {}); \
                     encoder {}causal, decoder {}causal, decoder padding {:?}",
                    c.patch_size,
                    c.down.len(),
                    c.up.len(),
                    c.decoder_spatial_factor(),
                    c.decoder_temporal_factor(),
                    c.spatial_compression_ratio,
                    c.temporal_compression_ratio,
                    if c.encoder_causal { "" } else { "non-" },
                    if c.decoder_causal { "" } else { "non-" },
                    c.decoder_padding
                ),
            ),
            (
                "scaling",
                format!(
                    "decode z · latents_std / {} + latents_mean, encode (mean − latents_mean) · {} / latents_std",
                    c.scaling_factor, c.scaling_factor
                ),
            ),
            (
                "tiling",
                format!(
                    "{}x{} px every {}x{}, {} frames every {}{}",
                    s.tile_sample_min_height,
                    s.tile_sample_min_width,
                    s.tile_sample_stride_height,
                    s.tile_sample_stride_width,
                    t.tile_sample_min_num_frames,
                    t.tile_sample_stride_num_frames,
                    if t.framewise { " (frames tiled)" } else { " (frames not tiled)" }
                ),
            ),
        ];
        if let Some(ts) = self.decode_timestep() {
            lines.push(("timestep", format!("decoder timestep-conditioned; decodes at {ts}")));
        }
        lines
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
