//! `decode`, `encode` and `inspect`: the engine on a real diffusers model directory.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::Args;
use serde::Deserialize;
use vae_parallel::cost::{self, CostSettings};
use vae_parallel::engine::{EncodeOutput, Engine, RequestOptions};
use vae_parallel::io;
use vae_parallel::models::{Direction, TileOverrides};
use vae_parallel::output::{self, Staged};
use vae_parallel::planner::cost::{DeviceKind, Placement};
use vae_parallel::report::{RequestReport, gather_summaries};
use vae_parallel::runtime::{DistributedVaeExecutor, OutputPlacement, ParallelMode, TileMerge};
use vae_parallel::transport::Communicator;

use crate::progress_bar::ProgressDisplay;
use crate::ranks::{GroupArgs, GroupOutcome, run_group};

/// Settings shared by `decode` and `encode`; each can also come from `--config FILE` (TOML, the
/// same names with underscores), flags winning.
#[derive(Debug, Clone, Args)]
pub struct ParallelArgs {
    /// A diffusers VAE directory (`config.json` + safetensors weights).
    #[arg(long)]
    model: PathBuf,
    /// Ranks that execute tiles (the reference's `vae_patch_parallel_size`); also the number
    /// of ranks started, unless --ranks says otherwise.
    #[arg(long)]
    vae_patch_parallel_size: Option<usize>,
    /// `tile` (default), `auto`, `spatial_shard_height`, `spatial_shard_width`,
    /// `spatial_shard_2d` (a grid of blocks with halos along both axes; every family) or
    /// `pipeline` (video decode: the decoder's layers in stages over the ranks, frame by frame).
    #[arg(long)]
    vae_parallel_mode: Option<String>,
    /// `spatial_shard_2d`: the grid of blocks, `RxC` (R rows of blocks by C columns; R·C ranks;
    /// default: the factorisation of the parallel size whose blocks are closest to square).
    #[arg(long)]
    shard_grid: Option<String>,
    /// Tile mode, 2-D tilings: `owner` (default: whole tiles go to the owner, which stitches
    /// each as it arrives; ranks never wait for each other) or `edges` (each rank blends its
    /// own tiles from its neighbours' raw edges and sends the owner only their kept parts: the
    /// owner receives the output's bytes, but the rounds run in lockstep; on the CPU, and not
    /// for a streamed video decode, which keep the owner merge). Same output either way.
    #[arg(long)]
    tile_merge: Option<String>,
    /// Tile large inputs as diffusers' `enable_tiling()` does (forced on by a parallel size > 1).
    #[arg(long)]
    vae_use_tiling: bool,
    /// Tile size in pixels (diffusers' `tile_sample_min_size`; default: the config's sample_size).
    #[arg(long)]
    tile_sample_min_size: Option<usize>,
    /// Tile overlap (diffusers' `tile_overlap_factor`, default 0.25).
    #[arg(long)]
    tile_overlap_factor: Option<f64>,
    /// Video VAEs (Wan, Qwen-Image): tile height in pixels (diffusers default 256).
    #[arg(long)]
    tile_sample_min_height: Option<usize>,
    /// Video VAEs: tile width in pixels (default 256).
    #[arg(long)]
    tile_sample_min_width: Option<usize>,
    /// Video VAEs: vertical tile stride in pixels (default 192).
    #[arg(long)]
    tile_sample_stride_height: Option<usize>,
    /// Video VAEs: horizontal tile stride in pixels (default 192).
    #[arg(long)]
    tile_sample_stride_width: Option<usize>,
    /// HunyuanVideo-1.5: latent tile height (diffusers' `tile_latent_min_height`; default
    /// 256 / the spatial ratio, and not derived from --tile-sample-min-height).
    #[arg(long)]
    tile_latent_min_height: Option<usize>,
    /// HunyuanVideo-1.5: latent tile width (`tile_latent_min_width`).
    #[arg(long)]
    tile_latent_min_width: Option<usize>,
    /// LTX: frames per temporal tile (diffusers' `tile_sample_min_num_frames`, default 16);
    /// giving it or the stride tiles the frames (`use_framewise_decoding`).
    #[arg(long)]
    tile_sample_min_num_frames: Option<usize>,
    /// LTX: frames between temporal tiles (`tile_sample_stride_num_frames`, default 8).
    #[arg(long)]
    tile_sample_stride_num_frames: Option<usize>,
    /// LTX-Video: the timestep a timestep-conditioned decoder decodes at (the pipelines'
    /// `decode_timestep`; default 0).
    #[arg(long)]
    decode_timestep: Option<f64>,
    /// Latents are as the diffusion pipeline produces them: undo (decode) or apply (encode) the
    /// family's latent normalisation.
    #[arg(long)]
    latents_normalized: bool,
    /// Give the output to every rank (`all`) or rank 0 (`owner`); default: the family's contract.
    #[arg(long)]
    placement: Option<String>,
    /// Number of ranks (default: the parallel size).
    #[arg(long)]
    ranks: Option<usize>,
    /// `local` (threads), `socket` (processes) or `nccl` (one process per GPU; needs
    /// `--device cuda`, rank r runs on cuda:r).
    #[arg(long)]
    transport: Option<String>,
    /// Compute threads of this process (default: all cores). Local ranks each run on a pool of
    /// their own of twice their even share of them, all at most.
    #[arg(long)]
    threads: Option<usize>,
    /// `cpu` (default), `cuda` or `cuda:N`. Without a usable CUDA device (no driver, or a
    /// build without kernels) the work runs on the CPU, and a warning says why.
    #[arg(long)]
    device: Option<String>,
    /// Element type the model computes in: `f32` (default), `bf16` (on CUDA bf16 tensors, as
    /// `vae.to(torch.bfloat16)` with f32 latents cast on the way in; on a CPU with AVX512-BF16,
    /// f32 tensors whose convolutions multiply in bf16; inputs and outputs stay f32) or `tf32`
    /// (CUDA only: f32 with each convolution product from TF32 operands, PyTorch's default for
    /// an f32 model on a GPU).
    #[arg(long)]
    dtype: Option<String>,
    /// `auto`: run the fastest strategy whose predicted peak memory per rank (the request's own
    /// tensors, beyond the weights and the input) fits this size, e.g. `512M`, `2G`; an error
    /// naming the smallest predicted peak when none does (see `vae-parallel plan`).
    #[arg(long)]
    max_memory_per_rank: Option<String>,
    /// The device profile `vae-parallel calibrate` wrote (default: the one in the default
    /// place, else built-in constants) for the cost model's predictions.
    #[arg(long)]
    profile: Option<PathBuf>,
    /// TOML file with any of the settings above.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Also write the per-rank report to this file: an SVG plot of every rank's phases for a
    /// `.svg` name, JSON otherwise.
    #[arg(long)]
    report: Option<PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    vae_patch_parallel_size: Option<usize>,
    vae_parallel_mode: Option<String>,
    shard_grid: Option<String>,
    tile_merge: Option<String>,
    vae_use_tiling: Option<bool>,
    tile_sample_min_size: Option<usize>,
    tile_overlap_factor: Option<f64>,
    tile_sample_min_height: Option<usize>,
    tile_sample_min_width: Option<usize>,
    tile_sample_stride_height: Option<usize>,
    tile_sample_stride_width: Option<usize>,
    tile_latent_min_height: Option<usize>,
    tile_latent_min_width: Option<usize>,
    tile_sample_min_num_frames: Option<usize>,
    tile_sample_stride_num_frames: Option<usize>,
    decode_timestep: Option<f64>,
    latents_normalized: Option<bool>,
    placement: Option<String>,
    ranks: Option<usize>,
    transport: Option<String>,
    threads: Option<usize>,
    device: Option<String>,
    dtype: Option<String>,
    max_memory_per_rank: Option<String>,
    profile: Option<PathBuf>,
}

