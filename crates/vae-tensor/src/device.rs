//! Devices and element types.

use std::fmt;
use std::str::FromStr;

use crate::TensorError;

/// Where a tensor lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Device {
    /// Host memory, computed by the CPU backend.
    #[default]
    Cpu,
    /// A CUDA device by ordinal. Where the device cannot be used (no driver, no such device, a
    /// build without the `cuda` feature or without embedded kernels), creating tensors there
    /// returns [`TensorError::DeviceUnavailable`].
    Cuda(usize),
}

impl Device {
    /// True for [`Device::Cpu`].
    pub fn is_cpu(&self) -> bool {
        matches!(self, Self::Cpu)
    }

    /// Whether models compute in `dtype` here: the CPU backend in f32 only, CUDA in f32 or bf16.
    pub fn computes_in(&self, dtype: DType) -> bool {
        match self {
            Self::Cpu => dtype == DType::F32,
            Self::Cuda(_) => matches!(dtype, DType::F32 | DType::BF16),
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

impl FromStr for Device {
    type Err = TensorError;

    /// Parses `cpu`, `cuda` (device 0) or `cuda:N`.
    fn from_str(s: &str) -> Result<Self, TensorError> {
        let bad = || TensorError::InvalidArgument { op: "device", reason: format!("{s:?} is not cpu, cuda or cuda:N") };
        match s.trim() {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            other => other.strip_prefix("cuda:").and_then(|n| n.parse().ok()).map(Self::Cuda).ok_or_else(bad),
        }
    }
}

/// While it lives, the CUDA work the calling thread queues on one device goes to a stream of the
/// thread's own instead of the device's default stream: the way several ranks share one GPU (the
/// in-process transport) and still run side by side.
///
/// Tensors need no care when they cross streams: once a second stream exists, every device
/// buffer records the stream that last wrote it, and work on another stream waits for that
/// record (cudarc's event tracking). When the scope ends, the device's default stream waits for
/// everything queued on the thread's stream, so the thread's later work, and
/// [`crate::cuda::synchronize`], see its results. On the CPU, and in a build without the `cuda`
/// feature, the scope does nothing.
#[must_use = "the thread's own stream is used only while the scope lives"]
pub struct StreamScope {
    #[cfg(feature = "cuda")]
    _own: Option<crate::cuda::backend::OwnStream>,
    /// A scope belongs to the thread that opened it.
    _not_send: std::marker::PhantomData<*const ()>,
}

impl StreamScope {
    /// Opens a stream of the calling thread's own on `device` (nothing for the CPU). Fails
    /// like any first use of the device when it cannot be opened.
    pub fn own(device: &Device) -> Result<Self, TensorError> {
        match device {
            Device::Cpu => Ok(Self::none()),
            #[cfg(feature = "cuda")]
            Device::Cuda(ordinal) => Ok(Self {
                _own: Some(crate::cuda::backend::CudaDevice::get(*ordinal)?.own_stream()?),
                _not_send: std::marker::PhantomData,
            }),
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => Err(TensorError::DeviceUnavailable {
                device: *device,
                reason: "this build has no CUDA backend (the `cuda` feature is off)".into(),
            }),
        }
    }

    /// A scope that changes nothing (work stays where it was going).
    pub fn none() -> Self {
        Self {
            #[cfg(feature = "cuda")]
            _own: None,
            _not_send: std::marker::PhantomData,
        }
    }
}

impl fmt::Debug for StreamScope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("StreamScope")
    }
}

/// While it lives, the calling thread's f32 convolutions on CUDA take one TF32 product per
/// product (operands rounded to 10-bit mantissas, f32 accumulation): PyTorch's default for f32
/// convolutions on Ampere and later GPUs (`torch.backends.cudnn.allow_tf32`), about three times
/// the tensor-core rate of the default f32 path, which keeps f32 accuracy with three TF32 products
/// each. Everything else (bf16, the CPU, attention and other matrix products, which PyTorch keeps
/// in f32) is unchanged. Scopes nest; the previous mode returns when one ends.
#[must_use = "TF32 mode holds only while the scope lives"]
pub struct Tf32Scope {
    #[cfg(feature = "cuda")]
    _guard: crate::cuda::backend::Tf32Guard,
    /// A scope belongs to the thread that opened it.
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Tf32Scope {
    /// Turns TF32 mode on for the calling thread.
    pub fn enter() -> Self {
        Self {
            #[cfg(feature = "cuda")]
            _guard: crate::cuda::backend::Tf32Guard::enter(),
            _not_send: std::marker::PhantomData,
        }
    }
}

impl fmt::Debug for Tf32Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Tf32Scope")
    }
}

