//! Convolutions on the CPU: the public 2-D op and the job both it and the 3-D op
//! ([`crate::Conv3dParams`]) hand to the kernels.
//!
//! Two algorithms on one register-blocked product ([`microkernel`]), and one on AMX tiles:
//! - [`direct`]: an implicit GEMM over the kernel taps (no im2col matrix), for every
//!   convolution. Each output is one chain of fused multiply-adds over (temporal tap, spatial
//!   tap, input channel) in that order, so it depends on its receptive field alone.
//! - [`winograd`]: F(4×4, 3×3) and F(2×2, 3×3) for 3×3 stride-1 convolutions, 4× (2.25×)
//!   fewer multiplications. Its rounding couples the outputs of a tile, so it runs only where
//!   the caller declares (with [`Conv2dParams::band_aligned`]) that band cuts fall on multiples
//!   of the tile: a shard rank's band then holds whole tiles laid out as the direct
//!   computation's, and shard and direct decodes stay bit-identical.
//! - [`amx_direct`] (x86-64): bf16 convolutions ([`crate::CpuBf16Scope`]) on a CPU with AMX,
//!   stride 1 and `Cin` a multiple of 32, reading the input through aligned tiles; each output
//!   depends on its receptive field alone. The other bf16 convolutions take [`direct`] with
//!   AMX ([`amx`]) or AVX512-BF16 products.

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod amx_direct;
mod direct;
mod microkernel;
#[cfg(test)]
mod testing;
mod winograd;

use crate::backend::DeviceConv;
use crate::memory::Buffer;
use crate::ops::simd::{self, Isa};
use crate::{Result, Shape, Tensor, TensorError};

/// Stride and zero padding of a [`Tensor::conv2d`]. Dilation and groups are not supported
/// (the VAEs use neither).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Conv2dParams {
    /// Step between output positions, the same in both directions; must be at least 1.
    pub stride: usize,
    /// Zero padding around the input, as `[top, bottom, left, right]`.
    pub padding: [usize; 4],
    /// The caller's promise on where the input may be cut into bands (see
    /// [`Conv2dParams::band_aligned`]); 1 by default: anywhere.
    pub band_align: usize,
}

impl Default for Conv2dParams {
    /// Stride 1, no padding.
    fn default() -> Self {
        Self::new(1, [0; 4])
    }
}

impl Conv2dParams {
    /// The given stride and `[top, bottom, left, right]` padding.
    pub const fn new(stride: usize, padding: [usize; 4]) -> Self {
        Self { stride, padding, band_align: 1 }
    }

    /// Stride 1 and `(k − 1) / 2` zeros on every side: PyTorch's `Conv2d(k, padding=k // 2)`
    /// for odd `k`, which keeps the spatial size.
    pub const fn same(k: usize) -> Self {
        let p = k.saturating_sub(1) / 2;
        Self::new(1, [p; 4])
    }

    /// diffusers' `Downsample2D` with `padding=0`: one zero row at the bottom and one zero
    /// column at the right, then a stride-2 convolution without padding.
    pub const fn diffusers_downsample() -> Self {
        Self::new(2, [0, 1, 0, 1])
    }

    /// The same convolution with the promise that wherever this conv's input is ever cut into
    /// bands computed apart and joined (spatial-shard bands, with their halos), the cuts fall
    /// on output rows and columns that are multiples of `align` (the output's own edges always
    /// qualify). The kernels may then use algorithms whose rounding couples neighbouring
    /// outputs within aligned blocks of up to `align` (Winograd tiles) and stay bit-identical
    /// across such cuts. A model passes the number of rows one latent row has become at the
    /// conv's resolution, since bands are whole latent rows. 0 is taken as 1.
    pub const fn band_aligned(mut self, align: usize) -> Self {
        self.band_align = if align == 0 { 1 } else { align };
        self
    }

