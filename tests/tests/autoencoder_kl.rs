//! The AutoencoderKL family against diffusers: every fixture case within 1e-4 of diffusers'
//! output, and tile-parallel runs on 1..4 ranks bit-identical to the serial tiled run.

#![allow(clippy::print_stderr)] // the per-case differences are worth seeing with --nocapture

use std::collections::HashMap;
use std::sync::Arc;

use vae_integration_tests::{FixtureCase, fixture_cases, fixtures_dir, kl_case_output};
use vae_models::autoencoder_kl::{AutoencoderKl, KlOperator, KlTask};
use vae_parallel::io::read_npy;
use vae_parallel::{CostProfile, Decode, Encode, Tiling, Vae};
use vae_runtime::{DistributedVaeExecutor, Job, Output, OutputPlacement, execute_serial};
use vae_tensor::Tensor;
use vae_transport::{TransportConfig, run_local};

const TOLERANCE: f32 = 1e-4;

fn dir() -> std::path::PathBuf {
    fixtures_dir().join("autoencoder_kl")
}

fn load(case: &FixtureCase) -> AutoencoderKl {
    let mut model = AutoencoderKl::load(&dir().join(&case.model)).unwrap_or_else(|e| panic!("{}: {e}", case.model));
    model.set_tiling(case.tile_sample_min_size, case.tile_overlap_factor).unwrap();
    model
}

#[test]
fn every_fixture_case_matches_diffusers() {
    let cases = fixture_cases("autoencoder_kl");
    assert!(cases.len() >= 12, "expected a full manifest, got {} cases", cases.len());
    let mut worst: HashMap<String, f32> = HashMap::new();
    for case in &cases {
        let model = load(case);
        let input = read_npy(dir().join(&case.input)).unwrap();
        let expected = read_npy(dir().join(&case.output)).unwrap();
        let got = kl_case_output(&model, case, &input);
        assert_eq!(got.dims(), expected.dims(), "{}: shape", case.name);
        let diff = got.max_abs_diff(&expected).unwrap();
        assert!(diff <= TOLERANCE, "{}: max |ours - diffusers| = {diff}", case.name);
        worst.insert(case.name.clone(), diff);
    }
    let mut sorted: Vec<_> = worst.into_iter().collect();
    sorted.sort_by(|a, b| b.1.total_cmp(&a.1));
    eprintln!("largest differences from diffusers: {:?}", &sorted[..sorted.len().min(5)]);
    // Tiled and untiled outputs differ (blended seams), so a tiled case matching proves the
    // tiling, not just the decoder.
    assert!(cases.iter().any(|c| c.tiling && c.op == "decode"));
    assert!(cases.iter().any(|c| c.tiling && c.op == "encode"));
}

#[test]
fn tile_parallel_decode_and_encode_are_bit_identical_on_one_to_four_ranks() {
    for case in fixture_cases("autoencoder_kl").iter().filter(|c| c.tiling && (c.op == "decode" || c.op == "encode")) {
        let model = load(case);
        let input = read_npy(dir().join(&case.input)).unwrap();
        let task = if case.op == "decode" { KlTask::Decode } else { KlTask::Encode };
        let op = KlOperator::new(&model, task, true);
        let serial = execute_serial(&op, &input).unwrap();
        for world in 1..=4 {
            let results = run_local(world, TransportConfig::default(), |comm| {
                let exec = DistributedVaeExecutor::new(Arc::new(comm), world).unwrap();
                exec.run(&input, Job::tiles(&op), Output::Placed(OutputPlacement::AllRanks)).unwrap().tensor.unwrap()
            })
            .unwrap();
            for (rank, r) in results.into_iter().enumerate() {
                assert!(r.unwrap().bit_eq(&serial), "{} on {world} ranks, rank {rank}", case.name);
            }
        }
    }
}

#[test]
fn the_engine_routes_normalised_latents_like_the_pipelines() {
    for case in fixture_cases("autoencoder_kl").iter().filter(|c| c.op.ends_with("normalized")) {
        let tiling = vae_models::TileOverrides {
            sample_min_size: case.tile_sample_min_size,
            overlap_factor: case.tile_overlap_factor,
            ..Default::default()
        };
        let engine =
            Vae::builder(dir().join(&case.model)).tiling(tiling).cost_profile(CostProfile::Off).build().unwrap();
        let input = read_npy(dir().join(&case.input)).unwrap();
        let expected = read_npy(dir().join(&case.output)).unwrap();
        let tiling = Tiling::Reference { asked: case.tiling };
        let decode = Decode::default().mode(vae_runtime::ParallelMode::Tile).tiling(tiling).pipeline_latents();
        let encode = Encode::default().mode(vae_runtime::ParallelMode::Tile).tiling(tiling).pipeline_latents();
        // Parallel size 1 on a group of 2: a larger size would force tiling on (as the
        // reference does), and these fixtures are untiled.
        let got = run_local(2, TransportConfig::default(), |comm| {
            let exec = DistributedVaeExecutor::new(Arc::new(comm), 1).unwrap();
            let out = if case.op == "decode_normalized" {
                engine.decode_on(&exec, &input, &decode)
            } else {
                engine.encode_on(&exec, &input, &encode)
            };
            out.unwrap().tensor
        })
        .unwrap()
        .remove(0)
        .unwrap()
        .expect("rank 0 holds the output");
        let diff = got.max_abs_diff(&expected).unwrap();
        assert!(diff <= TOLERANCE, "{}: {diff}", case.name);
    }
}

