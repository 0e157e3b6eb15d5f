//! The Wan / Qwen-Image operators the distributed executor runs: tiled decode and encode,
//! and the spatial-shard decode.

use std::ops::Range;

use vae_planner::{GridSpec, ShardAxis, TileTask};
use vae_runtime::stitch::{StitchLayout, merge_plan, tiled_plan, untiled_plan};
use vae_runtime::{
    Classified, OperatorError, PipelineOperator, PipelineSteps, ShardContext, ShardGeometry, ShardOperator, StageState,
    StreamRuns, TileMap, TileOperator, TilePlan, TileStream,
};
use vae_tensor::{DType, Device, Tensor};

use super::model::{FrameStream, MapExtent, Output, VideoVaeClass, WanVae};
use super::stage::StageStream;

/// Wan decode for the executor: diffusers' `tiled_decode` cut into split / exec / merge (each
/// tile decoded frame by frame with its own cache; blend and crop in H and W; clamp after), or
/// the plain decode as one tile when the latent is not larger than a tile.
pub struct WanDecodeOperator<'m> {
    model: &'m WanVae,
    use_tiling: bool,
    held: Output,
}

impl<'m> WanDecodeOperator<'m> {
    /// An operator that tiles as `enable_tiling()` does when `use_tiling`.
    pub fn new(model: &'m WanVae, use_tiling: bool) -> Self {
        Self { model, use_tiling, held: Output::Whole }
    }

    /// The same, for a streamed decode ([`TileOperator::exec_run`]): its memory check counts
    /// one latent frame's output, and every tile's cache alive at once (the whole map's).
    pub fn streaming(model: &'m WanVae, use_tiling: bool) -> Self {
        Self { model, use_tiling, held: Output::Streamed }
    }
}

impl TileOperator for WanDecodeOperator<'_> {
    type Payload = [Range<usize>; 2];
    type TileSpec = Option<StitchLayout>;

    fn split(&self, z: &Tensor) -> std::result::Result<TilePlan<Self::Payload, Self::TileSpec>, OperatorError> {
        self.model.check_whole().map_err(Classified::from)?;
        self.model.check_latent(z).map_err(Classified::from)?;
        let (h, w) = (z.dims()[3], z.dims()[4]);
        let tiling = self.model.tiling();
        let tiled = self.use_tiling && tiling.needs_tiling_decode(h, w)?;
        let map = if tiled && self.held == Output::Whole { MapExtent::Tile } else { MapExtent::Whole };
        self.model.check_memory(true, z.dims(), map, self.held).map_err(Classified::from)?;
        if !tiled {
            return Ok(untiled_plan([3, 4], [h, w]));
        }
        Ok(tiled_plan([3, 4], &tiling.decode_layout(h, w)?))
    }

    fn exec(&self, z: &Tensor, task: &TileTask<Self::Payload>) -> std::result::Result<Tensor, OperatorError> {
        let [rows, cols] = &task.payload;
        let tile = z.narrow(3, rows.start, rows.len())?.narrow(4, cols.start, cols.len())?;
        Ok(self.model.decode_frames(&tile).map_err(Classified::from)?)
    }

    fn merge(
        &self,
        tiles: TileMap,
        grid: &GridSpec<Self::TileSpec, DType>,
    ) -> std::result::Result<Tensor, OperatorError> {
        self.finish_stitched(merge_plan(tiles, grid)?, grid)
    }

    fn stitch_layout<'g>(&self, grid: &'g GridSpec<Self::TileSpec, DType>) -> Option<&'g StitchLayout> {
        grid.tile_spec.as_ref()
    }

    /// Unpatchify (Wan2.2) and clamp. diffusers' Qwen-Image tiled_decode does not clamp; Wan's
    /// and every plain decode do.
    fn finish_stitched(
        &self,
        merged: Tensor,
        grid: &GridSpec<Self::TileSpec, DType>,
    ) -> std::result::Result<Tensor, OperatorError> {
        let clamp = grid.tile_spec.is_none() || self.model.class == VideoVaeClass::Wan;
        Ok(self.model.finish_decode(merged, clamp).map_err(Classified::from)?)
    }

    fn device(&self) -> Device {
        self.model.device()
    }

    /// One run per latent frame.
    fn stream_runs(&self, z: &Tensor) -> Option<StreamRuns> {
        let latent_frames = *z.dims().get(2)?;
        Some(StreamRuns { runs: latent_frames, frames: self.model.decoded_frames(latent_frames) })
    }

    fn start_tile(&self, z: &Tensor, task: &TileTask<Self::Payload>) -> std::result::Result<TileStream, OperatorError> {
        let [rows, cols] = &task.payload;
        let tile = z.narrow(3, rows.start, rows.len())?.narrow(4, cols.start, cols.len())?;
        let stream: FrameStream<'static, 'static> = self.model.start_frames(&tile, None).map_err(Classified::from)?;
        Ok(Box::new(stream))
    }

    fn exec_run(
        &self,
        _: &Tensor,
        _: &TileTask<Self::Payload>,
        state: &mut TileStream,
    ) -> std::result::Result<Tensor, OperatorError> {
        let stream = state.downcast_mut::<FrameStream<'static, 'static>>().ok_or("not this operator's tile state")?;
        Ok(self.model.next_run(stream).map_err(Classified::from)?)
    }
}

