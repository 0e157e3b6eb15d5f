//! The two halves of `AutoencoderKLHunyuanVideo15`: `HunyuanVideo15Encoder3D` and
//! `HunyuanVideo15Decoder3D`, each over a whole clip or this rank's band of one.

use vae_tensor::Tensor;

use super::config::HunyuanVideo15Config;
use super::layers::{CausalConv3d, Downsample, MidBlock, ResnetBlock, Upsample, mean_channel_groups, repeat_channels};
use crate::layers::{Band, RmsNorm};
use crate::weights::Weights;
use crate::{ModelError, Result};

/// One level: its resnets, then (maybe) a resample.
struct Level<R> {
    resnets: Vec<ResnetBlock>,
    resample: Option<R>,
}

/// A level's `n` resnets, the first from `cin` channels, all to `width`, at a resolution where
/// one latent row has become `align` rows.
fn resnets(w: &mut Weights<'_>, n: usize, cin: usize, width: usize, align: usize) -> Result<Vec<ResnetBlock>> {
    (0..n)
        .map(|j| ResnetBlock::load(&mut w.pp(format!("resnets.{j}")), if j == 0 { cin } else { width }, width, align))
        .collect()
}

/// `HunyuanVideo15Encoder3D`: conv_in, down blocks, mid block, then norm, SiLU and conv_out
/// plus the mean of the last map's channel groups.
pub(super) struct Encoder {
    conv_in: CausalConv3d,
    levels: Vec<Level<Downsample>>,
    mid: MidBlock,
    norm_out: RmsNorm,
    conv_out: CausalConv3d,
    /// The moments' channels (twice the latent's).
    moments: usize,
}

impl Encoder {
    pub(super) fn load(w: &mut Weights<'_>, c: &HunyuanVideo15Config) -> Result<Self> {
        let widths = &c.block_out_channels;
        // Rows per latent row, halved by every spatial downsample.
        let mut align = c.spatial_compression_ratio;
        let conv_in = CausalConv3d::load(&mut w.pp("conv_in"), c.in_channels, widths[0], 3)?.band_aligned(align);
        let mut cin = widths[0];
        let mut levels = Vec::with_capacity(widths.len());
        for (i, r) in c.encoder_levels().map_err(ModelError::Unsupported)?.into_iter().enumerate() {
            let mut b = w.pp(format!("down_blocks.{i}"));
            let resnets = resnets(&mut b, c.layers_per_block, cin, widths[i], align)?;
            let resample = r
                .map(|r| Downsample::load(&mut b.pp("downsamplers.0"), widths[i], r.out_channels, r.temporal, align))
                .transpose()?;
            if let Some(r) = r {
                cin = r.out_channels;
                align /= 2;
            } else {
                cin = widths[i];
            }
            levels.push(Level { resnets, resample });
        }
        let last = *widths.last().unwrap_or(&cin);
        let moments = 2 * c.latent_channels;
        Ok(Self {
            conv_in,
            levels,
            mid: MidBlock::load(&mut w.pp("mid_block"), last, 1)?,
            norm_out: RmsNorm::load(&mut w.pp("norm_out"), last, false)?,
            conv_out: CausalConv3d::load(&mut w.pp("conv_out"), last, moments, 3)?,
            moments,
        })
    }

    /// The moments `[B, 2·latent, 1 + (T − 1) / temporal, H / spatial, W / spatial]` of a clip
    /// (or this rank's band of them).
    pub(super) fn forward(&self, x: &Tensor, band: &mut Band<'_, '_>) -> Result<Tensor> {
        let mut x = self.conv_in.forward(x, band)?;
        for level in &self.levels {
            for resnet in &level.resnets {
                x = resnet.forward(&x, band)?;
            }
            if let Some(down) = &level.resample {
                x = down.forward(&x, band)?;
            }
        }
        let x = self.mid.forward(&x, band)?;
        let shortcut = mean_channel_groups(&x, self.moments)?;
        let mut y = self.conv_out.forward(&self.norm_out.forward_silu(&x)?, band)?;
        y.add_assign(&shortcut)?;
        Ok(y)
    }
}

/// `HunyuanVideo15Decoder3D`: conv_in plus the latent's channels repeated, mid block, up
/// blocks, then norm, SiLU and conv_out. No clamp.
pub(super) struct Decoder {
    conv_in: CausalConv3d,
    repeats: usize,
    mid: MidBlock,
    levels: Vec<Level<Upsample>>,
    norm_out: RmsNorm,
    conv_out: CausalConv3d,
}

impl Decoder {
    pub(super) fn load(w: &mut Weights<'_>, c: &HunyuanVideo15Config) -> Result<Self> {
        let widths: Vec<usize> = c.block_out_channels.iter().rev().copied().collect();
        let conv_in = CausalConv3d::load(&mut w.pp("conv_in"), c.latent_channels, widths[0], 3)?;
        let mid = MidBlock::load(&mut w.pp("mid_block"), widths[0], 1)?;
        let mut cin = widths[0];
        // Rows per latent row, doubled by every upsample.
        let mut align = 1;
        let mut levels = Vec::with_capacity(widths.len());
        for (i, r) in c.decoder_levels().map_err(ModelError::Unsupported)?.into_iter().enumerate() {
            let mut b = w.pp(format!("up_blocks.{i}"));
            let resnets = resnets(&mut b, c.layers_per_block + 1, cin, widths[i], align)?;
            let resample = r
                .map(|r| Upsample::load(&mut b.pp("upsamplers.0"), widths[i], r.out_channels, r.temporal, align))
                .transpose()?;
            if let Some(r) = r {
                cin = r.out_channels;
                align *= 2;
            } else {
                cin = widths[i];
            }
            levels.push(Level { resnets, resample });
        }
        let last = *widths.last().unwrap_or(&cin);
        Ok(Self {
            conv_in,
            repeats: widths[0] / c.latent_channels,
            mid,
            levels,
            norm_out: RmsNorm::load(&mut w.pp("norm_out"), last, false)?,
            conv_out: CausalConv3d::load(&mut w.pp("conv_out"), last, c.out_channels, 3)?.band_aligned(align),
        })
    }

    /// The clip `[B, out, 1 + (T − 1)·temporal, H·spatial, W·spatial]` of a latent (or this
    /// rank's band of it).
    pub(super) fn forward(&self, z: &Tensor, band: &mut Band<'_, '_>) -> Result<Tensor> {
        let mut x = self.conv_in.forward(z, band)?;
        x.add_assign(&repeat_channels(z, self.repeats)?)?;
        let mut x = self.mid.forward(&x, band)?;
        for level in &self.levels {
            for resnet in &level.resnets {
                x = resnet.forward(&x, band)?;
            }
            if let Some(up) = &level.resample {
                x = up.forward(&x, band)?;
            }
        }
        self.conv_out.forward(&self.norm_out.forward_silu(&x)?, band)
    }
}
