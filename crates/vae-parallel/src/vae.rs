//! [`Vae`]: a diffusers VAE directory loaded through the family registry, ready to serve decode
//! and encode requests on any [`Group`](crate::Group) of ranks.
//!
//! Model policy (supported modes, strategy, tile geometry, output placement) comes from the
//! family ([`LoadedVae`]); `Vae` holds the request-wide pieces every family shares: precision
//! scopes, pipeline (de)normalisation, which pixels a request follows ([`Tiling`]), `auto`'s
//! choice by the cost model, and the owner's log of the strategy that ran.

use std::path::{Path, PathBuf};

use vae_models::{Direction, Execution, LoadedVae, ModelError, TileOverrides};
use vae_planner::cost::{DeviceKind, DeviceProfile};
use vae_runtime::{
    DistributedVaeExecutor, ExecOutput, FrameSink, OutputPlacement, ParallelMode, Predicted, RuntimeError, Strategy,
    StrategyChoice,
};
use vae_tensor::{DType, Device, Tensor};

use crate::cost::{self, Constants, CostSettings};
use crate::error::{Error, Result};
use crate::launch::TransportKind;
use crate::options::{Decode, Encode, EncodeOutput, Options, Tiling};

/// Where the cost model's device constants come from.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum CostProfile {
    /// The profile `vae-parallel calibrate` wrote in its default place, else this CPU's probed
    /// constants: the built-in ones scaled by a first-use probe of a few seconds, cached per
    /// CPU ([`cost::probe`]), run when a request first needs them (`auto` on rank 0) rather than
    /// at load; the built-in ones as they are under `VAE_COST_PROBE=0`.
    #[default]
    Default,
    /// A profile file `calibrate` wrote.
    File(PathBuf),
    /// These constants.
    Given(DeviceProfile),
    /// No cost model: `auto` follows the family's rules, reports carry no prediction, and a
    /// memory cap is refused.
    Off,
}

/// How to load a [`Vae`]: `Vae::builder(dir)`, then the settings, then [`VaeBuilder::build`].
#[derive(Debug, Clone)]
#[must_use]
pub struct VaeBuilder {
    dir: PathBuf,
    device: Device,
    dtype: DType,
    tf32: bool,
    tiling: TileOverrides,
    decode_timestep: Option<f64>,
    profile: CostProfile,
}

impl VaeBuilder {
    /// Where the weights live and the model computes (default: the CPU). A CUDA device that
    /// cannot be used is an error at [`build`](Self::build)
    /// ([`crate::settings`] resolves `cuda` to the CPU with a warning instead).
    pub fn device(mut self, device: Device) -> Self {
        self.device = device;
        self
    }

    /// The element type the model computes in: f32 (default) anywhere; bf16 on CUDA (bf16
    /// tensors) and on a CPU with AVX512-BF16 (f32 tensors whose convolutions multiply in bf16;
    /// elsewhere a typed error naming the missing feature). Inputs and outputs stay f32.
    pub fn dtype(mut self, dtype: DType) -> Self {
        self.dtype = dtype;
        self
    }

    /// f32 convolutions as one TF32 product each (PyTorch's default for an f32 model on a GPU;
    /// CUDA only, the CPU is unchanged).
    pub fn tf32(mut self, on: bool) -> Self {
        self.tf32 = on;
        self
    }

    /// The tile geometry, as the keywords of diffusers' `enable_tiling` (each family takes
    /// its class's keywords and refuses the others).
    pub fn tiling(mut self, tiling: TileOverrides) -> Self {
        self.tiling = tiling;
        self
    }

    /// The timestep a timestep-conditioned decoder decodes at (LTX-Video's `decode_timestep`).
    pub fn decode_timestep(mut self, timestep: f64) -> Self {
        self.decode_timestep = Some(timestep);
        self
    }

    /// Where the cost model's constants come from (default: the calibrated profile, else
    /// built-in constants).
    pub fn cost_profile(mut self, profile: CostProfile) -> Self {
        self.profile = profile;
        self
    }