/// Wan / Qwen-Image encode for the executor: diffusers' `tiled_encode` cut into split / exec /
/// merge (each pixel tile encoded chunk by chunk with its own cache, blended and cropped in
/// latent H and W, cropped to the latent size), or the plain encode as one tile when the video
/// is not larger than a tile. The output is the raw moments.
pub struct WanEncodeOperator<'m> {
    model: &'m WanVae,
    use_tiling: bool,
}

impl<'m> WanEncodeOperator<'m> {
    /// An operator that tiles as `enable_tiling()` does when `use_tiling`.
    pub fn new(model: &'m WanVae, use_tiling: bool) -> Self {
        Self { model, use_tiling }
    }
}

impl TileOperator for WanEncodeOperator<'_> {
    type Payload = [Range<usize>; 2];
    type TileSpec = Option<StitchLayout>;

    fn split(&self, x: &Tensor) -> std::result::Result<TilePlan<Self::Payload, Self::TileSpec>, OperatorError> {
        self.model.check_whole().map_err(Classified::from)?;
        self.model.check_video(x).map_err(Classified::from)?;
        // diffusers decides on the input size, then tiles the patchified tensor.
        let p = self.model.patch();
        let (h, w) = (x.dims()[3] / p, x.dims()[4] / p);
        let tiling = self.model.tiling();
        let tiled = self.use_tiling && tiling.needs_tiling_encode(x.dims()[3], x.dims()[4]);
        self.model
            .check_memory(false, x.dims(), if tiled { MapExtent::Tile } else { MapExtent::Whole }, Output::Whole)
            .map_err(Classified::from)?;
        if !tiled {
            return Ok(untiled_plan([3, 4], [h, w]));
        }
        // Every stride-2 resample maps n to n / 2 (a final partial row is dropped).
        let halvings = self.model.config.dim_mult.len().saturating_sub(1) as u32;
        Ok(tiled_plan([3, 4], &tiling.encode_layout(h, w, |n| n >> halvings)?))
    }

    fn exec(&self, x: &Tensor, task: &TileTask<Self::Payload>) -> std::result::Result<Tensor, OperatorError> {
        // Ranges are in patchified pixels: the same pixels of the RGB input, patchified.
        let [rows, cols] = &task.payload;
        let p = self.model.patch();
        let tile = x.narrow(3, rows.start * p, rows.len() * p)?.narrow(4, cols.start * p, cols.len() * p)?;
        let tile = self.model.patchify_input(&tile).map_err(Classified::from)?;
        Ok(self.model.encode_frames(&tile).map_err(Classified::from)?)
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

/// Wan / Qwen-Image decode sharded along one spatial axis: the plain (direct) decode, each
/// rank running the decoder on its band of the latent with halo exchanges, assembled on the
/// owner, then unpatchified (Wan2.2) and clamped as the plain decode is.
pub struct WanShardDecodeOperator<'m> {
    model: &'m WanVae,
    held: Output,
}