/// Flags over the config file over defaults.
pub(crate) struct Resolved {
    model: PathBuf,
    /// Where the model computes (after the CUDA probe).
    pub(crate) device: vae_parallel::tensor::Device,
    /// What it computes in.
    compute: ComputeType,
    pub(crate) parallel_size: usize,
    /// How stitched tiles are merged.
    pub(crate) tile_merge: TileMerge,
    pub(crate) group: GroupArgs,
    pub(crate) options: RequestOptions,
    /// The tile geometry given (each family takes the keywords its class has).
    tiling: TileOverrides,
    /// `--decode-timestep`, for a timestep-conditioned decoder.
    decode_timestep: Option<f64>,
    report: Option<PathBuf>,
    /// The `--config` file, if any.
    config: Option<PathBuf>,
    /// The cost model's settings.
    pub(crate) cost: CostSettings,
}

impl ParallelArgs {
    pub(crate) fn resolve(&self) -> anyhow::Result<Resolved> {
        let file: FileConfig = match &self.config {
            Some(path) => {
                let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
                toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?
            }
            None => FileConfig::default(),
        };
        let parallel_size = self.vae_patch_parallel_size.or(file.vae_patch_parallel_size).unwrap_or(1);
        if parallel_size == 0 {
            bail!("--vae-patch-parallel-size must be at least 1");
        }
        let mode: ParallelMode =
            self.vae_parallel_mode.clone().or(file.vae_parallel_mode).unwrap_or_else(|| "tile".into()).parse()?;
        let shard_grid = match self.shard_grid.clone().or(file.shard_grid) {
            None => None,
            Some(text) => {
                Some(vae_parallel::planner::parse_grid(&text).map_err(|e| anyhow::anyhow!("--shard-grid: {e}"))?)
            }
        };
        let tile_merge: TileMerge = match self.tile_merge.clone().or(file.tile_merge) {
            None => TileMerge::default(),
            Some(text) => text.parse().context("--tile-merge")?,
        };
        let placement = match self.placement.clone().or(file.placement).as_deref() {
            None => None,
            Some("owner") => Some(OutputPlacement::OwnerOnly),
            Some("all") => Some(OutputPlacement::AllRanks),
            Some(other) => bail!("--placement must be owner or all, not {other:?}"),
        };
        if let Some(n) = self.threads.or(file.threads) {
            if n == 0 {
                bail!("--threads must be at least 1");
            }
            // Only the first configuration takes effect; later calls in one process are no-ops.
            let _ = rayon::ThreadPoolBuilder::new().num_threads(n).build_global();
        }
        let transport: vae_parallel::group::TransportKind =
            self.transport.clone().or(file.transport).unwrap_or_else(|| "local".into()).parse()?;
        let requested: vae_parallel::tensor::Device =
            self.device.clone().or(file.device).unwrap_or_else(|| "cpu".into()).parse()?;
        let (device, fallback) = vae_parallel::tensor::cuda::resolve_device(requested);
        if let Some(why) = fallback {
            eprintln!("warning: --device {requested}: {why}");
        }
        let compute = compute_type(&self.dtype.clone().or(file.dtype).unwrap_or_else(|| "f32".into()), device)?;
        let ranks = self.ranks.or(file.ranks).unwrap_or(parallel_size);
        let max_memory_per_rank = match self.max_memory_per_rank.clone().or(file.max_memory_per_rank) {
            None => None,
            Some(text) => Some(cost::parse_size(&text).context("--max-memory-per-rank")?),
        };
        let profile = cost::load_profile(self.profile.clone().or(file.profile).as_deref())?;
        let threads = self.threads.or(file.threads).unwrap_or_else(rayon::current_num_threads);
        let rank_placement = match profile.kind {
            // A socket rank has a process's pool of `threads`; a local rank, a pool of its own.
            DeviceKind::Cpu if transport.is_multi_process() => {
                vae_parallel::local_ranks::host_placement(threads, ranks)
            }
            DeviceKind::Cpu => vae_parallel::local_ranks::local_placement(Some(threads), ranks),
            // NCCL ranks each have a GPU; the others share the one they compute on.
            DeviceKind::Cuda => {
                let sharing = if transport == vae_parallel::group::TransportKind::Nccl { 1 } else { ranks.max(1) };
                Placement { threads_per_rank: 1.0 / sharing as f64, ranks_per_host: sharing, threads_alone: 1.0 }
            }
        };
        let cost = CostSettings { profile, placement: rank_placement };
        if transport == vae_parallel::group::TransportKind::Nccl {
            if requested != vae_parallel::tensor::Device::Cuda(0) {
                bail!("--transport nccl runs rank r on cuda:r: pass --device cuda, not {requested}");
            }
            if device.is_cpu() {
                bail!("--transport nccl needs usable GPUs, and cuda:0 is not (see the warning above)");
            }
        }
        Ok(Resolved {
            model: self.model.clone(),
            device,
            compute,
            parallel_size,
            tile_merge,
            group: GroupArgs { ranks, transport, rank: None, master_addr: None },
            options: RequestOptions {
                mode,
                use_tiling: self.vae_use_tiling || file.vae_use_tiling.unwrap_or(false),
                latents_normalized: self.latents_normalized || file.latents_normalized.unwrap_or(false),
                placement,
                max_memory_per_rank,
                shard_grid,
            },
            tiling: TileOverrides {
                sample_min_size: self.tile_sample_min_size.or(file.tile_sample_min_size),
                overlap_factor: self.tile_overlap_factor.or(file.tile_overlap_factor),
                sample_min_height: self.tile_sample_min_height.or(file.tile_sample_min_height),
                sample_min_width: self.tile_sample_min_width.or(file.tile_sample_min_width),
                sample_stride_height: self.tile_sample_stride_height.or(file.tile_sample_stride_height),
                sample_stride_width: self.tile_sample_stride_width.or(file.tile_sample_stride_width),
                latent_min_height: self.tile_latent_min_height.or(file.tile_latent_min_height),
                latent_min_width: self.tile_latent_min_width.or(file.tile_latent_min_width),
                sample_min_num_frames: self.tile_sample_min_num_frames.or(file.tile_sample_min_num_frames),
                sample_stride_num_frames: self.tile_sample_stride_num_frames.or(file.tile_sample_stride_num_frames),
            },
            decode_timestep: self.decode_timestep.or(file.decode_timestep),
            report: self.report.clone(),
            config: self.config.clone(),
            cost,
        })
    }
}

