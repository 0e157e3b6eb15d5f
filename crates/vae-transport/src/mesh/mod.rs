//! The message engine both CPU backends share.
//!
//! Every rank owns an [`Inbox`] with one queue per peer. A backend only has to move frames
//! into the right inbox (the local backend pushes directly, the socket backend through a
//! reader thread per connection) and report peers that fail or leave; the collectives, the
//! sequence checks, the deadlines and the poisoning live here, once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod inbox;

pub(crate) use inbox::Inbox;

use crate::pool::PooledBuf;
use crate::stats::StatsCounters;
use crate::{ByteBuf, CommStats, DataType, PeerExchange, ReduceOp, Result, TransportConfig, TransportError};

/// Kind of a data frame. The numeric values are part of the socket wire format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum OpKind {
    AllGather = 1,
    Gather = 2,
    Broadcast = 3,
    AllReduce = 4,
    Barrier = 5,
    Exchange = 6,
}

impl OpKind {
    pub(crate) fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => Self::AllGather,
            2 => Self::Gather,
            3 => Self::Broadcast,
            4 => Self::AllReduce,
            5 => Self::Barrier,
            6 => Self::Exchange,
            _ => return None,
        })
    }

    fn name(self) -> &'static str {
        match self {
            Self::AllGather => "all_gather",
            Self::Gather => "gather",
            Self::Broadcast => "broadcast",
            Self::AllReduce => "all_reduce",
            Self::Barrier => "barrier",
            Self::Exchange => "exchange",
        }
    }
}

/// How long a failed send waits to learn why the peer is unreachable.
const SEND_FAILURE_GRACE: Duration = Duration::from_millis(250);

/// What a frame claims to be part of: checked against what the receiver is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub kind: OpKind,
    /// Group-wide collective counter, or the per-pair counter for exchanges.
    pub seq: u64,
    /// Kind-specific agreement: element type, root, reduce op.
    pub tag: u64,
}

impl Header {
    fn tag_for(dtype: DataType, root: usize, op: Option<ReduceOp>) -> u64 {
        (dtype as u64) | ((op.map_or(0, |o| o as u64)) << 8) | ((root as u64) << 16)
    }

    fn describe(&self) -> String {
        let dtype = DataType::from_u8((self.tag & 0xff) as u8).map_or_else(|| "?".to_string(), |d| d.to_string());
        let op = match (self.tag >> 8) & 0xff {
            1 => ", sum",
            2 => ", max",
            _ => "",
        };
        let root = match self.kind {
            OpKind::Gather | OpKind::Broadcast => format!(", root {}", self.tag >> 16),
            _ => String::new(),
        };
        format!("{}#{}({dtype}{op}{root})", self.kind.name(), self.seq)
    }
}

/// Shared payload: one copy out of the sender serves every receiver of a local collective.
pub(crate) type Payload = Arc<PooledBuf>;

/// A data frame in an inbox.
#[derive(Debug)]
pub(crate) struct Frame {
    pub header: Header,
    pub payload: Payload,
}

/// The operation a rank is in, and until when it may wait.
#[derive(Debug, Clone, Copy)]
pub(crate) struct OpClock {
    op: &'static str,
    started: Instant,
    deadline: Instant,
    /// How long a wait on a live peer goes on once the group is known to have failed.
    failure_grace: Duration,
}

/// How a backend moves frames to other ranks.
pub(crate) trait Wire: Send + Sync {
    /// Delivers one frame to the inbox of every rank in `to` (possibly through sockets). The
    /// local backend copies `payload` once and shares it; the socket backend writes it as is.
    fn send(&self, to: &[usize], header: Header, payload: &[u8]) -> Result<()>;
    /// Best effort: tell every peer that `failed_rank` (this rank, or the rank whose failure
    /// made this one give up) failed for `reason`.
    fn announce_failure(&self, failed_rank: usize, reason: &str);
    /// Best effort: tell every peer this rank leaves cleanly.
    fn announce_departure(&self);
    /// The group's shared mailbox, when its ranks share this process.
    fn mailbox(&self) -> Option<&crate::Mailbox> {
        None
    }
}

#[derive(Debug)]
struct Sequence {
    collective: u64,
    /// Per-peer exchange counters, made on first use (exchanges are between neighbours).
    exchange_sent: HashMap<usize, u64>,
    exchange_received: HashMap<usize, u64>,
}

