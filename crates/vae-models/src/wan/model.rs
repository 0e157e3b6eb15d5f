//! The loaded Wan / Qwen-Image VAE: loading, the plain decode and encode, and the pipelines'
//! latent (de)normalisation.

use std::path::Path;

use vae_planner::WanTiling;
use vae_runtime::progress::{self, Progress};
use vae_runtime::{FrameFeed, FrameSink, ShardContext};
use vae_tensor::{DType, Device, Tensor};

use super::cache::Pass;
use super::config::WanConfig;
use super::decoder::Decoder;
use super::encoder::Encoder;
use super::layers::CausalConv3d;
use super::stage::KeptStage;
use crate::placement::{check_precision, on_device, to_host};
use crate::weights::{WeightStore, Weights};
use crate::{ModelError, Result};

/// Over what a request's largest feature map extends, for [`WanVae::check_memory`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum MapExtent {
    /// The whole frame.
    Whole,
    /// One tile.
    Tile,
    /// Bands of a spatial shard, over however many ranks: the output alone is counted.
    Banded,
}

/// How much of a decode's output a request holds at once, for [`WanVae::check_memory`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Output {
    /// All of it (assembled on the owner).
    Whole,
    /// One latent frame's output frames: the decode streams them to a sink.
    Streamed,
}

/// A decode in progress, a latent frame at a time: the latent after `post_quant_conv`, the
/// causal cache (and band, on a shard) and the next latent frame.
pub(super) struct FrameStream<'b, 'c> {
    x: Tensor,
    pass: Pass<'b, 'c>,
    next: usize,
    frames: usize,
}

/// The two diffusers classes this module loads; they share the decoder and differ in policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VideoVaeClass {
    /// `AutoencoderKLWan`: clamps to [-1, 1] after plain and tiled decode.
    Wan,
    /// `AutoencoderKLQwenImage`: clamps after plain decode only (its `tiled_decode` does not).
    QwenImage,
}

impl VideoVaeClass {
    /// Both classes.
    pub const ALL: [Self; 2] = [Self::Wan, Self::QwenImage];

    /// The diffusers class name.
    pub const fn class_name(self) -> &'static str {
        match self {
            Self::Wan => "AutoencoderKLWan",
            Self::QwenImage => "AutoencoderKLQwenImage",
        }
    }

    /// The class a `_class_name` names (`None`: a config without one, read as Wan).
    pub fn from_class_name(name: Option<&str>) -> Option<Self> {
        match name {
            None => Some(Self::Wan),
            Some(name) => Self::ALL.into_iter().find(|c| c.class_name() == name),
        }
    }
}

/// A loaded Wan2.1-style (or Qwen-Image) VAE, decode side.
pub struct WanVae {
    pub(super) class: VideoVaeClass,
    /// Where the weights live and the decoder and encoder compute.
    device: Device,
    /// The element type the decoder and encoder compute in.
    dtype: DType,
    pub(super) config: WanConfig,
    pub(super) post_quant_conv: CausalConv3d,
    pub(super) decoder: Decoder,
    /// `None` once the model keeps only a pipeline stage of its decoder.
    pub(super) quant_conv: Option<CausalConv3d>,
    /// `None` once the model keeps only a pipeline stage of its decoder.
    pub(super) encoder: Option<Encoder>,
    tiling: WanTiling,
    /// The pipeline stage this model keeps the weights of, if it let go of the others
    /// ([`Self::keep_only_pipeline_stage`]); it then runs that stage and nothing else.
    pub(super) kept_stage: Option<KeptStage>,
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
        let Some(class) = VideoVaeClass::from_class_name(config.class_name.as_deref()) else {
            return Err(ModelError::Config {
                path,
                message: format!(
                    "_class_name {:?} is not AutoencoderKLWan or AutoencoderKLQwenImage",
                    config.class_name.as_deref().unwrap_or_default()
                ),
            });
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
            quant_conv: Some(quant_conv),
            encoder: Some(encoder),
            tiling: WanTiling::new(ratio, patch),
            kept_stage: None,
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
        self.check_whole()?;
        self.check_latent(z)?;
        self.finish_decode(self.decode_frames(z)?, true)
    }

    /// [`Self::decode`] with each latent frame's output frames handed to `sink` as soon as they
    /// are decoded (unpatchified and clamped, on the host in f32, bit for bit the frames of
    /// `decode`); no more than one latent frame's output is held at a time.
    pub fn decode_streaming(&self, z: &Tensor, sink: &mut dyn FrameSink) -> Result<()> {
        self.check_whole()?;
        self.check_latent(z)?;
        self.check_memory(true, z.dims(), MapExtent::Whole, Output::Streamed)?;
        let mut feed = FrameFeed::new(sink, self.decoded_frames(z.dims()[2]));
        self.decode_runs_on(z, None, &mut |run| feed.feed(self.finish_decode(run, true)?).map_err(ModelError::Sink))?;
        feed.finish().map_err(ModelError::Sink)
    }

