//! Wan2.1 against diffusers: the plain (untiled) decode of 1 and 3 latent frames, which
//! exercises the causal cache across frames, the "Rep" first chunk of the temporal upsamplers and
//! the final clamp.

use vae_integration_tests::fixtures_dir;
use vae_models::wan::WanVae;
use vae_parallel::io::read_npy;

#[test]
fn wan21_plain_decode_matches_diffusers_for_one_and_three_frames() {
    let dir = fixtures_dir().join("wan");
    let model = WanVae::load(&dir.join("wan21_like")).unwrap();
    for case in ["decode_t1", "decode_t3"] {
        let z = read_npy(dir.join(format!("wan21_like.{case}.in.npy"))).unwrap();
        let expected = read_npy(dir.join(format!("wan21_like.{case}.out.npy"))).unwrap();
        let got = model.decode(&z).unwrap();
        assert_eq!(got.dims(), expected.dims(), "{case}");
        let diff = got.max_abs_diff(&expected).unwrap();
        assert!(diff <= 1e-4, "{case}: max |ours - diffusers| = {diff}");
    }
}

#[test]
fn a_latent_with_the_wrong_channel_count_or_rank_is_refused() {
    let model = WanVae::load(&fixtures_dir().join("wan").join("wan21_like")).unwrap();
    let wrong =
        vae_tensor::Tensor::zeros(vec![1, 8, 1, 2, 2], vae_tensor::DType::F32, &vae_tensor::Device::Cpu).unwrap();
    let err = model.decode(&wrong).unwrap_err();
    assert!(err.to_string().contains("[B, 16, T, H, W]"), "{err}");
    let image_like =
        vae_tensor::Tensor::zeros(vec![1, 16, 2, 2], vae_tensor::DType::F32, &vae_tensor::Device::Cpu).unwrap();
    assert!(model.decode(&image_like).is_err());
    // Wan2.2 takes RGB videos whose size is a multiple of its patch size.
    let wan22 = WanVae::load(&fixtures_dir().join("wan").join("wan22_like")).unwrap();
    let video =
        vae_tensor::Tensor::zeros(vec![1, 3, 1, 31, 48], vae_tensor::DType::F32, &vae_tensor::Device::Cpu).unwrap();
    let err = wan22.encode_moments(&video).unwrap_err();
    assert!(err.to_string().contains("multiple of the patch size"), "{err}");
}

#[test]
fn wan21_tiled_decode_matches_diffusers_and_is_bit_identical_on_one_to_four_ranks() {
    use std::sync::Arc;
    use vae_models::wan::WanDecodeOperator;
    use vae_runtime::{DistributedVaeExecutor, Job, Output, OutputPlacement, execute_serial};
    use vae_transport::{TransportConfig, run_local};

    let dir = fixtures_dir().join("wan");
    let mut model = WanVae::load(&dir.join("wan21_like")).unwrap();
    // As the fixture: enable_tiling(16, 24, 8, 16) — latent tiles 2x3, stride 1x2.
    model.set_tiling([16, 24], [8, 16]).unwrap();
    let z = read_npy(dir.join("wan21_like.decode_tiled.in.npy")).unwrap();
    let expected = read_npy(dir.join("wan21_like.decode_tiled.out.npy")).unwrap();
    let op = WanDecodeOperator::new(&model, true);
    let serial = execute_serial(&op, &z).unwrap();
    assert_eq!(serial.dims(), expected.dims());
    let diff = serial.max_abs_diff(&expected).unwrap();
    assert!(diff <= 1e-4, "tiled: max |ours - diffusers| = {diff}");
    // The untiled decode of the same latent differs: the tiles really were blended.
    assert!(model.decode(&z).unwrap().max_abs_diff(&expected).unwrap() > 1e-3);
    for world in 1..=4 {
        let results = run_local(world, TransportConfig::default(), |comm| {
            let exec = DistributedVaeExecutor::new(Arc::new(comm), world).unwrap();
            exec.run(&z, Job::tiles(&op), Output::Placed(OutputPlacement::OwnerOnly)).unwrap().tensor
        })
        .unwrap();
        let merged = results.into_iter().next().unwrap().unwrap().expect("rank 0 owns the output");
        assert!(merged.bit_eq(&serial), "{world} ranks");
    }
}

