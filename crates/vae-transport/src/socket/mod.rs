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

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

mod handshake;

use handshake::Opening;

use crate::auth::{ENV_INSECURE_NO_AUTH, GroupSecret};
use crate::mesh::{Frame, Header, Inbox, MeshComm, OpKind, Wire, delegate_communicator};
use crate::pool::{BufferPool, PooledBuf};
use crate::wire::{Reader, WireError, Writer};
use crate::{Result, TransportConfig, TransportError};

/// Environment variable: this process's rank.
pub const ENV_RANK: &str = "VAE_RANK";
/// Environment variable: number of ranks.
pub const ENV_WORLD_SIZE: &str = "VAE_WORLD_SIZE";
/// Environment variable: the master address (`host:port`, `tcp://host:port` or `unix:/path`).
pub const ENV_MASTER_ADDR: &str = "VAE_MASTER_ADDR";

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
    /// ([`TransportConfig::from_env`]).
    pub fn from_env() -> Result<Self> {
        let var = |name: &str| {
            std::env::var(name)
                .map_err(|_| TransportError::InvalidArgument(format!("environment variable {name} is not set")))
        };
        let number = |name: &str| -> Result<usize> {
            let text = var(name)?;
            text.trim()
                .parse()
                .map_err(|_| TransportError::InvalidArgument(format!("{name}={text:?} is not a non-negative integer")))
        };
        Ok(Self {
            rank: number(ENV_RANK)?,
            world_size: number(ENV_WORLD_SIZE)?,
            master: var(ENV_MASTER_ADDR)?.parse()?,
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

/// A connected stream of either family.
#[derive(Debug)]
enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    /// The user id of the process at the other end of a Unix socket (Linux `SO_PEERCRED`);
    /// `None` for TCP or where the system cannot tell.
    fn peer_uid(&self) -> Option<u32> {
        #[cfg(target_os = "linux")]
        if let Self::Unix(s) = self {
            use std::os::fd::AsRawFd;
            let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
            let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
            // SAFETY: `cred` and `len` are valid for writes of the size `len` says, and the
            // descriptor is this open socket's.
            let rc = unsafe {
                libc::getsockopt(
                    s.as_raw_fd(),
                    libc::SOL_SOCKET,
                    libc::SO_PEERCRED,
                    (&mut cred as *mut libc::ucred).cast(),
                    &mut len,
                )
            };
            return (rc == 0).then_some(cred.uid);
        }
        None
    }

    /// This process's effective user id (Linux); `None` elsewhere.
    fn own_uid() -> Option<u32> {
        #[cfg(target_os = "linux")]
        {
            // SAFETY: `geteuid` takes nothing and cannot fail.
            return Some(unsafe { libc::geteuid() });
        }
        #[allow(unreachable_code)]
        None
    }

    fn try_clone(&self) -> io::Result<Self> {
        Ok(match self {
            Self::Tcp(s) => Self::Tcp(s.try_clone()?),
            Self::Unix(s) => Self::Unix(s.try_clone()?),
        })
    }

    fn set_read_timeout(&self, d: Option<Duration>) -> io::Result<()> {
        match self {
            Self::Tcp(s) => s.set_read_timeout(d),
            Self::Unix(s) => s.set_read_timeout(d),
        }
    }

    fn set_write_timeout(&self, d: Option<Duration>) -> io::Result<()> {
        match self {
            Self::Tcp(s) => s.set_write_timeout(d),
            Self::Unix(s) => s.set_write_timeout(d),
        }
    }

    fn shutdown(&self) {
        let _ = match self {
            Self::Tcp(s) => s.shutdown(std::net::Shutdown::Both),
            Self::Unix(s) => s.shutdown(std::net::Shutdown::Both),
        };
    }

    fn prepare(&self) -> io::Result<()> {
        match self {
            Self::Tcp(s) => {
                s.set_nonblocking(false)?;
                s.set_nodelay(true)
            }
            Self::Unix(s) => s.set_nonblocking(false),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Self::Tcp(s) => s.read(buf),
            Self::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Self::Tcp(s) => s.write(buf),
            Self::Unix(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Self::Tcp(s) => s.flush(),
            Self::Unix(s) => s.flush(),
        }
    }
}

enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener, PathBuf),
}

impl Listener {
    fn bind(endpoint: &Endpoint) -> io::Result<Self> {
        match endpoint {
            Endpoint::Tcp(hp) => Ok(Self::Tcp(TcpListener::bind(hp.as_str())?)),
            Endpoint::Unix(path) => {
                // A socket file left by a crashed run would make bind fail; nobody can be
                // listening on it if connecting is refused. Never remove anything else.
                use std::os::unix::fs::FileTypeExt;
                let is_socket = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket());
                if is_socket && UnixStream::connect(path).is_err() {
                    let _ = std::fs::remove_file(path);
                }
                let listener = UnixListener::bind(path)?;
                Ok(Self::Unix(listener, path.clone()))
            }
        }
    }

    fn advertised(&self, tcp_host: Option<std::net::IpAddr>) -> io::Result<String> {
        match self {
            Self::Tcp(l) => {
                let mut addr = l.local_addr()?;
                if let Some(ip) = tcp_host {
                    addr.set_ip(ip);
                }
                Ok(format!("tcp://{addr}"))
            }
            Self::Unix(_, path) => Ok(format!("unix:{}", path.display())),
        }
    }

    /// Accepts one connection before `deadline`.
    fn accept(&self, deadline: Instant) -> io::Result<Stream> {
        match self {
            Self::Tcp(l) => l.set_nonblocking(true)?,
            Self::Unix(l, _) => l.set_nonblocking(true)?,
        }
        loop {
            let accepted = match self {
                Self::Tcp(l) => l.accept().map(|(s, _)| Stream::Tcp(s)),
                Self::Unix(l, _) => l.accept().map(|(s, _)| Stream::Unix(s)),
            };
            match accepted {
                Ok(stream) => {
                    stream.prepare()?;
                    return Ok(stream);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::Interrupted => {
                    if Instant::now() >= deadline {
                        return Err(io::Error::new(io::ErrorKind::TimedOut, "no connection before the deadline"));
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => return Err(e),
            }
        }
    }
}

impl Drop for Listener {
    /// The socket file is only needed while ranks join: it goes with the listener, so no run
    /// leaves files behind, even one that fails half way.
    fn drop(&mut self) {
        if let Self::Unix(_, path) = self {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Connects to `endpoint`, retrying refused or missing listeners until `deadline` (the other
/// side may simply not have started yet).
fn connect(endpoint: &Endpoint, deadline: Instant) -> io::Result<Stream> {
    loop {
        let attempt = match endpoint {
            Endpoint::Tcp(hp) => {
                let addrs: Vec<SocketAddr> = hp.to_socket_addrs()?.collect();
                let mut last = io::Error::new(io::ErrorKind::NotFound, format!("{hp} resolves to no address"));
                let mut connected = None;
                for addr in addrs {
                    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(10));
                    match TcpStream::connect_timeout(&addr, left) {
                        Ok(s) => {
                            connected = Some(Stream::Tcp(s));
                            break;
                        }
                        Err(e) => last = e,
                    }
                }
                connected.ok_or(last)
            }
            Endpoint::Unix(path) => UnixStream::connect(path).map(Stream::Unix),
        };
        match attempt {
            Ok(stream) => {
                stream.prepare()?;
                return Ok(stream);
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::ConnectionRefused | io::ErrorKind::NotFound | io::ErrorKind::TimedOut
                ) && Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(e),
        }
    }
}

fn write_frame(stream: &mut Stream, kind: u8, seq: u64, tag: u64, payload: &[u8]) -> io::Result<()> {
    let mut header = [0u8; HEADER_LEN];
    header[0..4].copy_from_slice(&MAGIC);
    header[4] = kind;
    header[8..16].copy_from_slice(&seq.to_le_bytes());
    header[16..24].copy_from_slice(&tag.to_le_bytes());
    header[24..32].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    stream.write_all(&header)?;
    stream.write_all(payload)?;
    stream.flush()
}

struct RawFrame {
    kind: u8,
    seq: u64,
    tag: u64,
    payload: PooledBuf,
}

fn read_frame(stream: &mut impl Read, buffers: &Arc<BufferPool>) -> io::Result<RawFrame> {
    let mut header = [0u8; HEADER_LEN];
    stream.read_exact(&mut header)?;
    if header[0..4] != MAGIC {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "bad frame magic: not a vae-parallel peer"));
    }
    let word = |i: usize| u64::from_le_bytes(header[i..i + 8].try_into().expect("8 bytes"));
    let (kind, len) = (header[4], word(24));
    let limit = if OpKind::from_u8(kind).is_some() { MAX_PAYLOAD } else { MAX_CONTROL_PAYLOAD };
    let len = usize::try_from(len).ok().filter(|&l| l as u64 <= limit).ok_or_else(|| {
        io::Error::new(io::ErrorKind::InvalidData, format!("frame of kind {kind} announces {len} bytes"))
    })?;
    // Reserve what a well-behaved peer sends at once, then grow only as bytes arrive.
    let mut payload = buffers.take(len.min(RECEIVE_STEP));
    payload.fill_from(stream, len, RECEIVE_STEP)?;
    Ok(RawFrame { kind, seq: word(8), tag: word(16), payload })
}

/// A handshake frame (small; not worth a pooled buffer).
fn read_control_frame(stream: &mut impl Read) -> io::Result<RawFrame> {
    read_frame(stream, &Arc::default())
}

/// Identity every connection starts with: protocol, byte order, group size, rank.
fn hello_payload(rank: usize, world: usize, addr: &str) -> Vec<u8> {
    let little_endian = u64::from(cfg!(target_endian = "little"));
    let mut hello = Writer::new();
    hello.u64(u64::from(PROTOCOL_VERSION)).u64(little_endian).usize(world).usize(rank).str(addr);
    hello.into_bytes()
}

struct Hello {
    rank: usize,
    addr: String,
}

fn parse_hello(payload: &[u8], world: usize) -> std::result::Result<Hello, String> {
    let mut d = Reader::new(payload, "handshake");
    let parsed = (|| -> std::result::Result<_, WireError> { Ok((d.u64()?, d.u64()?, d.u64()?, d.u64()?, d.str()?)) })();
    let (version, little, their_world, rank, addr) = parsed.map_err(|e| e.to_string())?;
    if version != u64::from(PROTOCOL_VERSION) {
        return Err(format!("protocol version {version}, expected {PROTOCOL_VERSION}"));
    }
    if little != u64::from(cfg!(target_endian = "little")) {
        return Err("peer has the other byte order".into());
    }
    if their_world as usize != world {
        return Err(format!("rank {rank} was started with world size {their_world}, this rank with {world}"));
    }
    if rank as usize >= world {
        return Err(format!("rank {rank} is out of range for world size {world}"));
    }
    Ok(Hello { rank: rank as usize, addr })
}

fn rendezvous_err(context: &str, e: &io::Error) -> TransportError {
    // A read timeout surfaces as EAGAIN ("Resource temporarily unavailable"): say what it means.
    if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) {
        return TransportError::Rendezvous(format!(
            "{context}: timed out (VAE_CONNECT_TIMEOUT_S sets how long the rendezvous waits)"
        ));
    }
    TransportError::Rendezvous(format!("{context}: {e}"))
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
                .map_err(|e| TransportError::io(Some(peer), "spawning a reader thread", &e))?;
            readers.push(handle);
        }

        let wire = SocketWire { rank, writers: Arc::new(writers) };
        let inner = MeshComm::new(rank, world, "socket", wire, inbox, options.config);
        let stop = Arc::new(Stop::default());
        let mut comm = Self { inner, closing, stop, readers, heartbeats: Vec::new(), shutdown_handles };
        comm.start_heartbeats(options.config.failure_timeout / 4)?;
        comm.inner.barrier()?;
        tracing::debug!(rank, world, master = %options.master, "socket group connected");
        Ok(comm)
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
                .map_err(|e| TransportError::io(None, "spawning a heartbeat thread", &e))?;
            self.heartbeats.push(handle);
        }
        Ok(())
    }
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

fn master_rendezvous(
    listener: &Listener,
    world: usize,
    deadline: Instant,
    secret: Option<&GroupSecret>,
    links: &mut [Option<Stream>],
) -> Result<()> {
    let mut addrs = vec![String::new(); world];
    let mut joined = 0;
    let reject_all = |links: &mut [Option<Stream>], reason: &str| {
        for stream in links.iter_mut().flatten() {
            let _ = write_frame(stream, KIND_REJECT, 0, 0, reason.as_bytes());
        }
    };
    while joined < world - 1 {
        let mut stream = listener.accept(deadline).map_err(|e| {
            let msg = format!("rank 0 waiting for {} more rank(s) to join", world - 1 - joined);
            reject_all(links, &msg);
            rendezvous_err(&msg, &e)
        })?;
        // A rank says who it is as soon as it connects; a connection that does not, in time, or
        // cannot prove it holds the group secret is not a rank and must not hold up the others.
        let hello_deadline = deadline.min(Instant::now() + handshake::HELLO_DEADLINE);
        let payload = match handshake::accept(&mut stream, secret, 0, world, hello_deadline)? {
            Opening::Hello { kind: KIND_HELLO, payload } => payload,
            Opening::Hello { kind, .. } => {
                tracing::warn!(kind, "rank 0 dropped a connection that opened with a frame that is not a hello");
                continue;
            }
            Opening::Dropped(why) => {
                tracing::warn!("rank 0 dropped a connection that is not a member of the group: {why}");
                continue;
            }
        };
        let problem = match parse_hello(&payload, world) {
            Ok(hello) if hello.rank == 0 => Err("a second process claims rank 0".to_string()),
            Ok(hello) if links[hello.rank].is_some() => Err(format!("two processes claim rank {}", hello.rank)),
            Ok(hello) => Ok(hello),
            Err(reason) => Err(reason),
        };
        match problem {
            Ok(hello) => {
                stream.set_read_timeout(None).map_err(|e| rendezvous_err("configuring a joining rank", &e))?;
                addrs[hello.rank] = hello.addr;
                links[hello.rank] = Some(stream);
                joined += 1;
            }
            Err(reason) => {
                let _ = write_frame(&mut stream, KIND_REJECT, 0, 0, reason.as_bytes());
                reject_all(links, &reason);
                return Err(TransportError::Rendezvous(reason));
            }
        }
    }
    let mut table = Writer::new();
    table.usize(world);
    for addr in &addrs {
        table.str(addr);
    }
    for (peer, stream) in links.iter_mut().enumerate() {
        if let Some(stream) = stream {
            write_frame(stream, KIND_WELCOME, 0, 0, table.as_slice())
                .map_err(|e| rendezvous_err(&format!("welcoming rank {peer}"), &e))?;
        }
    }
    Ok(())
}

fn worker_rendezvous(options: &SocketOptions, deadline: Instant, links: &mut [Option<Stream>]) -> Result<()> {
    let (rank, world) = (options.rank, options.world_size);
    let mut master = connect(&options.master, deadline)
        .map_err(|e| rendezvous_err(&format!("rank {rank} connecting to the master at {}", options.master), &e))?;
    // Listen where the others can reach us: the interface that reaches the master, or a
    // socket file next to the master's.
    let (listener, host) = match (&options.master, &master) {
        (Endpoint::Unix(path), _) => {
            let mut name = path.as_os_str().to_owned();
            name.push(format!(".rank{rank}"));
            (Listener::bind(&Endpoint::Unix(PathBuf::from(name))), None)
        }
        (Endpoint::Tcp(_), Stream::Tcp(s)) => {
            let ip = s.local_addr().map_err(|e| rendezvous_err("reading the local address", &e))?.ip();
            (Listener::bind(&Endpoint::Tcp(SocketAddr::new(ip, 0).to_string())), Some(ip))
        }
        (Endpoint::Tcp(_), Stream::Unix(_)) => unreachable!("a TCP endpoint yields a TCP stream"),
    };
    let listener = listener.map_err(|e| rendezvous_err(&format!("rank {rank} binding its listener"), &e))?;
    let advertised = listener.advertised(host).map_err(|e| rendezvous_err("reading the listener address", &e))?;

    let secret = options.secret.as_ref();
    handshake::connect(&mut master, secret, 0, world, KIND_HELLO, &hello_payload(rank, world, &advertised), deadline)?;
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(10));
    master.set_read_timeout(Some(left)).map_err(|e| rendezvous_err("configuring the master link", &e))?;
    let reply = read_control_frame(&mut master)
        .map_err(|e| rendezvous_err(&format!("rank {rank} waiting for the master's table of ranks"), &e))?;
    master.set_read_timeout(None).map_err(|e| rendezvous_err("configuring the master link", &e))?;
    let addrs = match reply.kind {
        KIND_WELCOME => {
            let mut d = Reader::new(&reply.payload, "table of ranks");
            let table_err = |e: WireError| TransportError::Rendezvous(format!("reading the table: {e}"));
            let n = d.usize().map_err(table_err)?;
            (0..n).map(|_| d.str()).collect::<std::result::Result<Vec<_>, _>>().map_err(table_err)?
        }
        KIND_REJECT => {
            return Err(TransportError::Rendezvous(format!(
                "rank 0 rejected rank {rank}: {}",
                String::from_utf8_lossy(&reply.payload)
            )));
        }
        other => return Err(TransportError::Rendezvous(format!("unexpected frame kind {other} from the master"))),
    };
    if addrs.len() != world {
        return Err(TransportError::Rendezvous(format!("master sent {} addresses for {world} ranks", addrs.len())));
    }
    links[0] = Some(master);

    for (peer, addr) in addrs.iter().enumerate().take(rank).skip(1) {
        let endpoint: Endpoint = addr.parse()?;
        let mut stream = connect(&endpoint, deadline)
            .map_err(|e| rendezvous_err(&format!("rank {rank} connecting to rank {peer}"), &e))?;
        handshake::connect(
            &mut stream,
            secret,
            peer,
            world,
            KIND_PEER_HELLO,
            &hello_payload(rank, world, ""),
            deadline,
        )?;
        links[peer] = Some(stream);
    }
    // The higher ranks connect here. Anything else that does (a port scanner, a stranger
    // without the secret, a duplicate) is dropped and logged; the group goes on.
    let mut expected = world - 1 - rank;
    while expected > 0 {
        let mut stream = listener
            .accept(deadline)
            .map_err(|e| rendezvous_err(&format!("rank {rank} waiting for {expected} higher rank(s)"), &e))?;
        let hello_deadline = deadline.min(Instant::now() + handshake::HELLO_DEADLINE);
        let why = match handshake::accept(&mut stream, secret, rank, world, hello_deadline)? {
            Opening::Hello { kind: KIND_PEER_HELLO, payload } => match parse_hello(&payload, world) {
                Ok(hello) if hello.rank > rank && links[hello.rank].is_none() => {
                    links[hello.rank] = Some(stream);
                    expected -= 1;
                    continue;
                }
                Ok(hello) => format!("a second or unexpected connection claiming rank {}", hello.rank),
                Err(reason) => reason,
            },
            Opening::Hello { kind, .. } => format!("opened with a frame of kind {kind}, not a peer's hello"),
            Opening::Dropped(why) => why,
        };
        tracing::warn!(rank, "dropped a connection that is not one of the group's ranks: {why}");
    }
    Ok(())
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
    use proptest::prelude::*;

    use super::*;

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
