//! The ops of `kernels-cu/elementwise.cu`: casts, add, affine, SiLU, clamp.

use super::storage::CudaStorage;
use crate::backend::{DeviceElementwise, DeviceStore, no_device_path};
use crate::kernel_args::{Add, Affine, Cast, Clamp, Silu, SiluInto};
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
        let cast = Cast { x: self.data.view(0), out: out.data.view_mut(0), n: self.len as u64 };
        cast.launch(&self.device, self.device.streaming(self.len.div_ceil(4))).map_err(self.err("to_dtype"))?;
        Ok(out)
    }

    /// `self + other`, element-wise.
    fn add(&self, other: &Self) -> Result<Self> {
        self.same_dtype("add", &[other])?;
        let mut out = self.output(self.len)?;
        let add = Add { a: self.data.view(0), b: other.data.view(0), out: out.data.view_mut(0), n: self.len as u64 };
        add.launch(&self.device, self.packs()).map_err(self.err("add"))?;
        Ok(out)
    }

    /// `x * mul + add`, two roundings (`affine_f32`). With `add = -0.0` this is exactly `x * mul`,
    /// signed zeros included.
    fn affine(&self, mul: f32, add: f32) -> Result<Self> {
        let mut out = self.output(self.len)?;
        let affine = Affine { x: self.data.view(0), out: out.data.view_mut(0), n: self.len as u64, mul, add };
        affine.launch(&self.device, self.packs()).map_err(self.err("affine"))?;
        Ok(out)
    }

    /// SiLU in place.
    fn silu_inplace(&mut self) -> Result<()> {
        let (ordinal, cfg) = (self.device.ordinal, self.packs());
        let silu = Silu { x: self.data.view_mut(0), n: self.len as u64 };
        silu.launch(&self.device, cfg).map_err(|e| e.into_tensor(ordinal, "silu"))
    }

    /// SiLU into a new tensor: one pass (read, write) instead of a copy and an in-place pass.
    fn silu(&self) -> Result<Self> {
        let mut out = self.output(self.len)?;
        let silu = SiluInto { x: self.data.view(0), out: out.data.view_mut(0), n: self.len as u64 };
        silu.launch(&self.device, self.packs()).map_err(self.err("silu"))?;
        Ok(out)
    }

    /// Clamp to `[lo, hi]` in place.
    fn clamp_inplace(&mut self, lo: f32, hi: f32) -> Result<()> {
        let (ordinal, cfg) = (self.device.ordinal, self.packs());
        let clamp = Clamp { x: self.data.view_mut(0), n: self.len as u64, lo, hi };
        clamp.launch(&self.device, cfg).map_err(|e| e.into_tensor(ordinal, "clamp"))
    }
}