    /// Loads the model.
    pub fn build(self) -> Result<Vae> {
        let cpu_bf16 = self.device.is_cpu() && self.dtype == DType::BF16;
        if cpu_bf16 {
            // Refused here, before the weights load, where the CPU cannot do it.
            drop(vae_tensor::CpuBf16Scope::enter().map_err(ModelError::from)?);
        }
        if self.tf32 && self.device.is_cpu() {
            return Err(Error::Model(ModelError::Unsupported(
                "TF32 convolutions need a CUDA device (the CPU computes in f32 or bf16)".into(),
            )));
        }
        let profile = match self.profile {
            CostProfile::Default => {
                Some(cost::calibrated_profile().map_or(Constants::ThisCpu, |p| Constants::Given(Box::new(p))))
            }
            CostProfile::File(path) => Some(Constants::Given(Box::new(cost::read_profile(&path)?))),
            CostProfile::Given(profile) => Some(Constants::Given(Box::new(profile))),
            CostProfile::Off => None,
        };
        if let Some(Constants::Given(p)) = &profile {
            import_conv_choices(p)?;
        }
        let dtype = if cpu_bf16 { DType::F32 } else { self.dtype };
        let mut model = vae_models::family::load(&self.dir, self.device, dtype)?;
        model.enable_tiling(&self.tiling)?;
        if let Some(t) = self.decode_timestep {
            model.set_decode_timestep(t)?;
        }
        Ok(Vae { model, dir: self.dir, tf32: self.tf32, cpu_bf16, profile })
    }
}

/// A loaded VAE: a diffusers directory (`config.json` and safetensors weights) of any family
/// the registry knows (AutoencoderKL for SD / FLUX.1 / Z-Image, FLUX.2, Wan2.1 / 2.2,
/// Qwen-Image, HunyuanVideo-1.5, LTX-Video / LTX-2). Its requests run on a
/// [`Group`](crate::Group); one `Vae` serves any number of requests, in any mode, and the
/// local ranks of a group share it (its weights are in memory once).
///
/// ```
/// # let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../fixtures/autoencoder_kl/sd_like");
/// use vae_parallel::{Decode, Device, Group, Tensor, Vae};
///
/// let vae = Vae::load(dir)?;
/// assert_eq!(vae.class_name(), "AutoencoderKL");
/// let latent = Tensor::seeded_uniform([1, 4, 16, 16], 7, -1.0, 1.0, &Device::Cpu)?;
/// let image = Group::local(2)?.decode(&vae, &latent, &Decode::default())?.unwrap();
/// assert_eq!(image.dims(), &[1, 3, 128, 128]);
/// # Ok::<(), vae_parallel::Error>(())
/// ```
pub struct Vae {
    model: Box<dyn LoadedVae>,
    dir: PathBuf,
    /// f32 convolutions as one TF32 product each, on the threads that run requests.
    tf32: bool,
    /// A CPU model loaded for bf16: f32 weights and activations, convolutions with bf16
    /// products ([`vae_tensor::CpuBf16Scope`]) on the threads that run requests.
    cpu_bf16: bool,
    /// The cost model's device constants: predictions in every report, and `auto` choosing by
    /// them (None: the family's rules).
    profile: Option<Constants>,
}

impl std::fmt::Debug for Vae {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vae").field("dir", &self.dir).field("class", &self.model.class_name()).finish()
    }
}

impl Vae {
    /// Loads a diffusers VAE directory onto the CPU in f32, with the calibrated cost profile
    /// (or this CPU's probed constants: [`CostProfile::Default`]).
    pub fn load(dir: impl AsRef<Path>) -> Result<Self> {
        Self::builder(dir).build()
    }

    /// A builder for a model on another device or in another precision, with other tiles.
    pub fn builder(dir: impl AsRef<Path>) -> VaeBuilder {
        VaeBuilder {
            dir: dir.as_ref().to_path_buf(),
            device: Device::Cpu,
            dtype: DType::F32,
            tf32: false,
            tiling: TileOverrides::default(),
            decode_timestep: None,
            profile: CostProfile::Default,
        }
    }

