//! The two halves of the LTX VAEs: the encoder (patchify, conv_in, down blocks, mid block, norm,
//! SiLU, conv_out, the log-variance channel repeated) and the decoder (conv_in, mid block, up
//! blocks, norm, optional timestep scale and shift, SiLU, conv_out, unpatchify), each over one
//! batch item's clip or this rank's band of one.

use vae_tensor::Tensor;

use super::config::LtxConfig;
use super::layers::{CausalConv3d, Downsampler, ResnetBlock, RmsNorm, TimestepEmbedder, Upsampler, host};
use crate::clip::clip_dims;
use crate::layers::Band;
use crate::weights::Weights;
use crate::{ModelError, Result};

/// `n` resnets at `channels`.
fn resnets(
    w: &mut Weights<'_>,
    n: usize,
    channels: usize,
    (causal, spatial): (bool, super::config::SpatialPadding),
    timestep: bool,
    align: usize,
) -> Result<Vec<ResnetBlock>> {
    (0..n)
        .map(|j| ResnetBlock::load(&mut w.pp(format!("resnets.{j}")), channels, causal, spatial, timestep, align))
        .collect()
}

/// One encoder block.
struct DownBlock {
    resnets: Vec<ResnetBlock>,
    down: Option<Downsampler>,
}

/// `LTXVideoEncoder3d` (0.9.5 blocks) / `LTX2VideoEncoder3d`.
pub(super) struct Encoder {
    patch: usize,
    conv_in: CausalConv3d,
    blocks: Vec<DownBlock>,
    mid: Vec<ResnetBlock>,
    norm_out: RmsNorm,
    conv_out: CausalConv3d,
    latent: usize,
}

impl Encoder {
    pub(super) fn load(w: &mut Weights<'_>, c: &LtxConfig) -> Result<Self> {
        let conv = (c.encoder_causal, c.encoder_padding);
        let p = c.patch_size;
        // Rows per latent row at each resolution: halved by every spatial downsample.
        let mut align = c.encoder_spatial_factor() / p;
        let conv_in =
            CausalConv3d::load(&mut w.pp("conv_in"), c.in_channels * p * p, c.encoder_stem, conv.0, conv.1, align)?;
        let mut blocks = Vec::with_capacity(c.down.len());
        for (i, level) in c.down.iter().enumerate() {
            let mut b = w.pp(format!("down_blocks.{i}"));
            let resnets = resnets(&mut b, level.layers, level.width, conv, false, align)?;
            let down = match level.down {
                Some(stride) => {
                    let d = Downsampler::load(
                        &mut b.pp("downsamplers.0"),
                        level.width,
                        level.out,
                        stride,
                        conv.0,
                        conv.1,
                        align,
                    )?;
                    align /= stride[1];
                    Some(d)
                }
                None => None,
            };
            blocks.push(DownBlock { resnets, down });
        }
        let width = c.encoder_last_width();
        let mid = resnets(&mut w.pp("mid_block"), c.encoder_mid_layers, width, conv, false, align)?;
        let conv_out = CausalConv3d::load(&mut w.pp("conv_out"), width, c.latent_channels + 1, conv.0, conv.1, align)?;
        Ok(Self {
            patch: p,
            norm_out: RmsNorm::new(width, conv_out.weight())?,
            conv_in,
            blocks,
            mid,
            conv_out,
            latent: c.latent_channels,
        })
    }

    /// The moments `[1, 2·latent, 1 + (T − 1) / temporal, H / spatial, W / spatial]` of one
    /// item's video (or this rank's band of them): `latent` means, then the one log-variance
    /// channel the encoder makes, repeated `latent` times.
    pub(super) fn forward(&self, x: &Tensor, band: &mut Band<'_, '_>) -> Result<Tensor> {
        let mut x = self.conv_in.forward(&x.patchify(self.patch)?, band)?;
        for block in &self.blocks {
            for r in &block.resnets {
                x = r.forward(&x, None, band)?;
            }
            if let Some(d) = &block.down {
                x = d.forward(&x, band)?;
            }
        }
        for r in &self.mid {
            x = r.forward(&x, None, band)?;
        }
        let h = self.conv_out.forward(&self.norm_out.forward_silu(&x)?, band)?;
        let logvar = h.narrow(1, self.latent, 1)?;
        let mut parts = vec![&h];
        parts.extend(std::iter::repeat_n(&logvar, self.latent - 1));
        Ok(Tensor::cat(&parts, 1)?)
    }
}

/// A block's timestep embedder, when the decoder is conditioned.
fn embedder(w: &mut Weights<'_>, timestep: bool, dim: usize) -> Result<Option<TimestepEmbedder>> {
    timestep.then(|| TimestepEmbedder::load(&mut w.pp("time_embedder"), dim)).transpose()
}

/// One decoder block (the mid block has no upsample).
struct UpBlock {
    embedder: Option<TimestepEmbedder>,
    up: Option<Upsampler>,
    resnets: Vec<ResnetBlock>,
}

