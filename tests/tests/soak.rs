//! One long-lived engine per family serving many mixed requests on one group of two local
//! ranks: tiles, shards along both axes, direct decodes, encodes and bad inputs in a fixed
//! cycle. Every repeat of a request is bit-identical to its first run, every bad input is a
//! typed error on both ranks that leaves the engines usable, and memory is flat: the tensors
//! alive return to the same figure after every cycle, and the process does not grow.
//!
//! `VAE_SOAK_REQUESTS` sets the number of requests (CI runs a few cycles; the full soak is
//! `VAE_SOAK_REQUESTS=1000 cargo test --release -p vae-integration-tests --test soak -- --nocapture`,
//! with its figures in docs/benchmarks.md).

#![allow(clippy::print_stdout)] // the soak's figures

use std::sync::Arc;

use vae_integration_tests::{fixtures_dir, random_tensor};
use vae_integration_tests::{load_vae, reference, reference_encode};
use vae_parallel::EncodeOutput;
use vae_runtime::{DistributedVaeExecutor, ParallelMode};
use vae_tensor::Tensor;
use vae_transport::{TransportConfig, run_local};

/// The kinds of request in one cycle.
const KINDS: usize = 9;

/// Resident set size of this process, in bytes (Linux).
fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm.split_whitespace().nth(1).and_then(|v| v.parse().ok()).unwrap_or(0);
    pages * 4096
}

/// An FNV-1a hash of a tensor's shape and bits.
fn digest(t: &Tensor) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for b in t.dims().iter().flat_map(|d| d.to_le_bytes()).chain(t.as_bytes().unwrap().iter().copied()) {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

#[test]
fn one_engine_serves_many_mixed_requests_with_flat_memory_and_identical_repeats() {
    let requests: usize = std::env::var("VAE_SOAK_REQUESTS").ok().and_then(|v| v.parse().ok()).unwrap_or(4 * KINDS);
    let wan = load_vae(&fixtures_dir().join("wan").join("wan21_like"));
    let kl = load_vae(&fixtures_dir().join("autoencoder_kl").join("sd_like"));
    let video_latent = random_tensor(&[1, 16, 2, 8, 12], 1);
    let small_latent = random_tensor(&[1, 16, 1, 2, 2], 2);
    let video = random_tensor(&[1, 3, 5, 32, 48], 3);
    let image_latent = random_tensor(&[1, 4, 12, 16], 4);
    let image = random_tensor(&[1, 3, 96, 128], 5);
    let wrong_channels = random_tensor(&[1, 7, 1, 4, 4], 6);
    let mut nan_latent = image_latent.to_vec_f32().unwrap();
    nan_latent[5] = f32::NAN;
    let nan_latent = Tensor::from_vec(nan_latent, image_latent.dims().to_vec(), &vae_tensor::Device::Cpu).unwrap();

    let results = run_local(2, TransportConfig::default(), |comm| {
        let exec = DistributedVaeExecutor::new(Arc::new(comm), 2).unwrap();
        let mode = reference;
        let mut first: Vec<Option<Option<u64>>> = vec![None; KINDS];
        let (mut live_after_warmup, mut rss_after_warmup) = (0usize, 0u64);
        let (mut live_max_drift, mut rss_max) = (0i64, 0u64);
        for i in 0..requests {
            let kind = i % KINDS;
            let outcome = match kind {
                0 => wan.decode_on(&exec, &video_latent, &mode(ParallelMode::Tile)),
                1 => wan.decode_on(&exec, &video_latent, &mode(ParallelMode::SpatialShardHeight)),
                2 => wan.decode_on(&exec, &video_latent, &mode(ParallelMode::SpatialShardWidth)),
                3 => wan.decode_on(&exec, &small_latent, &mode(ParallelMode::Auto)),
                4 => wan.encode_on(&exec, &video, &reference_encode(ParallelMode::Tile, EncodeOutput::Moments)),
                5 => wan.decode_on(&exec, &wrong_channels, &mode(ParallelMode::Auto)),
                6 => kl.decode_on(&exec, &image_latent, &mode(ParallelMode::Tile).tiled()),
                7 => kl.encode_on(&exec, &image, &reference_encode(ParallelMode::Tile, EncodeOutput::Mean)),
                _ => kl.decode_on(&exec, &nan_latent, &mode(ParallelMode::Tile)),
            };
            // Kinds 5 and 8 are bad inputs: a typed error, the same on both ranks.
            let result = match (kind, outcome) {
                (5 | 8, Err(e)) => {
                    assert!(e.to_string().contains("invalid input"), "request {i}: {e}");
                    None
                }
                (5 | 8, Ok(_)) => panic!("request {i}: a bad input was accepted"),
                (_, Ok(out)) => Some(out.tensor.as_ref().map(digest).unwrap_or(0)),
                (_, Err(e)) => panic!("request {i} (kind {kind}): {e}"),
            };
            match &first[kind] {
                None => first[kind] = Some(result),
                Some(expected) => assert_eq!(*expected, result, "request {i} (kind {kind}) differs from its first run"),
            }
            if (i + 1) % KINDS == 0 {
                let (live, rss) = (vae_tensor::memory::live_bytes(), rss_bytes());
                if i + 1 == KINDS {
                    (live_after_warmup, rss_after_warmup) = (live, rss);
                } else {
                    live_max_drift = live_max_drift.max((live as i64 - live_after_warmup as i64).abs());
                    rss_max = rss_max.max(rss);
                }
            }
        }
        (live_after_warmup, live_max_drift, rss_after_warmup, rss_max)
    })
    .unwrap();
    for (rank, r) in results.into_iter().enumerate() {
        let (live, drift, rss_warm, rss_max) = r.unwrap();
        println!(
            "soak rank {rank}: {requests} requests; tensors alive after each cycle {live} B (largest drift {drift} B); \
             process RSS after warm-up {:.1} MiB, largest after {:.1} MiB",
            rss_warm as f64 / (1 << 20) as f64,
            rss_max as f64 / (1 << 20) as f64
        );
        assert_eq!(drift, 0, "rank {rank}: tensors left alive between cycles");
        if requests >= 3 * KINDS {
            // The process (both ranks' threads together) stays within 5 % of its size after the
            // first cycle, plus 4 MiB for allocator slack.
            assert!(
                rss_max as f64 <= rss_warm as f64 * 1.05 + 4.0 * (1 << 20) as f64,
                "rank {rank}: the process grew from {rss_warm} to {rss_max} bytes"
            );
        }
    }
}
