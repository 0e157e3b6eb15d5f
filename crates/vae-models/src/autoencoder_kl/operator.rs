//! Operators of the AutoencoderKL family for the distributed executor: diffusers'
//! `tiled_decode` and `_tiled_encode` cut into split / exec / merge, the untiled paths as a
//! single tile (so small inputs are computed once, by one rank, instead of on every rank), and
//! the spatial shard (each rank decodes a band of the latent, or encodes a band of the image:
//! halo rows for every convolution, the whole map's GroupNorm statistics, the mid-block
//! attention on the gathered map), whose output is the direct computation's bit for bit.

use std::ops::Range;

use vae_planner::{GridSpec, ShardAxis, TileLayout2d, TileTask};
use vae_runtime::stitch::{StitchLayout, merge_plan, tiled_plan, untiled_plan};
use vae_runtime::{
    Classified, OperatorError, ShardContext, ShardGeometry, ShardOperator, TileMap, TileOperator, TilePlan,
};
use vae_tensor::{DType, Device, Tensor};

use super::model::AutoencoderKl;
use crate::ModelError;

/// Encode or decode, tiled as diffusers would for the input (`use_tiling` and larger than a
/// tile), or in one piece.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KlTask {
    /// Latent → image.
    Decode,
    /// Image → raw moments (after `quant_conv`).
    Encode,
}

/// The operator the executor runs for one request.
pub struct KlOperator<'m> {
    model: &'m AutoencoderKl,
    task: KlTask,
    use_tiling: bool,
}

impl<'m> KlOperator<'m> {
    /// An operator for `task`; with `use_tiling`, inputs larger than a tile are tiled exactly as
    /// diffusers' `enable_tiling()` does.
    pub fn new(model: &'m AutoencoderKl, task: KlTask, use_tiling: bool) -> Self {
        Self { model, task, use_tiling }
    }

    fn tiled(&self, input: &Tensor) -> bool {
        self.use_tiling
            && match self.task {
                KlTask::Decode => self.model.decode_is_tiled(input),
                KlTask::Encode => self.model.encode_is_tiled(input),
            }
    }

    /// Refuses a request whose output plus largest feature map (at full resolution: the
    /// first encoder or last decoder level, over the whole image or one tile) cannot fit.
    fn check_memory(&self, input: &Tensor, tiled: bool) -> Result<(), ModelError> {
        check_memory(self.model, self.task, input, if tiled { MapExtent::Tile } else { MapExtent::Whole })
    }

    fn layout(&self, h: usize, w: usize) -> Result<TileLayout2d, ModelError> {
        let tiling = self.model.tiling();
        let levels = self.model.config().levels() as u32;
        let plan = match self.task {
            KlTask::Decode => tiling.decode_layout(h, w, self.model.config().spatial_scale()),
            // Each Downsample2D (pad right/bottom by 1, 3×3 stride 2) maps n to n / 2.
            KlTask::Encode => tiling.encode_layout(h, w, |n| n >> (levels - 1)),
        };
        plan.map_err(|e| ModelError::InvalidInput(format!("tiling: {e}")))
    }
}

impl TileOperator for KlOperator<'_> {
    type Payload = [Range<usize>; 2];
    type TileSpec = Option<StitchLayout>;

    fn split(&self, input: &Tensor) -> Result<TilePlan<Self::Payload, Self::TileSpec>, OperatorError> {
        match self.task {
            KlTask::Decode => self.model.check_latent(input).map_err(Classified::from)?,
            KlTask::Encode => self.model.check_image(input).map_err(Classified::from)?,
        }
        let (h, w) = (input.dims()[2], input.dims()[3]);
        let tiled = self.tiled(input);
        self.check_memory(input, tiled).map_err(Classified::from)?;
        if !tiled {
            return Ok(untiled_plan([2, 3], [h, w]));
        }
        Ok(tiled_plan([2, 3], &self.layout(h, w).map_err(Classified::from)?))
    }

    fn exec(&self, input: &Tensor, task: &TileTask<Self::Payload>) -> Result<Tensor, OperatorError> {
        let [rows, cols] = &task.payload;
        let whole = rows.len() == input.dims()[2] && cols.len() == input.dims()[3];
        let tile;
        let tile_ref = if whole {
            input
        } else {
            tile = input.narrow(2, rows.start, rows.len())?.narrow(3, cols.start, cols.len())?;
            &tile
        };
        Ok(match self.task {
            KlTask::Decode => self.model.decode_unchecked(tile_ref).map_err(Classified::from)?,
            KlTask::Encode => self.model.encode_unchecked(tile_ref).map_err(Classified::from)?,
        })
    }

    fn merge(&self, tiles: TileMap, grid: &GridSpec<Self::TileSpec, DType>) -> Result<Tensor, OperatorError> {
        Ok(merge_plan(tiles, grid)?)
    }

    fn stitch_layout<'g>(&self, grid: &'g GridSpec<Self::TileSpec, DType>) -> Option<&'g StitchLayout> {
        grid.tile_spec.as_ref()
    }

    fn device(&self) -> Device {
        self.model.device()
    }
}

