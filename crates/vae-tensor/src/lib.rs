//! Tensors and the ops vae-parallel needs, on the CPU and (feature `cuda`) on CUDA devices.
//!
//! Tensors are dense and row-major (NCHW for images, NCTHW for video, as diffusers). A
//! [`Tensor`] owns its storage; ops return new tensors, except the few in-place ones that the
//! diffusers semantics need (the tile blend writes into the current tile) or that save a copy
//! on the hot path (`*_inplace`, [`Tensor::add_assign`]). Storage is an enum over backends so
//! that the layers above never name one.
//!
//! The ops (convolution, group norm, attention, matmul, element-wise and layout ops) follow
//! PyTorch's semantics in f32; every buffer is charged to the allocating thread's
//! [`memory`] counters.

pub mod abi;
mod backend;
mod boxes;
#[cfg(feature = "cuda")]
pub mod cuda;
mod device;
pub mod dlpack;
mod error;
#[cfg(feature = "cuda")]
mod kernel_args;
pub mod memory;
mod ops;
pub mod process;
pub mod profile;
pub mod recycle;
mod shape;
mod stored;
mod tensor;

pub use device::{CpuBf16Scope, DType, Device, DeviceMemory, StreamScope, Tf32Scope};
pub use error::{Result, TensorError};
pub use ops::conv::{Conv2dParams, ConvTarget, conv_windows_in_place, with_packed_weights};
pub use ops::group_stats::{GroupExtrema, GroupMoments, GroupPartial};
pub use ops::simd::cpu_isa_name;
pub use ops::video::Conv3dParams;
pub use shape::Shape;
pub use stored::SafetensorsError;
pub use tensor::{BoxOf, Tensor};
