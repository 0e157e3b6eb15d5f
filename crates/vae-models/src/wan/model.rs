//! Wan2.1 decoder modules, by diffusers' state-dict names.

use std::path::Path;

use std::ops::Range;

use serde::Deserialize;
use vae_planner::{BandPartition, GridSpec, ShardAxis, TileTask, WanTiling, halo_width};
use vae_runtime::progress::{self, Progress};
use vae_runtime::stitch::{StitchSpec, merge_plan, tiled_plan, untiled_plan};
use vae_runtime::{
    OperatorError, ParallelMode, ShardContext, ShardGeometry, ShardOperator, Strategy, StrategyChoice, TileMap,
    TileOperator, TilePlan,
};
use vae_tensor::{Conv2dParams, Conv3dParams, DType, Device, Tensor};

use crate::placement::{check_precision, on_device, to_host};
use crate::weights::{WeightStore, Weights};
use crate::{ModelError, Result};

/// Frames of each causal conv's input that the next chunk needs (diffusers' `CACHE_T`).
const CACHE_T: usize = 2;
/// `F.normalize`'s epsilon in `WanRMS_norm`.
const NORMALIZE_EPS: f32 = 1e-12;

/// `config.json` of an `AutoencoderKLWan` (the fields the decoder needs; missing ones take
/// diffusers' defaults).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct WanConfig {
    /// Encoder base width.
    pub base_dim: usize,
    /// Decoder base width (defaults to `base_dim`).
    pub decoder_base_dim: Option<usize>,
    /// Latent channels.
    pub z_dim: usize,
    /// Width multipliers per level.
    pub dim_mult: Vec<usize>,
    /// Residual blocks per level.
    pub num_res_blocks: usize,
    /// Attention scales (diffusers' Wan VAEs use none).
    pub attn_scales: Vec<f64>,
    /// Which encoder levels halve time (the decoder reverses it).
    pub temperal_downsample: Vec<bool>,
    /// Wan2.2's residual up/down blocks.
    pub is_residual: bool,
    /// Image channels in (`in_channels`; Qwen-Image's config calls it `input_channels`).
    #[serde(alias = "input_channels")]
    pub in_channels: usize,
    /// Output channels.
    pub out_channels: usize,
    /// Wan2.2's patchify size.
    pub patch_size: Option<usize>,
    /// Pixels per latent pixel (8 for Wan2.1 and Qwen-Image, 16 for Wan2.2).
    pub scale_factor_spatial: Option<usize>,
    /// Per-channel latent mean (pipeline normalisation).
    pub latents_mean: Vec<f64>,
    /// Per-channel latent std (pipeline normalisation).
    pub latents_std: Vec<f64>,
}

impl Default for WanConfig {
    fn default() -> Self {
        Self {
            base_dim: 96,
            decoder_base_dim: None,
            z_dim: 16,
            dim_mult: vec![1, 2, 4, 4],
            num_res_blocks: 2,
            attn_scales: Vec::new(),
            temperal_downsample: vec![false, true, true],
            is_residual: false,
            in_channels: 3,
            out_channels: 3,
            patch_size: None,
            scale_factor_spatial: None,
            latents_mean: Vec::new(),
            latents_std: Vec::new(),
        }
    }
}

/// `WanCausalConv3d`: time padded only in front (`2·pt` frames, fewer when cached frames are
/// prepended), space padded symmetrically.
struct CausalConv3d {
    weight: Tensor,
    bias: Tensor,
    pad: [usize; 3],
    time_stride: usize,
    /// Rows one latent row has become at this conv's resolution: band cuts of a spatial shard
    /// fall on multiples of it (`Conv3dParams::band_aligned`).
    band_align: usize,
}

impl CausalConv3d {
    fn load(w: &mut Weights<'_>, cin: usize, cout: usize, k: [usize; 3], pad: [usize; 3]) -> Result<Self> {
        Ok(Self {
            weight: w.get("weight", &[cout, cin, k[0], k[1], k[2]])?,
            bias: w.get("bias", &[cout])?,
            pad,
            time_stride: 1,
            band_align: 1,
        })
    }

    /// The same conv at a resolution where one latent row has become `align` rows.
    fn band_aligned(mut self, align: usize) -> Self {
        self.band_align = align;
        self
    }

    fn forward(&self, x: &Tensor, cache: Option<&Tensor>) -> Result<Tensor> {
        self.forward_haloed(x, cache, None)
    }

    /// Rows each neighbour must supply along `axis` (the kernel's halo).
    fn halo(&self, axis: ShardAxis) -> usize {
        kernel_halo(&self.weight, axis)
    }

    /// [`Self::forward`] for an input (and cache) that already carries its halo rows along
    /// `halo_axis`, so that axis is not padded again.
    fn forward_haloed(&self, x: &Tensor, cache: Option<&Tensor>, halo_axis: Option<ShardAxis>) -> Result<Tensor> {
        let mut front = 2 * self.pad[0];
        let cached = match cache {
            Some(c) if front > 0 => {
                front = front.saturating_sub(c.dims()[2]);
                Some(c)
            }
            _ => None,
        };
        let [_, mut ph, mut pw] = self.pad;
        match halo_axis {
            Some(ShardAxis::Height) => ph = 0,
            Some(ShardAxis::Width) => pw = 0,
            None => {}
        }
        let params =
            Conv3dParams::new([self.time_stride, 1, 1], [front, 0, ph, ph, pw, pw]).band_aligned(self.band_align);
        // The cached frames in front of the new ones (diffusers' `torch.cat([cache_x, x], 2)`),
        // without the concatenation on CUDA.
        Ok(match cached {
            Some(c) => x.conv3d_after(c, &self.weight, Some(&self.bias), &params)?,
            None => x.conv3d(&self.weight, Some(&self.bias), &params)?,
        })
    }
}

/// One slot per causal conv (and per temporal upsample) in visit order; request-scoped.
enum Slot {
    Empty,
    /// The first chunk's marker of a temporal upsample (diffusers' `"Rep"`).
    Rep,
    Frames(Tensor),
}

/// The feature cache of one decode request.
struct FeatCache {
    slots: Vec<Slot>,
    next: usize,
}

impl FeatCache {
    fn new() -> Self {
        Self { slots: Vec::new(), next: 0 }
    }

    fn slot(&mut self) -> &mut Slot {
        if self.next == self.slots.len() {
            self.slots.push(Slot::Empty);
        }
        self.next += 1;
        &mut self.slots[self.next - 1]
    }
}

