//! LTX-Video 0.9.5+ (`AutoencoderKLLTXVideo`, timestep-conditioned decoder) and LTX-2
//! (`AutoencoderKLLTX2Video`, reflect-padded decoder) against diffusers: every fixture case
//! (plain, batched, spatially, temporally and spatio-temporally tiled decode and encode; the
//! pipelines' latent normalisation) within 1e-4; tile-parallel runs over time × space tiles
//! bit-identical to the serial tiled path and spatial shards (bands and 2-D grids of blocks)
//! bit-identical to the plain call on 1-6 local ranks; the policy; bad requests as typed errors.

use std::sync::Arc;

use serde_json::Value;
use vae_integration_tests::{blocks_on_local_ranks, fixtures_dir, random_tensor, shard_on_local_ranks};
use vae_models::family::{self, Direction, TileOverrides};
use vae_models::ltx::{LtxClass, LtxOperator, LtxShardOperator, LtxTiling, LtxVae, SpatialPadding};
use vae_parallel::io::read_npy;
use vae_runtime::{
    DistributedVaeExecutor, Job, Output, OutputPlacement, ParallelMode, ShardAxis, Strategy, TileOperator,
    execute_serial,
};
use vae_tensor::{DType, Device, Tensor};
use vae_transport::{TransportConfig, run_local};

/// The fixture models: LTX-Video 0.9.5-like, LTX-2-like, and the LTX-2 class off its published
/// path (causal decoder, reflect-padded encoder, mixed upsample types, no ratios in the config).
const MODELS: [(&str, LtxClass); 3] =
    [("ltx_video_like", LtxClass::LtxVideo), ("ltx2_like", LtxClass::Ltx2), ("ltx2_variant", LtxClass::Ltx2)];

fn dir() -> std::path::PathBuf {
    fixtures_dir().join("ltx")
}

fn class_of(model: &str) -> LtxClass {
    MODELS.iter().find(|(m, _)| *m == model).unwrap_or_else(|| panic!("{model}")).1
}

fn load(model: &str) -> LtxVae {
    LtxVae::load_with(&dir().join(model), class_of(model), Device::Cpu, DType::F32).unwrap()
}

