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
pub(crate) mod amx;
#[cfg(target_arch = "x86_64")]
mod amx_direct;
mod direct;

pub use direct::with_packed_weights;
mod microkernel;
#[cfg(test)]
mod testing;
mod winograd;

use std::ops::Range;

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

/// Where [`Tensor::conv2d_into`] and [`Tensor::conv3d_into`] write: the output rows and columns
/// `window` of the convolution (`[rows, columns]`), into `dest` (the output's dims but for a
/// larger height and width) with the window's first row and column at `at`.
///
/// Each output is the one the whole convolution computes, bit for bit: a window starts on the
/// convolution's band alignment ([`Conv2dParams::band_aligned`]), where the Winograd tiles of
/// the whole output start anyway. This is how a spatial shard computes the rows of its band
/// that need no neighbour's rows apart from the others, straight into the band's output.
///
/// A destination without elements takes the whole output instead (the window must then be all
/// of it, at `[0, 0]`), on any device: the convolution made as [`Tensor::conv2d`] makes it.
#[derive(Debug)]
pub struct ConvTarget<'a> {
    /// The output rows and columns to compute.
    pub window: [Range<usize>; 2],
    /// The tensor they go into (CPU, f32).
    pub dest: &'a mut Tensor,
    /// Where the window's first row and column go in `dest`.
    pub at: [usize; 2],
}

/// Whether [`Tensor::conv2d_into`] and [`Tensor::conv3d_into`] compute on this thread only the
/// window they are given. `false` while bf16 products run on a CPU with AMX
/// ([`crate::CpuBf16Scope`]): the AMX kernel computes whole outputs, so a window costs the whole
/// convolution and a temporary output beside the destination.
pub fn conv_windows_in_place() -> bool {
    #[cfg(target_arch = "x86_64")]
    if crate::device::cpu_bf16_active() && amx::supported() {
        return false;
    }
    true
}