#[test]
fn qwen_image_decode_matches_diffusers_plain_clamped_and_tiled_unclamped() {
    use vae_models::wan::{VideoVaeClass, WanDecodeOperator};
    use vae_runtime::execute_serial;

    let dir = fixtures_dir().join("qwen_image");
    let mut model = WanVae::load(&dir.join("qwen_image_like")).unwrap();
    assert_eq!(model.class(), VideoVaeClass::QwenImage);
    for case in ["decode_t1", "decode_t3"] {
        let z = read_npy(dir.join(format!("qwen_image_like.{case}.in.npy"))).unwrap();
        let expected = read_npy(dir.join(format!("qwen_image_like.{case}.out.npy"))).unwrap();
        let diff = model.decode(&z).unwrap().max_abs_diff(&expected).unwrap();
        assert!(diff <= 1e-4, "{case}: {diff}");
    }
    model.set_tiling([16, 24], [8, 16]).unwrap();
    let z = read_npy(dir.join("qwen_image_like.decode_tiled.in.npy")).unwrap();
    let expected = read_npy(dir.join("qwen_image_like.decode_tiled.out.npy")).unwrap();
    let got = execute_serial(&WanDecodeOperator::new(&model, true), &z).unwrap();
    let diff = got.max_abs_diff(&expected).unwrap();
    assert!(diff <= 1e-4, "tiled: {diff}");
    // diffusers leaves Qwen-Image's tiled output unclamped; this fixture goes past 1.
    assert!(got.as_slice_f32().unwrap().iter().any(|v| v.abs() > 1.0));
}

#[test]
fn wan21_and_qwen_image_plain_encode_match_diffusers() {
    for (family, model_name) in [("wan", "wan21_like"), ("qwen_image", "qwen_image_like")] {
        let dir = fixtures_dir().join(family);
        let model = WanVae::load(&dir.join(model_name)).unwrap();
        for frames in ["f1", "f5"] {
            let x = read_npy(dir.join(format!("{model_name}.encode_{frames}.in.npy"))).unwrap();
            let expected = read_npy(dir.join(format!("{model_name}.encode_{frames}_moments.out.npy"))).unwrap();
            let got = model.encode_moments(&x).unwrap();
            assert_eq!(got.dims(), expected.dims(), "{model_name} {frames}");
            let diff = got.max_abs_diff(&expected).unwrap();
            assert!(diff <= 1e-4, "{model_name} {frames}: {diff}");
            let mean = read_npy(dir.join(format!("{model_name}.encode_{frames}_mean.out.npy"))).unwrap();
            assert!(got.diag_gaussian_mean().unwrap().max_abs_diff(&mean).unwrap() <= 1e-4);
        }
    }
}

