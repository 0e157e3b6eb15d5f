//! `vae-parallel bench kernels`: each op the decoders spend their time in, alone, at the shapes
//! a Wan2.1 480x832 decode (and an SD-style 1024 px AutoencoderKL decode) gives it, with the
//! achieved FLOP/s (convolutions, attention) or bytes/s (everything else) next to the device's
//! peak. On the CPU there is no published peak, so only the achieved rate is printed. On CUDA
//! the convolutions are timed again with each tile width of the tensor-core kernels forced
//! (`[128-px tiles]`, `[256-px tiles]`), side by side with the backend's own choice.

use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context;
use clap::Args;

use crate::tensor::cuda::{ConvKernels, ConvTilesScope, probe, resolve_device, synchronize, wgmma_runs};
use crate::tensor::{Conv2dParams, Conv3dParams, DType, Device, Tensor};

/// Options of `bench kernels`.
#[derive(Debug, Args)]
pub struct KernelBenchArgs {
    /// Where the ops run and in what type.
    #[command(flatten)]
    target: crate::cli::model_cmds::DeviceArgs,
    /// Divides every spatial extent (1: the real decoder shapes; larger for a quick look).
    #[arg(long, default_value_t = 1)]
    downscale: usize,
    /// Timed runs per op, after one warm-up; the best is reported.
    #[arg(long, default_value_t = 3)]
    iters: usize,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

/// What bounds an op: arithmetic or memory traffic.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Bound {
    /// Counted in FLOPs (an FMA is two).
    Compute(f64),
    /// Counted in the bytes it must read and write at least once.
    Memory(f64),
}

/// The op of a case, on its prepared inputs.
type OpFn = Box<dyn Fn(&[Tensor]) -> crate::tensor::Result<Tensor>>;

/// One op at one shape.
struct Case {
    name: String,
    shape: String,
    bound: Bound,
    /// Inputs, on the host in f32; moved to the device (and type) before timing.
    inputs: Vec<Tensor>,
    /// Which inputs take the compute type (the rest are f32 per-channel parameters).
    typed: Vec<bool>,
    run: OpFn,
    /// A convolution on tensor cores, timed again at each tile width on CUDA.
    tiled: bool,
}

fn random(dims: &[usize], seed: u64) -> anyhow::Result<Tensor> {
    Ok(Tensor::seeded_uniform(dims.to_vec(), seed, -1.0, 1.0, &Device::Cpu)?)
}

fn elems(dims: &[usize]) -> f64 {
    dims.iter().product::<usize>() as f64
}

/// Wan's causal 3x3x3 conv from `x` ([1, Cin, 3, H, W]) to `cout` channels on one new frame
/// behind its 2 cached ones (no temporal padding: every tap is real work), weights scaled by
/// `scale`, inputs seeded from `seed`; `tiled` where it runs on the tensor-core tiles.
fn conv3d_case(name: &str, x: [usize; 5], cout: usize, scale: f32, seed: u64, tiled: bool) -> anyhow::Result<Case> {
    let w = [cout, x[1], 3, 3, 3];
    Ok(Case {
        name: name.into(),
        shape: format!("{x:?} * {w:?}"),
        bound: Bound::Compute(2.0 * elems(&w) * elems(&x[3..])),
        inputs: vec![random(&x, seed)?, random(&w, seed + 1)?.mul_scalar(scale)?, random(&[cout], seed + 2)?],
        typed: vec![true, true, false],
        run: Box::new(|t| t[0].conv3d(&t[1], Some(&t[2]), &Conv3dParams::new([1; 3], [0, 0, 1, 1, 1, 1]))),
        tiled,
    })
}

