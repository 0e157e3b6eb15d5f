//! The pipeline strategy: a [`PipelineOperator`]'s steps cut into stages balanced on their
//! predicted cost, stage `s` on rank `s`, run in lockstep ticks. In tick `k` stage `s` runs
//! run `k - s` (when there is one), then every stage hands its result to the next and the last
//! stage hands its output to the owner, which finishes it and passes it on (to the request's
//! sink, or into the whole output). `R` runs take `R + N - 1` ticks: the bubble is
//! `(N - 1) / (R + N - 1)` of the run.
//!
//! The hand-overs are paired exchanges between the ranks named, so the owner's receipt of the
//! last stage's frames rides on the same exchange as its own stage's hand-over. Ranks beyond
//! the stages exchange an empty message with the owner in every tick: they wait a tick at a
//! time, never the whole pipeline in one collective's timeout.

use std::cell::RefCell;
use std::ops::Range;
use std::time::{Duration, Instant};

use vae_planner::StagePartition;
use vae_tensor::{Device, Tensor};
use vae_transport::PeerExchange;
use vae_transport::wire::{Reader, Writer};

use super::failure::Failure;
use super::report::{PhaseTimings, StrategyReport};
use super::streamed::{feed_of, hand_on, nothing_left};
use super::{
    DistributedVaeExecutor, OWNER, RankWork, RequestStrategy, abort_at, guarded, read_tensor_header,
    write_tensor_header,
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

/// What one leg of a tick's exchange sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Send {
    /// This stage's result of the tick.
    Outgoing,
    /// An empty message.
    Nothing,
}

/// What one leg of a tick's exchange brings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Brings {
    /// The previous stage's result.
    Previous,
    /// The last stage's output (on the owner).
    LastOutput,
    /// An empty message.
    Nothing,
}

/// One rank's place in the pipeline's exchanges: its stage (`None` beyond the stages).
#[derive(Debug, Clone, Copy)]
struct Peers {
    rank: usize,
    stages: usize,
    world: usize,
}

impl Peers {
    fn stage(&self) -> Option<usize> {
        (self.rank < self.stages).then_some(self.rank)
    }

    fn last(&self) -> usize {
        self.stages - 1
    }

    /// The legs of every tick's exchange: to the next stage, from the previous one, from the
    /// last stage to the owner, and between the owner and each rank beyond the stages; a peer
    /// met twice (with two stages, the owner is the last stage's previous one) is one leg.
    fn legs(&self) -> Vec<(usize, Send, Brings)> {
        let (r, last) = (self.rank, self.last());
        let mut legs: Vec<(usize, Send, Brings)> = Vec::new();
        let mut add = |peer: usize, send: Send, brings: Brings| match legs.iter_mut().find(|l| l.0 == peer) {
            Some(leg) => {
                if send == Send::Outgoing {
                    leg.1 = send;
                }
                if brings != Brings::Nothing {
                    leg.2 = brings;
                }
            }
            None => legs.push((peer, send, brings)),
        };
        if self.stage().is_none() {
            add(OWNER, Send::Nothing, Brings::Nothing);
            return legs;
        }
        if r > 0 {
            add(r - 1, Send::Nothing, Brings::Previous);
        }
        if r < last {
            add(r + 1, Send::Outgoing, Brings::Nothing);
        }
        if r == last && r != OWNER {
            add(OWNER, Send::Outgoing, Brings::Nothing);
        }
        if r == OWNER {
            if last != OWNER {
                add(last, Send::Nothing, Brings::LastOutput);
            }
            for idle in self.stages..self.world {
                add(idle, Send::Nothing, Brings::Nothing);
            }
        }
        legs
    }

    /// Whether stage `s` runs a run in tick `k` of `runs` runs.
    fn active(s: usize, k: usize, runs: usize) -> bool {
        k >= s && k - s < runs
    }
}

/// What every rank's plan must agree on: the step count and the stage count, in one number.
fn plan_key(steps: usize, stages: usize) -> usize {
    steps * (vae_transport::MAX_WORLD_SIZE + 1) + stages
}

impl<O: PipelineOperator> RequestStrategy for PipelineStrategy<'_, '_, O> {
    type Plan = PipelinePlan;
    /// The owner's whole output, unstreamed.
    type Local = Option<Tensor>;

