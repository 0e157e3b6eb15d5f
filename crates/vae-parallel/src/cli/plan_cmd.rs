//! `plan`: the cost model's table for one request (every strategy the model could run, with
//! its predicted latency and peak memory per rank, and `auto`'s choice) without running it;
//! with `--measure`, each strategy also runs on local ranks beside its prediction, on the
//! request's device (`--device cuda`: the ranks share the GPU, and the measured peak is device
//! memory).

use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;

use crate::cli::model_cmds::ParallelArgs;
use crate::cost::{self, Candidate};
use crate::models::Direction;
use crate::planner::cost::DeviceKind;
use crate::report::human_ms;
use crate::runtime::Strategy;
use crate::transport::TransportConfig;
use crate::{Decode, Device, Encode, EncodeOutput, Group, Options, ParallelMode, Request, Tensor, Tiling, Vae};

/// `vae-parallel plan`.
#[derive(Debug, Args)]
pub struct PlanArgs {
    #[command(flatten)]
    parallel: ParallelArgs,
    /// The input's shape, comma-separated: the latent `B,C,H,W` (video `B,C,T,H,W`) to decode,
    /// or with --encode the image (video) to encode.
    #[arg(long)]
    shape: String,
    /// Plan an encode instead of a decode.
    #[arg(long)]
    encode: bool,
    /// Also run every strategy on local ranks (a random input, this process's threads shared
    /// as `decode` shares them) and print the measured latency and peak beside the prediction.
    #[arg(long)]
    measure: bool,
    /// With --measure: runs per strategy, the fastest kept (the first also warms the buffers).
    #[arg(long, default_value_t = 2)]
    runs: usize,
    /// Ranks per host sharing its cores (default: every rank on this host, as `decode` starts
    /// them). `--ranks-per-host 1` predicts ranks that each have a device of the profile's
    /// kind to themselves (a cluster of such machines).
    #[arg(long)]
    ranks_per_host: Option<usize>,
    /// Also print where each strategy's predicted time goes: its busiest rank's compute by
    /// kind of step (convolutions by kernel and, on a CPU, algorithm; norms; element-wise
    /// passes; attention; the owner's blend of tiles) and its messages.
    #[arg(long)]
    breakdown: bool,
}

/// What one measured run gave: the slowest rank's seconds and the largest request peak.
struct Measured {
    seconds: f64,
    peak_bytes: u64,
}

/// `vae-parallel plan`.
pub fn plan(args: &PlanArgs) -> anyhow::Result<ExitCode> {
    let r = args.parallel.resolve()?;
    if let Some(n) = args.ranks_per_host {
        anyhow::ensure!(n >= 1, "--ranks-per-host must be at least 1");
        anyhow::ensure!(!args.measure, "--measure runs the ranks on this host: leave --ranks-per-host out");
    }
    let dims = crate::cli::parse_shape(&args.shape, "a comma-separated list of sizes")?;
    anyhow::ensure!(args.runs >= 1, "--runs must be at least 1");
    let mut cost = r.cost_settings()?;
    if let Some(n) = args.ranks_per_host {
        cost.placement = crate::planner::cost::Placement {
            threads_per_rank: cost.profile.threads as f64,
            ranks_per_host: n,
            threads_alone: cost.profile.threads as f64,
        };
    }
    let direction = if args.encode { Direction::Encode } else { Direction::Decode };
    let vae = r.load_vae_on(r.settings.device)?;
    let model = vae.model();
    let ranks = r.settings.parallel_size;
    let options = r.options();
    let Some(candidates) = cost::candidates(model, direction, &dims, ranks, options.tiling, &cost) else {
        anyhow::bail!("{} has no cost model for an input of {dims:?}", model.class_name());
    };
    anyhow::ensure!(!candidates.is_empty(), "no strategy is modelled for an input of {dims:?} on {ranks} rank(s)");
    let profile = &cost.profile;
    println!("model     {} ({})", r.model_dir().display(), model.class_name());
    println!("request   {} {dims:?} on {ranks} rank(s)", if args.encode { "encode" } else { "decode" });
    println!("profile   {} [{}]", profile.device, profile.source);
    let runs_on_gpu = !r.settings.device.is_cpu();
    if runs_on_gpu != (profile.kind == DeviceKind::Cuda) {
        println!(
            "note      the profile describes {}, the request runs on {}: the predictions are for the profile's device",
            if profile.kind == DeviceKind::Cuda { "a GPU" } else { "CPU cores" },
            r.settings.device
        );
    }
    match profile.kind {
        DeviceKind::Cpu => println!(
            "threads   {:.2} per rank, {} rank(s) sharing {} core(s)",
            cost.placement.threads_per_rank, cost.placement.ranks_per_host, profile.cores
        ),
        DeviceKind::Cuda => println!("gpus      {} rank(s) sharing each GPU", cost.placement.ranks_per_host),
    }
    if let Some(cap) = options.max_memory_per_rank {
        println!("cap       {} per rank", crate::report::human_bytes(cap));
    }
    let choice = cost::choose(&candidates, options.max_memory_per_rank, ranks);
    let input = args.measure.then(|| Tensor::seeded_uniform(dims.clone(), 0, -1.0, 1.0, &Device::Cpu)).transpose()?;
    // The ranks `decode` would start on this host, with timeouts long enough for any request.
    let group = match input {
        Some(_) => Some(
            Group::local_builder(ranks)
                .transport_config(TransportConfig {
                    collective_timeout: Duration::from_secs(6 * 3600),
                    ..TransportConfig::default()
                })
                .build()?,
        ),
        None => None,
    };
    println!();
    print!("{:<16} {:>12} {:>14} {:>6}", "strategy", "predicted ms", "peak per rank", "fits");
    if input.is_some() {
        print!(" {:>11} {:>7} {:>14} {:>7}", "measured ms", "ratio", "measured peak", "ratio");
    }
    println!();
    for c in &candidates {
        let fits = options.max_memory_per_rank.is_none_or(|cap| c.prediction.peak_bytes <= cap);
        let chosen = matches!(&choice, Ok(best) if std::ptr::eq(*best, c));
        print!(
            "{:<16} {:>12.0} {:>14} {:>6}",
            format!("{}{}", c.label, if chosen { " *" } else { "" }),
            c.prediction.ms,
            crate::report::human_bytes(c.prediction.peak_bytes),
            if fits { "yes" } else { "no" }
        );
        if let (Some(input), Some(group)) = (&input, &group) {
            let m = measure(&vae, group, direction, input, c, args.runs, &options)?;
            print!(
                " {:>11.0} {:>7.2} {:>14} {:>7.2}",
                m.seconds * 1e3,
                c.prediction.ms / (m.seconds * 1e3),
                crate::report::human_bytes(m.peak_bytes),
                c.prediction.peak_bytes as f64 / m.peak_bytes.max(1) as f64
            );
        }
        println!();
    }
    if args.breakdown {
        print_breakdown(&candidates);
    }
    println!();
    match choice {
        Ok(best) => println!("auto would run: {}", best.label),
        Err(e) => println!(
            "auto would refuse: {}",
            crate::settings::rename_options(&e.to_string(), crate::settings::cli_flag)
        ),
    }
    Ok(ExitCode::SUCCESS)
}

