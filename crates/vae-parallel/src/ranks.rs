//! Running one body on every rank of a group, whatever the transport.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Args;
use vae_parallel::engine::EngineError;
use vae_parallel::group::{GroupExit, TransportKind, is_rank_process, launch_processes};
use vae_parallel::local_ranks::{pool_threads, run_local_ranks};
use vae_parallel::transport::{Communicator, NcclComm, SocketComm, SocketOptions, TransportConfig};

/// Where the ranks run.
#[derive(Debug, Clone, Args)]
pub struct GroupArgs {
    /// Number of ranks.
    #[arg(long, default_value_t = 4)]
    pub ranks: usize,
    /// `local` (threads of this process), `socket` (one process per rank; launched here, or
    /// started by you once per rank with --rank/--master-addr or VAE_RANK / VAE_WORLD_SIZE /
    /// VAE_MASTER_ADDR) or `nccl` (processes as for `socket`, one GPU each: rank r on
    /// cuda:r, collectives over NCCL).
    #[arg(long, default_value = "local")]
    pub transport: TransportKind,
    /// Join a socket group as this rank (instead of VAE_RANK); needs --master-addr.
    #[arg(long, requires = "master_addr")]
    pub rank: Option<usize>,
    /// Rank 0's address for --rank: host:port, tcp://host:port or unix:/path.
    #[arg(long, requires = "rank")]
    pub master_addr: Option<String>,
}

/// The error of a supervisor whose rank 0 already said what failed: the process exits with a
/// failure and prints nothing more.
#[derive(Debug)]
pub struct AlreadyReported;

impl std::fmt::Display for AlreadyReported {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the rank processes failed (rank 0 said why)")
    }
}

impl std::error::Error for AlreadyReported {}

/// The error of a supervised group that failed: quiet when rank 0 reported it, else naming the
/// ranks (one killed by a signal, say, says nothing itself).
pub fn supervised_failure(exit: &vae_parallel::group::GroupExit) -> anyhow::Error {
    if exit.interrupted {
        anyhow::anyhow!("interrupted: the rank processes were stopped; nothing was written")
    } else if exit.owner_reported() {
        AlreadyReported.into()
    } else {
        anyhow::anyhow!("the rank processes failed: {}", exit.describe_failures())
    }
}

/// What this process saw of a group run.
pub enum GroupOutcome<R> {
    /// Every rank ran here (local transport): results in rank order.
    AllRanks(Vec<anyhow::Result<R>>),
    /// This process was one rank of a socket group.
    OneRank(usize, anyhow::Result<R>),
    /// This process launched and supervised the rank processes.
    Supervised(GroupExit),
}

/// Runs `body` on every rank of the group `args` describes.
pub fn run_group<R: Send>(
    args: &GroupArgs,
    body: impl Fn(Arc<dyn Communicator>) -> anyhow::Result<R> + Sync,
) -> anyhow::Result<GroupOutcome<R>> {
    if args.ranks == 0 {
        bail!("--ranks must be at least 1");
    }
    let config = TransportConfig::from_env()?;
    match args.transport {
        TransportKind::Local => {
            // Each rank on a pool of its own, sized from --threads (else all cores).
            let each = pool_threads(None, args.ranks);
            let results = run_local_ranks(args.ranks, each, config, |comm| run_rank(Arc::new(comm), &body))?;
            Ok(GroupOutcome::AllRanks(
                results
                    .into_iter()
                    .map(|r| r.unwrap_or_else(|panic| Err(anyhow::anyhow!("panicked: {panic}"))))
                    .collect(),
            ))
        }
        kind @ (TransportKind::Socket | TransportKind::Nccl) if args.rank.is_some() || is_rank_process() => {
            let options = match (args.rank, &args.master_addr) {
                (Some(rank), Some(master)) => SocketOptions {
                    rank,
                    world_size: args.ranks,
                    master: master.parse()?,
                    config,
                    secret: vae_parallel::transport::GroupSecret::from_env()?,
                },
                _ => SocketOptions::from_env()?,
            };
            let comm = SocketComm::connect(&options).context("joining the socket group")?;
            let rank = comm.rank();
            if kind == TransportKind::Nccl {
                // Rank r on cuda:r (cuda:LOCAL_RANK under torchrun, whose ranks span hosts).
                // Every rank gets the same verdict from the bootstrap, so all fail together (and
                // none waits inside NCCL) when one cannot open its GPU.
                let gpu = vae_parallel::group::local_rank().unwrap_or(rank);
                let nccl = NcclComm::from_bootstrap(&comm, gpu).context("joining the NCCL group")?;
                return Ok(GroupOutcome::OneRank(rank, run_rank(Arc::new(nccl), &body)));
            }
            Ok(GroupOutcome::OneRank(rank, run_rank(Arc::new(comm), &body)))
        }
        TransportKind::Socket | TransportKind::Nccl => {
            let forwarded: Vec<_> = std::env::args_os().skip(1).collect();
            let grace = config.failure_timeout + Duration::from_secs(5);
            Ok(GroupOutcome::Supervised(launch_processes(args.ranks, &forwarded, grace)?))
        }
    }
}

/// Runs one rank's body; a failure is announced to the other ranks with its reason (a no-op
/// when they already know), so nobody waits for this rank or blames the wrong one.
fn run_rank<R>(
    comm: Arc<dyn Communicator>,
    body: &(impl Fn(Arc<dyn Communicator>) -> anyhow::Result<R> + Sync),
) -> anyhow::Result<R> {
    let result = body(Arc::clone(&comm));
    if let Err(err) = &result
        && !err.downcast_ref::<EngineError>().is_some_and(EngineError::known_to_all_ranks)
    {
        comm.abort(&crate::error_text(err));
    }
    result
}
