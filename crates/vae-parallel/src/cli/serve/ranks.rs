//! The service's group: local ranks, socket or NCCL rank processes it launched itself (and
//! relaunches when one dies), or ranks the environment placed (which it cannot replace). Rank 0
//! (the serving process) broadcasts each request to the other processes before running it, so
//! that every rank runs the same requests in the same order; the other ranks loop on
//! [`rank_loop`].

use std::ffi::OsString;
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;

use super::spec::Frame;
use crate::launch::{TransportKind, die_with_parent, is_rank_process};
use crate::settings;
use crate::transport::socket::{ENV_MASTER_ADDR, ENV_RANK, ENV_WORLD_SIZE};
use crate::transport::{Communicator, CommunicatorExt, GroupSecret, SocketOptions, TransportConfig};
use crate::{Device, Group, Vae};

/// Set on the rank processes the service launched: they exit when their group fails (the
/// service relaunches them), rather than being placed by the environment.
pub const ENV_SERVE_LAUNCHED: &str = "VAE_SERVE_LAUNCHED";

/// Rank processes this service started, and how to start them again.
struct Launched {
    children: Vec<Child>,
    /// The private directory of the rendezvous socket (removed when dropped).
    _dir: tempfile::TempDir,
}

impl Launched {
    /// Stops every rank process and waits for it: none is left behind.
    fn reap(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
        }
        for child in &mut self.children {
            let _ = child.wait();
        }
        self.children.clear();
    }

    /// Ranks that have exited (a rank killed mid-request, say).
    fn exited(&mut self) -> Vec<usize> {
        let mut gone = Vec::new();
        for (i, child) in self.children.iter_mut().enumerate() {
            if !matches!(child.try_wait(), Ok(None)) {
                gone.push(i + 1);
            }
        }
        gone
    }
}

impl Drop for Launched {
    fn drop(&mut self) {
        self.reap();
    }
}

/// The group requests run on, as rank 0 holds it.
pub struct ServiceGroup {
    /// The group.
    pub group: Group,
    transport: TransportKind,
    ranks: usize,
    threads: Option<usize>,
    /// The command line of a launched rank (`serve` and its flags).
    args: Vec<OsString>,
    launched: Option<Launched>,
    /// Set when a request panicked: the group may be mid-collective, so it is rebuilt.
    panicked: Option<String>,
}

impl ServiceGroup {
    /// The group the settings describe, as rank 0: local ranks, or rank processes launched here
    /// (`args` is the `serve` command line they run), or this process's rank of a group the
    /// environment placed.
    pub fn start(settings: &settings::Resolved, args: Vec<OsString>) -> anyhow::Result<Self> {
        let mut this = Self {
            group: Group::local(1)?,
            transport: settings.transport,
            ranks: settings.ranks,
            threads: settings.threads,
            args,
            launched: None,
            panicked: None,
        };
        this.group = this.form()?;
        Ok(this)
    }

    /// Whether the ranks are this service's own (local threads, or processes it launched) and
    /// can be replaced when one fails.
    pub fn can_rebuild(&self) -> bool {
        !self.transport.is_multi_process() || !is_rank_process()
    }

    /// A one-line description: `2 local rank(s)`, `2 socket rank process(es) launched here`.
    pub fn describe(&self) -> String {
        match (self.transport, is_rank_process()) {
            (TransportKind::Local, _) => format!("{} local rank(s)", self.ranks),
            (kind, false) => format!("{} {kind} rank process(es) launched here", self.ranks),
            (kind, true) => format!("{} {kind} rank process(es) placed by the environment", self.ranks),
        }
    }

    fn form(&mut self) -> anyhow::Result<Group> {
        match self.transport {
            TransportKind::Local => {
                let mut builder = Group::local_builder(self.ranks);
                if let Some(threads) = self.threads {
                    builder = builder.threads(threads);
                }
                Ok(builder.build()?)
            }
            kind if is_rank_process() => join(kind, &SocketOptions::from_env()?),
            kind => {
                if let Some(mut old) = self.launched.take() {
                    old.reap();
                }
                let (launched, options) = self.launch()?;
                self.launched = Some(launched);
                join(kind, &options)
            }
        }
    }

    /// Starts ranks 1.. as processes running `serve` with the same flags, on a fresh private
    /// Unix socket and a fresh group secret; returns how rank 0 joins them.
    fn launch(&self) -> anyhow::Result<(Launched, SocketOptions)> {
        let exe = std::env::current_exe().context("finding this executable")?;
        let dir = tempfile::Builder::new().prefix("vae-serve-").tempdir().context("making the rendezvous directory")?;
        let master = format!("unix:{}", dir.path().join("master.sock").display());
        let secret = GroupSecret::generate()?;
        let mut launched = Launched { children: Vec::new(), _dir: dir };
        for rank in 1..self.ranks {
            let mut command = Command::new(&exe);
            let child = die_with_parent(&mut command)
                .args(&self.args)
                .env(ENV_RANK, rank.to_string())
                .env(ENV_WORLD_SIZE, self.ranks.to_string())
                .env(ENV_MASTER_ADDR, &master)
                .env(crate::transport::auth::ENV_GROUP_SECRET, secret.to_hex())
                .env_remove(crate::transport::auth::ENV_GROUP_SECRET_FILE)
                .env(ENV_SERVE_LAUNCHED, "1")
                .spawn()
                .with_context(|| format!("starting rank process {rank}"))?;
            launched.children.push(child);
        }
        let options = SocketOptions {
            rank: 0,
            world_size: self.ranks,
            master: master.parse()?,
            config: TransportConfig::from_env()?,
            secret: Some(secret),
        };
        Ok((launched, options))
    }

