//! The `socket` backend: ranks are processes, on one host or several, connected by a full mesh
//! of TCP or Unix-domain stream sockets. No MPI, no system packages.
//!
//! # Rendezvous
//! Rank 0 listens at the master address; every other rank listens at an address of its own,
//! connects to the master and says hello (rank, world size, own address). When all have joined,
//! rank 0 sends everyone the table of addresses; rank `i` then connects to ranks `1..i` and
//! accepts ranks `i+1..`, so every pair has one connection (the master connection is the link
//! between rank 0 and each rank). An NCCL group of processes bootstraps over such a group: rank
//! 0's NCCL unique id is broadcast on it.
//!
//! # Failure detection
//! A reader thread per connection moves frames into the rank's inbox. A peer whose process dies
//! closes its sockets, which the reader sees at once; a peer that is alive sends a heartbeat
//! every quarter of the failure timeout, so a peer that goes silent (hung host, lost network)
//! is declared failed after `failure_timeout`. A rank that aborts sends an abort frame with
//! its reason; a rank that finishes says goodbye.
//!
//! # Wire format
//! Every frame is a 32-byte header — magic `VAEF`, kind, 3 reserved bytes, sequence (u64),
//! tag (u64), payload length (u64), all little-endian — followed by the payload. Payloads of
//! typed buffers are sent in native byte order; the handshake refuses peers of the other
//! endianness.

use std::io;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

mod handshake;
mod rendezvous;
mod stream;

use rendezvous::{master_rendezvous, rendezvous_err, worker_rendezvous};
use stream::{Listener, Stream, read_frame, write_frame};

use crate::auth::{ENV_INSECURE_NO_AUTH, GroupSecret};
use crate::mesh::{Frame, Header, Inbox, MeshComm, OpKind, Wire, delegate_communicator};
use crate::pool::BufferPool;
use crate::{Result, TransportConfig, TransportError};

/// Environment variable: this process's rank.
pub const ENV_RANK: &str = "VAE_RANK";
/// Environment variable: number of ranks.
pub const ENV_WORLD_SIZE: &str = "VAE_WORLD_SIZE";
/// Environment variable: the master address (`host:port`, `tcp://host:port` or `unix:/path`).
pub const ENV_MASTER_ADDR: &str = "VAE_MASTER_ADDR";

/// torchrun's (and `torch.distributed`'s) names, read where the `VAE_*` ones are absent, so that
/// `torchrun --nproc-per-node N` starts a group: `RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
/// `MASTER_PORT`.
pub const TORCHRUN_ENV: [&str; 4] = ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"];

/// Under torchrun the group's master listens this many ports above `MASTER_PORT`: torchrun's
/// own store (which `torch.distributed` joins) holds `MASTER_PORT` itself.
pub const TORCHRUN_PORT_OFFSET: u16 = 1;

/// Whether this process's environment names its rank: `VAE_RANK`, or torchrun's `RANK` with
/// its `WORLD_SIZE`.
pub fn rank_in_env() -> bool {
    std::env::var_os(ENV_RANK).is_some()
        || (std::env::var_os(TORCHRUN_ENV[0]).is_some() && std::env::var_os(TORCHRUN_ENV[1]).is_some())
}

const MAGIC: [u8; 4] = *b"VAEF";
const PROTOCOL_VERSION: u32 = 1;
const HEADER_LEN: usize = 32;
/// Largest payload a data frame may announce; larger means a corrupt or foreign stream.
const MAX_PAYLOAD: u64 = 1 << 40;
/// Largest payload of a control or handshake frame (abort reasons, address tables).
const MAX_CONTROL_PAYLOAD: u64 = 1 << 20;
/// A data payload's buffer grows in steps of this as its bytes arrive.
const RECEIVE_STEP: usize = 64 << 20;

// Control frame kinds (data kinds are `OpKind`, 1..=6).
const KIND_HEARTBEAT: u8 = 16;
const KIND_ABORT: u8 = 17;
const KIND_GOODBYE: u8 = 18;
const KIND_HELLO: u8 = 32;
const KIND_WELCOME: u8 = 33;
const KIND_REJECT: u8 = 34;
const KIND_PEER_HELLO: u8 = 35;
const KIND_AUTH_CHALLENGE: u8 = 36;
const KIND_AUTH_RESPONSE: u8 = 37;

