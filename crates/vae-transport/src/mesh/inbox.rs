//! A rank's receiving side: one FIFO per peer, the peers' status, the group's first failure, and
//! the waits on them with their deadlines and stale-frame checks.

use std::collections::{HashMap, VecDeque};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{Frame, Header, OpClock, OpKind};
use crate::{Result, TransportError};

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum PeerStatus {
    Alive,
    Left,
    /// Dead, or gave up after a failure: it will send nothing more.
    Failed,
}

#[derive(Debug)]
pub(super) struct InboxState {
    /// One FIFO per peer: two ranks that run the same program do the operations that involve
    /// both of them in the same order, so the next frame from a peer must be the one expected.
    /// Made on a peer's first frame: most ranks only ever hear from the owner and their
    /// neighbours, and N ranks of one process must not hold N² queues.
    queues: HashMap<usize, VecDeque<Frame>>,
    status: Vec<PeerStatus>,
    /// The first failure of any rank this rank has heard of, and when it heard.
    group_failure: Option<(usize, String)>,
    failure_seen: Option<Instant>,
    /// The wait in progress: the peer it waits on and its `stale_below`. A delivery wakes the
    /// waiter only when it is that peer's frame or a stale one, not for every frame of an
    /// all_gather (N wake-ups of N ranks).
    waiting: Option<(usize, u64)>,
    /// Every queue front was checked for staleness against this `stale_below`...
    checked_below: u64,
    /// ...except the fronts of these queues, which changed since.
    unchecked: Vec<usize>,
}

impl InboxState {
    /// Whether the wait in progress (if any) is on `peer`.
    fn is_waiting_on(&self, peer: usize) -> bool {
        self.waiting.is_some_and(|(p, _)| p == peer)
    }

    /// The first queue (lowest rank) whose front is a collective frame older than
    /// `stale_below`. Checks only the fronts that changed since the last check against the same
    /// `stale_below`, so a rank waiting on N peers in turn does O(N) checks, not O(N²).
    fn stale_front(&mut self, stale_below: u64) -> Option<usize> {
        let is_stale = |q: &VecDeque<Frame>| {
            q.front().is_some_and(|f| f.header.kind != OpKind::Exchange && f.header.seq < stale_below)
        };
        if self.checked_below != stale_below {
            self.checked_below = stale_below;
            self.unchecked.clear();
            return self.queues.iter().filter(|(_, q)| is_stale(q)).map(|(peer, _)| *peer).min();
        }
        let queues = &self.queues;
        let found = self.unchecked.iter().copied().filter(|q| queues.get(q).is_some_and(is_stale)).min();
        self.unchecked.clear();
        found
    }
}

/// The receiving side of one rank.
#[derive(Debug)]
pub(crate) struct Inbox {
    state: Mutex<InboxState>,
    arrived: Condvar,
}

