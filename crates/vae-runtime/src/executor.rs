//! The model-agnostic tile executor (tile mode of the specification).

use std::collections::BTreeMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vae_planner::{GridCoord, GridSpec, TileTask, lpt_assign};
use vae_tensor::{DType, Device, Shape, Tensor};
use vae_transport::{CommStats, Communicator, CommunicatorExt};

use crate::codec::{Reader, Writer};
use crate::{RuntimeError, Stage};

/// Errors a model operator returns; carried to every rank as text.
pub type OperatorError = Box<dyn std::error::Error + Send + Sync + 'static>;

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
}

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

    /// Adds a tile output; returns the previous one at that coordinate, if any.
    pub fn insert(&mut self, coord: GridCoord, tile: Tensor) -> Option<Tensor> {
        self.tiles.insert(coord, tile)
    }

    /// The output at `coord`.
    pub fn get(&self, coord: &[usize]) -> Option<&Tensor> {
        self.tiles.get(coord)
    }

    /// Removes and returns the output at `coord`.
    pub fn take(&mut self, coord: &[usize]) -> Option<Tensor> {
        self.tiles.remove(coord)
    }

    /// Number of tiles.
    pub fn len(&self) -> usize {
        self.tiles.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.tiles.is_empty()
    }

    /// Coordinates and outputs in row-major coordinate order.
    pub fn iter(&self) -> impl Iterator<Item = (&GridCoord, &Tensor)> {
        self.tiles.iter()
    }
}

/// Which ranks receive the merged output (a per-model contract: e.g. AutoencoderKL and Wan
/// decode to the owner only, Qwen-Image and FLUX.2 decode to all ranks, encoders to all).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputPlacement {
    /// Only the owner (rank 0) gets the tensor; the others get `None`.
    OwnerOnly,
    /// The owner broadcasts the tensor to every rank.
    AllRanks,
}

/// Time spent in each phase of one request on one rank.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PhaseTimings {
    /// Splitting the input.
    pub split: Duration,
    /// Agreeing on the input (hash exchange).
    pub agree: Duration,
    /// Executing this rank's tiles.
    pub exec: Duration,
    /// Exchanging tile shapes and gathering tiles to the owner.
    pub gather: Duration,
    /// Merging (owner only).
    pub merge: Duration,
    /// Final status / output broadcast.
    pub broadcast: Duration,
}

impl PhaseTimings {
    /// Sum of all phases.
    pub fn total(&self) -> Duration {
        self.split + self.agree + self.exec + self.gather + self.merge + self.broadcast
    }
}

/// What one rank did for one request.
#[derive(Debug, Clone, PartialEq)]
pub struct RankReport {
    /// This rank.
    pub rank: usize,
    /// Ranks in the group.
    pub world_size: usize,
    /// Ranks that executed tiles (`min(requested, world)`).
    pub parallel_size: usize,
    /// Tiles in the plan.
    pub tile_count: usize,
    /// The tiles this rank executed, in execution order.
    pub tiles: Vec<usize>,
    /// Sum of their workloads.
    pub workload: u64,
    /// True on the rank that merged.
    pub is_owner: bool,
    /// Time per phase.
    pub timings: PhaseTimings,
    /// Traffic of this request.
    pub traffic: CommStats,
    /// High-water mark of this rank's tensor memory during the request, in bytes (the
    /// allocation accounting of `vae_tensor::memory`; includes tensors alive before it).
    pub peak_bytes: usize,
}

/// A request's result on one rank.
#[derive(Debug)]
pub struct ExecOutput {
    /// The merged output, on the ranks the placement gives it to.
    pub tensor: Option<Tensor>,
    /// What this rank did.
    pub report: RankReport,
}

/// The rank that merges and owns the output.
const OWNER: usize = 0;

/// Runs [`TileOperator`]s over the ranks of a communicator.
///
/// Every rank of the group calls [`execute`](Self::execute) with the same input and operator.
/// Ranks beyond the parallel size (or without tiles) join every collective and get `None` or
/// the broadcast output. The output is bit-identical to what one rank computes alone, for any
/// number of ranks, because tiles are computed exactly as alone and merged by one rank in the
/// operator's own order. Holds no per-request state.
pub struct DistributedVaeExecutor {
    comm: Arc<dyn Communicator>,
    requested: usize,
    parallel_size: usize,
}

impl std::fmt::Debug for DistributedVaeExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DistributedVaeExecutor")
            .field("rank", &self.comm.rank())
            .field("world_size", &self.comm.size())
            .field("requested", &self.requested)
            .field("parallel_size", &self.parallel_size)
            .finish()
    }
}