/// A communicator over any [`Wire`].
pub(crate) struct MeshComm<W: Wire> {
    rank: usize,
    size: usize,
    backend: &'static str,
    wire: W,
    inbox: Arc<Inbox>,
    config: TransportConfig,
    /// Held for the whole of an operation: calls from several threads are serialised.
    sequence: Mutex<Sequence>,
    poisoned: Mutex<Option<TransportError>>,
    left: AtomicBool,
    stats: StatsCounters,
}

impl<W: Wire> MeshComm<W> {
    pub(crate) fn new(
        rank: usize,
        size: usize,
        backend: &'static str,
        wire: W,
        inbox: Arc<Inbox>,
        config: TransportConfig,
    ) -> Self {
        Self {
            rank,
            size,
            backend,
            wire,
            inbox,
            config,
            sequence: Mutex::new(Sequence {
                collective: 0,
                exchange_sent: HashMap::new(),
                exchange_received: HashMap::new(),
            }),
            poisoned: Mutex::new(None),
            left: AtomicBool::new(false),
            stats: StatsCounters::default(),
        }
    }

    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    pub(crate) fn size(&self) -> usize {
        self.size
    }

    pub(crate) fn mailbox(&self) -> Option<&crate::Mailbox> {
        self.wire.mailbox()
    }

