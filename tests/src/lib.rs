//! Support for the workspace integration tests: running one test scenario in N rank processes.
//!
//! A test binary re-runs itself once per rank, selecting an `#[ignore]`d entry test with
//! `--exact NAME --include-ignored`; the entry reads [`SCENARIO_ENV`] and joins the socket group
//! from the usual `VAE_RANK` / `VAE_WORLD_SIZE` / `VAE_MASTER_ADDR` variables.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;

/// Environment variable naming the scenario a rank process plays.
pub const SCENARIO_ENV: &str = "VAE_TEST_SCENARIO";

static NEXT: AtomicUsize = AtomicUsize::new(0);

/// A fresh Unix-socket master address in the temporary directory.
pub fn unix_master(tag: &str) -> String {
    let n = NEXT.fetch_add(1, Ordering::SeqCst);
    let path = std::env::temp_dir().join(format!("vae-it-{}-{tag}-{n}.sock", std::process::id()));
    format!("unix:{}", path.display())
}

/// One spawned rank.
pub struct RankProcess {
    child: Child,
    lines: mpsc::Receiver<String>,
    reader: std::thread::JoinHandle<()>,
}

/// How a rank process ended.
pub struct RankExit {
    /// Exit status was success.
    pub success: bool,
    /// Its stdout and stderr.
    pub output: String,
}

/// Starts `world` copies of this test binary running the ignored test `entry` as the ranks of
/// a socket group at `master`, playing `scenario`.
pub fn spawn_ranks(entry: &str, scenario: &str, world: usize, master: &str, env: &[(&str, &str)]) -> Vec<RankProcess> {
    let exe = std::env::current_exe().expect("test binary path");
    (0..world)
        .map(|rank| {
            let mut cmd = Command::new(&exe);
            cmd.args(["--exact", entry, "--include-ignored", "--nocapture", "--test-threads=1", "-q"])
                .env(SCENARIO_ENV, scenario)
                .env("VAE_RANK", rank.to_string())
                .env("VAE_WORLD_SIZE", world.to_string())
                .env("VAE_MASTER_ADDR", master)
                .env("VAE_CONNECT_TIMEOUT_S", "60")
                .env("VAE_COLLECTIVE_TIMEOUT_S", "120")
                .env("RUST_BACKTRACE", "0")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            for (k, v) in env {
                cmd.env(k, v);
            }
            let mut child = cmd.spawn().expect("spawn a rank process");
            let stdout = child.stdout.take().expect("piped stdout");
            let (tx, lines) = mpsc::channel();
            let reader = std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            });
            RankProcess { child, lines, reader }
        })
        .collect()
}

/// Waits for every rank and returns how each ended.
pub fn wait_all(ranks: Vec<RankProcess>) -> Vec<RankExit> {
    ranks
        .into_iter()
        .map(|r| {
            let out = r.child.wait_with_output().expect("wait for a rank process");
            // Every line of stdout has been read once the reader sees end of file.
            let _ = r.reader.join();
            let mut text: Vec<String> = r.lines.try_iter().collect();
            text.push(String::from_utf8_lossy(&out.stderr).into_owned());
            RankExit { success: out.status.success(), output: text.join("\n") }
        })
        .collect()
}

/// Panics with every rank's output unless all ranks succeeded — having actually run the entry
/// test (a filter that matches nothing would also exit successfully).
pub fn assert_all_succeeded(what: &str, exits: &[RankExit]) {
    if exits.iter().any(|e| !e.success || !e.output.contains("1 passed")) {
        let text: Vec<String> =
            exits.iter().enumerate().map(|(r, e)| format!("--- rank {r} ---\n{}", e.output)).collect();
        panic!("{what} failed:\n{}", text.join("\n"));
    }
}

/// `cuda:0` when this machine (or the fake driver) can run ops on it; otherwise prints why
/// `test` is skipped and gives `None`.
#[allow(clippy::print_stderr, reason = "a test's skip reason goes to the test output")]
pub fn cuda(test: &str) -> Option<vae_tensor::Device> {
    use vae_tensor::Device;
    match vae_tensor::cuda::resolve_device(Device::Cuda(0)) {
        (Device::Cuda(n), None) => Some(Device::Cuda(n)),
        (_, why) => {
            eprintln!("{test}: skipped, {}", why.unwrap_or_default());
            None
        }
    }
}

