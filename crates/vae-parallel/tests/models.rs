//! `decode`, `encode` and `inspect` on the diffusers fixtures, and every kind of bad input: a
//! one-line error and a non-zero exit, no panic, no hang, no output file left behind.

mod support;

use std::path::{Path, PathBuf};

use support::{cli, read_npy_f32};

/// The Wan fixtures' tiling: diffusers' `enable_tiling(16, 24, 8, 16)`.
const WAN_FIXTURE_TILING: [&str; 8] = [
    "--tile-sample-min-height",
    "16",
    "--tile-sample-min-width",
    "24",
    "--tile-sample-stride-height",
    "8",
    "--tile-sample-stride-width",
    "16",
];

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/autoencoder_kl")
}

/// A scratch directory for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("vae-models-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A copy of a fixture model that a test may break.
fn model_copy(name: &str, model: &str) -> PathBuf {
    let dir = scratch(name).join(model);
    std::fs::create_dir_all(&dir).unwrap();
    for file in ["config.json", "diffusion_pytorch_model.safetensors"] {
        std::fs::copy(fixtures().join(model).join(file), dir.join(file)).unwrap();
    }
    dir
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

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
    let diff = got.iter().zip(&expected).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
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
    let diff = got.iter().zip(&expected).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
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
    let diff = got.iter().zip(&expected).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
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

/// Runs a decode that must fail, and checks the failure is clean.
fn assert_clean_failure(name: &str, args: &[&str], expect: &str) {
    let (ok, text) = cli(args);
    assert!(!ok, "{name}: should fail:\n{text}");
    assert!(text.contains(expect), "{name}: expected {expect:?} in:\n{text}");
    assert!(!text.contains("panicked"), "{name}: panicked:\n{text}");
    let error_lines = text.lines().filter(|l| l.starts_with("error:")).count();
    assert_eq!(error_lines, 1, "{name}: one error line:\n{text}");
}

fn decode_args<'a>(model: &'a str, latent: &'a str, out: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    decode_on("2", model, latent, out, extra)
}

/// `decode` arguments with a parallel size of `ranks`.
fn decode_on<'a>(ranks: &'a str, model: &'a str, latent: &'a str, out: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec!["decode", "--model", model, "--latent", latent, "--out", out, "--vae-patch-parallel-size", ranks];
    v.extend_from_slice(extra);
    v
}

#[test]
fn outputs_never_overwrite_what_the_user_gave() {
    let dir = scratch("overwrite");
    let model = model_copy("overwrite-model", "sd_like");
    let latent = dir.join("z.npy");
    std::fs::copy(fixtures().join("sd_like.decode.in.npy"), &latent).unwrap();
    let original = std::fs::read(&latent).unwrap();
    let config = dir.join("run.toml");
    std::fs::write(&config, "vae_patch_parallel_size = 1\n").unwrap();
    let (m, l, out) = (s(&model), s(&latent), dir.join("out.npy"));
    let (o, model_config) = (s(&out), model.join("config.json"));
    let same_latent = dir.join(".").join("z.npy");
    for (name, args, expect) in [
        ("out is the latent", decode_args(m, l, l, &[]), "--out"),
        ("out is the latent, spelt otherwise", decode_args(m, l, s(&same_latent), &[]), "is the --latent file"),
        ("report is the latent", decode_args(m, l, o, &["--report", l]), "--report"),
        (
            "report is the config",
            decode_args(m, l, o, &["--config", s(&config), "--report", s(&config)]),
            "--config file",
        ),
        ("report is the output", decode_args(m, l, o, &["--report", o]), "--report and --out name the same file"),
        ("report in the model", decode_args(m, l, o, &["--report", s(&model_config)]), "would overwrite the model's"),
        (
            "encode out is its input",
            vec!["encode", "--model", m, "--input", s(&out), "--out", s(&out)],
            "is the --input file",
        ),
    ] {
        if name.starts_with("encode") {
            std::fs::write(&out, &original).unwrap();
        }
        assert_clean_failure(name, &args, expect);
        let _ = std::fs::remove_file(&out);
    }
    assert_eq!(std::fs::read(&latent).unwrap(), original, "the latent is untouched");
    assert!(std::fs::read_to_string(&model_config).unwrap().contains("AutoencoderKL"), "the model is untouched");
    assert_eq!(std::fs::read_to_string(&config).unwrap(), "vae_patch_parallel_size = 1\n");
    assert!(!out.exists(), "nothing was written");
}