    /// The output extent `(Ho, Wo)` for an `h × w` input and a `kh × kw` kernel, or `None` when
    /// the stride is 0, the kernel is empty or larger than the padded input, or sizes overflow.
    pub fn output_size(&self, h: usize, w: usize, kh: usize, kw: usize) -> Option<(usize, usize)> {
        let [top, bottom, left, right] = self.padding;
        let hp = h.checked_add(top)?.checked_add(bottom)?;
        let wp = w.checked_add(left)?.checked_add(right)?;
        if self.stride == 0 || kh == 0 || kw == 0 || kh > hp || kw > wp {
            return None;
        }
        Some(((hp - kh) / self.stride + 1, (wp - kw) / self.stride + 1))
    }
}

impl Tensor {
    /// 2-D cross-correlation, as PyTorch's `F.conv2d`: input `[N, Cin, H, W]`, weight
    /// `[Cout, Cin, kh, kw]`, optional bias `[Cout]`, output `[N, Cout, Ho, Wo]` with
    /// `Ho = (H + top + bottom − kh) / stride + 1` (likewise `Wo`). Padding is zeros.
    ///
    /// Runs on the current rayon pool with the kernels of the module docs (Winograd where
    /// [`Conv2dParams::band_aligned`] allows it). Scratch: one zero-padded copy of the input
    /// (none for an unpadded 1×1 conv) and per-thread blocks of a few MiB; never an
    /// output-sized temporary.
    pub fn conv2d(&self, weight: &Tensor, bias: Option<&Tensor>, params: &Conv2dParams) -> Result<Tensor> {
        self.conv2d_of(weight, bias, params, false)
    }

    /// `self.upsample_nearest2d(2)?.conv2d(weight, bias, params)` (diffusers' `Upsample2D`), the
    /// same bits, without the 4× map where the kernel can read the input as if upsampled: bf16
    /// convolutions on AMX (stride 1, `Cin` a multiple of 32) repeat each row and column while
    /// they pack the input into tiles. Elsewhere the upsampled map is made first.
    pub fn upsample2x_conv2d(&self, weight: &Tensor, bias: Option<&Tensor>, params: &Conv2dParams) -> Result<Tensor> {
        self.conv2d_of(weight, bias, params, true)
    }

    /// [`Tensor::conv2d`] of `self`, or with `upsample` of `self` upsampled 2× (nearest).
    fn conv2d_of(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        params: &Conv2dParams,
        upsample: bool,
    ) -> Result<Tensor> {
        const OP: &str = "conv2d";
        let &[n, cin, h0, w0] = self.dims() else {
            return Err(TensorError::InvalidArgument {
                op: OP,
                reason: format!("input must be [N, Cin, H, W], got {}", self.shape()),
            });
        };
        // The extent the convolution sees.
        let (h, w) = if upsample { (2 * h0, 2 * w0) } else { (h0, w0) };
        let mismatch = |rhs: &Shape| TensorError::ShapeMismatch { op: OP, lhs: self.shape().clone(), rhs: rhs.clone() };
        let &[cout, wcin, kh, kw] = weight.dims() else { return Err(mismatch(weight.shape())) };
        if wcin != cin {
            return Err(mismatch(weight.shape()));
        }
        self.check_same_device(OP, weight)?;
        if let Some(b) = bias {
            self.check_same_device(OP, b)?;
            if b.dims() != [cout] {
                return Err(TensorError::ShapeMismatch { op: OP, lhs: weight.shape().clone(), rhs: b.shape().clone() });
            }
        }
        let Some((ho, wo)) = params.output_size(h, w, kh, kw) else {
            return Err(TensorError::InvalidArgument {
                op: OP,
                reason: format!(
                    "kernel {kh}x{kw} with stride {} and padding {:?} does not fit input {}",
                    params.stride,
                    params.padding,
                    self.shape()
                ),
            });
        };
        if upsample && self.cuda().is_some() {
            return self.upsample_nearest2d(2)?.conv2d(weight, bias, params);
        }
        let s = params.stride;
        let [top, bottom, left, right] = params.padding;
        if let (Some(x), Some(wt)) = (self.cuda(), weight.cuda()) {
            // One frame through the 3-D kernel: NCHW is NCTHW with T = 1 in memory.
            let b = bias
                .map(|b| {
                    b.cuda()
                        .ok_or_else(|| TensorError::InvalidArgument { op: OP, reason: "bias not on the device".into() })
                })
                .transpose()?;
            let g = crate::abi::ConvGeom {
                n: n as u64,
                cin: cin as u64,
                t: 1,
                h: h as u64,
                w: w as u64,
                cout: cout as u64,
                kt: 1,
                kh: kh as u64,
                kw: kw as u64,
                to: 1,
                ho: ho as u64,
                wo: wo as u64,
                stride_t: 1,
                stride: s as u64,
                pad_front: 0,
                pad_top: top as i64,
                pad_left: left as i64,
            };
            let _ = (bottom, right); // implied by the output extents
            return Ok(Tensor::from_cuda(x.conv3d(None, wt, b, g)?, Shape::new([n, cout, ho, wo])));
        }
        let job = ConvJob {
            frames: Frames { parts: [&[], self.as_slice_f32()?], part_t: [0, 1], n, cin, h: h0, w: w0 },
            weight: weight.as_slice_f32()?,
            bias: bias.map(|b| b.as_slice_f32()).transpose()?,
            cout,
            kernel: [1, kh, kw],
            stride: [1, s],
            pad_front: 0,
            padding: params.padding,
            out: [1, ho, wo],
            band_align: params.band_align,
            bf16: crate::device::cpu_bf16_active(),
            upsample,
        };
        #[cfg(target_arch = "x86_64")]
        let fused = amx_direct::applies(&job);
        #[cfg(not(target_arch = "x86_64"))]
        let fused = false;
        if upsample && !fused {
            return self.upsample_nearest2d(2)?.conv2d(weight, bias, params);
        }
        Ok(Tensor::from_buffer(job.run(simd::isa())?, Shape::new([n, cout, ho, wo])))
    }
}

