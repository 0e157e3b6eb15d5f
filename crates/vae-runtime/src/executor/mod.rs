//! The distributed executor: one request skeleton that every strategy shares, and the
//! strategies that fill it in (tiles: split / exec / merge of a [`TileOperator`];
//! spatial shard: bands or 2-D blocks of a [`ShardOperator`](crate::shard::ShardOperator)
//! with halo exchanges; pipeline: stages of a
//! [`PipelineOperator`](crate::pipeline::PipelineOperator) over runs of frames), each with its
//! output returned or streamed. A request names its strategy and output with a [`Job`] and an
//! [`Output`] ([`job`]).
//!
//! Every request runs the same six phases on every rank: plan (from the input alone), agree
//! (the same input and a plan that worked, on every rank), compute this rank's share, gather
//! to the owner, merge there, and one broadcast of the outcome (and the output, for
//! [`OutputPlacement::AllRanks`]). Errors found before the computation, and a tile that failed
//! on any rank, are agreed: every rank returns the same one and the group stays usable.
//!
//! Coordination is four collectives, each rooted at the owner (a gather and a broadcast to
//! agree, a gather of the results, a broadcast of the outcome): the owner judges and tells
//! the others its verdict ([`verdict`]), so a request costs O(N) messages on N ranks, never
//! the N² of every rank judging an all_gather for itself.

mod blocked;
mod edges;
mod failure;
pub mod job;
mod pipelined;
mod report;
mod sharded;
mod stitched;
mod streamed;
mod tile;
mod verdict;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::Instant;

use vae_tensor::{DType, Device, StreamScope, Tensor};
use vae_transport::wire::{Reader, Writer};
use vae_transport::{Communicator, CommunicatorExt};

use failure::Failure;
pub use failure::{Classified, FailureKind};
pub use job::{Job, JobStrategy, Output};
pub use report::{ExecOutput, OutputPlacement, PhaseTimings, Predicted, RankReport, StrategyReport};
pub use tile::{TileMap, TileOperator, TilePlan, TileStream, execute_serial};

use crate::shard::HaloOverlap;
use crate::{RuntimeError, Stage};

/// Errors a model operator returns; carried to every rank as text, with the [`FailureKind`]
/// a [`Classified`] error names ([`FailureKind::Failed`] for any other error).
pub type OperatorError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// The rank that merges and owns the output.
const OWNER: usize = 0;

/// Dimensions past this many in a shape another rank sends are a protocol error.
const MAX_WIRE_RANK: usize = 16;

/// What a strategy fills into the request skeleton ([`DistributedVaeExecutor::run_request`]).
trait RequestStrategy {
    /// The plan: identical on every rank, made from the input alone.
    type Plan;
    /// What this rank computed.
    type Local;

    /// Plans the request (errors as text and kind: every rank learns them in the agreement).
    fn plan(&self, exec: &DistributedVaeExecutor, input: &Tensor) -> Result<Self::Plan, Failure>;
    /// The number every rank's plan must agree on (tiles, or the extent cut into bands).
    fn plan_size(plan: &Self::Plan) -> usize;
    /// Why the ranks' plan sizes show a non-deterministic plan, if they do.
    fn disagreement(sizes: &[usize]) -> Option<String>;
    /// A choice of this rank that every rank must make alike, because it decides which
    /// collectives the request runs (the tile strategy's merge): agreed with the plan.
    fn choice(&self, _exec: &DistributedVaeExecutor) -> u8 {
        0
    }
    /// Computes this rank's share; sets [`PhaseTimings::exec`] (and `halo`).
    fn compute(
        &self,
        exec: &DistributedVaeExecutor,
        input: &Tensor,
        plan: &Self::Plan,
        timings: &mut PhaseTimings,
    ) -> Result<(Self::Local, RankWork), RuntimeError>;
    /// Gathers to the owner and merges there: the owner's outcome, `None` on the other ranks.
    /// Sets [`PhaseTimings::gather`] and `merge`.
    fn collect(
        &self,
        exec: &DistributedVaeExecutor,
        input: &Tensor,
        plan: &Self::Plan,
        local: Self::Local,
        timings: &mut PhaseTimings,
    ) -> Result<Option<Result<Tensor, RuntimeError>>, RuntimeError>;
}

/// What this rank computed, for its report.
struct RankWork {
    tile_count: usize,
    tiles: Vec<usize>,
    workload: u64,
    strategy: StrategyReport,
}

