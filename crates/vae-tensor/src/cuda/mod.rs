//! Finding a usable CUDA device at run time, and the kernels this build carries.
//!
//! CUDA libraries are loaded at run time (cudarc's `dynamic-loading`), so the crate builds and
//! runs on machines without any CUDA. cudarc panics when a library it calls is missing, so every
//! entry point here probes for the library first ([`library_loadable`]) and turns each failure
//! into a reason that callers show before falling back to the CPU.
//!
//! The workspace asks cudarc for `fallback-dynamic-loading`, not `dynamic-loading`: a build that
//! also holds candle's CUDA backend (a candle-based engine) turns on cudarc's `dynamic-linking`,
//! which cudarc refuses beside `dynamic-loading` but takes instead of the fallback. The crate then
//! links the libraries at build time, and the probe (which uses none of cudarc's loader) finds
//! them loaded.
//!
//! Status: device discovery, the kernel table, and f32 and bf16 CUDA tensors
//! (`Tensor::to_device`, `Tensor::to_dtype`) with CUDA paths for every op the decoders and
//! encoders use (add, SiLU, clamp, affine, RMS and group norm, conv2d / conv3d — bf16 on tensor
//! cores —, nearest upsample, narrow / cat / permute, matmul / linear, attention, Wan2.2's
//! DupUp3D / AvgDown3D) are built, and every VAE family can be loaded onto a CUDA device. All of
//! it has passed its GPU tests on an H200; threads holding a [`crate::StreamScope`] (several
//! ranks on one GPU) run on streams of their own, so far tested under the fake driver only.

use std::panic::{AssertUnwindSafe, catch_unwind};

pub(crate) mod backend;
pub(crate) mod kernels;

use crate::Device;

/// One compiled `kernels-cu/*.cu`, as embedded by the build script.
#[derive(Debug, Clone, Copy)]
pub struct EmbeddedModule {
    /// The source file's stem (`conv`, `norm`, ...).
    pub name: &'static str,
    /// PTX for compute capability 8.0 and later (JIT-compiled by the driver).
    pub ptx_compute_80: &'static str,
    /// PTX for compute capability 9.0 and later.
    pub ptx_compute_90: &'static str,
    /// SASS for sm_90 (H100 / H200), loaded without JIT.
    pub cubin_sm_90: &'static [u8],
}

/// One compiled `kernels-cu/*_sm90a.cu`: kernels with Hopper-only instructions (`wgmma`), which
/// run on compute capability 9.0 alone.
#[derive(Debug, Clone, Copy)]
pub struct Sm90aModule {
    /// The source file's stem (`conv_sm90a`).
    pub name: &'static str,
    /// SASS for sm_90a.
    pub cubin_sm_90a: &'static [u8],
}

include!(concat!(env!("OUT_DIR"), "/kernels.rs"));

/// The kernel modules embedded in this build (none when `cargo xtask kernels` had not run).
pub fn embedded_modules() -> &'static [EmbeddedModule] {
    EMBEDDED
}

/// The Hopper-only kernel modules embedded in this build.
pub fn embedded_sm90a_modules() -> &'static [Sm90aModule] {
    EMBEDDED_SM90A
}

/// What the driver says about a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaDeviceInfo {
    /// The ordinal.
    pub ordinal: usize,
    /// The device name.
    pub name: String,
    /// `(major, minor)` compute capability.
    pub compute_capability: (i32, i32),
    /// Device memory, bytes.
    pub total_memory: usize,
    /// Streaming multiprocessors.
    pub multiprocessors: u32,
    /// Peak SM clock, kHz.
    pub clock_khz: u32,
    /// Peak memory clock, kHz.
    pub memory_clock_khz: u32,
    /// Memory bus width, bits.
    pub memory_bus_bits: u32,
}

