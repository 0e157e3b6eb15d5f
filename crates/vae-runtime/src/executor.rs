//! The model-agnostic tile executor (tile mode of the specification).

use std::collections::BTreeMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::ops::Range;

use vae_planner::{BandPartition, GridCoord, GridSpec, ShardAxis, TileTask, lpt_assign};
use vae_tensor::{DType, Device, Shape, StreamScope, Tensor};
use vae_transport::{CommStats, Communicator, CommunicatorExt};

use crate::codec::{Reader, Writer};
use crate::progress::{self, Progress};
use crate::shard::{ShardContext, ShardOperator, ShardTraffic};
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
    /// The device the operator computes on (its model's), whatever the input's: in-process ranks
    /// that share a GPU each get a stream of their own there for the request.
    fn device(&self) -> Device;
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
    /// Computing: this rank's tiles, or its band of a shard computation (without the
    /// communication inside it, which is [`Self::halo`]).
    pub exec: Duration,
    /// Shard mode: communication inside the computation (halo exchanges and full-map gathers).
    pub halo: Duration,
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
        self.split + self.agree + self.exec + self.halo + self.gather + self.merge + self.broadcast
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
    /// The same high-water mark at the end of the computation, before outputs are gathered
    /// (the activation peak: it excludes the assembled output the owner holds afterwards).
    pub exec_peak_bytes: usize,
    /// High-water mark of this rank's device (CUDA) tensor memory during the request, in bytes
    /// (0 when it computes on the CPU; includes weights and tensors alive before it).
    pub device_peak_bytes: usize,
    /// How the request was computed.
    pub strategy: StrategyReport,
    /// Why that strategy: the model policy's choice or fallback (set by the caller that chose).
    pub reason: Option<String>,
}

/// How a request was computed, for the report.
#[derive(Debug, Clone, PartialEq)]
pub enum StrategyReport {
    /// Tile-parallel (a request below the tile size is one direct tile).
    Tile,
    /// Spatial shard.
    Shard {
        /// The split axis.
        axis: ShardAxis,
        /// This rank's rows of the input (`None` on ranks beyond the parallel size).
        band: Option<Range<usize>>,
        /// Communication inside the computation.
        traffic: ShardTraffic,
    },
}

