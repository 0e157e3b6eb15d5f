//! The LTX operators the distributed executor runs: diffusers' spatial `tiled_decode` /
//! `tiled_encode` and temporal `_temporal_tiled_decode` / `_temporal_tiled_encode` as one grid
//! of time × rows × columns tiles (every tile an independent work unit, balanced over the ranks
//! by the executor), merged as the classes merge them: each chunk of frames stitched in H and W,
//! then the chunks blended along time. And the plain decode and encode sharded along H or W.

use std::ops::Range;

use vae_planner::{GridSpec, ShardAxis, TileTask};
use vae_runtime::stitch::{StitchSpec, stitch};
use vae_runtime::{
    Classified, OperatorError, ShardContext, ShardGeometry, ShardOperator, TileMap, TileOperator, TilePlan,
};
use vae_tensor::{DType, Device, Tensor};

use super::config::SpatialPadding;
use super::model::LtxVae;
use super::tiling::TemporalMerge;
use crate::checks::MapExtent;
use crate::family::Direction;
use crate::{ModelError, Result};

/// One tile: its frames, rows and columns (its chunk of frames is its grid coordinate's first).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LtxTile {
    /// Input frames.
    pub frames: Range<usize>,
    /// Input rows.
    pub rows: Range<usize>,
    /// Input columns.
    pub cols: Range<usize>,
}

/// How the tiles are merged: in H and W within a chunk (if tiled there), then along time (if
/// the frames are tiled).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LtxMerge {
    /// The stitch of each chunk's tiles.
    pub spatial: Option<StitchSpec>,
    /// The merge of the chunks.
    pub temporal: Option<TemporalMerge>,
}

/// Decode or encode as the class does it with `use_tiling` (and `use_framewise_decoding`) as set.
pub struct LtxOperator<'m> {
    model: &'m LtxVae,
    direction: Direction,
    use_tiling: bool,
}

impl<'m> LtxOperator<'m> {
    /// An operator for `direction` that tiles in H and W as `enable_tiling()` does when
    /// `use_tiling`, and in time when the model's tiling is framewise.
    pub fn new(model: &'m LtxVae, direction: Direction, use_tiling: bool) -> Self {
        Self { model, direction, use_tiling }
    }

