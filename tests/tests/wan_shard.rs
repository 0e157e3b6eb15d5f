//! Spatial-shard decode of the video VAEs (Wan2.1, Wan2.2, Qwen-Image) on local ranks against
//! the single-rank direct decode, the strategy policy, and request-scoped state.

use std::sync::Arc;

use vae_integration_tests::fixtures_dir;
use vae_models::wan::{WanShardDecodeOperator, WanVae};
use vae_runtime::{
    DistributedVaeExecutor, OutputPlacement, ParallelMode, RankReport, ShardAxis, Strategy, StrategyReport,
};
use vae_tensor::{Device, Tensor};
use vae_transport::{TransportConfig, run_local};

/// The three video families of the fixtures: (directory, model).
const MODELS: [(&str, &str); 3] = [("wan", "wan21_like"), ("wan", "wan22_like"), ("qwen_image", "qwen_image_like")];

fn load(family: &str, name: &str) -> WanVae {
    WanVae::load(&fixtures_dir().join(family).join(name)).unwrap()
}

/// A deterministic latent with values in about [-2, 2] (an LCG: no dependency, same on every
/// platform).
fn latent(dims: [usize; 5], seed: u64) -> Tensor {
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let n = dims.iter().product();
    let data = (0..n)
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        })
        .collect();
    Tensor::from_vec(data, dims.to_vec(), &Device::Cpu).unwrap()
}

/// Shard-decodes `z` on `world` local ranks; returns the owner's output and every report.
fn shard_decode(model: &WanVae, z: &Tensor, axis: ShardAxis, world: usize) -> (Tensor, Vec<RankReport>) {
    let op = WanShardDecodeOperator::new(model);
    let results = run_local(world, TransportConfig::default(), |comm| {
        let exec = DistributedVaeExecutor::new(Arc::new(comm), world).unwrap();
        exec.execute_sharded(z, &op, axis, OutputPlacement::OwnerOnly).unwrap()
    })
    .unwrap();
    let mut outs: Vec<_> = results.into_iter().map(|r| r.unwrap()).collect();
    let tensor = outs[0].tensor.take().expect("rank 0 owns the output");
    assert!(outs[1..].iter().all(|o| o.tensor.is_none()), "owner-only placement");
    (tensor, outs.into_iter().map(|o| o.report).collect())
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
    let z = vae_parallel::io::read_npy(&dir.join("qwen_image_like.decode_t3.in.npy")).unwrap();
    let expected = vae_parallel::io::read_npy(&dir.join("qwen_image_like.decode_t3.out.npy")).unwrap();
    let op = WanShardDecodeOperator::new(&model);
    let results = run_local(2, TransportConfig::default(), |comm| {
        let exec = DistributedVaeExecutor::new(Arc::new(comm), 2).unwrap();
        exec.execute_sharded(&z, &op, ShardAxis::Width, OutputPlacement::AllRanks).unwrap().tensor.unwrap()
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
    // Encode runs as tiles in every mode; a forced shard mode says so.
    assert!(model.encode_strategy(ParallelMode::SpatialShardWidth).fallback);
    assert!(!model.encode_strategy(ParallelMode::Auto).fallback);
}