/// Where a socket listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// A TCP `host:port`.
    Tcp(String),
    /// A Unix-domain socket path (one host only).
    Unix(PathBuf),
}

impl FromStr for Endpoint {
    type Err = TransportError;

    fn from_str(s: &str) -> Result<Self> {
        let s = s.trim();
        if let Some(path) = s.strip_prefix("unix:") {
            if path.is_empty() {
                return Err(TransportError::InvalidArgument("empty Unix socket path".into()));
            }
            return Ok(Self::Unix(PathBuf::from(path)));
        }
        let hostport = s.strip_prefix("tcp://").unwrap_or(s);
        match hostport.rsplit_once(':') {
            Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => {
                Ok(Self::Tcp(hostport.to_string()))
            }
            _ => Err(TransportError::InvalidArgument(format!(
                "master address {s:?} is neither host:port, tcp://host:port nor unix:/path"
            ))),
        }
    }
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Tcp(hp) => write!(f, "tcp://{hp}"),
            Self::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

/// How one process joins a socket group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SocketOptions {
    /// This process's rank.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// Rank 0's listening address.
    pub master: Endpoint,
    /// Timeouts.
    pub config: TransportConfig,
    /// The group's secret: every link proves both ends hold it before any frame is accepted
    /// (see [`crate::auth`]). Required on TCP unless [`ENV_INSECURE_NO_AUTH`] is `1`.
    pub secret: Option<GroupSecret>,
}

impl SocketOptions {
    /// Reads `VAE_RANK`, `VAE_WORLD_SIZE`, `VAE_MASTER_ADDR` and the timeouts
    /// ([`TransportConfig::from_env`]); where a `VAE_*` name is absent, torchrun's: `RANK`,
    /// `WORLD_SIZE`, and `MASTER_ADDR` with `MASTER_PORT` (the group then listens on
    /// `MASTER_PORT + 1`, see [`TORCHRUN_PORT_OFFSET`]).
    pub fn from_env() -> Result<Self> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// [`Self::from_env`] over any source of variables.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let missing = |names: &str| TransportError::InvalidArgument(format!("environment variable {names} is not set"));
        let first = |ours: &str, torch: &str| {
            var(ours).map(|v| (ours.to_string(), v)).or_else(|| var(torch).map(|v| (torch.to_string(), v)))
        };
        let number = |ours: &str, torch: &str| -> Result<usize> {
            let (name, text) = first(ours, torch).ok_or_else(|| missing(&format!("{ours} (or {torch})")))?;
            text.trim()
                .parse()
                .map_err(|_| TransportError::InvalidArgument(format!("{name}={text:?} is not a non-negative integer")))
        };
        let [rank, world, addr, port] = TORCHRUN_ENV;
        let master = match var(ENV_MASTER_ADDR) {
            Some(text) => text.parse()?,
            None => {
                let host = var(addr).ok_or_else(|| missing(&format!("{ENV_MASTER_ADDR} (or {addr} and {port})")))?;
                let text = var(port).ok_or_else(|| missing(&format!("{port} (with {addr}={host})")))?;
                let base: u16 = text
                    .trim()
                    .parse()
                    .map_err(|_| TransportError::InvalidArgument(format!("{port}={text:?} is not a port number")))?;
                let ours = base.checked_add(TORCHRUN_PORT_OFFSET).ok_or_else(|| {
                    TransportError::InvalidArgument(format!("{port}={base} leaves no port above it for the group"))
                })?;
                let host = host.trim();
                // An IPv6 address is bracketed before a port is put after it.
                let host = if host.contains(':') && !host.starts_with('[') { format!("[{host}]") } else { host.into() };
                format!("{host}:{ours}").parse()?
            }
        };
        Ok(Self {
            rank: number(ENV_RANK, rank)?,
            world_size: number(ENV_WORLD_SIZE, world)?,
            master,
            config: TransportConfig::from_env()?,
            secret: GroupSecret::from_env()?,
        })
    }

    fn validate(&self) -> Result<()> {
        crate::check_world_size(self.world_size)?;
        let insecure = std::env::var(ENV_INSECURE_NO_AUTH).is_ok_and(|v| v.trim() == "1");
        if matches!(self.master, Endpoint::Tcp(_)) && self.secret.is_none() && !insecure && self.world_size > 1 {
            return Err(TransportError::InvalidArgument(format!(
                "a TCP group needs a group secret, or any process that reaches its ports can join it: \
                 give every rank the same 64 hex digits in {} (or a file of them in {}), or set {ENV_INSECURE_NO_AUTH}=1 \
                 to run without one",
                crate::auth::ENV_GROUP_SECRET,
                crate::auth::ENV_GROUP_SECRET_FILE
            )));
        }
        if self.rank >= self.world_size {
            return Err(TransportError::InvalidArgument(format!(
                "rank {} is out of range for world size {}",
                self.rank, self.world_size
            )));
        }
        self.config.validate()
    }
}

