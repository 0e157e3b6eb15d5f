//! The building blocks diffusers' 2-D VAEs share (`diffusers.models.resnet`,
//! `diffusers.models.attention_processor`, `diffusers.models.unets.unet_2d_blocks`), and the RMS
//! norm of the video VAEs (Wan, Qwen-Image, HunyuanVideo-1.5), loaded by their state-dict names.

use std::borrow::Cow;

use vae_runtime::ShardContext;
use vae_tensor::{Conv2dParams, ConvTarget, Tensor};

use crate::Result;
use crate::weights::Weights;

/// Where a layer runs: on a whole map (`None`), or on this rank's band of a map sharded along
/// one axis, with the request's [`ShardContext`] for halos, statistics and gathers. A band's
/// result is the same band of the whole map's result, bit for bit.
pub type Band<'a, 'c> = Option<&'a mut ShardContext<'c>>;

/// An empty tensor in place of weights a model has let go of.
pub(crate) fn released() -> Result<Tensor> {
    Ok(Tensor::from_vec(Vec::new(), vec![0], &vae_tensor::Device::Cpu)?)
}

/// `F.normalize`'s epsilon in the video VAEs' RMS norms.
const NORMALIZE_EPS: f32 = 1e-12;

/// `WanRMS_norm` / `HunyuanVideo15RMS_norm` without bias: `F.normalize` over channels · √C · γ.
pub(crate) struct RmsNorm {
    gamma: Tensor,
}

impl RmsNorm {
    /// The scale `gamma`, shaped `[dim, 1, 1]` for images or `[dim, 1, 1, 1]` for video.
    pub(crate) fn load(w: &mut Weights<'_>, dim: usize, images: bool) -> Result<Self> {
        let shape: Vec<usize> = if images { vec![dim, 1, 1] } else { vec![dim, 1, 1, 1] };
        Ok(Self { gamma: w.get("gamma", &shape)? })
    }

    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.rms_norm_channels(&self.gamma, None, 1, NORMALIZE_EPS)?)
    }

    /// Frees the scale (see [`Conv2d::release`]).
    pub(crate) fn release(&mut self) -> Result<()> {
        self.gamma = released()?;
        Ok(())
    }

    /// [`Self::forward`] then SiLU, in one pass (the same values).
    pub(crate) fn forward_silu(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.rms_norm_channels_silu(&self.gamma, None, 1, NORMALIZE_EPS)?)
    }
}

/// `nn.Conv2d` with bias.
#[derive(Debug, Clone)]
pub struct Conv2d {
    weight: Tensor,
    bias: Tensor,
    params: Conv2dParams,
}

impl Conv2d {
    /// Loads `weight` `[cout, cin, k, k]` and `bias` `[cout]` from `w`.
    pub fn load(w: &mut Weights<'_>, cin: usize, cout: usize, k: usize, params: Conv2dParams) -> Result<Self> {
        Ok(Self { weight: w.get("weight", &[cout, cin, k, k])?, bias: w.get("bias", &[cout])?, params })
    }

    /// Frees the weights (a model that keeps only some of its layers): the convolution
    /// cannot run afterwards, and its owner must refuse to run it.
    pub(crate) fn release(&mut self) -> Result<()> {
        self.weight = released()?;
        self.bias = released()?;
        Ok(())
    }

    /// A 3×3 convolution with padding 1 (the VAE's workhorse).
    pub fn load3x3(w: &mut Weights<'_>, cin: usize, cout: usize) -> Result<Self> {
        Self::load(w, cin, cout, 3, Conv2dParams::same(3))
    }

    /// A 1×1 convolution.
    pub fn load1x1(w: &mut Weights<'_>, cin: usize, cout: usize) -> Result<Self> {
        Self::load(w, cin, cout, 1, Conv2dParams::same(1))
    }

    /// The same convolution, promised to see band cuts only on multiples of `align` rows and
    /// columns of its input (see [`Conv2dParams::band_aligned`]): pass the rows one latent row
    /// has become at the conv's resolution.
    pub fn band_aligned(mut self, align: usize) -> Self {
        self.params = self.params.band_aligned(align);
        self
    }

