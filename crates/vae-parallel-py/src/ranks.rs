//! The ranks a request runs on, and running it there: the calling thread waits without the GIL
//! while the ranks work on threads of their own, and checks for signals as it waits, so that
//! Ctrl-C stops a request (every rank aborts at its next tile, frame or collective) and is
//! raised as `KeyboardInterrupt`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use pyo3::prelude::*;
use vae_parallel::engine::{Engine, EngineError};
use vae_parallel::local_ranks::{pool_threads, run_local_ranks};
use vae_parallel::report::{RequestReport, gather_summaries};
use vae_parallel::runtime::{DistributedVaeExecutor, ExecOutput, ParallelMode};
use vae_parallel::tensor::Tensor;
use vae_parallel::transport::{Communicator, SocketComm, SocketOptions, TransportConfig};

use crate::errors::{ExecutionError, GroupError, config_error, engine_error, one_line};

/// How often a waiting request looks for a pending signal.
const SIGNAL_POLL: Duration = Duration::from_millis(50);

/// What an interrupted rank tells the others.
const INTERRUPTED: &str = "interrupted (KeyboardInterrupt)";

/// The ranks a request runs on.
pub(crate) enum Group {
    /// This many threads of this process, over a local group made for each request.
    Local(usize, TransportConfig),
    /// This process is one rank of a socket group it joined when the model loaded: every rank
    /// calls each request with the same input.
    Socket(Arc<dyn Communicator>),
}

/// The socket group of this process: joined once, on the first model loaded with
/// `transport="socket"`, and shared by every such model after it (a process is one rank of one
/// group; joining again would need every other rank to join again too).
pub(crate) fn socket_group(py: Python<'_>) -> PyResult<Arc<dyn Communicator>> {
    static GROUP: Mutex<Option<Arc<dyn Communicator>>> = Mutex::new(None);
    // Locked without the GIL: a second thread loading meanwhile waits here, not holding it.
    py.detach(|| {
        let mut group = GROUP.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(comm) = group.as_ref() {
            return Ok(Arc::clone(comm));
        }
        let options = SocketOptions::from_env().map_err(config_error)?;
        let comm = SocketComm::connect(&options)
            .map_err(|e| GroupError::new_err(format!("joining the socket group: {}", one_line(&e))))?;
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        *group = Some(Arc::clone(&comm));
        Ok(comm)
    })
}

/// The communicators of the request in flight, so that an interrupt can abort them.
#[derive(Default)]
struct InFlight {
    comms: Mutex<Vec<Arc<dyn Communicator>>>,
    interrupted: AtomicBool,
}

impl InFlight {
    /// A rank's communicator, aborted at once if the request was interrupted already.
    fn enlist(&self, comm: &Arc<dyn Communicator>) {
        self.comms.lock().unwrap_or_else(|e| e.into_inner()).push(Arc::clone(comm));
        if self.interrupted.load(Ordering::SeqCst) {
            comm.abort(INTERRUPTED);
        }
    }

    fn interrupt(&self) {
        self.interrupted.store(true, Ordering::SeqCst);
        for comm in self.comms.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            comm.abort(INTERRUPTED);
        }
    }
}

/// What a request gives this process: its output (`None` on a socket rank the output does not
/// go to) and, on rank 0, the request's report from every rank.
pub(crate) struct Finished {
    pub tensor: Option<Tensor>,
    pub report: Option<RequestReport>,
}

/// Set when the ranks' thread is done, however it ends.
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

impl Group {
    /// Ranks every request runs on.
    pub(crate) fn size(&self) -> usize {
        match self {
            Self::Local(n, _) => *n,
            Self::Socket(comm) => comm.size(),
        }
    }

    /// This process's rank (0 for a local group, whose ranks are its threads).
    pub(crate) fn rank(&self) -> usize {
        match self {
            Self::Local(..) => 0,
            Self::Socket(comm) => comm.rank(),
        }
    }