/// One rank's links: a writer per peer (`None` for itself) and the state the threads share.
struct SocketWire {
    rank: usize,
    writers: Writers,
}

/// One writer per peer (`None` for this rank), shared with the heartbeat thread; the lock keeps
/// frames whole.
type Writers = Arc<Vec<Option<Mutex<Stream>>>>;

impl SocketWire {
    fn write_control(&self, kind: u8, payload: &[u8]) {
        for writer in self.writers.iter().flatten() {
            let mut stream = writer.lock().unwrap_or_else(|e| e.into_inner());
            // Best effort: a dead peer is exactly the case this is for.
            let _ = write_frame(&mut stream, kind, 0, 0, payload);
        }
    }
}

impl Wire for SocketWire {
    fn send(&self, to: &[usize], header: Header, payload: &[u8]) -> Result<()> {
        for &peer in to {
            let writer =
                self.writers[peer].as_ref().ok_or_else(|| TransportError::InvalidArgument("no link to self".into()))?;
            let mut stream = writer.lock().unwrap_or_else(|e| e.into_inner());
            write_frame(&mut stream, header.kind as u8, header.seq, header.tag, payload).map_err(|e| {
                TransportError::io(Some(peer), format!("rank {} sending to rank {peer}", self.rank), &e)
            })?;
        }
        Ok(())
    }

    fn announce_failure(&self, failed_rank: usize, reason: &str) {
        let mut payload = (failed_rank as u64).to_le_bytes().to_vec();
        payload.extend_from_slice(reason.as_bytes());
        self.write_control(KIND_ABORT, &payload);
    }

    fn announce_departure(&self) {
        self.write_control(KIND_GOODBYE, &[]);
    }
}

/// A rank's links once their reader threads run.
struct StartedLinks {
    inbox: Arc<Inbox>,
    wire: SocketWire,
    readers: Vec<JoinHandle<()>>,
    shutdown_handles: Vec<Stream>,
    closing: Arc<AtomicBool>,
}

/// Stops the heartbeat threads.
#[derive(Default)]
struct Stop {
    stopped: Mutex<bool>,
    signal: Condvar,
}

/// One rank of a multi-process group over sockets.
pub struct SocketComm {
    inner: MeshComm<SocketWire>,
    closing: Arc<AtomicBool>,
    stop: Arc<Stop>,
    readers: Vec<JoinHandle<()>>,
    heartbeats: Vec<JoinHandle<()>>,
    shutdown_handles: Vec<Stream>,
}

impl std::fmt::Debug for SocketComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SocketComm").field("rank", &self.inner.rank()).field("size", &self.inner.size()).finish()
    }
}

delegate_communicator!(SocketComm);

impl SocketComm {
    /// Joins the group described by [`SocketOptions::from_env`].
    pub fn from_env() -> Result<Self> {
        Self::connect(&SocketOptions::from_env()?)
    }