/// The last `CACHE_T` frames of `x`, with the previous cache's last frame in front when `x`
/// has fewer (diffusers' `cache_x` rule).
fn frames_to_cache(x: &Tensor, previous: Option<&Tensor>) -> Result<Tensor> {
    let t = x.dims()[2];
    let keep = t.min(CACHE_T);
    let tail = x.narrow(2, t - keep, keep)?;
    match previous {
        Some(prev) if keep < CACHE_T => {
            let last = prev.narrow(2, prev.dims()[2] - 1, 1)?;
            Ok(Tensor::cat(&[&last, &tail], 2)?)
        }
        _ => Ok(tail),
    }
}

/// The halo of a conv weight (`[Cout, Cin, (kt,) kh, kw]`) along `axis`: the kernel's spatial
/// extents are its last two dimensions, as H and W are a tensor's.
fn kernel_halo(weight: &Tensor, axis: ShardAxis) -> usize {
    axis.dim_in(weight.rank()).map_or(0, |d| halo_width(weight.dims()[d]))
}

/// This rank's band of a spatial-shard request, or `None` for the whole map.
type Band<'a, 'c> = Option<&'a mut ShardContext<'c>>;

/// A causal conv fed through the cache, as every 3×3×3 conv of the decoder is.
///
/// On a band, the conv input first gets its halo rows from the neighbours; the cache then
/// holds frames with their halos, so only the new frames' rows travel (the cached frames'
/// halos arrived with them).
fn cached_conv(conv: &CausalConv3d, x: &Tensor, cache: &mut FeatCache, band: Band<'_, '_>) -> Result<Tensor> {
    let haloed;
    let slot = cache.slot();
    let previous = match slot {
        Slot::Frames(t) => Some(&*t),
        _ => None,
    };
    let (x, axis) = match band {
        Some(ctx) => {
            let axis = ctx.axis();
            haloed = ctx.with_halo(x, conv.halo(axis))?;
            if let Some(cached) = previous {
                ctx.note_reused_halo(cached, conv.halo(axis));
            }
            (&haloed, Some(axis))
        }
        None => (x, None),
    };
    let to_cache = frames_to_cache(x, previous)?;
    let out = conv.forward_haloed(x, previous, axis)?;
    *slot = Slot::Frames(to_cache);
    Ok(out)
}

/// `WanRMS_norm`: `F.normalize` over channels · √C · γ.
struct RmsNorm {
    gamma: Tensor,
}

impl RmsNorm {
    fn load(w: &mut Weights<'_>, dim: usize, images: bool) -> Result<Self> {
        let shape: Vec<usize> = if images { vec![dim, 1, 1] } else { vec![dim, 1, 1, 1] };
        Ok(Self { gamma: w.get("gamma", &shape)? })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.rms_norm_channels(&self.gamma, None, 1, NORMALIZE_EPS)?)
    }

    /// [`Self::forward`] then SiLU, in one pass (the same values).
    fn forward_silu(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.rms_norm_channels_silu(&self.gamma, None, 1, NORMALIZE_EPS)?)
    }
}

struct ResidualBlock {
    norm1: RmsNorm,
    conv1: CausalConv3d,
    norm2: RmsNorm,
    conv2: CausalConv3d,
    shortcut: Option<CausalConv3d>,
}

impl ResidualBlock {
    /// A block at a resolution where one latent row has become `align` rows.
    fn load(w: &mut Weights<'_>, cin: usize, cout: usize, align: usize) -> Result<Self> {
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

    /// RMS norms, SiLU, residual adds and the 1×1×1 shortcut are per pixel: on a band only
    /// the two 3×3×3 convs communicate.
    fn forward(&self, x: &Tensor, cache: &mut FeatCache, mut band: Band<'_, '_>) -> Result<Tensor> {
        let h = match &self.shortcut {
            Some(s) => s.forward(x, None)?,
            None => x.clone(),
        };
        let y = self.norm1.forward_silu(x)?;
        let y = cached_conv(&self.conv1, &y, cache, band.as_deref_mut())?;
        let y = self.norm2.forward_silu(&y)?;
        let mut y = cached_conv(&self.conv2, &y, cache, band)?;
        y.add_assign(&h)?;
        Ok(y)
    }
}

/// `WanAttentionBlock`: single-head attention over each frame's H·W positions.
struct AttentionBlock {
    norm: RmsNorm,
    to_qkv: (Tensor, Tensor),
    proj: (Tensor, Tensor),
}

impl AttentionBlock {
    fn load(w: &mut Weights<'_>, dim: usize) -> Result<Self> {
        let mut qkv = w.pp("to_qkv");
        let to_qkv = (qkv.get("weight", &[3 * dim, dim, 1, 1])?, qkv.get("bias", &[3 * dim])?);
        let mut p = w.pp("proj");
        let proj = (p.get("weight", &[dim, dim, 1, 1])?, p.get("bias", &[dim])?);
        Ok(Self { norm: RmsNorm::load(&mut w.pp("norm"), dim, true)?, to_qkv, proj })
    }

    /// On a band, attention needs every position of the frame: the whole map is gathered,
    /// attended (the same computation on every rank) and this rank keeps its band.
    fn forward_on(&self, x: &Tensor, band: Band<'_, '_>) -> Result<Tensor> {
        match band {
            None => self.forward(x),
            Some(ctx) => {
                let full = ctx.all_gather_map(x)?;
                Ok(ctx.own_band(&self.forward(&full)?)?)
            }
        }
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let d = x.dims().to_vec();
        let (b, c, t, h, w) = (d[0], d[1], d[2], d[3], d[4]);
        let frames = x.permute(&[0, 2, 1, 3, 4])?.reshape(vec![b * t, c, h, w])?;
        let normed = self.norm.forward(&frames)?;
        let one = Conv2dParams::same(1);
        let qkv = normed.conv2d(&self.to_qkv.0, Some(&self.to_qkv.1), &one)?;
        let qkv = qkv.reshape(vec![b * t, 3 * c, h * w])?.transpose(1, 2)?;
        let (q, k, v) = (qkv.narrow(2, 0, c)?, qkv.narrow(2, c, c)?, qkv.narrow(2, 2 * c, c)?);
        let attended = Tensor::attention(&q, &k, &v)?.transpose(1, 2)?.reshape(vec![b * t, c, h, w])?;
        let out = attended.conv2d(&self.proj.0, Some(&self.proj.1), &one)?;
        let mut out = out.reshape(vec![b, t, c, h, w])?.permute(&[0, 2, 1, 3, 4])?;
        out.add_assign(x)?;
        Ok(out)
    }
}

/// `WanResample` in the decoder's two modes.
struct Upsample {
    conv: (Tensor, Tensor),
    time_conv: Option<CausalConv3d>,
    /// Rows one latent row has become after the upsampling (see `CausalConv3d::band_align`).
    band_align: usize,
}

impl Upsample {
    /// `out_dim`: `dim / 2` in Wan2.1's up blocks, `dim` in Wan2.2's residual ones; `align`:
    /// rows one latent row has become after the upsampling.
    fn load(w: &mut Weights<'_>, dim: usize, out_dim: usize, temporal: bool, align: usize) -> Result<Self> {
        let mut conv = w.pp("resample.1");
        let conv = (conv.get("weight", &[out_dim, dim, 3, 3])?, conv.get("bias", &[out_dim])?);
        let time_conv = if temporal {
            Some(CausalConv3d::load(&mut w.pp("time_conv"), dim, 2 * dim, [3, 1, 1], [1, 0, 0])?)
        } else {
            None
        };
        Ok(Self { conv, time_conv, band_align: align })
    }

