//! The video VAEs on a CUDA device against diffusers and against the CPU: plain decode and
//! encode, and the 2-rank shard decode. Needs a GPU and a build with the kernels embedded;
//! elsewhere each test says why it is skipped.
#![allow(clippy::print_stderr)] // a skipped GPU test says so

use std::sync::Arc;

use vae_integration_tests::{fixtures_dir, random_tensor};
use vae_models::wan::{WanShardDecodeOperator, WanVae};
use vae_parallel::io::read_npy;
use vae_runtime::{DistributedVaeExecutor, OutputPlacement, ShardAxis};
use vae_tensor::Device;
use vae_tensor::cuda::resolve_device;
use vae_transport::{TransportConfig, run_local};

fn cuda(test: &str) -> Option<Device> {
    match resolve_device(Device::Cuda(0)) {
        (Device::Cuda(n), None) => Some(Device::Cuda(n)),
        (_, why) => {
            eprintln!("{test}: skipped, {}", why.unwrap_or_default());
            None
        }
    }
}

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
        let z = read_npy(&dir.join(format!("{name}.{decode_case}.in.npy"))).unwrap();
        let want = read_npy(&dir.join(format!("{name}.{decode_case}.out.npy"))).unwrap();
        let got = model.decode(&z).unwrap();
        assert!(got.device().is_cpu(), "outputs come back to the host");
        let diff = got.max_abs_diff(&want).unwrap();
        assert!(diff <= 1e-3, "{name} decode on CUDA: max |cuda - diffusers| = {diff}");
        let x = read_npy(&dir.join(format!("{name}.{encode_case}.in.npy"))).unwrap();
        let want = read_npy(&dir.join(format!("{name}.{encode_case}_moments.out.npy"))).unwrap();
        let diff = model.encode_moments(&x).unwrap().max_abs_diff(&want).unwrap();
        assert!(diff <= 1e-3, "{name} encode on CUDA: {diff}");
    }
}

#[test]
fn shard_decode_on_cuda_matches_the_direct_decode_on_cuda() {
    let Some(device) = cuda("shard on CUDA") else { return };
    let model = WanVae::load_on(&fixtures_dir().join("wan").join("wan21_like"), device).unwrap();
    let z = random_tensor(&[1, 16, 2, 5, 7], 4);
    let direct = model.decode(&z).unwrap();
    let op = WanShardDecodeOperator::new(&model);
    for axis in [ShardAxis::Height, ShardAxis::Width] {
        let results = run_local(2, TransportConfig::default(), |comm| {
            let exec = DistributedVaeExecutor::new(Arc::new(comm), 2).unwrap();
            exec.execute_sharded(&z, &op, axis, OutputPlacement::OwnerOnly).unwrap().tensor
        })
        .unwrap();
        let got = results.into_iter().next().unwrap().unwrap().expect("rank 0 owns the output");
        let diff = got.max_abs_diff(&direct).unwrap();
        assert!(diff <= 1e-5, "{axis}: max |shard - direct| on CUDA = {diff}");
    }
}