    /// The diffusers class (`_class_name`).
    pub fn class_name(&self) -> &'static str {
        self.model.class_name()
    }

    /// The model directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where the model computes.
    pub fn device(&self) -> Device {
        self.model.device()
    }

    /// The element type the model computes in (bf16 for a CPU bf16 model, whose tensors are
    /// f32).
    pub fn compute_dtype(&self) -> DType {
        if self.cpu_bf16 { DType::BF16 } else { self.model.dtype() }
    }

    /// Whether f32 convolutions take one TF32 product each.
    pub fn tf32(&self) -> bool {
        self.tf32
    }

    /// The loaded model, for the family's own API.
    pub fn model(&self) -> &dyn LoadedVae {
        self.model.as_ref()
    }

    /// The cost model's device constants, if it has any. Under [`CostProfile::Default`] on a
    /// CPU nobody calibrated, this CPU's probed constants: the probe runs first (seconds, once
    /// per CPU) where no request has needed it yet.
    pub fn cost_profile(&self) -> Option<&DeviceProfile> {
        self.profile.as_ref().map(|c| c.get(true))
    }

    /// Replaces the cost model's constants (None: the family's rules). A GPU profile's
    /// convolution choices are imported into this process, as at load.
    pub fn set_cost_profile(&mut self, profile: Option<DeviceProfile>) -> Result<()> {
        if let Some(p) = &profile {
            import_conv_choices(p)?;
        }
        self.profile = profile.map(|p| Constants::Given(Box::new(p)));
        Ok(())
    }

    /// Whether the family streams a video decode frame by frame
    /// ([`Group::decode_to`](crate::Group::decode_to)).
    pub fn streams(&self) -> bool {
        self.model.streams()
    }

    /// The modes this model accepts.
    pub fn supported_modes(&self) -> Vec<ParallelMode> {
        ParallelMode::ALL.into_iter().filter(|m| self.check_mode(*m).is_ok()).collect()
    }

    /// Refuses, with a typed error naming the class, a mode this model cannot run (every
    /// request checks it again).
    pub fn check_mode(&self, mode: ParallelMode) -> Result<()> {
        Ok(self.model.check_mode(mode)?)
    }

    /// Who receives the output of a `direction` request with these options.
    pub fn placement(&self, direction: Direction, options: &Options) -> OutputPlacement {
        options.placement.unwrap_or_else(|| self.model.default_placement(direction))
    }

    /// For a process that serves one stage of pipelined decodes (mode `pipeline` over
    /// processes): lets go of every weight but those of the stage `rank` runs in a pipelined
    /// decode of `latent_dims` latents over `ranks` ranks; returns its decoder steps. The model
    /// then serves such decodes and refuses every other request.
    pub fn keep_only_pipeline_stage(
        &mut self,
        latent_dims: &[usize],
        ranks: usize,
        rank: usize,
    ) -> Result<std::ops::Range<usize>> {
        Ok(self.model.keep_only_pipeline_stage(latent_dims, ranks, rank)?)
    }

    /// The calling thread's precision scopes for one request.
    fn scopes(&self) -> Result<(Option<vae_tensor::Tf32Scope>, Option<vae_tensor::CpuBf16Scope>)> {
        let tf32 = self.tf32.then(vae_tensor::Tf32Scope::enter);
        let bf16 = match self.cpu_bf16 {
            true => Some(vae_tensor::CpuBf16Scope::enter().map_err(ModelError::from)?),
            false => None,
        };
        Ok((tf32, bf16))
    }

    /// One rank's part of a decode over the executor's ranks; every rank calls it with the
    /// same latent. [`Group::decode`](crate::Group::decode) calls it on each rank and owns what
    /// surrounds it (the abort rule, the owner's result, the report); call it directly only
    /// to drive ranks yourself.
    pub fn decode_on(
        &self,
        executor: &DistributedVaeExecutor,
        latent: &Tensor,
        options: &Decode,
    ) -> Result<ExecOutput> {
        options.validate()?;
        let _scopes = self.scopes()?;
        let mut denormalized = None;
        let z = self.decoder_input(latent, options, &mut denormalized)?;
        self.run(executor, Direction::Decode, z, options)
    }

    /// One rank's part of an encode of an image in [-1, 1]; see [`Self::decode_on`].
    pub fn encode_on(&self, executor: &DistributedVaeExecutor, image: &Tensor, options: &Encode) -> Result<ExecOutput> {
        options.validate()?;
        let _scopes = self.scopes()?;
        self.model.check_mode(options.mode)?;
        let mut out = self.run(executor, Direction::Encode, image, options)?;
        if let Some(moments) = out.tensor.take() {
            out.tensor = Some(match options.output {
                EncodeOutput::Moments => moments,
                EncodeOutput::Mean => {
                    let mean = moments.diag_gaussian_mean().map_err(ModelError::from)?;
                    if options.latents_normalized { self.model.normalize_latents(&mean)? } else { mean }
                }
            });
        }
        Ok(out)
    }

    /// One rank's part of a decode of a video latent whose output frames go to `sink` as they
    /// are decoded (the owner's; `None` on the other ranks): bit for bit the frames of the same
    /// decode unstreamed, with memory that does not grow with the frame count for the causal
    /// video families. On one rank without tiling it is the direct decode, outside the
    /// executor (no report: `None`); otherwise the strategy the family chooses, streamed.
    pub fn decode_streaming_on(
        &self,
        executor: &DistributedVaeExecutor,
        latent: &Tensor,
        options: &Decode,
        sink: Option<&mut dyn FrameSink>,
    ) -> Result<Option<ExecOutput>> {
        options.validate()?;
        let _scopes = self.scopes()?;
        let mut denormalized = None;
        let z = self.decoder_input(latent, options, &mut denormalized)?;
        if executor.communicator().size() == 1 && !options.tiling.tiles(executor.parallel_size()) {
            // Outside the executor: cancelling the group must still stop it at a frame.
            let _cancel = vae_runtime::cancel::CancelScope::enter(std::sync::Arc::clone(executor.communicator()));
            let sink = sink.ok_or_else(|| ModelError::Unsupported("a streamed decode needs a frame sink".into()))?;
            self.model.decode_streaming(z, sink)?;
            return Ok(None);
        }
        let _convolutions = agree_on_convolutions(executor)?;
        // The executor works on host tensors: a device latent crosses to the host once.
        let on_host;
        let z = if z.device().is_cpu() {
            z
        } else {
            tracing::debug!(device = %z.device(), "a streamed decode of a device latent: copied to the host once");
            on_host = z.to_device(&Device::Cpu).map_err(ModelError::from)?;
            &on_host
        };
        let (choice, use_tiling, predicted) = self.choose(executor, Direction::Decode, z.dims(), options)?;
        let run = Execution {
            executor,
            direction: Direction::Decode,
            input: z,
            strategy: choice.strategy,
            use_tiling,
            placement: OutputPlacement::OwnerOnly,
        };
        let out = self.model.execute_streaming(run, sink)?;
        Ok(Some(with_reason(out, choice, predicted)))
    }

    /// Latents as the family's diffusion pipeline produces them → latents the VAE decodes.
    pub(crate) fn denormalize(&self, z: &Tensor) -> Result<Tensor> {
        Ok(self.model.denormalize_latents(z)?)
    }

    /// The latent a decode request gives the VAE (after checking the request's mode): as given,
    /// or with the pipeline's normalisation undone (kept in `slot`).
    fn decoder_input<'a>(
        &self,
        latent: &'a Tensor,
        options: &Options,
        slot: &'a mut Option<Tensor>,
    ) -> Result<&'a Tensor> {
        self.model.check_mode(options.mode)?;
        if !options.latents_normalized {
            return Ok(latent);
        }
        Ok(slot.insert(self.model.denormalize_latents(latent)?))
    }

    /// One request, in the strategy chosen for it.
    ///
    /// An input on the model's CUDA device (a DLPack or candle tensor) stays there where the
    /// request is one whole untiled computation on one rank: the model reads it in place and
    /// its result is left on the device ([`Self::run_on_device`]). Every other path (tiles,
    /// bands, several ranks) works on host tensors: the input is copied to the host once and
    /// the result back to the device once. An input on another device is refused.
    fn run(
        &self,
        executor: &DistributedVaeExecutor,
        direction: Direction,
        input: &Tensor,
        options: &Options,
    ) -> Result<ExecOutput> {
        let _convolutions = agree_on_convolutions(executor)?;
        let device = self.model.device();
        if !input.device().is_cpu() && input.device() != device {
            return Err(Error::Model(ModelError::InvalidInput(format!(
                "the input is on {}, the model on {device}: move it to the model's device or the CPU first",
                input.device()
            ))));
        }
        let (choice, use_tiling, predicted) = self.choose(executor, direction, input.dims(), options)?;
        if input.device().is_cpu() {
            let out = self.execute(executor, direction, input, options, choice.strategy, use_tiling)?;
            return Ok(with_reason(out, choice, predicted));
        }
        let whole = executor.communicator().size() == 1 && choice.strategy == Strategy::Tile && !use_tiling;
        if whole {
            tracing::debug!(%device, "the input is on the model's device: computed in place, the result left there");
            let out = self.run_on_device(direction, input)?;
            return Ok(with_reason(out, choice, predicted));
        }
        tracing::debug!(
            %device,
            strategy = ?choice.strategy,
            use_tiling,
            ranks = executor.communicator().size(),
            "a device input on a path that works on host tensors: copied to the host once, the result back to \
             the device once"
        );
        let host = input.to_device(&Device::Cpu).map_err(ModelError::from)?;
        let mut out = self.execute(executor, direction, &host, options, choice.strategy, use_tiling)?;
        out.tensor = out.tensor.map(|t| t.to_device(&device)).transpose().map_err(ModelError::from)?;
        Ok(with_reason(out, choice, predicted))
    }

    /// The request through the family's executor (host tensors).
    fn execute(
        &self,
        executor: &DistributedVaeExecutor,
        direction: Direction,
        input: &Tensor,
        options: &Options,
        strategy: Strategy,
        use_tiling: bool,
    ) -> Result<ExecOutput> {
        Ok(self.model.execute(Execution {
            executor,
            direction,
            input,
            strategy,
            use_tiling,
            placement: self.placement(direction, options),
        })?)
    }

    /// A whole untiled computation of an input on the model's device, on this (the only)
    /// rank: the model reads the input in place and the result stays on the device
    /// ([`vae_models::ResultsOnDevice`]); no tile plan, no transport, no host copy. What the
    /// executor's one direct tile computes, bit for bit (the same model call).
    fn run_on_device(&self, direction: Direction, input: &Tensor) -> Result<ExecOutput> {
        // The report's peak is this request's, as the executor's requests reset it.
        vae_tensor::memory::reset_peak();
        let start_bytes = vae_tensor::memory::live_bytes();
        let clock = std::time::Instant::now();
        let tensor = {
            let _on_device = vae_models::ResultsOnDevice::enter();
            match direction {
                Direction::Decode => self.model.decode(input)?,
                Direction::Encode => self.model.encode_moments(input)?,
            }
        };
        let report =
            vae_runtime::RankReport::whole_on_one_rank(clock.elapsed(), tensor.elem_count() as u64, start_bytes);
        Ok(ExecOutput { tensor: Some(tensor), report })
    }

    /// The cost model's settings for a request on `executor`'s group, where the profile
    /// predicts for this model: its own kind of device, and a GPU profile its element type (a
    /// model on another device or in another type runs by the family's rules). Ranks share the
    /// host's cores as their group places them: a local rank or a rank process on its pool
    /// (the calling thread's), NCCL ranks a GPU each, other ranks on a GPU sharing it. `decides`:
    /// the request's choice depends on the constants here (rank 0 under `auto`), so this CPU's
    /// are probed first where they have not been ([`Constants::get`]).
    fn cost_settings(&self, executor: &DistributedVaeExecutor, decides: bool) -> Option<CostSettings> {
        let constants = self.profile.as_ref()?;
        let on_gpu = !self.model.device().is_cpu();
        if (constants.kind() == DeviceKind::Cuda) != on_gpu {
            return None;
        }
        let profile = constants.get(decides);
        let elem = self.model.dtype().size_in_bytes() as u64;
        if profile.map_bytes().is_some_and(|b| b != elem) {
            return None;
        }
        let comm = executor.communicator();
        // A local rank runs on its pool, a rank process on its own threads: the calling
        // thread's pool either way.
        let transport = match comm.backend() {
            "local" => TransportKind::Local,
            "nccl" => TransportKind::Nccl,
            _ => TransportKind::Socket,
        };
        let threads = rayon::current_num_threads();
        let placement = match (profile.kind, transport) {
            // The rank's own pool (twice its even share of the process's threads).
            (DeviceKind::Cpu, TransportKind::Local) => crate::local_ranks::host_placement(threads, comm.size()),
            _ => cost::placement(profile.kind, transport, threads, comm.size(), crate::launch::ranks_per_host()),
        };
        Some(CostSettings { profile: profile.clone(), placement })
    }

    /// The strategy for one request, whether it tiles, and the cost model's prediction for it.
    ///
    /// Under `auto` with a cost model for the family, the fastest predicted strategy that
    /// fits `max_memory_per_rank` among those that give the pixels [`Options::tiling`] asks
    /// for; the cost model's inputs (a rank's profile, threads and device) may differ between
    /// ranks, so rank 0's decision (a strategy, the family's rules, or a refusal) is broadcast
    /// and every rank follows it. Otherwise the family's choice (which depends on global
    /// quantities only), held to the pixels asked for: untiled pixels where the family chose
    /// tiles run on one rank, with a warning naming why.
    fn choose(
        &self,
        executor: &DistributedVaeExecutor,
        direction: Direction,
        dims: &[usize],
        options: &Options,
    ) -> Result<(StrategyChoice, bool, Option<Predicted>)> {
        let ranks = executor.parallel_size();
        let model = self.model.as_ref();
        // Only rank 0's choice counts (it is broadcast), and only a choice between two strategies
        // or more needs this CPU's constants: the other ranks' predictions, and a request with
        // one candidate (the memory constants are the built-in ones either way), need not wait
        // for a probe.
        let mut settings = self.cost_settings(executor, false);
        if options.mode == ParallelMode::Auto && executor.communicator().rank() == 0 {
            let choices = settings
                .as_ref()
                .and_then(|s| cost::candidates(model, direction, dims, ranks, options.tiling, s))
                .map_or(0, |c| c.len());
            if choices > 1 {
                settings = self.cost_settings(executor, true);
            }
        }
        let cap = options.max_memory_per_rank;
        let human_bytes = crate::report::human_bytes;
        let no_model = || -> Error {
            Error::Cost(match &self.profile {
                None => cost::CostError::NoProfile,
                Some(_) => cost::CostError::NoModel {
                    class: format!("{} on {}", model.class_name(), model.device()),
                    dims: dims.to_vec(),
                },
            })
        };
        if options.mode == ParallelMode::Auto {
            // What this rank would run: the cost model's choice, a refusal, or the family's rules
            // (no cost model here). Each rank's profile, threads and device are its own, so
            // rank 0 decides for the group, also for ranks that have no cost model.
            let candidates = settings
                .as_ref()
                .and_then(|s| cost::candidates(model, direction, dims, ranks, options.tiling, s))
                .filter(|c| !c.is_empty());
            let local: Result<Option<&cost::Candidate>> = match &candidates {
                Some(all) => cost::choose(all, cap, ranks).map(Some).map_err(Error::from),
                None if cap.is_some() => Err(no_model()),
                None => Ok(None),
            };
            let mine = match &local {
                Ok(Some(c)) => Decision::Run(c.strategy, c.use_tiling),
                Ok(None) => Decision::Rules,
                Err(_) => Decision::Refuse,
            };
            match agree_on_choice(executor, mine)? {
                // Every rank refuses this request alike: the group stays usable.
                Decision::Refuse => {
                    return Err(Error::Refused(match local {
                        Err(Error::Cost(e)) => e,
                        _ => cost::CostError::RefusedByOwner,
                    }));
                }
                Decision::Rules => {}
                Decision::Run(strategy, tiling) => {
                    let prediction = candidates.as_deref().and_then(|all| cost::prediction_of(all, strategy, tiling));
                    let cap = cap.map(|c| format!(" within {}", human_bytes(c))).unwrap_or_default();
                    let figures = prediction.map_or_else(String::new, |p| {
                        format!(" ({:.0} ms, {} per rank)", p.prediction.ms, human_bytes(p.prediction.peak_bytes))
                    });
                    let label = prediction.map_or_else(|| format!("{strategy:?}"), |p| p.label.clone());
                    let choice =
                        StrategyChoice::chosen(strategy, format!("auto: {label}, the fastest predicted{cap}{figures}"));
                    let predicted =
                        prediction.map(|p| Predicted { ms: p.prediction.ms, peak_bytes: p.prediction.peak_bytes });
                    return Ok((announce(executor, choice), tiling, predicted));
                }
            }
        } else if cap.is_some() {
            // Refused alike on every rank, as rank 0 decides.
            let mine = if settings.is_none() { Decision::Refuse } else { Decision::Rules };
            if agree_on_choice(executor, mine)? == Decision::Refuse {
                return Err(Error::Refused(match (settings.is_none(), no_model()) {
                    (true, Error::Cost(e)) => e,
                    _ => cost::CostError::RefusedByOwner,
                }));
            }
            if executor.communicator().rank() == 0 {
                tracing::warn!(mode = %options.mode, "`max_memory_per_rank` applies to `vae_parallel_mode` auto; ignored");
            }
        }
        let choice = with_grid(model.strategy(direction, options.mode, dims, ranks), options);
        let (choice, use_tiling) = follow_tiling(choice, options, ranks, direction);
        let choice = announce(executor, choice);
        let prediction = settings
            .as_ref()
            .and_then(|s| cost::predict_strategy(model, direction, dims, ranks, choice.strategy, use_tiling, s));
        let predicted = prediction.map(|p| Predicted { ms: p.ms, peak_bytes: p.peak_bytes });
        Ok((choice, use_tiling, predicted))
    }
}

