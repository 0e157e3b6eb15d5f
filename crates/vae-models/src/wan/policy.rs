//! The family's parallel policy: which modes run, and which strategy a request gets.

use vae_planner::{BandPartition, ShardAxis};
use vae_runtime::{ParallelMode, Strategy, StrategyChoice};

use super::model::WanVae;
use crate::Result;

impl WanVae {
    /// Every parallel mode is available: the decoder's norms are per-pixel RMS norms, so a
    /// band (or a block of a 2-D grid) needs no statistics from the others, and the decoder is
    /// causal, one latent frame at a time, so its layers pipeline over frames.
    ///
    /// A model that kept only a pipeline stage's weights runs the pipeline mode alone.
    pub fn check_mode(&self, mode: ParallelMode) -> Result<()> {
        match mode {
            ParallelMode::Pipeline => Ok(()),
            _ => self.check_whole(),
        }
    }

    /// This family's decode policy for one request of a `latent_dims` latent over `ranks`
    /// ranks. Deterministic and free of side effects, from global quantities only, so every
    /// rank decides alike.
    ///
    /// - `tile`: tiles.
    /// - `spatial_shard_height` / `_width`: that axis whenever every rank gets a band at
    ///   least as wide as the decoder's widest halo (at any latent size: the shard decode is
    ///   the exact direct decode); otherwise tile, flagged as a fallback. Never the other axis.
    /// - `auto`: with two ranks or more, the longer latent axis that can give every rank a
    ///   band (width on ties); tile when neither can. (It does not choose the pipeline: that
    ///   needs a cost model that compares it with the shard.)
    /// - `pipeline`: the decoder's layers in stages over the ranks, for any video latent.
    /// - `spatial_shard_2d`: the grid of blocks closest to square whose blocks are at least the
    ///   decoder's widest halo along both axes; otherwise tile, flagged as a fallback.
    pub fn decode_strategy(&self, mode: ParallelMode, latent_dims: &[usize], ranks: usize) -> StrategyChoice {
        let extent = |axis: ShardAxis| axis.dim_in(latent_dims.len()).map(|d| latent_dims[d]).unwrap_or(0);
        let fits = |axis: ShardAxis| {
            latent_dims.len() == 5 && BandPartition::fits(extent(axis), ranks, self.decoder.widest_halo(axis))
        };
        let why_not = |axis: ShardAxis| {
            format!(
                "a latent {axis} of {} cannot give {ranks} rank(s) a band of at least {} row(s)",
                extent(axis),
                self.decoder.widest_halo(axis).max(1)
            )
        };
        match mode {
            ParallelMode::Tile => StrategyChoice::chosen(Strategy::Tile, "tile mode"),
            ParallelMode::Pipeline => StrategyChoice::chosen(Strategy::Pipeline, "pipeline requested"),
            // Blocks at least the decoder's widest halo along both axes.
            ParallelMode::SpatialShard2d => {
                let halo = [ShardAxis::Height, ShardAxis::Width].map(|a| self.decoder.widest_halo(a));
                StrategyChoice::forced_blocks_in_units("a latent", latent_dims, 5, 1, ranks, halo, "decoding")
            }
            ParallelMode::SpatialShardHeight | ParallelMode::SpatialShardWidth => {
                let axis = if mode == ParallelMode::SpatialShardHeight { ShardAxis::Height } else { ShardAxis::Width };
                if latent_dims.len() != 5 || fits(axis) {
                    // A malformed latent goes to the shard path, whose input check names it.
                    StrategyChoice::chosen(Strategy::Shard(axis), format!("{mode} requested"))
                } else {
                    StrategyChoice::fallback_to_tile(format!("{mode}: {}; decoding with tiles", why_not(axis)))
                }
            }
            ParallelMode::Auto => {
                if ranks < 2 {
                    return StrategyChoice::chosen(Strategy::Tile, "auto: one rank, nothing to shard");
                }
                if latent_dims.len() != 5 {
                    return StrategyChoice::chosen(Strategy::Tile, "auto: not a video latent");
                }
                let (h, w) = (extent(ShardAxis::Height), extent(ShardAxis::Width));
                let axis = match (fits(ShardAxis::Height), fits(ShardAxis::Width)) {
                    (true, true) if h > w => ShardAxis::Height,
                    (true, true) | (false, true) => ShardAxis::Width,
                    (true, false) => ShardAxis::Height,
                    (false, false) => {
                        return StrategyChoice::chosen(
                            Strategy::Tile,
                            format!("auto: {} and {}; tiles", why_not(ShardAxis::Height), why_not(ShardAxis::Width)),
                        );
                    }
                };
                let why = if fits(ShardAxis::Height) && fits(ShardAxis::Width) {
                    if h == w { "width on a tie".to_string() } else { format!("the longer axis of {h}x{w}") }
                } else {
                    format!("the only axis that fits {ranks} ranks")
                };
                StrategyChoice::chosen(Strategy::Shard(axis), format!("auto: {axis}, {why}"))
            }
        }
    }

    /// This family's encode policy, from global quantities only:
    ///
    /// - `spatial_shard_height` / `_width`: that axis whenever the video's extent is a whole
    ///   number of latent rows (`WanVae::encode_band_unit` pixels) and every rank gets one;
    ///   otherwise tiles, flagged as a fallback.
    /// - `auto`: where tiling would otherwise be used (two ranks or more, frames larger than a
    ///   tile), the shard along the longer axis that fits (width on ties); otherwise tiles.
    /// - `tile`: tiles.
    /// - `pipeline`: tiles, flagged as a fallback (only the decoder pipelines).
    pub fn encode_strategy(&self, mode: ParallelMode, dims: &[usize], ranks: usize) -> StrategyChoice {
        let unit = self.encode_band_unit();
        let fits = |axis: ShardAxis| -> std::result::Result<(), String> {
            let extent = axis.dim_in(dims.len()).filter(|_| dims.len() == 5).map(|d| dims[d]).ok_or("not a video")?;
            vae_runtime::whole_bands("a video", axis, extent, unit, ranks)
        };
        match mode {
            ParallelMode::Tile => StrategyChoice::chosen(Strategy::Tile, "tile mode"),
            ParallelMode::Pipeline => {
                StrategyChoice::fallback_to_tile("pipeline: only the decoder runs as a pipeline; encoding with tiles")
            }
            ParallelMode::SpatialShardHeight | ParallelMode::SpatialShardWidth => {
                let axis = if mode == ParallelMode::SpatialShardHeight { ShardAxis::Height } else { ShardAxis::Width };
                StrategyChoice::forced_shard(mode, axis, fits(axis), dims.len() == 5, "encoding")
            }
            ParallelMode::SpatialShard2d => {
                StrategyChoice::forced_blocks_in_units("a video", dims, 5, unit, ranks, [1, 1], "encoding")
            }
            ParallelMode::Auto => {
                let tile = |why: String| StrategyChoice::chosen(Strategy::Tile, format!("auto: {why}; tiles"));
                if ranks < 2 {
                    return tile("one rank".into());
                }
                let &[_, _, _, h, w] = dims else { return tile("not a video".into()) };
                if !self.tiling().needs_tiling_encode(h, w) {
                    return tile(format!("{h}x{w} frames fit one tile"));
                }
                StrategyChoice::auto_axis(h, w, &format!("{h}x{w} frames"), fits)
            }
        }
    }
}