    /// Why the group can serve no more requests, if it cannot: a transport failure, or a
    /// launched rank that has exited.
    pub fn failure(&mut self) -> Option<String> {
        if let Some(why) = &self.panicked {
            return Some(why.clone());
        }
        if let Some(err) = self.group.failure() {
            return Some(err.to_line());
        }
        let gone = self.launched.as_mut().map(Launched::exited).unwrap_or_default();
        (!gone.is_empty()).then(|| format!("rank process(es) {gone:?} exited"))
    }

    /// Replaces a failed group: the launched ranks stopped and started again, or fresh local
    /// pools. An error where the environment placed the ranks.
    pub fn rebuild(&mut self) -> anyhow::Result<()> {
        if !self.can_rebuild() {
            anyhow::bail!("the ranks were placed by the environment: the service cannot replace them");
        }
        self.group = self.form()?;
        self.panicked = None;
        Ok(())
    }

    /// Marks the group failed (a request panicked on it): [`Self::failure`] says `why` until it
    /// is rebuilt.
    pub fn mark_failed(&mut self, why: String) {
        self.panicked = Some(why);
    }

    /// Sends `frame` to the other rank processes (nothing for a local group).
    pub fn broadcast(&self, frame: &Frame, input: Option<&crate::Tensor>) -> crate::Result<()> {
        if self.group.is_local() {
            return Ok(());
        }
        let bytes = frame.to_bytes(input)?;
        self.group.run_on_ranks(|comm| {
            let mut sent = bytes.clone();
            Ok(comm.broadcast(0, &mut sent)?)
        })
    }

    /// Tells the other ranks to exit, then reaps the ones launched here.
    pub fn stop(&mut self) {
        if self.failure().is_none() {
            let _ = self.broadcast(&Frame::Stop, None);
        }
        if let Some(mut launched) = self.launched.take() {
            // A moment for them to leave by themselves, then none is left behind.
            let deadline = std::time::Instant::now() + Duration::from_secs(2);
            while std::time::Instant::now() < deadline && launched.exited().len() < launched.children.len() {
                std::thread::sleep(Duration::from_millis(20));
            }
            launched.reap();
        }
    }
}

/// Joins a socket group (over NCCL for `nccl`).
pub fn join(kind: TransportKind, options: &SocketOptions) -> anyhow::Result<Group> {
    Ok(match kind {
        TransportKind::Nccl => Group::nccl_join(options).context("joining the NCCL group")?,
        _ => Group::join(options).context("joining the socket group")?,
    })
}

/// The device this process's rank loads its models on: an NCCL rank's own GPU, else the one the
/// settings resolved.
pub fn rank_device(settings: &settings::Resolved, rank: usize) -> Device {
    match settings.transport {
        TransportKind::Nccl => Device::Cuda(crate::launch::local_rank().unwrap_or(rank)),
        _ => settings.device,
    }
}

/// A rank other than 0: receives each request rank 0 broadcasts and runs its part, until rank 0
/// says stop (success) or the group fails (an error: a launched rank exits, and the service
/// relaunches it).
pub fn rank_loop(group: &Group, models: &[(String, Vae)], base: &settings::Settings) -> anyhow::Result<()> {
    use super::engine::run_request;
    loop {
        let bytes = group.run_on_ranks(|comm: &Arc<dyn Communicator>| {
            let mut bytes = Vec::new();
            comm.broadcast(0, &mut bytes)?;
            Ok(bytes)
        })?;
        let (frame, input) = Frame::from_bytes(&bytes)?;
        match frame {
            Frame::Heartbeat => {}
            Frame::Stop => return Ok(()),
            Frame::Run { kind, options, streamed } => {
                let Some(input) = input else { anyhow::bail!("rank 0 sent a request without its input") };
                let Some((_, vae)) = models.iter().find(|(name, _)| *name == options.model) else {
                    anyhow::bail!("rank 0 asked for model {:?}, which this rank did not load", options.model)
                };
                // Errors every rank finds alike were answered by rank 0; a failure of the group
                // ends this rank.
                if let Err(err) = run_request(group, vae, base, kind, &options, &input, streamed, None, None) {
                    tracing::debug!("request failed on this rank: {}", err.to_line());
                }
                if let Some(err) = group.failure() {
                    return Err(err.into());
                }
            }
        }
    }
}