thread_local! {
    /// Whether [`CpuBf16Scope`] is open on this thread.
    static CPU_BF16: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the calling thread's CPU convolutions multiply in bf16 ([`CpuBf16Scope`]).
pub(crate) fn cpu_bf16_active() -> bool {
    CPU_BF16.with(|c| c.get())
}

/// While it lives, the calling thread's CPU convolutions multiply in bf16: their input and
/// weights are rounded to bf16 (nearest, ties to even) and multiplied with AVX512-BF16's
/// `vdpbf16ps`, twice the f32 rate, with f32 sums and f32 outputs. Where the caller allows
/// F(2×2, 3×3) Winograd ([`crate::Conv2dParams::band_aligned`]) its transformed operands are
/// multiplied in bf16 (they stay close to bf16 precision); where it allows F(4×4, 3×3), that
/// runs in f32 (its operands would not, and with a quarter of the products it is as fast in
/// f32). Every other op stays f32. This is the CPU's `--dtype bf16`: at least PyTorch's bf16
/// convolution accuracy, without PyTorch's rounding of every activation to bf16 in between.
/// Scopes nest; the previous mode returns when one ends.
#[must_use = "bf16 convolutions hold only while the scope lives"]
pub struct CpuBf16Scope {
    previous: bool,
    /// A scope belongs to the thread that opened it.
    _not_send: std::marker::PhantomData<*const ()>,
}

impl CpuBf16Scope {
    /// Turns bf16 convolutions on for the calling thread, or says which CPU feature is missing.
    pub fn enter() -> Result<Self, TensorError> {
        if let Some(why) = crate::ops::simd::bf16_missing() {
            return Err(TensorError::DeviceUnavailable {
                device: Device::Cpu,
                reason: format!("bf16 convolutions need AVX512-BF16: {why}"),
            });
        }
        let previous = CPU_BF16.with(|c| c.replace(true));
        Ok(Self { previous, _not_send: std::marker::PhantomData })
    }

    /// Whether this CPU can open the scope (else [`CpuBf16Scope::enter`]'s error says why).
    pub fn supported() -> bool {
        crate::ops::simd::bf16_supported()
    }
}

impl Drop for CpuBf16Scope {
    fn drop(&mut self) {
        CPU_BF16.with(|c| c.set(self.previous));
    }
}

impl fmt::Debug for CpuBf16Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("CpuBf16Scope")
    }
}

/// Element type of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum DType {
    /// 32-bit float: the CPU backend's type, and diffusers' reference precision.
    #[default]
    F32,
    /// bfloat16 (CUDA backend).
    BF16,
}

impl DType {
    /// Size of one element in bytes.
    pub const fn size_in_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::BF16 => 2,
        }
    }

    /// A stable numeric code, for wire formats.
    pub const fn code(self) -> u8 {
        match self {
            Self::F32 => 0,
            Self::BF16 => 1,
        }
    }

    /// The inverse of [`DType::code`].
    pub const fn from_code(code: u8) -> Option<Self> {
        match code {
            0 => Some(Self::F32),
            1 => Some(Self::BF16),
            _ => None,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::F32 => "f32",
            Self::BF16 => "bf16",
        })
    }
}

impl FromStr for DType {
    type Err = TensorError;

    fn from_str(s: &str) -> Result<Self, TensorError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "f32" | "float32" | "fp32" => Ok(Self::F32),
            "bf16" | "bfloat16" => Ok(Self::BF16),
            _ => Err(TensorError::InvalidArgument { op: "dtype", reason: format!("{s:?} is not f32 or bf16") }),
        }
    }
}

/// Elements of a tensor in GPU memory, named by address ([`crate::Tensor::device_memory`]): `len`
/// bytes at `address` on CUDA device `ordinal`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceMemory {
    /// The CUDA ordinal of the device.
    pub ordinal: usize,
    /// The device address of the first element.
    pub address: u64,
    /// The size in bytes.
    pub len: usize,
}