fn manifest() -> Vec<Value> {
    let text = std::fs::read_to_string(dir().join("manifest.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn npy(name: &Value) -> Tensor {
    read_npy(dir().join(name.as_str().unwrap())).unwrap()
}

fn input(model: &str, tag: &str) -> Tensor {
    read_npy(dir().join(format!("{model}.{tag}.in.npy"))).unwrap()
}

/// A model with the case's tiling attributes, framewise flag and decode timestep, and whether
/// the case tiles in H and W (`use_tiling`).
fn model_for(case: &Value) -> (LtxVae, bool) {
    let mut model = load(case["model"].as_str().unwrap());
    let tiling = case["tiling"].as_bool().unwrap();
    let framewise = case["framewise"].as_bool().unwrap();
    if tiling || framewise {
        let n = |k: &str| case[k].as_u64().unwrap_or_else(|| panic!("{k}")) as usize;
        let mut t = *model.tiling();
        t.spatial.tile_sample_min_height = n("tile_sample_min_height");
        t.spatial.tile_sample_min_width = n("tile_sample_min_width");
        t.spatial.tile_sample_stride_height = n("tile_sample_stride_height");
        t.spatial.tile_sample_stride_width = n("tile_sample_stride_width");
        t.tile_sample_min_num_frames = n("tile_sample_min_num_frames");
        t.tile_sample_stride_num_frames = n("tile_sample_stride_num_frames");
        t.framewise = framewise;
        model.set_tiling(t).unwrap();
    }
    if let Some(ts) = case["decode_timestep"].as_f64() {
        model.set_decode_timestep(ts).unwrap();
    }
    (model, tiling)
}

fn run(model: &LtxVae, direction: Direction, tiled: bool, x: &Tensor) -> Tensor {
    execute_serial(&LtxOperator::new(model, direction, tiled), x).unwrap()
}

#[test]
fn every_fixture_case_matches_diffusers() {
    let cases = manifest();
    assert_eq!(cases.len(), 41);
    for case in &cases {
        let name = case["name"].as_str().unwrap();
        let (model, tiled) = model_for(case);
        let (x, expected) = (npy(&case["input"]), npy(&case["output"]));
        let encode = |x: &Tensor| run(&model, Direction::Encode, tiled, x);
        let got = match (case["op"].as_str().unwrap(), case["output_kind"].as_str().unwrap()) {
            ("decode", _) => run(&model, Direction::Decode, tiled, &x),
            ("decode_normalized", _) => run(&model, Direction::Decode, tiled, &model.denormalize_latents(&x).unwrap()),
            ("encode", "moments") => encode(&x),
            ("encode", "mean") => encode(&x).diag_gaussian_mean().unwrap(),
            ("encode_normalized", _) => model.normalize_latents(&encode(&x).diag_gaussian_mean().unwrap()).unwrap(),
            other => panic!("{name}: unknown case {other:?}"),
        };
        assert_eq!(got.dims(), expected.dims(), "{name}");
        let diff = got.max_abs_diff(&expected).unwrap();
        assert!(diff <= 1e-4, "{name}: max |ours - diffusers| = {diff}");
    }
}

#[test]
fn the_plain_calls_are_the_untiled_operators() {
    for (m, _) in MODELS {
        let mut model = load(m);
        if model.decode_timestep().is_some() {
            model.set_decode_timestep(0.05).unwrap();
        }
        let z = input(m, "decode_t3");
        assert!(model.decode(&z).unwrap().bit_eq(&run(&model, Direction::Decode, false, &z)));
        let x = input(m, if m == "ltx2_variant" { "encode_f3" } else { "encode_f5" });
        assert!(model.encode_moments(&x).unwrap().bit_eq(&run(&model, Direction::Encode, false, &x)));
    }
}

/// The decode timestep matters to a conditioned decoder (and 0 is what it decodes at until set).
#[test]
fn the_decode_timestep_conditions_the_ltx_video_decoder() {
    let mut model = load("ltx_video_like");
    let z = input("ltx_video_like", "decode_t1");
    assert_eq!(model.decode_timestep(), Some(0.0));
    let at0 = model.decode(&z).unwrap();
    model.set_decode_timestep(0.05).unwrap();
    assert!(model.decode(&z).unwrap().max_abs_diff(&at0).unwrap() > 1e-3);
    let mut ltx2 = load("ltx2_like");
    assert_eq!(ltx2.decode_timestep(), None);
    let err = ltx2.set_decode_timestep(0.05).unwrap_err();
    assert!(matches!(err, vae_models::ModelError::Unsupported(_)), "{err}");
}

/// The tiled and framewise cases on 1-4 local ranks: the owner's (decode) or every rank's
/// (encode) output is the serial tiled result bit for bit, and tiling really changed it.
#[test]
fn tile_parallel_decode_and_encode_are_bit_identical_on_one_to_four_ranks() {
    let tiled_cases = manifest().into_iter().filter(|c| {
        (c["tiling"].as_bool().unwrap() || c["framewise"].as_bool().unwrap()) && c["output_kind"] != "mean"
    });
    let mut runs = 0;
    for case in tiled_cases {
        let name = case["name"].as_str().unwrap().to_string();
        let (model, tiled) = model_for(&case);
        let x = npy(&case["input"]);
        let (direction, placement) = match case["op"].as_str().unwrap() {
            "decode" => (Direction::Decode, OutputPlacement::OwnerOnly),
            _ => (Direction::Encode, OutputPlacement::AllRanks),
        };
        let op = LtxOperator::new(&model, direction, tiled);
        let tasks = op.split(&x).unwrap().tasks.len();
        assert!(tasks > 1, "{name}: {tasks} tile");
        let serial = execute_serial(&op, &x).unwrap();
        let mut plain = load(case["model"].as_str().unwrap());
        if let Some(ts) = case["decode_timestep"].as_f64() {
            plain.set_decode_timestep(ts).unwrap();
        }
        let untiled = run(&plain, direction, false, &x);
        // (Tiles sized by ratios the blocks do not make give an output of another size.)
        if serial.dims() == untiled.dims() {
            assert!(serial.max_abs_diff(&untiled).unwrap() > 1e-4, "{name}: the tiles were not blended");
        }
        for world in 1..=4 {
            let outs = run_local(world, TransportConfig::default(), |comm| {
                let exec = DistributedVaeExecutor::new(Arc::new(comm), world).unwrap();
                exec.run(&x, Job::tiles(&op), Output::Placed(placement)).unwrap().tensor
            })
            .unwrap();
            let holders: Vec<Tensor> = outs.into_iter().filter_map(|r| r.unwrap()).collect();
            let expected = if direction == Direction::Decode { 1 } else { world };
            assert_eq!(holders.len(), expected, "{name} on {world} ranks");
            assert!(holders.iter().all(|out| out.bit_eq(&serial)), "{name} on {world} ranks");
            runs += 1;
        }
    }
    assert!(runs >= 40, "{runs} runs");
}

/// The shard of every latent and video below along both axes, on as many ranks (up to 4) as
/// give each a band (two latent rows where the decoder reflects): the plain decode (encode) bit
/// for bit, with halo exchanges; zero or reflected rows only at the global edges.
#[test]
fn spatial_shards_are_the_plain_decode_and_encode_bit_for_bit() {
    let mut runs = 0;
    for (m, _) in MODELS {
        let mut model = load(m);
        if model.decode_timestep().is_some() {
            model.set_decode_timestep(0.05).unwrap();
        }
        let c = model.config();
        let rows = |p: SpatialPadding| if p == SpatialPadding::Reflect { 2 } else { 1 };
        let (decode_rows, encode_rows) = (rows(c.decoder_padding), rows(c.encoder_padding));
        let unit = c.encoder_spatial_factor();
        let variant = m == "ltx2_variant";
        let latents =
            [input(m, if variant { "decode_t3" } else { "decode_batch2" }), random_tensor(&[1, 8, 2, 8, 6], 31)];
        let videos = [input(m, if variant { "encode_f3" } else { "encode_f5" }), input(m, "encode_tiled_f1")];
        let cases = latents
            .iter()
            .map(|z| (Direction::Decode, z, 1, decode_rows))
            .chain(videos.iter().map(|x| (Direction::Encode, x, unit, encode_rows)));
        for (direction, x, unit, min_rows) in cases {
            let direct = match direction {
                Direction::Decode => model.decode(x).unwrap(),
                Direction::Encode => model.encode_moments(x).unwrap(),
            };
            let op = LtxShardOperator::new(&model, direction);
            for axis in [ShardAxis::Height, ShardAxis::Width] {
                let rows = x.dims()[axis.dim_in(5).unwrap()] / unit;
                for world in 2..=(rows / min_rows).min(4) {
                    let (out, reports) = shard_on_local_ranks(&op, x, axis, world);
                    assert!(out.bit_eq(&direct), "{m}: {direction:?} of {:?} along {axis} on {world} ranks", x.dims());
                    for r in &reports {
                        let vae_runtime::StrategyReport::Shard { traffic, .. } = &r.strategy else {
                            panic!("not a shard")
                        };
                        assert!(traffic.halo_exchanges > 0, "{traffic:?}");
                    }
                    runs += 1;
                }
            }
        }
    }
    assert!(runs >= 24, "{runs} shard runs");
}

/// Grids of 2 to 6 blocks, both orientations of the 1-D cuts among them.
const GRIDS: [[usize; 2]; 4] = [[1, 2], [2, 1], [2, 2], [2, 3]];

/// The decode and encode of every class on 2-D grids of blocks two latent rows and columns
/// wide: halos along both axes (corners from the diagonal blocks), zeros or reflections only
/// where a block meets the map's edge (the rows its other axis's halo widened included), the
/// folds and unfolds within blocks of whole latent pixels: the plain call bit for bit.
#[test]
fn block_shards_are_the_plain_decode_and_encode_bit_for_bit() {
    for (m, _) in MODELS {
        let mut model = load(m);
        if model.decode_timestep().is_some() {
            model.set_decode_timestep(0.05).unwrap();
        }
        let unit = model.config().encoder_spatial_factor();
        let frames = input(m, if m == "ltx2_variant" { "encode_f3" } else { "encode_f5" }).dims()[2];
        // Uneven blocks (5 × 7 latent pixels), two latent rows and columns at least.
        let z = random_tensor(&[1, 8, 2, 5, 7], 33);
        let x = random_tensor(&[1, 3, frames, 5 * unit, 7 * unit], 34);
        for (direction, input) in [(Direction::Decode, &z), (Direction::Encode, &x)] {
            let direct = match direction {
                Direction::Decode => model.decode(input).unwrap(),
                Direction::Encode => model.encode_moments(input).unwrap(),
            };
            let op = LtxShardOperator::new(&model, direction);
            for grid in GRIDS {
                let (out, reports) = blocks_on_local_ranks(&op, input, grid, grid[0] * grid[1]);
                let diff = out.max_abs_diff(&direct).unwrap();
                assert!(out.bit_eq(&direct), "{m}: {direction:?} of {:?} on {grid:?}: max diff {diff}", input.dims());
                for r in &reports {
                    let vae_runtime::StrategyReport::Blocks { traffic, .. } = &r.strategy else { panic!("not blocks") };
                    assert!(traffic.halo_exchanges > 0, "{traffic:?}");
                }
            }
        }
    }
}

/// `auto` shards the longer axis over two ranks or more unless the frames are tiled, a forced
/// axis too narrow for the ranks falls back to tiles (two latent rows a rank where the decoder
/// reflects), and through the family interface the result is the plain call's.
#[test]
fn the_policy_shards_where_every_rank_gets_a_band() {
    let mut vae = family::load(&dir().join("ltx2_like"), Device::Cpu, DType::F32).unwrap();
    let decode = |vae: &dyn vae_models::LoadedVae, mode, dims: &[usize], ranks| {
        vae.strategy(Direction::Decode, mode, dims, ranks)
    };
    assert_eq!(decode(&*vae, ParallelMode::Auto, &[1, 8, 3, 6, 9], 2).strategy, Strategy::Shard(ShardAxis::Width));
    assert_eq!(decode(&*vae, ParallelMode::Auto, &[1, 8, 3, 6, 9], 1).strategy, Strategy::Tile);
    let narrow = decode(&*vae, ParallelMode::SpatialShardHeight, &[1, 8, 3, 5, 9], 3);
    assert!(narrow.fallback && narrow.reason.contains("two latent rows"), "{narrow:?}");
    let encode = vae.strategy(Direction::Encode, ParallelMode::SpatialShardWidth, &[1, 3, 5, 64, 60], 2);
    assert!(encode.fallback && encode.reason.contains("not a multiple of 8"), "{encode:?}");
    // The 2-D mode: blocks of two latent rows and columns where the decoder reflects.
    let blocks = |dims: &[usize], ranks| decode(&*vae, ParallelMode::SpatialShard2d, dims, ranks);
    assert_eq!(blocks(&[1, 8, 3, 6, 9], 6).strategy, Strategy::Shard2d([2, 3]));
    assert_eq!(blocks(&[1, 8, 3, 6, 6], 4).strategy, Strategy::Shard2d([2, 2]));
    let thin = blocks(&[1, 8, 3, 3, 3], 4);
    assert!(thin.fallback && thin.reason.contains("at least 2 × 2"), "{thin:?}");

    let z = random_tensor(&[1, 8, 2, 6, 4], 32);
    let direct = vae.decode(&z).unwrap();
    let on_three = |vae: &dyn vae_models::LoadedVae| {
        run_local(3, TransportConfig::default(), |comm| {
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
            (strategy, vae.execute(run).unwrap().tensor.unwrap())
        })
        .unwrap()
    };
    for out in on_three(&*vae) {
        let (strategy, out) = out.unwrap();
        assert_eq!(strategy, Strategy::Shard(ShardAxis::Height));
        assert!(out.bit_eq(&direct));
    }
    // Frame tiles requested: auto keeps diffusers' chunked result, as tiles over the ranks.
    vae.enable_tiling(&TileOverrides { sample_min_num_frames: Some(4), ..Default::default() }).unwrap();
    let chunked =
        execute_serial(&LtxOperator::new(vae.as_any().downcast_ref::<LtxVae>().unwrap(), Direction::Decode, true), &z)
            .unwrap();
    for out in on_three(&*vae) {
        let (strategy, out) = out.unwrap();
        assert_eq!(strategy, Strategy::Tile);
        assert!(out.bit_eq(&chunked));
    }
    // A streamed one-rank decode hands on the same frames.
    let mut frames = vae_runtime::CollectFrames::new();
    vae.decode_streaming(&z, &mut frames).unwrap();
    assert!(frames.into_tensor().unwrap().bit_eq(&chunked));
}

#[test]
fn the_registry_loads_both_classes_with_every_mode_but_the_pipeline() {
    for (m, class) in MODELS {
        let mut vae = family::load(&dir().join(m), Device::Cpu, DType::F32).unwrap();
        assert_eq!(vae.class_name(), class.name());
        for mode in ParallelMode::ALL {
            let verdict = vae.check_mode(mode);
            if mode == ParallelMode::Pipeline {
                let err = verdict.unwrap_err();
                let text = err.to_string();
                assert!(matches!(err, vae_models::ModelError::Unsupported(_)), "{text}");
                assert!(text.contains("cannot decode as a pipeline over frames"), "{text}");
            } else {
                assert!(verdict.is_ok(), "{mode}");
            }
        }
        // enable_tiling: the six keywords, 0 keeps the current value (the class's `or`), a frame
        // keyword turns the frame tiles on, and the other families' keywords are refused.
        vae.enable_tiling(&TileOverrides {
            sample_min_height: Some(64),
            sample_stride_width: Some(0),
            ..Default::default()
        })
        .unwrap();
        let t: LtxTiling = *vae.as_any().downcast_ref::<LtxVae>().unwrap().tiling();
        assert_eq!(
            (t.spatial.tile_sample_min_height, t.spatial.tile_sample_stride_width, t.framewise),
            (64, 448, false)
        );
        vae.enable_tiling(&TileOverrides { sample_stride_num_frames: Some(4), ..Default::default() }).unwrap();
        let t: LtxTiling = *vae.as_any().downcast_ref::<LtxVae>().unwrap().tiling();
        assert_eq!((t.tile_sample_min_num_frames, t.tile_sample_stride_num_frames, t.framewise), (16, 4, true));
        for bad in [
            TileOverrides { sample_min_size: Some(64), ..Default::default() },
            TileOverrides { latent_min_height: Some(4), ..Default::default() },
            TileOverrides { overlap_factor: Some(0.25), ..Default::default() },
            TileOverrides { sample_stride_height: Some(4), ..Default::default() },
        ] {
            assert!(vae.enable_tiling(&bad).is_err(), "{bad:?}");
        }
        assert_eq!(vae.tiling_keywords().len(), 6);
        let described = vae.describe();
        assert!(described.iter().any(|(k, v)| *k == "tiling" && v.contains("frames tiled")), "{described:?}");
    }
    // Frame keywords are refused by the families that do not tile frames.
    let mut wan = family::load(&fixtures_dir().join("wan/wan21_like"), Device::Cpu, DType::F32).unwrap();
    assert!(wan.enable_tiling(&TileOverrides { sample_min_num_frames: Some(8), ..Default::default() }).is_err());
    assert!(wan.set_decode_timestep(0.05).is_err());
}

#[test]
fn bad_inputs_are_typed_errors() {
    let zeros = |dims: &[usize]| Tensor::zeros(dims.to_vec(), DType::F32, &Device::Cpu).unwrap();
    let invalid = |err: vae_models::ModelError, text: &str| {
        assert!(matches!(err, vae_models::ModelError::InvalidInput(_)), "{err}");
        assert!(err.to_string().contains(text), "{err}");
    };
    let model = load("ltx_video_like");
    invalid(model.decode(&zeros(&[1, 3, 1, 2, 2])).unwrap_err(), "[B, 8, T, H, W]");
    invalid(model.decode(&zeros(&[1, 8, 2, 2])).unwrap_err(), "[B, 8, T, H, W]");
    invalid(model.encode_moments(&zeros(&[1, 3, 4, 16, 16])).unwrap_err(), "1 + 4k frames (e.g. 1 or 5)");
    invalid(model.encode_moments(&zeros(&[1, 3, 1, 12, 16])).unwrap_err(), "multiple of the 8x");
    invalid(model.encode_moments(&zeros(&[1, 4, 1, 16, 16])).unwrap_err(), "[B, 3, T, H, W]");
    let mut nan = zeros(&[1, 8, 1, 2, 2]).to_vec_f32().unwrap();
    nan[3] = f32::NAN;
    invalid(
        model.decode(&Tensor::from_vec(nan, vec![1, 8, 1, 2, 2], &Device::Cpu).unwrap()).unwrap_err(),
        "non-finite",
    );
    // The reflect-padded decoder needs 2 x 2 latents, and tiles of them.
    let ltx2 = load("ltx2_like");
    invalid(ltx2.decode(&zeros(&[1, 8, 1, 1, 4])).unwrap_err(), "at least 2x2");
    let mut tiled = load("ltx2_like");
    let mut t = *tiled.tiling();
    t.spatial.tile_sample_min_height = 16;
    t.spatial.tile_sample_stride_height = 8;
    tiled.set_tiling(t).unwrap();
    let err = execute_serial(&LtxOperator::new(&tiled, Direction::Decode, true), &zeros(&[1, 8, 1, 3, 2])).unwrap_err();
    assert!(err.to_string().contains("at least 2x2"), "{err}");
    // A temporal encode tile of a frame count the encoder cannot take fails before any work.
    let mut framewise = load("ltx_video_like");
    let mut t = *framewise.tiling();
    (t.framewise, t.tile_sample_min_num_frames, t.tile_sample_stride_num_frames) = (true, 8, 6);
    framewise.set_tiling(t).unwrap();
    let err = LtxOperator::new(&framewise, Direction::Encode, false).split(&zeros(&[1, 3, 13, 8, 8])).err().unwrap();
    assert!(err.to_string().contains("1 + 4k frames"), "{err}");
    // A stride under the compression would step by 0 latent pixels (a Python range error).
    let mut t = *framewise.tiling();
    t.spatial.tile_sample_stride_width = 4;
    let err = framewise.set_tiling(t).unwrap_err();
    assert!(err.to_string().contains("would be 0"), "{err}");
}
