//! [`Group`]: the ranks a request runs on, and the one place that runs a request there.
//!
//! A group is local ranks (threads of this process, each on a thread pool of its own), or
//! this process as one rank of a group of processes (sockets, or NCCL with a GPU each) joined
//! from the environment or from a communicator the caller already holds. Whatever the kind,
//! [`Group::run`] owns what callers would otherwise get wrong: every rank runs the same
//! request in the same order (one at a time), a rank whose failure the others cannot know of
//! aborts the group so that nobody waits for it (the abort rule), a panic becomes an error
//! naming its rank, the owner's result is the one returned (rank 0's; on a process rank its
//! own), every rank's report is gathered to the owner, and a [`CancelToken`] stops a request
//! at the next tile, frame or collective.

use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};

use vae_runtime::{DistributedVaeExecutor, ExecOutput, FrameSink, ProgressScope, ProgressSink};
use vae_tensor::Tensor;
use vae_transport::{Communicator, NcclComm, SocketComm, SocketOptions, TransportConfig};

use crate::error::{Error, Result};
use crate::local_ranks::{RankPools, pool_threads};
use crate::options::{Decode, Encode, Options};
use crate::report::{RequestReport, gather_summaries};
use crate::vae::Vae;

/// Stops a request in flight: every rank aborts at its next tile, frame or collective, and the
/// request fails with `reason`. Made per request and handed to [`Request::cancel_on`]; clones
/// share it, so another thread (a signal handler's poller, a server whose client went away)
/// can cancel. A token cancelled before its request starts stops it as soon as it starts.
///
/// A group of processes cannot serve requests after one was cancelled (its links are
/// aborted); a local group makes fresh links for each request and can.
#[derive(Clone, Default)]
pub struct CancelToken(Arc<CancelState>);

#[derive(Default)]
struct CancelState {
    reason: Mutex<Option<String>>,
    /// The communicators of the request in flight; emptied when it ends, so that a late
    /// cancel (a client that leaves after its answer) aborts nothing.
    comms: Mutex<Vec<Arc<dyn Communicator>>>,
}

impl std::fmt::Debug for CancelToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CancelToken").field("cancelled", &self.is_cancelled()).finish()
    }
}

impl CancelToken {
    /// A token that has not been cancelled.
    pub fn new() -> Self {
        Self::default()
    }

    /// Cancels the request: its ranks stop and it fails with `reason`.
    pub fn cancel(&self, reason: &str) {
        let mut held = self.0.reason.lock().unwrap_or_else(|e| e.into_inner());
        held.get_or_insert_with(|| reason.to_string());
        for comm in self.0.comms.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            comm.abort(reason);
        }
    }

    /// Whether [`Self::cancel`] was called.
    pub fn is_cancelled(&self) -> bool {
        self.0.reason.lock().unwrap_or_else(|e| e.into_inner()).is_some()
    }

    /// The reason given to [`Self::cancel`], if it was called.
    pub fn reason(&self) -> Option<String> {
        self.0.reason.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The request ended: its communicators are let go, and a cancel from now on aborts
    /// nothing (a group of processes outlives a request that finished).
    fn release(&self) {
        self.0.comms.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    /// A rank's communicator of the request, aborted at once if the token was cancelled.
    fn enlist(&self, comm: &Arc<dyn Communicator>) {
        self.0.comms.lock().unwrap_or_else(|e| e.into_inner()).push(Arc::clone(comm));
        if let Some(reason) = self.0.reason.lock().unwrap_or_else(|e| e.into_inner()).as_deref() {
            comm.abort(reason);
        }
    }
}

/// What a request does, on which input.
enum Work<'a> {
    Decode(&'a Tensor, &'a Decode),
    Encode(&'a Tensor, &'a Encode),
    /// A streamed decode: the sink is taken by the owner's rank.
    DecodeTo(&'a Tensor, &'a Decode, Mutex<Option<&'a mut (dyn FrameSink + Send)>>),
}

/// One request for [`Group::run`]: a decode, an encode or a streamed decode, and optionally the
/// token that cancels it and where the owner's progress goes.
pub struct Request<'a> {
    work: Work<'a>,
    cancel: Option<&'a CancelToken>,
    progress: Option<ProgressSink>,
}