    /// Output channels.
    pub fn out_channels(&self) -> usize {
        self.weight.dims()[0]
    }

    /// The weight, `[cout, cin, k, k]`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The stride, padding and band alignment it was loaded with.
    pub fn params(&self) -> &Conv2dParams {
        &self.params
    }

    /// The convolution with other parameters (an input that already carries halo rows along
    /// one axis is not padded along it again).
    pub fn forward_with(&self, x: &Tensor, params: &Conv2dParams) -> Result<Tensor> {
        Ok(x.conv2d(&self.weight, Some(&self.bias), params)?)
    }

    /// [`Self::forward_with`], computing only `target`'s window of the output into its
    /// destination ([`Tensor::conv2d_into`]).
    pub fn forward_into(&self, x: &Tensor, params: &Conv2dParams, target: ConvTarget<'_>) -> Result<()> {
        Ok(x.conv2d_into(&self.weight, Some(&self.bias), params, target)?)
    }

    /// Applies the convolution to an NCHW tensor.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.conv2d(&self.weight, Some(&self.bias), &self.params)?)
    }

    /// [`Self::forward`] of `x` upsampled 2× (nearest), without making the 4× map where the
    /// kernel can read `x` as if upsampled ([`Tensor::upsample2x_conv2d`]).
    pub fn forward_upsampled(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.upsample2x_conv2d(&self.weight, Some(&self.bias), &self.params)?)
    }

    /// [`Self::forward`] on a map or a band of one: a band takes its neighbours' rows (the
    /// halo: the padding along the axis), and the convolution pads only the other axis; the
    /// exchange runs while the rows that need no halo are computed
    /// ([`ShardContext::conv_with_halo`]). Stride 1 only (every decoder convolution).
    pub fn forward_on(&self, x: &Tensor, band: &mut Band<'_, '_>) -> Result<Tensor> {
        let Some(ctx) = band.as_deref_mut() else { return self.forward(x) };
        self.forward_haloed(Cow::Borrowed(x), ctx)
    }

    /// [`Self::forward_on`] of a map the caller no longer needs: a band's map is dropped as soon
    /// as the convolution has what it reads of it, so the map and the output do not both live
    /// beside a haloed copy.
    pub fn forward_owned(&self, x: Tensor, band: &mut Band<'_, '_>) -> Result<Tensor> {
        let Some(ctx) = band.as_deref_mut() else { return self.forward(&x) };
        self.forward_haloed(Cow::Owned(x), ctx)
    }

    /// The convolution of a band with its neighbours' rows.
    fn forward_haloed(&self, x: Cow<'_, Tensor>, ctx: &mut ShardContext<'_>) -> Result<Tensor> {
        let halo = self.band_halo(ctx)?;
        let cout = self.out_channels();
        // The interior and the edges are separate calls: pack the weights once for them.
        let (out, _) = vae_tensor::with_packed_weights(&self.weight, || {
            ctx.conv_with_halo(x, halo, self.params.band_align, cout, None, &mut |piece| {
                let params = Conv2dParams { padding: piece.padding(self.params.padding), ..self.params };
                self.forward_into(piece.input, &params, piece.target)
            })
        })?;
        Ok(out)
    }

    /// The halo a band (or block) needs from each neighbour: the padding along the cut axes.
    fn band_halo(&self, ctx: &ShardContext<'_>) -> Result<usize> {
        let [top, bottom, left, right] = self.params.padding;
        if self.params.stride != 1 || top != bottom || left != right {
            return Err(crate::ModelError::Unsupported(format!(
                "a banded convolution needs stride 1 and symmetric padding, not {:?}",
                self.params
            )));
        }
        match ctx.halo_axes() {
            [true, false] => Ok(top),
            [false, true] => Ok(left),
            _ if top == left => Ok(top),
            _ => Err(crate::ModelError::Unsupported(format!(
                "a convolution on a block of a 2-D grid needs the same padding along both axes, not {:?}",
                self.params
            ))),
        }
    }
}

