//! HunyuanVideo-1.5 (`AutoencoderKLHunyuanVideo15`) against diffusers: every fixture case
//! (plain, batched, tiled and uncropped-tiled decode; plain, batched and tiled encode; the
//! pipelines' latent scale) within 1e-4, tile-parallel runs bit-identical to the serial tiled
//! path, spatial shards (bands and 2-D grids of blocks) bit-identical to the plain call on 1-6
//! local ranks, the policy, and bad requests as typed errors.

use std::sync::Arc;

use serde_json::Value;
use vae_integration_tests::{blocks_on_local_ranks, fixtures_dir, random_tensor, shard_on_local_ranks};
use vae_models::family::{self, Direction, TileOverrides};
use vae_models::hunyuan_video15::{
    HunyuanVideo15Operator, HunyuanVideo15ShardOperator, HunyuanVideo15Tiling, HunyuanVideo15Vae,
};
use vae_parallel::io::read_npy;
use vae_runtime::{
    DistributedVaeExecutor, Job, Output, OutputPlacement, ParallelMode, ShardAxis, Strategy, TileOperator,
    execute_serial,
};
use vae_tensor::{DType, Device, Tensor};
use vae_transport::{TransportConfig, run_local};

const MODEL: &str = "hunyuan_video15_like";

fn dir() -> std::path::PathBuf {
    fixtures_dir().join("hunyuan_video15")
}

fn load() -> HunyuanVideo15Vae {
    HunyuanVideo15Vae::load_with(&dir().join(MODEL), Device::Cpu, DType::F32).unwrap()
}

