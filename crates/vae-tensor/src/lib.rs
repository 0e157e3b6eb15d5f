//! Tensors and the ops vae-parallel needs, on a CPU backend now and shaped for a CUDA backend.
//!
//! Tensors are dense and row-major (NCHW for images, NCTHW for video, as diffusers). A
//! [`Tensor`] owns its storage; ops return new tensors, except the few in-place ones that the
//! diffusers semantics need (the tile blend writes into the current tile). Storage is an enum
//! over backends so that the layers above never name one.

mod device;
mod error;
mod shape;
mod tensor;

pub use device::{DType, Device};
pub use error::{Result, TensorError};
pub use shape::Shape;
pub use tensor::Tensor;
