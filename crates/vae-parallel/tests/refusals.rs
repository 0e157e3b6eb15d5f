//! Every kind of bad input and request through the CLI (and the library where a rank's error
//! kind matters): a one-line error and a non-zero exit on every rank, no panic, no hang, and no
//! output file left behind or overwritten.

mod support;

use std::path::Path;

use support::{assert_clean_failure, cli, decode_args, decode_on, fixtures, model_copy, npy, read_npy_f32, s, scratch};

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
/// of failure it is (an input that does not fit the model), not only in its text, and the
/// group's error is one of that kind.
#[test]
fn a_latent_that_does_not_fit_is_an_invalid_input_on_every_rank() {
    use std::sync::Arc;

    use vae_parallel::runtime::{DistributedVaeExecutor, FailureKind, RuntimeError, Stage};
    use vae_parallel::transport::{TransportConfig, run_local};
    use vae_parallel::{CostProfile, Decode, Error, ErrorKind, Group, Tiling, Vae};

    let f = fixtures();
    let vae = Vae::builder(f.join("sd_like")).cost_profile(CostProfile::Off).build().unwrap();
    // A FLUX.2 latent: not the SD-like model's 4 channels.
    let latent = vae_parallel::io::read_npy(f.join("flux2_like.decode.in.npy")).unwrap();
    let tiles = Decode::default().tiling(Tiling::Reference { asked: false });
    let results = run_local(2, TransportConfig::default(), |comm| {
        let exec = DistributedVaeExecutor::new(Arc::new(comm), 2).unwrap();
        vae.decode_on(&exec, &latent, &tiles).map(|_| ())
    })
    .unwrap();
    for (rank, result) in results.into_iter().enumerate() {
        match result.unwrap() {
            Err(Error::Runtime(
                err @ RuntimeError::Operator { stage: Stage::Split, kind: FailureKind::InvalidInput, .. },
            )) => assert!(err.to_string().starts_with("split failed on rank 0: invalid input:"), "rank {rank}: {err}"),
            other => panic!("rank {rank}: {other:?}"),
        }
    }
    let err = Group::local(2).unwrap().decode(&vae, &latent, &tiles).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
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