/// `nn.GroupNorm` with affine parameters.
#[derive(Debug, Clone)]
pub struct GroupNorm {
    weight: Tensor,
    bias: Tensor,
    groups: usize,
    eps: f32,
}

impl GroupNorm {
    /// Loads `weight` and `bias` `[channels]`.
    pub fn load(w: &mut Weights<'_>, groups: usize, channels: usize, eps: f32) -> Result<Self> {
        Ok(Self { weight: w.get("weight", &[channels])?, bias: w.get("bias", &[channels])?, groups, eps })
    }

    /// Normalises an `[N, C, ...]` tensor.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.group_norm(self.groups, &self.weight, &self.bias, self.eps)?)
    }

    /// [`Self::forward`] then SiLU, in one pass (the same values).
    pub fn forward_silu(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.group_norm_silu(self.groups, &self.weight, &self.bias, self.eps)?)
    }

    /// [`Self::forward_silu`] (or, without `silu`, [`Self::forward`]) on a map or a band of
    /// one: a band is normalised with the whole map's statistics
    /// ([`ShardContext::group_norm`]).
    pub fn forward_on(&self, x: &Tensor, silu: bool, band: &mut Band<'_, '_>) -> Result<Tensor> {
        match band.as_deref_mut() {
            Some(ctx) => Ok(ctx.group_norm(x, self.groups, &self.weight, &self.bias, self.eps, silu)?),
            None if silu => self.forward_silu(x),
            None => self.forward(x),
        }
    }
}

/// `nn.Linear` with bias.
#[derive(Debug, Clone)]
pub struct Linear {
    weight: Tensor,
    bias: Tensor,
}

impl Linear {
    /// Loads `weight` `[out, in]` and `bias` `[out]`.
    pub fn load(w: &mut Weights<'_>, cin: usize, cout: usize) -> Result<Self> {
        Ok(Self { weight: w.get("weight", &[cout, cin])?, bias: w.get("bias", &[cout])? })
    }

    /// Applies the layer over the last dimension.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.linear(&self.weight, Some(&self.bias))?)
    }
}

/// diffusers `ResnetBlock2D` as the VAEs use it: no time embedding, SiLU, output scale 1.
#[derive(Debug, Clone)]
pub struct ResnetBlock2d {
    norm1: GroupNorm,
    conv1: Conv2d,
    norm2: GroupNorm,
    conv2: Conv2d,
    conv_shortcut: Option<Conv2d>,
}

impl ResnetBlock2d {
    /// Loads a block mapping `cin` to `cout` channels (a 1×1 `conv_shortcut` when they differ)
    /// that runs where one latent row has become `align` rows ([`Conv2d::band_aligned`]).
    pub fn load(w: &mut Weights<'_>, cin: usize, cout: usize, groups: usize, eps: f32, align: usize) -> Result<Self> {
        Ok(Self {
            norm1: GroupNorm::load(&mut w.pp("norm1"), groups, cin, eps)?,
            conv1: Conv2d::load3x3(&mut w.pp("conv1"), cin, cout)?.band_aligned(align),
            norm2: GroupNorm::load(&mut w.pp("norm2"), groups, cout, eps)?,
            conv2: Conv2d::load3x3(&mut w.pp("conv2"), cout, cout)?.band_aligned(align),
            conv_shortcut: if cin != cout {
                Some(Conv2d::load1x1(&mut w.pp("conv_shortcut"), cin, cout)?)
            } else {
                None
            },
        })
    }

    /// `shortcut(x) + conv2(silu(norm2(conv1(silu(norm1(x))))))`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_on(x, &mut None)
    }

    /// [`Self::forward`] on a map or a band of one (the shortcut is 1×1: local).
    /// Each intermediate map is dropped as soon as the next exists (at most the input, one
    /// normalised map, its halo'd copy on a band, and the convolution's output live at once).
    pub fn forward_on(&self, x: &Tensor, band: &mut Band<'_, '_>) -> Result<Tensor> {
        let h = self.conv1.forward_owned(self.norm1.forward_on(x, true, band)?, band)?;
        let normed = self.norm2.forward_on(&h, true, band)?;
        drop(h);
        let mut h = self.conv2.forward_owned(normed, band)?;
        // diffusers computes `(input + hidden) / output_scale_factor` with a factor of 1.0,
        // which changes nothing.
        match &self.conv_shortcut {
            Some(shortcut) => {
                let mut out = shortcut.forward(x)?;
                out.add_assign(&h)?;
                Ok(out)
            }
            // `h + x` in place (addition commutes bit for bit): no third map.
            None => {
                h.add_assign(x)?;
                Ok(h)
            }
        }
    }
}

