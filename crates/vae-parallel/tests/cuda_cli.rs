//! The CLI's CUDA paths as a user runs them: `bench kernels` on the device (rates next to the
//! device's peak), a video decode with `--device cuda` in f32, tf32 and bf16 against the CPU,
//! `calibrate` and `plan --measure` on the device, rank 0's convolution choices followed by a
//! group of rank processes, and the same decode over NCCL with a rank process per GPU. Needs a
//! usable GPU (or the fake
//! driver of `cargo xtask gpu-emu`, whose NCCL run needs FAKE_CUDA_DEVICE_COUNT=2 at least);
//! elsewhere each test says why it is skipped.
#![allow(clippy::print_stderr)] // a skipped GPU test says so

mod support;

use std::path::Path;

use support::{WAN_FIXTURE_TILING, json_line, max_abs_diff, read_npy_f32, wan21_fixture};

use vae_parallel::planner::cost::{DeviceKind, DeviceProfile};
use vae_parallel::tensor::Device;
use vae_parallel::tensor::cuda::resolve_device;

fn gpu(test: &str) -> bool {
    match resolve_device(Device::Cuda(0)) {
        (Device::Cuda(_), None) => true,
        (_, why) => {
            eprintln!("{test}: skipped, {}", why.unwrap_or_default());
            false
        }
    }
}

/// Runs `vae-parallel`, which must succeed.
fn cli(args: &[&str]) -> String {
    let (ok, text) = support::cli(args);
    assert!(ok, "vae-parallel {args:?}:\n{text}");
    text
}

#[test]
fn the_kernel_bench_runs_on_the_device_and_reports_its_peaks() {
    if !gpu("bench kernels on CUDA") {
        return;
    }
    for dtype in ["f32", "bf16"] {
        let text = cli(&[
            "bench",
            "kernels",
            "--device",
            "cuda",
            "--dtype",
            dtype,
            "--downscale",
            "30",
            "--iters",
            "1",
            "--json",
        ]);
        let v = json_line(&text);
        assert_eq!((v["device"].as_str(), v["dtype"].as_str()), (Some("cuda:0"), Some(dtype)), "{v}");
        // Each tensor-core convolution again at both tile widths, next to the backend's choice.
        let names: Vec<&str> = v["ops"].as_array().unwrap().iter().map(|o| o["op"].as_str().unwrap()).collect();
        for conv in ["conv3d 3x3x3 (cached)", "conv3d 3x3x3 96 ch", "conv2d 3x3"] {
            for width in ["", " [128-px tiles]", " [256-px tiles]"] {
                assert!(names.contains(&format!("{conv}{width}").as_str()), "{conv}{width} missing: {v}");
            }
        }
        for op in v["ops"].as_array().unwrap() {
            assert!(op["achieved"].as_f64().unwrap() > 0.0, "{op}");
            assert!(op["peak"].as_f64().unwrap() > 0.0, "a known architecture has peaks: {op}");
        }
    }
}

