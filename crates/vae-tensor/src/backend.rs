//! The device backend as the tensor sees it: the op set a device storage implements (one trait
//! per concern, [`DeviceStore`] … [`DeviceAttention`]) and [`DeviceStorage`], the storage of a
//! device tensor in every build.
//!
//! A `Tensor` method validates its arguments once, on the host, then dispatches on its storage:
//! the CPU body, or the device trait's method. With the `cuda` feature the device storage is
//! the CUDA backend's; without it, an uninhabited stand-in, so no op needs a `cfg` and the
//! compiler checks every device call in both builds. What a device backend cannot do is
//! decided in its trait impl, in code, as a typed error ([`no_device_path`]), not discovered
//! when a host-only body meets device memory.

use crate::abi::ConvGeom;
use crate::{DType, Device, Result, TensorError};

#[cfg(feature = "cuda")]
pub(crate) use crate::cuda::backend::CudaStorage as DeviceStorage;
#[cfg(not(feature = "cuda"))]
pub(crate) use stand_in::NoDevice as DeviceStorage;

/// The error of an op a device backend does not run: the tensor must come to the CPU first.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // only the CUDA backend lacks ops
pub(crate) fn no_device_path(op: &'static str, ordinal: usize) -> TensorError {
    TensorError::DeviceUnavailable {
        device: Device::Cuda(ordinal),
        reason: format!("{op} has no CUDA path; copy the tensor with to_device(Cpu)"),
    }
}

// The op set of a device storage, by concern: one trait per `kernels-cu/` file, each
// implemented in the CUDA backend's launcher file of that name. Arguments were checked by the
// `Tensor` method (shapes, devices, parameters); extents arrive flattened as the kernels take
// them.

/// Device memory: allocation, transfers, identity.
pub(crate) trait DeviceStore: Sized {
    /// Zeros of `dtype` on device `ordinal`.
    fn zeros(ordinal: usize, len: usize, dtype: DType) -> Result<Self>;
    /// f32 host values on device `ordinal`.
    fn upload(ordinal: usize, host: &[f32]) -> Result<Self>;
    /// The values as f32 on the host (bf16 widened exactly).
    fn download(&self) -> Result<Vec<f32>>;
    /// The device ordinal.
    fn ordinal(&self) -> usize;
    /// The element type.
    fn dtype(&self) -> DType;
    /// The address of the elements once every queued write finished.
    fn settled_address(&self) -> Result<u64>;
    /// The address once every queued read and write finished.
    fn settled_address_mut(&mut self) -> Result<u64>;
    /// Storage of the same type and device, contents undefined.
    fn uninit_like(&self, len: usize) -> Result<Self>;
}

/// Element-wise ops and casts.
pub(crate) trait DeviceElementwise: Sized {
    /// A copy in `dtype`.
    fn to_dtype(&self, dtype: DType) -> Result<Self>;
    /// `self + other`.
    fn add(&self, other: &Self) -> Result<Self>;
    /// `x · mul + add`, rounded after each operation.
    fn affine(&self, mul: f32, add: f32) -> Result<Self>;
    /// `x · factor`, in place.
    fn mul_scalar_inplace(&mut self, factor: f32) -> Result<()>;
    /// `x / divisor`, a true division.
    fn div_scalar(&self, divisor: f32) -> Result<Self>;
    /// `x + value`.
    fn add_scalar(&self, value: f32) -> Result<Self>;
    /// `x · scale[c] + shift[c]` over `[batch, channels, inner]`.
    fn channel_affine(&self, scale: &[f32], shift: &[f32], dims: [usize; 3]) -> Result<Self>;
    /// `(x − mean[c]) / std[c]` over `[batch, channels, inner]`.
    fn channel_normalize(&self, mean: &[f32], std: &[f32], dims: [usize; 3]) -> Result<Self>;
    /// SiLU.
    fn silu(&self) -> Result<Self>;
    /// SiLU in place.
    fn silu_inplace(&mut self) -> Result<()>;
    /// `torch.clamp` in place.
    fn clamp_inplace(&mut self, lo: f32, hi: f32) -> Result<()>;
}

