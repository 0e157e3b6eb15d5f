//! The pipeline strategy: a [`PipelineOperator`]'s steps cut into stages balanced on their
//! predicted cost, stage `s` on rank `s`, run in lockstep ticks. In tick `k` stage `s` runs
//! run `k - s` (when there is one), then every stage hands its result to the next and the last
//! stage hands its output to the owner, which finishes it and passes it on (to the request's
//! sink, or into the whole output). `R` runs take `R + N - 1` ticks: the bubble is
//! `(N - 1) / (R + N - 1)` of the run.
//!
//! The hand-overs are paired exchanges between the ranks named, so the owner's receipt of the
//! last stage's frames rides on the same exchange as its own stage's hand-over.

use std::cell::RefCell;
use std::ops::Range;
use std::time::{Duration, Instant};

use vae_planner::StagePartition;
use vae_tensor::{Device, Tensor};
use vae_transport::PeerExchange;
use vae_transport::wire::{Reader, Writer};

use super::failure::Failure;
use super::report::{PhaseTimings, StrategyReport};
use super::{
    DistributedVaeExecutor, OWNER, RankWork, RequestStrategy, guarded, read_tensor_header, write_tensor_header,
};
use crate::pipeline::{PipelineOperator, PipelineStage, PipelineSteps, StageState};
use crate::progress::{self, Progress};
use crate::stream::{CollectFrames, FrameFeed, FrameSink};
use crate::{RuntimeError, Stage};

/// Tensors one message carries at most (a stage hands over an activation and a shortcut).
const MAX_TENSORS: usize = 16;

/// The pipeline strategy of one request. With a sink, the owner streams the frames into it;
/// without, it collects them into the output.
pub(super) struct PipelineStrategy<'o, 's, O> {
    pub(super) op: &'o O,
    pub(super) sink: RefCell<Option<&'s mut dyn FrameSink>>,
    pub(super) streamed: bool,
}

/// The stages and runs of a request.
pub(super) struct PipelinePlan {
    stages: StagePartition,
    steps: PipelineSteps,
}

/// Who a stage exchanges with in every tick: its neighbours in the line of stages, and the
/// last stage with the owner.
struct Peers {
    stage: usize,
    stages: usize,
}

impl Peers {
    fn previous(&self) -> Option<usize> {
        self.stage.checked_sub(1)
    }

    fn next(&self) -> Option<usize> {
        (self.stage + 1 < self.stages).then_some(self.stage + 1)
    }

    /// The rank the last stage sends its output to (the owner), or the last stage the owner
    /// receives from: `None` when both are this rank.
    fn output_peer(&self) -> Option<usize> {
        let last = self.stages - 1;
        match self.stage {
            s if s == last && last != OWNER => Some(OWNER),
            OWNER if last != OWNER => Some(last),
            _ => None,
        }
    }

    /// Whether stage `s` runs a run in tick `k` of `runs` runs.
    fn active(s: usize, k: usize, runs: usize) -> bool {
        k >= s && k - s < runs
    }
}

impl<O: PipelineOperator> RequestStrategy for PipelineStrategy<'_, '_, O> {
    type Plan = PipelinePlan;
    /// The owner's whole output, unstreamed.
    type Local = Option<Tensor>;

    /// The steps and their costs from the input alone, cut into as many stages as there are
    /// ranks (fewer when the model has fewer steps).
    fn plan(&self, exec: &DistributedVaeExecutor, input: &Tensor) -> Result<PipelinePlan, Failure> {
        let steps = guarded(|| self.op.steps(input))?;
        if steps.runs.runs == 0 {
            return Err("the input has no runs (latent frames) to pipeline".to_string().into());
        }
        let count = exec.parallel_size.min(steps.costs.len());
        let stages = StagePartition::balanced(&steps.costs, count).map_err(|e| e.to_string())?;
        Ok(PipelinePlan { stages, steps })
    }

    fn plan_size(plan: &PipelinePlan) -> usize {
        plan.steps.costs.len()
    }

    fn disagreement(steps: &[usize]) -> Option<String> {
        steps.iter().any(|s| *s != steps[0]).then(|| format!("ranks planned different numbers of steps: {steps:?}"))
    }