    /// The steps and their costs from the input alone, cut into as many stages as the
    /// parallel size (fewer when the model has fewer steps).
    fn plan(&self, exec: &DistributedVaeExecutor, input: &Tensor) -> Result<PipelinePlan, Failure> {
        let steps = guarded(|| self.op.steps(input))?;
        if steps.runs.runs == 0 {
            return Err("the input has no runs (latent frames) to pipeline".to_string().into());
        }
        if self.streamed && exec.comm.rank() == OWNER && self.sink.borrow().is_none() {
            return Err("the owner of a streamed request needs a frame sink".to_string().into());
        }
        let count = exec.parallel_size.min(steps.costs.len());
        let stages = StagePartition::balanced(&steps.costs, count).map_err(|e| e.to_string())?;
        Ok(PipelinePlan { stages, steps })
    }

    fn plan_size(plan: &PipelinePlan) -> usize {
        plan_key(plan.stages.steps(), plan.stages.len())
    }

    fn disagreement(keys: &[usize]) -> Option<String> {
        let per = vae_transport::MAX_WORLD_SIZE + 1;
        let described: Vec<String> = keys.iter().map(|k| format!("{} steps in {} stages", k / per, k % per)).collect();
        keys.iter().any(|k| *k != keys[0]).then(|| format!("ranks planned different pipelines: {described:?}"))
    }

