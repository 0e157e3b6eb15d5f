//! Fallbacks and rejections of the parallel modes are reported once per request, with their
//! reason. One test in its own binary: it installs the process-wide log subscriber (the ranks
//! are threads, so a thread-local one would miss them).

use std::io::Write;
use std::sync::{Arc, Mutex};

use vae_integration_tests::fixtures_dir;
use vae_integration_tests::{load_vae, reference, reference_encode};
use vae_runtime::{DistributedVaeExecutor, ParallelMode};
use vae_tensor::{DType, Device, Tensor};
use vae_transport::{TransportConfig, run_local};

/// Everything the subscriber writes.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn take(&self) -> String {
        String::from_utf8(std::mem::take(&mut *self.0.lock().unwrap())).unwrap()
    }
}

#[test]
fn fallbacks_warn_once_per_request_and_rejections_are_typed_errors_on_every_rank() {
    let captured = Captured::default();
    let writer = captured.clone();
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .init();

    let wan = load_vae(&fixtures_dir().join("wan").join("wan21_like"));
    // Height 3 cannot feed 4 ranks: spatial_shard_height falls back to tile (never to width).
    let z = Tensor::zeros(vec![1, 16, 1, 3, 8], DType::F32, &Device::Cpu).unwrap();
    let reasons = run_local(4, TransportConfig::default(), |comm| {
        let exec = DistributedVaeExecutor::new(Arc::new(comm), 4).unwrap();
        let out = wan.decode_on(&exec, &z, &reference(ParallelMode::SpatialShardHeight)).unwrap();
        (out.report.strategy.label(), out.report.reason.unwrap())
    })
    .unwrap();
    for r in reasons {
        let (strategy, reason) = r.unwrap();
        assert_eq!(strategy, "tile");
        assert!(reason.contains("latent height of 3 cannot give 4 rank(s)"), "{reason}");
    }
    let log = captured.take();
    let warnings: Vec<&str> = log.lines().filter(|l| l.contains("WARN")).collect();
    assert_eq!(warnings.len(), 1, "one warning for the request, not one per rank:\n{log}");
    assert!(warnings[0].contains("spatial_shard_height") && warnings[0].contains("latent height of 3"), "{log}");

    // auto choosing tile is not a fallback: no warning.
    run_local(4, TransportConfig::default(), |comm| {
        let exec = DistributedVaeExecutor::new(Arc::new(comm), 4).unwrap();
        wan.decode_on(&exec, &z.narrow(3, 0, 2).unwrap(), &reference(ParallelMode::Auto)).unwrap();
    })
    .unwrap();
    assert_eq!(captured.take(), "", "auto's tile choice is not a warning");

    // An image that cannot be cut between whole latent columns encodes a forced shard mode
    // with tiles, with one warning for the request.
    let kl = load_vae(&fixtures_dir().join("autoencoder_kl").join("sd_like"));
    assert!(kl.check_mode(ParallelMode::SpatialShardWidth).is_ok());
    let image = Tensor::zeros(vec![1, 3, 16, 20], DType::F32, &Device::Cpu).unwrap();
    run_local(2, TransportConfig::default(), |comm| {
        let exec = DistributedVaeExecutor::new(Arc::new(comm), 2).unwrap();
        let options = reference_encode(ParallelMode::SpatialShardWidth, vae_parallel::EncodeOutput::Mean);
        kl.encode_on(&exec, &image, &options).unwrap();
    })
    .unwrap();
    let log = captured.take();
    let warnings: Vec<&str> = log.lines().filter(|l| l.contains("WARN")).collect();
    assert_eq!(warnings.len(), 1, "one warning for the request:\n{log}");
    assert!(warnings[0].contains("not a multiple of 8") && warnings[0].contains("encoding with tiles"), "{log}");
}
