//! Every VAE family on a CUDA device against diffusers and against the CPU: every AutoencoderKL
//! / FLUX.2 fixture case, the video VAEs' plain decode and encode (HunyuanVideo-1.5's and LTX's
//! tiled and batched too), tile-parallel and 2-rank shard decode. Needs a GPU and a build with the kernels embedded; elsewhere each test says
//! why it is skipped, and loading onto CUDA is checked to be a typed error.
#![allow(clippy::print_stderr)] // a skipped GPU test says so

use std::sync::Arc;

use vae_integration_tests::{cuda, fixture_cases, fixtures_dir, kl_case_output, random_tensor};
use vae_models::ModelError;
use vae_models::autoencoder_kl::{AutoencoderKl, KlOperator, KlTask};
use vae_models::wan::{WanShardDecodeOperator, WanVae};
use vae_parallel::io::read_npy;
use vae_runtime::{DistributedVaeExecutor, Job, Output, OutputPlacement, ShardAxis};
use vae_tensor::{DType, Device, TensorError};
use vae_transport::{BytePathOnly, Communicator, NcclComm, TransportConfig, nccl_available, run_local};

#[test]
fn video_vaes_decode_and_encode_on_cuda_as_diffusers_does() {
    let Some(device) = cuda("video VAEs on CUDA") else { return };
    for (family, name, decode_case, encode_case) in [
        ("wan", "wan21_like", "decode_t3", "encode_f5"),
        ("wan", "wan22_like", "decode_t2", "encode_f5"),
        ("qwen_image", "qwen_image_like", "decode_t3", "encode_f5"),
    ] {
        let dir = fixtures_dir().join(family);
        let model = WanVae::load_on(&dir.join(name), device).unwrap();
        let z = read_npy(dir.join(format!("{name}.{decode_case}.in.npy"))).unwrap();
        let want = read_npy(dir.join(format!("{name}.{decode_case}.out.npy"))).unwrap();
        let got = model.decode(&z).unwrap();
        assert!(got.device().is_cpu(), "outputs come back to the host");
        let diff = got.max_abs_diff(&want).unwrap();
        assert!(diff <= 1e-3, "{name} decode on CUDA: max |cuda - diffusers| = {diff}");
        let x = read_npy(dir.join(format!("{name}.{encode_case}.in.npy"))).unwrap();
        let want = read_npy(dir.join(format!("{name}.{encode_case}_moments.out.npy"))).unwrap();
        let diff = model.encode_moments(&x).unwrap().max_abs_diff(&want).unwrap();
        assert!(diff <= 1e-3, "{name} encode on CUDA: {diff}");
    }
}

#[test]
fn hunyuan_video15_on_cuda_matches_diffusers_plain_tiled_batched_and_sharded() {
    use vae_models::family::Direction;
    use vae_models::hunyuan_video15::{
        HunyuanVideo15Operator, HunyuanVideo15ShardOperator, HunyuanVideo15Tiling, HunyuanVideo15Vae,
    };
    use vae_runtime::execute_serial;
    let Some(device) = cuda("HunyuanVideo-1.5 on CUDA") else { return };
    let dir = fixtures_dir().join("hunyuan_video15");
    let mut model = HunyuanVideo15Vae::load_with(&dir.join("hunyuan_video15_like"), device, DType::F32).unwrap();
    model
        .set_tiling(HunyuanVideo15Tiling {
            tile_sample_min_height: 32,
            tile_sample_min_width: 32,
            tile_latent_min_height: 4,
            tile_latent_min_width: 4,
            tile_overlap_factor: 0.25,
        })
        .unwrap();
    let case = |name: &str| read_npy(dir.join(format!("hunyuan_video15_like.{name}.npy"))).unwrap();
    for (input, output, tiled) in [
        ("decode_t3.in", "decode_t3.out", false),
        ("decode_batch2.in", "decode_batch2.out", false),
        ("decode_tiled.in", "decode_tiled.out", true),
    ] {
        let got = execute_serial(&HunyuanVideo15Operator::new(&model, Direction::Decode, tiled), &case(input)).unwrap();
        let diff = got.max_abs_diff(&case(output)).unwrap();
        assert!(diff <= 1e-3, "{input} on CUDA: max |cuda - diffusers| = {diff}");
    }
    for (input, output, tiled) in
        [("encode_f5.in", "encode_f5_moments.out", false), ("encode_tiled_f1.in", "encode_tiled_f1_moments.out", true)]
    {
        let got = execute_serial(&HunyuanVideo15Operator::new(&model, Direction::Encode, tiled), &case(input)).unwrap();
        let diff = got.max_abs_diff(&case(output)).unwrap();
        assert!(diff <= 1e-3, "{input} on CUDA: max |cuda - diffusers| = {diff}");
    }
    // The shard on 2 ranks of the GPU (halos, replicated global edges, the gathered attention).
    let z = random_tensor(&[1, 4, 2, 5, 6], 6);
    let direct = model.decode(&z).unwrap();
    let op = HunyuanVideo15ShardOperator::new(&model, Direction::Decode);
    for axis in [ShardAxis::Height, ShardAxis::Width] {
        let results = run_local(2, TransportConfig::default(), |comm| {
            let exec = DistributedVaeExecutor::new(Arc::new(comm), 2).unwrap();
            exec.run(&z, Job::bands(&op, axis), Output::Placed(OutputPlacement::OwnerOnly)).unwrap().tensor
        })
        .unwrap();
        let got = results.into_iter().next().unwrap().unwrap().expect("rank 0 owns the output");
        let diff = got.max_abs_diff(&direct).unwrap();
        assert!(diff <= 1e-5, "{axis}: max |shard - direct| on CUDA = {diff}");
    }
}

