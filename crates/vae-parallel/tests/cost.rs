//! The cost model through the CLI: `plan` (and `--measure`), `calibrate`, `auto` under
//! `--max-memory-per-rank`, and the prediction in every report.

mod support;

use support::{cli, fixtures, max_abs_diff, read_npy_f32, s, scratch, wan21_fixture};

/// `plan` arguments for the SD-like fixture's tiled latent on `ranks` ranks.
fn plan_args<'a>(model: &'a str, ranks: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec!["plan", "--model", model, "--shape", "1,4,9,14", "--vae-patch-parallel-size", ranks];
    v.extend_from_slice(extra);
    v
}

#[test]
fn plan_prints_every_strategy_with_its_prediction_and_autos_choice() {
    let model = fixtures().join("sd_like");
    let (ok, text) = cli(&plan_args(s(&model), "2", &[]));
    assert!(ok, "{text}");
    for row in ["tile (", "shard-height", "shard-width", "shard-1x2"] {
        assert!(text.lines().any(|l| l.starts_with(row)), "no {row:?} row:\n{text}");
    }
    assert!(text.contains("auto would run: "), "{text}");
    assert_eq!(text.lines().filter(|l| l.ends_with(" yes") && l.contains(" *")).count(), 1, "{text}");

    // One rank: the direct pass, and tiles since the latent is larger than one.
    let (ok, text) = cli(&plan_args(s(&model), "1", &[]));
    assert!(ok && text.lines().any(|l| l.starts_with("direct")) && text.contains("tile ("), "{text}");

    // A cap nothing fits: the refusal names the smallest peak.
    let (ok, text) = cli(&plan_args(s(&model), "2", &["--max-memory-per-rank", "1K"]));
    assert!(ok && text.contains("auto would refuse: no strategy fits --max-memory-per-rank 1.0 KiB"), "{text}");
    assert!(!text.contains(" *"), "nothing is chosen: {text}");

    // Bad input.
    let (ok, text) = cli(&["plan", "--model", s(&model), "--shape", "1,4,x"]);
    assert!(!ok && text.contains("--shape"), "{text}");
    let (ok, text) = cli(&plan_args(s(&model), "2", &["--max-memory-per-rank", "lots"]));
    assert!(!ok && text.contains("--max-memory-per-rank") && !text.contains("panicked"), "{text}");
}

#[test]
fn plan_breakdown_shows_where_each_strategys_time_goes() {
    let model = fixtures().join("sd_like");
    let (ok, text) = cli(&plan_args(s(&model), "2", &["--breakdown"]));
    assert!(ok, "{text}");
    let header = text.lines().find(|l| l.starts_with("busiest rank, ms")).unwrap_or_else(|| panic!("{text}"));
    assert!(header.contains("tile (") && header.contains("shard-height"), "{header}");
    // The decoder's kinds of step, each with a figure per strategy; a shard also sends messages.
    let figures = |row: &str| -> Vec<f64> { row.split_whitespace().filter_map(|w| w.parse().ok()).collect() };
    let strategies = text.lines().filter(|l| l.starts_with("tile (") || l.starts_with("shard-")).count();
    for kind in ["conv 3x3 ", "norm", "element-wise", "attention", "messages"] {
        let row = text.lines().find(|l| l.starts_with(kind)).unwrap_or_else(|| panic!("no {kind:?} row:\n{text}"));
        let f = figures(row);
        assert!(f.len() == strategies && f.iter().all(|&v| v >= 0.0), "{row}\n{text}");
    }
    // The convolutions dominate a decoder's compute (the first column: tiles).
    let total = |prefix: &str| -> f64 {
        text.lines().filter(|l| l.starts_with(prefix)).map(|l| figures(l).first().copied().unwrap_or(0.0)).sum()
    };
    assert!(total("conv ") > total("norm") + total("element-wise"), "{text}");
}

#[test]
fn plan_measure_runs_every_strategy_beside_its_prediction() {
    let model = fixtures().join("sd_like");
    let (ok, text) = cli(&plan_args(s(&model), "2", &["--measure", "--runs", "1"]));
    assert!(ok, "{text}");
    assert!(text.contains("measured ms") && text.contains("measured peak"), "{text}");
    let rows: Vec<&str> = text.lines().filter(|l| l.starts_with("tile (") || l.starts_with("shard-")).collect();
    assert_eq!(rows.len(), 4, "{text}");
    for row in rows {
        // strategy, predicted ms, peak (2 words), fits, measured ms, ratio, peak (2 words), ratio.
        let fields: Vec<&str> = row.split_whitespace().collect();
        let ratio: f64 = fields[fields.len() - 1].parse().unwrap_or(0.0);
        assert!(ratio > 0.0, "{row}");
    }
}

