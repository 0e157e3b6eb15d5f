//! The ops of `kernels-cu/gemm.cu`: batched GEMM on CUDA cores, matmul and linear.

use cudarc::driver::LaunchConfig;

use super::storage::CudaStorage;
use crate::backend::{DeviceElementwise, DeviceLayout, DeviceLinalg, DeviceStore};
use crate::kernel_args::GemmBatched;
use crate::{DType, Result, TensorError};

impl DeviceLinalg for CudaStorage {
    /// Batched matrix product `[batch, m, k] · [batch, k, n]`, both dense and of one type. bf16
    /// accumulates into f32 and rounds once at the end.
    fn matmul(&self, rhs: &Self, [batch, m, n, k]: [usize; 4]) -> Result<Self> {
        self.same_dtype("matmul", &[rhs])?;
        let mut out = self.like_typed(batch * m * n, DType::F32)?;
        self.gemm_batched(rhs, &mut out, [batch, m, n, k], [m * k, k, 1], [k * n, n, 1], 1.0, 0.0)?;
        out.to_dtype(self.dtype())
    }

    /// `F.linear` over `rows` rows: `x [rows, k] · weightᵀ [k, n] + bias` (x and weight of one
    /// type, the bias f32). As on the CPU (and in PyTorch's `addmm`), the bias is the value the
    /// product is added onto: an f32 output starts as the bias broadcast over the rows (a box
    /// copy with row stride 0), the GEMM adds to it with `beta = 1`, and bf16 rounds once at
    /// the end.
    fn linear(&self, weight: &Self, bias: Option<&Self>, [rows, n, k]: [usize; 3]) -> Result<Self> {
        self.same_dtype("linear", &[weight])?;
        let mut out = self.like_typed(rows * n, DType::F32)?;
        let beta = match bias {
            Some(b) => {
                Self::f32_param("linear", b)?;
                b.copy_box_into(&[0, 1], 0, &mut out, &[n, 1], 0, &[rows, n])?;
                1.0
            }
            None => 0.0,
        };
        // Element (kk, j) of weightᵀ is weight[j, kk]: row stride 1, column stride k.
        self.gemm_batched(weight, &mut out, [1, rows, n, k], [0, k, 1], [0, 1, k], 1.0, beta)?;
        out.to_dtype(self.dtype())
    }
}

impl CudaStorage {
    /// `c[b] = alpha · a[b] · b[b] + beta · c[b]` for every batch `b` (`gemm_batched_f32`; `c`
    /// is only read when `beta ≠ 0`), operands given by their `[batch, row, column]` element
    /// strides, `c` dense.
    #[allow(clippy::too_many_arguments)] // the GEMM's own parameter list
    pub(super) fn gemm_batched(
        &self,
        b: &Self,
        c: &mut Self,
        [batch, m, n, k]: [usize; 4],
        a_strides: [usize; 3],
        b_strides: [usize; 3],
        alpha: f32,
        beta: f32,
    ) -> Result<()> {
        // The kernel's three instantiations (see `GemmBatched`).
        match (self.dtype(), b.dtype(), c.dtype()) {
            (DType::F32, DType::F32, DType::F32)
            | (DType::BF16, DType::BF16, DType::F32)
            | (DType::F32, DType::BF16, DType::BF16) => {}
            (x, y, z) => {
                return Err(TensorError::InvalidArgument {
                    op: "gemm",
                    reason: format!("no GEMM kernel for {x} x {y} -> {z}"),
                });
            }
        }
        // One block per 64x64 tile of one batch entry: rows in grid y and batches in grid z,
        // both limited to 65535 by the hardware.
        if m.div_ceil(64) > 65_535 || batch > 65_535 {
            return Err(TensorError::InvalidArgument {
                op: "gemm",
                reason: format!(
                    "{batch} batches of {m} rows exceed one launch (at most 65535 batches and 65535 x 64 rows)"
                ),
            });
        }
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(64) as u32, m.div_ceil(64) as u32, batch as u32),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let [a_batch, a_rs, a_cs] = a_strides.map(|v| v as i64);
        let [b_batch, b_rs, b_cs] = b_strides.map(|v| v as i64);
        let product = GemmBatched {
            a: self.data.view(0),
            b: b.data.view(0),
            c: c.data.view_mut(0),
            m: m as u64,
            n: n as u64,
            k: k as u64,
            a_batch,
            a_rs,
            a_cs,
            b_batch,
            b_rs,
            b_cs,
            c_batch: (m * n) as i64,
            ldc: n as i64,
            alpha,
            beta,
        };
        product.launch(&self.device, cfg).map_err(self.err("gemm"))?;
        Ok(())
    }
}