    pub(crate) fn backend(&self) -> &'static str {
        self.backend
    }

    /// The failure this rank knows of, without waiting: its own first error, or the first
    /// failure a peer reported.
    pub(crate) fn failure(&self) -> Option<TransportError> {
        if let Some(first) = self.poisoned.lock().unwrap_or_else(|e| e.into_inner()).clone() {
            return Some(first);
        }
        self.inbox.group_failure().map(|(rank, reason)| TransportError::PeerFailed { rank, reason })
    }

    pub(crate) fn stats(&self) -> CommStats {
        self.stats.snapshot()
    }

    pub(crate) fn wire(&self) -> &W {
        &self.wire
    }

    fn others(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.size).filter(move |&r| r != self.rank)
    }

    fn other_ranks(&self) -> Vec<usize> {
        self.others().collect()
    }

    /// Runs one operation: refuses if poisoned, serialises, poisons on failure.
    fn run<R>(&self, op: &'static str, body: impl FnOnce(&mut Sequence, &OpClock) -> Result<R>) -> Result<R> {
        if let Some(first) = self.poisoned.lock().unwrap_or_else(|e| e.into_inner()).clone() {
            return Err(TransportError::Poisoned(Box::new(first)));
        }
        let mut seq = self.sequence.lock().unwrap_or_else(|e| e.into_inner());
        let started = Instant::now();
        let clock = OpClock {
            op,
            started,
            deadline: started + self.config.collective_timeout,
            failure_grace: (self.config.failure_timeout / 5).max(Duration::from_millis(50)),
        };
        // No check for a known failure here: an operation whose frames all arrived before the
        // failure (the failed rank did its part) completes; one that must wait for a missing
        // frame fails in `Inbox::wait`, and one that only sends fails in `sent_only`.
        let result = body(&mut seq, &clock);
        drop(seq);
        if let Err(err) = &result {
            tracing::debug!(rank = self.rank, op, error = %err, "collective failed");
            self.poison(err.clone());
        }
        result
    }

    /// Records the first failure and, unless every rank already knows, tells the others.
    fn poison(&self, err: TransportError) {
        let mut slot = self.poisoned.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_some() {
            return;
        }
        let (rank, reason) = blame(&err, self.rank);
        *slot = Some(err);
        drop(slot);
        // Passed on even when this rank only heard of it: a failure one link saw (missed
        // heartbeats) may be news to the others.
        self.wire.announce_failure(rank, &reason);
    }

    pub(crate) fn abort(&self, reason: &str) {
        let err = TransportError::Aborted { rank: self.rank, reason: reason.to_string() };
        let mut slot = self.poisoned.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_some() {
            return;
        }
        *slot = Some(err);
        drop(slot);
        tracing::debug!(rank = self.rank, reason, "aborting the group");
        // Wake this rank's own waits too (abort may come from another thread).
        self.inbox.own_failure(self.rank, reason.to_string());
        self.wire.announce_failure(self.rank, reason);
    }

    /// Leaves the group: a failure if unwinding from a panic, a clean departure otherwise.
    /// Idempotent; backends call it from `Drop`.
    pub(crate) fn leave(&self) {
        if self.left.swap(true, Ordering::SeqCst) {
            return;
        }
        if std::thread::panicking() {
            self.abort(&format!("rank {} panicked", self.rank));
            return;
        }
        match self.failure() {
            None => self.wire.announce_departure(),
            // Leaving after a failure, this rank's own or one it heard of: repeat who failed
            // first, so that a peer that has not heard of it yet (one waiting for this rank
            // alone, say) blames the right rank rather than this departure.
            Some(err) => {
                let (rank, reason) = blame(&err, self.rank);
                self.wire.announce_failure(rank, &reason);
            }
        }
    }

    fn send_to(&self, to: &[usize], header: Header, payload: &[u8]) -> Result<()> {
        if to.is_empty() {
            return Ok(());
        }
        self.wire.send(to, header, payload).map_err(|err| {
            let explained = match &err {
                TransportError::Io { rank: Some(peer), .. } => {
                    self.inbox.why_unreachable(self.rank, *peer, header.kind.name(), SEND_FAILURE_GRACE)
                }
                _ => None,
            };
            explained.unwrap_or(err)
        })
    }

    /// The next frame from `from`, which must be `expected`. For a collective, queued frames of
    /// earlier collectives are stale; for an exchange, those of every collective started so far
    /// (`collectives_started`).
    fn recv_from(&self, from: usize, expected: Header, collectives_started: u64, clock: &OpClock) -> Result<Frame> {
        let stale_below = if expected.kind == OpKind::Exchange { collectives_started } else { expected.seq };
        let frame = self.inbox.wait(self.rank, from, expected, stale_below, clock)?;
        if frame.header != expected {
            return Err(TransportError::CollectiveMismatch {
                local_rank: self.rank,
                rank: from,
                local: expected.describe(),
                remote: frame.header.describe(),
            });
        }
        Ok(frame)
    }

    /// The end of an operation that received nothing: it must still not succeed once the
    /// group is known to have failed (its peers will never use what it sent).
    fn sent_only(&self) -> Result<()> {
        match self.inbox.group_failure() {
            Some((rank, reason)) => Err(TransportError::PeerFailed { rank, reason }),
            None => Ok(()),
        }
    }

    fn check_rank(&self, what: &str, r: usize) -> Result<()> {
        if r >= self.size {
            return Err(TransportError::InvalidArgument(format!(
                "{what} {r} is not a rank of a group of {}",
                self.size
            )));
        }
        Ok(())
    }

    pub(crate) fn all_gather_bytes(&self, dtype: DataType, send: &[u8], recv: &mut dyn ByteBuf) -> Result<Vec<usize>> {
        const OP: &str = "all_gather";
        self.run(OP, |seq, clock| {
            let tag = Header::tag_for(dtype, 0, None);
            let header = Header { kind: OpKind::AllGather, seq: next(&mut seq.collective), tag };
            self.send_to(&self.other_ranks(), header, send)?;
            let parts = self.receive_from_all(header, clock)?;
            let counts = concat_into(recv, send, &parts)?;
            let received = counts.iter().sum::<usize>() - send.len();
            self.stats.all_gather.record(send.len() * (self.size - 1), received);
            Ok(counts)
        })
    }

    pub(crate) fn gather_bytes(
        &self,
        root: usize,
        dtype: DataType,
        send: &[u8],
        recv: &mut dyn ByteBuf,
    ) -> Result<Option<Vec<usize>>> {
        const OP: &str = "gather";
        self.run(OP, |seq, clock| {
            self.check_rank("gather root", root)?;
            let tag = Header::tag_for(dtype, root, None);
            let header = Header { kind: OpKind::Gather, seq: next(&mut seq.collective), tag };
            if self.rank != root {
                self.send_to(&[root], header, send)?;
                self.stats.gather.record(send.len(), 0);
                return self.sent_only().map(|()| None);
            }
            let parts = self.receive_from_all(header, clock)?;
            let counts = concat_into(recv, send, &parts)?;
            self.stats.gather.record(0, counts.iter().sum::<usize>() - send.len());
            Ok(Some(counts))
        })
    }

    /// One frame from every other rank (`None` in this rank's own slot).
    fn receive_from_all(&self, header: Header, clock: &OpClock) -> Result<Vec<Option<Payload>>> {
        let mut parts: Vec<Option<Payload>> = vec![None; self.size];
        for peer in self.others() {
            parts[peer] = Some(self.recv_from(peer, header, header.seq, clock)?.payload);
        }
        Ok(parts)
    }

    pub(crate) fn broadcast_bytes(&self, root: usize, dtype: DataType, buf: &mut dyn ByteBuf) -> Result<()> {
        const OP: &str = "broadcast";
        self.run(OP, |seq, clock| {
            self.check_rank("broadcast root", root)?;
            let header = Header {
                kind: OpKind::Broadcast,
                seq: next(&mut seq.collective),
                tag: Header::tag_for(dtype, root, None),
            };
            if self.rank == root {
                let bytes = buf.as_bytes();
                self.send_to(&self.other_ranks(), header, bytes)?;
                self.stats.broadcast.record(bytes.len() * (self.size - 1), 0);
                self.sent_only()?;
            } else {
                let frame = self.recv_from(root, header, header.seq, clock)?;
                buf.assign_concat(&[&frame.payload[..]])?;
                self.stats.broadcast.record(0, frame.payload.len());
            }
            Ok(())
        })
    }

    pub(crate) fn all_reduce_bytes(&self, dtype: DataType, op: ReduceOp, buf: &mut [u8]) -> Result<()> {
        const OP: &str = "all_reduce";
        self.run(OP, |seq, clock| {
            if !buf.len().is_multiple_of(dtype.size_in_bytes()) {
                return Err(TransportError::InvalidArgument(format!(
                    "all_reduce buffer of {} bytes is not a whole number of {dtype} elements",
                    buf.len()
                )));
            }
            let header = Header {
                kind: OpKind::AllReduce,
                seq: next(&mut seq.collective),
                tag: Header::tag_for(dtype, 0, Some(op)),
            };
            if self.size == 1 {
                self.stats.all_reduce.record(0, 0);
                return Ok(());
            }
            self.send_to(&self.other_ranks(), header, buf)?;
            let own = buf.to_vec();
            let mut parts: Vec<Option<Payload>> = vec![None; self.size];
            for peer in self.others() {
                let frame = self.recv_from(peer, header, header.seq, clock)?;
                if frame.payload.len() != buf.len() {
                    return Err(TransportError::LengthMismatch {
                        op: OP,
                        local_rank: self.rank,
                        local: buf.len(),
                        rank: peer,
                        remote: frame.payload.len(),
                    });
                }
                parts[peer] = Some(frame.payload);
            }
            // Reduce in rank order on every rank, so float results are identical everywhere.
            let ordered: Vec<&[u8]> =
                (0..self.size).map(|r| parts[r].as_deref().map_or(own.as_slice(), |p| &p[..])).collect();
            reduce_into(dtype, op, &ordered, buf);
            self.stats.all_reduce.record(buf.len() * (self.size - 1), buf.len() * (self.size - 1));
            Ok(())
        })
    }

    pub(crate) fn exchange_bytes(&self, dtype: DataType, legs: &mut [PeerExchange<'_>]) -> Result<()> {
        const OP: &str = "exchange";
        self.run(OP, |seq, clock| {
            for (i, leg) in legs.iter().enumerate() {
                self.check_rank("exchange peer", leg.peer)?;
                if leg.peer == self.rank {
                    return Err(TransportError::InvalidArgument(format!(
                        "rank {} cannot exchange with itself",
                        self.rank
                    )));
                }
                if legs[..i].iter().any(|l| l.peer == leg.peer) {
                    return Err(TransportError::InvalidArgument(format!(
                        "peer {} listed twice in one exchange",
                        leg.peer
                    )));
                }
            }
            let tag = Header::tag_for(dtype, 0, None);
            let mut sent = 0;
            for leg in legs.iter() {
                let header =
                    Header { kind: OpKind::Exchange, seq: next(seq.exchange_sent.entry(leg.peer).or_default()), tag };
                self.send_to(&[leg.peer], header, leg.send)?;
                sent += leg.send.len();
            }
            let mut received = 0;
            for leg in legs.iter_mut() {
                let header = Header {
                    kind: OpKind::Exchange,
                    seq: next(seq.exchange_received.entry(leg.peer).or_default()),
                    tag,
                };
                let frame = self.recv_from(leg.peer, header, seq.collective, clock)?;
                leg.recv.assign_concat(&[&frame.payload[..]])?;
                received += frame.payload.len();
            }
            self.stats.exchange.record(sent, received);
            Ok(())
        })
    }

    pub(crate) fn barrier(&self) -> Result<()> {
        const OP: &str = "barrier";
        self.run(OP, |seq, clock| {
            let header = Header { kind: OpKind::Barrier, seq: next(&mut seq.collective), tag: 0 };
            self.send_to(&self.other_ranks(), header, &[])?;
            for peer in self.others() {
                self.recv_from(peer, header, header.seq, clock)?;
            }
            self.stats.barrier.record(0, 0);
            Ok(())
        })
    }
}

