//! Repository tasks, run as `cargo xtask <task>`.
//!
//! - `ci`: what `.ci/run` checks — formatting, clippy with warnings denied, the test suite.
//! - `bench [--decode-only | --no-decode] [--cases A,B] [--threads 1,2] [--iters N] [--dtypes f32,bf16]
//!   [--layouts nchw,channels_last] [--python PATH]`: the transport and failure-detection
//!   benchmarks of the CLI and the demo, in release mode, for the rank counts the reports quote;
//!   then the CPU comparison with diffusers (`docs/benchmarks.md`, see `bench.rs`): VAEs with
//!   random weights in real geometries (FLUX.1, SD, Wan2.1; `scripts/bench_diffusers.py`),
//!   decodes and encodes, f32 and bf16, diffusers in NCHW and channels-last and `vae-parallel
//!   bench decode|encode` back to back per configuration, the raw JSON lines written to
//!   `target/bench-results/<timestamp>.jsonl` and one ratio table printed. The Python is
//!   `--python`, else `$VAE_FIXTURES_PYTHON`, else `/work/venv-fixtures/bin/python` if it
//!   exists; without one (or without diffusers) the comparison is skipped with a message.
//!   `bench --tabulate FILE.jsonl` prints such a file's table again.
//! - `kernels`: compiles `kernels-cu/*.cu` with NVRTC (no GPU, no CUDA install: NVIDIA's pip
//!   wheels in a venv under `target/`) to PTX and an `sm_90` cubin in `target/kernels/`, and fails
//!   on a compile error, a warning or a register spill (see `kernels.rs`).
//! - `kernels-emu`: compiles the same kernels for the CPU with the emulation layer in
//!   `kernels-cu/emu/` and runs each kernel's test against a naive reference (see
//!   `kernels_emu.rs`).
//! - `gpu-emu`: builds a fake `libcuda.so` on the same emulation layer and runs the CUDA
//!   backend's GPU tests against it, with no GPU (see `gpu_emu.rs`).
//! - `fuzz [--cases N]`: every parser of user and peer input (`.npy`, PNG, `config.json`,
//!   safetensors, the wire messages, socket frames and hellos, tile summaries) fed random and
//!   mutated input, N cases per target (default 200,000: over 10⁶ in all), in release mode;
//!   CI runs the same targets with proptest's 256 cases as part of the test suite.
//! - `wheel [--profile NAME] [--out DIR]`: the Python package as one wheel that
//!   installs without a Rust toolchain (CPython >= 3.9 abi3, manylinux_2_28 x86_64: the
//!   extension with the CUDA backend and kernels, the `vae-parallel` command, type stubs),
//!   checked by `auditwheel show` (see `wheel.rs`).
//! - `fixtures [--python PATH] [--out DIR]`: regenerates the diffusers ground-truth fixtures
//!   (`fixtures/autoencoder_kl/` and its siblings `wan/`, `qwen_image/`, `hunyuan_video15/`,
//!   `ltx/`) with `scripts/gen_fixtures.py`, after checking that the Python has the packages
//!   pinned in `scripts/requirements-fixtures.txt`. The Python is `--python`, else
//!   `$VAE_FIXTURES_PYTHON`, else `python3`.

#![allow(clippy::print_stdout, clippy::print_stderr)] // a terminal tool

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

mod bench;
mod gpu_emu;
mod kernels;
mod kernels_emu;
mod wheel;

const USAGE: &str = "usage: cargo xtask <ci | kernels | kernels-emu | gpu-emu | bench [--decode-only | --no-decode] [--cases A,B] \
                     [--threads 1,2] [--iters N] [--dtypes f32,bf16] [--layouts nchw,channels_last] [--python PATH] \
                     | bench --tabulate FILE.jsonl | fuzz [--cases N] | fixtures [--python PATH] [--out DIR] \
                     | wheel [--profile NAME] [--out DIR]>";