#[test]
fn auto_under_a_memory_cap_runs_what_fits_or_refuses_cleanly() {
    let dir = scratch("cap");
    let model = fixtures().join("sd_like");
    let latent = fixtures().join("sd_like.decode_tiled.in.npy");
    let out = dir.join("out.npy");
    let report = dir.join("r.json");
    let decode = |extra: &[&str]| {
        let mut v = vec!["decode", "--model", s(&model), "--latent", s(&latent), "--out", s(&out)];
        v.extend(["--vae-patch-parallel-size", "2", "--report", s(&report)]);
        v.extend_from_slice(extra);
        cli(&v)
    };
    let (ok, text) = decode(&["--vae-parallel-mode", "auto", "--max-memory-per-rank", "1K"]);
    assert!(!ok && text.contains("no strategy fits --max-memory-per-rank 1.0 KiB"), "{text}");
    assert_eq!(text.lines().filter(|l| l.starts_with("error:")).count(), 1, "{text}");
    assert!(!out.exists() && !report.exists());

    let (ok, text) = decode(&["--vae-parallel-mode", "auto", "--max-memory-per-rank", "1G"]);
    assert!(ok && text.contains("the fastest predicted within 1.0 GiB"), "{text}");
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    assert!(json["predicted_ms"].as_f64().unwrap() > 0.0, "{json}");
    assert!(json["predicted_peak_bytes"].as_u64().unwrap() > 0, "{json}");
    // Whatever auto chose is exact: tiles give diffusers' tiled decode (a shard the untiled
    // one, which the shard tests check).
    if json["strategy"] == "tile" {
        let (g, e) = (read_npy_f32(&out), read_npy_f32(&fixtures().join("sd_like.decode_tiled.out.npy")));
        let diff = max_abs_diff(&g, &e);
        assert!(g.len() == e.len() && diff <= 1e-4, "{diff}");
    }

    // Any mode's report carries the prediction for what ran.
    std::fs::remove_file(&out).unwrap();
    let (ok, text) = decode(&["--vae-parallel-mode", "spatial_shard_height"]);
    assert!(ok, "{text}");
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    assert_eq!(json["strategy"], "shard-height");
    assert!(json["predicted_ms"].as_f64().unwrap() > 0.0 && json["predicted_peak_bytes"].as_u64().unwrap() > 0);

    // The Wan encoder has a cost model: auto runs the fastest predicted strategy that fits,
    // and the report carries its prediction.
    let (wan, _) = wan21_fixture();
    let video = wan.parent().unwrap().join("wan21_like.encode_f5.in.npy");
    let mut v = vec!["encode", "--model", s(&wan), "--input", s(&video), "--out", s(&out)];
    v.extend(["--vae-patch-parallel-size", "2", "--vae-parallel-mode", "auto", "--max-memory-per-rank", "1G"]);
    v.extend(["--report", s(&report)]);
    std::fs::remove_file(&out).ok();
    let (ok, text) = cli(&v);
    assert!(ok && text.contains("the fastest predicted within 1.0 GiB"), "{text}");
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    assert!(json["predicted_ms"].as_f64().unwrap() > 0.0, "{json}");
    let want = read_npy_f32(&wan.parent().unwrap().join("wan21_like.encode_f5_moments.out.npy"));
    assert_eq!(read_npy_f32(&out).len() * 2, want.len(), "the mean of the moments");

    // LTX has a cost model: its decode under a cap runs the fastest predicted strategy.
    let ltx = fixtures().join("../ltx/ltx2_like");
    let latent = fixtures().join("../ltx/ltx2_like.decode_t3.in.npy");
    let mut v = vec!["decode", "--model", s(&ltx), "--latent", s(&latent), "--out", s(&out)];
    v.extend(["--vae-patch-parallel-size", "2", "--vae-parallel-mode", "auto", "--max-memory-per-rank", "1G"]);
    std::fs::remove_file(&out).ok();
    let (ok, text) = cli(&v);
    assert!(ok && text.contains("the fastest predicted within 1.0 GiB"), "{text}");
    let (g, e) = (read_npy_f32(&out), read_npy_f32(&fixtures().join("../ltx/ltx2_like.decode_t3.out.npy")));
    let diff = max_abs_diff(&g, &e);
    assert!(g.len() == e.len() && diff <= 1e-4, "{diff}");

    // A request without a cost model (LTX-2's frames tiled in time) cannot honour a cap.
    let video = fixtures().join("../ltx/ltx2_like.encode_temporal.in.npy");
    let mut v = vec!["encode", "--model", s(&ltx), "--input", s(&video), "--out", s(&out)];
    v.extend(["--tile-sample-min-num-frames", "8", "--tile-sample-stride-num-frames", "4"]);
    v.extend(["--vae-patch-parallel-size", "2", "--vae-parallel-mode", "auto", "--max-memory-per-rank", "1G"]);
    std::fs::remove_file(&out).ok();
    let (ok, text) = cli(&v);
    assert!(!ok && text.contains("has no cost model"), "{text}");
    assert!(!out.exists());
}

