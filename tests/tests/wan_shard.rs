//! Spatial-shard decode of the video VAEs (Wan2.1, Wan2.2, Qwen-Image) on local ranks against
//! the single-rank direct decode, the strategy policy, and request-scoped state.

use std::sync::Arc;

use vae_integration_tests::fixtures_dir;
use vae_models::wan::{WanShardDecodeOperator, WanShardEncodeOperator, WanVae};
use vae_runtime::{
    DistributedVaeExecutor, Job, Output, OutputPlacement, ParallelMode, RankReport, ShardAxis, Strategy, StrategyReport,
};
use vae_tensor::{Device, Tensor};
use vae_transport::{TransportConfig, run_local};

/// The three video families of the fixtures: (directory, model).
const MODELS: [(&str, &str); 3] = [("wan", "wan21_like"), ("wan", "wan22_like"), ("qwen_image", "qwen_image_like")];

fn load(family: &str, name: &str) -> WanVae {
    WanVae::load(&fixtures_dir().join(family).join(name)).unwrap()
}

fn latent(dims: [usize; 5], seed: u64) -> Tensor {
    vae_integration_tests::random_tensor(&dims, seed)
}

/// Shard-decodes `z` on `world` local ranks; returns the owner's output and every report.
fn shard_decode(model: &WanVae, z: &Tensor, axis: ShardAxis, world: usize) -> (Tensor, Vec<RankReport>) {
    vae_integration_tests::shard_on_local_ranks(&WanShardDecodeOperator::new(model), z, axis, world)
}

#[test]
fn shard_decode_equals_the_direct_decode_on_two_to_four_ranks_for_every_family() {
    // Extents that do not divide by 2, 3 or 4, several latent frames.
    let mut bit_identical = Vec::new();
    let mut worst = 0.0f32;
    for (family, name) in MODELS {
        let model = load(family, name);
        let z_dim = model.config().z_dim;
        let z = latent([1, z_dim, 3, 7, 10], 11);
        let direct = model.decode(&z).unwrap();
        for axis in [ShardAxis::Height, ShardAxis::Width] {
            for world in 2..=4 {
                let (got, reports) = shard_decode(&model, &z, axis, world);
                assert_eq!(got.dims(), direct.dims(), "{name} {axis} {world}");
                let diff = got.max_abs_diff(&direct).unwrap();
                assert!(diff <= 1e-5, "{name} shard {axis} on {world} ranks: max |shard - direct| = {diff}");
                worst = worst.max(diff);
                if got.bit_eq(&direct) {
                    bit_identical.push(format!("{name}/{axis}/{world}"));
                }
                // Every rank held its own band and exchanged halos with its neighbours.
                for r in &reports {
                    let StrategyReport::Shard { axis: a, band: Some(band), traffic } = &r.strategy else {
                        panic!("rank {} ran {:?}", r.rank, r.strategy);
                    };
                    assert_eq!(*a, axis);
                    assert!(!band.is_empty());
                    assert!(traffic.halo_exchanges > 0 && traffic.halo_bytes_sent > 0, "rank {}", r.rank);
                    assert_eq!(traffic.map_gathers, 3, "one attention gather per latent frame");
                    // Bands of three latent rows or more overlap their exchanges.
                    if world == 2 {
                        assert!(traffic.halo_overlapped > 0, "rank {}: {traffic:?}", r.rank);
                    }
                }
            }
        }
    }
    // Reported, not asserted: bit-identity is the goal, 1e-5 the contract.
    #[allow(clippy::print_stdout)]
    {
        println!("max |shard - direct| = {worst:e}; bit-identical: {} of 18: {bit_identical:?}", bit_identical.len());
    }
}

