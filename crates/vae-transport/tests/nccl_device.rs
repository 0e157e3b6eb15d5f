//! The NCCL backend's device-to-device exchange (`Communicator::exchange_device`): one rank per
//! GPU, buffers sent from and received into device memory, every byte checked; mismatched
//! lengths fail on both ranks of the pair without a hang; bad arguments are typed errors. Needs
//! two GPUs or more (the fake driver and fake NCCL of `cargo xtask gpu-emu` provide them);
//! elsewhere it says why it is skipped.
#![cfg(feature = "nccl")]
#![allow(clippy::print_stderr)] // a skipped GPU test says so

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
use vae_transport::{Communicator, DeviceBytes, DeviceExchange, NcclComm, TransportError, nccl_available};

/// The GPUs NCCL can use here, or why the test cannot run.
fn gpus(test: &str) -> Option<usize> {
    if let Err(reason) = nccl_available() {
        eprintln!("{test}: skipped, {reason}");
        return None;
    }
    let gpus = CudaContext::device_count().unwrap_or(0).max(0) as usize;
    if gpus < 2 {
        eprintln!("{test}: skipped, it needs one GPU per rank and this machine has {gpus}");
        return None;
    }
    Some(gpus)
}

/// The bytes rank `from` sends rank `to`: `len` bytes that name both.
fn payload(from: usize, to: usize, len: usize) -> Vec<u8> {
    (0..len).map(|i| (from * 37 + to * 11 + i * 3) as u8).collect()
}

/// A rank's device buffers: what it sends each peer, and where each peer's bytes land.
struct Buffers {
    stream: Arc<CudaStream>,
    sends: Vec<(usize, CudaSlice<u8>)>,
    recvs: Vec<(usize, CudaSlice<u8>)>,
}

impl Buffers {
    /// Sends `send_len(rank, peer)` bytes to each peer and expects `recv_len(rank, peer)`.
    fn new(
        rank: usize,
        peers: &[usize],
        send_len: impl Fn(usize, usize) -> usize,
        recv_len: impl Fn(usize, usize) -> usize,
    ) -> Self {
        let stream = CudaContext::new(rank).unwrap().default_stream();
        let sends =
            peers.iter().map(|&p| (p, stream.clone_htod(&payload(rank, p, send_len(rank, p))).unwrap())).collect();
        // Filled with a marker, so that bytes nobody wrote show.
        let recvs = peers.iter().map(|&p| (p, stream.clone_htod(&vec![0xa5u8; recv_len(rank, p)]).unwrap())).collect();
        stream.synchronize().unwrap();
        Self { stream, sends, recvs }
    }

    fn legs(&self, rank: usize) -> Vec<DeviceExchange> {
        let bytes = |s: &CudaSlice<u8>| DeviceBytes {
            ordinal: rank,
            address: s.device_ptr(&self.stream).0,
            len: cudarc::driver::DeviceSlice::len(s),
        };
        self.sends
            .iter()
            .zip(&self.recvs)
            .map(|((peer, s), (_, r))| DeviceExchange { peer: *peer, send: bytes(s), recv: bytes(r) })
            .collect()
    }

    fn received(&self) -> Vec<(usize, Vec<u8>)> {
        self.recvs.iter().map(|(p, r)| (*p, self.stream.clone_dtoh(r).unwrap())).collect()
    }
}

/// Runs `body` on every rank of an NCCL group of `ranks` GPUs, one thread each.
fn on_ranks<T: Send>(ranks: usize, body: impl Fn(&NcclComm) -> T + Sync) -> Vec<T> {
    let ordinals: Vec<usize> = (0..ranks).collect();
    let comms = NcclComm::from_devices(&ordinals).expect("an NCCL group, one rank per GPU");
    std::thread::scope(|s| {
        let handles: Vec<_> = comms.iter().map(|c| s.spawn(|| body(c))).collect();
        handles.into_iter().map(|h| h.join().expect("a rank thread")).collect()
    })
}

