//! The NCCL backend on the GPUs of the machine: real ones, or the fake driver's with the fake
//! NCCL of `cargo xtask gpu-emu` (FAKE_CUDA_DEVICE_COUNT devices). Every world size from 1 to
//! the number of GPUs runs as threads of this process, one rank per GPU as NCCL requires, and two
//! rank processes form a socket group and then an NCCL group from it; every collective's result
//! is checked to the byte, and bad calls must be typed errors on every rank. Under the fake, its
//! refusals (where real NCCL would corrupt memory or hang) and its reductions are checked too.
//! Skipped, with the reason, where NCCL or a GPU is missing.
#![cfg(feature = "nccl")]
#![allow(clippy::print_stderr, clippy::print_stdout)] // a skipped GPU test says so; rank processes report

mod common;

use std::ffi::c_void;
use std::io::Read;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
use cudarc::nccl::{result as nccl, sys};
use vae_transport::{
    Communicator, CommunicatorExt, DataType, NcclComm, PeerExchange, ReduceOp, SocketComm, TransportError,
    nccl_available,
};

/// One NCCL test at a time: two groups on one GPU at once can deadlock real NCCL.
static GPUS: Mutex<()> = Mutex::new(());

/// The GPU count and the lock on them, or `None` (having said why) where NCCL or a GPU is missing.
fn gpus() -> Option<(usize, MutexGuard<'static, ()>)> {
    if let Err(reason) = nccl_available() {
        eprintln!("nccl: skipped, {reason}");
        return None;
    }
    match CudaContext::device_count() {
        Ok(n) if n > 0 => Some((n as usize, GPUS.lock().unwrap_or_else(|p| p.into_inner()))),
        Ok(_) => {
            eprintln!("nccl: skipped, the CUDA driver reports no GPU");
            None
        }
        Err(e) => {
            eprintln!("nccl: skipped, the CUDA driver does not start: {e}");
            None
        }
    }
}

/// Whether the GPUs are the fake driver's (whose NCCL is the fake's, built beside it).
fn fake_gpus() -> bool {
    CudaContext::new(0).and_then(|c| c.name()).is_ok_and(|name| name.contains("kernels-emu"))
}

/// Runs `body` on every rank of an NCCL group on `ordinals` (rank r on `ordinals[r]`), each on
/// its own thread, which owns its rank: a rank that panics drops it, so that the others' waits
/// for it fail instead of hanging.
fn on_every_rank<R: Send>(ordinals: &[usize], body: impl Fn(&NcclComm) -> R + Sync) -> Vec<R> {
    let comms = NcclComm::from_devices(ordinals).unwrap_or_else(|e| panic!("an NCCL group on cuda:{ordinals:?}: {e}"));
    std::thread::scope(|s| {
        let body = &body;
        let handles: Vec<_> = comms.into_iter().map(|comm| s.spawn(move || body(&comm))).collect();
        handles.into_iter().map(|h| h.join().expect("a rank panicked")).collect()
    })
}

// ---------------------------------------------------------------- what the ranks send

/// Rank r's bytes for all_gather: uneven lengths, and rank 1 sends nothing.
fn bytes_of(r: usize) -> Vec<u8> {
    let len = if r == 1 { 0 } else { 2 * r + 3 };
    (0..len).map(|i| (r * 40 + i) as u8 ^ 0x5a).collect()
}

/// Rank r's floats: uneven lengths again (rank 2 sends none), so the padding of 4-byte elements
/// is exercised too.
fn floats_of(r: usize) -> Vec<f32> {
    let len = [3, 1, 0, 6, 2, 5, 4, 7][r % 8];
    (0..len).map(|i| (r * 100 + i) as f32 + 0.25).collect()
}

/// Rank r's words: r + 1 of them, with every bit of the high bytes set.
fn words_of(r: usize) -> Vec<u64> {
    (0..=r as u64).map(|i| u64::MAX - r as u64 * 1000 - i).collect()
}

/// The length of what `from` sends `to` in the exchange: a pair's two directions differ, and
/// rank 0 sends the rank before it (on a ring of more than two) or its one partner nothing.
fn leg_len(from: usize, to: usize, size: usize) -> usize {
    if size > 2 && to == (from + 1) % size {
        3 + from
    } else if from == 0 {
        0
    } else {
        6 + 2 * from
    }
}

/// What `from` sends `to`: every byte depends on both ranks and on its position.
fn leg(from: usize, to: usize, size: usize) -> Vec<u8> {
    (0..leg_len(from, to, size)).map(|i| (from * 53 + to * 17 + i * 3) as u8).collect()
}

/// Values whose sums are exact in any order (multiples of 1/4 far below 2^24), so that real
/// NCCL, which does not reduce in rank order, gives the same bits as the host.
fn reals(rank: usize, len: usize) -> Vec<f64> {
    (0..len).map(|i| ((rank * 7 + i * 3) % 23) as f64 * 0.25 - 2.0 - rank as f64).collect()
}