impl DistributedVaeExecutor {
    /// An executor over `comm` that spreads tiles over `parallel_size` ranks. A size larger
    /// than the group is clamped to the group, with one warning here rather than one per call.
    pub fn new(comm: Arc<dyn Communicator>, parallel_size: usize) -> Result<Self, RuntimeError> {
        if parallel_size == 0 {
            return Err(RuntimeError::Config("parallel size must be at least 1".into()));
        }
        let world = comm.size();
        let effective = parallel_size.min(world);
        if effective < parallel_size && comm.rank() == OWNER {
            tracing::warn!(
                requested = parallel_size,
                group = world,
                "VAE parallel size {parallel_size} is larger than the group of {world} ranks; using {world}"
            );
        }
        Ok(Self { comm, requested: parallel_size, parallel_size: effective })
    }

    /// The effective parallel size.
    pub fn parallel_size(&self) -> usize {
        self.parallel_size
    }

    /// The communicator.
    pub fn communicator(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }

    /// Runs one request: split on every rank, check the ranks hold the same input, assign
    /// tiles (LPT), execute, gather to the owner, merge there, and give the output to the
    /// ranks `placement` names. An error on any rank becomes an error on every rank.
    pub fn execute<O: TileOperator>(
        &self,
        input: &Tensor,
        op: &O,
        placement: OutputPlacement,
    ) -> Result<ExecOutput, RuntimeError> {
        let result = self.run(input, op, placement);
        if let Err(err) = &result {
            // Agreed errors are known everywhere and transport errors have already been
            // propagated; anything else happened here alone and the others must not wait.
            if !err.is_agreed() && !matches!(err, RuntimeError::Transport(_)) {
                self.comm.abort(&format!("rank {} failed: {err}", self.comm.rank()));
            }
        }
        result
    }

