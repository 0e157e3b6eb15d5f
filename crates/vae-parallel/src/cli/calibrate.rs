//! `calibrate`: measures this machine's constants for the cost model
//! ([`crate::planner::cost::DeviceProfile`]) and writes them as TOML.
//!
//! Each convolution shape the image and video VAEs run is timed at several map sizes: on the
//! CPU (one thread) at four, from maps too small to amortise packing or transforming the
//! weights to maps past the caches, kept as times to interpolate; on a GPU (`--device cuda`, in
//! `--dtype`) at two, a rate and a call's fixed cost (the launches and a map too small to fill
//! the device). Besides: on the CPU a GroupNorm + SiLU pass, attention, the speed-up of
//! more threads, a convolution's scratch and the in-process link between two ranks; on a GPU
//! the same pass and attention on the whole device, the fixed cost of a small op, a
//! device-to-device copy for the link between ranks sharing the GPU, and the scratch a
//! convolution allocates on the device. With `--model` on a GPU, the per-layer choice between
//! our convolutions and cuDNN's for that model (`fastest`), kept in the profile.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use clap::Args;

use crate::cli::model_cmds::{ComputeType, DeviceArgs, compute_type};
use crate::cost::measure::{
    ConvShape, Timing, attention_gmacs, conv_call, cpu_name, link, norm_silu_gbps, per_call, side_for, uniform,
};
use crate::planner::cost::kernels::cpu_conv_scratch_bytes;
use crate::planner::cost::{ConvRate, DeviceKind, DeviceProfile};
use crate::runtime::DistributedVaeExecutor;
use crate::tensor::cuda::{
    CONV_CHOICES_ENV, ConvKernels, ConvTilesScope, export_conv_choices, probe, resolve_device, synchronize,
};
use crate::tensor::{Conv2dParams, Device, Tensor};
use crate::{CostProfile, Decode, Group, Vae};

/// `vae-parallel calibrate`.
#[derive(Debug, Args)]
pub struct CalibrateArgs {
    /// Where to write the profile (default: the place `plan`, `decode` and `encode` read it
    /// from, `$XDG_CONFIG_HOME/vae-parallel/cpu-profile.toml` or under `~/.config`; for a GPU
    /// `cuda-profile.toml` beside it, which they read only when named with `--profile`).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Threads of the multi-thread measurement (default: all cores; CPU only).
    #[arg(long)]
    threads: Option<usize>,
    /// Smaller problems: about a quarter of the time, noisier figures.
    #[arg(long)]
    quick: bool,
    /// The device to measure and, on a GPU, the element type (the CPU is measured in f32).
    #[command(flatten)]
    target: DeviceArgs,
    /// Divides the maps' sides (1: the sizes the constants are meant for; larger only to check
    /// that the command runs, the figures then meaningless; the CPU's convolution maps keep
    /// their least size).
    #[arg(long, default_value_t = 1)]
    downscale: usize,
    /// A model directory whose convolution layers to choose for on the GPU: one decode of a
    /// latent of `--shape` on one rank with `VAE_CUDA_CONV=fastest` semantics (each layer timed
    /// on our kernels and cuDNN's admissible algorithms), its choices written into the profile
    /// (`conv_choices`) for every process that loads it (`--profile`) and the groups whose
    /// rank 0 it is. CUDA only.
    #[arg(long, requires = "shape")]
    model: Option<PathBuf>,
    /// With `--model`: the latent decoded, `B,C,H,W` (video `B,C,T,H,W`; two frames at least,
    /// so that the layers that read cached frames are chosen too). Choices are per layer, not
    /// per extent: a small latent chooses for every size.
    #[arg(long, requires = "model")]
    shape: Option<String>,
}

