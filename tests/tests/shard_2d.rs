//! The 2-D spatial shard (`spatial_shard_2d`): the GroupNorm families (AutoencoderKL: SD,
//! FLUX.1, Z-Image; and FLUX.2) and the video families with per-pixel norms (Wan2.1, Wan2.2,
//! Qwen-Image) on grids of blocks, each rank holding one block through every layer with halos
//! along both axes and corners from the diagonal neighbours, against the single-rank direct
//! decode and encode: bit for bit on every grid.

use vae_integration_tests::{blocks_on_local_ranks, fixtures_dir, random_tensor};
use vae_models::autoencoder_kl::{AutoencoderKl, KlShardOperator, KlTask};
use vae_parallel::io::read_npy;
use vae_runtime::{Job, Output, RankReport, ShardAxis, ShardTraffic, StrategyReport};
use vae_tensor::Tensor;

const MODELS: [&str; 3] = ["sd_like", "flux1_like", "flux2_like"];

/// Grids of 2 to 6 ranks, both orientations of the 1-D cuts among them.
const GRIDS: [[usize; 2]; 4] = [[1, 2], [2, 1], [2, 2], [2, 3]];

fn load(name: &str) -> AutoencoderKl {
    AutoencoderKl::load(&fixtures_dir().join("autoencoder_kl").join(name)).unwrap()
}

fn blocks(model: &AutoencoderKl, task: KlTask, input: &Tensor, grid: [usize; 2]) -> (Tensor, Vec<RankReport>) {
    let world = grid[0] * grid[1];
    blocks_on_local_ranks(&KlShardOperator::new(model, task, world), input, grid, world)
}

/// Every rank's block and traffic, checked to be a block of `grid`.
fn traffic_of(reports: &[RankReport], grid: [usize; 2]) -> Vec<ShardTraffic> {
    reports
        .iter()
        .map(|r| match &r.strategy {
            StrategyReport::Blocks { grid: g, block: Some([rows, cols]), traffic } => {
                assert_eq!(*g, grid);
                assert!(!rows.is_empty() && !cols.is_empty(), "rank {}: an empty block", r.rank);
                *traffic
            }
            other => panic!("rank {} ran {other:?}", r.rank),
        })
        .collect()
}

#[test]
fn block_decode_equals_the_direct_decode_bit_for_bit_on_every_grid() {
    let mut cases = 0;
    for name in MODELS {
        let model = load(name);
        let cfg = model.config();
        let norms = 4 + cfg.decoder_block_out_channels.len() * (cfg.layers_per_block + 1) * 2 + 1;
        // Batch 2; extents that do not divide by the grid (uneven blocks).
        for (h, w) in [(7, 10), (5, 7)] {
            let z = random_tensor(&[2, cfg.latent_channels, h, w], 5);
            let direct = model.decode(&z).unwrap();
            for grid in GRIDS {
                let (got, reports) = blocks(&model, KlTask::Decode, &z, grid);
                let diff = got.max_abs_diff(&direct).unwrap();
                assert!(got.bit_eq(&direct), "{name} {h}x{w} on {grid:?}: max |blocks - direct| = {diff}");
                for (rank, t) in traffic_of(&reports, grid).iter().enumerate() {
                    assert_eq!(t.norm_exchanges, 2 * norms as u64, "{name} rank {rank}: {t:?}");
                    assert_eq!(t.map_gathers, 1, "{name} rank {rank}");
                    assert!(t.halo_bytes_sent > 0, "{name} rank {rank}");
                    // Blocks of three latent rows and columns or more overlap their exchanges.
                    if (h, w) == (7, 10) {
                        assert!(t.halo_overlapped > 0, "{name} {grid:?} rank {rank}: {t:?}");
                    }
                }
                cases += 1;
            }
        }
    }
    assert_eq!(cases, 3 * 2 * GRIDS.len());
}

/// The encoder's strided convolutions on blocks of whole latent rows and columns: the moments
/// of the untiled encode, bit for bit.
#[test]
fn block_encode_equals_the_direct_encode_bit_for_bit_on_every_grid() {
    for name in MODELS {
        let model = load(name);
        let scale = model.config().spatial_scale();
        let x = random_tensor(&[2, model.config().in_channels, 5 * scale, 7 * scale], 3);
        let direct = model.encode_moments(&x).unwrap();
        for grid in GRIDS {
            let (got, _) = blocks(&model, KlTask::Encode, &x, grid);
            assert!(got.bit_eq(&direct), "{name} encode on {grid:?}: {}", got.max_abs_diff(&direct).unwrap());
        }
    }
}