/// Runs a model's operators over the ranks of a communicator, one request at a time
/// ([`run`](Self::run)).
///
/// Every rank of the group calls [`run`](Self::run) with the same input, job and kind of
/// output. Ranks beyond the parallel size (or without a share) join every collective and get
/// `None` or the broadcast output. The output is bit-identical to what one rank computes
/// alone, for any number of ranks and every strategy (each [`Job`] constructor says why).
/// Holds no per-request state.
pub struct DistributedVaeExecutor {
    comm: Arc<dyn Communicator>,
    requested: usize,
    parallel_size: usize,
    /// When spatial shards overlap a halo exchange with the interior's computation
    /// ([`crate::ShardContext::conv_with_halo`]).
    halo_overlap: HaloOverlap,
    /// How a tiled request whose merge is a stitch is merged.
    tile_merge: TileMerge,
}

/// How the ranks merge a 2-D tiling whose merge is diffusers' stitch
/// ([`TileOperator::stitch_layout`]). Both give the same bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TileMerge {
    /// Whole tiles go to the owner, which stitches each as soon as its turn comes. The ranks
    /// never wait for each other (over the local and socket transports); the owner receives the
    /// whole overlapping tiles (about 1.8 times the output at diffusers' overlap) and blends.
    #[default]
    Owner,
    /// Each rank blends its own tiles from its neighbours' raw edges and gathers only their
    /// kept parts: the owner receives the output's bytes and blends nothing. The edges go in a
    /// paired exchange after each round of tiles, which makes the rounds lockstep, and each rank
    /// holds its share of a row and a column of edges. Where a tile's blend ramps overlap the
    /// edges its neighbours read (ramps past half a tile), for an operator on a GPU (not run on
    /// one yet) and for a streamed tile decode, the owner merge is used. A tile that comes out
    /// another size fails as that tile (stage exec, its rank), not as the owner's merge.
    Edges,
}