#[test]
fn ltx_on_cuda_matches_diffusers_plain_tiled_in_space_and_time_and_sharded() {
    use vae_models::family::Direction;
    use vae_models::ltx::{LtxClass, LtxOperator, LtxShardOperator, LtxVae};
    use vae_runtime::execute_serial;
    let Some(device) = cuda("LTX on CUDA") else { return };
    let dir = fixtures_dir().join("ltx");
    let case = |name: &str| read_npy(dir.join(format!("{name}.npy"))).unwrap();
    for (name, class) in [("ltx2_like", LtxClass::Ltx2), ("ltx_video_like", LtxClass::LtxVideo)] {
        let mut model = LtxVae::load_with(&dir.join(name), class, device, DType::F32).unwrap();
        if class == LtxClass::LtxVideo {
            model.set_decode_timestep(0.05).unwrap();
        }
        let untiled = *model.tiling();
        // The fixtures' tiles: 16 px every 8, and 8 frames every 4; LTX-2's reflecting decoder
        // takes 24 px every 16 (tiles of at least 2 latent pixels).
        let tiles = |px: [usize; 2]| {
            let mut t = untiled;
            t.spatial.tile_sample_min_height = px[0];
            t.spatial.tile_sample_min_width = px[0];
            t.spatial.tile_sample_stride_height = px[1];
            t.spatial.tile_sample_stride_width = px[1];
            (t.tile_sample_min_num_frames, t.tile_sample_stride_num_frames, t.framewise) = (8, 4, true);
            t
        };
        for (direction, tag, output, tiled) in [
            (Direction::Decode, "decode_t3", "decode_t3", false),
            (Direction::Decode, "decode_batch2", "decode_batch2", false),
            (Direction::Decode, "decode_spatiotemporal", "decode_spatiotemporal", true),
            (Direction::Encode, "encode_f5", "encode_f5_moments", false),
            (Direction::Encode, "encode_spatiotemporal", "encode_spatiotemporal_moments", true),
        ] {
            let px = if class == LtxClass::Ltx2 && direction == Direction::Decode { [24, 16] } else { [16, 8] };
            model.set_tiling(if tiled { tiles(px) } else { untiled }).unwrap();
            let op = LtxOperator::new(&model, direction, tiled);
            let got = execute_serial(&op, &case(&format!("{name}.{tag}.in"))).unwrap();
            let diff = got.max_abs_diff(&case(&format!("{name}.{output}.out"))).unwrap();
            assert!(diff <= 1e-3, "{name} {tag} on CUDA: max |cuda - diffusers| = {diff}");
        }
        // The shard on 2 ranks of the GPU (halos; zero or reflected rows at the global edges).
        let z = random_tensor(&[1, 8, 2, 5, 6], 7);
        let direct = model.decode(&z).unwrap();
        let op = LtxShardOperator::new(&model, Direction::Decode);
        for axis in [ShardAxis::Height, ShardAxis::Width] {
            let results = run_local(2, TransportConfig::default(), |comm| {
                let exec = DistributedVaeExecutor::new(Arc::new(comm), 2).unwrap();
                exec.run(&z, Job::bands(&op, axis), Output::Placed(OutputPlacement::OwnerOnly)).unwrap().tensor
            })
            .unwrap();
            let got = results.into_iter().next().unwrap().unwrap().expect("rank 0 owns the output");
            let diff = got.max_abs_diff(&direct).unwrap();
            assert!(diff <= 1e-5, "{name} {axis}: max |shard - direct| on CUDA = {diff}");
        }
    }
}