impl<'a> Request<'a> {
    /// Decodes `latent` (`[B, C, H, W]` images, `[B, C, T, H, W]` video) into pixels in [-1, 1].
    pub fn decode(latent: &'a Tensor, options: &'a Decode) -> Self {
        Self { work: Work::Decode(latent, options), cancel: None, progress: None }
    }

    /// Encodes `image` (pixels in [-1, 1]) into latents (or moments).
    pub fn encode(image: &'a Tensor, options: &'a Encode) -> Self {
        Self { work: Work::Encode(image, options), cancel: None, progress: None }
    }

    /// Decodes a video latent with its output frames handed to `sink` as they are decoded (the
    /// owner's sink; on the other ranks of a group of processes it is never called).
    pub fn decode_to(latent: &'a Tensor, options: &'a Decode, sink: &'a mut (dyn FrameSink + Send)) -> Self {
        Self { work: Work::DecodeTo(latent, options, Mutex::new(Some(sink))), cancel: None, progress: None }
    }

    /// Stops the request when `token` is cancelled.
    pub fn cancel_on(mut self, token: &'a CancelToken) -> Self {
        self.cancel = Some(token);
        self
    }

    /// Sends the owner's progress (its tiles, and the frames or chunks of the tile or band it
    /// computes: [`vae_runtime::progress`]) to `sink`; `None` sends it nowhere.
    pub fn progress(mut self, sink: Option<ProgressSink>) -> Self {
        self.progress = sink;
        self
    }

    fn options(&self) -> &Options {
        match &self.work {
            Work::Decode(_, o) | Work::DecodeTo(_, o, _) => o,
            Work::Encode(_, o) => o,
        }
    }

    fn streamed(&self) -> bool {
        matches!(self.work, Work::DecodeTo(..))
    }
}

/// What a request leaves on this process.
#[derive(Debug, Default)]
#[non_exhaustive]
pub struct Finished {
    /// The output on the ranks it goes to (the owner, rank 0, or every rank as the request's
    /// placement says; on a local group, rank 0's); `None` on a rank it does not go to, and
    /// for a streamed decode, whose frames went to the sink.
    pub output: Option<Tensor>,
    /// Every rank's part of the request, on the owner (`None` elsewhere, and for a streamed
    /// decode on one rank, which runs outside the executor).
    pub report: Option<RequestReport>,
    /// The most tensor memory this process's rank (rank 0 of a local group) held for the
    /// request beyond what was alive when it started, bytes.
    pub peak_bytes: u64,
}

/// The ranks of a group: its kind decides how a request reaches them.
enum Ranks {
    /// Threads of this process, each on a pool of its own; a fresh local group per request.
    Local(RankPools),
    /// This process is one rank of a group it joined; every rank runs each request.
    Joined(Arc<dyn Communicator>),
}

/// The ranks requests run on: local threads, or this process as one rank of a group of
/// processes. Requests run one at a time (calls from several threads wait for the one in
/// flight; a request must not be made from inside [`Group::run_on_ranks`]'s body, which holds
/// the group); the same [`Vae`] serves every rank of a local group. On an NCCL group a rank's
/// abort reaches only itself (NCCL has no abort across ranks): a failure on one rank that the
/// others cannot know of leaves them waiting until their collective times out.
///
/// ```
/// # let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../fixtures/autoencoder_kl/sd_like");
/// use vae_parallel::{Decode, Device, Group, Tensor, Vae};
///
/// let vae = Vae::load(dir)?;
/// let group = Group::local(4)?;
/// let latent = Tensor::seeded_uniform([1, 4, 16, 16], 1, -1.0, 1.0, &Device::Cpu)?;
/// // The untiled decode, split exactly over the 4 ranks; rank 0 receives it.
/// let image = group.decode(&vae, &latent, &Decode::default())?.expect("rank 0 holds the output");
/// // The same pixels on one rank.
/// let alone = Group::local(1)?.decode(&vae, &latent, &Decode::default())?.unwrap();
/// assert_eq!(image.to_vec_f32()?, alone.to_vec_f32()?);
/// # Ok::<(), vae_parallel::Error>(())
/// ```
pub struct Group {
    ranks: Ranks,
    config: TransportConfig,
    /// Held while a request runs: one at a time, in every rank's order.
    busy: Mutex<()>,
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Group").field("size", &self.size()).field("backend", &self.backend()).finish()
    }
}