/// The convolutions measured: `(kernel [t, h, w], align, C_in, C_out)` of the AutoencoderKL
/// encoders and decoders (SD, FLUX.1, FLUX.2) and the Wan2.1 / Qwen-Image and Wan2.2 decoders,
/// each in the alignment class its layer runs in (the CPU's algorithm).
const SHAPES: &[ConvShape] = &[
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
    ([3, 3, 3], 1, 1024, 1024),
    ([3, 3, 3], 2, 1024, 1024),
    ([3, 3, 3], 4, 512, 512),
    ([3, 3, 3], 4, 256, 256),
    ([1, 3, 3], 4, 1024, 1024),
];

/// The work of one call at which the CPU times every shape (multiply-adds, on one output
/// frame): from maps too small to amortise a call's fixed work to maps larger than the caches
/// (sides 8–512), since a convolution's rate changes with its map.
const CPU_LEVELS: [f64; 4] = [0.25e9, 2e9, 8e9, 32e9];
/// `--quick`: two sizes, a call's fixed cost and one rate.
const CPU_QUICK_LEVELS: [f64; 2] = [0.0625e9, 1e9];
/// The level at which the CPU's thread scaling is timed (pooled over the shapes).
const CPU_SCALING_LEVEL: usize = 2;

/// The small map's side for a large map of `side`: a quarter, rounded up to a multiple of
/// `multiple` (and at least that).
fn small_side(side: usize, multiple: usize) -> usize {
    (side / 4).next_multiple_of(multiple).max(multiple)
}

/// A rate and a call's fixed cost, seconds, from two timings `(seconds, multiply-adds)`:
/// the line `t = call + macs / rate` through both. Where noise makes that line meaningless
/// (no positive slope, or a negative intercept), the large map's average rate and what the
/// small one lost against it.
fn fit(large: (f64, f64), small: (f64, f64)) -> (f64, f64) {
    let ((t_large, m_large), (t_small, m_small)) = (large, small);
    let slope = (m_large - m_small) / (t_large - t_small);
    // A slope far above the large map's average rate is timing noise, not a rate.
    let plausible = slope.is_finite() && slope > 0.0 && slope <= 4.0 * m_large / t_large;
    if plausible && t_small - m_small / slope >= 0.0 {
        (slope, t_small - m_small / slope)
    } else {
        let rate = m_large / t_large;
        (rate, (t_small - m_small / rate).max(0.0))
    }
}

/// One convolution's rate and fixed cost per call (on a CPU packing or transforming its
/// weights; on a GPU its launches and a map too small to fill the device), from a map large
/// enough to be timed (a 3-D one over 4 output frames) and one with a sixteenth of its pixels
/// (and one output frame: the video decoders' widest convolutions run on one latent frame a
/// call): `t = call + macs / rate` through both.
fn conv_rate(timing: &Timing, shape: &ConvShape, budget: f64) -> anyhow::Result<ConvRate> {
    let &(kernel, align, cin, cout) = shape;
    let side = side_for(shape, budget, 4, timing.sides, timing.multiple);
    let large = conv_call(timing, shape, (side, 4), timing.calls[0])?;
    let small = conv_call(timing, shape, (small_side(side, timing.multiple), 1), timing.calls[1])?;
    let (rate, call) = fit(large, small);
    Ok(ConvRate {
        kernel,
        align,
        in_channels: cin,
        out_channels: cout,
        gmacs: rate / 1e9,
        call_us: call * 1e6,
        times: Vec::new(),
    })
}

