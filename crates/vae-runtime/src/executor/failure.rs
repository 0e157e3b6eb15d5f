//! What kind of failure an operator error is, carried with it to every rank: an operator
//! wraps its error in [`Classified`], the executor reads the kind from it, and
//! [`RuntimeError::Operator`](crate::RuntimeError::Operator) hands it to every rank next to the
//! message, so that a caller can tell a bad request from a failure without parsing text.

use std::fmt;

use super::OperatorError;
use crate::{RuntimeError, Stage};

/// What kind of failure an operator error is: whose fault it is, and so what a caller can do
/// about it (fix the request, choose another mode, or report a failure).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum FailureKind {
    /// The request does not fit the model: its shape, size or element type.
    InvalidInput,
    /// The model cannot do what was asked (a parallel mode, say), whatever the input.
    Unsupported,
    /// Anything else: the computation itself failed (and every error that says nothing more).
    #[default]
    Failed,
}

impl FailureKind {
    /// The kind's byte on the wire.
    pub(crate) fn code(self) -> u8 {
        match self {
            Self::InvalidInput => 0,
            Self::Unsupported => 1,
            Self::Failed => 2,
        }
    }

    /// The kind a byte from [`Self::code`] names; `None` for any other byte.
    pub(crate) fn from_code(code: u8) -> Option<Self> {
        match code {
            0 => Some(Self::InvalidInput),
            1 => Some(Self::Unsupported),
            2 => Some(Self::Failed),
            _ => None,
        }
    }
}

/// An operator error with its [`FailureKind`]: what an operator returns (boxed, as any
/// [`OperatorError`]) so that the kind reaches every rank with the message. An error that is
/// not wrapped is [`FailureKind::Failed`].
///
/// It is invisible in the text: `Display` is the wrapped error's and `source()` is the wrapped
/// error's source, so the message every rank reports is the same with or without it.
#[derive(Debug)]
pub struct Classified {
    kind: FailureKind,
    error: OperatorError,
}

impl Classified {
    /// `error`, classified as `kind`.
    pub fn new(kind: FailureKind, error: impl Into<OperatorError>) -> Self {
        Self { kind, error: error.into() }
    }

    /// The kind of failure.
    pub fn kind(&self) -> FailureKind {
        self.kind
    }

    /// The wrapped error.
    pub fn error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        self.error.as_ref()
    }

    /// The wrapped error, unwrapped.
    pub fn into_error(self) -> OperatorError {
        self.error
    }
}

impl fmt::Display for Classified {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.error, f)
    }
}

impl std::error::Error for Classified {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.error.source()
    }
}

/// An operator failure as the executor carries it between ranks: its kind and its message
/// (with its causes).
#[derive(Debug, Clone)]
pub(crate) struct Failure {
    pub(crate) kind: FailureKind,
    pub(crate) message: String,
}

impl Failure {
    /// A failure of `kind`.
    pub(crate) fn new(kind: FailureKind, message: impl Into<String>) -> Self {
        Self { kind, message: message.into() }
    }

    /// The error every rank reports for this failure at `stage` on `rank`.
    pub(crate) fn at(self, stage: Stage, rank: usize) -> RuntimeError {
        RuntimeError::Operator { stage, rank, kind: self.kind, message: self.message }
    }
}

/// What the executor finds wrong itself (an output of the wrong rank, a band that cannot be
/// assembled) is a [`FailureKind::Failed`].
impl From<String> for Failure {
    fn from(message: String) -> Self {
        Self::new(FailureKind::Failed, message)
    }
}
