//! The LTX blocks by diffusers' state-dict names (`autoencoder_kl_ltx` and
//! `autoencoder_kl_ltx2`): the 3-D conv that pads time by repeating edge frames (causal: the
//! first frame in front; non-causal: first and last on each side) and H / W with zeros or by
//! reflection, the per-pixel RMS norm without weights, the residual block with its optional
//! timestep scale and shift, the resamples that fold pixels into channels and back with
//! averaged or repeated shortcuts, and the timestep embedder.
//!
//! Every layer takes and returns one batch item's clip `[1, C, T, H, W]`, or this rank's band of
//! one along H or W ([`Band`]): convs take their neighbours' rows and pad (zeros or a
//! reflection) only at the global edges; everything else is per pixel.

use vae_tensor::{Conv3dParams, Tensor};

use super::config::{SpatialPadding, Stride};
use crate::clip::{Edge, clip_dims, padded_for_conv};
use crate::layers::{Band, Linear};
use crate::weights::Weights;
use crate::{ModelError, Result};

/// The RMS norms' epsilon in diffusers (`RMSNorm(eps=1e-8)` / `PerChannelRMSNorm`). Our norm
/// divides by `max(‖x‖, 1e-12)` instead of `sqrt(mean(x²) + 1e-8)`: the same for any activation
/// whose mean square is far above `1e-8`, which is what the tolerance tests check.
const NORM_EPS: f32 = 1e-12;

/// `LTXVideoCausalConv3d` / `LTX2VideoCausalConv3d`: a `k × k × k` conv whose time padding
/// repeats the first frame `k − 1` times in front (causal) or the first and last `(k − 1) / 2`
/// times each side, and whose H / W padding of `k / 2` is zeros or a reflection.
pub(super) struct CausalConv3d {
    weight: Tensor,
    bias: Tensor,
    k: usize,
    causal: bool,
    spatial: SpatialPadding,
    /// Rows one latent row has become at this conv's resolution (`Conv3dParams::band_aligned`).
    band_align: usize,
}

impl CausalConv3d {
    /// Loads `conv.weight` / `conv.bias` of a `k`-cube conv.
    pub(super) fn load(
        w: &mut Weights<'_>,
        cin: usize,
        cout: usize,
        causal: bool,
        spatial: SpatialPadding,
        align: usize,
    ) -> Result<Self> {
        Ok(Self {
            weight: w.get("conv.weight", &[cout, cin, 3, 3, 3])?,
            bias: w.get("conv.bias", &[cout])?,
            k: 3,
            causal,
            spatial,
            band_align: align,
        })
    }

    /// The weight (for tensors made on its device, in its element type).
    pub(super) fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The conv of a clip, or of this rank's band of one: along the band's axis the padding is
    /// the neighbours' rows, zeros or reflected rows only at the global edges.
    pub(super) fn forward(&self, x: &Tensor, band: &mut Band<'_, '_>) -> Result<Tensor> {
        let k = self.k;
        let time = if self.causal { (k - 1, 0) } else { ((k - 1) / 2, (k - 1) / 2) };
        let edge = match self.spatial {
            SpatialPadding::Zeros => Edge::Zeros,
            SpatialPadding::Reflect => Edge::Reflect,
        };
        let padded = padded_for_conv(x, k, time, edge, band)?;
        let params = Conv3dParams::default().band_aligned(self.band_align);
        Ok(padded.conv3d(&self.weight, Some(&self.bias), &params)?)
    }
}

/// The per-pixel RMS norm without weights (`RMSNorm(elementwise_affine=False)` /
/// `PerChannelRMSNorm`), as `normalize(x) · √C` with a scale of ones.
pub(super) struct RmsNorm {
    ones: Tensor,
}

impl RmsNorm {
    /// A norm over `channels`, its scale on the device and in the element type of `like`.
    pub(super) fn new(channels: usize, like: &Tensor) -> Result<Self> {
        let ones = Tensor::from_vec(vec![1.0; channels], vec![channels, 1, 1, 1], &like.device())?;
        Ok(Self { ones: ones.to_dtype(like.dtype())? })
    }

    pub(super) fn forward_silu(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.rms_norm_channels_silu(&self.ones, None, 1, NORM_EPS)?)
    }

    /// The norm, `x · (1 + scale) + shift` per channel, then SiLU: the timestep-conditioned
    /// blocks' order, as one pass of the norm with `1 + scale` for its weight and `shift` for its
    /// bias (each product and sum rounded once, not after each of PyTorch's steps).
    pub(super) fn forward_modulated_silu(&self, x: &Tensor, shift: &[f32], scale: &[f32]) -> Result<Tensor> {
        let c = shift.len();
        let like = |v: Vec<f32>| -> Result<Tensor> {
            Ok(Tensor::from_vec(v, vec![c, 1, 1, 1], &self.ones.device())?.to_dtype(self.ones.dtype())?)
        };
        let gamma = like(scale.iter().map(|s| 1.0 + s).collect())?;
        let bias = like(shift.to_vec())?;
        Ok(x.rms_norm_channels_silu(&gamma, Some(&bias), 1, NORM_EPS)?)
    }
}

