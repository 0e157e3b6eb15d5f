//! Checks shared by the local and the socket backend tests: the same assertions must hold for
//! every backend.

#![allow(dead_code)]

use std::process::{Command, Stdio};

use vae_transport::{Communicator, CommunicatorExt, ReduceOp};

/// What rank `r` contributes: uneven lengths (rank 2 sends nothing) and rank-specific values.
pub fn contribution(r: usize) -> Vec<f32> {
    let len = if r == 2 { 0 } else { 3 * r + 1 };
    (0..len).map(|i| (r * 1000 + i) as f32 + 0.5).collect()
}

/// Runs every collective with uneven payloads and checks the results exactly.
pub fn exercise_all_collectives(comm: &dyn Communicator) {
    let (rank, size) = (comm.rank(), comm.size());
    let before = comm.stats();

    // all_gather, uneven lengths
    let gathered = comm.all_gather(&contribution(rank)).expect("all_gather");
    assert_eq!(gathered.len(), size);
    for r in 0..size {
        assert_eq!(gathered.part(r), contribution(r).as_slice(), "all_gather part of rank {r} on rank {rank}");
    }

    // gather to every root in turn
    for root in 0..size {
        let got = comm.gather(root, &contribution(rank)).expect("gather");
        if rank == root {
            let got = got.expect("root receives");
            for r in 0..size {
                assert_eq!(got.part(r), contribution(r).as_slice(), "gather to {root}: part {r}");
            }
        } else {
            assert!(got.is_none(), "non-root {rank} must not receive a gather");
        }
    }

    // broadcast from every root; receivers start with buffers of a different length
    for root in 0..size {
        let mut buf: Vec<i64> =
            if rank == root { (0..(root as i64 + 5)).map(|i| i * 7 - root as i64).collect() } else { vec![-1; rank] };
        comm.broadcast(root, &mut buf).expect("broadcast");
        let expected: Vec<i64> = (0..(root as i64 + 5)).map(|i| i * 7 - root as i64).collect();
        assert_eq!(buf, expected, "broadcast from {root} on rank {rank}");
    }

    // all_reduce on every element type
    let mut f = vec![rank as f32 + 0.25, -(rank as f32), 1.0];
    comm.all_reduce(ReduceOp::Sum, &mut f).expect("all_reduce f32");
    let mut expected_f = [0.0f32; 3];
    for r in 0..size {
        expected_f[0] += r as f32 + 0.25;
        expected_f[1] += -(r as f32);
        expected_f[2] += 1.0;
    }
    assert_eq!(f, expected_f, "f32 sum in rank order");

    let mut d = vec![rank as f64 * 1.5, 2.0];
    comm.all_reduce(ReduceOp::Max, &mut d).expect("all_reduce f64");
    assert_eq!(d, vec![(size - 1) as f64 * 1.5, 2.0]);

    let mut i = vec![rank as i64 - 3, 10];
    comm.all_reduce(ReduceOp::Sum, &mut i).expect("all_reduce i64");
    let n = size as i64;
    assert_eq!(i, vec![n * (n - 1) / 2 - 3 * n, 10 * n]);

    let mut b = vec![rank as u8, 200];
    comm.all_reduce(ReduceOp::Max, &mut b).expect("all_reduce u8");
    assert_eq!(b, vec![(size - 1) as u8, 200]);

    let mut u = vec![1u64 << rank.min(60)];
    comm.all_reduce(ReduceOp::Sum, &mut u).expect("all_reduce u64");
    assert_eq!(u[0], (0..size).map(|r| 1u64 << r.min(60)).sum::<u64>());

    // neighbour (halo) exchange with lengths that differ per direction
    let to_prev: Vec<f32> = vec![rank as f32; rank + 1];
    let to_next: Vec<f32> = vec![-(rank as f32); 2 * rank + 3];
    let halo = comm.neighbour_exchange(&to_prev, &to_next).expect("neighbour_exchange");
    let (from_prev, from_next) = (halo.from_prev, halo.from_next);
    if rank > 0 {
        let p = rank - 1;
        assert_eq!(from_prev.expect("has prev"), vec![-(p as f32); 2 * p + 3]);
    } else {
        assert!(from_prev.is_none());
    }
    if rank + 1 < size {
        let nx = rank + 1;
        assert_eq!(from_next.expect("has next"), vec![nx as f32; nx + 1]);
    } else {
        assert!(from_next.is_none());
    }

    // paired send_recv: 0<->1, 2<->3, ... (an odd last rank sits out)
    let partner = rank ^ 1;
    if partner < size {
        let got = comm.send_recv(partner, &[rank as u64; 3]).expect("send_recv");
        assert_eq!(got, vec![partner as u64; 3]);
    }

    comm.barrier().expect("barrier");

    // the collectives above are counted
    let stats = comm.stats().since(&before);
    assert_eq!(stats.all_gather.calls, 1);
    assert_eq!(stats.gather.calls, size as u64);
    assert_eq!(stats.broadcast.calls, size as u64);
    assert_eq!(stats.all_reduce.calls, 5);
    assert_eq!(stats.barrier.calls, 1);
}

/// A rank process of this test binary: it runs the ignored test `entry` alone, as `rank` of a
/// socket group of `world` ranks meeting at `master`, with `scenario` in the environment
/// variable `scenario_var` and its stdout and stderr piped back.
pub fn rank_process(
    entry: &str,
    scenario_var: &str,
    scenario: &str,
    rank: usize,
    world: usize,
    master: &str,
) -> Command {
    let mut cmd = Command::new(std::env::current_exe().expect("the test binary"));
    cmd.args(["--exact", entry, "--include-ignored", "--nocapture", "--test-threads=1", "-q"])
        .env(scenario_var, scenario)
        .env("VAE_RANK", rank.to_string())
        .env("VAE_WORLD_SIZE", world.to_string())
        .env("VAE_MASTER_ADDR", master)
        .env("VAE_CONNECT_TIMEOUT_S", "30")
        .env("VAE_COLLECTIVE_TIMEOUT_S", "60")
        .env("RUST_BACKTRACE", "0")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}
