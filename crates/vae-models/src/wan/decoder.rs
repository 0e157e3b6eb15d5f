//! `WanDecoder3d`: one latent frame at a time through the cache, on the whole map or on this
//! rank's band of a spatial shard.

use std::borrow::Cow;

use vae_planner::ShardAxis;
use vae_tensor::Tensor;

use super::cache::Pass;
use super::config::WanConfig;
use super::layers::{AttentionBlock, CausalConv3d, ResidualBlock};
use super::resample::Upsample;
use crate::layers::RmsNorm;
use crate::weights::Weights;
use crate::{ModelError, Result};

/// One level of `up_blocks`: residual blocks, then the upsampling (none at the last level).
struct UpBlock {
    resnets: Vec<ResidualBlock>,
    upsample: Option<Upsample>,
    /// Wan2.2's residual up blocks add `DupUp3D(x)` of the block input: `(factor_t, out_dim)`.
    dup_shortcut: Option<(usize, usize)>,
}

/// One layer (or block) of the decoder, in the order it runs: the unit a pipeline's stages are
/// cut from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Step {
    /// `conv_in`.
    ConvIn,
    /// `mid_block.resnets.k`.
    MidResnet(usize),
    /// `mid_block.attentions.0`.
    MidAttention,
    /// `up_blocks.b.resnets.j`.
    Resnet(usize, usize),
    /// `up_blocks.b`'s upsampler (and, for Wan2.2, the block's DupUp3D shortcut added after it).
    Upsample(usize),
    /// `norm_out`, SiLU and `conv_out`.
    Head,
}

/// What passes from one step to the next: the activation and, inside a Wan2.2 residual up
/// block, the block's input for its DupUp3D shortcut.
pub(super) struct Carry {
    /// The activation.
    pub(super) x: Tensor,
    /// The up block's input while its shortcut is pending.
    pub(super) shortcut: Option<Tensor>,
}

