//! Rank processes: which transport a group of processes uses, whether this process is one
//! rank of such a group, and starting the ranks of a group on this host.
//!
//! A program that runs on a socket or NCCL group can be started once per rank by the user or a
//! launcher such as torchrun (each with `VAE_RANK`, `VAE_WORLD_SIZE`, `VAE_MASTER_ADDR`, or
//! torchrun's variables), and then joins with [`Group::from_env`](crate::Group::from_env); or
//! once without them, in which case it becomes a supervisor: [`launch_processes`] starts one
//! copy of the current executable per rank on this host, with a fresh Unix-socket rendezvous
//! and a fresh group secret, and waits for all of them.

use std::ffi::OsString;
use std::process::{Child, Command, ExitStatus};
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use vae_transport::socket::{ENV_MASTER_ADDR, ENV_RANK, ENV_WORLD_SIZE};

/// Which transport a group uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportKind {
    /// Ranks are threads of this process.
    Local,
    /// Ranks are processes connected by sockets.
    Socket,
    /// Ranks are processes, one per GPU, whose collectives run over NCCL (the group is formed
    /// over sockets first, which hand out NCCL's unique id).
    Nccl,
}

impl TransportKind {
    /// True when each rank is its own process (socket and NCCL groups).
    pub fn is_multi_process(self) -> bool {
        self != Self::Local
    }
}

impl FromStr for TransportKind {
    type Err = crate::Error;

    fn from_str(s: &str) -> Result<Self, crate::Error> {
        match s.trim() {
            "local" => Ok(Self::Local),
            "socket" => Ok(Self::Socket),
            "nccl" => Ok(Self::Nccl),
            other => Err(crate::Error::invalid_option(format!(
                "unknown transport {other:?} (expected local, socket or nccl)"
            ))),
        }
    }
}

impl std::fmt::Display for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Local => "local",
            Self::Socket => "socket",
            Self::Nccl => "nccl",
        })
    }
}

/// Errors of starting or supervising rank processes.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// Invalid settings.
    #[error("{0}")]
    Config(String),
    /// A rank process could not be started or waited for.
    #[error("rank process {rank}: {source}")]
    Spawn {
        /// The rank.
        rank: usize,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The private directory of the rendezvous sockets could not be made.
    #[error("making the rendezvous directory: {0}")]
    Rendezvous(#[source] std::io::Error),
}

/// Set in the environment of the rank processes [`launch_processes`] starts: such a rank other
/// than 0 leaves the error line to rank 0 (which names the rank that failed first), so a failure
/// is said once, not once per process.
pub const ENV_SUPERVISED: &str = "VAE_SUPERVISED";

/// True when this process is a rank other than 0 of a group [`launch_processes`] started.
pub fn is_supervised_non_owner() -> bool {
    std::env::var_os(ENV_SUPERVISED).is_some() && std::env::var(ENV_RANK).is_ok_and(|r| r.trim() != "0")
}

/// True when this process was started as one rank of a socket group (its environment names a
/// rank: `VAE_RANK`, or torchrun's `RANK` and `WORLD_SIZE`), as opposed to being the program a
/// user ran directly.
pub fn is_rank_process() -> bool {
    vae_transport::socket::rank_in_env()
}

/// The GPU of this rank on its host where a launcher named it (torchrun's `LOCAL_RANK`).
pub fn local_rank() -> Option<usize> {
    std::env::var("LOCAL_RANK").ok().and_then(|v| v.trim().parse().ok())
}

/// The ranks on this host where a launcher said (torchrun's `LOCAL_WORLD_SIZE`): the cost
/// model's ranks sharing a host's cores.
pub fn ranks_per_host() -> Option<usize> {
    std::env::var("LOCAL_WORLD_SIZE").ok().and_then(|v| v.trim().parse().ok()).filter(|&n| n > 0)
}

/// How the rank processes of a launched group ended.
#[derive(Debug)]
pub struct GroupExit {
    /// Exit status per rank, in rank order (`None`: killed by the supervisor after the grace
    /// period).
    pub statuses: Vec<Option<ExitStatus>>,
    /// The supervisor was interrupted (SIGINT or SIGTERM) and stopped the ranks.
    pub interrupted: bool,
}

impl GroupExit {
    /// True when every rank exited successfully.
    pub fn success(&self) -> bool {
        self.statuses.iter().all(|s| s.is_some_and(|s| s.success()))
    }

    /// Whether rank 0 exited by itself with a failure, having said why (its error line).
    pub fn owner_reported(&self) -> bool {
        self.statuses.first().is_some_and(|s| s.is_some_and(|s| s.code() == Some(1)))
    }

    /// Ranks that failed or had to be killed.
    pub fn failed_ranks(&self) -> Vec<usize> {
        self.statuses.iter().enumerate().filter(|(_, s)| !s.is_some_and(|s| s.success())).map(|(r, _)| r).collect()
    }

    /// How each failed rank ended, the ranks that failed by themselves first (those the
    /// supervisor stopped only waited on them): "rank 1 was killed by signal 9; rank 0 did not
    /// exit within the grace period and was stopped".
    pub fn describe_failures(&self) -> String {
        use std::os::unix::process::ExitStatusExt;
        let mut own = Vec::new();
        let mut stopped = Vec::new();
        for (rank, status) in self.statuses.iter().enumerate() {
            match status {
                Some(s) if s.success() => {}
                Some(s) => own.push(match (s.code(), s.signal()) {
                    (Some(code), _) => format!("rank {rank} exited with code {code}"),
                    (None, Some(signal)) => format!("rank {rank} was killed by signal {signal}"),
                    (None, None) => format!("rank {rank} failed"),
                }),
                None => stopped.push(format!("rank {rank} did not exit within the grace period and was stopped")),
            }
        }
        own.extend(stopped);
        own.join("; ")
    }
}

/// Starts `ranks` copies of the current executable with `args`, each told its rank and a fresh
/// Unix-socket master address, and waits for them. Once one rank has failed, the others get
/// `grace` to report the failure themselves before they are killed.
pub fn launch_processes(ranks: usize, args: &[OsString], grace: Duration) -> Result<GroupExit, LaunchError> {
    vae_transport::check_world_size(ranks).map_err(|e| LaunchError::Config(e.to_string()))?;
    let exe = std::env::current_exe().map_err(|source| LaunchError::Spawn { rank: 0, source })?;
    // The rendezvous sockets live in a fresh directory only this user can enter (0700), under a
    // random name: no other user can reach or replace them.
    let private = tempfile::Builder::new().prefix("vae-parallel-").tempdir().map_err(LaunchError::Rendezvous)?;
    let master = private.path().join("master.sock");
    // Every group this launches authenticates its links with a fresh secret, handed to the
    // ranks in their environment (never on a command line, where other users can read it).
    let secret = vae_transport::GroupSecret::generate().map_err(|e| LaunchError::Config(e.to_string()))?;
    let mut children: Vec<Child> = Vec::with_capacity(ranks);
    for rank in 0..ranks {
        let mut command = Command::new(&exe);
        let spawned = die_with_parent(&mut command)
            .args(args)
            .env(ENV_RANK, rank.to_string())
            .env(ENV_WORLD_SIZE, ranks.to_string())
            .env(ENV_MASTER_ADDR, format!("unix:{}", master.display()))
            .env(vae_transport::auth::ENV_GROUP_SECRET, secret.to_hex())
            .env_remove(vae_transport::auth::ENV_GROUP_SECRET_FILE)
            .env(ENV_SUPERVISED, "1")
            .spawn();
        match spawned {
            Ok(child) => children.push(child),
            Err(source) => {
                for mut c in children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(LaunchError::Spawn { rank, source });
            }
        }
    }
    tracing::debug!(ranks, master = %master.display(), "launched rank processes");
    let (statuses, interrupted) = supervise(children, grace);
    drop(private);
    Ok(GroupExit { statuses, interrupted })
}

/// Makes the process `cmd` starts end with the supervisor: killed by the kernel when the
/// supervisor dies, however it dies (Linux's parent-death signal; elsewhere nothing). For a
/// program that starts rank processes of its own (the CLI's service relaunches its ranks).
pub fn die_with_parent(cmd: &mut Command) -> &mut Command {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        let parent = std::process::id();
        // SAFETY: runs in the child between fork and exec, where only async-signal-safe calls
        // are allowed: `prctl` and `getppid` are system calls on plain integers, and neither
        // error below allocates.
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The supervisor may have died before the call: then nobody would signal us.
                if libc::getppid() as u32 != parent {
                    return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
                }
                Ok(())
            });
        }
    }
    cmd
}

