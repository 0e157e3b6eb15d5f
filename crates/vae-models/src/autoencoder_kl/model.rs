//! The modules of diffusers' `AutoencoderKL` / `AutoencoderKLFlux2`: `Encoder`, `Decoder`,
//! `quant_conv`, `post_quant_conv`, and FLUX.2's latent batch-norm statistics.

use std::path::Path;

use vae_planner::{AutoencoderKlTiling, ShardAxis};
use vae_runtime::{ParallelMode, Strategy, StrategyChoice};
use vae_tensor::{DType, Device, Tensor};

use super::config::{AutoencoderKlConfig, KlVariant};
use crate::family::Direction;
use crate::layers::{Band, Conv2d, Downsample2d, GroupNorm, MidBlock2d, ResnetBlock2d, Upsample2d};
use crate::placement::{check_precision, on_device, to_host};
use crate::weights::{WeightStore, Weights};
use crate::{ModelError, Result};

/// Epsilon of every GroupNorm in these VAEs (diffusers hard-codes it).
const NORM_EPS: f32 = 1e-6;

struct DownBlock {
    resnets: Vec<ResnetBlock2d>,
    downsample: Option<Downsample2d>,
}

/// diffusers `Encoder` (`double_z=True`): image → moments (mean and log-variance).
pub struct Encoder {
    conv_in: Conv2d,
    down_blocks: Vec<DownBlock>,
    mid_block: MidBlock2d,
    conv_norm_out: GroupNorm,
    conv_out: Conv2d,
}

impl Encoder {
    fn load(w: &mut Weights<'_>, c: &AutoencoderKlConfig) -> Result<Self> {
        let widths = &c.block_out_channels;
        let groups = c.norm_num_groups;
        // Rows one latent row spans at each level (the alignment of band cuts there).
        let mut align = 1usize << (widths.len() - 1);
        let conv_in = Conv2d::load3x3(&mut w.pp("conv_in"), c.in_channels, widths[0])?.band_aligned(align);
        let mut down_blocks = Vec::with_capacity(widths.len());
        let mut output = widths[0];
        for (i, &width) in widths.iter().enumerate() {
            let input = output;
            output = width;
            let mut block = w.pp(format!("down_blocks.{i}"));
            let resnets = (0..c.layers_per_block)
                .map(|j| {
                    let cin = if j == 0 { input } else { output };
                    ResnetBlock2d::load(&mut block.pp("resnets").pp(j), cin, output, groups, NORM_EPS, align)
                })
                .collect::<Result<Vec<_>>>()?;
            let last = i + 1 == widths.len();
            let downsample =
                if last { None } else { Some(Downsample2d::load(&mut block.pp("downsamplers").pp(0), output)?) };
            align = (align / 2).max(1);
            down_blocks.push(DownBlock { resnets, downsample });
        }
        let top = *widths.last().expect("validated non-empty");
        Ok(Self {
            conv_in,
            down_blocks,
            mid_block: MidBlock2d::load(&mut w.pp("mid_block"), top, groups, c.mid_block_add_attention)?,
            conv_norm_out: GroupNorm::load(&mut w.pp("conv_norm_out"), groups, top, NORM_EPS)?,
            conv_out: Conv2d::load3x3(&mut w.pp("conv_out"), top, 2 * c.latent_channels)?,
        })
    }

    /// Runs the encoder on an NCHW image.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_on(x, &mut None)
    }

    /// [`Self::forward`] on an image or this rank's band of one (cut between whole latent
    /// rows): the band of the whole image's moments, bit for bit.
    pub fn forward_on(&self, x: &Tensor, band: &mut Band<'_, '_>) -> Result<Tensor> {
        let mut h = self.conv_in.forward_on(x, band)?;
        for block in &self.down_blocks {
            for resnet in &block.resnets {
                vae_runtime::cancel::check()?;
                h = resnet.forward_on(&h, band)?;
            }
            if let Some(down) = &block.downsample {
                h = down.forward_on(&h, band)?;
            }
        }
        h = self.mid_block.forward_on(&h, band)?;
        let normed = self.conv_norm_out.forward_on(&h, true, band)?;
        drop(h);
        self.conv_out.forward_owned(normed, band)
    }
}

