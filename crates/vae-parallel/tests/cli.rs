//! The `vae-parallel` binary, as a user runs it.

mod support;

use std::process::Command;

use support::{cli, json_line};

#[test]
fn the_demo_decodes_a_photo_with_the_built_in_vae_and_is_bit_identical() {
    let out = temp_path("demo.png");
    let svg = temp_path("demo.svg");
    let (ok, text) = cli(&[
        "demo",
        "--ranks",
        "3",
        "--height",
        "160",
        "--width",
        "144",
        "--out",
        out.to_str().unwrap(),
        "--svg",
        svg.to_str().unwrap(),
    ]);
    assert!(ok, "{text}");
    assert!(
        text.contains("built-in trained VAE") && text.contains("[1, 3, 160, 144] -> latent [1, 4, 40, 36]"),
        "{text}"
    );
    for (decode, reference) in [
        ("tile", "tiled, 1 rank"),
        ("spatial_shard_height", "untiled, 1 rank"),
        ("spatial_shard_2d", "untiled, 1 rank"),
    ] {
        let line = text
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{decode} ")))
            .unwrap_or_else(|| panic!("{text}"));
        assert!(line.contains(&format!("{reference}: bit-identical")), "{line}");
    }
    assert!(text.contains("every 3-rank decode is bit-identical to its one-rank decode"), "{text}");
    // The photo and four decodes side by side, 4-pixel gaps between them.
    let png = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(&out).unwrap())).read_info().unwrap();
    assert_eq!((png.info().width, png.info().height), (5 * 144 + 4 * 4, 160));
    assert!(text.contains("4 tile(s)"), "the tile mode tiles: {text}");
    // The figure: a well-formed SVG with a piece per tile, band and block, and the timeline.
    let figure = std::fs::read_to_string(&svg).unwrap();
    let doc = roxmltree::Document::parse(&figure).expect("the figure is well-formed XML");
    let pieces = doc.descendants().filter(|n| n.has_tag_name("rect") && n.attribute("fill-opacity").is_some()).count();
    assert!(pieces >= 7, "{pieces} pieces: four tiles, three bands, three blocks");
    assert_eq!(doc.descendants().filter(|n| n.attribute("data-phase") == Some("exec")).count(), 3);
    let _ = (std::fs::remove_file(&out), std::fs::remove_file(&svg));
}

#[test]
fn the_synthetic_demo_runs_on_local_ranks_and_is_bit_identical() {
    let (ok, text) = cli(&["demo", "--operator", "synthetic", "--ranks", "4"]);
    assert!(ok, "{text}");
    assert!(text.contains("bit-identical to a single-rank run"), "{text}");
    assert!(text.contains("[1, 4, 480, 832]"), "{text}");
}

fn temp_path(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("vae-cli-{}-{name}", std::process::id()))
}

#[test]
fn the_demo_runs_on_rank_processes_with_broadcast() {
    let (ok, text) = cli(&[
        "demo",
        "--operator",
        "synthetic",
        "--transport",
        "socket",
        "--ranks",
        "3",
        "--broadcast",
        "--height",
        "30",
        "--width",
        "40",
    ]);
    assert!(ok, "{text}");
    assert!(text.contains("transport socket, 3 rank(s)"), "{text}");
    assert!(text.contains("bit-identical"), "{text}");
}

#[test]
fn the_demo_writes_its_report_as_json_and_as_a_plot() {
    let path = std::env::temp_dir().join(format!("vae-cli-report-{}.json", std::process::id()));
    let plot = path.with_extension("svg");
    let (ok, text) = cli(&[
        "demo",
        "--operator",
        "synthetic",
        "--ranks",
        "2",
        "--json",
        path.to_str().unwrap(),
        "--svg",
        plot.to_str().unwrap(),
    ]);
    assert!(ok, "{text}");
    let json = std::fs::read_to_string(&path).unwrap();
    let svg = std::fs::read_to_string(&plot).unwrap();
    let _ = (std::fs::remove_file(&path), std::fs::remove_file(&plot));
    assert!(json.contains("\"world_size\": 2") && json.contains("\"phase_ms\""), "{json}");
    let doc = roxmltree::Document::parse(&svg).expect("the plot is well-formed XML");
    let execs = doc.descendants().filter(|n| n.attribute("data-phase") == Some("exec")).count();
    assert_eq!(execs, 2, "an exec segment per rank: {svg}");
}