/// diffusers `Downsample2D(use_conv=True, padding=0)`: pad right and bottom by one, then a 3×3
/// stride-2 convolution.
#[derive(Debug, Clone)]
pub struct Downsample2d {
    conv: Conv2d,
}

impl Downsample2d {
    /// Loads `conv`.
    pub fn load(w: &mut Weights<'_>, channels: usize) -> Result<Self> {
        Ok(Self { conv: Conv2d::load(&mut w.pp("conv"), channels, channels, 3, Conv2dParams::diffusers_downsample())? })
    }

    /// Halves the spatial size (rounding down).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.conv.forward(x)
    }

    /// [`Self::forward`] on a map or a band of one (`downsample_on`).
    pub fn forward_on(&self, x: &Tensor, band: &mut Band<'_, '_>) -> Result<Tensor> {
        downsample_on(&self.conv, x, band)
    }
}

/// A diffusers downsampling convolution (pad right and bottom by one, 3×3, stride 2) on a map or
/// a band (or block) of one whose edges lie on the stride grid (even start and length): output
/// row `i` reads input rows `2i..2i + 3`, so a band takes one row of the next band (a zero row
/// past the map's bottom, diffusers' padding) and none of the previous; a block the same along
/// both axes.
pub(crate) fn downsample_on(conv: &Conv2d, x: &Tensor, band: &mut Band<'_, '_>) -> Result<Tensor> {
    let Some(ctx) = band.as_deref_mut() else { return conv.forward(x) };
    let [split_h, split_w] = ctx.halo_axes();
    // The unsplit axis keeps diffusers' padding: one zero row (or column) at its far end.
    let padding = [0, usize::from(!split_h), 0, usize::from(!split_w)];
    let split: Vec<usize> = [(2, split_h), (3, split_w)].into_iter().filter(|(_, s)| *s).map(|(d, _)| d).collect();
    for &dim in &split {
        let len = x.dims()[dim];
        if !len.is_multiple_of(2) {
            return Err(crate::ModelError::InvalidInput(format!(
                "a band of {len} rows is not on the stride grid of a downsampling convolution"
            )));
        }
    }
    let mut below = ctx.with_halo(x, 1)?;
    for &dim in &split {
        let len = x.dims()[dim];
        below = below.narrow(dim, 1, len + 1)?;
    }
    conv.forward_with(&below, &Conv2dParams { padding, ..*conv.params() })
}

/// diffusers `Upsample2D(use_conv=True)`: nearest 2× upsampling, then a 3×3 convolution.
#[derive(Debug, Clone)]
pub struct Upsample2d {
    conv: Conv2d,
}

impl Upsample2d {
    /// Loads `conv`, which runs where one latent row has become `align` rows (after the
    /// upsampling; see [`Conv2d::band_aligned`]).
    pub fn load(w: &mut Weights<'_>, channels: usize, align: usize) -> Result<Self> {
        Ok(Self { conv: Conv2d::load3x3(&mut w.pp("conv"), channels, channels)?.band_aligned(align) })
    }

    /// Doubles the spatial size.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.conv.forward_upsampled(x)
    }

    /// [`Self::forward`] on a map or a band of one (nearest upsampling is local: a band
    /// doubles).
    pub fn forward_on(&self, x: &Tensor, band: &mut Band<'_, '_>) -> Result<Tensor> {
        if band.is_none() {
            return self.forward(x);
        }
        self.conv.forward_owned(x.upsample_nearest2d(2)?, band)
    }
}