struct UpBlock {
    resnets: Vec<ResnetBlock2d>,
    upsample: Option<Upsample2d>,
}

/// diffusers `Decoder`: latent → image.
pub struct Decoder {
    conv_in: Conv2d,
    mid_block: MidBlock2d,
    up_blocks: Vec<UpBlock>,
    conv_norm_out: GroupNorm,
    conv_out: Conv2d,
}

impl Decoder {
    fn load(w: &mut Weights<'_>, c: &AutoencoderKlConfig) -> Result<Self> {
        let widths = &c.decoder_block_out_channels;
        let groups = c.norm_num_groups;
        let top = *widths.last().expect("validated non-empty");
        let conv_in = Conv2d::load3x3(&mut w.pp("conv_in"), c.latent_channels, top)?;
        let mid_block = MidBlock2d::load(&mut w.pp("mid_block"), top, groups, c.mid_block_add_attention)?;
        let mut up_blocks = Vec::with_capacity(widths.len());
        let mut output = top;
        // Rows one latent row spans at each level (the alignment of band cuts there).
        let mut align = 1;
        for (i, &width) in widths.iter().rev().enumerate() {
            let prev = output;
            output = width;
            let mut block = w.pp(format!("up_blocks.{i}"));
            let resnets = (0..=c.layers_per_block)
                .map(|j| {
                    let cin = if j == 0 { prev } else { output };
                    ResnetBlock2d::load(&mut block.pp("resnets").pp(j), cin, output, groups, NORM_EPS, align)
                })
                .collect::<Result<Vec<_>>>()?;
            let last = i + 1 == widths.len();
            if !last {
                align *= 2;
            }
            let upsample =
                if last { None } else { Some(Upsample2d::load(&mut block.pp("upsamplers").pp(0), output, align)?) };
            up_blocks.push(UpBlock { resnets, upsample });
        }
        Ok(Self {
            conv_in,
            mid_block,
            up_blocks,
            conv_norm_out: GroupNorm::load(&mut w.pp("conv_norm_out"), groups, widths[0], NORM_EPS)?,
            conv_out: Conv2d::load3x3(&mut w.pp("conv_out"), widths[0], c.out_channels)?.band_aligned(align),
        })
    }

    /// Runs the decoder on an NCHW latent (after `post_quant_conv`).
    pub fn forward(&self, z: &Tensor) -> Result<Tensor> {
        self.forward_on(z, &mut None)
    }

    /// [`Self::forward`] on a latent or this rank's band of one: the band of the whole
    /// decoded image, bit for bit.
    pub fn forward_on(&self, z: &Tensor, band: &mut Band<'_, '_>) -> Result<Tensor> {
        let h = self.conv_in.forward_on(z, band)?;
        let mut h = self.mid_block.forward_on(&h, band)?;
        for block in &self.up_blocks {
            for resnet in &block.resnets {
                vae_runtime::cancel::check()?;
                h = resnet.forward_on(&h, band)?;
            }
            if let Some(up) = &block.upsample {
                h = up.forward_on(&h, band)?;
            }
        }
        let normed = self.conv_norm_out.forward_on(&h, true, band)?;
        drop(h);
        self.conv_out.forward_owned(normed, band)
    }
}

/// FLUX.2's `bn` running statistics over 2×2-patchified latents, which the FLUX.2 pipeline uses
/// to (de)normalise latents.
#[derive(Debug, Clone, PartialEq)]
pub struct LatentBatchNorm {
    /// `bn.running_mean`, per patchified channel.
    pub mean: Vec<f32>,
    /// `bn.running_var`, per patchified channel.
    pub var: Vec<f32>,
    /// `batch_norm_eps`.
    pub eps: f64,
}

impl LatentBatchNorm {
    /// `sqrt(running_var + eps)` in f32, as the pipeline computes it on an f32 tensor.
    pub fn std(&self) -> Vec<f32> {
        self.var.iter().map(|v| (v + self.eps as f32).sqrt()).collect()
    }
}

