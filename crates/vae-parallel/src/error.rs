//! The facade's one error type, [`Error`], and its coarse classification, [`ErrorKind`].
//!
//! Every front end (the CLI, the Python package, a Rust engine, the service) reports failures
//! through it: `kind()` says what the caller did wrong (or what went wrong around it) without
//! matching on the layers' own errors, which stay reachable through the variants and
//! `source()`. Messages name options as the settings do (`` `shard_grid` ``,
//! `` `vae_parallel_mode` ``, see [`crate::settings`]); a front end maps those names to its own
//! spelling (the CLI to its flags, Python to its keywords) with [`crate::settings::rename_options`].

use vae_models::ModelError;
use vae_runtime::{FailureKind, RuntimeError};
use vae_transport::TransportError;

use crate::cost::CostError;
use crate::io::IoError;
use crate::launch::LaunchError;
use crate::local_ranks::LocalRanksError;
use crate::report::ReportError;

/// What kind of failure an [`Error`] is: what a caller branches on (Python raises one
/// exception class per kind; the service answers one HTTP status per kind).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The input tensor or file does not fit the model (shape, channels, values).
    InvalidInput,
    /// An option's value is invalid (a mode that does not exist, a grid of 0 rows, a size that
    /// is not a size).
    InvalidOption,
    /// A valid request this model, device or build cannot run (a mode the family has no
    /// strategy for, a memory cap nothing fits, bf16 on a CPU without AVX512-BF16).
    Unsupported,
    /// The model directory cannot be loaded (missing or malformed config or weights).
    Model,
    /// The group of ranks could not be formed (bad environment, a rank process that could not
    /// be started, a rendezvous that failed).
    Group,
    /// A request failed while it ran (a rank died, timed out, or was cancelled; a bug).
    Execution,
    /// The operating system refused to read or write a file.
    Io,
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::InvalidInput => "invalid input",
            Self::InvalidOption => "invalid option",
            Self::Unsupported => "unsupported",
            Self::Model => "model",
            Self::Group => "group",
            Self::Execution => "execution",
            Self::Io => "I/O",
        })
    }
}