#[test]
fn bad_input_is_a_clean_error_on_every_rank_and_leaves_no_file() {
    let f = fixtures();
    let dir = scratch("bad");
    let out = dir.join("out.npy");
    let (model, latent) = (f.join("sd_like"), f.join("sd_like.decode.in.npy"));
    let (m, l, o) = (s(&model), s(&latent), s(&out));

    // Wrong channel count and wrong rank.
    assert_clean_failure("channels", &decode_args(m, s(&f.join("flux2_like.decode.in.npy")), o, &[]), "expects 4");
    let rank3 = dir.join("rank3.npy");
    std::fs::write(&rank3, npy(&[4, 6, 9], &vec![0.0; 216])).unwrap();
    assert_clean_failure("rank", &decode_args(m, s(&rank3), o, &[]), "[B, C, H, W]");

    // NaN in the latent: count and first position.
    let mut values = vec![0.5f32; 216];
    values[10] = f32::NAN;
    values[20] = f32::INFINITY;
    let nan = dir.join("nan.npy");
    std::fs::write(&nan, npy(&[1, 4, 6, 9], &values)).unwrap();
    assert_clean_failure(
        "nan",
        &decode_args(m, s(&nan), o, &[]),
        "2 non-finite value(s); the first is NaN at index [0, 0, 1, 1]",
    );

    // Unknown mode, parallel size 0, missing output directory, not-a-npy latent.
    assert_clean_failure(
        "mode",
        &decode_args(m, l, o, &["--vae-parallel-mode", "diagonal"]),
        "unknown VAE parallel mode",
    );
    // An image VAE has no frames to pipeline: a typed refusal, not another mode.
    assert_clean_failure(
        "pipeline",
        &decode_args(m, l, o, &["--vae-parallel-mode", "pipeline"]),
        "AutoencoderKL decodes images: pipeline mode",
    );
    assert_clean_failure(
        "size0",
        &["decode", "--model", m, "--latent", l, "--out", o, "--vae-patch-parallel-size", "0"],
        "at least 1",
    );
    assert_clean_failure("outdir", &decode_args(m, l, "/nonexistent-dir/out.npy", &[]), "does not exist");
    let garbage = dir.join("garbage.npy");
    std::fs::write(&garbage, b"not numpy").unwrap();
    assert_clean_failure("npy", &decode_args(m, s(&garbage), o, &[]), "not a .npy file");

    // tf32 is a CUDA type, and bf16 on the CPU needs AVX512-BF16: refused, not quietly run in
    // f32 (where the CPU has it, `cpu_bf16_decode_runs_with_bf16_products` runs it).
    if !vae_parallel::tensor::CpuBf16Scope::supported() {
        assert_clean_failure("bf16 on cpu", &decode_args(m, l, o, &["--dtype", "bf16"]), "AVX512-BF16");
    }
    assert_clean_failure(
        "tf32 on cpu",
        &decode_args(m, l, o, &["--dtype", "tf32"]),
        "--dtype tf32 needs a CUDA device",
    );
    assert_clean_failure("dtype", &decode_args(m, l, o, &["--dtype", "f64"]), "is not f32, bf16 or tf32");
    // NCCL runs rank r on cuda:r: the CPU (and any other device choice) is refused up front.
    assert_clean_failure("nccl on cpu", &decode_args(m, l, o, &["--transport", "nccl"]), "pass --device cuda, not cpu");
    assert!(!out.exists(), "no output file after failures");
}

/// An error every rank agreed on is reported as the owner found it, every time: no rank's
/// abort after it races the owner's own report ("rank 1 failed: ..." in some runs).
#[test]
fn an_agreed_error_is_reported_the_same_way_every_time() {
    let f = fixtures();
    let dir = scratch("agreed");
    let out = dir.join("out.npy");
    let (model, latent) = (f.join("sd_like"), f.join("flux2_like.decode.in.npy"));
    let args = decode_on("3", s(&model), s(&latent), s(&out), &[]);
    let lines: std::collections::BTreeSet<String> = (0..20)
        .map(|_| {
            let (ok, text) = cli(&args);
            assert!(!ok, "{text}");
            text.lines()
                .find(|l| l.starts_with("error:"))
                .unwrap_or_else(|| panic!("no error line:\n{text}"))
                .to_string()
        })
        .collect();
    assert_eq!(lines.len(), 1, "{lines:#?}");
    let line = lines.first().unwrap();
    assert!(line.starts_with("error: split failed on rank 0: invalid input:"), "{line}");
}

