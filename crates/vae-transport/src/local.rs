//! The `local` backend: the ranks of a group are threads of one process.
//!
//! Frames move between inboxes in memory. An outgoing buffer is copied once and shared by
//! every receiver (a broadcast to seven ranks costs one copy out and seven copies in, never
//! seven serialisations). A rank whose handle is dropped while its thread unwinds from a panic
//! is reported as failed to every other rank at once; a rank that returns early is reported as
//! having left, so nobody waits for it. Ranks can also hand each other values without
//! serialising them, through the group's [`Mailbox`].

use std::sync::Arc;

use crate::Mailbox;
use crate::mesh::{Frame, Header, Inbox, MeshComm, Payload, Wire, delegate_communicator};
use crate::pool::BufferPool;
use crate::{Result, TransportConfig, TransportError};

/// All inboxes of one in-process group.
#[derive(Debug)]
struct LocalWorld {
    inboxes: Vec<Arc<Inbox>>,
    buffers: Arc<BufferPool>,
    mailbox: Mailbox,
}

struct LocalWire {
    rank: usize,
    world: Arc<LocalWorld>,
}

impl Wire for LocalWire {
    fn send(&self, to: &[usize], header: Header, payload: &[u8]) -> Result<()> {
        // One copy out of the sender, shared by every receiver.
        let shared: Payload = Arc::new(self.world.buffers.copy_of(payload));
        for &peer in to {
            self.world.inboxes[peer].deliver(self.rank, Frame { header, payload: Arc::clone(&shared) });
        }
        Ok(())
    }

    fn announce_failure(&self, failed_rank: usize, reason: &str) {
        for (r, inbox) in self.world.inboxes.iter().enumerate() {
            if r != self.rank {
                inbox.peer_failed(self.rank, failed_rank, reason.to_string());
            }
        }
    }

    fn announce_departure(&self) {
        for (r, inbox) in self.world.inboxes.iter().enumerate() {
            if r != self.rank {
                inbox.peer_left(self.rank);
            }
        }
    }

    fn mailbox(&self) -> Option<&Mailbox> {
        Some(&self.world.mailbox)
    }
}

/// One rank of an in-process group (see [`local_group`]).
pub struct LocalComm {
    inner: MeshComm<LocalWire>,
}

impl std::fmt::Debug for LocalComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalComm").field("rank", &self.inner.rank()).field("size", &self.inner.size()).finish()
    }
}

delegate_communicator!(LocalComm);

/// Creates the `size` communicators of one in-process group, one per rank, to be moved into
/// one thread each.
pub fn local_group(size: usize, config: TransportConfig) -> Result<Vec<LocalComm>> {
    crate::check_world_size(size)?;
    config.validate()?;
    let world = Arc::new(LocalWorld {
        inboxes: (0..size).map(|_| Arc::new(Inbox::new(size))).collect(),
        buffers: Arc::new(BufferPool::default()),
        mailbox: Mailbox::default(),
    });
    Ok((0..size)
        .map(|rank| {
            let wire = LocalWire { rank, world: Arc::clone(&world) };
            LocalComm { inner: MeshComm::new(rank, size, "local", wire, Arc::clone(&world.inboxes[rank]), config) }
        })
        .collect())
}

/// Runs `body` on `size` ranks, one thread each (named `vae-rank-N`), and returns each rank's
/// result in rank order. A rank that panics yields `Err` with the panic message; the other
/// ranks see it as a failed peer instead of hanging.
pub fn run_local<R, F>(size: usize, config: TransportConfig, body: F) -> Result<Vec<std::result::Result<R, String>>>
where
    R: Send,
    F: Fn(LocalComm) -> R + Sync,
{
    let comms = local_group(size, config)?;
    let body = &body;
    std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                std::thread::Builder::new()
                    .name(format!("vae-rank-{rank}"))
                    .spawn_scoped(scope, move || body(comm))
                    .map_err(|e| TransportError::io(None, format!("spawning the thread of rank {rank}"), &e))
            })
            .collect::<Result<_>>()?;
        Ok(handles.into_iter().map(|h| h.join().map_err(|payload| panic_message(payload.as_ref()))).collect())
    })
}

/// The message of a panic payload (a rank's thread that panicked, a caught unwind).
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic with a non-string payload".to_string()
    }
}
