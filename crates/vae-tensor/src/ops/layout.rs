//! Shape and layout ops: reshape, permute, transpose, and the VAE posterior's mean.

use rayon::prelude::*;

use crate::backend::{DeviceLayout, DeviceStore};
use crate::memory::Buffer;
use crate::ops::PAR_MIN_ELEMS;
use crate::{Result, Shape, Tensor, TensorError};

/// Side of the square tiles the batched 2-D transpose copies, so that both the reads and the
/// writes of a tile stay within a few cache lines per row.
const TILE: usize = 32;

impl Tensor {
    /// A copy with the same elements in row-major order and a new shape of equal element count.
    pub fn reshape(&self, shape: impl Into<Shape>) -> Result<Tensor> {
        self.clone().into_reshaped(shape)
    }

    /// [`Tensor::reshape`] without a copy, consuming `self`.
    pub fn into_reshaped(self, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        if shape.checked_elem_count() != Some(self.elem_count()) {
            return Err(TensorError::ShapeMismatch { op: "reshape", lhs: self.shape().clone(), rhs: shape });
        }
        let mut t = self;
        t.set_shape(shape);
        Ok(t)
    }

    /// A copy with dimensions reordered: output dimension `i` is input dimension `dims[i]`, as
    /// `torch.permute(...).contiguous()`. `dims` must be a permutation of `0..rank`.
    pub fn permute(&self, dims: &[usize]) -> Result<Tensor> {
        let _profile = crate::profile::Scope::new("permute");
        const OP: &str = "permute";
        let rank = self.rank();
        let mut seen = vec![false; rank];
        let valid = dims.len() == rank && dims.iter().all(|&d| d < rank && !std::mem::replace(&mut seen[d], true));
        if !valid {
            return Err(TensorError::InvalidArgument {
                op: OP,
                reason: format!("{dims:?} is not a permutation of the dimensions of {}", self.shape()),
            });
        }
        let src_dims = self.dims();
        let out_dims: Vec<usize> = dims.iter().map(|&d| src_dims[d]).collect();
        if let Some(x) = self.cuda() {
            // Walk the output in row-major order, reading the input through permuted strides.
            let in_strides = self.shape().strides();
            let src_strides: Vec<usize> = dims.iter().map(|&d| in_strides[d]).collect();
            let out_shape = Shape::new(out_dims.clone());
            // The box covers the whole output: no need to clear it first.
            let mut out = x.uninit_like(out_shape.elem_count())?;
            x.copy_box_into(&src_strides, 0, &mut out, &out_shape.strides(), 0, &out_dims)?;
            return Ok(Tensor::from_cuda(out, out_shape));
        }
        let src = self.as_slice_f32()?;
        let mut out = Buffer::for_overwrite(src.len());
        if !src.is_empty() {
            if dims.iter().enumerate().all(|(i, &d)| i == d) {
                out.as_mut_slice().copy_from_slice(src);
            } else if rank >= 2
                && dims[..rank - 2].iter().enumerate().all(|(i, &d)| i == d)
                && dims[rank - 2..] == [rank - 1, rank - 2]
            {
                let (r, c) = (src_dims[rank - 2], src_dims[rank - 1]);
                transpose_batched(src, out.as_mut_slice(), r, c);
            } else {
                permute_general(src, src_dims, dims, &out_dims, out.as_mut_slice());
            }
        }
        Ok(Tensor::from_buffer(out, Shape::new(out_dims)))
    }

    /// A copy with dimensions `d0` and `d1` swapped.
    pub fn transpose(&self, d0: usize, d1: usize) -> Result<Tensor> {
        self.check_dim("transpose", d0)?;
        self.check_dim("transpose", d1)?;
        let mut dims: Vec<usize> = (0..self.rank()).collect();
        dims.swap(d0, d1);
        self.permute(&dims)
    }

    /// The mean of diffusers' `DiagonalGaussianDistribution` for encoder moments
    /// `[N, 2C, *]`: the first `C` channels (the rest are the log-variance).
    pub fn diag_gaussian_mean(&self) -> Result<Tensor> {
        let _profile = crate::profile::Scope::new("diag_gaussian_mean");
        const OP: &str = "diag_gaussian_mean";
        if self.rank() < 2 || !self.dims()[1].is_multiple_of(2) {
            return Err(TensorError::InvalidArgument {
                op: OP,
                reason: format!("moments must be [N, 2C, ...] with an even channel count, got {}", self.shape()),
            });
        }
        self.narrow(1, 0, self.dims()[1] / 2)
    }
}

/// `out[b][j][i] = src[b][i][j]` for `b` batches of `r × c` matrices, in square tiles.
fn transpose_batched(src: &[f32], out: &mut [f32], r: usize, c: usize) {
    let mat = r * c;
    if mat >= PAR_MIN_ELEMS {
        // Large matrices: bands of TILE output rows (source columns) in parallel.
        for (dst, s) in out.chunks_mut(mat).zip(src.chunks(mat)) {
            dst.par_chunks_mut(TILE * r)
                .enumerate()
                .for_each(|(band, dst)| transpose_tile_rows(s, dst, r, c, band * TILE));
        }
    } else if src.len() >= PAR_MIN_ELEMS {
        out.par_chunks_mut(mat).zip(src.par_chunks(mat)).for_each(|(dst, s)| transpose_tile_rows(s, dst, r, c, 0));
    } else {
        out.chunks_mut(mat).zip(src.chunks(mat)).for_each(|(dst, s)| transpose_tile_rows(s, dst, r, c, 0));
    }
}

/// Writes output rows `j0..j0 + dst.len() / r` of the transpose of the `r × c` matrix `src`
/// into `dst`, TILE source rows at a time.
fn transpose_tile_rows(src: &[f32], dst: &mut [f32], r: usize, c: usize, j0: usize) {
    let cols = dst.len() / r;
    for i0 in (0..r).step_by(TILE) {
        for jb in (0..cols).step_by(TILE) {
            for j in jb..(jb + TILE).min(cols) {
                for i in i0..(i0 + TILE).min(r) {
                    dst[j * r + i] = src[i * c + j0 + j];
                }
            }
        }
    }
}

/// Any permutation: each output row (run of the last output dimension) is gathered from the
/// source with the permuted strides; rows run in parallel.
fn permute_general(src: &[f32], src_dims: &[usize], perm: &[usize], out_dims: &[usize], out: &mut [f32]) {
    let src_strides = Shape::new(src_dims.to_vec()).strides();
    let strides: Vec<usize> = perm.iter().map(|&d| src_strides[d]).collect();
    let rank = out_dims.len();
    let row = out_dims[rank - 1];
    let inner_stride = strides[rank - 1];
    let gather = |(r, dst): (usize, &mut [f32])| {
        // Source offset of the row's first element, from the row index's digits.
        let mut rest = r;
        let mut off = 0;
        for d in (0..rank - 1).rev() {
            off += (rest % out_dims[d]) * strides[d];
            rest /= out_dims[d];
        }
        if inner_stride == 1 {
            dst.copy_from_slice(&src[off..][..row]);
        } else {
            for (k, v) in dst.iter_mut().enumerate() {
                *v = src[off + k * inner_stride];
            }
        }
    };
    if out.len() < PAR_MIN_ELEMS {
        out.chunks_mut(row).enumerate().for_each(gather);
    } else {
        out.par_chunks_mut(row).enumerate().for_each(gather);
    }
}