/// The same refusal through the library, on two local ranks: every rank's error says what kind
/// of failure it is (an input that does not fit the model), not only in its text.
#[test]
fn a_latent_that_does_not_fit_is_an_invalid_input_on_every_rank() {
    use std::sync::Arc;

    use vae_parallel::engine::{Engine, EngineError, RequestOptions};
    use vae_parallel::models::TileOverrides;
    use vae_parallel::runtime::{DistributedVaeExecutor, FailureKind, RuntimeError, Stage};
    use vae_parallel::transport::{TransportConfig, run_local};

    let f = fixtures();
    let engine = Engine::load(&f.join("sd_like"), &TileOverrides::default()).unwrap();
    // A FLUX.2 latent: not the SD-like model's 4 channels.
    let latent = vae_parallel::io::read_npy(&f.join("flux2_like.decode.in.npy")).unwrap();
    let results = run_local(2, TransportConfig::default(), |comm| {
        let exec = DistributedVaeExecutor::new(Arc::new(comm), 2).unwrap();
        engine.decode(&exec, &latent, &RequestOptions::default()).map(|_| ())
    })
    .unwrap();
    for (rank, result) in results.into_iter().enumerate() {
        match result.unwrap() {
            Err(EngineError::Runtime(
                err @ RuntimeError::Operator { stage: Stage::Split, kind: FailureKind::InvalidInput, .. },
            )) => assert!(err.to_string().starts_with("split failed on rank 0: invalid input:"), "rank {rank}: {err}"),
            other => panic!("rank {rank}: {other:?}"),
        }
    }
}

/// A .npy file of f32.
fn npy(shape: &[usize], values: &[f32]) -> Vec<u8> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': ({},), }}", dims.join(", "));
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

/// Rewrites a model's weights file through `edit` on the (name → (dtype, shape, bytes)) map.
fn rewrite_weights(dir: &Path, edit: impl FnOnce(&mut Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>)) {
    let path = dir.join("diffusion_pytorch_model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(name, view)| (name, view.dtype(), view.shape().to_vec(), view.data().to_vec()))
        .collect();
    edit(&mut tensors);
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(name, dtype, shape, data)| {
            (name.clone(), safetensors::tensor::TensorView::new(*dtype, shape.clone(), data).unwrap())
        })
        .collect();
    let serialized = safetensors::serialize(views, None).unwrap();
    std::fs::write(&path, serialized).unwrap();
}

