//! The engine: load a diffusers VAE directory, serve decode and encode requests over a group
//! of ranks. Model policy (supported modes, tile geometry, output placement) comes from the
//! family's adapter in `vae-models`; the engine only routes.

use std::path::{Path, PathBuf};

use vae_models::autoencoder_kl::{AutoencoderKl, KlOperator, KlTask};
use vae_models::wan::{VideoVaeClass, WanDecodeOperator, WanEncodeOperator, WanShardDecodeOperator, WanVae};
use vae_models::{Direction, Family, ModelError};
use vae_runtime::{
    DistributedVaeExecutor, ExecOutput, OutputPlacement, ParallelMode, RuntimeError, Strategy, StrategyChoice,
};
use vae_tensor::Tensor;

/// Errors of the engine.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The model could not be loaded or refused the request.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The distributed run failed.
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    /// The directory holds a VAE class vae-parallel does not implement (yet).
    #[error("{path}: {message}")]
    Unsupported {
        /// The model directory.
        path: PathBuf,
        /// Why.
        message: String,
    },
}

/// How one request runs.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestOptions {
    /// `--vae-parallel-mode`.
    pub mode: ParallelMode,
    /// `--vae-use-tiling` (forced on by a parallel size above 1, as the reference does).
    pub use_tiling: bool,
    /// Latents are as the diffusion pipeline produces them (normalised): undo / apply the
    /// family's normalisation around the VAE.
    pub latents_normalized: bool,
    /// Who receives the output; `None` = the family's contract.
    pub placement: Option<OutputPlacement>,
}

impl Default for RequestOptions {
    fn default() -> Self {
        Self { mode: ParallelMode::Tile, use_tiling: false, latents_normalized: false, placement: None }
    }
}

/// What `encode` returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EncodeOutput {
    /// The raw moments (mean and log-variance) after `quant_conv`.
    Moments,
    /// The mean of the latent distribution.
    Mean,
}

/// A loaded model.
pub enum Model {
    /// AutoencoderKL or AutoencoderKLFlux2.
    AutoencoderKl(Box<AutoencoderKl>),
    /// AutoencoderKLWan (Wan2.1-style) or AutoencoderKLQwenImage.
    Video(Box<WanVae>),
}

/// A loaded VAE ready to serve requests.
pub struct Engine {
    model: Model,
    dir: PathBuf,
    /// f32 convolutions as one TF32 product each (`--dtype tf32`), on the threads that run
    /// requests.
    tf32_convolutions: bool,
    /// A CPU model loaded for bf16: f32 weights and activations, convolutions with bf16
    /// products ([`vae_tensor::CpuBf16Scope`]) on the threads that run requests.
    cpu_bf16: bool,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").field("dir", &self.dir).field("family", &self.family()).finish()
    }
}

/// Reads `_class_name` from a model directory's `config.json`.
pub fn class_name(dir: &Path) -> Result<String, EngineError> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|source| ModelError::Io { path: path.clone(), source })?;
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| ModelError::Config { path: path.clone(), message: e.to_string() })?;
    Ok(value.get("_class_name").and_then(|v| v.as_str()).unwrap_or("AutoencoderKL").to_string())
}

impl Engine {
    /// Loads a diffusers VAE directory, with optional tile overrides (`tile_sample_min_size`,
    /// `tile_overlap_factor`).
    pub fn load(
        dir: &Path,
        tile_sample_min_size: Option<usize>,
        tile_overlap_factor: Option<f64>,
    ) -> Result<Self, EngineError> {
        Self::load_on(dir, tile_sample_min_size, tile_overlap_factor, vae_tensor::Device::Cpu, vae_tensor::DType::F32)
    }

