//! Pipeline parallelism over runs (a causal video decoder's latent frames): the model's layers
//! cut into stages, stage `s` on rank `s`, each latent frame passed from stage to stage while
//! the earlier stages already work on the next ones.
//!
//! Exact by construction: every stage applies its layers to each frame as the whole model would,
//! in the same order, with the causal cache of its own layers, so the output is bit for bit the
//! direct (unsharded, untiled) computation's. Each rank holds only its stages' activations and
//! cache; the owner (rank 0) also receives the last stage's frames.
//!
//! This module is what a model implements ([`PipelineOperator`]); the schedule (lockstep ticks,
//! hand-overs between neighbouring stages, the owner's sink) is the executor's. Which requests
//! run as a pipeline is model policy, in the adapters.

use std::ops::Range;

use vae_tensor::{Device, Tensor};

use crate::executor::OperatorError;
use crate::shard::StreamRuns;

/// The state of one rank's stage (its layers' causal cache, the frame it is at): the
/// operator's own, carried by the executor from run to run.
pub type StageState = Box<dyn std::any::Any + Send>;

/// A model's computation as a sequence of steps (layers or blocks) that a pipeline cuts into
/// contiguous stages, run one run (latent frame) at a time.
pub trait PipelineOperator {
    /// Checks the input; returns each step's relative cost for it (the stages are balanced
    /// on these) and the runs it makes. Runs on every rank, which must all agree.
    fn steps(&self, input: &Tensor) -> Result<PipelineSteps, OperatorError>;
    /// Starts a stage running `steps` on `input`: a fresh state.
    fn start_stage(&self, input: &Tensor, steps: Range<usize>) -> Result<StageState, OperatorError>;
    /// Runs `run` through the stage. `carried` is what the previous stage returned for this run
    /// (empty for the first stage, which reads `input`); the result goes to the next stage, or,
    /// from the last, is the run's output (one tensor, before [`finish`](Self::finish)).
    /// Tensors returned are on the host.
    fn exec_stage(
        &self,
        input: &Tensor,
        run: usize,
        state: &mut StageState,
        carried: Vec<Tensor>,
    ) -> Result<Vec<Tensor>, OperatorError>;
    /// Turns the last stage's output of one run into its output frames (unpatchify, clamp,
    /// ...). Runs on the owner only.
    fn finish(&self, output: Tensor) -> Result<Tensor, OperatorError>;
    /// The bytes of the weights `steps` use, for the report.
    fn stage_weight_bytes(&self, steps: Range<usize>) -> u64;
    /// The device the operator computes on.
    fn device(&self) -> Device;
}

/// What a pipelined computation is made of, for one input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PipelineSteps {
    /// Each step's relative cost (multiply-adds, say), in order.
    pub costs: Vec<u64>,
    /// The runs that go through the pipeline and the output frames they make.
    pub runs: StreamRuns,
}

/// One rank's part of a pipeline, for its report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PipelineStage {
    /// This rank's stage (its index), `None` on ranks beyond the stages.
    pub stage: Option<usize>,
    /// Stages in the pipeline.
    pub stages: usize,
    /// The model steps this stage runs.
    pub steps: Range<usize>,
    /// Steps of the whole model.
    pub total_steps: usize,
    /// Its share of the predicted cost, in parts per million.
    pub cost_share_ppm: u32,
    /// The bytes of its weights.
    pub weight_bytes: u64,
    /// Runs that went through it.
    pub runs: usize,
    /// Bytes it sent in hand-overs: to the next stage (from the last stage, to the owner),
    /// the one-byte empty messages of its idle ticks included.
    pub bytes_out: u64,
    /// The time it spent computing.
    pub busy: std::time::Duration,
    /// The time it spent in hand-overs (waiting for its neighbours, and the transfers).
    pub idle: std::time::Duration,
}
