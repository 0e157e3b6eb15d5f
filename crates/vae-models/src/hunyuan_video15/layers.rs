//! The HunyuanVideo-1.5 blocks by diffusers' state-dict names
//! (`diffusers.models.autoencoders.autoencoder_kl_hunyuanvideo15`): the causal 3-D conv with
//! replicate padding, the RMS norm, the residual block, the mid block's frame-causal attention,
//! and the DCAE down / upsamples that fold 2 × 2 (× 2) blocks into channels and back.
//!
//! Every layer takes and returns a whole clip `[B, C, T, H, W]` (this decoder is not run a frame
//! at a time, since its attention looks at every earlier frame at once), or this rank's band of
//! one along H or W ([`Band`]): convs take their neighbours' rows and replicate only at the
//! global edges, the attention gathers the whole map, everything else is per pixel.

use vae_tensor::{Conv3dParams, Tensor};

use crate::Result;
use crate::clip::{Edge, clip_dims, padded_for_conv};
use crate::layers::{Band, RmsNorm};
use crate::weights::Weights;

/// `HunyuanVideo15CausalConv3d`: replicate padding of `kt − 1` frames in front, none behind,
/// and `k / 2` rows and columns on each side, then an unpadded `nn.Conv3d`.
pub(super) struct CausalConv3d {
    weight: Tensor,
    bias: Tensor,
    kernel: [usize; 3],
    /// Rows one latent row has become at this conv's resolution (`Conv3dParams::band_aligned`).
    band_align: usize,
}

impl CausalConv3d {
    /// A `k × k × k` conv (the class's only kernel shapes are cubes).
    pub(super) fn load(w: &mut Weights<'_>, cin: usize, cout: usize, k: usize) -> Result<Self> {
        Ok(Self {
            weight: w.get("conv.weight", &[cout, cin, k, k, k])?,
            bias: w.get("conv.bias", &[cout])?,
            kernel: [k; 3],
            band_align: 1,
        })
    }

    /// The conv of a clip, or of this rank's band of one: along the band's axis the padding is
    /// the neighbours' rows, replicated edge rows only at the global edges.
    pub(super) fn forward(&self, x: &Tensor, band: &mut Band<'_, '_>) -> Result<Tensor> {
        let [kt, kh, kw] = self.kernel;
        debug_assert_eq!(kh, kw, "the class's kernels are cubes");
        let padded = padded_for_conv(x, kh, (kt - 1, 0), Edge::Repeat, band)?;
        let params = Conv3dParams::default().band_aligned(self.band_align);
        Ok(padded.conv3d(&self.weight, Some(&self.bias), &params)?)
    }

    /// The same conv at a resolution where one latent row has become `align` rows (band cuts
    /// fall on multiples of it, so the kernel may use tiles of up to that many rows).
    pub(super) fn band_aligned(mut self, align: usize) -> Self {
        self.band_align = align;
        self
    }
}

/// A plain `nn.Conv3d` with a 1 × 1 × 1 kernel (shortcuts and attention projections).
pub(super) struct PointConv {
    weight: Tensor,
    bias: Tensor,
}

impl PointConv {
    pub(super) fn load(w: &mut Weights<'_>, cin: usize, cout: usize) -> Result<Self> {
        Ok(Self { weight: w.get("weight", &[cout, cin, 1, 1, 1])?, bias: w.get("bias", &[cout])? })
    }

    pub(super) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.conv3d(&self.weight, Some(&self.bias), &Conv3dParams::default())?)
    }
}

/// `HunyuanVideo15ResnetBlock`: norm, SiLU, causal conv, twice, plus the (1×1×1) shortcut.
pub(super) struct ResnetBlock {
    norm1: RmsNorm,
    conv1: CausalConv3d,
    norm2: RmsNorm,
    conv2: CausalConv3d,
    shortcut: Option<PointConv>,
}

