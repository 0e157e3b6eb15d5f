//! Tensors from the bytes a safetensors file stores. Model weights and input latents come as
//! f32, f16 or bf16 elements; this is the one place that turns them into an f32 tensor, so the
//! weight loader and the input reader read every stored type alike.

use safetensors::Dtype;
use safetensors::tensor::TensorView;

use crate::{Device, Tensor, TensorError};

/// Why a stored tensor did not become a [`Tensor`].
#[derive(Debug, thiserror::Error)]
pub enum SafetensorsError {
    /// The elements are not of a float type read here (f32, f16 or bf16).
    #[error("element type {dtype} is not a float type (expected F32, F16 or BF16)")]
    NotFloat {
        /// The stored element type.
        dtype: Dtype,
    },
    /// The values did not make a tensor of the stored shape.
    #[error(transparent)]
    Tensor(#[from] TensorError),
}

impl Tensor {
    /// The f32 tensor on the CPU that a safetensors view holds: f32 elements as stored, f16 and
    /// bf16 ones widened exactly (every value is an f32 value). Any other element type is
    /// [`SafetensorsError::NotFloat`].
    pub fn from_safetensors_view(view: &TensorView<'_>) -> Result<Tensor, SafetensorsError> {
        let bytes = view.data();
        // A view holds exactly its elements' bytes, so nothing is left over.
        let values: Vec<f32> = match view.dtype() {
            Dtype::F32 => bytes.as_chunks::<4>().0.iter().map(|c| f32::from_le_bytes(*c)).collect(),
            Dtype::F16 => bytes.as_chunks::<2>().0.iter().map(|c| half::f16::from_le_bytes(*c).to_f32()).collect(),
            Dtype::BF16 => bytes.as_chunks::<2>().0.iter().map(|c| half::bf16::from_le_bytes(*c).to_f32()).collect(),
            dtype => return Err(SafetensorsError::NotFloat { dtype }),
        };
        Ok(Tensor::from_vec(values, view.shape().to_vec(), &Device::Cpu)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(dtype: Dtype, shape: &[usize], bytes: &[u8]) -> Result<Tensor, SafetensorsError> {
        Tensor::from_safetensors_view(&TensorView::new(dtype, shape.to_vec(), bytes).unwrap())
    }

    #[test]
    fn every_float_type_becomes_the_same_f32_values() {
        let values = [1.0f32, -0.5, 3.25, 0.0, 65504.0, -2.0f32.powi(-14)];
        let f32_bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let f16_bytes: Vec<u8> = values.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect();
        let bf16_bytes: Vec<u8> = values.iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect();
        for (dtype, bytes) in [(Dtype::F32, f32_bytes), (Dtype::F16, f16_bytes), (Dtype::BF16, bf16_bytes)] {
            let t = view(dtype, &[2, 3], &bytes).unwrap();
            assert_eq!(t.dims(), &[2, 3], "{dtype}");
            let want: Vec<f32> = match dtype {
                Dtype::BF16 => values.iter().map(|v| half::bf16::from_f32(*v).to_f32()).collect(),
                _ => values.to_vec(),
            };
            assert_eq!(t.to_vec_f32().unwrap(), want, "{dtype}");
        }
    }

    #[test]
    fn other_element_types_are_refused_by_name() {
        let err = view(Dtype::I32, &[2], &[0; 8]).unwrap_err();
        assert!(matches!(err, SafetensorsError::NotFloat { dtype: Dtype::I32 }), "{err}");
        assert_eq!(err.to_string(), "element type I32 is not a float type (expected F32, F16 or BF16)");
    }
}