impl Resolved {
    /// The model directory.
    pub(crate) fn model_dir(&self) -> &Path {
        &self.model
    }

    /// [`refuse_overwriting`] for a command reading `input` and writing `out` (and the report).
    /// Before any work: no output names an input ([`refuse_overwriting`]), and a file can be
    /// created where each output goes.
    fn refuse_overwriting(&self, out: &Path, input: (&str, &Path)) -> anyhow::Result<()> {
        let mut outputs = vec![("--out", out)];
        outputs.extend(self.report.as_deref().map(|r| ("--report", r)));
        let mut inputs = vec![input];
        inputs.extend(self.config.as_deref().map(|c| ("--config", c)));
        refuse_overwriting(&outputs, &inputs, &self.model)?;
        for (flag, path) in &outputs {
            output::check_writable(path).with_context(|| format!("{flag} {}", path.display()))?;
        }
        Ok(())
    }

    /// Local ranks are threads of this process: they share one loaded model (weights in memory
    /// once). Socket ranks are processes and load their own.
    pub(crate) fn shared_engine(&self) -> anyhow::Result<Option<Engine>> {
        if self.group.transport.is_multi_process() {
            return Ok(None);
        }
        Ok(Some(self.load_engine(self.device)?))
    }

    pub(crate) fn load_engine(&self, device: vae_parallel::tensor::Device) -> anyhow::Result<Engine> {
        let mut engine = Engine::load_on(&self.model, &self.tiling, device, self.compute.dtype)?;
        engine.set_tf32_convolutions(self.compute.tf32);
        engine.set_cost(Some(self.cost.clone()));
        if let Some(t) = self.decode_timestep {
            engine.set_decode_timestep(t)?;
        }
        // A mode the family cannot run is refused now, before any request.
        engine.check_mode(self.options.mode)?;
        Ok(engine)
    }

