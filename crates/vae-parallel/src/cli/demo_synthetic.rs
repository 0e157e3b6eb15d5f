//! `vae-parallel demo --operator synthetic`: the tile executor alone, on a stand-in decoder
//! (nearest upsampling, doubled, offset per tile), on local ranks or rank processes: fast, for
//! exercising the executor and the transports; the result is compared with one rank's.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::cli::demo::DemoArgs;
use crate::io;
use crate::report::{RequestReport, gather_summaries, human_bytes};
use crate::runtime::synthetic::SyntheticDecoder;
use crate::runtime::{DistributedVaeExecutor, ExecOutput, Job, Output, OutputPlacement, TileOperator, execute_serial};
use crate::tensor::{Device, Tensor};
use crate::transport::{Communicator, CommunicatorExt};

/// What rank 0 found.
struct Outcome {
    report: RequestReport,
    output_dims: Vec<usize>,
    max_abs_diff: f32,
    copies_agree: bool,
    wall: Duration,
    single_wall: Duration,
    single_peak: usize,
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
    crate::tensor::memory::reset_peak();
    let started = Instant::now();
    let reference = execute_serial(op, x)?;
    let single_wall = started.elapsed();
    let single_peak = crate::tensor::memory::peak_bytes();
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
    };
    Ok(Some((outcome, merged)))
}

fn rank_body(comm: Arc<dyn Communicator>, args: &DemoArgs) -> anyhow::Result<Option<Outcome>> {
    let x = pattern([1, args.channels, args.height.unwrap_or(60), args.width.unwrap_or(104)])?;
    let op = synthetic(args);
    let strategy = format!("tile ({}/{} synthetic tiles)", args.tile, args.stride);
    Ok(run_and_compare(comm, args, &x, &op, strategy)?.map(|(o, _)| o))
}

/// Runs the synthetic demo and prints what happened.
pub fn run(args: &DemoArgs) -> anyhow::Result<ExitCode> {
    let group = match crate::cli::ranks::ranks(&args.group, None)?.group()? {
        Ok(group) => group,
        Err(supervised) => return Ok(supervised),
    };
    let rank0 = group.run_on_ranks(|comm| {
        rank_body(Arc::clone(comm), args)
            .map_err(|e| crate::Error::Runtime(crate::runtime::RuntimeError::Protocol(format!("{e:#}"))))
    })?;
    if group.rank() != 0 {
        return Ok(ExitCode::SUCCESS);
    }
    let Some(o) = rank0 else { anyhow::bail!("rank 0 produced no outcome") };

    println!(
        "vae-parallel demo: synthetic decoder (nearest ×{} upsample, doubled, offset per tile) → {:?}",
        args.scale, o.output_dims
    );
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
