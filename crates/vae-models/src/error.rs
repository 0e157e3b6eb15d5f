//! The model error type.

use std::path::PathBuf;

use vae_runtime::{Classified, FailureKind, RuntimeError};
use vae_tensor::TensorError;

/// What can go wrong loading or running a VAE.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// `config.json` (or an index file) is not what diffusers writes.
    #[error("{path}: {message}")]
    Config {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A weights file is not a readable safetensors file.
    #[error("{path}: not a valid safetensors file: {message}")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        message: String,
    },
    /// The model needs a weight the checkpoint lacks.
    #[error("missing weight {key:?} (expected shape {expected:?})")]
    MissingWeight {
        /// The state-dict key.
        key: String,
        /// The shape the model needs.
        expected: Vec<usize>,
    },
    /// The checkpoint has weights the model does not use.
    #[error("unexpected weight(s) in the checkpoint: {}", keys.join(", "))]
    UnexpectedWeights {
        /// The keys, sorted.
        keys: Vec<String>,
    },
    /// A weight has the wrong shape.
    #[error("weight {key:?} has shape {found:?}, the model needs {expected:?}")]
    WeightShape {
        /// The state-dict key.
        key: String,
        /// What the model needs.
        expected: Vec<usize>,
        /// What the checkpoint has.
        found: Vec<usize>,
    },
    /// A weight stored in an element type that is not a float type.
    #[error("weight {key:?} is stored as {dtype}, expected f32, f16 or bf16")]
    WeightDtype {
        /// The state-dict key.
        key: String,
        /// The stored type.
        dtype: String,
    },
    /// A weight holds NaN or infinite values.
    #[error("weight {key:?} has {count} non-finite value(s) (the first is {first}): the checkpoint is corrupt")]
    NonFiniteWeight {
        /// The state-dict key.
        key: String,
        /// How many.
        count: usize,
        /// The first one.
        first: f32,
    },
    /// The input does not fit the model (channels, rank, non-finite values, ...).
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// A request the family cannot serve (e.g. a parallel mode it does not support).
    #[error("{0}")]
    Unsupported(String),
    /// A tensor op failed.
    #[error(transparent)]
    Tensor(#[from] TensorError),
    /// The sink of a streaming decode could not take the frames it was given.
    #[error("passing on decoded frames: {0}")]
    Sink(vae_runtime::SinkError),
    /// The distributed runtime failed.
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
}

/// A model error as an operator returns it to the distributed executor, with the kind of
/// failure it is, so that every rank can tell a request that does not fit the model
/// ([`FailureKind::InvalidInput`]: a bad input, or a tensor op that refused its shapes) or a
/// request the model cannot serve ([`FailureKind::Unsupported`]) from a failure.
impl From<ModelError> for Classified {
    fn from(e: ModelError) -> Self {
        let kind = match &e {
            ModelError::InvalidInput(_) | ModelError::Tensor(_) => FailureKind::InvalidInput,
            ModelError::Unsupported(_) => FailureKind::Unsupported,
            _ => FailureKind::Failed,
        };
        Classified::new(kind, e)
    }
}

/// Result alias of this crate.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use std::error::Error;

    use vae_tensor::Shape;

    use super::*;

    #[test]
    fn a_model_error_is_classified_by_what_it_says_about_the_request() {
        let shapes = TensorError::ShapeMismatch { op: "add", lhs: Shape::new(vec![2]), rhs: Shape::new(vec![3]) };
        let cases = [
            (ModelError::InvalidInput("3 channels, 16 expected".into()), FailureKind::InvalidInput),
            (ModelError::Tensor(shapes), FailureKind::InvalidInput),
            (ModelError::Unsupported("no shard here".into()), FailureKind::Unsupported),
            (ModelError::MissingWeight { key: "conv.weight".into(), expected: vec![4] }, FailureKind::Failed),
            (ModelError::Runtime(RuntimeError::Config("bad".into())), FailureKind::Failed),
        ];
        for (err, kind) in cases {
            let (text, source) = (err.to_string(), err.source().map(ToString::to_string));
            let classified = Classified::from(err);
            assert_eq!(classified.kind(), kind, "{text}");
            assert_eq!(classified.to_string(), text, "the text is the model error's");
            assert_eq!(classified.source().map(ToString::to_string), source);
        }
    }
}