/// The pinned Python packages of the fixture generator, relative to the repository root.
const FIXTURE_REQUIREMENTS: &str = "scripts/requirements-fixtures.txt";

/// The fixture generator, relative to the repository root.
const FIXTURE_SCRIPT: &str = "scripts/gen_fixtures.py";

/// Environment variable naming the Python that `fixtures` runs when `--python` is not given.
const FIXTURE_PYTHON_ENV: &str = "VAE_FIXTURES_PYTHON";

fn main() -> anyhow::Result<()> {
    let task = std::env::args().nth(1);
    match task.as_deref() {
        Some("ci") => ci(),
        Some("bench") => bench::bench(std::env::args().skip(2)),
        Some("kernels") => kernels::kernels(&repo_root()),
        Some("kernels-emu") => kernels_emu::kernels_emu(&repo_root()),
        Some("gpu-emu") => gpu_emu::gpu_emu(&repo_root()),
        Some("fixtures") => fixtures(std::env::args().skip(2)),
        Some("wheel") => wheel::wheel(&repo_root(), std::env::args().skip(2)),
        Some("fuzz") => fuzz(std::env::args().skip(2)),
        Some("-h" | "--help") | None => {
            println!("{USAGE}");
            Ok(())
        }
        Some(other) => bail!("unknown task {other:?}\n{USAGE}"),
    }
}

/// Runs `program` with `args`, failing unless it exits successfully.
fn run(program: &str, args: &[&str]) -> anyhow::Result<()> {
    eprintln!("$ {program} {}", args.join(" "));
    let status = Command::new(program).args(args).status().with_context(|| format!("starting {program}"))?;
    if !status.success() {
        bail!("{program} {} failed with {status}", args.join(" "));
    }
    Ok(())
}

/// Runs the `cargo` that started this task (or `cargo` from `PATH`).
fn cargo(args: &[&str]) -> anyhow::Result<()> {
    run(&std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()), args)
}

/// Formatting, clippy with warnings denied, and the test suite.
fn ci() -> anyhow::Result<()> {
    cargo(&["fmt", "--all", "--", "--check"])?;
    cargo(&["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"])?;
    cargo(&["test", "--workspace"])
}

/// The fuzz targets (`fuzz_*` property tests) with many cases each, in release mode.
fn fuzz(mut args: impl Iterator<Item = String>) -> anyhow::Result<()> {
    let mut cases: u64 = 200_000;
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--cases" => cases = args.next().context("--cases needs a number")?.parse().context("--cases")?,
            other => bail!("unknown argument {other:?} to fuzz\n{USAGE}"),
        }
    }
    let started = std::time::Instant::now();
    let runs: [&[&str]; 3] = [
        &["test", "--release", "-p", "vae-integration-tests", "--test", "fuzz"],
        &["test", "--release", "-p", "vae-transport", "--lib", "fuzz_"],
        &["test", "--release", "-p", "vae-runtime", "--lib", "fuzz_"],
    ];
    let program = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    for args in runs {
        eprintln!("$ PROPTEST_CASES={cases} cargo {}", args.join(" "));
        let status = Command::new(&program)
            .args(args)
            .env("PROPTEST_CASES", cases.to_string())
            .status()
            .with_context(|| format!("starting {program}"))?;
        if !status.success() {
            bail!("fuzz targets failed: cargo {}", args.join(" "));
        }
    }
    // Seven targets: npy, PNG, config.json, safetensors, wire reader (integration tests),
    // socket frames and hellos (vae-transport), tile summaries (vae-runtime).
    println!("fuzz: 7 targets x {cases} cases, no failure, {:.0} s", started.elapsed().as_secs_f64());
    Ok(())
}

/// The repository root (the parent of this crate's directory).
fn repo_root() -> PathBuf {
    let xtask_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    xtask_dir.parent().unwrap_or(xtask_dir).to_path_buf()
}

