//! Moving a computation's input to the model's device and its result back. Models keep their
//! weights on one device, while everything above them (tiles, bands, transports, files) works
//! on host tensors, so each computation uploads its input once (none when it is on the model's
//! device in the model's type already) and downloads its result once, unless the caller keeps
//! results on the device ([`ResultsOnDevice`]: a whole untiled decode or encode on one rank,
//! whose input and output never need the host).

use std::cell::Cell;

use vae_tensor::{DType, Device, Tensor};

use crate::{ModelError, Result};

thread_local! {
    /// How many [`ResultsOnDevice`] scopes the calling thread holds.
    static ON_DEVICE: Cell<usize> = const { Cell::new(0) };
}

/// While it lives, the calling thread's model computations (`LoadedVae::decode`,
/// `encode_moments`) return their results on the model's device instead of bringing them to the
/// host. For a caller that runs a whole untiled computation on one rank and wants the device
/// tensor (a DLPack or candle consumer on the same GPU); every path that tiles, splits or
/// exchanges works on host tensors and must not run under it. Scopes nest; not `Send`.
#[must_use = "results stay on the device only while the scope lives"]
pub struct ResultsOnDevice {
    _not_send: std::marker::PhantomData<*const ()>,
}

impl ResultsOnDevice {
    /// Keeps the calling thread's model results on the device until the scope drops.
    pub fn enter() -> Self {
        ON_DEVICE.with(|n| n.set(n.get() + 1));
        Self { _not_send: std::marker::PhantomData }
    }

    /// Whether the calling thread holds a scope.
    pub fn active() -> bool {
        ON_DEVICE.with(Cell::get) > 0
    }
}

impl Drop for ResultsOnDevice {
    fn drop(&mut self) {
        ON_DEVICE.with(|n| n.set(n.get().saturating_sub(1)));
    }
}

impl std::fmt::Debug for ResultsOnDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ResultsOnDevice")
    }
}

/// `t` in host memory (no copy when it is there already), or `t` itself under
/// [`ResultsOnDevice`].
pub(crate) fn to_host(t: Tensor) -> Result<Tensor> {
    if t.device().is_cpu() || ResultsOnDevice::active() { Ok(t) } else { Ok(t.to_device(&Device::Cpu)?) }
}

/// `x` on `device` with elements of `dtype` (as a pipeline casts latents to the VAE's dtype):
/// `x` itself when it is so already, else a copy kept in `slot` (so the caller decides how long
/// the upload lives).
pub(crate) fn on_device<'t>(
    x: &'t Tensor,
    device: Device,
    dtype: DType,
    slot: &'t mut Option<Tensor>,
) -> Result<&'t Tensor> {
    if x.device() == device && x.dtype() == dtype {
        return Ok(x);
    }
    Ok(slot.insert(x.to_device(&device)?.to_dtype(dtype)?))
}

/// `run` on each batch item of a host tensor (`[B, ...]`) in turn, each uploaded to `device` in
/// `dtype` and its result brought back; the results concatenated along the batch. Cancellation
/// is checked, and progress reported, item by item.
pub(crate) fn per_item(
    x: &Tensor,
    device: Device,
    dtype: DType,
    mut run: impl FnMut(&Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let batch = x.dims().first().copied().unwrap_or(0);
    let mut outs = Vec::with_capacity(batch);
    for i in 0..batch {
        vae_runtime::cancel::check()?;
        // A batch of one is its item: no copy of it, and none of the result below.
        let narrowed = if batch == 1 { None } else { Some(x.narrow(0, i, 1)?) };
        let mut uploaded = None;
        let item = on_device(narrowed.as_ref().unwrap_or(x), device, dtype, &mut uploaded)?;
        outs.push(to_host(run(item)?)?);
        vae_runtime::progress::report(vae_runtime::progress::Progress::Steps { done: i + 1, total: batch });
    }
    if outs.len() == 1 {
        return Ok(outs.remove(0));
    }
    let refs: Vec<&Tensor> = outs.iter().collect();
    Ok(Tensor::cat(&refs, 0)?)
}

/// An error unless a model can compute on `device` in `dtype`: the CPU backend is f32 only, the
/// CUDA backend f32 or bf16.
pub(crate) fn check_precision(device: Device, dtype: DType) -> Result<()> {
    if device.computes_in(dtype) {
        return Ok(());
    }
    Err(ModelError::Unsupported(format!(
        "{dtype} on {device}: the CPU computes in f32 only, CUDA devices in f32 or bf16"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precision_is_f32_on_the_cpu_and_f32_or_bf16_on_cuda() {
        assert!(check_precision(Device::Cpu, DType::F32).is_ok());
        assert!(check_precision(Device::Cuda(0), DType::F32).is_ok());
        assert!(check_precision(Device::Cuda(1), DType::BF16).is_ok());
        let err = check_precision(Device::Cpu, DType::BF16).unwrap_err();
        assert!(matches!(err, ModelError::Unsupported(_)), "{err}");
    }

    #[test]
    fn results_stay_on_the_device_only_inside_the_scope() {
        assert!(!ResultsOnDevice::active());
        let outer = ResultsOnDevice::enter();
        let inner = ResultsOnDevice::enter();
        drop(inner);
        assert!(ResultsOnDevice::active(), "scopes nest");
        drop(outer);
        assert!(!ResultsOnDevice::active());
        let host = Tensor::from_vec(vec![1.0], vec![1], &Device::Cpu).unwrap();
        assert!(to_host(host).unwrap().device().is_cpu());
    }
}
