//! `vae-parallel bench`: transport throughput, failure-detection latency, single-rank decode
//! and encode latency / memory on a real model directory, shard vs tile side by side, and
//! per-op rates (`kernel_bench`).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Args, Subcommand};

use crate::cli::model_cmds::ComputeType;
use crate::cli::ranks::{GroupArgs, Ranks};
use crate::report::human_bytes;
use crate::runtime::{DistributedVaeExecutor, HaloOverlap, RuntimeError};
use crate::runtime::{ParallelMode, RankReport, StrategyReport};
use crate::tensor::cuda::{ConvKernels, ConvTilesScope};
use crate::transport::TransportConfig;
use crate::transport::{Communicator, CommunicatorExt, ReduceOp};
use crate::{CostProfile, Decode, Device, Encode, Error, Group, Tensor, Tiling, Vae};

/// Which benchmark.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Bandwidth of all_gather and broadcast between ranks.
    Transport(TransportArgs),
    /// How long the other ranks take to learn that one rank died.
    Failover(FailoverArgs),
    /// Latency and peak memory of decoding one latent on one rank (local transport, parallel
    /// size 1, untiled), for comparison with diffusers (`scripts/bench_diffusers.py`).
    Decode(DecodeBenchArgs),
    /// Latency and peak memory of encoding one image on one rank (local transport, parallel
    /// size 1, untiled, the latent distribution's mean), measured as `bench decode` measures.
    Encode(EncodeBenchArgs),
    /// One process, side by side: the direct decode on one rank, the spatial-shard decode, the
    /// tile-parallel decode and (when asked) the pipelined decode on N local ranks (each rank
    /// with its own thread pool): latency, per-rank activation peak, bytes exchanged, halo
    /// bytes, and agreement with the direct decode.
    Shard(ShardBenchArgs),
    /// Each op the decoders spend their time in, alone, at a Wan2.1 480x832 (and SD 1024 px)
    /// decode's shapes: achieved FLOP/s or bytes/s next to the device's peak (`--device cuda`
    /// without a usable GPU: the CPU, with a warning).
    Kernels(crate::cli::kernel_bench::KernelBenchArgs),
    /// A soak of a running `vae-parallel serve`: mixed requests from concurrent clients,
    /// latency percentiles, throughput, the processes' RSS, every answer checked against its
    /// case's first; `--kill-rank` then times the recovery from a rank killed mid-request.
    Serve(crate::cli::serve_bench::ServeBenchArgs),
}