/// How much of the full-resolution map one rank holds at once.
#[derive(Debug, Clone, Copy)]
enum MapExtent {
    Whole,
    Tile,
    /// A band of the map, one of this many.
    Band(usize),
}

/// Refuses a request whose output plus largest feature map (at full resolution: the first
/// encoder or last decoder level; over the whole image, one tile or one band) cannot fit.
fn check_memory(model: &AutoencoderKl, task: KlTask, input: &Tensor, extent: MapExtent) -> Result<(), ModelError> {
    let c = model.config();
    let d = input.dims();
    let (b, h, w) = (d[0] as u64, d[2] as u64, d[3] as u64);
    let scale = c.spatial_scale() as u64;
    let pixels = match task {
        KlTask::Decode => h * scale * w * scale,
        KlTask::Encode => h * w,
    };
    let tile = model.tiling().tile_sample_min_size as u64;
    let map_pixels = match extent {
        MapExtent::Whole => pixels,
        MapExtent::Tile => pixels.min(tile * tile),
        MapExtent::Band(ranks) => pixels.div_ceil(ranks.max(1) as u64),
    };
    let (output, widest, advice) = match task {
        KlTask::Decode => (
            b * c.out_channels as u64 * pixels * 4,
            *c.decoder_block_out_channels.first().unwrap_or(&0) as u64,
            "decode with tiles (`vae_use_tiling`)",
        ),
        KlTask::Encode => (
            b * 2 * c.latent_channels as u64 * (pixels / (scale * scale)) * 4,
            *c.block_out_channels.first().unwrap_or(&0) as u64,
            "encode with tiles (`vae_use_tiling`)",
        ),
    };
    crate::checks::ensure_fits(output, b * widest * map_pixels * 4, advice)
}

/// The spatial shard: each rank decodes its band of the latent's rows (or columns), or encodes
/// its band of the image's (cut between whole latent rows, so every strided convolution sees
/// band edges on its stride grid).
pub struct KlShardOperator<'m> {
    model: &'m AutoencoderKl,
    task: KlTask,
    ranks: usize,
}

impl<'m> KlShardOperator<'m> {
    /// An operator for `task` over `ranks` bands.
    pub fn new(model: &'m AutoencoderKl, task: KlTask, ranks: usize) -> Self {
        Self { model, task, ranks }
    }
}

impl ShardOperator for KlShardOperator<'_> {
    /// Every convolution is 3×3 (halo 1), 1×1, or (encoding) 3×3 with stride 2 on a band of
    /// even rows: a band of one latent row is enough. An encode's band unit is the image rows
    /// of one latent row.
    fn geometry(&self, input: &Tensor, _: ShardAxis) -> Result<ShardGeometry, OperatorError> {
        match self.task {
            KlTask::Decode => self.model.check_latent(input).map_err(Classified::from)?,
            KlTask::Encode => self.model.check_image(input).map_err(Classified::from)?,
        }
        if let Some(refusal) = self.model.shard_refusal() {
            return Err(Classified::from(refusal).into());
        }
        check_memory(self.model, self.task, input, MapExtent::Band(self.ranks)).map_err(Classified::from)?;
        let unit = match self.task {
            KlTask::Decode => 1,
            KlTask::Encode => self.model.config().spatial_scale(),
        };
        Ok(ShardGeometry { min_band: 1, unit })
    }

    fn exec(&self, input: &Tensor, ctx: &mut ShardContext<'_>) -> Result<Tensor, OperatorError> {
        let band = ctx.local_input(input)?;
        Ok(match self.task {
            KlTask::Decode => self.model.decode_on(&band, &mut Some(ctx)).map_err(Classified::from)?,
            KlTask::Encode => self.model.encode_on(&band, &mut Some(ctx)).map_err(Classified::from)?,
        })
    }

    fn finish(&self, assembled: Tensor) -> Result<Tensor, OperatorError> {
        Ok(assembled)
    }

    fn device(&self) -> Device {
        self.model.device()
    }

    /// Its layers ([`crate::layers`]) take halos along both axes of a block: square 3×3
    /// convolutions, the stride-2 downsample on even blocks, GroupNorm statistics and the
    /// attention's gathered map over the whole grid.
    fn splits_blocks(&self) -> bool {
        true
    }
}
