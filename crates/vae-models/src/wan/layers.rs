//! The Wan blocks by diffusers' state-dict names: the causal 3-D conv, the RMS norm, the
//! residual block and the mid-block attention (`diffusers.models.autoencoders.autoencoder_kl_wan`).

use std::borrow::Cow;

use vae_planner::{ShardAxis, halo_width};
use vae_tensor::{Conv3dParams, ConvTarget, Tensor};

use super::cache::Pass;
use crate::Result;
use crate::layers::{Conv2d, RmsNorm, released};
use crate::weights::Weights;

/// `WanCausalConv3d`: time padded only in front (`2·pt` frames, fewer when cached frames are
/// prepended), space padded symmetrically.
pub(super) struct CausalConv3d {
    weight: Tensor,
    bias: Tensor,
    pad: [usize; 3],
    /// 2 for the encoder's temporal downsampling, else 1.
    pub(super) time_stride: usize,
    /// Rows one latent row has become at this conv's resolution: band cuts of a spatial shard
    /// fall on multiples of it (`Conv3dParams::band_aligned`).
    band_align: usize,
}

impl CausalConv3d {
    pub(super) fn load(w: &mut Weights<'_>, cin: usize, cout: usize, k: [usize; 3], pad: [usize; 3]) -> Result<Self> {
        Ok(Self {
            weight: w.get("weight", &[cout, cin, k[0], k[1], k[2]])?,
            bias: w.get("bias", &[cout])?,
            pad,
            time_stride: 1,
            band_align: 1,
        })
    }

    /// The same conv at a resolution where one latent row has become `align` rows.
    pub(super) fn band_aligned(mut self, align: usize) -> Self {
        self.band_align = align;
        self
    }

    pub(super) fn forward(&self, x: &Tensor, cache: Option<&Tensor>) -> Result<Tensor> {
        let cached = cache.filter(|_| 2 * self.pad[0] > 0);
        let params = self.params(cached, self.spatial_padding());
        // The cached frames in front of the new ones (diffusers' `torch.cat([cache_x, x], 2)`),
        // without the concatenation on CUDA.
        Ok(match cached {
            Some(c) => x.conv3d_after(c, &self.weight, Some(&self.bias), &params)?,
            None => x.conv3d(&self.weight, Some(&self.bias), &params)?,
        })
    }

    /// Rows each neighbour must supply along `axis` (the kernel's halo).
    pub(super) fn halo(&self, axis: ShardAxis) -> usize {
        kernel_halo(&self.weight, axis)
    }

    /// The halo a band (or block) cut along `halo_axes` (height, width) exchanges: the kernel's
    /// along the cut axis; a block's must be the same along both (every Wan kernel is square).
    pub(super) fn band_halo(&self, halo_axes: [bool; 2]) -> Result<usize> {
        square_halo(&self.weight, halo_axes)
    }

    /// Output channels.
    pub(super) fn out_channels(&self) -> usize {
        self.weight.dims()[0]
    }

    /// The layer's own spatial padding, `[top, bottom, left, right]`.
    pub(super) fn spatial_padding(&self) -> [usize; 4] {
        let [_, ph, pw] = self.pad;
        [ph, ph, pw, pw]
    }

    /// The conv of `x` behind `cache` (laid out as `x`) with the spatial `padding`, computing
    /// only `target`'s window of the output into its destination: one piece of a band's
    /// overlapped convolution ([`vae_runtime::ShardContext::conv_with_halo`]).
    pub(super) fn forward_piece(
        &self,
        x: &Tensor,
        cache: Option<&Tensor>,
        padding: [usize; 4],
        target: ConvTarget<'_>,
    ) -> Result<()> {
        let params = self.params(cache, padding);
        let cache = cache.filter(|_| 2 * self.pad[0] > 0);
        Ok(x.conv3d_into(cache, &self.weight, Some(&self.bias), &params, target)?)
    }

