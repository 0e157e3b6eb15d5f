//! `decode`, `encode` and `inspect`: a [`Vae`] on a real diffusers model directory, run on the
//! group the flags describe.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::Args;

use crate::cli::progress_bar::ProgressDisplay;
use crate::cli::ranks::{GroupArgs, Ranks};
use crate::cost::{self, CostSettings};
use crate::launch::TransportKind;
use crate::models::Direction;
use crate::output::{self, Staged};
use crate::report::RequestReport;
use crate::settings::{self, Settings};
use crate::{
    CostProfile, Decode, Device, Encode, EncodeOutput, FrameSink, Group, Options, ParallelMode, Request, SinkError,
    Tensor, Vae, io,
};

/// Settings shared by `decode` and `encode`; each can also come from `--config FILE` (TOML, the
/// same names with underscores), flags winning.
#[derive(Debug, Clone, Args)]
pub struct ParallelArgs {
    /// A diffusers VAE directory (`config.json` + safetensors weights).
    #[arg(long)]
    model: PathBuf,
    #[command(flatten)]
    flags: ParallelFlags,
    /// Also write the per-rank report to this file: an SVG plot of every rank's phases for a
    /// `.svg` name, JSON otherwise.
    #[arg(long)]
    report: Option<PathBuf>,
}

/// The group's and the requests' settings as flags: `decode`, `encode` and `serve` take the same.
#[derive(Debug, Clone, Args)]
pub struct ParallelFlags {
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
}

impl ParallelFlags {
    /// The flags given, by their settings' names.
    pub(crate) fn flags(&self) -> Settings {
        Settings {
            vae_patch_parallel_size: self.vae_patch_parallel_size,
            vae_parallel_mode: self.vae_parallel_mode.clone(),
            shard_grid: self.shard_grid.clone(),
            tile_merge: self.tile_merge.clone(),
            vae_use_tiling: self.vae_use_tiling.then_some(true),
            tile_sample_min_size: self.tile_sample_min_size,
            tile_overlap_factor: self.tile_overlap_factor,
            tile_sample_min_height: self.tile_sample_min_height,
            tile_sample_min_width: self.tile_sample_min_width,
            tile_sample_stride_height: self.tile_sample_stride_height,
            tile_sample_stride_width: self.tile_sample_stride_width,
            tile_latent_min_height: self.tile_latent_min_height,
            tile_latent_min_width: self.tile_latent_min_width,
            tile_sample_min_num_frames: self.tile_sample_min_num_frames,
            tile_sample_stride_num_frames: self.tile_sample_stride_num_frames,
            decode_timestep: self.decode_timestep,
            latents_normalized: self.latents_normalized.then_some(true),
            placement: self.placement.clone(),
            ranks: self.ranks,
            transport: self.transport.clone(),
            threads: self.threads,
            device: self.device.clone(),
            dtype: self.dtype.clone(),
            max_memory_per_rank: self.max_memory_per_rank.clone(),
            profile: self.profile.clone(),
        }
    }

    /// Flags over the config file over defaults, resolved by the library (which refuses what
    /// Python and Rust callers would be refused, in the same words); a CUDA device that cannot be
    /// used is said once, here.
    pub(crate) fn settings(&self) -> anyhow::Result<settings::Resolved> {
        let file = match &self.config {
            Some(path) => Settings::from_toml_file(path)?,
            None => Settings::default(),
        };
        let settings = self.flags().or(file).resolve()?;
        if let Some(why) = &settings.device_fallback {
            eprintln!("warning: --device {}: {why}", settings.requested_device);
        }
        if let Some(n) = settings.threads {
            // Only the first configuration takes effect; later calls in one process change nothing.
            let _ = crate::init(crate::Config::default().threads(n).map_large_allocations(false));
        }
        Ok(settings)
    }

    /// The `--config` file, if any.
    pub(crate) fn config(&self) -> Option<&Path> {
        self.config.as_deref()
    }
}

