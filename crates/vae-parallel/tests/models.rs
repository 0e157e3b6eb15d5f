//! `decode`, `encode` and `inspect` on the diffusers fixtures through the CLI, for every family
//! and strategy: the outputs against diffusers' and against each other. Bad input is
//! `refusals.rs`.

mod support;

use std::path::Path;

use support::{
    WAN_FIXTURE_TILING, assert_clean_failure, cli, decode_on, fixtures, max_abs_diff, read_npy_f32, s, scratch,
};

/// The CLI's tiled decode of the SD-like fixture on two local ranks into `out`.
fn tiled_decode_on_two_ranks(out: &Path, extra: &[&str]) -> (bool, String) {
    let f = fixtures();
    let (model, latent) = (f.join("sd_like"), f.join("sd_like.decode_tiled.in.npy"));
    let mut args = vec!["decode", "--model", s(&model), "--latent", s(&latent), "--out", s(out)];
    args.extend(["--vae-patch-parallel-size", "2", "--vae-use-tiling"]);
    args.extend(extra);
    cli(&args)
}

#[test]
fn decode_matches_diffusers_through_the_cli_on_two_ranks() {
    let dir = scratch("decode");
    let out = dir.join("out.npy");
    let f = fixtures();
    let (ok, text) = tiled_decode_on_two_ranks(&out, &[]);
    assert!(ok, "{text}");
    let got = read_npy_f32(&out);
    let expected = read_npy_f32(&f.join("sd_like.decode_tiled.out.npy"));
    assert_eq!(got.len(), expected.len());
    let diff = max_abs_diff(&got, &expected);
    assert!(diff <= 1e-4, "max diff {diff}");
    // PNG output: one file.
    let png = dir.join("out.png");
    let (ok, text) = cli(&[
        "decode",
        "--model",
        s(&f.join("sd_like")),
        "--latent",
        s(&f.join("sd_like.decode.in.npy")),
        "--out",
        s(&png),
    ]);
    assert!(ok && png.is_file(), "{text}");
}

/// `--dtype bf16` on a CPU with AVX512-BF16: the same decode on two ranks, with bf16 products,
/// close to diffusers' f32 output (elsewhere the refusal is checked below).
#[test]
fn cpu_bf16_decode_runs_with_bf16_products() {
    if !vae_parallel::tensor::CpuBf16Scope::supported() {
        return;
    }
    let dir = scratch("decode-bf16");
    let out = dir.join("out.npy");
    let f = fixtures();
    let (ok, text) = tiled_decode_on_two_ranks(&out, &["--dtype", "bf16"]);
    assert!(ok, "{text}");
    let got = read_npy_f32(&out);
    let expected = read_npy_f32(&f.join("sd_like.decode_tiled.out.npy"));
    let diff = max_abs_diff(&got, &expected);
    // torch 2.15 in bf16 on the CPU reaches 0.0615 on this model (tests/tests/cpu_bf16.rs).
    assert!(diff > 0.0 && diff <= 0.0615, "bf16 products, not f32 and not worse than torch bf16: max diff {diff}");
}

#[test]
fn encode_and_inspect_work() {
    let dir = scratch("encode");
    let out = dir.join("mean.npy");
    let f = fixtures();
    let (ok, text) = cli(&[
        "encode",
        "--model",
        s(&f.join("flux1_like")),
        "--input",
        s(&f.join("flux1_like.encode_tiled.in.npy")),
        "--out",
        s(&out),
        "--output",
        "moments",
        "--vae-patch-parallel-size",
        "2",
        "--transport",
        "socket",
    ]);
    assert!(ok, "{text}");
    let got = read_npy_f32(&out);
    // Two ranks force tiling on, as the reference does: the tiled fixture is the truth.
    let expected = read_npy_f32(&f.join("flux1_like.encode_tiled_moments.out.npy"));
    let diff = max_abs_diff(&got, &expected);
    assert!(got.len() == expected.len() && diff <= 1e-4, "max diff {diff}");
    let (ok, text) = cli(&["inspect", "--model", s(&f.join("flux2_like"))]);
    assert!(ok && text.contains("AutoencoderKLFlux2") && text.contains("modes       tile, auto"), "{text}");
}

