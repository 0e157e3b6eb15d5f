//! Element-wise ops and zero padding.

use rayon::prelude::*;

use crate::backend::DeviceElementwise;
use crate::memory::Buffer;
use crate::ops::{PAR_MIN_ELEMS, par_chunks_apply, silu_into};
use crate::{Result, Shape, Tensor, TensorError};

/// PyTorch's clamp: NaN stays NaN, and `min > max` gives `max` everywhere.
#[inline]
fn clamp(x: f32, min: f32, max: f32) -> f32 {
    let x = if x < min { min } else { x };
    if x > max { max } else { x }
}

/// `f(src chunk, dst chunk)` over matching chunks of two equally long slices, in parallel when
/// they are large.
fn par_zip_apply(src: &[f32], dst: &mut [f32], f: impl Fn(&[f32], &mut [f32]) + Sync + Send) {
    if src.len() < PAR_MIN_ELEMS {
        f(src, dst);
    } else {
        dst.par_chunks_mut(PAR_MIN_ELEMS / 2).zip(src.par_chunks(PAR_MIN_ELEMS / 2)).for_each(|(d, s)| f(s, d));
    }
}

impl Tensor {
    /// A new tensor of `f` applied to every element, in parallel for large tensors.
    fn map(&self, f: impl Fn(f32) -> f32 + Sync + Send) -> Result<Tensor> {
        let src = self.as_slice_f32()?;
        let mut out = Buffer::for_overwrite(src.len());
        par_zip_apply(src, out.as_mut_slice(), |s, d| d.iter_mut().zip(s).for_each(|(d, &x)| *d = f(x)));
        Ok(Tensor::from_buffer(out, self.shape().clone()))
    }

    /// Applies `f` to every element in place.
    fn map_inplace(&mut self, f: impl Fn(f32) -> f32 + Sync + Send) -> Result<()> {
        par_chunks_apply(self.as_mut_slice_f32()?, |c| c.iter_mut().for_each(|x| *x = f(*x)));
        Ok(())
    }

    /// SiLU (swish), `x · sigmoid(x)`, element-wise.
    pub fn silu(&self) -> Result<Tensor> {
        let _profile = crate::profile::Scope::new("silu");
        if let Some(c) = self.cuda() {
            return Ok(Tensor::from_cuda(c.silu()?, self.shape().clone()));
        }
        let src = self.as_slice_f32()?;
        let mut out = Buffer::for_overwrite(src.len());
        par_zip_apply(src, out.as_mut_slice(), |s, d| silu_into(crate::ops::simd::isa(), s, d));
        Ok(Tensor::from_buffer(out, self.shape().clone()))
    }

    /// [`Tensor::silu`] in place.
    pub fn silu_inplace(&mut self) -> Result<()> {
        let _profile = crate::profile::Scope::new("silu");
        if let Some(c) = self.cuda_mut() {
            return c.silu_inplace();
        }
        let isa = crate::ops::simd::isa();
        par_chunks_apply(self.as_mut_slice_f32()?, |c| {
            let mut buf = [0.0f32; 256];
            for chunk in c.chunks_mut(256) {
                let n = chunk.len();
                buf[..n].copy_from_slice(chunk);
                silu_into(isa, &buf[..n], chunk);
            }
        });
        Ok(())
    }

    /// Element-wise sum of two tensors of the same shape (no broadcasting).
    pub fn add(&self, other: &Tensor) -> Result<Tensor> {
        let _profile = crate::profile::Scope::new("add");
        self.check_same_shape("add", other)?;
        if let (Some(a), Some(b)) = (self.cuda(), other.cuda()) {
            return Ok(Tensor::from_cuda(a.add(b)?, self.shape().clone()));
        }
        let (a, b) = (self.as_slice_f32()?, other.as_slice_f32()?);
        let mut out = Buffer::for_overwrite(a.len());
        let sum = |(o, (x, y)): (&mut [f32], (&[f32], &[f32]))| {
            o.iter_mut().zip(x.iter().zip(y)).for_each(|(o, (x, y))| *o = x + y);
        };
        if a.len() < PAR_MIN_ELEMS {
            sum((out.as_mut_slice(), (a, b)));
        } else {
            let chunk = PAR_MIN_ELEMS / 2;
            out.as_mut_slice().par_chunks_mut(chunk).zip(a.par_chunks(chunk).zip(b.par_chunks(chunk))).for_each(sum);
        }
        Ok(Tensor::from_buffer(out, self.shape().clone()))
    }

