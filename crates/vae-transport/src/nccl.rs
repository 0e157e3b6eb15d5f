//! The `nccl` backend: the [`Communicator`] collectives over NCCL (cudarc, loaded at run time),
//! one rank per GPU: single-process multi-GPU ([`NcclComm::from_devices`], one thread per GPU)
//! or one process per GPU ([`NcclComm::from_bootstrap`], the NCCL unique id handed out over an
//! already-joined group such as the socket backend).
//!
//! The trait moves host bytes, so every collective stages its buffer through device memory:
//! variable-length contributions travel as a length exchange then an equal-length (padded)
//! collective; `gather` (NCCL has none) and paired exchanges are grouped `ncclSend`/`ncclRecv`
//! calls, lengths first, so only the root of a gather receives the gathered set. Device buffers skip
//! the staging: [`Communicator::exchange_device`] sends and receives them where they are (the
//! shard context's halos and maps). NCCL refuses two ranks on one GPU: several ranks on one GPU
//! use the `local` backend instead.
//!
//! Status: builds with no CUDA installed; ran with world size 1 on an H200 (a single GPU cannot
//! hold two NCCL ranks); several ranks run in CI against the fake driver and fake NCCL of
//! `cargo xtask gpu-emu`. NCCL has no timeouts of its own: a rank that dies mid-collective can
//! leave the others waiting (the socket backend's failure detection does not apply here), and
//! [`Communicator::abort`] marks this rank alone: NCCL has no channel to tell the others.

use std::sync::Arc;
use std::sync::Mutex;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};
use cudarc::nccl::{Comm, Id};

use crate::stats::StatsCounters;
use crate::{
    ByteBuf, CommStats, Communicator, CommunicatorExt, DataType, DeviceExchange, PeerExchange, ReduceOp, Result,
    TransportError,
};

/// One rank of an NCCL group.
pub struct NcclComm {
    /// Behind a lock: an NCCL communicator must not be used by two threads at once.
    comm: Mutex<Comm>,
    stream: Arc<CudaStream>,
    rank: usize,
    size: usize,
    stats: StatsCounters,
    /// Set by [`Communicator::abort`], or by the first failure inside NCCL: later calls fail
    /// with it (`Aborted`, or `Poisoned` holding the failure) instead of entering NCCL.
    failed: Mutex<Option<TransportError>>,
}

// SAFETY: `Comm` holds a raw `ncclComm_t`, which NCCL lets any thread use as long as calls are
// not concurrent; every use here goes through the `comm` mutex. The stream and counters are
// already thread-safe.
unsafe impl Send for NcclComm {}
// SAFETY: as above.
unsafe impl Sync for NcclComm {}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm").field("rank", &self.rank).field("size", &self.size).finish()
    }
}

fn unavailable(what: impl std::fmt::Display) -> TransportError {
    TransportError::Unavailable(format!("nccl: {what}"))
}

fn nccl_err(op: &str, e: impl std::fmt::Debug + 'static) -> TransportError {
    // cudarc's NcclError prints as just "NcclError": name its result code instead.
    let message = match (&e as &dyn std::any::Any).downcast_ref::<cudarc::nccl::result::NcclError>() {
        Some(nccl) => format!("{:?}", nccl.0),
        None => format!("{e:?}"),
    };
    TransportError::Io { rank: None, context: format!("nccl {op}"), message }
}

/// Checks that the CUDA driver and NCCL libraries can be loaded (cudarc panics otherwise).
fn check_libraries() -> Result<()> {
    if !loadable("cuda") {
        return Err(unavailable("no CUDA driver (libcuda.so was not found)"));
    }
    if !loadable("nccl") {
        return Err(unavailable(
            "libnccl.so was not found (pip wheels ship libnccl.so.2: link it as libnccl.so on LD_LIBRARY_PATH)",
        ));
    }
    Ok(())
}