/// `PixArtAlphaCombinedTimestepSizeEmbeddings(dim, 0)`: the 256-channel sinusoidal projection
/// of a timestep (cosines first), then `linear_1`, SiLU, `linear_2`.
pub(super) struct TimestepEmbedder {
    linear_1: Linear,
    linear_2: Linear,
}

/// The projection's channels.
const PROJ: usize = 256;

impl TimestepEmbedder {
    /// Loads `time_embedder.timestep_embedder.linear_{1,2}` under `w`.
    pub(super) fn load(w: &mut Weights<'_>, dim: usize) -> Result<Self> {
        let mut e = w.pp("timestep_embedder");
        Ok(Self {
            linear_1: Linear::load(&mut e.pp("linear_1"), PROJ, dim)?,
            linear_2: Linear::load(&mut e.pp("linear_2"), dim, dim)?,
        })
    }

    /// `get_timestep_embedding(t, 256, flip_sin_to_cos=True, downscale_freq_shift=0)` in f32,
    /// rounded where PyTorch rounds.
    fn project(t: f32) -> Vec<f32> {
        let half = PROJ / 2;
        let log = (-(10000f64.ln())) as f32;
        let args: Vec<f32> = (0..half).map(|i| t * ((log * i as f32) / half as f32).exp()).collect();
        args.iter().map(|a| a.cos()).chain(args.iter().map(|a| a.sin())).collect()
    }

    /// The embedding of timestep `t` (already scaled by the decoder's multiplier), on the host.
    pub(super) fn forward(&self, t: f32, like: &Tensor) -> Result<Vec<f32>> {
        let proj = Tensor::from_vec(Self::project(t), vec![1, PROJ], &like.device())?.to_dtype(like.dtype())?;
        let mut h = self.linear_1.forward(&proj)?;
        h.silu_inplace()?;
        let out = self.linear_2.forward(&h)?.to_dtype(vae_tensor::DType::F32)?.to_device(&vae_tensor::Device::Cpu)?;
        Ok(out.to_vec_f32()?)
    }
}

/// `LTXVideoResnetBlock3d` / `LTX2VideoResnetBlock3d` with equal widths (the only ones LTX-Video
/// 0.9.5+ and LTX-2 have): norm, (timestep scale and shift), SiLU, conv, twice, plus the input.
pub(super) struct ResnetBlock {
    norm: RmsNorm,
    conv1: CausalConv3d,
    conv2: CausalConv3d,
    /// `scale_shift_table` `[4, C]` on the host: shift 1, scale 1, shift 2, scale 2.
    table: Option<Vec<f32>>,
    channels: usize,
}

impl ResnetBlock {
    pub(super) fn load(
        w: &mut Weights<'_>,
        channels: usize,
        causal: bool,
        spatial: SpatialPadding,
        timestep: bool,
        align: usize,
    ) -> Result<Self> {
        let conv1 = CausalConv3d::load(&mut w.pp("conv1"), channels, channels, causal, spatial, align)?;
        let conv2 = CausalConv3d::load(&mut w.pp("conv2"), channels, channels, causal, spatial, align)?;
        let table = if timestep { Some(host(&w.get("scale_shift_table", &[4, channels])?)?) } else { None };
        Ok(Self { norm: RmsNorm::new(channels, &conv1.weight)?, conv1, conv2, table, channels })
    }

    /// The block on `x`; `temb` is the block's embedded timestep `[4·C]` when it is conditioned.
    pub(super) fn forward(&self, x: &Tensor, temb: Option<&[f32]>, band: &mut Band<'_, '_>) -> Result<Tensor> {
        let c = self.channels;
        let mut y = match (&self.table, temb) {
            // Each map is dropped once the next is made.
            (Some(table), Some(temb)) => {
                let e: Vec<f32> = temb.iter().zip(table).map(|(a, b)| a + b).collect();
                let n2 = {
                    let h = self.conv1.forward(&self.norm.forward_modulated_silu(x, &e[..c], &e[c..2 * c])?, band)?;
                    self.norm.forward_modulated_silu(&h, &e[2 * c..3 * c], &e[3 * c..])?
                };
                self.conv2.forward(&n2, band)?
            }
            (None, _) => {
                let n2 = {
                    let h = self.conv1.forward(&self.norm.forward_silu(x)?, band)?;
                    self.norm.forward_silu(&h)?
                };
                self.conv2.forward(&n2, band)?
            }
            (Some(_), None) => {
                return Err(ModelError::InvalidInput("a timestep-conditioned block needs a timestep".into()));
            }
        };
        y.add_assign(x)?;
        Ok(y)
    }
}

