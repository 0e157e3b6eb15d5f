//! The tile strategy: a model's [`TileOperator`] split into tiles on every rank, the tiles
//! dealt out by LPT, each executed by one rank exactly as it would be alone, gathered to the
//! owner and merged there in the operator's own order, so the output is bit-identical for any
//! number of ranks. Also [`execute_serial`], the same without a group.

use std::collections::BTreeMap;

use vae_planner::{GridCoord, GridSpec, TileTask, lpt_assign};
use vae_tensor::{DType, Device, Shape, Tensor};
use vae_transport::CommunicatorExt;
use vae_transport::wire::{Reader, Writer};

use super::failure::Failure;
use super::report::{PhaseTimings, StrategyReport};
use super::stitched::{RoundTimes, compute_and_stitch, deal};
use super::{
    DistributedVaeExecutor, OWNER, OperatorError, RankWork, RequestStrategy, TileMerge, guarded, inconsistent,
    read_tensor_header, verdict, write_tensor_header,
};
use crate::progress::{self, Progress};
use crate::shard::StreamRuns;
use crate::stitch::StitchLayout;
use crate::{RuntimeError, Stage};

/// What a split produces: the tasks, and how to merge their outputs.
#[derive(Debug, Clone, PartialEq)]
pub struct TilePlan<P, S> {
    /// The tiles, with dense ids `0..n` in order.
    pub tasks: Vec<TileTask<P>>,
    /// The grid and the merge metadata.
    pub grid: GridSpec<S, DType>,
}

/// A model's tiled computation, split into the three steps the executor distributes.
///
/// `split` runs on every rank and must be deterministic (every rank must produce the same
/// plan from the same input); `exec` runs on the rank a tile is assigned to; `merge` runs on
/// the owner with every tile's output, keyed by grid coordinate.
pub trait TileOperator {
    /// Per-tile input (typically the input ranges of the tile).
    type Payload;
    /// Merge metadata carried in the [`GridSpec`].
    type TileSpec;

    /// Cuts the input into tiles.
    fn split(&self, input: &Tensor) -> Result<TilePlan<Self::Payload, Self::TileSpec>, OperatorError>;
    /// Computes one tile. The output must have the input's rank.
    fn exec(&self, input: &Tensor, task: &TileTask<Self::Payload>) -> Result<Tensor, OperatorError>;
    /// Assembles the output from every tile's output.
    fn merge(&self, tiles: TileMap, grid: &GridSpec<Self::TileSpec, DType>) -> Result<Tensor, OperatorError>;
    /// The device the operator computes on (its model's), whatever the input's: in-process ranks
    /// that share a GPU each get a stream of their own there for the request.
    fn device(&self) -> Device;

    /// The plan's merge as diffusers' 2-D stitch of a [`StitchLayout`] (then
    /// [`finish_stitched`](Self::finish_stitched)), when it is one. The executor then
    /// stitches every tile on the owner as soon as its turn comes and frees it, into an output
    /// allocated once, instead of gathering every tile before one [`merge`](Self::merge): a
    /// rank holds one tile output at a time, and the owner the output and a few tiles. An
    /// operator that says `Some` promises that `merge(tiles, grid)` is
    /// `finish_stitched(stitch(tiles, ..), grid)`, bit for bit. `None`, the default, keeps
    /// the whole-map merge.
    fn stitch_layout<'g>(&self, _grid: &'g GridSpec<Self::TileSpec, DType>) -> Option<&'g StitchLayout> {
        None
    }

    /// What [`merge`](Self::merge) does to the stitched map when
    /// [`stitch_layout`](Self::stitch_layout) says it is a stitch (a clamp, an unpatchify);
    /// the default returns it as it is.
    fn finish_stitched(
        &self,
        stitched: Tensor,
        _grid: &GridSpec<Self::TileSpec, DType>,
    ) -> Result<Tensor, OperatorError> {
        Ok(stitched)
    }

    /// For a streamed computation: how many runs of frames every tile makes for `input`, and
    /// the output frames they make in all (after `merge`). `None`, the default, for an
    /// operator that does not stream.
    fn stream_runs(&self, _input: &Tensor) -> Option<StreamRuns> {
        None
    }

    /// Starts one tile of a streamed computation: its state (a causal decoder's cache) for
    /// [`exec_run`](Self::exec_run).
    fn start_tile(&self, _input: &Tensor, _task: &TileTask<Self::Payload>) -> Result<TileStream, OperatorError> {
        Err("this operator does not stream its output".into())
    }

    /// The tile's next run of output frames, on the host: the runs of a tile, concatenated
    /// along the frame axis, are its [`exec`](Self::exec) output. [`merge`](Self::merge)
    /// merges one run of every tile as it merges whole tiles.
    fn exec_run(
        &self,
        _input: &Tensor,
        _task: &TileTask<Self::Payload>,
        _state: &mut TileStream,
    ) -> Result<Tensor, OperatorError> {
        Err("this operator does not stream its output".into())
    }
}