    /// The shared engine, or one loaded into `slot` for this rank's process: on the rank's own
    /// GPU for NCCL groups (cuda:`LOCAL_RANK` under torchrun, else cuda:r), else on the
    /// resolved device.
    fn engine_for_rank<'a>(
        &self,
        rank: usize,
        shared: &'a Option<Engine>,
        slot: &'a mut Option<Engine>,
    ) -> anyhow::Result<&'a Engine> {
        use vae_parallel::tensor::Device;
        let device = match (self.group.transport, self.device) {
            (vae_parallel::group::TransportKind::Nccl, _) => {
                Device::Cuda(vae_parallel::group::local_rank().unwrap_or(rank))
            }
            (_, device) => device,
        };
        match shared {
            Some(engine) => Ok(engine),
            None => Ok(slot.insert(self.load_engine(device)?)),
        }
    }

    /// The engine of a decode of `latent` on `rank`: [`Self::engine_for_rank`]'s, which, for a
    /// pipelined decode where each rank is a process of its own, keeps only the weights of this
    /// rank's stage of a pipeline over `ranks` ranks. A latent the stage cannot be cut for keeps
    /// every weight: the request then refuses it, on every rank alike.
    fn decode_engine<'a>(
        &self,
        rank: usize,
        shared: &'a Option<Engine>,
        slot: &'a mut Option<Engine>,
        latent: &vae_parallel::tensor::Tensor,
        ranks: usize,
    ) -> anyhow::Result<&'a Engine> {
        if shared.is_some() || self.options.mode != ParallelMode::Pipeline {
            return self.engine_for_rank(rank, shared, slot);
        }
        self.engine_for_rank(rank, shared, slot)?;
        let engine = slot.as_mut().context("no engine was loaded for this rank")?;
        match engine.keep_only_pipeline_stage(latent.dims(), ranks, rank) {
            Ok(steps) => tracing::debug!(rank, ?steps, "this process keeps one pipeline stage's weights"),
            Err(e) => tracing::debug!(rank, "this process keeps every weight: {e}"),
        }
        Ok(engine)
    }
}