    /// Rows of each neighbour the 3×3 resample conv needs.
    fn halo(&self, axis: ShardAxis) -> usize {
        kernel_halo(&self.conv.0, axis)
    }

    /// The time conv (3×1×1) and the nearest upsample are local on a band (the band doubles);
    /// only the 3×3 resample conv takes halo rows.
    fn forward(&self, x: &Tensor, cache: &mut FeatCache, band: Band<'_, '_>) -> Result<Tensor> {
        let mut x = x.clone();
        if let Some(time_conv) = &self.time_conv {
            let slot = cache.slot();
            match slot {
                // The first chunk: no temporal upsampling, only the marker.
                Slot::Empty => *slot = Slot::Rep,
                Slot::Rep | Slot::Frames(_) => {
                    let d = x.dims().to_vec();
                    let (b, c, t, h, w) = (d[0], d[1], d[2], d[3], d[4]);
                    let keep = t.min(CACHE_T);
                    let mut to_cache = x.narrow(2, t - keep, keep)?;
                    let out = match slot {
                        Slot::Frames(prev) => {
                            if keep < CACHE_T {
                                let last = prev.narrow(2, prev.dims()[2] - 1, 1)?;
                                to_cache = Tensor::cat(&[&last, &to_cache], 2)?;
                            }
                            time_conv.forward(&x, Some(prev))?
                        }
                        _ => {
                            if keep < CACHE_T {
                                let zeros =
                                    Tensor::zeros(to_cache.dims().to_vec(), to_cache.dtype(), &to_cache.device())?;
                                to_cache = Tensor::cat(&[&zeros, &to_cache], 2)?;
                            }
                            time_conv.forward(&x, None)?
                        }
                    };
                    *slot = Slot::Frames(to_cache);
                    // [b, 2c, t, h, w] → [b, 2, c, t, h, w] → frames interleaved → [b, c, 2t, h, w]
                    x = out.reshape(vec![b, 2, c, t, h, w])?.permute(&[0, 2, 3, 1, 4, 5])?.reshape(vec![
                        b,
                        c,
                        2 * t,
                        h,
                        w,
                    ])?;
                }
            }
        }
        let d = x.dims().to_vec();
        let (b, c, t, h, w) = (d[0], d[1], d[2], d[3], d[4]);
        let frames = x.permute(&[0, 2, 1, 3, 4])?.reshape(vec![b * t, c, h, w])?;
        // nearest-exact with an integer factor is plain nearest.
        let upsampled = frames.upsample_nearest2d(2)?;
        let k = self.conv.0.dims()[2];
        let same = Conv2dParams::same(k).band_aligned(self.band_align);
        let up = match band {
            None => upsampled.conv2d(&self.conv.0, Some(&self.conv.1), &same)?,
            Some(ctx) => {
                let axis = ctx.axis();
                let haloed = ctx.with_halo(&upsampled, self.halo(axis))?;
                let [top, bottom, left, right] = same.padding;
                let padding = match axis {
                    ShardAxis::Height => [0, 0, left, right],
                    ShardAxis::Width => [top, bottom, 0, 0],
                };
                let params = Conv2dParams::new(1, padding).band_aligned(self.band_align);
                haloed.conv2d(&self.conv.0, Some(&self.conv.1), &params)?
            }
        };
        let co = up.dims()[1];
        Ok(up.reshape(vec![b, t, co, 2 * h, 2 * w])?.permute(&[0, 2, 1, 3, 4])?)
    }
}

/// `WanResample` in the encoder's two modes: a per-frame stride-2 conv after padding right and
/// bottom, and for `downsample3d` a stride-2 time conv over the cached last frame and the chunk.
struct Downsample {
    conv: (Tensor, Tensor),
    time_conv: Option<CausalConv3d>,
}

impl Downsample {
    fn load(w: &mut Weights<'_>, dim: usize, temporal: bool) -> Result<Self> {
        let mut conv = w.pp("resample.1");
        let conv = (conv.get("weight", &[dim, dim, 3, 3])?, conv.get("bias", &[dim])?);
        let time_conv = if temporal {
            let mut t = CausalConv3d::load(&mut w.pp("time_conv"), dim, dim, [3, 1, 1], [0, 0, 0])?;
            t.time_stride = 2;
            Some(t)
        } else {
            None
        };
        Ok(Self { conv, time_conv })
    }