/// A loaded AutoencoderKL-family VAE.
pub struct AutoencoderKl {
    config: AutoencoderKlConfig,
    /// Where the weights live and the encoder and decoder compute.
    device: Device,
    /// The element type the encoder and decoder compute in.
    dtype: DType,
    encoder: Encoder,
    decoder: Decoder,
    quant_conv: Option<Conv2d>,
    post_quant_conv: Option<Conv2d>,
    latent_bn: Option<LatentBatchNorm>,
    tiling: AutoencoderKlTiling,
    parameter_count: usize,
    stored_dtypes: Vec<(String, usize)>,
}

impl std::fmt::Debug for AutoencoderKl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AutoencoderKl").field("config", &self.config).field("tiling", &self.tiling).finish()
    }
}

impl AutoencoderKl {
    /// Loads a diffusers model directory (`config.json` and the safetensors weights) onto the
    /// CPU.
    pub fn load(dir: &Path) -> Result<Self> {
        Self::load_on(dir, Device::Cpu)
    }

    /// [`Self::load`] with the weights on `device`: the encoder and decoder then compute there,
    /// while inputs, outputs and tiles stay on the host (each computation uploads its input and
    /// downloads its result), so nothing above the model changes.
    pub fn load_on(dir: &Path, device: Device) -> Result<Self> {
        Self::load_with(dir, device, DType::F32)
    }

    /// [`Self::load_on`] computing in `dtype` (`vae.to(dtype)`): f32 anywhere, bf16 on CUDA.
    /// Inputs are cast to `dtype` on upload (as pipelines cast latents to the VAE's dtype) and
    /// results come back as f32 holding the `dtype` values.
    pub fn load_with(dir: &Path, device: Device, dtype: DType) -> Result<Self> {
        check_precision(device, dtype)?;
        let config = AutoencoderKlConfig::from_file(&dir.join("config.json"))?;
        let mut store = WeightStore::open_dir(dir)?;
        store.set_device(device);
        store.set_dtype(dtype);
        let model = Self::from_store(config, &mut store)?;
        store.finish()?;
        Ok(model)
    }

    /// Builds the model from a config and weights (every weight the config implies must be
    /// there with its shape; call [`WeightStore::finish`] afterwards to refuse extra ones). The
    /// model computes on the store's device.
    pub fn from_store(config: AutoencoderKlConfig, store: &mut WeightStore) -> Result<Self> {
        let (device, dtype) = (store.device(), store.dtype());
        let mut stored_dtypes: Vec<(String, usize)> = store.dtypes().into_iter().collect();
        stored_dtypes.sort();
        let mut w = Weights::new(store);
        let encoder = Encoder::load(&mut w.pp("encoder"), &config)?;
        let decoder = Decoder::load(&mut w.pp("decoder"), &config)?;
        let latent = config.latent_channels;
        let quant_conv = if config.use_quant_conv {
            Some(Conv2d::load1x1(&mut w.pp("quant_conv"), 2 * latent, 2 * latent)?)
        } else {
            None
        };
        let post_quant_conv = if config.use_post_quant_conv {
            Some(Conv2d::load1x1(&mut w.pp("post_quant_conv"), latent, latent)?)
        } else {
            None
        };
        let latent_bn = match config.variant {
            KlVariant::AutoencoderKl => None,
            KlVariant::Flux2 => {
                let channels = config.patch_size[0] * config.patch_size[1] * latent;
                let mut bn = w.pp("bn");
                let mean = bn.get("running_mean", &[channels])?.to_vec_f32()?;
                let var = bn.get("running_var", &[channels])?.to_vec_f32()?;
                bn.skip("num_batches_tracked");
                Some(LatentBatchNorm { mean, var, eps: config.batch_norm_eps })
            }
        };
        let tiling = AutoencoderKlTiling::from_config(config.sample_size, config.levels());
        drop(w);
        let parameter_count = store.parameter_count();
        Ok(Self {
            config,
            device,
            dtype,
            encoder,
            decoder,
            quant_conv,
            post_quant_conv,
            latent_bn,
            tiling,
            parameter_count,
            stored_dtypes,
        })
    }

    /// A model with seeded random weights (see [`WeightStore::synthetic`]): for demos,
    /// benchmarks and tests that need no files. Identical for equal configs and seeds.
    pub fn synthetic(config: AutoencoderKlConfig, seed: u64) -> Result<Self> {
        Self::from_store(config, &mut WeightStore::synthetic(seed))
    }