#[test]
fn bad_checkpoints_are_clean_errors_naming_the_problem() {
    let f = fixtures();
    let dir = scratch("ckpt");
    let out = dir.join("out.npy");
    let latent = f.join("sd_like.decode.in.npy");
    let run = |name: &str, model: &Path, expect: &str| {
        assert_clean_failure(name, &decode_args(s(model), s(&latent), s(&out), &[]), expect);
    };

    let missing = model_copy("missing", "sd_like");
    rewrite_weights(&missing, |t| t.retain(|(n, ..)| n != "decoder.conv_in.bias"));
    run("missing weight", &missing, "missing weight \"decoder.conv_in.bias\"");

    let extra = model_copy("extra", "sd_like");
    rewrite_weights(&extra, |t| {
        t.push(("decoder.surprise.weight".into(), safetensors::Dtype::F32, vec![1], vec![0; 4]))
    });
    run("extra weight", &extra, "unexpected weight(s) in the checkpoint: decoder.surprise.weight");

    let shaped = model_copy("shape", "sd_like");
    rewrite_weights(&shaped, |t| {
        let bias = t.iter_mut().find(|(n, ..)| n == "decoder.conv_in.bias").unwrap();
        bias.2 = vec![bias.2[0] / 2];
        bias.3.truncate(bias.3.len() / 2);
    });
    run("mis-shaped weight", &shaped, "has shape [8], the model needs [16]");

    let truncated = model_copy("truncated", "sd_like");
    let path = truncated.join("diffusion_pytorch_model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    run("truncated", &truncated, "not a valid safetensors file");

    let garbage = model_copy("garbage", "sd_like");
    std::fs::write(garbage.join("diffusion_pytorch_model.safetensors"), b"hello").unwrap();
    run("garbage", &garbage, "not a valid safetensors file");

    let class = model_copy("class", "sd_like");
    let config =
        std::fs::read_to_string(class.join("config.json")).unwrap().replace("\"AutoencoderKL\"", "\"UNet2DModel\"");
    std::fs::write(class.join("config.json"), config).unwrap();
    run("unknown class", &class, "\"UNet2DModel\" is not a VAE class");

    let typed = model_copy("typed", "sd_like");
    let config = std::fs::read_to_string(typed.join("config.json"))
        .unwrap()
        .replace("\"latent_channels\": 4", "\"latent_channels\": \"four\"");
    std::fs::write(typed.join("config.json"), config).unwrap();
    run("wrong type", &typed, "field `latent_channels`");
    assert!(!out.exists());
}

#[test]
fn video_vaes_decode_and_encode_through_the_cli() {
    let wan = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/wan");
    let dir = scratch("video");
    let close = |got: &Path, expected: &Path| {
        let (g, e) = (read_npy_f32(got), read_npy_f32(expected));
        assert_eq!(g.len(), e.len(), "{}", got.display());
        g.iter().zip(&e).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max)
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
        g.iter().zip(&e).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max)
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
        g.iter().zip(&e).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max)
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
    let diff = g.iter().zip(&e).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
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

/// Outputs go in place only when the whole request succeeded, never through a planted link, and
/// a bad `--report` place is found before any work.
#[test]
fn outputs_are_safe_against_links_and_partial_failures() {
    let dir = scratch("safe-outputs");
    let f = fixtures();
    let (model, latent) = (f.join("sd_like"), f.join("sd_like.decode.in.npy"));

    // A symbolic link planted at --out is replaced, its target untouched.
    let victim = dir.join("victim");
    std::fs::write(&victim, b"precious").unwrap();
    let out = dir.join("out.npy");
    std::os::unix::fs::symlink(&victim, &out).unwrap();
    let (ok, text) = cli(&decode_args(s(&model), s(&latent), s(&out), &[]));
    assert!(ok, "{text}");
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    assert!(!std::fs::symlink_metadata(&out).unwrap().file_type().is_symlink());
    assert_eq!(read_npy_f32(&out).len(), read_npy_f32(&f.join("sd_like.decode.out.npy")).len());

    // A --report that cannot be written fails up front: --out is not written either.
    let out2 = dir.join("out2.npy");
    let report = dir.join("no-such-dir").join("report.json");
    assert_clean_failure(
        "report place",
        &decode_args(s(&model), s(&latent), s(&out2), &["--report", s(&report)]),
        "--report",
    );
    assert!(!out2.exists());

    // Nothing but the outputs is left in the directory: no temporary files.
    let mut left: Vec<String> =
        std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    left.sort();
    assert_eq!(left, ["out.npy", "victim"]);
}

/// Group and parallel sizes past the limit are one typed error, at once (they allocated a mesh
/// of millions of queues, or ran for minutes).
#[test]
fn oversized_groups_are_refused_at_once() {
    let f = fixtures();
    let (model, latent) = (f.join("sd_like"), f.join("sd_like.decode.in.npy"));
    let out = scratch("oversized").join("never.npy");
    for extra in [vec!["--ranks", "5000"], vec!["--ranks", "5000", "--transport", "socket"]] {
        let mut args = decode_on("10000", s(&model), s(&latent), s(&out), &[]);
        args.extend(extra);
        let started = std::time::Instant::now();
        assert_clean_failure("oversized", &args, "larger than the limit of 4096");
        assert!(started.elapsed().as_secs() < 10, "refused in {:?}", started.elapsed());
        assert!(!out.exists());
    }
}

