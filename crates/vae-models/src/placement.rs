//! Moving a computation's input to the model's device and its result back. Models keep their
//! weights on one device, while everything above them (tiles, bands, transports, files) works
//! on host tensors, so each computation uploads its input once and downloads its result once.

use vae_tensor::{Device, Tensor};

use crate::Result;

/// `t` in host memory (no copy when it is there already).
pub(crate) fn to_host(t: Tensor) -> Result<Tensor> {
    if t.device().is_cpu() { Ok(t) } else { Ok(t.to_device(&Device::Cpu)?) }
}

/// `x` on `device`: `x` itself when it is there already, else a copy kept in `slot` (so the
/// caller decides how long the upload lives).
pub(crate) fn on_device<'t>(x: &'t Tensor, device: Device, slot: &'t mut Option<Tensor>) -> Result<&'t Tensor> {
    if x.device() == device {
        return Ok(x);
    }
    Ok(slot.insert(x.to_device(&device)?))
}