/// One convolution on one CPU thread, timed on one output frame at each of `levels` of work
/// per call (a distinct side each): its times, and its rate and fixed cost from the smallest
/// and the largest map (for shapes and readers that use the line). Also each timed map's side
/// and seconds.
fn cpu_conv_times(shape: &ConvShape, levels: &[f64]) -> anyhow::Result<(ConvRate, Vec<(usize, f64)>)> {
    let &(kernel, align, cin, cout) = shape;
    let timing = &Timing::CPU;
    let mut sides: Vec<usize> =
        levels.iter().map(|&budget| side_for(shape, budget, 1, timing.sides, timing.multiple)).collect();
    sides.dedup();
    let timed = sides.iter().map(|&side| conv_call(timing, shape, (side, 1), 1)).collect::<Result<Vec<_>, _>>()?;
    let (first, last) = (timed[0], timed[timed.len() - 1]);
    let (rate, call) = if timed.len() > 1 { fit(last, first) } else { (last.1 / last.0, 0.0) };
    // One size (a shape so large that every level is the least side) is a rate, not a curve.
    let times = if timed.len() > 1 {
        sides.iter().zip(&timed).map(|(&side, &(seconds, _))| [(side * side) as f64, seconds]).collect()
    } else {
        Vec::new()
    };
    let measured =
        ConvRate { kernel, align, in_channels: cin, out_channels: cout, gmacs: rate / 1e9, call_us: call * 1e6, times };
    Ok((measured, sides.into_iter().zip(timed.into_iter().map(|(seconds, _)| seconds)).collect()))
}

/// `vae-parallel calibrate`.
pub fn calibrate(args: &CalibrateArgs) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(args.downscale >= 1, "--downscale must be at least 1");
    let requested: Device = args.target.device.parse()?;
    let (device, fallback) = resolve_device(requested);
    if let Some(why) = fallback {
        // Measuring the CPU instead would overwrite its profile with figures nobody asked for.
        let why = why.strip_suffix("; running on the CPU").unwrap_or(&why);
        anyhow::bail!("--device {requested}: {why}; nothing calibrated");
    }
    let (profile, kind) = match device {
        Device::Cpu => {
            anyhow::ensure!(
                args.model.is_none(),
                "--model chooses between our convolutions and cuDNN's on a GPU: it needs --device cuda"
            );
            anyhow::ensure!(
                args.target.dtype.trim() == "f32",
                "calibrate measures the CPU in f32 (the cost model's CPU rates); --dtype {} is for --device cuda",
                args.target.dtype
            );
            (cpu_profile(args)?, DeviceKind::Cpu)
        }
        Device::Cuda(ordinal) => {
            (cuda_profile(ordinal, compute_type(&args.target.dtype, device)?, args)?, DeviceKind::Cuda)
        }
    };
    let out = match &args.out {
        Some(p) => p.clone(),
        None => crate::cost::default_profile_path(kind).context("no HOME to put the profile under: pass --out")?,
    };
    profile.validate().map_err(|e| anyhow::anyhow!("the measured constants are not usable: {e}"))?;
    let text = toml::to_string_pretty(&profile).context("serialising the profile")?;
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let mut staged = crate::output::Staged::new();
    staged.add(&out, text.as_bytes())?;
    staged.commit()?;
    println!("wrote {}", out.display());
    Ok(ExitCode::SUCCESS)
}

/// The source line of a profile this command writes.
fn source(args: &CalibrateArgs) -> String {
    let mut flags = String::new();
    if args.quick {
        flags.push_str(" --quick");
    }
    if args.downscale > 1 {
        flags.push_str(&format!(" --downscale {}", args.downscale));
    }
    format!("vae-parallel calibrate {}{flags}", env!("CARGO_PKG_VERSION"))
}

fn print_conv(c: &ConvRate) {
    eprintln!(
        "  conv {}x{}x{} align {} {:>3} -> {:>3}: {:9.1} GMAC/s{}",
        c.kernel[0],
        c.kernel[1],
        c.kernel[2],
        c.align,
        c.in_channels,
        c.out_channels,
        c.gmacs,
        if c.call_us > 0.0 { format!(", {:.1} µs a call", c.call_us) } else { String::new() }
            + &if c.times.is_empty() {
                String::new()
            } else {
                let times: Vec<String> =
                    c.times.iter().map(|[p, t]| format!("{:.0}²: {:.1} ms", p.sqrt(), t * 1e3)).collect();
                format!(" ({})", times.join(", "))
            }
    );
}