/// The family's choice with the grid the request names: a 2-D shard on `options.shard_grid`,
/// whatever the family would have chosen by default (its default grid, or tiles when that grid
/// does not fit). The executor checks the named grid against the input and the ranks and
/// refuses one that does not fit with an agreed error, rather than tiling silently.
fn with_grid(mut choice: StrategyChoice, options: &Options) -> StrategyChoice {
    let Some(grid) = options.shard_grid else { return choice };
    choice.fallback = false;
    choice.strategy = Strategy::Shard2d(grid);
    choice.reason = format!("{} requested: {} × {} blocks (`shard_grid`)", options.mode, grid[0], grid[1]);
    choice
}

/// The family's choice held to the pixels the request asks for, and whether a tile strategy
/// tiles. Untiled pixels where the family chose tiles on several ranks: the direct computation
/// on one rank, flagged so that the owner warns why. Tiled pixels under `auto`: tiles, though
/// the family's rule would shard (a named shard mode keeps its shard: a shard has no tiles).
fn follow_tiling(
    mut choice: StrategyChoice,
    options: &Options,
    ranks: usize,
    direction: Direction,
) -> (StrategyChoice, bool) {
    let verb = match direction {
        Direction::Decode => "decode",
        Direction::Encode => "encode",
    };
    match options.tiling {
        Tiling::Off if choice.strategy == Strategy::Tile && ranks > 1 => {
            choice.reason = format!("{}; the untiled {verb} runs on one rank (tiling is off)", choice.reason);
            choice.fallback = true;
        }
        Tiling::On if options.mode == ParallelMode::Auto && choice.strategy != Strategy::Tile => {
            choice = StrategyChoice::chosen(Strategy::Tile, "auto: tiled pixels asked for (`vae_use_tiling`); tiles");
        }
        // A named shard or pipeline has no tiles: the untiled pixels, though tiled ones were asked.
        Tiling::On if choice.strategy != Strategy::Tile => {
            choice.reason =
                format!("{}; untiled pixels, though tiling is on (a {} has no tiles)", choice.reason, options.mode);
            choice.fallback = true;
        }
        _ => {}
    }
    let use_tiling = options.tiling.tiles(ranks);
    (choice, use_tiling)
}

