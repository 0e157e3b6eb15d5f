//! The shard and tile strategies with their output streamed: each rank computes its band (or
//! block of a 2-D grid), or its tiles, run by run (a causal video decoder's latent frame at a
//! time, each tile keeping its own cache), every run is gathered to the owner as soon as it is
//! computed, and the owner assembles (or merges), finishes and hands it to a [`FrameSink`].
//! No rank ever holds more than one run of the output, so memory does not grow with the frame
//! count, and the frames are bit for bit those of the same strategy unstreamed (merging is per
//! frame: tiles blend in height and width only).

use std::cell::RefCell;
use std::time::{Duration, Instant};

use vae_planner::{ShardAxis, lpt_assign};
use vae_tensor::{DType, Device, Tensor};
use vae_transport::CommunicatorExt;

use super::blocked::{BlockPlan, BlockStrategy, assemble_blocks};
use super::failure::Failure;
use super::report::{PhaseTimings, StrategyReport};
use super::sharded::{BandPlan, ShardStrategy, abort_shard, assemble_bands, band_message};
use super::tile::{TileOutputs, TileStrategy, gather_and_merge};
use super::{DistributedVaeExecutor, OWNER, RankWork, RequestStrategy, guarded};
use crate::progress::{self, Progress};
use crate::shard::{ShardContext, ShardOperator, ShardTraffic, StreamRuns};
use crate::stream::{FrameFeed, FrameSink};
use crate::{RuntimeError, Stage};
use crate::{TileOperator, TilePlan};

/// How a streamed shard cuts the map: bands along an axis, or the blocks of an `[R, C]` grid.
#[derive(Debug, Clone, Copy)]
pub(super) enum Cut {
    Bands(ShardAxis),
    Blocks([usize; 2]),
}

/// The parts of a streamed shard: its bands or its blocks.
#[derive(Debug, Clone)]
pub(super) enum CutPlan {
    Bands(ShardAxis, BandPlan),
    Blocks(BlockPlan),
}

/// The streamed shard strategy of one request; the owner's sink receives the frames.
pub(super) struct StreamedShardStrategy<'o, 's, O> {
    pub(super) op: &'o O,
    pub(super) cut: Cut,
    pub(super) sink: RefCell<Option<&'s mut dyn FrameSink>>,
}

impl<O: ShardOperator> StreamedShardStrategy<'_, '_, O> {
    /// Gathers one run to the owner (this rank's band or block of it, or nothing beyond the
    /// parallel size); on the owner, assembles and finishes it and hands it to the sink.
    fn gather_run(
        &self,
        exec: &DistributedVaeExecutor,
        plan: &(CutPlan, StreamRuns),
        own: Option<Tensor>,
        feed: &mut Option<FrameFeed<'_>>,
    ) -> Result<(), RuntimeError> {
        let comm = exec.comm.as_ref();
        let message = band_message(own.as_ref(), comm.rank())?;
        let Some(parts) = comm.gather(OWNER, message.as_slice())? else { return Ok(()) };
        let failed = |failure: Failure| failure.at(Stage::Merge, OWNER);
        let message = |text: &str| failed(Failure::from(text.to_string()));
        let feed = feed.as_mut().ok_or_else(|| message("the owner has no frame sink"))?;
        let own = own.ok_or_else(|| message("the owner computed no part of the map"))?;
        let parts: Vec<&[u8]> = parts.parts().collect();
        let full = match &plan.0 {
            CutPlan::Bands(axis, bands) => assemble_bands(own, &parts, *axis, &bands.bands),
            CutPlan::Blocks(blocks) => assemble_blocks(own, &parts, &blocks.grid),
        }
        .map_err(|e| failed(e.into()))?;
        let frames = guarded(|| self.op.finish(full)).map_err(failed)?;
        hand_on(feed, frames)
    }
}

