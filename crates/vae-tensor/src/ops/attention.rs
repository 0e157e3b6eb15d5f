//! Softmax and single-head scaled dot-product attention.

use rayon::prelude::*;

use crate::backend::{DeviceAttention, DeviceStorage};
use crate::memory::Buffer;
use crate::ops::PAR_MIN_ELEMS;
use crate::ops::gemm::{MatMut, MatRef, matmul_into};
use crate::{Result, Shape, Tensor, TensorError};

/// Score elements held at once by [`Tensor::attention`] (16 MiB of f32).
const SCORE_BLOCK_ELEMS: usize = 1 << 22;
/// Bounds on the query rows per block: enough rows to keep the GEMMs efficient, few enough to
/// bound the scores for long key sequences.
const MIN_BLOCK_ROWS: usize = 32;
const MAX_BLOCK_ROWS: usize = 1024;

/// Softmax of one row in place: `exp(x − max) / Σ exp(x − max)`, summed in f64. A row of all
/// `-inf` gives NaN, as in PyTorch.
fn softmax_row(row: &mut [f32]) {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| if x > m || x.is_nan() { x } else { m });
    let mut sum = 0.0f64;
    for x in row.iter_mut() {
        *x = (*x - max).exp();
        sum += *x as f64;
    }
    let inv = (1.0 / sum) as f32;
    row.iter_mut().for_each(|x| *x *= inv);
}

/// Softmax of every row of `data` (rows of `len`), rows in parallel when large.
fn softmax_rows(data: &mut [f32], len: usize) {
    if len == 0 {
        return;
    }
    if data.len() < PAR_MIN_ELEMS {
        data.chunks_exact_mut(len).for_each(softmax_row);
    } else {
        data.par_chunks_exact_mut(len).with_min_len((PAR_MIN_ELEMS / 4 / len).max(1)).for_each(softmax_row);
    }
}

impl Tensor {
    /// Softmax over the last dimension.
    pub fn softmax_last_dim(&self) -> Result<Tensor> {
        let _profile = crate::profile::Scope::new("softmax");
        let Some(&len) = self.dims().last() else {
            return Err(TensorError::InvalidArgument { op: "softmax_last_dim", reason: "needs rank >= 1".into() });
        };
        let mut out = self.clone();
        softmax_rows(out.as_mut_slice_f32()?, len);
        Ok(out)
    }

    /// Single-head scaled dot-product attention, `softmax(q · kᵀ / sqrt(D)) · v`, for `q`
    /// `[B, N, D]`, `k` `[B, M, D]` and `v` `[B, M, Dv]`; the output is `[B, N, Dv]`. This is
    /// the core of the diffusers VAE mid-block attention (after the q/k/v projections).
    ///
    /// Queries are processed in blocks so the `N × M` score matrix is never materialised: at
    /// most 1024 rows (and about 16 MiB of scores) at a time, which for a 128x128 latent
    /// (`N = M = 16384`) is 256 rows.
    pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let _profile = crate::profile::Scope::new("attention");
        const OP: &str = "attention";
        q.check_same_device(OP, k)?;
        q.check_same_device(OP, v)?;
        let mismatch = |a: &Tensor, b: &Tensor| TensorError::ShapeMismatch {
            op: OP,
            lhs: a.shape().clone(),
            rhs: b.shape().clone(),
        };
        let (&[b, n, d], &[kb, m, kd], &[vb, vm, dv]) = (q.dims(), k.dims(), v.dims()) else {
            return Err(TensorError::InvalidArgument {
                op: OP,
                reason: format!("q, k, v must be [B, N, D], got {}, {}, {}", q.shape(), k.shape(), v.shape()),
            });
        };
        if kb != b || kd != d {
            return Err(mismatch(q, k));
        }
        if vb != b || vm != m {
            return Err(mismatch(k, v));
        }
        if d == 0 {
            return Err(TensorError::InvalidArgument { op: OP, reason: "head dimension is 0".into() });
        }
        let scale = (1.0 / (d as f64).sqrt()) as f32;
        if let (Some(qc), Some(kc), Some(vc)) = (q.cuda(), k.cuda(), v.cuda()) {
            let out = DeviceStorage::attention(qc, kc, vc, [b, n, m, d, dv], scale)?;
            return Ok(Tensor::from_cuda(out, Shape::new([b, n, dv])));
        }
        let rows = (SCORE_BLOCK_ELEMS / m.max(1)).clamp(MIN_BLOCK_ROWS, MAX_BLOCK_ROWS).min(n.max(1));
        let mut scores = Buffer::zeros(rows * m);
        let mut out = Buffer::zeros(b * n * dv);
        let (qd, kd, vd) = (q.as_slice_f32()?, k.as_slice_f32()?, v.as_slice_f32()?);
        for bi in 0..b {
            for r0 in (0..n).step_by(rows) {
                let br = rows.min(n - r0);
                let s = &mut scores.as_mut_slice()[..br * m];
                // scores = scale · q[r0..r0+br] · kᵀ; element (j, i) of kᵀ is k[i, j].
                matmul_into(
                    [br, m, d],
                    MatMut { data: &mut *s, offset: 0, rs: m, cs: 1 },
                    MatRef { data: qd, offset: (bi * n + r0) * d, rs: d, cs: 1 },
                    MatRef { data: kd, offset: bi * m * d, rs: 1, cs: d },
                    false,
                    scale,
                )?;
                softmax_rows(s, m);
                matmul_into(
                    [br, dv, m],
                    MatMut { data: out.as_mut_slice(), offset: (bi * n + r0) * dv, rs: dv, cs: 1 },
                    MatRef { data: s, offset: 0, rs: m, cs: 1 },
                    MatRef { data: vd, offset: bi * m * dv, rs: dv, cs: 1 },
                    false,
                    1.0,
                )?;
            }
        }
        Ok(Tensor::from_buffer(out, Shape::new([b, n, dv])))
    }
}