    /// [`Self::load`] with the weights on `device` in `dtype`, where every family then
    /// computes (inputs, outputs, tiles and bands stay on the host, in f32). f32 anywhere; bf16
    /// on CUDA (bf16 tensors) and on a CPU with AVX512-BF16 (f32 tensors, convolutions with bf16
    /// products: see [`vae_tensor::CpuBf16Scope`]; elsewhere a typed error naming the missing
    /// CPU feature).
    pub fn load_on(
        dir: &Path,
        tile_sample_min_size: Option<usize>,
        tile_overlap_factor: Option<f64>,
        device: vae_tensor::Device,
        dtype: vae_tensor::DType,
    ) -> Result<Self, EngineError> {
        let class = class_name(dir)?;
        let cpu_bf16 = device.is_cpu() && dtype == vae_tensor::DType::BF16;
        if cpu_bf16 {
            // Refused here, before the weights load, where the CPU cannot do it.
            drop(vae_tensor::CpuBf16Scope::enter().map_err(ModelError::from)?);
        }
        let dtype = if cpu_bf16 { vae_tensor::DType::F32 } else { dtype };
        let model = match class.as_str() {
            "AutoencoderKL" | "AutoencoderKLFlux2" => {
                let mut m = AutoencoderKl::load_with(dir, device, dtype)?;
                m.set_tiling(tile_sample_min_size, tile_overlap_factor)?;
                Model::AutoencoderKl(Box::new(m))
            }
            "AutoencoderKLWan" | "AutoencoderKLQwenImage" => {
                if tile_sample_min_size.is_some() || tile_overlap_factor.is_some() {
                    return Err(EngineError::Unsupported {
                        path: dir.to_path_buf(),
                        message: format!(
                            "{class} tiles with --tile-sample-min-height/-width and \
                             --tile-sample-stride-height/-width, not --tile-sample-min-size / --tile-overlap-factor"
                        ),
                    });
                }
                Model::Video(Box::new(WanVae::load_with(dir, device, dtype)?))
            }
            other => {
                return Err(EngineError::Unsupported {
                    path: dir.to_path_buf(),
                    message: format!("{other:?} is not a VAE class vae-parallel knows"),
                });
            }
        };
        Ok(Self { model, dir: dir.to_path_buf(), tf32_convolutions: false, cpu_bf16 })
    }

    /// TF32 mode for the f32 convolutions of every request (see [`vae_tensor::Tf32Scope`]): what
    /// PyTorch does by default for an f32 model on a GPU. Only CUDA models change.
    pub fn set_tf32_convolutions(&mut self, on: bool) {
        self.tf32_convolutions = on;
    }

    /// The calling thread's TF32 mode for one request.
    fn tf32_scope(&self) -> Option<vae_tensor::Tf32Scope> {
        self.tf32_convolutions.then(vae_tensor::Tf32Scope::enter)
    }

    /// The calling thread's bf16 convolutions for one request of a CPU bf16 model.
    fn cpu_bf16_scope(&self) -> Result<Option<vae_tensor::CpuBf16Scope>, EngineError> {
        if !self.cpu_bf16 {
            return Ok(None);
        }
        Ok(Some(vae_tensor::CpuBf16Scope::enter().map_err(ModelError::from)?))
    }

    /// The element type the model computes in (bf16 for a CPU bf16 model, whose tensors are
    /// f32).
    pub fn compute_dtype(&self) -> vae_tensor::DType {
        if self.cpu_bf16 {
            return vae_tensor::DType::BF16;
        }
        match &self.model {
            Model::AutoencoderKl(m) => m.dtype(),
            Model::Video(m) => m.dtype(),
        }
    }

    /// Sets the tile geometry of a video VAE as diffusers' `enable_tiling(min_h, min_w,
    /// stride_h, stride_w)` does (pixels); other families tile by size and overlap instead.
    pub fn set_video_tiling(&mut self, min: [usize; 2], stride: [usize; 2]) -> Result<(), EngineError> {
        match &mut self.model {
            Model::Video(m) => Ok(m.set_tiling(min, stride)?),
            Model::AutoencoderKl(_) => Err(EngineError::Unsupported {
                path: self.dir.clone(),
                message: "AutoencoderKL-family VAEs tile with --tile-sample-min-size / --tile-overlap-factor".into(),
            }),
        }
    }

    /// The model directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The loaded model.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The family.
    pub fn family(&self) -> Family {
        match &self.model {
            Model::AutoencoderKl(m) => match m.config().variant {
                vae_models::autoencoder_kl::KlVariant::AutoencoderKl => Family::AutoencoderKl,
                vae_models::autoencoder_kl::KlVariant::Flux2 => Family::Flux2,
            },
            Model::Video(m) => match m.class() {
                VideoVaeClass::Wan => Family::Wan,
                VideoVaeClass::QwenImage => Family::QwenImage,
            },
        }
    }

    /// The modes this model accepts, for `inspect`.
    pub fn supported_modes(&self) -> Vec<ParallelMode> {
        ParallelMode::ALL.into_iter().filter(|m| self.check_mode(*m).is_ok()).collect()
    }

    /// Refuses, with a typed error naming the family, a mode this model cannot run (call it
    /// when the mode is configured; every request checks it again).
    pub fn check_mode(&self, mode: ParallelMode) -> Result<(), EngineError> {
        match &self.model {
            Model::AutoencoderKl(k) => Ok(k.check_mode(mode)?),
            Model::Video(v) => Ok(v.check_mode(mode)?),
        }
    }