/// The owner's feed into its sink on rank 0 (which must have a sink), `None` elsewhere.
pub(super) fn feed_of<'a, 's: 'a>(
    rank: usize,
    sink: Option<&'a mut (dyn FrameSink + 's)>,
    total: usize,
) -> Result<Option<FrameFeed<'a>>, Failure> {
    match (rank == OWNER, sink) {
        (true, Some(sink)) => Ok(Some(FrameFeed::new(sink, total))),
        (true, None) => Err("the owner of a streamed request needs a frame sink".to_string().into()),
        (false, _) => Ok(None),
    }
}

/// Passes one finished run to the owner's sink; its failure is the merge's, on the owner.
pub(super) fn hand_on(feed: &mut FrameFeed<'_>, frames: Tensor) -> Result<(), RuntimeError> {
    feed.feed(frames).map_err(|e| Failure::from(format!("passing on decoded frames: {e}")).at(Stage::Merge, OWNER))
}

impl<O: ShardOperator> RequestStrategy for StreamedShardStrategy<'_, '_, O> {
    type Plan = (CutPlan, StreamRuns);
    type Local = ();

    /// The bands (or blocks) of the unstreamed strategy, and the runs the operator will emit.
    fn plan(&self, exec: &DistributedVaeExecutor, input: &Tensor) -> Result<Self::Plan, Failure> {
        let parts = match self.cut {
            Cut::Bands(axis) => CutPlan::Bands(axis, ShardStrategy { op: self.op, axis }.plan(exec, input)?),
            Cut::Blocks(grid) => CutPlan::Blocks(BlockStrategy { op: self.op, grid }.plan(exec, input)?),
        };
        let runs = streams(self.op.stream_runs(input))?;
        Ok((parts, runs))
    }

    fn plan_size(plan: &Self::Plan) -> usize {
        match &plan.0 {
            CutPlan::Bands(_, bands) => ShardStrategy::<O>::plan_size(bands),
            CutPlan::Blocks(blocks) => BlockStrategy::<O>::plan_size(blocks),
        }
    }

    fn disagreement(sizes: &[usize]) -> Option<String> {
        sizes.iter().any(|e| *e != sizes[0]).then(|| format!("ranks planned parts of different sizes: {sizes:?}"))
    }

    /// This rank's band (or block), run by run, each run gathered to the owner (and passed on
    /// there) as soon as it is computed. A failure aborts the group: the neighbours may be
    /// waiting for a halo, and every rank for the run's gather.
    fn compute(
        &self,
        exec: &DistributedVaeExecutor,
        input: &Tensor,
        plan: &Self::Plan,
        timings: &mut PhaseTimings,
    ) -> Result<((), RankWork), RuntimeError> {
        let clock = Instant::now();
        let rank = exec.comm.rank();
        let comm = exec.comm.as_ref();
        // This rank's context (None beyond the parts), and what its report says of its part.
        let (context, part) = match &plan.0 {
            CutPlan::Bands(axis, bands) => {
                let band = bands.bands.band(rank);
                let ctx = band.is_some().then(|| ShardContext::new(comm, *axis, bands.bands.clone(), rank));
                (ctx.map(|c| c.with_unit(bands.unit)), Part::Band(*axis, band))
            }
            CutPlan::Blocks(blocks) => {
                let block = blocks.grid.block(rank);
                let ctx = block.is_some().then(|| ShardContext::blocks(comm, blocks.grid.clone(), rank));
                (ctx.map(|c| c.with_unit(blocks.unit)), Part::Block(blocks.grid.grid(), block))
            }
        };
        let mut sink = self.sink.borrow_mut();
        let mut owner = feed_of(rank, sink.as_deref_mut(), plan.1.frames).map_err(|f| abort_shard(exec, rank, f))?;
        let mut traffic = ShardTraffic::default();
        let (mut runs, mut gathering) = (0usize, Duration::ZERO);
        let mut run = |own: Option<Tensor>| -> Result<(), RuntimeError> {
            let started = Instant::now();
            let result = self.gather_run(exec, plan, own, &mut owner);
            gathering += started.elapsed();
            runs += 1;
            result
        };
        match context {
            Some(ctx) => {
                let mut ctx = ctx.with_overlap(exec.halo_overlap);
                let out = guarded(|| {
                    self.op.exec_streaming(input, &mut ctx, &mut |r| run(Some(r)).map_err(|e| Box::new(e) as _))
                });
                traffic = ctx.traffic();
                if let Err(message) = out {
                    return Err(abort_shard(exec, rank, message));
                }
            }
            None => {
                for _ in 0..plan.1.runs {
                    run(None).map_err(|e| abort_shard(exec, rank, e.to_string().into()))?;
                }
            }
        }
        if runs != plan.1.runs {
            let message = format!("emitted {runs} runs of frames, {} were announced", plan.1.runs);
            return Err(abort_shard(exec, rank, message.into()));
        }
        if let Some(owner) = &owner {
            owner.finish().map_err(|e| abort_shard(exec, rank, e.to_string().into()))?;
        }
        timings.halo = traffic.comm_time();
        timings.gather = gathering;
        timings.exec = clock.elapsed().saturating_sub(timings.halo + gathering);
        let (workload, strategy) = match part {
            Part::Band(axis, band) => {
                (band.as_ref().map_or(0, |b| b.len() as u64), StrategyReport::Shard { axis, band, traffic })
            }
            Part::Block(grid, block) => (
                block.as_ref().map_or(0, |[h, w]| (h.len() * w.len()) as u64),
                StrategyReport::Blocks { grid, block, traffic },
            ),
        };
        let work = RankWork { tile_count: 0, tiles: Vec::new(), workload, strategy };
        Ok(((), work))
    }