impl StrategyReport {
    /// "tile", "shard-height" or "shard-width".
    pub fn label(&self) -> String {
        match self {
            Self::Tile => "tile".into(),
            Self::Shard { axis, .. } => format!("shard-{axis}"),
        }
    }
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
        self.abort_unless_known(self.run(input, op, placement))
    }

    /// Agreed errors are known everywhere and transport errors have already been propagated;
    /// any other error happened on this rank alone, and the others must not wait for it.
    fn abort_unless_known<T>(&self, result: Result<T, RuntimeError>) -> Result<T, RuntimeError> {
        if let Err(err) = &result
            && !err.is_agreed()
            && !matches!(err, RuntimeError::Transport(_))
        {
            self.comm.abort(&format!("rank {} failed: {err}", self.comm.rank()));
        }
        result
    }

    /// Runs one request of a [`ShardOperator`] split along `axis` over the first
    /// `parallel_size` ranks: check that the ranks hold the same input and that it can be cut
    /// into bands no narrower than the operator's widest halo, compute every band (with halo
    /// exchanges between neighbours), gather the output bands to the owner, finish there, and
    /// give the output to the ranks `placement` names. Ranks beyond the parallel size join the
    /// agreement, the gather and the broadcast.
    ///
    /// Errors found before the computation (bad input, too few rows for the ranks) are agreed:
    /// every rank returns the same error and the group stays usable. A failure during the
    /// computation (a bug, since the input was validated) aborts the group, so that no
    /// neighbour waits for a halo that never comes: the others get a transport error that
    /// names this rank.
    pub fn execute_sharded<O: ShardOperator>(
        &self,
        input: &Tensor,
        op: &O,
        axis: ShardAxis,
        placement: OutputPlacement,
    ) -> Result<ExecOutput, RuntimeError> {
        self.abort_unless_known(self.run_sharded(input, op, axis, placement))
    }

    fn run_sharded<O: ShardOperator>(
        &self,
        input: &Tensor,
        op: &O,
        axis: ShardAxis,
        placement: OutputPlacement,
    ) -> Result<ExecOutput, RuntimeError> {
        let _stream = self.device_stream(op.device());
        let comm = self.comm.as_ref();
        let (rank, world) = (comm.rank(), comm.size());
        let traffic_before = comm.stats();
        vae_tensor::memory::reset_peak();
        let mut timings = PhaseTimings::default();

        // 1. Plan the bands, on every rank, from the input alone.
        let clock = Instant::now();
        let plan = guarded(|| op.geometry(input, axis)).and_then(|geometry| {
            let dim = axis
                .dim_in(input.rank())
                .ok_or_else(|| format!("cannot shard the {axis} of an input of shape {}", input.shape()))?;
            BandPartition::new(input.dims()[dim], self.parallel_size, geometry.min_band).map_err(|e| e.to_string())
        });
        timings.split = clock.elapsed();

        // 2. Agree on the input and the plan.
        let clock = Instant::now();
        let extents = self.agree(input, plan.as_ref().map(BandPartition::extent).map_err(String::as_str))?;
        timings.agree = clock.elapsed();
        if extents.iter().any(|e| *e != extents[0]) {
            return Err(RuntimeError::Inconsistent(format!("ranks planned bands over different extents: {extents:?}")));
        }
        let bands = plan.expect("plan errors returned above");

        // 3. Compute this rank's band; the communication inside is timed separately.
        let clock = Instant::now();
        let band = bands.band(rank);
        let mut traffic = ShardTraffic::default();
        let local = match band {
            None => None,
            Some(_) => {
                let mut ctx = ShardContext::new(comm, axis, bands.clone(), rank);
                let out = guarded(|| op.exec(input, &mut ctx));
                traffic = ctx.traffic();
                match out {
                    Ok(out) if out.rank() == input.rank() => Some(out),
                    Ok(out) => {
                        let message =
                            format!("band output has rank {}, the input has rank {}", out.rank(), input.rank());
                        return Err(self.abort_shard(rank, message));
                    }
                    Err(message) => return Err(self.abort_shard(rank, message)),
                }
            }
        };
        timings.halo = traffic.comm_time();
        timings.exec = clock.elapsed().saturating_sub(timings.halo);
        let exec_peak_bytes = vae_tensor::memory::peak_bytes();
        tracing::debug!(rank, ?band, elapsed = ?timings.exec, halo = ?timings.halo, "computed band");

        // 4. Gather the bands to the owner, each with its shape.
        let clock = Instant::now();
        let mut message = Writer::default();
        match (&local, rank == OWNER) {
            (Some(out), false) => {
                message.u8(1).u8(out.dtype().code()).usize(out.rank());
                for d in out.dims() {
                    message.usize(*d);
                }
                message.0.extend_from_slice(out.as_bytes()?);
            }
            _ => {
                message.u8(0);
            }
        }
        let gathered = comm.gather(OWNER, &message.0)?;
        drop(message);
        timings.gather = clock.elapsed();

        // 5. Assemble and finish on the owner.
        let clock = Instant::now();
        // The owner's band moves into the assembly (no copy); other ranks drop theirs here.
        let merged = gathered.map(|parts| {
            let own = local.ok_or_else(|| "the owner computed no band".to_string())?;
            assemble_bands(own, &parts.parts().collect::<Vec<_>>(), axis, &bands)
                .and_then(|full| guarded(|| op.finish(full)))
        });
        timings.merge = clock.elapsed();

        // 6. One broadcast: the status, plus the output when every rank needs it.
        let clock = Instant::now();
        let tensor = self.publish(merged, placement)?;
        timings.broadcast = clock.elapsed();

        let report = RankReport {
            rank,
            world_size: world,
            parallel_size: self.parallel_size,
            tile_count: 0,
            tiles: Vec::new(),
            workload: band.as_ref().map_or(0, |b| b.len() as u64),
            is_owner: rank == OWNER,
            timings,
            traffic: comm.stats().since(&traffic_before),
            peak_bytes: vae_tensor::memory::peak_bytes(),
            exec_peak_bytes,
            device_peak_bytes: vae_tensor::memory::device_peak_bytes(),
            strategy: StrategyReport::Shard { axis, band, traffic },
            reason: None,
        };
        Ok(ExecOutput { tensor, report })
    }

    /// A failure inside a sharded computation: the neighbours may be waiting for this rank's
    /// halo, so the group is aborted and they fail fast with a transport error naming it.
    fn abort_shard(&self, rank: usize, message: String) -> RuntimeError {
        let err = RuntimeError::Operator { stage: Stage::Shard, rank, message };
        self.comm.abort(&format!("rank {rank} failed: {err}"));
        err
    }

    /// Where this rank's device work goes during a request on `device`. Ranks that are threads
    /// of one process (the in-process transport) may share a GPU; each then queues its kernels
    /// on a stream of its own, so that they run side by side instead of one after another on
    /// the device's default stream. A rank alone in its process keeps the default stream (a
    /// second stream would make every launch record and wait for events, for nothing).
    fn device_stream(&self, device: Device) -> StreamScope {
        if device.is_cpu() || self.comm.size() < 2 || self.comm.mailbox().is_none() {
            return StreamScope::none();
        }
        StreamScope::own(&device).unwrap_or_else(|e| {
            // The default stream is as correct, only serial; the request itself will report
            // a device that cannot be used.
            tracing::warn!(rank = self.comm.rank(), "no stream of its own on {device}: {e}");
            StreamScope::none()
        })
    }

    fn run<O: TileOperator>(
        &self,
        input: &Tensor,
        op: &O,
        placement: OutputPlacement,
    ) -> Result<ExecOutput, RuntimeError> {
        let _stream = self.device_stream(op.device());
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
        let counts = self.agree(input, split.as_ref().map(|plan| plan.tasks.len()).map_err(String::as_str))?;
        timings.agree = clock.elapsed();
        if let Some((r, n)) = counts.iter().enumerate().find(|(_, n)| **n != counts[0]) {
            return Err(RuntimeError::Inconsistent(format!(
                "the split is not deterministic: rank {r} made {n} tiles, rank 0 made {}",
                counts[0]
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
        progress::report(Progress::Tiles { done: 0, total: mine.len() });
        for &tile_id in mine {
            let task = &plan.tasks[tile_id];
            match guarded(|| op.exec(input, task)) {
                Ok(out) if out.rank() == input.rank() => {
                    outputs.push((tile_id, out));
                    progress::report(Progress::Tiles { done: outputs.len(), total: mine.len() });
                }
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
        let exec_peak_bytes = vae_tensor::memory::peak_bytes();
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
            exec_peak_bytes,
            device_peak_bytes: vae_tensor::memory::device_peak_bytes(),
            strategy: StrategyReport::Tile,
            reason: None,
        };
        Ok(ExecOutput { tensor, report })
    }

    /// Checks that every rank holds the same input and that the plan worked everywhere (one
    /// all_gather of the input hash and the plan status): a split error on any rank becomes the
    /// same error on every rank. Returns each rank's plan size, for a determinism check.
    fn agree(&self, input: &Tensor, plan: Result<usize, &str>) -> Result<Vec<usize>, RuntimeError> {
        let comm = self.comm.as_ref();
        let hash = input.content_hash()?;
        let mut msg = Writer::default();
        msg.u64(hash);
        match plan {
            Ok(size) => msg.u8(0).usize(size),
            Err(message) => msg.u8(1).str(message),
        };
        let gathered = comm.all_gather(&msg.0)?;
        let mut hashes = Vec::with_capacity(comm.size());
        let mut sizes = Vec::with_capacity(comm.size());
        let mut first_split_error = None;
        for (r, part) in gathered.parts().enumerate() {
            let mut rd = Reader::new(part, "input agreement");
            hashes.push(rd.u64().map_err(inconsistent)?);
            if rd.u8().map_err(inconsistent)? == 1 {
                let message = rd.str().map_err(inconsistent)?;
                first_split_error.get_or_insert(RuntimeError::Operator { stage: Stage::Split, rank: r, message });
            } else {
                sizes.push(rd.usize().map_err(inconsistent)?);
            }
        }
        if hashes.iter().any(|h| *h != hashes[0]) {
            return Err(RuntimeError::InputMismatch { hashes });
        }
        match first_split_error {
            Some(err) => Err(err),
            None => Ok(sizes),
        }
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
    progress::report(Progress::Tiles { done: 0, total: plan.tasks.len() });
    for task in &plan.tasks {
        let stage = Stage::Exec { tile_id: task.tile_id };
        let out = guarded(|| op.exec(input, task)).map_err(|m| failed(stage, m))?;
        if out.rank() != input.rank() {
            let message =
                format!("tile output has rank {} ({}), the input has rank {}", out.rank(), out.shape(), input.rank());
            return Err(failed(stage, message));
        }
        tiles.insert(task.grid_coord.clone(), out);
        progress::report(Progress::Tiles { done: tiles.len(), total: plan.tasks.len() });
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

/// The owner's output band and the other ranks' gathered bands, concatenated along the axis
/// in rank order; every band must have the owner's shape except along the axis, where it has
/// its own band's share of the owner's scale.
fn assemble_bands(own: Tensor, parts: &[&[u8]], axis: ShardAxis, bands: &BandPartition) -> Result<Tensor, String> {
    let dim = axis.dim_in(own.rank()).ok_or("the output has no such axis")?;
    let own_band = bands.bands()[OWNER].len();
    let local = own.dims()[dim];
    if local == 0 || !local.is_multiple_of(own_band) {
        return Err(format!("the owner's output band of {local} rows is not a multiple of its input band {own_band}"));
    }
    let scale = local / own_band;
    let mut tensors = Vec::with_capacity(bands.len());
    for (r, part) in parts.iter().enumerate().take(bands.len()).skip(1) {
        let mut rd = Reader::new(part, "output band");
        let parsed = (|| -> Result<Tensor, RuntimeError> {
            if rd.u8()? != 1 {
                return Err(RuntimeError::Protocol("no band".into()));
            }
            let dtype = DType::from_code(rd.u8()?).ok_or_else(|| RuntimeError::Protocol("unknown dtype".into()))?;
            let ndim = rd.usize()?;
            let dims = (0..ndim.min(16)).map(|_| rd.usize()).collect::<Result<Vec<_>, _>>()?;
            let mut expected = own.dims().to_vec();
            expected[dim] = bands.bands()[r].len() * scale;
            if dims != expected || dtype != own.dtype() {
                return Err(RuntimeError::Protocol(format!("band of shape {dims:?}, expected {expected:?}")));
            }
            Ok(Tensor::from_bytes(dtype, dims, rd.rest(), &own.device())?)
        })();
        tensors.push(parsed.map_err(|e| format!("rank {r}'s output band: {e}"))?);
    }
    let mut refs: Vec<&Tensor> = vec![&own];
    refs.extend(tensors.iter());
    Tensor::cat(&refs, dim).map_err(|e| e.to_string())
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