/// Options of `bench shard`.
#[derive(Debug, Args)]
pub struct ShardBenchArgs {
    /// A diffusers video VAE directory (AutoencoderKLWan or AutoencoderKLQwenImage).
    #[arg(long)]
    model: PathBuf,
    /// The latent (`.npy` or `.safetensors`); without it, a random latent of `--shape`.
    #[arg(long)]
    latent: Option<PathBuf>,
    /// Shape of the random latent, `B,C,T,H,W` (default: Wan's 480x832, 9 frames).
    #[arg(long, default_value = "1,16,3,60,104")]
    shape: String,
    /// Ranks of the shard and tile runs.
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    /// Shard mode: `auto`, `spatial_shard_height`, `spatial_shard_width` or `spatial_shard_2d`
    /// (the grid of blocks closest to square).
    #[arg(long, default_value = "auto")]
    mode: String,
    /// Compute threads of each rank (its own pool).
    #[arg(long, default_value_t = 1)]
    threads_per_rank: usize,
    /// Which runs, comma-separated, in order: `direct`, `shard` (halo exchanges overlapped with
    /// the interior's compute where that pays), `shard-blocking` (each exchange made whole
    /// before its convolution), `shard-overlap-all` (every convolution overlapped), `tile`,
    /// `pipeline` (the decoder's layers in stages over the ranks, frame by frame).
    #[arg(long, default_value = "direct,shard,tile")]
    runs: String,
    /// `cpu` (default) or `cuda[:N]`: every rank on that one device (on a GPU, each rank queues
    /// its kernels on a stream of its own), falling back to the CPU with a warning.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// `f32` (default), `bf16` or `tf32` (CUDA only; see `decode --help`).
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

/// Options of `bench decode`.
#[derive(Debug, Args)]
pub struct DecodeBenchArgs {
    /// The latent: `.npy` or `.safetensors`, f32 `[B, C, H, W]` (video VAEs `[B, C, T, H, W]`).
    #[arg(long)]
    latent: PathBuf,
    #[command(flatten)]
    common: OneRankBenchArgs,
}

/// Options of `bench encode`.
#[derive(Debug, Args)]
pub struct EncodeBenchArgs {
    /// The image: `.npy` or `.safetensors`, f32 `[B, 3, H, W]` in [-1, 1] (video VAEs
    /// `[B, 3, T, H, W]`).
    #[arg(long)]
    input: PathBuf,
    #[command(flatten)]
    common: OneRankBenchArgs,
}

/// What `bench decode` and `bench encode` share.
#[derive(Debug, Args)]
pub struct OneRankBenchArgs {
    /// A diffusers VAE directory (`config.json` + safetensors weights).
    #[arg(long)]
    model: PathBuf,
    /// Timed runs (after one warm-up).
    #[arg(long, default_value_t = 3)]
    iters: usize,
    /// Also time every tensor op of the timed runs (vae-tensor's per-op timers, CPU) and print
    /// the split: calls and milliseconds per run, share of the run.
    #[arg(long)]
    profile: bool,
    /// Compute threads (rayon's global pool; default: all cores). The pool can be sized once
    /// per process, so compare thread counts in separate runs.
    #[arg(long)]
    threads: Option<usize>,
    /// Print one JSON object (the numbers of the table) instead of the table.
    #[arg(long)]
    json: bool,
    /// `cpu` (default) or `cuda[:N]` (falls back to the CPU with a warning).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// `f32` (default), `bf16` or `tf32` (CUDA only; see `decode --help`).
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// The convolutions' kernels: `auto` (default: ours, the backend picks a tile per launch),
    /// `mma.sync` tiles of `128` or `256` pixels (bit-identical results, only the time differs),
    /// `wgmma`: Hopper's warpgroup MMA for the bf16 convolutions of 96 channels and more
    /// (compute capability 9.0; elsewhere and for other convolutions, auto), `cudnn`: cuDNN's
    /// convolutions (libcudnn.so.9 loaded at run time, see VAE_CUDNN_PATH; ours where it does not
    /// load), or `fastest`: per convolution shape, ours or a cuDNN algorithm, whichever ran
    /// fastest when the shape was first timed. CUDA only.
    #[arg(long, default_value = "auto")]
    conv_tiles: String,
}

/// Parses `--conv-tiles`: `None` for the backend's own choice.
fn conv_tiles(flag: &str, device: Device) -> anyhow::Result<Option<ConvKernels>> {
    if flag.trim() == "auto" {
        return Ok(None);
    }
    let kernels = flag.parse::<ConvKernels>().map_err(|_| {
        anyhow::anyhow!("--conv-tiles {:?} is not auto, 128, 256, wgmma, cudnn or fastest", flag.trim())
    })?;
    anyhow::ensure!(!device.is_cpu(), "--conv-tiles {flag} needs a CUDA device (the CPU has no tensor-core tiles)");
    Ok(Some(kernels))
}

/// Options of `bench transport`.
#[derive(Debug, Args)]
pub struct TransportArgs {
    #[command(flatten)]
    group: GroupArgs,
    /// Bytes each rank contributes, in MiB.
    #[arg(long, default_value_t = 32)]
    mib: usize,
    /// Timed repetitions (after one warm-up).
    #[arg(long, default_value_t = 5)]
    iters: usize,
}

/// Options of `bench failover`.
#[derive(Debug, Args)]
pub struct FailoverArgs {
    #[command(flatten)]
    group: GroupArgs,
    /// How long after the last barrier the victim (the last rank) dies, in milliseconds.
    #[arg(long, default_value_t = 200)]
    delay_ms: u64,
}

/// Runs the chosen benchmark.
pub fn run(which: &BenchCommand) -> anyhow::Result<ExitCode> {
    match which {
        BenchCommand::Transport(args) => transport(args),
        BenchCommand::Failover(args) => failover(args),
        BenchCommand::Decode(args) => one_rank(Task::Decode, &args.latent, &args.common),
        BenchCommand::Encode(args) => one_rank(Task::Encode, &args.input, &args.common),
        BenchCommand::Shard(args) => shard(args),
        BenchCommand::Kernels(args) => crate::cli::kernel_bench::run(args),
        BenchCommand::Serve(args) => crate::cli::serve_bench::run(args),
    }
}

/// A benchmark's own failure inside a rank, as the group reports errors.
fn failed(what: &str) -> Error {
    Error::Runtime(RuntimeError::Protocol(what.to_string()))
}

/// One timed collective: the slowest rank's time of each repetition.
fn time_collective(
    comm: &dyn Communicator,
    iters: usize,
    mut op: impl FnMut() -> crate::Result<()>,
) -> crate::Result<Vec<f64>> {
    op()?; // warm-up: connections, page faults, allocations
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters {
        comm.barrier()?;
        let t = Instant::now();
        op()?;
        let mut slowest = [t.elapsed().as_secs_f64()];
        comm.all_reduce(ReduceOp::Max, &mut slowest)?;
        times.push(slowest[0]);
    }
    Ok(times)
}

struct TransportResult {
    all_gather: Vec<f64>,
    broadcast: Vec<f64>,
}

fn transport(args: &TransportArgs) -> anyhow::Result<ExitCode> {
    let bytes = args.mib << 20;
    let group = match crate::cli::ranks::ranks(&args.group, None)?.group()? {
        Ok(group) => group,
        Err(supervised) => return Ok(supervised),
    };
    let result = group.run_on_ranks(|comm| {
        let send = vec![comm.rank() as u8; bytes];
        // Steady state: the receive buffer is reused, as a serving process would.
        let mut recv = Vec::new();
        let all_gather = time_collective(comm.as_ref(), args.iters, || {
            comm.all_gather_into(&send, &mut recv)?;
            if recv.len() != bytes * comm.size() {
                return Err(failed("short all_gather"));
            }
            Ok(())
        })?;
        let mut buf = send.clone();
        let broadcast = time_collective(comm.as_ref(), args.iters, || Ok(comm.broadcast(0, &mut buf)?))?;
        Ok(TransportResult { all_gather, broadcast })
    })?;
    if group.rank() != 0 {
        return Ok(ExitCode::SUCCESS);
    }
    let (backend, world) = (group.backend(), group.size());
    let mib = args.mib as f64;
    println!(
        "transport {backend}, {world} ranks, {} MiB per rank, best / median of {} (slowest rank each time)",
        args.mib, args.iters
    );
    println!(
        "{:>11}  {:>10}  {:>10}  {:>14}  {:>14}",
        "collective", "best ms", "median ms", "algbw GiB/s", "busbw GiB/s"
    );
    // NCCL's conventions: algbw = data size / time; all_gather busbw = algbw·(n-1)/n.
    for (name, times, data_mib, bus_factor) in [
        ("all_gather", &result.all_gather, mib * world as f64, (world as f64 - 1.0) / world as f64),
        ("broadcast", &result.broadcast, mib, 1.0),
    ] {
        let mut sorted = times.clone();
        sorted.sort_by(f64::total_cmp);
        let (best, median) = (sorted[0], sorted[sorted.len() / 2]);
        let algbw = data_mib / 1024.0 / best;
        println!(
            "{name:>11}  {:>10.2}  {:>10.2}  {:>14.2}  {:>14.2}",
            best * 1e3,
            median * 1e3,
            algbw,
            algbw * bus_factor
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn failover(args: &FailoverArgs) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(args.group.ranks >= 2, "failover needs at least 2 ranks");
    let delay = Duration::from_millis(args.delay_ms);
    let group = match crate::cli::ranks::ranks(&args.group, None)? {
        Ranks::Group(group) => group,
        Ranks::Supervised(exit) => {
            // The victim is expected to fail; the others must succeed.
            let failed = exit.failed_ranks();
            anyhow::ensure!(failed == vec![args.group.ranks - 1], "unexpected failures: ranks {failed:?}");
            return Ok(ExitCode::SUCCESS);
        }
    };
    let victim = group.size() - 1;
    let lines = Mutex::new(Vec::new());
    let outcome = group.run_on_ranks(|comm| {
        comm.barrier()?;
        if comm.rank() == victim {
            std::thread::sleep(delay);
            if comm.backend() == "socket" {
                // A crash: no destructor runs, the kernel closes the sockets.
                std::process::abort();
            }
            panic!("rank {victim} dies on purpose");
        }
        let waiting = Instant::now();
        let Err(err) = comm.barrier() else { return Err(failed("the victim reached the barrier")) };
        let detected = waiting.elapsed().saturating_sub(delay);
        lines.lock().unwrap_or_else(|e| e.into_inner()).push((comm.rank(), detected, err.to_string()));
        Ok(())
    });
    // The victim's death is the error expected; any other is the benchmark's. A local group
    // reports it (every rank ran here); a surviving rank process has only its own part, which
    // saw the death.
    match outcome {
        Err(Error::OnRank { rank, .. }) if rank == victim && group.is_local() => {}
        Err(e) => return Err(e.into()),
        Ok(()) if !group.is_local() => {}
        Ok(()) => anyhow::bail!("rank {victim} did not die"),
    }
    let mut lines = lines.into_inner().unwrap_or_else(|e| e.into_inner());
    lines.sort_by_key(|(rank, ..)| *rank);
    for (rank, detected, err) in lines {
        println!(
            "rank {rank}: death of rank {victim} reported {:.2} ms after it happened: {err}",
            detected.as_secs_f64() * 1e3
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// A `/proc/self/status` field in KiB (`VmRSS`, `VmHWM`).
fn proc_status_kib(key: &str) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    status
        .lines()
        .find_map(|line| line.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
        .with_context(|| format!("no {key} in /proc/self/status"))
}

/// Restarts the kernel's resident-set high-water mark (`VmHWM`) from the current resident set;
/// false where the kernel refuses.
fn reset_rss_high_water() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

const MIB: f64 = (1u64 << 20) as f64;

/// What `bench decode` / `bench encode` time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Task {
    /// `vae.decode(z)`.
    Decode,
    /// `vae.encode(x)`, the latent distribution's mean.
    Encode,
}

impl Task {
    /// The JSON `"kind"` and the verb of the table.
    fn name(self) -> &'static str {
        match self {
            Task::Decode => "decode",
            Task::Encode => "encode",
        }
    }
}

struct OneRankRun {
    input: Vec<usize>,
    output: Vec<usize>,
    times: Vec<f64>,
    peak_tensor_bytes: usize,
    /// Device tensor high-water mark (weights included; 0 on the CPU).
    peak_device_bytes: usize,
    live_tensor_bytes: usize,
    hwm_reset: bool,
    baseline_kib: u64,
    /// Per-op totals over the timed runs (empty without `--profile`).
    profile: Vec<crate::tensor::profile::OpTime>,
}

/// Loads the engine once, runs the task once to warm up, then times `iters` runs. Memory is
/// measured as `scripts/bench_diffusers.py` does: the resident high-water mark is reset after
/// the load, the baseline is the resident set then, and the peak is `VmHWM` at the end.
fn run_on_one_rank(
    task: Task,
    input: &Path,
    args: &OneRankBenchArgs,
    device: Device,
    compute: ComputeType,
    tiles: Option<ConvKernels>,
) -> anyhow::Result<OneRankRun> {
    let (model, iters, profile) = (&args.model, args.iters, args.profile);
    let (decode, encode) = (Decode::default(), Encode::default());
    let group = Group::local(1)?;
    group
        .run_on_ranks(|comm| {
            // The work runs on the rank's thread, in its pool: its scopes and its account.
            let _tiles = tiles.map(ConvTilesScope::only);
            let vae = Vae::builder(model)
                .device(device)
                .dtype(compute.dtype)
                .tf32(compute.tf32)
                .cost_profile(CostProfile::Off)
                .build()?;
            let input = crate::io::read_tensor(input)?;
            let executor = DistributedVaeExecutor::new(Arc::clone(comm), 1)?;
            let run = || match task {
                Task::Decode => vae.decode_on(&executor, &input, &decode),
                Task::Encode => vae.encode_on(&executor, &input, &encode),
            };
            // Weights and the input: the high-water mark below counts them too.
            let live_tensor_bytes = crate::tensor::memory::live_bytes();
            let hwm_reset = reset_rss_high_water();
            let baseline_kib =
                proc_status_kib(if hwm_reset { "VmRSS" } else { "VmHWM" }).map_err(|e| failed(&e.to_string()))?;

            let warm = run()?;
            let output = warm.tensor.ok_or_else(|| failed("rank 0 got no output"))?.dims().to_vec();
            let mut peak_tensor_bytes = warm.report.peak_bytes;
            let mut peak_device_bytes = warm.report.device_peak_bytes;
            let mut times = Vec::with_capacity(iters);
            let timers = crate::tensor::profile::set_enabled;
            timers(profile);
            let _ = crate::tensor::profile::take();
            for _ in 0..iters {
                let t = Instant::now();
                let out = run()?;
                times.push(t.elapsed().as_secs_f64());
                peak_tensor_bytes = peak_tensor_bytes.max(out.report.peak_bytes);
                peak_device_bytes = peak_device_bytes.max(out.report.device_peak_bytes);
                drop(out);
            }
            timers(false);
            let profile = crate::tensor::profile::take();
            Ok(OneRankRun {
                profile,
                input: input.dims().to_vec(),
                output,
                times,
                peak_tensor_bytes,
                peak_device_bytes,
                live_tensor_bytes,
                hwm_reset,
                baseline_kib,
            })
        })
        .map_err(Into::into)
}

/// `bench decode` and `bench encode`: one rank, untiled, one warm-up then `iters` timed runs.
fn one_rank(task: Task, input: &Path, args: &OneRankBenchArgs) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(args.iters >= 1, "--iters must be at least 1");
    if let Some(n) = args.threads {
        anyhow::ensure!(n >= 1, "--threads must be at least 1");
        // First thing, before any parallel work can create the default pool.
        rayon::ThreadPoolBuilder::new().num_threads(n).build_global().context("sizing rayon's global thread pool")?;
    }
    let (device, fallback) = crate::tensor::cuda::resolve_device(args.device.parse()?);
    if let Some(why) = fallback {
        eprintln!("warning: --device {}: {why}", args.device);
    }
    let dtype = crate::cli::model_cmds::compute_type(&args.dtype, device)?;
    let tiles = conv_tiles(&args.conv_tiles, device)?;
    if let (Some(ConvKernels::Wgmma), Device::Cuda(ordinal)) = (tiles, device)
        && !crate::tensor::cuda::wgmma_runs(ordinal, dtype.dtype)?
    {
        eprintln!(
            "warning: --conv-tiles wgmma: no warpgroup MMA kernels for {dtype} on cuda:{ordinal} (bf16 on compute \
             capability 9.0 only); the convolutions take the backend's mma.sync choice"
        );
    }
    if matches!(tiles, Some(ConvKernels::Cudnn | ConvKernels::Fastest))
        && let Err(why) = crate::tensor::cuda::cudnn_version()
    {
        eprintln!("warning: --conv-tiles {}: {why}; our kernels run instead", args.conv_tiles.trim());
    }
    let run = run_on_one_rank(task, input, args, device, dtype, tiles)?;
    let peak_kib = proc_status_kib("VmHWM")?;

    let mut sorted = run.times.clone();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    let (best, median) = (sorted[0], (sorted[(n - 1) / 2] + sorted[n / 2]) / 2.0);
    let baseline_mib = run.baseline_kib as f64 / 1024.0;
    let peak_mib = peak_kib as f64 / 1024.0;
    let task_mib = peak_kib.saturating_sub(run.baseline_kib) as f64 / 1024.0;
    let tensor_mib = run.peak_tensor_bytes as f64 / MIB;
    let live_mib = run.live_tensor_bytes as f64 / MIB;
    let threads = rayon::current_num_threads();
    // The image's width: the output's (decode) or the input's (encode).
    let image = match task {
        Task::Decode => &run.output,
        Task::Encode => &run.input,
    };
    if args.json {
        // The field names of `scripts/bench_diffusers.py` (`decode_rss_mib` for encodes too).
        let value = serde_json::json!({
            "kind": task.name(),
            "impl": "vae-parallel",
            "device": device.to_string(),
            "dtype": dtype.to_string(),
            "conv_tiles": tiles.map_or("auto".to_string(), |w| w.to_string()),
            // Whether cuDNN ran (`cudnn`, `fastest`), and what `fastest` chose per shape.
            "cudnn_convolutions": crate::tensor::cuda::cudnn_convolutions(),
            "conv_choices": crate::tensor::cuda::export_conv_choices(),
            "size": image.last().copied().unwrap_or(0),
            "input_shape": run.input,
            "output_shape": run.output,
            "threads": threads,
            "iters": args.iters,
            "best_ms": best * 1e3,
            "median_ms": median * 1e3,
            "times_ms": run.times.iter().map(|t| t * 1e3).collect::<Vec<_>>(),
            "hwm_reset": run.hwm_reset,
            "baseline_rss_mib": baseline_mib,
            "peak_rss_mib": peak_mib,
            "decode_rss_mib": task_mib,
            "peak_tensor_mib": tensor_mib,
            "peak_device_mib": run.peak_device_bytes as f64 / MIB,
            "live_tensor_mib_before": live_mib,
            "cpu_isa": crate::tensor::cpu_isa_name(),
            "profile": run.profile.iter().map(|op| serde_json::json!({
                "op": op.name,
                "calls_per_run": op.calls as f64 / args.iters as f64,
                "ms_per_run": op.time.as_secs_f64() * 1e3 / args.iters as f64,
            })).collect::<Vec<_>>(),
        });
        println!("{value}");
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{} {} {:?} → {:?} on {device} in {dtype}, 1 rank (local), untiled, {threads} thread(s), best / median of {}",
        task.name(),
        input.display(),
        run.input,
        run.output,
        args.iters
    );
    println!("latency       best {:.1} ms, median {:.1} ms", best * 1e3, median * 1e3);
    println!(
        "tensors       peak {tensor_mib:.1} MiB alive at once (vae-tensor high-water mark), \
         {live_mib:.1} MiB of it (weights, {}) alive before",
        match task {
            Task::Decode => "latent",
            Task::Encode => "image",
        }
    );
    if run.peak_device_bytes > 0 {
        println!(
            "device        peak {:.1} MiB of tensors on {device} (weights included)",
            run.peak_device_bytes as f64 / MIB
        );
    }
    println!(
        "process RSS   peak {peak_mib:.1} MiB, {task_mib:.1} MiB above the {baseline_mib:.1} MiB after loading{}",
        if run.hwm_reset { "" } else { " (high-water mark not reset: includes the load)" }
    );
    if args.profile {
        print_profile(&run.profile, args.iters, median);
    }
    Ok(ExitCode::SUCCESS)
}

/// The per-op split of the timed runs, per run, longest first, with the time outside ops.
fn print_profile(ops: &[crate::tensor::profile::OpTime], iters: usize, run_s: f64) {
    let per_run = |d: Duration| d.as_secs_f64() / iters as f64;
    let in_ops: f64 = ops.iter().map(|op| per_run(op.time)).sum();
    println!("per-op split (CPU kernels: {}), per run:", crate::tensor::cpu_isa_name());
    println!("  {:<20} {:>8} {:>10} {:>7}", "op", "calls", "ms", "share");
    for op in ops {
        let ms = per_run(op.time) * 1e3;
        let share = per_run(op.time) / run_s * 100.0;
        println!("  {:<20} {:>8.0} {:>10.1} {:>6.1}%", op.name, op.calls as f64 / iters as f64, ms, share);
    }
    let rest = (run_s - in_ops).max(0.0);
    println!("  {:<20} {:>8} {:>10.1} {:>6.1}%", "(outside ops)", "", rest * 1e3, rest / run_s * 100.0);
}

/// One run of `bench shard`.
struct ShardRun {
    name: String,
    ranks: usize,
    seconds: f64,
    output: Tensor,
    reports: Vec<RankReport>,
}

/// Decodes on the local `group`; the time is the slowest rank's, from a common barrier.
fn timed_local_decode(
    vae: &Vae,
    group: &Group,
    latent: &Tensor,
    options: &Decode,
) -> anyhow::Result<(f64, Tensor, Vec<RankReport>)> {
    let ranks = Mutex::new(Vec::new());
    let output = group.run_on_ranks(|comm| {
        let executor = DistributedVaeExecutor::new(Arc::clone(comm), comm.size())?
            .with_tile_merge(options.tile_merge)
            .with_halo_overlap(options.halo_overlap);
        comm.barrier()?;
        let started = Instant::now();
        let out = vae.decode_on(&executor, latent, options)?;
        ranks.lock().unwrap_or_else(|e| e.into_inner()).push((started.elapsed().as_secs_f64(), out.report));
        Ok(out.tensor)
    })?;
    let mut ranks = ranks.into_inner().unwrap_or_else(|e| e.into_inner());
    ranks.sort_by_key(|(_, report)| report.rank);
    let seconds = ranks.iter().map(|(s, _)| *s).fold(0.0, f64::max);
    let reports = ranks.into_iter().map(|(_, report)| report).collect();
    Ok((seconds, output.context("rank 0 got no output")?, reports))
}

fn shard(args: &ShardBenchArgs) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(args.ranks >= 1 && args.threads_per_rank >= 1, "--ranks and --threads-per-rank must be at least 1");
    let mode: ParallelMode = args.mode.parse()?;
    anyhow::ensure!(
        !matches!(mode, ParallelMode::Tile | ParallelMode::Pipeline),
        "--mode is the shard mode (auto or spatial_shard_*); tile and pipeline run as the runs `tile` and `pipeline`"
    );
    let (device, fallback) = crate::tensor::cuda::resolve_device(args.device.parse()?);
    if let Some(why) = fallback {
        eprintln!("warning: --device {}: {why}", args.device);
    }
    let dtype = crate::cli::model_cmds::compute_type(&args.dtype, device)?;
    let vae = Vae::builder(&args.model)
        .device(device)
        .dtype(dtype.dtype)
        .tf32(dtype.tf32)
        .cost_profile(CostProfile::Off)
        .build()?;
    anyhow::ensure!(
        vae.check_mode(ParallelMode::SpatialShardHeight).is_ok(),
        "bench shard needs a family with a spatial shard ({} has none)",
        vae.class_name()
    );
    // Long CPU decodes: a rank may wait minutes for the slowest one in a collective.
    let config = TransportConfig { collective_timeout: Duration::from_secs(6 * 3600), ..TransportConfig::default() };
    let group = |ranks: usize| {
        Group::local_builder(ranks).threads_per_rank(args.threads_per_rank).transport_config(config).build()
    };
    let (one, many) = (group(1)?, group(args.ranks)?);
    let latent = match &args.latent {
        Some(path) => crate::io::read_tensor(path)?,
        None => {
            let dims = crate::cli::parse_shape(&args.shape, "B,C,T,H,W")?;
            // Seed 0: the latent every `bench shard` run has used.
            Tensor::seeded_uniform(dims, 0, -2.0, 2.0, &Device::Cpu)?
        }
    };
    let mut runs: Vec<ShardRun> = Vec::new();
    for name in args.runs.split(',').map(str::trim) {
        // The reference's semantics, as the CLI's `decode`: tiles on several ranks, the direct
        // decode on one.
        let reference = Decode::default().tiling(Tiling::Reference { asked: false });
        let (ranks, options) = match name {
            "direct" => (1, reference.mode(ParallelMode::Tile)),
            "shard" | "shard-blocking" | "shard-overlap-all" => (args.ranks, reference.mode(mode)),
            "tile" => (args.ranks, reference.mode(ParallelMode::Tile).tiled()),
            "pipeline" => (args.ranks, reference.mode(ParallelMode::Pipeline)),
            other => anyhow::bail!(
                "unknown run {other:?} (direct, shard, shard-blocking, shard-overlap-all, tile or pipeline)"
            ),
        };
        let overlap = match name {
            "shard-blocking" => HaloOverlap::Never,
            "shard-overlap-all" => HaloOverlap::Always,
            _ => HaloOverlap::WherePays,
        };
        let options = options.halo_overlap(overlap);
        let group = if ranks == 1 { &one } else { &many };
        eprintln!("running {name} on {ranks} rank(s) x {} thread(s) on {device}...", args.threads_per_rank);
        if !device.is_cpu() {
            // Untimed: the first decode of a shape on a GPU also grows the memory pool and, on
            // the first run, loads the kernels.
            timed_local_decode(&vae, group, &latent, &options)?;
        }
        let (seconds, output, reports) = timed_local_decode(&vae, group, &latent, &options)?;
        runs.push(ShardRun { name: name.to_string(), ranks, seconds, output, reports });
    }
    let direct = runs.iter().find(|r| r.name == "direct");
    // A rank's peak of what it computes with: host memory on the CPU, device memory on a GPU
    // (the weights included, which every rank of the process shares).
    let rank_peak = |r: &RankReport| if device.is_cpu() { r.exec_peak_bytes } else { r.device_peak_bytes };
    let rows: Vec<serde_json::Value> = runs
        .iter()
        .map(|run| {
            let peak = run.reports.iter().map(rank_peak).max().unwrap_or(0);
            let sent: u64 = run.reports.iter().map(|r| r.traffic.bytes_sent()).sum();
            let (halo_sent, halo_reused, map_sent, halo_ms, wait_ms) =
                run.reports.iter().fold((0, 0, 0, 0.0, 0.0), |acc, r| match &r.strategy {
                    StrategyReport::Shard { traffic, .. } | StrategyReport::Blocks { traffic, .. } => (
                        acc.0 + traffic.halo_bytes_sent,
                        acc.1 + traffic.halo_bytes_reused,
                        acc.2 + traffic.map_bytes_sent,
                        f64::max(acc.3, traffic.comm_time().as_secs_f64() * 1e3),
                        f64::max(acc.4, traffic.halo_wait.as_secs_f64() * 1e3),
                    ),
                    // A pipeline's hand-overs (waiting included) are in its per-stage lines.
                    StrategyReport::Pipeline(_) | StrategyReport::Tile => acc,
                });
            let (speedup, peak_ratio, diff, identical) = match direct {
                Some(d) => {
                    let d_peak = rank_peak(&d.reports[0]).max(1) as f64;
                    (
                        Some(d.seconds / run.seconds),
                        Some(peak as f64 / d_peak),
                        run.output.max_abs_diff(&d.output).ok(),
                        Some(run.output.bit_eq(&d.output)),
                    )
                }
                None => (None, None, None, None),
            };
            // Pipeline: each stage's steps, busy and hand-over time, weights and peak.
            let stages: Vec<serde_json::Value> = run
                .reports
                .iter()
                .filter_map(|r| match &r.strategy {
                    StrategyReport::Pipeline(stage) if stage.stage.is_some() => Some(serde_json::json!({
                        "rank": r.rank,
                        "steps": [stage.steps.start, stage.steps.end],
                        "cost_share": f64::from(stage.cost_share_ppm) / 1e6,
                        "busy_ms": stage.busy.as_secs_f64() * 1e3,
                        "idle_ms": stage.idle.as_secs_f64() * 1e3,
                        "weight_mib": stage.weight_bytes as f64 / MIB,
                        "exec_peak_mib": rank_peak(r) as f64 / MIB,
                    })),
                    _ => None,
                })
                .collect();
            serde_json::json!({
                "stages": stages,
                "run": run.name,
                "ranks": run.ranks,
                "strategy": run.reports[0].strategy.label(),
                "reason": run.reports[0].reason,
                "seconds": run.seconds,
                "speedup_vs_direct": speedup,
                "max_rank_exec_peak_mib": peak as f64 / MIB,
                "peak_ratio_vs_direct": peak_ratio,
                "bytes_sent_all_ranks": sent,
                "halo_bytes_sent_all_ranks": halo_sent,
                "halo_bytes_reused_all_ranks": halo_reused,
                "map_bytes_sent_all_ranks": map_sent,
                "max_rank_comm_ms": halo_ms,
                "max_rank_halo_wait_ms": wait_ms,
                "max_abs_diff_vs_direct": diff,
                "bit_identical_to_direct": identical,
            })
        })
        .collect();
    let summary = serde_json::json!({
        "kind": "shard",
        "device": device.to_string(),
        "dtype": dtype.to_string(),
        "latent": latent.dims(),
        "threads_per_rank": args.threads_per_rank,
        "runs": rows,
    });
    if args.json {
        println!("{summary}");
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "decode of a {:?} latent in {dtype} on {device}, {} thread(s) per rank, one process (local ranks)",
        latent.dims(),
        args.threads_per_rank
    );
    println!(
        "{:<14} {:>5}  {:<13} {:>9} {:>8}  {:>11} {:>7}  {:>11} {:>11} {:>11} {:>10} {:>10}  {:>9}",
        "run",
        "ranks",
        "strategy",
        "seconds",
        "speedup",
        "peak/rank",
        "vs 1",
        "sent",
        "halo sent",
        "halo saved",
        "comm ms",
        "halo wait",
        "max diff"
    );
    for row in &rows {
        let opt = |k: &str, f: &dyn Fn(f64) -> String| row[k].as_f64().map_or_else(|| "-".to_string(), f);
        println!(
            "{:<14} {:>5}  {:<13} {:>9.2} {:>8}  {:>11} {:>7}  {:>11} {:>11} {:>11} {:>10.1} {:>10.1}  {:>9}",
            row["run"].as_str().unwrap_or(""),
            row["ranks"],
            row["strategy"].as_str().unwrap_or(""),
            row["seconds"].as_f64().unwrap_or(0.0),
            opt("speedup_vs_direct", &|v| format!("{v:.2}x")),
            format!("{:.1} MiB", row["max_rank_exec_peak_mib"].as_f64().unwrap_or(0.0)),
            opt("peak_ratio_vs_direct", &|v| format!("{v:.3}")),
            human_bytes(row["bytes_sent_all_ranks"].as_u64().unwrap_or(0)),
            human_bytes(row["halo_bytes_sent_all_ranks"].as_u64().unwrap_or(0)),
            human_bytes(row["halo_bytes_reused_all_ranks"].as_u64().unwrap_or(0)),
            row["max_rank_comm_ms"].as_f64().unwrap_or(0.0),
            row["max_rank_halo_wait_ms"].as_f64().unwrap_or(0.0),
            opt("max_abs_diff_vs_direct", &|v| format!("{v:.1e}")),
        );
    }
    for row in &rows {
        println!("  {}: {}", row["run"].as_str().unwrap_or(""), row["reason"].as_str().unwrap_or(""));
        for stage in row["stages"].as_array().into_iter().flatten() {
            println!(
                "    rank {} steps {}: predicted {:.1} % of the work, busy {:.0} ms, in hand-overs {:.0} ms, weights {:.1} MiB, peak {:.1} MiB",
                stage["rank"],
                stage["steps"],
                stage["cost_share"].as_f64().unwrap_or(0.0) * 100.0,
                stage["busy_ms"].as_f64().unwrap_or(0.0),
                stage["idle_ms"].as_f64().unwrap_or(0.0),
                stage["weight_mib"].as_f64().unwrap_or(0.0),
                stage["exec_peak_mib"].as_f64().unwrap_or(0.0),
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}
