//! `Group`'s own rules, through the library as an engine calls it: which rank's result and
//! error come back, a panic on one rank as an error naming it on every rank, no rank left
//! waiting, cancellation, and one group serving request after request.

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use vae_parallel::transport::{CommunicatorExt, ReduceOp};
use vae_parallel::{CancelToken, Decode, Device, Error, ErrorKind, Group, Request, Tensor, Vae};

#[test]
fn a_panic_on_one_rank_is_an_error_naming_it_and_nobody_hangs() {
    let group = Group::local(3).unwrap();
    let started = Instant::now();
    let err = group
        .run_on_ranks(|comm| {
            if comm.rank() == 2 {
                panic!("rank two gives up");
            }
            // The others wait in a collective the panicking rank never joins.
            comm.barrier()?;
            Ok(())
        })
        .unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(5), "the group waited {:?}", started.elapsed());
    // Rank 0's own error comes first: the group failed, naming rank 2 and its reason.
    assert_eq!(err.kind(), ErrorKind::Execution, "{err}");
    assert!(err.to_line().contains("rank 2") && err.to_line().contains("rank two gives up"), "{err}");
    // The group serves the next request.
    let sum = group
        .run_on_ranks(|comm| {
            let mut value = [comm.rank() as u64];
            comm.all_reduce(ReduceOp::Sum, &mut value)?;
            Ok(value[0])
        })
        .unwrap();
    assert_eq!(sum, 3);
}

#[test]
fn a_failure_on_another_rank_than_the_owner_names_the_rank() {
    let group = Group::local(2).unwrap();
    let err = group
        .run_on_ranks(|comm| match comm.rank() {
            1 => Err(Error::invalid_option("rank one refuses")),
            _ => Ok(()),
        })
        .unwrap_err();
    match &err {
        Error::OnRank { rank: 1, source } => assert!(source.to_string().contains("rank one refuses")),
        other => panic!("{other:?}"),
    }
    assert_eq!(err.kind(), ErrorKind::InvalidOption);
}

#[test]
fn a_cancelled_request_stops_soon_and_the_group_serves_the_next() {
    // Many tiles of 32 pixels: long enough to be stopped half way.
    let vae = Vae::builder(support::fixtures().join("sd_like"))
        .tiling(vae_parallel::TileOverrides { sample_min_size: Some(32), ..Default::default() })
        .build()
        .unwrap();
    let group = Group::local(2).unwrap();
    let latent = Tensor::seeded_uniform([1, 4, 96, 96], 3, -1.0, 1.0, &Device::Cpu).unwrap();
    let tiles = Decode::default().tiled();
    let started = Instant::now();
    group.decode(&vae, &latent, &tiles).unwrap();
    let full = started.elapsed();

    let token = CancelToken::new();
    let canceller = token.clone();
    let timer = std::thread::spawn(move || {
        std::thread::sleep(full / 5);
        canceller.cancel("the client went away");
    });
    let started = Instant::now();
    let err = group.run(&vae, Request::decode(&latent, &tiles).cancel_on(&token)).unwrap_err();
    let stopped = started.elapsed();
    timer.join().unwrap();
    assert!(err.to_line().contains("the client went away"), "{err}");
    assert!(stopped < full * 3 / 5, "stopped after {stopped:?} of {full:?}");
    // A token cancelled before its request: it does not run.
    let err = group.run(&vae, Request::decode(&latent, &tiles).cancel_on(&token)).unwrap_err();
    assert!(err.to_line().contains("the client went away"), "{err}");
    // The local group serves the next request.
    let small = latent.narrow(2, 0, 8).unwrap().narrow(3, 0, 8).unwrap();
    assert!(group.decode(&vae, &small, &tiles).unwrap().is_some());
}

#[test]
fn one_group_serves_requests_from_several_threads_one_at_a_time() {
    let vae = Vae::load(support::fixtures().join("sd_like")).unwrap();
    let group = Group::local(2).unwrap();
    let latent = Tensor::seeded_uniform([1, 4, 12, 16], 9, -1.0, 1.0, &Device::Cpu).unwrap();
    let alone = group.decode(&vae, &latent, &Decode::default()).unwrap().unwrap();
    let done = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for _ in 0..3 {
            scope.spawn(|| {
                for _ in 0..2 {
                    let image = group.decode(&vae, &latent, &Decode::default()).unwrap().unwrap();
                    assert!(image.bit_eq(&alone));
                    done.fetch_add(1, Ordering::SeqCst);
                }
            });
        }
    });
    assert_eq!(done.load(Ordering::SeqCst), 6);
}

#[test]
fn a_group_of_zero_ranks_is_an_invalid_option() {
    let err = Group::local(0).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidOption);
    assert_eq!(err.to_string(), "`ranks` must be at least 1");
}

/// Two ranks of a group of processes (threads here, each holding its own `Group` made from its
/// communicator, as two processes would): what every rank refuses alike leaves the group
/// usable, and so does a cancel that comes after its request ended.
#[test]
fn refusals_and_late_cancels_leave_a_group_of_processes_usable() {
    use std::sync::Arc;

    use vae_parallel::ParallelMode;
    use vae_parallel::transport::{TransportConfig, run_local};

    let vae = Vae::load(support::fixtures().join("sd_like")).unwrap();
    let latent = Tensor::seeded_uniform([1, 4, 12, 16], 5, -1.0, 1.0, &Device::Cpu).unwrap();
    let results = run_local(2, TransportConfig::default(), |comm| {
        let group = Group::from_communicator(Arc::new(comm));
        // An image VAE has no pipeline: refused by each rank on its own, nothing aborted.
        let piped = group.decode(&vae, &latent, &Decode::default().mode(ParallelMode::Pipeline)).unwrap_err();
        assert_eq!(piped.kind(), ErrorKind::Unsupported, "{piped}");
        let mut grid = Decode::default().mode(ParallelMode::Tile);
        grid.shard_grid = Some([0, 2]);
        assert_eq!(group.decode(&vae, &latent, &grid).unwrap_err().kind(), ErrorKind::InvalidOption);
        // A request that finished, then its token cancelled (a client that left after its answer).
        let token = CancelToken::new();
        group.run(&vae, Request::decode(&latent, &Decode::default()).cancel_on(&token)).unwrap();
        token.cancel("the client went away");
        // The group still serves requests.
        let image = group.decode(&vae, &latent, &Decode::default().mode(ParallelMode::SpatialShardHeight)).unwrap();
        assert!(group.failure().is_none());
        image.map(|t| t.dims().to_vec())
    })
    .unwrap();
    assert_eq!(results[0].as_ref().unwrap().as_deref(), Some(&[1, 3, 96, 128][..]));
    assert!(results[1].as_ref().unwrap().is_none(), "the pixels go to the owner");
}