impl UpBlock {
    fn forward(&self, x: Tensor, t: Option<f32>, band: &mut Band<'_, '_>) -> Result<Tensor> {
        let temb = match (&self.embedder, t) {
            (Some(e), Some(t)) => Some(e.forward(t, &x)?),
            _ => None,
        };
        let mut x = match &self.up {
            Some(up) => up.forward(&x, band)?,
            None => x,
        };
        for r in &self.resnets {
            x = r.forward(&x, temb.as_deref(), band)?;
        }
        Ok(x)
    }
}

/// The decoder's timestep conditioning: the multiplier, and the output's scale and shift.
struct OutputConditioning {
    multiplier: f32,
    embedder: TimestepEmbedder,
    /// `scale_shift_table` `[2, C]`: shift, then scale.
    table: Vec<f32>,
}

/// `LTXVideoDecoder3d` / `LTX2VideoDecoder3d`.
pub(super) struct Decoder {
    conv_in: CausalConv3d,
    mid: UpBlock,
    blocks: Vec<UpBlock>,
    norm_out: RmsNorm,
    conditioning: Option<OutputConditioning>,
    conv_out: CausalConv3d,
    patch: usize,
    width: usize,
}

impl Decoder {
    pub(super) fn load(w: &mut Weights<'_>, c: &LtxConfig) -> Result<Self> {
        let conv = (c.decoder_causal, c.decoder_padding);
        let ts = c.timestep_conditioning;
        // Rows per latent row, doubled by every spatial upsample.
        let mut align = 1;
        let conv_in =
            CausalConv3d::load(&mut w.pp("conv_in"), c.latent_channels, c.decoder_stem, conv.0, conv.1, align)?;
        let mut m = w.pp("mid_block");
        let mid = UpBlock {
            embedder: embedder(&mut m, ts, 4 * c.decoder_stem)?,
            up: None,
            resnets: resnets(&mut m, c.decoder_mid_layers, c.decoder_stem, conv, ts, align)?,
        };
        let mut blocks = Vec::with_capacity(c.up.len());
        for (i, level) in c.up.iter().enumerate() {
            let mut b = w.pp(format!("up_blocks.{i}"));
            let up = match level.up {
                Some(step) => {
                    let u = Upsampler::load(&mut b.pp("upsamplers.0"), level.cin, step, conv.0, conv.1, align)?;
                    align *= step.0[1];
                    Some(u)
                }
                None => None,
            };
            blocks.push(UpBlock {
                embedder: embedder(&mut b, ts, 4 * level.width)?,
                up,
                resnets: resnets(&mut b, level.layers, level.width, conv, ts, align)?,
            });
        }
        let width = c.decoder_last_width();
        let p = c.patch_size;
        let conv_out = CausalConv3d::load(&mut w.pp("conv_out"), width, c.out_channels * p * p, conv.0, conv.1, align)?;
        let conditioning = if ts {
            let multiplier = host(&w.get("timestep_scale_multiplier", &[])?)?;
            Some(OutputConditioning {
                multiplier: multiplier[0],
                embedder: TimestepEmbedder::load(&mut w.pp("time_embedder"), 2 * width)?,
                table: host(&w.get("scale_shift_table", &[2, width])?)?,
            })
        } else {
            None
        };
        Ok(Self {
            norm_out: RmsNorm::new(width, conv_out.weight())?,
            conv_in,
            mid,
            blocks,
            conditioning,
            conv_out,
            patch: p,
            width,
        })
    }

    /// Whether the decoder takes a timestep.
    pub(super) fn conditioned(&self) -> bool {
        self.conditioning.is_some()
    }

    /// One item's clip `[1, out, 1 + (T − 1)·temporal, H·spatial, W·spatial]` from its latent (or
    /// this rank's band of it), at `timestep` when the decoder is conditioned.
    pub(super) fn forward(&self, z: &Tensor, timestep: Option<f32>, band: &mut Band<'_, '_>) -> Result<Tensor> {
        let t = match (&self.conditioning, timestep) {
            (Some(c), Some(t)) => Some(t * c.multiplier),
            (Some(_), None) => {
                return Err(ModelError::InvalidInput(
                    "this decoder is timestep-conditioned: it needs a decode timestep".into(),
                ));
            }
            (None, _) => None,
        };
        let x = self.conv_in.forward(z, band)?;
        let mut x = self.mid.forward(x, t, band)?;
        for block in &self.blocks {
            x = block.forward(x, t, band)?;
        }
        let y = match (&self.conditioning, t) {
            (Some(c), Some(t)) => {
                let e = c.embedder.forward(t, &x)?;
                let w = self.width;
                let ss: Vec<f32> = e.iter().zip(&c.table).map(|(a, b)| a + b).collect();
                self.norm_out.forward_modulated_silu(&x, &ss[..w], &ss[w..])?
            }
            _ => self.norm_out.forward_silu(&x)?,
        };
        let y = self.conv_out.forward(&y, band)?;
        debug_assert_eq!(clip_dims(&y)?[1] % (self.patch * self.patch), 0);
        Ok(y.unpatchify(self.patch)?)
    }
}
