//! Matrix products: batched matmul and `nn.Linear`.

use crate::backend::DeviceLinalg;
use crate::memory::Buffer;
use crate::ops::gemm::{MatMut, MatRef, matmul_into};
use crate::{Result, Shape, Tensor, TensorError};

impl Tensor {
    /// Batched matrix product `[.., M, K] · [.., K, N] → [.., M, N]`. Both operands must have
    /// the same rank (at least 2) and equal leading (batch) dimensions; there is no broadcasting.
    pub fn matmul(&self, rhs: &Tensor) -> Result<Tensor> {
        let _profile = crate::profile::Scope::new("matmul");
        const OP: &str = "matmul";
        self.check_same_device(OP, rhs)?;
        let r = self.rank();
        let mismatch = || TensorError::ShapeMismatch { op: OP, lhs: self.shape().clone(), rhs: rhs.shape().clone() };
        if r < 2
            || rhs.rank() != r
            || self.dims()[..r - 2] != rhs.dims()[..r - 2]
            || self.dims()[r - 1] != rhs.dims()[r - 2]
        {
            return Err(mismatch());
        }
        let (m, k, n) = (self.dims()[r - 2], self.dims()[r - 1], rhs.dims()[r - 1]);
        let batch: usize = self.dims()[..r - 2].iter().product();
        let mut dims = self.dims().to_vec();
        dims[r - 1] = n;
        if let (Some(a), Some(b)) = (self.cuda(), rhs.cuda()) {
            return Ok(Tensor::from_cuda(a.matmul(b, [batch, m, n, k])?, Shape::new(dims)));
        }
        let mut out = Buffer::zeros(batch * m * n);
        let (a, b) = (self.as_slice_f32()?, rhs.as_slice_f32()?);
        for i in 0..batch {
            matmul_into(
                [m, n, k],
                MatMut { data: out.as_mut_slice(), offset: i * m * n, rs: n, cs: 1 },
                MatRef { data: a, offset: i * m * k, rs: k, cs: 1 },
                MatRef { data: b, offset: i * k * n, rs: n, cs: 1 },
                false,
                1.0,
            )?;
        }
        Ok(Tensor::from_buffer(out, Shape::new(dims)))
    }

    /// `torch.nn.functional.linear`: `y = x · weightᵀ + bias` over the last dimension, with
    /// `x` `[.., in]`, `weight` `[out, in]` and `bias` `[out]`; the output is `[.., out]`. As in
    /// PyTorch's `addmm`, the bias is the initial value the product accumulates onto.
    pub fn linear(&self, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        let _profile = crate::profile::Scope::new("linear");
        const OP: &str = "linear";
        self.check_same_device(OP, weight)?;
        let mismatch =
            |t: &Tensor| TensorError::ShapeMismatch { op: OP, lhs: self.shape().clone(), rhs: t.shape().clone() };
        let (Some(&k), &[n, wk]) = (self.dims().last(), weight.dims()) else { return Err(mismatch(weight)) };
        if wk != k {
            return Err(mismatch(weight));
        }
        if let Some(b) = bias {
            self.check_same_device(OP, b)?;
            if b.dims() != [n] {
                return Err(mismatch(b));
            }
        }
        let rows: usize = self.dims()[..self.rank() - 1].iter().product();
        let mut dims = self.dims().to_vec();
        *dims.last_mut().expect("rank >= 1 checked above") = n;
        if let (Some(x), Some(w)) = (self.cuda(), weight.cuda()) {
            let b = bias
                .map(|b| {
                    b.cuda()
                        .ok_or_else(|| TensorError::InvalidArgument { op: OP, reason: "bias not on the device".into() })
                })
                .transpose()?;
            return Ok(Tensor::from_cuda(x.linear(w, b, [rows, n, k])?, Shape::new(dims)));
        }
        let mut out = Buffer::zeros(rows * n);
        if let Some(b) = bias {
            let b = b.as_slice_f32()?;
            if n > 0 {
                out.as_mut_slice().chunks_exact_mut(n).for_each(|row| row.copy_from_slice(b));
            }
        }
        matmul_into(
            [rows, n, k],
            MatMut { data: out.as_mut_slice(), offset: 0, rs: n, cs: 1 },
            MatRef { data: self.as_slice_f32()?, offset: 0, rs: k, cs: 1 },
            // weightᵀ: element (kk, j) is weight[j, kk].
            MatRef { data: weight.as_slice_f32()?, offset: 0, rs: 1, cs: k },
            bias.is_some(),
            1.0,
        )?;
        Ok(Tensor::from_buffer(out, Shape::new(dims)))
    }
}