impl CudaDeviceInfo {
    /// Peak DRAM bandwidth from the memory clock and bus width (double data rate), bytes/s.
    pub fn peak_bandwidth(&self) -> f64 {
        2.0 * self.memory_clock_khz as f64 * 1e3 * self.memory_bus_bits as f64 / 8.0
    }

    /// Peak f32 FLOP/s on CUDA cores (an FMA is two FLOPs), for the architectures this build
    /// has kernels for; `None` elsewhere.
    pub fn peak_f32_flops(&self) -> Option<f64> {
        self.per_sm_per_clock(|cc| match cc {
            (8, 0) => Some(128.0),          // A100: 64 FP32 lanes per SM
            (8, _) | (9, 0) => Some(256.0), // GA10x / AD10x, H100 / H200: 128 lanes
            _ => None,
        })
    }

    /// Peak dense bf16 tensor-core FLOP/s (f32 accumulation); `None` for unknown architectures.
    pub fn peak_bf16_tensor_flops(&self) -> Option<f64> {
        self.per_sm_per_clock(|cc| match cc {
            (8, 0) => Some(2048.0), // A100: 312 TFLOP/s at 108 SMs, 1.41 GHz
            (9, 0) => Some(4096.0), // H100 / H200 SXM: 989 TFLOP/s at 132 SMs, 1.83 GHz
            _ => None,
        })
    }

    /// Peak dense TF32 tensor-core FLOP/s (half the bf16 rate); `None` for unknown
    /// architectures.
    pub fn peak_tf32_tensor_flops(&self) -> Option<f64> {
        self.peak_bf16_tensor_flops().map(|f| f / 2.0)
    }

    fn per_sm_per_clock(&self, flops: impl Fn((i32, i32)) -> Option<f64>) -> Option<f64> {
        flops(self.compute_capability).map(|f| f * self.multiprocessors as f64 * self.clock_khz as f64 * 1e3)
    }
}

/// Which kernels the tensor-core convolutions take, where a benchmark or a check forces one
/// family instead of the backend's choice per launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ConvKernels {
    /// `mma.sync` tiles of 128 pixels: three stages in static shared memory, two blocks per
    /// multiprocessor.
    Pixels128,
    /// `mma.sync` tiles of 256 pixels: four stages in dynamic shared memory, one block per
    /// multiprocessor, half the operand traffic per product.
    Pixels256,
    /// Hopper's warpgroup MMA (`wgmma`, `kernels-cu/conv_sm90a.cu`) for every bf16 convolution
    /// of at least 96 output channels on a device of compute capability 9.0; the backend's
    /// `mma.sync` choice for the others (f32 and TF32, fewer channels, other GPUs). Not yet the
    /// default: it has run only under the kernel emulator and the fake driver so far. The
    /// environment variable `VAE_CUDA_WGMMA=1` makes it the default of a process.
    Wgmma,
    /// cuDNN's convolutions (`libcudnn.so.9`, loaded at run time; see [`CUDNN_PATH_ENV`]): for
    /// each convolution the first algorithm cuDNN's heuristics offer among those admitted
    /// (deterministic GEMM and direct algorithms; FFT and Winograd never run). Results are
    /// meant to be bit-identical across rank counts by construction of that admitted set; this
    /// has been verified only against the fake cuDNN (`cargo xtask gpu-emu`), not yet with
    /// NVIDIA's library on a GPU. Where cuDNN cannot be loaded, our kernels run, with a warning
    /// once. `VAE_CUDA_CONV=cudnn` ([`CONV_ENV`]) makes it the default of a process.
    Cudnn,
    /// Per convolution shape, whichever of our kernels and cuDNN's admissible algorithms ran
    /// fastest when the shape was first timed on this kind of device; the choices are kept per
    /// device name and can be written out and read back ([`export_conv_choices`],
    /// [`import_conv_choices`]); a group of processes runs rank 0's ([`conv_decision`],
    /// [`ConvDecisionScope`]). As [`Self::Cudnn`],
    /// our kernels alone where cuDNN cannot be loaded.
    Fastest,
}

