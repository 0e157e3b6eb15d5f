//! `calibrate`: measures this machine's constants for the cost model
//! ([`vae_parallel::planner::cost::DeviceProfile`]) and writes them as TOML: the convolution
//! shapes the image VAEs run (one thread), a GroupNorm + SiLU pass, attention, the speed-up of
//! more threads, a convolution's scratch, and the in-process link between two ranks.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use vae_parallel::planner::cost::{ConvRate, DeviceProfile};
use vae_parallel::tensor::{Conv2dParams, Conv3dParams, Device, Tensor};
use vae_parallel::transport::{Communicator, CommunicatorExt, TransportConfig, run_local};

/// `vae-parallel calibrate`.
#[derive(Debug, Args)]
pub struct CalibrateArgs {
    /// Where to write the profile (default: the place `plan`, `decode` and `encode` read it
    /// from, `$XDG_CONFIG_HOME/vae-parallel/cpu-profile.toml` or under `~/.config`).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Threads of the multi-thread measurement (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Smaller problems: about a quarter of the time, noisier figures.
    #[arg(long)]
    quick: bool,
}

/// The convolutions measured: `(kernel [t, h, w], align, C_in, C_out)` of the AutoencoderKL
/// encoders and decoders (SD, FLUX.1, FLUX.2) and the Wan2.1 / Qwen-Image decoder, each in the
/// alignment class its layer runs in (the CPU's algorithm).
const SHAPES: &[([usize; 3], usize, usize, usize)] = &[
    ([1, 3, 3], 1, 16, 512),
    ([1, 3, 3], 1, 512, 512),
    ([1, 3, 3], 2, 512, 512),
    ([1, 3, 3], 4, 512, 512),
    ([1, 3, 3], 4, 512, 256),
    ([1, 3, 3], 4, 256, 256),
    ([1, 3, 3], 4, 256, 128),
    ([1, 3, 3], 4, 128, 128),
    ([1, 3, 3], 4, 128, 3),
    ([1, 3, 3], 4, 3, 128),
    ([1, 3, 3], 2, 256, 512),
    ([1, 3, 3], 1, 512, 32),
    ([1, 3, 3], 1, 128, 128),
    ([1, 1, 1], 1, 512, 256),
    ([1, 1, 1], 1, 256, 128),
    ([3, 3, 3], 1, 16, 384),
    ([3, 3, 3], 1, 384, 384),
    ([3, 3, 3], 2, 384, 384),
    ([3, 3, 3], 2, 192, 384),
    ([3, 3, 3], 4, 192, 192),
    ([3, 3, 3], 4, 96, 96),
    ([3, 3, 3], 4, 96, 3),
    ([3, 1, 1], 1, 384, 768),
    ([1, 3, 3], 2, 384, 192),
    ([1, 3, 3], 4, 384, 192),
    ([1, 3, 3], 4, 192, 96),
    ([1, 1, 1], 1, 192, 384),
];