    /// `self += other` element-wise; shapes must be equal.
    pub fn add_assign(&mut self, other: &Tensor) -> Result<()> {
        let _profile = crate::profile::Scope::new("add");
        self.check_same_shape("add_assign", other)?;
        if let (Some(a), Some(b)) = (self.cuda(), other.cuda()) {
            // The kernel writes a third buffer: `self` cannot be both operand and output.
            let sum = a.add(b)?;
            *self = Tensor::from_cuda(sum, self.shape().clone());
            return Ok(());
        }
        let b = other.as_slice_f32()?;
        let a = self.as_mut_slice_f32()?;
        if a.len() < PAR_MIN_ELEMS {
            a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
        } else {
            a.par_chunks_mut(PAR_MIN_ELEMS / 2)
                .zip(b.par_chunks(PAR_MIN_ELEMS / 2))
                .for_each(|(a, b)| a.iter_mut().zip(b).for_each(|(x, y)| *x += y));
        }
        Ok(())
    }

    /// Every element times `factor`.
    pub fn mul_scalar(&self, factor: f32) -> Result<Tensor> {
        let _profile = crate::profile::Scope::new("scalar");
        if let Some(x) = self.cuda() {
            // `x · factor + (-0)` is `x · factor` exactly, signed zeros included.
            return Ok(Tensor::from_cuda(x.affine(factor, -0.0)?, self.shape().clone()));
        }
        self.map(|x| x * factor)
    }

    /// [`Tensor::mul_scalar`] in place.
    pub fn mul_scalar_inplace(&mut self, factor: f32) -> Result<()> {
        let _profile = crate::profile::Scope::new("scalar");
        if let Some(c) = self.cuda_mut() {
            return c.mul_scalar_inplace(factor);
        }
        self.map_inplace(|x| x * factor)
    }

    /// Every element divided by `divisor` (a true division, as PyTorch's `x / s`, which can
    /// differ in the last bit from multiplying by `1 / s`).
    pub fn div_scalar(&self, divisor: f32) -> Result<Tensor> {
        let _profile = crate::profile::Scope::new("scalar");
        if let Some(c) = self.cuda() {
            return Ok(Tensor::from_cuda(c.div_scalar(divisor)?, self.shape().clone()));
        }
        self.map(|x| x / divisor)
    }

    /// `value` added to every element.
    pub fn add_scalar(&self, value: f32) -> Result<Tensor> {
        let _profile = crate::profile::Scope::new("scalar");
        if let Some(c) = self.cuda() {
            return Ok(Tensor::from_cuda(c.add_scalar(value)?, self.shape().clone()));
        }
        self.map(|x| x + value)
    }

    /// `x · scale[c] + shift[c]` per channel (dimension 1 of `[N, C, *]`), rounded after the
    /// product and after the sum as PyTorch's `x * scale + shift` with broadcast vectors.
    pub fn channel_affine(&self, scale: &[f32], shift: &[f32]) -> Result<Tensor> {
        let _profile = crate::profile::Scope::new("channel_affine");
        let dims = self.check_per_channel("channel_affine", scale, shift)?;
        if let Some(c) = self.cuda() {
            return Ok(Tensor::from_cuda(c.channel_affine(scale, shift, dims)?, self.shape().clone()));
        }
        self.per_channel(scale, shift, |x, s, t| (x * s) + t)
    }

    /// `(x − mean[c]) / std[c]` per channel (dimension 1 of `[N, C, *]`), as PyTorch's
    /// `(x - mean) / std` with broadcast vectors.
    pub fn channel_normalize(&self, mean: &[f32], std: &[f32]) -> Result<Tensor> {
        let _profile = crate::profile::Scope::new("channel_affine");
        let dims = self.check_per_channel("channel_normalize", mean, std)?;
        if let Some(c) = self.cuda() {
            return Ok(Tensor::from_cuda(c.channel_normalize(mean, std, dims)?, self.shape().clone()));
        }
        self.per_channel(mean, std, |x, m, s| (x - m) / s)
    }