/// The environment variable that makes [`ConvKernels::Cudnn`] (`cudnn`) or
/// [`ConvKernels::Fastest`] (`fastest`) the default of a process; unset, empty or `auto`: our
/// kernels.
pub const CONV_ENV: &str = "VAE_CUDA_CONV";

pub use backend::cudnn::CUDNN_PATH_ENV;

/// The environment variable naming a file of per-layer convolution choices
/// ([`export_conv_choices`]' text) that a process reads before its first convolution under
/// [`ConvKernels::Fastest`]; a process that read one times nothing.
pub use backend::CHOICES_ENV as CONV_CHOICES_ENV;

/// Why cuDNN cannot be used in this process (not found, too old, failed to load); its
/// message is the reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}")]
pub struct CudnnUnavailable {
    /// Why, in words.
    pub reason: String,
}

/// cuDNN's version where it loads (see [`CUDNN_PATH_ENV`] for where it is looked for), or why
/// it cannot be used. Never panics.
pub fn cudnn_version() -> Result<usize, CudnnUnavailable> {
    backend::cudnn::library().map_err(|reason| CudnnUnavailable { reason })
}

/// How many convolutions this process has queued on cuDNN (a check that a run asked to use it
/// did).
pub fn cudnn_convolutions() -> u64 {
    backend::cudnn::convolutions()
}

/// The per-shape convolution choices [`ConvKernels::Fastest`] made in this process, one line
/// each (`device<TAB>shape<TAB>choice`), for [`import_conv_choices`] in another.
pub fn export_conv_choices() -> String {
    backend::export_conv_choices()
}

/// Reads choices written by [`export_conv_choices`]: later convolutions of those shapes on
/// devices of those names run what they say instead of being timed. Returns how many were read;
/// a malformed line, or a cuDNN algorithm the bit-identity rule refuses, refuses the whole text.
pub fn import_conv_choices(text: &str) -> crate::Result<usize> {
    backend::import_conv_choices(text)
        .map_err(|reason| crate::TensorError::InvalidArgument { op: "import_conv_choices", reason })
}

/// What rank 0 of a group of processes tells every rank before a request, so that the group
/// convolves alike: the route the calling thread's convolutions take (our kernels, forced
/// cuDNN, or [`ConvKernels::Fastest`]), then this process's per-layer choices as
/// [`export_conv_choices`] writes them (under `fastest`, those of the file
/// `VAE_CUDA_CONV_CHOICES` names read first). Every rank, rank 0 included, follows it through a
/// [`ConvDecisionScope`] for the request.
pub fn conv_decision() -> crate::Result<String> {
    backend::conv_decision().map_err(|reason| crate::TensorError::InvalidArgument { op: "conv_decision", reason })
}

/// While it lives, the calling thread's convolutions follow rank 0's [`conv_decision`]: its
/// route, and under `fastest` its choice per layer (whatever device name rank 0 made it
/// under), a layer it did not decide running our kernels; nothing is timed. So ranks whose
/// own tables, clocks or `VAE_CUDA_CONV` differ still run the same implementation for the
/// same layer, and their results stay bit-identical to one rank's under the same decision.
/// Forced cuDNN picks its algorithm per layer on each rank by a fixed preference, not by
/// rank 0's text. Scopes nest; the previous decision (or none) returns when one ends. A scope
/// belongs to the thread that opened it.
#[must_use = "the decision holds only while the scope lives"]
pub struct ConvDecisionScope {
    _guard: backend::AgreedConvGuard,
}

impl ConvDecisionScope {
    /// Follows `decision` (rank 0's [`conv_decision`]) on the calling thread. With `hold` (the
    /// other ranks), its choices are also imported into this process's table
    /// ([`import_conv_choices`]: kept afterwards, and nothing timed by this process from then
    /// on). A malformed text is refused and changes nothing.
    pub fn enter(decision: &str, hold: bool) -> crate::Result<Self> {
        let guard = backend::AgreedConvGuard::enter(decision, hold)
            .map_err(|reason| crate::TensorError::InvalidArgument { op: "ConvDecisionScope", reason })?;
        Ok(Self { _guard: guard })
    }
}