    fn run<O: TileOperator>(
        &self,
        input: &Tensor,
        op: &O,
        placement: OutputPlacement,
    ) -> Result<ExecOutput, RuntimeError> {
        let comm = self.comm.as_ref();
        let (rank, world) = (comm.rank(), comm.size());
        let traffic_before = comm.stats();
        vae_tensor::memory::reset_peak();
        let mut timings = PhaseTimings::default();

        // 1. Split, on every rank.
        let clock = Instant::now();
        let split = guarded(|| op.split(input)).and_then(|plan| {
            plan.grid.validate_tasks(&plan.tasks).map_err(|e| e.to_string())?;
            Ok(plan)
        });
        timings.split = clock.elapsed();

        // 2. Agree: same input everywhere, and the split worked everywhere.
        let clock = Instant::now();
        let hash = input.content_hash()?;
        let mut msg = Writer::default();
        msg.u64(hash);
        match &split {
            Ok(plan) => msg.u8(0).usize(plan.tasks.len()),
            Err(message) => msg.u8(1).str(message),
        };
        let gathered = comm.all_gather(&msg.0)?;
        let mut hashes = Vec::with_capacity(world);
        let mut tile_counts = Vec::with_capacity(world);
        let mut first_split_error = None;
        for (r, part) in gathered.parts().enumerate() {
            let mut rd = Reader::new(part, "input agreement");
            hashes.push(rd.u64().map_err(inconsistent)?);
            if rd.u8().map_err(inconsistent)? == 1 {
                let message = rd.str().map_err(inconsistent)?;
                first_split_error.get_or_insert(RuntimeError::Operator { stage: Stage::Split, rank: r, message });
            } else {
                tile_counts.push((r, rd.usize().map_err(inconsistent)?));
            }
        }
        timings.agree = clock.elapsed();
        if hashes.iter().any(|h| *h != hashes[0]) {
            return Err(RuntimeError::InputMismatch { hashes });
        }
        if let Some(err) = first_split_error {
            return Err(err);
        }
        if let Some((r, n)) = tile_counts.iter().find(|(_, n)| *n != tile_counts[0].1) {
            return Err(RuntimeError::Inconsistent(format!(
                "the split is not deterministic: rank {r} made {n} tiles, rank {} made {}",
                tile_counts[0].0, tile_counts[0].1
            )));
        }
        let plan = split.expect("split errors returned above");

        // 3. Assign (identical on every rank, no communication) and execute.
        let clock = Instant::now();
        let workloads: Vec<u64> = plan.tasks.iter().map(|t| t.workload).collect();
        let assignment = lpt_assign(&workloads, self.parallel_size)?;
        let mine: &[usize] = assignment.per_rank.get(rank).map_or(&[], Vec::as_slice);
        let mut outputs: Vec<(usize, Tensor)> = Vec::with_capacity(mine.len());
        let mut exec_error = None;
        for &tile_id in mine {
            let task = &plan.tasks[tile_id];
            match guarded(|| op.exec(input, task)) {
                Ok(out) if out.rank() == input.rank() => outputs.push((tile_id, out)),
                Ok(out) => {
                    exec_error = Some((
                        tile_id,
                        format!(
                            "tile output has rank {} ({}), the input has rank {}",
                            out.rank(),
                            out.shape(),
                            input.rank()
                        ),
                    ));
                    break;
                }
                Err(message) => {
                    exec_error = Some((tile_id, message));
                    break;
                }
            }
        }
        timings.exec = clock.elapsed();
        tracing::debug!(rank, tiles = ?mine, elapsed = ?timings.exec, "executed tiles");

        // 4. Tell everyone what this rank produced (or why it failed), then gather to the owner.
        let clock = Instant::now();
        let mut summary = Writer::default();
        match &exec_error {
            Some((tile_id, message)) => summary.u8(1).usize(*tile_id).str(message),
            None => {
                summary.u8(0).usize(outputs.len());
                for (tile_id, out) in &outputs {
                    summary.usize(*tile_id).u8(out.dtype().code()).usize(out.rank());
                    for d in out.dims() {
                        summary.usize(*d);
                    }
                }
                &mut summary
            }
        };
        let summaries = comm.all_gather(&summary.0)?;
        let mut produced: Vec<Vec<(usize, DType, Shape)>> = Vec::with_capacity(world);
        let mut first_exec_error = None;
        for (r, part) in summaries.parts().enumerate() {
            match decode_summary(r, part).map_err(inconsistent)? {
                Err((tile_id, message)) => {
                    first_exec_error.get_or_insert(RuntimeError::Operator {
                        stage: Stage::Exec { tile_id },
                        rank: r,
                        message,
                    });
                    produced.push(Vec::new());
                }
                Ok(tiles) => produced.push(tiles),
            }
        }
        if let Some(err) = first_exec_error {
            return Err(err);
        }
        check_every_tile_once(&produced, plan.tasks.len())?;

        // The owner keeps its own tiles as they are; the others send theirs as bytes.
        let mut payload = Vec::new();
        if rank != OWNER {
            for (_, out) in &outputs {
                payload.extend_from_slice(out.as_bytes()?);
            }
            outputs.clear();
        }
        let gathered = comm.gather(OWNER, &payload)?;
        drop(payload);
        timings.gather = clock.elapsed();

        // 5. Merge on the owner; whatever happens there is reported to every rank.
        let clock = Instant::now();
        let merged = gathered.map(|parts| {
            assemble(&plan, &produced, &parts.parts().collect::<Vec<_>>(), outputs, &input.device())
                .and_then(|tiles| guarded(|| op.merge(tiles, &plan.grid)))
                .and_then(|out| cast_output(out, plan.grid.output_dtype))
        });
        timings.merge = clock.elapsed();

        // 6. One broadcast: the merge status, plus the output when every rank needs it.
        let clock = Instant::now();
        let tensor = self.publish(merged, placement)?;
        timings.broadcast = clock.elapsed();

        let report = RankReport {
            rank,
            world_size: world,
            parallel_size: self.parallel_size,
            tile_count: plan.tasks.len(),
            tiles: mine.to_vec(),
            workload: assignment.loads.get(rank).copied().unwrap_or(0),
            is_owner: rank == OWNER,
            timings,
            traffic: comm.stats().since(&traffic_before),
            peak_bytes: vae_tensor::memory::peak_bytes(),
        };
        Ok(ExecOutput { tensor, report })
    }

    /// Broadcasts the owner's merge outcome (and the output, for [`OutputPlacement::AllRanks`]).
    fn publish(
        &self,
        merged: Option<Result<Tensor, String>>,
        placement: OutputPlacement,
    ) -> Result<Option<Tensor>, RuntimeError> {
        let comm = self.comm.as_ref();
        let mut message = Writer::default();
        if let Some(outcome) = &merged {
            match outcome {
                Err(reason) => {
                    message.u8(1).str(reason);
                }
                Ok(out) => {
                    message.u8(0);
                    if placement == OutputPlacement::AllRanks {
                        message.u8(out.dtype().code()).usize(out.rank());
                        for d in out.dims() {
                            message.usize(*d);
                        }
                        message.0.extend_from_slice(out.as_bytes()?);
                    }
                }
            }
        }
        let mut bytes = message.0;
        comm.broadcast(OWNER, &mut bytes)?;
        match merged {
            Some(Ok(out)) => Ok(Some(out)),
            Some(Err(message)) => Err(RuntimeError::Operator { stage: Stage::Merge, rank: OWNER, message }),
            None => {
                let mut rd = Reader::new(&bytes, "merge status");
                if rd.u8()? == 1 {
                    return Err(RuntimeError::Operator { stage: Stage::Merge, rank: OWNER, message: rd.str()? });
                }
                if placement == OutputPlacement::OwnerOnly {
                    return Ok(None);
                }
                let dtype =
                    DType::from_code(rd.u8()?).ok_or_else(|| RuntimeError::Protocol("unknown output dtype".into()))?;
                let ndim = rd.usize()?;
                let dims = (0..ndim).map(|_| rd.usize()).collect::<Result<Vec<_>, _>>()?;
                Ok(Some(Tensor::from_bytes(dtype, dims, rd.rest(), &Device::Cpu)?))
            }
        }
    }
}