fn manifest() -> Vec<Value> {
    let text = std::fs::read_to_string(dir().join("manifest.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The case's `enable_tiling(...)` keywords, or `None` for an untiled case.
fn case_tiling(case: &Value) -> Option<HunyuanVideo15Tiling> {
    if !case["tiling"].as_bool().unwrap() {
        return None;
    }
    let n = |k: &str| case[k].as_u64().unwrap_or_else(|| panic!("{k}")) as usize;
    Some(HunyuanVideo15Tiling {
        tile_sample_min_height: n("tile_sample_min_height"),
        tile_sample_min_width: n("tile_sample_min_width"),
        tile_latent_min_height: n("tile_latent_min_height"),
        tile_latent_min_width: n("tile_latent_min_width"),
        tile_overlap_factor: case["tile_overlap_factor"].as_f64().unwrap(),
    })
}

fn npy(name: &Value) -> Tensor {
    read_npy(dir().join(name.as_str().unwrap())).unwrap()
}

/// A model with the case's tiling, and whether the case tiles.
fn model_for(case: &Value) -> (HunyuanVideo15Vae, bool) {
    let mut model = load();
    let tiling = case_tiling(case);
    if let Some(t) = tiling {
        model.set_tiling(t).unwrap();
    }
    (model, tiling.is_some())
}

#[test]
fn every_fixture_case_matches_diffusers() {
    let cases = manifest();
    assert_eq!(cases.len(), 15);
    for case in &cases {
        let name = case["name"].as_str().unwrap();
        let (model, tiled) = model_for(case);
        let input = npy(&case["input"]);
        let expected = npy(&case["output"]);
        let decode =
            |z: &Tensor| execute_serial(&HunyuanVideo15Operator::new(&model, Direction::Decode, tiled), z).unwrap();
        let encode =
            |x: &Tensor| execute_serial(&HunyuanVideo15Operator::new(&model, Direction::Encode, tiled), x).unwrap();
        let got = match (case["op"].as_str().unwrap(), case["output_kind"].as_str().unwrap()) {
            ("decode", _) => decode(&input),
            ("decode_normalized", _) => decode(&model.denormalize_latents(&input).unwrap()),
            ("encode", "moments") => encode(&input),
            ("encode", "mean") => encode(&input).diag_gaussian_mean().unwrap(),
            ("encode_normalized", _) => model.normalize_latents(&encode(&input).diag_gaussian_mean().unwrap()).unwrap(),
            other => panic!("{name}: unknown case {other:?}"),
        };
        assert_eq!(got.dims(), expected.dims(), "{name}");
        let diff = got.max_abs_diff(&expected).unwrap();
        assert!(diff <= 1e-4, "{name}: max |ours - diffusers| = {diff}");
    }
}

#[test]
fn the_plain_calls_are_the_untiled_operators() {
    let model = load();
    let z = read_npy(dir().join(format!("{MODEL}.decode_t3.in.npy"))).unwrap();
    let plain = model.decode(&z).unwrap();
    assert!(plain.bit_eq(&execute_serial(&HunyuanVideo15Operator::new(&model, Direction::Decode, false), &z).unwrap()));
    let x = read_npy(dir().join(format!("{MODEL}.encode_f5.in.npy"))).unwrap();
    let moments = model.encode_moments(&x).unwrap();
    assert!(
        moments.bit_eq(&execute_serial(&HunyuanVideo15Operator::new(&model, Direction::Encode, false), &x).unwrap())
    );
}

/// The tiled cases on 1-4 local ranks: the owner's (decode) or every rank's (encode) output is
/// the serial tiled result bit for bit, and the tiles really were blended.
#[test]
fn tile_parallel_decode_and_encode_are_bit_identical_on_one_to_four_ranks() {
    for case in manifest().iter().filter(|c| c["tiling"].as_bool().unwrap() && c["output_kind"] != "mean") {
        let name = case["name"].as_str().unwrap();
        let (model, _) = model_for(case);
        let input = npy(&case["input"]);
        let (direction, placement) = match case["op"].as_str().unwrap() {
            "decode" => (Direction::Decode, OutputPlacement::OwnerOnly),
            _ => (Direction::Encode, OutputPlacement::AllRanks),
        };
        let op = HunyuanVideo15Operator::new(&model, direction, true);
        let serial = execute_serial(&op, &input).unwrap();
        let untiled = execute_serial(&HunyuanVideo15Operator::new(&model, direction, false), &input).unwrap();
        if serial.dims() == untiled.dims() {
            assert!(serial.max_abs_diff(&untiled).unwrap() > 1e-4, "{name}: the tiles were not blended");
        }
        for world in 1..=4 {
            let outs = run_local(world, TransportConfig::default(), |comm| {
                let exec = DistributedVaeExecutor::new(Arc::new(comm), world).unwrap();
                exec.run(&input, Job::tiles(&op), Output::Placed(placement)).unwrap().tensor
            })
            .unwrap();
            let holders: Vec<Tensor> = outs.into_iter().filter_map(|r| r.unwrap()).collect();
            let expected = if direction == Direction::Decode { 1 } else { world };
            assert_eq!(holders.len(), expected, "{name} on {world} ranks");
            assert!(holders.iter().all(|out| out.bit_eq(&serial)), "{name} on {world} ranks");
        }
    }
}

/// The shard of every latent and video below along both axes, on as many ranks (up to 4) as
/// give each a latent row: the plain decode (encode) bit for bit, halos and the gathered
/// attention included; bands that end at a global edge replicate it as the plain conv does.
#[test]
fn spatial_shards_are_the_plain_decode_and_encode_bit_for_bit() {
    let model = load();
    let latents = [
        read_npy(dir().join(format!("{MODEL}.decode_t3.in.npy"))).unwrap(),
        read_npy(dir().join(format!("{MODEL}.decode_batch2.in.npy"))).unwrap(),
        random_tensor(&[1, 4, 3, 7, 5], 15),
    ];
    let videos = [
        read_npy(dir().join(format!("{MODEL}.encode_f5.in.npy"))).unwrap(),
        read_npy(dir().join(format!("{MODEL}.encode_tiled_f1.in.npy"))).unwrap(),
    ];
    let cases =
        latents.iter().map(|z| (Direction::Decode, z, 1)).chain(videos.iter().map(|x| (Direction::Encode, x, 8)));
    let mut runs = 0;
    for (direction, input, unit) in cases {
        let direct = match direction {
            Direction::Decode => model.decode(input).unwrap(),
            Direction::Encode => model.encode_moments(input).unwrap(),
        };
        let op = HunyuanVideo15ShardOperator::new(&model, direction);
        for axis in [ShardAxis::Height, ShardAxis::Width] {
            let rows = input.dims()[axis.dim_in(5).unwrap()] / unit;
            for world in 2..=rows.min(4) {
                let (out, reports) = shard_on_local_ranks(&op, input, axis, world);
                assert!(out.bit_eq(&direct), "{direction:?} of {:?} along {axis} on {world} ranks", input.dims());
                // Every rank exchanged halos and gathered the map for the mid block's attention.
                for r in &reports {
                    let vae_runtime::StrategyReport::Shard { traffic, .. } = &r.strategy else { panic!("not a shard") };
                    assert!(traffic.halo_exchanges > 0 && traffic.map_gathers > 0, "{traffic:?}");
                }
                runs += 1;
            }
        }
    }
    assert!(runs >= 12, "{runs} shard runs");
}

/// Grids of 2 to 6 blocks, both orientations of the 1-D cuts among them.
const GRIDS: [[usize; 2]; 4] = [[1, 2], [2, 1], [2, 2], [2, 3]];

/// The decode and encode on 2-D grids of blocks: halos along both axes (corners from the
/// diagonal blocks), edges replicated only where a block meets the map's edge (its corner
/// rows included), the 2 × 2 folds within blocks of whole latent pixels and the attention on
/// the gathered map: the plain call bit for bit, and the same bytes over the CLI's socket
/// processes (`models.rs`).
#[test]
fn block_shards_are_the_plain_decode_and_encode_bit_for_bit() {
    let model = load();
    let z = random_tensor(&[1, 4, 3, 7, 5], 17);
    let x = random_tensor(&[1, 3, 5, 32, 24], 18);
    for (direction, input) in [(Direction::Decode, &z), (Direction::Encode, &x)] {
        let direct = match direction {
            Direction::Decode => model.decode(input).unwrap(),
            Direction::Encode => model.encode_moments(input).unwrap(),
        };
        let op = HunyuanVideo15ShardOperator::new(&model, direction);
        for grid in GRIDS {
            let (out, reports) = blocks_on_local_ranks(&op, input, grid, grid[0] * grid[1]);
            let diff = out.max_abs_diff(&direct).unwrap();
            assert!(out.bit_eq(&direct), "{direction:?} of {:?} on {grid:?}: max diff {diff}", input.dims());
            for r in &reports {
                let vae_runtime::StrategyReport::Blocks { traffic, .. } = &r.strategy else { panic!("not blocks") };
                assert!(traffic.halo_exchanges > 0 && traffic.map_gathers > 0, "{traffic:?}");
            }
        }
    }
}

/// `auto` shards the longer axis over two ranks or more (an encode only where tiles would
/// otherwise run), a forced axis too narrow for the ranks falls back to tiles, and through
/// the family interface the result is the plain call's.
#[test]
fn the_policy_shards_where_every_rank_gets_a_latent_row() {
    let vae = family::load(&dir().join(MODEL), Device::Cpu, DType::F32).unwrap();
    let decode = |mode, dims: &[usize], ranks| vae.strategy(Direction::Decode, mode, dims, ranks);
    assert_eq!(decode(ParallelMode::Auto, &[1, 4, 3, 6, 9], 2).strategy, Strategy::Shard(ShardAxis::Width));
    assert_eq!(decode(ParallelMode::Auto, &[1, 4, 3, 9, 6], 3).strategy, Strategy::Shard(ShardAxis::Height));
    assert_eq!(decode(ParallelMode::Auto, &[1, 4, 3, 9, 6], 1).strategy, Strategy::Tile);
    let narrow = decode(ParallelMode::SpatialShardHeight, &[1, 4, 3, 2, 9], 3);
    assert!(narrow.fallback && narrow.strategy == Strategy::Tile, "{narrow:?}");
    let encode = |mode, dims: &[usize], ranks| vae.strategy(Direction::Encode, mode, dims, ranks);
    assert_eq!(encode(ParallelMode::Auto, &[1, 3, 5, 64, 64], 2).strategy, Strategy::Tile, "fits a tile");
    assert_eq!(encode(ParallelMode::Auto, &[1, 3, 5, 512, 264], 2).strategy, Strategy::Shard(ShardAxis::Height));
    let ragged = encode(ParallelMode::SpatialShardWidth, &[1, 3, 5, 64, 60], 2);
    assert!(ragged.fallback && ragged.reason.contains("not a multiple of 8"), "{ragged:?}");
    // The 2-D mode: the squarest grid of blocks holding a latent pixel each (an encode's of
    // whole latent pixels), tiles where none fits.
    assert_eq!(decode(ParallelMode::SpatialShard2d, &[1, 4, 3, 6, 9], 6).strategy, Strategy::Shard2d([2, 3]));
    assert_eq!(decode(ParallelMode::SpatialShard2d, &[1, 4, 3, 6, 9], 4).strategy, Strategy::Shard2d([2, 2]));
    let thin = decode(ParallelMode::SpatialShard2d, &[1, 4, 3, 1, 1], 2);
    assert!(thin.fallback && thin.strategy == Strategy::Tile, "{thin:?}");
    assert_eq!(encode(ParallelMode::SpatialShard2d, &[1, 3, 5, 64, 64], 4).strategy, Strategy::Shard2d([2, 2]));
    let ragged = encode(ParallelMode::SpatialShard2d, &[1, 3, 5, 64, 60], 4);
    assert!(ragged.fallback && ragged.reason.contains("whole latent rows and columns of 8"), "{ragged:?}");

    let z = random_tensor(&[1, 4, 2, 5, 6], 16);
    let direct = vae.decode(&z).unwrap();
    let outs = run_local(3, TransportConfig::default(), |comm| {
        let executor = DistributedVaeExecutor::new(Arc::new(comm), 3).unwrap();
        let strategy = vae.strategy(Direction::Decode, ParallelMode::Auto, z.dims(), 3).strategy;
        let run = vae_models::Execution {
            executor: &executor,
            direction: Direction::Decode,
            input: &z,
            strategy,
            use_tiling: true,
            placement: OutputPlacement::AllRanks,
        };
        vae.execute(run).unwrap().tensor.unwrap()
    })
    .unwrap();
    for out in outs {
        assert!(out.unwrap().bit_eq(&direct));
    }
}

#[test]
fn the_registry_loads_the_class_with_every_mode_but_the_pipeline() {
    let mut vae = family::load(&dir().join(MODEL), Device::Cpu, DType::F32).unwrap();
    assert_eq!(vae.class_name(), "AutoencoderKLHunyuanVideo15");
    for mode in ParallelMode::ALL {
        let verdict = vae.check_mode(mode);
        if mode == ParallelMode::Pipeline {
            let err = verdict.unwrap_err();
            assert!(matches!(err, vae_models::ModelError::Unsupported(_)) && err.to_string().contains("every frame"));
        } else {
            assert!(verdict.is_ok(), "{mode}");
        }
    }
    // enable_tiling: the latent tile is its own keyword, a factor of 0 keeps the current one (the
    // class's `or`), and the Wan / AutoencoderKL keywords are refused.
    vae.enable_tiling(&TileOverrides { sample_min_height: Some(64), overlap_factor: Some(0.0), ..Default::default() })
        .unwrap();
    let t = *vae.as_any().downcast_ref::<HunyuanVideo15Vae>().unwrap().tiling();
    assert_eq!((t.tile_sample_min_height, t.tile_latent_min_height, t.tile_overlap_factor), (64, 32, 0.25));
    for bad in [
        TileOverrides { sample_min_size: Some(64), ..Default::default() },
        TileOverrides { sample_stride_height: Some(64), ..Default::default() },
        TileOverrides { overlap_factor: Some(1.0), ..Default::default() },
    ] {
        assert!(vae.enable_tiling(&bad).is_err(), "{bad:?}");
    }
    let described = vae.describe();
    assert!(described.iter().any(|(k, v)| *k == "tiling" && v.contains("tile_latent_min 32x32")), "{described:?}");
}

#[test]
fn bad_inputs_are_typed_errors() {
    let model = load();
    let zeros = |dims: &[usize]| Tensor::zeros(dims.to_vec(), DType::F32, &Device::Cpu).unwrap();
    let invalid = |err: vae_models::ModelError, text: &str| {
        assert!(matches!(err, vae_models::ModelError::InvalidInput(_)), "{err}");
        assert!(err.to_string().contains(text), "{err}");
    };
    invalid(model.decode(&zeros(&[1, 3, 1, 2, 2])).unwrap_err(), "[B, 4, T, H, W]");
    invalid(model.decode(&zeros(&[1, 4, 2, 2])).unwrap_err(), "[B, 4, T, H, W]");
    invalid(model.encode_moments(&zeros(&[1, 3, 4, 16, 16])).unwrap_err(), "1 + 4k frames (e.g. 1 or 5)");
    invalid(model.encode_moments(&zeros(&[1, 3, 1, 12, 16])).unwrap_err(), "multiple of the 8x");
    invalid(model.encode_moments(&zeros(&[1, 4, 1, 16, 16])).unwrap_err(), "[B, 3, T, H, W]");
    let mut nan = zeros(&[1, 4, 1, 2, 2]).to_vec_f32().unwrap();
    nan[3] = f32::NAN;
    let nan = Tensor::from_vec(nan, vec![1, 4, 1, 2, 2], &Device::Cpu).unwrap();
    invalid(model.decode(&nan).unwrap_err(), "non-finite");
    // A tiled encode whose tiles are not whole latent pixels fails in split, before any work.
    let mut tiled = load();
    tiled
        .set_tiling(HunyuanVideo15Tiling {
            tile_sample_min_height: 20,
            tile_sample_min_width: 20,
            tile_latent_min_height: 2,
            tile_latent_min_width: 2,
            tile_overlap_factor: 0.25,
        })
        .unwrap();
    let err =
        HunyuanVideo15Operator::new(&tiled, Direction::Encode, true).split(&zeros(&[1, 3, 1, 32, 32])).err().unwrap();
    assert!(err.to_string().contains("not a multiple of the 8x"), "{err}");
}
