//! Video (NCTHW) ops of the Wan 2.1/2.2 VAEs, following diffusers' `autoencoder_kl_wan.py`:
//! the 3-D convolution under `WanCausalConv3d`, `WanRMS_norm`, Wan 2.2's `AvgDown3D` /
//! `DupUp3D`, and the `patchify` / `unpatchify` pair.
//!
//! The 3-D convolution runs on the same CPU kernels as [`Tensor::conv2d`] (see `ops::conv`):
//! output frame `t` reads input frame `t·st + dt − t_front` with temporal tap `dt`, and the
//! temporal taps are more reduction rows of one product. The causal cache in front is read in
//! place, never concatenated.

use rayon::prelude::*;

use crate::backend::{DeviceConv, DeviceLayout, DeviceNorm, DeviceStorage};
use crate::memory::Buffer;
use crate::ops::OutPtr;
use crate::ops::lanes::{self, Lanes, WideLanes};
use crate::{Result, Shape, Tensor, TensorError};

/// Stride and zero padding of a [`Tensor::conv3d`]. Dilation and groups are not supported
/// (the Wan VAEs use neither).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Conv3dParams {
    /// Steps between output positions as `[t, h, w]`; each at least 1, and the two spatial
    /// strides equal (the 2-D core takes one spatial stride).
    pub stride: [usize; 3],
    /// Zero padding as `[t_front, t_back, top, bottom, left, right]`.
    pub padding: [usize; 6],
    /// Where the input may be cut into spatial bands, as [`crate::Conv2dParams::band_aligned`] says;
    /// 1 by default: anywhere.
    pub band_align: usize,
}

impl Default for Conv3dParams {
    /// Stride 1, no padding.
    fn default() -> Self {
        Self::new([1; 3], [0; 6])
    }
}

impl Conv3dParams {
    /// The given `[t, h, w]` stride and `[t_front, t_back, top, bottom, left, right]` padding.
    pub const fn new(stride: [usize; 3], padding: [usize; 6]) -> Self {
        Self { stride, padding, band_align: 1 }
    }

    /// The same convolution with [`crate::Conv2dParams::band_aligned`]'s promise for its spatial
    /// bands.
    pub const fn band_aligned(mut self, align: usize) -> Self {
        self.band_align = if align == 0 { 1 } else { align };
        self
    }

    /// diffusers' `WanCausalConv3d(padding=(pt, ph, pw), stride)` with no cache: `2·pt` zero
    /// frames in front and none behind, `ph` rows above and below, `pw` columns left and right.
    /// (With a cache of `c` frames prepended by the caller, the front padding is `2·pt − c`.)
    pub const fn causal(stride: [usize; 3], [pt, ph, pw]: [usize; 3]) -> Self {
        Self::new(stride, [2 * pt, 0, ph, ph, pw, pw])
    }

    /// The output extent `(To, Ho, Wo)` for a `t × h × w` input and a `kt × kh × kw` kernel, or
    /// `None` when a stride is 0, the kernel is empty or larger than the padded input, or sizes
    /// overflow.
    pub fn output_size(&self, [t, h, w]: [usize; 3], [kt, kh, kw]: [usize; 3]) -> Option<[usize; 3]> {
        let mut out = [0; 3];
        for (i, (n, k)) in [(t, kt), (h, kh), (w, kw)].into_iter().enumerate() {
            let padded = n.checked_add(self.padding[2 * i])?.checked_add(self.padding[2 * i + 1])?;
            let s = self.stride[i];
            if s == 0 || k == 0 || k > padded {
                return None;
            }
            out[i] = (padded - k) / s + 1;
        }
        Some(out)
    }
}

/// Positions per task of the RMS norm: their f64 sums of squares stay in L1.
const RMS_RUN: usize = 2048;

crate::ops::simd::isa_kernel! {
    /// The RMS norm of positions `p0..p0 + len` of one item `x` (`[C, inner]`) into `rows` (one
    /// per channel, `len` long).
    fn rms_kernel(
        x: &[f32],
        inner: usize,
        p0: usize,
        rows: Vec<&mut [f32]>,
        params: (&[f32], Option<&[f32]>),
        eps: f64,
        silu: bool,
    ) = rms_norm_run;
}

