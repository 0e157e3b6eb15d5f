//! `vae-parallel demo`: the tile executor end to end on a synthetic decoder.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use vae_parallel::report::{RequestReport, gather_summaries};
use vae_parallel::runtime::synthetic::SyntheticDecoder;
use vae_parallel::runtime::{DistributedVaeExecutor, OutputPlacement, TileOperator};
use vae_parallel::tensor::{Device, Tensor};
use vae_parallel::transport::{Communicator, CommunicatorExt, TransportConfig, run_local};

use crate::ranks::{GroupArgs, GroupOutcome, run_group};

/// Options of `vae-parallel demo`.
#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    #[command(flatten)]
    group: GroupArgs,
    /// Ranks that execute tiles (default: all).
    #[arg(long)]
    parallel_size: Option<usize>,
    /// Input height in latent units (60 = a 480-pixel Wan latent).
    #[arg(long, default_value_t = 60)]
    height: usize,
    /// Input width in latent units (104 = an 832-pixel Wan latent).
    #[arg(long, default_value_t = 104)]
    width: usize,
    /// Input channels.
    #[arg(long, default_value_t = 4)]
    channels: usize,
    /// Tile size in latent units.
    #[arg(long, default_value_t = 32)]
    tile: usize,
    /// Tile stride in latent units.
    #[arg(long, default_value_t = 24)]
    stride: usize,
    /// Output pixels per latent unit.
    #[arg(long, default_value_t = 8)]
    scale: usize,
    /// Simulated work per tile, in milliseconds (makes the spread over ranks visible).
    #[arg(long, default_value_t = 0)]
    work_ms: u64,
    /// Give the output to every rank instead of rank 0 only.
    #[arg(long)]
    broadcast: bool,
    /// Also write the report as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// What rank 0 found.
struct Outcome {
    report: RequestReport,
    output_dims: Vec<usize>,
    identical: bool,
    max_abs_diff: f32,
    copies_agree: bool,
    wall: Duration,
}

fn input(args: &DemoArgs) -> anyhow::Result<Tensor> {
    let dims = [1, args.channels, args.height, args.width];
    let n: usize = dims.iter().product();
    // A smooth pattern plus a hash, so that every tile differs.
    let data = (0..n)
        .map(|i| {
            let h = (i as u32).wrapping_mul(2654435761) >> 8;
            ((i as f32) * 0.001).sin() + (h as f32 / (1u32 << 24) as f32) * 0.1
        })
        .collect();
    Ok(Tensor::from_vec(data, dims, &Device::Cpu)?)
}

fn operator(args: &DemoArgs) -> SyntheticDecoder {
    SyntheticDecoder {
        tile: args.tile,
        stride: args.stride,
        scale: args.scale,
        tile_offset: 1.0 / 64.0,
        work_per_tile: Duration::from_millis(args.work_ms),
    }
}