#[test]
fn bad_arguments_are_clear_errors() {
    let (ok, text) = cli(&["demo", "--ranks", "0"]);
    assert!(!ok);
    assert!(text.contains("--ranks must be at least 1"), "{text}");
    let (ok, text) = cli(&["demo", "--transport", "carrier-pigeon"]);
    assert!(!ok);
    assert!(text.contains("unknown transport"), "{text}");
    let (ok, text) = cli(&["demo", "--operator", "synthetic", "--stride", "0"]);
    assert!(!ok);
    assert!(text.contains("stride"), "{text}");
}

#[test]
fn failover_is_reported_by_every_surviving_rank() {
    let (ok, text) = cli(&["bench", "failover", "--ranks", "3", "--delay-ms", "20"]);
    assert!(ok, "{text}");
    assert_eq!(text.matches("death of rank 2 reported").count(), 2, "{text}");
}

#[test]
fn the_transport_bench_runs_over_sockets() {
    let (ok, text) =
        cli(&["bench", "transport", "--transport", "socket", "--ranks", "2", "--mib", "1", "--iters", "2"]);
    assert!(ok, "{text}");
    assert!(text.contains("all_gather") && text.contains("busbw"), "{text}");
}

/// Starts rank 1 and then rank 0 of a two-process synthetic demo made by `args`, and checks that
/// both succeed and rank 0 found the result bit-identical.
fn two_synthetic_demo_ranks(args: impl Fn(&str) -> Command) {
    let other = args("1").stdout(std::process::Stdio::null()).spawn().unwrap();
    let first = args("0").output().unwrap();
    let other = other.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&first.stdout);
    assert!(first.status.success() && other.status.success(), "{text}{}", String::from_utf8_lossy(&first.stderr));
    assert!(text.contains("transport socket, 2 rank(s)") && text.contains("bit-identical"), "{text}");
}

#[test]
fn ranks_can_be_started_by_hand_with_flags() {
    let master =
        format!("unix:{}", std::env::temp_dir().join(format!("vae-cli-{}.sock", std::process::id())).display());
    let exe = env!("CARGO_BIN_EXE_vae-parallel");
    let args = |rank: &str| {
        let mut cmd = Command::new(exe);
        cmd.args(["demo", "--operator", "synthetic", "--transport", "socket", "--ranks", "2", "--rank", rank]);
        cmd.args(["--master-addr", &master]);
        cmd.args(["--height", "20", "--width", "20"]).env("VAE_CONNECT_TIMEOUT_S", "30");
        cmd
    };
    two_synthetic_demo_ranks(args);
}

/// `torchrun --nproc-per-node 2 --no-python vae-parallel ... --transport socket` gives each
/// process `RANK`, `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT`: that is enough to join (the
/// group listens one port above torchrun's store).
#[test]
fn ranks_join_from_torchruns_environment() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let exe = env!("CARGO_BIN_EXE_vae-parallel");
    let args = |rank: &str| {
        let mut cmd = Command::new(exe);
        cmd.args(["demo", "--operator", "synthetic", "--transport", "socket", "--ranks", "2"]);
        cmd.args(["--height", "20", "--width", "20"]).env("VAE_CONNECT_TIMEOUT_S", "30");
        cmd.env_remove("VAE_RANK").env_remove("VAE_WORLD_SIZE").env_remove("VAE_MASTER_ADDR");
        cmd.envs([("RANK", rank), ("WORLD_SIZE", "2"), ("LOCAL_RANK", rank), ("MASTER_ADDR", "127.0.0.1")]);
        cmd.env("MASTER_PORT", (port - 1).to_string()).env("VAE_GROUP_SECRET", "cd".repeat(32));
        cmd
    };
    two_synthetic_demo_ranks(args);
}

