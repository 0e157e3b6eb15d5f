//! `WanEncoder3d`: video frames → latent moments, one chunk at a time through the cache.

use std::borrow::Cow;

use vae_tensor::Tensor;

use super::cache::Pass;
use super::config::WanConfig;
use super::layers::{AttentionBlock, CausalConv3d, ResidualBlock};
use super::resample::Downsample;
use crate::Result;
use crate::layers::RmsNorm;
use crate::weights::Weights;

/// Wan2.2's `WanResidualDownBlock`: residual blocks and a resample, plus an `AvgDown3D` of
/// the block input as a shortcut.
struct ResidualDownBlock {
    resnets: Vec<ResidualBlock>,
    downsample: Option<Downsample>,
    /// `(factor_t, factor_s, out_dim)` of the AvgDown3D shortcut.
    avg: (usize, usize, usize),
}

impl ResidualDownBlock {
    fn forward(&self, x: &Tensor, pass: &mut Pass<'_, '_>) -> Result<Tensor> {
        let (factor_t, factor_s, out_dim) = self.avg;
        let shortcut = x.avg_down3d(factor_t, factor_s, out_dim)?;
        let mut x = x.clone();
        for resnet in &self.resnets {
            x = resnet.forward(&x, pass)?;
        }
        if let Some(down) = &self.downsample {
            x = down.forward(&x, pass)?;
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
pub(super) struct Encoder {
    conv_in: CausalConv3d,
    layers: Vec<DownLayer>,
    mid_resnets: [ResidualBlock; 2],
    mid_attention: AttentionBlock,
    norm_out: RmsNorm,
    conv_out: CausalConv3d,
}

impl Encoder {
    pub(super) fn load(w: &mut Weights<'_>, c: &WanConfig) -> Result<Self> {
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

    /// One chunk of frames through the encoder, on the whole map or on the pass's band (of whole
    /// latent rows): convs take halos through the cache, the downsampling convs one row of the
    /// next band, the attention the gathered map; norms and the AvgDown3D shortcut are local.
    pub(super) fn forward(&self, x: &Tensor, pass: &mut Pass<'_, '_>) -> Result<Tensor> {
        let mut x = pass.cached_conv(&self.conv_in, Cow::Borrowed(x))?;
        for layer in &self.layers {
            x = match layer {
                DownLayer::Residual(r) => r.forward(&x, pass)?,
                DownLayer::Downsample(d) => d.forward(&x, pass)?,
                DownLayer::ResidualDown(d) => d.forward(&x, pass)?,
            };
        }
        let x = self.mid_resnets[0].forward(&x, pass)?;
        let x = self.mid_attention.forward_on(&x, pass)?;
        let x = self.mid_resnets[1].forward(&x, pass)?;
        let x = self.norm_out.forward_silu(&x)?;
        pass.cached_conv(&self.conv_out, Cow::Owned(x))
    }
}