/// The cases, spatial extents divided by `down`; `size` is the element size of the compute type.
fn cases(down: usize, size: f64) -> anyhow::Result<Vec<Case>> {
    let d = |n: usize| (n / down).max(1);
    let mut out = Vec::new();
    // Wan2.1 decoder: 384 channels at the latent resolution.
    out.push(conv3d_case("conv3d 3x3x3 (cached)", [1, 384, 3, d(60), d(104)], 384, 0.02, 1, true)?);
    // Wan2.1's last stage: 96 channels at full resolution, where a decode spends a third of its
    // convolution FLOPs.
    out.push(conv3d_case("conv3d 3x3x3 96 ch", [1, 96, 3, d(480), d(832)], 96, 0.03, 20, true)?);
    // The resample conv after an upsample (Wan, 192 channels at 4x) and AutoencoderKL's 3x3.
    let x = [1, 192, d(240), d(416)];
    let w = [192, 192, 3, 3];
    out.push(Case {
        name: "conv2d 3x3".into(),
        shape: format!("{x:?} * {w:?}"),
        bound: Bound::Compute(2.0 * 192.0 * 192.0 * 9.0 * elems(&x[2..])),
        inputs: vec![random(&x, 4)?, random(&w, 5)?.mul_scalar(0.02)?, random(&[192], 6)?],
        typed: vec![true, true, false],
        run: Box::new(|t| t[0].conv2d(&t[1], Some(&t[2]), &Conv2dParams::same(3))),
        tiled: true,
    });
    // Wan2.1's RGB head: 96 channels to 3 at full resolution (CUDA cores: a tensor-core tile
    // would be 61 rows of zeros out of 64).
    out.push(conv3d_case("conv3d 3x3x3 to RGB", [1, 96, 3, d(480), d(832)], 3, 0.05, 10, false)?);
    // Mid-block attention over the latent's positions, one head of 384.
    let n = d(60) * d(104);
    let q = [1, n, 384];
    out.push(Case {
        name: "attention".into(),
        shape: format!("{q:?}"),
        bound: Bound::Compute(4.0 * (n * n) as f64 * 384.0),
        inputs: vec![random(&q, 7)?, random(&q, 8)?, random(&q, 9)?],
        typed: vec![true; 3],
        run: Box::new(|t| Tensor::attention(&t[0], &t[1], &t[2])),
        tiled: false,
    });
    // The memory-bound ops, each at the decoder shape above and at one large realistic shape:
    // Wan2.1's last stage (96 channels, 4 frames of 480x832 per chunk: 153 M elements), an SD
    // 1024 px decoder's GroupNorm at full resolution, and a 4x upsample / permute stage.
    let small_v = [1, 384, 1, d(120), d(208)];
    let large_v = [1, 96, 4, d(480), d(832)];
    for (v, label) in [(small_v, ""), (large_v, " (large)")] {
        let name = |op: &str| format!("{op}{label}");
        let c = v[1];
        out.push(Case {
            name: name("rms_norm_channels"),
            shape: format!("{v:?}"),
            bound: Bound::Memory(2.0 * elems(&v) * size),
            inputs: vec![random(&v, 10)?, random(&[c, 1, 1, 1], 11)?],
            typed: vec![true, false],
            run: Box::new(|t| t[0].rms_norm_channels(&t[1], None, 1, 1e-12)),
            tiled: false,
        });
        out.push(Case {
            name: name("silu"),
            shape: format!("{v:?}"),
            bound: Bound::Memory(2.0 * elems(&v) * size),
            inputs: vec![random(&v, 15)?],
            typed: vec![true],
            run: Box::new(|t| t[0].silu()),
            tiled: false,
        });
        out.push(Case {
            name: name("add"),
            shape: format!("{v:?}"),
            bound: Bound::Memory(3.0 * elems(&v) * size),
            inputs: vec![random(&v, 16)?, random(&v, 17)?],
            typed: vec![true, true],
            run: Box::new(|t| t[0].add(&t[1])),
            tiled: false,
        });
    }
    for (g, label) in [([1, 512, d(128), d(128)], ""), ([1, 128, d(1024), d(1024)], " (large)")] {
        let c = g[1];
        out.push(Case {
            name: format!("group_norm{label}"),
            shape: format!("{g:?}"),
            bound: Bound::Memory(2.0 * elems(&g) * size),
            inputs: vec![random(&g, 12)?, random(&[c], 13)?, random(&[c], 14)?],
            typed: vec![true, false, false],
            run: Box::new(|t| t[0].group_norm(32, &t[1], &t[2], 1e-6)),
            tiled: false,
        });
    }
    for (u, label) in [([1, 384, d(60), d(104)], ""), ([1, 192, d(240), d(416)], " (large)")] {
        out.push(Case {
            name: format!("upsample_nearest2d x2{label}"),
            shape: format!("{u:?}"),
            bound: Bound::Memory(5.0 * elems(&u) * size),
            inputs: vec![random(&u, 18)?],
            typed: vec![true],
            run: Box::new(|t| t[0].upsample_nearest2d(2)),
            tiled: false,
        });
        out.push(Case {
            name: format!("permute (NCHW -> NHWC){label}"),
            shape: format!("{u:?}"),
            bound: Bound::Memory(2.0 * elems(&u) * size),
            inputs: vec![random(&u, 19)?],
            typed: vec![true],
            run: Box::new(|t| t[0].permute(&[0, 2, 3, 1])),
            tiled: false,
        });
    }
    Ok(out)
}