    /// Joins a group: rendezvous at the master, full mesh, a barrier. Returns once every rank
    /// is connected to every other, or fails within `connect_timeout`.
    pub fn connect(options: &SocketOptions) -> Result<Self> {
        options.validate()?;
        let (rank, world) = (options.rank, options.world_size);
        let deadline = Instant::now() + options.config.connect_timeout;
        let mut links: Vec<Option<Stream>> = (0..world).map(|_| None).collect();
        if world > 1 {
            if rank == 0 {
                let listener = Listener::bind(&options.master).map_err(|e| {
                    rendezvous_err(&format!("rank 0 binding the master address {}", options.master), &e)
                })?;
                master_rendezvous(&listener, world, deadline, options.secret.as_ref(), &mut links)?;
            } else {
                worker_rendezvous(options, deadline, &mut links)?;
            }
        }

        // A link-by-link setup failure here (the host out of threads, say) is this rank's
        // own: told to every peer with its reason, or they would see a rank leave and blame it
        // without saying why.
        let mut announce: Vec<Stream> = links.iter().flatten().filter_map(|s| s.try_clone().ok()).collect();
        let told = move |err: TransportError| {
            let mut payload = (rank as u64).to_le_bytes().to_vec();
            payload.extend_from_slice(format!("could not join: {err}").as_bytes());
            for stream in &mut announce {
                let _ = write_frame(stream, KIND_ABORT, 0, 0, &payload);
            }
            err
        };
        let started = Self::start_links(options, links).map_err(told)?;
        let inner = MeshComm::new(rank, world, "socket", started.wire, started.inbox, options.config);
        let mut comm = Self {
            inner,
            closing: started.closing,
            stop: Arc::new(Stop::default()),
            readers: started.readers,
            heartbeats: Vec::new(),
            shutdown_handles: started.shutdown_handles,
        };
        if let Err(err) = comm.start_heartbeats(options.config.failure_timeout / 4) {
            comm.inner.abort(&format!("could not join: {err}"));
            return Err(err);
        }
        comm.inner.barrier()?;
        tracing::debug!(rank, world, master = %options.master, "socket group connected");
        Ok(comm)
    }

    /// Starts a reader thread per link and wraps each link's writing half.
    fn start_links(options: &SocketOptions, links: Vec<Option<Stream>>) -> Result<StartedLinks> {
        let (rank, world) = (options.rank, options.world_size);
        let inbox = Arc::new(Inbox::new(world));
        let buffers = Arc::new(BufferPool::default());
        let closing = Arc::new(AtomicBool::new(false));
        let mut writers = Vec::with_capacity(world);
        let mut readers = Vec::new();
        let mut shutdown_handles = Vec::new();
        let setup = |e: io::Error| TransportError::io(None, "configuring a link", &e);
        for (peer, link) in links.into_iter().enumerate() {
            let Some(stream) = link else {
                writers.push(None);
                continue;
            };
            // Every peer's reader thread drains its sockets at all times, so a write that makes
            // no progress for the failure timeout means the peer is gone or hung.
            stream.set_write_timeout(Some(options.config.failure_timeout)).map_err(setup)?;
            let mut reader = stream.try_clone().map_err(setup)?;
            reader.set_read_timeout(Some(options.config.failure_timeout)).map_err(setup)?;
            shutdown_handles.push(stream.try_clone().map_err(setup)?);
            writers.push(Some(Mutex::new(stream)));
            let cx = ReaderContext {
                peer,
                world,
                inbox: Arc::clone(&inbox),
                buffers: Arc::clone(&buffers),
                closing: Arc::clone(&closing),
                failure_timeout: options.config.failure_timeout,
            };
            let handle = std::thread::Builder::new()
                .name(format!("vae-rank{rank}-from{peer}"))
                .spawn(move || read_loop(&mut reader, &cx))
                .map_err(|e| thread_err("a reader thread", world, &e))?;
            readers.push(handle);
        }
        let wire = SocketWire { rank, writers: Arc::new(writers) };
        Ok(StartedLinks { inbox, wire, readers, shutdown_handles, closing })
    }

    /// One heartbeat thread per link, so that a peer whose socket stops draining (hung) can
    /// only stall the heartbeats it would not read anyway.
    fn start_heartbeats(&mut self, interval: Duration) -> Result<()> {
        let interval = interval.max(Duration::from_millis(1));
        let writers = Arc::clone(&self.inner.wire().writers);
        for peer in (0..writers.len()).filter(|&p| writers[p].is_some()) {
            let (stop, writers) = (Arc::clone(&self.stop), Arc::clone(&writers));
            let handle = std::thread::Builder::new()
                .name(format!("vae-rank{}-beat{peer}", self.inner.rank()))
                .spawn(move || heartbeat_loop(&writers, peer, &stop, interval))
                .map_err(|e| thread_err("a heartbeat thread", self.inner.size(), &e))?;
            self.heartbeats.push(handle);
        }
        Ok(())
    }
}