/// The input frames of a CPU convolution: `parts[0]` (`part_t[0]` frames, possibly none: Wan's
/// causal cache) followed along time by `parts[1]`, each `[N, Cin, T, H, W]` (an NCHW image is
/// one frame per batch item).
#[derive(Clone, Copy)]
pub(crate) struct Frames<'a> {
    pub parts: [&'a [f32]; 2],
    pub part_t: [usize; 2],
    pub n: usize,
    pub cin: usize,
    pub h: usize,
    pub w: usize,
}

impl Frames<'_> {
    /// Frames along time.
    pub fn t(&self) -> usize {
        self.part_t[0] + self.part_t[1]
    }

    /// The `H × W` plane of channel `c` of frame `ti` of batch item `b`.
    pub fn plane(&self, b: usize, c: usize, ti: usize) -> &[f32] {
        let (part, t) = if ti < self.part_t[0] { (0, ti) } else { (1, ti - self.part_t[0]) };
        let (len, frames) = (self.h * self.w, self.part_t[part]);
        &self.parts[part][((b * self.cin + c) * frames + t) * len..][..len]
    }
}

/// One CPU convolution, validated by the op that builds it: weights `[Cout, Cin, kt, kh, kw]`,
/// output `[N, Cout, To, Ho, Wo]`.
pub(crate) struct ConvJob<'a> {
    pub frames: Frames<'a>,
    pub weight: &'a [f32],
    pub bias: Option<&'a [f32]>,
    pub cout: usize,
    /// `[kt, kh, kw]`.
    pub kernel: [usize; 3],
    /// `[temporal, spatial]` strides.
    pub stride: [usize; 2],
    /// Zero frames before the first input frame.
    pub pad_front: usize,
    /// `[top, bottom, left, right]`.
    pub padding: [usize; 4],
    /// `[To, Ho, Wo]`.
    pub out: [usize; 3],
    pub band_align: usize,
    /// Products in bf16 ([`crate::CpuBf16Scope`]).
    pub bf16: bool,
    /// The convolution reads `frames` upsampled 2× (nearest): an input of `2h × 2w` whose row
    /// `y`, column `x` is the frames' `(y / 2, x / 2)`. Only [`amx_direct`] reads it this way;
    /// the op builds such a job for it alone.
    pub upsample: bool,
}