/// Per position, the sum of squares over channels in f64 (channel by channel, one chain per
/// position whatever the vector width), `1 / max(‖x‖, eps)`, then `x · r · √C·γ + β` in f64
/// rounded once, then the optional SiLU in f32.
#[inline(always)]
fn rms_norm_run<S: Lanes>(
    x: &[f32],
    inner: usize,
    p0: usize,
    mut rows: Vec<&mut [f32]>,
    (gamma, bias): (&[f32], Option<&[f32]>),
    eps: f64,
    silu: bool,
) {
    let len = rows.first().map_or(0, |r| r.len());
    let c = rows.len();
    // Sums of squares, padded to whole vectors (the padding sums zeros).
    let padded = len.div_ceil(S::L) * S::L;
    let mut inv = vec![0.0f64; padded];
    let mut buf = vec![0.0f32; padded];
    for ch in 0..c {
        buf[..len].copy_from_slice(&x[ch * inner + p0..][..len]);
        for i in (0..padded).step_by(S::L) {
            // SAFETY: `i + L ≤ padded` for `buf` and `inv` (halves at i and i + L/2).
            unsafe {
                let [lo, hi] = S::load(buf.as_ptr().add(i)).widen();
                let (a, b) = (inv.as_mut_ptr().add(i), inv.as_mut_ptr().add(i + S::L / 2));
                S::Wide::fma(lo, lo, S::Wide::load(a)).store(a);
                S::Wide::fma(hi, hi, S::Wide::load(b)).store(b);
            }
        }
    }
    inv.iter_mut().for_each(|s| *s = 1.0 / s.sqrt().max(eps));
    let scale = (c as f64).sqrt();
    for (ch, row) in rows.iter_mut().enumerate() {
        let g = S::Wide::splat(gamma[ch] as f64 * scale);
        let b = S::Wide::splat(bias.map_or(0.0, |b| b[ch] as f64));
        buf[..len].copy_from_slice(&x[ch * inner + p0..][..len]);
        for i in (0..padded).step_by(S::L) {
            // SAFETY: as above.
            unsafe {
                let [lo, hi] = S::load(buf.as_ptr().add(i)).widen();
                let (ra, rb) = (S::Wide::load(inv.as_ptr().add(i)), S::Wide::load(inv.as_ptr().add(i + S::L / 2)));
                let y = S::narrow([lo.mul(ra).mul(g).add(b), hi.mul(rb).mul(g).add(b)]);
                let y = if silu { lanes::silu(y) } else { y };
                y.store(buf.as_mut_ptr().add(i));
            }
        }
        row.copy_from_slice(&buf[..len]);
    }
}

fn invalid(op: &'static str, reason: String) -> TensorError {
    TensorError::InvalidArgument { op, reason }
}

fn checked_len(op: &'static str, dims: &[usize]) -> Result<usize> {
    dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).ok_or_else(|| invalid(op, "sizes overflow usize".into()))
}

/// The five extents of an NCTHW tensor, or an error naming `op`.
fn video_dims(op: &'static str, t: &Tensor) -> Result<[usize; 5]> {
    match *t.dims() {
        [n, c, f, h, w] => Ok([n, c, f, h, w]),
        _ => Err(invalid(op, format!("input must be [N, C, T, H, W], got {}", t.shape()))),
    }
}

/// A per-channel parameter with `c` elements shaped `[c]`, `[c, 1]`, `[c, 1, 1]`, ...
fn channel_param<'a>(op: &'static str, x: &Tensor, p: &'a Tensor, c: usize) -> Result<&'a [f32]> {
    x.check_same_device(op, p)?;
    let ok = p.dims().first() == Some(&c) && p.dims()[1..].iter().all(|&d| d == 1);
    if !ok {
        return Err(TensorError::ShapeMismatch { op, lhs: x.shape().clone(), rhs: p.shape().clone() });
    }
    p.as_slice_f32()
}

