//! `vae-parallel demo`: the README's main job with nothing to download. By default a built-in
//! small AutoencoderKL (SD-like, seeded random weights) decodes a seeded latent on one rank
//! and on N ranks (tile-parallel), and the two are compared; `--operator synthetic` runs a
//! stand-in decoder instead (fast, for exercising the executor and transports).

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Args, ValueEnum};
use vae_parallel::io;
use vae_parallel::models::autoencoder_kl::{AutoencoderKl, AutoencoderKlConfig, KlOperator, KlTask};
use vae_parallel::report::{RequestReport, gather_summaries, human_bytes};
use vae_parallel::runtime::synthetic::SyntheticDecoder;
use vae_parallel::runtime::{
    DistributedVaeExecutor, ExecOutput, Job, Output, OutputPlacement, TileOperator, execute_serial,
};
use vae_parallel::tensor::{Device, Tensor};
use vae_parallel::transport::{Communicator, CommunicatorExt};

use crate::ranks::GroupArgs;

/// The built-in model: diffusers `AutoencoderKL`, SD layout (4 levels, 4 latent channels, 8×)
/// at reduced widths, 128-pixel tiles (16 latent, stride 12).
const PRESET_CONFIG: &str = r#"{
    "_class_name": "AutoencoderKL",
    "block_out_channels": [16, 32, 64, 64],
    "down_block_types": ["DownEncoderBlock2D", "DownEncoderBlock2D", "DownEncoderBlock2D", "DownEncoderBlock2D"],
    "up_block_types": ["UpDecoderBlock2D", "UpDecoderBlock2D", "UpDecoderBlock2D", "UpDecoderBlock2D"],
    "layers_per_block": 1,
    "latent_channels": 4,
    "norm_num_groups": 8,
    "sample_size": 128
}"#;
const PRESET_SEED: u64 = 2026;

/// Which operator the demo runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DemoOperator {
    /// The built-in AutoencoderKL preset (seeded weights), tiled as diffusers tiles.
    Vae,
    /// A stand-in decoder: nearest upsampling, doubled, offset per tile.
    Synthetic,
}

/// Options of `vae-parallel demo`.
#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    #[command(flatten)]
    group: GroupArgs,
    /// What to run.
    #[arg(long, value_enum, default_value_t = DemoOperator::Vae)]
    operator: DemoOperator,
    /// Ranks that execute tiles (default: all).
    #[arg(long)]
    parallel_size: Option<usize>,
    /// Latent height (default: 40 for the VAE = 320 px; 60 for the synthetic operator).
    #[arg(long)]
    height: Option<usize>,
    /// Latent width (default: 56 for the VAE = 448 px; 104 for the synthetic operator).
    #[arg(long)]
    width: Option<usize>,
    /// Synthetic operator: input channels.
    #[arg(long, default_value_t = 4)]
    channels: usize,
    /// Synthetic operator: tile size in latent units.
    #[arg(long, default_value_t = 32)]
    tile: usize,
    /// Synthetic operator: tile stride in latent units.
    #[arg(long, default_value_t = 24)]
    stride: usize,
    /// Synthetic operator: output pixels per latent unit.
    #[arg(long, default_value_t = 8)]
    scale: usize,
    /// Synthetic operator: simulated work per tile, in milliseconds.
    #[arg(long, default_value_t = 0)]
    work_ms: u64,
    /// Give the output to every rank instead of rank 0 only.
    #[arg(long)]
    broadcast: bool,
    /// Where the VAE demo writes the decoded image (PNG).
    #[arg(long, default_value = "vae-parallel-demo.png")]
    out: PathBuf,
    /// Also write the report as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Also write the report as an SVG plot of every rank's phases to this file.
    #[arg(long)]
    svg: Option<PathBuf>,
}

/// What rank 0 found.
struct Outcome {
    report: RequestReport,
    output_dims: Vec<usize>,
    max_abs_diff: f32,
    copies_agree: bool,
    wall: Duration,
    single_wall: Duration,
    single_peak: usize,
    written: Option<PathBuf>,
}

