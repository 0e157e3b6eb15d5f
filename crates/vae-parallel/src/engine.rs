//! The engine: load a diffusers VAE directory through the family registry, serve decode and
//! encode requests over a group of ranks. Model policy (supported modes, strategy, tile
//! geometry, output placement) comes from the family ([`LoadedVae`]); the engine holds the
//! request-wide pieces every family shares: precision scopes, pipeline (de)normalisation,
//! the owner's log of the chosen strategy, and the report's reason.

use std::path::{Path, PathBuf};

use vae_models::{Direction, Execution, LoadedVae, ModelError, TileOverrides};
use vae_runtime::{
    DistributedVaeExecutor, ExecOutput, OutputPlacement, ParallelMode, Predicted, RuntimeError, Strategy,
    StrategyChoice,
};

use crate::cost::{self, CostSettings};
use vae_planner::cost::DeviceKind;
use vae_tensor::Tensor;

/// Errors of the engine.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The model could not be loaded or refused the request.
    #[error(transparent)]
    Model(ModelError),
    /// The cost model refused the request (nothing fits the memory cap).
    #[error(transparent)]
    Cost(#[from] crate::cost::CostError),
    /// The distributed run failed.
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
}

impl EngineError {
    /// True when every rank of the group already knows of this error: an agreed error (each
    /// rank returns it for the same request) or a transport error (it came from the group).
    /// Any other error happened on one rank alone, and that rank must abort the group so that
    /// the others stop waiting for it; aborting on a known one would race the other ranks'
    /// own report of it.
    pub fn known_to_all_ranks(&self) -> bool {
        matches!(self, Self::Runtime(r) if r.is_agreed() || matches!(r, RuntimeError::Transport(_)))
    }
}

impl From<ModelError> for EngineError {
    fn from(e: ModelError) -> Self {
        match e {
            ModelError::Runtime(e) => Self::Runtime(e),
            e => Self::Model(e),
        }
    }
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
    /// `--max-memory-per-rank`, bytes: `auto` runs the fastest predicted strategy whose
    /// predicted peak per rank fits (needs the engine's cost settings, [`Engine::set_cost`]).
    pub max_memory_per_rank: Option<u64>,
    /// `--shard-grid`: the `[R, C]` grid of blocks of `spatial_shard_2d`; `None`: the
    /// factorisation of the parallel size whose blocks are closest to square. A grid that
    /// does not fit the input or the ranks is an error (the default grid falls back to tiles).
    pub shard_grid: Option<[usize; 2]>,
}

impl Default for RequestOptions {
    fn default() -> Self {
        Self {
            mode: ParallelMode::Tile,
            use_tiling: false,
            latents_normalized: false,
            placement: None,
            max_memory_per_rank: None,
            shard_grid: None,
        }
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

/// A loaded VAE ready to serve requests.
pub struct Engine {
    model: Box<dyn LoadedVae>,
    dir: PathBuf,
    /// f32 convolutions as one TF32 product each (`--dtype tf32`), on the threads that run
    /// requests.
    tf32_convolutions: bool,
    /// A CPU model loaded for bf16: f32 weights and activations, convolutions with bf16
    /// products ([`vae_tensor::CpuBf16Scope`]) on the threads that run requests.
    cpu_bf16: bool,
    /// The cost model's device constants and placement: predictions in every report, and
    /// `auto` choosing by them.
    cost: Option<CostSettings>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").field("dir", &self.dir).field("class", &self.model.class_name()).finish()
    }
}

impl Engine {
    /// Loads a diffusers VAE directory onto the CPU in f32, with the family's tile geometry
    /// changed as `tiling` says (see [`LoadedVae::enable_tiling`]).
    pub fn load(dir: &Path, tiling: &TileOverrides) -> Result<Self, EngineError> {
        Self::load_on(dir, tiling, vae_tensor::Device::Cpu, vae_tensor::DType::F32)
    }