/// How to build a local [`Group`]: `Group::local_builder(ranks)`, the settings, then
/// [`LocalGroupBuilder::build`].
#[derive(Debug, Clone)]
#[must_use]
pub struct LocalGroupBuilder {
    ranks: usize,
    threads: Option<usize>,
    threads_per_rank: Option<usize>,
    config: Option<TransportConfig>,
}

impl LocalGroupBuilder {
    /// The compute threads the ranks share (default: rayon's global pool's, all cores unless
    /// [`crate::init`] said otherwise). Each rank's pool holds twice its even share of them,
    /// all of them at most: the operating system shares the cores among the ranks that are
    /// busy, and a rank left alone with the most work keeps up to twice its share busy.
    pub fn threads(mut self, threads: usize) -> Self {
        self.threads = Some(threads);
        self
    }

    /// Exactly this many threads in each rank's pool, instead of a share of
    /// [`Self::threads`] (a benchmark that fixes each rank's threads).
    pub fn threads_per_rank(mut self, threads: usize) -> Self {
        self.threads_per_rank = Some(threads);
        self
    }

    /// Timeouts of the group's collectives (default: [`TransportConfig::from_env`]).
    pub fn transport_config(mut self, config: TransportConfig) -> Self {
        self.config = Some(config);
        self
    }

    /// Starts the ranks' pools.
    pub fn build(self) -> Result<Group> {
        if self.ranks == 0 {
            return Err(Error::invalid_option("`ranks` must be at least 1"));
        }
        if self.threads == Some(0) || self.threads_per_rank == Some(0) {
            return Err(Error::invalid_option("`threads` must be at least 1"));
        }
        let config = match self.config {
            Some(config) => config,
            None => TransportConfig::from_env()?,
        };
        config.validate()?;
        let each = self.threads_per_rank.unwrap_or_else(|| pool_threads(self.threads, self.ranks));
        let pools = RankPools::new(self.ranks, each)?;
        Ok(Group { ranks: Ranks::Local(pools), config, busy: Mutex::new(()) })
    }
}

impl Group {
    /// `ranks` local ranks: threads of this process, sharing its cores
    /// ([`LocalGroupBuilder::threads`]).
    pub fn local(ranks: usize) -> Result<Self> {
        Self::local_builder(ranks).build()
    }

    /// A builder for local ranks with other threads or timeouts.
    pub fn local_builder(ranks: usize) -> LocalGroupBuilder {
        LocalGroupBuilder { ranks, threads: None, threads_per_rank: None, config: None }
    }

    /// Joins, as one rank, the socket group the environment describes (`VAE_RANK`,
    /// `VAE_WORLD_SIZE`, `VAE_MASTER_ADDR`, or torchrun's `RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
    /// `MASTER_PORT`; a `VAE_GROUP_SECRET` on TCP). Every process of the group must then make
    /// the same requests in the same order; returns once every rank has joined.
    pub fn from_env() -> Result<Self> {
        Self::join(&SocketOptions::from_env()?)
    }

    /// Joins a socket group as `options` say (a rank, the world size, rank 0's address).
    pub fn join(options: &SocketOptions) -> Result<Self> {
        let comm = SocketComm::connect(options)?;
        Ok(Self::from_communicator(Arc::new(comm)))
    }

    /// Joins the group the environment describes ([`Self::from_env`]) and runs its
    /// collectives over NCCL ([`Self::nccl_join`]).
    pub fn nccl_from_env() -> Result<Self> {
        Self::nccl_join(&SocketOptions::from_env()?)
    }