/// Every error of the facade. Use [`Error::kind`] to branch; the variants hold the layer's own
/// error for callers that need its details.
///
/// ```
/// # let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../fixtures/autoencoder_kl/sd_like");
/// use vae_parallel::{Decode, Device, ErrorKind, Group, Tensor, Vae};
///
/// let vae = Vae::load(dir)?;
/// // Three channels where the model's latent has four: refused on every rank, before any work.
/// let wrong = Tensor::seeded_uniform([1, 3, 8, 8], 0, -1.0, 1.0, &Device::Cpu)?;
/// let err = Group::local(2)?.decode(&vae, &wrong, &Decode::default()).unwrap_err();
/// assert_eq!(err.kind(), ErrorKind::InvalidInput);
/// assert!(err.to_line().contains("latent"), "{err}");
/// // A missing model is a model error, naming the file.
/// let missing = Vae::load("/nonexistent/vae").unwrap_err();
/// assert_eq!(missing.kind(), ErrorKind::Model);
/// # Ok::<(), vae_parallel::Error>(())
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The model could not be loaded, or refused the request.
    #[error(transparent)]
    Model(ModelError),
    /// The cost model's settings are invalid, or (outside a request's agreement) it found
    /// nothing that fits.
    #[error(transparent)]
    Cost(#[from] CostError),
    /// The group refused the request, every rank alike, on rank 0's word: nothing fits the
    /// memory cap, or there is no cost model for the cap. The group stays usable.
    #[error(transparent)]
    Refused(CostError),
    /// The distributed run failed.
    #[error(transparent)]
    Runtime(RuntimeError),
    /// The group could not be joined, or failed outside a request.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// A tensor file could not be read or written.
    #[error(transparent)]
    Io(#[from] IoError),
    /// The ranks' reports could not be gathered.
    #[error(transparent)]
    Report(#[from] ReportError),
    /// Rank processes could not be started or supervised.
    #[error(transparent)]
    Launch(#[from] LaunchError),
    /// Local ranks could not be started (their threads, or the group's settings).
    #[error(transparent)]
    LocalRanks(#[from] LocalRanksError),
    /// An option's value is invalid; the message names the option.
    #[error("{0}")]
    InvalidOption(String),
    /// A rank's computation panicked (a bug); the other ranks were told.
    #[error("rank {rank} panicked: {message}")]
    Panicked {
        /// The rank.
        rank: usize,
        /// The panic's message.
        message: String,
    },
    /// A rank other than this process's result failed: its error, with the rank it failed on.
    #[error("rank {rank}: {source}")]
    OnRank {
        /// The rank.
        rank: usize,
        /// Its error.
        #[source]
        source: Box<Error>,
    },
}

/// The facade's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl From<ModelError> for Error {
    fn from(e: ModelError) -> Self {
        match e {
            ModelError::Runtime(e) => Self::Runtime(e),
            e => Self::Model(e),
        }
    }
}

impl From<RuntimeError> for Error {
    fn from(e: RuntimeError) -> Self {
        Self::Runtime(e)
    }
}

impl From<vae_tensor::TensorError> for Error {
    fn from(e: vae_tensor::TensorError) -> Self {
        Self::Model(ModelError::from(e))
    }
}

impl Error {
    /// An invalid option's error (the message names the option as the settings do).
    pub fn invalid_option(message: impl Into<String>) -> Self {
        Self::InvalidOption(message.into())
    }

    /// What kind of failure this is.
    pub fn kind(&self) -> ErrorKind {
        match self {
            // A device that cannot be used, or an element type it cannot compute in.
            Self::Model(ModelError::Tensor(
                vae_tensor::TensorError::DeviceUnavailable { .. } | vae_tensor::TensorError::UnsupportedDType { .. },
            )) => ErrorKind::Unsupported,
            Self::Model(ModelError::InvalidInput(_) | ModelError::Tensor(_)) => ErrorKind::InvalidInput,
            Self::Model(ModelError::Unsupported(_)) => ErrorKind::Unsupported,
            Self::Model(ModelError::Sink(_)) => ErrorKind::Execution,
            Self::Model(_) => ErrorKind::Model,
            Self::Cost(CostError::Profile { .. } | CostError::Size { .. }) => ErrorKind::InvalidOption,
            Self::Cost(_) | Self::Refused(_) => ErrorKind::Unsupported,
            Self::Runtime(RuntimeError::Config(_)) => ErrorKind::InvalidOption,
            Self::Runtime(RuntimeError::InputMismatch { .. }) => ErrorKind::InvalidInput,
            // A model's refusal inside the executor reaches every rank with its kind; any other
            // operator failure is an execution error.
            Self::Runtime(RuntimeError::Operator { kind: FailureKind::InvalidInput, .. }) => ErrorKind::InvalidInput,
            Self::Runtime(RuntimeError::Operator { kind: FailureKind::Unsupported, .. }) => ErrorKind::Unsupported,
            Self::Runtime(_) => ErrorKind::Execution,
            // A group's settings (its environment, a size, an address) that cannot form one.
            Self::Transport(TransportError::InvalidArgument(_)) => ErrorKind::InvalidOption,
            Self::Transport(TransportError::Unavailable(_)) => ErrorKind::Unsupported,
            // Forming the group failed.
            Self::Transport(TransportError::Rendezvous(_) | TransportError::Io { .. }) => ErrorKind::Group,
            // A formed group failed while it worked: a peer died, timed out or was aborted.
            Self::Transport(_) => ErrorKind::Execution,
            Self::Launch(_) | Self::LocalRanks(_) => ErrorKind::Group,
            Self::Io(IoError::Os { .. }) => ErrorKind::Io,
            Self::Io(IoError::Unsupported(_)) => ErrorKind::Unsupported,
            Self::Io(_) => ErrorKind::InvalidInput,
            Self::Report(_) | Self::Panicked { .. } => ErrorKind::Execution,
            Self::InvalidOption(_) => ErrorKind::InvalidOption,
            Self::OnRank { source, .. } => source.kind(),
        }
    }

    /// True when every rank of the group already knows of this error: an agreed error (each
    /// rank returns it for the same request) or a transport error (it came from the group).
    /// Any other error happened on one rank alone, and that rank must abort the group so that
    /// the others stop waiting for it; aborting on a known one would race the other ranks' own
    /// report of it.
    pub fn known_to_all_ranks(&self) -> bool {
        match self {
            Self::Runtime(r) => r.is_agreed() || matches!(r, RuntimeError::Transport(_)),
            Self::Transport(_) => true,
            // Rank 0's decision, broadcast to every rank.
            Self::Refused(_) => true,
            Self::OnRank { source, .. } => source.known_to_all_ranks(),
            _ => false,
        }
    }

    /// The message and its causes on one line, each cause once (as the CLI prints errors).
    pub fn to_line(&self) -> String {
        one_line(self)
    }
}

/// An error's message and its causes on one line, a cause whose text the line already holds
/// left out (an error that prints its source as well as returning it would otherwise say it
/// twice: "x: No such file (os error 2): No such file (os error 2)").
pub fn one_line(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut cause = err.source();
    while let Some(c) = cause {
        let part = c.to_string();
        if !text.contains(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
        cause = c.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_follow_the_layers_errors() {
        assert_eq!(Error::from(ModelError::InvalidInput("x".into())).kind(), ErrorKind::InvalidInput);
        assert_eq!(Error::from(ModelError::Unsupported("x".into())).kind(), ErrorKind::Unsupported);
        assert_eq!(Error::invalid_option("`shard_grid` x").kind(), ErrorKind::InvalidOption);
        let operator = RuntimeError::Operator {
            stage: vae_runtime::Stage::Shard,
            rank: 1,
            kind: FailureKind::InvalidInput,
            message: "bad".into(),
        };
        let on_rank = Error::OnRank { rank: 1, source: Box::new(Error::from(operator)) };
        assert_eq!(on_rank.kind(), ErrorKind::InvalidInput);
        assert!(on_rank.known_to_all_ranks());
        assert!(!Error::Panicked { rank: 0, message: "x".into() }.known_to_all_ranks());
    }

    #[test]
    fn a_cause_the_message_already_holds_is_said_once() {
        let os = std::io::Error::new(std::io::ErrorKind::NotFound, "No such file or directory (os error 2)");
        let err = Error::Io(IoError::Os { path: "z.npy".into(), source: os });
        assert_eq!(err.to_line(), "z.npy: No such file or directory (os error 2)");
    }
}