// ---------------------------------------------------------------- the checks

/// Every collective, each result checked exactly, then the traffic counters, then the bad calls,
/// which must fail on every rank with a typed error.
fn exercise(comm: &dyn Communicator) {
    let (rank, size) = (comm.rank(), comm.size());
    let at = format!("rank {rank} of {size}");
    let before = comm.stats();

    // all_gather of uneven contributions (one empty), in three element sizes.
    let all = comm.all_gather(&bytes_of(rank)).expect("all_gather u8");
    assert_eq!(all.len(), size, "{at}");
    for r in 0..size {
        assert_eq!(all.part(r), bytes_of(r).as_slice(), "all_gather u8, part {r}, {at}");
    }
    assert_eq!(all.as_flat(), (0..size).flat_map(bytes_of).collect::<Vec<_>>().as_slice(), "{at}");
    let all = comm.all_gather(&floats_of(rank)).expect("all_gather f32");
    for r in 0..size {
        assert_eq!(all.part(r), floats_of(r).as_slice(), "all_gather f32, part {r}, {at}");
    }
    let mut into = vec![7u64; 3];
    let counts = comm.all_gather_into(&words_of(rank), &mut into).expect("all_gather u64");
    assert_eq!(counts, (1..=size).collect::<Vec<_>>(), "{at}");
    assert_eq!(into, (0..size).flat_map(words_of).collect::<Vec<_>>(), "all_gather u64, {at}");

    // gather to the last rank and to rank 1 (roots other than 0 where there are any).
    for (root, floats) in [(size - 1, false), (1 % size, true)] {
        if floats {
            let got = comm.gather(root, &floats_of(rank)).expect("gather f32");
            assert_eq!(got.is_some(), rank == root, "{at}");
            if let Some(got) = got {
                (0..size).for_each(|r| assert_eq!(got.part(r), floats_of(r).as_slice(), "gather to {root}, {at}"));
            }
        } else {
            let got = comm.gather(root, &words_of(rank)).expect("gather u64");
            assert_eq!(got.is_some(), rank == root, "{at}");
            if let Some(got) = got {
                (0..size).for_each(|r| assert_eq!(got.part(r), words_of(r).as_slice(), "gather to {root}, {at}"));
            }
        }
    }

    // broadcast from the last rank (the others start with other lengths), of nothing, and from
    // rank 1.
    let root = size - 1;
    let sent: Vec<f64> = (0..5).map(|i| i as f64 * -1.5 + root as f64).collect();
    let mut b = if rank == root { sent.clone() } else { vec![-7.0; rank + 2] };
    comm.broadcast(root, &mut b).expect("broadcast f64");
    assert_eq!(b, sent, "broadcast from {root}, {at}");
    let mut empty = if rank == root { Vec::new() } else { vec![9u8; 4] };
    comm.broadcast(root, &mut empty).expect("broadcast of nothing");
    assert!(empty.is_empty(), "an empty broadcast from {root} leaves {empty:?} on {at}");
    let root = 1 % size;
    let mut w = if rank == root { words_of(5) } else { Vec::new() };
    comm.broadcast(root, &mut w).expect("broadcast u64");
    assert_eq!(w, words_of(5), "broadcast from {root}, {at}");

    // all_reduce, sum and max, of f32, f64 and u64 (sums wrap).
    let len = 37;
    let expect = |op: ReduceOp| -> Vec<f64> {
        (0..len)
            .map(|i| {
                let v = (0..size).map(|r| reals(r, len)[i]);
                if op == ReduceOp::Sum { v.sum() } else { v.fold(f64::MIN, f64::max) }
            })
            .collect()
    };
    for op in [ReduceOp::Sum, ReduceOp::Max] {
        let mut f: Vec<f32> = reals(rank, len).iter().map(|&v| v as f32).collect();
        comm.all_reduce(op, &mut f).expect("all_reduce f32");
        assert_eq!(f, expect(op).iter().map(|&v| v as f32).collect::<Vec<_>>(), "f32 {op}, {at}");
        let mut d = reals(rank, len);
        comm.all_reduce(op, &mut d).expect("all_reduce f64");
        assert_eq!(d, expect(op), "f64 {op}, {at}");
        let mine = |r: usize| [u64::MAX - r as u64, (r as u64) << 40 | 3, 1];
        let mut u = mine(rank);
        comm.all_reduce(op, &mut u).expect("all_reduce u64");
        let want: Vec<u64> = (0..3)
            .map(|i| {
                let v = (0..size).map(|r| mine(r)[i]);
                if op == ReduceOp::Sum { v.fold(0u64, u64::wrapping_add) } else { v.max().unwrap() }
            })
            .collect();
        assert_eq!(u.to_vec(), want, "u64 {op}, {at}");
    }

    // A paired exchange, two legs of different lengths per rank on a ring (one of them empty on
    // rank 0), then a line's halo exchange (no legs at all on a single rank).
    let (mut sent, mut received) = (0, 0);
    if size > 1 {
        let peers: Vec<usize> =
            if size == 2 { vec![1 - rank] } else { vec![(rank + 1) % size, (rank + size - 1) % size] };
        let sends: Vec<Vec<u8>> = peers.iter().map(|&p| leg(rank, p, size)).collect();
        let mut recvs: Vec<Vec<u8>> = peers.iter().map(|_| vec![0xee; 2]).collect();
        let mut legs: Vec<PeerExchange<'_>> = peers
            .iter()
            .zip(&sends)
            .zip(recvs.iter_mut())
            .map(|((&peer, send), recv)| PeerExchange { peer, send, recv })
            .collect();
        comm.exchange_bytes(DataType::U8, &mut legs).expect("exchange");
        drop(legs);
        for (&p, got) in peers.iter().zip(&recvs) {
            assert_eq!(got, &leg(p, rank, size), "exchange: what rank {p} sent {at}");
            received += got.len();
        }
        sent += sends.iter().map(Vec::len).sum::<usize>();
    }
    let to_prev = vec![rank as f32 + 0.5; rank + 1];
    let to_next = vec![-(rank as f32); 2 * rank + 3];
    let halo = comm.neighbour_exchange(&to_prev, &to_next).expect("neighbour_exchange");
    assert_eq!(halo.from_prev, (rank > 0).then(|| vec![-((rank - 1) as f32); 2 * rank + 1]), "{at}");
    assert_eq!(halo.from_next, (rank + 1 < size).then(|| vec![rank as f32 + 1.5; rank + 2]), "{at}");
    sent += 4 * (if rank > 0 { to_prev.len() } else { 0 } + if rank + 1 < size { to_next.len() } else { 0 });
    received += 4 * (halo.from_prev.map_or(0, |v| v.len()) + halo.from_next.map_or(0, |v| v.len()));

    comm.barrier().expect("barrier");

    // What was counted.
    let stats = comm.stats().since(&before);
    let others = |bytes: fn(usize) -> usize| (0..size).filter(|&r| r != rank).map(bytes).sum::<usize>() as u64;
    let mine = bytes_of(rank).len() + 4 * floats_of(rank).len() + 8 * words_of(rank).len();
    assert_eq!(stats.all_gather.calls, 3, "{at}");
    assert_eq!(stats.all_gather.bytes_sent, (mine * (size - 1)) as u64, "{at}");
    assert_eq!(
        stats.all_gather.bytes_received,
        others(|r| bytes_of(r).len() + 4 * floats_of(r).len() + 8 * words_of(r).len()),
        "{at}"
    );
    assert_eq!(stats.gather.calls, 2, "{at}");
    assert_eq!(stats.broadcast.calls, 3, "{at}");
    let (from_last, from_one) = (rank == size - 1, rank == 1 % size);
    let broadcast_sent = if from_last { 40 * (size - 1) } else { 0 } + if from_one { 48 * (size - 1) } else { 0 };
    let broadcast_received = if from_last { 0 } else { 40 } + if from_one { 0 } else { 48 };
    assert_eq!(stats.broadcast.bytes_sent, broadcast_sent as u64, "{at}");
    assert_eq!(stats.broadcast.bytes_received, broadcast_received as u64, "{at}");
    assert_eq!(stats.exchange.calls, if size > 1 { 2 } else { 1 }, "{at}");
    assert_eq!((stats.exchange.bytes_sent, stats.exchange.bytes_received), (sent as u64, received as u64), "{at}");
    assert_eq!(stats.barrier.calls, 1, "{at}");

    // Bad calls: typed errors on every rank, and nobody is left waiting.
    let mut sink = Vec::<u8>::new();
    for peer in [rank, size] {
        let err = comm
            .exchange_bytes(DataType::U8, &mut [PeerExchange { peer, send: &[1, 2], recv: &mut sink }])
            .expect_err("an exchange with itself or with a rank that does not exist");
        assert!(matches!(err, TransportError::InvalidArgument(_)), "exchange with {peer}, {at}: {err}");
    }
    let err = comm.broadcast(size, &mut vec![1u8]).expect_err("a broadcast from a rank that does not exist");
    assert!(matches!(err, TransportError::InvalidArgument(_)), "{at}: {err}");
    let err = comm.gather(size, &[1u8]).expect_err("a gather to a rank that does not exist");
    assert!(matches!(err, TransportError::InvalidArgument(_)), "{at}: {err}");
    if size > 1 {
        let mut uneven = vec![1.0f32; rank + 1];
        let err = comm.all_reduce(ReduceOp::Sum, &mut uneven).expect_err("an all_reduce of different lengths");
        assert!(
            matches!(err, TransportError::LengthMismatch { op: "all_reduce", local_rank, local: l, .. }
                if local_rank == rank && l == 4 * (rank + 1)),
            "{at}: {err}"
        );
    }
    // An aborted rank refuses what follows (every rank aborts: none waits for another).
    comm.abort("the test is over");
    let err = comm.barrier().expect_err("a barrier after abort");
    assert!(matches!(err, TransportError::Aborted { rank: r, .. } if r == rank), "{at}: {err}");
}

