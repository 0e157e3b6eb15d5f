//! `--dtype bf16` on the CPU: f32 models whose convolutions multiply in bf16 (AVX512-BF16),
//! against diffusers' f32 fixtures, the shard decode against the direct bf16 decode, and the
//! typed error where the CPU lacks the feature.

use std::sync::Arc;

use vae_integration_tests::fixtures_dir;
use vae_models::autoencoder_kl::AutoencoderKl;
use vae_models::wan::{WanShardDecodeOperator, WanVae};
use vae_parallel::io::read_npy;
use vae_runtime::{DistributedVaeExecutor, Job, Output, OutputPlacement, ShardAxis};
use vae_tensor::{CpuBf16Scope, Tensor};
use vae_transport::{TransportConfig, run_local};

fn read(path: &std::path::Path) -> Tensor {
    read_npy(path).unwrap()
}

#[test]
fn bf16_convolutions_stay_close_to_diffusers_f32_and_shards_stay_bit_identical() {
    let scope = CpuBf16Scope::enter();
    if !CpuBf16Scope::supported() {
        let err = scope.unwrap_err().to_string();
        assert!(err.contains("AVX512-BF16"), "the error names the missing feature: {err}");
        return;
    }
    let _scope = scope.unwrap();
    // The fixtures are f32 diffusers outputs: this bounds the drift of bf16 products (inputs
    // and weights of every convolution rounded to 8 significant bits), it is not a parity check.
    // The bounds are what diffusers 0.38 / torch 2.15 reach with the same model in bf16 on the
    // CPU (`vae.to(torch.bfloat16)`, bf16 latent), measured on these fixtures: ours must not be
    // worse (it rounds the products only, not every activation).
    let kl = fixtures_dir().join("autoencoder_kl");
    let mut worst = Vec::new();
    for (name, torch_bf16) in [("sd_like", 0.0615), ("flux1_like", 0.0528), ("flux2_like", 0.0923)] {
        let model = AutoencoderKl::load(&kl.join(name)).unwrap();
        let z = read(&kl.join(format!("{name}.decode.in.npy")));
        let want = read(&kl.join(format!("{name}.decode.out.npy")));
        let got = model.decode(&z).unwrap();
        let diff = got.max_abs_diff(&want).unwrap();
        worst.push((name, diff));
        assert!(diff <= torch_bf16, "{name} bf16 decode vs diffusers f32: {diff} (torch bf16: {torch_bf16})");
    }
    let wan = fixtures_dir().join("wan");
    let model = WanVae::load(&wan.join("wan21_like")).unwrap();
    let z = read(&wan.join("wan21_like.decode_t3.in.npy"));
    let want = read(&wan.join("wan21_like.decode_t3.out.npy"));
    let direct = model.decode(&z).unwrap();
    let diff = direct.max_abs_diff(&want).unwrap();
    worst.push(("wan21_like", diff));
    assert!(diff <= 0.00987, "wan21_like bf16 decode vs diffusers f32: {diff} (torch bf16: 0.00987)");
    // The shard decode runs the same bf16 kernels on whole tiles of the direct grid: bit-identical.
    let op = WanShardDecodeOperator::new(&model);
    for axis in [ShardAxis::Height, ShardAxis::Width] {
        let results = run_local(2, TransportConfig::default(), |comm| {
            // Each rank's thread computes in bf16 too.
            let _bf16 = CpuBf16Scope::enter().unwrap();
            let exec = DistributedVaeExecutor::new(Arc::new(comm), 2).unwrap();
            exec.run(&z, Job::bands(&op, axis), Output::Placed(OutputPlacement::OwnerOnly)).unwrap().tensor
        })
        .unwrap();
        let shard = results.into_iter().next().unwrap().unwrap().expect("rank 0 owns the output");
        assert!(shard.bit_eq(&direct), "bf16 shard ({axis}) vs direct: {}", shard.max_abs_diff(&direct).unwrap());
    }
    #[allow(clippy::print_stdout)]
    {
        println!("bf16 CPU decodes vs diffusers f32, max |diff|: {worst:?}");
    }
}