impl ResnetBlock {
    /// A block at a resolution where one latent row has become `align` rows.
    pub(super) fn load(w: &mut Weights<'_>, cin: usize, cout: usize, align: usize) -> Result<Self> {
        Ok(Self {
            norm1: RmsNorm::load(&mut w.pp("norm1"), cin, false)?,
            conv1: CausalConv3d::load(&mut w.pp("conv1"), cin, cout, 3)?.band_aligned(align),
            norm2: RmsNorm::load(&mut w.pp("norm2"), cout, false)?,
            conv2: CausalConv3d::load(&mut w.pp("conv2"), cout, cout, 3)?.band_aligned(align),
            shortcut: if cin != cout { Some(PointConv::load(&mut w.pp("conv_shortcut"), cin, cout)?) } else { None },
        })
    }

    pub(super) fn forward(&self, x: &Tensor, band: &mut Band<'_, '_>) -> Result<Tensor> {
        // Each map is dropped once the next is made (shadowed bindings would live to the end).
        let n2 = {
            let h = self.conv1.forward(&self.norm1.forward_silu(x)?, band)?;
            self.norm2.forward_silu(&h)?
        };
        let mut y = self.conv2.forward(&n2, band)?;
        drop(n2);
        match &self.shortcut {
            Some(s) => y.add_assign(&s.forward(x)?)?,
            None => y.add_assign(x)?,
        }
        Ok(y)
    }
}

/// `HunyuanVideo15AttnBlock`: single-head attention over every position of the clip, each
/// frame's positions attending to their own frame's and every earlier frame's (the class's
/// causal mask), plus the input.
pub(super) struct AttnBlock {
    norm: RmsNorm,
    to_q: PointConv,
    to_k: PointConv,
    to_v: PointConv,
    proj_out: PointConv,
}

impl AttnBlock {
    pub(super) fn load(w: &mut Weights<'_>, dim: usize) -> Result<Self> {
        Ok(Self {
            norm: RmsNorm::load(&mut w.pp("norm"), dim, false)?,
            to_q: PointConv::load(&mut w.pp("to_q"), dim, dim)?,
            to_k: PointConv::load(&mut w.pp("to_k"), dim, dim)?,
            to_v: PointConv::load(&mut w.pp("to_v"), dim, dim)?,
            proj_out: PointConv::load(&mut w.pp("proj_out"), dim, dim)?,
        })
    }

    /// On a band, attention needs every position: the whole map is gathered, attended (the same
    /// computation on every rank) and this rank keeps its band.
    pub(super) fn forward_on(&self, x: &Tensor, band: &mut Band<'_, '_>) -> Result<Tensor> {
        match band.as_deref_mut() {
            None => self.forward(x),
            Some(ctx) => {
                let full = ctx.all_gather_map(x)?;
                Ok(ctx.own_band(&self.forward(&full)?)?)
            }
        }
    }

    /// The masked softmax of the class is, row by row, the softmax over the keys the mask lets
    /// through: frame `f`'s queries against the keys and values of frames `0..=f`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let [b, c, t, h, w] = clip_dims(x)?;
        let normed = self.norm.forward(x)?;
        // [B, C, T·H·W] → [B, T·H·W, C]
        let tokens = |p: &PointConv| -> Result<Tensor> {
            Ok(p.forward(&normed)?.reshape(vec![b, c, t * h * w])?.transpose(1, 2)?)
        };
        let (q, k, v) = (tokens(&self.to_q)?, tokens(&self.to_k)?, tokens(&self.to_v)?);
        let hw = h * w;
        let mut frames = Vec::with_capacity(t);
        for f in 0..t {
            let q = q.narrow(1, f * hw, hw)?;
            let seen = (f + 1) * hw;
            frames.push(Tensor::attention(&q, &k.narrow(1, 0, seen)?, &v.narrow(1, 0, seen)?)?);
        }
        let refs: Vec<&Tensor> = frames.iter().collect();
        let attended = Tensor::cat(&refs, 1)?.transpose(1, 2)?.reshape(vec![b, c, t, h, w])?;
        let mut out = self.proj_out.forward(&attended)?;
        out.add_assign(x)?;
        Ok(out)
    }
}