/// The encode shards too, cut between whole latent rows (8 pixel rows; 16 for Wan2.2's
/// patchified input): bit-identical to the direct encode on 1–4 ranks, along either axis.
#[test]
fn shard_encode_equals_the_direct_encode_bit_for_bit_for_every_family() {
    let mut cases = 0;
    for (family, name) in MODELS {
        let model = load(family, name);
        let unit = 8 * model.config().patch_size.filter(|p| *p > 1).unwrap_or(1);
        // Five frames (two chunks), latent extents of 5 x 7 (a multiple of no rank count).
        let x = vae_integration_tests::random_tensor(&[1, 3, 5, 5 * unit, 7 * unit], 4);
        let direct = model.encode_moments(&x).unwrap();
        for axis in [ShardAxis::Height, ShardAxis::Width] {
            for world in 1..=4 {
                let op = WanShardEncodeOperator::new(&model);
                let (got, reports) = vae_integration_tests::shard_on_local_ranks(&op, &x, axis, world);
                assert_eq!(got.dims(), direct.dims(), "{name} {axis} {world}");
                assert!(
                    got.bit_eq(&direct),
                    "{name} shard encode {axis} on {world} ranks: max |shard - direct| = {}",
                    got.max_abs_diff(&direct).unwrap()
                );
                for r in &reports {
                    let StrategyReport::Shard { band: Some(band), traffic, .. } = &r.strategy else {
                        panic!("rank {} ran {:?}", r.rank, r.strategy);
                    };
                    assert!(!band.is_empty(), "{name} rank {}", r.rank);
                    if world > 1 {
                        assert!(traffic.halo_bytes_sent > 0, "{name} rank {}", r.rank);
                    }
                }
                cases += 1;
            }
        }
    }
    assert_eq!(cases, 3 * 2 * 4);
}

#[test]
fn a_shard_over_one_rank_is_the_direct_decode_bit_for_bit() {
    let model = load("wan", "wan21_like");
    let z = latent([1, 16, 2, 3, 5], 3);
    let (got, reports) = shard_decode(&model, &z, ShardAxis::Width, 1);
    assert!(got.bit_eq(&model.decode(&z).unwrap()));
    let StrategyReport::Shard { traffic, .. } = &reports[0].strategy else { panic!() };
    assert_eq!(traffic.halo_bytes_sent, 0, "no neighbours, nothing sent");
}

#[test]
fn qwen_image_shards_to_every_rank_and_the_fixture_still_matches_diffusers() {
    // The diffusers fixture of a plain 3-frame decode, reproduced by a 2-rank width shard that
    // hands the output to every rank (Qwen-Image's contract).
    let dir = fixtures_dir().join("qwen_image");
    let model = load("qwen_image", "qwen_image_like");
    let z = vae_parallel::io::read_npy(dir.join("qwen_image_like.decode_t3.in.npy")).unwrap();
    let expected = vae_parallel::io::read_npy(dir.join("qwen_image_like.decode_t3.out.npy")).unwrap();
    let op = WanShardDecodeOperator::new(&model);
    let results = run_local(2, TransportConfig::default(), |comm| {
        let exec = DistributedVaeExecutor::new(Arc::new(comm), 2).unwrap();
        exec.run(&z, Job::bands(&op, ShardAxis::Width), Output::Placed(OutputPlacement::AllRanks))
            .unwrap()
            .tensor
            .unwrap()
    })
    .unwrap();
    for r in results {
        let diff = r.unwrap().max_abs_diff(&expected).unwrap();
        assert!(diff <= 1e-4, "{diff}");
    }
}

#[test]
fn the_auto_policy_follows_the_reference_table_and_its_own_edge_cases() {
    let model = load("wan", "wan21_like");
    let pick = |t: usize, h: usize, w: usize, world: usize| {
        model.decode_strategy(ParallelMode::Auto, &[1, 16, t, h, w], world).strategy
    };
    // The reference's table (world 4).
    assert_eq!(pick(5, 60, 104, 4), Strategy::Shard(ShardAxis::Width));
    assert_eq!(pick(5, 104, 60, 4), Strategy::Shard(ShardAxis::Height));
    assert_eq!(pick(5, 64, 64, 4), Strategy::Shard(ShardAxis::Width));
    assert_eq!(pick(5, 2, 2, 4), Strategy::Tile);
    assert_eq!(pick(5, 60, 104, 1), Strategy::Tile);
    assert_eq!(model.decode_strategy(ParallelMode::Auto, &[1, 16, 60, 104], 4).strategy, Strategy::Tile);
    // Edge cases: only one axis fits (the shorter one is too short); exactly one row per rank.
    assert_eq!(pick(1, 3, 2, 3), Strategy::Shard(ShardAxis::Height));
    assert_eq!(pick(1, 2, 3, 3), Strategy::Shard(ShardAxis::Width));
    assert_eq!(pick(1, 4, 4, 4), Strategy::Shard(ShardAxis::Width));
    assert_eq!(pick(1, 3, 3, 4), Strategy::Tile);
    // Deterministic and free of side effects: the same question, the same answer.
    let reason = model.decode_strategy(ParallelMode::Auto, &[1, 16, 5, 60, 104], 4).reason;
    assert_eq!(reason, model.decode_strategy(ParallelMode::Auto, &[1, 16, 5, 60, 104], 4).reason);
    assert!(reason.contains("width"), "{reason}");
}

