//! The loaded LTX VAE: loading, input checks, the plain decode (at the decode timestep, for a
//! timestep-conditioned decoder) and encode, one batch item at a time, and the pipelines'
//! latent normalisation with the `latents_mean` / `latents_std` the checkpoint stores.

use std::path::Path;

use vae_tensor::{DType, Device, Tensor};

use super::config::{LtxClass, LtxConfig, SpatialPadding};
use super::layers::host;
use super::networks::{Decoder, Encoder};
use super::tiling::LtxTiling;
use crate::checks::MapExtent;
use crate::layers::Band;
use crate::placement::{check_precision, per_item};
use crate::weights::{WeightStore, Weights};
use crate::{ModelError, Result};

/// A loaded `AutoencoderKLLTXVideo` or `AutoencoderKLLTX2Video`.
pub struct LtxVae {
    device: Device,
    dtype: DType,
    config: LtxConfig,
    encoder: Encoder,
    decoder: Decoder,
    tiling: LtxTiling,
    latents_mean: Vec<f32>,
    latents_std: Vec<f32>,
    /// The timestep a conditioned decoder decodes at (the pipelines' `decode_timestep`).
    decode_timestep: f32,
}

impl LtxVae {
    /// Loads a diffusers directory of `class` (every weight must be used) onto `device`,
    /// computing in `dtype`; inputs and outputs stay on the host.
    pub fn load_with(dir: &Path, class: LtxClass, device: Device, dtype: DType) -> Result<Self> {
        check_precision(device, dtype)?;
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| ModelError::Io { path: path.clone(), source })?;
        let config = LtxConfig::parse(&text, class).map_err(|message| ModelError::Config { path, message })?;
        let mut store = WeightStore::open_dir(dir)?;
        // The latent statistics stay f32 on the host, whatever the model computes in.
        let c = config.latent_channels;
        let latents_mean = host(&store.take("latents_mean", &[c])?)?;
        let latents_std = host(&store.take("latents_std", &[c])?)?;
        store.set_device(device);
        store.set_dtype(dtype);
        let mut w = Weights::new(&mut store);
        let encoder = Encoder::load(&mut w.pp("encoder"), &config)?;
        let decoder = Decoder::load(&mut w.pp("decoder"), &config)?;
        drop(w);
        store.finish()?;
        let tiling = LtxTiling::new(config.spatial_compression_ratio, config.temporal_compression_ratio);
        Ok(Self { device, dtype, config, encoder, decoder, tiling, latents_mean, latents_std, decode_timestep: 0.0 })
    }

    /// The configuration.
    pub fn config(&self) -> &LtxConfig {
        &self.config
    }

    /// The class loaded.
    pub fn class(&self) -> LtxClass {
        self.config.class
    }

    /// Where the model computes.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The element type the model computes in.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The tile geometry.
    pub fn tiling(&self) -> &LtxTiling {
        &self.tiling
    }

    /// Sets the tile geometry, refusing what the class cannot tile with. The compression ratios
    /// are the model's (the class's attributes): those of `tiling` are replaced by them.
    pub fn set_tiling(&mut self, mut tiling: LtxTiling) -> Result<()> {
        tiling.spatial.spatial_compression_ratio = self.config.spatial_compression_ratio;
        tiling.temporal_compression_ratio = self.config.temporal_compression_ratio;
        tiling.check()?;
        self.tiling = tiling;
        Ok(())
    }

    /// The decode timestep (0 until set: the pipelines' default `decode_timestep`).
    pub fn decode_timestep(&self) -> Option<f32> {
        self.decoder.conditioned().then_some(self.decode_timestep)
    }

    /// Sets the timestep a conditioned decoder decodes at; refused for a decoder without one.
    pub fn set_decode_timestep(&mut self, t: f64) -> Result<()> {
        if !self.decoder.conditioned() {
            return Err(ModelError::Unsupported(format!(
                "this {} decoder is not timestep-conditioned (timestep_conditioning is false): it takes no \
                 decode timestep",
                self.class().name()
            )));
        }
        if !t.is_finite() {
            return Err(ModelError::InvalidInput(format!("the decode timestep must be finite, got {t}")));
        }
        self.decode_timestep = t as f32;
        Ok(())
    }

    /// Pixels per latent pixel as the networks compute them.
    pub fn spatial_factor(&self) -> usize {
        self.config.decoder_spatial_factor()
    }

    /// Pixels per latent pixel of the encoder.
    pub(super) fn encoder_spatial_factor(&self) -> usize {
        self.config.encoder_spatial_factor()
    }

    /// `vae.decode(z, temb).sample` without tiling.
    pub fn decode(&self, z: &Tensor) -> Result<Tensor> {
        self.check_latent(z)?;
        self.check_memory(true, z.dims(), MapExtent::Whole)?;
        self.decode_clip(z, None)
    }

    /// The decoder on each batch item of a (tile of a) latent, on the host: of the whole latent
    /// or of this rank's band of it.
    pub(super) fn decode_clip(&self, z: &Tensor, mut band: Band<'_, '_>) -> Result<Tensor> {
        let t = self.decode_timestep();
        per_item(z, self.device, self.dtype, |x| self.decoder.forward(x, t, &mut band))
    }

    /// `vae._encode(x)` without tiling: the moments `[B, 2·latent, 1 + (T − 1) / temporal,
    /// H / spatial, W / spatial]`, the log-variance channel repeated.
    pub fn encode_moments(&self, x: &Tensor) -> Result<Tensor> {
        self.check_video(x, false)?;
        self.check_frame_size(x.dims()[3], x.dims()[4])?;
        self.check_memory(false, x.dims(), MapExtent::Whole)?;
        self.encode_clip(x, None)
    }

    /// The encoder on each batch item of a (tile of a) video, on the host.
    pub(super) fn encode_clip(&self, x: &Tensor, mut band: Band<'_, '_>) -> Result<Tensor> {
        per_item(x, self.device, self.dtype, |x| self.encoder.forward(x, &mut band))
    }

    /// The LTX pipelines' `_denormalize_latents`: `z · std / scaling_factor + mean` per channel.
    pub fn denormalize_latents(&self, z: &Tensor) -> Result<Tensor> {
        self.check_latent(z)?;
        let c = self.latents_std.len();
        let zeros = vec![0.0; c];
        let scaled = z.channel_affine(&self.latents_std, &zeros)?.div_scalar(self.config.scaling_factor as f32)?;
        Ok(scaled.channel_affine(&vec![1.0; c], &self.latents_mean)?)
    }

    /// The pipelines' `_normalize_latents` of an encoded mean: `(mean − latents_mean) ·
    /// scaling_factor / std` per channel.
    pub fn normalize_latents(&self, mean: &Tensor) -> Result<Tensor> {
        self.check_latent(mean)?;
        let c = self.latents_std.len();
        let minus: Vec<f32> = self.latents_mean.iter().map(|m| -m).collect();
        let centred = mean.channel_affine(&vec![1.0; c], &minus)?.mul_scalar(self.config.scaling_factor as f32)?;
        Ok(centred.channel_normalize(&vec![0.0; c], &self.latents_std)?)
    }

    /// `latents_mean` and `latents_std` as stored.
    pub fn latent_statistics(&self) -> (&[f32], &[f32]) {
        (&self.latents_mean, &self.latents_std)
    }

    pub(super) fn check_latent(&self, z: &Tensor) -> Result<()> {
        let d = z.dims();
        let c = self.config.latent_channels;
        let name = self.class().name();
        if d.len() != 5 || d[1] != c || d.contains(&0) {
            return Err(ModelError::InvalidInput(format!("{name} latent must be [B, {c}, T, H, W], got {d:?}")));
        }
        if self.config.decoder_padding == SpatialPadding::Reflect && (d[3] < 2 || d[4] < 2) {
            return Err(ModelError::InvalidInput(format!(
                "{name}'s decoder pads by reflection, which needs a latent of at least 2x2, got {}x{}",
                d[3], d[4]
            )));
        }
        crate::checks::check_finite(z, "latent")
    }

    /// The frame counts the encoder takes: `1 + k·temporal` (each temporal downsample pairs the
    /// frames after the first; diffusers fails on a frame left over).
    pub(super) fn check_frames(&self, frames: usize) -> Result<()> {
        crate::checks::encoder_frames(frames, self.config.encoder_temporal_factor())
    }

    /// A video the encoder takes: its shape, finite values and (unless `chunked`: its frames are
    /// tiled, and each chunk is checked instead) a frame count it can pair down.
    pub(super) fn check_video(&self, x: &Tensor, chunked: bool) -> Result<()> {
        let d = x.dims();
        let c = self.config.in_channels;
        if d.len() != 5 || d[1] != c || d.contains(&0) {
            return Err(ModelError::InvalidInput(format!("video must be [B, {c}, T, H, W], got {d:?}")));
        }
        crate::checks::check_finite(x, "video")?;
        if chunked { Ok(()) } else { self.check_frames(d[2]) }
    }

    /// Frames (or a tile of them) the encoder can fold: whole latent pixels.
    pub(super) fn check_frame_size(&self, h: usize, w: usize) -> Result<()> {
        crate::checks::whole_latent_pixels(h, w, self.encoder_spatial_factor())
    }

    /// Refuses a request whose output plus largest feature map cannot fit
    /// ([`crate::checks::ensure_fits`]): the decoder's last width over every output frame at a
    /// patch's resolution (of the frame or of a tile), the encoder's first over the input.
    pub(super) fn check_memory(&self, decode: bool, dims: &[usize], map: MapExtent) -> Result<()> {
        let &[b, _, t, h, w] = dims else { return Ok(()) };
        let c = &self.config;
        let (b, t, h, w) = (b as u64, t as u64, h as u64, w as u64);
        let pp = (c.patch_size * c.patch_size) as u64;
        if decode {
            let (s, r) = (self.spatial_factor() as u64, c.decoder_temporal_factor() as u64);
            let frames = 1 + t.saturating_sub(1) * r;
            let pixels = h * s * w * s;
            let output = b * c.out_channels as u64 * frames * pixels * 4;
            let map = c.decoder_last_width() as u64 * frames * map.pixels(pixels) / pp * 4;
            crate::checks::ensure_fits(output, map, "decode with tiles")
        } else {
            let (s, r) = (self.encoder_spatial_factor() as u64, c.encoder_temporal_factor() as u64);
            let output = b * 2 * c.latent_channels as u64 * (1 + t.saturating_sub(1) / r) * (h / s) * (w / s) * 4;
            let map = c.encoder_stem as u64 * t * map.pixels(h * w) / pp * 4;
            crate::checks::ensure_fits(output, map, "encode with tiles")
        }
    }
}