    /// This rank's stage, tick by tick (beyond the stages: an empty exchange with the owner
    /// per tick); a failure aborts the group (the neighbours wait for its hand-over).
    fn compute(
        &self,
        exec: &DistributedVaeExecutor,
        input: &Tensor,
        plan: &PipelinePlan,
        timings: &mut PhaseTimings,
    ) -> Result<(Option<Tensor>, RankWork), RuntimeError> {
        let clock = Instant::now();
        let rank = exec.comm.rank();
        let peers = Peers { rank, stages: plan.stages.len(), world: exec.comm.size() };
        let steps = plan.stages.stage(rank);
        let total_cost: u64 = plan.steps.costs.iter().sum();
        let mut report = PipelineStage {
            stage: peers.stage(),
            stages: peers.stages,
            steps: steps.clone().unwrap_or(0..0),
            total_steps: plan.steps.costs.len(),
            cost_share_ppm: (plan.stages.cost(rank) as u128 * 1_000_000 / total_cost.max(1) as u128) as u32,
            weight_bytes: steps.clone().map_or(0, |s| self.op.stage_weight_bytes(s)),
            runs: 0,
            bytes_out: 0,
            busy: Duration::ZERO,
            idle: Duration::ZERO,
        };
        let fail = |failure: Failure| abort_at(exec, Stage::Pipeline { stage: rank }, failure);
        let mut sink = self.sink.borrow_mut();
        let mut collected = CollectFrames::new();
        let total = plan.steps.runs.frames;
        let mut feed = if self.streamed {
            feed_of(rank, sink.as_deref_mut(), total).map_err(fail)?
        } else {
            (rank == OWNER).then(|| FrameFeed::new(&mut collected, total))
        };
        // A runtime error (the group's, or a cancellation) is the request's to handle.
        self.run_ticks(exec, input, steps, &peers, plan.steps.runs.runs, feed.as_mut(), &mut report).map_err(|e| {
            match e {
                Halted::Failed(failure) => fail(failure),
                Halted::Runtime(err) => err,
            }
        })?;
        let mut output = None;
        if let Some(feed) = feed {
            feed.finish().map_err(|e| fail(e.to_string().into()))?;
            if !self.streamed {
                output = Some(collected.into_tensor().map_err(|e| fail(e.to_string().into()))?);
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
        Ok(match local {
            Some(out) => Some(Ok(out)),
            None => nothing_left(exec),
        })
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
    /// The ticks of one rank: run its stage (if it has one), then hand over; on the owner,
    /// finish each run's output as the last stage hands it over and pass it on.
    #[allow(clippy::too_many_arguments)]
    fn run_ticks(
        &self,
        exec: &DistributedVaeExecutor,
        input: &Tensor,
        steps: Option<Range<usize>>,
        peers: &Peers,
        runs: usize,
        mut feed: Option<&mut FrameFeed<'_>>,
        report: &mut PipelineStage,
    ) -> Result<(), Halted> {
        let last = peers.last();
        let legs = peers.legs();
        let mut state: Option<StageState> = match steps {
            Some(steps) => Some(guarded(|| self.op.start_stage(input, steps)).map_err(Halted::Failed)?),
            None => None,
        };
        let mut carried: Option<Vec<Tensor>> = None;
        for tick in 0..runs + peers.stages - 1 {
            crate::cancel::check()?;
            let busy = Instant::now();
            let out = match (peers.stage(), state.as_mut()) {
                (Some(s), Some(state)) if Peers::active(s, tick, runs) => {
                    let run = tick - s;
                    let given = match (s, carried.take()) {
                        (0, _) => Vec::new(),
                        (_, Some(given)) => given,
                        (_, None) => return Err(Halted::Failed(format!("run {run} did not reach stage {s}").into())),
                    };
                    let out = guarded(|| self.op.exec_stage(input, run, state, given)).map_err(Halted::Failed)?;
                    report.runs += 1;
                    Some(out)
                }
                _ => None,
            };
            report.busy += busy.elapsed();

            let waited = Instant::now();
            let outgoing = message(out.as_deref()).map_err(|e| Halted::Failed(e.to_string().into()))?;
            let received = exchange(exec, &legs, &outgoing)?;
            report.bytes_out +=
                legs.iter().filter(|l| l.1 == Send::Outgoing).count() as u64 * outgoing.as_slice().len() as u64;
            if let Some(s) = peers.stage().filter(|s| *s > 0 && Peers::active(s - 1, tick, runs)) {
                let bytes = received.previous.as_deref().unwrap_or_default();
                carried = Some(
                    parse(bytes).map_err(|e| Halted::Failed(format!("from stage {}: {}", s - 1, e.message).into()))?,
                );
            }
            report.idle += waited.elapsed();

            // The owner passes on a run's output: its own (one stage) or the last stage's.
            if let Some(feed) = feed.as_deref_mut()
                && Peers::active(last, tick, runs)
            {
                let mut output = match received.last_output.as_deref() {
                    None => out.unwrap_or_default(),
                    Some(bytes) => parse(bytes).map_err(Halted::Failed)?,
                };
                if output.len() != 1 {
                    let what = format!("the last stage's output of run {} is {} tensors", tick - last, output.len());
                    return Err(Halted::Failed(what.into()));
                }
                let frames = guarded(|| self.op.finish(output.remove(0))).map_err(Halted::Failed)?;
                if let Err(err) = hand_on(feed, frames) {
                    // The other stages wait for the owner's next hand-over.
                    exec.comm.abort(&format!("rank {OWNER} failed: {err}"));
                    return Err(Halted::Runtime(err));
                }
                progress::report(Progress::Steps { done: tick - last + 1, total: runs });
            }
        }
        Ok(())
    }
}

/// What one tick's exchange brought this rank.
struct Received {
    /// The previous stage's message (on every stage but the first).
    previous: Option<Vec<u8>>,
    /// The last stage's message (on the owner, when another rank runs the last stage).
    last_output: Option<Vec<u8>>,
}

/// One tick's paired exchange over `legs` ([`Peers::legs`]).
fn exchange(
    exec: &DistributedVaeExecutor,
    legs: &[(usize, Send, Brings)],
    outgoing: &Writer,
) -> Result<Received, RuntimeError> {
    let empty = Writer::new();
    let mut recvs = vec![Vec::<u8>::new(); legs.len()];
    if !legs.is_empty() {
        let mut exchange: Vec<PeerExchange<'_>> = legs
            .iter()
            .zip(recvs.iter_mut())
            .map(|(&(peer, send, _), recv)| {
                let send = if send == Send::Outgoing { outgoing } else { &empty };
                PeerExchange { peer, send: send.as_slice(), recv }
            })
            .collect();
        exec.comm.exchange_bytes(vae_transport::DataType::U8, &mut exchange)?;
    }
    let mut received = Received { previous: None, last_output: None };
    for (leg, bytes) in legs.iter().zip(recvs) {
        match leg.2 {
            Brings::Previous => received.previous = Some(bytes),
            Brings::LastOutput => received.last_output = Some(bytes),
            Brings::Nothing => {}
        }
    }
    Ok(received)
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
/// run was coming), and so are bytes past the last tensor.
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
        if !rd.rest().is_empty() {
            return Err(RuntimeError::Protocol("bytes past the last tensor of a hand-over".into()));
        }
        Ok(tensors)
    };
    read().map_err(|e| Failure::from(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Job, Output, OutputPlacement};

    /// Every leg one rank lists, its peer lists back, once; every stage but the first hears
    /// from its previous one, the owner hears from the last stage (when another rank runs it),
    /// and every rank beyond the stages meets the owner in every tick.
    #[test]
    fn every_leg_is_paired_for_any_stage_and_world_count() {
        for stages in 1..=8 {
            for world in stages..=stages + 3 {
                let legs: Vec<_> = (0..world).map(|rank| Peers { rank, stages, world }.legs()).collect();
                for (rank, mine) in legs.iter().enumerate() {
                    let mut peers: Vec<usize> = mine.iter().map(|l| l.0).collect();
                    peers.sort_unstable();
                    peers.dedup();
                    assert_eq!(peers.len(), mine.len(), "{stages}/{world}: rank {rank} lists a peer twice");
                    for &(peer, send, brings) in mine {
                        assert_ne!(peer, rank);
                        let back = legs[peer].iter().find(|l| l.0 == rank);
                        let back = back.unwrap_or_else(|| panic!("{stages}/{world}: {rank}->{peer} is not paired"));
                        // What one side brings, the other sends.
                        assert_eq!(
                            brings != Brings::Nothing,
                            back.1 == Send::Outgoing,
                            "{stages}/{world}: {rank}<-{peer}"
                        );
                        assert_eq!(
                            send == Send::Outgoing,
                            back.2 != Brings::Nothing,
                            "{stages}/{world}: {rank}->{peer}"
                        );
                    }
                    let brings = |b: Brings| mine.iter().filter(|l| l.2 == b).count();
                    assert_eq!(brings(Brings::Previous), usize::from(rank > 0 && rank < stages));
                    assert_eq!(brings(Brings::LastOutput), usize::from(rank == OWNER && stages > 1));
                    if rank >= stages {
                        assert_eq!(mine, &vec![(OWNER, Send::Nothing, Brings::Nothing)]);
                    }
                }
            }
        }
    }

    /// A toy model: `steps` steps, step `i` adding `i + 1` to each frame; one run per frame of
    /// an `[1, 1, T, 1, 2]` input. It fails at `fail_at` (the first step of the stage, run), if
    /// set.
    struct AddSteps {
        steps: usize,
        fail_at: Option<(usize, usize)>,
        /// How long each run of a stage takes, at least.
        pause: std::time::Duration,
    }

    impl PipelineOperator for AddSteps {
        fn steps(&self, input: &Tensor) -> Result<PipelineSteps, crate::OperatorError> {
            let t = input.dims()[2];
            Ok(PipelineSteps { costs: vec![1; self.steps], runs: crate::StreamRuns { runs: t, frames: t } })
        }

        fn start_stage(&self, _: &Tensor, steps: Range<usize>) -> Result<StageState, crate::OperatorError> {
            Ok(Box::new(steps))
        }

        fn exec_stage(
            &self,
            input: &Tensor,
            run: usize,
            state: &mut StageState,
            carried: Vec<Tensor>,
        ) -> Result<Vec<Tensor>, crate::OperatorError> {
            let steps = state.downcast_ref::<Range<usize>>().ok_or("state")?.clone();
            std::thread::sleep(self.pause);
            if self.fail_at.is_some_and(|(stage_start, r)| stage_start == steps.start && r == run) {
                return Err("the stage broke".into());
            }
            let mut x = match carried.into_iter().next() {
                Some(x) => x,
                None => input.narrow(2, run, 1)?,
            };
            for i in steps {
                x = x.affine(1.0, (i + 1) as f32)?;
            }
            Ok(vec![x])
        }

        fn finish(&self, output: Tensor) -> Result<Tensor, crate::OperatorError> {
            Ok(output)
        }

        fn stage_weight_bytes(&self, steps: Range<usize>) -> u64 {
            steps.len() as u64
        }

        fn device(&self) -> Device {
            Device::Cpu
        }
    }

    /// The owner's output values (`None` elsewhere) and the rank's report.
    type RankResult = (Option<Vec<f32>>, super::super::RankReport);

    /// The toy model on `world` local ranks with a parallel size of `parallel`: each rank's
    /// result (the owner's output, or nothing) and report, or its error.
    fn run(
        op: &AddSteps,
        frames: usize,
        world: usize,
        parallel: usize,
        config: vae_transport::TransportConfig,
    ) -> Vec<Result<RankResult, RuntimeError>> {
        let input =
            Tensor::from_vec((0..2 * frames).map(|v| v as f32).collect(), vec![1, 1, frames, 1, 2], &Device::Cpu)
                .unwrap();
        vae_transport::run_local(world, config, |comm| {
            let exec = DistributedVaeExecutor::new(std::sync::Arc::new(comm), parallel).unwrap();
            let out = exec.run(&input, Job::pipeline(op), Output::Placed(OutputPlacement::OwnerOnly))?;
            Ok((out.tensor.map(|t| t.to_vec_f32().unwrap()), out.report))
        })
        .unwrap()
        .into_iter()
        .map(|r| r.unwrap())
        .collect()
    }

    #[test]
    fn any_number_of_stages_adds_every_step_once() {
        // 1 to 7 stages over 5 steps (more ranks than steps: 5 stages, the rest idle).
        for world in 1..=7 {
            let op = AddSteps { steps: 5, fail_at: None, pause: std::time::Duration::ZERO };
            let results = run(&op, 3, world, world, vae_transport::TransportConfig::default());
            let (output, _) = results[0].as_ref().unwrap();
            let want: Vec<f32> = (0..6).map(|v| v as f32 + 15.0).collect();
            assert_eq!(output.as_deref(), Some(&want[..]), "{world} rank(s)");
            for (rank, r) in results.iter().enumerate() {
                let StrategyReport::Pipeline(stage) = &r.as_ref().unwrap().1.strategy else { panic!("not a pipeline") };
                assert_eq!(stage.stage, (rank < world.min(5)).then_some(rank), "{world} rank(s)");
                assert_eq!(stage.runs, if rank < world.min(5) { 3 } else { 0 });
            }
        }
    }

    #[test]
    fn a_stage_that_fails_mid_run_fails_every_rank_naming_it() {
        for (world, stage_start) in [(3, 2), (4, 3), (4, 1)] {
            // 4 steps over `world` stages: stage k starts at step k; it fails on run 1.
            let op = AddSteps { steps: 4, fail_at: Some((stage_start, 1)), pause: std::time::Duration::ZERO };
            let results = run(&op, 4, world, world, vae_transport::TransportConfig::default());
            for (rank, r) in results.iter().enumerate() {
                let err = r.as_ref().err().unwrap_or_else(|| panic!("rank {rank} of {world} succeeded")).to_string();
                assert!(err.contains(&format!("rank {stage_start}")), "rank {rank} of {world}: {err}");
            }
        }
    }

    #[test]
    fn ranks_beyond_the_stages_wait_a_tick_at_a_time() {
        // 12 runs of 60 ms each: 0.8 s in all, twice the collective timeout, 60 ms a tick.
        let config = vae_transport::TransportConfig {
            collective_timeout: std::time::Duration::from_millis(400),
            ..vae_transport::TransportConfig::default()
        };
        let op = AddSteps { steps: 2, fail_at: None, pause: std::time::Duration::from_millis(60) };
        let results = run(&op, 12, 4, 2, config);
        for (rank, r) in results.iter().enumerate() {
            assert!(r.is_ok(), "rank {rank}: {:?}", r.as_ref().err());
        }
    }

    #[test]
    fn a_hand_over_reads_back_and_refuses_what_it_did_not_write() {
        let t = Tensor::seeded_uniform(vec![1, 2, 1, 3, 3], 1, -1.0, 1.0, &Device::Cpu).unwrap();
        let written = message(Some(&[t.clone(), t.clone()])).unwrap();
        let read = parse(written.as_slice()).unwrap();
        assert!(read.len() == 2 && read.iter().all(|r| r.bit_eq(&t)));
        assert!(parse(message(None).unwrap().as_slice()).is_err(), "nothing, where a run was due");
        let mut longer = written.as_slice().to_vec();
        longer.push(0);
        assert!(parse(&longer).is_err(), "trailing bytes");
        assert!(parse(&written.as_slice()[..written.as_slice().len() - 1]).is_err(), "truncated");
    }
}