/// Within 1e-4 of diffusers' untiled decode (the fixture), as the direct decode is.
#[test]
fn block_decode_matches_the_diffusers_fixture() {
    for name in MODELS {
        let model = load(name);
        let dir = fixtures_dir().join("autoencoder_kl");
        let z = read_npy(dir.join(format!("{name}.decode.in.npy"))).unwrap();
        let want = read_npy(dir.join(format!("{name}.decode.out.npy"))).unwrap();
        let (got, _) = blocks(&model, KlTask::Decode, &z, [2, 2]);
        let diff = got.max_abs_diff(&want).unwrap();
        assert!(diff <= 1e-4, "{name}: max |blocks - diffusers| = {diff}");
    }
}

/// On 4 ranks and a square latent, 2 × 2 blocks make the busiest rank send about half the
/// halo bytes of 4 row bands (an inner band sends two full-width edges per convolution, a
/// block a half-width edge and a half-height edge), and fewer halo bytes in all.
#[test]
fn a_two_by_two_grid_halves_the_busiest_ranks_halo_bytes_of_four_bands() {
    let model = load("sd_like");
    let z = random_tensor(&[1, model.config().latent_channels, 16, 16], 2);
    let (bands, band_reports) = vae_integration_tests::shard_on_local_ranks(
        &KlShardOperator::new(&model, KlTask::Decode, 4),
        &z,
        ShardAxis::Height,
        4,
    );
    let (grid, grid_reports) = blocks(&model, KlTask::Decode, &z, [2, 2]);
    assert!(grid.bit_eq(&bands));
    let halo = |r: &RankReport| match &r.strategy {
        StrategyReport::Shard { traffic, .. } | StrategyReport::Blocks { traffic, .. } => traffic.halo_bytes_sent,
        _ => 0,
    };
    let busiest = |rs: &[RankReport]| rs.iter().map(halo).max().unwrap();
    let total = |rs: &[RankReport]| rs.iter().map(halo).sum::<u64>();
    let (b, g) = (busiest(&band_reports), busiest(&grid_reports));
    let ratio = g as f64 / b as f64;
    assert!((0.45..0.6).contains(&ratio), "busiest rank: {g} bytes on 2x2 blocks, {b} on 4 bands ({ratio:.2})");
    assert!(total(&grid_reports) < total(&band_reports));
}

/// A grid larger than the parallel size and a block narrower than a latent row: agreed errors on
/// every rank, before any work.
#[test]
fn a_grid_that_cannot_run_is_an_error_on_every_rank() {
    use vae_runtime::{DistributedVaeExecutor, FailureKind, OutputPlacement, RuntimeError};
    let model = load("sd_like");
    let op = KlShardOperator::new(&model, KlTask::Decode, 4);
    let z = random_tensor(&[1, model.config().latent_channels, 3, 8], 1);
    for (grid, kind) in [([2, 3], FailureKind::InvalidInput), ([4, 1], FailureKind::Failed)] {
        let results = vae_transport::run_local(4, vae_transport::TransportConfig::default(), |comm| {
            let exec = DistributedVaeExecutor::new(std::sync::Arc::new(comm), 4).unwrap();
            exec.run(&z, Job::blocks(&op, grid), Output::Placed(OutputPlacement::OwnerOnly)).map(|_| ())
        })
        .unwrap();
        for r in results {
            let err = r.unwrap().unwrap_err();
            assert!(matches!(&err, RuntimeError::Operator { kind: k, .. } if *k == kind), "{grid:?}: {err:?}");
        }
    }
}

/// The video families of the fixtures (Wan2.1, Wan2.2 with its patchified input and output,
/// Qwen-Image): (directory, model).
const VIDEO_MODELS: [(&str, &str); 3] =
    [("wan", "wan21_like"), ("wan", "wan22_like"), ("qwen_image", "qwen_image_like")];