#[test]
fn shard_decode_on_cuda_matches_the_direct_decode_on_cuda() {
    let Some(device) = cuda("shard on CUDA") else { return };
    let model = WanVae::load_on(&fixtures_dir().join("wan").join("wan21_like"), device).unwrap();
    // 7 x 10 latent rows and columns: uneven bands on 2 and 4 ranks.
    let z = random_tensor(&[1, 16, 2, 7, 10], 4);
    let direct = model.decode(&z).unwrap();
    let op = WanShardDecodeOperator::new(&model);
    for (ranks, axis) in [2, 4].into_iter().flat_map(|n| [(n, ShardAxis::Height), (n, ShardAxis::Width)]) {
        let results = run_local(ranks, TransportConfig::default(), |comm| {
            let exec = DistributedVaeExecutor::new(Arc::new(comm), ranks).unwrap();
            exec.run(&z, Job::bands(&op, axis), Output::Placed(OutputPlacement::OwnerOnly)).unwrap().tensor
        })
        .unwrap();
        let got = results.into_iter().next().unwrap().unwrap().expect("rank 0 owns the output");
        let diff = got.max_abs_diff(&direct).unwrap();
        assert!(diff <= 1e-5, "{ranks} ranks, {axis}: max |shard - direct| on CUDA = {diff}");
    }
}

/// The 2-D shard on CUDA: device halos along both axes (the corners through the rows padded
/// first) on a 2 × 2 grid of blocks, as close to the direct decode on CUDA as the 1-D shard is.
#[test]
fn block_shard_decode_on_cuda_matches_the_direct_decode_on_cuda() {
    let Some(device) = cuda("2-D shard on CUDA") else { return };
    let model = WanVae::load_on(&fixtures_dir().join("wan").join("wan21_like"), device).unwrap();
    let z = random_tensor(&[1, 16, 2, 7, 10], 4);
    let direct = model.decode(&z).unwrap();
    let op = WanShardDecodeOperator::new(&model);
    let results = run_local(4, TransportConfig::default(), |comm| {
        let exec = DistributedVaeExecutor::new(Arc::new(comm), 4).unwrap();
        exec.run(&z, Job::blocks(&op, [2, 2]), Output::Placed(OutputPlacement::OwnerOnly)).unwrap().tensor
    })
    .unwrap();
    let got = results.into_iter().next().unwrap().unwrap().expect("rank 0 owns the output");
    let diff = got.max_abs_diff(&direct).unwrap();
    assert!(diff <= 1e-5, "2 x 2 blocks: max |blocks - direct| on CUDA = {diff}");
}

/// Under `VAE_CUDA_CONV=cudnn` (the second pass of `cargo xtask gpu-emu`, on the fake cuDNN) the
/// convolutions do run on cuDNN: the other tests' checks hold for its results, not ours.
#[test]
fn convolutions_run_on_cudnn_where_the_process_asks_for_it() {
    let Some(device) = cuda("cuDNN convolutions on CUDA") else { return };
    if std::env::var(vae_tensor::cuda::CONV_ENV).as_deref() != Ok("cudnn") {
        eprintln!("cuDNN convolutions: not asked for in this run ({} is not cudnn)", vae_tensor::cuda::CONV_ENV);
        return;
    }
    let version = vae_tensor::cuda::cudnn_version();
    assert!(version.is_ok(), "{}=cudnn but cuDNN does not load: {version:?}", vae_tensor::cuda::CONV_ENV);
    let before = vae_tensor::cuda::cudnn_convolutions();
    let model = WanVae::load_on(&fixtures_dir().join("wan").join("wan21_like"), device).unwrap();
    model.decode(&random_tensor(&[1, 16, 2, 7, 10], 4)).unwrap();
    assert!(vae_tensor::cuda::cudnn_convolutions() > before, "the decode's convolutions ran on cuDNN");
}