impl Tensor {
    /// 3-D cross-correlation, as PyTorch's `F.conv3d` after `F.pad`: input `[N, Cin, T, H, W]`,
    /// weight `[Cout, Cin, kt, kh, kw]`, optional bias `[Cout]`, output `[N, Cout, To, Ho, Wo]`
    /// with `To = (T + t_front + t_back − kt) / st + 1` (likewise `Ho`, `Wo`). Padding is zeros.
    ///
    /// This covers `WanCausalConv3d` (see [`Conv3dParams::causal`]); the causal cache goes in
    /// front of the input along dimension 2, with a correspondingly smaller front padding, through
    /// [`Tensor::conv3d_after`].
    ///
    /// Runs as one [`Tensor::conv2d`] per temporal tap over the batch of frames that tap reads
    /// (see the module docs), accumulated in f32 in tap order, bias added once. Scratch: a
    /// frame-major copy of the input, one gathered batch of frames and its conv output per tap,
    /// and a frame-major output before the final transpose.
    pub fn conv3d(&self, weight: &Tensor, bias: Option<&Tensor>, params: &Conv3dParams) -> Result<Tensor> {
        self.conv3d_behind(None, weight, bias, params)
    }

    /// [`Tensor::conv3d`] of `front` followed by `self` along time (`Tensor::cat(&[front, self],
    /// 2)`: Wan's causal cache in front of a chunk's frames), with the same result. On CUDA the
    /// concatenation is never made: the conv's channels-last copy of its input reads the frames
    /// from both tensors. `front` must match `self` in batch, channels, height and width.
    pub fn conv3d_after(
        &self,
        front: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
        params: &Conv3dParams,
    ) -> Result<Tensor> {
        const OP: &str = "conv3d";
        let [n, c, t, h, w] = video_dims(OP, self)?;
        let [fn_, fc, ft, fh, fw] = video_dims(OP, front)?;
        if [fn_, fc, fh, fw] != [n, c, h, w] {
            return Err(TensorError::ShapeMismatch { op: OP, lhs: front.shape().clone(), rhs: self.shape().clone() });
        }
        self.check_same_device(OP, front)?;
        if front.dtype() != self.dtype() {
            return Err(invalid(OP, format!("frames of {} in front of {}", front.dtype(), self.dtype())));
        }
        match (ft, t) {
            (0, _) => self.conv3d(weight, bias, params),
            (_, 0) => front.conv3d(weight, bias, params),
            _ => self.conv3d_behind(Some(front), weight, bias, params),
        }
    }

    /// The outputs of [`Tensor::conv3d_after`] (of [`Tensor::conv3d`] without `front`) in
    /// `target`'s window, written into its destination (see [`crate::ConvTarget`]). CPU tensors
    /// only.
    pub fn conv3d_into(
        &self,
        front: Option<&Tensor>,
        weight: &Tensor,
        bias: Option<&Tensor>,
        params: &Conv3dParams,
        target: crate::ConvTarget<'_>,
    ) -> Result<()> {
        const OP: &str = "conv3d_into";
        if target.dest.elem_count() == 0 {
            let whole = match front {
                Some(f) => self.conv3d_after(f, weight, bias, params)?,
                None => self.conv3d(weight, bias, params)?,
            };
            if !target.takes_whole(whole.dims()) {
                return Err(invalid(
                    OP,
                    format!("an empty destination for the window {:?} of {}", target.window, whole.shape()),
                ));
            }
            *target.dest = whole;
            return Ok(());
        }
        if self.cuda().is_some() {
            return Err(invalid(OP, "the CPU only".into()));
        }
        let front = match front {
            Some(f) => {
                let [n, c, _, h, w] = video_dims(OP, self)?;
                let [fn_, fc, ft, fh, fw] = video_dims(OP, f)?;
                if [fn_, fc, fh, fw] != [n, c, h, w] {
                    return Err(TensorError::ShapeMismatch {
                        op: OP,
                        lhs: f.shape().clone(),
                        rhs: self.shape().clone(),
                    });
                }
                self.check_same_device(OP, f)?;
                (ft > 0).then_some(f)
            }
            None => None,
        };
        self.conv3d_target(front, weight, bias, params, Some(target)).map(drop)
    }