/// Options of `decode`.
#[derive(Debug, Clone, Args)]
pub struct DecodeArgs {
    #[command(flatten)]
    parallel: ParallelArgs,
    /// The latent: `.npy` or `.safetensors`, f32 `[B, C, H, W]`.
    #[arg(long)]
    latent: PathBuf,
    /// `.npy`: the raw decoder output (`vae.decode(z).sample`); `.png`: diffusers' image
    /// post-processing, one file per batch item (per frame of a video); `.mp4` (H.264 through
    /// ffmpeg: on PATH or named by VAE_FFMPEG) or `.gif`: a video, one file per batch item.
    #[arg(long)]
    out: PathBuf,
    /// Frames per second of an `.mp4` or `.gif` output.
    #[arg(long, default_value_t = vae_parallel::video::DEFAULT_FPS)]
    fps: u32,
    /// Write a video's frames as they are decoded (to any of the outputs above), never holding
    /// the whole video: memory no longer grows with the frame count, in every mode (tiles or
    /// bands are gathered to rank 0 a latent frame at a time).
    #[arg(long)]
    stream: bool,
}

/// Options of `encode`.
#[derive(Debug, Clone, Args)]
pub struct EncodeArgs {
    #[command(flatten)]
    parallel: ParallelArgs,
    /// The image: `.npy` `[B, 3, H, W]` in [-1, 1], or an 8-bit `.png`.
    #[arg(long)]
    input: PathBuf,
    /// Where the latent goes (`.npy`).
    #[arg(long)]
    out: PathBuf,
    /// `moments` (mean and log-variance after quant_conv) or `mean`.
    #[arg(long, default_value = "mean")]
    output: String,
}

/// Options of `inspect`.
#[derive(Debug, Clone, Args)]
pub struct InspectArgs {
    /// A diffusers VAE directory.
    #[arg(long)]
    model: PathBuf,
}

/// `--device` and `--dtype` of a command that measures one device (`calibrate`, `bench
/// kernels`).
#[derive(Debug, Clone, Args)]
pub(crate) struct DeviceArgs {
    /// `cpu` (default) or `cuda[:N]`.
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
    /// `f32` (default), `bf16` or `tf32` (CUDA only; on CUDA convolutions run on tensor cores in
    /// all three: f32 as three TF32 products each, tf32 as one).
    #[arg(long, default_value = "f32")]
    pub(crate) dtype: String,
}

/// What `--dtype` asks for: the element type, and whether f32 convolutions take one TF32 product
/// per product (`tf32`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ComputeType {
    pub dtype: vae_parallel::tensor::DType,
    pub tf32: bool,
}

impl std::fmt::Display for ComputeType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.tf32 { f.write_str("tf32") } else { self.dtype.fmt(f) }
    }
}

/// The `--dtype` flag for work on `device` (after the CUDA probe). A type the device cannot
/// compute in is refused, never run quietly in f32: the numbers would not be the ones asked for.
pub(crate) fn compute_type(flag: &str, device: vae_parallel::tensor::Device) -> anyhow::Result<ComputeType> {
    use vae_parallel::tensor::DType;
    let (dtype, tf32) = match flag.trim() {
        "f32" => (DType::F32, false),
        "bf16" => (DType::BF16, false),
        "tf32" => (DType::F32, true),
        other => bail!("--dtype {other:?} is not f32, bf16 or tf32"),
    };
    if device.is_cpu() && dtype == DType::BF16 {
        // bf16 convolutions on the CPU, where it has AVX512-BF16; refused naming what it lacks.
        if let Err(err) = vae_parallel::tensor::CpuBf16Scope::enter() {
            bail!("--dtype bf16 on the CPU: {err}; use --dtype f32 (or --device cuda)");
        }
        return Ok(ComputeType { dtype, tf32 });
    }
    if !device.computes_in(dtype) || (tf32 && device.is_cpu()) {
        let asked = if tf32 { "tf32".to_string() } else { dtype.to_string() };
        bail!(
            "--dtype {asked} needs a CUDA device (the CPU computes in f32 or bf16); use --device cuda or --dtype f32"
        );
    }
    Ok(ComputeType { dtype, tf32 })
}