impl std::str::FromStr for TileMerge {
    type Err = RuntimeError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "owner" => Ok(Self::Owner),
            "edges" => Ok(Self::Edges),
            other => Err(RuntimeError::Config(format!("a tile merge is owner or edges, not {other:?}"))),
        }
    }
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
        if parallel_size > vae_transport::MAX_WORLD_SIZE {
            return Err(RuntimeError::Config(format!(
                "parallel size {parallel_size} is larger than the limit of {} ranks",
                vae_transport::MAX_WORLD_SIZE
            )));
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
        Ok(Self {
            comm,
            requested: parallel_size,
            parallel_size: effective,
            halo_overlap: HaloOverlap::default(),
            tile_merge: TileMerge::default(),
        })
    }

    /// The same executor merging stitched tiles as `merge` says ([`TileMerge`]). Every rank of a
    /// group must choose the same; the outputs are the same bits either way.
    pub fn with_tile_merge(mut self, merge: TileMerge) -> Self {
        self.tile_merge = merge;
        self
    }

    /// The same executor with spatial shards' halo exchanges overlapped with the interior's
    /// computation as `overlap` says (default: where it pays). Every rank of a group must
    /// choose the same; the outputs are the same bits either way.
    pub fn with_halo_overlap(mut self, overlap: HaloOverlap) -> Self {
        self.halo_overlap = overlap;
        self
    }

    /// The effective parallel size.
    pub fn parallel_size(&self) -> usize {
        self.parallel_size
    }

    /// The communicator.
    pub fn communicator(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }

    /// Runs one request: `job`'s strategy with its operator ([`Job::tiles`], [`Job::bands`],
    /// [`Job::blocks`], [`Job::pipeline`]; each says what it guarantees), its output given to
    /// the ranks a placement names or streamed into the owner's sink ([`Output`]). Every rank
    /// of the group calls it with the same input, job and kind of output.
    ///
    /// Errors found before the computation, and a tile that failed on any rank, are agreed:
    /// every rank returns the same one and the group stays usable. Any other failure of a rank
    /// aborts the group, so that no rank waits for it: the others get a transport error that
    /// names that rank.
    pub fn run<S: JobStrategy>(
        &self,
        input: &Tensor,
        job: Job<S>,
        output: Output<'_>,
    ) -> Result<ExecOutput, RuntimeError> {
        job.run(self, input, output)
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

    /// The request skeleton: the six phases, the strategy filling in plan, compute and collect.
    fn run_request<S: RequestStrategy>(
        &self,
        input: &Tensor,
        strategy: &S,
        device: Device,
        placement: OutputPlacement,
    ) -> Result<ExecOutput, RuntimeError> {
        let _stream = self.device_stream(device);
        let _cancel = crate::cancel::CancelScope::enter(Arc::clone(&self.comm));
        let comm = self.comm.as_ref();
        let (rank, world) = (comm.rank(), comm.size());
        let traffic_before = comm.stats();
        vae_tensor::memory::reset_peak();
        let start_bytes = vae_tensor::memory::live_bytes();
        let mut timings = PhaseTimings::default();

        // 1. Plan, on every rank.
        let clock = Instant::now();
        let plan = strategy.plan(self, input);
        timings.split = clock.elapsed();

        // 2. Agree: the same input everywhere, and the plan worked everywhere.
        let clock = Instant::now();
        self.agree(input, plan.as_ref().map(S::plan_size), S::disagreement, strategy.choice(self))?;
        timings.agree = clock.elapsed();
        // The owner's verdict already failed the request on every rank if any plan failed.
        let plan = plan.map_err(|failure| failure.at(Stage::Split, rank))?;

        // 3. Compute this rank's share.
        let (local, work) = strategy.compute(self, input, &plan, &mut timings)?;
        let exec_peak_bytes = vae_tensor::memory::peak_bytes();

        // 4, 5. Gather to the owner and merge there; whatever happens there is told to every
        // rank in the broadcast.
        let merged = strategy.collect(self, input, &plan, local, &mut timings)?;

        // 6. One broadcast: the merge status, plus the output when every rank needs it.
        let clock = Instant::now();
        let tensor = self.publish(merged, placement)?;
        timings.broadcast = clock.elapsed();

        let report = RankReport {
            rank,
            world_size: world,
            parallel_size: self.parallel_size,
            tile_count: work.tile_count,
            tiles: work.tiles,
            workload: work.workload,
            is_owner: rank == OWNER,
            timings,
            traffic: comm.stats().since(&traffic_before),
            peak_bytes: vae_tensor::memory::peak_bytes(),
            exec_peak_bytes,
            start_bytes,
            device_peak_bytes: vae_tensor::memory::device_peak_bytes(),
            strategy: work.strategy,
            reason: None,
            fallback: false,
            predicted: None,
        };
        Ok(ExecOutput { tensor, report })
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

    /// Checks that every rank holds the same input and that the plan worked everywhere, and that
    /// every plan has the same size (`disagreement` says when sizes show a non-deterministic
    /// plan): each rank sends its input hash and plan status to the owner, which judges and
    /// tells every rank, so a split error on any rank becomes the same error on every rank.
    fn agree(
        &self,
        input: &Tensor,
        plan: Result<usize, &Failure>,
        disagreement: fn(&[usize]) -> Option<String>,
        choice: u8,
    ) -> Result<(), RuntimeError> {
        let comm = self.comm.as_ref();
        let mut msg = Writer::new();
        msg.u64(input.content_hash()?).u8(choice);
        match plan {
            Ok(size) => msg.u8(0).usize(size),
            Err(failure) => verdict::write_kind(msg.u8(1), failure.kind).str(&failure.message),
        };
        let gathered = comm.gather(OWNER, msg.as_slice())?;
        let verdict = gathered.map(|parts| judge_agreement(parts.parts(), disagreement));
        self.announce(verdict.as_ref().map(|v| v.as_ref().map(|()| &[][..])))?;
        match verdict {
            Some(Err(err)) => Err(err),
            _ => Ok(()),
        }
    }

    /// Broadcasts the owner's merge outcome (and the output, for [`OutputPlacement::AllRanks`]).
    fn publish(
        &self,
        merged: Option<Result<Tensor, RuntimeError>>,
        placement: OutputPlacement,
    ) -> Result<Option<Tensor>, RuntimeError> {
        let mut payload = Writer::new();
        if let Some(Ok(out)) = &merged
            && placement == OutputPlacement::AllRanks
        {
            write_tensor_header(&mut payload, out.dtype(), out.dims()).bytes(out.as_bytes()?);
        }
        let announced = self.announce(merged.as_ref().map(|m| m.as_ref().map(|_| payload.as_slice())))?;
        drop(payload);
        match merged {
            Some(outcome) => outcome.map(Some),
            None if placement == OutputPlacement::OwnerOnly => Ok(None),
            None => {
                let mut rd = Reader::new(announced.payload(), "output");
                let (dtype, dims) = read_tensor_header(&mut rd)?;
                Ok(Some(Tensor::from_bytes(dtype, dims, rd.rest(), &Device::Cpu)?))
            }
        }
    }

    /// Tells every rank the owner's verdict with one broadcast: the owner passes `Some` (`Ok`
    /// with a payload, or the agreed error every rank is to return), the others `None` and get
    /// the payload, or the error. The owner gets nothing back: it has its verdict.
    fn announce(&self, verdict: Option<Result<&[u8], &RuntimeError>>) -> Result<Announced, RuntimeError> {
        let mut message = Writer::new();
        if let Some(v) = verdict {
            verdict::write(&mut message, v, OWNER);
        }
        let mut message = message.into_bytes();
        self.comm.broadcast(OWNER, &mut message)?;
        if verdict.is_some() {
            return Ok(Announced { message: Vec::new() });
        }
        verdict::read(&message)??;
        Ok(Announced { message })
    }
}

/// A verdict's message as a rank other than the owner received it.
struct Announced {
    message: Vec<u8>,
}

impl Announced {
    /// What came after the `Ok`.
    fn payload(&self) -> &[u8] {
        self.message.get(1..).unwrap_or(&[])
    }
}

/// The owner's judgement of every rank's input hash and plan status (rank order): different
/// inputs first, then the first rank whose plan failed, then plans of different sizes.
fn judge_agreement<'a>(
    parts: impl Iterator<Item = &'a [u8]>,
    disagreement: fn(&[usize]) -> Option<String>,
) -> Result<(), RuntimeError> {
    let mut hashes = Vec::new();
    let mut sizes = Vec::new();
    let mut choices = Vec::new();
    let mut first_split_error = None;
    for (r, part) in parts.enumerate() {
        let mut rd = Reader::new(part, "input agreement");
        hashes.push(rd.u64().map_err(inconsistent)?);
        choices.push(rd.u8().map_err(inconsistent)?);
        if rd.u8().map_err(inconsistent)? == 1 {
            let kind = verdict::read_kind(&mut rd).map_err(inconsistent)?;
            let failure = Failure::new(kind, rd.str().map_err(inconsistent)?);
            first_split_error.get_or_insert(failure.at(Stage::Split, r));
        } else {
            sizes.push(rd.usize().map_err(inconsistent)?);
        }
    }
    if hashes.windows(2).any(|pair| pair[0] != pair[1]) {
        return Err(RuntimeError::InputMismatch { hashes });
    }
    if let Some(err) = first_split_error {
        return Err(err);
    }
    if let Some(r) = choices.iter().position(|&c| c != choices[0]) {
        return Err(RuntimeError::Inconsistent(format!(
            "rank {r} chose another way to run the request than rank 0 (a tile merge of {} against {}): \
             every rank must be given the same settings",
            choice_name(choices[r]),
            choice_name(choices[0])
        )));
    }
    match disagreement(&sizes) {
        Some(message) => Err(RuntimeError::Inconsistent(message)),
        None => Ok(()),
    }
}