/// Normalisations, each with an optional fused SiLU.
pub(crate) trait DeviceNorm: Sized {
    /// Wan's channel RMS norm over `[batch, channels, inner]`.
    fn rms_norm_channels(
        &self,
        gamma: &Self,
        bias: Option<&Self>,
        dims: [usize; 3],
        eps: f32,
        fuse_silu: bool,
    ) -> Result<Self>;
    /// GroupNorm over `[batch, channels, spatial]`.
    #[allow(clippy::too_many_arguments)] // the norm's own parameter list
    fn group_norm(
        &self,
        gamma: &Self,
        beta: &Self,
        dims: [usize; 3],
        groups: usize,
        eps: f32,
        fuse_silu: bool,
    ) -> Result<Self>;
}

/// Convolutions.
pub(crate) trait DeviceConv: Sized {
    /// The 3-D convolution of geometry `g` (2-D ones are its `t = 1` case), with `front`'s
    /// `ft` frames before `self`'s along time when given (Wan's causal cache).
    fn conv3d(&self, front: Option<(&Self, u64)>, weight: &Self, bias: Option<&Self>, g: ConvGeom) -> Result<Self>;
}

/// Layout ops: resampling and strided copies.
pub(crate) trait DeviceLayout: Sized {
    /// Nearest upsampling of `planes` planes of `h × w` by `factor`.
    fn upsample_nearest2d(&self, planes: usize, h: usize, w: usize, factor: usize) -> Result<Self>;
    /// A strided box of `self` into a strided box of `dst`.
    #[allow(clippy::too_many_arguments)] // two strided views and their extent
    fn copy_box_into(
        &self,
        src_strides: &[usize],
        src_offset: usize,
        dst: &mut Self,
        dst_strides: &[usize],
        dst_offset: usize,
        extent: &[usize],
    ) -> Result<()>;
    /// Wan2.2's `DupUp3D`.
    fn dup_up3d(&self, dims: [usize; 5], params: [usize; 5], out_len: usize) -> Result<Self>;
    /// Wan2.2's `AvgDown3D`.
    fn avg_down3d(&self, dims: [usize; 5], params: [usize; 5], out_len: usize) -> Result<Self>;
}

/// Matrix products.
pub(crate) trait DeviceLinalg: Sized {
    /// Batched `[batch, m, k] · [batch, k, n]`.
    fn matmul(&self, rhs: &Self, dims: [usize; 4]) -> Result<Self>;
    /// `x · wᵀ + b` over `[rows, k]` with `w` `[n, k]`.
    fn linear(&self, weight: &Self, bias: Option<&Self>, dims: [usize; 3]) -> Result<Self>;
}

/// Attention.
pub(crate) trait DeviceAttention: Sized {
    /// Single-head `softmax(q kᵀ · scale) v` for `[batch, n, d]`, `[batch, m, d]`, `[batch, m, dv]`.
    fn attention(q: &Self, k: &Self, v: &Self, dims: [usize; 5], scale: f32) -> Result<Self>;
}

/// The device storage of a build without the `cuda` feature: no value exists, so every op is
/// `match *self {}`, and making one is the error that names the missing feature.
#[cfg(not(feature = "cuda"))]
mod stand_in {
    use super::{DeviceAttention, DeviceConv, DeviceElementwise, DeviceLayout, DeviceLinalg, DeviceNorm, DeviceStore};
    use crate::abi::ConvGeom;
    use crate::{DType, Device, Result, TensorError};

    /// Uninhabited.
    #[derive(Debug, Clone, PartialEq)]
    pub(crate) enum NoDevice {}

