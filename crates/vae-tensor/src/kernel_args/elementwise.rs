//! `kernels-cu/elementwise.cu`: add, affine, SiLU, clamp and the f32 ↔ bf16 casts.
//!
//! Each is a grid-stride loop over `i < n` (16-byte packs where every pointer is aligned, then
//! element by element) that touches element `i` of each buffer and nothing else: any launch
//! shape is correct, and buffers of `n` elements bound every access.

use cudarc::driver::LaunchConfig;

use super::{Instance, KernelArgs, LaunchError, enqueue, holds, kernel_args, select, typed};
use crate::DType;
use crate::cuda::backend::CudaDevice;
use crate::cuda::kernels;

pub(super) const ADD: [Instance; 2] = typed(kernels::ADD);
pub(super) const AFFINE: [Instance; 2] = typed(kernels::AFFINE);
pub(super) const SILU: [Instance; 2] = typed(kernels::SILU);
pub(super) const SILU_INTO: [Instance; 2] = typed(kernels::SILU_INTO);
pub(super) const CLAMP: [Instance; 2] = typed(kernels::CLAMP);
pub(super) const CAST: [Instance; 2] = [
    Instance { kernel: kernels::CAST_F32_BF16, types: &[("TI", DType::F32), ("TO", DType::BF16)] },
    Instance { kernel: kernels::CAST_BF16_F32, types: &[("TI", DType::BF16), ("TO", DType::F32)] },
];

kernel_args! {
    /// `add_*`: `out[i] = a[i] + b[i]` for `i < n`.
    struct Add<'a> {
        a: [const T*],
        b: [const T*],
        out: [T*],
        n: [u64],
    }

    /// `affine_*`: `out[i] = x[i] · mul + add`, two roundings.
    struct Affine<'a> {
        x: [const T*],
        out: [T*],
        n: [u64],
        mul: [float],
        add: [float],
    }

    /// `silu_*`: SiLU of `x[i]` in place.
    struct Silu<'a> {
        x: [T*],
        n: [u64],
    }

    /// `silu_into_*`: `out[i] = silu(x[i])`.
    struct SiluInto<'a> {
        x: [const T*],
        out: [T*],
        n: [u64],
    }

    /// `clamp_*`: `x[i]` clamped to `[lo, hi]` in place.
    struct Clamp<'a> {
        x: [T*],
        n: [u64],
        lo: [float],
        hi: [float],
    }

    /// `cast_f32_bf16` / `cast_bf16_f32`: `out[i] = x[i]` in the other storage type.
    struct Cast<'a> {
        x: [const TI*],
        out: [TO*],
        n: [u64],
    }
}

/// Queues one of `instances` (the one the operands select) over `n` elements of every buffer in
/// `lens`.
fn launch<A: KernelArgs>(
    args: A,
    instances: &[Instance],
    lens: &[(&str, usize)],
    n: u64,
    device: &CudaDevice,
    cfg: LaunchConfig,
) -> Result<(), LaunchError> {
    let instance = select(&args, instances)?;
    for &(what, len) in lens {
        holds(instance.kernel, what, len, Some(n))?;
    }
    let f = device.function(instance.kernel)?;
    // SAFETY: `instance` is the instantiation whose storage types are the operands' (`select`),
    // `f` its entry point, and `A` declares its parameters (the signature test checks them
    // against elementwise.cu). The kernel's grid-stride loop touches elements `i < n` of each
    // buffer, whatever `cfg`, and every buffer holds `n` (checked); the written one is a unique
    // borrow (`DataViewMut`).
    unsafe { enqueue(args, device, &f, cfg) }
}

impl Add<'_> {
    /// Queues the sum on `device`.
    pub(crate) fn launch(self, device: &CudaDevice, cfg: LaunchConfig) -> Result<(), LaunchError> {
        let lens = [("a", self.a.len()), ("b", self.b.len()), ("out", self.out.len())];
        let n = self.n;
        launch(self, &ADD, &lens, n, device, cfg)
    }
}

impl Affine<'_> {
    /// Queues the affine map on `device`.
    pub(crate) fn launch(self, device: &CudaDevice, cfg: LaunchConfig) -> Result<(), LaunchError> {
        let lens = [("x", self.x.len()), ("out", self.out.len())];
        let n = self.n;
        launch(self, &AFFINE, &lens, n, device, cfg)
    }
}

impl Silu<'_> {
    /// Queues the in-place SiLU on `device`.
    pub(crate) fn launch(self, device: &CudaDevice, cfg: LaunchConfig) -> Result<(), LaunchError> {
        let lens = [("x", self.x.len())];
        let n = self.n;
        launch(self, &SILU, &lens, n, device, cfg)
    }
}

impl SiluInto<'_> {
    /// Queues the SiLU on `device`.
    pub(crate) fn launch(self, device: &CudaDevice, cfg: LaunchConfig) -> Result<(), LaunchError> {
        let lens = [("x", self.x.len()), ("out", self.out.len())];
        let n = self.n;
        launch(self, &SILU_INTO, &lens, n, device, cfg)
    }
}

impl Clamp<'_> {
    /// Queues the in-place clamp on `device`.
    pub(crate) fn launch(self, device: &CudaDevice, cfg: LaunchConfig) -> Result<(), LaunchError> {
        let lens = [("x", self.x.len())];
        let n = self.n;
        launch(self, &CLAMP, &lens, n, device, cfg)
    }
}

impl Cast<'_> {
    /// Queues the cast on `device`.
    pub(crate) fn launch(self, device: &CudaDevice, cfg: LaunchConfig) -> Result<(), LaunchError> {
        let lens = [("x", self.x.len()), ("out", self.out.len())];
        let n = self.n;
        launch(self, &CAST, &lens, n, device, cfg)
    }
}