    fn forward(&self, x: &Tensor, cache: &mut FeatCache) -> Result<Tensor> {
        let d = x.dims().to_vec();
        let (b, c, t, h, w) = (d[0], d[1], d[2], d[3], d[4]);
        let frames = x.permute(&[0, 2, 1, 3, 4])?.reshape(vec![b * t, c, h, w])?;
        let down = frames.conv2d(&self.conv.0, Some(&self.conv.1), &Conv2dParams::diffusers_downsample())?;
        let (co, ho, wo) = (down.dims()[1], down.dims()[2], down.dims()[3]);
        let x = down.reshape(vec![b, t, co, ho, wo])?.permute(&[0, 2, 1, 3, 4])?;
        let Some(time_conv) = &self.time_conv else { return Ok(x) };
        let slot = cache.slot();
        match slot {
            // The first chunk only fills the cache; time is not halved yet.
            Slot::Empty | Slot::Rep => {
                *slot = Slot::Frames(x.clone());
                Ok(x)
            }
            Slot::Frames(prev) => {
                let last = prev.narrow(2, prev.dims()[2] - 1, 1)?;
                let to_cache = x.narrow(2, x.dims()[2] - 1, 1)?;
                let out = time_conv.forward(&Tensor::cat(&[&last, &x], 2)?, None)?;
                *slot = Slot::Frames(to_cache);
                Ok(out)
            }
        }
    }
}

/// Wan2.2's `WanResidualDownBlock`: residual blocks and a resample, plus an `AvgDown3D` of
/// the block input as a shortcut.
struct ResidualDownBlock {
    resnets: Vec<ResidualBlock>,
    downsample: Option<Downsample>,
    /// `(factor_t, factor_s, out_dim)` of the AvgDown3D shortcut.
    avg: (usize, usize, usize),
}

impl ResidualDownBlock {
    fn forward(&self, x: &Tensor, cache: &mut FeatCache) -> Result<Tensor> {
        let (factor_t, factor_s, out_dim) = self.avg;
        let shortcut = x.avg_down3d(factor_t, factor_s, out_dim)?;
        let mut x = x.clone();
        for resnet in &self.resnets {
            x = resnet.forward(&x, cache, None)?;
        }
        if let Some(down) = &self.downsample {
            x = down.forward(&x, cache)?;
        }
        x.add_assign(&shortcut)?;
        Ok(x)
    }
}

/// One entry of the encoder's `down_blocks` list (boxed: the kinds differ in size).
enum DownLayer {
    Residual(Box<ResidualBlock>),
    Downsample(Box<Downsample>),
    ResidualDown(Box<ResidualDownBlock>),
}

/// `WanEncoder3d` (non-residual, Wan2.1 / Qwen-Image): image frames → moments.
struct Encoder {
    conv_in: CausalConv3d,
    layers: Vec<DownLayer>,
    mid_resnets: [ResidualBlock; 2],
    mid_attention: AttentionBlock,
    norm_out: RmsNorm,
    conv_out: CausalConv3d,
}

impl Encoder {
    fn load(w: &mut Weights<'_>, c: &WanConfig) -> Result<Self> {
        let dims: Vec<usize> = std::iter::once(1).chain(c.dim_mult.iter().copied()).map(|u| c.base_dim * u).collect();
        let levels = c.dim_mult.len();
        // Rows one latent row spans at each level (the alignment of band cuts there).
        let mut align = 1usize << levels.saturating_sub(1);
        let conv_in =
            CausalConv3d::load(&mut w.pp("conv_in"), c.in_channels, dims[0], [3, 3, 3], [1, 1, 1])?.band_aligned(align);
        let mut layers = Vec::new();
        for i in 0..levels {
            let (mut in_dim, out_dim) = (dims[i], dims[i + 1]);
            let down_flag = i != levels - 1;
            let temporal = down_flag && *c.temperal_downsample.get(i).unwrap_or(&false);
            if c.is_residual {
                let mut block = w.pp(format!("down_blocks.{i}"));
                let mut resnets = Vec::new();
                let mut current = in_dim;
                for j in 0..c.num_res_blocks {
                    resnets.push(ResidualBlock::load(&mut block.pp("resnets").pp(j), current, out_dim, align)?);
                    current = out_dim;
                }
                if down_flag {
                    align = (align / 2).max(1);
                }
                let downsample = if down_flag {
                    Some(Downsample::load(&mut block.pp("downsampler"), out_dim, temporal)?)
                } else {
                    None
                };
                let avg = (if temporal { 2 } else { 1 }, if down_flag { 2 } else { 1 }, out_dim);
                layers.push(DownLayer::ResidualDown(Box::new(ResidualDownBlock { resnets, downsample, avg })));
                continue;
            }
            for _ in 0..c.num_res_blocks {
                let k = layers.len();
                let block = ResidualBlock::load(&mut w.pp(format!("down_blocks.{k}")), in_dim, out_dim, align)?;
                layers.push(DownLayer::Residual(Box::new(block)));
                in_dim = out_dim;
            }
            if down_flag {
                align = (align / 2).max(1);
                let k = layers.len();
                let down = Downsample::load(&mut w.pp(format!("down_blocks.{k}")), out_dim, temporal)?;
                layers.push(DownLayer::Downsample(Box::new(down)));
            }
        }
        let top = *dims.last().expect("non-empty");
        let mut mid = w.pp("mid_block");
        let mid_resnets = [
            ResidualBlock::load(&mut mid.pp("resnets").pp(0), top, top, 1)?,
            ResidualBlock::load(&mut mid.pp("resnets").pp(1), top, top, 1)?,
        ];
        let mid_attention = AttentionBlock::load(&mut mid.pp("attentions").pp(0), top)?;
        Ok(Self {
            conv_in,
            layers,
            mid_resnets,
            mid_attention,
            norm_out: RmsNorm::load(&mut w.pp("norm_out"), top, false)?,
            conv_out: CausalConv3d::load(&mut w.pp("conv_out"), top, 2 * c.z_dim, [3, 3, 3], [1, 1, 1])?,
        })
    }

    fn forward(&self, x: &Tensor, cache: &mut FeatCache) -> Result<Tensor> {
        let mut x = cached_conv(&self.conv_in, x, cache, None)?;
        for layer in &self.layers {
            x = match layer {
                DownLayer::Residual(r) => r.forward(&x, cache, None)?,
                DownLayer::Downsample(d) => d.forward(&x, cache)?,
                DownLayer::ResidualDown(d) => d.forward(&x, cache)?,
            };
        }
        let x = self.mid_resnets[0].forward(&x, cache, None)?;
        let x = self.mid_attention.forward(&x)?;
        let x = self.mid_resnets[1].forward(&x, cache, None)?;
        let x = self.norm_out.forward_silu(&x)?;
        cached_conv(&self.conv_out, &x, cache, None)
    }
}

struct UpBlock {
    resnets: Vec<ResidualBlock>,
    upsample: Option<Upsample>,
    /// Wan2.2's residual up blocks add `DupUp3D(x)` of the block input: `(factor_t, out_dim)`.
    dup_shortcut: Option<(usize, usize)>,
}

/// `WanDecoder3d` (non-residual, Wan2.1).
struct Decoder {
    conv_in: CausalConv3d,
    mid_resnets: [ResidualBlock; 2],
    mid_attention: AttentionBlock,
    up_blocks: Vec<UpBlock>,
    norm_out: RmsNorm,
    conv_out: CausalConv3d,
}

impl Decoder {
    fn load(w: &mut Weights<'_>, c: &WanConfig) -> Result<Self> {
        let dim = c.decoder_base_dim.unwrap_or(c.base_dim);
        let mult = &c.dim_mult;
        let last = *mult.last().ok_or_else(|| ModelError::InvalidInput("dim_mult is empty".into()))?;
        let dims: Vec<usize> = std::iter::once(last).chain(mult.iter().rev().copied()).map(|u| dim * u).collect();
        let up_temporal: Vec<bool> = c.temperal_downsample.iter().rev().copied().collect();
        let conv_in = CausalConv3d::load(&mut w.pp("conv_in"), c.z_dim, dims[0], [3, 3, 3], [1, 1, 1])?;
        let mut mid = w.pp("mid_block");
        let mid_resnets = [
            ResidualBlock::load(&mut mid.pp("resnets").pp(0), dims[0], dims[0], 1)?,
            ResidualBlock::load(&mut mid.pp("resnets").pp(1), dims[0], dims[0], 1)?,
        ];
        let mid_attention = AttentionBlock::load(&mut mid.pp("attentions").pp(0), dims[0])?;
        let mut up_blocks = Vec::new();
        // Rows one latent row spans at each level (the alignment of band cuts there).
        let mut align = 1;
        for i in 0..mult.len() {
            let (mut in_dim, out_dim) = (dims[i], dims[i + 1]);
            if i > 0 && !c.is_residual {
                in_dim /= 2;
            }
            let mut block = w.pp(format!("up_blocks.{i}"));
            let mut resnets = Vec::new();
            let mut current = in_dim;
            for j in 0..=c.num_res_blocks {
                resnets.push(ResidualBlock::load(&mut block.pp("resnets").pp(j), current, out_dim, align)?);
                current = out_dim;
            }
            let up_flag = i != mult.len() - 1;
            if up_flag {
                align *= 2;
            }
            let temporal = up_flag && *up_temporal.get(i).unwrap_or(&false);
            let (upsample, dup_shortcut) = match (up_flag, c.is_residual) {
                (false, _) => (None, None),
                (true, false) => {
                    let up = Upsample::load(&mut block.pp("upsamplers").pp(0), out_dim, out_dim / 2, temporal, align)?;
                    (Some(up), None)
                }
                (true, true) => (
                    Some(Upsample::load(&mut block.pp("upsampler"), out_dim, out_dim, temporal, align)?),
                    Some((if temporal { 2 } else { 1 }, out_dim)),
                ),
            };
            up_blocks.push(UpBlock { resnets, upsample, dup_shortcut });
        }
        let out_dim = *dims.last().expect("non-empty");
        Ok(Self {
            conv_in,
            mid_resnets,
            mid_attention,
            up_blocks,
            norm_out: RmsNorm::load(&mut w.pp("norm_out"), out_dim, false)?,
            conv_out: CausalConv3d::load(&mut w.pp("conv_out"), out_dim, c.out_channels, [3, 3, 3], [1, 1, 1])?
                .band_aligned(align),
        })
    }