/// The VAE mid-block attention: diffusers `Attention(heads=1, dim_head=C, residual_connection,
/// norm_num_groups, bias=True)` over the `H·W` positions of an NCHW map.
#[derive(Debug, Clone)]
pub struct SpatialAttention {
    group_norm: GroupNorm,
    to_q: Linear,
    to_k: Linear,
    to_v: Linear,
    to_out: Linear,
}

impl SpatialAttention {
    /// Loads `group_norm`, `to_q`, `to_k`, `to_v` and `to_out.0`.
    pub fn load(w: &mut Weights<'_>, channels: usize, groups: usize, eps: f32) -> Result<Self> {
        Ok(Self {
            group_norm: GroupNorm::load(&mut w.pp("group_norm"), groups, channels, eps)?,
            to_q: Linear::load(&mut w.pp("to_q"), channels, channels)?,
            to_k: Linear::load(&mut w.pp("to_k"), channels, channels)?,
            to_v: Linear::load(&mut w.pp("to_v"), channels, channels)?,
            to_out: Linear::load(&mut w.pp("to_out").pp(0), channels, channels)?,
        })
    }

    /// `x + to_out(attention(to_q(n), to_k(n), to_v(n)))` with `n = group_norm(x)` as a sequence.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let (b, c, hw) = (dims[0], dims[1], dims[2..].iter().product::<usize>());
        // GroupNorm over [B, C, H·W] equals GroupNorm over [B, C, H, W].
        let normed = self.group_norm.forward(x)?.reshape(vec![b, c, hw])?.transpose(1, 2)?;
        let q = self.to_q.forward(&normed)?;
        let k = self.to_k.forward(&normed)?;
        let v = self.to_v.forward(&normed)?;
        drop(normed);
        let attended = Tensor::attention(&q, &k, &v)?;
        let mut out = self.to_out.forward(&attended)?.transpose(1, 2)?.reshape(dims)?;
        out.add_assign(x)?;
        Ok(out)
    }

    /// [`Self::forward`] on a map or a band of one: every position attends to all the others,
    /// so a band gathers the whole map, computes it as one device would, and keeps its band.
    /// (Attending with the band's queries alone would split the work, but the GEMMs' results
    /// for a row depend on how many rows they multiply at once, which breaks bit-identity.)
    pub fn forward_on(&self, x: &Tensor, band: &mut Band<'_, '_>) -> Result<Tensor> {
        let Some(ctx) = band.as_deref_mut() else { return self.forward(x) };
        let full = ctx.all_gather_map(x)?;
        Ok(ctx.own_band(&self.forward(&full)?)?)
    }
}

/// diffusers `UNetMidBlock2D` as the VAEs use it: resnet, (attention), resnet.
#[derive(Debug, Clone)]
pub struct MidBlock2d {
    first: ResnetBlock2d,
    attention: Option<SpatialAttention>,
    second: ResnetBlock2d,
}

impl MidBlock2d {
    /// Loads `resnets.0`, `attentions.0` (when `with_attention`) and `resnets.1`, at the
    /// latent's resolution.
    pub fn load(w: &mut Weights<'_>, channels: usize, groups: usize, with_attention: bool) -> Result<Self> {
        const EPS: f32 = 1e-6;
        Ok(Self {
            first: ResnetBlock2d::load(&mut w.pp("resnets").pp(0), channels, channels, groups, EPS, 1)?,
            attention: if with_attention {
                Some(SpatialAttention::load(&mut w.pp("attentions").pp(0), channels, groups, EPS)?)
            } else {
                None
            },
            second: ResnetBlock2d::load(&mut w.pp("resnets").pp(1), channels, channels, groups, EPS, 1)?,
        })
    }

    /// Runs the block.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_on(x, &mut None)
    }

    /// [`Self::forward`] on a map or a band of one.
    pub fn forward_on(&self, x: &Tensor, band: &mut Band<'_, '_>) -> Result<Tensor> {
        let mut h = self.first.forward_on(x, band)?;
        if let Some(attention) = &self.attention {
            h = attention.forward_on(&h, band)?;
        }
        self.second.forward_on(&h, band)
    }
}