#[test]
fn forced_axes_fall_back_to_tile_with_a_reason_and_are_never_swapped() {
    let model = load("wan", "wan21_like");
    let height = model.decode_strategy(ParallelMode::SpatialShardHeight, &[1, 16, 2, 3, 40], 4);
    assert_eq!(height.strategy, Strategy::Tile, "height 3 cannot feed 4 ranks; never reinterpreted as width");
    assert!(height.fallback);
    assert!(height.reason.contains("latent height of 3") && height.reason.contains("4 rank"), "{}", height.reason);
    let width = model.decode_strategy(ParallelMode::SpatialShardWidth, &[1, 16, 2, 3, 40], 4);
    assert_eq!(width.strategy, Strategy::Shard(ShardAxis::Width));
    assert!(!width.fallback);
    // A shard request applies at any size that fits, below the tiling threshold too.
    let small = model.decode_strategy(ParallelMode::SpatialShardHeight, &[1, 16, 1, 2, 2], 2);
    assert_eq!(small.strategy, Strategy::Shard(ShardAxis::Height));
    // An encode shards in whole latent rows (8 pixels here): a width of 60 cannot.
    let enc = |mode, dims: &[usize], ranks| model.encode_strategy(mode, dims, ranks);
    let forced = enc(ParallelMode::SpatialShardWidth, &[1, 3, 5, 40, 64], 2);
    assert_eq!(forced.strategy, Strategy::Shard(ShardAxis::Width));
    let odd = enc(ParallelMode::SpatialShardWidth, &[1, 3, 5, 40, 60], 2);
    assert!(odd.fallback && odd.reason.contains("not a multiple of 8"), "{}", odd.reason);
    let small = enc(ParallelMode::Auto, &[1, 3, 5, 40, 64], 2);
    assert!(small.strategy == Strategy::Tile && !small.fallback, "frames within one tile: {}", small.reason);
    let t = model.tiling();
    let (th, tw) = (t.tile_sample_min_height, t.tile_sample_min_width);
    let big = enc(ParallelMode::Auto, &[1, 3, 5, th + 8, tw + 40], 2);
    assert_eq!(big.strategy, Strategy::Shard(ShardAxis::Width), "{}", big.reason);
}

/// The allocator high-water mark of a plain decode on a fresh thread, above what was live.
fn direct_decode_peak(model: &WanVae, z: &Tensor) -> usize {
    std::thread::scope(|s| {
        s.spawn(|| {
            let before = vae_tensor::memory::live_bytes();
            vae_tensor::memory::reset_peak();
            let out = model.decode(z).unwrap();
            drop(out);
            vae_tensor::memory::peak_bytes() - before
        })
        .join()
        .unwrap()
    })
}

#[test]
fn per_rank_activation_peak_falls_as_one_over_n() {
    let model = load("wan", "wan21_like");
    let z = latent([1, 16, 2, 24, 24], 5);
    let direct = direct_decode_peak(&model, &z) as f64;
    for axis in [ShardAxis::Height, ShardAxis::Width] {
        for world in [2, 3, 4] {
            let (_, reports) = shard_decode(&model, &z, axis, world);
            // The computation's peak (the owner's assembled output comes after it).
            let worst = reports.iter().map(|r| r.exec_peak_bytes).max().unwrap() as f64;
            let ratio = worst / direct;
            let bound = 1.25 / world as f64;
            assert!(
                ratio <= bound,
                "{axis} on {world} ranks: peak {worst} / direct {direct} = {ratio:.3} > {bound:.3}"
            );
        }
    }
}