/// The best of `reps` timings of `f` (its result dropped inside the timing) after one untimed
/// run, seconds.
fn best_of<T>(reps: usize, mut f: impl FnMut() -> anyhow::Result<T>) -> anyhow::Result<f64> {
    drop(f()?);
    let mut best = f64::INFINITY;
    for _ in 0..reps {
        let t = Instant::now();
        drop(f()?);
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(best)
}

fn uniform(dims: Vec<usize>, seed: u64) -> anyhow::Result<Tensor> {
    Ok(Tensor::seeded_uniform(dims, seed, -1.0, 1.0, &Device::Cpu)?)
}

/// One convolution's one-thread rate (GMAC/s) on a map large enough to be timed: a 2-D
/// convolution, or a 3-D one over 4 output frames.
fn conv_rate(&(kernel, align, cin, cout): &([usize; 3], usize, usize, usize), budget: f64) -> anyhow::Result<ConvRate> {
    let [kt, k, _] = kernel;
    let frames = if kt > 1 { 4 } else { 1 };
    let per_pixel = (cin * cout * kernel.iter().product::<usize>()) as f64;
    let side = ((budget / per_pixel / frames as f64).sqrt() as usize).clamp(64, 256) / 8 * 8;
    let w = uniform(vec![cout, cin, kt, k, k], 2)?;
    let b = uniform(vec![cout], 3)?;
    let seconds = if kt > 1 {
        let x = uniform(vec![1, cin, frames + kt - 1, side, side], 1)?;
        let p = k / 2;
        let params = Conv3dParams::new([1, 1, 1], [0, 0, p, p, p, p]).band_aligned(align);
        best_of(2, || Ok(x.conv3d(&w, Some(&b), &params)?))?
    } else {
        let x = uniform(vec![1, cin, side, side], 1)?;
        let w = w.reshape(vec![cout, cin, k, k])?;
        let params = Conv2dParams::same(k).band_aligned(align);
        best_of(2, || Ok(x.conv2d(&w, Some(&b), &params)?))?
    };
    let macs = per_pixel * (frames * side * side) as f64;
    Ok(ConvRate { kernel, align, in_channels: cin, out_channels: cout, gmacs: macs / seconds / 1e9 })
}

/// `vae-parallel calibrate`.
pub fn calibrate(args: &CalibrateArgs) -> anyhow::Result<ExitCode> {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let threads = args.threads.unwrap_or(cores).max(1);
    let out = match &args.out {
        Some(p) => p.clone(),
        None => vae_parallel::cost::default_profile_path().context("no HOME to put the profile under: pass --out")?,
    };
    let budget = if args.quick { 1e9 } else { 4e9 };
    let one = rayon::ThreadPoolBuilder::new().num_threads(1).build()?;
    let many = rayon::ThreadPoolBuilder::new().num_threads(threads).build()?;

    eprintln!("calibrating on {} thread(s) of {cores} core(s) …", threads);
    let convs = one.install(|| SHAPES.iter().map(|s| conv_rate(s, budget)).collect::<anyhow::Result<Vec<_>>>())?;
    for c in &convs {
        eprintln!(
            "  conv {}x{}x{} align {} {:>3} -> {:>3}: {:6.1} GMAC/s",
            c.kernel[0], c.kernel[1], c.kernel[2], c.align, c.in_channels, c.out_channels, c.gmacs
        );
    }
    // Thread scaling: the decoder's largest 3×3 class on every thread against one, measured
    // alternately three times (the best of each), so that a drift of the machine's speed
    // between the two does not read as scaling.
    let reference = ([1, 3, 3], 4, 256, 256);
    let (mut single, mut multi) = (0.0f64, 0.0f64);
    for _ in 0..3 {
        single = single.max(one.install(|| conv_rate(&reference, budget))?.gmacs);
        multi = multi.max(many.install(|| conv_rate(&reference, budget))?.gmacs);
    }
    let thread_efficiency =
        if threads > 1 { ((multi / single - 1.0) / (threads - 1) as f64).clamp(0.0, 1.0) } else { 1.0 };
    eprintln!("  {threads} thread(s): {multi:.1} GMAC/s, efficiency {thread_efficiency:.2}");

    // GroupNorm + SiLU: bytes read and written.
    let side = if args.quick { 128 } else { 256 };
    let map = uniform(vec![1, 128, side, side], 4)?;
    let (gamma, beta) = (uniform(vec![128], 5)?, uniform(vec![128], 6)?);
    let seconds = one.install(|| best_of(2, || Ok(map.group_norm_silu(32, &gamma, &beta, 1e-6)?)))?;
    let elementwise_gbps = 2.0 * (map.dims().iter().product::<usize>() * 4) as f64 / seconds / 1e9;
    eprintln!("  group norm + SiLU: {elementwise_gbps:.1} GB/s");

    // Attention over a 32×32 (64×64) map of 512 channels.
    let n = if args.quick { 1024 } else { 4096 };
    let q = uniform(vec![1, n, 512], 7)?;
    let seconds = one.install(|| best_of(1, || Ok(Tensor::attention(&q, &q, &q)?)))?;
    let attention_gmacs = 2.0 * (n * n * 512) as f64 / seconds / 1e9;
    eprintln!("  attention: {attention_gmacs:.1} GMAC/s");

    // A 3×3 convolution's scratch beyond its output and its weights transformed for Winograd
    // F(4×4) (36 values per kernel).
    let conv_scratch_bytes = many.install(|| -> anyhow::Result<u64> {
        let (c, s) = (128, 128);
        let x = uniform(vec![1, c, s, s], 8)?;
        let w = uniform(vec![c, c, 3, 3], 9)?;
        let mem = &vae_parallel::tensor::memory::Account::current();
        let _charged = mem.enter();
        vae_parallel::tensor::memory::reset_peak();
        let before = vae_parallel::tensor::memory::live_bytes();
        drop(x.conv2d(&w, None, &Conv2dParams::same(3).band_aligned(4))?);
        let held = vae_parallel::tensor::memory::peak_bytes().saturating_sub(before);
        let known = (c * s * s + c * c * 36) * 4;
        Ok(held.saturating_sub(known) as u64)
    })?;
    eprintln!("  conv scratch: {conv_scratch_bytes} B");

    let (link_latency_us, link_gbps) = link()?;
    eprintln!("  link (threads): {link_latency_us:.1} µs, {link_gbps:.2} GB/s");

    let profile = DeviceProfile {
        device: format!("cpu: {}", cpu_name()),
        source: format!(
            "vae-parallel calibrate {}{}",
            env!("CARGO_PKG_VERSION"),
            if args.quick { " --quick" } else { "" }
        ),
        cores,
        threads,
        thread_efficiency,
        convs,
        elementwise_gbps,
        attention_gmacs,
        link_latency_us,
        link_gbps,
        conv_scratch_bytes,
    };
    let text = toml::to_string_pretty(&profile).context("serialising the profile")?;
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let mut staged = vae_parallel::output::Staged::new();
    staged.add(&out, text.as_bytes())?;
    staged.commit()?;
    println!("wrote {}", out.display());
    Ok(ExitCode::SUCCESS)
}

/// Two local ranks: the mean of 200 barriers (latency) and an all-gather of 32 MiB each way
/// (bandwidth).
fn link() -> anyhow::Result<(f64, f64)> {
    let results = run_local(2, TransportConfig::default(), |comm| -> anyhow::Result<(f64, f64)> {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let rounds = 200;
        let t = Instant::now();
        for _ in 0..rounds {
            comm.barrier()?;
        }
        let latency_us = t.elapsed().as_secs_f64() / rounds as f64 * 1e6;
        let data = vec![1.0f32; 8 << 20];
        let mut gathered = Vec::new();
        comm.all_gather_into(&data, &mut gathered)?;
        let t = Instant::now();
        comm.all_gather_into(&data, &mut gathered)?;
        let gbps = (data.len() * 4) as f64 / t.elapsed().as_secs_f64() / 1e9;
        Ok((latency_us, gbps))
    })?;
    let mut out = (0.0f64, f64::INFINITY);
    for r in results {
        let (l, g) = r.map_err(|panic| anyhow::anyhow!("a rank panicked: {panic}"))??;
        out = (out.0.max(l), out.1.min(g));
    }
    Ok(out)
}

/// The CPU's model name and the SIMD features the kernels choose from.
fn cpu_name() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = info
        .lines()
        .find_map(|l| l.strip_prefix("model name").and_then(|r| r.split(':').nth(1)))
        .map_or("unknown CPU".to_string(), |m| m.trim().to_string());
    let flags: Vec<&str> = info
        .lines()
        .find_map(|l| l.strip_prefix("flags").and_then(|r| r.split(':').nth(1)))
        .map(|f| {
            f.split_whitespace().filter(|f| ["avx2", "fma", "avx512f", "avx512_bf16", "amx_tile"].contains(f)).collect()
        })
        .unwrap_or_default();
    format!("{model} ({})", flags.join(", "))
}