/// `HunyuanVideo15MidBlock` with one layer: resnet, attention, resnet.
pub(super) struct MidBlock {
    resnets: [ResnetBlock; 2],
    attention: AttnBlock,
}

impl MidBlock {
    pub(super) fn load(w: &mut Weights<'_>, dim: usize, align: usize) -> Result<Self> {
        Ok(Self {
            resnets: [
                ResnetBlock::load(&mut w.pp("resnets.0"), dim, dim, align)?,
                ResnetBlock::load(&mut w.pp("resnets.1"), dim, dim, align)?,
            ],
            attention: AttnBlock::load(&mut w.pp("attentions.0"), dim)?,
        })
    }

    pub(super) fn forward(&self, x: &Tensor, band: &mut Band<'_, '_>) -> Result<Tensor> {
        let x = self.resnets[0].forward(x, band)?;
        let x = self.attention.forward_on(&x, band)?;
        self.resnets[1].forward(&x, band)
    }
}

/// `_dcae_upsample_rearrange`: `[B, r1·r2·r3·C, F, H, W]` → `[B, C, r1·F, r2·H, r3·W]`, the
/// channel index read as `(r1, r2, r3, c)`.
fn unfold(x: &Tensor, r: [usize; 3]) -> Result<Tensor> {
    let [b, packed, f, h, w] = clip_dims(x)?;
    let c = packed / (r[0] * r[1] * r[2]);
    let x = x.reshape(vec![b, r[0], r[1], r[2], c, f, h, w])?.permute(&[0, 4, 5, 1, 6, 2, 7, 3])?;
    Ok(x.into_reshaped(vec![b, c, f * r[0], h * r[1], w * r[2]])?)
}

/// `_dcae_downsample_rearrange`: `[B, C, r1·F, r2·H, r3·W]` → `[B, r1·r2·r3·C, F, H, W]`.
fn fold(x: &Tensor, r: [usize; 3]) -> Result<Tensor> {
    let [b, c, pf, ph, pw] = clip_dims(x)?;
    let (f, h, w) = (pf / r[0], ph / r[1], pw / r[2]);
    let x = x.reshape(vec![b, c, f, r[0], h, r[1], w, r[2]])?.permute(&[0, 3, 5, 7, 1, 2, 4, 6])?;
    Ok(x.into_reshaped(vec![b, r[0] * r[1] * r[2] * c, f, h, w])?)
}

/// `repeat_interleave(repeats, dim=1)`: each channel `repeats` times in a row (Wan 2.2's
/// `DupUp3D` with no unfolding).
pub(super) fn repeat_channels(x: &Tensor, repeats: usize) -> Result<Tensor> {
    let channels = clip_dims(x)?[1];
    Ok(x.dup_up3d(1, 1, channels * repeats, false)?)
}

/// `view(B, out, group, ...).mean(dim=2)`: the mean of each run of `C / out` channels.
pub(super) fn mean_channel_groups(x: &Tensor, out: usize) -> Result<Tensor> {
    Ok(x.avg_down3d(1, 1, out)?)
}

/// The frames `from..` of a clip along time.
fn frames(x: &Tensor, from: usize) -> Result<Tensor> {
    Ok(x.narrow(2, from, x.dims()[2] - from)?)
}

/// `[first, rest]` along time, skipping an empty `rest`.
fn cat_time(first: Tensor, rest: Option<Tensor>) -> Result<Tensor> {
    match rest {
        None => Ok(first),
        Some(rest) => Ok(Tensor::cat(&[&first, &rest], 2)?),
    }
}

/// `HunyuanVideo15Upsample`: a conv to `factor · out` channels unfolded into 2 × 2 pixels (and
/// two frames for every frame after the first when temporal: the first frame unfolds in space
/// only, keeping the first half of its channels), plus the input's channels repeated and
/// unfolded the same way.
pub(super) struct Upsample {
    conv: CausalConv3d,
    temporal: bool,
    repeats: usize,
}