/// Wan / Qwen-Image decode on grids of blocks: each causal convolution's cached frames keep the
/// halos of both axes (corners included), the attention runs on the gathered map. Held to the
/// 1-D shard's contract (within 1e-5 of the direct decode) and asserted bit-identical, which it
/// is on every grid here.
#[test]
fn video_block_decode_equals_the_direct_decode_on_every_grid() {
    use vae_models::wan::{WanShardDecodeOperator, WanVae};
    for (family, name) in VIDEO_MODELS {
        let model = WanVae::load(&fixtures_dir().join(family).join(name)).unwrap();
        let z = random_tensor(&[1, model.config().z_dim, 3, 7, 10], 11);
        let direct = model.decode(&z).unwrap();
        for grid in GRIDS {
            let world = grid[0] * grid[1];
            let (got, reports) = blocks_on_local_ranks(&WanShardDecodeOperator::new(&model), &z, grid, world);
            let diff = got.max_abs_diff(&direct).unwrap();
            assert!(got.bit_eq(&direct), "{name} on {grid:?}: max |blocks - direct| = {diff}");
            for (rank, t) in traffic_of(&reports, grid).iter().enumerate() {
                assert!(t.halo_exchanges > 0 && t.halo_bytes_sent > 0, "{name} rank {rank}");
                assert!(t.halo_overlapped > 0, "{name} {grid:?} rank {rank}: {t:?}");
                assert_eq!(t.map_gathers, 3, "{name}: one attention gather per latent frame");
            }
        }
    }
}

/// The video encode on blocks of whole latent rows and columns (8 pixels; 16 for Wan2.2's
/// patchified input): the direct encode's moments, bit for bit.
#[test]
fn video_block_encode_equals_the_direct_encode_on_every_grid() {
    use vae_models::wan::{WanShardEncodeOperator, WanVae};
    for (family, name) in VIDEO_MODELS {
        let model = WanVae::load(&fixtures_dir().join(family).join(name)).unwrap();
        let unit = 8 * model.config().patch_size.filter(|p| *p > 1).unwrap_or(1);
        let x = random_tensor(&[1, 3, 5, 5 * unit, 7 * unit], 4);
        let direct = model.encode_moments(&x).unwrap();
        for grid in GRIDS {
            let world = grid[0] * grid[1];
            let (got, _) = blocks_on_local_ranks(&WanShardEncodeOperator::new(&model), &x, grid, world);
            assert!(got.bit_eq(&direct), "{name} encode on {grid:?}: {}", got.max_abs_diff(&direct).unwrap());
        }
    }
}

/// The forced 2-D mode takes the grid closest to square when every block gets a latent row and
/// column (for Wan, the decoder's widest halo), whole latent rows and columns for an encode, and
/// falls back to tiles, saying why, otherwise.
#[test]
fn the_policy_picks_the_squarest_grid_that_fits() {
    use vae_models::family::Direction;
    use vae_runtime::{ParallelMode, Strategy};
    let kl = load("sd_like");
    let decode = |dims: &[usize], ranks| kl.strategy(Direction::Decode, ParallelMode::SpatialShard2d, dims, ranks);
    assert_eq!(decode(&[1, 4, 16, 16], 4).strategy, Strategy::Shard2d([2, 2]));
    assert_eq!(decode(&[1, 4, 8, 32], 4).strategy, Strategy::Shard2d([1, 4]));
    assert_eq!(decode(&[1, 4, 60, 104], 6).strategy, Strategy::Shard2d([2, 3]));
    let none = decode(&[1, 4, 2, 2], 5);
    assert!(none.strategy == Strategy::Tile && none.fallback, "{}", none.reason);
    let encode = |dims: &[usize], ranks| kl.strategy(Direction::Encode, ParallelMode::SpatialShard2d, dims, ranks);
    assert_eq!(encode(&[1, 3, 64, 64], 4).strategy, Strategy::Shard2d([2, 2]));
    let odd = encode(&[1, 3, 64, 60], 4);
    assert!(
        odd.strategy == Strategy::Tile && odd.fallback && odd.reason.contains("whole latent rows"),
        "{}",
        odd.reason
    );

    let wan = vae_models::wan::WanVae::load(&fixtures_dir().join("wan/wan21_like")).unwrap();
    let z_dim = wan.config().z_dim;
    let chosen = wan.decode_strategy(ParallelMode::SpatialShard2d, &[1, z_dim, 3, 7, 10], 4);
    assert_eq!(chosen.strategy, Strategy::Shard2d([2, 2]));
    let narrow = wan.decode_strategy(ParallelMode::SpatialShard2d, &[1, z_dim, 3, 1, 3], 4);
    assert!(narrow.strategy == Strategy::Tile && narrow.fallback, "{}", narrow.reason);
}