#[test]
fn without_a_usable_gpu_loading_onto_cuda_is_a_typed_error() {
    if cuda("CUDA load errors (this machine has a GPU)").is_some() {
        return;
    }
    let unavailable = |e: ModelError| matches!(e, ModelError::Tensor(TensorError::DeviceUnavailable { .. }));
    let kl = AutoencoderKl::load_on(&fixtures_dir().join("autoencoder_kl").join("sd_like"), Device::Cuda(0));
    assert!(kl.is_err_and(unavailable), "AutoencoderKL onto CUDA without a GPU");
    let wan = WanVae::load_on(&fixtures_dir().join("wan").join("wan21_like"), Device::Cuda(0));
    assert!(wan.is_err_and(unavailable), "Wan onto CUDA without a GPU");
}

#[test]
fn autoencoder_kl_family_on_cuda_matches_diffusers_in_every_fixture_case() {
    let Some(device) = cuda("AutoencoderKL on CUDA") else { return };
    let dir = fixtures_dir().join("autoencoder_kl");
    let cases = fixture_cases("autoencoder_kl");
    assert!(cases.len() >= 12, "a full manifest");
    for case in &cases {
        let mut model = AutoencoderKl::load_on(&dir.join(&case.model), device).unwrap();
        model.set_tiling(case.tile_sample_min_size, case.tile_overlap_factor).unwrap();
        let input = read_npy(dir.join(&case.input)).unwrap();
        let want = read_npy(dir.join(&case.output)).unwrap();
        let got = kl_case_output(&model, case, &input);
        assert!(got.device().is_cpu(), "outputs come back to the host");
        let diff = got.max_abs_diff(&want).unwrap();
        assert!(diff <= 1e-3, "{} on CUDA: max |cuda - diffusers| = {diff}", case.name);
    }
}

#[test]
fn autoencoder_kl_tiles_on_two_and_four_ranks_of_one_gpu_match_the_serial_cuda_run() {
    let Some(device) = cuda("AutoencoderKL tile-parallel on CUDA") else { return };
    let mut model = AutoencoderKl::load_on(&fixtures_dir().join("autoencoder_kl").join("sd_like"), device).unwrap();
    model.set_tiling(Some(32), Some(0.25)).unwrap();
    let z = random_tensor(&[1, 4, 9, 11], 5);
    let op = KlOperator::new(&model, KlTask::Decode, true);
    let serial = vae_runtime::execute_serial(&op, &z).unwrap();
    for ranks in [2, 4] {
        let results = run_local(ranks, TransportConfig::default(), |comm| {
            let exec = DistributedVaeExecutor::new(Arc::new(comm), ranks).unwrap();
            let out = exec.run(&z, Job::tiles(&op), Output::Placed(OutputPlacement::OwnerOnly)).unwrap();
            // Each rank's tiles were computed on the device: its account saw device memory.
            assert!(out.report.device_peak_bytes > 0, "rank {}: device peak reported", out.report.rank);
            out.tensor
        })
        .unwrap();
        let got = results.into_iter().next().unwrap().unwrap().expect("rank 0 owns the output");
        // The same kernels on the same device for every tile: identical bits.
        let diff = got.max_abs_diff(&serial).unwrap();
        assert!(got.bit_eq(&serial), "{ranks}-rank tiles on CUDA vs serial: {diff}");
    }
}