#[test]
fn the_wan_decoder_has_a_cost_model_too() {
    let (wan, latent) = wan21_fixture();
    let mut args = vec!["plan", "--model", s(&wan), "--shape", "1,16,3,2,3", "--vae-patch-parallel-size", "2"];
    args.extend(["--measure", "--runs", "1"]);
    let (ok, text) = cli(&args);
    assert!(ok && text.contains("shard-width") && text.contains("auto would run"), "{text}");
    let dir = scratch("wan");
    let (out, report) = (dir.join("out.npy"), dir.join("r.json"));
    let mut v = vec!["decode", "--model", s(&wan), "--latent", s(&latent), "--out", s(&out), "--report", s(&report)];
    v.extend(["--vae-patch-parallel-size", "2", "--vae-parallel-mode", "auto", "--max-memory-per-rank", "1G"]);
    let (ok, text) = cli(&v);
    assert!(ok && text.contains("the fastest predicted"), "{text}");
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    assert!(json["predicted_peak_bytes"].as_u64().unwrap() > 0, "{json}");
}

/// Without `--profile`: the calibrated profile in the config directory, else this CPU's probed
/// constants (here a cache the test writes, so nothing is measured), else, with the probe off,
/// the built-in ones. `auto` follows the probed constants; a request in a named mode does not
/// wait for a probe.
#[test]
fn without_a_profile_the_calibrated_else_the_probed_else_the_builtin_constants_predict() {
    use vae_parallel::cost::probe::{self, ProbeKey};
    use vae_parallel::planner::cost::DeviceProfile;

    let config = scratch("probe-config");
    let dir = config.join("vae-parallel");
    let model = fixtures().join("sd_like");
    let env = |probe: &'static str| [("XDG_CONFIG_HOME", s(&config).to_string()), ("VAE_COST_PROBE", probe.into())];
    let run = |args: &[&str], probe: &'static str| {
        let env = env(probe);
        let pairs: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        support::cli_with_env(args, &pairs)
    };

    // The probe on, nothing cached: a named mode runs with the built-in constants' prediction
    // and measures nothing.
    let scratch_dir = scratch("probe-decode");
    let (out, report) = (scratch_dir.join("out.npy"), scratch_dir.join("r.json"));
    let latent = fixtures().join("sd_like.decode_tiled.in.npy");
    let mut decode = vec!["decode", "--model", s(&model), "--latent", s(&latent), "--out", s(&out)];
    decode.extend(["--vae-patch-parallel-size", "2", "--report", s(&report)]);
    let named = [decode.clone(), vec!["--vae-parallel-mode", "spatial_shard_height"]].concat();
    let (ok, text) = run(&named, "1");
    assert!(ok, "{text}");
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    assert!(json["predicted_ms"].as_f64().unwrap() > 0.0, "{json}");
    assert!(!dir.exists() || std::fs::read_dir(&dir).unwrap().next().is_none(), "a named mode probed");

    // This CPU's cached probe, whose messages cost an hour: `plan` and `auto` follow it (tiles,
    // where the built-in constants shard).
    let probed =
        DeviceProfile { link_latency_us: 3.6e9, source: "probed by the test".into(), ..DeviceProfile::builtin_cpu() };
    probe::write_cached(&dir, &ProbeKey::current(), &probed).unwrap();
    let plan = plan_args(s(&model), "2", &[]);
    let (ok, text) = run(&plan, "1");
    assert!(ok && text.contains("[probed by the test]") && text.contains("auto would run: tile"), "{text}");
    let auto = [decode.clone(), vec!["--vae-parallel-mode", "auto"]].concat();
    std::fs::remove_file(&out).unwrap();
    let (ok, text) = run(&auto, "1");
    assert!(ok, "{text}");
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    assert_eq!(json["strategy"], "tile", "{json}");

    // The probe off: the built-in constants, which shard.
    let (ok, text) = run(&plan, "0");
    assert!(ok && text.contains("built-in defaults") && text.contains("auto would run: shard"), "{text}");

    // A calibrated profile wins over the probe.
    let calibrated = DeviceProfile { source: "calibrated by the test".into(), ..DeviceProfile::builtin_cpu() };
    std::fs::write(dir.join("cpu-profile.toml"), toml::to_string_pretty(&calibrated).unwrap()).unwrap();
    let (ok, text) = run(&plan, "1");
    assert!(ok && text.contains("[calibrated by the test]"), "{text}");
}