/// A thread that could not start: most often the host's limit on threads, which a socket group
/// of N ranks on one host meets at 2·N·(N − 1) threads (a reader and a heartbeat per link).
fn thread_err(what: &str, world: usize, err: &io::Error) -> TransportError {
    let mut message = err.to_string();
    if err.kind() == io::ErrorKind::WouldBlock {
        let threads = 2 * world.saturating_sub(1);
        message.push_str(&format!(
            "; the host's limit on threads? each rank of a socket group runs two per peer, {threads} here"
        ));
    }
    TransportError::Io { rank: None, context: format!("starting {what}"), message }
}

fn heartbeat_loop(writers: &Writers, peer: usize, stop: &Stop, interval: Duration) {
    let Some(writer) = &writers[peer] else { return };
    loop {
        {
            let stopped = stop.stopped.lock().unwrap_or_else(|e| e.into_inner());
            let (stopped, _) = stop.signal.wait_timeout(stopped, interval).unwrap_or_else(|e| e.into_inner());
            if *stopped {
                return;
            }
        }
        // A writer busy with a data frame proves liveness by itself: skip it.
        if let Ok(mut stream) = writer.try_lock()
            && write_frame(&mut stream, KIND_HEARTBEAT, 0, 0, &[]).is_err()
        {
            return; // the link is gone; its reader reports why
        }
    }
}

struct ReaderContext {
    peer: usize,
    world: usize,
    inbox: Arc<Inbox>,
    buffers: Arc<BufferPool>,
    closing: Arc<AtomicBool>,
    failure_timeout: Duration,
}

fn read_loop(stream: &mut Stream, cx: &ReaderContext) {
    let failed = |stream: &Stream, rank: usize, reason: String| {
        cx.inbox.peer_failed(cx.peer, rank, reason);
        // Unblocks any write to this peer at once instead of after its timeout.
        stream.shutdown();
    };
    let (peer, inbox, closing, failure_timeout) = (cx.peer, &cx.inbox, &cx.closing, cx.failure_timeout);
    loop {
        match read_frame(stream, &cx.buffers) {
            Ok(frame) => match frame.kind {
                KIND_HEARTBEAT => {}
                KIND_ABORT => {
                    // Payload: the failed rank (u64) and the reason; the sender may be passing
                    // on another rank's failure.
                    let (rank, reason) = match frame.payload.split_first_chunk::<8>() {
                        Some((rank, reason)) => (u64::from_le_bytes(*rank) as usize, reason),
                        None => (peer, &frame.payload[..]),
                    };
                    let rank = if rank < cx.world { rank } else { peer };
                    inbox.peer_failed(peer, rank, String::from_utf8_lossy(reason).into_owned());
                    return;
                }
                KIND_GOODBYE => {
                    inbox.peer_left(peer);
                    return;
                }
                kind => match OpKind::from_u8(kind) {
                    Some(kind) => inbox.deliver(
                        peer,
                        Frame {
                            header: Header { kind, seq: frame.seq, tag: frame.tag },
                            payload: Arc::new(frame.payload),
                        },
                    ),
                    None => {
                        failed(stream, peer, format!("protocol error: unknown frame kind {kind}"));
                        return;
                    }
                },
            },
            Err(e) => {
                if closing.load(Ordering::SeqCst) {
                    return;
                }
                let reason = match e.kind() {
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                        format!("no message or heartbeat for {failure_timeout:?} (process hung or network lost)")
                    }
                    io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe => {
                        "connection closed without a goodbye (process died?)".to_string()
                    }
                    _ => format!("connection error: {e}"),
                };
                failed(stream, peer, reason);
                return;
            }
        }
    }
}