    fn plan(&self, x: &Tensor) -> Result<TilePlan<LtxTile, LtxMerge>> {
        let m = self.model;
        let t = m.tiling();
        let decode = self.direction == Direction::Decode;
        let frames = x.dims().get(2).copied().unwrap_or(0);
        let temporal = if decode { t.tiles_frames_decode(frames) } else { t.tiles_frames_encode(frames) };
        if decode {
            m.check_latent(x)?
        } else {
            m.check_video(x, temporal)?
        }
        let (h, w) = (x.dims()[3], x.dims()[4]);
        let (chunks, temporal) = if temporal {
            let (chunks, merge) = if decode { t.decode_chunks(frames)? } else { t.encode_chunks(frames)? };
            if !decode {
                for c in &chunks {
                    m.check_frames(c.len())?;
                }
            }
            (chunks, Some(merge))
        } else {
            (std::iter::once(0..frames).collect(), None)
        };
        let spatial_tiled = self.use_tiling
            && if decode {
                t.spatial.needs_tiling_decode(h, w).map_err(|e| ModelError::InvalidInput(e.to_string()))?
            } else {
                t.spatial.needs_tiling_encode(h, w)
            };
        let (rows, cols, spatial) = if spatial_tiled {
            let layout = if decode {
                t.spatial.decode_layout(h, w)
            } else {
                let r = m.encoder_spatial_factor();
                t.spatial.encode_layout_with_ratio(h, w, t.spatial.spatial_compression_ratio, |n| n / r)
            }
            .map_err(|e| ModelError::InvalidInput(e.to_string()))?;
            let ranges = |a: &vae_planner::AxisPlan| -> Vec<Range<usize>> {
                (0..a.count()).filter_map(|i| a.tiling().input_range(i)).collect()
            };
            let (rows, cols) = (ranges(&layout.rows), ranges(&layout.cols));
            let reflect = decode && m.config().decoder_padding == SpatialPadding::Reflect;
            if let Some(r) = rows.iter().chain(&cols).find(|r| reflect && r.len() < 2) {
                return Err(ModelError::InvalidInput(format!(
                    "a decode tile spans latent {r:?}; the decoder pads by reflection, which needs tiles of at least \
                     2x2 latent pixels (choose a tile stride that leaves no 1-pixel tail)"
                )));
            }
            if !decode {
                for r in rows.iter().chain(&cols) {
                    if r.len() % m.encoder_spatial_factor() != 0 {
                        return Err(ModelError::InvalidInput(format!(
                            "an encode tile spans {} px ({r:?}), not a multiple of the {}x compression; choose \
                             tiles and frame sizes that are",
                            r.len(),
                            m.encoder_spatial_factor()
                        )));
                    }
                }
            }
            let rules = [layout.rows.merge().rule(), layout.cols.merge().rule()];
            let pixels = t.spatial.tile_sample_min_height * t.spatial.tile_sample_min_width;
            m.check_memory(decode, x.dims(), MapExtent::Tile(pixels))?;
            (rows, cols, Some(StitchSpec { dims: [3, 4], rules }))
        } else {
            if !decode {
                m.check_frame_size(h, w)?;
            }
            m.check_memory(decode, x.dims(), MapExtent::Whole)?;
            (std::iter::once(0..h).collect(), std::iter::once(0..w).collect(), None)
        };
        let mut tasks = Vec::with_capacity(chunks.len() * rows.len() * cols.len());
        for (ci, f) in chunks.iter().enumerate() {
            for (i, r) in rows.iter().enumerate() {
                for (j, c) in cols.iter().enumerate() {
                    let work = (f.len() * r.len() * c.len()) as u64;
                    let tile = LtxTile { frames: f.clone(), rows: r.clone(), cols: c.clone() };
                    tasks.push(TileTask::new(tasks.len(), vec![ci, i, j], tile, work));
                }
            }
        }
        let grid = GridSpec {
            split_dims: vec![2, 3, 4],
            grid_shape: vec![chunks.len(), rows.len(), cols.len()],
            tile_spec: LtxMerge { spatial, temporal },
            output_dtype: Some(DType::F32),
        };
        Ok(TilePlan { tasks, grid })
    }

    fn merge_tiles(&self, mut tiles: TileMap, grid: &GridSpec<LtxMerge, DType>) -> Result<Tensor> {
        let [chunks, rows, cols] = [grid.grid_shape[0], grid.grid_shape[1], grid.grid_shape[2]];
        let spec = grid.tile_spec;
        let mut merged = Vec::with_capacity(chunks);
        for ci in 0..chunks {
            let missing = |i: usize, j: usize| ModelError::InvalidInput(format!("tile [{ci}, {i}, {j}] is missing"));
            let chunk = match spec.spatial {
                Some(stitch_spec) => {
                    let mut sub = TileMap::new();
                    for i in 0..rows {
                        for j in 0..cols {
                            sub.insert(vec![i, j], tiles.take(&[ci, i, j]).ok_or_else(|| missing(i, j))?);
                        }
                    }
                    stitch(sub, [rows, cols], &stitch_spec).map_err(|e| ModelError::InvalidInput(e.to_string()))?
                }
                None => tiles.take(&[ci, 0, 0]).ok_or_else(|| missing(0, 0))?,
            };
            merged.push(chunk);
        }
        match spec.temporal {
            Some(t) => t.merge(merged),
            None => merged.pop().ok_or_else(|| ModelError::InvalidInput("no tiles".into())),
        }
    }
}