/// Whether the shared library cudarc binds as `name` can be loaded under one of the names
/// cudarc's loader tries on Linux (`libNAME.so`, `.so.12` down to `.so.9`, `.so.1`). It stands
/// in for cudarc's `is_culib_present`, which exists only when cudarc loads libraries itself: a
/// build that holds candle's CUDA backend links them instead (cudarc's `dynamic-linking`, which
/// the workspace's `fallback-dynamic-loading` gives way to), and `dlopen` then finds the loaded
/// library by its soname. NCCL's soname, `libnccl.so.2`, is not among the names, under either
/// way of binding it (cudarc's loader does not try it): a `libnccl.so` link is needed.
fn loadable(name: &str) -> bool {
    let names = std::iter::once(format!("lib{name}.so"))
        .chain(["12", "11", "10", "9", "1"].map(|major| format!("lib{name}.so.{major}")));
    names.filter_map(|n| std::ffi::CString::new(n).ok()).any(|n| {
        // SAFETY: `dlopen` of a NUL-terminated name, and `dlclose` of the handle it gave, as
        // cudarc's own probe does.
        unsafe {
            let handle = libc::dlopen(n.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
            if handle.is_null() {
                return false;
            }
            libc::dlclose(handle);
            true
        }
    })
}

/// Device memory someone else owns, named by address ([`Communicator::exchange_device`]), in the
/// form cudarc's NCCL calls take. Its users order it by synchronising (the caller finished
/// writing it before the call; the call synchronises its stream before returning), so it
/// records no events.
struct Borrowed<'a> {
    address: u64,
    len: usize,
    stream: &'a Arc<CudaStream>,
}

impl DeviceSlice<u8> for Borrowed<'_> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }
}

impl DevicePtr<u8> for Borrowed<'_> {
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (cudarc::driver::sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.address, SyncOnDrop::Sync(None))
    }
}

impl DevicePtrMut<u8> for Borrowed<'_> {
    fn device_ptr_mut<'a>(&'a mut self, _stream: &'a CudaStream) -> (cudarc::driver::sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.address, SyncOnDrop::Sync(None))
    }
}

impl NcclComm {
    /// One communicator per GPU in `ordinals`, in one process (rank `i` on `ordinals[i]`); run
    /// each on its own thread.
    pub fn from_devices(ordinals: &[usize]) -> Result<Vec<Self>> {
        check_libraries()?;
        let streams = ordinals
            .iter()
            .map(|&o| {
                CudaContext::new(o).map(|c| c.default_stream()).map_err(|e| unavailable(format!("cuda:{o}: {e}")))
            })
            .collect::<Result<Vec<_>>>()?;
        let comms = Comm::from_devices(streams.clone()).map_err(|e| nccl_err("comm init", e))?;
        let size = comms.len();
        Ok(comms
            .into_iter()
            .zip(streams)
            .enumerate()
            .map(|(rank, (comm, stream))| Self::wrap(comm, stream, rank, size))
            .collect())
    }

    /// This process's rank of an NCCL group on GPU `ordinal`, with the same rank and size as
    /// `bootstrap` (an already-joined group, e.g. the socket backend): rank 0 makes the NCCL
    /// unique id and broadcasts it over `bootstrap`.
    pub fn from_bootstrap(bootstrap: &dyn Communicator, ordinal: usize) -> Result<Self> {
        // Every rank joins the broadcast, even one that cannot load NCCL, so nobody waits.
        let local = check_libraries();
        let mut id_bytes: Vec<u8> = match (&local, bootstrap.rank()) {
            (Ok(()), 0) => {
                let id = Id::new().map_err(|e| nccl_err("unique id", e))?;
                id.internal().iter().map(|c| *c as u8).collect()
            }
            _ => Vec::new(),
        };
        bootstrap.broadcast(0, &mut id_bytes)?;
        // NCCL's init blocks until every rank has joined, with no timeout: one rank that cannot
        // (no library, no such GPU) would hang the rest. So each rank first opens its device and
        // the group agrees over `bootstrap` that all did, before anyone enters NCCL.
        let ready = local.and_then(|()| {
            let internal: [std::ffi::c_char; 128] = id_bytes
                .iter()
                .map(|b| *b as std::ffi::c_char)
                .collect::<Vec<_>>()
                .try_into()
                .map_err(|_| unavailable("rank 0 could not make an NCCL unique id"))?;
            let ctx = CudaContext::new(ordinal).map_err(|e| unavailable(format!("cuda:{ordinal}: {e}")))?;
            Ok((internal, ctx.default_stream()))
        });
        let verdicts = bootstrap.all_gather(&[u8::from(ready.is_ok())])?;
        let (internal, stream) = ready?;
        let failed: Vec<usize> = (0..bootstrap.size()).filter(|&r| verdicts.part(r).first() != Some(&1)).collect();
        if !failed.is_empty() {
            return Err(unavailable(format!("rank(s) {failed:?} could not open their GPU or NCCL")));
        }
        let comm = Comm::from_rank(Arc::clone(&stream), bootstrap.rank(), bootstrap.size(), Id::uninit(internal))
            .map_err(|e| nccl_err("comm init", e))?;
        Ok(Self::wrap(comm, stream, bootstrap.rank(), bootstrap.size()))
    }