/// Each candidate's busiest rank (the most compute and messages), its predicted milliseconds
/// by kind of step: one row per kind, one column per strategy.
fn print_breakdown(candidates: &[Candidate]) {
    let busiest: Vec<&crate::planner::cost::RankPrediction> = candidates
        .iter()
        .filter_map(|c| {
            c.prediction.ranks.iter().max_by(|a, b| (a.compute_s + a.comm_s).total_cmp(&(b.compute_s + b.comm_s)))
        })
        .collect();
    let mut kinds: Vec<&String> = busiest.iter().flat_map(|r| r.compute_by_kind.keys()).collect();
    kinds.sort();
    kinds.dedup();
    println!();
    print!("{:<24}", "busiest rank, ms");
    candidates.iter().for_each(|c| print!(" {:>14}", c.label));
    println!();
    for kind in kinds {
        print!("{kind:<24}");
        busiest
            .iter()
            .for_each(|r| print!(" {:>14}", human_ms(r.compute_by_kind.get(kind).copied().unwrap_or(0.0) * 1e3)));
        println!();
    }
    print!("{:<24}", "messages");
    busiest.iter().for_each(|r| print!(" {:>14}", human_ms(r.comm_s * 1e3)));
    println!();
}

/// Runs `candidate` on the local `group` `runs` times; the fastest run's time and the largest
/// peak (above each rank's start).
fn measure(
    vae: &Vae,
    group: &Group,
    direction: Direction,
    input: &Tensor,
    candidate: &Candidate,
    runs: usize,
    base: &Options,
) -> anyhow::Result<Measured> {
    let (mode, shard_grid) = match candidate.strategy {
        Strategy::Tile | Strategy::Pipeline => (ParallelMode::Tile, None),
        Strategy::Shard(axis) => (
            if axis == crate::planner::ShardAxis::Height {
                ParallelMode::SpatialShardHeight
            } else {
                ParallelMode::SpatialShardWidth
            },
            None,
        ),
        Strategy::Shard2d(grid) => (ParallelMode::SpatialShard2d, Some(grid)),
    };
    let mut options = base.clone();
    options.mode = mode;
    options.shard_grid = shard_grid;
    options.tiling = if candidate.use_tiling { Tiling::On } else { Tiling::Off };
    options.max_memory_per_rank = None;
    let (decode, encode) = (Decode::default().with_options(options.clone()), Encode::default().with_options(options));
    let encode = encode.output(EncodeOutput::Moments);
    let on_cpu = vae.device().is_cpu();
    let mut best = Measured { seconds: f64::INFINITY, peak_bytes: 0 };
    for _ in 0..runs {
        let started = Instant::now();
        let request = match direction {
            Direction::Decode => Request::decode(input, &decode),
            Direction::Encode => Request::encode(input, &encode),
        };
        let finished = group.run(vae, request)?;
        let seconds = started.elapsed().as_secs_f64();
        let report = finished.report.ok_or_else(|| anyhow::anyhow!("the owner got no report"))?;
        // On a GPU the request's tensors are device memory (a rank's account starts with none:
        // the shared weights are charged to the loading thread).
        let peak = report
            .ranks
            .iter()
            .map(|r| if on_cpu { r.peak_bytes.saturating_sub(r.start_bytes) } else { r.device_peak_bytes })
            .max()
            .unwrap_or(0);
        best.seconds = best.seconds.min(seconds);
        best.peak_bytes = best.peak_bytes.max(peak);
    }
    Ok(best)
}