    /// [`Tensor::conv3d`] of `self`, or on CUDA of `front` (checked by the caller) followed by
    /// `self` along time.
    fn conv3d_behind(
        &self,
        front: Option<&Tensor>,
        weight: &Tensor,
        bias: Option<&Tensor>,
        params: &Conv3dParams,
    ) -> Result<Tensor> {
        self.conv3d_target(front, weight, bias, params, None)?
            .ok_or_else(|| invalid("conv3d", "no output without a target".into()))
    }

    /// [`Self::conv3d_behind`], or with `target` its window into the target (returning `None`).
    fn conv3d_target(
        &self,
        front: Option<&Tensor>,
        weight: &Tensor,
        bias: Option<&Tensor>,
        params: &Conv3dParams,
        target: Option<crate::ConvTarget<'_>>,
    ) -> Result<Option<Tensor>> {
        const OP: &str = "conv3d";
        let [n, cin, t, h, w] = video_dims(OP, self)?;
        let front_t = front.map_or(0, |f| f.dims()[2]);
        let t = t + front_t;
        let mismatch = |rhs: &Shape| TensorError::ShapeMismatch { op: OP, lhs: self.shape().clone(), rhs: rhs.clone() };
        let &[cout, wcin, kt, kh, kw] = weight.dims() else { return Err(mismatch(weight.shape())) };
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
        let [st, sh, sw] = params.stride;
        if sh != sw {
            return Err(invalid(OP, format!("spatial strides must be equal, got {:?}", params.stride)));
        }
        let Some([to, ho, wo]) = params.output_size([t, h, w], [kt, kh, kw]) else {
            return Err(invalid(
                OP,
                format!(
                    "kernel {kt}x{kh}x{kw} with stride {:?} and padding {:?} does not fit input {}",
                    params.stride,
                    params.padding,
                    self.shape()
                ),
            ));
        };
        let out_len = checked_len(OP, &[n, cout, to, ho, wo])?;
        let [t_front, _, top, bottom, left, right] = params.padding;
        if let (Some(x), Some(wt)) = (self.cuda(), weight.cuda()) {
            if target.is_some() {
                return Err(invalid(OP, "a target window on the CPU only".into()));
            }
            let b = bias.map(|b| b.cuda().ok_or_else(|| invalid(OP, "bias not on the device".into()))).transpose()?;
            let g = crate::abi::ConvGeom {
                n: n as u64,
                cin: cin as u64,
                t: t as u64,
                h: h as u64,
                w: w as u64,
                cout: cout as u64,
                kt: kt as u64,
                kh: kh as u64,
                kw: kw as u64,
                to: to as u64,
                ho: ho as u64,
                wo: wo as u64,
                stride_t: st as u64,
                stride: sh as u64,
                pad_front: t_front as i64,
                pad_top: top as i64,
                pad_left: left as i64,
            };
            let _ = (bottom, right, out_len); // implied by the output extents
            let front = match front {
                Some(f) => Some((
                    f.cuda().ok_or_else(|| invalid(OP, "front frames not on the device".into()))?,
                    front_t as u64,
                )),
                None => None,
            };
            return Ok(Some(Tensor::from_cuda(x.conv3d(front, wt, b, g)?, Shape::new([n, cout, to, ho, wo]))));
        }
        let window = match &target {
            Some(t) => t.window_of(OP, &[n, cout, to, ho, wo], params.band_align)?,
            None => crate::ops::conv::OutWindow::whole(ho, wo),
        };
        let main_t = t - front_t;
        let job = crate::ops::conv::ConvJob {
            frames: crate::ops::conv::Frames {
                parts: [front.map(|f| f.as_slice_f32()).transpose()?.unwrap_or(&[]), self.as_slice_f32()?],
                part_t: [front_t, main_t],
                n,
                cin,
                h,
                w,
            },
            weight: weight.as_slice_f32()?,
            bias: bias.map(|b| b.as_slice_f32()).transpose()?,
            cout,
            kernel: [kt, kh, kw],
            stride: [st, sh],
            pad_front: t_front,
            padding: [top, bottom, left, right],
            out: [to, ho, wo],
            band_align: params.band_align,
            bf16: crate::device::cpu_bf16_active(),
            upsample: false,
            window,
        };
        let _ = out_len; // checked above; the job checks it again
        match target {
            Some(t) => {
                job.run_into(crate::ops::simd::isa(), t.dest.as_mut_slice_f32()?)?;
                Ok(None)
            }
            None => Ok(Some(Tensor::from_buffer(job.run(crate::ops::simd::isa())?, Shape::new([n, cout, to, ho, wo])))),
        }
    }

