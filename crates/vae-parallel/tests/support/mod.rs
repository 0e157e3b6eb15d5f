//! What the CLI tests share: running the binary, its JSON line, and reading the `.npy` files it
//! writes (with a parser of their own, not the library's, so that a writer bug cannot hide behind
//! the matching reader).
#![allow(dead_code)] // each test file uses part of it

use std::path::{Path, PathBuf};
use std::process::Command;

/// Runs `vae-parallel` with `args`: whether it succeeded, and its stdout then stderr.
pub fn cli(args: &[&str]) -> (bool, String) {
    cli_with_env(args, &[])
}

/// [`cli`] with extra environment variables.
pub fn cli_with_env(args: &[&str], env: &[(&str, &str)]) -> (bool, String) {
    // A profile `calibrate` wrote under the developer's config must not change what the
    // tests see: the built-in constants (not probed), unless a test names a profile or
    // overrides this.
    let config_home = std::env::temp_dir().join(format!("vae-parallel-tests-config-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_vae-parallel"))
        .args(args)
        .env("XDG_CONFIG_HOME", &config_home)
        .env("VAE_COST_PROBE", "0")
        .envs(env.iter().copied())
        .output()
        .expect("run vae-parallel");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

/// The Wan fixtures' tiling: diffusers' `enable_tiling(16, 24, 8, 16)`.
pub const WAN_FIXTURE_TILING: [&str; 8] = [
    "--tile-sample-min-height",
    "16",
    "--tile-sample-min-width",
    "24",
    "--tile-sample-stride-height",
    "8",
    "--tile-sample-stride-width",
    "16",
];

/// The AutoencoderKL fixtures (and the FLUX.2 ones beside them).
pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/autoencoder_kl")
}

/// A fresh scratch directory for one test, named after the test file and this process.
pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("vae-{}-{}-{name}", env!("CARGO_CRATE_NAME"), std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A copy of a fixture model that a test may break.
pub fn model_copy(name: &str, model: &str) -> PathBuf {
    let dir = scratch(name).join(model);
    std::fs::create_dir_all(&dir).unwrap();
    for file in ["config.json", "diffusion_pytorch_model.safetensors"] {
        std::fs::copy(fixtures().join(model).join(file), dir.join(file)).unwrap();
    }
    dir
}

/// A path as the CLI argument it is.
pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Runs a command that must fail, and checks the failure is clean: `expect` in the text, no
/// panic, one error line.
pub fn assert_clean_failure(name: &str, args: &[&str], expect: &str) {
    let (ok, text) = cli(args);
    assert!(!ok, "{name}: should fail:\n{text}");
    assert!(text.contains(expect), "{name}: expected {expect:?} in:\n{text}");
    assert!(!text.contains("panicked"), "{name}: panicked:\n{text}");
    let error_lines = text.lines().filter(|l| l.starts_with("error:")).count();
    assert_eq!(error_lines, 1, "{name}: one error line:\n{text}");
}

/// `decode` arguments with a parallel size of 2.
pub fn decode_args<'a>(model: &'a str, latent: &'a str, out: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    decode_on("2", model, latent, out, extra)
}

/// `decode` arguments with a parallel size of `ranks`.
pub fn decode_on<'a>(ranks: &'a str, model: &'a str, latent: &'a str, out: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec!["decode", "--model", model, "--latent", latent, "--out", out, "--vae-patch-parallel-size", ranks];
    v.extend_from_slice(extra);
    v
}

/// A .npy file of f32.
pub fn npy(shape: &[usize], values: &[f32]) -> Vec<u8> {
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

/// The one JSON object a `--json` command printed (its line starts with `{`).
pub fn json_line(text: &str) -> serde_json::Value {
    let line = text.lines().find(|l| l.starts_with('{')).unwrap_or_else(|| panic!("no JSON line in:\n{text}"));
    serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"))
}

/// The Wan2.1-like fixture model and its 3-frame decode latent.
pub fn wan21_fixture() -> (PathBuf, PathBuf) {
    let wan = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/wan");
    (wan.join("wan21_like"), wan.join("wan21_like.decode_t3.in.npy"))
}

/// The largest absolute difference between two outputs, element by element.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max)
}

/// The f32 elements of a version-1 `.npy` file.
pub fn read_npy_f32(path: &Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap();
    let header_len = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    bytes[10 + header_len..].chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}