    /// Joins a socket group as `options` say and runs its collectives over NCCL, this rank on
    /// GPU `cuda:LOCAL_RANK` (torchrun's) or else `cuda:RANK`. Every rank gets the same verdict
    /// from the bootstrap, so all fail together (and none waits inside NCCL) when one cannot
    /// open its GPU.
    pub fn nccl_join(options: &SocketOptions) -> Result<Self> {
        let socket = SocketComm::connect(options)?;
        let gpu = crate::launch::local_rank().unwrap_or(socket.rank());
        let nccl = NcclComm::from_bootstrap(&socket, gpu)?;
        Ok(Self::from_communicator(Arc::new(nccl)))
    }

    /// This process as the rank `comm` says, of the group `comm` links (an engine's own
    /// communicator, say). Every rank of it must make the same requests in the same order.
    pub fn from_communicator(comm: Arc<dyn Communicator>) -> Self {
        Self { ranks: Ranks::Joined(comm), config: TransportConfig::default(), busy: Mutex::new(()) }
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        match &self.ranks {
            Ranks::Local(pools) => pools.ranks(),
            Ranks::Joined(comm) => comm.size(),
        }
    }

    /// This process's rank (0 for a local group, whose ranks are its threads).
    pub fn rank(&self) -> usize {
        match &self.ranks {
            Ranks::Local(_) => 0,
            Ranks::Joined(comm) => comm.rank(),
        }
    }