    /// diffusers' `WanRMS_norm`: `F.normalize(x, dim=channel_dim) · sqrt(C) · gamma + bias`,
    /// i.e. each vector along `channel_dim` divided by `max(‖x‖₂, eps)` (PyTorch's default eps
    /// is `1e-12`), times `sqrt(C)` and the per-channel `gamma` (plus `bias`). `gamma` and
    /// `bias` hold `C` elements shaped `[C]` or `[C, 1, ...]` (diffusers stores `[C, 1, 1]` for
    /// images and `[C, 1, 1, 1]` for video).
    ///
    /// The sum of squares is accumulated in f64 and each output evaluated in f64 and rounded
    /// once, so results are within about one f32 ulp of the exact value (PyTorch rounds after
    /// each of its five f32 operations).
    pub fn rms_norm_channels(
        &self,
        gamma: &Tensor,
        bias: Option<&Tensor>,
        channel_dim: usize,
        eps: f32,
    ) -> Result<Tensor> {
        let _profile = crate::profile::Scope::new("rms_norm");
        self.rms_norm_channels_then(gamma, bias, channel_dim, eps, false)
    }

    /// [`Tensor::rms_norm_channels`] followed by [`Tensor::silu`], in one pass over the data
    /// (Wan's resnets and output heads). On the CPU and in f32 on CUDA the result equals the
    /// two ops bit for bit; a bf16 CUDA tensor is rounded once instead of twice.
    pub fn rms_norm_channels_silu(
        &self,
        gamma: &Tensor,
        bias: Option<&Tensor>,
        channel_dim: usize,
        eps: f32,
    ) -> Result<Tensor> {
        let _profile = crate::profile::Scope::new("rms_norm");
        self.rms_norm_channels_then(gamma, bias, channel_dim, eps, true)
    }