#[test]
fn a_video_decode_with_device_cuda_matches_the_cpu() {
    if !gpu("decode --device cuda") {
        return;
    }
    let (model, latent) = wan21_fixture();
    let dir = std::env::temp_dir().join(format!("vae-cuda-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let decode = |out: &Path, extra: &[&str]| {
        let mut args = vec!["decode", "--model", model.to_str().unwrap(), "--latent", latent.to_str().unwrap()];
        args.extend(["--out", out.to_str().unwrap(), "--vae-patch-parallel-size", "2"]);
        args.extend_from_slice(extra);
        cli(&args);
        read_npy_f32(out)
    };
    let cpu = decode(&dir.join("cpu.npy"), &[]);
    // 2 local ranks, shard along the width: bands and halos on the device.
    let mode = ["--vae-parallel-mode", "spatial_shard_width"];
    // tf32: f32 with each convolution product from 10-bit-mantissa operands (2^-10 relative).
    for (dtype, tol) in [("f32", 1e-4f32), ("tf32", 5e-3), ("bf16", 0.1)] {
        let out = dir.join(format!("cuda_{dtype}.npy"));
        let got = decode(&out, &[&["--device", "cuda", "--dtype", dtype][..], &mode[..]].concat());
        let diff = max_abs_diff(&got, &cpu);
        eprintln!("decode --device cuda --dtype {dtype}: max |cuda - cpu| = {diff}");
        assert_eq!(got.len(), cpu.len());
        assert!(diff <= tol, "{dtype}: {diff} > {tol}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_shard_bench_runs_two_ranks_on_one_device() {
    if !gpu("bench shard on CUDA") {
        return;
    }
    let (model, latent) = wan21_fixture();
    let text = cli(&[
        "bench",
        "shard",
        "--model",
        model.to_str().unwrap(),
        "--latent",
        latent.to_str().unwrap(),
        "--mode",
        "spatial_shard_width",
        "--device",
        "cuda",
        "--json",
    ]);
    let v = json_line(&text);
    assert_eq!((v["device"].as_str(), v["dtype"].as_str()), (Some("cuda:0"), Some("f32")), "{v}");
    let runs = v["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 3, "{v}");
    // Two ranks on one GPU, each on a stream of its own, exchanging halos device to device:
    // the shard run is the direct decode's computation (as on the CPU).
    let shard = runs.iter().find(|r| r["run"] == "shard").unwrap();
    assert_eq!(shard["ranks"], 2, "{v}");
    assert!(shard["strategy"].as_str().unwrap().starts_with("shard"), "{v}");
    assert!(shard["max_abs_diff_vs_direct"].as_f64().unwrap() <= 1e-5, "{v}");
    assert!(runs.iter().all(|r| r["seconds"].as_f64().unwrap() > 0.0), "{v}");
}

#[test]
fn calibrate_measures_the_gpu_and_plan_predicts_and_measures_on_it() {
    if !gpu("calibrate on CUDA") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("vae-parallel-cuda-profile-{}", std::process::id()));
    let path = dir.join("gpu.toml");
    let profile = path.to_str().unwrap();
    cli(&["calibrate", "--device", "cuda", "--dtype", "bf16", "--quick", "--downscale", "16", "--out", profile]);
    let p: DeviceProfile = toml::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    p.validate().unwrap();
    assert_eq!((p.kind, p.dtype.as_str(), p.cores, p.threads), (DeviceKind::Cuda, "bf16", 1, 1), "{p:?}");
    assert!(p.device.starts_with("cuda: "), "{p:?}");
    // Every shape the image and video VAEs run (32), each with a rate and a call cost, no
    // times (those are the CPU's).
    assert_eq!(p.convs.len(), 32, "{p:?}");
    assert!(p.convs.iter().all(|c| c.gmacs > 0.0 && c.call_us >= 0.0 && c.times.is_empty()), "{p:?}");

    // The Wan fixture on two ranks sharing the GPU: every strategy predicted with the GPU's
    // constants and run on the GPU beside its prediction.
    let (model, _) = wan21_fixture();
    let text = cli(&[
        "plan",
        "--model",
        model.to_str().unwrap(),
        "--shape",
        "1,16,3,2,3",
        "--device",
        "cuda",
        "--dtype",
        "bf16",
        "--profile",
        profile,
        "--vae-patch-parallel-size",
        "2",
        "--measure",
        "--runs",
        "1",
    ]);
    assert!(text.contains("gpus      2 rank(s) sharing each GPU"), "{text}");
    assert!(!text.contains("note "), "the profile is the device's own: {text}");
    let rows: Vec<&str> = text.lines().filter(|l| l.starts_with("direct") || l.starts_with("shard")).collect();
    assert!(rows.iter().any(|l| l.starts_with("shard-")), "{text}");
    // Each row: predicted ms, peak, fits, then the measured ms, ratio, peak and ratio.
    for row in rows {
        assert_eq!(row.replace(" *", "").split_whitespace().count(), 10, "{row}\n{text}");
    }
    assert!(text.contains("auto would run: "), "{text}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_decode_over_nccl_with_a_rank_process_per_gpu_matches_the_cpu() {
    if !gpu("decode --transport nccl") {
        return;
    }
    if let Err(reason) = vae_parallel::transport::nccl_available() {
        eprintln!("decode --transport nccl: skipped, {reason}");
        return;
    }
    let gpus = vae_parallel::tensor::cuda::device_count();
    if gpus < 2 {
        // The one skip scripts/gpu-check.sh excuses on a GPU machine (NCCL puts one rank per
        // GPU); under `cargo xtask gpu-emu`, which gives this suite two devices, it fails.
        eprintln!("decode --transport nccl: skipped, it needs one GPU per rank and this machine has {gpus}");
        return;
    }
    let (model, latent) = wan21_fixture();
    let dir = std::env::temp_dir().join(format!("vae-cuda-cli-nccl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let decode = |out: &Path, extra: &[&str]| {
        let mut args = vec!["decode", "--model", model.to_str().unwrap(), "--latent", latent.to_str().unwrap()];
        args.extend(["--out", out.to_str().unwrap(), "--vae-patch-parallel-size", "2"]);
        args.extend(["--vae-parallel-mode", "spatial_shard_width"]);
        args.extend_from_slice(extra);
        let text = cli(&args);
        (read_npy_f32(out), text)
    };
    let (cpu, _) = decode(&dir.join("cpu.npy"), &[]);
    // Two rank processes, rank r on cuda:r, their halos and the gather over NCCL.
    let (nccl, text) = decode(&dir.join("nccl.npy"), &["--device", "cuda", "--transport", "nccl"]);
    assert!(text.contains("2 rank(s) (nccl transport)"), "{text}");
    let diff = max_abs_diff(&nccl, &cpu);
    eprintln!("decode --device cuda --transport nccl, 2 ranks: max |cuda - cpu| = {diff}");
    assert_eq!(nccl.len(), cpu.len());
    assert!(diff <= 1e-4, "{diff}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A group of processes convolves as its rank 0 chose. `calibrate --model` records a choice
/// per layer of the Wan fixture in the profile it writes; rank 0 loads that profile with every
/// choice set to cuDNN's algorithm 1, rank 1 is handed a table (`VAE_CUDA_CONV_CHOICES`) that
/// says ours for every layer, both under `VAE_CUDA_CONV=fastest`, as two rank processes placed
/// by the environment over sockets. Rank 0's decision is broadcast before the first
/// convolution: rank 1 takes its choices, and the tiled decode is bit-identical to one rank's
/// under rank 0's profile (which differs from one under ours: were rank 1 to follow its own
/// table, its tiles would differ). Needs cuDNN (under `cargo xtask gpu-emu` the fake).
#[test]
fn a_group_of_processes_convolves_as_rank_0_chose() {
    if !gpu("rank 0's convolution choices") {
        return;
    }
    if let Err(why) = vae_parallel::tensor::cuda::cudnn_version() {
        eprintln!("rank 0's convolution choices: skipped, {why}");
        return;
    }
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/wan/wan21_like");
    let latent = model.with_file_name("wan21_like.decode_tiled.in.npy");
    let dir = tempfile::tempdir().unwrap();
    let at = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    let m = model.to_str().unwrap();

    // The profile holds a choice for each layer the model's decode ran.
    let calibrated = at("calibrated.toml");
    let args = ["calibrate", "--device", "cuda", "--quick", "--downscale", "16", "--out", &calibrated];
    cli(&[&args[..], &["--model", m, "--shape", "1,16,2,3,5"]].concat());
    let mut p: DeviceProfile = toml::from_str(&std::fs::read_to_string(&calibrated).unwrap()).unwrap();
    assert!(p.conv_choices.len() >= 4, "{:?}", p.conv_choices);
    for line in &p.conv_choices {
        let fields: Vec<&str> = line.split('\t').collect();
        assert_eq!(fields.len(), 3, "{line:?}");
        assert_eq!(fields[1].split(' ').count(), 10, "{line:?}");
        assert!(fields[2] == "ours" || fields[2].starts_with("cudnn:"), "{line:?}");
    }
    let with = |choice: &str| -> Vec<String> {
        p.conv_choices.iter().map(|l| format!("{}\t{choice}", l.rsplit_once('\t').unwrap().0)).collect()
    };
    let ours = with("ours");
    p.conv_choices = with("cudnn:1");
    let n = p.conv_choices.len();
    let profile = at("cudnn.toml");
    std::fs::write(&profile, toml::to_string(&p).unwrap()).unwrap();
    let ours_file = at("ours.txt");
    std::fs::write(&ours_file, ours.iter().map(|l| format!("{l}\n")).collect::<String>()).unwrap();

    let tiled =
        [&["--device", "cuda", "--vae-parallel-mode", "tile", "--vae-use-tiling"][..], &WAN_FIXTURE_TILING].concat();
    let decode = [&["decode", "--model", m, "--latent", latent.to_str().unwrap()][..], &tiled].concat();
    let fastest = ("VAE_CUDA_CONV", "fastest");
    // One rank under rank 0's profile (its choices read from it), and one under ours.
    let one = at("one.npy");
    let (ok, text) = support::cli_with_env(
        &[&decode[..], &["--profile", &profile, "--out", &one, "--vae-patch-parallel-size", "1"]].concat(),
        &[fastest, ("RUST_LOG", "info")],
    );
    assert!(ok, "{text}");
    assert!(text.contains(&format!("{n} convolution choices read from the cost profile")), "{text}");
    let one_ours = at("one_ours.npy");
    let (ok, text) = support::cli_with_env(
        &[&decode[..], &["--out", &one_ours, "--vae-patch-parallel-size", "1"]].concat(),
        &[fastest, ("VAE_CUDA_CONV_CHOICES", &ours_file)],
    );
    assert!(ok, "{text}");
    let (one, one_ours) = (read_npy_f32(Path::new(&one)), read_npy_f32(Path::new(&one_ours)));
    assert_ne!(one, one_ours, "cuDNN's bits and ours must differ for this test to tell the ranks' choices apart");

    // Two rank processes placed by the environment, each with its own table.
    let master = format!("unix:{}", at("master.sock"));
    let group = [&decode[..], &["--transport", "socket", "--ranks", "2", "--vae-patch-parallel-size", "2"]].concat();
    let spawn = |rank: usize, extra: &[&str], env: &[(&str, &str)]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_vae-parallel"))
            .args(&group)
            .args(extra)
            .args(["--out", &at(&format!("rank{rank}.npy"))])
            .env("VAE_RANK", rank.to_string())
            .env("VAE_WORLD_SIZE", "2")
            .env("VAE_MASTER_ADDR", &master)
            .env("XDG_CONFIG_HOME", dir.path())
            .env("VAE_COST_PROBE", "0")
            .env("RUST_LOG", "info")
            .envs([fastest])
            .envs(env.iter().copied())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let rank1 = spawn(1, &[], &[("VAE_CUDA_CONV_CHOICES", &ours_file)]);
    let rank0 = spawn(0, &["--profile", &profile], &[]);
    let output = |child: std::process::Child| {
        let out = child.wait_with_output().unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        (out.status.success(), text)
    };
    let ((ok0, text0), (ok1, text1)) = (output(rank0), output(rank1));
    assert!(ok0 && ok1, "rank 0:\n{text0}\nrank 1:\n{text1}");
    let two = read_npy_f32(&dir.path().join("rank0.npy"));
    assert_eq!(two.len(), one.len());
    let differing = two.iter().zip(&one).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
    assert_eq!(differing, 0, "2 rank processes vs 1 rank under rank 0's choices: {differing} values differ");
    assert!(text1.contains(&format!("{n} convolution choices of rank 0 taken")), "{text1}");
}