/// One loaded model, one group of 4 local ranks, requests of every kind in a row: each
/// request's strategy state lives and dies with it.
#[test]
fn one_loaded_model_serves_mixed_requests_in_any_order() {
    let engine = vae_integration_tests::load_vae(&fixtures_dir().join("wan").join("wan21_like"));
    let model: &WanVae = engine.model().as_any().downcast_ref().expect("a video VAE");
    let tiled = latent([1, 16, 2, 8, 12], 21);
    let small = latent([1, 16, 1, 2, 2], 22);
    let landscape = latent([1, 16, 2, 4, 12], 23);
    let portrait = latent([1, 16, 2, 12, 4], 24);
    let direct_landscape = model.decode(&landscape).unwrap();
    let direct_portrait = model.decode(&portrait).unwrap();
    let options = vae_integration_tests::reference;
    let results = run_local(4, TransportConfig::default(), |comm| {
        let exec = DistributedVaeExecutor::new(Arc::new(comm), 4).unwrap();
        let live_before = vae_tensor::memory::live_bytes();
        let run = |z: &Tensor, mode| {
            let out = engine.decode_on(&exec, z, &options(mode)).unwrap();
            (out.tensor, out.report.strategy.label(), out.report.reason.unwrap())
        };
        let first_tile = run(&tiled, ParallelMode::Tile);
        let auto_small = run(&small, ParallelMode::Auto);
        let auto_landscape = run(&landscape, ParallelMode::Auto);
        let second_tile = run(&tiled, ParallelMode::Tile);
        let forced_portrait = run(&portrait, ParallelMode::SpatialShardHeight);
        let auto_portrait = run(&portrait, ParallelMode::Auto);
        let leftover = vae_tensor::memory::live_bytes() as i64 - live_before as i64;
        (first_tile, auto_small, auto_landscape, second_tile, forced_portrait, auto_portrait, leftover)
    })
    .unwrap();
    for (rank, r) in results.into_iter().enumerate() {
        let (first_tile, auto_small, auto_landscape, second_tile, forced_portrait, auto_portrait, leftover) =
            r.unwrap();
        assert_eq!(first_tile.1, "tile");
        assert_eq!(auto_small.1, "tile", "{}", auto_small.2);
        assert_eq!(auto_landscape.1, "shard-width", "{}", auto_landscape.2);
        assert_eq!(forced_portrait.1, "shard-height");
        assert_eq!(auto_portrait.1, "shard-height", "{}", auto_portrait.2);
        // Only the outputs this rank received are still alive; nothing else stayed behind.
        let kept: i64 =
            [&first_tile.0, &auto_small.0, &auto_landscape.0, &second_tile.0, &forced_portrait.0, &auto_portrait.0]
                .iter()
                .filter_map(|t| t.as_ref().map(|t| t.size_in_bytes() as i64))
                .sum();
        assert_eq!(leftover, kept, "rank {rank}: bytes left behind beyond its outputs");
        if rank > 0 {
            assert_eq!(kept, 0, "owner-only outputs");
            continue;
        }
        let first = first_tile.0.unwrap();
        assert!(first.bit_eq(&second_tile.0.unwrap()), "tile after shard requests is bit-identical to before");
        assert!(auto_landscape.0.unwrap().bit_eq(&direct_landscape));
        assert!(forced_portrait.0.unwrap().bit_eq(&direct_portrait));
        assert!(auto_portrait.0.unwrap().bit_eq(&direct_portrait));
    }
    // And the direct decode of the same model, after all that, is unchanged.
    assert!(model.decode(&portrait).unwrap().bit_eq(&direct_portrait));
}