#[test]
fn every_collective_at_every_world_size_up_to_the_gpu_count() {
    let Some((gpus, _lock)) = gpus() else { return };
    for size in 1..=gpus {
        let start = Instant::now();
        on_every_rank(&(0..size).collect::<Vec<_>>(), |comm| {
            // The checks every backend must pass (tests/common), counters included; then this
            // backend's own, which end by aborting the rank.
            common::exercise_all_collectives(comm);
            exercise(comm);
        });
        eprintln!("nccl: {size} rank(s), one per GPU: every collective checked in {:.2?}", start.elapsed());
    }
    if gpus > 1 {
        // Rank r on the GPU of another ordinal: nothing may assume they agree.
        on_every_rank(&(0..gpus).rev().collect::<Vec<_>>(), |comm| exercise(comm));
    }
}

#[test]
fn two_ranks_on_one_gpu_are_refused() {
    let Some((_, _lock)) = gpus() else { return };
    let err = NcclComm::from_devices(&[0, 0]).expect_err("NCCL refuses two ranks on one GPU");
    eprintln!("nccl: two ranks on cuda:0: {err}");
}

// ---------------------------------------------------------------- rank processes

const SCENARIO: &str = "VAE_TEST_NCCL_SCENARIO";

/// The process side: joins a socket group from the environment, makes the NCCL group over it
/// (rank r on cuda:r) and plays one scenario.
#[test]
#[ignore = "entry point of the rank processes that the NCCL tests spawn"]
fn nccl_rank_process_entry() {
    let scenario = std::env::var(SCENARIO).expect("spawned by an NCCL test");
    let boot = SocketComm::from_env().expect("the socket group");
    let rank = boot.rank();
    let comm = NcclComm::from_bootstrap(&boot, rank).expect("an NCCL group over the socket group");
    assert_eq!((comm.rank(), comm.size()), (rank, boot.size()));
    match scenario.as_str() {
        "collectives" => exercise(&comm),
        // Rank 1 goes silent (alive, its group open): rank 0's wait must end, under the fake
        // NCCL's timeout (FAKE_NCCL_TIMEOUT_S), well before rank 1 leaves.
        "silent_peer" if rank == 1 => std::thread::sleep(Duration::from_secs(4)),
        "silent_peer" => {
            let start = Instant::now();
            let err = comm.barrier().expect_err("rank 1 never joins the barrier");
            println!("GAVE UP after {:.1} s: {err}", start.elapsed().as_secs_f64());
            assert!(start.elapsed() < Duration::from_secs(3), "rank 0 waited {:?}", start.elapsed());
        }
        other => panic!("unknown scenario {other}"),
    }
    println!("RANK {rank} DONE");
}