/// Logs a decision once per request (on the owner, not once per rank): a forced mode that fell
/// back, or an untiled request that runs on one rank, is a warning; any other choice a debug
/// line.
fn announce(executor: &DistributedVaeExecutor, choice: StrategyChoice) -> StrategyChoice {
    if executor.communicator().rank() == 0 {
        if choice.fallback {
            tracing::warn!(reason = %choice.reason, "VAE parallel mode fell back: {}", choice.reason);
        } else {
            tracing::debug!(strategy = ?choice.strategy, reason = %choice.reason, "VAE parallel strategy");
        }
    }
    choice
}

/// What `auto` runs, as one rank sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Decision {
    /// The cost model's choice: a strategy, and whether it tiles.
    Run(Strategy, bool),
    /// No cost model (no profile for this device, or none for this family): the family's rules.
    Rules,
    /// Nothing fits the memory cap, or a cap without a cost model.
    Refuse,
}

/// Rank 0's decision, the same on every rank: one broadcast of `[what, kind, rows, columns,
/// tiles]` over the group (nothing on one rank).
fn agree_on_choice(executor: &DistributedVaeExecutor, mine: Decision) -> Result<Decision> {
    use vae_planner::ShardAxis;
    use vae_transport::CommunicatorExt;
    let comm = executor.communicator();
    if comm.size() <= 1 {
        return Ok(mine);
    }
    let mut word: Vec<u64> = match mine {
        Decision::Refuse => vec![0; 5],
        Decision::Rules => vec![2, 0, 0, 0, 0],
        Decision::Run(strategy, tiling) => {
            let (kind, [r, c]) = match strategy {
                Strategy::Tile => (1, [0, 0]),
                Strategy::Shard(ShardAxis::Height) => (2, [0, 0]),
                Strategy::Shard(ShardAxis::Width) => (3, [0, 0]),
                Strategy::Shard2d(grid) => (4, grid),
                Strategy::Pipeline => (5, [0, 0]),
            };
            vec![1, kind, r as u64, c as u64, u64::from(tiling)]
        }
    };
    comm.broadcast(0, &mut word).map_err(RuntimeError::from)?;
    let strategy = match word.as_slice() {
        [0, ..] => return Ok(Decision::Refuse),
        [2, ..] => return Ok(Decision::Rules),
        [1, 1, ..] => Strategy::Tile,
        [1, 2, ..] => Strategy::Shard(ShardAxis::Height),
        [1, 3, ..] => Strategy::Shard(ShardAxis::Width),
        [1, 4, r, c, _] => Strategy::Shard2d([*r as usize, *c as usize]),
        [1, 5, ..] => Strategy::Pipeline,
        other => {
            return Err(RuntimeError::Protocol(format!("rank 0 sent an unreadable strategy {other:?}")).into());
        }
    };
    Ok(Decision::Run(strategy, word[4] == 1))
}