fn check_output_path(path: &Path, allowed: &[&str]) -> anyhow::Result<()> {
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("").to_ascii_lowercase();
    if !allowed.contains(&ext.as_str()) {
        bail!(
            "output {} must end in {}",
            path.display(),
            allowed.iter().map(|e| format!(".{e}")).collect::<Vec<_>>().join(" or ")
        );
    }
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    if !dir.is_dir() {
        bail!("output directory {} does not exist", dir.display());
    }
    Ok(())
}

/// Refuses a command whose outputs would overwrite what the user gave it (an input file, the
/// config file, a file of the model directory) or each other, before any work or write: the
/// atomic rename would otherwise replace the input with the result.
fn refuse_overwriting(outputs: &[(&str, &Path)], inputs: &[(&str, &Path)], model_dir: &Path) -> anyhow::Result<()> {
    let model_files: Vec<PathBuf> = std::fs::read_dir(model_dir)
        .map(|entries| entries.filter_map(|e| e.ok()).map(|e| e.path()).filter(|p| p.is_file()).collect())
        .unwrap_or_default();
    for (i, (flag, out)) in outputs.iter().enumerate() {
        for (other, input) in inputs {
            if io::same_file(out, input) {
                bail!("{flag} {} is the {other} file: writing it would destroy the input", out.display());
            }
        }
        if let Some(file) = model_files.iter().find(|f| io::same_file(out, f)) {
            bail!("{flag} {} would overwrite the model's {}", out.display(), file.display());
        }
        if let Some((earlier, _)) = outputs[..i].iter().find(|(_, o)| io::same_file(out, o)) {
            bail!("{flag} and {earlier} name the same file {}", out.display());
        }
    }
    Ok(())
}

struct Done {
    report: RequestReport,
    /// The outputs, staged beside their targets: in place once the report is staged too.
    staged: Staged,
    seconds: f64,
}

fn finish_rank(
    comm: &Arc<dyn Communicator>,
    executor: &DistributedVaeExecutor,
    out: vae_parallel::runtime::ExecOutput,
    stage: impl FnOnce(&vae_parallel::tensor::Tensor, &mut Staged) -> anyhow::Result<()>,
    mode: ParallelMode,
    started: Instant,
) -> anyhow::Result<Option<Done>> {
    // The owner stages its outputs before the last collective, and puts them in place only
    // after it (in `print_done`), so a failure anywhere leaves no output behind.
    let mut staged = Staged::new();
    if let (Some(t), 0) = (&out.tensor, comm.rank()) {
        stage(t, &mut staged)?;
    }
    let seconds = started.elapsed().as_secs_f64();
    let Some(ranks) = gather_summaries(comm.as_ref(), 0, &out.report)? else { return Ok(None) };
    Ok(Some(Done {
        report: RequestReport::from_owner(
            &mode.to_string(),
            &out.report,
            comm.as_ref(),
            executor.parallel_size(),
            ranks,
        ),
        staged,
        seconds,
    }))
}

fn print_done(what: &str, done: Option<Done>, report_path: Option<&Path>) -> anyhow::Result<ExitCode> {
    let Some(mut done) = done else { return Ok(ExitCode::SUCCESS) };
    if let Some(path) = report_path {
        done.staged.add(path, &done.report.file_bytes(path)?)?;
    }
    let written = std::mem::take(&mut done.staged).commit()?;
    println!(
        "{what}: {} (mode {}: {}), {} rank(s) ({} transport), parallel size {}: {:.3} s",
        done.report.what_ran(),
        done.report.mode,
        done.report.reason,
        done.report.world_size,
        done.report.backend,
        done.report.parallel_size,
        done.seconds
    );
    print!("{}", done.report.to_table());
    for path in written.iter().filter(|p| Some(p.as_path()) != report_path) {
        println!("wrote {}", path.display());
    }
    if let Some(path) = report_path {
        println!("report written to {}", path.display());
    }
    Ok(ExitCode::SUCCESS)
}