/// The state of one tile of a streamed computation, the operator's own (a causal decoder's
/// cache, the frame it is at), carried by the executor from run to run.
pub type TileStream = Box<dyn std::any::Any + Send>;

/// Tile outputs by grid coordinate, handed to [`TileOperator::merge`].
#[derive(Debug, Default)]
pub struct TileMap {
    tiles: BTreeMap<GridCoord, Tensor>,
}

impl TileMap {
    /// An empty map.
    pub fn new() -> Self {
        Self::default()
    }

    /// Inserts a tile output; returns the previous one at that coordinate, if any.
    pub fn insert(&mut self, coord: GridCoord, tile: Tensor) -> Option<Tensor> {
        self.tiles.insert(coord, tile)
    }

    /// The tile output at `coord`.
    pub fn get(&self, coord: &[usize]) -> Option<&Tensor> {
        self.tiles.get(coord)
    }

    /// Removes and returns the tile output at `coord`.
    pub fn take(&mut self, coord: &[usize]) -> Option<Tensor> {
        self.tiles.remove(coord)
    }

    /// Number of tiles.
    pub fn len(&self) -> usize {
        self.tiles.len()
    }

    /// Whether there are no tiles.
    pub fn is_empty(&self) -> bool {
        self.tiles.is_empty()
    }

    /// Tiles in grid order.
    pub fn iter(&self) -> impl Iterator<Item = (&GridCoord, &Tensor)> {
        self.tiles.iter()
    }
}

/// The tile strategy of one request.
pub(super) struct TileStrategy<'o, O> {
    pub(super) op: &'o O,
}

/// What a rank holds after computing its tiles: the tiles, for the whole-map merge, or (tiles
/// stitched as they came) the owner's outcome.
pub(super) enum TileLocal {
    Held(TileOutputs),
    Stitched(Option<Result<Tensor, RuntimeError>>),
}

/// This rank's tiles: the outputs it computed, or the first tile that failed and why.
pub(super) struct TileOutputs {
    pub(super) outputs: Vec<(usize, Tensor)>,
    pub(super) error: Option<(usize, Failure)>,
}