/// The error of a step list that names an upsampler the block does not have.
fn no_upsampler(block: usize) -> ModelError {
    ModelError::InvalidInput(format!("up block {block} has no upsampler"))
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
    pub(super) fn forward(&self, x: Tensor, pass: &mut Pass<'_, '_>, first_chunk: bool) -> Result<Tensor> {
        let carry = Carry { x, shortcut: None };
        Ok(self.forward_steps(0..self.steps().len(), carry, pass, first_chunk)?.x)
    }

    /// The decoder's layers in order, as the steps a pipeline deals out in stages.
    pub(super) fn steps(&self) -> Vec<Step> {
        let mut steps = vec![Step::ConvIn, Step::MidResnet(0), Step::MidAttention, Step::MidResnet(1)];
        for (b, block) in self.up_blocks.iter().enumerate() {
            steps.extend((0..block.resnets.len()).map(|j| Step::Resnet(b, j)));
            if block.upsample.is_some() {
                steps.push(Step::Upsample(b));
            }
        }
        steps.push(Step::Head);
        steps
    }

    /// Steps `range` of [`Self::steps`] on one latent frame (chunk): what [`Self::forward`] does
    /// between those layers, op for op, so stages run one after another give its bits.
    pub(super) fn forward_steps(
        &self,
        range: std::ops::Range<usize>,
        mut carry: Carry,
        pass: &mut Pass<'_, '_>,
        first_chunk: bool,
    ) -> Result<Carry> {
        let steps = self.steps();
        let Some(steps) = steps.get(range.clone()) else {
            return Err(ModelError::InvalidInput(format!("the decoder has no steps {range:?}")));
        };
        for step in steps {
            let x = &carry.x;
            carry.x = match *step {
                Step::ConvIn => pass.cached_conv(&self.conv_in, Cow::Borrowed(x))?,
                Step::MidResnet(k) => self.mid_resnets[k].forward(x, pass)?,
                Step::MidAttention => self.mid_attention.forward_on(x, pass)?,
                Step::Resnet(b, j) => {
                    // DupUp3D's shortcut is the block's input.
                    if j == 0 && self.up_blocks[b].dup_shortcut.is_some() {
                        carry.shortcut = Some(x.clone());
                    }
                    self.up_blocks[b].resnets[j].forward(x, pass)?
                }
                Step::Upsample(b) => {
                    let block = &self.up_blocks[b];
                    let up = block.upsample.as_ref().ok_or_else(|| no_upsampler(b))?;
                    let mut x = up.forward(x, pass)?;
                    // DupUp3D moves channels into a 2×2 pixel block: per pixel, so local on a band.
                    if let Some((factor_t, out_dim)) = block.dup_shortcut {
                        let input = carry.shortcut.take().ok_or_else(|| {
                            ModelError::InvalidInput(format!("up block {b}'s shortcut did not reach its upsampler"))
                        })?;
                        x.add_assign(&input.dup_up3d(factor_t, 2, out_dim, first_chunk)?)?;
                    }
                    x
                }
                Step::Head => {
                    let x = self.norm_out.forward_silu(x)?;
                    pass.cached_conv(&self.conv_out, Cow::Owned(x))?
                }
            };
        }
        Ok(carry)
    }

    /// Each step's relative cost for a `h × w` latent: multiply-adds per steady-state chunk
    /// (a latent frame after the first: the frames it has become by that layer), from the
    /// layers' weight shapes and resolutions, plus attention's products over the frame.
    pub(super) fn step_costs(&self, h: usize, w: usize) -> Vec<u64> {
        let (mut pixels, mut frames) = ((h * w) as u64, 1u64);
        self.steps()
            .into_iter()
            .map(|step| {
                let per_pixel = self.step_weight_elements(step);
                match step {
                    Step::MidAttention => {
                        let c = self.mid_attention.channels() as u64;
                        let products = pixels.saturating_mul(pixels).saturating_mul(2 * c);
                        per_pixel.saturating_mul(pixels).saturating_add(products).saturating_mul(frames)
                    }
                    Step::Upsample(b) => {
                        // The time conv at the input's resolution and frames, the resample conv
                        // at the output's.
                        let up = self.up_blocks[b].upsample.as_ref();
                        let time = up.map_or(0, |u| u.time_weight_elements());
                        let before = time.saturating_mul(pixels).saturating_mul(frames);
                        if up.is_some_and(|u| u.is_temporal()) {
                            frames *= 2;
                        }
                        pixels = pixels.saturating_mul(4);
                        let after = (per_pixel - time).saturating_mul(pixels).saturating_mul(frames);
                        before.saturating_add(after)
                    }
                    _ => per_pixel.saturating_mul(pixels).saturating_mul(frames),
                }
            })
            .collect()
    }

    /// The weight elements of one step's convolutions and projections (its multiply-adds per
    /// output pixel and frame, the upsampler's two convs summed).
    fn step_weight_elements(&self, step: Step) -> u64 {
        match step {
            Step::ConvIn => self.conv_in.weight_elements(),
            Step::MidResnet(k) => self.mid_resnets[k].weight_elements(),
            Step::MidAttention => self.mid_attention.weight_elements(),
            Step::Resnet(b, j) => self.up_blocks[b].resnets[j].weight_elements(),
            Step::Upsample(b) => {
                self.up_blocks[b].upsample.as_ref().map_or(0, |u| u.time_weight_elements() + u.conv_weight_elements())
            }
            Step::Head => self.conv_out.weight_elements(),
        }
    }

    /// Frees the weights of every step outside `keep` (a pipeline stage's model): those steps
    /// cannot run afterwards, and the model must refuse every request but that stage's.
    pub(super) fn release_steps_outside(&mut self, keep: std::ops::Range<usize>) -> Result<()> {
        for (i, step) in self.steps().into_iter().enumerate() {
            if keep.contains(&i) {
                continue;
            }
            match step {
                Step::ConvIn => self.conv_in.release()?,
                Step::MidResnet(k) => self.mid_resnets[k].release()?,
                Step::MidAttention => self.mid_attention.release()?,
                Step::Resnet(b, j) => self.up_blocks[b].resnets[j].release()?,
                Step::Upsample(b) => self.up_blocks[b].upsample.as_mut().map_or(Ok(()), Upsample::release)?,
                Step::Head => {
                    self.norm_out.release()?;
                    self.conv_out.release()?;
                }
            }
        }
        Ok(())
    }

    /// The bytes of the weights of `steps` (convolutions and projections; biases and norm
    /// scales, a fraction of a percent, aside), for a pipeline stage's report.
    pub(super) fn step_weight_bytes(&self, range: std::ops::Range<usize>) -> u64 {
        let elements: u64 = self.steps().get(range).unwrap_or(&[]).iter().map(|s| self.step_weight_elements(*s)).sum();
        elements * self.conv_in.weight_dtype().size_in_bytes() as u64
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