impl ParallelArgs {
    /// Flags over the config file over defaults, resolved by the library (which refuses what
    /// Python and Rust callers would be refused, in the same words).
    pub(crate) fn resolve(&self) -> anyhow::Result<Resolved> {
        let settings = self.flags.settings()?;
        Ok(Resolved {
            model: self.model.clone(),
            group: GroupArgs { ranks: settings.ranks, transport: settings.transport, rank: None, master_addr: None },
            report: self.report.clone(),
            config: self.flags.config.clone(),
            settings,
        })
    }
}

/// Flags over the config file over defaults.
pub(crate) struct Resolved {
    model: PathBuf,
    /// The settings, typed.
    pub(crate) settings: settings::Resolved,
    pub(crate) group: GroupArgs,
    report: Option<PathBuf>,
    /// The `--config` file, if any.
    config: Option<PathBuf>,
}

impl Resolved {
    /// The cost model's settings for `plan` (requests derive their own from their group): the
    /// profile (`--profile`, else the calibrated one, else this CPU's probed constants, probed
    /// first where no cache holds them) and the request's ranks placed on this host's cores.
    pub(crate) fn cost_settings(&self) -> anyhow::Result<CostSettings> {
        let profile = cost::load_profile(self.settings.profile.as_deref())?;
        let threads = self.settings.threads.unwrap_or_else(rayon::current_num_threads);
        let placement = cost::placement(profile.kind, self.settings.transport, threads, self.settings.ranks, None);
        Ok(CostSettings { profile, placement })
    }

    /// The model directory.
    pub(crate) fn model_dir(&self) -> &Path {
        &self.model
    }

    /// The options of every request.
    pub(crate) fn options(&self) -> Options {
        self.settings.options.clone()
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

    /// The ranks of the command: a local group, this process's rank of a group of processes,
    /// or the supervisor of the rank processes it starts.
    pub(crate) fn ranks(&self) -> anyhow::Result<Ranks> {
        crate::cli::ranks::ranks(&self.group, self.settings.threads)
    }

    /// The model on `device` (the resolved one, unless a rank's own GPU), a mode it cannot run
    /// refused before any request.
    pub(crate) fn load_vae_on(&self, device: Device) -> anyhow::Result<Vae> {
        let vae = self.settings.vae_builder(&self.model, device).build()?;
        vae.check_mode(self.settings.options.mode)?;
        Ok(vae)
    }

    /// The model for this process's ranks: an NCCL rank's on its own GPU (cuda:`LOCAL_RANK`
    /// under torchrun, else cuda:r). A process that is one rank of a pipelined decode of
    /// `latent` keeps only its stage's weights; a latent the stage cannot be cut for keeps
    /// every weight (the request then refuses it, on every rank alike).
    fn load_vae(&self, group: &Group, latent: Option<&Tensor>) -> anyhow::Result<Vae> {
        let device = match self.group.transport {
            TransportKind::Nccl => Device::Cuda(crate::launch::local_rank().unwrap_or(group.rank())),
            _ => self.settings.device,
        };
        let mut vae = self.load_vae_on(device)?;
        if let Some(latent) =
            latent.filter(|_| !group.is_local() && self.settings.options.mode == ParallelMode::Pipeline)
        {
            // The stages of the ranks that compute: the parallel size, at most the group.
            let stages = self.settings.parallel_size.min(group.size());
            match vae.keep_only_pipeline_stage(latent.dims(), stages, group.rank()) {
                Ok(steps) => {
                    tracing::debug!(rank = group.rank(), ?steps, "this process keeps one pipeline stage's weights")
                }
                Err(e) => tracing::debug!(rank = group.rank(), "this process keeps every weight: {e}"),
            }
        }
        Ok(vae)
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
    #[arg(long, default_value_t = crate::video::DEFAULT_FPS)]
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
    pub dtype: crate::tensor::DType,
    pub tf32: bool,
}

impl std::fmt::Display for ComputeType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.tf32 { f.write_str("tf32") } else { self.dtype.fmt(f) }
    }
}

