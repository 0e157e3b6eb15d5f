//! Launchers of `kernels-cu/elementwise.cu`: casts, add, affine, SiLU, clamp.

use cudarc::driver::PushKernelArg;

use super::super::kernels;
use super::device::driver;
use super::storage::CudaStorage;
use crate::backend::{DeviceElementwise, DeviceStore, no_device_path};
use crate::{DType, Result};

impl DeviceElementwise for CudaStorage {
    /// `x · factor + (−0)` is `x · factor` exactly, signed zeros included.
    fn mul_scalar_inplace(&mut self, factor: f32) -> Result<()> {
        *self = self.affine(factor, -0.0)?;
        Ok(())
    }

    /// No kernel divides: `x · (1 / s)` can differ from `x / s` in the last bit.
    fn div_scalar(&self, _: f32) -> Result<Self> {
        Err(no_device_path("div_scalar", self.ordinal()))
    }

    /// `x · 1 + value` is `x + value` exactly.
    fn add_scalar(&self, value: f32) -> Result<Self> {
        self.affine(1.0, value)
    }

    /// The pipelines' per-channel (de)normalisation runs on host tensors, outside the model.
    fn channel_affine(&self, _: &[f32], _: &[f32], _: [usize; 3]) -> Result<Self> {
        Err(no_device_path("channel_affine", self.ordinal()))
    }

    /// As [`Self::channel_affine`].
    fn channel_normalize(&self, _: &[f32], _: &[f32], _: [usize; 3]) -> Result<Self> {
        Err(no_device_path("channel_normalize", self.ordinal()))
    }

    /// A copy converted to `dtype` (f32 → bf16 rounds to nearest even; bf16 → f32 is exact).
    fn to_dtype(&self, dtype: DType) -> Result<Self> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        let mut out = self.output_typed(self.len, dtype)?;
        let cast = match dtype {
            DType::BF16 => kernels::CAST_F32_BF16,
            DType::F32 => kernels::CAST_BF16_F32,
        };
        let f = self.device.function(cast)?;
        let n = self.len as u64;
        unsafe {
            self.device
                .stream()
                .launch_builder(&f)
                .arg(&self.data)
                .arg(&mut out.data)
                .arg(&n)
                .launch(self.device.streaming(self.len.div_ceil(4)))
        }
        .map_err(self.err("to_dtype"))?;
        Ok(out)
    }

    /// `self + other`, element-wise.
    fn add(&self, other: &Self) -> Result<Self> {
        self.same_dtype("add", &[other])?;
        let mut out = self.output(self.len)?;
        let f = self.kernel(kernels::ADD)?;
        let n = self.len as u64;
        unsafe {
            self.device
                .stream()
                .launch_builder(&f)
                .arg(&self.data)
                .arg(&other.data)
                .arg(&mut out.data)
                .arg(&n)
                .launch(self.packs())
        }
        .map_err(self.err("add"))?;
        Ok(out)
    }

    /// `x * mul + add`, two roundings (`affine_f32`). With `add = -0.0` this is exactly `x * mul`,
    /// signed zeros included.
    fn affine(&self, mul: f32, add: f32) -> Result<Self> {
        let mut out = self.output(self.len)?;
        let f = self.kernel(kernels::AFFINE)?;
        let n = self.len as u64;
        unsafe {
            self.device
                .stream()
                .launch_builder(&f)
                .arg(&self.data)
                .arg(&mut out.data)
                .arg(&n)
                .arg(&mul)
                .arg(&add)
                .launch(self.packs())
        }
        .map_err(self.err("affine"))?;
        Ok(out)
    }

    /// SiLU in place.
    fn silu_inplace(&mut self) -> Result<()> {
        let f = self.kernel(kernels::SILU)?;
        let n = self.len as u64;
        let (stream, cfg) = (self.device.stream(), self.packs());
        unsafe { stream.launch_builder(&f).arg(&mut self.data).arg(&n).launch(cfg) }
            .map_err(|e| driver(self.device.ordinal, "silu", e))?;
        Ok(())
    }

    /// SiLU into a new tensor: one pass (read, write) instead of a copy and an in-place pass.
    fn silu(&self) -> Result<Self> {
        let mut out = self.output(self.len)?;
        let f = self.kernel(kernels::SILU_INTO)?;
        let n = self.len as u64;
        unsafe {
            self.device.stream().launch_builder(&f).arg(&self.data).arg(&mut out.data).arg(&n).launch(self.packs())
        }
        .map_err(self.err("silu"))?;
        Ok(out)
    }

    /// Clamp to `[lo, hi]` in place.
    fn clamp_inplace(&mut self, lo: f32, hi: f32) -> Result<()> {
        let f = self.kernel(kernels::CLAMP)?;
        let n = self.len as u64;
        let (stream, cfg) = (self.device.stream(), self.packs());
        unsafe { stream.launch_builder(&f).arg(&mut self.data).arg(&n).arg(&lo).arg(&hi).launch(cfg) }
            .map_err(|e| driver(self.device.ordinal, "clamp", e))?;
        Ok(())
    }
}
