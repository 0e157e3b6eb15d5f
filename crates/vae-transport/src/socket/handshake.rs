//! The opening of every socket link: the connecting rank's hello (rank, world size, address),
//! and, in a group with a secret, the mutual challenge–response of [`crate::auth`] around it.
//!
//! Each exchange has one deadline for the whole of it, so a peer that trickles bytes cannot hold
//! a rank past it. On the accepting side a connection that fails here is an [`Opening::Dropped`]
//! the caller logs and forgets, never a reason to fail the group: only a peer that proved it
//! holds the secret (or any peer, in a group without one) can make the group fail.

use std::io::{self, Read};
use std::time::{Duration, Instant};

use super::stream::{RawFrame, Stream, read_control_frame, write_frame};
use super::{KIND_AUTH_CHALLENGE, KIND_AUTH_RESPONSE, KIND_REJECT, PROTOCOL_VERSION};
use crate::auth::{self, GroupSecret, LEN};
use crate::{Result, TransportError};

/// The longest a joining connection may take to say who it is.
pub(super) const HELLO_DEADLINE: Duration = Duration::from_secs(3);

/// A stream whose reads all end by one deadline.
struct Deadlined<'a> {
    stream: &'a mut Stream,
    deadline: Instant,
}

impl Read for Deadlined<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "the peer took too long"));
        }
        self.stream.set_read_timeout(Some(left))?;
        self.stream.read(buf)
    }
}

/// One control frame, read entirely before `deadline`.
pub(super) fn read_frame_by(stream: &mut Stream, deadline: Instant) -> io::Result<RawFrame> {
    let frame = read_control_frame(&mut Deadlined { stream, deadline });
    stream.set_read_timeout(None)?;
    frame
}

/// How an accepted connection opened.
pub(super) enum Opening {
    /// The hello frame's kind and payload (the hello alone), from a peer that proved it holds
    /// the secret if the group has one.
    Hello {
        /// The frame kind (a rank's or a peer's hello, or anything else a stranger sent).
        kind: u8,
        /// The hello.
        payload: Vec<u8>,
    },
    /// Not a member: why, for the log.
    Dropped(String),
}

/// The accepting side, rank `me` of a group of `world`: answers the challenge (with a secret)
/// and reads the hello, all before `deadline`.
pub(super) fn accept(
    stream: &mut Stream,
    secret: Option<&GroupSecret>,
    me: usize,
    world: usize,
    deadline: Instant,
) -> Result<Opening> {
    let Some(secret) = secret else {
        // Without a secret, a Unix socket admits only processes of this rank's own user.
        if let (Some(peer), Some(own)) = (stream.peer_uid(), Stream::own_uid())
            && peer != own
        {
            return Ok(Opening::Dropped(format!("a process of user {peer}, not of this group's user {own}")));
        }
        return Ok(match read_frame_by(stream, deadline) {
            Ok(frame) => Opening::Hello { kind: frame.kind, payload: frame.payload.to_vec() },
            Err(e) => Opening::Dropped(e.to_string()),
        });
    };
    let challenge = match read_frame_by(stream, deadline) {
        Ok(f) if f.kind == KIND_AUTH_CHALLENGE && f.payload.len() == LEN => f,
        Ok(f) => return Ok(Opening::Dropped(format!("opened with a frame of kind {} instead of a challenge", f.kind))),
        Err(e) => return Ok(Opening::Dropped(e.to_string())),
    };
    let context = auth::context(PROTOCOL_VERSION, world, me);
    let own = auth::nonce()?;
    let tag = secret.tag(&auth::acceptor_parts(&context, &challenge.payload, &own));
    if write_frame(stream, KIND_AUTH_RESPONSE, 0, 0, &[own.as_slice(), &tag].concat()).is_err() {
        return Ok(Opening::Dropped("closed before the answer".into()));
    }
    let hello = match read_frame_by(stream, deadline) {
        Ok(f) if f.payload.len() >= LEN => f,
        Ok(_) => return Ok(Opening::Dropped("a hello without a proof".into())),
        Err(e) => return Ok(Opening::Dropped(e.to_string())),
    };
    let split = hello.payload.len() - LEN;
    let proof = hello.payload[split..].to_vec();
    let parts = auth::connector_parts(&context, &own, &challenge.payload, &hello.payload[..split]);
    if !secret.verify(&parts, &proof) {
        let _ = write_frame(stream, KIND_REJECT, 0, 0, b"not a member of this group (wrong secret or world size)");
        return Ok(Opening::Dropped("its hello does not prove it holds the group secret".into()));
    }
    Ok(Opening::Hello { kind: hello.kind, payload: hello.payload[..split].to_vec() })
}

/// The connecting side: proves itself to rank `peer` (and checks that `peer` holds the secret
/// too) and says hello, before `deadline`.
#[allow(clippy::too_many_arguments)] // the link's two ends, its group and its hello
pub(super) fn connect(
    stream: &mut Stream,
    secret: Option<&GroupSecret>,
    peer: usize,
    world: usize,
    hello_kind: u8,
    hello: &[u8],
    deadline: Instant,
) -> Result<()> {
    let failed =
        |what: &str, e: &dyn std::fmt::Display| TransportError::Rendezvous(format!("rank {peer}'s link, {what}: {e}"));
    let Some(secret) = secret else {
        return write_frame(stream, hello_kind, 0, 0, hello).map_err(|e| failed("saying hello", &e));
    };
    let own = auth::nonce()?;
    write_frame(stream, KIND_AUTH_CHALLENGE, 0, 0, &own).map_err(|e| failed("sending the challenge", &e))?;
    let answer = read_frame_by(stream, deadline).map_err(|e| failed("waiting for the answer", &e))?;
    if answer.kind == KIND_REJECT {
        let reason = String::from_utf8_lossy(&answer.payload).into_owned();
        return Err(failed("rejected", &reason));
    }
    if answer.kind != KIND_AUTH_RESPONSE || answer.payload.len() != 2 * LEN {
        return Err(failed("the answer", &format!("a frame of kind {} instead", answer.kind)));
    }
    let (theirs, tag) = answer.payload.split_at(LEN);
    let context = auth::context(PROTOCOL_VERSION, world, peer);
    if !secret.verify(&auth::acceptor_parts(&context, &own, theirs), tag) {
        return Err(failed(
            "the answer",
            &"the peer does not hold this group's secret (or runs with another world size)",
        ));
    }
    let proof = secret.tag(&auth::connector_parts(&context, theirs, &own, hello));
    write_frame(stream, hello_kind, 0, 0, &[hello, proof.as_slice()].concat()).map_err(|e| failed("saying hello", &e))
}