    /// This rank's stage, tick by tick; a failure aborts the group (the neighbours wait for
    /// its hand-over).
    fn compute(
        &self,
        exec: &DistributedVaeExecutor,
        input: &Tensor,
        plan: &PipelinePlan,
        timings: &mut PhaseTimings,
    ) -> Result<(Option<Tensor>, RankWork), RuntimeError> {
        let clock = Instant::now();
        let rank = exec.comm.rank();
        let stages = plan.stages.len();
        let runs = plan.steps.runs.runs;
        let steps = plan.stages.stage(rank);
        let total_cost: u64 = plan.steps.costs.iter().sum();
        let mut report = PipelineStage {
            stage: steps.as_ref().map(|_| rank),
            stages,
            steps: steps.clone().unwrap_or(0..0),
            total_steps: plan.steps.costs.len(),
            cost_share_ppm: (plan.stages.cost(rank) as u128 * 1_000_000 / total_cost.max(1) as u128) as u32,
            weight_bytes: steps.clone().map_or(0, |s| self.op.stage_weight_bytes(s)),
            runs: 0,
            bytes_out: 0,
            busy: Duration::ZERO,
            idle: Duration::ZERO,
        };
        let fail = |failure: Failure| {
            let err = failure.at(Stage::Pipeline { stage: rank }, rank);
            exec.comm.abort(&format!("rank {rank} failed: {err}"));
            err
        };
        let mut output = None;
        if let Some(steps) = steps {
            let mut sink = self.sink.borrow_mut();
            let mut collected = CollectFrames::new();
            let total = plan.steps.runs.frames;
            let mut feed = match (rank == OWNER, self.streamed, sink.as_deref_mut()) {
                (false, ..) => None,
                (true, true, Some(sink)) => Some(FrameFeed::new(sink, total)),
                (true, true, None) => {
                    return Err(fail("the owner of a streamed request needs a frame sink".to_string().into()));
                }
                (true, false, _) => Some(FrameFeed::new(&mut collected, total)),
            };
            let peers = Peers { stage: rank, stages };
            // A runtime error (the group's, or a cancellation) is the request's to handle.
            self.run_stage(exec, input, steps, &peers, runs, feed.as_mut(), &mut report).map_err(|e| match e {
                Halted::Failed(failure) => fail(failure),
                Halted::Runtime(err) => err,
            })?;
            if let Some(feed) = feed {
                feed.finish().map_err(|e| fail(e.to_string().into()))?;
                if !self.streamed {
                    output = Some(collected.into_tensor().map_err(|e| fail(e.to_string().into()))?);
                }
            }
        }
        timings.halo = report.idle;
        timings.exec = clock.elapsed().saturating_sub(report.idle);
        tracing::debug!(rank, stage = ?report.stage, busy = ?report.busy, idle = ?report.idle, "ran pipeline stage");
        let work = RankWork {
            tile_count: 0,
            tiles: Vec::new(),
            workload: plan.stages.cost(rank),
            strategy: StrategyReport::Pipeline(report),
        };
        Ok((output, work))
    }

    /// The owner already holds the output (or streamed it): nothing is gathered.
    fn collect(
        &self,
        exec: &DistributedVaeExecutor,
        _: &Tensor,
        _: &PipelinePlan,
        local: Option<Tensor>,
        _: &mut PhaseTimings,
    ) -> Result<Option<Result<Tensor, RuntimeError>>, RuntimeError> {
        if exec.comm.rank() != OWNER {
            return Ok(None);
        }
        Ok(Some(match local {
            Some(out) => Ok(out),
            None => Tensor::zeros(vec![0], vae_tensor::DType::F32, &Device::Cpu).map_err(Into::into),
        }))
    }
}

/// Why a stage stopped: its operator (or the owner's sink) failed, or the group did.
enum Halted {
    Failed(Failure),
    Runtime(RuntimeError),
}

impl From<RuntimeError> for Halted {
    fn from(e: RuntimeError) -> Self {
        Self::Runtime(e)
    }
}

impl<O: PipelineOperator> PipelineStrategy<'_, '_, O> {
    /// The ticks of one stage: run, then hand over (and, on the owner, receive the last stage's
    /// output, finish it and pass it on).
    #[allow(clippy::too_many_arguments)]
    fn run_stage(
        &self,
        exec: &DistributedVaeExecutor,
        input: &Tensor,
        steps: Range<usize>,
        peers: &Peers,
        runs: usize,
        mut feed: Option<&mut FrameFeed<'_>>,
        report: &mut PipelineStage,
    ) -> Result<(), Halted> {
        let s = peers.stage;
        let last = peers.stages - 1;
        let mut state: StageState = guarded(|| self.op.start_stage(input, steps)).map_err(Halted::Failed)?;
        let mut carried: Option<Vec<Tensor>> = None;
        for tick in 0..runs + peers.stages - 1 {
            crate::cancel::check()?;
            let busy = Instant::now();
            let out = if Peers::active(s, tick, runs) {
                let run = tick - s;
                let given = match (s, carried.take()) {
                    (0, _) => Vec::new(),
                    (_, Some(given)) => given,
                    (_, None) => return Err(Halted::Failed(format!("run {run} did not reach stage {s}").into())),
                };
                let out = guarded(|| self.op.exec_stage(input, run, &mut state, given)).map_err(Halted::Failed)?;
                report.runs += 1;
                Some(out)
            } else {
                None
            };
            report.busy += busy.elapsed();

            // Hand over: to the next stage, or (from the last) to the owner.
            let waited = Instant::now();
            let outgoing = message(out.as_deref())?;
            report.bytes_out += outgoing.as_slice().len() as u64;
            let received = hand_over(exec, peers, &outgoing)?;
            if s > 0 && Peers::active(s - 1, tick, runs) {
                let bytes = received.from_previous.as_deref().unwrap_or_default();
                carried = Some(parse(bytes).map_err(Halted::Failed)?);
            }
            report.idle += waited.elapsed();

            // The owner passes on a run's output: its own (one stage) or the last stage's.
            if let Some(feed) = feed.as_deref_mut()
                && Peers::active(last, tick, runs)
            {
                let mut output = match received.from_last.as_deref() {
                    None => out.unwrap_or_default(),
                    Some(bytes) => parse(bytes).map_err(Halted::Failed)?,
                };
                if output.len() != 1 {
                    let what = format!("the last stage's output of run {} is {} tensors", tick - last, output.len());
                    return Err(Halted::Failed(what.into()));
                }
                let frames = guarded(|| self.op.finish(output.remove(0))).map_err(Halted::Failed)?;
                feed.feed(frames).map_err(|e| Halted::Failed(format!("passing on decoded frames: {e}").into()))?;
                progress::report(Progress::Steps { done: tick - last + 1, total: runs });
            }
        }
        Ok(())
    }
}