    /// One latent frame (chunk) through the decoder, on the whole map or on this rank's band.
    fn forward(&self, x: &Tensor, cache: &mut FeatCache, first_chunk: bool, mut band: Band<'_, '_>) -> Result<Tensor> {
        let x = cached_conv(&self.conv_in, x, cache, band.as_deref_mut())?;
        let x = self.mid_resnets[0].forward(&x, cache, band.as_deref_mut())?;
        let x = self.mid_attention.forward_on(&x, band.as_deref_mut())?;
        let mut x = self.mid_resnets[1].forward(&x, cache, band.as_deref_mut())?;
        for block in &self.up_blocks {
            // DupUp3D moves channels into a 2×2 pixel block: per pixel, so local on a band.
            let input = block.dup_shortcut.map(|_| x.clone());
            for resnet in &block.resnets {
                x = resnet.forward(&x, cache, band.as_deref_mut())?;
            }
            if let Some(up) = &block.upsample {
                x = up.forward(&x, cache, band.as_deref_mut())?;
            }
            if let (Some((factor_t, out_dim)), Some(input)) = (block.dup_shortcut, input) {
                x.add_assign(&input.dup_up3d(factor_t, 2, out_dim, first_chunk)?)?;
            }
        }
        let x = self.norm_out.forward_silu(&x)?;
        cached_conv(&self.conv_out, &x, cache, band)
    }

    /// The widest halo any conv of the decoder needs, in rows of its own input. Every layer
    /// runs at the latent's resolution or a multiple of it, so a latent band this wide covers
    /// every halo.
    fn widest_halo(&self, axis: ShardAxis) -> usize {
        let resnet_convs = |r: &ResidualBlock| [r.conv1.halo(axis), r.conv2.halo(axis)];
        let mut widest = self.conv_in.halo(axis).max(self.conv_out.halo(axis));
        for r in self.mid_resnets.iter().chain(self.up_blocks.iter().flat_map(|b| &b.resnets)) {
            widest = resnet_convs(r).into_iter().fold(widest, usize::max);
        }
        for up in self.up_blocks.iter().filter_map(|b| b.upsample.as_ref()) {
            widest = widest.max(up.halo(axis));
        }
        widest
    }
}

/// The two diffusers classes this module loads; they share the decoder and differ in policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VideoVaeClass {
    /// `AutoencoderKLWan`: clamps to [-1, 1] after plain and tiled decode.
    Wan,
    /// `AutoencoderKLQwenImage`: clamps after plain decode only (its `tiled_decode` does not).
    QwenImage,
}

/// A loaded Wan2.1-style (or Qwen-Image) VAE, decode side.
pub struct WanVae {
    class: VideoVaeClass,
    /// Where the weights live and the decoder and encoder compute.
    device: Device,
    /// The element type the decoder and encoder compute in.
    dtype: DType,
    config: WanConfig,
    post_quant_conv: CausalConv3d,
    decoder: Decoder,
    quant_conv: CausalConv3d,
    encoder: Encoder,
    tiling: WanTiling,
}

impl WanVae {
    /// Loads a diffusers `AutoencoderKLWan` or `AutoencoderKLQwenImage` directory (every
    /// weight must be used), onto the CPU.
    pub fn load(dir: &Path) -> Result<Self> {
        Self::load_on(dir, Device::Cpu)
    }

    /// [`Self::load`] with the weights on `device`: the encoder and decoder then compute there,
    /// while inputs, outputs, tiles and bands stay on the host (each computation uploads its
    /// input and downloads its result), so nothing above the model changes.
    pub fn load_on(dir: &Path, device: Device) -> Result<Self> {
        Self::load_with(dir, device, DType::F32)
    }