impl ConvTarget<'_> {
    /// Whether the target is an empty destination taking the whole output of `dims`.
    pub(crate) fn takes_whole(&self, dims: &[usize]) -> bool {
        let rank = dims.len();
        self.dest.elem_count() == 0 && self.at == [0, 0] && self.window == [0..dims[rank - 2], 0..dims[rank - 1]]
    }

    /// Checks the target against an output of `dims` (`[.., Ho, Wo]`) whose cuts are promised
    /// on multiples of `band_align`, and makes the job's window of it.
    pub(crate) fn window_of(&self, op: &'static str, dims: &[usize], band_align: usize) -> Result<OutWindow> {
        let invalid = |reason: String| TensorError::InvalidArgument { op, reason };
        let rank = dims.len();
        let d = self.dest.dims();
        if !self.dest.device().is_cpu() || d.len() != rank || d[..rank - 2] != dims[..rank - 2] {
            return Err(invalid(format!("a destination {} for an output {dims:?} on the CPU", self.dest.shape())));
        }
        let [rows, cols] = &self.window;
        let (ho, wo) = (dims[rank - 2], dims[rank - 1]);
        let within = |at: usize, len: usize, extent: usize| at.checked_add(len).is_some_and(|end| end <= extent);
        let fits = rows.start <= rows.end
            && cols.start <= cols.end
            && rows.end <= ho
            && cols.end <= wo
            && within(self.at[0], rows.len(), d[rank - 2])
            && within(self.at[1], cols.len(), d[rank - 1]);
        if !fits {
            return Err(invalid(format!(
                "window {:?} at {:?} of an output {ho} x {wo} into {}",
                self.window,
                self.at,
                self.dest.shape()
            )));
        }
        // Cuts on the band alignment: a window starts on it and ends on it or at the output's
        // edge, so the Winograd tiles it computes are the whole output's.
        let on_grid = |r: &Range<usize>, extent: usize| {
            r.start.is_multiple_of(band_align) && (r.end == extent || r.end.is_multiple_of(band_align))
        };
        if !on_grid(rows, ho) || !on_grid(cols, wo) {
            return Err(invalid(format!("a window {:?} off the band alignment {band_align}", self.window)));
        }
        Ok(OutWindow { rows: rows.clone(), cols: cols.clone(), dest: [d[rank - 2], d[rank - 1]], at: self.at })
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

    /// The outputs of [`Tensor::conv2d`] in `target`'s window, written into its destination
    /// (see [`ConvTarget`]). CPU tensors only.
    pub fn conv2d_into(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        params: &Conv2dParams,
        target: ConvTarget<'_>,
    ) -> Result<()> {
        const OP: &str = "conv2d_into";
        if target.dest.elem_count() == 0 {
            let [n, _, _, _, cout, _, _, ho, wo] = self.conv2d_geometry(weight, bias, params, false)?;
            if !target.takes_whole(&[n, cout, ho, wo]) {
                return Err(TensorError::InvalidArgument {
                    op: OP,
                    reason: format!("an empty destination for the window {:?} of {ho} x {wo}", target.window),
                });
            }
            *target.dest = self.conv2d(weight, bias, params)?;
            return Ok(());
        }
        if self.cuda().is_some() {
            return Err(TensorError::InvalidArgument { op: OP, reason: "the CPU only".into() });
        }
        let geometry = self.conv2d_geometry(weight, bias, params, false)?;
        let [n, _, _, _, cout, _, _, ho, wo] = geometry;
        let window = target.window_of(OP, &[n, cout, ho, wo], params.band_align)?;
        let job = self.cpu_conv2d_job(weight, bias, params, geometry, false, window)?;
        job.run_into(simd::isa(), target.dest.as_mut_slice_f32()?)
    }

    /// `self.upsample_nearest2d(2)?.conv2d(weight, bias, params)` (diffusers' `Upsample2D`), the
    /// same bits, without the 4× map where the kernel can read the input as if upsampled: bf16
    /// convolutions on AMX (stride 1, `Cin` a multiple of 32) repeat each row and column while
    /// they pack the input into tiles. Elsewhere the upsampled map is made first.
    pub fn upsample2x_conv2d(&self, weight: &Tensor, bias: Option<&Tensor>, params: &Conv2dParams) -> Result<Tensor> {
        self.conv2d_of(weight, bias, params, true)
    }

    /// The CPU job of a 2-D convolution of `self` with the checked `geometry`
    /// ([`Self::conv2d_geometry`]), reading `self` upsampled 2× with `upsample`, computing
    /// `window` of the output.
    fn cpu_conv2d_job<'a>(
        &'a self,
        weight: &'a Tensor,
        bias: Option<&'a Tensor>,
        params: &Conv2dParams,
        [n, cin, h, w, cout, kh, kw, ho, wo]: [usize; 9],
        upsample: bool,
        window: OutWindow,
    ) -> Result<ConvJob<'a>> {
        Ok(ConvJob {
            frames: Frames { parts: [&[], self.as_slice_f32()?], part_t: [0, 1], n, cin, h, w },
            weight: weight.as_slice_f32()?,
            bias: bias.map(|b| b.as_slice_f32()).transpose()?,
            cout,
            kernel: [1, kh, kw],
            stride: [1, params.stride],
            pad_front: 0,
            padding: params.padding,
            out: [1, ho, wo],
            band_align: params.band_align,
            bf16: crate::device::cpu_bf16_active(),
            upsample,
            window,
        })
    }

    /// The checked geometry of a 2-D convolution of `self` (upsampled 2× first with
    /// `upsample`): `[N, Cin, H, W, Cout, kh, kw, Ho, Wo]`, `H` and `W` the stored input's.
    fn conv2d_geometry(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        params: &Conv2dParams,
        upsample: bool,
    ) -> Result<[usize; 9]> {
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
        Ok([n, cin, h0, w0, cout, kh, kw, ho, wo])
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
        let [n, cin, h0, w0, cout, kh, kw, ho, wo] = self.conv2d_geometry(weight, bias, params, upsample)?;
        // The extent the convolution sees.
        let (h, w) = if upsample { (2 * h0, 2 * w0) } else { (h0, w0) };
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
        let geometry = [n, cin, h0, w0, cout, kh, kw, ho, wo];
        let job = self.cpu_conv2d_job(weight, bias, params, geometry, upsample, OutWindow::whole(ho, wo))?;
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
    /// Which outputs to compute and where they go ([`OutWindow::whole`]: all, as `[N, Cout,
    /// To, Ho, Wo]`).
    pub window: OutWindow,
}