fn supervise(mut children: Vec<Child>, grace: Duration) -> (Vec<Option<ExitStatus>>, bool) {
    let mut statuses: Vec<Option<ExitStatus>> = vec![None; children.len()];
    let mut failure_seen: Option<Instant> = None;
    // SIGINT and SIGTERM to the supervisor go to every rank; the ranks then exit (an
    // interrupted request writes nothing) and the supervisor reports their statuses.
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        let _ = signal_hook::flag::register(signal, Arc::clone(&stop));
    }
    let mut forwarded = false;
    loop {
        if stop.load(Ordering::Relaxed) && !forwarded {
            forwarded = true;
            failure_seen.get_or_insert_with(Instant::now);
            for (rank, child) in children.iter().enumerate() {
                if statuses[rank].is_none() {
                    // SAFETY: `kill` takes plain integers; the pid is our own live child's.
                    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
                }
            }
        }
        for (rank, child) in children.iter_mut().enumerate() {
            if statuses[rank].is_none()
                && let Ok(Some(status)) = child.try_wait()
            {
                if !status.success() && failure_seen.is_none() {
                    failure_seen = Some(Instant::now());
                }
                statuses[rank] = Some(status);
            }
        }
        if statuses.iter().all(Option::is_some) {
            return (statuses, forwarded);
        }
        if failure_seen.is_some_and(|t| t.elapsed() > grace) {
            for (rank, child) in children.iter_mut().enumerate() {
                if statuses[rank].is_none() {
                    tracing::warn!(rank, "killing a rank that did not exit after another rank failed");
                    let _ = child.kill();
                    let _ = child.wait();
                }
            }
            return (statuses, forwarded);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt;
    use std::process::ExitStatus;

    use super::GroupExit;

    /// A rank killed by a signal is named before the ranks the supervisor had to stop after
    /// it, so the line says which rank was lost even when the owner could not report it.
    #[test]
    fn a_failure_names_the_rank_that_died_before_those_stopped_after_it() {
        let exit = GroupExit {
            statuses: vec![
                None,
                Some(ExitStatus::from_raw(9)),
                Some(ExitStatus::from_raw(0)),
                Some(ExitStatus::from_raw(3 << 8)),
            ],
            interrupted: false,
        };
        assert_eq!(exit.failed_ranks(), vec![0, 1, 3]);
        assert_eq!(
            exit.describe_failures(),
            "rank 1 was killed by signal 9; rank 3 exited with code 3; \
             rank 0 did not exit within the grace period and was stopped"
        );
    }
}