impl Outcome {
    fn identical(&self) -> bool {
        self.max_abs_diff == 0.0 && self.copies_agree
    }
}

/// A deterministic input with structure and noise.
fn pattern(dims: [usize; 4]) -> anyhow::Result<Tensor> {
    let n: usize = dims.iter().product();
    let data = (0..n)
        .map(|i| {
            let h = (i as u32).wrapping_mul(2654435761) >> 8;
            ((i as f32) * 0.001).sin() + (h as f32 / (1u32 << 24) as f32 - 0.5)
        })
        .collect();
    Ok(Tensor::from_vec(data, dims, &Device::Cpu)?)
}

fn synthetic(args: &DemoArgs) -> SyntheticDecoder {
    SyntheticDecoder {
        tile: args.tile,
        stride: args.stride,
        scale: args.scale,
        tile_offset: 1.0 / 64.0,
        work_per_tile: Duration::from_millis(args.work_ms),
    }
}

/// Runs `op` on every rank, then (rank 0) on a group of one for comparison.
fn run_and_compare<O: TileOperator + Sync>(
    comm: Arc<dyn Communicator>,
    args: &DemoArgs,
    x: &Tensor,
    op: &O,
    strategy: String,
) -> anyhow::Result<Option<(Outcome, Tensor)>> {
    let world = comm.size();
    let placement = if args.broadcast { OutputPlacement::AllRanks } else { OutputPlacement::OwnerOnly };
    let executor = DistributedVaeExecutor::new(Arc::clone(&comm), args.parallel_size.unwrap_or(world))?;
    let started = Instant::now();
    let out: ExecOutput = executor.run(x, Job::tiles(op), Output::Placed(placement))?;
    let wall = started.elapsed();

    // Every rank that holds the output says what it holds.
    let hash = out.tensor.as_ref().map(Tensor::content_hash).transpose()?.unwrap_or(0);
    let hashes = comm.gather(0, &[hash])?;
    let summaries = gather_summaries(comm.as_ref(), 0, &out.report)?;
    let (Some(hashes), Some(summaries)) = (hashes, summaries) else {
        return Ok(None);
    };

    // The same request without a group, on this thread, for comparison (same thread: the
    // memory high-water marks then count the same model and input).
    vae_parallel::tensor::memory::reset_peak();
    let started = Instant::now();
    let reference = execute_serial(op, x)?;
    let single_wall = started.elapsed();
    let single_peak = vae_parallel::tensor::memory::peak_bytes();
    let merged = out.tensor.context("rank 0 owns the output")?;
    let copies_agree = hashes.as_flat().iter().enumerate().all(|(r, h)| {
        let holds = r == 0 || placement == OutputPlacement::AllRanks;
        if holds { *h == hashes.as_flat()[0] } else { *h == 0 }
    });
    let outcome = Outcome {
        report: RequestReport {
            mode: "tile".into(),
            strategy: out.report.strategy.label(),
            reason: strategy,
            fallback: false,
            backend: comm.backend().to_string(),
            world_size: world,
            parallel_size: executor.parallel_size(),
            tile_count: out.report.tile_count,
            predicted_ms: None,
            predicted_peak_bytes: None,
            ranks: summaries,
        },
        output_dims: merged.dims().to_vec(),
        max_abs_diff: merged.max_abs_diff(&reference)?,
        copies_agree,
        wall,
        single_wall,
        single_peak,
        written: None,
    };
    Ok(Some((outcome, merged)))
}