impl<'m> WanShardDecodeOperator<'m> {
    /// The sharded decode of `model`.
    pub fn new(model: &'m WanVae) -> Self {
        Self { model, held: Output::Whole }
    }

    /// The same, for a streamed decode ([`ShardOperator::exec_streaming`]): its memory check
    /// counts one latent frame's output.
    pub fn streaming(model: &'m WanVae) -> Self {
        Self { model, held: Output::Streamed }
    }
}

impl ShardOperator for WanShardDecodeOperator<'_> {
    fn geometry(&self, z: &Tensor, axis: ShardAxis) -> std::result::Result<ShardGeometry, OperatorError> {
        self.model.check_whole().map_err(Classified::from)?;
        self.model.check_latent(z).map_err(Classified::from)?;
        self.model.check_memory(true, z.dims(), MapExtent::Banded, self.held).map_err(Classified::from)?;
        Ok(ShardGeometry { min_band: self.model.decoder.widest_halo(axis), unit: 1 })
    }

    fn exec(&self, z: &Tensor, ctx: &mut ShardContext<'_>) -> std::result::Result<Tensor, OperatorError> {
        let band = ctx.local_input(z)?;
        Ok(self.model.decode_frames_on(&band, Some(ctx)).map_err(Classified::from)?)
    }

    fn finish(&self, assembled: Tensor) -> std::result::Result<Tensor, OperatorError> {
        Ok(self.model.finish_decode(assembled, true).map_err(Classified::from)?)
    }

    fn device(&self) -> Device {
        self.model.device()
    }

    /// Square kernels (halos alike along both axes), stride-2 downsamples on blocks of whole
    /// latent rows and columns, per-pixel norms, and the attention on the gathered map.
    fn splits_blocks(&self) -> bool {
        true
    }

    /// One run per latent frame.
    fn stream_runs(&self, z: &Tensor) -> Option<StreamRuns> {
        let latent_frames = *z.dims().get(2)?;
        Some(StreamRuns { runs: latent_frames, frames: self.model.decoded_frames(latent_frames) })
    }

    fn exec_streaming(
        &self,
        z: &Tensor,
        ctx: &mut ShardContext<'_>,
        emit: &mut dyn FnMut(Tensor) -> std::result::Result<(), OperatorError>,
    ) -> std::result::Result<(), OperatorError> {
        let band = ctx.local_input(z)?;
        // The executor's own failure (a gather, an abort) stays a runtime error; anything else
        // came from the sink.
        let decoded = self.model.decode_runs_on(&band, Some(ctx), &mut |run| {
            emit(run).map_err(|e| match e.downcast::<vae_runtime::RuntimeError>() {
                Ok(runtime) => crate::ModelError::Runtime(*runtime),
                Err(other) => crate::ModelError::Sink(other),
            })
        });
        Ok(decoded.map_err(Classified::from)?)
    }
}

/// Wan / Qwen-Image decode as a pipeline over latent frames: the decoder's layers cut into
/// stages (balanced on their multiply-adds at the request's resolution), each rank running its
/// stage's layers with their own causal cache on every latent frame in turn; the owner
/// unpatchifies (Wan2.2) and clamps each frame's output as the plain decode does.
pub struct WanPipelineDecodeOperator<'m> {
    model: &'m WanVae,
    held: Output,
}

