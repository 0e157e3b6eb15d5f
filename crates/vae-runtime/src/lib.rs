//! Mechanism for distributed VAE work, shared by every model family.
//!
//! [`DistributedVaeExecutor::run`] runs one request of a model over the ranks of a
//! [`vae_transport::Communicator`], as the [`Job`] says: [`Job::tiles`] a [`TileOperator`]
//! (split / exec / merge: every rank splits, assigns tiles with LPT, executes its own, and the
//! owner merges what it gathered), [`Job::bands`] a [`ShardOperator`] with the input cut into
//! bands, one per rank, with halo exchanges between neighbours ([`shard`]), [`Job::blocks`]
//! the same over a 2-D grid of blocks, [`Job::pipeline`] a [`PipelineOperator`]'s layers as
//! stages, one per rank, over runs of frames ([`pipeline`]); the [`Output`] is returned to the
//! ranks a placement names or streamed into a sink ([`stream`]). [`stitch`] is the
//! diffusers-style blend-and-crop merge that the tiled VAEs share; [`progress`] carries how far
//! a request has got to a progress bar. Model *policy* (which strategy, which tile sizes, who
//! gets the output) lives in the model adapters, never here.

pub mod cancel;
mod error;
mod executor;
mod mode;
pub mod pipeline;
pub mod progress;
pub mod shard;
pub mod stitch;
pub mod stream;
#[cfg(feature = "synthetic")]
pub mod synthetic;

pub use error::{RuntimeError, Stage};
pub use executor::job;
pub use executor::{
    Classified, DistributedVaeExecutor, ExecOutput, FailureKind, Job, OperatorError, Output, OutputPlacement,
    PhaseTimings, Predicted, RankReport, StrategyReport, TileMap, TileMerge, TileOperator, TilePlan, TileStream,
    execute_serial,
};
pub use mode::{ParallelMode, Strategy, StrategyChoice, UnknownMode, whole_bands};
pub use pipeline::{PipelineOperator, PipelineStage, PipelineSteps, StageState};
pub use progress::{Progress, ProgressScope, ProgressSink};
pub use shard::{
    HaloOverlap, HaloPiece, HaloWindow, ShardContext, ShardGeometry, ShardOperator, ShardTraffic, StreamRuns,
};
pub use stitch::{StitchLayout, StitchSpec, Stitcher};
pub use stream::{CollectFrames, FrameFeed, FrameSink, OnOwnThread, SinkError};
pub use vae_planner::ShardAxis;
