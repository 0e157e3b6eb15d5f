//! Spatial-shard decode of the GroupNorm families (AutoencoderKL: SD, FLUX.1, Z-Image; and
//! FLUX.2) on local and socket ranks against the single-rank direct decode: bit for bit, on
//! every rank count and along either axis, with the whole map's GroupNorm statistics exchanged.

use vae_integration_tests::fixtures_dir;
use vae_models::autoencoder_kl::{AutoencoderKl, KlShardOperator, KlTask};
use vae_parallel::io::read_npy;
use vae_runtime::{RankReport, ShardAxis, StrategyReport};
use vae_tensor::Tensor;

/// The GroupNorm families of the fixtures.
const MODELS: [&str; 3] = ["sd_like", "flux1_like", "flux2_like"];

fn load(name: &str) -> AutoencoderKl {
    AutoencoderKl::load(&fixtures_dir().join("autoencoder_kl").join(name)).unwrap()
}

/// Shard-decodes `z` on `world` local ranks; returns the owner's output and every report.
fn shard_decode(model: &AutoencoderKl, z: &Tensor, axis: ShardAxis, world: usize) -> (Tensor, Vec<RankReport>) {
    shard(model, KlTask::Decode, z, axis, world)
}

/// Shards `task` of `input` on `world` local ranks.
fn shard(
    model: &AutoencoderKl,
    task: KlTask,
    input: &Tensor,
    axis: ShardAxis,
    world: usize,
) -> (Tensor, Vec<RankReport>) {
    vae_integration_tests::shard_on_local_ranks(&KlShardOperator::new(model, task, world), input, axis, world)
}

/// `task` of `input` sharded along both axes on 1–4 ranks, each bit-identical to `direct`;
/// `check` sees every run's reports. Returns the number of runs.
fn each_shard_is_direct(
    model: &AutoencoderKl,
    task: KlTask,
    input: &Tensor,
    direct: &Tensor,
    mut check: impl FnMut(ShardAxis, usize, &RankReport, &vae_runtime::ShardTraffic),
) -> usize {
    let mut runs = 0;
    for axis in [ShardAxis::Height, ShardAxis::Width] {
        for world in 1..=4 {
            let (got, reports) = shard(model, task, input, axis, world);
            assert_eq!(got.dims(), direct.dims(), "{task:?} {axis} {world}");
            let diff = got.max_abs_diff(direct).unwrap();
            assert!(got.bit_eq(direct), "{task:?} shard {axis} on {world} ranks: max |shard - direct| = {diff}");
            for r in &reports {
                let StrategyReport::Shard { axis: a, band: Some(band), traffic } = &r.strategy else {
                    panic!("rank {} ran {:?}", r.rank, r.strategy);
                };
                assert_eq!(*a, axis);
                assert!(!band.is_empty());
                check(axis, world, r, traffic);
            }
            runs += 1;
        }
    }
    runs
}

/// The fixture case `input` → `output` of every model, `task` sharded along `axis` on `world`
/// ranks: within 1e-4 of diffusers, as the direct computation is.
fn near_the_fixtures(task: KlTask, input: &str, output: &str, axis: ShardAxis, world: usize) {
    for name in MODELS {
        let model = load(name);
        let dir = fixtures_dir().join("autoencoder_kl");
        let x = read_npy(dir.join(format!("{name}.{input}.npy"))).unwrap();
        let want = read_npy(dir.join(format!("{name}.{output}.npy"))).unwrap();
        let (got, _) = shard(&model, task, &x, axis, world);
        let diff = got.max_abs_diff(&want).unwrap();
        assert!(diff <= 1e-4, "{name} {task:?}: max |shard - diffusers| = {diff}");
    }
}

#[test]
fn shard_decode_equals_the_direct_decode_bit_for_bit_on_one_to_four_ranks() {
    let mut cases = 0;
    for name in MODELS {
        let model = load(name);
        let cfg = model.config();
        // Banded GroupNorms: four in the mid-block's resnets, two per resnet of each up block,
        // and the output norm (the attention's runs on the gathered map); two exchanges each
        // (the sum, the squared deviations).
        let norms = 4 + cfg.decoder_block_out_channels.len() * (cfg.layers_per_block + 1) * 2 + 1;
        // Batch 2, extents that do not divide by 2, 3 or 4 (5×7 once made the attention's
        // GEMMs differ when a band attended with its own queries only).
        for (h, w) in [(7, 10), (5, 7)] {
            let z = vae_integration_tests::random_tensor(&[2, cfg.latent_channels, h, w], 5);
            let direct = model.decode(&z).unwrap();
            cases += each_shard_is_direct(&model, KlTask::Decode, &z, &direct, |_, world, r, traffic| {
                // Every GroupNorm exchanged its statistics; the mid-block attention gathered the
                // map once; halos crossed between neighbours.
                assert_eq!(traffic.norm_exchanges, 2 * norms as u64, "{name} rank {}: {traffic:?}", r.rank);
                assert_eq!(traffic.map_gathers, 1, "{name} rank {}", r.rank);
                if world > 1 {
                    assert!(traffic.halo_bytes_sent > 0 && traffic.norm_bytes_sent > 0, "{name} rank {}", r.rank);
                }
                // Bands of three latent rows or more leave an interior to compute while the
                // halos travel.
                if world == 2 && (h, w) == (7, 10) {
                    assert!(traffic.halo_overlapped > 0, "{name} rank {}: {traffic:?}", r.rank);
                }
            });
        }
    }
    assert_eq!(cases, 3 * 2 * 2 * 4);
}