#[test]
fn the_kernel_bench_rates_every_op_and_gives_no_peak_on_the_cpu() {
    let (ok, text) = cli(&["bench", "kernels", "--downscale", "8", "--iters", "1", "--json"]);
    assert!(ok, "{text}");
    let v = json_line(&text);
    assert_eq!(v["device"], "cpu");
    let ops = v["ops"].as_array().unwrap();
    // The decoders' ops at their shapes, and each memory-bound one again at a large shape.
    let names: Vec<&str> = ops.iter().map(|o| o["op"].as_str().unwrap()).collect();
    let base = [
        "conv3d 3x3x3 (cached)",
        "conv3d 3x3x3 96 ch",
        "conv2d",
        "attention",
        "rms_norm_channels",
        "silu",
        "add",
        "group_norm",
        "upsample",
        "permute",
        "conv3d 3x3x3 to RGB",
    ];
    for name in base {
        assert!(names.iter().any(|n| n.starts_with(name) && !n.ends_with("(large)")), "{name} missing: {v}");
    }
    for name in &base[4..10] {
        assert!(names.iter().any(|n| n.starts_with(name) && n.ends_with("(large)")), "{name} (large) missing: {v}");
    }
    // One row per case: the tile widths are timed separately on CUDA only.
    assert_eq!(ops.len(), 17, "{v}");
    assert!(names.iter().all(|n| !n.contains("px tiles")), "{v}");
    for op in ops {
        assert!(op["best_ms"].as_f64().unwrap() > 0.0, "{op}");
        assert!(op["achieved"].as_f64().unwrap() > 0.0, "{op}");
        assert!(op["peak"].is_null() && op["fraction_of_peak"].is_null(), "no published CPU peak: {op}");
    }
    // Convolutions and attention are rated in FLOP/s, the rest in bytes/s.
    let unit = |name: &str| ops.iter().find(|o| o["op"].as_str().unwrap().starts_with(name)).unwrap()["unit"].clone();
    assert_eq!(unit("conv2d"), "FLOP/s");
    assert_eq!(unit("attention"), "FLOP/s");
    assert_eq!(unit("group_norm"), "B/s");
    // bf16 on the CPU: convolutions with bf16 products where the CPU has AVX512-BF16, else
    // refused naming the feature (never run as f32).
    let (ok, text) = cli(&["bench", "kernels", "--dtype", "bf16", "--downscale", "8", "--iters", "1"]);
    if vae_parallel::tensor::CpuBf16Scope::supported() {
        assert!(ok && text.contains("in bf16"), "{text}");
    } else {
        assert!(!ok && text.contains("AVX512-BF16"), "{text}");
    }
    // So is a choice of tensor-core kernels (before anything is loaded), and a width we lack.
    let decode =
        |tiles: &str| cli(&["bench", "decode", "--model", "no-model", "--latent", "no.npy", "--conv-tiles", tiles]);
    for tiles in ["256", "wgmma", "cudnn", "fastest"] {
        let (ok, text) = decode(tiles);
        assert!(!ok && text.contains(&format!("--conv-tiles {tiles} needs a CUDA device")), "{text}");
    }
    for bad in ["64", "cuDNN", "ours"] {
        let (ok, text) = decode(bad);
        assert!(!ok && text.contains("is not auto, 128, 256, wgmma, cudnn or fastest"), "{text}");
    }
}

