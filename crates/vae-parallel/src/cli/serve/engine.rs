//! The group's thread: the service's one place that runs requests. Requests wait in a bounded
//! queue in arrival order and run one at a time on the group (every rank runs each whole
//! request; the group holds one request at a time). A request whose client left before it
//! started is dropped; one whose client leaves while it runs is cancelled at the next tile,
//! frame or collective. After a rank fails the group is rebuilt before the next request (the
//! ranks this service launched are started again); an idle group of processes gets a heartbeat
//! so that its collectives stay within their timeout and a rank that died is found.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};

use super::metrics::Metrics;
use super::ranks::ServiceGroup;
use super::spec::{Frame, Kind, RequestOptions};
use crate::settings::Settings;
use crate::{CancelToken, Error, FrameSink, Group, Request, RequestReport, SinkError, Tensor, Vae, io};

/// How often an idle group of processes is sent a heartbeat.
const HEARTBEAT: Duration = Duration::from_secs(30);

/// What a request leaves: its output and report, or the library's error.
pub enum Outcome {
    /// It ran.
    Done {
        /// The output (none for a streamed decode, whose frames went to the stream).
        output: Option<Tensor>,
        /// Every rank's part, when the group made one.
        report: Option<Box<RequestReport>>,
        /// How long it waited in the queue.
        queued: Duration,
        /// How long it ran.
        ran: Duration,
    },
    /// It failed (or was refused, or its client left).
    Failed(Error),
    /// The group could not run it: the ranks failed and could not be replaced.
    Unavailable(String),
}

/// One request on its way to the group.
pub struct Job {
    /// Decode or encode.
    pub kind: Kind,
    /// Its options (the model by name).
    pub options: RequestOptions,
    /// The input tensor.
    pub input: Tensor,
    /// Where a streamed decode's frames go, as `.npy` chunks; `None`: the whole output.
    pub stream: Option<Stream>,
    /// Cancelled when the client leaves.
    pub cancel: CancelToken,
    /// The answer.
    pub reply: oneshot::Sender<Outcome>,
    /// When it arrived.
    pub arrived: Instant,
}

/// A streamed decode's way to its client: the channel of `.npy` chunks, and how long a chunk
/// may wait for room in it (the client reads too slowly) before the request fails.
pub struct Stream {
    /// The chunks, bounded: the HTTP side writes them to the connection as the client reads.
    pub to: mpsc::Sender<Vec<u8>>,
    /// The longest a chunk may wait for the client (`--read-timeout-s`).
    pub stall: Duration,
}

/// Why a request was not queued.
#[derive(Debug)]
pub enum Refused {
    /// The queue is full (429).
    QueueFull,
    /// The group's thread has ended: the service can run nothing more (503, not ready).
    Gone,
}

/// The handle the HTTP side holds: the queue into the group's thread.
#[derive(Clone)]
pub struct Engine {
    queue: SyncSender<Job>,
    /// The service's counters.
    pub metrics: Arc<Metrics>,
    /// Whether the group can take requests (`/readyz`).
    pub ready: Arc<AtomicBool>,
    /// Set when the service stops: the group's thread answers what still waits, stops the
    /// group (no rank left behind) and ends.
    pub stop: Arc<AtomicBool>,
}

impl Engine {
    /// Queues `job`; refuses it when the queue is full, or when the group's thread has ended
    /// (the service is then marked not ready).
    pub fn submit(&self, job: Job) -> Result<(), Refused> {
        self.metrics.queued.fetch_add(1, Ordering::Relaxed);
        let refused = match self.queue.try_send(job) {
            Ok(()) => return Ok(()),
            Err(TrySendError::Full(_)) => Refused::QueueFull,
            Err(TrySendError::Disconnected(_)) => {
                self.ready.store(false, Ordering::Relaxed);
                Refused::Gone
            }
        };
        self.metrics.queued.fetch_sub(1, Ordering::Relaxed);
        Err(refused)
    }
}

/// Starts the group's thread on `group` with `models`; a queue of `capacity` requests waits
/// for it. The thread ends, stopping the group, when every [`Engine`] is dropped.
pub fn start(
    group: ServiceGroup,
    models: Arc<Vec<(String, Vae)>>,
    base: Settings,
    capacity: usize,
) -> (Engine, std::thread::JoinHandle<()>) {
    let (queue, jobs) = std::sync::mpsc::sync_channel(capacity);
    let metrics = Arc::new(Metrics::default());
    let ready = Arc::new(AtomicBool::new(true));
    let stop = Arc::new(AtomicBool::new(false));
    let engine = Engine { queue, metrics: Arc::clone(&metrics), ready: Arc::clone(&ready), stop: Arc::clone(&stop) };
    let thread = std::thread::Builder::new()
        .name("vae-group".into())
        .spawn(move || group_thread(group, &models, &base, jobs, &metrics, &ready, &stop))
        .expect("starting the group's thread");
    (engine, thread)
}