#[test]
fn calibrate_writes_a_profile_that_plan_reads() {
    let dir = scratch("calibrate");
    let profile = dir.join("sub").join("cpu.toml");
    let (ok, text) = cli(&["calibrate", "--quick", "--threads", "1", "--out", s(&profile)]);
    assert!(ok && profile.is_file(), "{text}");
    let toml = std::fs::read_to_string(&profile).unwrap();
    assert!(toml.contains("[[convs]]") && toml.contains("link_gbps"), "{toml}");
    let model = fixtures().join("sd_like");
    let (ok, text) = cli(&plan_args(s(&model), "2", &["--profile", s(&profile)]));
    assert!(ok && text.contains("[vae-parallel calibrate"), "{text}");
    std::fs::write(&profile, "cores = \"two\"").unwrap();
    let (ok, text) = cli(&plan_args(s(&model), "2", &["--profile", s(&profile)]));
    assert!(!ok && text.contains("cpu.toml") && !text.contains("panicked"), "{text}");
}

/// Each rank's profile and threads are its own, so `auto` under the cost model could decide
/// differently per rank: rank 0 decides for the group. Here rank 1's profile makes every
/// message cost an hour, so alone it would tile; it runs rank 0's shard instead. A rank without
/// any cost model follows rank 0 as well.
#[test]
fn every_rank_runs_rank_zeros_choice_whatever_its_own_profile_says() {
    use std::sync::Arc;

    use vae_parallel::cost::CostSettings;
    use vae_parallel::planner::cost::{DeviceProfile, Placement};
    use vae_parallel::runtime::{DistributedVaeExecutor, ParallelMode};
    use vae_parallel::transport::{Communicator, TransportConfig, run_local};
    use vae_parallel::{CostProfile, Decode, Tiling, Vae};

    let model = fixtures().join("sd_like");
    let latent = vae_parallel::io::read_tensor(fixtures().join("sd_like.decode_tiled.in.npy")).unwrap();
    let placement = Placement { threads_per_rank: 1.0, ranks_per_host: 2, threads_alone: 2.0 };
    let slow_links = DeviceProfile { link_latency_us: 3.6e9, ..DeviceProfile::builtin_cpu() };
    let engines: Vec<Vae> = [DeviceProfile::builtin_cpu(), slow_links]
        .into_iter()
        .map(|profile| Vae::builder(&model).cost_profile(CostProfile::Given(profile)).build().unwrap())
        .collect();
    // The reference's semantics: tiles or a shard on two ranks.
    let tiling = Tiling::Reference { asked: false };
    let options = Decode::default().mode(ParallelMode::Auto).tiling(tiling);
    // Alone, each would choose differently.
    let alone: Vec<String> = engines
        .iter()
        .map(|e| {
            let all = vae_parallel::cost::candidates(
                e.model(),
                vae_parallel::models::Direction::Decode,
                latent.dims(),
                2,
                tiling,
                &CostSettings { profile: e.cost_profile().unwrap().clone(), placement },
            )
            .unwrap();
            vae_parallel::cost::choose(&all, None, 2).unwrap().label.clone()
        })
        .collect();
    assert!(alone[0].starts_with("shard") && alone[1].starts_with("tile"), "{alone:?}");
    let results = run_local(2, TransportConfig::default(), |comm| {
        let rank = comm.rank();
        let exec = DistributedVaeExecutor::new(Arc::new(comm), 2).unwrap();
        engines[rank].decode_on(&exec, &latent, &options).unwrap().report.strategy.label()
    })
    .unwrap();
    let ran: Vec<String> = results.into_iter().map(Result::unwrap).collect();
    assert_eq!(ran, vec![alone[0].clone(), alone[0].clone()]);

    // A rank with no cost model at all (no profile for its device) follows rank 0 too, and
    // rank 0 without one makes the group follow the family's rules; never a hang.
    let bare = Vae::builder(&model).cost_profile(CostProfile::Off).build().unwrap();
    let run = |pair: [&Vae; 2]| -> Vec<String> {
        let results = run_local(2, TransportConfig::default(), |comm| {
            let rank = comm.rank();
            let exec = DistributedVaeExecutor::new(Arc::new(comm), 2).unwrap();
            pair[rank].decode_on(&exec, &latent, &options).unwrap().report.strategy.label()
        });
        results.unwrap().into_iter().map(Result::unwrap).collect()
    };
    let family = run([&bare, &bare]);
    assert_eq!(family[0], family[1]);
    assert_eq!(run([&engines[0], &bare]), vec![alone[0].clone(), alone[0].clone()]);
    assert_eq!(run([&bare, &engines[1]]), family);
}