impl<W: Wire> Drop for MeshComm<W> {
    fn drop(&mut self) {
        self.leave();
    }
}

/// Writes `own` (in the empty slot) and the received parts, in rank order, into `recv`;
/// returns the byte count per rank.
fn concat_into(recv: &mut dyn ByteBuf, own: &[u8], parts: &[Option<Payload>]) -> Result<Vec<usize>> {
    let slices: Vec<&[u8]> = parts.iter().map(|p| p.as_deref().map_or(own, |v| &v[..])).collect();
    recv.assign_concat(&slices)?;
    Ok(slices.iter().map(|s| s.len()).collect())
}

/// Whom to name when passing a failure on, and why: the rank that failed first where the error
/// names one (a dead, silent or departed peer), else this rank.
fn blame(err: &TransportError, me: usize) -> (usize, String) {
    match err.root_cause() {
        TransportError::PeerFailed { rank, reason } => (*rank, reason.clone()),
        other => (other.failed_rank().unwrap_or(me), other.to_string()),
    }
}

fn next(counter: &mut u64) -> u64 {
    let v = *counter;
    *counter += 1;
    v
}

/// Element-wise reduction of `parts` (all of `out.len()` bytes) into `out`, in slice order.
pub(crate) fn reduce_into(dtype: DataType, op: ReduceOp, parts: &[&[u8]], out: &mut [u8]) {
    macro_rules! reduce {
        ($t:ty, $sum:expr, $max:expr) => {{
            const N: usize = std::mem::size_of::<$t>();
            let read = |bytes: &[u8], i: usize| {
                <$t>::from_ne_bytes(bytes[i * N..(i + 1) * N].try_into().expect("length checked"))
            };
            let combine: fn($t, $t) -> $t = match op {
                ReduceOp::Sum => $sum,
                ReduceOp::Max => $max,
            };
            for i in 0..out.len() / N {
                let mut acc = read(parts[0], i);
                for part in &parts[1..] {
                    acc = combine(acc, read(part, i));
                }
                out[i * N..(i + 1) * N].copy_from_slice(&acc.to_ne_bytes());
            }
        }};
    }
    match dtype {
        DataType::U8 => reduce!(u8, |a, b| a.wrapping_add(b), |a, b| a.max(b)),
        DataType::I64 => reduce!(i64, |a, b| a.wrapping_add(b), |a, b| a.max(b)),
        DataType::U64 => reduce!(u64, |a, b| a.wrapping_add(b), |a, b| a.max(b)),
        DataType::F32 => reduce!(f32, |a, b| a + b, f32::max),
        DataType::F64 => reduce!(f64, |a, b| a + b, f64::max),
    }
}