    /// Output frames of a decode of `latent_frames` latent frames: one for the first, then the
    /// decoder's temporal factor for each of the others.
    pub(super) fn decoded_frames(&self, latent_frames: usize) -> usize {
        1 + latent_frames.saturating_sub(1) * self.decoder.temporal_factor()
    }

    /// [`Self::decode_frames_on`] a latent frame at a time: each one's output frames (or this
    /// rank's band of them), unclamped, on the host, handed to `emit` as soon as they are
    /// decoded.
    pub(super) fn decode_runs_on(
        &self,
        z: &Tensor,
        band: Option<&mut ShardContext<'_>>,
        emit: &mut dyn FnMut(Tensor) -> Result<()>,
    ) -> Result<()> {
        let mut stream = self.start_frames(z, band)?;
        while stream.next < stream.frames {
            emit(self.next_run(&mut stream)?)?;
            progress::report(Progress::Steps { done: stream.next, total: stream.frames });
        }
        Ok(())
    }

    /// A decode of `z` (or of this rank's band of it) ready to run a latent frame at a time
    /// with [`Self::next_run`].
    pub(super) fn start_frames<'b, 'c>(
        &self,
        z: &Tensor,
        band: Option<&'b mut ShardContext<'c>>,
    ) -> Result<FrameStream<'b, 'c>> {
        self.check_whole()?;
        let mut uploaded = None;
        let zd = on_device(z, self.device, self.dtype, &mut uploaded)?;
        // 1×1×1: per pixel, local on a band.
        let x = self.post_quant_conv.forward(zd, None)?;
        Ok(FrameStream { frames: x.dims()[2], x, pass: Pass::new(band), next: 0 })
    }

    /// The next latent frame's output frames (unclamped, on the host), through the stream's
    /// causal cache.
    pub(super) fn next_run(&self, stream: &mut FrameStream<'_, '_>) -> Result<Tensor> {
        vae_runtime::cancel::check()?;
        let i = stream.next;
        if i >= stream.frames {
            return Err(ModelError::InvalidInput(format!(
                "a decode of {} latent frames has no frame {i}",
                stream.frames
            )));
        }
        stream.pass.next_chunk();
        let out = self.decoder.forward(stream.x.narrow(2, i, 1)?, &mut stream.pass, i == 0)?;
        stream.next += 1;
        to_host(out)
    }

    /// After the decoder (and, when tiled, the merge): unpatchify (Wan2.2), then clamp.
    pub(super) fn finish_decode(&self, x: Tensor, clamp: bool) -> Result<Tensor> {
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
        self.check_whole()?;
        self.check_video(x)?;
        self.encode_frames(&self.patchify_input(x)?)
    }

    /// Wan2.2's encoder works on 2×2-patchified frames (diffusers patchifies before encoding).
    pub(super) fn patchify_input(&self, x: &Tensor) -> Result<Tensor> {
        match self.patch() {
            1 => Ok(x.clone()),
            p => Ok(x.patchify(p)?),
        }
    }

    /// Pixel rows of one latent row: the encoder's spatial halvings times the patch size.
    pub(super) fn encode_band_unit(&self) -> usize {
        (1usize << self.config.dim_mult.len().saturating_sub(1)) * self.patch()
    }

    pub(super) fn patch(&self) -> usize {
        self.config.patch_size.filter(|p| *p > 1).unwrap_or(1)
    }