impl<O: TileOperator> RequestStrategy for TileStrategy<'_, O> {
    type Plan = TilePlan<O::Payload, O::TileSpec>;
    type Local = TileLocal;

    fn plan(&self, _: &DistributedVaeExecutor, input: &Tensor) -> Result<Self::Plan, Failure> {
        guarded(|| self.op.split(input)).and_then(|plan| {
            plan.grid.validate_tasks(&plan.tasks).map_err(|e| e.to_string())?;
            Ok(plan)
        })
    }

    fn plan_size(plan: &Self::Plan) -> usize {
        plan.tasks.len()
    }

    fn disagreement(sizes: &[usize]) -> Option<String> {
        let (r, n) = sizes.iter().enumerate().find(|(_, n)| **n != sizes[0])?;
        Some(format!("the split is not deterministic: rank {r} made {n} tiles, rank 0 made {}", sizes[0]))
    }

    fn choice(&self, exec: &DistributedVaeExecutor) -> u8 {
        u8::from(self.merge(exec) == TileMerge::Edges)
    }

    /// Assigns (identical on every rank, no communication) and executes this rank's tiles; a
    /// failing tile stops the others and is told to every rank in [`Self::collect`]. A plan
    /// that is a stitch is gathered and merged here too, round by round
    /// ([`compute_and_stitch`]).
    fn compute(
        &self,
        exec: &DistributedVaeExecutor,
        input: &Tensor,
        plan: &Self::Plan,
        timings: &mut PhaseTimings,
    ) -> Result<(TileLocal, RankWork), RuntimeError> {
        let clock = std::time::Instant::now();
        let rank = exec.comm.rank();
        let workloads: Vec<u64> = plan.tasks.iter().map(|t| t.workload).collect();
        let layout = self.op.stitch_layout(&plan.grid);
        let (assignment, rounds) = match layout {
            Some(layout) => {
                let (assignment, rounds) = deal(plan, layout, self.merge(exec), &workloads, exec.parallel_size)?;
                (assignment, Some(rounds))
            }
            None => (lpt_assign(&workloads, exec.parallel_size)?, None),
        };
        let mine: &[usize] = assignment.per_rank.get(rank).map_or(&[], Vec::as_slice);
        let work = RankWork {
            tile_count: plan.tasks.len(),
            tiles: mine.to_vec(),
            workload: assignment.loads.get(rank).copied().unwrap_or(0),
            strategy: StrategyReport::Tile,
        };
        if let Some(rounds) = rounds {
            let mut times = RoundTimes::default();
            let outcome = compute_and_stitch(self.op, exec, input, plan, rounds, &assignment, &mut times)?;
            (timings.exec, timings.halo, timings.gather, timings.merge) =
                (times.exec, times.edges, times.gather, times.merge);
            tracing::debug!(rank, tiles = ?mine, elapsed = ?clock.elapsed(), "executed and stitched tiles");
            return Ok((TileLocal::Stitched(outcome), work));
        }
        let mut local = TileOutputs { outputs: Vec::with_capacity(mine.len()), error: None };
        progress::report(Progress::Tiles { done: 0, total: mine.len() });
        for &tile_id in mine {
            // A failed group stops this rank between tiles, not after its last.
            crate::cancel::check()?;
            match exec_tile(self.op, input, &plan.tasks[tile_id]) {
                Ok(out) => {
                    local.outputs.push((tile_id, out));
                    progress::report(Progress::Tiles { done: local.outputs.len(), total: mine.len() });
                }
                Err(failure) => {
                    local.error = Some((tile_id, failure));
                    break;
                }
            }
        }
        timings.exec = clock.elapsed();
        tracing::debug!(rank, tiles = ?mine, elapsed = ?timings.exec, "executed tiles");
        Ok((TileLocal::Held(local), work))
    }

    /// Sends the owner what this rank produced (or why it failed) and its tiles' bytes, in one
    /// gather; the owner checks that every tile came back once and merges. Its outcome, an
    /// exec failure on any rank included, reaches every rank in the request's broadcast.
    fn collect(
        &self,
        exec: &DistributedVaeExecutor,
        input: &Tensor,
        plan: &Self::Plan,
        local: TileLocal,
        timings: &mut PhaseTimings,
    ) -> Result<Option<Result<Tensor, RuntimeError>>, RuntimeError> {
        match local {
            TileLocal::Held(local) => gather_and_merge(self.op, exec, input, plan, local, timings),
            TileLocal::Stitched(outcome) => Ok(outcome),
        }
    }
}

impl<O: TileOperator> TileStrategy<'_, O> {
    /// The merge this rank runs stitched tiles with: the executor's, but the owner merge for an
    /// operator on a GPU (the merge by edges blends on the host and has not run on a GPU).
    fn merge(&self, exec: &DistributedVaeExecutor) -> TileMerge {
        if self.op.device().is_cpu() {
            exec.tile_merge
        } else {
            if exec.tile_merge == TileMerge::Edges && exec.comm.rank() == OWNER {
                tracing::info!("stitched tiles on a GPU are merged on the owner, not by edges");
            }
            TileMerge::Owner
        }
    }
}

/// Computes one tile, its errors and panics caught; an output of another rank than the input's
/// is a failure too.
pub(super) fn exec_tile<O: TileOperator>(
    op: &O,
    input: &Tensor,
    task: &TileTask<O::Payload>,
) -> Result<Tensor, Failure> {
    let out = guarded(|| op.exec(input, task))?;
    if out.rank() != input.rank() {
        let message =
            format!("tile output has rank {} ({}), the input has rank {}", out.rank(), out.shape(), input.rank());
        return Err(message.into());
    }
    Ok(out)
}