    /// Where the model computes.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The element type the model computes in.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The configuration.
    pub fn config(&self) -> &AutoencoderKlConfig {
        &self.config
    }

    /// Scalar parameters in the checkpoint.
    pub fn parameter_count(&self) -> usize {
        self.parameter_count
    }

    /// Element types the checkpoint stores, with tensor counts (weights are used as f32).
    pub fn stored_dtypes(&self) -> &[(String, usize)] {
        &self.stored_dtypes
    }

    /// FLUX.2's latent statistics (`None` for AutoencoderKL).
    pub fn latent_batch_norm(&self) -> Option<&LatentBatchNorm> {
        self.latent_bn.as_ref()
    }

    /// The tile geometry in use (diffusers' defaults from the config unless changed).
    pub fn tiling(&self) -> &AutoencoderKlTiling {
        &self.tiling
    }

    /// Changes the tile size and/or overlap as a diffusers user can: `tile_sample_min_size` in
    /// pixels (the latent tile follows as `int(size / 2^(levels-1))`, diffusers' formula) and
    /// `tile_overlap_factor`.
    pub fn set_tiling(&mut self, tile_sample_min_size: Option<usize>, tile_overlap_factor: Option<f64>) -> Result<()> {
        if tile_sample_min_size.is_none() && tile_overlap_factor.is_none() {
            // The config's own geometry: like diffusers, a problem with it only shows once
            // tiling is used (as a typed error from the split).
            return Ok(());
        }
        let mut tiling = self.tiling;
        if let Some(size) = tile_sample_min_size {
            tiling = AutoencoderKlTiling {
                tile_overlap_factor: tiling.tile_overlap_factor,
                ..AutoencoderKlTiling::from_config(size, self.config.levels())
            };
        }
        if let Some(f) = tile_overlap_factor {
            tiling.tile_overlap_factor = f;
        }
        if tiling.tile_latent_min_size == 0 {
            return Err(ModelError::InvalidInput(format!(
                "tile_sample_min_size {} is smaller than one latent pixel ({} px)",
                tiling.tile_sample_min_size,
                self.config.spatial_scale()
            )));
        }
        // Reject geometry that cannot tile (zero stride, blend wider than the tile) up front.
        tiling.decode_layout(1, 1, 1).map_err(|e| ModelError::InvalidInput(format!("tiling: {e}")))?;
        tiling.encode_stride().map_err(|e| ModelError::InvalidInput(format!("tiling: {e}")))?;
        self.tiling = tiling;
        Ok(())
    }

    /// Every parallel mode but `pipeline` runs on the CPU: decode and encode shard exactly (the
    /// GroupNorms take the whole map's statistics from the other ranks); an image has no frames
    /// to pipeline. On a GPU the shard modes are refused: its statistics are computed on the host.
    pub fn check_mode(&self, mode: ParallelMode) -> Result<()> {
        if mode == ParallelMode::Pipeline {
            return Err(ModelError::Unsupported(format!(
                "{} decodes images: pipeline mode passes a video decoder's latent frames from stage to \
                 stage (use tile, auto, spatial_shard_height, spatial_shard_width or spatial_shard_2d)",
                self.config.variant.class_name()
            )));
        }
        let shard = matches!(
            mode,
            ParallelMode::SpatialShardHeight | ParallelMode::SpatialShardWidth | ParallelMode::SpatialShard2d
        );
        match self.shard_refusal() {
            Some(refusal) if shard => Err(refusal),
            _ => Ok(()),
        }
    }

    /// Why this model cannot shard where it is: its distributed GroupNorm statistics are
    /// computed on the host, so the shard runs on the CPU only. None on the CPU.
    pub(crate) fn shard_refusal(&self) -> Option<ModelError> {
        (!self.device.is_cpu()).then(|| {
            ModelError::Unsupported(format!(
                "the {} shard runs on the CPU for now (its GroupNorm statistics are computed on the host); \
                 use tile on {}",
                self.config.variant.class_name(),
                self.device
            ))
        })
    }