impl std::fmt::Debug for ConvDecisionScope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ConvDecisionScope")
    }
}

/// The environment variable that makes [`ConvKernels::Wgmma`] the default of a process (`1`),
/// until a GPU has measured the warpgroup-MMA convolutions and they become the default.
pub const WGMMA_ENV: &str = "VAE_CUDA_WGMMA";

impl ConvKernels {
    /// The `mma.sync` tile width this choice forces, if any.
    pub(crate) fn mma_pixels(self) -> Option<u64> {
        match self {
            Self::Pixels128 => Some(128),
            Self::Pixels256 => Some(256),
            Self::Wgmma | Self::Cudnn | Self::Fastest => None,
        }
    }
}

/// A name that is not a [`ConvKernels`] (see its [`std::str::FromStr`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{given:?} is not 128, 256, wgmma, cudnn or fastest")]
pub struct UnknownConvKernels {
    /// The text given, trimmed.
    pub given: String,
}

impl std::str::FromStr for ConvKernels {
    type Err = UnknownConvKernels;

    /// `128`, `256`, `wgmma`, `cudnn` or `fastest` (as [`std::fmt::Display`] writes them).
    fn from_str(s: &str) -> Result<Self, UnknownConvKernels> {
        Ok(match s.trim() {
            "128" => Self::Pixels128,
            "256" => Self::Pixels256,
            "wgmma" => Self::Wgmma,
            "cudnn" => Self::Cudnn,
            "fastest" => Self::Fastest,
            other => return Err(UnknownConvKernels { given: other.to_owned() }),
        })
    }
}

impl std::fmt::Display for ConvKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Pixels128 => "128",
            Self::Pixels256 => "256",
            Self::Wgmma => "wgmma",
            Self::Cudnn => "cudnn",
            Self::Fastest => "fastest",
        })
    }
}

/// While it lives, the calling thread's tensor-core convolutions (and attention products) take
/// the kernels of one [`ConvKernels`] only, instead of the backend's choice per launch: for
/// benchmarks that time them side by side. Both `mma.sync` widths give bit-identical results
/// (every output is summed in the same order); whether `wgmma`'s tensor cores round the same is
/// for a GPU to show. Scopes nest; the previous choice returns when one ends.
#[must_use = "the kernel choice holds only while the scope lives"]
pub struct ConvTilesScope {
    _guard: backend::ConvTilesGuard,
    /// A scope belongs to the thread that opened it.
    _not_send: std::marker::PhantomData<*const ()>,
}

impl ConvTilesScope {
    /// Restricts the calling thread's tensor-core convolutions to `kernels`.
    pub fn only(kernels: ConvKernels) -> Self {
        Self { _guard: backend::ConvTilesGuard::enter(Some(kernels)), _not_send: std::marker::PhantomData }
    }
}

impl std::fmt::Debug for ConvTilesScope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ConvTilesScope")
    }
}

/// Whether device `ordinal` runs [`ConvKernels::Wgmma`]: compute capability 9.0 and a build that
/// embeds the sm_90a kernels (opens the device on first use).
pub fn wgmma_available(ordinal: usize) -> crate::Result<bool> {
    Ok(backend::CudaDevice::get(ordinal)?.has_wgmma())
}

/// Whether [`ConvKernels::Wgmma`] changes any kernel of `dtype` convolutions on device `ordinal`:
/// the warpgroup-MMA kernels exist there ([`wgmma_available`]) and take that dtype (bf16 only:
/// the backend keeps f32 and TF32 on `mma.sync`).
pub fn wgmma_runs(ordinal: usize, dtype: crate::DType) -> crate::Result<bool> {
    Ok(backend::wgmma_takes(dtype) && wgmma_available(ordinal)?)
}