#[test]
fn bench_encode_and_decode_report_the_same_fields() {
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures");
    let kl = fixtures.join("autoencoder_kl");
    let (model, image, latent) =
        (kl.join("flux1_like"), kl.join("flux1_like.encode.in.npy"), kl.join("flux1_like.decode.in.npy"));
    let (model, image, latent) = (model.to_str().unwrap(), image.to_str().unwrap(), latent.to_str().unwrap());
    let common = ["--model", model, "--iters", "2", "--threads", "1", "--json"];
    let run = |task: &str, flag: &str, input: &str| {
        let (ok, text) = cli(&[&["bench", task, flag, input][..], &common[..]].concat());
        assert!(ok, "{text}");
        json_line(&text)
    };
    let encode = run("encode", "--input", image);
    assert_eq!(encode["kind"], "encode");
    assert_eq!(encode["input_shape"], serde_json::json!([2, 3, 40, 56]));
    assert_eq!(encode["output_shape"], serde_json::json!([2, 16, 10, 14]), "the mean, not the moments");
    assert_eq!((encode["size"].as_u64(), encode["dtype"].as_str()), (Some(56), Some("f32")));
    assert_eq!(encode["times_ms"].as_array().map(Vec::len), Some(2));
    let decode = run("decode", "--latent", latent);
    assert_eq!(decode["kind"], "decode");
    assert_eq!(decode["output_shape"], serde_json::json!([1, 3, 24, 36]));
    assert_eq!(decode["size"], 36);
    let keys = |v: &serde_json::Value| v.as_object().unwrap().keys().cloned().collect::<Vec<_>>();
    assert_eq!(keys(&encode), keys(&decode));
    for key in ["best_ms", "median_ms", "decode_rss_mib", "peak_rss_mib", "baseline_rss_mib", "peak_tensor_mib"] {
        assert!(encode[key].as_f64().is_some_and(|v| v >= 0.0), "{key}: {encode}");
    }
    // A video VAE's clip.
    let wan = fixtures.join("wan");
    let (model, clip) = (wan.join("wan21_like"), wan.join("wan21_like.encode_f5.in.npy"));
    let (ok, text) = cli(&[
        "bench",
        "encode",
        "--model",
        model.to_str().unwrap(),
        "--input",
        clip.to_str().unwrap(),
        "--iters",
        "1",
        "--json",
    ]);
    assert!(ok, "{text}");
    assert_eq!(json_line(&text)["output_shape"], serde_json::json!([1, 16, 2, 2, 3]));
    // A dtype the CPU does not compute in is refused, not run as f32 (bf16 needs AVX512-BF16).
    let (ok, text) = cli(&["bench", "encode", "--model", "no-model", "--input", "no.npy", "--dtype", "tf32"]);
    assert!(!ok && text.contains("error: --dtype tf32"), "{text}");
    // With the kernels capped below AVX-512 the refusal names why, on any machine.
    let out = Command::new(env!("CARGO_BIN_EXE_vae-parallel"))
        .args(["bench", "encode", "--model", "no-model", "--input", "no.npy", "--dtype", "bf16"])
        .env("VAE_CPU_ISA", "avx2")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && text.contains("--dtype bf16") && text.contains("AVX512-BF16"), "{text}");
    let (ok, text) = cli(&["bench", "encode", "--model", "no-model", "--input", "no.npy", "--dtype", "bf16"]);
    if vae_parallel::tensor::CpuBf16Scope::supported() {
        assert!(!ok && text.contains("no-model"), "refused for the missing model, not the dtype: {text}");
    } else {
        assert!(!ok && text.contains("error: --dtype bf16") && text.contains("AVX512-BF16"), "{text}");
    }
}

/// SIGTERM to the supervisor of a socket group stops every rank within 2 s; nothing is written
/// and the failure is said once.
#[test]
fn a_terminated_supervisor_takes_its_ranks_with_it() {
    let dir = std::env::temp_dir().join(format!("vae-cli-sigterm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("demo.png");
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_vae-parallel"))
        .args(["demo", "--transport", "socket", "--ranks", "2", "--height", "240", "--width", "240", "--out"])
        .arg(&out)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let supervisor = child.id();
    // Wait until both ranks run (the supervisor's children).
    let ranks = || -> Vec<String> {
        let text =
            std::fs::read_to_string(format!("/proc/{supervisor}/task/{supervisor}/children")).unwrap_or_default();
        text.split_whitespace().map(str::to_string).collect()
    };
    let started = std::time::Instant::now();
    while ranks().len() < 2 {
        assert!(started.elapsed().as_secs() < 30, "the ranks never started");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let pids = ranks();
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(std::process::Command::new("kill").args(["-TERM", &supervisor.to_string()]).status().unwrap().success());
    let hit = std::time::Instant::now();
    let output = child.wait_with_output().unwrap();
    assert!(!output.status.success());
    let alive = |pid: &String| {
        std::path::Path::new(&format!("/proc/{pid}")).exists()
            && !std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default().contains(") Z ")
    };
    while pids.iter().any(alive) {
        assert!(hit.elapsed().as_secs_f64() < 2.0, "a rank outlived its supervisor by 2 s");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(stderr.lines().filter(|l| l.starts_with("error:")).count(), 1, "{stderr}");
    assert!(stderr.contains("interrupted"), "{stderr}");
    assert!(!out.exists(), "an interrupted run wrote its output");
    std::fs::remove_dir_all(&dir).unwrap();
}