/// Runs the rank processes of `scenario` (one per GPU of `world`), each with `env`, and returns
/// whether each succeeded with what it printed.
fn run_ranks(scenario: &str, world: usize, env: &[(&str, &str)]) -> Vec<(bool, String)> {
    let master = std::env::temp_dir().join(format!("vae-nccl-{}-{scenario}.sock", std::process::id()));
    let children: Vec<_> = (0..world)
        .map(|rank| {
            let master = format!("unix:{}", master.display());
            let mut cmd = common::rank_process("nccl_rank_process_entry", SCENARIO, scenario, rank, world, &master);
            for (k, v) in env {
                cmd.env(k, v);
            }
            let mut child = cmd.spawn().expect("a rank process");
            // Read as it comes, so that a chatty rank never blocks on a full pipe.
            let read = |mut pipe: Box<dyn Read + Send>| {
                std::thread::spawn(move || {
                    let mut text = String::new();
                    let _ = pipe.read_to_string(&mut text);
                    text
                })
            };
            let out = read(Box::new(child.stdout.take().unwrap()));
            let err = read(Box::new(child.stderr.take().unwrap()));
            (child, [out, err])
        })
        .collect();
    // A rank that never ends (an NCCL wait without a timeout) fails the test instead of hanging it.
    let deadline = Instant::now() + Duration::from_secs(180);
    children
        .into_iter()
        .enumerate()
        .map(|(rank, (mut child, output))| {
            let status = loop {
                if let Some(status) = child.try_wait().unwrap() {
                    break Some(status);
                }
                if Instant::now() > deadline {
                    let _ = child.kill();
                    let _ = child.wait();
                    break None;
                }
                std::thread::sleep(Duration::from_millis(20));
            };
            let text: String = output.into_iter().map(|h| h.join().unwrap_or_default()).collect();
            let ok = status.is_some_and(|s| s.success()) && text.contains("1 passed");
            (ok, format!("rank {rank} ({status:?}):\n{text}"))
        })
        .collect()
}