#[test]
fn ranks_beyond_the_parallel_size_join_the_collectives_without_a_band() {
    let model = load("wan", "wan22_like");
    let z = latent([1, 48, 2, 5, 3], 8);
    let direct = model.decode(&z).unwrap();
    let op = WanShardDecodeOperator::new(&model);
    let results = run_local(4, TransportConfig::default(), |comm| {
        let exec = DistributedVaeExecutor::new(Arc::new(comm), 2).unwrap();
        exec.run(&z, Job::bands(&op, ShardAxis::Height), Output::Placed(OutputPlacement::AllRanks)).unwrap()
    })
    .unwrap();
    for (rank, r) in results.into_iter().enumerate() {
        let out = r.unwrap();
        assert!(out.tensor.unwrap().bit_eq(&direct), "rank {rank}");
        let StrategyReport::Shard { band, .. } = &out.report.strategy else { panic!() };
        assert_eq!(band.is_some(), rank < 2, "rank {rank}: {band:?}");
    }
}

/// A sharded computation that fails on rank 1 between two halo exchanges.
struct FailsMidway;

impl vae_runtime::ShardOperator for FailsMidway {
    fn geometry(&self, _: &Tensor, _: ShardAxis) -> Result<vae_runtime::ShardGeometry, vae_runtime::OperatorError> {
        Ok(vae_runtime::ShardGeometry { min_band: 1, unit: 1 })
    }

    fn exec(
        &self,
        input: &Tensor,
        ctx: &mut vae_runtime::ShardContext<'_>,
    ) -> Result<Tensor, vae_runtime::OperatorError> {
        let band = ctx.local_input(input)?;
        let first = ctx.with_halo(&band, 1)?;
        if ctx.rank() == 1 {
            return Err("out of scratch memory".into());
        }
        let _ = ctx.with_halo(&band, 1)?;
        Ok(first)
    }

    fn finish(&self, assembled: Tensor) -> Result<Tensor, vae_runtime::OperatorError> {
        Ok(assembled)
    }

    fn device(&self) -> Device {
        Device::Cpu
    }
}

#[test]
fn a_failure_inside_a_shard_computation_fails_every_rank_fast_instead_of_hanging() {
    let z = latent([1, 2, 1, 8, 8], 1);
    let started = std::time::Instant::now();
    let results = run_local(3, TransportConfig::default(), |comm| {
        let exec = DistributedVaeExecutor::new(Arc::new(comm), 3).unwrap();
        exec.run(&z, Job::bands(&FailsMidway, ShardAxis::Width), Output::Placed(OutputPlacement::OwnerOnly))
            .unwrap_err()
            .to_string()
    })
    .unwrap();
    assert!(started.elapsed() < std::time::Duration::from_secs(5), "took {:?}", started.elapsed());
    for (rank, r) in results.into_iter().enumerate() {
        let message = r.unwrap();
        if rank == 1 {
            assert!(message.contains("sharded computation failed on rank 1: out of scratch memory"), "{message}");
        } else {
            assert!(message.contains("rank 1"), "rank {rank} should learn who failed: {message}");
        }
    }
}

#[test]
fn a_bad_latent_or_a_too_narrow_band_is_an_agreed_error_and_the_group_stays_usable() {
    let model = load("wan", "wan21_like");
    let op = WanShardDecodeOperator::new(&model);
    let wrong_channels = latent([1, 8, 1, 4, 4], 2);
    let too_narrow = latent([1, 16, 1, 2, 8], 2);
    let fine = latent([1, 16, 1, 4, 4], 2);
    let direct = model.decode(&fine).unwrap();
    let results = run_local(3, TransportConfig::default(), |comm| {
        let exec = DistributedVaeExecutor::new(Arc::new(comm), 3).unwrap();
        let placement = OutputPlacement::AllRanks;
        let e1 = exec.run(&wrong_channels, Job::bands(&op, ShardAxis::Height), Output::Placed(placement)).unwrap_err();
        let e2 = exec.run(&too_narrow, Job::bands(&op, ShardAxis::Height), Output::Placed(placement)).unwrap_err();
        let ok = exec.run(&fine, Job::bands(&op, ShardAxis::Height), Output::Placed(placement)).unwrap();
        (e1.to_string(), e2.to_string(), ok.tensor.unwrap())
    })
    .unwrap();
    for r in results {
        let (e1, e2, ok) = r.unwrap();
        assert!(e1.contains("[B, 16, T, H, W]"), "{e1}");
        assert!(e2.contains("cannot give 3 ranks a band"), "{e2}");
        assert!(ok.bit_eq(&direct));
    }
}