/// Waits until everything queued on `device` has run (a no-op for the CPU), so host timers
/// measure the work and not its launch.
pub fn synchronize(device: Device) -> crate::Result<()> {
    match device {
        Device::Cpu => Ok(()),
        Device::Cuda(ordinal) => backend::CudaDevice::get(ordinal)?.synchronize(),
    }
}

/// Whether the shared library cudarc binds as `name` (`"cuda"`, `"cudnn"`) can be loaded under
/// one of the names cudarc's loader tries on Linux: `libNAME.so`, then the major versions
/// `.so.12` down to `.so.9`, and `.so.1`. It stands in for cudarc's `is_culib_present`, which
/// exists only when cudarc loads libraries itself; under `dynamic-linking` (see the module doc)
/// the library is a load-time dependency, and `dlopen` finds it, loaded, by its soname.
pub(crate) fn library_loadable(name: &str) -> bool {
    let names = std::iter::once(format!("lib{name}.so"))
        .chain(["12", "11", "10", "9", "1"].map(|major| format!("lib{name}.so.{major}")));
    names.filter_map(|n| std::ffi::CString::new(n).ok()).any(|n| {
        // SAFETY: `dlopen` of a NUL-terminated name, and `dlclose` of the handle it gave, as
        // cudarc's own probe does (a loaded library's count goes up and back down).
        unsafe {
            let handle = libc::dlopen(n.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
            if handle.is_null() {
                return false;
            }
            libc::dlclose(handle);
            true
        }
    })
}

/// How many CUDA devices the driver reports: 0 without a driver (or one that fails to start).
/// Never panics.
pub fn device_count() -> usize {
    if !library_loadable("cuda") {
        return 0;
    }
    catch_unwind(cudarc::driver::CudaContext::device_count).ok().and_then(Result::ok).map_or(0, |n| n.max(0) as usize)
}

/// Asks the driver about device `ordinal`, or says why it cannot be used (no driver library, no
/// such device, a driver error). Never panics.
pub fn probe(ordinal: usize) -> Result<CudaDeviceInfo, String> {
    if !library_loadable("cuda") {
        return Err("no CUDA driver (libcuda.so was not found)".into());
    }
    let asked = catch_unwind(AssertUnwindSafe(|| -> Result<CudaDeviceInfo, String> {
        let count = cudarc::driver::CudaContext::device_count().map_err(|e| format!("driver error: {e}"))?;
        if ordinal >= count.max(0) as usize {
            return Err(format!("no CUDA device {ordinal} (the driver sees {count})"));
        }
        let ctx = cudarc::driver::CudaContext::new(ordinal).map_err(|e| format!("driver error: {e}"))?;
        use cudarc::driver::sys::CUdevice_attribute::*;
        let attribute = |a| ctx.attribute(a).map(|v| v.max(0) as u32).map_err(|e| format!("driver error: {e}"));
        Ok(CudaDeviceInfo {
            ordinal,
            name: ctx.name().map_err(|e| format!("driver error: {e}"))?,
            compute_capability: ctx.compute_capability().map_err(|e| format!("driver error: {e}"))?,
            total_memory: ctx.total_mem().map_err(|e| format!("driver error: {e}"))?,
            multiprocessors: attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
            clock_khz: attribute(CU_DEVICE_ATTRIBUTE_CLOCK_RATE)?,
            memory_clock_khz: attribute(CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE)?,
            memory_bus_bits: attribute(CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH)?,
        })
    }));
    asked.unwrap_or_else(|_| Err("the CUDA driver library failed to load".into()))
}

/// Where work asked for `requested` can run: the CUDA device when the driver opens it and this
/// build embeds the kernels, else the CPU with the reason.
pub fn resolve_device(requested: Device) -> (Device, Option<String>) {
    match requested {
        Device::Cpu => (Device::Cpu, None),
        Device::Cuda(ordinal) => match probe(ordinal) {
            Err(reason) => (Device::Cpu, Some(format!("CUDA unavailable: {reason}; running on the CPU"))),
            Ok(info) if embedded_modules().is_empty() => (
                Device::Cpu,
                Some(format!(
                    "found cuda:{ordinal} ({}), but this build embeds no CUDA kernels (run `cargo xtask kernels`, \
                     then build); running on the CPU",
                    info.name
                )),
            ),
            Ok(_) => (requested, None),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn asking_for_a_gpu_never_panics_and_always_says_where_work_runs() {
        assert_eq!(resolve_device(Device::Cpu), (Device::Cpu, None));
        match resolve_device(Device::Cuda(0)) {
            (Device::Cuda(0), None) => assert!(probe(0).is_ok() && !embedded_modules().is_empty()),
            (Device::Cpu, Some(message)) => assert!(message.ends_with("running on the CPU"), "{message}"),
            other => panic!("unexpected {other:?}"),
        }
        // A device far beyond any machine is refused by name when a driver exists.
        if let Err(reason) = probe(4096) {
            assert!(reason.contains("no CUDA") || reason.contains("driver"), "{reason}");
        }
        // The count agrees with what the probe opens: every device below it, none at it.
        let count = device_count();
        assert!((0..count).all(|o| probe(o).is_ok()), "{count} devices");
        assert!(probe(count).is_err(), "no device {count}");
    }

    #[test]
    fn conv_kernel_choices_read_back_what_they_write() {
        for k in [
            ConvKernels::Pixels128,
            ConvKernels::Pixels256,
            ConvKernels::Wgmma,
            ConvKernels::Cudnn,
            ConvKernels::Fastest,
        ] {
            assert_eq!(k.to_string().parse::<ConvKernels>(), Ok(k));
        }
        assert!(
            "auto"
                .parse::<ConvKernels>()
                .is_err_and(|e| e.to_string().contains("cudnn or fastest") && e.given == "auto")
        );
        assert!("cuDNN".parse::<ConvKernels>().is_err());
    }

    #[test]
    fn device_peaks_follow_the_published_figures() {
        // An H100 SXM as its driver reports it: 132 SMs at 1.98 GHz, HBM3 at 2.619 GHz x 5120 bits.
        let h100 = CudaDeviceInfo {
            ordinal: 0,
            name: "NVIDIA H100 80GB HBM3".into(),
            compute_capability: (9, 0),
            total_memory: 80 << 30,
            multiprocessors: 132,
            clock_khz: 1_980_000,
            memory_clock_khz: 2_619_000,
            memory_bus_bits: 5120,
        };
        assert!((h100.peak_bandwidth() / 1e12 - 3.35).abs() < 0.01, "{}", h100.peak_bandwidth());
        assert!((h100.peak_f32_flops().unwrap() / 1e12 - 66.9).abs() < 0.1);
        assert!((h100.peak_bf16_tensor_flops().unwrap() / 1e12 - 1070.5).abs() < 0.5);
        assert!((h100.peak_tf32_tensor_flops().unwrap() / 1e12 - 535.3).abs() < 0.5);
        let unknown = CudaDeviceInfo { compute_capability: (7, 5), ..h100 };
        assert_eq!(unknown.peak_f32_flops(), None);
        assert_eq!(unknown.peak_bf16_tensor_flops(), None);
    }

    #[test]
    fn embedded_modules_hold_ptx_and_cubin_when_present() {
        for m in embedded_modules() {
            assert!(m.ptx_compute_80.contains(".target sm_80"), "{}", m.name);
            assert!(m.ptx_compute_90.contains(".target sm_90"), "{}", m.name);
            assert!(m.cubin_sm_90.starts_with(b"\x7fELF"), "{}", m.name);
        }
        for m in embedded_sm90a_modules() {
            assert!(m.cubin_sm_90a.starts_with(b"\x7fELF"), "{}", m.name);
        }
    }
}
