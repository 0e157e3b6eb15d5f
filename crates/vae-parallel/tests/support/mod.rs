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
    // tests see: the built-in constants, unless a test names a profile.
    let config_home = std::env::temp_dir().join(format!("vae-parallel-tests-config-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_vae-parallel"))
        .args(args)
        .env("XDG_CONFIG_HOME", &config_home)
        .envs(env.iter().copied())
        .output()
        .expect("run vae-parallel");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
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

/// The f32 elements of a version-1 `.npy` file.
pub fn read_npy_f32(path: &Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap();
    let header_len = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    bytes[10 + header_len..].chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}