#[test]
fn bf16_decodes_on_cuda_stay_close_to_diffusers_f32() {
    let Some(device) = cuda("bf16 models on CUDA") else { return };
    // The fixtures are f32 diffusers outputs; a bf16 model rounds every activation to 8
    // significant bits, so this bounds the drift, it is not a parity check (the f32 tests are).
    let kl = fixtures_dir().join("autoencoder_kl");
    let z = read_npy(kl.join("sd_like.decode.in.npy")).unwrap();
    let want = read_npy(kl.join("sd_like.decode.out.npy")).unwrap();
    let model = AutoencoderKl::load_with(&kl.join("sd_like"), device, DType::BF16).unwrap();
    assert_eq!(model.dtype(), DType::BF16);
    let got = model.decode(&z).unwrap();
    assert_eq!(got.dtype(), DType::F32, "results come back as f32");
    let diff = got.max_abs_diff(&want).unwrap();
    eprintln!("sd_like decode, bf16 on CUDA vs diffusers f32: max diff {diff}");
    assert!(diff <= 0.1, "sd_like bf16 decode: {diff}");
    let wan = fixtures_dir().join("wan");
    let z = read_npy(wan.join("wan21_like.decode_t3.in.npy")).unwrap();
    let want = read_npy(wan.join("wan21_like.decode_t3.out.npy")).unwrap();
    let model = WanVae::load_with(&wan.join("wan21_like"), device, DType::BF16).unwrap();
    let direct = model.decode(&z).unwrap();
    let diff = direct.max_abs_diff(&want).unwrap();
    eprintln!("wan21_like decode, bf16 on CUDA vs diffusers f32: max diff {diff}");
    assert!(diff <= 0.1, "wan21_like bf16 decode: {diff}");
    // Shard decode in bf16: local ranks hand each other their bf16 halo rows on the device, so
    // nothing is rounded twice and the result equals the direct bf16 decode up to the kernels'
    // accumulation order at band edges.
    let op = WanShardDecodeOperator::new(&model);
    let results = run_local(2, TransportConfig::default(), |comm| {
        let exec = DistributedVaeExecutor::new(Arc::new(comm), 2).unwrap();
        exec.run(&z, Job::bands(&op, ShardAxis::Width), Output::Placed(OutputPlacement::OwnerOnly)).unwrap().tensor
    })
    .unwrap();
    let shard = results.into_iter().next().unwrap().unwrap().expect("rank 0 owns the output");
    let diff = shard.max_abs_diff(&direct).unwrap();
    assert!(diff <= 1e-2, "bf16 shard vs direct: {diff}");
}

/// Decodes `z` sharded along the width over one NCCL rank per GPU (rank r on cuda:r, each with
/// its own copy of the model), the halos moving GPU to GPU or, with `host_bytes`, through the
/// host. Returns the owner's output and the halo bytes every rank sent.
fn nccl_shard_decode(
    ranks: usize,
    dtype: DType,
    z: &vae_tensor::Tensor,
    host_bytes: bool,
) -> (vae_tensor::Tensor, Vec<u64>) {
    let ordinals: Vec<usize> = (0..ranks).collect();
    let comms = NcclComm::from_devices(&ordinals).expect("an NCCL group, one rank per GPU");
    let dir = fixtures_dir().join("wan").join("wan21_like");
    let results: Vec<(Option<vae_tensor::Tensor>, u64)> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let dir = &dir;
                s.spawn(move || {
                    let device = Device::Cuda(comm.rank());
                    assert!(comm.exchanges_device_buffers(comm.rank()));
                    let comm: Arc<dyn Communicator> =
                        if host_bytes { Arc::new(BytePathOnly(comm)) } else { Arc::new(comm) };
                    let model = WanVae::load_with(dir, device, dtype).unwrap();
                    let op = WanShardDecodeOperator::new(&model);
                    let exec = DistributedVaeExecutor::new(comm, ranks).unwrap();
                    let out = exec
                        .run(z, Job::bands(&op, ShardAxis::Width), Output::Placed(OutputPlacement::OwnerOnly))
                        .unwrap();
                    (out.tensor, out.report.traffic.exchange.bytes_sent)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("a rank thread")).collect()
    });
    let sent = results.iter().map(|(_, b)| *b).collect();
    let output = results.into_iter().next().and_then(|(t, _)| t).expect("rank 0 owns the output");
    (output, sent)
}