/// The CPU's constants, f32.
fn cpu_profile(args: &CalibrateArgs) -> anyhow::Result<DeviceProfile> {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let threads = args.threads.unwrap_or(cores).max(1);
    let down = (args.downscale * args.downscale) as f64;
    let levels: Vec<f64> =
        if args.quick { &CPU_QUICK_LEVELS[..] } else { &CPU_LEVELS[..] }.iter().map(|l| l / down).collect();
    let one = rayon::ThreadPoolBuilder::new().num_threads(1).build()?;
    let many = rayon::ThreadPoolBuilder::new().num_threads(threads).build()?;

    eprintln!("calibrating on {} thread(s) of {cores} core(s) …", threads);
    // Each shape on one thread at every level, then on every thread at one level: the host's
    // thread scaling of 2-D and of 3-D convolutions, pooled over their shapes (one shape's
    // alone is as noisy as it is large on a shared machine; together they weigh the shapes by
    // their time, as a decode does).
    let scaling_level = CPU_SCALING_LEVEL.min(levels.len() - 1);
    let mut pooled = [[0.0f64; 3]; 2];
    let mut convs = Vec::with_capacity(SHAPES.len());
    for shape in SHAPES {
        let (rate, sides) = one.install(|| cpu_conv_times(shape, &levels))?;
        print_conv(&rate);
        if threads > 1 {
            let at = scaling_level.min(sides.len() - 1);
            let (side, single) = sides[at];
            // Every thread, one, every thread again: the best of each, so that a slow spell of a
            // shared machine does not read as scaling.
            let timed = |pool: &rayon::ThreadPool| pool.install(|| conv_call(&Timing::CPU, shape, (side, 1), 1));
            let (multi, macs) = timed(&many)?;
            let single = single.min(timed(&one)?.0);
            let multi = multi.min(timed(&many)?.0);
            let sums = &mut pooled[usize::from(shape.0[0] > 1)];
            for (sum, v) in sums.iter_mut().zip([single, multi, macs]) {
                *sum += v;
            }
        }
        convs.push(rate);
    }
    let efficiency = |[single, multi, _]: [f64; 3]| {
        if threads > 1 && multi > 0.0 { ((single / multi - 1.0) / (threads - 1) as f64).clamp(0.0, 1.0) } else { 1.0 }
    };
    let rate = |[_, multi, macs]: [f64; 3]| if multi > 0.0 { macs / multi / 1e9 } else { 0.0 };
    let (thread_efficiency, thread_efficiency_3d) = (efficiency(pooled[0]), efficiency(pooled[1]));
    if threads > 1 {
        let (flat, video) = (rate(pooled[0]), rate(pooled[1]));
        eprintln!("  {threads} thread(s), 2-D: {flat:.1} GMAC/s, efficiency {thread_efficiency:.2}");
        eprintln!("  {threads} thread(s), 3-D: {video:.1} GMAC/s, efficiency {thread_efficiency_3d:.2}");
    }

    // GroupNorm + SiLU: bytes read and written.
    let side = (if args.quick { 128 } else { 256 } / args.downscale).max(8);
    let elementwise_gbps = one.install(|| norm_silu_gbps(&Timing::CPU, side, 1))?;
    eprintln!("  group norm + SiLU: {elementwise_gbps:.1} GB/s");

    // Attention over a 32×32 (64×64) map of 512 channels.
    let n = (if args.quick { 1024 } else { 4096 } / down as usize).max(64);
    let attention_gmacs = one.install(|| attention_gmacs(&Timing { reps: 1, ..Timing::CPU }, n, 1))?;
    eprintln!("  attention: {attention_gmacs:.1} GMAC/s");

    // What a 3×3 Winograd F(4×4) convolution holds beyond its output and what the model counts
    // for its kernel (`kernels`: the transformed weights, a band's buffers): the rest.
    let conv_scratch_bytes = many.install(|| -> anyhow::Result<u64> {
        let (c, s) = (128, 128);
        let x = uniform(vec![1, c, s, s], 8)?;
        let w = uniform(vec![c, c, 3, 3], 9)?;
        let mem = &crate::tensor::memory::Account::current();
        let _charged = mem.enter();
        crate::tensor::memory::reset_peak();
        let before = crate::tensor::memory::live_bytes();
        drop(x.conv2d(&w, None, &Conv2dParams::same(3).band_aligned(4))?);
        let held = crate::tensor::memory::peak_bytes().saturating_sub(before);
        let kernel = cpu_conv_scratch_bytes([1, 3, 3], 4, [c, c], [s, s], rayon::current_num_threads());
        let known = (c * s * s * 4) as u64 + kernel;
        Ok((held as u64).saturating_sub(known))
    })?;
    eprintln!("  conv scratch: {conv_scratch_bytes} B");

    let (link_latency_us, link_gbps) = link()?;
    eprintln!("  link (threads): {link_latency_us:.1} µs, {link_gbps:.2} GB/s");

    Ok(DeviceProfile {
        device: format!("cpu: {}", cpu_name()),
        kind: DeviceKind::Cpu,
        dtype: "f32".into(),
        source: source(args),
        cores,
        threads,
        thread_efficiency,
        thread_efficiency_3d: Some(thread_efficiency_3d),
        convs,
        elementwise_gbps,
        attention_gmacs,
        op_call_us: 0.0,
        link_latency_us,
        link_gbps,
        conv_scratch_bytes,
        conv_choices: Vec::new(),
    })
}