fn group_thread(
    mut group: ServiceGroup,
    models: &[(String, Vae)],
    base: &Settings,
    jobs: Receiver<Job>,
    metrics: &Metrics,
    ready: &AtomicBool,
    stop: &AtomicBool,
) {
    let mut last_sent = Instant::now();
    loop {
        if stop.load(Ordering::Relaxed) {
            // What still waits is answered, never dropped silently.
            while let Ok(job) = jobs.try_recv() {
                metrics.queued.fetch_sub(1, Ordering::Relaxed);
                let _ = job.reply.send(Outcome::Unavailable("the service is stopping".into()));
            }
            break;
        }
        let job = match jobs.recv_timeout(Duration::from_millis(200)) {
            Ok(job) => job,
            Err(RecvTimeoutError::Timeout) => {
                // A rank that died while the group was idle: replaced now (or the service made
                // unready), not when the next request comes.
                if group.failure().is_some() {
                    heal(&mut group, metrics, ready);
                }
                if last_sent.elapsed() >= HEARTBEAT {
                    if group.failure().is_none() {
                        let _ = group.broadcast(&Frame::Heartbeat, None);
                    }
                    last_sent = Instant::now();
                    heal(&mut group, metrics, ready);
                }
                continue;
            }
            Err(RecvTimeoutError::Disconnected) => break,
        };
        last_sent = Instant::now();
        metrics.queued.fetch_sub(1, Ordering::Relaxed);
        // A client that left while its request waited: nothing to run.
        if job.cancel.is_cancelled() {
            let reason = job.cancel.reason().unwrap_or_default();
            let aborted = crate::transport::TransportError::Aborted { rank: 0, reason };
            let _ = job.reply.send(Outcome::Failed(Error::Runtime(crate::runtime::RuntimeError::Transport(aborted))));
            continue;
        }
        heal(&mut group, metrics, ready);
        if !ready.load(Ordering::Relaxed) {
            let why = group.failure().unwrap_or_else(|| "the group is down".into());
            let _ = job.reply.send(Outcome::Unavailable(why));
            continue;
        }
        metrics.running.store(1, Ordering::Relaxed);
        let Job { kind, options, input, stream, cancel, reply, arrived } = job;
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            run_job(&group, models, base, kind, &options, &input, stream, &cancel, arrived)
        }));
        let outcome = ran.unwrap_or_else(|panic| {
            // A bug, not the client's: this request fails, the group (which may have been
            // left mid-collective) is rebuilt, and the service keeps its thread.
            let message = panic_message(panic.as_ref());
            tracing::error!("a request panicked: {message}");
            group.mark_failed(format!("a request panicked: {message}"));
            Outcome::Failed(Error::Panicked { rank: 0, message })
        });
        let _ = reply.send(outcome);
        metrics.running.store(0, Ordering::Relaxed);
        // A rank that died (or a cancel that aborted a group of processes) is replaced now,
        // before the next request.
        heal(&mut group, metrics, ready);
    }
    group.stop();
}

/// Rebuilds a failed group where it can (the time it took in the metrics); marks the service
/// unready where it cannot.
fn heal(group: &mut ServiceGroup, metrics: &Metrics, ready: &AtomicBool) {
    let Some(why) = group.failure() else {
        ready.store(true, Ordering::Relaxed);
        return;
    };
    if !group.can_rebuild() {
        if ready.swap(false, Ordering::Relaxed) {
            tracing::error!("the group failed ({why}); its ranks were placed by the environment: not ready");
        }
        return;
    }
    tracing::warn!("the group failed ({why}): rebuilding it");
    let started = Instant::now();
    match group.rebuild() {
        Ok(()) => {
            let ms = started.elapsed().as_millis() as u64;
            metrics.rebuilds.fetch_add(1, Ordering::Relaxed);
            metrics.last_rebuild_ms.store(ms, Ordering::Relaxed);
            tracing::warn!("the group was rebuilt in {ms} ms");
            ready.store(true, Ordering::Relaxed);
        }
        Err(e) => {
            tracing::error!("rebuilding the group failed: {e:#}");
            ready.store(false, Ordering::Relaxed);
        }
    }
}

/// Runs one job on the group: its outcome.
#[allow(clippy::too_many_arguments)]
fn run_job(
    group: &ServiceGroup,
    models: &[(String, Vae)],
    base: &Settings,
    kind: Kind,
    options: &RequestOptions,
    input: &Tensor,
    stream: Option<Stream>,
    token: &CancelToken,
    arrived: Instant,
) -> Outcome {
    let queued = arrived.elapsed();
    let Some((_, vae)) = models.iter().find(|(name, _)| *name == options.model) else {
        return Outcome::Failed(Error::invalid_option(format!("unknown model {:?}", options.model)));
    };
    let started = Instant::now();
    let streamed = stream.is_some();
    // A cancel aborts a group of processes; ranks placed by the environment cannot be replaced,
    // so there a request whose client left runs to its end (its frames dropped) rather than
    // leave the service unready.
    let cancel = group.can_rebuild().then_some(token);
    let frame = Frame::Run { kind, options: options.clone(), streamed };
    let result = group.broadcast(&frame, Some(input)).and_then(|()| {
        let stream = stream.map(|s| (s, token.clone()));
        run_request(&group.group, vae, base, kind, options, input, streamed, stream, cancel)
    });
    match result {
        Ok((output, report)) => Outcome::Done { output, report: report.map(Box::new), queued, ran: started.elapsed() },
        Err(err) => Outcome::Failed(err),
    }
}

