//! `kernels-cu/gemm.cu`: the batched GEMM on CUDA cores, `C[b] = alpha · A[b] B[b] + beta ·
//! C[b]` with any strides.

use cudarc::driver::LaunchConfig;

use super::{Instance, LaunchError, enqueue, holds_offsets, kernel_args, reach, require, select};
use crate::DType;
use crate::cuda::backend::CudaDevice;
use crate::cuda::kernels;

pub(super) const GEMM_BATCHED: [Instance; 3] = [
    Instance { kernel: kernels::GEMM_F32, types: &[("TA", DType::F32), ("TB", DType::F32), ("TC", DType::F32)] },
    Instance {
        kernel: kernels::GEMM_BF16_BF16_F32,
        types: &[("TA", DType::BF16), ("TB", DType::BF16), ("TC", DType::F32)],
    },
    Instance {
        kernel: kernels::GEMM_F32_BF16_BF16,
        types: &[("TA", DType::F32), ("TB", DType::BF16), ("TC", DType::BF16)],
    },
];

kernel_args! {
    /// `gemm_batched_*`: for every batch `z` of the grid's z extent, `C = alpha · A B + beta · C`
    /// over `M × K` by `K × N`, element `(i, j)` of `A` at `z · a_batch + i · a_rs + j · a_cs`
    /// (likewise `B`), of `C` at `z · c_batch + i · ldc + j`; `C` is read only where `beta ≠ 0`.
    struct GemmBatched<'a> {
        a: [const TA*],
        b: [const TB*],
        c: [TC*],
        m: [u64],
        n: [u64],
        k: [u64],
        a_batch: [i64],
        a_rs: [i64],
        a_cs: [i64],
        b_batch: [i64],
        b_rs: [i64],
        b_cs: [i64],
        c_batch: [i64],
        ldc: [i64],
        alpha: [float],
        beta: [float],
    }
}

impl GemmBatched<'_> {
    /// Queues the product on `device`: blocks of 256 threads, one per 64 × 64 tile of `C` (grid
    /// x over `N`, y over `M`) and batch (grid z).
    pub(crate) fn launch(self, device: &CudaDevice, cfg: LaunchConfig) -> Result<(), LaunchError> {
        let instance = select(&self, &GEMM_BATCHED)?;
        let kernel = instance.kernel;
        let (gx, gy, batch) = cfg.grid_dim;
        let (m, n, k, batch) = (self.m, self.n, self.k, u64::from(batch));
        let covered = u64::from(gx) * 64 >= n && u64::from(gy) * 64 >= m;
        require(kernel, cfg.block_dim == (256, 1, 1) && covered, || {
            format!("grid {:?} of {:?} for {m} x {n}; the kernel takes blocks of 256", cfg.grid_dim, cfg.block_dim)
        })?;
        if batch > 0 && m > 0 && k > 0 {
            let offsets = reach(&[batch, m, k], &[self.a_batch, self.a_rs, self.a_cs]);
            holds_offsets(kernel, "a", self.a.len(), offsets)?;
        }
        if batch > 0 && k > 0 && n > 0 {
            let offsets = reach(&[batch, k, n], &[self.b_batch, self.b_rs, self.b_cs]);
            holds_offsets(kernel, "b", self.b.len(), offsets)?;
        }
        if batch > 0 && m > 0 && n > 0 {
            let offsets = reach(&[batch, m, n], &[self.c_batch, self.ldc, 1]);
            holds_offsets(kernel, "c", self.c.len(), offsets)?;
        }
        let f = device.function(kernel)?;
        // SAFETY: `instance` is the instantiation of the operands' three storage types, `f` its
        // entry point, and `Self` declares its parameters (signature test, against gemm.cu).
        // Block `(x, y, z)` loads `A` at rows `i < M` and depths `< K`, `B` at depths `< K` and
        // columns `j < N` (both bounds tested per element) and stores `C` at `i < M`, `j < N`, of
        // batch `z` below the grid's z extent: every offset lies between the lowest and highest
        // that these extents and strides reach, inside the buffers (checked). Its tile loads
        // assume exactly 256 threads (checked).
        unsafe { enqueue(self, device, &f, cfg) }
    }
}