    /// Nothing is left to gather: the owner's outcome is an empty tensor (the frames went to
    /// the sink).
    fn collect(
        &self,
        exec: &DistributedVaeExecutor,
        _: &Tensor,
        _: &Self::Plan,
        (): (),
        _: &mut PhaseTimings,
    ) -> Result<Option<Result<Tensor, RuntimeError>>, RuntimeError> {
        Ok(nothing_left(exec))
    }
}

/// The part of the map a rank of a streamed shard holds, for its report.
enum Part {
    Band(ShardAxis, Option<std::ops::Range<usize>>),
    Block([usize; 2], Option<[std::ops::Range<usize>; 2]>),
}

/// The tile strategy with its output streamed; the owner's sink receives the frames.
pub(super) struct StreamedTileStrategy<'o, 's, O> {
    pub(super) op: &'o O,
    pub(super) sink: RefCell<Option<&'s mut dyn FrameSink>>,
}

impl<O: TileOperator> RequestStrategy for StreamedTileStrategy<'_, '_, O> {
    type Plan = (TilePlan<O::Payload, O::TileSpec>, StreamRuns);
    type Local = ();

    /// The tiles of the tile strategy, and the runs every tile will make.
    fn plan(&self, exec: &DistributedVaeExecutor, input: &Tensor) -> Result<Self::Plan, Failure> {
        let tiles = TileStrategy { op: self.op }.plan(exec, input)?;
        let runs = streams(self.op.stream_runs(input))?;
        Ok((tiles, runs))
    }

    fn plan_size(plan: &Self::Plan) -> usize {
        TileStrategy::<O>::plan_size(&plan.0)
    }

    fn disagreement(sizes: &[usize]) -> Option<String> {
        TileStrategy::<O>::disagreement(sizes)
    }