/// Within 1e-4 of diffusers' untiled decode (the fixture), as the direct decode is.
#[test]
fn shard_decode_matches_the_diffusers_fixture() {
    near_the_fixtures(KlTask::Decode, "decode.in", "decode.out", ShardAxis::Height, 3);
}

/// One loaded model serves shard, tile, direct and encode requests in any order, each as on a
/// fresh model: the same bits every time.
#[test]
fn requests_of_every_kind_leave_no_state_behind() {
    use vae_models::autoencoder_kl::KlOperator;
    let model = load("flux1_like");
    let z = vae_integration_tests::random_tensor(&[1, 16, 6, 9], 8);
    let x = vae_integration_tests::random_tensor(&[1, 3, 48, 40], 3);
    let tile = || vae_runtime::execute_serial(&KlOperator::new(&model, KlTask::Decode, true), &z).unwrap();
    let first_tile = tile();
    let direct = model.decode(&z).unwrap();
    let moments = model.encode_moments(&x).unwrap();
    let (h, _) = shard_decode(&model, &z, ShardAxis::Height, 2);
    let (e, _) = shard(&model, KlTask::Encode, &x, ShardAxis::Width, 3);
    let (w, _) = shard_decode(&model, &z, ShardAxis::Width, 3);
    let again = model.decode(&z).unwrap();
    let (h2, _) = shard_decode(&model, &z, ShardAxis::Height, 2);
    for t in [&h, &w, &again, &h2] {
        assert!(t.bit_eq(&direct));
    }
    assert!(e.bit_eq(&moments));
    assert!(tile().bit_eq(&first_tile), "tiles after shards: the first tile run's bits");
}

/// `auto` shards where tiles would otherwise be used, along the longer latent axis that gives
/// every rank a row (width on ties), and keeps tiles elsewhere; forced modes fall back only
/// when the axis is too short; encode always tiles.
#[test]
fn the_policy_shards_where_tiles_would_be_used() {
    use vae_models::family::Direction;
    use vae_runtime::{ParallelMode, Strategy};
    let model = load("sd_like");
    let t = model.tiling().tile_latent_min_size;
    let decode = |mode, dims: &[usize], ranks| model.strategy(Direction::Decode, mode, dims, ranks);
    let auto = |dims: &[usize], ranks| decode(ParallelMode::Auto, dims, ranks).strategy;
    assert_eq!(auto(&[1, 4, t + 3, t + 1], 2), Strategy::Shard(ShardAxis::Height));
    assert_eq!(auto(&[1, 4, t + 1, t + 1], 2), Strategy::Shard(ShardAxis::Width));
    assert_eq!(auto(&[1, 4, 2, t + 9], 3), Strategy::Shard(ShardAxis::Width));
    assert_eq!(auto(&[1, 4, t, t], 2), Strategy::Tile, "one tile: decoded whole");
    assert_eq!(auto(&[1, 4, t + 3, t + 1], 1), Strategy::Tile, "one rank");
    let forced = decode(ParallelMode::SpatialShardHeight, &[1, 4, 2, 9], 3);
    assert!(forced.strategy == Strategy::Tile && forced.fallback, "2 rows cannot go to 3 ranks");
    let forced = decode(ParallelMode::SpatialShardHeight, &[1, 4, 3, 9], 3);
    assert_eq!(forced.strategy, Strategy::Shard(ShardAxis::Height));
    // An encode cuts between whole latent rows: the image extent must be a multiple of 8.
    let encode = |mode, dims: &[usize], ranks| model.strategy(Direction::Encode, mode, dims, ranks);
    assert_eq!(encode(ParallelMode::SpatialShardWidth, &[1, 3, 64, 64], 2).strategy, Strategy::Shard(ShardAxis::Width));
    let odd = encode(ParallelMode::SpatialShardWidth, &[1, 3, 64, 60], 2);
    assert!(odd.strategy == Strategy::Tile && odd.fallback && odd.reason.contains("multiple of 8"), "{}", odd.reason);
    let s = 8 * t;
    assert_eq!(encode(ParallelMode::Auto, &[1, 3, s + 24, s + 8], 2).strategy, Strategy::Shard(ShardAxis::Height));
    assert_eq!(encode(ParallelMode::Auto, &[1, 3, s, s], 2).strategy, Strategy::Tile, "one tile");
}

#[test]
fn shard_encode_equals_the_direct_encode_bit_for_bit_on_one_to_four_ranks() {
    let mut cases = 0;
    for name in MODELS {
        let model = load(name);
        let (c, scale) = (model.config().in_channels, model.config().spatial_scale());
        // Batch 2; latent extents of 7 × 10 and 5 × 7 (a multiple of no rank count).
        for (h, w) in [(7, 10), (5, 7)] {
            let x = vae_integration_tests::random_tensor(&[2, c, h * scale, w * scale], 9);
            let direct = model.encode_moments(&x).unwrap();
            cases += each_shard_is_direct(&model, KlTask::Encode, &x, &direct, |_, _, r, traffic| {
                assert!(traffic.norm_exchanges > 0, "{name} rank {}", r.rank);
            });
        }
    }
    assert_eq!(cases, 3 * 2 * 2 * 4);
}

/// Within 1e-4 of diffusers' untiled encode (the fixture).
#[test]
fn shard_encode_matches_the_diffusers_fixture() {
    near_the_fixtures(KlTask::Encode, "encode.in", "encode_moments.out", ShardAxis::Width, 2);
}
