//! Where the CLI's ranks run: a local [`Group`], this process as one rank of a group of
//! processes, or, when a socket or NCCL group is asked for and the environment names no rank,
//! a supervisor that starts one copy of this command per rank and waits for them.

use std::time::Duration;

use anyhow::Context;
use clap::Args;

use crate::Group;
use crate::launch::{GroupExit, TransportKind, is_rank_process, launch_processes};
use crate::transport::{GroupSecret, SocketOptions, TransportConfig};

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
pub fn supervised_failure(exit: &GroupExit) -> anyhow::Error {
    if exit.interrupted {
        anyhow::anyhow!("interrupted: the rank processes were stopped; nothing was written")
    } else if exit.owner_reported() {
        AlreadyReported.into()
    } else {
        anyhow::anyhow!("the rank processes failed: {}", exit.describe_failures())
    }
}

/// What this process is for a command's ranks.
pub enum Ranks {
    /// The group this process runs requests on (every local rank, or its own rank).
    Group(Group),
    /// This process started the rank processes, which ran the command; they have ended.
    Supervised(GroupExit),
}

impl Ranks {
    /// The group, or (for a supervisor) the command's end: success when every rank succeeded.
    pub fn group(self) -> anyhow::Result<Result<Group, std::process::ExitCode>> {
        match self {
            Self::Group(group) => Ok(Ok(group)),
            Self::Supervised(exit) if exit.success() => Ok(Err(std::process::ExitCode::SUCCESS)),
            Self::Supervised(exit) => Err(supervised_failure(&exit)),
        }
    }
}

/// The ranks `args` describe, local ranks sharing `threads` compute threads (default: all).
pub fn ranks(args: &GroupArgs, threads: Option<usize>) -> anyhow::Result<Ranks> {
    if args.ranks == 0 {
        anyhow::bail!("--ranks must be at least 1");
    }
    match args.transport {
        TransportKind::Local => {
            let mut builder = Group::local_builder(args.ranks);
            if let Some(threads) = threads {
                builder = builder.threads(threads);
            }
            Ok(Ranks::Group(builder.build()?))
        }
        kind @ (TransportKind::Socket | TransportKind::Nccl) if args.rank.is_some() || is_rank_process() => {
            let options = match (args.rank, &args.master_addr) {
                (Some(rank), Some(master)) => SocketOptions {
                    rank,
                    world_size: args.ranks,
                    master: master.parse()?,
                    config: TransportConfig::from_env()?,
                    secret: GroupSecret::from_env()?,
                },
                _ => SocketOptions::from_env()?,
            };
            let group = match kind {
                TransportKind::Nccl => Group::nccl_join(&options).context("joining the NCCL group")?,
                _ => Group::join(&options).context("joining the socket group")?,
            };
            Ok(Ranks::Group(group))
        }
        TransportKind::Socket | TransportKind::Nccl => {
            let forwarded: Vec<_> = std::env::args_os().skip(1).collect();
            let grace = TransportConfig::from_env()?.failure_timeout + Duration::from_secs(5);
            Ok(Ranks::Supervised(launch_processes(args.ranks, &forwarded, grace)?))
        }
    }
}
