//! Input checks every family shares.

use vae_tensor::Tensor;

use crate::{ModelError, Result};

/// An error naming how many values of `what` are NaN or infinite and where the first is: such
/// an input would decode to garbage without a word.
pub(crate) fn check_finite(t: &Tensor, what: &str) -> Result<()> {
    let values = t.as_slice_f32()?;
    let Some(first) = values.iter().position(|v| !v.is_finite()) else { return Ok(()) };
    let count = values.iter().filter(|v| !v.is_finite()).count();
    let strides = t.shape().strides();
    let index: Vec<usize> = strides.iter().zip(t.dims()).map(|(s, n)| (first / s) % n).collect();
    Err(ModelError::InvalidInput(format!(
        "{what} has {count} non-finite value(s); the first is {} at index {index:?}",
        values[first]
    )))
}
