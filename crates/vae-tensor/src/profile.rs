//! Per-op wall-clock timers for the CPU backend: where one decode spends its time.
//!
//! Off by default, at the cost of one relaxed atomic load per op. When [`set_enabled`] turns
//! them on, each op run on a thread adds its elapsed time and a call to that thread's table
//! under the op's name (the kernel for convolutions: `conv.winograd`, `conv.direct`); an op
//! called inside another op (a conv inside `conv3d`) counts toward the outer one only, so the
//! rows add up to the time spent in ops. [`take`] reads and clears the calling thread's table:
//! a rank's thread reads its own ops. Times include the op's parallel work on the rayon pool.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

static ENABLED: AtomicBool = AtomicBool::new(false);

thread_local! {
    static TABLE: RefCell<Table> = RefCell::new(Table::default());
}

#[derive(Default)]
struct Table {
    depth: usize,
    ops: BTreeMap<&'static str, (u64, Duration)>,
}

/// Turns the timers on or off for every thread.
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Whether the timers are on.
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// One op's totals on a thread.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpTime {
    /// The op (and kernel) name.
    pub name: &'static str,
    /// Calls.
    pub calls: u64,
    /// Wall-clock time inside the op.
    pub time: Duration,
}

/// The calling thread's totals since the last `take`, longest first; clears them.
pub fn take() -> Vec<OpTime> {
    let ops = TABLE.with(|t| std::mem::take(&mut t.borrow_mut().ops));
    let mut rows: Vec<OpTime> = ops.into_iter().map(|(name, (calls, time))| OpTime { name, calls, time }).collect();
    rows.sort_by(|a, b| b.time.cmp(&a.time).then(a.name.cmp(b.name)));
    rows
}

/// Times the rest of the enclosing scope as `name` (when the timers are on and no op is
/// already being timed on this thread).
pub(crate) struct Scope {
    start: Option<(&'static str, Instant)>,
}

impl Scope {
    pub(crate) fn new(name: &'static str) -> Self {
        if !enabled() {
            return Self { start: None };
        }
        let outer = TABLE.with(|t| {
            let mut t = t.borrow_mut();
            t.depth += 1;
            t.depth == 1
        });
        Self { start: Some((if outer { name } else { "" }, Instant::now())) }
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        let Some((name, start)) = self.start else { return };
        let elapsed = start.elapsed();
        TABLE.with(|t| {
            let mut t = t.borrow_mut();
            t.depth -= 1;
            if !name.is_empty() {
                let e = t.ops.entry(name).or_default();
                e.0 += 1;
                e.1 += elapsed;
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outer_ops_only_and_per_thread() {
        set_enabled(true);
        let _ = take();
        {
            let _a = Scope::new("outer");
            let _b = Scope::new("inner");
        }
        {
            let _a = Scope::new("outer");
        }
        std::thread::spawn(|| {
            let _a = Scope::new("elsewhere");
        })
        .join()
        .unwrap();
        let rows = take();
        assert_eq!(rows.len(), 1, "{rows:?}");
        assert_eq!((rows[0].name, rows[0].calls), ("outer", 2));
        assert!(take().is_empty(), "take clears");
    }
}
