//! The package's exceptions: `VaeParallelError` and one subclass per kind of failure
//! ([`vae_parallel::ErrorKind`]), each carrying the library's one-line message with the options
//! named as this package's keywords.

use pyo3::PyErr;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use vae_parallel::{Error, ErrorKind};

create_exception!(vae_parallel, VaeParallelError, PyException, "Every error this package raises.");
create_exception!(vae_parallel, InputError, VaeParallelError, "The input array does not fit the model.");
create_exception!(vae_parallel, ModelError, VaeParallelError, "The model directory cannot be loaded.");
create_exception!(vae_parallel, ConfigError, VaeParallelError, "An option is invalid or unsupported here.");
create_exception!(vae_parallel, ExecutionError, VaeParallelError, "A request failed while running.");
create_exception!(vae_parallel, GroupError, VaeParallelError, "The group of ranks could not be started.");

/// This package's keyword for an option the library names (`vae_parallel_mode` is `mode`).
fn keyword(name: &str) -> Option<String> {
    Some(
        match name {
            "vae_parallel_mode" => "mode",
            "vae_use_tiling" => "use_tiling",
            "vae_patch_parallel_size" => "ranks",
            other => other,
        }
        .to_string(),
    )
}

/// A library message with its options named as this package's keywords.
pub(crate) fn message(text: &str) -> String {
    vae_parallel::settings::rename_options(text, keyword)
}

/// The Python exception for a library error: one class per kind.
pub(crate) fn to_py(err: &Error) -> PyErr {
    let text = message(&err.to_line());
    // A file that cannot be read or written as asked is the input's fault, as the package has
    // always said.
    if matches!(err, Error::Io(_)) {
        return InputError::new_err(text);
    }
    match err.kind() {
        ErrorKind::InvalidInput | ErrorKind::Io => InputError::new_err(text),
        ErrorKind::InvalidOption | ErrorKind::Unsupported => ConfigError::new_err(text),
        ErrorKind::Model => ModelError::new_err(text),
        ErrorKind::Group => GroupError::new_err(text),
        _ => ExecutionError::new_err(text),
    }
}

/// A Python exception for an option this package checks itself.
pub(crate) fn config_error(text: impl Into<String>) -> PyErr {
    ConfigError::new_err(message(&text.into()))
}