/// NaN weights are refused at load for every family, and NaN latents for the video families
/// as for the image ones: one typed error naming the tensor, no output.
#[test]
fn non_finite_weights_and_latents_are_refused_for_every_family() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures");
    let dir = scratch("non-finite");
    let out = dir.join("never.npy");
    for (family, model, latent) in [
        ("autoencoder_kl", "sd_like", "sd_like.decode.in.npy"),
        ("autoencoder_kl", "flux2_like", "flux2_like.decode.in.npy"),
        ("wan", "wan21_like", "wan21_like.decode_t1.in.npy"),
        ("qwen_image", "qwen_image_like", "qwen_image_like.decode_t1.in.npy"),
    ] {
        let copy = dir.join(model);
        std::fs::create_dir_all(&copy).unwrap();
        for file in ["config.json", "diffusion_pytorch_model.safetensors"] {
            std::fs::copy(root.join(family).join(model).join(file), copy.join(file)).unwrap();
        }
        rewrite_weights(&copy, |t| {
            let bias = t.iter_mut().find(|(n, ..)| n == "decoder.conv_in.bias").unwrap();
            assert_eq!(bias.1, safetensors::Dtype::F32, "{model}");
            bias.3[4..8].copy_from_slice(&f32::NAN.to_le_bytes());
        });
        let latent = root.join(family).join(latent);
        assert_clean_failure(
            model,
            &decode_args(s(&copy), s(&latent), s(&out), &[]),
            "weight \"decoder.conv_in.bias\" has 1 non-finite value(s)",
        );

        // The intact model, a latent with one NaN.
        let mut z = read_npy_f32(&latent);
        z[3] = f32::NAN;
        let shape = vae_parallel::io::read_tensor(&latent).unwrap().dims().to_vec();
        let nan_latent = dir.join(format!("{model}.nan.npy"));
        let t = vae_parallel::tensor::Tensor::from_vec(z, shape, &vae_parallel::tensor::Device::Cpu).unwrap();
        std::fs::write(&nan_latent, vae_parallel::io::npy_bytes(&t).unwrap()).unwrap();
        let intact = root.join(family).join(model);
        assert_clean_failure(
            &format!("{model} NaN latent"),
            &decode_args(s(&intact), s(&nan_latent), s(&out), &[]),
            "latent has 1 non-finite value(s)",
        );
    }
    assert!(!out.exists());
}

/// A bad input in a launched socket group is said once (by rank 0), not once per process.
#[test]
fn a_socket_group_says_a_failure_once() {
    let f = fixtures();
    let out = scratch("socket-once").join("never.npy");
    let missing = scratch("socket-once-in").join("missing.npy");
    let model = f.join("sd_like");
    let mut args = decode_on("3", s(&model), s(&missing), s(&out), &[]);
    args.extend(["--transport", "socket", "--ranks", "3"]);
    assert_clean_failure("socket input error", &args, "missing.npy");
    assert!(!out.exists());
}

/// A request that cannot fit in the memory the machine has (here capped by VAE_MEMORY_LIMIT)
/// is refused before any work with both figures, and the advice that helps: tiles shrink the
/// largest feature map; nothing but a smaller request shrinks the output.
#[test]
fn a_request_that_cannot_fit_is_refused_before_any_work() {
    let f = fixtures();
    let (model, latent) = (f.join("sd_like"), f.join("sd_like.decode.in.npy"));
    let out = scratch("memory").join("out.npy");
    let run = |limit: &str, extra: &[&str]| {
        support::cli_with_env(&decode_on("1", s(&model), s(&latent), s(&out), extra), &[("VAE_MEMORY_LIMIT", limit)])
    };
    // The direct decode's floor is above 100 KiB, the tiled one's below.
    let (ok, text) = run("100K", &[]);
    assert!(!ok && text.contains("needs at least") && text.contains("100.0 KiB available"), "{text}");
    assert!(text.contains("with tiles (--vae-use-tiling)"), "{text}");
    assert!(!out.exists());
    let (ok, text) = run("100K", &["--vae-use-tiling", "--tile-sample-min-size", "32"]);
    assert!(ok, "{text}");
    // Below the output itself, tiles cannot help and the error says so.
    std::fs::remove_file(&out).unwrap();
    let (ok, text) = run("16K", &["--vae-use-tiling", "--tile-sample-min-size", "32"]);
    assert!(!ok && text.contains("the whole output is assembled on one rank"), "{text}");
    assert_eq!(text.lines().filter(|l| l.starts_with("error:")).count(), 1, "{text}");
    assert!(!out.exists());
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