    /// [`Self::load_on`] computing in `dtype` (`vae.to(dtype)`): f32 anywhere, bf16 on CUDA.
    /// Inputs are cast to `dtype` on upload (as pipelines cast latents to the VAE's dtype) and
    /// results come back as f32 holding the `dtype` values.
    pub fn load_with(dir: &Path, device: Device, dtype: DType) -> Result<Self> {
        check_precision(device, dtype)?;
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| ModelError::Io { path: path.clone(), source })?;
        let config: WanConfig = serde_json::from_str(&text)
            .map_err(|e| ModelError::Config { path: path.clone(), message: e.to_string() })?;
        let value: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| ModelError::Config { path: path.clone(), message: e.to_string() })?;
        let class = match value.get("_class_name").and_then(|v| v.as_str()) {
            Some("AutoencoderKLWan") | None => VideoVaeClass::Wan,
            Some("AutoencoderKLQwenImage") => VideoVaeClass::QwenImage,
            Some(other) => {
                return Err(ModelError::Config {
                    path,
                    message: format!("_class_name {other:?} is not AutoencoderKLWan or AutoencoderKLQwenImage"),
                });
            }
        };
        if !config.attn_scales.is_empty() {
            return Err(ModelError::Unsupported("Wan VAEs with attention scales are not implemented yet".into()));
        }
        let mut store = WeightStore::open_dir(dir)?;
        store.set_device(device);
        store.set_dtype(dtype);
        let mut w = Weights::new(&mut store);
        let z = config.z_dim;
        let post_quant_conv = CausalConv3d::load(&mut w.pp("post_quant_conv"), z, z, [1, 1, 1], [0, 0, 0])?;
        let decoder = Decoder::load(&mut w.pp("decoder"), &config)?;
        let quant_conv = CausalConv3d::load(&mut w.pp("quant_conv"), 2 * z, 2 * z, [1, 1, 1], [0, 0, 0])?;
        let encoder = Encoder::load(&mut w.pp("encoder"), &config)?;
        drop(w);
        store.finish()?;
        let ratio = config.scale_factor_spatial.unwrap_or(8);
        let patch = config.patch_size.filter(|p| *p > 1);
        Ok(Self {
            class,
            device,
            dtype,
            config,
            post_quant_conv,
            decoder,
            quant_conv,
            encoder,
            tiling: WanTiling::new(ratio, patch),
        })
    }

    /// The tile geometry (diffusers' defaults: 256-pixel tiles every 192 pixels).
    pub fn tiling(&self) -> &WanTiling {
        &self.tiling
    }

    /// Sets the tile geometry as diffusers' `enable_tiling(min_h, min_w, stride_h, stride_w)`.
    pub fn set_tiling(&mut self, min: [usize; 2], stride: [usize; 2]) -> Result<()> {
        if min.contains(&0) || stride.contains(&0) {
            return Err(ModelError::InvalidInput(format!(
                "tile sizes and strides must be positive, got {min:?} / {stride:?}"
            )));
        }
        // Like diffusers, geometry that cannot tile one direction (a latent stride of 0 for
        // decode, say) is only an error when that path is used: the split reports it.
        self.tiling.tile_sample_min_height = min[0];
        self.tiling.tile_sample_min_width = min[1];
        self.tiling.tile_sample_stride_height = stride[0];
        self.tiling.tile_sample_stride_width = stride[1];
        Ok(())
    }

    /// The configuration.
    pub fn config(&self) -> &WanConfig {
        &self.config
    }

    /// Where the model computes.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The element type the model computes in.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Which diffusers class was loaded.
    pub fn class(&self) -> VideoVaeClass {
        self.class
    }

    /// `vae.decode(z).sample` without tiling: `post_quant_conv`, then one latent frame per
    /// decoder call with the causal cache, then clamp to [-1, 1].
    pub fn decode(&self, z: &Tensor) -> Result<Tensor> {
        self.check_latent(z)?;
        self.finish_decode(self.decode_frames(z)?, true)
    }

    /// After the decoder (and, when tiled, the merge): unpatchify (Wan2.2), then clamp.
    fn finish_decode(&self, x: Tensor, clamp: bool) -> Result<Tensor> {
        let x = match self.config.patch_size.filter(|p| *p > 1) {
            Some(p) => x.unpatchify(p)?,
            None => x,
        };
        Ok(if clamp { x.clamp(-1.0, 1.0)? } else { x })
    }

    /// `vae._encode(x)` without tiling: the encoder on frame 0, then on chunks of 4 frames
    /// with the causal cache (frames past the last whole chunk are dropped, as diffusers
    /// does), then `quant_conv`: the moments `[B, 2·z_dim, 1 + (T-1)/4, H/8, W/8]`.
    pub fn encode_moments(&self, x: &Tensor) -> Result<Tensor> {
        self.check_video(x)?;
        self.encode_frames(&self.patchify_input(x)?)
    }

    /// Wan2.2's encoder works on 2×2-patchified frames (diffusers patchifies before encoding).
    fn patchify_input(&self, x: &Tensor) -> Result<Tensor> {
        match self.patch() {
            1 => Ok(x.clone()),
            p => Ok(x.patchify(p)?),
        }
    }

    fn patch(&self) -> usize {
        self.config.patch_size.filter(|p| *p > 1).unwrap_or(1)
    }

    fn check_video(&self, x: &Tensor) -> Result<()> {
        // Wan2.2's encoder sees patchified frames; callers pass RGB.
        let patch = self.patch();
        let channels = self.config.in_channels / (patch * patch);
        let d = x.dims();
        if d.len() != 5 || d[1] != channels || d.contains(&0) {
            return Err(ModelError::InvalidInput(format!("video must be [B, {channels}, T, H, W], got {:?}", d)));
        }
        // diffusers encodes frame 0, then chunks of 4, and silently drops a partial chunk;
        // refusing is kinder than losing frames.
        if !(d[2] - 1).is_multiple_of(4) {
            let below = 1 + (d[2] - 1) / 4 * 4;
            return Err(ModelError::InvalidInput(format!(
                "video has {} frames; the encoder takes 1 + 4k frames (e.g. {below} or {})",
                d[2],
                below + 4
            )));
        }
        if !d[3].is_multiple_of(patch) || !d[4].is_multiple_of(patch) {
            return Err(ModelError::InvalidInput(format!(
                "video of {}x{} pixels is not a multiple of the patch size {patch}",
                d[3], d[4]
            )));
        }
        Ok(())
    }

    /// The chunked causal encode of one (tile of a) video with a fresh cache, then `quant_conv`.
    fn encode_frames(&self, x: &Tensor) -> Result<Tensor> {
        let mut uploaded = None;
        let x = on_device(x, self.device, self.dtype, &mut uploaded)?;
        let encoder = &self.encoder;
        let d = x.dims();
        let chunks = 1 + (d[2] - 1) / 4;
        let mut cache = FeatCache::new();
        let mut outs = Vec::with_capacity(chunks);
        for i in 0..chunks {
            cache.next = 0;
            let (start, len) = if i == 0 { (0, 1) } else { (1 + 4 * (i - 1), 4) };
            outs.push(encoder.forward(&x.narrow(2, start, len)?, &mut cache)?);
            progress::report(Progress::Steps { done: i + 1, total: chunks });
        }
        let refs: Vec<&Tensor> = outs.iter().collect();
        to_host(self.quant_conv.forward(&Tensor::cat(&refs, 2)?, None)?)
    }

    /// Every parallel mode is available: the decoder's norms are per-pixel RMS norms, so a
    /// band needs no statistics from the others (encode runs as tiles in every mode).
    pub fn check_mode(&self, _mode: ParallelMode) -> Result<()> {
        Ok(())
    }

    /// This family's decode policy for one request of a `latent_dims` latent over `ranks`
    /// ranks. Deterministic and free of side effects, from global quantities only, so every
    /// rank decides alike.
    ///
    /// - `tile`: tiles.
    /// - `spatial_shard_height` / `_width`: that axis whenever every rank gets a band at
    ///   least as wide as the decoder's widest halo (at any latent size: the shard decode is
    ///   the exact direct decode); otherwise tile, flagged as a fallback. Never the other axis.
    /// - `auto`: with two ranks or more, the longer latent axis that can give every rank a
    ///   band (width on ties); tile when neither can.
    pub fn decode_strategy(&self, mode: ParallelMode, latent_dims: &[usize], ranks: usize) -> StrategyChoice {
        let extent = |axis: ShardAxis| axis.dim_in(latent_dims.len()).map(|d| latent_dims[d]).unwrap_or(0);
        let fits = |axis: ShardAxis| {
            latent_dims.len() == 5 && BandPartition::fits(extent(axis), ranks, self.decoder.widest_halo(axis))
        };
        let why_not = |axis: ShardAxis| {
            format!(
                "a latent {axis} of {} cannot give {ranks} rank(s) a band of at least {} row(s)",
                extent(axis),
                self.decoder.widest_halo(axis).max(1)
            )
        };
        match mode {
            ParallelMode::Tile => StrategyChoice::chosen(Strategy::Tile, "tile mode"),
            ParallelMode::SpatialShardHeight | ParallelMode::SpatialShardWidth => {
                let axis = if mode == ParallelMode::SpatialShardHeight { ShardAxis::Height } else { ShardAxis::Width };
                if latent_dims.len() != 5 || fits(axis) {
                    // A malformed latent goes to the shard path, whose input check names it.
                    StrategyChoice::chosen(Strategy::Shard(axis), format!("{mode} requested"))
                } else {
                    StrategyChoice::fallback_to_tile(format!("{mode}: {}; decoding with tiles", why_not(axis)))
                }
            }
            ParallelMode::Auto => {
                if ranks < 2 {
                    return StrategyChoice::chosen(Strategy::Tile, "auto: one rank, nothing to shard");
                }
                if latent_dims.len() != 5 {
                    return StrategyChoice::chosen(Strategy::Tile, "auto: not a video latent");
                }
                let (h, w) = (extent(ShardAxis::Height), extent(ShardAxis::Width));
                let axis = match (fits(ShardAxis::Height), fits(ShardAxis::Width)) {
                    (true, true) if h > w => ShardAxis::Height,
                    (true, true) | (false, true) => ShardAxis::Width,
                    (true, false) => ShardAxis::Height,
                    (false, false) => {
                        return StrategyChoice::chosen(
                            Strategy::Tile,
                            format!("auto: {} and {}; tiles", why_not(ShardAxis::Height), why_not(ShardAxis::Width)),
                        );
                    }
                };
                let why = if fits(ShardAxis::Height) && fits(ShardAxis::Width) {
                    if h == w { "width on a tie".to_string() } else { format!("the longer axis of {h}x{w}") }
                } else {
                    format!("the only axis that fits {ranks} ranks")
                };
                StrategyChoice::chosen(Strategy::Shard(axis), format!("auto: {axis}, {why}"))
            }
        }
    }

    /// This family's encode policy: tiles in every mode (spatial shard is decode-only, as in
    /// the reference); a forced shard mode is flagged as a fallback.
    pub fn encode_strategy(&self, mode: ParallelMode) -> StrategyChoice {
        match mode {
            ParallelMode::Tile => StrategyChoice::chosen(Strategy::Tile, "tile mode"),
            ParallelMode::Auto => StrategyChoice::chosen(Strategy::Tile, "auto: encode runs as tiles"),
            shard => {
                StrategyChoice::fallback_to_tile(format!("{shard}: spatial shard is decode-only; encoding with tiles"))
            }
        }
    }

    /// Latents as WanPipeline / QwenImagePipeline produce them → latents the VAE decodes:
    /// `z / (1 / latents_std) + latents_mean` per channel, op by op as the pipelines compute it.
    pub fn denormalize_latents(&self, z: &Tensor) -> Result<Tensor> {
        self.check_latent(z)?;
        let (mean, inv_std) = self.latent_stats()?;
        let zeros = vec![0.0; mean.len()];
        let ones = vec![1.0; mean.len()];
        Ok(z.channel_normalize(&zeros, &inv_std)?.channel_affine(&ones, &mean)?)
    }

    /// The inverse for encoded means: `(mean - latents_mean) * (1 / latents_std)`.
    pub fn normalize_latents(&self, mean_latent: &Tensor) -> Result<Tensor> {
        self.check_latent(mean_latent)?;
        let (mean, inv_std) = self.latent_stats()?;
        let zeros = vec![0.0; mean.len()];
        let ones = vec![1.0; mean.len()];
        Ok(mean_latent.channel_normalize(&mean, &ones)?.channel_affine(&inv_std, &zeros)?)
    }

    /// `(latents_mean, 1 / latents_std)` in f32, as the pipelines build them.
    fn latent_stats(&self) -> Result<(Vec<f32>, Vec<f32>)> {
        let c = &self.config;
        if c.latents_mean.len() != c.z_dim || c.latents_std.len() != c.z_dim {
            return Err(ModelError::InvalidInput(format!(
                "latents_mean / latents_std have {} / {} entries for z_dim {}",
                c.latents_mean.len(),
                c.latents_std.len(),
                c.z_dim
            )));
        }
        let mean = c.latents_mean.iter().map(|v| *v as f32).collect();
        let inv_std = c.latents_std.iter().map(|v| 1.0 / *v as f32).collect();
        Ok((mean, inv_std))
    }

    fn check_latent(&self, z: &Tensor) -> Result<()> {
        let d = z.dims();
        if d.len() != 5 || d[1] != self.config.z_dim || d.contains(&0) {
            return Err(ModelError::InvalidInput(format!(
                "Wan latent must be [B, {}, T, H, W], got {:?}",
                self.config.z_dim, d
            )));
        }
        Ok(())
    }

    /// The per-frame causal decode with a fresh cache, unclamped (a tile of `tiled_decode`).
    fn decode_frames(&self, z: &Tensor) -> Result<Tensor> {
        self.decode_frames_on(z, None)
    }

    /// [`Self::decode_frames`] of the whole latent, or of this rank's band of it (`z` is then
    /// the band; the result is the output's band).
    fn decode_frames_on(&self, z: &Tensor, mut band: Band<'_, '_>) -> Result<Tensor> {
        let mut uploaded = None;
        let z = on_device(z, self.device, self.dtype, &mut uploaded)?;
        let d = z.dims();
        // 1×1×1: per pixel, local on a band.
        let x = self.post_quant_conv.forward(z, None)?;
        let mut cache = FeatCache::new();
        let mut frames = Vec::with_capacity(d[2]);
        for i in 0..d[2] {
            cache.next = 0;
            frames.push(self.decoder.forward(&x.narrow(2, i, 1)?, &mut cache, i == 0, band.as_deref_mut())?);
            progress::report(Progress::Steps { done: i + 1, total: d[2] });
        }
        let refs: Vec<&Tensor> = frames.iter().collect();
        to_host(Tensor::cat(&refs, 2)?)
    }
}