/// [`TileStrategy::collect`]: one gather of every rank's tile summary and bytes to the owner,
/// which checks that every tile came back once and merges (also each run of a streamed tile
/// decode).
pub(super) fn gather_and_merge<O: TileOperator>(
    op: &O,
    exec: &DistributedVaeExecutor,
    input: &Tensor,
    plan: &TilePlan<O::Payload, O::TileSpec>,
    local: TileOutputs,
    timings: &mut PhaseTimings,
) -> Result<Option<Result<Tensor, RuntimeError>>, RuntimeError> {
    let comm = exec.comm.as_ref();
    let clock = std::time::Instant::now();
    let message = summary_message(&local, comm.rank())?;
    let mut outputs = local.outputs;
    if comm.rank() != OWNER {
        outputs.clear();
    }
    let gathered = comm.gather(OWNER, message.as_slice())?;
    drop(message);
    timings.gather = clock.elapsed();

    let clock = std::time::Instant::now();
    let merged = gathered.map(|parts| {
        let (produced, payloads) = read_summaries(parts.parts())?;
        check_every_tile_once(&produced, plan.tasks.len())?;
        assemble(plan, &produced, &payloads, outputs, &input.device())
            .map_err(Failure::from)
            .and_then(|tiles| guarded(|| op.merge(tiles, &plan.grid)))
            .and_then(|out| cast_output(out, plan.grid.output_dtype).map_err(Failure::from))
            .map_err(|failure| failure.at(Stage::Merge, OWNER))
    });
    timings.merge = clock.elapsed();
    Ok(merged)
}

/// What `rank` tells the owner about its tiles: the first that failed and why, or their ids,
/// types and shapes, followed by their bytes (but for the owner, which keeps its own tiles).
pub(super) fn summary_message(local: &TileOutputs, rank: usize) -> Result<Writer, RuntimeError> {
    let mut message = Writer::new();
    match &local.error {
        Some((tile_id, failure)) => {
            verdict::write_kind(message.u8(1).usize(*tile_id), failure.kind).str(&failure.message);
        }
        None => {
            message.u8(0).usize(local.outputs.len());
            for (tile_id, out) in &local.outputs {
                write_tensor_header(message.usize(*tile_id), out.dtype(), out.dims());
            }
            if rank != OWNER {
                for (_, out) in &local.outputs {
                    message.bytes(out.as_bytes()?);
                }
            }
        }
    }
    Ok(message)
}

/// Every rank's tile summary (the owner's included) and the tile bytes that follow it, in rank
/// order; the first rank that failed a tile makes the request fail with its error.
fn read_summaries<'a>(parts: impl Iterator<Item = &'a [u8]>) -> Result<(Vec<Produced>, Vec<&'a [u8]>), RuntimeError> {
    let mut produced = Vec::new();
    let mut payloads = Vec::new();
    let mut first_exec_error = None;
    for (r, part) in parts.enumerate() {
        let (summary, payload) = decode_summary(r, part).map_err(inconsistent)?;
        match summary {
            Err((tile_id, failure)) => {
                first_exec_error.get_or_insert(failure.at(Stage::Exec { tile_id }, r));
                produced.push(Vec::new());
            }
            Ok(tiles) => produced.push(tiles),
        }
        payloads.push(payload);
    }
    match first_exec_error {
        Some(err) => Err(err),
        None => Ok((produced, payloads)),
    }
}

/// The tiles a rank produced: their ids, dtypes and shapes.
pub(super) type Produced = Vec<(usize, DType, Shape)>;

/// A rank's tile summary: the tiles it produced, or the exec error it hit.
pub(super) type Summary = Result<Produced, (usize, Failure)>;

/// Reads a rank's summary; returns it with the bytes after it (its tiles' bytes).
pub(super) fn decode_summary(rank: usize, bytes: &[u8]) -> Result<(Summary, &[u8]), RuntimeError> {
    let mut rd = Reader::new(bytes, "tile summary");
    if rd.u8()? == 1 {
        let tile_id = rd.usize()?;
        let kind = verdict::read_kind(&mut rd)?;
        let failure = Failure::new(kind, rd.str()?);
        return Ok((Err((tile_id, failure)), rd.rest()));
    }
    let count = rd.usize()?;
    let mut tiles = Vec::with_capacity(count.min(bytes.len()));
    for _ in 0..count {
        let tile_id = rd.usize()?;
        let (dtype, dims) = read_tensor_header(&mut rd).map_err(|e| match e {
            RuntimeError::Protocol(m) => RuntimeError::Protocol(format!("rank {rank}: {m}")),
            other => other,
        })?;
        let shape = Shape::new(dims);
        if shape.checked_elem_count().and_then(|n| n.checked_mul(dtype.size_in_bytes())).is_none() {
            return Err(RuntimeError::Protocol(format!("rank {rank} reported an impossible tile shape {shape}")));
        }
        tiles.push((tile_id, dtype, shape));
    }
    Ok((Ok(tiles), rd.rest()))
}