    /// [`Self::load`] with the weights on `device` in `dtype`, where every family then
    /// computes (inputs, outputs, tiles and bands stay on the host, in f32). f32 anywhere; bf16
    /// on CUDA (bf16 tensors) and on a CPU with AVX512-BF16 (f32 tensors, convolutions with bf16
    /// products: see [`vae_tensor::CpuBf16Scope`]; elsewhere a typed error naming the missing
    /// CPU feature).
    pub fn load_on(
        dir: &Path,
        tiling: &TileOverrides,
        device: vae_tensor::Device,
        dtype: vae_tensor::DType,
    ) -> Result<Self, EngineError> {
        let cpu_bf16 = device.is_cpu() && dtype == vae_tensor::DType::BF16;
        if cpu_bf16 {
            // Refused here, before the weights load, where the CPU cannot do it.
            drop(vae_tensor::CpuBf16Scope::enter().map_err(ModelError::from)?);
        }
        let dtype = if cpu_bf16 { vae_tensor::DType::F32 } else { dtype };
        let mut model = vae_models::family::load(dir, device, dtype)?;
        model.enable_tiling(tiling)?;
        Ok(Self { model, dir: dir.to_path_buf(), tf32_convolutions: false, cpu_bf16, cost: None })
    }

    /// The timestep a timestep-conditioned decoder decodes at (LTX-Video's `decode_timestep`);
    /// refused, with a typed error, for a model whose decoder takes none.
    pub fn set_decode_timestep(&mut self, timestep: f64) -> Result<(), EngineError> {
        Ok(self.model.set_decode_timestep(timestep)?)
    }

    /// The cost model's settings (device profile, threads and ranks per host): with them every
    /// report carries the prediction for the strategy that ran, and `auto` runs the fastest
    /// predicted strategy (that fits `--max-memory-per-rank`) for a family with a cost model.
    /// Profiles describe CPUs: a model on a GPU keeps its family's rules (and refuses a cap).
    pub fn set_cost(&mut self, settings: Option<CostSettings>) {
        self.cost = settings;
    }

    /// The cost settings, if any.
    pub fn cost(&self) -> Option<&CostSettings> {
        self.cost.as_ref()
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
        if self.cpu_bf16 { vae_tensor::DType::BF16 } else { self.model.dtype() }
    }

    /// The model directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The loaded model.
    pub fn model(&self) -> &dyn LoadedVae {
        self.model.as_ref()
    }

    /// For a process that serves one stage of pipelined decodes (`--vae-parallel-mode
    /// pipeline` over processes): lets go of every weight but those of the stage `rank` runs in
    /// a pipelined decode of `latent_dims` latents over `ranks` ranks; returns its decoder
    /// steps. The engine then serves such decodes and refuses every other request.
    pub fn keep_only_pipeline_stage(
        &mut self,
        latent_dims: &[usize],
        ranks: usize,
        rank: usize,
    ) -> Result<std::ops::Range<usize>, EngineError> {
        Ok(self.model.keep_only_pipeline_stage(latent_dims, ranks, rank)?)
    }

    /// The modes this model accepts, for `inspect`.
    pub fn supported_modes(&self) -> Vec<ParallelMode> {
        ParallelMode::ALL.into_iter().filter(|m| self.check_mode(*m).is_ok()).collect()
    }

    /// Refuses, with a typed error naming the class, a mode this model cannot run (call it
    /// when the mode is configured; every request checks it again).
    pub fn check_mode(&self, mode: ParallelMode) -> Result<(), EngineError> {
        Ok(self.model.check_mode(mode)?)
    }

    /// Who receives the output of a `direction` request with these options.
    pub fn placement(&self, direction: Direction, options: &RequestOptions) -> OutputPlacement {
        options.placement.unwrap_or_else(|| self.model.default_placement(direction))
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
        let mut denormalized = None;
        let z = self.decoder_input(latent, options, &mut denormalized)?;
        self.run(executor, Direction::Decode, z, options)
    }

