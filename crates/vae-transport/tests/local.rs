//! The local (threads) backend: every collective on 1..8 ranks, and every failure mode.

mod common;

use std::time::{Duration, Instant};

use vae_transport::{Communicator, CommunicatorExt, TransportConfig, TransportError, run_local};

fn config() -> TransportConfig {
    TransportConfig { collective_timeout: Duration::from_secs(20), ..TransportConfig::default() }
}

#[test]
fn every_collective_on_one_to_eight_ranks() {
    for size in 1..=8 {
        let results = run_local(size, config(), |comm| common::exercise_all_collectives(&comm)).unwrap();
        for (rank, r) in results.into_iter().enumerate() {
            r.unwrap_or_else(|panic| panic!("size {size} rank {rank}: {panic}"));
        }
    }
}

#[test]
fn a_rank_that_aborts_fails_every_other_rank_naming_it() {
    let results = run_local(4, config(), |comm| {
        if comm.rank() == 1 {
            comm.abort("tile 7 could not be decoded");
        }
        comm.barrier()
    })
    .unwrap();
    for (rank, r) in results.into_iter().enumerate() {
        let err = r.unwrap().unwrap_err();
        assert_eq!(err.failed_rank(), Some(1), "rank {rank}: {err}");
        if rank != 1 {
            assert!(err.to_string().contains("tile 7 could not be decoded"), "rank {rank}: {err}");
        }
    }
}

#[test]
fn a_panicking_rank_is_reported_as_failed_not_waited_for() {
    let started = Instant::now();
    let results = run_local(3, config(), |comm| {
        if comm.rank() == 2 {
            std::thread::sleep(Duration::from_millis(50));
            panic!("boom in rank 2");
        }
        let first = comm.all_gather(&[comm.rank() as u64]);
        (first, started.elapsed())
    })
    .unwrap();
    assert!(results[2].as_ref().unwrap_err().contains("boom in rank 2"));
    for r in &results[..2] {
        let (outcome, elapsed) = r.as_ref().unwrap();
        let err = outcome.as_ref().unwrap_err();
        assert!(matches!(err, TransportError::PeerFailed { rank: 2, .. }), "{err}");
        assert!(err.to_string().contains("panicked"), "{err}");
        // Reported at once, not after the 20 s collective timeout.
        assert!(*elapsed < Duration::from_secs(5), "took {elapsed:?}");
    }
}

#[test]
fn a_rank_that_returns_early_is_reported_as_having_left() {
    let results = run_local(2, config(), |comm| if comm.rank() == 0 { comm.barrier() } else { Ok(()) }).unwrap();
    let err = results[0].as_ref().unwrap().as_ref().unwrap_err();
    assert!(matches!(err, TransportError::PeerLeft { rank: 1, waiting: 0, op: "barrier" }), "{err}");
}

#[test]
fn mismatched_collectives_are_detected_and_fail_every_rank() {
    let results = run_local(3, config(), |comm| {
        let first =
            if comm.rank() == 1 { comm.all_gather(&[1u8]).map(|_| ()) } else { comm.broadcast(0, &mut vec![0u8; 4]) };
        // Whatever the first call returned, the group is now unusable everywhere.
        let second = comm.barrier();
        (first, second)
    })
    .unwrap();
    let mut saw_mismatch = false;
    for (rank, r) in results.into_iter().enumerate() {
        let (first, second) = r.unwrap();
        for e in [&first, &second].into_iter().filter_map(|r| r.as_ref().err()) {
            saw_mismatch |= matches!(e.root_cause(), TransportError::CollectiveMismatch { .. });
        }
        assert!(second.is_err(), "rank {rank} must not continue after a mismatch");
    }
    assert!(saw_mismatch, "some rank must report the mismatch itself");
}

#[test]
fn different_roots_are_detected_at_the_next_collective() {
    let results = run_local(2, config(), |comm| {
        let root = comm.rank(); // each rank believes it is the root: both send, neither receives
        let first = comm.broadcast(root, &mut vec![1.0f32; 2]);
        (first, comm.barrier())
    })
    .unwrap();
    for r in results {
        let (first, second) = r.unwrap();
        // The first call may already fail on the rank that is slower to finish sending.
        if let Err(e) = &first {
            assert!(e.failed_rank().is_some(), "{e}");
        }
        let err = second.unwrap_err();
        assert!(
            matches!(err.root_cause(), TransportError::CollectiveMismatch { .. } | TransportError::PeerFailed { .. }),
            "{err}"
        );
    }
}