/// Runs `bench kernels`.
pub fn run(args: &KernelBenchArgs) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(args.iters >= 1, "--iters must be at least 1");
    anyhow::ensure!(args.downscale >= 1, "--downscale must be at least 1");
    let (device, fallback) = resolve_device(args.target.device.parse()?);
    if let Some(why) = fallback {
        eprintln!("warning: --device {}: {why}", args.target.device);
    }
    let compute = crate::cli::model_cmds::compute_type(&args.target.dtype, device)?;
    let dtype = compute.dtype;
    let _tf32 = compute.tf32.then(crate::tensor::Tf32Scope::enter);
    // bf16 on the CPU: f32 tensors, convolutions with bf16 products.
    let cpu_bf16 = device.is_cpu() && dtype == DType::BF16;
    let _bf16 = cpu_bf16.then(crate::tensor::CpuBf16Scope::enter).transpose()?;
    let info = match device {
        Device::Cuda(ordinal) => Some(probe(ordinal).map_err(anyhow::Error::msg)?),
        Device::Cpu => None,
    };
    let peak_compute = info.as_ref().and_then(|i| match dtype {
        DType::BF16 => i.peak_bf16_tensor_flops(),
        _ if compute.tf32 => i.peak_tf32_tensor_flops(),
        _ => i.peak_f32_flops(),
    });
    let peak_bandwidth = info.as_ref().map(|i| i.peak_bandwidth());

    let mut rows = Vec::new();
    // On CUDA each tensor-core case also runs on each kernel family forced, side by side; the
    // warpgroup-MMA kernels only where they exist (bf16 on compute capability 9.0).
    let mut widths = vec![None];
    if let Device::Cuda(ordinal) = device {
        widths.extend([Some(ConvKernels::Pixels128), Some(ConvKernels::Pixels256)]);
        if wgmma_runs(ordinal, dtype)? {
            widths.push(Some(ConvKernels::Wgmma));
        }
    }
    for case in cases(args.downscale, dtype.size_in_bytes() as f64)? {
        let inputs = case
            .inputs
            .iter()
            .zip(&case.typed)
            .map(|(t, &typed)| {
                let t = t.to_device(&device)?;
                if typed && !cpu_bf16 { t.to_dtype(dtype) } else { Ok(t) }
            })
            .collect::<crate::tensor::Result<Vec<_>>>()
            .with_context(|| format!("{}: preparing the inputs", case.name))?;
        for &width in widths.iter().filter(|w| case.tiled || w.is_none()) {
            let _tiles = width.map(ConvTilesScope::only);
            let name = match width {
                None => case.name.clone(),
                Some(ConvKernels::Wgmma) => format!("{} [wgmma]", case.name),
                Some(w) => format!("{} [{w}-px tiles]", case.name),
            };
            let mut best = f64::INFINITY;
            for i in 0..=args.iters {
                let clock = Instant::now();
                let out = (case.run)(&inputs).with_context(|| name.clone())?;
                synchronize(device)?;
                let seconds = clock.elapsed().as_secs_f64();
                drop(out);
                if i > 0 {
                    best = best.min(seconds); // run 0 warms up (kernel loading, caches)
                }
            }
            let (amount, peak, unit) = match case.bound {
                Bound::Compute(flops) => (flops, peak_compute, "FLOP/s"),
                Bound::Memory(bytes) => (bytes, peak_bandwidth, "B/s"),
            };
            let achieved = amount / best;
            rows.push(serde_json::json!({
                "op": name,
                "shape": case.shape,
                "best_ms": best * 1e3,
                "unit": unit,
                "achieved": achieved,
                "peak": peak,
                "fraction_of_peak": peak.map(|p| achieved / p),
            }));
        }
    }
    if args.json {
        let value = serde_json::json!({
            "kind": "kernels",
            "device": device.to_string(),
            "device_name": info.as_ref().map(|i| i.name.clone()),
            "dtype": compute.to_string(),
            "downscale": args.downscale,
            "iters": args.iters,
            "ops": rows,
        });
        println!("{value}");
        return Ok(ExitCode::SUCCESS);
    }
    let threads = rayon::current_num_threads();
    match &info {
        Some(i) => println!("ops on {device} ({}) in {compute}, best of {}", i.name, args.iters),
        None => println!("ops on the CPU ({threads} thread(s)) in {dtype}, best of {} (no published peak)", args.iters),
    }
    println!("{:<40}  {:>34}  {:>10}  {:>16}  {:>16}  {:>8}", "op", "shape", "best ms", "achieved", "peak", "of peak");
    for r in &rows {
        let rate = |v: &serde_json::Value| {
            v.as_f64().map_or("-".to_string(), |x| {
                let unit = r["unit"].as_str().unwrap_or("");
                if unit == "B/s" { format!("{:.1} GB/s", x / 1e9) } else { format!("{:.2} TFLOP/s", x / 1e12) }
            })
        };
        println!(
            "{:<40}  {:>34}  {:>10.3}  {:>16}  {:>16}  {:>8}",
            r["op"].as_str().unwrap_or(""),
            r["shape"].as_str().unwrap_or(""),
            r["best_ms"].as_f64().unwrap_or(0.0),
            rate(&r["achieved"]),
            rate(&r["peak"]),
            r["fraction_of_peak"].as_f64().map_or("-".to_string(), |f| format!("{:.1} %", f * 100.0)),
        );
    }
    Ok(ExitCode::SUCCESS)
}
