//! Stopping a rank's computation soon after its group failed, instead of at its next
//! collective: the executor enters a [`CancelScope`] with the rank's communicator for each
//! request, and long computations call [`check`] between steps (the executor between tiles, the
//! video models between latent frames). Outside a scope, `check` always passes.

use std::cell::RefCell;
use std::sync::Arc;

use vae_transport::Communicator;

use crate::RuntimeError;

thread_local! {
    static GROUPS: RefCell<Vec<Arc<dyn Communicator>>> = const { RefCell::new(Vec::new()) };
}

/// The calling thread's computations belong to `comm`'s group while this lives. Not `Send`.
pub struct CancelScope {
    _not_send: std::marker::PhantomData<*const ()>,
}

impl std::fmt::Debug for CancelScope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CancelScope")
    }
}

impl CancelScope {
    /// Enters the scope of `comm` (scopes nest; the innermost is checked).
    pub fn enter(comm: Arc<dyn Communicator>) -> Self {
        GROUPS.with(|g| g.borrow_mut().push(comm));
        Self { _not_send: std::marker::PhantomData }
    }
}

impl Drop for CancelScope {
    fn drop(&mut self) {
        GROUPS.with(|g| g.borrow_mut().pop());
    }
}

/// An error once the group of the innermost [`CancelScope`] has failed (the transport's error
/// naming the rank that failed first); `Ok` otherwise, or outside any scope.
pub fn check() -> Result<(), RuntimeError> {
    let failure = GROUPS.with(|g| g.borrow().last().and_then(|comm| comm.failure()));
    match failure {
        Some(err) => Err(RuntimeError::Transport(err)),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vae_transport::{TransportConfig, run_local};

    #[test]
    fn a_scope_reports_its_group_failure_and_nothing_outside() {
        assert!(check().is_ok());
        let results = run_local(2, TransportConfig::default(), |comm| {
            let comm: Arc<dyn Communicator> = Arc::new(comm);
            let _scope = CancelScope::enter(Arc::clone(&comm));
            assert!(check().is_ok());
            // Both ranks have checked before rank 1 aborts (else it could abort first). The
            // barrier may itself see the abort on rank 0: only the order matters here.
            let _ = comm.barrier();
            if comm.rank() == 1 {
                comm.abort("tile 3 failed");
            }
            // Rank 0 learns of it without a collective.
            let started = std::time::Instant::now();
            while check().is_ok() {
                assert!(started.elapsed().as_secs() < 10, "the failure never showed");
                std::thread::yield_now();
            }
            check().unwrap_err().to_string()
        })
        .unwrap();
        for r in results {
            let text = r.unwrap();
            assert!(text.contains("tile 3 failed") || text.contains("rank 1"), "{text}");
        }
    }
}