    /// The transport: `local`, `socket`, `nccl`, or the name a caller's communicator gives.
    pub fn backend(&self) -> &'static str {
        match &self.ranks {
            Ranks::Local(_) => "local",
            Ranks::Joined(comm) => comm.backend(),
        }
    }

    /// Whether the ranks are threads of this process.
    pub fn is_local(&self) -> bool {
        matches!(self.ranks, Ranks::Local(_))
    }

    /// The compute threads of each rank: a local rank's pool, or this process's (rayon's
    /// global pool).
    pub fn threads_per_rank(&self) -> usize {
        match &self.ranks {
            Ranks::Local(pools) => pools.threads_per_rank(),
            Ranks::Joined(_) => rayon::current_num_threads(),
        }
    }

    /// Why a group of processes can serve no more requests (a rank died, or a request was
    /// cancelled); `None` while it can, and always for a local group.
    pub fn failure(&self) -> Option<Error> {
        match &self.ranks {
            Ranks::Local(_) => None,
            Ranks::Joined(comm) => comm.failure().map(Error::from),
        }
    }

    /// Decodes `latent` on every rank; the pixels on the ranks the output goes to (the owner,
    /// rank 0, by default), `None` elsewhere.
    ///
    /// `latent` may be on the model's CUDA device (a tensor lent through DLPack, for one): on
    /// a group of one rank, untiled, it is decoded in place and the pixels stay on the device;
    /// otherwise it crosses to the host once and the pixels come back to the device once. The
    /// same holds for [`Self::encode`].
    pub fn decode(&self, vae: &Vae, latent: &Tensor, options: &Decode) -> Result<Option<Tensor>> {
        Ok(self.run(vae, Request::decode(latent, options))?.output)
    }

    /// Encodes `image` on every rank; the latent (or moments) on the ranks it goes to (every
    /// rank by default).
    pub fn encode(&self, vae: &Vae, image: &Tensor, options: &Encode) -> Result<Option<Tensor>> {
        Ok(self.run(vae, Request::encode(image, options))?.output)
    }

    /// Decodes a video latent with its output frames handed to `sink` as they are decoded: bit
    /// for bit the frames of [`Self::decode`], in any mode, without holding the whole video
    /// (for the families that stream: [`Vae::streams`]).
    pub fn decode_to(
        &self,
        vae: &Vae,
        latent: &Tensor,
        options: &Decode,
        sink: &mut (dyn FrameSink + Send),
    ) -> Result<()> {
        self.run(vae, Request::decode_to(latent, options, sink)).map(drop)
    }

    /// Runs one request on every rank and returns what this process holds of it: the output
    /// and, on the owner, the report. A failure on any rank fails the request on every rank;
    /// on a local group the error is rank 0's, or the first failed rank's (naming it) when
    /// rank 0's part succeeded.
    pub fn run(&self, vae: &Vae, request: Request<'_>) -> Result<Finished> {
        // A local group's ranks are all here: a request cancelled before it starts need not
        // start. A process's rank runs it, so that enlisting aborts the whole group.
        if let Some(token) = request.cancel
            && token.is_cancelled()
            && self.is_local()
        {
            return Err(Error::Runtime(vae_runtime::RuntimeError::Transport(vae_transport::TransportError::Aborted {
                rank: self.rank(),
                reason: token.reason().unwrap_or_default(),
            })));
        }
        let result = self.run_prepared(vae, |prepared| self.run_request(vae, prepared), &request);
        if let Some(token) = request.cancel {
            token.release();
        }
        result
    }

    /// What every rank would refuse alike (an invalid option, a mode the model cannot run, a
    /// latent the pipeline's normalisation does not fit) is refused here, before any collective:
    /// each process of a group refuses the same request on its own, and the group stays usable.
    /// The pipeline's normalisation is undone once, here, for every local rank.
    fn run_prepared(
        &self,
        vae: &Vae,
        run: impl FnOnce(&Request<'_>) -> Result<Finished>,
        request: &Request<'_>,
    ) -> Result<Finished> {
        let options = request.options();
        options.validate()?;
        vae.check_mode(options.mode)?;
        if let Work::Encode(_, encode) = &request.work {
            encode.validate()?;
        }
        let (latent, decode) = match &request.work {
            Work::Decode(z, o) | Work::DecodeTo(z, o, _) if o.latents_normalized => {
                let mut plain = (*o).clone();
                plain.latents_normalized = false;
                (vae.denormalize(z)?, plain)
            }
            _ => return run(request),
        };
        let work = match &request.work {
            Work::DecodeTo(_, _, sink) => {
                // The caller's sink, its trait object's lifetime shortened to the new request's.
                let sink = sink.lock().unwrap_or_else(|e| e.into_inner()).take();
                let sink = sink.map(|s| -> &mut (dyn FrameSink + Send) { s });
                Work::DecodeTo(&latent, &decode, Mutex::new(sink))
            }
            _ => Work::Decode(&latent, &decode),
        };
        run(&Request { work, cancel: request.cancel, progress: request.progress.clone() })
    }

    /// The request on every rank, its output checked on a local group.
    fn run_request(&self, vae: &Vae, request: &Request<'_>) -> Result<Finished> {
        let progress = request.progress.clone();
        let finished = self.run_on_ranks(|comm| {
            if let Some(token) = request.cancel {
                token.enlist(comm);
            }
            let _progress = progress.clone().filter(|_| comm.rank() == 0).map(ProgressScope::enter);
            vae_tensor::memory::reset_peak();
            let before = vae_tensor::memory::live_bytes();
            let finished = rank_work(vae, request, comm)?;
            let peak_bytes = vae_tensor::memory::peak_bytes().saturating_sub(before) as u64;
            Ok(Finished { peak_bytes, ..finished })
        })?;
        if self.is_local() && finished.output.is_none() && !request.streamed() {
            return Err(Error::Runtime(vae_runtime::RuntimeError::Protocol("the owner received no output".into())));
        }
        Ok(finished)
    }

    /// Aborts a group of processes with `reason`: every other rank's pending or next collective
    /// fails naming this rank and the reason, and the group serves no more requests. For a
    /// process that cannot take part in a request the others make (it failed to load the model,
    /// to read the input): better than leaving them waiting. Nothing for a local group, whose
    /// ranks start with each request.
    pub fn abort(&self, reason: &str) {
        if let Ranks::Joined(comm) = &self.ranks {
            comm.abort(reason);
        }
    }

    /// Runs `body` on every rank with the rank's communicator, under the group's rules: one at
    /// a time, a failure the other ranks cannot know of (a panic included) aborting the group
    /// with its reason, so that nobody waits for the rank or blames the wrong one. Returns this
    /// process's result: rank 0's for a local group, or, when rank 0's succeeded and another
    /// rank's failed, that rank's error naming it. [`Self::run`] is this with a request's work;
    /// call it directly to run other collective work on the group's ranks (a benchmark of the
    /// transport, a custom operator on [`DistributedVaeExecutor`]).
    pub fn run_on_ranks<R: Send>(&self, body: impl Fn(&Arc<dyn Communicator>) -> Result<R> + Sync) -> Result<R> {
        let _busy = self.busy.lock().unwrap_or_else(|e| e.into_inner());
        match &self.ranks {
            Ranks::Joined(comm) => on_rank(comm, &body),
            Ranks::Local(pools) => {
                let results =
                    pools.run(self.config, |comm| on_rank(&(Arc::new(comm) as Arc<dyn Communicator>), &body))?;
                let mut owner = None;
                let mut failure = None;
                for (rank, result) in results.into_iter().enumerate() {
                    let result = result.map_err(|message| Error::Panicked { rank, message }).and_then(|r| r);
                    match result {
                        Err(e) if rank == 0 => return Err(e),
                        Err(e) => failure = failure.or(Some(Error::OnRank { rank, source: Box::new(e) })),
                        Ok(out) if rank == 0 => owner = Some(out),
                        Ok(_) => {}
                    }
                }
                match (failure, owner) {
                    (Some(err), _) => Err(err),
                    (None, Some(out)) => Ok(out),
                    (None, None) => {
                        Err(Error::Runtime(vae_runtime::RuntimeError::Protocol("rank 0 returned nothing".into())))
                    }
                }
            }
        }
    }
}