/// Regenerates the diffusers fixtures: checks the pinned packages, then runs the generator.
fn fixtures(mut args: impl Iterator<Item = String>) -> anyhow::Result<()> {
    let mut python = None;
    let mut out = None;
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--python" => python = Some(args.next().context("--python needs a path")?),
            "--out" => out = Some(args.next().context("--out needs a directory")?),
            other => bail!("unknown argument {other:?} to fixtures\n{USAGE}"),
        }
    }
    let python = python
        .or_else(|| std::env::var(FIXTURE_PYTHON_ENV).ok().filter(|p| !p.is_empty()))
        .unwrap_or_else(|| "python3".into());
    let root = repo_root();
    check_fixture_python(&python, &root)?;

    let script = root.join(FIXTURE_SCRIPT);
    let mut cmd = Command::new(&python);
    cmd.arg(&script).current_dir(&root);
    if let Some(out) = &out {
        cmd.arg(out);
    }
    eprintln!("$ {python} {} {}", script.display(), out.as_deref().unwrap_or(""));
    let status = cmd.status().with_context(|| format!("starting {python}"))?;
    if !status.success() {
        bail!("{FIXTURE_SCRIPT} failed with {status}");
    }
    Ok(())
}

/// The `name==version` pins of the requirements file, comments and blank lines skipped.
fn parse_pins(text: &str) -> anyhow::Result<Vec<(String, String)>> {
    let mut pins = Vec::new();
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let (name, version) =
            line.split_once("==").with_context(|| format!("{FIXTURE_REQUIREMENTS}: {line:?} is not name==version"))?;
        pins.push((name.trim().to_owned(), version.trim().to_owned()));
    }
    Ok(pins)
}

/// Checks that `python` imports every pinned package at exactly its pinned version.
fn check_fixture_python(python: &str, root: &Path) -> anyhow::Result<()> {
    let requirements = root.join(FIXTURE_REQUIREMENTS);
    let text = std::fs::read_to_string(&requirements).with_context(|| format!("reading {}", requirements.display()))?;
    let pins = parse_pins(&text)?;

    // Arguments: name, version, name, version, ... Prints one line per problem; exit 1 if any.
    const CHECK: &str = r#"
import importlib, importlib.metadata as md, sys
bad = []
a = sys.argv[1:]
for name, want in zip(a[0::2], a[1::2]):
    try:
        importlib.import_module(name.replace("-", "_"))
        have = md.version(name)
    except Exception as e:
        bad.append(f"{name}=={want}: not importable ({type(e).__name__}: {e})")
        continue
    if have.split("+")[0] != want:
        bad.append(f"{name}=={want}: found {have}")
print("\n".join(bad))
sys.exit(1 if bad else 0)
"#;
    let mut cmd = Command::new(python);
    cmd.arg("-c").arg(CHECK);
    for (name, version) in &pins {
        cmd.arg(name).arg(version);
    }
    let output = cmd.output().with_context(|| {
        format!(
            "starting {python:?} (set --python or ${FIXTURE_PYTHON_ENV} to a Python with {})",
            requirements.display()
        )
    })?;
    if !output.status.success() {
        bail!(
            "{python} lacks the packages pinned in {} (install them with `{python} -m pip install -r {FIXTURE_REQUIREMENTS}`, \
             or pass --python / set ${FIXTURE_PYTHON_ENV}):\n{}{}",
            requirements.display(),
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr),
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse_pins;

    #[test]
    fn pins_skip_comments_and_blanks() {
        let pins = parse_pins("# c\n\ntorch==2.15.0  # cpu\n diffusers == 0.38.0\n").unwrap();
        assert_eq!(pins, [("torch".to_owned(), "2.15.0".to_owned()), ("diffusers".to_owned(), "0.38.0".to_owned())]);
        assert!(parse_pins("numpy>=2\n").is_err());
    }
}