impl Upsample {
    /// An upsample whose input is at a resolution where one latent row has become `align` rows.
    pub(super) fn load(w: &mut Weights<'_>, cin: usize, cout: usize, temporal: bool, align: usize) -> Result<Self> {
        let factor = if temporal { 8 } else { 4 };
        let conv = CausalConv3d::load(&mut w.pp("conv"), cin, cout * factor, 3)?.band_aligned(align);
        Ok(Self { conv, temporal, repeats: factor * cout / cin })
    }

    pub(super) fn forward(&self, x: &Tensor, band: &mut Band<'_, '_>) -> Result<Tensor> {
        let h = self.conv.forward(x, band)?;
        if !self.temporal {
            let h = unfold(&h, [1, 2, 2])?;
            let mut shortcut = unfold(&repeat_channels(x, self.repeats)?, [1, 2, 2])?;
            shortcut.add_assign(&h)?;
            return Ok(shortcut);
        }
        let t = x.dims()[2];
        let first = unfold(&h.narrow(2, 0, 1)?, [1, 2, 2])?;
        let first = first.narrow(1, 0, first.dims()[1] / 2)?;
        let rest = (t > 1).then(|| unfold(&frames(&h, 1)?, [2, 2, 2])).transpose()?;
        let h = cat_time(first, rest)?;
        let x_first = repeat_channels(&unfold(&x.narrow(2, 0, 1)?, [1, 2, 2])?, self.repeats / 2)?;
        let x_rest = (t > 1).then(|| repeat_channels(&unfold(&frames(x, 1)?, [2, 2, 2])?, self.repeats)).transpose()?;
        let mut shortcut = cat_time(x_first, x_rest)?;
        shortcut.add_assign(&h)?;
        Ok(shortcut)
    }
}

/// `HunyuanVideo15Downsample`: a conv to `out / factor` channels folded from 2 × 2 pixels (and
/// pairs of frames after the first when temporal: the first frame folds in space only and is
/// doubled along channels), plus the input folded the same way, its channel groups averaged.
pub(super) struct Downsample {
    conv: CausalConv3d,
    temporal: bool,
    out: usize,
}

impl Downsample {
    /// A downsample whose input is at a resolution where one latent row has become `align` rows.
    pub(super) fn load(w: &mut Weights<'_>, cin: usize, cout: usize, temporal: bool, align: usize) -> Result<Self> {
        let factor = if temporal { 8 } else { 4 };
        let conv = CausalConv3d::load(&mut w.pp("conv"), cin, cout / factor, 3)?.band_aligned(align);
        Ok(Self { conv, temporal, out: cout })
    }

    pub(super) fn forward(&self, x: &Tensor, band: &mut Band<'_, '_>) -> Result<Tensor> {
        let h = self.conv.forward(x, band)?;
        if !self.temporal {
            let h = fold(&h, [1, 2, 2])?;
            let mut shortcut = mean_channel_groups(&fold(x, [1, 2, 2])?, self.out)?;
            shortcut.add_assign(&h)?;
            return Ok(shortcut);
        }
        let t = x.dims()[2];
        let first = fold(&h.narrow(2, 0, 1)?, [1, 2, 2])?;
        let first = Tensor::cat(&[&first, &first], 1)?;
        let rest = (t > 1).then(|| fold(&frames(&h, 1)?, [2, 2, 2])).transpose()?;
        let h = cat_time(first, rest)?;
        let x_first = mean_channel_groups(&fold(&x.narrow(2, 0, 1)?, [1, 2, 2])?, self.out)?;
        let x_rest = (t > 1).then(|| mean_channel_groups(&fold(&frames(x, 1)?, [2, 2, 2])?, self.out)).transpose()?;
        let mut shortcut = cat_time(x_first, x_rest)?;
        shortcut.add_assign(&h)?;
        Ok(shortcut)
    }
}