    /// The latent a decode request gives the VAE (after checking the request's mode): as given,
    /// or with the pipeline's normalisation undone (kept in `slot`).
    fn decoder_input<'a>(
        &self,
        latent: &'a Tensor,
        options: &RequestOptions,
        slot: &'a mut Option<Tensor>,
    ) -> Result<&'a Tensor, EngineError> {
        self.model.check_mode(options.mode)?;
        if !options.latents_normalized {
            return Ok(latent);
        }
        Ok(slot.insert(self.model.denormalize_latents(latent)?))
    }

    /// Decodes a video latent with its output frames handed to `sink` as they are decoded
    /// ([`vae_runtime::FrameSink`]; the owner's, `None` on the other ranks): bit for bit the
    /// frames of the same decode unstreamed, with memory that does not grow with the frame
    /// count for the causal video families. On a group of one rank without tiling it is the
    /// direct decode (no report: `None`); otherwise the strategy the family chooses (tiles or
    /// a spatial shard), streamed. Every rank calls it with the same latent.
    pub fn decode_streaming(
        &self,
        executor: &DistributedVaeExecutor,
        latent: &Tensor,
        options: &RequestOptions,
        sink: Option<&mut dyn vae_runtime::FrameSink>,
    ) -> Result<Option<ExecOutput>, EngineError> {
        let _tf32 = self.tf32_scope();
        let _bf16 = self.cpu_bf16_scope()?;
        let mut denormalized = None;
        let z = self.decoder_input(latent, options, &mut denormalized)?;
        if executor.communicator().size() == 1 && !options.use_tiling {
            // Outside the executor: cancelling the group (Ctrl-C) must still stop it at a frame.
            let _cancel = vae_runtime::cancel::CancelScope::enter(std::sync::Arc::clone(executor.communicator()));
            let sink = sink.ok_or_else(|| ModelError::Unsupported("a streamed decode needs a frame sink".into()))?;
            self.model.decode_streaming(z, sink)?;
            return Ok(None);
        }
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

    /// One request, in the strategy the family chooses for it.
    fn run(
        &self,
        executor: &DistributedVaeExecutor,
        direction: Direction,
        input: &Tensor,
        options: &RequestOptions,
    ) -> Result<ExecOutput, EngineError> {
        let (choice, use_tiling, predicted) = self.choose(executor, direction, input.dims(), options)?;
        let out = self.model.execute(Execution {
            executor,
            direction,
            input,
            strategy: choice.strategy,
            use_tiling,
            placement: self.placement(direction, options),
        })?;
        Ok(with_reason(out, choice, predicted))
    }

    /// The strategy for one request, whether it tiles, and the cost model's prediction for it:
    /// the family's choice (with the grid the request names), or under `auto` with cost
    /// settings and a family that has a cost model, the fastest predicted strategy whose peak
    /// fits `--max-memory-per-rank`. The family's choice depends on global quantities only;
    /// the cost model's inputs (a rank's profile, threads and device) may differ between ranks,
    /// so under `auto` rank 0's decision (a strategy, the family's rules, or a refusal) is
    /// broadcast to the group and every rank follows it.
    fn choose(
        &self,
        executor: &DistributedVaeExecutor,
        direction: Direction,
        dims: &[usize],
        options: &RequestOptions,
    ) -> Result<(StrategyChoice, bool, Option<Predicted>), EngineError> {
        let ranks = executor.parallel_size();
        let mut choice = self.model.strategy(direction, options.mode, dims, ranks);
        let use_tiling = options.use_tiling || ranks > 1;
        let predicted = |c: &cost::Candidate| Predicted { ms: c.prediction.ms, peak_bytes: c.prediction.peak_bytes };
        let human_bytes = crate::report::human_bytes;
        let model = self.model.as_ref();
        // A grid named with another mode is an error in every mode, `auto` included.
        choice = Self::with_grid(choice, options)?;
        // A profile predicts for its own kind of device, and a GPU profile for its element type:
        // a model on another device (a GPU under the CPU profile, the default) or in another
        // type runs by the family's rules.
        let on_gpu = !model.device().is_cpu();
        let elem = model.dtype().size_in_bytes() as u64;
        let settings = self.cost.as_ref().filter(|s| {
            (s.profile.kind == DeviceKind::Cuda) == on_gpu && s.profile.map_bytes().is_none_or(|b| b == elem)
        });
        let cap = options.max_memory_per_rank;
        let no_model = || -> EngineError {
            match &self.cost {
                None => ModelError::InvalidInput(
                    "--max-memory-per-rank needs the cost model's settings (a device profile)".into(),
                )
                .into(),
                Some(_) => cost::CostError::NoModel {
                    class: format!("{} on {}", model.class_name(), model.device()),
                    dims: dims.to_vec(),
                }
                .into(),
            }
        };
        if options.mode == ParallelMode::Auto {
            // What this rank would run: the cost model's choice, a refusal, or the family's rules
            // (no cost model here). Each rank's profile, threads and device are its own, so
            // rank 0 decides for the group, also for ranks that have no cost model.
            let candidates = settings
                .and_then(|s| cost::candidates(model, direction, dims, ranks, options.use_tiling, s))
                .filter(|c| !c.is_empty());
            let local: Result<Option<&cost::Candidate>, EngineError> = match &candidates {
                Some(all) => cost::choose(all, cap, ranks).map(Some).map_err(EngineError::from),
                None if cap.is_some() => Err(no_model()),
                None => Ok(None),
            };
            let mine = match &local {
                Ok(Some(c)) => Decision::Run(c.strategy, c.use_tiling),
                Ok(None) => Decision::Rules,
                Err(_) => Decision::Refuse,
            };
            match agree_on_choice(executor, mine)? {
                Decision::Refuse => return Err(local.err().unwrap_or_else(|| cost::CostError::RefusedByOwner.into())),
                Decision::Rules => {}
                Decision::Run(strategy, tiling) => {
                    let prediction = candidates.as_deref().and_then(|all| cost::prediction_of(all, strategy, tiling));
                    let cap = cap.map(|c| format!(" within {}", human_bytes(c))).unwrap_or_default();
                    let figures = prediction.map_or_else(String::new, |p| {
                        format!(" ({:.0} ms, {} per rank)", p.prediction.ms, human_bytes(p.prediction.peak_bytes))
                    });
                    let label = prediction.map_or_else(|| format!("{strategy:?}"), |p| p.label.clone());
                    choice =
                        StrategyChoice::chosen(strategy, format!("auto: {label}, the fastest predicted{cap}{figures}"));
                    return Ok((announce(executor, choice), tiling, prediction.map(predicted)));
                }
            }
        } else if cap.is_some() {
            if settings.is_none() {
                return Err(no_model());
            }
            tracing::warn!(mode = %options.mode, "--max-memory-per-rank applies to --vae-parallel-mode auto; ignored");
        }
        let choice = announce(executor, choice);
        let prediction = settings
            .and_then(|s| cost::predict_strategy(model, direction, dims, ranks, choice.strategy, use_tiling, s));
        let predicted = prediction.map(|p| Predicted { ms: p.ms, peak_bytes: p.peak_bytes });
        Ok((choice, use_tiling, predicted))
    }

    /// The family's choice with the grid the request names: a 2-D shard on `options.shard_grid`,
    /// whatever the family would have chosen by default (its default grid, or tiles when that
    /// grid does not fit). The executor checks the named grid against the input and the ranks
    /// and refuses one that does not fit with an agreed error, rather than tiling silently. A
    /// grid with another mode is an error.
    fn with_grid(mut choice: StrategyChoice, options: &RequestOptions) -> Result<StrategyChoice, EngineError> {
        let Some(grid) = options.shard_grid else { return Ok(choice) };
        if options.mode != ParallelMode::SpatialShard2d {
            return Err(ModelError::InvalidInput(format!(
                "--shard-grid applies to --vae-parallel-mode spatial_shard_2d, not {}",
                options.mode
            ))
            .into());
        }
        choice.fallback = false;
        choice.strategy = Strategy::Shard2d(grid);
        choice.reason = format!("{} requested: {} × {} blocks (--shard-grid)", options.mode, grid[0], grid[1]);
        Ok(choice)
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
        self.model.check_mode(options.mode)?;
        let mut out = self.run(executor, Direction::Encode, image, options)?;
        if let Some(moments) = out.tensor.take() {
            out.tensor = Some(match output {
                EncodeOutput::Moments => moments,
                EncodeOutput::Mean => {
                    let mean = moments.diag_gaussian_mean().map_err(ModelError::from)?;
                    if options.latents_normalized { self.model.normalize_latents(&mean)? } else { mean }
                }
            });
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
fn agree_on_choice(executor: &DistributedVaeExecutor, mine: Decision) -> Result<Decision, EngineError> {
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
            return Err(ModelError::InvalidInput(format!("rank 0 sent an unreadable strategy {other:?}")).into());
        }
    };
    Ok(Decision::Run(strategy, word[4] == 1))
}

/// The report carries the family's reason for the strategy it ran, and the cost model's
/// prediction for it.
fn with_reason(mut out: ExecOutput, choice: StrategyChoice, predicted: Option<Predicted>) -> ExecOutput {
    out.report.reason = Some(choice.reason);
    out.report.predicted = predicted;
    out
}