    /// This rank's tiles (dealt by LPT as unstreamed), all started, then advanced a run at a
    /// time: each run of every tile is gathered to the owner, which merges it and passes it on.
    /// A failure aborts the group (every rank waits for the run's gather).
    fn compute(
        &self,
        exec: &DistributedVaeExecutor,
        input: &Tensor,
        plan: &Self::Plan,
        timings: &mut PhaseTimings,
    ) -> Result<((), RankWork), RuntimeError> {
        let clock = Instant::now();
        let rank = exec.comm.rank();
        let (tiles, runs) = plan;
        let workloads: Vec<u64> = tiles.tasks.iter().map(|t| t.workload).collect();
        let assignment = lpt_assign(&workloads, exec.parallel_size)?;
        let mine: &[usize] = assignment.per_rank.get(rank).map_or(&[], Vec::as_slice);
        let abort = |failure: Failure, stage: Stage| super::abort_at(exec, stage, failure);
        let mut sink = self.sink.borrow_mut();
        let mut owner = feed_of(rank, sink.as_deref_mut(), runs.frames).map_err(|f| abort(f, Stage::Merge))?;
        let mut states = Vec::with_capacity(mine.len());
        for &tile_id in mine {
            let state = guarded(|| self.op.start_tile(input, &tiles.tasks[tile_id]));
            states.push(state.map_err(|f| abort(f, Stage::Exec { tile_id }))?);
        }
        let mut gathering = Duration::ZERO;
        for run in 0..runs.runs {
            crate::cancel::check()?;
            // This run of every tile of this rank (or the first failure, told to the owner in
            // the gather, which then fails the request).
            let mut local = TileOutputs { outputs: Vec::with_capacity(mine.len()), error: None };
            for (&tile_id, state) in mine.iter().zip(states.iter_mut()) {
                match guarded(|| self.op.exec_run(input, &tiles.tasks[tile_id], state)) {
                    Ok(out) if out.rank() == input.rank() => local.outputs.push((tile_id, out)),
                    Ok(out) => {
                        let message =
                            format!("tile output has rank {}, the input has rank {}", out.rank(), input.rank());
                        local.error = Some((tile_id, message.into()));
                        break;
                    }
                    Err(failure) => {
                        local.error = Some((tile_id, failure));
                        break;
                    }
                }
            }
            let failed_here = local.error.as_ref().map(|(tile_id, f)| (*tile_id, f.clone()));
            let mut run_timings = PhaseTimings::default();
            let merged = gather_and_merge(self.op, exec, input, tiles, local, &mut run_timings)?;
            gathering += run_timings.gather + run_timings.merge;
            if let Some((tile_id, failure)) = failed_here {
                return Err(abort(failure, Stage::Exec { tile_id }));
            }
            if let (Some(owner), Some(merged)) = (owner.as_mut(), merged) {
                let done = merged.and_then(|frames| hand_on(owner, frames));
                if let Err(err) = done {
                    exec.comm.abort(&format!("rank {rank} failed: {err}"));
                    return Err(err);
                }
            }
            progress::report(Progress::Steps { done: run + 1, total: runs.runs });
        }
        if let Some(owner) = &owner {
            owner.finish().map_err(|e| abort(e.to_string().into(), Stage::Merge))?;
        }
        timings.gather = gathering;
        timings.exec = clock.elapsed().saturating_sub(gathering);
        let work = RankWork {
            tile_count: tiles.tasks.len(),
            tiles: mine.to_vec(),
            workload: assignment.loads.get(rank).copied().unwrap_or(0),
            strategy: StrategyReport::Tile,
        };
        Ok(((), work))
    }

    /// Nothing is left to gather: the owner's outcome is an empty tensor (the frames went to
    /// the sink).
    fn collect(
        &self,
        exec: &DistributedVaeExecutor,
        _: &Tensor,
        _: &Self::Plan,
        (): (),
        _: &mut PhaseTimings,
    ) -> Result<Option<Result<Tensor, RuntimeError>>, RuntimeError> {
        Ok(nothing_left(exec))
    }
}

/// The runs an operator announced, or the failure that it does not stream.
fn streams(runs: Option<StreamRuns>) -> Result<StreamRuns, Failure> {
    runs.ok_or_else(|| Failure::from("this model's output does not stream".to_string()))
}

/// A streamed request's outcome after its computation: nothing is left to gather, and the
/// owner's is an empty tensor (the frames went to the sink).
pub(super) fn nothing_left(exec: &DistributedVaeExecutor) -> Option<Result<Tensor, RuntimeError>> {
    (exec.comm.rank() == OWNER).then(|| Tensor::zeros(vec![0], DType::F32, &Device::Cpu).map_err(Into::into))
}
