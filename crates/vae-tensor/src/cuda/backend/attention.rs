//! Attention: two products around the row softmax of `kernels-cu/attention.cu`, on the
//! tensor-core convolution where the rows allow it.

use cudarc::driver::LaunchConfig;

use super::select::{ConvKernel, SCORES_TILE, TensorCoreMath, TensorCoreTile, tensor_core_tile};
use super::storage::CudaStorage;
use crate::abi::ConvGeom;
use crate::backend::{DeviceAttention, DeviceLayout, DeviceStore};
use crate::kernel_args::{ConvProduct, SoftmaxRows, SoftmaxRowsToBf16};
use crate::{DType, Result};

impl DeviceAttention for CudaStorage {
    /// Single-head attention `softmax(q kᵀ · scale) v` for `[batch, n, d]`, `[batch, m, d]`,
    /// `[batch, m, dv]`: two products around the row softmax, on the tensor cores where the rows
    /// allow it ([`Self::attention_on_tensor_cores`]), else the CUDA-core batched GEMM.
    fn attention(q: &Self, k: &Self, v: &Self, [batch, n, m, d, dv]: [usize; 5], scale: f32) -> Result<Self> {
        q.same_dtype("attention", &[k, v])?;
        // The tensor cores take rows of whole 16-byte chunks: d (Q and K rows) and m (rows of P
        // and of Vᵀ) in multiples of 8 bf16 or 4 f32 (Wan's mid block: d 384, m 60 x 104).
        let chunk = 16 / q.dtype().size_in_bytes();
        let shortest_tile = 64;
        if d % chunk == 0 && m % chunk == 0 && n.max(m) < i32::MAX as usize && n.div_ceil(shortest_tile) <= 65_535 {
            return Self::attention_on_tensor_cores(q, k, v, [batch, n, m, d, dv], scale);
        }
        // Scores and probabilities in f32 whatever the operands' type (as flash attention keeps
        // them); only the output is rounded to the operands' type.
        let mut scores = q.like_typed(batch * n * m, DType::F32)?;
        // Element (i, j) of kᵀ is k[j, i]: row stride 1, column stride d.
        q.gemm_batched(k, &mut scores, [batch, n, m, d], [n * d, d, 1], [m * d, 1, d], scale, 0.0)?;
        q.softmax_rows(&mut scores, None, batch * n, m, 1.0)?;
        let mut out = q.like(batch * n * dv)?;
        scores.gemm_batched(v, &mut out, [batch, n, dv, m], [n * m, m, 1], [m * dv, dv, 1], 1.0, 0.0)?;
        Ok(out)
    }
}

impl CudaStorage {
    /// `softmax(scores * scale)` row by row: in place (`probabilities` none), or into bf16
    /// probabilities.
    pub(super) fn softmax_rows(
        &self,
        scores: &mut Self,
        probabilities: Option<&mut Self>,
        rows: usize,
        cols: usize,
        scale: f32,
    ) -> Result<()> {
        let blocks = rows.clamp(1, 1 << 20) as u32;
        let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let (rows, cols) = (rows as u64, cols as u64);
        let x = scores.data.view_mut(0);
        let launched = match probabilities {
            None => SoftmaxRows { x, rows, cols, scale }.launch(&self.device, cfg),
            Some(p) => SoftmaxRowsToBf16 { x, p: p.data.view_mut(0), rows, cols, scale }.launch(&self.device, cfg),
        };
        launched.map_err(self.err("attention"))?;
        Ok(())
    }

    /// Attention with both products on the tensor-core convolution, as 1x1 convolutions of one
    /// batch each: the scores `Q Kᵀ` (`n` filters `Q[i]` over `m` pixels `K[j]` of `d` channels),
    /// f32 from bf16 operands as flash attention keeps them; the softmax into probabilities P of
    /// the operands' type (bf16 rounds them, as flash attention does); then `P V` (`n` filters
    /// `P[i]` over `dv` pixels `Vᵀ[c]` of `m` channels), which writes `[n, dv]` row by row.
    pub(super) fn attention_on_tensor_cores(
        q: &Self,
        k: &Self,
        v: &Self,
        [batch, n, m, d, dv]: [usize; 5],
        scale: f32,
    ) -> Result<Self> {
        let bf16 = q.dtype() == DType::BF16;
        let sms = q.device.sms as u64;
        // Every product below writes all of its output.
        let mut scores = q.output_typed(batch * n * m, DType::F32)?;
        let tile = if bf16 {
            SCORES_TILE
        } else {
            // Full f32 products in TF32 mode too, as PyTorch leaves matrix products in f32.
            tensor_core_tile(TensorCoreMath::F32, n as u64, m as u64, sms)
        };
        for b in 0..batch {
            q.tensor_core_gemm(tile, (k, b * m * d), (q, b * n * d), (&mut scores, b * n * m), [n, m, d])?;
        }
        let mut bf16_probabilities = if bf16 { Some(q.output(batch * n * m)?) } else { None };
        q.softmax_rows(&mut scores, bf16_probabilities.as_mut(), batch * n, m, scale)?;
        let p = bf16_probabilities.as_ref().unwrap_or(&scores);
        let mut vt = v.output(batch * dv * m)?;
        v.copy_box_into(&[m * dv, 1, dv], 0, &mut vt, &[dv * m, m, 1], 0, &[batch, dv, m])?;
        let mut out = q.output(batch * n * dv)?;
        let math = if bf16 { TensorCoreMath::Bf16 } else { TensorCoreMath::F32 };
        let tile = tensor_core_tile(math, n as u64, dv as u64, sms);
        for b in 0..batch {
            q.tensor_core_gemm(tile, (&vt, b * dv * m), (p, b * n * m), (&mut out, b * n * dv), [n, dv, m])?;
        }
        Ok(out)
    }

    /// `out[o][p] = Σ_c filters[o][c] · pixels[p][c]` for `[outs, pixels, channels]` (rows of
    /// whole 16-byte chunks), each operand from an element on: a 1x1 convolution on the
    /// tensor-core kernel `tile`, no bias.
    pub(super) fn tensor_core_gemm(
        &self,
        tile: TensorCoreTile,
        (pixels, pixels_from): (&Self, usize),
        (filters, filters_from): (&Self, usize),
        (out, out_from): (&mut Self, usize),
        [outs, cols, channels]: [usize; 3],
    ) -> Result<()> {
        let (outs, cols) = (outs as u64, cols as u64);
        let g = ConvGeom::pointwise(outs, cols, channels as u64);
        let cfg = LaunchConfig {
            grid_dim: tile.grid(cols, outs),
            block_dim: (256, 1, 1),
            shared_mem_bytes: tile.dynamic_shared_bytes(),
        };
        let product = ConvProduct {
            xp: pixels.data.view(pixels_from),
            wr: filters.data.view(filters_from),
            bias: None,
            out: out.data.view_mut(out_from),
            g,
        };
        product.launch(ConvKernel::TensorCores(tile), &self.device, cfg).map_err(self.err("attention"))?;
        Ok(())
    }
}