impl<'m> WanPipelineDecodeOperator<'m> {
    /// The pipelined decode of `model`, its output assembled on the owner.
    pub fn new(model: &'m WanVae) -> Self {
        Self { model, held: Output::Whole }
    }

    /// The same, streamed: its memory check counts one latent frame's output.
    pub fn streaming(model: &'m WanVae) -> Self {
        Self { model, held: Output::Streamed }
    }
}

impl PipelineOperator for WanPipelineDecodeOperator<'_> {
    fn steps(&self, z: &Tensor) -> std::result::Result<PipelineSteps, OperatorError> {
        self.model.check_latent(z).map_err(Classified::from)?;
        // A stage holds whole feature maps of its layers.
        self.model.check_memory(true, z.dims(), MapExtent::Whole, self.held).map_err(Classified::from)?;
        let d = z.dims();
        Ok(PipelineSteps {
            costs: self.model.pipeline_costs(d[3], d[4]).map_err(Classified::from)?,
            runs: StreamRuns { runs: d[2], frames: self.model.decoded_frames(d[2]) },
        })
    }

    fn start_stage(&self, z: &Tensor, steps: Range<usize>) -> std::result::Result<StageState, OperatorError> {
        Ok(Box::new(self.model.start_stage(z, steps).map_err(Classified::from)?))
    }

    fn exec_stage(
        &self,
        _: &Tensor,
        run: usize,
        state: &mut StageState,
        carried: Vec<Tensor>,
    ) -> std::result::Result<Vec<Tensor>, OperatorError> {
        let stage = state.downcast_mut::<StageStream>().ok_or("not this operator's stage state")?;
        Ok(self.model.stage_run(stage, run, carried).map_err(Classified::from)?)
    }

    fn finish(&self, output: Tensor) -> std::result::Result<Tensor, OperatorError> {
        Ok(self.model.finish_decode(output, true).map_err(Classified::from)?)
    }

    fn stage_weight_bytes(&self, steps: Range<usize>) -> u64 {
        self.model.decoder.step_weight_bytes(steps)
    }

    fn device(&self) -> Device {
        self.model.device()
    }
}

/// Wan / Qwen-Image encode sharded along one spatial axis: the plain encode, each rank running
/// the encoder on its band of the video, cut between whole latent rows (the pixel rows of one,
/// patchified for Wan2.2), with halo exchanges; the moments' bands assembled on the owner.
pub struct WanShardEncodeOperator<'m> {
    model: &'m WanVae,
}

impl<'m> WanShardEncodeOperator<'m> {
    /// The sharded encode of `model`.
    pub fn new(model: &'m WanVae) -> Self {
        Self { model }
    }
}

impl ShardOperator for WanShardEncodeOperator<'_> {
    fn geometry(&self, x: &Tensor, _: ShardAxis) -> std::result::Result<ShardGeometry, OperatorError> {
        self.model.check_whole().map_err(Classified::from)?;
        self.model.check_video(x).map_err(Classified::from)?;
        self.model.check_memory(false, x.dims(), MapExtent::Banded, Output::Whole).map_err(Classified::from)?;
        Ok(ShardGeometry { min_band: 1, unit: self.model.encode_band_unit() })
    }

    fn exec(&self, x: &Tensor, ctx: &mut ShardContext<'_>) -> std::result::Result<Tensor, OperatorError> {
        let band = ctx.local_input(x)?;
        let band = self.model.patchify_input(&band).map_err(Classified::from)?;
        Ok(self.model.encode_frames_on(&band, Some(ctx)).map_err(Classified::from)?)
    }

    fn finish(&self, assembled: Tensor) -> std::result::Result<Tensor, OperatorError> {
        Ok(assembled)
    }

    fn device(&self) -> Device {
        self.model.device()
    }

    /// Square kernels (halos alike along both axes), stride-2 downsamples on blocks of whole
    /// latent rows and columns, per-pixel norms, and the attention on the gathered map.
    fn splits_blocks(&self) -> bool {
        true
    }
}
