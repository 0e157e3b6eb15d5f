//! `vae_parallel.devices()`: whether this installation can run on a GPU here, and why not.
//!
//! One wheel serves machines with and without GPUs: the CUDA backend is compiled in, and the
//! driver, NVRTC and NCCL are loaded when first asked for. This function is how a user asks,
//! before loading a model with `device="cuda"`. It only asks the driver (nothing is allocated
//! beyond the driver's own context per device) and never fails: no driver, no device or a driver
//! error is an answer (`cuda` false, with the reason), not an exception.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use vae_tensor::cuda;

/// What this installation can run on: `{"cuda": bool, "reason": str | None, "kernels": bool,
/// "nccl": bool, "devices": [...]}`.
///
/// - `cuda`: `load(..., device="cuda")` runs on a GPU here: a driver, at least one device, and a
///   build that embeds the CUDA kernels; `reason` says why not (`None` when it does).
/// - `kernels`: this build embeds the CUDA kernels (every released wheel does).
/// - `nccl`: the NCCL library loads (a group of GPU processes over NCCL can be made).
/// - `devices`: one dict per device the driver reports: `ordinal`, `name`,
///   `compute_capability` (`(major, minor)`), `total_memory` (bytes), `multiprocessors`; a device
///   the driver lists but cannot open is left out (its error is the `reason` when no device
///   opens).
#[pyfunction]
pub(crate) fn devices(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let kernels = !cuda::embedded_modules().is_empty();
    // Opening a driver context can take a while: without the GIL.
    let (found, mut reason) = py.detach(|| {
        let count = cuda::device_count();
        let mut found = Vec::with_capacity(count);
        let mut reason = None;
        for ordinal in 0..count {
            match cuda::probe(ordinal) {
                Ok(info) => found.push(info),
                Err(why) => reason = Some(why),
            }
        }
        if count == 0 {
            // Ask for device 0 to learn why there is none (no driver library, or none seen).
            reason = cuda::probe(0).err().or_else(|| Some("the CUDA driver reports no device".into()));
        }
        (found, reason)
    });
    if reason.is_none() && !kernels {
        reason = Some("this build embeds no CUDA kernels (run `cargo xtask kernels`, then build)".into());
    }
    let usable = !found.is_empty() && kernels;
    if usable {
        reason = None;
    }
    let list = PyList::empty(py);
    for info in found {
        let d = PyDict::new(py);
        d.set_item("ordinal", info.ordinal)?;
        d.set_item("name", info.name)?;
        d.set_item("compute_capability", info.compute_capability)?;
        d.set_item("total_memory", info.total_memory)?;
        d.set_item("multiprocessors", info.multiprocessors)?;
        list.append(d)?;
    }
    let out = PyDict::new(py);
    out.set_item("cuda", usable)?;
    out.set_item("reason", reason)?;
    out.set_item("kernels", kernels)?;
    out.set_item("nccl", vae_transport::nccl_available().is_ok())?;
    out.set_item("devices", list)?;
    Ok(out)
}