impl Inbox {
    pub(crate) fn new(size: usize) -> Self {
        Self {
            state: Mutex::new(InboxState {
                queues: HashMap::new(),
                status: vec![PeerStatus::Alive; size],
                group_failure: None,
                failure_seen: None,
                waiting: None,
                checked_below: u64::MAX,
                unchecked: Vec::new(),
            }),
            arrived: Condvar::new(),
        }
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, InboxState> {
        // A panic while holding this lock cannot leave the queues inconsistent (every update
        // is a single push/pop), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A frame from `from` arrived.
    pub(crate) fn deliver(&self, from: usize, frame: Frame) {
        let mut state = self.lock();
        let wake = match state.waiting {
            Some((peer, stale_below)) => {
                peer == from || (frame.header.kind != OpKind::Exchange && frame.header.seq < stale_below)
            }
            None => false,
        };
        let queue = state.queues.entry(from).or_default();
        let new_front = queue.is_empty();
        queue.push_back(frame);
        if new_front {
            state.unchecked.push(from);
        }
        drop(state);
        if wake {
            self.arrived.notify_all();
        }
    }

    /// `from` reports that `failed_rank` failed (itself, or a rank whose failure made it give
    /// up): `from` will send nothing more, so waits on it fail once its queued frames are
    /// consumed. Waits on ranks still alive go on — they either send, or give up and say so —
    /// which keeps a collective that every rank did complete from failing on some ranks.
    pub(crate) fn peer_failed(&self, from: usize, failed_rank: usize, reason: String) {
        self.mark_failed(from, failed_rank, reason, false);
    }

    /// This rank (`me`) gives up: its own wait, whatever peer it is on, ends now.
    pub(super) fn own_failure(&self, me: usize, reason: String) {
        self.mark_failed(me, me, reason, true);
    }

    fn mark_failed(&self, from: usize, failed_rank: usize, reason: String, always_wake: bool) {
        let mut state = self.lock();
        // The waiter cares about its own peer, and about the first failure (which starts its
        // grace); later reports wake nobody, so N ranks giving up cost O(N) wake-ups, not N².
        let mut wake = always_wake || state.is_waiting_on(from);
        if state.group_failure.is_none() {
            state.group_failure = Some((failed_rank, reason));
            state.failure_seen = Some(Instant::now());
            wake = true;
        }
        // Only the reporter is known to send nothing more: everything it sent before the report
        // is already queued (one ordered link per peer). The rank it names may be alive with
        // frames still in flight (a mismatch blames a live peer); if it died, its own link
        // reports that, in order, after its last frame.
        if let Some(status) = state.status.get_mut(from) {
            *status = PeerStatus::Failed;
        }
        drop(state);
        if wake {
            self.arrived.notify_all();
        }
    }

    /// Why a send to `peer` failed, if this rank learns it within `grace`: a write error to a
    /// peer that died or gave up arrives at about the moment its reader sees the close or the
    /// abort, and that failure (naming the rank that failed first) is the better error.
    pub(super) fn why_unreachable(
        &self,
        me: usize,
        peer: usize,
        op: &'static str,
        grace: Duration,
    ) -> Option<TransportError> {
        let deadline = Instant::now() + grace;
        let mut state = self.lock();
        // Woken by news of `peer` only (a stale_below of 0 makes no frame stale).
        state.waiting = Some((peer, 0));
        let found = loop {
            match state.status[peer] {
                PeerStatus::Failed => {
                    let (rank, reason) = state.group_failure.clone().unwrap_or((peer, "failed".into()));
                    break Some(TransportError::PeerFailed { rank, reason });
                }
                PeerStatus::Left => break Some(TransportError::PeerLeft { rank: peer, waiting: me, op }),
                PeerStatus::Alive => {}
            }
            let now = Instant::now();
            if now >= deadline {
                break None;
            }
            state = self.arrived.wait_timeout(state, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
        };
        state.waiting = None;
        found
    }

    /// `rank` left cleanly: waits on it fail once its queued frames are consumed.
    pub(crate) fn peer_left(&self, rank: usize) {
        let mut state = self.lock();
        if state.status[rank] == PeerStatus::Alive {
            state.status[rank] = PeerStatus::Left;
        }
        // Only a wait on that rank can end by it (every rank leaving at the end of a run must
        // not wake every waiter N times).
        let wake = state.is_waiting_on(rank);
        drop(state);
        if wake {
            self.arrived.notify_all();
        }
    }

    /// Waits for the next frame from `from`. `stale_below` is the first collective sequence
    /// number this rank has not finished: a collective frame older than that, still queued,
    /// belongs to a collective this rank completed without expecting it (say, ranks that
    /// disagree on a gather root) — a mismatch to report now rather than a hang later.
    pub(super) fn wait(
        &self,
        me: usize,
        from: usize,
        expected: Header,
        stale_below: u64,
        clock: &OpClock,
    ) -> Result<Frame> {
        let OpClock { op, started, deadline, failure_grace } = *clock;
        let mut state = self.lock();
        state.waiting = Some((from, stale_below));
        let result = loop {
            // Frames that already arrived are still good: the peer did its part of this
            // collective before anything failed. Only a wait that cannot be satisfied fails.
            let queue = state.queues.get_mut(&from);
            if let Some(frame) = queue.and_then(VecDeque::pop_front) {
                if state.queues.get(&from).is_some_and(|q| !q.is_empty()) {
                    state.unchecked.push(from);
                }
                break Ok(frame);
            }
            if let Some(peer) = state.stale_front(stale_below) {
                let frame = state.queues.get(&peer).and_then(VecDeque::front).expect("a stale front");
                break Err(TransportError::CollectiveMismatch {
                    local_rank: me,
                    rank: peer,
                    local: expected.describe(),
                    remote: format!("{} (which rank {me} did not take part in)", frame.header.describe()),
                });
            }
            if state.status[from] == PeerStatus::Failed || state.status[me] == PeerStatus::Failed {
                let (rank, reason) = state.group_failure.clone().unwrap_or((from, "failed".into()));
                break Err(TransportError::PeerFailed { rank, reason });
            }
            if state.status[from] == PeerStatus::Left {
                break Err(TransportError::PeerLeft { rank: from, waiting: me, op });
            }
            let now = Instant::now();
            // Once the group has failed, a live peer gets a short grace for frames in flight;
            // after that, waiting on it could only end in a timeout (it may be waiting on us).
            let mut until = deadline;
            if let (Some((rank, reason)), Some(seen)) = (&state.group_failure, state.failure_seen) {
                if now >= seen + failure_grace {
                    break Err(TransportError::PeerFailed { rank: *rank, reason: reason.clone() });
                }
                until = until.min(seen + failure_grace);
            }
            if now >= deadline {
                break Err(TransportError::Timeout { rank: from, waiting: me, op, waited: now - started });
            }
            state = self.arrived.wait_timeout(state, until - now).unwrap_or_else(|e| e.into_inner()).0;
        };
        state.waiting = None;
        result
    }

    /// The first failure this rank has heard of, if any.
    pub(super) fn group_failure(&self) -> Option<(usize, String)> {
        self.lock().group_failure.clone()
    }
}