    /// This family's policy for one request of an `input_dims` input over `ranks` ranks, from
    /// global quantities only, so every rank decides alike.
    ///
    /// - `spatial_shard_height` / `_width`: that axis whenever every rank gets at least one
    ///   latent row (or column), of whole latent rows for an encode (an image whose extent is a
    ///   multiple of the VAE's scale); otherwise tiles, flagged as a fallback.
    /// - `auto`: where tiling would otherwise be used (two ranks or more, an input larger than a
    ///   tile, on the CPU), the shard along the longer axis that fits (width on ties): the exact
    ///   untiled result, without seams; otherwise tiles.
    /// - `spatial_shard_2d`: the grid of blocks closest to square that gives every block a latent
    ///   row and column (whole ones for an encode); otherwise tiles, flagged as a fallback.
    /// - `tile`: tiles.
    pub fn strategy(
        &self,
        direction: Direction,
        mode: ParallelMode,
        input_dims: &[usize],
        ranks: usize,
    ) -> StrategyChoice {
        let verb = match direction {
            Direction::Decode => "decoding",
            Direction::Encode => "encoding",
        };
        match mode {
            ParallelMode::Tile => StrategyChoice::chosen(Strategy::Tile, "tile mode"),
            // `check_mode` refuses it first.
            ParallelMode::Pipeline => StrategyChoice::fallback_to_tile("pipeline: an image VAE; tiles"),
            ParallelMode::Auto => self.auto(direction, input_dims, ranks),
            ParallelMode::SpatialShardHeight | ParallelMode::SpatialShardWidth => {
                let axis = if mode == ParallelMode::SpatialShardHeight { ShardAxis::Height } else { ShardAxis::Width };
                let fit = self.shard_fits(direction, input_dims, axis, ranks);
                StrategyChoice::forced_shard(mode, axis, fit, input_dims.len() == 4, verb)
            }
            ParallelMode::SpatialShard2d => {
                let unit = match direction {
                    Direction::Decode => 1,
                    Direction::Encode => self.config.spatial_scale(),
                };
                StrategyChoice::forced_blocks_in_units("an image", input_dims, 4, unit, ranks, [1, 1], verb)
            }
        }
    }

    /// Why `axis` of an `dims` input cannot be cut into `ranks` bands, if it cannot: a band is
    /// at least one latent row (for an encode, the image rows of one, whole).
    fn shard_fits(
        &self,
        direction: Direction,
        dims: &[usize],
        axis: ShardAxis,
        ranks: usize,
    ) -> std::result::Result<(), String> {
        let extent = axis.dim_in(dims.len()).filter(|_| dims.len() == 4).map(|d| dims[d]).ok_or("not an NCHW input")?;
        match direction {
            Direction::Decode => vae_runtime::whole_bands("a latent", axis, extent, 1, ranks),
            Direction::Encode => vae_runtime::whole_bands("an image", axis, extent, self.config.spatial_scale(), ranks),
        }
    }

    fn auto(&self, direction: Direction, dims: &[usize], ranks: usize) -> StrategyChoice {
        let tile = |why: String| StrategyChoice::chosen(Strategy::Tile, format!("auto: {why}; tiles"));
        if ranks < 2 {
            return tile("one rank".into());
        }
        let &[_, _, h, w] = dims else { return tile("not an NCHW input".into()) };
        if !self.device.is_cpu() {
            return tile(format!("this family's shard runs on the CPU, not {}", self.device));
        }
        let tiled = match direction {
            Direction::Decode => self.tiling.needs_tiling_decode(h, w),
            Direction::Encode => self.tiling.needs_tiling_encode(h, w),
        };
        if !tiled {
            return tile(format!("a {h}x{w} input fits one tile"));
        }
        StrategyChoice::auto_axis(h, w, &format!("a {h}x{w} input"), |axis| {
            self.shard_fits(direction, dims, axis, ranks)
        })
    }

    /// Checks a latent: `[B, latent_channels, H, W]`, finite.
    pub fn check_latent(&self, z: &Tensor) -> Result<()> {
        check_nchw(z, self.config.latent_channels, "latent")
    }

