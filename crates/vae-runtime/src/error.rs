//! The runtime error type.

use std::fmt;

use vae_planner::PlanError;
use vae_tensor::TensorError;
use vae_transport::TransportError;

use crate::FailureKind;

/// The operator stage an error came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Splitting the input into tiles.
    Split,
    /// Executing one tile.
    Exec {
        /// The tile.
        tile_id: usize,
    },
    /// Merging the tiles (or assembling the bands) on the owner.
    Merge,
    /// Computing a band of a spatial-shard request.
    Shard,
    /// Running one stage of a pipeline.
    Pipeline {
        /// The stage.
        stage: usize,
    },
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Split => f.write_str("split"),
            Self::Exec { tile_id } => write!(f, "exec of tile {tile_id}"),
            Self::Merge => f.write_str("merge"),
            Self::Shard => f.write_str("sharded computation"),
            Self::Pipeline { stage } => write!(f, "pipeline stage {stage}"),
        }
    }
}

/// Errors of a distributed request. Every error that is not a transport failure is agreed
/// on: all ranks of the group return the same error, and the group stays usable for the next
/// request.
#[derive(Debug, Clone, thiserror::Error)]
pub enum RuntimeError {
    /// The transport failed (a peer died, timed out, or the ranks fell out of step). The
    /// communicator is unusable afterwards.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// A tensor op failed on this rank.
    #[error(transparent)]
    Tensor(#[from] TensorError),
    /// A plan was invalid on this rank.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The ranks do not hold the same input.
    #[error("ranks hold different inputs (content hash per rank: {hashes:x?}); every rank must pass the same tensor")]
    InputMismatch {
        /// Each rank's input hash, in rank order.
        hashes: Vec<u64>,
    },
    /// The model operator failed on some rank; every rank reports it.
    #[error("{stage} failed on rank {rank}: {message}")]
    Operator {
        /// Where it failed.
        stage: Stage,
        /// The rank it failed on.
        rank: usize,
        /// What kind of failure it is (from the operator's [`Classified`](crate::Classified)
        /// error; [`FailureKind::Failed`] when the operator did not say, or the executor
        /// failed around it).
        kind: FailureKind,
        /// The operator's error, with its causes.
        message: String,
    },
    /// Invalid executor configuration.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The ranks disagree about the request (a non-deterministic split, tiles lost or
    /// duplicated). Found from data every rank gathered, so every rank reports it.
    #[error("ranks disagree: {0}")]
    Inconsistent(String),
    /// A message from a peer could not be read (a bug, or mixed versions).
    #[error("protocol error: {0}")]
    Protocol(String),
}

impl RuntimeError {
    /// True when every rank of the group returns this error for the same request (so nobody
    /// needs to be told about it).
    pub fn is_agreed(&self) -> bool {
        matches!(self, Self::InputMismatch { .. } | Self::Operator { .. } | Self::Config(_) | Self::Inconsistent(_))
    }

    /// The kind of an operator failure ([`Self::Operator`]); `None` for every other error.
    pub fn failure_kind(&self) -> Option<FailureKind> {
        match self {
            Self::Operator { kind, .. } => Some(*kind),
            _ => None,
        }
    }
}

impl From<vae_transport::wire::WireError> for RuntimeError {
    fn from(e: vae_transport::wire::WireError) -> Self {
        Self::Protocol(e.to_string())
    }
}