#[test]
fn the_collectives_run_across_rank_processes() {
    let Some((gpus, _lock)) = gpus() else { return };
    if gpus < 2 {
        // The one reason excused on a GPU machine: NCCL puts one rank per GPU.
        // The one skip scripts/gpu-check.sh excuses on a GPU machine; gpu-emu (4 devices) fails on it.
        eprintln!("nccl across processes: skipped, it needs one GPU per rank and this machine has {gpus}");
        return;
    }
    let outcomes = run_ranks("collectives", 2, &[]);
    for (ok, text) in &outcomes {
        assert!(ok, "{text}");
    }
    if fake_gpus() {
        let outcomes = run_ranks("silent_peer", 2, &[("FAKE_NCCL_TIMEOUT_S", "1")]);
        for (ok, text) in &outcomes {
            assert!(ok, "{text}");
        }
        // (The test harness may print the test's name on the same line first.)
        let gave_up = outcomes[0].1.lines().find_map(|l| l.find("GAVE UP").map(|at| &l[at..]));
        eprintln!("nccl across processes, rank 1 silent: rank 0 {}", gave_up.unwrap_or_default());
    }
}

// ---------------------------------------------------------------- the fake NCCL itself

/// A raw NCCL communicator (what cudarc's `Comm` wraps), for the calls its safe API cannot make
/// wrong on purpose.
#[derive(Clone, Copy)]
struct Raw(sys::ncclComm_t);

// SAFETY: NCCL lets any thread use a communicator, one at a time; each test thread uses its own.
unsafe impl Send for Raw {}

fn raw_group(ordinals: &[i32]) -> Result<Vec<Raw>, sys::ncclResult_t> {
    let mut comms = vec![std::ptr::null_mut(); ordinals.len()];
    // SAFETY: `comms` has room for one communicator per ordinal.
    unsafe { nccl::comm_init_all(comms.as_mut_ptr(), ordinals.len() as i32, ordinals.as_ptr()) }.map_err(|e| e.0)?;
    Ok(comms.into_iter().map(Raw).collect())
}

fn abort_all(comms: &[Raw]) {
    for c in comms {
        // SAFETY: a live communicator, aborted once.
        unsafe { nccl::comm_abort(c.0) }.expect("ncclCommAbort");
    }
}

fn code(r: Result<nccl::NcclStatus, nccl::NcclError>) -> sys::ncclResult_t {
    r.map_or_else(|e| e.0, |_| sys::ncclResult_t::ncclSuccess)
}

/// A rank thread's view of its GPU: its default stream, and buffers uploaded to it.
struct Gpu {
    stream: Arc<CudaStream>,
}

impl Gpu {
    fn new(ordinal: usize) -> Self {
        Self { stream: CudaContext::new(ordinal).unwrap().default_stream() }
    }
    fn upload(&self, bytes: &[u8]) -> CudaSlice<u8> {
        self.stream.clone_htod(bytes).unwrap()
    }
    fn zeros(&self, n: usize) -> CudaSlice<u8> {
        self.stream.alloc_zeros(n.max(1)).unwrap()
    }
    fn ptr(&self, d: &CudaSlice<u8>) -> u64 {
        d.device_ptr(&self.stream).0
    }
    fn download(&self, d: &CudaSlice<u8>) -> Vec<u8> {
        self.stream.clone_dtoh(d).unwrap()
    }
    fn raw_stream(&self) -> sys::cudaStream_t {
        self.stream.cu_stream() as _
    }
}

/// `ncclAllReduce` of `input` (`count` elements of `dtype`) on `comm`, from this thread.
fn raw_all_reduce(
    comm: Raw,
    gpu: &Gpu,
    input: &[u8],
    count: usize,
    dtype: sys::ncclDataType_t,
    op: sys::ncclRedOp_t,
) -> Result<Vec<u8>, sys::ncclResult_t> {
    let (d_in, d_out) = (gpu.upload(input), gpu.zeros(input.len()));
    let (src, dst) = (gpu.ptr(&d_in) as *const c_void, gpu.ptr(&d_out) as *mut c_void);
    // SAFETY: device buffers of `input.len()` bytes on this rank's GPU, alive until after the call.
    let r = code(unsafe { nccl::all_reduce(src, dst, count, dtype, op, comm.0, gpu.raw_stream()) });
    if r != sys::ncclResult_t::ncclSuccess {
        return Err(r);
    }
    Ok(gpu.download(&d_out)[..input.len()].to_vec())
}

