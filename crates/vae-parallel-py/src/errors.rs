//! The package's exceptions: `VaeParallelError` and one subclass per kind of failure, each
//! carrying the CLI's one-line message.

use pyo3::PyErr;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use vae_parallel::engine::EngineError;
use vae_parallel::models::ModelError as VaeModelError;
use vae_parallel::runtime::{FailureKind, RuntimeError};

create_exception!(vae_parallel, VaeParallelError, PyException, "Every error this package raises.");
create_exception!(vae_parallel, InputError, VaeParallelError, "The input array does not fit the model.");
create_exception!(vae_parallel, ModelError, VaeParallelError, "The model directory cannot be loaded.");
create_exception!(vae_parallel, ConfigError, VaeParallelError, "An option is invalid or unsupported here.");
create_exception!(vae_parallel, ExecutionError, VaeParallelError, "A request failed while running.");
create_exception!(vae_parallel, GroupError, VaeParallelError, "The group of ranks could not be started.");

/// An error's message and its causes on one line, each cause once (as the CLI prints it).
pub(crate) fn one_line(err: &dyn std::error::Error) -> String {
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

/// The Python exception for an engine error.
pub(crate) fn engine_error(err: &EngineError) -> PyErr {
    let text = one_line(err);
    match err {
        EngineError::Model(VaeModelError::InvalidInput(_) | VaeModelError::Tensor(_)) => InputError::new_err(text),
        EngineError::Model(VaeModelError::Unsupported(_)) => ConfigError::new_err(text),
        EngineError::Model(VaeModelError::Sink(_)) => ExecutionError::new_err(text),
        EngineError::Model(_) => ModelError::new_err(text),
        EngineError::Cost(_) => ConfigError::new_err(text),
        EngineError::Runtime(RuntimeError::Config(_)) => ConfigError::new_err(text),
        EngineError::Runtime(RuntimeError::InputMismatch { .. }) => InputError::new_err(text),
        // A model's refusal inside the executor reaches every rank with its kind; any other
        // operator failure is an execution error.
        EngineError::Runtime(RuntimeError::Operator { kind: FailureKind::InvalidInput, .. }) => {
            InputError::new_err(text)
        }
        EngineError::Runtime(RuntimeError::Operator { kind: FailureKind::Unsupported, .. }) => {
            ConfigError::new_err(text)
        }
        EngineError::Runtime(_) => ExecutionError::new_err(text),
    }
}

pub(crate) fn config_error(err: impl std::fmt::Display) -> PyErr {
    ConfigError::new_err(err.to_string())
}