fn rank_body(comm: Arc<dyn Communicator>, args: &DemoArgs) -> anyhow::Result<Option<Outcome>> {
    let (rank, world) = (comm.rank(), comm.size());
    let x = input(args)?;
    let op = operator(args);
    let placement = if args.broadcast { OutputPlacement::AllRanks } else { OutputPlacement::OwnerOnly };
    let executor = DistributedVaeExecutor::new(Arc::clone(&comm), args.parallel_size.unwrap_or(world))?;

    let started = Instant::now();
    let out = executor.execute(&x, &op, placement)?;
    let wall = started.elapsed();

    // Every rank that holds the output says what it holds.
    let hash = out.tensor.as_ref().map(Tensor::content_hash).transpose()?.unwrap_or(0);
    let hashes = comm.gather(0, &[hash])?;
    let summaries = gather_summaries(comm.as_ref(), 0, &out.report)?;
    let (Some(hashes), Some(summaries)) = (hashes, summaries) else {
        return Ok(None);
    };

    // The same request on a group of one, for comparison.
    let config = TransportConfig::default();
    let single = run_local(1, config, |c| {
        DistributedVaeExecutor::new(Arc::new(c), 1).and_then(|e| e.execute(&x, &op, OutputPlacement::OwnerOnly))
    })?
    .remove(0)
    .map_err(|panic| anyhow::anyhow!("single-rank run panicked: {panic}"))??;
    let reference = single.tensor.context("a single rank always owns the output")?;
    let merged = out.tensor.context("rank 0 owns the output")?;
    let copies_agree = hashes.as_flat().iter().enumerate().all(|(r, h)| {
        let holds = r == 0 || placement == OutputPlacement::AllRanks;
        if holds { *h == hashes.as_flat()[0] } else { *h == 0 }
    });

    let plan = op.split(&x).map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(Some(Outcome {
        report: RequestReport {
            strategy: format!(
                "tile ({}×{} grid of {}/{} tiles)",
                plan.grid.grid_shape[0], plan.grid.grid_shape[1], args.tile, args.stride
            ),
            backend: comm.backend().to_string(),
            world_size: world,
            parallel_size: executor.parallel_size(),
            tile_count: plan.tasks.len(),
            ranks: summaries,
        },
        output_dims: merged.dims().to_vec(),
        identical: merged.bit_eq(&reference),
        max_abs_diff: merged.max_abs_diff(&reference)?,
        copies_agree,
        wall,
    }))
    .inspect(|_| tracing::debug!(rank, "demo finished"))
}

/// Runs the demo and prints what happened.
pub fn run(args: &DemoArgs) -> anyhow::Result<ExitCode> {
    let outcome = run_group(&args.group, |comm| rank_body(comm, args))?;
    let rank0 = match outcome {
        GroupOutcome::AllRanks(mut results) => {
            for (rank, r) in results.iter().enumerate().skip(1) {
                if let Err(e) = r {
                    anyhow::bail!("rank {rank}: {e:#}");
                }
            }
            results.swap_remove(0)?
        }
        GroupOutcome::OneRank(0, result) => result?,
        GroupOutcome::OneRank(_, result) => {
            result?;
            return Ok(ExitCode::SUCCESS);
        }
        GroupOutcome::Supervised(exit) => {
            if exit.success() {
                return Ok(ExitCode::SUCCESS);
            }
            anyhow::bail!("rank process(es) {:?} failed", exit.failed_ranks());
        }
    };
    let Some(o) = rank0 else { anyhow::bail!("rank 0 produced no outcome") };

    println!(
        "vae-parallel demo: synthetic decoder (nearest ×{} upsample, doubled, offset per tile) on a [1, {}, {}, {}] input",
        args.scale, args.channels, args.height, args.width
    );
    println!(
        "  transport {}, {} rank(s), parallel size {}, output to {}",
        o.report.backend,
        o.report.world_size,
        o.report.parallel_size,
        if args.broadcast { "all ranks" } else { "rank 0" }
    );
    println!("  strategy {}: {} tiles → output {:?}", o.report.strategy, o.report.tile_count, o.output_dims);
    println!();
    print!("{}", o.report.to_table());
    println!("  (* = owner: merged the tiles; 'other ms' = split + input agreement)");
    println!();
    println!("  wall time on rank 0: {:.2} ms", o.wall.as_secs_f64() * 1e3);
    if let Some(path) = &args.json {
        write_atomically(path, &serde_json::to_vec_pretty(&o.report)?)?;
        println!("  report written to {}", path.display());
    }
    if o.identical && o.copies_agree {
        println!("  result: bit-identical to a single-rank run (max |diff| 0) on every rank that holds it");
        Ok(ExitCode::SUCCESS)
    } else {
        println!(
            "  result: MISMATCH — max |diff| vs single rank {}, broadcast copies agree: {}",
            o.max_abs_diff, o.copies_agree
        );
        Ok(ExitCode::FAILURE)
    }
}

/// Writes a file via a temporary sibling and a rename, so a reader never sees half of it.
pub fn write_atomically(path: &std::path::Path, bytes: &[u8]) -> anyhow::Result<()> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
    let name = path.file_name().context("output path has no file name")?;
    let tmp = dir.join(format!(".{}.tmp{}", name.to_string_lossy(), std::process::id()));
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))?;
    Ok(())
}