/// Implements [`crate::Communicator`] for a backend type holding a `MeshComm` in `inner`.
macro_rules! delegate_communicator {
    ($ty:ty) => {
        impl $crate::Communicator for $ty {
            fn rank(&self) -> usize {
                self.inner.rank()
            }
            fn size(&self) -> usize {
                self.inner.size()
            }
            fn backend(&self) -> &'static str {
                self.inner.backend()
            }
            fn all_gather_bytes(
                &self,
                dtype: $crate::DataType,
                send: &[u8],
                recv: &mut dyn $crate::ByteBuf,
            ) -> $crate::Result<Vec<usize>> {
                self.inner.all_gather_bytes(dtype, send, recv)
            }
            fn gather_bytes(
                &self,
                root: usize,
                dtype: $crate::DataType,
                send: &[u8],
                recv: &mut dyn $crate::ByteBuf,
            ) -> $crate::Result<Option<Vec<usize>>> {
                self.inner.gather_bytes(root, dtype, send, recv)
            }
            fn broadcast_bytes(
                &self,
                root: usize,
                dtype: $crate::DataType,
                buf: &mut dyn $crate::ByteBuf,
            ) -> $crate::Result<()> {
                self.inner.broadcast_bytes(root, dtype, buf)
            }
            fn all_reduce_bytes(
                &self,
                dtype: $crate::DataType,
                op: $crate::ReduceOp,
                buf: &mut [u8],
            ) -> $crate::Result<()> {
                self.inner.all_reduce_bytes(dtype, op, buf)
            }
            fn exchange_bytes(
                &self,
                dtype: $crate::DataType,
                legs: &mut [$crate::PeerExchange<'_>],
            ) -> $crate::Result<()> {
                self.inner.exchange_bytes(dtype, legs)
            }
            fn barrier(&self) -> $crate::Result<()> {
                self.inner.barrier()
            }
            fn abort(&self, reason: &str) {
                self.inner.abort(reason)
            }
            fn stats(&self) -> $crate::CommStats {
                self.inner.stats()
            }
            fn mailbox(&self) -> Option<&$crate::Mailbox> {
                self.inner.mailbox()
            }
            fn failure(&self) -> Option<$crate::TransportError> {
                self.inner.failure()
            }
        }
    };
}
pub(crate) use delegate_communicator;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reduce_is_in_rank_order() {
        // 1e8 + 1 - 1e8 in f32 depends on order; every rank must compute the same order.
        let a = 1.0e8f32.to_ne_bytes();
        let b = 1.0f32.to_ne_bytes();
        let c = (-1.0e8f32).to_ne_bytes();
        let mut out = [0u8; 4];
        reduce_into(DataType::F32, ReduceOp::Sum, &[&a, &b, &c], &mut out);
        assert_eq!(f32::from_ne_bytes(out), (1.0e8f32 + 1.0) + -1.0e8);
    }

    #[test]
    fn header_description_names_kind_type_and_root() {
        let h = Header { kind: OpKind::Broadcast, seq: 3, tag: Header::tag_for(DataType::F32, 2, None) };
        assert_eq!(h.describe(), "broadcast#3(f32, root 2)");
        let h = Header { kind: OpKind::AllReduce, seq: 0, tag: Header::tag_for(DataType::I64, 0, Some(ReduceOp::Max)) };
        assert_eq!(h.describe(), "all_reduce#0(i64, max)");
    }

    /// The clock of an operation `op` starting now, with `timeout` and a 1 s failure grace.
    fn test_clock(op: &'static str, timeout: Duration) -> OpClock {
        let started = Instant::now();
        OpClock { op, started, deadline: started + timeout, failure_grace: Duration::from_secs(1) }
    }

    #[test]
    fn a_stale_collective_frame_is_a_mismatch_not_a_hang() {
        // Rank 2 sent a gather to this rank that this rank did not expect (it thought another
        // rank was the root); this rank is now in collective #1.
        let inbox = Inbox::new(3);
        let stale = Header { kind: OpKind::Gather, seq: 0, tag: Header::tag_for(DataType::U8, 1, None) };
        inbox.deliver(2, Frame { header: stale, payload: Payload::default() });
        let expected = Header { kind: OpKind::Broadcast, seq: 1, tag: 0 };
        let clock = test_clock("broadcast", Duration::from_secs(30));
        let start = clock.started;
        let err = inbox.wait(1, 0, expected, 1, &clock).unwrap_err();
        assert!(matches!(err, TransportError::CollectiveMismatch { rank: 2, .. }), "{err}");
        assert!(start.elapsed() < Duration::from_secs(1));
    }

    #[test]
    fn inbox_times_out_and_names_the_peer() {
        let inbox = Inbox::new(2);
        let expected = Header { kind: OpKind::Barrier, seq: 0, tag: 0 };
        let clock = test_clock("barrier", Duration::from_millis(20));
        let err = inbox.wait(0, 1, expected, 0, &clock).unwrap_err();
        assert!(matches!(err, TransportError::Timeout { rank: 1, waiting: 0, op: "barrier", .. }), "{err}");
    }
}