fn rank_body(comm: Arc<dyn Communicator>, args: &DemoArgs) -> anyhow::Result<Option<Outcome>> {
    match args.operator {
        DemoOperator::Vae => {
            let config = AutoencoderKlConfig::from_json(PRESET_CONFIG).map_err(anyhow::Error::msg)?;
            let model = AutoencoderKl::synthetic(config, PRESET_SEED)?;
            let (h, w) = (args.height.unwrap_or(40), args.width.unwrap_or(56));
            let z = pattern([1, 4, h, w])?;
            let op = KlOperator::new(&model, KlTask::Decode, true);
            let tiles = model.tiling();
            let strategy =
                format!("tile ({} px tiles, overlap {})", tiles.tile_sample_min_size, tiles.tile_overlap_factor);
            let Some((mut outcome, image)) = run_and_compare(comm, args, &z, &op, strategy)? else { return Ok(None) };
            outcome.written = io::write_png_batch(&args.out, &image)?.into_iter().next();
            Ok(Some(outcome))
        }
        DemoOperator::Synthetic => {
            let x = pattern([1, args.channels, args.height.unwrap_or(60), args.width.unwrap_or(104)])?;
            let op = synthetic(args);
            let strategy = format!("tile ({}/{} synthetic tiles)", args.tile, args.stride);
            Ok(run_and_compare(comm, args, &x, &op, strategy)?.map(|(o, _)| o))
        }
    }
}

/// Runs the demo and prints what happened.
pub fn run(args: &DemoArgs) -> anyhow::Result<ExitCode> {
    if let Some(dir) = args.out.parent().filter(|p| !p.as_os_str().is_empty())
        && !dir.is_dir()
    {
        anyhow::bail!("output directory {} does not exist", dir.display());
    }
    let group = match crate::ranks::ranks(&args.group, None)?.group()? {
        Ok(group) => group,
        Err(supervised) => return Ok(supervised),
    };
    let rank0 = group.run_on_ranks(|comm| {
        rank_body(Arc::clone(comm), args)
            .map_err(|e| vae_parallel::Error::Runtime(vae_parallel::runtime::RuntimeError::Protocol(format!("{e:#}"))))
    })?;
    if group.rank() != 0 {
        return Ok(ExitCode::SUCCESS);
    }
    let Some(o) = rank0 else { anyhow::bail!("rank 0 produced no outcome") };

    match args.operator {
        DemoOperator::Vae => println!(
            "vae-parallel demo: built-in AutoencoderKL (SD layout, seeded weights) decoding a latent to {:?}",
            o.output_dims
        ),
        DemoOperator::Synthetic => println!(
            "vae-parallel demo: synthetic decoder (nearest ×{} upsample, doubled, offset per tile) → {:?}",
            args.scale, o.output_dims
        ),
    }
    println!(
        "  transport {}, {} rank(s), parallel size {}, output to {}; mode {}: {} tiles",
        o.report.backend,
        o.report.world_size,
        o.report.parallel_size,
        if args.broadcast { "all ranks" } else { "rank 0" },
        o.report.reason,
        o.report.tile_count
    );
    println!();
    let peak = o.report.ranks.iter().map(|r| r.peak_bytes).max().unwrap_or(0);
    println!("  {:>8}  {:>10}  {:>12}  {:>16}", "ranks", "time ms", "peak mem", "max |diff| vs 1");
    println!(
        "  {:>8}  {:>10.1}  {:>12}  {:>16}",
        1,
        o.single_wall.as_secs_f64() * 1e3,
        human_bytes(o.single_peak as u64),
        "-"
    );
    println!(
        "  {:>8}  {:>10.1}  {:>12}  {:>16}",
        o.report.world_size,
        o.wall.as_secs_f64() * 1e3,
        human_bytes(peak),
        o.max_abs_diff
    );
    println!();
    print!("{}", o.report.to_table());
    println!("  (* = owner: merged the tiles; 'other ms' = split + input agreement; peak mem per rank)");
    if let Some(path) = &o.written {
        println!("  image written to {}", path.display());
    }
    if let Some(path) = &args.json {
        io::write_atomically(path, &serde_json::to_vec_pretty(&o.report)?)?;
        println!("  report written to {}", path.display());
    }
    if let Some(path) = &args.svg {
        io::write_atomically(path, o.report.to_svg().as_bytes())?;
        println!("  report plot written to {}", path.display());
    }
    if o.identical() {
        println!("  result: bit-identical to a single-rank run (max |diff| 0) on every rank that holds it");
        Ok(ExitCode::SUCCESS)
    } else {
        println!("  result: MISMATCH — max |diff| vs single rank {}, copies agree: {}", o.max_abs_diff, o.copies_agree);
        Ok(ExitCode::FAILURE)
    }
}