    fn wrap(comm: Comm, stream: Arc<CudaStream>, rank: usize, size: usize) -> Self {
        Self { comm: Mutex::new(comm), stream, rank, size, stats: StatsCounters::default(), failed: Mutex::new(None) }
    }

    fn comm(&self) -> std::sync::MutexGuard<'_, Comm> {
        self.comm.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs one operation: refused when the communicator failed or was aborted before; a
    /// failure inside it (anything but a caller error or a length mismatch, which every rank
    /// detects alike before moving data) leaves the communicator failed, as the other backends
    /// do, since the ranks may no longer agree on where they are.
    fn run<R>(&self, body: impl FnOnce() -> Result<R>) -> Result<R> {
        if let Some(first) = self.failed.lock().unwrap_or_else(|p| p.into_inner()).clone() {
            return Err(match first {
                aborted @ TransportError::Aborted { .. } => aborted,
                other => TransportError::Poisoned(Box::new(other)),
            });
        }
        let result = body();
        if let Err(e) = &result
            && !matches!(e, TransportError::InvalidArgument(_) | TransportError::LengthMismatch { .. })
        {
            self.failed.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert_with(|| e.clone());
        }
        result
    }

    fn upload(&self, bytes: &[u8], len: usize) -> Result<CudaSlice<u8>> {
        let mut padded = bytes.to_vec();
        padded.resize(len.max(1), 0);
        self.stream.clone_htod(&padded).map_err(|e| nccl_err("upload", e))
    }

    fn download(&self, d: &CudaSlice<u8>) -> Result<Vec<u8>> {
        self.stream.clone_dtoh(d).map_err(|e| nccl_err("download", e))
    }

    /// Runs `post` between `ncclGroupStart` and `ncclGroupEnd`, so that the sends and receives
    /// it posts complete together and no pair of ranks can deadlock on their order. cudarc's
    /// `Comm::group` unwraps `ncclGroupEnd`'s result in a destructor, which would panic when a
    /// peer fails; here the group is always closed and the first error returned.
    ///
    /// The buffers passed in must be used on this communicator's stream alone (they are: each is
    /// made on it, and read back on it): inside a group NCCL enqueues the operations only at
    /// `ncclGroupEnd`, after cudarc recorded the buffers' events, so another stream ordered by
    /// those events alone would not wait for them.
    fn grouped(&self, post: impl FnOnce(&Comm) -> Result<()>) -> Result<()> {
        let comm = self.comm();
        cudarc::nccl::group_start().map_err(|e| nccl_err("group start", e))?;
        let posted = post(&comm);
        let ended = cudarc::nccl::group_end().map_err(|e| nccl_err("group end", e));
        posted.and(ended.map(drop))
    }

    /// Sends each leg's words to its peer and receives as many words back from it, grouped so
    /// that no pair of ranks can deadlock on the order of their legs.
    fn swap_words(&self, legs: Vec<(usize, Vec<u64>)>) -> Result<Vec<Vec<u64>>> {
        let sends: Vec<CudaSlice<u64>> = legs
            .iter()
            .map(|(_, words)| self.stream.clone_htod(words).map_err(|e| nccl_err("upload", e)))
            .collect::<Result<_>>()?;
        let mut recvs: Vec<CudaSlice<u64>> = legs
            .iter()
            .map(|(_, words)| self.stream.alloc_zeros::<u64>(words.len()).map_err(|e| nccl_err("alloc", e)))
            .collect::<Result<_>>()?;
        self.grouped(|comm| {
            for ((peer, _), (s, r)) in legs.iter().zip(sends.iter().zip(recvs.iter_mut())) {
                comm.send(s, *peer as i32).map_err(|e| nccl_err("send", e))?;
                comm.recv(r, *peer as i32).map_err(|e| nccl_err("recv", e))?;
            }
            Ok(())
        })?;
        recvs.iter().map(|d| self.stream.clone_dtoh(d).map_err(|e| nccl_err("download", e))).collect()
    }