    fn placement(&self, direction: Direction, options: &RequestOptions) -> OutputPlacement {
        options.placement.unwrap_or_else(|| self.family().default_placement(direction))
    }

    /// Decodes a latent over the executor's ranks. Every rank calls it with the same latent.
    pub fn decode(
        &self,
        executor: &DistributedVaeExecutor,
        latent: &Tensor,
        options: &RequestOptions,
    ) -> Result<ExecOutput, EngineError> {
        let _tf32 = self.tf32_scope();
        let _bf16 = self.cpu_bf16_scope()?;
        let use_tiling = options.use_tiling || executor.parallel_size() > 1;
        let placement = self.placement(Direction::Decode, options);
        let denormalized;
        match &self.model {
            Model::AutoencoderKl(model) => {
                model.check_mode(options.mode)?;
                let z = if options.latents_normalized {
                    denormalized = model.denormalize_latents(latent)?;
                    &denormalized
                } else {
                    latent
                };
                let choice = announce(executor, model.strategy(options.mode));
                let out = executor.execute(z, &KlOperator::new(model, KlTask::Decode, use_tiling), placement)?;
                Ok(with_reason(out, choice))
            }
            Model::Video(model) => {
                model.check_mode(options.mode)?;
                let z = if options.latents_normalized {
                    denormalized = model.denormalize_latents(latent)?;
                    &denormalized
                } else {
                    latent
                };
                let choice =
                    announce(executor, model.decode_strategy(options.mode, z.dims(), executor.parallel_size()));
                let out = match choice.strategy {
                    Strategy::Tile => executor.execute(z, &WanDecodeOperator::new(model, use_tiling), placement)?,
                    Strategy::Shard(axis) => {
                        executor.execute_sharded(z, &WanShardDecodeOperator::new(model), axis, placement)?
                    }
                };
                Ok(with_reason(out, choice))
            }
        }
    }

    /// Encodes an image in [-1, 1] over the executor's ranks; every rank calls it.
    pub fn encode(
        &self,
        executor: &DistributedVaeExecutor,
        image: &Tensor,
        options: &RequestOptions,
        output: EncodeOutput,
    ) -> Result<ExecOutput, EngineError> {
        let _tf32 = self.tf32_scope();
        let _bf16 = self.cpu_bf16_scope()?;
        if output == EncodeOutput::Moments && options.latents_normalized {
            return Err(ModelError::InvalidInput(
                "normalised output is defined for the mean, not the raw moments (use --output mean)".into(),
            )
            .into());
        }
        let use_tiling = options.use_tiling || executor.parallel_size() > 1;
        let placement = self.placement(Direction::Encode, options);
        let mut out = match &self.model {
            Model::AutoencoderKl(model) => {
                model.check_mode(options.mode)?;
                let choice = announce(executor, model.strategy(options.mode));
                with_reason(
                    executor.execute(image, &KlOperator::new(model, KlTask::Encode, use_tiling), placement)?,
                    choice,
                )
            }
            Model::Video(model) => {
                model.check_mode(options.mode)?;
                let choice = announce(executor, model.encode_strategy(options.mode));
                with_reason(executor.execute(image, &WanEncodeOperator::new(model, use_tiling), placement)?, choice)
            }
        };
        if let Some(moments) = out.tensor.take() {
            let shaped = match output {
                EncodeOutput::Moments => moments,
                EncodeOutput::Mean => {
                    let mean = moments.diag_gaussian_mean().map_err(ModelError::from)?;
                    match (&self.model, options.latents_normalized) {
                        (_, false) => mean,
                        (Model::AutoencoderKl(model), true) => model.normalize_latents(&mean)?,
                        (Model::Video(model), true) => model.normalize_latents(&mean)?,
                    }
                }
            };
            out.tensor = Some(shaped);
        }
        Ok(out)
    }
}

/// Logs a family's decision once per request (on the owner, not once per rank): a forced mode
/// that fell back to tile is a warning, any other choice a debug line.
fn announce(executor: &DistributedVaeExecutor, choice: StrategyChoice) -> StrategyChoice {
    if executor.communicator().rank() == 0 {
        if choice.fallback {
            tracing::warn!(reason = %choice.reason, "VAE parallel mode fell back to tile: {}", choice.reason);
        } else {
            tracing::debug!(strategy = ?choice.strategy, reason = %choice.reason, "VAE parallel strategy");
        }
    }
    choice
}

/// The report carries the family's reason for the strategy it ran.
fn with_reason(mut out: ExecOutput, choice: StrategyChoice) -> ExecOutput {
    out.report.reason = Some(choice.reason);
    out
}