#[test]
fn device_buffers_go_from_gpu_to_gpu_byte_for_byte() {
    let Some(gpus) = gpus("nccl device exchange") else { return };
    for ranks in 2..=gpus.min(4) {
        // Every rank exchanges with every other, each pair with its own length (one of them 0).
        let len = |from: usize, to: usize| (from * 5 + to * 3) % 7 * 1000 + from + to;
        let received = on_ranks(ranks, |comm| {
            let rank = comm.rank();
            assert!(comm.exchanges_device_buffers(rank));
            assert!(!comm.exchanges_device_buffers(rank + 1), "only its own GPU");
            let peers: Vec<usize> = (0..ranks).filter(|&p| p != rank).collect();
            let buffers = Buffers::new(rank, &peers, len, |me, peer| len(peer, me));
            // SAFETY: the buffers live until after the call and nothing else uses them.
            unsafe { comm.exchange_device(&buffers.legs(rank)) }.unwrap();
            let stats = comm.stats().exchange;
            assert_eq!(stats.bytes_sent, peers.iter().map(|&p| len(rank, p) as u64).sum::<u64>());
            buffers.received()
        });
        for (rank, got) in received.into_iter().enumerate() {
            for (peer, bytes) in got {
                assert_eq!(bytes, payload(peer, rank, len(peer, rank)), "{ranks} ranks: rank {rank} from {peer}");
            }
        }
    }
}

#[test]
fn mismatched_lengths_fail_on_both_ranks_of_the_pair_without_a_hang() {
    let Some(_) = gpus("nccl device exchange mismatch") else { return };
    // Rank 0 sends 100 bytes; rank 1 expects 60. The other direction matches (40 bytes).
    let results = on_ranks(2, |comm| {
        let rank = comm.rank();
        let peer = 1 - rank;
        let send = |me: usize, _| if me == 0 { 100 } else { 40 };
        let recv = |me: usize, _| if me == 0 { 40 } else { 60 };
        let buffers = Buffers::new(rank, &[peer], send, recv);
        // SAFETY: as above.
        let result = unsafe { comm.exchange_device(&buffers.legs(rank)) };
        // The group is still usable: the next exchange, with matching lengths, works.
        let matching = Buffers::new(rank, &[peer], |_, _| 8, |_, _| 8);
        // SAFETY: as above.
        unsafe { comm.exchange_device(&matching.legs(rank)) }.expect("an exchange after the mismatch");
        assert_eq!(matching.received()[0].1, payload(peer, rank, 8));
        (result, buffers.received())
    });
    for (rank, (result, received)) in results.into_iter().enumerate() {
        match result {
            Err(TransportError::LengthMismatch { local_rank, rank: peer, .. }) => {
                assert_eq!((local_rank, peer), (rank, 1 - rank));
            }
            other => panic!("rank {rank}: expected a length mismatch, got {other:?}"),
        }
        // What did arrive is the sender's bytes, never beyond the receive buffer.
        let (peer, bytes) = &received[0];
        let want = if rank == 0 { payload(1, 0, 40) } else { payload(0, 1, 60) };
        assert_eq!(bytes, &want, "rank {rank} from {peer}");
    }
}

#[test]
fn bad_legs_are_typed_errors_before_anything_moves() {
    let Some(_) = gpus("nccl device exchange arguments") else { return };
    let results = on_ranks(2, |comm| {
        let rank = comm.rank();
        let buffers = Buffers::new(rank, &[1 - rank], |_, _| 16, |_, _| 16);
        let mut legs = buffers.legs(rank);
        let mut to_self = legs.clone();
        to_self[0].peer = rank;
        let mut beyond = legs.clone();
        beyond[0].peer = 2;
        legs[0].recv.ordinal = 1 - rank;
        // SAFETY: each is refused before any buffer is touched.
        unsafe { [comm.exchange_device(&to_self), comm.exchange_device(&beyond), comm.exchange_device(&legs)] }
    });
    for (rank, errors) in results.into_iter().enumerate() {
        for e in errors {
            assert!(matches!(e, Err(TransportError::InvalidArgument(_))), "rank {rank}: {e:?}");
        }
    }
}