#[test]
fn wan21_and_qwen_image_tiled_encode_match_diffusers_and_are_bit_identical_across_ranks() {
    use std::sync::Arc;
    use vae_models::wan::WanEncodeOperator;
    use vae_runtime::{DistributedVaeExecutor, Job, Output, OutputPlacement, execute_serial};
    use vae_transport::{TransportConfig, run_local};

    for (family, model_name) in [("wan", "wan21_like"), ("qwen_image", "qwen_image_like")] {
        let dir = fixtures_dir().join(family);
        let mut model = WanVae::load(&dir.join(model_name)).unwrap();
        // As the fixture: enable_tiling(24, 32, 16, 16).
        model.set_tiling([24, 32], [16, 16]).unwrap();
        let x = read_npy(dir.join(format!("{model_name}.encode_tiled_f5.in.npy"))).unwrap();
        let expected = read_npy(dir.join(format!("{model_name}.encode_tiled_f5_moments.out.npy"))).unwrap();
        let op = WanEncodeOperator::new(&model, true);
        let serial = execute_serial(&op, &x).unwrap();
        assert_eq!(serial.dims(), expected.dims(), "{model_name}");
        let diff = serial.max_abs_diff(&expected).unwrap();
        assert!(diff <= 1e-4, "{model_name} tiled encode: {diff}");
        for world in 1..=4 {
            let results = run_local(world, TransportConfig::default(), |comm| {
                let exec = DistributedVaeExecutor::new(Arc::new(comm), world).unwrap();
                exec.run(&x, Job::tiles(&op), Output::Placed(OutputPlacement::AllRanks)).unwrap().tensor.unwrap()
            })
            .unwrap();
            for r in results {
                assert!(r.unwrap().bit_eq(&serial), "{model_name} on {world} ranks");
            }
        }
    }
}

#[test]
fn wan22_plain_and_tiled_decode_match_diffusers() {
    use vae_models::wan::WanDecodeOperator;
    use vae_runtime::execute_serial;

    let dir = fixtures_dir().join("wan");
    let mut model = WanVae::load(&dir.join("wan22_like")).unwrap();
    for case in ["decode_t1", "decode_t2"] {
        let z = read_npy(dir.join(format!("wan22_like.{case}.in.npy"))).unwrap();
        let expected = read_npy(dir.join(format!("wan22_like.{case}.out.npy"))).unwrap();
        let got = model.decode(&z).unwrap();
        assert_eq!(got.dims(), expected.dims(), "{case}");
        let diff = got.max_abs_diff(&expected).unwrap();
        assert!(diff <= 1e-4, "{case}: {diff}");
    }
    // As the fixture: enable_tiling(32, 48, 16, 32); the merge runs in patchified space.
    model.set_tiling([32, 48], [16, 32]).unwrap();
    let z = read_npy(dir.join("wan22_like.decode_tiled.in.npy")).unwrap();
    let expected = read_npy(dir.join("wan22_like.decode_tiled.out.npy")).unwrap();
    let op = WanDecodeOperator::new(&model, true);
    let got = execute_serial(&op, &z).unwrap();
    assert_eq!(got.dims(), expected.dims());
    let diff = got.max_abs_diff(&expected).unwrap();
    assert!(diff <= 1e-4, "tiled: {diff}");
    // Tiles stitched on the owner as they arrive, unpatchified after: the serial bits.
    for world in 1..=3 {
        assert!(tiles_on_local_ranks(&op, &z, world).bit_eq(&got), "{world} ranks");
    }
}

/// `op` on `world` local ranks, the owner's output.
fn tiles_on_local_ranks<O: vae_runtime::TileOperator + Sync>(
    op: &O,
    x: &vae_tensor::Tensor,
    world: usize,
) -> vae_tensor::Tensor {
    use std::sync::Arc;
    use vae_runtime::{DistributedVaeExecutor, Job, Output, OutputPlacement};
    use vae_transport::{TransportConfig, run_local};
    let results = run_local(world, TransportConfig::default(), |comm| {
        let exec = DistributedVaeExecutor::new(Arc::new(comm), world).unwrap();
        exec.run(x, Job::tiles(op), Output::Placed(OutputPlacement::OwnerOnly)).unwrap().tensor
    })
    .unwrap();
    results.into_iter().next().unwrap().unwrap().expect("rank 0 owns the output")
}