fn outcome<R>(outcome: GroupOutcome<R>) -> anyhow::Result<Option<R>> {
    match outcome {
        GroupOutcome::AllRanks(mut results) => {
            // Rank 0's error first: an agreed error is the same everywhere, and a failure
            // elsewhere shows on rank 0 naming the rank.
            if results.first().is_some_and(|r| r.is_ok())
                && let Some((rank, Err(e))) = results.iter().enumerate().find(|(_, r)| r.is_err())
            {
                bail!("rank {rank}: {}", crate::error_text(e));
            }
            Ok(Some(results.swap_remove(0)?))
        }
        GroupOutcome::OneRank(rank, result) => {
            let r = result?;
            Ok((rank == 0).then_some(r))
        }
        GroupOutcome::Supervised(exit) => {
            if exit.success() {
                Ok(None)
            } else {
                Err(crate::ranks::supervised_failure(&exit))
            }
        }
    }
}

/// `vae-parallel decode`.
pub fn decode(args: &DecodeArgs) -> anyhow::Result<ExitCode> {
    let r = args.parallel.resolve()?;
    if args.stream {
        return decode_streamed(args, &r);
    }
    check_output_path(&args.out, &io::DECODED_EXTENSIONS)?;
    r.refuse_overwriting(&args.out, ("--latent", &args.latent))?;
    if args.fps == 0 {
        bail!("--fps must be at least 1");
    }
    let shared = r.shared_engine()?;
    let result = run_group(&r.group, |comm| {
        let _progress = ProgressDisplay::start("decoding", "frame", comm.rank() == 0);
        let started = Instant::now();
        let mut loaded = None;
        let latent = io::read_tensor(&args.latent)?;
        let executor = DistributedVaeExecutor::new(Arc::clone(&comm), r.parallel_size)?.with_tile_merge(r.tile_merge);
        let engine = r.decode_engine(comm.rank(), &shared, &mut loaded, &latent, executor.parallel_size())?;
        let out = engine.decode(&executor, &latent, &r.options)?;
        finish_rank(
            &comm,
            &executor,
            out,
            |t, staged| Ok(io::stage_decoded(staged, &args.out, t, args.fps)?),
            r.options.mode,
            started,
        )
    })?;
    print_done("decode", outcome(result)?.flatten(), r.report.as_deref())
}

/// What a streamed decode leaves on rank 0.
enum Streamed {
    /// One rank, the direct decode: frames written, the staged files, the tensor peak above
    /// the start, seconds.
    Direct(usize, Staged, usize, f64),
    /// A group: the usual request report, the staged files among its outputs.
    Group(Done),
}

