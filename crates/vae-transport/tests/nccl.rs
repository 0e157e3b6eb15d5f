//! The NCCL backend on a GPU machine: every collective with world size 1 (NCCL refuses two
//! ranks on one GPU), and with every GPU of the machine as a rank when it has several. Skipped,
//! with the reason, where NCCL or a GPU is missing.
#![cfg(feature = "nccl")]
#![allow(clippy::print_stderr)] // a skipped GPU test says so

use vae_transport::{Communicator, CommunicatorExt, NcclComm, PeerExchange, ReduceOp, nccl_available};

fn exercise(comm: &NcclComm) {
    let (rank, size) = (comm.rank(), comm.size());
    // Variable-length all_gather.
    let mine: Vec<u8> = vec![rank as u8; rank + 1];
    let all = comm.all_gather(&mine).unwrap();
    for r in 0..size {
        assert_eq!(all.part(r), vec![r as u8; r + 1].as_slice());
    }
    let g = comm.gather(0, &[rank as u64 * 10]).unwrap();
    assert_eq!(g.is_some(), rank == 0);
    if let Some(g) = g {
        assert_eq!(g.as_flat(), (0..size as u64).map(|r| r * 10).collect::<Vec<_>>().as_slice());
    }
    let mut b: Vec<f32> = if rank == 0 { vec![1.5, 2.5, 3.5] } else { Vec::new() };
    comm.broadcast(0, &mut b).unwrap();
    assert_eq!(b, [1.5, 2.5, 3.5]);
    let mut s = [rank as f64 + 1.0, 1.0];
    comm.all_reduce(ReduceOp::Sum, &mut s).unwrap();
    assert_eq!(s, [(size * (size + 1) / 2) as f64, size as f64]);
    if size > 1 {
        let peer = (rank + 1) % size;
        let back = (rank + size - 1) % size;
        let mut from_back = Vec::<u8>::new();
        let mut from_peer = Vec::<u8>::new();
        let send_peer = vec![rank as u8; 3];
        let send_back = vec![rank as u8; 5];
        let mut legs = vec![PeerExchange { peer, send: &send_peer, recv: &mut from_peer }];
        if back != peer {
            legs.push(PeerExchange { peer: back, send: &send_back, recv: &mut from_back });
        }
        comm.exchange_bytes(vae_transport::DataType::U8, &mut legs).unwrap();
    }
    comm.barrier().unwrap();
    assert!(comm.stats().all_gather.calls >= 1);
}

#[test]
fn every_collective_works_on_one_rank_per_gpu() {
    if let Err(reason) = nccl_available() {
        eprintln!("nccl: skipped, {reason}");
        return;
    }
    let comms = NcclComm::from_devices(&[0]).expect("an NCCL group of one on cuda:0");
    exercise(&comms[0]);
    let gpus = cudarc::driver::CudaContext::device_count().unwrap_or(1).max(1) as usize;
    if gpus > 1 {
        let ordinals: Vec<usize> = (0..gpus).collect();
        let comms = NcclComm::from_devices(&ordinals).unwrap();
        std::thread::scope(|s| {
            for c in &comms {
                s.spawn(move || exercise(c));
            }
        });
    }
}
