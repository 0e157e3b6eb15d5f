//! Group normalisation.

use rayon::prelude::*;

use crate::backend::DeviceNorm;
use crate::memory::Buffer;
use crate::ops::group_stats::GroupMoments;
use crate::ops::lanes::{self, LaneMap, Lanes, WideLanes};
use crate::{Result, Tensor, TensorError};

crate::ops::simd::isa_kernel! {
    /// One group (`per_group` channels of `spatial` values) normalised into `dst`.
    fn group_kernel(
        x: &[f32],
        dst: &mut [f32],
        params: (&[f32], &[f32]),
        spatial: usize,
        moments: GroupMoments,
        silu: bool,
    ) = normalize_group;
}

/// `(x − mean) · (γ · rstd) + β` evaluated in f64 and rounded once per element, then the
/// optional SiLU in f32.
#[inline(always)]
fn normalize_group<S: Lanes>(
    x: &[f32],
    dst: &mut [f32],
    (gamma, beta): (&[f32], &[f32]),
    spatial: usize,
    GroupMoments { mean, rstd }: GroupMoments,
    silu: bool,
) {
    for (j, (dst, x)) in dst.chunks_exact_mut(spatial).zip(x.chunks_exact(spatial)).enumerate() {
        let op = Normalize::<S> {
            mean: S::Wide::splat(mean),
            scale: S::Wide::splat(gamma[j] as f64 * rstd),
            shift: S::Wide::splat(beta[j] as f64),
            silu,
        };
        lanes::map::<S, _>(x, dst, &op);
    }
}

/// `(x − mean) · scale + shift` in f64, rounded to f32, then the optional SiLU.
struct Normalize<S: Lanes> {
    mean: S::Wide,
    scale: S::Wide,
    shift: S::Wide,
    silu: bool,
}

impl<S: Lanes> LaneMap<S> for Normalize<S> {
    #[inline(always)]
    fn apply(&self, v: S) -> S {
        let [lo, hi] = v.widen();
        let lo = S::Wide::fma(lo.sub(self.mean), self.scale, self.shift);
        let hi = S::Wide::fma(hi.sub(self.mean), self.scale, self.shift);
        let y = S::narrow([lo, hi]);
        if self.silu { lanes::silu(y) } else { y }
    }
}

impl Tensor {
    /// `torch.nn.functional.group_norm` on `[N, C, *]` (any trailing dimensions): for each
    /// sample and each of `num_groups` groups of `C / num_groups` channels, the mean and the
    /// biased variance over the group's channels and positions, then
    /// `y = (x − mean) / sqrt(var + eps) · weight[c] + bias[c]`.
    ///
    /// Statistics are exact two-pass sums in fixed point ([`GroupMoments`]), so they do not
    /// lose precision on large groups (a 512-channel 1024x1024 VAE activation has 16 M
    /// elements per group) and do not depend on how the group is split (a sharded decode
    /// computes the same ones from its bands); each output is evaluated in f64 and rounded
    /// once, which keeps it within about one f32 ulp of the exact result. Vectorised, with the
    /// same bits on every instruction set. (PyTorch's kernels compute
    /// `x · a + (beta − mean · a)` in f32, whose error grows with `|mean| / std`; this
    /// implementation is never further from exact than they are.)
    pub fn group_norm(&self, num_groups: usize, weight: &Tensor, bias: &Tensor, eps: f32) -> Result<Tensor> {
        let _profile = crate::profile::Scope::new("group_norm");
        self.group_norm_then(num_groups, weight, bias, eps, false)
    }

    /// [`Tensor::group_norm`] followed by [`Tensor::silu`], in one pass over the data (every
    /// norm of the VAE resnets is followed by a SiLU). On the CPU and in f32 on CUDA the result
    /// equals the two ops bit for bit; a bf16 CUDA tensor is rounded once instead of twice.
    pub fn group_norm_silu(&self, num_groups: usize, weight: &Tensor, bias: &Tensor, eps: f32) -> Result<Tensor> {
        let _profile = crate::profile::Scope::new("group_norm");
        self.group_norm_then(num_groups, weight, bias, eps, true)
    }

    fn group_norm_then(
        &self,
        num_groups: usize,
        weight: &Tensor,
        bias: &Tensor,
        eps: f32,
        silu: bool,
    ) -> Result<Tensor> {
        self.check_group_norm(num_groups, weight, bias)?;
        let (c, spatial) = (self.dims()[1], self.dims()[2..].iter().product());
        if let (Some(x), Some(g), Some(b)) = (self.cuda(), weight.cuda(), bias.cuda()) {
            let out = x.group_norm(g, b, [self.dims()[0], c, spatial], num_groups, eps, silu)?;
            return Ok(Tensor::from_cuda(out, self.shape().clone()));
        }
        let moments = GroupMoments::local(self, num_groups, eps)?;
        self.normalize_groups(num_groups, weight, bias, &moments, silu)
    }

    /// GroupNorm (then SiLU, if `silu`) with given statistics, one [`GroupMoments`] per
    /// (sample, group), sample-major: the last step of [`Tensor::group_norm`], for a caller that
    /// computed the statistics over more than this tensor (a band of a sharded map). CPU only.
    pub fn group_norm_with(
        &self,
        num_groups: usize,
        weight: &Tensor,
        bias: &Tensor,
        moments: &[GroupMoments],
        silu: bool,
    ) -> Result<Tensor> {
        let _profile = crate::profile::Scope::new("group_norm");
        self.check_group_norm(num_groups, weight, bias)?;
        let want = self.dims()[0] * num_groups;
        if moments.len() != want {
            return Err(TensorError::InvalidArgument {
                op: "group_norm",
                reason: format!("{} statistics for {want} (sample, group) pairs", moments.len()),
            });
        }
        self.normalize_groups(num_groups, weight, bias, moments, silu)
    }

    /// `[N, C, *]` with `C` a multiple of `num_groups`, and per-channel parameters on its device.
    fn check_group_norm(&self, num_groups: usize, weight: &Tensor, bias: &Tensor) -> Result<()> {
        const OP: &str = "group_norm";
        let c = self.group_geometry(OP, num_groups).map(|_| self.dims()[1])?;
        for p in [weight, bias] {
            self.check_same_device(OP, p)?;
            if p.dims() != [c] {
                return Err(TensorError::ShapeMismatch { op: OP, lhs: self.shape().clone(), rhs: p.shape().clone() });
            }
        }
        Ok(())
    }

    fn normalize_groups(
        &self,
        num_groups: usize,
        weight: &Tensor,
        bias: &Tensor,
        moments: &[GroupMoments],
        silu: bool,
    ) -> Result<Tensor> {
        let c = self.dims()[1];
        let spatial: usize = self.dims()[2..].iter().product();
        let per_group = c / num_groups;
        let group_len = per_group * spatial;
        let (gamma, beta) = (weight.as_slice_f32()?, bias.as_slice_f32()?);
        let src = self.as_slice_f32()?;
        let mut out = Buffer::for_overwrite(src.len());
        if group_len > 0 {
            let isa = crate::ops::simd::isa();
            out.as_mut_slice().par_chunks_mut(group_len).zip(src.par_chunks(group_len)).enumerate().for_each(
                |(i, (dst, x))| {
                    let c0 = (i % num_groups) * per_group;
                    let params = (&gamma[c0..c0 + per_group], &beta[c0..c0 + per_group]);
                    group_kernel(isa, x, dst, params, spatial, moments[i], silu);
                },
            );
        }
        Ok(Tensor::from_buffer(out, self.shape().clone()))
    }
}