/// `vae-parallel decode --stream`: the frames written as they are decoded, on one rank (the
/// direct decode) or over a group (the streamed spatial shard).
fn decode_streamed(args: &DecodeArgs, r: &Resolved) -> anyhow::Result<ExitCode> {
    use vae_parallel::runtime::OnOwnThread;
    use vae_parallel::stream_out::{STREAMED_EXTENSIONS, StreamedOutput};
    check_output_path(&args.out, &STREAMED_EXTENSIONS)?;
    r.refuse_overwriting(&args.out, ("--latent", &args.latent))?;
    if args.fps == 0 {
        bail!("--fps must be at least 1");
    }
    let shared = r.shared_engine()?;
    let result = run_group(&r.group, |comm| {
        let _progress = ProgressDisplay::start("decoding", "frame", comm.rank() == 0);
        let started = Instant::now();
        let mut loaded = None;
        let latent = io::read_tensor(&args.latent)?;
        let executor = DistributedVaeExecutor::new(Arc::clone(&comm), r.parallel_size)?.with_tile_merge(r.tile_merge);
        let engine = r.decode_engine(comm.rank(), &shared, &mut loaded, &latent, executor.parallel_size())?;
        if comm.size() == 1 && r.report.is_some() {
            bail!("--report is written for a streamed decode over several ranks, not on one rank yet");
        }
        // Only the owner writes (it checked the path and --fps before any rank started), on a
        // thread of its own: frame t is written while frame t + 1 decodes.
        let mut sink = match comm.rank() {
            0 => Some(OnOwnThread::start(StreamedOutput::new(&args.out, args.fps)?, 1)?),
            _ => None,
        };
        vae_parallel::tensor::memory::reset_peak();
        let before = vae_parallel::tensor::memory::live_bytes();
        let out = engine.decode_streaming(
            &executor,
            &latent,
            &r.options,
            sink.as_mut().map(|s| s as &mut dyn vae_parallel::runtime::FrameSink),
        )?;
        let peak = vae_parallel::tensor::memory::peak_bytes().saturating_sub(before);
        let written = sink.map(OnOwnThread::finish).transpose().map_err(|e| anyhow::anyhow!(e))?;
        let frames = written.as_ref().map_or(0, StreamedOutput::frames_written);
        let staged = written.map(StreamedOutput::finish).transpose()?;
        Ok(match (out, staged) {
            (None, Some(staged)) => Some(Streamed::Direct(frames, staged, peak, started.elapsed().as_secs_f64())),
            (None, None) => None,
            (Some(out), staged) => {
                let done = finish_rank(&comm, &executor, out, |_, _| Ok(()), r.options.mode, started)?;
                done.map(|mut done| {
                    if let Some(staged) = staged {
                        done.staged.append(staged);
                    }
                    Streamed::Group(done)
                })
            }
        })
    })?;
    match outcome(result)?.flatten() {
        Some(Streamed::Group(done)) => print_done("decode (streamed)", Some(done), r.report.as_deref()),
        Some(Streamed::Direct(frames, staged, peak, seconds)) => {
            let written = staged.commit()?;
            println!(
                "decode (streamed, 1 rank): {frames} frame(s) in {seconds:.3} s, tensor peak {:.1} MiB above the \
                 model",
                peak as f64 / (1 << 20) as f64
            );
            let shown = if written.len() > 4 { &written[..1] } else { &written[..] };
            for path in shown {
                println!("wrote {}", path.display());
            }
            if written.len() > shown.len() {
                println!("… and {} more file(s) beside it", written.len() - shown.len());
            }
            Ok(ExitCode::SUCCESS)
        }
        None => Ok(ExitCode::SUCCESS),
    }
}

/// `vae-parallel encode`.
pub fn encode(args: &EncodeArgs) -> anyhow::Result<ExitCode> {
    let r = args.parallel.resolve()?;
    check_output_path(&args.out, &["npy"])?;
    r.refuse_overwriting(&args.out, ("--input", &args.input))?;
    let output = match args.output.as_str() {
        "moments" => EncodeOutput::Moments,
        "mean" => EncodeOutput::Mean,
        other => bail!("--output must be moments or mean, not {other:?}"),
    };
    let shared = r.shared_engine()?;
    let result = run_group(&r.group, |comm| {
        let _progress = ProgressDisplay::start("encoding", "chunk", comm.rank() == 0);
        let started = Instant::now();
        let mut loaded = None;
        let engine = r.engine_for_rank(comm.rank(), &shared, &mut loaded)?;
        let image = match args.input.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase).as_deref() {
            Some("png") => io::read_png(&args.input)?,
            _ => io::read_tensor(&args.input)?,
        };
        let executor = DistributedVaeExecutor::new(Arc::clone(&comm), r.parallel_size)?.with_tile_merge(r.tile_merge);
        let out = engine.encode(&executor, &image, &r.options, output)?;
        finish_rank(
            &comm,
            &executor,
            out,
            |t, staged| Ok(staged.add(&args.out, &io::npy_bytes(t)?)?),
            r.options.mode,
            started,
        )
    })?;
    print_done("encode", outcome(result)?.flatten(), r.report.as_deref())
}

/// `vae-parallel inspect`.
pub fn inspect(args: &InspectArgs) -> anyhow::Result<ExitCode> {
    let engine = Engine::load(&args.model, &TileOverrides::default())?;
    let model = engine.model();
    println!("model       {}", args.model.display());
    println!("class       {} ({})", model.class_name(), model.models());
    for (label, value) in model.describe() {
        println!("{label:<11} {value}");
    }
    let modes: Vec<String> = engine.supported_modes().iter().map(ToString::to_string).collect();
    println!("modes       {}", modes.join(", "));
    let flags: Vec<String> = model.tiling_keywords().iter().map(|k| format!("--{}", k.replace('_', "-"))).collect();
    println!("tile flags  {}", flags.join(", "));
    println!(
        "placement   decode → {:?}, encode → {:?}",
        model.default_placement(Direction::Decode),
        model.default_placement(Direction::Encode)
    );
    Ok(ExitCode::SUCCESS)
}