#[test]
fn a_toml_config_is_read_and_flags_win() {
    let dir = scratch("toml");
    let config = dir.join("run.toml");
    std::fs::write(&config, "vae_patch_parallel_size = 3\nvae_parallel_mode = \"spatial_shard_width\"\n").unwrap();
    let f = fixtures();
    let args = |mode: Option<&str>| {
        let mut v = vec![
            "decode".to_string(),
            "--model".into(),
            s(&f.join("sd_like")).into(),
            "--latent".into(),
            s(&f.join("sd_like.decode.in.npy")).into(),
            "--out".into(),
            s(&dir.join("o.npy")).into(),
            "--config".into(),
            s(&config).into(),
        ];
        if let Some(m) = mode {
            v.extend(["--vae-parallel-mode".into(), m.into()]);
        }
        v
    };
    let from_file = args(None);
    let (ok, text) = cli(&from_file.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(ok && text.contains("shard-width (mode spatial_shard_width"), "the file's mode applies: {text}");
    let overridden = args(Some("tile"));
    let (ok, text) = cli(&overridden.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(
        ok && text.contains("3 rank(s)") && !text.contains("shard-width"),
        "the flag wins, the file's size stays: {text}"
    );
}

#[test]
fn video_vaes_decode_and_encode_through_the_cli() {
    let wan = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/wan");
    let dir = scratch("video");
    let close = |got: &Path, expected: &Path| {
        let (g, e) = (read_npy_f32(got), read_npy_f32(expected));
        assert_eq!(g.len(), e.len(), "{}", got.display());
        max_abs_diff(&g, &e)
    };
    // Tiled decode on 3 ranks with diffusers' enable_tiling(16, 24, 8, 16).
    let out = dir.join("tiled.npy");
    let (model, latent) = (wan.join("wan21_like"), wan.join("wan21_like.decode_tiled.in.npy"));
    let args = ["decode", "--model", s(&model), "--latent", s(&latent)];
    let (ok, text) =
        cli(&[&args[..], &WAN_FIXTURE_TILING, &["--out", s(&out), "--vae-patch-parallel-size", "3"]].concat());
    assert!(ok, "{text}");
    assert!(close(&out, &wan.join("wan21_like.decode_tiled.out.npy")) <= 1e-4);

    // Pipeline latents: undone with latents_mean / latents_std as WanPipeline does.
    let out = dir.join("normalized.npy");
    let (ok, text) = cli(&[
        "decode",
        "--model",
        s(&wan.join("wan21_like")),
        "--latent",
        s(&wan.join("wan21_like.decode_normalized.in.npy")),
        "--out",
        s(&out),
        "--latents-normalized",
    ]);
    assert!(ok, "{text}");
    assert!(close(&out, &wan.join("wan21_like.decode_normalized.out.npy")) <= 1e-4);

    // One PNG per frame: 3 latent frames decode to 9.
    let png = dir.join("frames.png");
    let (ok, text) = cli(&[
        "decode",
        "--model",
        s(&wan.join("wan21_like")),
        "--latent",
        s(&wan.join("wan21_like.decode_t3.in.npy")),
        "--out",
        s(&png),
    ]);
    assert!(ok, "{text}");
    let frames = std::fs::read_dir(&dir)
        .unwrap()
        .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().starts_with("frames_"))
        .count();
    assert_eq!(frames, 9, "{text}");

    // Encode (moments) on 2 ranks.
    let out = dir.join("moments.npy");
    let (ok, text) = cli(&[
        "encode",
        "--model",
        s(&wan.join("wan21_like")),
        "--input",
        s(&wan.join("wan21_like.encode_f5.in.npy")),
        "--out",
        s(&out),
        "--output",
        "moments",
        "--vae-patch-parallel-size",
        "2",
    ]);
    assert!(ok, "{text}");
    assert!(close(&out, &wan.join("wan21_like.encode_f5_moments.out.npy")) <= 1e-4);

    // Wan2.2 decodes and encodes (its encoder patchifies the RGB video first).
    let (ok, text) = cli(&[
        "decode",
        "--model",
        s(&wan.join("wan22_like")),
        "--latent",
        s(&wan.join("wan22_like.decode_t2.in.npy")),
        "--out",
        s(&dir.join("w22.npy")),
    ]);
    assert!(ok, "{text}");
    assert!(close(&dir.join("w22.npy"), &wan.join("wan22_like.decode_t2.out.npy")) <= 1e-4);
    let (ok, text) = cli(&[
        "encode",
        "--model",
        s(&wan.join("wan22_like")),
        "--input",
        s(&wan.join("wan22_like.encode_f1.in.npy")),
        "--out",
        s(&dir.join("w22m.npy")),
        "--output",
        "moments",
    ]);
    assert!(ok, "{text}");
    assert!(close(&dir.join("w22m.npy"), &wan.join("wan22_like.encode_f1_moments.out.npy")) <= 1e-4);
}

#[test]
fn hunyuan_video15_decodes_and_encodes_through_the_cli() {
    let hv = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/hunyuan_video15");
    let model = hv.join("hunyuan_video15_like");
    let dir = scratch("hunyuan");
    let close = |got: &Path, expected: &str| {
        let (g, e) = (read_npy_f32(got), read_npy_f32(&hv.join(expected)));
        assert_eq!(g.len(), e.len(), "{}", got.display());
        max_abs_diff(&g, &e)
    };
    let tiling = [
        "--tile-sample-min-height",
        "32",
        "--tile-sample-min-width",
        "32",
        "--tile-latent-min-height",
        "4",
        "--tile-latent-min-width",
        "4",
        "--tile-overlap-factor",
        "0.25",
    ];
    // Tiled decode: one process, then two socket processes (the same bytes).
    let latent = hv.join("hunyuan_video15_like.decode_tiled.in.npy");
    let one = dir.join("one.npy");
    let base = ["decode", "--model", s(&model), "--latent", s(&latent), "--vae-use-tiling"];
    let (ok, text) = cli(&[&base[..], &tiling, &["--out", s(&one)]].concat());
    assert!(ok, "{text}");
    assert!(close(&one, "hunyuan_video15_like.decode_tiled.out.npy") <= 1e-4);
    let two = dir.join("two.npy");
    let socket = ["--vae-patch-parallel-size", "2", "--transport", "socket", "--out", s(&two)];
    let (ok, text) = cli(&[&base[..], &tiling, &socket].concat());
    assert!(ok, "{text}");
    assert!(std::fs::read(&one).unwrap() == std::fs::read(&two).unwrap(), "2 socket processes differ from 1");
    // Tiled encode (moments) on 3 local ranks.
    let moments = dir.join("moments.npy");
    let input = hv.join("hunyuan_video15_like.encode_tiled_f1.in.npy");
    let encode = ["encode", "--model", s(&model), "--input", s(&input), "--output", "moments", "--out", s(&moments)];
    let (ok, text) = cli(&[&encode[..], &tiling, &["--vae-patch-parallel-size", "3"]].concat());
    assert!(ok, "{text}");
    assert!(close(&moments, "hunyuan_video15_like.encode_tiled_f1_moments.out.npy") <= 1e-4);
    // Pipeline latents: z / scaling_factor.
    let out = dir.join("normalized.npy");
    let latent = hv.join("hunyuan_video15_like.decode_normalized.in.npy");
    let (ok, text) =
        cli(&["decode", "--model", s(&model), "--latent", s(&latent), "--out", s(&out), "--latents-normalized"]);
    assert!(ok, "{text}");
    assert!(close(&out, "hunyuan_video15_like.decode_normalized.out.npy") <= 1e-4);
    // The shard over 2 socket processes writes the plain decode's bytes.
    let plain = dir.join("plain.npy");
    let (ok, text) = cli(&["decode", "--model", s(&model), "--latent", s(&latent), "--out", s(&plain)]);
    assert!(ok, "{text}");
    let shard = dir.join("shard.npy");
    let mut args = vec!["decode", "--model", s(&model), "--latent", s(&latent), "--out", s(&shard)];
    args.extend([
        "--vae-patch-parallel-size",
        "2",
        "--transport",
        "socket",
        "--vae-parallel-mode",
        "spatial_shard_width",
    ]);
    let (ok, text) = cli(&args);
    assert!(ok, "{text}");
    assert!(
        std::fs::read(&plain).unwrap() == std::fs::read(&shard).unwrap(),
        "the shard differs from the plain decode"
    );
    // inspect names the class, its modes and its tiling flags; the pipeline is a clean error.
    let (ok, text) = cli(&["inspect", "--model", s(&model)]);
    let modes = "modes       tile, auto, spatial_shard_height, spatial_shard_width, spatial_shard_2d\n";
    assert!(ok && text.contains("AutoencoderKLHunyuanVideo15") && text.contains(modes), "{text}");
    assert!(text.contains("--tile-latent-min-height, --tile-latent-min-width, --tile-overlap-factor"), "{text}");
    let piped = dir.join("piped.npy");
    let mut args = vec!["decode", "--model", s(&model), "--latent", s(&latent), "--out", s(&piped)];
    args.extend(["--vae-patch-parallel-size", "2", "--vae-parallel-mode", "pipeline"]);
    assert_clean_failure("hunyuan pipeline", &args, "cannot decode as a pipeline");
    assert!(!piped.exists());
}

#[test]
fn ltx_decodes_and_encodes_through_the_cli() {
    let ltx = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/ltx");
    let (video, ltx2) = (ltx.join("ltx_video_like"), ltx.join("ltx2_like"));
    let dir = scratch("ltx");
    let close = |got: &Path, expected: &str| {
        let (g, e) = (read_npy_f32(got), read_npy_f32(&ltx.join(expected)));
        assert_eq!(g.len(), e.len(), "{}", got.display());
        max_abs_diff(&g, &e)
    };
    // Spatio-temporal tiled decode of the timestep-conditioned LTX-Video decoder: one process,
    // then two socket processes (the same bytes).
    let tiling = [
        "--tile-sample-min-height",
        "16",
        "--tile-sample-min-width",
        "16",
        "--tile-sample-stride-height",
        "8",
        "--tile-sample-stride-width",
        "8",
        "--tile-sample-min-num-frames",
        "8",
        "--tile-sample-stride-num-frames",
        "4",
        "--decode-timestep",
        "0.05",
    ];
    let latent = ltx.join("ltx_video_like.decode_spatiotemporal.in.npy");
    let one = dir.join("one.npy");
    let base = ["decode", "--model", s(&video), "--latent", s(&latent), "--vae-use-tiling"];
    let (ok, text) = cli(&[&base[..], &tiling, &["--out", s(&one)]].concat());
    assert!(ok, "{text}");
    assert!(close(&one, "ltx_video_like.decode_spatiotemporal.out.npy") <= 1e-4);
    let two = dir.join("two.npy");
    let socket = ["--vae-patch-parallel-size", "2", "--transport", "socket", "--out", s(&two)];
    let (ok, text) = cli(&[&base[..], &tiling, &socket].concat());
    assert!(ok, "{text}");
    assert!(std::fs::read(&one).unwrap() == std::fs::read(&two).unwrap(), "2 socket processes differ from 1");
    // Temporally tiled encode (moments) on 3 local ranks.
    let moments = dir.join("moments.npy");
    let input = ltx.join("ltx2_like.encode_temporal.in.npy");
    let encode = ["encode", "--model", s(&ltx2), "--input", s(&input), "--output", "moments", "--out", s(&moments)];
    let frames = ["--tile-sample-min-num-frames", "8", "--tile-sample-stride-num-frames", "4"];
    let (ok, text) = cli(&[&encode[..], &frames, &["--vae-patch-parallel-size", "3"]].concat());
    assert!(ok, "{text}");
    assert!(close(&moments, "ltx2_like.encode_temporal_moments.out.npy") <= 1e-4);
    // Pipeline latents: z · std / scaling_factor + mean, the statistics from the checkpoint.
    let out = dir.join("normalized.npy");
    let latent = ltx.join("ltx2_like.decode_normalized.in.npy");
    let (ok, text) =
        cli(&["decode", "--model", s(&ltx2), "--latent", s(&latent), "--out", s(&out), "--latents-normalized"]);
    assert!(ok, "{text}");
    assert!(close(&out, "ltx2_like.decode_normalized.out.npy") <= 1e-4);
    // The reflect-padded shard over 2 socket processes writes the plain decode's bytes.
    let latent = ltx.join("ltx2_like.decode_tiled.in.npy");
    let plain = dir.join("plain.npy");
    let (ok, text) = cli(&["decode", "--model", s(&ltx2), "--latent", s(&latent), "--out", s(&plain)]);
    assert!(ok, "{text}");
    let shard = dir.join("shard.npy");
    let mut args = vec!["decode", "--model", s(&ltx2), "--latent", s(&latent), "--out", s(&shard)];
    args.extend([
        "--vae-patch-parallel-size",
        "2",
        "--transport",
        "socket",
        "--vae-parallel-mode",
        "spatial_shard_height",
    ]);
    let (ok, text) = cli(&args);
    assert!(ok, "{text}");
    assert!(
        std::fs::read(&plain).unwrap() == std::fs::read(&shard).unwrap(),
        "the shard differs from the plain decode"
    );
    // inspect names the class and its tiling flags; a timestep for LTX-2 and the pipeline mode
    // are clean errors.
    let (ok, text) = cli(&["inspect", "--model", s(&video)]);
    assert!(ok && text.contains("AutoencoderKLLTXVideo") && text.contains("timestep-conditioned"), "{text}");
    assert!(text.contains("--tile-sample-min-num-frames"), "{text}");
    let bad = dir.join("bad.npy");
    let args = ["decode", "--model", s(&ltx2), "--latent", s(&latent), "--out", s(&bad), "--decode-timestep", "0.05"];
    assert_clean_failure("ltx2 timestep", &args, "not timestep-conditioned");
    let mut args = vec!["decode", "--model", s(&ltx2), "--latent", s(&latent), "--out", s(&bad)];
    args.extend(["--vae-patch-parallel-size", "2", "--vae-parallel-mode", "pipeline"]);
    assert_clean_failure("ltx pipeline", &args, "cannot decode as a pipeline");
    assert!(!bad.exists());
}

#[test]
fn shard_decode_through_the_cli_matches_diffusers_and_reports_its_strategy() {
    let wan = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/wan");
    let dir = scratch("shard");
    let out = dir.join("shard.npy");
    let report = dir.join("report.json");
    let (model, latent) = (wan.join("wan21_like"), wan.join("wan21_like.decode_t3.in.npy"));
    // The plain 3-frame fixture (latent 2x3), width-sharded over 3 ranks: one column each.
    let mode = ["--vae-parallel-mode", "spatial_shard_width", "--report", s(&report)];
    let (ok, text) = cli(&decode_on("3", s(&model), s(&latent), s(&out), &mode));
    assert!(ok, "{text}");
    assert!(text.contains("shard-width (mode spatial_shard_width: spatial_shard_width requested)"), "{text}");
    assert!(text.contains("cols 0..1") && text.contains("cols 2..3"), "bands of a width shard are columns: {text}");
    let (g, e) = (read_npy_f32(&out), read_npy_f32(&wan.join("wan21_like.decode_t3.out.npy")));
    let diff = max_abs_diff(&g, &e);
    assert!(g.len() == e.len() && diff <= 1e-4, "{diff}");
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    assert_eq!(json["mode"], "spatial_shard_width");
    assert_eq!(json["strategy"], "shard-width");
    let ranks = json["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 3);
    for (r, rank) in ranks.iter().enumerate() {
        assert_eq!(rank["band"], serde_json::json!([r, r + 1]), "{rank}");
        assert!(rank["halo_bytes_sent"].as_u64().unwrap() > 0);
        assert!(rank["phase_ms"]["halo"].as_f64().is_some() && rank["exec_peak_bytes"].as_u64().unwrap() > 0);
    }

    // A forced axis that cannot fit falls back to tiles and says why; a `.svg` report is the plot.
    let plot = dir.join("report.svg");
    let (ok, text) = cli(&decode_on(
        "3",
        s(&model),
        s(&latent),
        s(&out),
        &["--vae-parallel-mode", "spatial_shard_height", "--report", s(&plot)],
    ));
    assert!(ok, "{text}");
    assert!(text.contains("spatial_shard_height: a latent height of 2 cannot give 3 rank(s)"), "{text}");
    let svg = std::fs::read_to_string(&plot).unwrap();
    let doc = roxmltree::Document::parse(&svg).expect("the report plot is well-formed XML");
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    let bars = doc.descendants().filter(|n| n.has_tag_name("g") && n.attribute("data-rank").is_some()).count();
    assert_eq!(bars, 3, "one bar per rank: {svg}");
    assert!(svg.contains("cannot give 3 rank(s)"), "the plot names the fallback: {svg}");

    // inspect lists every mode for the video family; AutoencoderKL shards its decode too, over
    // processes as over threads: the direct decode's bytes.
    let (ok, text) = cli(&["inspect", "--model", s(&model)]);
    assert!(ok && text.contains("tile, auto, spatial_shard_height, spatial_shard_width"), "{text}");
    let f = fixtures();
    let (direct, sharded) = (dir.join("akl-direct.npy"), dir.join("akl-shard.npy"));
    let (model, latent) = (f.join("sd_like"), f.join("sd_like.decode.in.npy"));
    let (ok, text) = cli(&decode_on("1", s(&model), s(&latent), s(&direct), &[]));
    assert!(ok, "{text}");
    let shard = ["--vae-parallel-mode", "spatial_shard_width", "--transport", "socket"];
    let (ok, text) = cli(&decode_on("3", s(&model), s(&latent), s(&sharded), &shard));
    assert!(ok, "{text}");
    assert_eq!(std::fs::read(&direct).unwrap(), std::fs::read(&sharded).unwrap(), "shard = direct, byte for byte");
    // The encode too (bands of whole latent rows).
    let (direct, sharded) = (dir.join("akl-enc-direct.npy"), dir.join("akl-enc-shard.npy"));
    let image = f.join("sd_like.encode.in.npy");
    let encode = |model: &Path, input: &Path, ranks: &str, out: &Path, extra: &[&str]| {
        let mut args = vec!["encode", "--model", s(model), "--input", s(input), "--out", s(out)];
        args.extend(["--output", "moments", "--vae-patch-parallel-size", ranks]);
        args.extend(extra);
        cli(&args)
    };
    let (ok, text) = encode(&model, &image, "1", &direct, &[]);
    assert!(ok, "{text}");
    let socket = ["--transport", "socket"];
    let (ok, text) =
        encode(&model, &image, "2", &sharded, &["--vae-parallel-mode", "spatial_shard_height", socket[0], socket[1]]);
    assert!(ok && text.contains("shard-height"), "{text}");
    assert_eq!(std::fs::read(&direct).unwrap(), std::fs::read(&sharded).unwrap(), "shard encode = direct");
    // A video encode over socket processes (5 frames, 5 × 7 latent rows and columns of 8 pixels:
    // the fixtures' videos are too narrow to cut into whole latent columns).
    use vae_parallel::tensor::{Device, Tensor};
    let video = dir.join("video.npy");
    let x = Tensor::seeded_uniform(vec![1, 3, 5, 40, 56], 1, -1.0, 1.0, &Device::Cpu).unwrap();
    std::fs::write(&video, vae_parallel::io::npy_bytes(&x).unwrap()).unwrap();
    let wan21 = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/wan/wan21_like");
    let (direct, sharded) = (dir.join("wan-enc-direct.npy"), dir.join("wan-enc-shard.npy"));
    let (ok, text) = encode(&wan21, &video, "1", &direct, &[]);
    assert!(ok, "{text}");
    let (ok, text) =
        encode(&wan21, &video, "2", &sharded, &["--vae-parallel-mode", "spatial_shard_width", socket[0], socket[1]]);
    assert!(ok && text.contains("shard-width"), "{text}");
    assert_eq!(std::fs::read(&direct).unwrap(), std::fs::read(&sharded).unwrap(), "video shard encode = direct");
}

/// `spatial_shard_2d` through the CLI: AutoencoderKL decode and encode and the Wan decode on a
/// 2 × 2 grid of blocks over socket processes, byte for byte the direct results; `--shard-grid`
/// picks the grid (also from the config file) and is a clean error where it cannot apply; the
/// video families (Wan, HunyuanVideo-1.5, LTX-2's reflect-padded decoder) on blocks over socket
/// processes.
#[test]
fn a_two_dimensional_shard_runs_through_the_cli() {
    let dir = scratch("shard-2d");
    let f = fixtures();
    let (model, latent) = (f.join("sd_like"), f.join("sd_like.decode.in.npy"));
    let (direct, blocks) = (dir.join("direct.npy"), dir.join("blocks.npy"));
    let (ok, text) = cli(&decode_on("1", s(&model), s(&latent), s(&direct), &[]));
    assert!(ok, "{text}");
    let grid = ["--vae-parallel-mode", "spatial_shard_2d", "--transport", "socket"];
    let (ok, text) = cli(&decode_on("4", s(&model), s(&latent), s(&blocks), &grid));
    assert!(ok && text.contains("shard-2x2"), "{text}");
    assert_eq!(std::fs::read(&direct).unwrap(), std::fs::read(&blocks).unwrap(), "2 × 2 blocks = direct");

    // A 1 × 3 grid named in the config file, on local ranks.
    let config = dir.join("grid.toml");
    std::fs::write(&config, "vae_parallel_mode = \"spatial_shard_2d\"\nshard_grid = \"1x3\"\n").unwrap();
    let (ok, text) = cli(&decode_on("3", s(&model), s(&latent), s(&blocks), &["--config", s(&config)]));
    assert!(ok && text.contains("shard-1x3") && text.contains("(--shard-grid)"), "{text}");
    assert_eq!(std::fs::read(&direct).unwrap(), std::fs::read(&blocks).unwrap(), "1 × 3 blocks = direct");

    // The encode's moments on 2 × 2 blocks of whole latent rows and columns.
    let image = f.join("sd_like.encode.in.npy");
    let encode = |ranks: &str, out: &Path, extra: &[&str]| {
        let mut args = vec!["encode", "--model", s(&model), "--input", s(&image), "--out", s(out)];
        args.extend(["--output", "moments", "--vae-patch-parallel-size", ranks]);
        args.extend(extra);
        cli(&args)
    };
    let (enc_direct, enc_blocks) = (dir.join("enc-direct.npy"), dir.join("enc-blocks.npy"));
    let (ok, text) = encode("1", &enc_direct, &[]);
    assert!(ok, "{text}");
    let blocks_over_sockets =
        ["--vae-parallel-mode", "spatial_shard_2d", "--shard-grid", "2x2", "--transport", "socket"];
    let (ok, text) = encode("4", &enc_blocks, &blocks_over_sockets);
    assert!(ok && text.contains("shard-2x2"), "{text}");
    assert_eq!(std::fs::read(&enc_direct).unwrap(), std::fs::read(&enc_blocks).unwrap(), "2 × 2 encode = direct");

    // A named grid runs where the default grid does not fit: a 2 × 2 latent on 3 ranks has no
    // grid of 3 blocks (the default falls back to tiles), but 1 × 2 blocks fit, the third rank idle.
    let small = dir.join("small.npy");
    let z = vae_parallel::tensor::Tensor::seeded_uniform(
        vec![1, 4, 2, 2],
        2,
        -1.0,
        1.0,
        &vae_parallel::tensor::Device::Cpu,
    )
    .unwrap();
    std::fs::write(&small, vae_parallel::io::npy_bytes(&z).unwrap()).unwrap();
    let (small_direct, small_blocks) = (dir.join("small-direct.npy"), dir.join("small-blocks.npy"));
    let (ok, text) = cli(&decode_on("1", s(&model), s(&small), s(&small_direct), &[]));
    assert!(ok, "{text}");
    let mode = ["--vae-parallel-mode", "spatial_shard_2d"];
    let (ok, text) = cli(&decode_on("3", s(&model), s(&small), s(&small_blocks), &mode));
    assert!(
        ok && text.contains("tile") && text.contains("cannot cut a 2x2 input"),
        "the default grid falls back: {text}"
    );
    let named = ["--vae-parallel-mode", "spatial_shard_2d", "--shard-grid", "1x2"];
    let (ok, text) = cli(&decode_on("3", s(&model), s(&small), s(&small_blocks), &named));
    assert!(ok && text.contains("shard-1x2"), "{text}");
    assert_eq!(std::fs::read(&small_direct).unwrap(), std::fs::read(&small_blocks).unwrap(), "1 × 2 = direct");

    // Clean errors: a grid without the 2-D mode, a grid larger than the ranks, a malformed grid.
    let out = dir.join("never.npy");
    let args = decode_on("4", s(&model), s(&latent), s(&out), &["--shard-grid", "2x2"]);
    assert_clean_failure(
        "grid without the mode",
        &args,
        "--shard-grid applies to --vae-parallel-mode spatial_shard_2d",
    );
    let args = decode_on(
        "2",
        s(&model),
        s(&latent),
        s(&out),
        &["--vae-parallel-mode", "spatial_shard_2d", "--shard-grid", "2x2"],
    );
    assert_clean_failure("grid beyond the ranks", &args, "a 2 × 2 grid of blocks needs 4 ranks");
    let args = decode_on(
        "4",
        s(&model),
        s(&latent),
        s(&out),
        &["--vae-parallel-mode", "spatial_shard_2d", "--shard-grid", "2by2"],
    );
    assert_clean_failure("malformed grid", &args, "--shard-grid");
    assert!(!out.exists());

    // inspect lists the mode for AutoencoderKL; the video families decode on blocks over socket
    // processes, the direct decode's bytes.
    let (ok, text) = cli(&["inspect", "--model", s(&model)]);
    assert!(ok && text.contains("spatial_shard_width, spatial_shard_2d"), "{text}");
    let video = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures");
    let latent_of = |name: &str, channels: usize| {
        let z = vae_parallel::tensor::Tensor::seeded_uniform(
            vec![1, channels, 2, 6, 6],
            1,
            -1.0,
            1.0,
            &vae_parallel::tensor::Device::Cpu,
        )
        .unwrap();
        let path = dir.join(format!("{name}.npy"));
        std::fs::write(&path, vae_parallel::io::npy_bytes(&z).unwrap()).unwrap();
        path
    };
    for (name, model, channels) in [
        ("wan", "wan/wan21_like", 16),
        ("hunyuan", "hunyuan_video15/hunyuan_video15_like", 4),
        ("ltx2", "ltx/ltx2_like", 8),
    ] {
        let (model, latent) = (video.join(model), latent_of(name, channels));
        let (direct, blocks) = (dir.join(format!("{name}-direct.npy")), dir.join(format!("{name}-blocks.npy")));
        let (ok, text) = cli(&decode_on("1", s(&model), s(&latent), s(&direct), &[]));
        assert!(ok, "{name}: {text}");
        let (ok, text) = cli(&decode_on("4", s(&model), s(&latent), s(&blocks), &grid));
        assert!(ok && text.contains("shard-2x2"), "{name}: {text}");
        assert_eq!(std::fs::read(&direct).unwrap(), std::fs::read(&blocks).unwrap(), "{name} 2 × 2 = direct");
    }
}

/// `--tile-merge edges` (each rank blends its own tiles from its neighbours' raw edges and
/// sends the owner only their kept parts) writes the bytes of the owner merge, over socket
/// processes and local ranks, for an image decode, a video decode and an encode; the config
/// key says the same, and a merge it does not know is refused.
#[test]
fn a_tile_merge_by_edges_writes_the_owner_merges_bytes() {
    let dir = scratch("tile-merge");
    let f = fixtures();
    let wan = f.join("../wan");
    let paths = [
        f.join("sd_like"),
        f.join("sd_like.decode_tiled.in.npy"),
        wan.join("wan21_like"),
        wan.join("wan21_like.decode_tiled.in.npy"),
        f.join("flux1_like"),
        f.join("flux1_like.encode_tiled.in.npy"),
    ];
    let sd = ["decode", "--model", s(&paths[0]), "--latent", s(&paths[1])];
    let wan_args = [&["decode", "--model", s(&paths[2]), "--latent", s(&paths[3])][..], &WAN_FIXTURE_TILING].concat();
    let encode = ["encode", "--model", s(&paths[4]), "--input", s(&paths[5]), "--output", "moments"];
    let config = dir.join("edges.toml");
    std::fs::write(&config, "tile_merge = \"edges\"\n").unwrap();
    for (name, base) in [("sd", &sd[..]), ("wan", &wan_args[..]), ("encode", &encode[..])] {
        let owner = dir.join(format!("{name}-owner.npy"));
        let (ok, text) = cli(&[base, &["--vae-patch-parallel-size", "3", "--out", s(&owner)]].concat());
        assert!(ok, "{name}: {text}");
        for (i, extra) in [
            vec!["--tile-merge", "edges", "--transport", "socket"],
            vec!["--tile-merge", "edges", "--vae-patch-parallel-size", "2"],
            vec!["--config", s(&config)],
        ]
        .into_iter()
        .enumerate()
        {
            let edges = dir.join(format!("{name}-edges-{i}.npy"));
            let mut args = [base, &["--out", s(&edges)]].concat();
            if !extra.contains(&"--vae-patch-parallel-size") {
                args.extend(["--vae-patch-parallel-size", "3"]);
            }
            args.extend(extra.iter().copied());
            let (ok, text) = cli(&args);
            assert!(ok, "{name} {extra:?}: {text}");
            assert!(std::fs::read(&owner).unwrap() == std::fs::read(&edges).unwrap(), "{name} {extra:?}");
        }
    }
    let out = dir.join("never.npy");
    let (ok, text) = cli(&[&sd[..], &["--tile-merge", "ranks", "--out", s(&out)]].concat());
    assert!(!ok && text.contains("--tile-merge") && text.contains("owner or edges"), "{text}");
    assert!(!out.exists());
}