    /// The parameters behind `cache` (which replaces as many front padding frames as it holds)
    /// with the spatial `padding`.
    fn params(&self, cache: Option<&Tensor>, [top, bottom, left, right]: [usize; 4]) -> Conv3dParams {
        let front = match cache {
            Some(c) => (2 * self.pad[0]).saturating_sub(c.dims()[2]),
            None => 2 * self.pad[0],
        };
        Conv3dParams::new([self.time_stride, 1, 1], [front, 0, top, bottom, left, right]).band_aligned(self.band_align)
    }

    /// Rows one latent row has become at this conv's resolution (its band alignment).
    pub(super) fn band_align(&self) -> usize {
        self.band_align
    }

    /// The weight's elements: multiply-adds per output pixel and frame.
    /// The kernel `[Cout, Cin, kt, kh, kw]`.
    pub(super) fn weight(&self) -> &Tensor {
        &self.weight
    }

    pub(super) fn weight_elements(&self) -> u64 {
        self.weight.elem_count() as u64
    }

    /// Frees the weights (see [`Conv2d::release`]).
    pub(super) fn release(&mut self) -> Result<()> {
        self.weight = released()?;
        self.bias = released()?;
        Ok(())
    }

    /// The weight's element type.
    pub(super) fn weight_dtype(&self) -> vae_tensor::DType {
        self.weight.dtype()
    }
}

/// The halo of a conv weight along the axes `halo_axes` cuts (height, width): the one halo
/// [`vae_runtime::ShardContext::with_halo`] exchanges along all of them, or an error for a
/// kernel whose halos differ along two cut axes.
pub(super) fn square_halo(weight: &Tensor, halo_axes: [bool; 2]) -> Result<usize> {
    let halos: Vec<usize> = [ShardAxis::Height, ShardAxis::Width]
        .into_iter()
        .zip(halo_axes)
        .filter(|(_, cut)| *cut)
        .map(|(axis, _)| kernel_halo(weight, axis))
        .collect();
    match halos.as_slice() {
        [] => Ok(0),
        [h] => Ok(*h),
        [h, w] if h == w => Ok(*h),
        _ => Err(crate::ModelError::Unsupported(format!(
            "a {:?} kernel on a block of a 2-D grid (its halos differ along the two axes)",
            weight.dims()
        ))),
    }
}

/// The halo of a conv weight (`[Cout, Cin, (kt,) kh, kw]`) along `axis`: the kernel's spatial
/// extents are its last two dimensions, as H and W are a tensor's.
pub(super) fn kernel_halo(weight: &Tensor, axis: ShardAxis) -> usize {
    axis.dim_in(weight.rank()).map_or(0, |d| halo_width(weight.dims()[d]))
}

/// `WanResidualBlock`: RMS norm, SiLU, causal conv, twice, plus the (1×1×1 conv) shortcut.
pub(super) struct ResidualBlock {
    norm1: RmsNorm,
    pub(super) conv1: CausalConv3d,
    norm2: RmsNorm,
    pub(super) conv2: CausalConv3d,
    shortcut: Option<CausalConv3d>,
}

impl ResidualBlock {
    /// A block at a resolution where one latent row has become `align` rows.
    pub(super) fn load(w: &mut Weights<'_>, cin: usize, cout: usize, align: usize) -> Result<Self> {
        Ok(Self {
            norm1: RmsNorm::load(&mut w.pp("norm1"), cin, false)?,
            conv1: CausalConv3d::load(&mut w.pp("conv1"), cin, cout, [3, 3, 3], [1, 1, 1])?.band_aligned(align),
            norm2: RmsNorm::load(&mut w.pp("norm2"), cout, false)?,
            conv2: CausalConv3d::load(&mut w.pp("conv2"), cout, cout, [3, 3, 3], [1, 1, 1])?.band_aligned(align),
            shortcut: if cin != cout {
                Some(CausalConv3d::load(&mut w.pp("conv_shortcut"), cin, cout, [1, 1, 1], [0, 0, 0])?)
            } else {
                None
            },
        })
    }

    /// Frees every weight (see [`Conv2d::release`]).
    pub(super) fn release(&mut self) -> Result<()> {
        self.norm1.release()?;
        self.conv1.release()?;
        self.norm2.release()?;
        self.conv2.release()?;
        self.shortcut.as_mut().map_or(Ok(()), CausalConv3d::release)
    }

