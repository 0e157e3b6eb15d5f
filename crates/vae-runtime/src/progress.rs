//! How far a request has got on a rank, for a progress bar.
//!
//! The layers that know report it: the executor after each tile of the rank, a video model after
//! each temporal step of a tile or band (a latent frame of a decode, a chunk of an encode). They
//! call [`report`], which hands the update to the sink the calling thread entered with
//! [`ProgressScope::enter`], and does nothing when there is none. The scope belongs to a rank's
//! thread for one request (every local rank is a thread of its own), so no sink outlives its
//! request or sees another rank's work, and no signature between the caller and the layers
//! has to carry it. On CUDA a step is counted when its work is queued, not when it finishes.

use std::cell::RefCell;
use std::sync::{Arc, Mutex};

/// One update.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// `done` of this rank's `total` tiles are computed (`done` 0 when its first tile starts).
    Tiles {
        /// Tiles computed.
        done: usize,
        /// Tiles this rank computes in the request.
        total: usize,
    },
    /// Within the tile or band being computed: `done` of its `total` temporal steps.
    Steps {
        /// Steps computed.
        done: usize,
        /// Steps of the tile or band.
        total: usize,
    },
}

/// Where updates go.
pub type ProgressSink = Arc<dyn Fn(Progress) + Send + Sync>;

thread_local! {
    static SINK: RefCell<Option<ProgressSink>> = const { RefCell::new(None) };
}

/// While alive, the calling thread's updates go to one sink; dropping it restores the sink
/// before it (scopes nest).
#[must_use = "updates go to the sink only while the scope is alive"]
pub struct ProgressScope {
    previous: Option<ProgressSink>,
}

impl ProgressScope {
    /// Sends this thread's updates to `sink` until the scope is dropped.
    pub fn enter(sink: ProgressSink) -> Self {
        Self { previous: SINK.with(|s| s.replace(Some(sink))) }
    }
}

impl Drop for ProgressScope {
    fn drop(&mut self) {
        let previous = self.previous.take();
        SINK.with(|s| *s.borrow_mut() = previous);
    }
}

/// Hands `update` to the calling thread's sink, if it has one.
pub fn report(update: Progress) {
    // The sink is cloned out first, so that it may itself report or enter a scope.
    if let Some(sink) = SINK.with(|s| s.borrow().clone()) {
        sink(update);
    }
}

/// Runs `work` on this thread with a sink that keeps every update, and returns its result with
/// them in order: a log of a request's progress (what the tests of every layer check).
pub fn collect<T>(work: impl FnOnce() -> T) -> (T, Vec<Progress>) {
    let log = Arc::new(Mutex::new(Vec::new()));
    let sink = Arc::clone(&log);
    let scope = ProgressScope::enter(Arc::new(move |p| sink.lock().unwrap_or_else(|e| e.into_inner()).push(p)));
    let out = work();
    drop(scope);
    let updates = std::mem::take(&mut *log.lock().unwrap_or_else(|e| e.into_inner()));
    (out, updates)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recorder() -> (ProgressSink, Arc<Mutex<Vec<Progress>>>) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = Arc::clone(&seen);
        (Arc::new(move |p| log.lock().unwrap().push(p)), seen)
    }

    #[test]
    fn updates_reach_the_innermost_scope_of_their_thread_only() {
        let (outer, outer_seen) = recorder();
        let (inner, inner_seen) = recorder();
        report(Progress::Tiles { done: 0, total: 9 }); // no scope: nothing happens
        let _outer = ProgressScope::enter(outer);
        report(Progress::Tiles { done: 0, total: 2 });
        {
            let _inner = ProgressScope::enter(inner);
            report(Progress::Steps { done: 1, total: 3 });
            // Another thread has no sink.
            std::thread::spawn(|| report(Progress::Steps { done: 2, total: 3 })).join().unwrap();
        }
        report(Progress::Tiles { done: 1, total: 2 });
        assert_eq!(
            *outer_seen.lock().unwrap(),
            [Progress::Tiles { done: 0, total: 2 }, Progress::Tiles { done: 1, total: 2 }]
        );
        assert_eq!(*inner_seen.lock().unwrap(), [Progress::Steps { done: 1, total: 3 }]);
    }

    #[test]
    fn collect_keeps_the_updates_of_its_work_alone() {
        let ((), inside) = collect(|| {
            report(Progress::Steps { done: 1, total: 2 });
            let ((), nested) = collect(|| report(Progress::Steps { done: 2, total: 2 }));
            assert_eq!(nested, [Progress::Steps { done: 2, total: 2 }]);
        });
        assert_eq!(inside, [Progress::Steps { done: 1, total: 2 }]);
    }

    #[test]
    fn a_dropped_scope_leaves_no_sink() {
        let (sink, seen) = recorder();
        drop(ProgressScope::enter(sink));
        report(Progress::Tiles { done: 0, total: 1 });
        assert!(seen.lock().unwrap().is_empty());
    }
}