/// A weight as host f32 values.
pub(super) fn host(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(vae_tensor::DType::F32)?.to_device(&vae_tensor::Device::Cpu)?.to_vec_f32()?)
}

/// `LTXVideoDownsampler3d` / `LTX2VideoDownsampler3d`: the first `st − 1` frames prepended,
/// then a conv to `out / (st·sh·sw)` channels folded from `st × sh × sw` blocks, plus the input
/// folded the same way with groups of its channels averaged down to `out`.
pub(super) struct Downsampler {
    conv: CausalConv3d,
    stride: Stride,
    out: usize,
}

impl Downsampler {
    pub(super) fn load(
        w: &mut Weights<'_>,
        cin: usize,
        out: usize,
        stride: Stride,
        causal: bool,
        spatial: SpatialPadding,
        align: usize,
    ) -> Result<Self> {
        let k: usize = stride.iter().product();
        let conv = CausalConv3d::load(&mut w.pp("conv"), cin, out / k, causal, spatial, align)?;
        Ok(Self { conv, stride, out })
    }

    pub(super) fn forward(&self, x: &Tensor, band: &mut Band<'_, '_>) -> Result<Tensor> {
        let [st, s, _] = self.stride;
        // The first frames prepended where the fold spans frames; the input itself otherwise.
        let longer = if st > 1 { Some(Tensor::cat(&[&x.narrow(2, 0, st - 1)?, x], 2)?) } else { None };
        let x = longer.as_ref().unwrap_or(x);
        if !x.dims()[2].is_multiple_of(st) {
            return Err(ModelError::InvalidInput(format!(
                "a temporal downsample got {} frames; the encoder takes 1 + k·(its temporal ratio) frames",
                x.dims()[2] - (st - 1)
            )));
        }
        let residual = x.avg_down3d(st, s, self.out)?;
        let h = self.conv.forward(x, band)?;
        // A fold with groups of one channel: the conv's channels rearranged, unchanged.
        let mut h = h.avg_down3d(st, s, self.out)?;
        h.add_assign(&residual)?;
        Ok(h)
    }
}

/// `LTXVideoUpsampler3d` / `LTX2VideoUpsampler3d`: a conv to `C·st·sh·sw / u` channels unfolded
/// into `st × sh × sw` blocks (channel order `(c, t, h, w)`), the first `st − 1` frames dropped;
/// with `residual`, plus the input unfolded the same way and its channels repeated (`repeat`,
/// whole copies) `st·sh·sw / u` times.
pub(super) struct Upsampler {
    conv: CausalConv3d,
    stride: Stride,
    residual: bool,
    /// Channels after it.
    out: usize,
}

impl Upsampler {
    pub(super) fn load(
        w: &mut Weights<'_>,
        cin: usize,
        (stride, residual, u): (Stride, bool, usize),
        causal: bool,
        spatial: SpatialPadding,
        align: usize,
    ) -> Result<Self> {
        let k: usize = stride.iter().product();
        let conv = CausalConv3d::load(&mut w.pp("conv"), cin, cin * k / u, causal, spatial, align)?;
        Ok(Self { conv, stride, residual, out: cin / u })
    }

    pub(super) fn forward(&self, x: &Tensor, band: &mut Band<'_, '_>) -> Result<Tensor> {
        let [st, s, _] = self.stride;
        let k: usize = self.stride.iter().product();
        let mut h = self.conv.forward(x, band)?.dup_up3d(st, s, self.out, true)?;
        if self.residual {
            let cin = clip_dims(x)?[1];
            let unfolded = x.dup_up3d(st, s, cin / k, true)?;
            let copies = self.out / (cin / k);
            let residual = if copies == 1 { unfolded } else { Tensor::cat(&vec![&unfolded; copies], 1)? };
            h.add_assign(&residual)?;
        }
        Ok(h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against diffusers' `get_timestep_embedding(torch.tensor([50.0]), 256, flip_sin_to_cos=True,
    /// downscale_freq_shift=0)` (torch 2.15): cosines first, then sines, frequencies
    /// `10000^(-i/128)`.
    #[test]
    fn the_timestep_projection_is_diffusers() {
        let p = TimestepEmbedder::project(50.0);
        assert_eq!(p.len(), 256);
        let torch = [
            (0, 0.964_966_06),
            (1, -0.827_987_5),
            (64, 0.877_582_55),
            (127, 0.999_985_6),
            (128, -0.262_374_85),
            (129, 0.560_746_6),
            (200, 0.277_480_48),
            (255, 0.005_373_012),
        ];
        for (i, want) in torch {
            assert!((p[i] - want).abs() <= 1e-6, "{i}: {} vs {want}", p[i]);
        }
    }
}