/// Writes `tensors` (name, dtype, shape, bytes) as one safetensors file.
fn write_safetensors(path: &std::path::Path, tensors: &[(String, safetensors::Dtype, Vec<usize>, Vec<u8>)]) {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    std::fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
}

#[test]
fn sharded_and_half_precision_checkpoints_load() {
    let src = dir().join("sd_like");
    let bytes = std::fs::read(src.join("diffusion_pytorch_model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> =
        st.tensors().into_iter().map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec())).collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let z = read_npy(dir().join("sd_like.decode.in.npy")).unwrap();
    let reference = AutoencoderKl::load(&src).unwrap().decode(&z).unwrap();

    // Two shards and the index diffusers writes for them: the same model, the same pixels.
    let sharded = std::env::temp_dir().join(format!("vae-sharded-{}", std::process::id()));
    std::fs::create_dir_all(&sharded).unwrap();
    std::fs::copy(src.join("config.json"), sharded.join("config.json")).unwrap();
    let (first, second) = tensors.split_at(tensors.len() / 2);
    let names =
        ["diffusion_pytorch_model-00001-of-00002.safetensors", "diffusion_pytorch_model-00002-of-00002.safetensors"];
    write_safetensors(&sharded.join(names[0]), first);
    write_safetensors(&sharded.join(names[1]), second);
    let map: serde_json::Map<String, serde_json::Value> = first
        .iter()
        .map(|t| (t.0.clone(), names[0].into()))
        .chain(second.iter().map(|t| (t.0.clone(), names[1].into())))
        .collect();
    let index = serde_json::json!({ "metadata": {}, "weight_map": map });
    std::fs::write(sharded.join("diffusion_pytorch_model.safetensors.index.json"), index.to_string()).unwrap();
    let from_shards = AutoencoderKl::load(&sharded).unwrap().decode(&z).unwrap();
    assert!(from_shards.bit_eq(&reference));

    // The same weights stored as f16 and bf16: read, widened to f32, decoded close to f32.
    for (dtype, tolerance) in [(safetensors::Dtype::F16, 2e-2f32), (safetensors::Dtype::BF16, 1e-1)] {
        let narrowed: Vec<_> = tensors
            .iter()
            .map(|(n, d, s, b)| {
                if *d != safetensors::Dtype::F32 {
                    return (n.clone(), *d, s.clone(), b.clone());
                }
                let values = b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap()));
                let bytes: Vec<u8> = match dtype {
                    safetensors::Dtype::F16 => values.flat_map(|v| half::f16::from_f32(v).to_le_bytes()).collect(),
                    _ => values.flat_map(|v| half::bf16::from_f32(v).to_le_bytes()).collect(),
                };
                (n.clone(), dtype, s.clone(), bytes)
            })
            .collect();
        let half_dir = sharded.join(format!("{dtype:?}"));
        std::fs::create_dir_all(&half_dir).unwrap();
        std::fs::copy(src.join("config.json"), half_dir.join("config.json")).unwrap();
        write_safetensors(&half_dir.join("diffusion_pytorch_model.safetensors"), &narrowed);
        let decoded = AutoencoderKl::load(&half_dir).unwrap().decode(&z).unwrap();
        let diff = decoded.max_abs_diff(&reference).unwrap();
        assert!(diff > 0.0 && diff < tolerance, "{dtype:?}: {diff}");
    }
    let _ = std::fs::remove_dir_all(&sharded);
}

#[test]
fn sdxl_style_latent_statistics_are_applied_like_the_pipeline() {
    use vae_models::autoencoder_kl::AutoencoderKlConfig;
    let config = AutoencoderKlConfig::from_json(
        r#"{"block_out_channels": [8, 8], "norm_num_groups": 4, "latent_channels": 2, "scaling_factor": 0.5,
            "down_block_types": ["DownEncoderBlock2D", "DownEncoderBlock2D"],
            "up_block_types": ["UpDecoderBlock2D", "UpDecoderBlock2D"],
            "latents_mean": [0.25, -1.0], "latents_std": [2.0, 0.5]}"#,
    )
    .unwrap();
    let model = AutoencoderKl::synthetic(config, 7).unwrap();
    let z = Tensor::from_vec(vec![1.0, -2.0, 3.0, 0.5], vec![1, 2, 1, 2], &vae_tensor::Device::Cpu).unwrap();
    let decoded_input = model.denormalize_latents(&z).unwrap();
    // z * std / scaling_factor + mean, per channel.
    let expected = [1.0f32 * 2.0 / 0.5 + 0.25, -2.0 * 2.0 / 0.5 + 0.25, 3.0 * 0.5 / 0.5 - 1.0, 0.5 * 0.5 / 0.5 - 1.0];
    assert_eq!(decoded_input.to_vec_f32().unwrap(), expected.to_vec());
    let back = model.normalize_latents(&decoded_input).unwrap();
    assert!(back.max_abs_diff(&z).unwrap() < 1e-6);
    // A config whose statistics do not match the channels is refused with the reason.
    let err = AutoencoderKlConfig::from_json(r#"{"latent_channels": 4, "latents_mean": [0.0], "latents_std": [1.0]}"#)
        .unwrap_err();
    assert!(err.contains("latents_mean"), "{err}");
}