impl ConvJob<'_> {
    /// The input frame output frame `o` reads with temporal tap `dt`, if it exists (else the
    /// tap reads zero padding and is skipped).
    pub fn input_frame(&self, o: usize, dt: usize) -> Option<usize> {
        let ti = (o * self.stride[0] + dt).checked_sub(self.pad_front)?;
        (ti < self.frames.t()).then_some(ti)
    }

    /// Output elements, checked for overflow.
    fn out_len(&self) -> Result<usize> {
        let [to, ho, wo] = self.out;
        [self.frames.n, self.cout, to, ho, wo]
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| TensorError::InvalidArgument { op: "conv", reason: "sizes overflow usize".into() })
    }

    /// Runs the convolution with `isa`'s kernels: Winograd where it applies and the band
    /// alignment allows, the direct kernel otherwise.
    pub fn run(&self, isa: Isa) -> Result<Buffer> {
        let out_len = self.out_len()?;
        #[cfg(target_arch = "x86_64")]
        if self.upsample && amx_direct::applies(self) {
            let _profile = crate::profile::Scope::new("conv.amx_upsample");
            return amx_direct::run(self, out_len);
        }
        if self.upsample {
            return Err(TensorError::InvalidArgument {
                op: "conv2d",
                reason: "only the AMX kernel reads an input upsampled".into(),
            });
        }
        #[cfg(target_arch = "x86_64")]
        if amx_direct::applies(self) {
            let _profile = crate::profile::Scope::new("conv.amx");
            return amx_direct::run(self, out_len);
        }
        if winograd::applies(self) {
            let _profile = crate::profile::Scope::new("conv.winograd");
            winograd::run(self, isa, out_len)
        } else {
            let _profile = crate::profile::Scope::new("conv.direct");
            direct::run(self, isa, out_len)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fused op gives the bits of upsampling then convolving: in f32 (made in two steps) and
    /// in bf16 (read upsampled by the AMX kernel where the CPU has it), stride 1 and 2, and the
    /// same typed error for a bad weight.
    #[test]
    fn upsample2x_conv2d_is_upsample_then_conv2d() {
        let dev = crate::Device::Cpu;
        let x = Tensor::from_vec(crate::ops::test_values(2 * 64 * 5 * 7, 1), [2, 64, 5, 7], &dev).unwrap();
        let w = Tensor::from_vec(crate::ops::test_values(24 * 64 * 9, 2), [24, 64, 3, 3], &dev).unwrap();
        let b = Tensor::from_vec(crate::ops::test_values(24, 3), [24], &dev).unwrap();
        let check = || {
            for params in [Conv2dParams::same(3), Conv2dParams::same(3).band_aligned(2), Conv2dParams::new(2, [1; 4])] {
                let fused = x.upsample2x_conv2d(&w, Some(&b), &params).unwrap();
                let two = x.upsample_nearest2d(2).unwrap().conv2d(&w, Some(&b), &params).unwrap();
                assert_eq!(fused.dims(), two.dims());
                let (f, t) = (fused.as_slice_f32().unwrap(), two.as_slice_f32().unwrap());
                assert!(f.iter().zip(t).all(|(p, q)| p.to_bits() == q.to_bits()), "{params:?}");
            }
        };
        check();
        if crate::CpuBf16Scope::supported() {
            let _bf16 = crate::CpuBf16Scope::enter().unwrap();
            check();
        }
        let bad = Tensor::from_vec(vec![0.0; 24 * 32 * 9], [24, 32, 3, 3], &dev).unwrap();
        assert!(matches!(
            x.upsample2x_conv2d(&bad, None, &Conv2dParams::same(3)),
            Err(TensorError::ShapeMismatch { .. })
        ));
    }

    #[test]
    fn output_sizes_follow_pytorch() {
        assert_eq!(Conv2dParams::same(3).output_size(7, 5, 3, 3), Some((7, 5)));
        assert_eq!(Conv2dParams::diffusers_downsample().output_size(128, 128, 3, 3), Some((64, 64)));
        assert_eq!(Conv2dParams::diffusers_downsample().output_size(7, 6, 3, 3), Some((3, 3)));
        assert_eq!(Conv2dParams::default().output_size(2, 2, 3, 3), None);
        assert_eq!(Conv2dParams::new(0, [0; 4]).output_size(4, 4, 1, 1), None);
    }
}
