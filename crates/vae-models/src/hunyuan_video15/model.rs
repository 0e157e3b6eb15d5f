//! The loaded HunyuanVideo-1.5 VAE: loading, input checks, the plain decode and encode (each
//! batch item alone), and the pipelines' latent scale.

use std::path::Path;

use vae_tensor::{DType, Device, Tensor};

use super::config::HunyuanVideo15Config;
use super::networks::{Decoder, Encoder};
use super::tiling::HunyuanVideo15Tiling;
use crate::checks::MapExtent;
use crate::layers::Band;
use crate::placement::{check_precision, per_item};
use crate::weights::{WeightStore, Weights};
use crate::{ModelError, Result};

/// The diffusers class this module loads.
pub const CLASS_NAME: &str = "AutoencoderKLHunyuanVideo15";

/// A loaded `AutoencoderKLHunyuanVideo15`.
pub struct HunyuanVideo15Vae {
    device: Device,
    dtype: DType,
    config: HunyuanVideo15Config,
    encoder: Encoder,
    decoder: Decoder,
    tiling: HunyuanVideo15Tiling,
}

impl HunyuanVideo15Vae {
    /// Loads a diffusers `AutoencoderKLHunyuanVideo15` directory (every weight must be used)
    /// onto `device`, computing in `dtype`; inputs and outputs stay on the host.
    pub fn load_with(dir: &Path, device: Device, dtype: DType) -> Result<Self> {
        check_precision(device, dtype)?;
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| ModelError::Io { path: path.clone(), source })?;
        let config: HunyuanVideo15Config = serde_json::from_str(&text)
            .map_err(|e| ModelError::Config { path: path.clone(), message: e.to_string() })?;
        if config.class_name.as_deref() != Some(CLASS_NAME) {
            return Err(ModelError::Config {
                path,
                message: format!("_class_name {:?} is not {CLASS_NAME}", config.class_name.unwrap_or_default()),
            });
        }
        config.validate().map_err(|message| ModelError::Config { path, message })?;
        let mut store = WeightStore::open_dir(dir)?;
        store.set_device(device);
        store.set_dtype(dtype);
        let mut w = Weights::new(&mut store);
        let encoder = Encoder::load(&mut w.pp("encoder"), &config)?;
        let decoder = Decoder::load(&mut w.pp("decoder"), &config)?;
        drop(w);
        store.finish()?;
        let tiling = HunyuanVideo15Tiling::new(config.spatial_compression_ratio);
        Ok(Self { device, dtype, config, encoder, decoder, tiling })
    }

    /// The configuration.
    pub fn config(&self) -> &HunyuanVideo15Config {
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

    /// The tile geometry (the class's: 256-pixel tiles, a quarter of overlap).
    pub fn tiling(&self) -> &HunyuanVideo15Tiling {
        &self.tiling
    }

    /// Sets the tile geometry, refusing what the class cannot tile with.
    pub fn set_tiling(&mut self, tiling: HunyuanVideo15Tiling) -> Result<()> {
        tiling.check()?;
        self.tiling = tiling;
        Ok(())
    }

    /// Pixels per latent pixel along H and W.
    pub fn spatial_ratio(&self) -> usize {
        self.config.spatial_compression_ratio
    }

    /// Frames per latent frame after the first.
    pub(super) fn temporal_ratio(&self) -> usize {
        self.config.temporal_compression_ratio
    }

    /// `vae.decode(z).sample` without tiling: the whole clip through the decoder, no clamp.
    pub fn decode(&self, z: &Tensor) -> Result<Tensor> {
        self.check_latent(z)?;
        self.check_memory(true, z.dims(), MapExtent::Whole)?;
        self.decode_clip(z, None)
    }

    /// The decoder on each batch item of a (tile of a) latent, on the host: of the whole latent,
    /// or of this rank's band of it (`z` is then the band; the result is the output's band).
    /// diffusers' own batched call fails for more than one item (its causal mask does not
    /// broadcast over the attention heads); this is what its `enable_slicing()` computes.
    pub(super) fn decode_clip(&self, z: &Tensor, mut band: Band<'_, '_>) -> Result<Tensor> {
        per_item(z, self.device, self.dtype, |x| self.decoder.forward(x, &mut band))
    }

    /// `vae._encode(x)` without tiling: the moments `[B, 2·latent, 1 + (T − 1) / temporal,
    /// H / spatial, W / spatial]` (there is no `quant_conv` in this class).
    pub fn encode_moments(&self, x: &Tensor) -> Result<Tensor> {
        self.check_video(x)?;
        self.check_frame_size(x.dims()[3], x.dims()[4])?;
        self.check_memory(false, x.dims(), MapExtent::Whole)?;
        self.encode_clip(x, None)
    }

    /// The encoder on each batch item of a (tile of a) video, on the host; of a whole video, or
    /// of this rank's band of one (whole latent rows).
    pub(super) fn encode_clip(&self, x: &Tensor, mut band: Band<'_, '_>) -> Result<Tensor> {
        per_item(x, self.device, self.dtype, |x| self.encoder.forward(x, &mut band))
    }

    /// HunyuanVideo15Pipeline's latents → what the VAE decodes: `z / scaling_factor`.
    pub fn denormalize_latents(&self, z: &Tensor) -> Result<Tensor> {
        self.check_latent(z)?;
        Ok(z.div_scalar(self.config.scaling_factor as f32)?)
    }

    /// The image-to-video pipeline's conditioning latents from an encoded mean (the
    /// distribution's mode): `mean · scaling_factor`.
    pub fn normalize_latents(&self, mean: &Tensor) -> Result<Tensor> {
        self.check_latent(mean)?;
        Ok(mean.mul_scalar(self.config.scaling_factor as f32)?)
    }

    pub(super) fn check_latent(&self, z: &Tensor) -> Result<()> {
        let d = z.dims();
        let c = self.config.latent_channels;
        if d.len() != 5 || d[1] != c || d.contains(&0) {
            return Err(ModelError::InvalidInput(format!("{CLASS_NAME} latent must be [B, {c}, T, H, W], got {d:?}")));
        }
        crate::checks::check_finite(z, "latent")
    }

    /// The shape the encoder takes: `in_channels`, `1 + k·temporal` frames (every temporal
    /// downsample pairs the frames after the first; diffusers fails on a frame left over).
    pub(super) fn check_video(&self, x: &Tensor) -> Result<()> {
        let d = x.dims();
        let c = self.config.in_channels;
        if d.len() != 5 || d[1] != c || d.contains(&0) {
            return Err(ModelError::InvalidInput(format!("video must be [B, {c}, T, H, W], got {d:?}")));
        }
        crate::checks::check_finite(x, "video")?;
        crate::checks::encoder_frames(d[2], self.temporal_ratio())
    }

    /// Frames (or a tile of them) the encoder can fold: whole latent pixels.
    pub(super) fn check_frame_size(&self, h: usize, w: usize) -> Result<()> {
        crate::checks::whole_latent_pixels(h, w, self.spatial_ratio())
    }

    /// Refuses a request whose output plus largest feature map cannot fit
    /// ([`crate::checks::ensure_fits`]). The decoder's largest map is its last level's width
    /// over every output frame (of the whole frame, or of one tile); the encoder's, its first
    /// level's width over the input (frame or tile). A shard's bands are not counted.
    pub(super) fn check_memory(&self, decode: bool, dims: &[usize], map: MapExtent) -> Result<()> {
        let &[b, _, t, h, w] = dims else { return Ok(()) };
        let c = &self.config;
        let (b, t, h, w) = (b as u64, t as u64, h as u64, w as u64);
        let (s, r) = (self.spatial_ratio() as u64, self.temporal_ratio() as u64);
        let first = *c.block_out_channels.first().unwrap_or(&1) as u64;
        if decode {
            let frames = 1 + t.saturating_sub(1) * r;
            let pixels = h * s * w * s;
            let output = b * c.out_channels as u64 * frames * pixels * 4;
            let map = first * frames * map.pixels(pixels) * 4;
            crate::checks::ensure_fits(output, map, "decode with tiles")
        } else {
            let output = b * 2 * c.latent_channels as u64 * (1 + t.saturating_sub(1) / r) * (h / s) * (w / s) * 4;
            let map = first * t * map.pixels(h * w) * 4;
            crate::checks::ensure_fits(output, map, "encode with tiles")
        }
    }
}