/// One rank's `body`, under the abort rule: a failure the other ranks cannot know of (a panic
/// included) aborts the group with its reason.
fn on_rank<R>(comm: &Arc<dyn Communicator>, body: &(impl Fn(&Arc<dyn Communicator>) -> Result<R> + Sync)) -> Result<R> {
    let rank = comm.rank();
    let result = std::panic::catch_unwind(AssertUnwindSafe(|| body(comm))).unwrap_or_else(|payload| {
        Err(Error::Panicked { rank, message: vae_transport::panic_message(payload.as_ref()) })
    });
    if let Err(err) = &result
        && !err.known_to_all_ranks()
    {
        comm.abort(&err.to_line());
    }
    result
}

/// One rank's part of a request: the work, then every rank's report gathered to rank 0.
fn rank_work(vae: &Vae, request: &Request<'_>, comm: &Arc<dyn Communicator>) -> Result<Finished> {
    let options = request.options();
    options.validate()?;
    let executor = DistributedVaeExecutor::new(Arc::clone(comm), options.parallel_size.unwrap_or(comm.size()))?
        .with_tile_merge(options.tile_merge)
        .with_halo_overlap(options.halo_overlap);
    let out: Option<ExecOutput> = match &request.work {
        Work::Decode(latent, o) => Some(vae.decode_on(&executor, latent, o)?),
        Work::Encode(image, o) => Some(vae.encode_on(&executor, image, o)?),
        Work::DecodeTo(latent, o, sink) => {
            let mut sink = match comm.rank() {
                0 => sink.lock().unwrap_or_else(|e| e.into_inner()).take(),
                _ => None,
            };
            let sink = sink.as_mut().map(|s| &mut **s as &mut dyn FrameSink);
            vae.decode_streaming_on(&executor, latent, o, sink)?
        }
    };
    // A streamed decode on one rank ran outside the executor: no report.
    let Some(out) = out else { return Ok(Finished::default()) };
    let summaries = gather_summaries(comm.as_ref(), 0, &out.report)?;
    let report = summaries.map(|ranks| {
        RequestReport::from_owner(
            &options.mode.to_string(),
            &out.report,
            comm.as_ref(),
            executor.parallel_size(),
            ranks,
        )
    });
    Ok(Finished { output: out.tensor, report, peak_bytes: 0 })
}