/// The tile merge a [`RequestStrategy::choice`] stands for.
fn choice_name(choice: u8) -> &'static str {
    if choice == 1 { "edges" } else { "owner" }
}

/// Writes a tensor's element type and shape (then its bytes follow, or not).
fn write_tensor_header<'w>(w: &'w mut Writer, dtype: DType, dims: &[usize]) -> &'w mut Writer {
    w.u8(dtype.code()).usize(dims.len());
    for d in dims {
        w.usize(*d);
    }
    w
}

/// Reads what [`write_tensor_header`] wrote.
fn read_tensor_header(rd: &mut Reader<'_>) -> Result<(DType, Vec<usize>), RuntimeError> {
    let code = rd.u8()?;
    let dtype = DType::from_code(code).ok_or_else(|| RuntimeError::Protocol(format!("unknown dtype code {code}")))?;
    let ndim = rd.usize()?;
    if ndim > MAX_WIRE_RANK {
        return Err(RuntimeError::Protocol(format!("a shape of {ndim} dimensions")));
    }
    let dims = (0..ndim).map(|_| rd.usize()).collect::<Result<Vec<_>, _>>()?;
    Ok((dtype, dims))
}

/// Problems found in data that every rank gathered are found by every rank alike.
fn inconsistent(err: impl Into<RuntimeError>) -> RuntimeError {
    match err.into() {
        RuntimeError::Protocol(msg) => RuntimeError::Inconsistent(msg),
        other => other,
    }
}

/// A failure of this rank in `stage` of a computation its peers may be waiting on: the group
/// is aborted (they fail fast, with an error naming this rank) and the failure returned.
fn abort_at(exec: &DistributedVaeExecutor, stage: Stage, failure: Failure) -> RuntimeError {
    let rank = exec.comm.rank();
    let err = failure.at(stage, rank);
    exec.comm.abort(&format!("rank {rank} failed: {err}"));
    err
}

/// Runs operator code, turning errors and panics into text with the error's causes, and the
/// kind a [`Classified`] error names ([`FailureKind::Failed`] for any other error, and for a
/// panic).
fn guarded<T>(body: impl FnOnce() -> Result<T, OperatorError>) -> Result<T, Failure> {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => {
            let kind = e.downcast_ref::<Classified>().map_or(FailureKind::Failed, Classified::kind);
            let mut text = e.to_string();
            let mut source = e.source();
            while let Some(s) = source {
                text.push_str(": ");
                text.push_str(&s.to_string());
                source = s.source();
            }
            Err(Failure::new(kind, text))
        }
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| (*s).to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "non-string panic payload".into());
            Err(Failure::new(FailureKind::Failed, format!("panicked: {what}")))
        }
    }
}