/// What one tick's hand-over brought this rank.
struct Received {
    /// The previous stage's message (on every stage but the first).
    from_previous: Option<Vec<u8>>,
    /// The last stage's message (on the owner, when another rank runs the last stage).
    from_last: Option<Vec<u8>>,
}

/// One tick's hand-over: `outgoing` to the next stage (from the last stage: to the owner),
/// an empty message to every other peer, in one paired exchange; a peer met twice (with two
/// stages, the owner is also the last stage's previous one) is one leg.
fn hand_over(exec: &DistributedVaeExecutor, peers: &Peers, outgoing: &Writer) -> Result<Received, RuntimeError> {
    let (s, last) = (peers.stage, peers.stages - 1);
    let empty = Writer::new();
    let output_peer = peers.output_peer();
    let mut sends: Vec<(usize, &Writer)> = Vec::with_capacity(3);
    let (mut previous_leg, mut last_leg) = (None, None);
    if let Some(p) = peers.previous() {
        previous_leg = Some(sends.len());
        sends.push((p, if s == last && Some(p) == output_peer { outgoing } else { &empty }));
    }
    if let Some(n) = peers.next() {
        if Some(n) == output_peer {
            last_leg = Some(sends.len());
        }
        sends.push((n, outgoing));
    }
    if let Some(o) = output_peer.filter(|o| Some(*o) != peers.previous() && Some(*o) != peers.next()) {
        if s == OWNER {
            last_leg = Some(sends.len());
        }
        sends.push((o, if s == last { outgoing } else { &empty }));
    }
    let mut recvs = vec![Vec::<u8>::new(); sends.len()];
    if !sends.is_empty() {
        let mut legs: Vec<PeerExchange<'_>> = sends
            .iter()
            .zip(recvs.iter_mut())
            .map(|((peer, send), recv)| PeerExchange { peer: *peer, send: send.as_slice(), recv })
            .collect();
        exec.comm.exchange_bytes(vae_transport::DataType::U8, &mut legs)?;
    }
    let mut take = |leg: Option<usize>| leg.map(|i| std::mem::take(&mut recvs[i]));
    Ok(Received { from_previous: take(previous_leg), from_last: take(last_leg) })
}

/// A hand-over: nothing (a stage idle in this tick), or tensors with their shapes.
fn message(tensors: Option<&[Tensor]>) -> Result<Writer, RuntimeError> {
    let mut w = Writer::new();
    match tensors {
        None => {
            w.u8(0);
        }
        Some(tensors) => {
            w.u8(1).usize(tensors.len());
            for t in tensors {
                let bytes = t.as_bytes()?;
                write_tensor_header(&mut w, t.dtype(), t.dims()).usize(bytes.len()).bytes(bytes);
            }
        }
    }
    Ok(w)
}

/// Reads what [`message`] wrote, into host tensors; nothing is an error (the schedule said a
/// run was coming).
fn parse(bytes: &[u8]) -> Result<Vec<Tensor>, Failure> {
    let read = || -> Result<Vec<Tensor>, RuntimeError> {
        let mut rd = Reader::new(bytes, "pipeline hand-over");
        if rd.u8()? != 1 {
            return Err(RuntimeError::Protocol("a run expected from the previous stage did not come".into()));
        }
        let count = rd.usize()?;
        if count > MAX_TENSORS {
            return Err(RuntimeError::Protocol(format!("a hand-over of {count} tensors")));
        }
        let mut tensors = Vec::with_capacity(count);
        for _ in 0..count {
            let (dtype, dims) = read_tensor_header(&mut rd)?;
            let len = rd.usize()?;
            let data = rd.bytes(len)?;
            tensors.push(Tensor::from_bytes(dtype, dims, data, &Device::Cpu)?);
        }
        Ok(tensors)
    };
    read().map_err(|e| Failure::from(e.to_string()))
}