/// Runs an operator without a group: split, execute every tile in order, merge (the ops still
/// use the rayon pool). The same result [`Job::tiles`](super::Job::tiles) returns on any
/// number of ranks, without a communicator (what a single-device caller, or a reference,
/// needs).
pub fn execute_serial<O: TileOperator>(op: &O, input: &Tensor) -> Result<Tensor, RuntimeError> {
    let plan = guarded(|| op.split(input)).map_err(|f| f.at(Stage::Split, 0))?;
    plan.grid.validate_tasks(&plan.tasks)?;
    let mut tiles = TileMap::new();
    progress::report(Progress::Tiles { done: 0, total: plan.tasks.len() });
    for task in &plan.tasks {
        let stage = Stage::Exec { tile_id: task.tile_id };
        let out = guarded(|| op.exec(input, task)).map_err(|f| f.at(stage, 0))?;
        if out.rank() != input.rank() {
            let message =
                format!("tile output has rank {} ({}), the input has rank {}", out.rank(), out.shape(), input.rank());
            return Err(Failure::from(message).at(stage, 0));
        }
        tiles.insert(task.grid_coord.clone(), out);
        progress::report(Progress::Tiles { done: tiles.len(), total: plan.tasks.len() });
    }
    guarded(|| op.merge(tiles, &plan.grid))
        .and_then(|out| cast_output(out, plan.grid.output_dtype).map_err(Failure::from))
        .map_err(|f| f.at(Stage::Merge, 0))
}

/// Every planned tile must come back exactly once.
fn check_every_tile_once(produced: &[Produced], count: usize) -> Result<(), RuntimeError> {
    let mut seen = vec![false; count];
    for (r, tiles) in produced.iter().enumerate() {
        for (tile_id, _, _) in tiles {
            match seen.get_mut(*tile_id) {
                Some(s) if !*s => *s = true,
                Some(_) => {
                    return Err(RuntimeError::Inconsistent(format!("tile {tile_id} came back twice (rank {r})")));
                }
                None => return Err(RuntimeError::Inconsistent(format!("rank {r} returned unknown tile {tile_id}"))),
            }
        }
    }
    match seen.iter().position(|s| !s) {
        Some(missing) => Err(RuntimeError::Inconsistent(format!("tile {missing} was not executed by any rank"))),
        None => Ok(()),
    }
}

/// Rebuilds the owner's map of tile outputs from its own tensors and the gathered bytes.
fn assemble<P, S>(
    plan: &TilePlan<P, S>,
    produced: &[Produced],
    parts: &[&[u8]],
    own: Vec<(usize, Tensor)>,
    device: &Device,
) -> Result<TileMap, String> {
    let mut map = TileMap::new();
    for (tile_id, out) in own {
        map.insert(plan.tasks[tile_id].grid_coord.clone(), out);
    }
    for (r, tiles) in produced.iter().enumerate() {
        if r == OWNER {
            continue;
        }
        let mut at = 0usize;
        for (tile_id, dtype, shape) in tiles {
            // Shapes were checked for overflow when the summaries were decoded.
            let len = shape.elem_count() * dtype.size_in_bytes();
            let end = at.checked_add(len).ok_or_else(|| format!("rank {r}'s tiles overflow"))?;
            let bytes = parts[r].get(at..end).ok_or_else(|| format!("rank {r} sent too few bytes"))?;
            at = end;
            let tensor = Tensor::from_bytes(*dtype, shape.clone(), bytes, device).map_err(|e| e.to_string())?;
            map.insert(plan.tasks[*tile_id].grid_coord.clone(), tensor);
        }
        if at != parts[r].len() {
            return Err(format!("rank {r} sent {} bytes, its tiles need {at}", parts[r].len()));
        }
    }
    Ok(map)
}

pub(super) fn cast_output(out: Tensor, dtype: Option<DType>) -> Result<Tensor, String> {
    match dtype {
        Some(d) if d != out.dtype() => {
            Err(format!("merged output is {}, the plan asks for {d}; casting is not supported yet", out.dtype()))
        }
        _ => Ok(out),
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::decode_summary;

    proptest! {
        /// A tile summary from another rank is decoded or refused, never trusted into a panic or
        /// an allocation its bytes do not back.
        #[test]
        fn fuzz_tile_summaries(bytes in prop::collection::vec(any::<u8>(), 0..200), rank in 0usize..4) {
            let _ = decode_summary(rank, &bytes);
            let mut headed = vec![0u8];
            headed.extend_from_slice(&bytes);
            let _ = decode_summary(rank, &headed);
        }
    }
}
