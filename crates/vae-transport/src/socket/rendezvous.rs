//! Forming a group: rank 0 collects every rank's hello and sends back the table of addresses;
//! each rank then links to the lower ranks and accepts the higher ones. Every link opens with
//! [`super::handshake`].

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use super::handshake::{self, Opening};
use super::stream::{Listener, Stream, connect, read_control_frame, write_frame};
use super::{Endpoint, KIND_HELLO, KIND_PEER_HELLO, KIND_REJECT, KIND_WELCOME, PROTOCOL_VERSION, SocketOptions};
use crate::auth::GroupSecret;
use crate::wire::{Reader, WireError, Writer};
use crate::{Result, TransportError};

/// Identity every connection starts with: protocol, byte order, group size, rank.
pub(super) fn hello_payload(rank: usize, world: usize, addr: &str) -> Vec<u8> {
    let little_endian = u64::from(cfg!(target_endian = "little"));
    let mut hello = Writer::new();
    hello.u64(u64::from(PROTOCOL_VERSION)).u64(little_endian).usize(world).usize(rank).str(addr);
    hello.into_bytes()
}

pub(super) struct Hello {
    rank: usize,
    addr: String,
}

pub(super) fn parse_hello(payload: &[u8], world: usize) -> std::result::Result<Hello, String> {
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

pub(super) fn rendezvous_err(context: &str, e: &io::Error) -> TransportError {
    // A read timeout surfaces as EAGAIN ("Resource temporarily unavailable"): say what it means.
    if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) {
        return TransportError::Rendezvous(format!(
            "{context}: timed out (VAE_CONNECT_TIMEOUT_S sets how long the rendezvous waits)"
        ));
    }
    TransportError::Rendezvous(format!("{context}: {e}"))
}

pub(super) fn master_rendezvous(
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

pub(super) fn worker_rendezvous(
    options: &SocketOptions,
    deadline: Instant,
    links: &mut [Option<Stream>],
) -> Result<()> {
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