/// Runs `body(rank, comm, gpu)` on a thread per rank of `comms` (rank r on `ordinals[r]`).
fn on_raw_ranks<R: Send>(comms: &[Raw], ordinals: &[i32], body: impl Fn(usize, Raw, &Gpu) -> R + Sync) -> Vec<R> {
    std::thread::scope(|s| {
        let body = &body;
        let handles: Vec<_> = comms
            .iter()
            .zip(ordinals)
            .enumerate()
            .map(|(rank, (&comm, &ordinal))| s.spawn(move || body(rank, comm, &Gpu::new(ordinal as usize))))
            .collect();
        handles.into_iter().map(|h| h.join().expect("a rank thread")).collect()
    })
}

/// `v` as the bits of an IEEE half (exact for the small integers used here).
fn to_f16(v: f32) -> u16 {
    let bits = v.to_bits();
    if v == 0.0 {
        return (bits >> 16) as u16;
    }
    let exp = ((bits >> 23) & 0xff) as i32 - 127 + 15;
    ((bits >> 16) & 0x8000) as u16 | ((exp as u16) << 10) | ((bits >> 13) & 0x3ff) as u16
}

fn from_f16(h: u16) -> f32 {
    let exp = ((h >> 10) & 0x1f) as i32;
    let mant = (h & 0x3ff) as f32 / 1024.0;
    let v = if exp == 0 { mant * 2f32.powi(-14) } else { (1.0 + mant) * 2f32.powi(exp - 15) };
    if h & 0x8000 != 0 { -v } else { v }
}

/// Every data type cudarc exposes.
const DATA_TYPES: [sys::ncclDataType_t; 10] = {
    use sys::ncclDataType_t::*;
    [
        ncclInt8,
        ncclUint8,
        ncclInt32,
        ncclUint32,
        ncclInt64,
        ncclUint64,
        ncclFloat16,
        ncclFloat32,
        ncclFloat64,
        ncclBfloat16,
    ]
};

fn is_float(t: sys::ncclDataType_t) -> bool {
    use sys::ncclDataType_t::*;
    matches!(t, ncclFloat16 | ncclFloat32 | ncclFloat64 | ncclBfloat16)
}

fn is_unsigned(t: sys::ncclDataType_t) -> bool {
    use sys::ncclDataType_t::*;
    matches!(t, ncclUint8 | ncclUint32 | ncclUint64)
}

/// A small integer as one element of type `t`.
fn encode(t: sys::ncclDataType_t, v: i64) -> Vec<u8> {
    use sys::ncclDataType_t::*;
    match t {
        ncclInt8 | ncclUint8 => vec![v as u8],
        ncclInt32 | ncclUint32 => (v as i32).to_le_bytes().to_vec(),
        ncclFloat16 => to_f16(v as f32).to_le_bytes().to_vec(),
        ncclFloat32 => (v as f32).to_le_bytes().to_vec(),
        ncclFloat64 => (v as f64).to_le_bytes().to_vec(),
        ncclBfloat16 => (((v as f32).to_bits() >> 16) as u16).to_le_bytes().to_vec(),
        _ => v.to_le_bytes().to_vec(),
    }
}

/// One element of type `t`.
fn decode(t: sys::ncclDataType_t, b: &[u8]) -> f64 {
    use sys::ncclDataType_t::*;
    match t {
        ncclInt8 => b[0] as i8 as f64,
        ncclUint8 => b[0] as f64,
        ncclInt32 => i32::from_le_bytes(b.try_into().unwrap()) as f64,
        ncclUint32 => u32::from_le_bytes(b.try_into().unwrap()) as f64,
        ncclInt64 => i64::from_le_bytes(b.try_into().unwrap()) as f64,
        ncclUint64 => u64::from_le_bytes(b.try_into().unwrap()) as f64,
        ncclFloat16 => from_f16(u16::from_le_bytes([b[0], b[1]])) as f64,
        ncclFloat32 => f32::from_le_bytes(b.try_into().unwrap()) as f64,
        ncclBfloat16 => f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16) as f64,
        _ => f64::from_le_bytes(b.try_into().unwrap()),
    }
}