    /// Every rank's `u64`, in rank order.
    fn all_gather_u64(&self, v: u64) -> Result<Vec<u64>> {
        let send = self.stream.clone_htod(&[v]).map_err(|e| nccl_err("upload", e))?;
        let mut recv = self.stream.alloc_zeros::<u64>(self.size).map_err(|e| nccl_err("alloc", e))?;
        self.comm().all_gather(&send, &mut recv).map_err(|e| nccl_err("all_gather", e))?;
        self.stream.clone_dtoh(&recv).map_err(|e| nccl_err("download", e))
    }

    /// Paired host-buffer sends and receives (lengths first, then the payloads, grouped):
    /// the exchanges, and the gather. Returns the bytes sent and received.
    fn send_recv(&self, legs: &mut [PeerExchange<'_>]) -> Result<(usize, usize)> {
        if let Some(bad) = legs.iter().find(|l| l.peer >= self.size || l.peer == self.rank) {
            return Err(TransportError::InvalidArgument(format!(
                "exchange with rank {} from rank {}",
                bad.peer, self.rank
            )));
        }
        let lens: Vec<usize> = self
            .swap_words(legs.iter().map(|l| (l.peer, vec![l.send.len() as u64])).collect())?
            .into_iter()
            .map(|words| words[0] as usize)
            .collect();
        let sends: Vec<CudaSlice<u8>> =
            legs.iter().map(|l| self.upload(l.send, l.send.len())).collect::<Result<_>>()?;
        let mut recvs: Vec<CudaSlice<u8>> = lens
            .iter()
            .map(|&n| self.stream.alloc_zeros::<u8>(n.max(1)).map_err(|e| nccl_err("alloc", e)))
            .collect::<Result<_>>()?;
        self.grouped(|comm| {
            for (((leg, s), r), &n) in legs.iter().zip(&sends).zip(recvs.iter_mut()).zip(&lens) {
                if !leg.send.is_empty() {
                    comm.send(&s.slice(..leg.send.len()), leg.peer as i32).map_err(|e| nccl_err("send", e))?;
                }
                if n > 0 {
                    comm.recv(&mut r.slice_mut(..n), leg.peer as i32).map_err(|e| nccl_err("recv", e))?;
                }
            }
            Ok(())
        })?;
        let (mut sent, mut received) = (0, 0);
        for ((leg, r), &n) in legs.iter_mut().zip(&recvs).zip(&lens) {
            let bytes = self.download(r)?;
            leg.recv.assign_concat(&[&bytes[..n]])?;
            sent += leg.send.len();
            received += n;
        }
        Ok((sent, received))
    }

    /// The padded all_gather behind `all_gather_bytes` and `all_reduce_bytes`: each rank's bytes.
    fn gather_all(&self, send: &[u8]) -> Result<Vec<Vec<u8>>> {
        let lens = self.all_gather_u64(send.len() as u64)?;
        let max = lens.iter().copied().max().unwrap_or(0) as usize;
        let d_send = self.upload(send, max)?;
        let mut d_recv = self.stream.alloc_zeros::<u8>(max.max(1) * self.size).map_err(|e| nccl_err("alloc", e))?;
        self.comm().all_gather(&d_send, &mut d_recv).map_err(|e| nccl_err("all_gather", e))?;
        let all = self.download(&d_recv)?;
        Ok(lens.iter().enumerate().map(|(r, &len)| all[r * max.max(1)..][..len as usize].to_vec()).collect())
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn backend(&self) -> &'static str {
        "nccl"
    }

    fn all_gather_bytes(&self, _dtype: DataType, send: &[u8], recv: &mut dyn ByteBuf) -> Result<Vec<usize>> {
        self.run(|| {
            let parts = self.gather_all(send)?;
            let refs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
            recv.assign_concat(&refs)?;
            let received: usize = parts.iter().map(Vec::len).sum();
            self.stats.all_gather.record(send.len() * (self.size - 1), received.saturating_sub(send.len()));
            Ok(parts.iter().map(Vec::len).collect())
        })
    }

    fn gather_bytes(
        &self,
        root: usize,
        _dtype: DataType,
        send: &[u8],
        recv: &mut dyn ByteBuf,
    ) -> Result<Option<Vec<usize>>> {
        self.run(|| {
            if root >= self.size {
                return Err(TransportError::InvalidArgument(format!("gather root {root} in a group of {}", self.size)));
            }
            // Point to point: each rank sends the root its bytes and the root receives N − 1
            // parts, so nobody but the root holds (or moves) the gathered set.
            if self.rank != root {
                let mut nothing = Vec::<u8>::new();
                self.send_recv(&mut [PeerExchange { peer: root, send, recv: &mut nothing }])?;
                self.stats.gather.record(send.len(), 0);
                return Ok(None);
            }
            let mut parts: Vec<Vec<u8>> = vec![Vec::new(); self.size];
            let mut legs: Vec<PeerExchange<'_>> = parts
                .iter_mut()
                .enumerate()
                .filter(|(peer, _)| *peer != root)
                .map(|(peer, part)| PeerExchange { peer, send: &[], recv: part })
                .collect();
            let (_, received) = self.send_recv(&mut legs)?;
            drop(legs);
            parts[root] = send.to_vec();
            self.stats.gather.record(0, received);
            let refs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
            recv.assign_concat(&refs)?;
            Ok(Some(parts.iter().map(Vec::len).collect()))
        })
    }

    fn broadcast_bytes(&self, root: usize, _dtype: DataType, buf: &mut dyn ByteBuf) -> Result<()> {
        self.run(|| {
            if root >= self.size {
                return Err(TransportError::InvalidArgument(format!(
                    "broadcast root {root} in a group of {}",
                    self.size
                )));
            }
            let mut len = self.stream.clone_htod(&[buf.as_bytes().len() as u64]).map_err(|e| nccl_err("upload", e))?;
            self.comm().broadcast_in_place(&mut len, root as i32).map_err(|e| nccl_err("broadcast", e))?;
            let len = self.stream.clone_dtoh(&len).map_err(|e| nccl_err("download", e))?[0] as usize;
            let mut data = self.upload(if self.rank == root { buf.as_bytes() } else { &[] }, len)?;
            self.comm().broadcast_in_place(&mut data, root as i32).map_err(|e| nccl_err("broadcast", e))?;
            let bytes = self.download(&data)?;
            buf.assign_concat(&[&bytes[..len]])?;
            self.stats.broadcast.record(
                if self.rank == root { len * (self.size - 1) } else { 0 },
                if self.rank == root { 0 } else { len },
            );
            Ok(())
        })
    }

    fn all_reduce_bytes(&self, dtype: DataType, op: ReduceOp, buf: &mut [u8]) -> Result<()> {
        self.run(|| {
            // Every rank's buffer, reduced here in rank order: bit-identical to the other backends
            // (NCCL's own reduction order depends on its ring or tree). The buffers are small
            // (statistics, flags), so gathering them costs nothing that matters.
            let parts = self.gather_all(buf)?;
            // Every rank sees every length, so all of them refuse a mismatch alike.
            if let Some((r, part)) = parts.iter().enumerate().find(|(_, p)| p.len() != buf.len()) {
                return Err(TransportError::LengthMismatch {
                    op: "all_reduce",
                    local_rank: self.rank,
                    local: buf.len(),
                    rank: r,
                    remote: part.len(),
                });
            }
            if !buf.len().is_multiple_of(dtype.size_in_bytes()) {
                return Err(TransportError::InvalidArgument(format!("{} bytes are not {dtype} elements", buf.len())));
            }
            let refs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
            crate::mesh::reduce_into(dtype, op, &refs, buf);
            let moved = buf.len() * (self.size - 1);
            self.stats.all_reduce.record(moved, moved);
            Ok(())
        })
    }

    fn exchange_bytes(&self, _dtype: DataType, legs: &mut [PeerExchange<'_>]) -> Result<()> {
        self.run(|| {
            let (sent, received) = self.send_recv(legs)?;
            self.stats.exchange.record(sent, received);
            Ok(())
        })
    }

    fn exchanges_device_buffers(&self, ordinal: usize) -> bool {
        self.stream.context().ordinal() == ordinal
    }

    unsafe fn exchange_device(&self, legs: &[DeviceExchange]) -> Result<()> {
        self.run(|| {
            let ordinal = self.stream.context().ordinal();
            for leg in legs {
                if leg.peer >= self.size || leg.peer == self.rank {
                    return Err(TransportError::InvalidArgument(format!(
                        "exchange with rank {} from rank {}",
                        leg.peer, self.rank
                    )));
                }
                if let Some(b) = [leg.send, leg.recv].into_iter().find(|b| b.ordinal != ordinal) {
                    return Err(TransportError::InvalidArgument(format!(
                        "rank {} exchanges over cuda:{ordinal}, not a buffer on cuda:{}",
                        self.rank, b.ordinal
                    )));
                }
            }
            // Each side of a pair tells the other what it sends and what it expects, so both sides
            // agree whether the pair matches.
            let theirs: Vec<(usize, usize)> = self
                .swap_words(legs.iter().map(|l| (l.peer, vec![l.send.len as u64, l.recv.len as u64])).collect())?
                .into_iter()
                .map(|words| (words[0] as usize, words[1] as usize))
                .collect();
            // A mismatched pair still moves the shorter length both sides compute alike, so that
            // neither waits for bytes that never come (NCCL would wait forever), then both fail.
            let counts: Vec<(usize, usize)> = legs
                .iter()
                .zip(&theirs)
                .map(|(l, &(their_send, their_recv))| (l.send.len.min(their_recv), their_send.min(l.recv.len)))
                .collect();
            self.grouped(|comm| {
                for (leg, &(send, recv)) in legs.iter().zip(&counts) {
                    if send > 0 {
                        let data = Borrowed { address: leg.send.address, len: send, stream: &self.stream };
                        comm.send(&data, leg.peer as i32).map_err(|e| nccl_err("send", e))?;
                    }
                    if recv > 0 {
                        let mut into = Borrowed { address: leg.recv.address, len: recv, stream: &self.stream };
                        comm.recv(&mut into, leg.peer as i32).map_err(|e| nccl_err("recv", e))?;
                    }
                }
                Ok(())
            })?;
            self.stream.synchronize().map_err(|e| nccl_err("synchronize", e))?;
            let (sent, received) = counts.iter().fold((0, 0), |(s, r), &(cs, cr)| (s + cs, r + cr));
            self.stats.exchange.record(sent, received);
            for (leg, &(their_send, their_recv)) in legs.iter().zip(&theirs) {
                let (local, remote) = if their_send != leg.recv.len {
                    (leg.recv.len, their_send)
                } else if their_recv != leg.send.len {
                    (leg.send.len, their_recv)
                } else {
                    continue;
                };
                return Err(TransportError::LengthMismatch {
                    op: "exchange_device",
                    local_rank: self.rank,
                    local,
                    rank: leg.peer,
                    remote,
                });
            }
            Ok(())
        })
    }

    fn barrier(&self) -> Result<()> {
        self.run(|| {
            self.all_gather_u64(0)?;
            self.stats.barrier.record(0, 0);
            Ok(())
        })
    }

    fn abort(&self, reason: &str) {
        let mut failed = self.failed.lock().unwrap_or_else(|p| p.into_inner());
        if failed.is_none() {
            tracing::error!(rank = self.rank, "nccl rank aborted: {reason}");
            *failed = Some(TransportError::Aborted { rank: self.rank, reason: reason.to_string() });
        }
    }

    fn stats(&self) -> CommStats {
        self.stats.snapshot()
    }
}

/// Whether an NCCL group can be made on this machine, or why not (for reports and tests).
pub fn nccl_available() -> std::result::Result<(), String> {
    check_libraries().map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_nccl_or_a_gpu_making_a_group_is_a_clear_error() {
        if nccl_available().is_ok() {
            return; // a GPU machine: the GPU tests cover it
        }
        let err = NcclComm::from_devices(&[0]).unwrap_err();
        assert!(matches!(err, TransportError::Unavailable(_)), "{err}");
        assert!(err.to_string().contains("nccl"), "{err}");
    }

    #[test]
    fn bootstrapping_without_nccl_fails_on_every_rank_and_leaves_the_group_usable() {
        if nccl_available().is_ok() {
            return; // a GPU machine: the GPU tests cover it
        }
        let results = crate::run_local(3, crate::TransportConfig::default(), |boot| {
            let err = NcclComm::from_bootstrap(&boot, boot.rank()).unwrap_err();
            assert!(matches!(err, TransportError::Unavailable(_)), "{err}");
            // Nobody is stuck in NCCL: the bootstrap group still runs collectives.
            boot.all_gather(&[boot.rank() as u64]).unwrap().part(2).to_vec()
        })
        .unwrap();
        for r in results {
            assert_eq!(r.unwrap(), vec![2]);
        }
    }
}