impl Drop for SocketComm {
    fn drop(&mut self) {
        // Say goodbye (or report the panic) while the links are still up.
        self.inner.leave();
        self.closing.store(true, Ordering::SeqCst);
        {
            *self.stop.stopped.lock().unwrap_or_else(|e| e.into_inner()) = true;
            self.stop.signal.notify_all();
        }
        for h in self.heartbeats.drain(..) {
            let _ = h.join();
        }
        for stream in &self.shutdown_handles {
            stream.shutdown();
        }
        for h in self.readers.drain(..) {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::{TcpListener, TcpStream};
    use std::os::unix::net::UnixStream;

    use proptest::prelude::*;

    use super::rendezvous::parse_hello;
    use super::stream::read_control_frame;
    use super::*;

    fn options_from(vars: &[(&str, &str)]) -> Result<SocketOptions> {
        let vars: std::collections::HashMap<String, String> =
            vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        SocketOptions::from_vars(|name| vars.get(name).cloned())
    }

    #[test]
    fn torchruns_names_stand_in_for_absent_vae_ones() {
        let torchrun = [("RANK", "1"), ("WORLD_SIZE", "4"), ("MASTER_ADDR", "10.0.0.7"), ("MASTER_PORT", "29500")];
        let o = options_from(&torchrun).unwrap();
        assert_eq!((o.rank, o.world_size), (1, 4));
        assert_eq!(o.master, Endpoint::Tcp("10.0.0.7:29501".into()), "one port above torchrun's store");
        // The VAE_* names win, each on its own.
        let mixed = [&torchrun[..], &[("VAE_RANK", "3"), ("VAE_MASTER_ADDR", "unix:/tmp/g.sock")][..]].concat();
        let o = options_from(&mixed).unwrap();
        assert_eq!((o.rank, o.world_size), (3, 4));
        assert_eq!(o.master, Endpoint::Unix("/tmp/g.sock".into()));
        let v6 = [("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "::1"), ("MASTER_PORT", "7000")];
        assert_eq!(options_from(&v6).unwrap().master, Endpoint::Tcp("[::1]:7001".into()));
        // Missing or bad pieces are named.
        let no_port = [("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")];
        assert!(options_from(&no_port).unwrap_err().to_string().contains("MASTER_PORT"));
        let top = [("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "65535")];
        assert!(options_from(&top).unwrap_err().to_string().contains("no port above"));
        let bad = [("RANK", "x"), ("WORLD_SIZE", "2"), ("VAE_MASTER_ADDR", "h:1")];
        assert!(options_from(&bad).unwrap_err().to_string().contains("RANK=\"x\""));
        let none: [(&str, &str); 0] = [];
        assert!(
            options_from(&none).unwrap_err().to_string().contains("VAE_MASTER_ADDR (or MASTER_ADDR and MASTER_PORT)")
        );
    }

    #[test]
    fn a_unix_peer_is_known_by_its_user() {
        let (a, _b) = UnixStream::pair().unwrap();
        let stream = Stream::Unix(a);
        if cfg!(target_os = "linux") {
            assert!(stream.peer_uid().is_some());
            assert_eq!(stream.peer_uid(), Stream::own_uid());
        }
        let tcp = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = Stream::Tcp(TcpStream::connect(tcp.local_addr().unwrap()).unwrap());
        assert_eq!(client.peer_uid(), None, "TCP carries no user");
    }

    #[test]
    fn a_timed_out_rendezvous_says_so() {
        let e = io::Error::from(io::ErrorKind::WouldBlock);
        let text = rendezvous_err("rank 1 waiting for the master's table of ranks", &e).to_string();
        assert!(text.contains("timed out") && !text.contains("temporarily unavailable"), "{text}");
    }

    proptest! {
        /// Whatever arrives on a socket, a frame is read or refused with an error: no panic, and
        /// no allocation beyond what arrived (a header announcing a terabyte over a short stream
        /// fails when the stream ends).
        #[test]
        fn fuzz_frames_and_hellos(bytes in prop::collection::vec(any::<u8>(), 0..160), world in 1usize..8) {
            let mut stream: &[u8] = &bytes;
            let _ = read_control_frame(&mut stream);
            let mut headed = b"VAEF".to_vec();
            headed.extend_from_slice(&bytes);
            let mut stream: &[u8] = &headed;
            let _ = read_frame(&mut stream, &Arc::default());
            let _ = parse_hello(&bytes, world);
        }
    }
}
