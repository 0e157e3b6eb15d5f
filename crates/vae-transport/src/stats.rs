//! Traffic counters, for the per-request reports.

use std::sync::atomic::{AtomicU64, Ordering};

/// Counters of one kind of operation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpStats {
    /// Number of calls.
    pub calls: u64,
    /// Payload bytes this rank sent (counted once per destination).
    pub bytes_sent: u64,
    /// Payload bytes this rank received.
    pub bytes_received: u64,
}

/// Traffic of one rank, by operation kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommStats {
    /// `all_gather` calls.
    pub all_gather: OpStats,
    /// `gather` calls.
    pub gather: OpStats,
    /// `broadcast` calls.
    pub broadcast: OpStats,
    /// `all_reduce` calls.
    pub all_reduce: OpStats,
    /// Paired exchanges.
    pub exchange: OpStats,
    /// Barriers.
    pub barrier: OpStats,
}

impl CommStats {
    /// The counters by name, in a fixed order.
    pub fn by_kind(&self) -> [(&'static str, OpStats); 6] {
        [
            ("all_gather", self.all_gather),
            ("gather", self.gather),
            ("broadcast", self.broadcast),
            ("all_reduce", self.all_reduce),
            ("exchange", self.exchange),
            ("barrier", self.barrier),
        ]
    }

    /// Total bytes sent.
    pub fn bytes_sent(&self) -> u64 {
        self.by_kind().iter().map(|(_, s)| s.bytes_sent).sum()
    }

    /// Total bytes received.
    pub fn bytes_received(&self) -> u64 {
        self.by_kind().iter().map(|(_, s)| s.bytes_received).sum()
    }

    /// Counters accumulated since `earlier` (a snapshot of the same communicator).
    pub fn since(&self, earlier: &CommStats) -> CommStats {
        let d = |a: OpStats, b: OpStats| OpStats {
            calls: a.calls.saturating_sub(b.calls),
            bytes_sent: a.bytes_sent.saturating_sub(b.bytes_sent),
            bytes_received: a.bytes_received.saturating_sub(b.bytes_received),
        };
        CommStats {
            all_gather: d(self.all_gather, earlier.all_gather),
            gather: d(self.gather, earlier.gather),
            broadcast: d(self.broadcast, earlier.broadcast),
            all_reduce: d(self.all_reduce, earlier.all_reduce),
            exchange: d(self.exchange, earlier.exchange),
            barrier: d(self.barrier, earlier.barrier),
        }
    }
}

/// Live counters of one op kind.
#[derive(Debug, Default)]
pub(crate) struct OpCounters {
    calls: AtomicU64,
    sent: AtomicU64,
    received: AtomicU64,
}

impl OpCounters {
    pub(crate) fn record(&self, sent: usize, received: usize) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.sent.fetch_add(sent as u64, Ordering::Relaxed);
        self.received.fetch_add(received as u64, Ordering::Relaxed);
    }

    fn snapshot(&self) -> OpStats {
        OpStats {
            calls: self.calls.load(Ordering::Relaxed),
            bytes_sent: self.sent.load(Ordering::Relaxed),
            bytes_received: self.received.load(Ordering::Relaxed),
        }
    }
}

/// Live counters of a communicator.
#[derive(Debug, Default)]
pub(crate) struct StatsCounters {
    pub(crate) all_gather: OpCounters,
    pub(crate) gather: OpCounters,
    pub(crate) broadcast: OpCounters,
    pub(crate) all_reduce: OpCounters,
    pub(crate) exchange: OpCounters,
    pub(crate) barrier: OpCounters,
}

impl StatsCounters {
    pub(crate) fn snapshot(&self) -> CommStats {
        CommStats {
            all_gather: self.all_gather.snapshot(),
            gather: self.gather.snapshot(),
            broadcast: self.broadcast.snapshot(),
            all_reduce: self.all_reduce.snapshot(),
            exchange: self.exchange.snapshot(),
            barrier: self.barrier.snapshot(),
        }
    }
}