/// A rank's tile summary: its tiles' ids, dtypes and shapes, or the exec error it hit.
type Summary = Result<Vec<(usize, DType, Shape)>, (usize, String)>;

fn decode_summary(rank: usize, bytes: &[u8]) -> Result<Summary, RuntimeError> {
    let mut rd = Reader::new(bytes, "tile summary");
    if rd.u8()? == 1 {
        let tile_id = rd.usize()?;
        return Ok(Err((tile_id, rd.str()?)));
    }
    let count = rd.usize()?;
    let mut tiles = Vec::with_capacity(count.min(bytes.len()));
    for _ in 0..count {
        let tile_id = rd.usize()?;
        let dtype = DType::from_code(rd.u8()?)
            .ok_or_else(|| RuntimeError::Protocol(format!("rank {rank} sent an unknown dtype")))?;
        let ndim = rd.usize()?;
        let dims = (0..ndim).map(|_| rd.usize()).collect::<Result<Vec<_>, _>>()?;
        let shape = Shape::new(dims);
        if shape.checked_elem_count().and_then(|n| n.checked_mul(dtype.size_in_bytes())).is_none() {
            return Err(RuntimeError::Protocol(format!("rank {rank} reported an impossible tile shape {shape}")));
        }
        tiles.push((tile_id, dtype, shape));
    }
    Ok(Ok(tiles))
}

/// Problems found in data that every rank gathered are found by every rank alike.
fn inconsistent(err: RuntimeError) -> RuntimeError {
    match err {
        RuntimeError::Protocol(msg) => RuntimeError::Inconsistent(msg),
        other => other,
    }
}

/// Runs an operator without a group: split, execute every tile in order, merge (the ops still
/// use the rayon pool). The same result [`DistributedVaeExecutor::execute`] returns on any
/// number of ranks, without a communicator (what a single-device caller, or a reference,
/// needs).
pub fn execute_serial<O: TileOperator>(op: &O, input: &Tensor) -> Result<Tensor, RuntimeError> {
    let failed = |stage, message| RuntimeError::Operator { stage, rank: 0, message };
    let plan = guarded(|| op.split(input)).map_err(|m| failed(Stage::Split, m))?;
    plan.grid.validate_tasks(&plan.tasks)?;
    let mut tiles = TileMap::new();
    for task in &plan.tasks {
        let stage = Stage::Exec { tile_id: task.tile_id };
        let out = guarded(|| op.exec(input, task)).map_err(|m| failed(stage, m))?;
        if out.rank() != input.rank() {
            let message =
                format!("tile output has rank {} ({}), the input has rank {}", out.rank(), out.shape(), input.rank());
            return Err(failed(stage, message));
        }
        tiles.insert(task.grid_coord.clone(), out);
    }
    guarded(|| op.merge(tiles, &plan.grid))
        .and_then(|out| cast_output(out, plan.grid.output_dtype))
        .map_err(|m| failed(Stage::Merge, m))
}

/// Every planned tile must come back exactly once.
fn check_every_tile_once(produced: &[Vec<(usize, DType, Shape)>], count: usize) -> Result<(), RuntimeError> {
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
    produced: &[Vec<(usize, DType, Shape)>],
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

fn cast_output(out: Tensor, dtype: Option<DType>) -> Result<Tensor, String> {
    match dtype {
        Some(d) if d != out.dtype() => {
            Err(format!("merged output is {}, the plan asks for {d}; casting is not supported yet", out.dtype()))
        }
        _ => Ok(out),
    }
}

/// Runs operator code, turning errors and panics into text with the error's causes.
fn guarded<T>(body: impl FnOnce() -> Result<T, OperatorError>) -> Result<T, String> {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => {
            let mut text = e.to_string();
            let mut source = e.source();
            while let Some(s) = source {
                text.push_str(": ");
                text.push_str(&s.to_string());
                source = s.source();
            }
            Err(text)
        }
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| (*s).to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "non-string panic payload".into());
            Err(format!("panicked: {what}"))
        }
    }
}