    /// Checks `[N, C, *]` against per-channel vectors `a` and `b`; returns `[N, C, inner]`.
    fn check_per_channel(&self, op: &'static str, a: &[f32], b: &[f32]) -> Result<[usize; 3]> {
        if self.rank() < 2 {
            return Err(TensorError::InvalidArgument { op, reason: format!("needs [N, C, *], got {}", self.shape()) });
        }
        let c = self.dims()[1];
        for v in [a, b] {
            if v.len() != c {
                return Err(TensorError::ShapeMismatch { op, lhs: self.shape().clone(), rhs: Shape::new([v.len()]) });
            }
        }
        Ok([self.dims()[0], c, self.dims()[2..].iter().product()])
    }

    /// Applies `f(x, a[c], b[c])` to every element of channel `c` of a host `[N, C, *]` that
    /// [`Self::check_per_channel`] accepted.
    fn per_channel(&self, a: &[f32], b: &[f32], f: impl Fn(f32, f32, f32) -> f32 + Sync + Send) -> Result<Tensor> {
        let c = self.dims()[1];
        let spatial: usize = self.dims()[2..].iter().product();
        let mut out = self.clone();
        if spatial > 0 {
            out.as_mut_slice_f32()?.par_chunks_mut(spatial).enumerate().for_each(|(i, plane)| {
                let (x, y) = (a[i % c], b[i % c]);
                plane.iter_mut().for_each(|v| *v = f(*v, x, y));
            });
        }
        Ok(out)
    }

    /// Every element limited to `[min, max]`, as `torch.clamp`: NaN elements stay NaN, and
    /// `min > max` sets everything to `max`. NaN bounds are an error.
    pub fn clamp(&self, min: f32, max: f32) -> Result<Tensor> {
        let _profile = crate::profile::Scope::new("clamp");
        check_bounds(min, max)?;
        if self.cuda().is_some() {
            let mut out = self.clone();
            out.clamp_inplace(min, max)?;
            return Ok(out);
        }
        self.map(|x| clamp(x, min, max))
    }

    /// [`Tensor::clamp`] in place.
    pub fn clamp_inplace(&mut self, min: f32, max: f32) -> Result<()> {
        let _profile = crate::profile::Scope::new("clamp");
        check_bounds(min, max)?;
        if let Some(c) = self.cuda_mut() {
            return c.clamp_inplace(min, max);
        }
        self.map_inplace(|x| clamp(x, min, max))
    }

    /// Zero padding of the last two dimensions by `[top, bottom, left, right]`, as
    /// `F.pad(x, (left, right, top, bottom))`.
    pub fn pad2d(&self, padding: [usize; 4]) -> Result<Tensor> {
        let _profile = crate::profile::Scope::new("pad2d");
        const OP: &str = "pad2d";
        let r = self.rank();
        if r < 2 {
            return Err(TensorError::InvalidArgument {
                op: OP,
                reason: format!("needs rank >= 2, got {}", self.shape()),
            });
        }
        let [top, bottom, left, right] = padding;
        let (h, w) = (self.dims()[r - 2], self.dims()[r - 1]);
        let overflow = || TensorError::InvalidArgument { op: OP, reason: format!("padding {padding:?} overflows") };
        let hp = h.checked_add(top).and_then(|v| v.checked_add(bottom)).ok_or_else(overflow)?;
        let wp = w.checked_add(left).and_then(|v| v.checked_add(right)).ok_or_else(overflow)?;
        let mut dims = self.dims().to_vec();
        dims[r - 2] = hp;
        dims[r - 1] = wp;
        let shape = Shape::new(dims);
        let len = shape.checked_elem_count().ok_or_else(overflow)?;
        let mut out = Buffer::zeros(len);
        let src = self.as_slice_f32()?;
        if h * w > 0 && len > 0 {
            out.as_mut_slice().par_chunks_mut(hp * wp).zip(src.par_chunks(h * w)).for_each(|(dst, src)| {
                for (y, row) in src.chunks_exact(w).enumerate() {
                    dst[(y + top) * wp + left..][..w].copy_from_slice(row);
                }
            });
        }
        Ok(Tensor::from_buffer(out, shape))
    }
}

fn check_bounds(min: f32, max: f32) -> Result<()> {
    if min.is_nan() || max.is_nan() {
        return Err(TensorError::InvalidArgument {
            op: "clamp",
            reason: format!("bounds must not be NaN: {min}, {max}"),
        });
    }
    Ok(())
}