/// A GPU profile predicts for its GPU wherever `plan` runs: ranks share the GPU rather than
/// cores, maps take the profile's element type (bf16: half the f32 peak), and the table says
/// the request itself would run elsewhere. `calibrate` measures the CPU in f32 only, and a GPU
/// only where there is one.
#[test]
fn a_gpu_profile_predicts_for_the_gpu_wherever_plan_runs() {
    use vae_parallel::cost::CostSettings;
    use vae_parallel::models::Direction;
    use vae_parallel::planner::cost::{DeviceKind, DeviceProfile, Placement};
    use vae_parallel::{CostProfile, Tiling, Vae};

    let gpu = |dtype: &str| DeviceProfile {
        device: "cuda: test".into(),
        kind: DeviceKind::Cuda,
        dtype: dtype.into(),
        cores: 1,
        threads: 1,
        thread_efficiency: 1.0,
        conv_scratch_bytes: 0,
        conv_choices: Vec::new(),
        ..DeviceProfile::builtin_cpu()
    };
    let (model, latent) = wan21_fixture();
    let dims = vae_parallel::io::read_tensor(&latent).unwrap().dims().to_vec();
    let engine = Vae::builder(&model).cost_profile(CostProfile::Off).build().unwrap();
    let placement = Placement { threads_per_rank: 0.5, ranks_per_host: 2, threads_alone: 1.0 };
    let peak = |profile: DeviceProfile| {
        let settings = CostSettings { profile, placement };
        let all = vae_parallel::cost::candidates(
            engine.model(),
            Direction::Decode,
            &dims,
            2,
            Tiling::Reference { asked: false },
            &settings,
        )
        .unwrap();
        all.iter().find(|c| c.label.starts_with("shard-")).unwrap().prediction.peak_bytes as f64
    };
    let ratio = peak(gpu("bf16")) / peak(gpu("f32"));
    assert!((ratio - 0.5).abs() < 0.05, "bf16 maps are half of f32's: {ratio}");

    let dir = scratch("gpu-profile");
    let path = dir.join("gpu.toml");
    std::fs::write(&path, toml::to_string(&gpu("bf16")).unwrap()).unwrap();
    let (ok, text) = cli(&[
        "plan",
        "--model",
        s(&model),
        "--shape",
        &dims.iter().map(ToString::to_string).collect::<Vec<_>>().join(","),
        "--vae-patch-parallel-size",
        "2",
        "--profile",
        s(&path),
    ]);
    assert!(ok && text.contains("gpus      2 rank(s) sharing each GPU"), "{text}");
    assert!(text.contains("note      the profile describes a GPU, the request runs on cpu"), "{text}");

    let (ok, text) = cli(&["calibrate", "--dtype", "bf16", "--out", s(&dir.join("x.toml"))]);
    assert!(!ok && text.contains("calibrate measures the CPU in f32") && !dir.join("x.toml").exists(), "{text}");
    // A GPU asked for and not usable: an error, not the CPU measured in its place.
    use vae_parallel::tensor::{Device, cuda::resolve_device};
    if resolve_device(Device::Cuda(0)).1.is_some() {
        let (ok, text) = cli(&["calibrate", "--device", "cuda", "--quick", "--out", s(&dir.join("y.toml"))]);
        assert!(!ok && text.contains("nothing calibrated") && !dir.join("y.toml").exists(), "{text}");
    }
}