/// A panic's message, where it is text.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}

/// One request on `group` (every rank calls this with the same arguments, in the same order):
/// the output on the owner, and its report.
#[allow(clippy::too_many_arguments)]
pub fn run_request(
    group: &Group,
    vae: &Vae,
    base: &Settings,
    kind: Kind,
    options: &RequestOptions,
    input: &Tensor,
    streamed: bool,
    stream: Option<(Stream, CancelToken)>,
    cancel: Option<&CancelToken>,
) -> crate::Result<(Option<Tensor>, Option<RequestReport>)> {
    let finished = match kind {
        Kind::Encode => {
            let encode = options.encode(base)?;
            let request = Request::encode(input, &encode);
            group.run(vae, with_cancel(request, cancel))?
        }
        Kind::Decode if streamed => {
            let decode = options.decode(base)?;
            let mut sink = NpyChunks { to: stream, fail_when_gone: cancel.is_some() };
            let request = Request::decode_to(input, &decode, &mut sink);
            group.run(vae, with_cancel(request, cancel))?
        }
        Kind::Decode => {
            let decode = options.decode(base)?;
            let request = Request::decode(input, &decode);
            group.run(vae, with_cancel(request, cancel))?
        }
    };
    Ok((finished.output, finished.report))
}

fn with_cancel<'a>(request: Request<'a>, cancel: Option<&'a CancelToken>) -> Request<'a> {
    match cancel {
        Some(token) => request.cancel_on(token),
        None => request,
    }
}

/// A streamed decode's sink: each run of frames as a `.npy` chunk on the way to the client
/// (nothing on ranks other than the owner). A client that left, or that reads so slowly that a
/// chunk waits longer than the stream's stall limit, fails the decode (the group's thread is
/// never held by a client).
struct NpyChunks {
    /// The channel, the stall limit and the request's cancel token; `None` once the client is
    /// given up on (its frames then dropped).
    to: Option<(Stream, CancelToken)>,
    /// Whether a client that left fails the decode (else its frames are dropped: a group whose
    /// ranks cannot be replaced must not be aborted).
    fail_when_gone: bool,
}

/// How often a chunk waiting for a slow client retries.
const STALL_POLL: Duration = Duration::from_millis(5);

impl FrameSink for NpyChunks {
    fn begin(&mut self, _dims: &[usize]) -> Result<(), SinkError> {
        Ok(())
    }

    fn frames(&mut self, _first: usize, run: Tensor) -> Result<(), SinkError> {
        let Some((stream, token)) = &self.to else { return Ok(()) };
        let mut bytes = io::npy_bytes(&run)?;
        let deadline = Instant::now() + stream.stall;
        let gone = loop {
            match stream.to.try_send(bytes) {
                Ok(()) => return Ok(()),
                Err(mpsc::error::TrySendError::Closed(_)) => break "the client disconnected".to_string(),
                Err(mpsc::error::TrySendError::Full(back)) => bytes = back,
            }
            if token.is_cancelled() {
                break token.reason().unwrap_or_else(|| "the request was cancelled".into());
            }
            if Instant::now() >= deadline {
                break format!("the client reads its frames too slowly (none taken in {} s)", stream.stall.as_secs());
            }
            std::thread::sleep(STALL_POLL);
        };
        // Given up on: the rest of its frames are dropped, or the decode fails.
        self.to = None;
        if self.fail_when_gone { Err(gone.into()) } else { Ok(()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_queue_whose_thread_ended_refuses_as_gone_and_unready() {
        let (queue, jobs) = std::sync::mpsc::sync_channel(1);
        drop(jobs);
        let ready = Arc::new(AtomicBool::new(true));
        let engine = Engine {
            queue,
            metrics: Arc::new(Metrics::default()),
            ready: Arc::clone(&ready),
            stop: Arc::new(AtomicBool::new(false)),
        };
        let input = Tensor::seeded_uniform([1, 4, 2, 2], 1, -1.0, 1.0, &crate::Device::Cpu).unwrap();
        let (reply, _answer) = oneshot::channel();
        let job = Job {
            kind: Kind::Decode,
            options: RequestOptions::default(),
            input,
            stream: None,
            cancel: CancelToken::new(),
            reply,
            arrived: Instant::now(),
        };
        assert!(matches!(engine.submit(job), Err(Refused::Gone)));
        assert!(!ready.load(Ordering::Relaxed));
        assert_eq!(engine.metrics.queued.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_panics_message_is_its_text() {
        let caught = std::panic::catch_unwind(|| panic!("boom {}", 7)).unwrap_err();
        assert_eq!(panic_message(caught.as_ref()), "boom 7");
        let caught = std::panic::catch_unwind(|| std::panic::panic_any(3_u8)).unwrap_err();
        assert_eq!(panic_message(caught.as_ref()), "(no message)");
    }
}