    /// Its convs' weight elements: multiply-adds per output pixel and frame.
    pub(super) fn weight_elements(&self) -> u64 {
        let shortcut = self.shortcut.as_ref().map_or(0, CausalConv3d::weight_elements);
        self.conv1.weight_elements() + self.conv2.weight_elements() + shortcut
    }

    /// RMS norms, SiLU, residual adds and the 1×1×1 shortcut are per pixel: on a band only
    /// the two 3×3×3 convs communicate.
    pub(super) fn forward(&self, x: &Tensor, pass: &mut Pass<'_, '_>) -> Result<Tensor> {
        let h = match &self.shortcut {
            Some(s) => s.forward(x, None)?,
            None => x.clone(),
        };
        let y = self.norm1.forward_silu(x)?;
        let y = pass.cached_conv(&self.conv1, Cow::Owned(y))?;
        let y = self.norm2.forward_silu(&y)?;
        let mut y = pass.cached_conv(&self.conv2, Cow::Owned(y))?;
        y.add_assign(&h)?;
        Ok(y)
    }
}

/// `WanAttentionBlock`: single-head attention over each frame's H·W positions.
pub(super) struct AttentionBlock {
    norm: RmsNorm,
    to_qkv: Conv2d,
    proj: Conv2d,
}

impl AttentionBlock {
    pub(super) fn load(w: &mut Weights<'_>, dim: usize) -> Result<Self> {
        Ok(Self {
            norm: RmsNorm::load(&mut w.pp("norm"), dim, true)?,
            to_qkv: Conv2d::load1x1(&mut w.pp("to_qkv"), dim, 3 * dim)?,
            proj: Conv2d::load1x1(&mut w.pp("proj"), dim, dim)?,
        })
    }

    /// Frees every weight (see [`Conv2d::release`]).
    pub(super) fn release(&mut self) -> Result<()> {
        self.norm.release()?;
        self.to_qkv.release()?;
        self.proj.release()
    }

    /// Its projections' weight elements: multiply-adds per pixel and frame.
    pub(super) fn weight_elements(&self) -> u64 {
        (self.to_qkv.weight().elem_count() + self.proj.weight().elem_count()) as u64
    }

    /// The channels attended over.
    pub(super) fn channels(&self) -> usize {
        self.proj.out_channels()
    }

    /// On a band, attention needs every position of the frame: the whole map is gathered,
    /// attended (the same computation on every rank) and this rank keeps its band. (Attending
    /// with the band's queries alone would split the work, but the GEMMs' results for a row
    /// depend on how many rows they multiply at once, which breaks bit-identity.)
    pub(super) fn forward_on(&self, x: &Tensor, pass: &mut Pass<'_, '_>) -> Result<Tensor> {
        match pass.band.as_deref_mut() {
            None => self.forward(x),
            Some(ctx) => {
                let full = ctx.all_gather_map(x)?;
                Ok(ctx.own_band(&self.forward(&full)?)?)
            }
        }
    }

    pub(super) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let d = x.dims().to_vec();
        let (b, c, t, h, w) = (d[0], d[1], d[2], d[3], d[4]);
        let frames = x.permute(&[0, 2, 1, 3, 4])?.reshape(vec![b * t, c, h, w])?;
        let normed = self.norm.forward(&frames)?;
        let qkv = self.to_qkv.forward(&normed)?;
        let qkv = qkv.reshape(vec![b * t, 3 * c, h * w])?.transpose(1, 2)?;
        let (q, k, v) = (qkv.narrow(2, 0, c)?, qkv.narrow(2, c, c)?, qkv.narrow(2, 2 * c, c)?);
        let attended = Tensor::attention(&q, &k, &v)?.transpose(1, 2)?.reshape(vec![b * t, c, h, w])?;
        let out = self.proj.forward(&attended)?;
        let mut out = out.reshape(vec![b, t, c, h, w])?.permute(&[0, 2, 1, 3, 4])?;
        out.add_assign(x)?;
        Ok(out)
    }
}
