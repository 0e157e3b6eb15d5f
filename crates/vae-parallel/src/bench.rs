//! `vae-parallel bench`: transport throughput and failure-detection latency.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Args, Subcommand};
use vae_parallel::transport::{Communicator, CommunicatorExt, ReduceOp};

use crate::ranks::{GroupArgs, GroupOutcome, run_group};

/// Which benchmark.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Bandwidth of all_gather and broadcast between ranks.
    Transport(TransportArgs),
    /// How long the other ranks take to learn that one rank died.
    Failover(FailoverArgs),
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
    }
}

/// One timed collective: the slowest rank's time of each repetition.
fn time_collective(
    comm: &dyn Communicator,
    iters: usize,
    mut op: impl FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<Vec<f64>> {
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
    let outcome = run_group(&args.group, |comm: Arc<dyn Communicator>| {
        let send = vec![comm.rank() as u8; bytes];
        // Steady state: the receive buffer is reused, as a serving process would.
        let mut recv = Vec::new();
        let all_gather = time_collective(comm.as_ref(), args.iters, || {
            comm.all_gather_into(&send, &mut recv)?;
            anyhow::ensure!(recv.len() == bytes * comm.size(), "short all_gather");
            Ok(())
        })?;
        let mut buf = send.clone();
        let broadcast = time_collective(comm.as_ref(), args.iters, || Ok(comm.broadcast(0, &mut buf)?))?;
        Ok((comm.rank(), comm.backend(), comm.size(), TransportResult { all_gather, broadcast }))
    })?;
    let (backend, world, result) = match outcome {
        GroupOutcome::AllRanks(mut results) => {
            let (_, backend, world, r) = results.swap_remove(0)?;
            (backend, world, r)
        }
        GroupOutcome::OneRank(_, r) => {
            let (rank, backend, world, r) = r?;
            if rank != 0 {
                return Ok(ExitCode::SUCCESS);
            }
            (backend, world, r)
        }
        GroupOutcome::Supervised(exit) => {
            anyhow::ensure!(exit.success(), "rank process(es) {:?} failed", exit.failed_ranks());
            return Ok(ExitCode::SUCCESS);
        }
    };
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
    let outcome = run_group(&args.group, |comm: Arc<dyn Communicator>| {
        let victim = comm.size() - 1;
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
        let err = comm.barrier().expect_err("the victim never reaches this barrier");
        let detected = waiting.elapsed().saturating_sub(delay);
        Ok((comm.rank(), victim, detected, err.to_string()))
    })?;
    let mut lines = Vec::new();
    match outcome {
        GroupOutcome::AllRanks(results) => {
            for r in results.into_iter().filter_map(Result::ok) {
                lines.push(r);
            }
        }
        GroupOutcome::OneRank(_, r) => lines.push(r?),
        GroupOutcome::Supervised(exit) => {
            // The victim is expected to fail; the others must succeed.
            let failed = exit.failed_ranks();
            anyhow::ensure!(failed == vec![args.group.ranks - 1], "unexpected failures: ranks {failed:?}");
            return Ok(ExitCode::SUCCESS);
        }
    }
    for (rank, victim, detected, err) in lines {
        println!(
            "rank {rank}: death of rank {victim} reported {:.2} ms after it happened: {err}",
            detected.as_secs_f64() * 1e3
        );
    }
    Ok(ExitCode::SUCCESS)
}
