//! The HunyuanVideo-1.5 operators the distributed executor runs: diffusers' `tiled_decode` and
//! `tiled_encode` cut into split / exec / merge (or the plain path as one tile), and the plain
//! decode and encode sharded along one spatial axis.

use std::ops::Range;

use vae_planner::{GridSpec, ShardAxis, TileTask};
use vae_runtime::stitch::{StitchLayout, merge_plan, tiled_plan, untiled_plan};
use vae_runtime::{
    Classified, OperatorError, ShardContext, ShardGeometry, ShardOperator, TileMap, TileOperator, TilePlan,
};
use vae_tensor::{DType, Device, Tensor};

use super::model::HunyuanVideo15Vae;
use crate::Result;
use crate::checks::MapExtent;
use crate::family::Direction;

/// Decode (latent tiles decoded whole, every frame at once and each batch item alone) or encode
/// (pixel tiles encoded whole, to raw moments); the tiles blended and cut to their kept parts in
/// H and W, with no final crop and no clamp.
pub struct HunyuanVideo15Operator<'m> {
    model: &'m HunyuanVideo15Vae,
    direction: Direction,
    use_tiling: bool,
}

impl<'m> HunyuanVideo15Operator<'m> {
    /// An operator for `direction` that tiles as `enable_tiling()` does when `use_tiling`.
    pub fn new(model: &'m HunyuanVideo15Vae, direction: Direction, use_tiling: bool) -> Self {
        Self { model, direction, use_tiling }
    }

    fn plan(&self, x: &Tensor) -> Result<TilePlan<[Range<usize>; 2], Option<StitchLayout>>> {
        let m = self.model;
        let decode = self.direction == Direction::Decode;
        if decode {
            m.check_latent(x)?
        } else {
            m.check_video(x)?
        }
        let (h, w) = (x.dims()[3], x.dims()[4]);
        let t = m.tiling();
        let tiled = self.use_tiling && if decode { t.needs_tiling_decode(h, w) } else { t.needs_tiling_encode(h, w) };
        if !tiled {
            if !decode {
                m.check_frame_size(h, w)?;
            }
            m.check_memory(decode, x.dims(), MapExtent::Whole)?;
            return Ok(untiled_plan([3, 4], [h, w]));
        }
        m.check_memory(decode, x.dims(), MapExtent::Tile(t.tile_sample_min_height * t.tile_sample_min_width))?;
        let ratio = m.spatial_ratio();
        let layout = if decode { t.decode_layout(h, w, ratio)? } else { t.encode_layout(h, w, ratio)? };
        Ok(tiled_plan([3, 4], &layout))
    }
}

impl TileOperator for HunyuanVideo15Operator<'_> {
    type Payload = [Range<usize>; 2];
    type TileSpec = Option<StitchLayout>;

    fn split(&self, x: &Tensor) -> std::result::Result<TilePlan<Self::Payload, Self::TileSpec>, OperatorError> {
        Ok(self.plan(x).map_err(Classified::from)?)
    }

    fn exec(&self, x: &Tensor, task: &TileTask<Self::Payload>) -> std::result::Result<Tensor, OperatorError> {
        let [rows, cols] = &task.payload;
        let tile = x.narrow(3, rows.start, rows.len())?.narrow(4, cols.start, cols.len())?;
        let out = match self.direction {
            Direction::Decode => self.model.decode_clip(&tile, None),
            Direction::Encode => self.model.encode_clip(&tile, None),
        };
        Ok(out.map_err(Classified::from)?)
    }

    fn merge(
        &self,
        tiles: TileMap,
        grid: &GridSpec<Self::TileSpec, DType>,
    ) -> std::result::Result<Tensor, OperatorError> {
        Ok(merge_plan(tiles, grid)?)
    }

    fn stitch_layout<'g>(&self, grid: &'g GridSpec<Self::TileSpec, DType>) -> Option<&'g StitchLayout> {
        grid.tile_spec.as_ref()
    }

    fn device(&self) -> Device {
        self.model.device()
    }
}

/// The plain decode or encode sharded along one spatial axis, or over a 2-D grid of blocks:
/// each rank runs the network on its band or block (of latent rows and columns; for an encode,
/// of the pixels of whole ones) with halo exchanges, the attention on the gathered map; the
/// parts are assembled on the owner as they are. The result is the plain call's, bit for bit.
pub struct HunyuanVideo15ShardOperator<'m> {
    model: &'m HunyuanVideo15Vae,
    direction: Direction,
}

impl<'m> HunyuanVideo15ShardOperator<'m> {
    /// The sharded `direction` of `model`.
    pub fn new(model: &'m HunyuanVideo15Vae, direction: Direction) -> Self {
        Self { model, direction }
    }

    fn check(&self, x: &Tensor) -> Result<ShardGeometry> {
        let m = self.model;
        let decode = self.direction == Direction::Decode;
        if decode {
            m.check_latent(x)?;
        } else {
            m.check_video(x)?;
            m.check_frame_size(x.dims()[3], x.dims()[4])?;
        }
        m.check_memory(decode, x.dims(), MapExtent::Banded)?;
        // Every conv is 3 x 3 x 3: one row from each neighbour at any resolution.
        Ok(ShardGeometry { min_band: 1, unit: if decode { 1 } else { m.spatial_ratio() } })
    }
}

impl ShardOperator for HunyuanVideo15ShardOperator<'_> {
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

    /// Square kernels (halos alike along both axes, replicated only at the map's edges), folds
    /// and unfolds of 2 × 2 pixels within blocks of whole latent pixels, per-pixel norms, and
    /// the attention on the gathered map.
    fn splits_blocks(&self) -> bool {
        true
    }
}
