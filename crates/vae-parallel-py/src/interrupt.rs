//! Running a request while Python waits: the calling thread waits without the GIL while the
//! group runs the request on threads of its own, and checks for signals as it waits, so that
//! Ctrl-C cancels the request (every rank stops at its next tile, frame or collective) and is
//! raised as `KeyboardInterrupt`. Everything else about running a request is the library's
//! [`Group::run`].

use std::sync::{Condvar, Mutex};
use std::time::Duration;

use pyo3::prelude::*;
use vae_parallel::{CancelToken, Finished, Group, Request, Vae};

use crate::errors::{ExecutionError, to_py};

/// How often a waiting request looks for a pending signal.
const SIGNAL_POLL: Duration = Duration::from_millis(50);

/// What an interrupted request tells the ranks.
const INTERRUPTED: &str = "interrupted (KeyboardInterrupt)";

/// Set when the request's thread is done, however it ends.
#[derive(Default)]
struct Done {
    flag: Mutex<bool>,
    signal: Condvar,
}

impl Done {
    fn set(&self) {
        *self.flag.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.signal.notify_all();
    }

    /// Whether it is done, waiting up to `timeout` for it.
    fn wait(&self, timeout: Duration) -> bool {
        let flag = self.flag.lock().unwrap_or_else(|e| e.into_inner());
        *self.signal.wait_timeout_while(flag, timeout, |done| !*done).unwrap_or_else(|e| e.into_inner()).0
    }
}

/// Sets [`Done`] when dropped: on return and on unwinding alike.
struct SetOnDrop<'a>(&'a Done);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.set();
    }
}

/// Runs the request `make` builds (with the token that cancels it) on `group`; a signal while
/// it runs cancels it and is raised.
pub(crate) fn run<'a>(
    py: Python<'_>,
    group: &Group,
    vae: &Vae,
    make: impl FnOnce(&'a CancelToken) -> Request<'a> + Send,
    token: &'a CancelToken,
) -> PyResult<Finished> {
    let done = Done::default();
    std::thread::scope(|scope| {
        let worker = scope.spawn(|| {
            let _done = SetOnDrop(&done);
            group.run(vae, make(token))
        });
        loop {
            if py.detach(|| done.wait(SIGNAL_POLL)) {
                break;
            }
            if let Err(signal) = py.check_signals() {
                token.cancel(INTERRUPTED);
                // The ranks stop at their next tile, frame or collective.
                let _ = py.detach(|| worker.join());
                return Err(signal);
            }
        }
        match py.detach(|| worker.join()) {
            Ok(result) => result.map_err(|e| to_py(&e)),
            Err(_) => Err(ExecutionError::new_err("the request's thread panicked")),
        }
    })
}