    /// Checks an image: `[B, in_channels, H, W]` with H, W ≥ one latent pixel, finite.
    pub fn check_image(&self, x: &Tensor) -> Result<()> {
        check_nchw(x, self.config.in_channels, "image")?;
        let scale = self.config.spatial_scale();
        if x.dims()[2] < scale || x.dims()[3] < scale {
            return Err(ModelError::InvalidInput(format!(
                "image of {}x{} pixels is smaller than one latent pixel ({scale}x{scale})",
                x.dims()[2],
                x.dims()[3]
            )));
        }
        Ok(())
    }

    /// `post_quant_conv` (when present) then the decoder: `vae.decode(z)` without tiling.
    pub fn decode(&self, z: &Tensor) -> Result<Tensor> {
        self.check_latent(z)?;
        self.decode_unchecked(z)
    }

    pub(crate) fn decode_unchecked(&self, z: &Tensor) -> Result<Tensor> {
        self.decode_on(z, &mut None)
    }

    /// The decode of a latent, or of this rank's band of one (`post_quant_conv` is 1×1: local).
    pub(crate) fn decode_on(&self, z: &Tensor, band: &mut Band<'_, '_>) -> Result<Tensor> {
        let mut uploaded = None;
        let z = on_device(z, self.device, self.dtype, &mut uploaded)?;
        let image = match &self.post_quant_conv {
            Some(conv) => self.decoder.forward_on(&conv.forward(z)?, band)?,
            None => self.decoder.forward_on(z, band)?,
        };
        to_host(image)
    }

    /// The encoder then `quant_conv` (when present): the raw moments `[B, 2·latent, h, w]`
    /// (`vae._encode(x)` without tiling).
    pub fn encode_moments(&self, x: &Tensor) -> Result<Tensor> {
        self.check_image(x)?;
        self.encode_unchecked(x)
    }

    pub(crate) fn encode_unchecked(&self, x: &Tensor) -> Result<Tensor> {
        self.encode_on(x, &mut None)
    }

    /// The moments of an image, or of this rank's band of one (`quant_conv` is 1×1: local).
    pub(crate) fn encode_on(&self, x: &Tensor, band: &mut Band<'_, '_>) -> Result<Tensor> {
        let mut uploaded = None;
        let x = on_device(x, self.device, self.dtype, &mut uploaded)?;
        let moments = self.encoder.forward_on(x, band)?;
        to_host(match &self.quant_conv {
            Some(conv) => conv.forward(&moments)?,
            None => moments,
        })
    }

    /// Whether diffusers, with tiling enabled, takes the tiled path for this latent.
    pub fn decode_is_tiled(&self, z: &Tensor) -> bool {
        let d = z.dims();
        d.len() == 4 && self.tiling.needs_tiling_decode(d[2], d[3])
    }

    /// Whether diffusers, with tiling enabled, takes the tiled path for this image.
    pub fn encode_is_tiled(&self, x: &Tensor) -> bool {
        let d = x.dims();
        d.len() == 4 && self.tiling.needs_tiling_encode(d[2], d[3])
    }

    /// Latents as a diffusion pipeline produces them → latents the VAE decodes. AutoencoderKL:
    /// `z / scaling_factor + shift_factor` (shift only when set). FLUX.2: patchified latents
    /// `[B, 4·C, h, w]` → `z·sqrt(var + eps) + mean`, then unpatchified to `[B, C, 2h, 2w]`.
    pub fn denormalize_latents(&self, z: &Tensor) -> Result<Tensor> {
        match &self.latent_bn {
            None => {
                self.check_latent(z)?;
                let scale = self.config.scaling_factor.unwrap_or(1.0) as f32;
                if let Some((mean, std)) = &self.config.latents_stats {
                    // SDXL-style pipelines: `z * std / scaling_factor + mean`, op by op.
                    let (mean, std) = (to_f32(mean), to_f32(std));
                    let zeros = vec![0.0; std.len()];
                    let ones = vec![1.0; mean.len()];
                    let scaled = z.channel_affine(&std, &zeros)?.div_scalar(scale)?;
                    return Ok(scaled.channel_affine(&ones, &mean)?);
                }
                // PyTorch divides (`z / s`), which can differ from multiplying by 1/s in the last
                // bit; divide element-wise to match.
                let mut out = z.div_scalar(scale)?;
                if let Some(shift) = self.config.shift_factor {
                    out = out.add_scalar(shift as f32)?;
                }
                Ok(out)
            }
            Some(bn) => {
                let channels = bn.mean.len();
                check_nchw(z, channels, "patchified FLUX.2 latent")?;
                let scaled = z.channel_affine(&bn.std(), &bn.mean)?;
                unpatchify2x2(&scaled)
            }
        }
    }