impl TileOperator for LtxOperator<'_> {
    type Payload = LtxTile;
    type TileSpec = LtxMerge;

    fn split(&self, x: &Tensor) -> std::result::Result<TilePlan<LtxTile, LtxMerge>, OperatorError> {
        Ok(self.plan(x).map_err(Classified::from)?)
    }

    fn exec(&self, x: &Tensor, task: &TileTask<LtxTile>) -> std::result::Result<Tensor, OperatorError> {
        let t = &task.payload;
        let tile = x.narrow(2, t.frames.start, t.frames.len())?;
        let tile = tile.narrow(3, t.rows.start, t.rows.len())?.narrow(4, t.cols.start, t.cols.len())?;
        let out = match self.direction {
            Direction::Decode => self.model.decode_clip(&tile, None),
            Direction::Encode => self.model.encode_clip(&tile, None),
        };
        Ok(out.map_err(Classified::from)?)
    }

    fn merge(&self, tiles: TileMap, grid: &GridSpec<LtxMerge, DType>) -> std::result::Result<Tensor, OperatorError> {
        Ok(self.merge_tiles(tiles, grid).map_err(Classified::from)?)
    }

    fn device(&self) -> Device {
        self.model.device()
    }
}

/// The plain decode or encode sharded along one spatial axis, or over a 2-D grid of blocks:
/// each rank runs the network on its band or block (of latent rows and columns; for an encode,
/// of the pixels of whole ones) with a halo exchange at every conv, zeros or reflected rows
/// and columns only at the global edges. The result is the plain call's, bit for bit.
pub struct LtxShardOperator<'m> {
    model: &'m LtxVae,
    direction: Direction,
}

impl<'m> LtxShardOperator<'m> {
    /// The sharded `direction` of `model`.
    pub fn new(model: &'m LtxVae, direction: Direction) -> Self {
        Self { model, direction }
    }

    fn check(&self, x: &Tensor) -> Result<ShardGeometry> {
        let m = self.model;
        let decode = self.direction == Direction::Decode;
        if decode {
            m.check_latent(x)?;
        } else {
            m.check_video(x, false)?;
            m.check_frame_size(x.dims()[3], x.dims()[4])?;
        }
        m.check_memory(decode, x.dims(), MapExtent::Banded)?;
        // Every conv is 3 x 3 x 3: one row from each neighbour. A reflection at a global edge
        // reads the band's second row, so there every band holds two latent rows (min_band
        // counts units: latent rows).
        let c = m.config();
        let reflect = if decode { c.decoder_padding } else { c.encoder_padding } == SpatialPadding::Reflect;
        let unit = if decode { 1 } else { m.encoder_spatial_factor() };
        Ok(ShardGeometry { min_band: if reflect { 2 } else { 1 }, unit })
    }
}

impl ShardOperator for LtxShardOperator<'_> {
    fn geometry(&self, x: &Tensor, _: ShardAxis) -> std::result::Result<ShardGeometry, OperatorError> {
        Ok(self.check(x).map_err(Classified::from)?)
    }

    fn exec(&self, x: &Tensor, ctx: &mut ShardContext<'_>) -> std::result::Result<Tensor, OperatorError> {
        let band = ctx.local_input(x)?;
        let out = match self.direction {
            Direction::Decode => self.model.decode_clip(&band, Some(ctx)),
            Direction::Encode => self.model.encode_clip(&band, Some(ctx)),
        };
        Ok(out.map_err(Classified::from)?)
    }

    fn finish(&self, assembled: Tensor) -> std::result::Result<Tensor, OperatorError> {
        Ok(assembled)
    }

    fn device(&self) -> Device {
        self.model.device()
    }

    /// Square kernels (halos alike along both axes; zeros or reflections only at the map's
    /// edges, where a block then holds two latent rows and columns), folds and unfolds of
    /// pixels within blocks of whole latent pixels, and per-pixel norms.
    fn splits_blocks(&self) -> bool {
        true
    }
}