    /// Runs `body` (a request in `mode`) on every rank of the group with the same input and
    /// returns this process's result (rank 0's for a local group). A failure on any rank aborts
    /// the others and is raised once, as the CLI reports it; a signal while it runs (Ctrl-C)
    /// stops every rank and is raised. `streamed`: the output goes to a frame sink, so the
    /// owner gets no tensor (and on one rank no report either: the body returns `None`).
    pub(crate) fn run(
        &self,
        py: Python<'_>,
        engine: &Engine,
        mode: ParallelMode,
        streamed: bool,
        body: impl Fn(&Engine, &DistributedVaeExecutor) -> Result<Option<ExecOutput>, EngineError> + Sync,
    ) -> PyResult<Finished> {
        let in_flight = InFlight::default();
        let done = Done::default();
        std::thread::scope(|scope| {
            let ranks = scope.spawn(|| {
                let _done = SetOnDrop(&done);
                self.run_ranks(engine, mode, streamed, &body, &in_flight)
            });
            loop {
                if py.detach(|| done.wait(SIGNAL_POLL)) {
                    break;
                }
                if let Err(signal) = py.check_signals() {
                    in_flight.interrupt();
                    // The ranks stop at their next tile, frame or collective.
                    let _ = py.detach(|| ranks.join());
                    return Err(signal);
                }
            }
            py.detach(|| ranks.join()).unwrap_or_else(|_| Err(ExecutionError::new_err("the ranks' thread panicked")))
        })
    }

    fn run_ranks(
        &self,
        engine: &Engine,
        mode: ParallelMode,
        streamed: bool,
        body: &(impl Fn(&Engine, &DistributedVaeExecutor) -> Result<Option<ExecOutput>, EngineError> + Sync),
        in_flight: &InFlight,
    ) -> PyResult<Finished> {
        let one_rank = |comm: Arc<dyn Communicator>| -> PyResult<Finished> {
            in_flight.enlist(&comm);
            let executor = DistributedVaeExecutor::new(Arc::clone(&comm), comm.size()).map_err(EngineError::from);
            let result = executor.and_then(|executor| Ok((body(engine, &executor)?, executor.parallel_size())));
            let (out, parallel_size) = match result {
                Ok(done) => done,
                Err(e) => {
                    if !e.known_to_all_ranks() {
                        comm.abort(&one_line(&e));
                    }
                    return Err(engine_error(&e));
                }
            };
            // A request that ran on this process alone, outside the executor, has no report.
            let Some(out) = out else { return Ok(Finished { tensor: None, report: None }) };
            // Every rank's summary to rank 0, as the CLI's report.
            let ranks = gather_summaries(comm.as_ref(), 0, &out.report)
                .map_err(|e| ExecutionError::new_err(format!("gathering the report: {}", one_line(&e))))?;
            let report = ranks.map(|ranks| {
                RequestReport::from_owner(&mode.to_string(), &out.report, comm.as_ref(), parallel_size, ranks)
            });
            Ok(Finished { tensor: out.tensor, report })
        };
        match self {
            Self::Socket(comm) => one_rank(Arc::clone(comm)),
            Self::Local(ranks, config) => {
                let each = pool_threads(None, *ranks);
                let results = run_local_ranks(*ranks, each, *config, |comm| one_rank(Arc::new(comm)))
                    .map_err(|e| GroupError::new_err(one_line(&e)))?;
                let mut owner = None;
                let mut failure = None;
                for (rank, result) in results.into_iter().enumerate() {
                    match result {
                        Err(panic) => {
                            failure =
                                failure.or(Some(ExecutionError::new_err(format!("rank {rank} panicked: {panic}"))))
                        }
                        Ok(Err(e)) if rank == 0 => return Err(e),
                        Ok(Err(e)) => failure = failure.or(Some(e)),
                        Ok(Ok(out)) if rank == 0 => owner = Some(out),
                        Ok(Ok(_)) => {}
                    }
                }
                if let Some(err) = failure {
                    return Err(err);
                }
                let out = owner.ok_or_else(|| ExecutionError::new_err("rank 0 returned no result"))?;
                if out.tensor.is_none() && !streamed {
                    return Err(ExecutionError::new_err("the owner received no output"));
                }
                Ok(out)
            }
        }
    }
}