    fn no_backend(ordinal: usize) -> TensorError {
        TensorError::DeviceUnavailable {
            device: Device::Cuda(ordinal),
            reason: "this build has no CUDA backend (the `cuda` feature is off)".into(),
        }
    }

    impl DeviceStore for NoDevice {
        fn zeros(ordinal: usize, _: usize, _: DType) -> Result<Self> {
            Err(no_backend(ordinal))
        }
        fn upload(ordinal: usize, _: &[f32]) -> Result<Self> {
            Err(no_backend(ordinal))
        }
        fn download(&self) -> Result<Vec<f32>> {
            match *self {}
        }
        fn ordinal(&self) -> usize {
            match *self {}
        }
        fn dtype(&self) -> DType {
            match *self {}
        }
        fn settled_address(&self) -> Result<u64> {
            match *self {}
        }
        fn settled_address_mut(&mut self) -> Result<u64> {
            match *self {}
        }
        fn uninit_like(&self, _: usize) -> Result<Self> {
            match *self {}
        }
    }

    impl DeviceElementwise for NoDevice {
        fn to_dtype(&self, _: DType) -> Result<Self> {
            match *self {}
        }
        fn add(&self, _: &Self) -> Result<Self> {
            match *self {}
        }
        fn affine(&self, _: f32, _: f32) -> Result<Self> {
            match *self {}
        }
        fn mul_scalar_inplace(&mut self, _: f32) -> Result<()> {
            match *self {}
        }
        fn div_scalar(&self, _: f32) -> Result<Self> {
            match *self {}
        }
        fn add_scalar(&self, _: f32) -> Result<Self> {
            match *self {}
        }
        fn channel_affine(&self, _: &[f32], _: &[f32], _: [usize; 3]) -> Result<Self> {
            match *self {}
        }
        fn channel_normalize(&self, _: &[f32], _: &[f32], _: [usize; 3]) -> Result<Self> {
            match *self {}
        }
        fn silu(&self) -> Result<Self> {
            match *self {}
        }
        fn silu_inplace(&mut self) -> Result<()> {
            match *self {}
        }
        fn clamp_inplace(&mut self, _: f32, _: f32) -> Result<()> {
            match *self {}
        }
    }

    impl DeviceNorm for NoDevice {
        fn rms_norm_channels(&self, _: &Self, _: Option<&Self>, _: [usize; 3], _: f32, _: bool) -> Result<Self> {
            match *self {}
        }
        fn group_norm(&self, _: &Self, _: &Self, _: [usize; 3], _: usize, _: f32, _: bool) -> Result<Self> {
            match *self {}
        }
    }

    impl DeviceConv for NoDevice {
        fn conv3d(&self, _: Option<(&Self, u64)>, _: &Self, _: Option<&Self>, _: ConvGeom) -> Result<Self> {
            match *self {}
        }
    }

    impl DeviceLayout for NoDevice {
        fn upsample_nearest2d(&self, _: usize, _: usize, _: usize, _: usize) -> Result<Self> {
            match *self {}
        }
        fn copy_box_into(&self, _: &[usize], _: usize, _: &mut Self, _: &[usize], _: usize, _: &[usize]) -> Result<()> {
            match *self {}
        }
        fn dup_up3d(&self, _: [usize; 5], _: [usize; 5], _: usize) -> Result<Self> {
            match *self {}
        }
        fn avg_down3d(&self, _: [usize; 5], _: [usize; 5], _: usize) -> Result<Self> {
            match *self {}
        }
    }

    impl DeviceLinalg for NoDevice {
        fn matmul(&self, _: &Self, _: [usize; 4]) -> Result<Self> {
            match *self {}
        }
        fn linear(&self, _: &Self, _: Option<&Self>, _: [usize; 3]) -> Result<Self> {
            match *self {}
        }
    }

    impl DeviceAttention for NoDevice {
        fn attention(q: &Self, _: &Self, _: &Self, _: [usize; 5], _: f32) -> Result<Self> {
            match *q {}
        }
    }
}