/// Calls back to back per timed batch on a GPU: `n`, or one in a downscaled run, which only
/// checks that the command works.
fn calls(downscale: usize, n: usize) -> usize {
    if downscale > 1 { 1 } else { n }
}

/// Timed batches on a GPU: three, or one in a downscaled run.
fn reps(downscale: usize) -> usize {
    if downscale > 1 { 1 } else { 3 }
}

/// The constants of GPU `ordinal` in `compute`: one whole GPU, which ranks sharing it divide.
fn cuda_profile(ordinal: usize, compute: ComputeType, args: &CalibrateArgs) -> anyhow::Result<DeviceProfile> {
    let device = Device::Cuda(ordinal);
    let info = probe(ordinal).map_err(anyhow::Error::msg)?;
    let dtype = compute.dtype;
    let _tf32 = compute.tf32.then(crate::tensor::Tf32Scope::enter);
    let down = (args.downscale * args.downscale) as f64;
    let budget = if args.quick { 2.5e10 } else { 1e11 } / down;
    let on = |t: Tensor| -> anyhow::Result<Tensor> { Ok(t.to_device(&device)?.to_dtype(dtype)?) };
    let elem = dtype.size_in_bytes();
    let (calls, reps) = (|n: usize| calls(args.downscale, n), reps(args.downscale));
    eprintln!("calibrating {} ({device}) in {compute} …", info.name);

    let timing =
        Timing { device, dtype, sides: [32 / args.downscale, 1024], multiple: 4, calls: [calls(4), calls(16)], reps };
    let convs = SHAPES.iter().map(|s| conv_rate(&timing, s, budget)).collect::<anyhow::Result<Vec<_>>>()?;
    convs.iter().for_each(print_conv);

    // GroupNorm + SiLU over a large map: bytes read and written.
    let side = (if args.quick { 512 } else { 1024 } / args.downscale).max(8);
    let elementwise_gbps = norm_silu_gbps(&timing, side, calls(4))?;
    eprintln!("  group norm + SiLU: {elementwise_gbps:.1} GB/s");

    // A small op's fixed cost: SiLU over 8 Ki elements, many back to back.
    let tiny = on(uniform(vec![1, 32, 16, 16], 7)?)?;
    let op_call_us = per_call(device, calls(200), reps, || Ok(tiny.silu()?))? * 1e6;
    eprintln!("  a small op: {op_call_us:.1} µs");

    // Attention over a 64×64 map of 512 channels (96×96 unless --quick).
    let n = (if args.quick { 4096 } else { 9216 } / down as usize).max(64);
    let attention_gmacs = attention_gmacs(&timing, n, calls(2))?;
    eprintln!("  attention: {attention_gmacs:.1} GMAC/s");

    // A 3×3 convolution's device scratch beyond its output, its padded channels-last input
    // and its reordered weights.
    let conv_scratch_bytes = {
        let (c, s) = (128, (256 / args.downscale).max(8));
        let x = on(uniform(vec![1, c, s, s], 9)?)?;
        let w = on(uniform(vec![c, c, 3, 3], 10)?)?;
        synchronize(device)?;
        let mem = crate::tensor::memory::Account::new();
        let _charged = mem.enter();
        let out = x.conv2d(&w, None, &Conv2dParams::same(3))?;
        synchronize(device)?;
        let known = (c * s * s + c * (s + 2) * (s + 2) + c * c * 9) * elem;
        drop(out);
        mem.device_peak_bytes().saturating_sub(known) as u64
    };
    eprintln!("  conv scratch: {conv_scratch_bytes} B");

    // Ranks sharing the GPU hand each other device tensors: a message costs the host's
    // handshake (two local ranks' barrier) and a device-to-device copy.
    let (link_latency_us, _) = link()?;
    let half = on(uniform(vec![1, 64, side / 2, side], 11)?)?;
    let seconds = per_call(device, calls(4), reps, || Ok(Tensor::cat(&[&half, &half], 2)?))?;
    let link_gbps = (2 * half.dims().iter().product::<usize>() * elem) as f64 / seconds / 1e9;
    eprintln!("  link (ranks on this GPU): {link_latency_us:.1} µs, {link_gbps:.1} GB/s");

    Ok(DeviceProfile {
        device: format!("cuda: {} ({compute})", info.name),
        kind: DeviceKind::Cuda,
        dtype: compute.to_string(),
        source: source(args),
        cores: 1,
        threads: 1,
        thread_efficiency: 1.0,
        thread_efficiency_3d: None,
        convs,
        elementwise_gbps,
        attention_gmacs,
        op_call_us,
        link_latency_us,
        link_gbps,
        conv_scratch_bytes,
        conv_choices: model_conv_choices(args, device, compute)?,
    })
}