/// A GPU profile's per-layer convolution choices (`calibrate --model`), imported into this
/// process: its convolutions under `fastest` run them instead of being timed, and as rank 0 of
/// a group of processes it hands them to every rank ([`agree_on_convolutions`]).
fn import_conv_choices(profile: &DeviceProfile) -> Result<()> {
    if profile.conv_choices.is_empty() {
        return Ok(());
    }
    let text: String = profile.conv_choices.iter().map(|l| format!("{l}\n")).collect();
    let n = vae_tensor::cuda::import_conv_choices(&text).map_err(ModelError::from)?;
    tracing::info!("{n} convolution choices read from the cost profile");
    Ok(())
}

/// Rank 0's convolution decision (its route and per-layer choices, see
/// [`vae_tensor::cuda::conv_decision`]), followed by every rank of a group of processes for
/// one request: one broadcast of its text before the request's first convolution, as `auto`'s
/// strategy is agreed ([`agree_on_choice`]). Ranks that are processes may have been given
/// other `VAE_CUDA_CONV` settings or tables, or would time a layer to other winners; following
/// rank 0's text alone they run the same implementation per layer, so that their parts are
/// bit-identical to one rank's under it. Local ranks share the process's table (a layer is
/// timed once, under its lock) and need none. The broadcast happens on every request of a
/// group of processes, on any device, so that no rank's own settings decide whether it
/// takes part.
fn agree_on_convolutions(executor: &DistributedVaeExecutor) -> Result<Option<vae_tensor::cuda::ConvDecisionScope>> {
    use vae_transport::CommunicatorExt;
    let comm = executor.communicator();
    if comm.size() <= 1 || comm.backend() == "local" {
        return Ok(None);
    }
    let mut text = match comm.rank() {
        0 => vae_tensor::cuda::conv_decision().map_err(ModelError::from)?.into_bytes(),
        _ => Vec::new(),
    };
    comm.broadcast(0, &mut text).map_err(RuntimeError::from)?;
    let text = String::from_utf8(text)
        .map_err(|_| RuntimeError::Protocol("rank 0 sent a convolution decision that is not UTF-8".into()))?;
    let scope = vae_tensor::cuda::ConvDecisionScope::enter(&text, comm.rank() != 0).map_err(ModelError::from)?;
    Ok(Some(scope))
}

/// The report carries the reason for the strategy that ran, and the cost model's prediction
/// for it.
fn with_reason(mut out: ExecOutput, choice: StrategyChoice, predicted: Option<Predicted>) -> ExecOutput {
    out.report.fallback = choice.fallback;
    out.report.reason = Some(choice.reason);
    out.report.predicted = predicted;
    out
}
