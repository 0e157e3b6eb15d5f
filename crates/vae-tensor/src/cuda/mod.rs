//! Finding a usable CUDA device at run time, and the kernels this build carries.
//!
//! CUDA libraries are loaded at run time (cudarc's `dynamic-loading`), so the crate builds and
//! runs on machines without any CUDA. cudarc panics when a library it calls is missing, so every
//! entry point here probes for the library first and turns each failure into a reason that
//! callers show before falling back to the CPU.
//!
//! Status: device discovery, the kernel table, and f32 and bf16 CUDA tensors
//! (`Tensor::to_device`, `Tensor::to_dtype`) with CUDA paths for every op the decoders and
//! encoders use (add, SiLU, clamp, affine, RMS and group norm, conv2d / conv3d — bf16 on tensor
//! cores —, nearest upsample, narrow / cat / permute, matmul / linear, attention, Wan2.2's
//! DupUp3D / AvgDown3D) are built, and every VAE family can be loaded onto a CUDA device. None of
//! it has run on a GPU yet.

use std::panic::{AssertUnwindSafe, catch_unwind};

pub mod abi;
pub(crate) mod backend;

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

include!(concat!(env!("OUT_DIR"), "/kernels.rs"));

/// The kernel modules embedded in this build (none when `cargo xtask kernels` had not run).
pub fn embedded_modules() -> &'static [EmbeddedModule] {
    EMBEDDED
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
}

/// Asks the driver about device `ordinal`, or says why it cannot be used (no driver library, no
/// such device, a driver error). Never panics.
pub fn probe(ordinal: usize) -> Result<CudaDeviceInfo, String> {
    // SAFETY: only tries to dlopen the driver library's candidate names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("no CUDA driver (libcuda.so was not found)".into());
    }
    let asked = catch_unwind(AssertUnwindSafe(|| -> Result<CudaDeviceInfo, String> {
        let count = cudarc::driver::CudaContext::device_count().map_err(|e| format!("driver error: {e}"))?;
        if ordinal >= count.max(0) as usize {
            return Err(format!("no CUDA device {ordinal} (the driver sees {count})"));
        }
        let ctx = cudarc::driver::CudaContext::new(ordinal).map_err(|e| format!("driver error: {e}"))?;
        Ok(CudaDeviceInfo {
            ordinal,
            name: ctx.name().map_err(|e| format!("driver error: {e}"))?,
            compute_capability: ctx.compute_capability().map_err(|e| format!("driver error: {e}"))?,
            total_memory: ctx.total_mem().map_err(|e| format!("driver error: {e}"))?,
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
    }

    #[test]
    fn embedded_modules_hold_ptx_and_cubin_when_present() {
        for m in embedded_modules() {
            assert!(m.ptx_compute_80.contains(".target sm_80"), "{}", m.name);
            assert!(m.ptx_compute_90.contains(".target sm_90"), "{}", m.name);
            assert!(m.cubin_sm_90.starts_with(b"\x7fELF"), "{}", m.name);
        }
    }
}