/// Wan decode for the executor: diffusers' `tiled_decode` cut into split / exec / merge (each
/// tile decoded frame by frame with its own cache; blend and crop in H and W; clamp after), or
/// the plain decode as one tile when the latent is not larger than a tile.
pub struct WanDecodeOperator<'m> {
    model: &'m WanVae,
    use_tiling: bool,
}

impl<'m> WanDecodeOperator<'m> {
    /// An operator that tiles as `enable_tiling()` does when `use_tiling`.
    pub fn new(model: &'m WanVae, use_tiling: bool) -> Self {
        Self { model, use_tiling }
    }
}

impl TileOperator for WanDecodeOperator<'_> {
    type Payload = [Range<usize>; 2];
    type TileSpec = Option<StitchSpec>;

    fn split(&self, z: &Tensor) -> std::result::Result<TilePlan<Self::Payload, Self::TileSpec>, OperatorError> {
        self.model.check_latent(z)?;
        let (h, w) = (z.dims()[3], z.dims()[4]);
        let tiling = self.model.tiling();
        if !(self.use_tiling && tiling.needs_tiling_decode(h, w)?) {
            return Ok(untiled_plan([3, 4], [h, w]));
        }
        Ok(tiled_plan([3, 4], &tiling.decode_layout(h, w)?))
    }

    fn exec(&self, z: &Tensor, task: &TileTask<Self::Payload>) -> std::result::Result<Tensor, OperatorError> {
        let [rows, cols] = &task.payload;
        let tile = z.narrow(3, rows.start, rows.len())?.narrow(4, cols.start, cols.len())?;
        Ok(self.model.decode_frames(&tile)?)
    }

    fn merge(
        &self,
        tiles: TileMap,
        grid: &GridSpec<Self::TileSpec, DType>,
    ) -> std::result::Result<Tensor, OperatorError> {
        // diffusers' Qwen-Image tiled_decode does not clamp; Wan's and every plain decode do.
        let clamp = grid.tile_spec.is_none() || self.model.class == VideoVaeClass::Wan;
        let merged = merge_plan(tiles, grid)?;
        Ok(self.model.finish_decode(merged, clamp)?)
    }

    fn device(&self) -> Device {
        self.model.device()
    }
}