/// The outputs a [`ConvJob`] computes and where it writes them: rows `rows` and columns `cols`
/// of every output frame, into frames of `dest` (rows, columns) with the window's first row
/// and column at `at`. Outputs keep the arithmetic of the whole convolution: the window's
/// start must lie on the job's band alignment (the Winograd tiles are the whole output's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct OutWindow {
    pub rows: Range<usize>,
    pub cols: Range<usize>,
    pub dest: [usize; 2],
    pub at: [usize; 2],
}

impl OutWindow {
    /// Every output of an `ho × wo` frame, in place.
    pub fn whole(ho: usize, wo: usize) -> Self {
        Self { rows: 0..ho, cols: 0..wo, dest: [ho, wo], at: [0, 0] }
    }

    /// Where output row `oy`, column `ox` of output frame `frame` (`(b·Cout + co)·To + o`) goes.
    #[inline]
    pub fn index(&self, frame: usize, oy: usize, ox: usize) -> usize {
        (frame * self.dest[0] + oy - self.rows.start + self.at[0]) * self.dest[1] + ox - self.cols.start + self.at[1]
    }
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
        let [_, ho, wo] = self.out;
        if self.window != OutWindow::whole(ho, wo) {
            return Err(TensorError::InvalidArgument { op: "conv", reason: "a window runs into a destination".into() });
        }
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
        let mut out = Buffer::for_overwrite(out_len);
        self.run_kernel(isa, out.as_mut_slice());
        Ok(out)
    }

    /// Runs the window of the convolution ([`Self::window`]) into `dest`, which holds the
    /// window's destination frames. The AMX kernel computes whole outputs: its window is cut
    /// from a whole output made first.
    pub fn run_into(&self, isa: Isa, dest: &mut [f32]) -> Result<()> {
        let [to, ho, wo] = self.out;
        let w = &self.window;
        let frames = self.frames.n * self.cout * to;
        if w.rows.end > ho
            || w.cols.end > wo
            || w.at[0] + w.rows.len() > w.dest[0]
            || w.at[1] + w.cols.len() > w.dest[1]
        {
            return Err(TensorError::InvalidArgument {
                op: "conv",
                reason: format!("window {w:?} of an output of {ho} x {wo}"),
            });
        }
        if dest.len() != frames * w.dest[0] * w.dest[1] || self.upsample {
            return Err(TensorError::InvalidArgument {
                op: "conv",
                reason: format!("a destination of {} values for {frames} frames of {:?}", dest.len(), w.dest),
            });
        }
        if w.rows.is_empty() || w.cols.is_empty() {
            return Ok(());
        }
        #[cfg(target_arch = "x86_64")]
        if amx_direct::applies(self) {
            let whole = ConvJob { window: OutWindow::whole(ho, wo), ..*self };
            let out = whole.run(isa)?;
            let out = out.as_slice();
            for frame in 0..frames {
                for oy in w.rows.clone() {
                    let from = &out[(frame * ho + oy) * wo + w.cols.start..][..w.cols.len()];
                    dest[w.index(frame, oy, w.cols.start)..][..w.cols.len()].copy_from_slice(from);
                }
            }
            return Ok(());
        }
        self.run_kernel(isa, dest);
        Ok(())
    }

    /// The Winograd or the direct kernel, into `dest`.
    fn run_kernel(&self, isa: Isa, dest: &mut [f32]) {
        if winograd::applies(self) {
            let _profile = crate::profile::Scope::new("conv.winograd");
            winograd::run(self, isa, dest)
        } else {
            let _profile = crate::profile::Scope::new("conv.direct");
            direct::run(self, isa, dest)
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

    /// Inside [`with_packed_weights`] a convolution computed again with the same weights (a
    /// shard's interior, then its edges) packs them once, with the same bits; other weights and
    /// calls outside are packed as always.
    #[test]
    fn packed_weights_are_reused_inside_the_scope_only() {
        let dev = crate::Device::Cpu;
        let x = Tensor::from_vec(crate::ops::test_values(32 * 9 * 11, 1), [1, 32, 9, 11], &dev).unwrap();
        let w = Tensor::from_vec(crate::ops::test_values(8 * 32 * 9, 2), [8, 32, 3, 3], &dev).unwrap();
        let other = Tensor::from_vec(crate::ops::test_values(8 * 32 * 9, 3), [8, 32, 3, 3], &dev).unwrap();
        // Unaligned bands: the direct kernel.
        let params = Conv2dParams::same(3);
        let packings = || direct::PACKINGS.with(std::cell::Cell::get);
        let alone = x.conv2d(&w, None, &params).unwrap();
        let before = packings();
        let (a, b, c) = with_packed_weights(&w, || {
            let a = x.conv2d(&w, None, &params).unwrap();
            let b = x.conv2d(&w, None, &params).unwrap();
            (a, b, x.conv2d(&other, None, &params).unwrap())
        });
        assert_eq!(packings() - before, 2, "w once, the other weights once");
        assert!(a.bit_eq(&alone) && b.bit_eq(&alone));
        assert!(c.bit_eq(&x.conv2d(&other, None, &params).unwrap()));
        let before = packings();
        assert!(x.conv2d(&w, None, &params).unwrap().bit_eq(&alone));
        assert_eq!(packings() - before, 1, "outside the scope nothing is kept");
    }

    /// A window computed into a destination holds the whole convolution's bits there and leaves
    /// the rest of the destination alone: 2-D and 3-D (with frames in front), the direct kernel
    /// and Winograd F(2×2) and F(4×4), in f32 and with bf16 products; windows off the band
    /// alignment or outside the output are typed errors.
    #[test]
    fn a_window_into_a_destination_is_the_whole_convolutions() {
        let dev = crate::Device::Cpu;
        let x = Tensor::from_vec(crate::ops::test_values(2 * 32 * 12 * 16, 1), [2, 32, 12, 16], &dev).unwrap();
        let w = Tensor::from_vec(crate::ops::test_values(8 * 32 * 9, 2), [8, 32, 3, 3], &dev).unwrap();
        let b = Tensor::from_vec(crate::ops::test_values(8, 3), [8], &dev).unwrap();
        let video = x.reshape(vec![1, 32, 2, 12, 16]).unwrap();
        let front = video.narrow(2, 1, 1).unwrap();
        let w3 = Tensor::from_vec(crate::ops::test_values(8 * 32 * 27, 4), [8, 32, 3, 3, 3], &dev).unwrap();
        let sentinel = 7.5f32;
        // The window of `whole` at `[rows, cols]` equals `dest` at `at`, and the rest is untouched.
        let check = |whole: &Tensor, dest: &Tensor, [rows, cols]: [Range<usize>; 2], at: [usize; 2], what: &str| {
            let r = dest.rank();
            let (dh, dw) = (dest.dims()[r - 2], dest.dims()[r - 1]);
            let (wh, ww) = (whole.dims()[r - 2], whole.dims()[r - 1]);
            let (d, v) = (dest.as_slice_f32().unwrap(), whole.as_slice_f32().unwrap());
            for frame in 0..d.len() / (dh * dw) {
                for y in 0..dh {
                    for xx in 0..dw {
                        let got = d[(frame * dh + y) * dw + xx];
                        let at_window = (y.checked_sub(at[0]).map(|dy| dy + rows.start))
                            .zip(xx.checked_sub(at[1]).map(|dx| dx + cols.start))
                            .filter(|(oy, ox)| rows.contains(oy) && cols.contains(ox));
                        let want = at_window.map_or(sentinel, |(oy, ox)| v[(frame * wh + oy) * ww + ox]);
                        assert_eq!(got.to_bits(), want.to_bits(), "{what}: frame {frame}, ({y}, {xx})");
                    }
                }
            }
        };
        let run = |what: &str| {
            for align in [1, 2, 4] {
                let params = Conv2dParams::same(3).band_aligned(align);
                let whole = x.conv2d(&w, Some(&b), &params).unwrap();
                let window = [align..12 - align, 2 * align..16];
                let mut dest = Tensor::from_vec(vec![sentinel; 2 * 8 * 13 * 17], [2, 8, 13, 17], &dev).unwrap();
                let target = ConvTarget { window: window.clone(), dest: &mut dest, at: [1, 0] };
                x.conv2d_into(&w, Some(&b), &params, target).unwrap();
                check(&whole, &dest, window, [1, 0], &format!("{what} 2-D align {align}"));

                let p3 = crate::Conv3dParams::new([1, 1, 1], [1, 0, 1, 1, 1, 1]).band_aligned(align);
                let whole = video.conv3d_after(&front, &w3, Some(&b), &p3).unwrap();
                let window = [0..align, align..16 - align];
                let mut dest =
                    Tensor::from_vec(vec![sentinel; 8 * 2 * (align + 2) * 16], [1, 8, 2, align + 2, 16], &dev).unwrap();
                let target = ConvTarget { window: window.clone(), dest: &mut dest, at: [2, 1] };
                video.conv3d_into(Some(&front), &w3, Some(&b), &p3, target).unwrap();
                check(&whole, &dest, window, [2, 1], &format!("{what} 3-D align {align}"));
            }
        };
        run("f32");
        if crate::CpuBf16Scope::supported() {
            let _bf16 = crate::CpuBf16Scope::enter().unwrap();
            run("bf16");
        }
        // An empty destination takes the whole output, and only the whole output.
        let params = Conv2dParams::same(3).band_aligned(4);
        let mut empty = Tensor::zeros(vec![0; 4], crate::DType::F32, &dev).unwrap();
        let target = ConvTarget { window: [0..12, 0..16], dest: &mut empty, at: [0, 0] };
        x.conv2d_into(&w, Some(&b), &params, target).unwrap();
        assert!(empty.bit_eq(&x.conv2d(&w, Some(&b), &params).unwrap()));
        let mut empty = Tensor::zeros(vec![0; 4], crate::DType::F32, &dev).unwrap();
        let target = ConvTarget { window: [0..4, 0..16], dest: &mut empty, at: [0, 0] };
        assert!(matches!(x.conv2d_into(&w, Some(&b), &params, target), Err(TensorError::InvalidArgument { .. })));
        let mut dest = Tensor::zeros(vec![2, 8, 12, 16], crate::DType::F32, &dev).unwrap();
        // Off the alignment at either end, outside the output, or placed past the destination.
        for (window, at) in [
            ([2..12, 0..16], [0, 0]),
            ([4..10, 0..16], [0, 0]),
            ([0..13, 0..16], [0, 0]),
            ([0..12, 4..17], [0, 0]),
            ([0..4, 0..16], [usize::MAX, 0]),
        ] {
            let target = ConvTarget { window, dest: &mut dest, at };
            assert!(matches!(x.conv2d_into(&w, Some(&b), &params, target), Err(TensorError::InvalidArgument { .. })));
        }
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