#[test]
fn a_silent_live_peer_times_out_naming_it() {
    let cfg = TransportConfig { collective_timeout: Duration::from_millis(200), ..TransportConfig::default() };
    let results = run_local(2, cfg, |comm| {
        if comm.rank() == 1 {
            std::thread::sleep(Duration::from_millis(600));
            return Ok(());
        }
        comm.barrier()
    })
    .unwrap();
    let err = results[0].as_ref().unwrap().as_ref().unwrap_err();
    assert!(matches!(err, TransportError::Timeout { rank: 1, waiting: 0, .. }), "{err}");
}

#[test]
fn a_failed_communicator_stays_failed() {
    let results = run_local(2, config(), |comm| {
        if comm.rank() == 1 {
            comm.abort("stop");
        }
        let first = comm.barrier();
        let second = comm.all_gather(&[0u8]);
        (first.unwrap_err(), second.unwrap_err())
    })
    .unwrap();
    for r in results {
        let (_, second) = r.unwrap();
        assert!(matches!(second, TransportError::Poisoned(_)), "{second}");
        assert_eq!(second.failed_rank(), Some(1));
    }
}

#[test]
fn bad_arguments_are_errors_and_fail_the_peers_fast() {
    let results =
        run_local(
            2,
            config(),
            |comm| {
                if comm.rank() == 0 { comm.gather(5, &[0u8]).map(|_| ()) } else { comm.barrier() }
            },
        )
        .unwrap();
    let e0 = results[0].as_ref().unwrap().as_ref().unwrap_err();
    assert!(matches!(e0, TransportError::InvalidArgument(_)), "{e0}");
    let e1 = results[1].as_ref().unwrap().as_ref().unwrap_err();
    assert_eq!(e1.failed_rank(), Some(0), "{e1}");
}

#[test]
fn float_all_reduce_is_bit_identical_on_every_rank() {
    let results = run_local(5, config(), |comm| {
        let mut v: Vec<f32> = (0..64).map(|i| ((comm.rank() * 64 + i) as f32).sin() * 1e7).collect();
        comm.all_reduce(vae_transport::ReduceOp::Sum, &mut v).unwrap();
        v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    })
    .unwrap();
    let first = results[0].as_ref().unwrap();
    for r in &results {
        assert_eq!(r.as_ref().unwrap(), first);
    }
}

#[test]
fn zero_ranks_is_an_error() {
    assert!(matches!(vae_transport::local_group(0, config()), Err(TransportError::InvalidArgument(_))));
}

/// A short collective timeout: these cases must be detected, not waited out.
fn impatient() -> TransportConfig {
    TransportConfig { collective_timeout: Duration::from_secs(20), ..TransportConfig::default() }
}

#[test]
fn an_exchange_met_by_a_collective_is_a_mismatch_at_once() {
    let started = Instant::now();
    let results = run_local(2, impatient(), |comm| {
        if comm.rank() == 0 { comm.send_recv(1, &[1u8]).map(|_| ()) } else { comm.all_gather(&[2u8]).map(|_| ()) }
    })
    .unwrap();
    for r in results {
        assert!(r.unwrap().is_err());
    }
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
}

#[test]
fn ranks_that_disagree_on_a_gather_root_fail_fast() {
    let started = Instant::now();
    let results = run_local(3, impatient(), |comm| {
        let root = if comm.rank() == 2 { 1 } else { 0 };
        let first = comm.gather(root, &[comm.rank() as u8]).map(|_| ());
        let second = comm.broadcast(0, &mut vec![0u8; 3]);
        (first, second)
    })
    .unwrap();
    let mut saw_mismatch = false;
    for r in results {
        let (first, second) = r.unwrap();
        assert!(first.is_err() || second.is_err());
        for e in [first.err(), second.err()].into_iter().flatten() {
            saw_mismatch |= matches!(e.root_cause(), TransportError::CollectiveMismatch { .. });
        }
    }
    assert!(saw_mismatch);
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
}

#[test]
fn abort_from_another_thread_wakes_this_ranks_own_wait() {
    let started = Instant::now();
    let results = run_local(2, impatient(), |comm| {
        if comm.rank() == 1 {
            // Rank 1 is slow but alive; rank 0's watchdog gives up on the request.
            std::thread::sleep(Duration::from_millis(300));
            return comm.barrier();
        }
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(50));
                comm.abort("watchdog: request cancelled");
            });
            comm.all_gather(&[0u8]).map(|_| ())
        })
    })
    .unwrap();
    let e0 = results[0].as_ref().unwrap().as_ref().unwrap_err();
    assert!(e0.to_string().contains("watchdog"), "{e0}");
    let e1 = results[1].as_ref().unwrap().as_ref().unwrap_err();
    assert_eq!(e1.failed_rank(), Some(0), "{e1}");
    assert!(started.elapsed() < Duration::from_secs(5));
}
