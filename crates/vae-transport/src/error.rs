//! The transport error type.

use std::time::Duration;

/// Everything that can go wrong in a collective. Errors are values: no backend panics on a
/// failed peer, a timeout or a protocol mismatch.
///
/// Once a communicator has returned an error it is *poisoned*: the group is out of step (even
/// an invalid argument leaves the other ranks inside a collective this rank will not join), so
/// every later call returns [`TransportError::Poisoned`] wrapping the first error, and every
/// other rank learns of the failure within the backend's failure timeout.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransportError {
    /// Another rank failed (returned an error, panicked, died or went silent).
    #[error("rank {rank} failed: {reason}")]
    PeerFailed {
        /// The rank that failed.
        rank: usize,
        /// What that rank (or its connection) reported.
        reason: String,
    },
    /// A rank left the group cleanly while this rank still waited for it.
    #[error("rank {rank} left the group while rank {waiting} was waiting for it in {op}")]
    PeerLeft {
        /// The rank that left.
        rank: usize,
        /// This rank.
        waiting: usize,
        /// The operation that was waiting.
        op: &'static str,
    },
    /// A live peer did not reach the same collective in time.
    #[error("rank {waiting} timed out after {waited:?} waiting for rank {rank} in {op}")]
    Timeout {
        /// The rank that did not answer.
        rank: usize,
        /// This rank.
        waiting: usize,
        /// The operation.
        op: &'static str,
        /// How long this rank waited.
        waited: Duration,
    },
    /// Two ranks called different collectives (or the same one with a different root, element
    /// type or sequence number): the program is not in lockstep.
    #[error("collective mismatch: rank {local_rank} called {local}, rank {rank} called {remote}")]
    CollectiveMismatch {
        /// This rank.
        local_rank: usize,
        /// The peer that disagrees.
        rank: usize,
        /// What this rank called.
        local: String,
        /// What the peer called.
        remote: String,
    },
    /// Ranks passed buffers of different lengths to a collective that needs equal lengths.
    #[error("length mismatch in {op}: rank {local_rank} has {local} bytes, rank {rank} has {remote}")]
    LengthMismatch {
        /// The operation.
        op: &'static str,
        /// This rank.
        local_rank: usize,
        /// This rank's byte count.
        local: usize,
        /// The peer.
        rank: usize,
        /// The peer's byte count.
        remote: usize,
    },
    /// A caller error detected before anything was sent (bad root, peer, size).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// This rank aborted the group (see [`crate::Communicator::abort`]).
    #[error("rank {rank} aborted: {reason}")]
    Aborted {
        /// This rank.
        rank: usize,
        /// The reason given to `abort`.
        reason: String,
    },
    /// The communicator already failed earlier; the first error is inside.
    #[error("communicator unusable after an earlier failure: {0}")]
    Poisoned(Box<TransportError>),
    /// An I/O error on a link, or while setting one up.
    #[error("I/O error ({context}): {message}")]
    Io {
        /// The peer on the other side, when there is one.
        rank: Option<usize>,
        /// What was being done.
        context: String,
        /// The operating system's message.
        message: String,
    },
    /// The multi-process rendezvous failed (bad configuration, rejected peer, timeout).
    #[error("rendezvous failed: {0}")]
    Rendezvous(String),
    /// A backend that is not built in or not usable on this machine.
    #[error("backend unavailable: {0}")]
    Unavailable(String),
}

impl TransportError {
    /// The rank this error blames, when it names one (looking through [`Self::Poisoned`]).
    pub fn failed_rank(&self) -> Option<usize> {
        match self {
            Self::PeerFailed { rank, .. }
            | Self::PeerLeft { rank, .. }
            | Self::Timeout { rank, .. }
            | Self::CollectiveMismatch { rank, .. }
            | Self::LengthMismatch { rank, .. }
            | Self::Aborted { rank, .. } => Some(*rank),
            Self::Io { rank, .. } => *rank,
            Self::Poisoned(inner) => inner.failed_rank(),
            Self::InvalidArgument(_) | Self::Rendezvous(_) | Self::Unavailable(_) => None,
        }
    }

    /// The first error, looking through [`Self::Poisoned`].
    pub fn root_cause(&self) -> &TransportError {
        match self {
            Self::Poisoned(inner) => inner.root_cause(),
            other => other,
        }
    }

    pub(crate) fn io(rank: Option<usize>, context: impl Into<String>, err: &std::io::Error) -> Self {
        Self::Io { rank, context: context.into(), message: err.to_string() }
    }
}

/// Result alias of this crate.
pub type Result<T, E = TransportError> = std::result::Result<T, E>;