/// The `--dtype` flag for work on `device` (after the CUDA probe), as the library resolves it
/// (a type the device cannot compute in is refused, never run quietly in f32).
pub(crate) fn compute_type(flag: &str, device: Device) -> anyhow::Result<ComputeType> {
    let (dtype, tf32) = settings::parse_dtype(flag, device)?;
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

/// What the owner has when a request succeeded.
struct Done {
    report: RequestReport,
    /// The outputs, staged beside their targets: in place once the report is staged too.
    staged: Staged,
    seconds: f64,
}

/// Puts the staged outputs and the report in place (only once the whole request succeeded:
/// a failure anywhere leaves no output behind), then prints what ran.
fn print_done(what: &str, mut done: Done, report_path: Option<&Path>) -> anyhow::Result<ExitCode> {
    if let Some(path) = report_path {
        done.staged.add(path, &done.report.file_bytes(path)?)?;
    }
    let written = std::mem::take(&mut done.staged).commit()?;
    println!(
        "{what}: {} (mode {}: {}), {} rank(s) ({} transport), parallel size {}: {:.3} s",
        done.report.what_ran(),
        done.report.mode,
        settings::rename_options(&done.report.reason, settings::cli_flag),
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

/// `vae-parallel decode`.
pub fn decode(args: &DecodeArgs) -> anyhow::Result<ExitCode> {
    let r = args.parallel.resolve()?;
    if args.stream {
        return decode_streamed(args, &r);
    }
    let group = match prepare_decode(args, &r, &io::DECODED_EXTENSIONS)? {
        Ok(group) => group,
        Err(supervised) => return Ok(supervised),
    };
    let started = Instant::now();
    let (latent, vae) = or_abort(&group, || {
        let latent = io::read_tensor(&args.latent)?;
        let vae = r.load_vae(&group, Some(&latent))?;
        Ok((latent, vae))
    })?;
    let decode = Decode::default().with_options(r.options());
    let progress = ProgressDisplay::start("decoding", "frame", group.rank() == 0);
    let finished = group.run(&vae, Request::decode(&latent, &decode).progress(progress.sink()))?;
    drop(progress);
    // Only the owner writes, and says what ran.
    let Some(report) = finished.report else { return Ok(ExitCode::SUCCESS) };
    let mut staged = Staged::new();
    if let Some(pixels) = &finished.output {
        io::stage_decoded(&mut staged, &args.out, pixels, args.fps)?;
    }
    let seconds = started.elapsed().as_secs_f64();
    print_done("decode", Done { report, staged, seconds }, r.report.as_deref())
}

/// Before any work, what a decode refuses (an output it cannot write as `extensions` say, one
/// that would overwrite an input, a frame rate of 0); then the ranks: the group, or the end of a
/// supervisor whose rank processes ran the command.
fn prepare_decode(args: &DecodeArgs, r: &Resolved, extensions: &[&str]) -> anyhow::Result<Result<Group, ExitCode>> {
    check_output_path(&args.out, extensions)?;
    r.refuse_overwriting(&args.out, ("--latent", &args.latent))?;
    if args.fps == 0 {
        bail!("--fps must be at least 1");
    }
    r.ranks()?.group()
}

/// `prepare`'s result; on a failure this process's rank aborts its group of processes with the
/// reason first, so that the other ranks, already in the request, fail naming it rather than
/// waiting for a rank that left.
fn or_abort<T>(group: &Group, prepare: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<T> {
    prepare().inspect_err(|e| group.abort(&crate::cli::error_text(e)))
}

/// The frame sink of a rank other than the owner's, which the group never calls.
struct NoFrames;

impl FrameSink for NoFrames {
    fn begin(&mut self, _dims: &[usize]) -> Result<(), SinkError> {
        Ok(())
    }

    fn frames(&mut self, _first: usize, _run: Tensor) -> Result<(), SinkError> {
        Ok(())
    }
}

/// `vae-parallel decode --stream`: the frames written as they are decoded, on one rank (the
/// direct decode) or over a group (the streamed spatial shard).
fn decode_streamed(args: &DecodeArgs, r: &Resolved) -> anyhow::Result<ExitCode> {
    use crate::runtime::OnOwnThread;
    use crate::stream_out::{STREAMED_EXTENSIONS, StreamedOutput};
    let group = match prepare_decode(args, r, &STREAMED_EXTENSIONS)? {
        Ok(group) => group,
        Err(supervised) => return Ok(supervised),
    };
    if group.size() == 1 && r.report.is_some() {
        bail!("--report is written for a streamed decode over several ranks, not on one rank yet");
    }
    let started = Instant::now();
    let (latent, vae) = or_abort(&group, || {
        let latent = io::read_tensor(&args.latent)?;
        let vae = r.load_vae(&group, Some(&latent))?;
        Ok((latent, vae))
    })?;
    let decode = Decode::default().with_options(r.options());
    // Only the owner writes (it checked the path and --fps before any rank started), on a
    // thread of its own: frame t is written while frame t + 1 decodes.
    let mut owner = match group.rank() {
        0 => Some(OnOwnThread::start(StreamedOutput::new(&args.out, args.fps)?, 1)?),
        _ => None,
    };
    let mut elsewhere = NoFrames;
    let sink: &mut (dyn FrameSink + Send) = match owner.as_mut() {
        Some(sink) => sink,
        None => &mut elsewhere,
    };
    let progress = ProgressDisplay::start("decoding", "frame", group.rank() == 0);
    let finished = group.run(&vae, Request::decode_to(&latent, &decode, sink).progress(progress.sink()))?;
    drop(progress);
    let Some(owner) = owner else { return Ok(ExitCode::SUCCESS) };
    let written = owner.finish().map_err(|e| anyhow::anyhow!(e))?;
    let frames = written.frames_written();
    let staged = written.finish()?;
    let seconds = started.elapsed().as_secs_f64();
    match finished.report {
        Some(report) => print_done("decode (streamed)", Done { report, staged, seconds }, r.report.as_deref()),
        None => {
            let written = staged.commit()?;
            println!(
                "decode (streamed, 1 rank): {frames} frame(s) in {seconds:.3} s, tensor peak {:.1} MiB above the \
                 model",
                finished.peak_bytes as f64 / (1 << 20) as f64
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
    }
}

/// `vae-parallel encode`.
pub fn encode(args: &EncodeArgs) -> anyhow::Result<ExitCode> {
    let r = args.parallel.resolve()?;
    check_output_path(&args.out, &["npy"])?;
    r.refuse_overwriting(&args.out, ("--input", &args.input))?;
    let output: EncodeOutput = args.output.parse()?;
    let group = match r.ranks()?.group()? {
        Ok(group) => group,
        Err(supervised) => return Ok(supervised),
    };
    let started = Instant::now();
    let (vae, image) = or_abort(&group, || Ok((r.load_vae(&group, None)?, io::read_image(&args.input)?)))?;
    let encode = Encode::default().with_options(r.options()).output(output);
    let progress = ProgressDisplay::start("encoding", "chunk", group.rank() == 0);
    let finished = group.run(&vae, Request::encode(&image, &encode).progress(progress.sink()))?;
    drop(progress);
    let Some(report) = finished.report else { return Ok(ExitCode::SUCCESS) };
    let mut staged = Staged::new();
    if let Some(latent) = &finished.output {
        staged.add(&args.out, &io::npy_bytes(latent)?)?;
    }
    let seconds = started.elapsed().as_secs_f64();
    print_done("encode", Done { report, staged, seconds }, r.report.as_deref())
}

/// `vae-parallel inspect`.
pub fn inspect(args: &InspectArgs) -> anyhow::Result<ExitCode> {
    let vae = Vae::builder(&args.model).cost_profile(CostProfile::Off).build()?;
    let model = vae.model();
    println!("model       {}", args.model.display());
    println!("class       {} ({})", model.class_name(), model.models());
    for (label, value) in model.describe() {
        println!("{label:<11} {value}");
    }
    let modes: Vec<String> = vae.supported_modes().iter().map(ToString::to_string).collect();
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