/// Wan / Qwen-Image encode for the executor: diffusers' `tiled_encode` cut into split / exec /
/// merge (each pixel tile encoded chunk by chunk with its own cache, blended and cropped in
/// latent H and W, cropped to the latent size), or the plain encode as one tile when the video
/// is not larger than a tile. The output is the raw moments.
pub struct WanEncodeOperator<'m> {
    model: &'m WanVae,
    use_tiling: bool,
}

impl<'m> WanEncodeOperator<'m> {
    /// An operator that tiles as `enable_tiling()` does when `use_tiling`.
    pub fn new(model: &'m WanVae, use_tiling: bool) -> Self {
        Self { model, use_tiling }
    }
}

impl TileOperator for WanEncodeOperator<'_> {
    type Payload = [Range<usize>; 2];
    type TileSpec = Option<StitchSpec>;

    fn split(&self, x: &Tensor) -> std::result::Result<TilePlan<Self::Payload, Self::TileSpec>, OperatorError> {
        self.model.check_video(x)?;
        // diffusers decides on the input size, then tiles the patchified tensor.
        let p = self.model.patch();
        let (h, w) = (x.dims()[3] / p, x.dims()[4] / p);
        let tiling = self.model.tiling();
        if !(self.use_tiling && tiling.needs_tiling_encode(x.dims()[3], x.dims()[4])) {
            return Ok(untiled_plan([3, 4], [h, w]));
        }
        // Every stride-2 resample maps n to n / 2 (a final partial row is dropped).
        let halvings = self.model.config.dim_mult.len().saturating_sub(1) as u32;
        Ok(tiled_plan([3, 4], &tiling.encode_layout(h, w, |n| n >> halvings)?))
    }

    fn exec(&self, x: &Tensor, task: &TileTask<Self::Payload>) -> std::result::Result<Tensor, OperatorError> {
        // Ranges are in patchified pixels: the same pixels of the RGB input, patchified.
        let [rows, cols] = &task.payload;
        let p = self.model.patch();
        let tile = x.narrow(3, rows.start * p, rows.len() * p)?.narrow(4, cols.start * p, cols.len() * p)?;
        Ok(self.model.encode_frames(&self.model.patchify_input(&tile)?)?)
    }

    fn merge(
        &self,
        tiles: TileMap,
        grid: &GridSpec<Self::TileSpec, DType>,
    ) -> std::result::Result<Tensor, OperatorError> {
        Ok(merge_plan(tiles, grid)?)
    }

    fn device(&self) -> Device {
        self.model.device()
    }
}

/// Wan / Qwen-Image decode sharded along one spatial axis: the plain (direct) decode, each
/// rank running the decoder on its band of the latent with halo exchanges, assembled on the
/// owner, then unpatchified (Wan2.2) and clamped as the plain decode is.
pub struct WanShardDecodeOperator<'m> {
    model: &'m WanVae,
}

impl<'m> WanShardDecodeOperator<'m> {
    /// The sharded decode of `model`.
    pub fn new(model: &'m WanVae) -> Self {
        Self { model }
    }
}

impl ShardOperator for WanShardDecodeOperator<'_> {
    fn geometry(&self, z: &Tensor, axis: ShardAxis) -> std::result::Result<ShardGeometry, OperatorError> {
        self.model.check_latent(z)?;
        Ok(ShardGeometry { min_band: self.model.decoder.widest_halo(axis) })
    }

    fn exec(&self, z: &Tensor, ctx: &mut ShardContext<'_>) -> std::result::Result<Tensor, OperatorError> {
        let band = ctx.local_input(z)?;
        Ok(self.model.decode_frames_on(&band, Some(ctx))?)
    }

    fn finish(&self, assembled: Tensor) -> std::result::Result<Tensor, OperatorError> {
        Ok(self.model.finish_decode(assembled, true)?)
    }

    fn device(&self) -> Device {
        self.model.device()
    }
}
