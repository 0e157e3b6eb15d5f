//! Mechanism for distributed VAE work, shared by every model family.
//!
//! [`DistributedVaeExecutor`] runs a model's [`TileOperator`] (split / exec / merge) over the
//! ranks of a [`vae_transport::Communicator`]: every rank splits, assigns tiles with LPT,
//! executes its own, and the owner merges what it gathered. [`DistributedVaeExecutor::execute_sharded`]
//! runs a model's [`ShardOperator`] instead: the input cut into bands, one per rank, with halo
//! exchanges between neighbours ([`shard`]), or over a 2-D grid of blocks
//! ([`DistributedVaeExecutor::execute_sharded_blocks`]); [`DistributedVaeExecutor::execute_pipeline`]
//! runs a [`PipelineOperator`]'s layers as stages, one per rank, over runs of frames
//! ([`pipeline`]). [`stitch`] is the diffusers-style
//! blend-and-crop merge that the tiled VAEs share; [`progress`] carries how far a request has
//! got to a progress bar. Model *policy* (which strategy, which tile sizes, who gets the output)
//! lives in the model adapters, never here.

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
pub use executor::{
    Classified, DistributedVaeExecutor, ExecOutput, FailureKind, OperatorError, OutputPlacement, PhaseTimings,
    Predicted, RankReport, StrategyReport, TileMap, TileMerge, TileOperator, TilePlan, TileStream, execute_serial,
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