    fn rms_norm_channels_then(
        &self,
        gamma: &Tensor,
        bias: Option<&Tensor>,
        channel_dim: usize,
        eps: f32,
        silu: bool,
    ) -> Result<Tensor> {
        const OP: &str = "rms_norm_channels";
        self.check_dim(OP, channel_dim)?;
        if eps.is_nan() || eps < 0.0 {
            return Err(invalid(OP, format!("eps must be a non-negative number, got {eps}")));
        }
        let c = self.dims()[channel_dim];
        let inner: usize = self.dims()[channel_dim + 1..].iter().product();
        if let Some(x) = self.cuda() {
            fn check<'p>(x: &Tensor, p: &'p Tensor, c: usize) -> Result<&'p DeviceStorage> {
                x.check_same_device(OP, p)?;
                let ok = p.dims().first() == Some(&c) && p.dims()[1..].iter().all(|&d| d == 1);
                if !ok {
                    return Err(TensorError::ShapeMismatch { op: OP, lhs: x.shape().clone(), rhs: p.shape().clone() });
                }
                p.cuda().ok_or_else(|| invalid(OP, "parameter not on the device".into()))
            }
            let g = check(self, gamma, c)?;
            let b = bias.map(|b| check(self, b, c)).transpose()?;
            let batch: usize = self.dims()[..channel_dim].iter().product();
            let out = x.rms_norm_channels(g, b, [batch, c, inner], eps, silu)?;
            return Ok(Tensor::from_cuda(out, self.shape().clone()));
        }
        let gamma = channel_param(OP, self, gamma, c)?;
        let bias = bias.map(|b| channel_param(OP, self, b, c)).transpose()?;
        let src = self.as_slice_f32()?;
        let mut out = Buffer::for_overwrite(src.len());
        if let Some(batch) = src.len().checked_div(c * inner) {
            let block = c * inner;
            let isa = crate::ops::simd::isa();
            let dst = OutPtr::new(out.as_mut_slice());
            // Tasks own runs of positions (all channels of them): parallel even for one item.
            let runs = (0..batch).flat_map(|b| (0..inner).step_by(RMS_RUN).map(move |p0| (b, p0)));
            runs.collect::<Vec<_>>().into_par_iter().for_each(|(b, p0)| {
                let len = RMS_RUN.min(inner - p0);
                let x = &src[b * block..][..block];
                // SAFETY: positions p0..p0 + len of every channel of item b belong to this task.
                let rows: Vec<&mut [f32]> =
                    (0..c).map(|ch| unsafe { dst.slice(b * block + ch * inner + p0, len) }).collect();
                rms_kernel(isa, x, inner, p0, rows, (gamma, bias), eps as f64, silu);
            });
        }
        Ok(Tensor::from_buffer(out, self.shape().clone()))
    }

    /// Wan 2.2's `AvgDown3D(in_channels=C, out_channels, factor_t, factor_s)` on
    /// `[N, C, T, H, W]`: zero frames are prepended to make `T` a multiple of `factor_t` (they
    /// count in the mean), each `factor_t × factor_s × factor_s` block is folded into channels
    /// in the order `(c, dt, dh, dw)`, and consecutive groups of `C·factor / out_channels` of
    /// those channels are averaged. Output `[N, out_channels, ⌈T/ft⌉, H/fs, W/fs]`; `H` and `W`
    /// must be multiples of `factor_s`. Means are summed in f64 and rounded once.
    pub fn avg_down3d(&self, factor_t: usize, factor_s: usize, out_channels: usize) -> Result<Tensor> {
        let _profile = crate::profile::Scope::new("avg_down3d");
        const OP: &str = "avg_down3d";
        let [n, c, t, h, w] = video_dims(OP, self)?;
        if factor_t == 0 || factor_s == 0 || out_channels == 0 || c == 0 {
            return Err(invalid(
                OP,
                format!("factors and out_channels must be >= 1, got {factor_t}, {factor_s}, {out_channels}"),
            ));
        }
        if !h.is_multiple_of(factor_s) || !w.is_multiple_of(factor_s) {
            return Err(invalid(OP, format!("H and W of {} must be multiples of {factor_s}", self.shape())));
        }
        let factor = checked_len(OP, &[factor_t, factor_s, factor_s])?;
        let folded = checked_len(OP, &[c, factor])?;
        if !folded.is_multiple_of(out_channels) {
            return Err(invalid(
                OP,
                format!("{c} channels x factor {factor} do not divide into {out_channels} outputs"),
            ));
        }
        let group = folded / out_channels;
        let pad_t = (factor_t - t % factor_t) % factor_t;
        let tp = t + pad_t;
        if let Some(x) = self.cuda() {
            let (t2, h2, w2) = (tp / factor_t, h / factor_s, w / factor_s);
            let out_len = checked_len(OP, &[n, out_channels, t2, h2, w2])?;
            let out = x.avg_down3d([n, c, t, h, w], [out_channels, factor_t, factor_s, group, pad_t], out_len)?;
            return Ok(Tensor::from_cuda(out, Shape::new([n, out_channels, t2, h2, w2])));
        }
        let x = if pad_t > 0 {
            let zeros = Tensor::zeros([n, c, pad_t, h, w], self.dtype(), &self.device())?;
            Tensor::cat(&[&zeros, self], 2)?
        } else {
            self.clone()
        };
        let (t2, h2, w2) = (tp / factor_t, h / factor_s, w / factor_s);
        let x =
            x.into_reshaped([n, c, t2, factor_t, h2, factor_s, w2, factor_s])?.permute(&[0, 1, 3, 5, 7, 2, 4, 6])?;
        // Now [N, C·factor, T', H', W'] = [N, out, group, T'·H'·W'].
        let src = x.as_slice_f32()?;
        let spatial = t2 * h2 * w2;
        let mut out = Buffer::zeros(n * out_channels * spatial);
        if spatial > 0 {
            out.as_mut_slice().par_chunks_mut(spatial).zip(src.par_chunks(group * spatial)).for_each(|(dst, g)| {
                let mut sum = vec![0.0f64; spatial];
                for row in g.chunks_exact(spatial) {
                    sum.iter_mut().zip(row).for_each(|(s, &v)| *s += v as f64);
                }
                dst.iter_mut().zip(&sum).for_each(|(d, s)| *d = (s / group as f64) as f32);
            });
        }
        Ok(Tensor::from_buffer(out, Shape::new([n, out_channels, t2, h2, w2])))
    }

    /// Wan 2.2's `DupUp3D(in_channels=C, out_channels, factor_t, factor_s)` on
    /// `[N, C, T, H, W]`: channels are repeated (`repeat_interleave`) `out_channels·factor / C`
    /// times, then unfolded in the order `(c_out, dt, dh, dw)` into
    /// `[N, out_channels, T·ft, H·fs, W·fs]`, i.e.
    /// `y[n, o, t·ft + dt, h·fs + dh, w·fs + dw] = x[n, j / repeats, t, h, w]` with
    /// `j = ((o·ft + dt)·fs + dh)·fs + dw`. With `first_chunk` the first `factor_t − 1` output
    /// frames are dropped.
    pub fn dup_up3d(&self, factor_t: usize, factor_s: usize, out_channels: usize, first_chunk: bool) -> Result<Tensor> {
        let _profile = crate::profile::Scope::new("dup_up3d");
        const OP: &str = "dup_up3d";
        let [n, c, t, h, w] = video_dims(OP, self)?;
        if factor_t == 0 || factor_s == 0 || out_channels == 0 || c == 0 {
            return Err(invalid(
                OP,
                format!(
                    "factors, channels and out_channels must be >= 1, got {factor_t}, {factor_s}, {c}, {out_channels}"
                ),
            ));
        }
        let factor = checked_len(OP, &[factor_t, factor_s, factor_s])?;
        let unfolded = checked_len(OP, &[out_channels, factor])?;
        if !unfolded.is_multiple_of(c) {
            return Err(invalid(
                OP,
                format!("{out_channels} outputs x factor {factor} is not a multiple of {c} channels"),
            ));
        }
        let repeats = unfolded / c;
        checked_len(OP, &[n, unfolded, t, h, w])?;
        if let Some(x) = self.cuda() {
            let drop = if first_chunk && factor_t > 1 { (factor_t - 1).min(t * factor_t) } else { 0 };
            let dims = [n, out_channels, t * factor_t - drop, h * factor_s, w * factor_s];
            let out_len = checked_len(OP, &dims)?;
            let out = x.dup_up3d([n, c, t, h, w], [out_channels, factor_t, factor_s, repeats, drop], out_len)?;
            return Ok(Tensor::from_cuda(out, Shape::new(dims)));
        }
        // One pass over the output, a row at a time: output row `(b, o, frame, row)` interleaves
        // the input rows of the `fs` channels its columns unfold from.
        let src = self.as_slice_f32()?;
        let drop = if first_chunk && factor_t > 1 { (factor_t - 1).min(t * factor_t) } else { 0 };
        let (t2, h2, w2) = (t * factor_t - drop, h * factor_s, w * factor_s);
        let dims = [n, out_channels, t2, h2, w2];
        let mut out = Buffer::for_overwrite(checked_len(OP, &dims)?);
        if w2 > 0 {
            let (fs, ft) = (factor_s, factor_t);
            out.as_mut_slice().par_chunks_mut(w2).enumerate().for_each(|(r, dst)| {
                let (rest, y) = (r / h2, r % h2);
                let (rest, frame) = (rest / t2, rest % t2);
                let (b, o) = (rest / out_channels, rest % out_channels);
                let (ti, dt) = ((frame + drop) / ft, (frame + drop) % ft);
                let (hi, dh) = (y / fs, y % fs);
                let row = |dw: usize| {
                    let j = ((o * ft + dt) * fs + dh) * fs + dw;
                    &src[(((b * c + j / repeats) * t + ti) * h + hi) * w..][..w]
                };
                if fs == 1 {
                    dst.copy_from_slice(row(0));
                } else if fs == 2 {
                    let (even, odd) = (row(0), row(1));
                    for ((d, &a), &z) in dst.chunks_exact_mut(2).zip(even).zip(odd) {
                        d[0] = a;
                        d[1] = z;
                    }
                } else {
                    for dw in 0..fs {
                        for (d, &v) in dst[dw..].iter_mut().step_by(fs).zip(row(dw)) {
                            *d = v;
                        }
                    }
                }
            });
        }
        Ok(Tensor::from_buffer(out, Shape::new(dims)))
    }

    /// diffusers' Wan `patchify(x, p)`: `[N, C, T, H, W]` to `[N, C·p², T, H/p, W/p]` with
    /// `y[n, c·p² + dw·p + dh, t, h, w] = x[n, c, t, h·p + dh, w·p + dw]` (the column offset
    /// is the major one, from the Python's `permute(0, 1, 6, 4, 2, 3, 5)`). `p = 1` returns a
    /// copy of any input, as the Python returns its input before checking the rank.
    pub fn patchify(&self, p: usize) -> Result<Tensor> {
        let _profile = crate::profile::Scope::new("patchify");
        const OP: &str = "patchify";
        if p == 0 {
            return Err(invalid(OP, "patch size must be >= 1".into()));
        }
        if p == 1 {
            return Ok(self.clone());
        }
        let [n, c, t, h, w] = video_dims(OP, self)?;
        if !h.is_multiple_of(p) || !w.is_multiple_of(p) {
            return Err(invalid(OP, format!("H and W of {} must be multiples of the patch size {p}", self.shape())));
        }
        let pp = checked_len(OP, &[p, p])?;
        self.reshape([n, c, t, h / p, p, w / p, p])?.permute(&[0, 1, 6, 4, 2, 3, 5])?.into_reshaped([
            n,
            c * pp,
            t,
            h / p,
            w / p,
        ])
    }

    /// diffusers' Wan `unpatchify(x, p)`, the inverse of [`Tensor::patchify`]:
    /// `[N, C·p², T, H, W]` to `[N, C, T, H·p, W·p]`. The channel count must be a multiple of
    /// `p²`. `p = 1` returns a copy of any input.
    pub fn unpatchify(&self, p: usize) -> Result<Tensor> {
        let _profile = crate::profile::Scope::new("patchify");
        const OP: &str = "unpatchify";
        if p == 0 {
            return Err(invalid(OP, "patch size must be >= 1".into()));
        }
        if p == 1 {
            return Ok(self.clone());
        }
        let [n, cp, t, h, w] = video_dims(OP, self)?;
        let pp = checked_len(OP, &[p, p])?;
        if !cp.is_multiple_of(pp) {
            return Err(invalid(OP, format!("{cp} channels are not a multiple of the patch size squared {pp}")));
        }
        let (hp, wp) = (h.checked_mul(p), w.checked_mul(p));
        let (Some(hp), Some(wp)) = (hp, wp) else { return Err(invalid(OP, "sizes overflow usize".into())) };
        self.reshape([n, cp / pp, p, p, t, h, w])?.permute(&[0, 1, 4, 5, 3, 6, 2])?.into_reshaped([
            n,
            cp / pp,
            t,
            hp,
            wp,
        ])
    }
}
