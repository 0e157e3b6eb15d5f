//! `WanDecoder3d`: one latent frame at a time through the cache, on the whole map or on this
//! rank's band of a spatial shard.

use vae_planner::ShardAxis;
use vae_tensor::Tensor;

use super::cache::Pass;
use super::config::WanConfig;
use super::layers::{AttentionBlock, CausalConv3d, ResidualBlock, RmsNorm};
use super::resample::Upsample;
use crate::weights::Weights;
use crate::{ModelError, Result};

/// One level of `up_blocks`: residual blocks, then the upsampling (none at the last level).
struct UpBlock {
    resnets: Vec<ResidualBlock>,
    upsample: Option<Upsample>,
    /// Wan2.2's residual up blocks add `DupUp3D(x)` of the block input: `(factor_t, out_dim)`.
    dup_shortcut: Option<(usize, usize)>,
}

/// `WanDecoder3d` (non-residual, Wan2.1).
pub(super) struct Decoder {
    conv_in: CausalConv3d,
    mid_resnets: [ResidualBlock; 2],
    mid_attention: AttentionBlock,
    up_blocks: Vec<UpBlock>,
    norm_out: RmsNorm,
    conv_out: CausalConv3d,
}

impl Decoder {
    pub(super) fn load(w: &mut Weights<'_>, c: &WanConfig) -> Result<Self> {
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
    pub(super) fn forward(&self, x: &Tensor, pass: &mut Pass<'_, '_>, first_chunk: bool) -> Result<Tensor> {
        let x = pass.cached_conv(&self.conv_in, x)?;
        let x = self.mid_resnets[0].forward(&x, pass)?;
        let x = self.mid_attention.forward_on(&x, pass)?;
        let mut x = self.mid_resnets[1].forward(&x, pass)?;
        for block in &self.up_blocks {
            // DupUp3D moves channels into a 2×2 pixel block: per pixel, so local on a band.
            let input = block.dup_shortcut.map(|_| x.clone());
            for resnet in &block.resnets {
                x = resnet.forward(&x, pass)?;
            }
            if let Some(up) = &block.upsample {
                x = up.forward(&x, pass)?;
            }
            if let (Some((factor_t, out_dim)), Some(input)) = (block.dup_shortcut, input) {
                x.add_assign(&input.dup_up3d(factor_t, 2, out_dim, first_chunk)?)?;
            }
        }
        let x = self.norm_out.forward_silu(&x)?;
        pass.cached_conv(&self.conv_out, &x)
    }

    /// Output frames per latent frame after the first (which gives one): 2 per temporal
    /// upsampler.
    pub(super) fn temporal_factor(&self) -> usize {
        let temporal = self.up_blocks.iter().filter_map(|b| b.upsample.as_ref()).filter(|u| u.is_temporal()).count();
        1 << temporal
    }

    /// The widest halo any conv of the decoder needs, in rows of its own input. Every layer
    /// runs at the latent's resolution or a multiple of it, so a latent band this wide covers
    /// every halo.
    pub(super) fn widest_halo(&self, axis: ShardAxis) -> usize {
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