#[test]
fn the_fake_nccl_reduces_every_type_and_refuses_what_nccl_would_corrupt_or_hang_on() {
    let Some((gpus, _lock)) = gpus() else { return };
    if !fake_gpus() {
        // Real NCCL hangs or corrupts memory on most of these calls: they are the fake's checks.
        eprintln!("nccl: the fake NCCL's own checks do not apply to real GPUs");
        return;
    }
    use sys::ncclRedOp_t::*;
    use sys::ncclResult_t::*;

    // Sum, prod, max, min and avg of every type, reduced over up to four ranks; small integers,
    // so that every type holds every result exactly. Values 1 to 3 (and -2 on a signed type's
    // last element), in an order that differs by rank.
    let n = gpus.min(4);
    let ordinals: Vec<i32> = (0..n as i32).collect();
    let comms = raw_group(&ordinals).expect("ncclCommInitAll");
    let len = 5;
    let value = |rank: usize, i: usize| 1 + ((rank + 2 * i) % 3) as i64;
    for dtype in DATA_TYPES {
        let size = encode(dtype, 0).len();
        let v =
            |rank: usize, i: usize| if !is_unsigned(dtype) && i == len - 1 && rank == 0 { -2 } else { value(rank, i) };
        for op in [ncclSum, ncclProd, ncclMax, ncclMin, ncclAvg] {
            let results = on_raw_ranks(&comms, &ordinals, |rank, comm, gpu| {
                let input: Vec<u8> = (0..len).flat_map(|i| encode(dtype, v(rank, i))).collect();
                raw_all_reduce(comm, gpu, &input, len, dtype, op).expect("ncclAllReduce")
            });
            for i in 0..len {
                let all = (0..n).map(|r| v(r, i));
                let want = match op {
                    ncclSum => all.sum::<i64>() as f64,
                    ncclProd => all.product::<i64>() as f64,
                    ncclMax => all.max().unwrap() as f64,
                    ncclMin => all.min().unwrap() as f64,
                    // Floats divide; integers divide and truncate.
                    _ if is_float(dtype) => all.sum::<i64>() as f64 / n as f64,
                    _ => (all.sum::<i64>() / n as i64) as f64,
                };
                for (rank, got) in results.iter().enumerate() {
                    let got = decode(dtype, &got[i * size..][..size]);
                    // Halves and bfloat16 hold 2^-8 relative (an average of thirds).
                    assert!(
                        (got - want).abs() <= want.abs() / 256.0,
                        "{dtype:?} {op:?}, element {i}, rank {rank}: {got} != {want}"
                    );
                }
            }
        }
    }

    // A group that one thread drives for every rank (as ncclCommInitAll's users do), sends and
    // receives posted in an order that would deadlock if sends waited for their receives:
    // every rank receives from the next first.
    let bufs: Vec<(Gpu, CudaSlice<u8>, CudaSlice<u8>)> = (0..n)
        .map(|r| {
            let gpu = Gpu::new(r);
            let (send, recv) = (gpu.upload(&[r as u8 * 10; 6]), gpu.zeros(6));
            (gpu, send, recv)
        })
        .collect();
    nccl::group_start().unwrap();
    for (r, (gpu, send, recv)) in bufs.iter().enumerate() {
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        // SAFETY: device buffers of 6 bytes on rank r's GPU, alive until after group_end.
        unsafe {
            let to = sys::ncclDataType_t::ncclUint8;
            nccl::recv(gpu.ptr(recv) as *mut c_void, 6, to, next as i32, comms[r].0, gpu.raw_stream()).unwrap();
            nccl::send(gpu.ptr(send) as *const c_void, 6, to, prev as i32, comms[r].0, gpu.raw_stream()).unwrap();
        }
    }
    nccl::group_end().unwrap();
    for (r, (gpu, _, recv)) in bufs.iter().enumerate() {
        assert_eq!(gpu.download(recv), vec![((r + 1) % n) as u8 * 10; 6], "what rank {r} received from the next");
    }
    // cudarc frees a buffer on the null stream of whatever context is current (it binds none):
    // each rank's context first, or the frees go to a released one.
    for (gpu, send, recv) in bufs {
        gpu.stream.context().bind_to_thread().unwrap();
        drop((send, recv));
    }
    abort_all(&comms);

    // Two ranks on one GPU.
    assert_eq!(raw_group(&[0, 0]).err(), Some(ncclInvalidUsage));

    // Buffers that are not the communicator's device memory, or are too short (one group of one
    // per case: a refused call leaves its communicator failed).
    let one = |check: &dyn Fn(Raw, &Gpu) -> sys::ncclResult_t| {
        let comms = raw_group(&[0]).unwrap();
        let r = check(comms[0], &Gpu::new(0));
        abort_all(&comms);
        r
    };
    let f32_sum = |comm: Raw, gpu: &Gpu, src: u64, dst: u64, count: usize| {
        // SAFETY: the fake checks the pointers before it touches them: that is what is tested.
        code(unsafe {
            nccl::all_reduce(
                src as *const c_void,
                dst as *mut c_void,
                count,
                sys::ncclDataType_t::ncclFloat32,
                ncclSum,
                comm.0,
                gpu.raw_stream(),
            )
        })
    };
    let short = one(&|comm, gpu| {
        let d = gpu.zeros(40);
        f32_sum(comm, gpu, gpu.ptr(&d), gpu.ptr(&d), 11)
    });
    assert_eq!(short, ncclInvalidArgument, "11 floats in 40 bytes");
    let host = one(&|comm, gpu| {
        let h = [0f32; 4];
        f32_sum(comm, gpu, h.as_ptr() as u64, h.as_ptr() as u64, 4)
    });
    assert_eq!(host, ncclInvalidArgument, "host memory");
    if gpus > 1 {
        let other = one(&|comm, gpu| {
            let elsewhere = Gpu::new(1);
            let d = elsewhere.zeros(16);
            f32_sum(comm, gpu, elsewhere.ptr(&d), elsewhere.ptr(&d), 4)
        });
        assert_eq!(other, ncclInvalidArgument, "cuda:1's memory on cuda:0's communicator");
    }
    if gpus < 2 {
        return;
    }

    // A send whose count differs from the receive: both sides fail (NCCL would corrupt memory).
    let pair = raw_group(&[0, 1]).unwrap();
    let codes = on_raw_ranks(&pair, &[0, 1], |rank, comm, gpu| {
        let d = gpu.zeros(16);
        let to = sys::ncclDataType_t::ncclFloat32;
        // SAFETY: 16 bytes of device memory on this rank's GPU.
        code(unsafe {
            if rank == 0 {
                nccl::send(gpu.ptr(&d) as *const c_void, 4, to, 1, comm.0, gpu.raw_stream())
            } else {
                nccl::recv(gpu.ptr(&d) as *mut c_void, 3, to, 0, comm.0, gpu.raw_stream())
            }
        })
    });
    assert_eq!(codes, [ncclInvalidUsage, ncclInvalidUsage]);
    abort_all(&pair);

    // Collectives whose counts differ between ranks: every rank fails (NCCL would hang).
    let ordinals: Vec<i32> = (0..gpus.min(3) as i32).collect();
    let group = raw_group(&ordinals).unwrap();
    let codes = on_raw_ranks(&group, &ordinals, |rank, comm, gpu| {
        let count = if rank == ordinals.len() - 1 { 5 } else { 4 };
        raw_all_reduce(comm, gpu, &vec![0u8; 4 * count], count, sys::ncclDataType_t::ncclFloat32, ncclSum).err()
    });
    assert!(codes.iter().all(|c| *c == Some(ncclInvalidUsage)), "{codes:?}");
    abort_all(&group);

    // A rank waiting for a peer that never sends: ncclCommAbort from another thread ends the wait.
    let pair = raw_group(&[0, 1]).unwrap();
    let start = Instant::now();
    let waiting = std::thread::spawn({
        let comm = pair[0];
        move || {
            let comm = comm; // the whole handle (Send), not its raw pointer field
            let gpu = Gpu::new(0);
            let d = gpu.zeros(8);
            // SAFETY: 8 bytes of device memory on cuda:0.
            code(unsafe {
                nccl::recv(gpu.ptr(&d) as *mut c_void, 8, sys::ncclDataType_t::ncclUint8, 1, comm.0, gpu.raw_stream())
            })
        }
    });
    std::thread::sleep(Duration::from_millis(300));
    abort_all(&pair[..1]);
    assert_ne!(waiting.join().unwrap(), ncclSuccess);
    assert!(start.elapsed() < Duration::from_secs(10), "the abort took {:?}", start.elapsed());
    // ... and its peer, waiting for it in turn, learns that it left.
    let gpu = Gpu::new(1);
    let d = gpu.zeros(8);
    // SAFETY: 8 bytes of device memory on cuda:1.
    let left = code(unsafe {
        nccl::recv(gpu.ptr(&d) as *mut c_void, 8, sys::ncclDataType_t::ncclUint8, 0, pair[1].0, gpu.raw_stream())
    });
    assert_eq!(left, ncclRemoteError);
    abort_all(&pair[1..]);
}

/// The NCCL backend's traffic counters as the other backends keep them (`mesh.rs`): a barrier is
/// not an all_reduce, an all_reduce sends and receives its buffer once per other rank, and a
/// gather's root counts what it received.
#[test]
fn the_nccl_counters_agree_with_the_other_backends() {
    let Some((gpus, _lock)) = gpus() else { return };
    let size = gpus.min(3);
    on_every_rank(&(0..size).collect::<Vec<_>>(), |comm| {
        let (rank, before) = (comm.rank(), comm.stats());
        comm.all_reduce(ReduceOp::Sum, &mut [1.0f64; 4]).unwrap();
        comm.barrier().unwrap();
        comm.gather(0, &bytes_of(rank)).unwrap();
        let stats = comm.stats().since(&before);
        assert_eq!(stats.all_reduce.calls, 1, "rank {rank}: the barrier counted as an all_reduce");
        assert_eq!(stats.all_reduce.bytes_sent, 32 * (size as u64 - 1), "rank {rank}");
        if rank == 0 {
            let others: usize = (1..size).map(|r| bytes_of(r).len()).sum();
            assert_eq!(stats.gather.bytes_received, others as u64, "the gather's root");
        }
    });
}