/// `--model`'s per-layer convolution choices on `device`: one decode of a seeded latent of
/// `--shape` on one rank, every convolution under `fastest` (timed the first time its layer is
/// seen), then the process's table as [`export_conv_choices`] writes it, a line each.
fn model_conv_choices(args: &CalibrateArgs, device: Device, compute: ComputeType) -> anyhow::Result<Vec<String>> {
    let (Some(model), Some(shape)) = (&args.model, &args.shape) else { return Ok(Vec::new()) };
    let dims = crate::cli::parse_shape(shape, "a comma-separated latent shape")?;
    if std::env::var_os(CONV_CHOICES_ENV).is_some_and(|v| !v.is_empty()) {
        eprintln!(
            "warning: {CONV_CHOICES_ENV} is set: its choices are recorded, and the layers it does not name as ours"
        );
    }
    eprintln!("  choosing convolutions for {} …", model.display());
    let latent = Tensor::seeded_uniform(dims, 7, -1.0, 1.0, &Device::Cpu)?;
    let decode = Decode::default();
    Group::local(1)?.run_on_ranks(|comm| {
        // On the rank's thread: its scopes hold there.
        let _fastest = ConvTilesScope::only(ConvKernels::Fastest);
        let vae = Vae::builder(model)
            .device(device)
            .dtype(compute.dtype)
            .tf32(compute.tf32)
            .cost_profile(CostProfile::Off)
            .build()?;
        let executor = DistributedVaeExecutor::new(Arc::clone(comm), 1)?;
        vae.decode_on(&executor, &latent, &decode)?;
        Ok(())
    })?;
    let choices: Vec<String> = export_conv_choices().lines().map(str::to_owned).collect();
    for line in &choices {
        eprintln!("  conv choice {}", line.replace('\t', "  "));
    }
    Ok(choices)
}