#[test]
fn wan22_plain_and_tiled_encode_match_diffusers() {
    use vae_models::wan::WanEncodeOperator;
    use vae_runtime::execute_serial;

    let dir = fixtures_dir().join("wan");
    let mut model = WanVae::load(&dir.join("wan22_like")).unwrap();
    for frames in ["f1", "f5"] {
        let x = read_npy(dir.join(format!("wan22_like.encode_{frames}.in.npy"))).unwrap();
        let expected = read_npy(dir.join(format!("wan22_like.encode_{frames}_moments.out.npy"))).unwrap();
        let got = model.encode_moments(&x).unwrap();
        assert_eq!(got.dims(), expected.dims(), "{frames}");
        let diff = got.max_abs_diff(&expected).unwrap();
        assert!(diff <= 1e-4, "{frames}: {diff}");
    }
    // As the fixture: enable_tiling(16, 16, 8, 8), applied by diffusers to the patchified video.
    model.set_tiling([16, 16], [8, 8]).unwrap();
    let x = read_npy(dir.join("wan22_like.encode_f5.in.npy")).unwrap();
    let expected = read_npy(dir.join("wan22_like.encode_tiled_f5_moments.out.npy")).unwrap();
    let op = WanEncodeOperator::new(&model, true);
    let got = execute_serial(&op, &x).unwrap();
    assert_eq!(got.dims(), expected.dims());
    let diff = got.max_abs_diff(&expected).unwrap();
    assert!(diff <= 1e-4, "tiled: {diff}");
    for world in 1..=3 {
        assert!(tiles_on_local_ranks(&op, &x, world).bit_eq(&got), "{world} ranks");
    }
    assert!(model.encode_moments(&x).unwrap().max_abs_diff(&expected).unwrap() > 1e-4, "the tiled path differs");
}

#[test]
fn an_encode_of_a_frame_count_that_is_not_one_plus_four_k_is_refused() {
    let model = WanVae::load(&fixtures_dir().join("wan").join("wan21_like")).unwrap();
    let video =
        vae_tensor::Tensor::zeros(vec![1, 3, 6, 16, 16], vae_tensor::DType::F32, &vae_tensor::Device::Cpu).unwrap();
    let err = model.encode_moments(&video).unwrap_err();
    assert!(err.to_string().contains("1 + 4k frames (e.g. 5 or 9)"), "{err}");
}

/// The decoder is causal: the frames decoded from the first k latent frames do not depend on
/// later ones. Decoding a prefix on its own (a different chunking of the work) must therefore
/// give exactly the leading frames of the whole decode — a check on the cache's visit order.
#[test]
fn decoding_a_prefix_of_the_latent_gives_the_leading_frames_exactly() {
    for (family, name) in [("wan", "wan21_like"), ("wan", "wan22_like"), ("qwen_image", "qwen_image_like")] {
        let dir = fixtures_dir().join(family);
        let model = WanVae::load(&dir.join(name)).unwrap();
        let input = if name == "wan22_like" { "decode_t2" } else { "decode_t3" };
        let z = read_npy(dir.join(format!("{name}.{input}.in.npy"))).unwrap();
        let whole = model.decode(&z).unwrap();
        let t = z.dims()[2];
        for k in 1..t {
            let prefix = model.decode(&z.narrow(2, 0, k).unwrap()).unwrap();
            let frames = prefix.dims()[2];
            assert!(whole.narrow(2, 0, frames).unwrap().bit_eq(&prefix), "{name}: first {k} latent frame(s)");
        }
    }
}

#[test]
fn decode_and_encode_report_each_temporal_step_to_the_progress_sink() {
    use vae_runtime::progress::{Progress, collect};

    let dir = fixtures_dir().join("wan");
    let model = WanVae::load(&dir.join("wan21_like")).unwrap();
    let step = |done, total| Progress::Steps { done, total };
    // Three latent frames decode in three steps; five video frames encode in two (1, then 4).
    let z = read_npy(dir.join("wan21_like.decode_t3.in.npy")).unwrap();
    assert_eq!(collect(|| model.decode(&z).unwrap()).1, [step(1, 3), step(2, 3), step(3, 3)]);
    let x = read_npy(dir.join("wan21_like.encode_f5.in.npy")).unwrap();
    assert_eq!(collect(|| model.encode_moments(&x).unwrap()).1, [step(1, 2), step(2, 2)]);
}
