//! The byte level of the socket backend: a stream of either family (TCP, Unix), listeners,
//! connecting with retries, and the framing every message travels in.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Endpoint, HEADER_LEN, MAGIC, MAX_CONTROL_PAYLOAD, MAX_PAYLOAD, RECEIVE_STEP};
use crate::mesh::OpKind;
use crate::pool::{BufferPool, PooledBuf};

/// A connected stream of either family.
#[derive(Debug)]
pub(super) enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    /// The user id of the process at the other end of a Unix socket (Linux `SO_PEERCRED`);
    /// `None` for TCP or where the system cannot tell.
    pub(super) fn peer_uid(&self) -> Option<u32> {
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
    pub(super) fn own_uid() -> Option<u32> {
        #[cfg(target_os = "linux")]
        {
            // SAFETY: `geteuid` takes nothing and cannot fail.
            return Some(unsafe { libc::geteuid() });
        }
        #[allow(unreachable_code)]
        None
    }

    pub(super) fn try_clone(&self) -> io::Result<Self> {
        Ok(match self {
            Self::Tcp(s) => Self::Tcp(s.try_clone()?),
            Self::Unix(s) => Self::Unix(s.try_clone()?),
        })
    }

    pub(super) fn set_read_timeout(&self, d: Option<Duration>) -> io::Result<()> {
        match self {
            Self::Tcp(s) => s.set_read_timeout(d),
            Self::Unix(s) => s.set_read_timeout(d),
        }
    }

    pub(super) fn set_write_timeout(&self, d: Option<Duration>) -> io::Result<()> {
        match self {
            Self::Tcp(s) => s.set_write_timeout(d),
            Self::Unix(s) => s.set_write_timeout(d),
        }
    }

    pub(super) fn shutdown(&self) {
        let _ = match self {
            Self::Tcp(s) => s.shutdown(std::net::Shutdown::Both),
            Self::Unix(s) => s.shutdown(std::net::Shutdown::Both),
        };
    }

    pub(super) fn prepare(&self) -> io::Result<()> {
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

pub(super) enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener, PathBuf),
}

impl Listener {
    pub(super) fn bind(endpoint: &Endpoint) -> io::Result<Self> {
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

    pub(super) fn advertised(&self, tcp_host: Option<std::net::IpAddr>) -> io::Result<String> {
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
    pub(super) fn accept(&self, deadline: Instant) -> io::Result<Stream> {
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
pub(super) fn connect(endpoint: &Endpoint, deadline: Instant) -> io::Result<Stream> {
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

pub(super) fn write_frame(stream: &mut Stream, kind: u8, seq: u64, tag: u64, payload: &[u8]) -> io::Result<()> {
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

pub(super) struct RawFrame {
    pub(super) kind: u8,
    pub(super) seq: u64,
    pub(super) tag: u64,
    pub(super) payload: PooledBuf,
}

pub(super) fn read_frame(stream: &mut impl Read, buffers: &Arc<BufferPool>) -> io::Result<RawFrame> {
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
pub(super) fn read_control_frame(stream: &mut impl Read) -> io::Result<RawFrame> {
    read_frame(stream, &Arc::default())
}