    pub(super) fn check_video(&self, x: &Tensor) -> Result<()> {
        // Wan2.2's encoder sees patchified frames; callers pass RGB.
        let patch = self.patch();
        let channels = self.config.in_channels / (patch * patch);
        let d = x.dims();
        if d.len() != 5 || d[1] != channels || d.contains(&0) {
            return Err(ModelError::InvalidInput(format!("video must be [B, {channels}, T, H, W], got {:?}", d)));
        }
        crate::checks::check_finite(x, "video")?;
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
    pub(super) fn encode_frames(&self, x: &Tensor) -> Result<Tensor> {
        self.encode_frames_on(x, None)
    }

    /// [`Self::encode_frames`] of a video, or of this rank's band of one (whole latent rows).
    pub(super) fn encode_frames_on(&self, x: &Tensor, band: Option<&mut ShardContext<'_>>) -> Result<Tensor> {
        let mut uploaded = None;
        let x = on_device(x, self.device, self.dtype, &mut uploaded)?;
        self.check_whole()?;
        let (Some(encoder), Some(quant_conv)) = (&self.encoder, &self.quant_conv) else {
            return Err(ModelError::Unsupported("this model has let go of its encoder".into()));
        };
        let d = x.dims();
        let chunks = 1 + (d[2] - 1) / 4;
        let mut pass = Pass::new(band);
        let mut outs = Vec::with_capacity(chunks);
        for i in 0..chunks {
            vae_runtime::cancel::check()?;
            pass.next_chunk();
            let (start, len) = if i == 0 { (0, 1) } else { (1 + 4 * (i - 1), 4) };
            outs.push(encoder.forward(&x.narrow(2, start, len)?, &mut pass)?);
            progress::report(Progress::Steps { done: i + 1, total: chunks });
        }
        let refs: Vec<&Tensor> = outs.iter().collect();
        to_host(quant_conv.forward(&Tensor::cat(&refs, 2)?, None)?)
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

    pub(super) fn check_latent(&self, z: &Tensor) -> Result<()> {
        let d = z.dims();
        if d.len() != 5 || d[1] != self.config.z_dim || d.contains(&0) {
            return Err(ModelError::InvalidInput(format!(
                "Wan latent must be [B, {}, T, H, W], got {:?}",
                self.config.z_dim, d
            )));
        }
        crate::checks::check_finite(z, "latent")
    }

    /// Refuses a request whose output plus largest feature map cannot fit (see
    /// [`crate::checks::ensure_fits`]): decode produces `1 + (T - 1)·2^k` frames at full
    /// resolution, its last level holding `decoder_base_dim · dim_mult[0]` channels over the
    /// whole frame or one tile (a shard's bands are not counted); encode's first level holds `base_dim`
    /// channels over the frame or tile.
    pub(super) fn check_memory(&self, decode: bool, dims: &[usize], map: MapExtent, held: Output) -> Result<()> {
        if dims.len() != 5 {
            return Ok(()); // the shape check names the problem
        }
        let c = &self.config;
        let (b, t, h, w) = (dims[0] as u64, dims[2] as u64, dims[3] as u64, dims[4] as u64);
        let scale = c.scale_factor_spatial.unwrap_or(8) as u64;
        let p = self.patch() as u64;
        let first = *c.dim_mult.first().unwrap_or(&1) as u64;
        let tile = (self.tiling.tile_sample_min_height * self.tiling.tile_sample_min_width) as u64;
        let (output, map_bytes, advice) = if decode {
            let ups = c.temperal_downsample.iter().filter(|&&x| x).count() as u32;
            let frames = match held {
                Output::Streamed => 1u64 << ups,
                Output::Whole => 1 + t.saturating_sub(1) * (1u64 << ups),
            };
            let full = h * scale * w * scale;
            let output = b * c.out_channels as u64 / (p * p).max(1) * frames * full * 4;
            let pixels = match map {
                MapExtent::Whole => full,
                MapExtent::Tile => full.min(tile),
                MapExtent::Banded => 0,
            } / (p * p);
            let channels = c.decoder_base_dim.unwrap_or(c.base_dim) as u64 * first;
            (output, b * channels * pixels * 4, "decode with tiles or a spatial shard")
        } else {
            let pixels = match map {
                MapExtent::Tile => (h * w).min(tile),
                _ => h * w,
            } / (p * p);
            let latent_frames = 1 + t.saturating_sub(1) / 4;
            let output = b * 2 * c.z_dim as u64 * latent_frames * (h / scale) * (w / scale) * 4;
            (output, b * c.base_dim as u64 * pixels * 4, "encode with tiles")
        };
        crate::checks::ensure_fits(output, map_bytes, advice)
    }

    /// The per-frame causal decode with a fresh cache, unclamped (a tile of `tiled_decode`).
    pub(super) fn decode_frames(&self, z: &Tensor) -> Result<Tensor> {
        self.decode_frames_on(z, None)
    }

    /// [`Self::decode_frames`] of the whole latent, or of this rank's band of it (`z` is then
    /// the band; the result is the output's band).
    pub(super) fn decode_frames_on(&self, z: &Tensor, band: Option<&mut ShardContext<'_>>) -> Result<Tensor> {
        let mut frames = Vec::with_capacity(z.dims().get(2).copied().unwrap_or(0));
        self.decode_runs_on(z, band, &mut |run| {
            frames.push(run);
            Ok(())
        })?;
        let refs: Vec<&Tensor> = frames.iter().collect();
        Ok(Tensor::cat(&refs, 2)?)
    }
}