/// The repository's `fixtures/` directory (`$VAE_FIXTURES_DIR` when set).
pub fn fixtures_dir() -> std::path::PathBuf {
    // A test binary carried to another machine (scripts/gpu-check.sh) names the checkout there.
    if let Some(dir) = std::env::var_os("VAE_FIXTURES_DIR") {
        return dir.into();
    }
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join("fixtures")
}

/// One ground-truth case of `fixtures/<family>/manifest.json`.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct FixtureCase {
    /// Case name.
    pub name: String,
    /// Model directory name.
    pub model: String,
    /// `decode`, `encode`, `decode_normalized` or `encode_normalized`.
    pub op: String,
    /// Whether diffusers' tiling was enabled.
    pub tiling: bool,
    /// `tile_sample_min_size` set on the model, if any.
    pub tile_sample_min_size: Option<usize>,
    /// `tile_overlap_factor` set on the model, if any.
    pub tile_overlap_factor: Option<f64>,
    /// Input `.npy`.
    pub input: String,
    /// Expected output `.npy`.
    pub output: String,
    /// `sample`, `moments`, `mean` or `latents`.
    pub output_kind: String,
}

/// The cases of one family's manifest.
pub fn fixture_cases(family: &str) -> Vec<FixtureCase> {
    let path = fixtures_dir().join(family).join("manifest.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A deterministic tensor uniform in [-2, 2) from `seed` (the same on every platform and in
/// every process).
pub fn random_tensor(dims: &[usize], seed: u64) -> vae_tensor::Tensor {
    vae_tensor::Tensor::seeded_uniform(dims.to_vec(), seed, -2.0, 2.0, &vae_tensor::Device::Cpu)
        .expect("a host tensor of any shape")
}

/// What our AutoencoderKL-family implementation gives for a fixture case, computed serially
/// (tiled when the case enables tiling), on whatever device `model` computes.
pub fn kl_case_output(
    model: &vae_models::autoencoder_kl::AutoencoderKl,
    case: &FixtureCase,
    input: &vae_tensor::Tensor,
) -> vae_tensor::Tensor {
    use vae_models::autoencoder_kl::{KlOperator, KlTask};
    use vae_runtime::execute_serial;
    let run = |task, x: &vae_tensor::Tensor| execute_serial(&KlOperator::new(model, task, case.tiling), x).unwrap();
    match (case.op.as_str(), case.output_kind.as_str()) {
        ("decode", _) => run(KlTask::Decode, input),
        ("decode_normalized", _) => run(KlTask::Decode, &model.denormalize_latents(input).unwrap()),
        (op @ ("encode" | "encode_normalized"), kind) => {
            let moments = run(KlTask::Encode, input);
            match (op, kind) {
                ("encode", "moments") => moments,
                ("encode", "mean") => moments.diag_gaussian_mean().unwrap(),
                ("encode_normalized", _) => model.normalize_latents(&moments.diag_gaussian_mean().unwrap()).unwrap(),
                other => panic!("unknown encode output {other:?}"),
            }
        }
        other => panic!("unknown op {other:?}"),
    }
}

/// Shard-runs `op` on `input` along `axis` over `world` local ranks (parallel size `world`,
/// output on the owner); returns the owner's output and every rank's report.
pub fn shard_on_local_ranks<O: vae_runtime::ShardOperator + Sync>(
    op: &O,
    input: &vae_tensor::Tensor,
    axis: vae_runtime::ShardAxis,
    world: usize,
) -> (vae_tensor::Tensor, Vec<vae_runtime::RankReport>) {
    on_local_ranks(world, |exec| {
        exec.run(
            input,
            vae_runtime::Job::bands(op, axis),
            vae_runtime::Output::Placed(vae_runtime::OutputPlacement::OwnerOnly),
        )
    })
}

/// [`shard_on_local_ranks`] over a 2-D `grid` of blocks ([`vae_runtime::Job::blocks`]).
pub fn blocks_on_local_ranks<O: vae_runtime::ShardOperator + Sync>(
    op: &O,
    input: &vae_tensor::Tensor,
    grid: [usize; 2],
    world: usize,
) -> (vae_tensor::Tensor, Vec<vae_runtime::RankReport>) {
    on_local_ranks(world, |exec| {
        exec.run(
            input,
            vae_runtime::Job::blocks(op, grid),
            vae_runtime::Output::Placed(vae_runtime::OutputPlacement::OwnerOnly),
        )
    })
}

/// Runs `request` on `world` local ranks with an executor of parallel size `world`; returns the
/// owner's output (checked to be the owner's alone) and every rank's report. Shard convolutions
/// overlap their exchanges wherever their part has an interior ([`HaloOverlap::Always`]): the
/// fixtures' parts are too small for the default rule to overlap a Winograd convolution, and
/// these tests check every piece's bits.
///
/// [`HaloOverlap::Always`]: vae_runtime::HaloOverlap::Always
fn on_local_ranks(
    world: usize,
    request: impl Fn(&vae_runtime::DistributedVaeExecutor) -> Result<vae_runtime::ExecOutput, vae_runtime::RuntimeError>
    + Sync,
) -> (vae_tensor::Tensor, Vec<vae_runtime::RankReport>) {
    let results = vae_transport::run_local(world, vae_transport::TransportConfig::default(), |comm| {
        let exec = vae_runtime::DistributedVaeExecutor::new(std::sync::Arc::new(comm), world)
            .unwrap()
            .with_halo_overlap(vae_runtime::HaloOverlap::Always);
        request(&exec).unwrap()
    })
    .unwrap();
    let mut outs: Vec<_> = results.into_iter().map(|r| r.unwrap()).collect();
    let tensor = outs[0].tensor.take().expect("rank 0 owns the output");
    assert!(outs[1..].iter().all(|o| o.tensor.is_none()), "owner-only placement");
    (tensor, outs.into_iter().map(|o| o.report).collect())
}

/// A frame sink that keeps nothing.
pub struct DiscardFrames;

impl vae_runtime::FrameSink for DiscardFrames {
    fn begin(&mut self, _: &[usize]) -> Result<(), vae_runtime::SinkError> {
        Ok(())
    }

    fn frames(&mut self, _: usize, _: vae_tensor::Tensor) -> Result<(), vae_runtime::SinkError> {
        Ok(())
    }
}

/// Asserts that a streamed request's tensor peak on every one of 2 local ranks grows by at most
/// 10 % from 2 to 16 latent frames, beyond the growth of the latent itself, which a rank holds
/// its part of (Wan2.1's 16 channels, `hw` latent pixels): `run` makes the
/// request on one rank, the owner's sink (`Some` on rank 0) keeping nothing, and returns that
/// rank's report.
pub fn assert_streamed_peaks_flat<F>(hw: [usize; 2], seed: u64, run: F)
where
    F: Fn(
            &vae_runtime::DistributedVaeExecutor,
            &vae_tensor::Tensor,
            Option<&mut dyn vae_runtime::FrameSink>,
        ) -> vae_runtime::RankReport
        + Sync,
{
    let peaks = |frames: usize| -> Vec<usize> {
        let z = random_tensor(&[1, 16, frames, hw[0], hw[1]], seed);
        let results = vae_transport::run_local(2, vae_transport::TransportConfig::default(), |comm| {
            let exec = vae_runtime::DistributedVaeExecutor::new(std::sync::Arc::new(comm), 2).unwrap();
            let mut sink = DiscardFrames;
            let sink = (exec.communicator().rank() == 0).then_some(&mut sink as &mut dyn vae_runtime::FrameSink);
            run(&exec, &z, sink).peak_bytes
        })
        .unwrap();
        results.into_iter().map(|r| r.unwrap()).collect()
    };
    let (short, long) = (peaks(2), peaks(16));
    let latent_growth = (16 - 2) * 16 * hw[0] * hw[1] * std::mem::size_of::<f32>();
    for (rank, (s, l)) in short.iter().zip(&long).enumerate() {
        assert!(
            *l as f64 <= 1.10 * *s as f64 + latent_growth as f64,
            "rank {rank}: peak {l} B for 16 latent frames, {s} B for 2 (the latent grows by {latent_growth} B)"
        );
    }
}

/// A fixture model as the CLI loads it without a cost profile: its requests follow the
/// family's rules.
pub fn load_vae(dir: &std::path::Path) -> vae_parallel::Vae {
    vae_parallel::Vae::builder(dir).cost_profile(vae_parallel::CostProfile::Off).build().unwrap()
}

/// A decode's options with the reference's (the CLI's) semantics: `mode`, and tiling on when
/// asked or when several ranks compute.
pub fn reference(mode: vae_runtime::ParallelMode) -> vae_parallel::Decode {
    vae_parallel::Decode::default().mode(mode).tiling(vae_parallel::Tiling::Reference { asked: false })
}

/// An encode's options with the reference's semantics, returning `output`.
pub fn reference_encode(mode: vae_runtime::ParallelMode, output: vae_parallel::EncodeOutput) -> vae_parallel::Encode {
    vae_parallel::Encode::default().mode(mode).tiling(vae_parallel::Tiling::Reference { asked: false }).output(output)
}