#[test]
fn shard_decode_over_nccl_moves_halos_gpu_to_gpu_and_matches_the_host_path_bit_for_bit() {
    let Some(device) = cuda("shard over NCCL") else { return };
    if let Err(reason) = nccl_available() {
        eprintln!("shard over NCCL: skipped, {reason}");
        return;
    }
    let gpus = vae_tensor::cuda::device_count();
    if gpus < 2 {
        // A machine with one GPU cannot hold two NCCL ranks: scripts/gpu-check.sh excuses this
        // skip alone (the fake driver of `cargo xtask gpu-emu` has several devices: it fails there).
        eprintln!("shard over NCCL: skipped, it needs one GPU per rank and this machine has {gpus}");
        return;
    }
    let z = random_tensor(&[1, 16, 2, 7, 10], 4);
    for dtype in [DType::F32, DType::BF16] {
        let direct = WanVae::load_with(&fixtures_dir().join("wan").join("wan21_like"), device, dtype)
            .unwrap()
            .decode(&z)
            .unwrap();
        for ranks in (2..=gpus.min(3)).rev() {
            let (on_device, device_sent) = nccl_shard_decode(ranks, dtype, &z, false);
            let (via_host, host_sent) = nccl_shard_decode(ranks, dtype, &z, true);
            // The same halo values either way (bf16 widens to f32 and back exactly).
            let (a, b) = (on_device.to_vec_f32().unwrap(), via_host.to_vec_f32().unwrap());
            let first = a.iter().zip(&b).position(|(x, y)| x.to_bits() != y.to_bits());
            assert!(
                a.len() == b.len() && first.is_none(),
                "{ranks} ranks, {dtype}: GPU-to-GPU halos vs host halos differ first at element {first:?}"
            );
            let diff = on_device.max_abs_diff(&direct).unwrap();
            let bound = if dtype == DType::BF16 { 1e-2 } else { 1e-5 };
            assert!(diff <= bound, "{ranks} ranks over NCCL, {dtype}: max |shard - direct| = {diff}");
            // Rows travel in their own type on the device, as f32 through the host.
            let per_element = if dtype == DType::BF16 { 2 } else { 1 };
            let halved: Vec<u64> = device_sent.iter().map(|b| b * per_element).collect();
            assert!(device_sent.iter().all(|&b| b > 0), "{ranks} ranks, {dtype}: every rank sent halos");
            assert_eq!(halved, host_sent, "{ranks} ranks, {dtype}: halo bytes GPU to GPU vs through the host");
            eprintln!(
                "shard over NCCL, {ranks} ranks, {dtype}: max |shard - direct| {diff}; halo bytes sent per rank \
                 {device_sent:?} GPU to GPU, {host_sent:?} through the host"
            );
        }
    }
}

/// The cost model's profiles describe CPUs: an engine on a GPU keeps its family's rules under
/// `auto` (here tiles, as the AutoencoderKL rule says on CUDA) with no prediction, and refuses a
/// memory cap with a typed error instead of choosing by a CPU's figures.
#[test]
fn on_cuda_auto_keeps_the_family_rules_and_a_memory_cap_is_refused() {
    use vae_parallel::cost::CostError;
    use vae_parallel::planner::cost::DeviceProfile;
    use vae_parallel::{CostProfile, Error, Vae};
    use vae_runtime::ParallelMode;

    let Some(device) = cuda("the cost model on CUDA") else { return };
    let dir = fixtures_dir().join("autoencoder_kl").join("sd_like");
    let engine = Vae::builder(&dir)
        .device(device)
        .dtype(DType::F32)
        .cost_profile(CostProfile::Given(DeviceProfile::builtin_cpu()))
        .build()
        .unwrap();
    let z = random_tensor(&[1, 4, 9, 11], 5);
    let results = run_local(2, TransportConfig::default(), |comm| {
        let exec = DistributedVaeExecutor::new(Arc::new(comm), 2).unwrap();
        let auto = vae_integration_tests::reference(ParallelMode::Auto);
        let out = engine.decode_on(&exec, &z, &auto).unwrap();
        let capped = auto.max_memory_per_rank(1 << 30);
        let refused = engine.decode_on(&exec, &z, &capped).unwrap_err();
        (out.report.strategy.label(), out.report.predicted, refused)
    })
    .unwrap();
    for r in results {
        let (strategy, predicted, refused) = r.unwrap();
        assert_eq!(strategy, "tile");
        assert!(predicted.is_none());
        assert!(matches!(refused, Error::Refused(CostError::NoModel { .. })), "{refused}");
        assert!(refused.to_string().contains("on cuda"), "{refused}");
    }
}