    /// The inverse for encoded means: AutoencoderKL `(mean - shift_factor) · scaling_factor`;
    /// FLUX.2 patchify 2×2, then `(x - mean) / sqrt(var + eps)`.
    pub fn normalize_latents(&self, mean: &Tensor) -> Result<Tensor> {
        self.check_latent(mean)?;
        match &self.latent_bn {
            None => {
                let scale = self.config.scaling_factor.unwrap_or(1.0) as f32;
                if let Some((lmean, lstd)) = &self.config.latents_stats {
                    // `(mean - latents_mean) * scaling_factor / latents_std`, op by op.
                    let (lmean, lstd) = (to_f32(lmean), to_f32(lstd));
                    let zeros = vec![0.0; lstd.len()];
                    let ones = vec![1.0; lmean.len()];
                    let centred = mean.channel_normalize(&lmean, &ones)?.mul_scalar(scale)?;
                    return Ok(centred.channel_normalize(&zeros, &lstd)?);
                }
                let shifted = match self.config.shift_factor {
                    Some(shift) => mean.add_scalar(-(shift as f32))?,
                    None => mean.clone(),
                };
                Ok(shifted.mul_scalar(scale)?)
            }
            Some(bn) => {
                let patched = patchify2x2(mean)?;
                Ok(patched.channel_normalize(&bn.mean, &bn.std())?)
            }
        }
    }
}

fn to_f32(values: &[f64]) -> Vec<f32> {
    values.iter().map(|v| *v as f32).collect()
}

/// `[B, C, H, W]` → `[B, 4C, H/2, W/2]`, channel `c·4 + dy·2 + dx` (FLUX.2 `_patchify_latents`).
pub fn patchify2x2(x: &Tensor) -> Result<Tensor> {
    let d = x.dims().to_vec();
    if d.len() != 4 || !d[2].is_multiple_of(2) || !d[3].is_multiple_of(2) {
        return Err(ModelError::InvalidInput(format!("cannot patchify a latent of shape {:?} 2x2", d)));
    }
    let (b, c, h, w) = (d[0], d[1], d[2], d[3]);
    Ok(x.reshape(vec![b, c, h / 2, 2, w / 2, 2])?.permute(&[0, 1, 3, 5, 2, 4])?.reshape(vec![
        b,
        c * 4,
        h / 2,
        w / 2,
    ])?)
}

/// The inverse of [`patchify2x2`] (FLUX.2 `_unpatchify_latents`).
pub fn unpatchify2x2(x: &Tensor) -> Result<Tensor> {
    let d = x.dims().to_vec();
    if d.len() != 4 || !d[1].is_multiple_of(4) {
        return Err(ModelError::InvalidInput(format!("cannot unpatchify a latent of shape {:?}", d)));
    }
    let (b, c, h, w) = (d[0], d[1] / 4, d[2], d[3]);
    Ok(x.reshape(vec![b, c, 2, 2, h, w])?.permute(&[0, 1, 4, 2, 5, 3])?.reshape(vec![b, c, h * 2, w * 2])?)
}

fn check_nchw(t: &Tensor, channels: usize, what: &str) -> Result<()> {
    let d = t.dims();
    if d.len() != 4 {
        return Err(ModelError::InvalidInput(format!("{what} must be [B, C, H, W], got shape {:?}", d)));
    }
    if d[1] != channels {
        return Err(ModelError::InvalidInput(format!("{what} has {} channels, the model expects {channels}", d[1])));
    }
    if d.contains(&0) {
        return Err(ModelError::InvalidInput(format!("{what} of shape {:?} is empty", d)));
    }
    crate::checks::check_finite(t, what)
}
