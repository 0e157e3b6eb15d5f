//! Repository tasks, run as `cargo xtask <task>`.
//!
//! - `ci`: what `.ci/run` checks — formatting, clippy with warnings denied, the test suite.
//! - `bench [--python PATH] [--iters N] [--decode-only | --no-decode]`: the transport and
//!   failure-detection benchmarks of the CLI and the demo, in release mode, for the rank counts
//!   the reports quote; then the decode comparison with diffusers (`docs/benchmarks.md`): an SD
//!   geometry VAE with random weights (`scripts/bench_diffusers.py`), 256² and 512² outputs, 1
//!   and 2 threads, diffusers and `vae-parallel bench decode` back to back per configuration,
//!   printed as a table. The Python is `--python`, else `$VAE_FIXTURES_PYTHON`, else
//!   `/work/venv-fixtures/bin/python` if it exists; without one (or without diffusers) the
//!   comparison is skipped with a message.
//! - `kernels`: compiles `kernels-cu/*.cu` with NVRTC (no GPU, no CUDA install: NVIDIA's pip
//!   wheels in a venv under `target/`) to PTX and an `sm_90` cubin in `target/kernels/`, and fails
//!   on a compile error, a warning or a register spill (see `kernels.rs`).
//! - `kernels-emu`: compiles the same kernels for the CPU with the emulation layer in
//!   `kernels-cu/emu/` and runs each kernel's test against a naive reference (see
//!   `kernels_emu.rs`).
//! - `gpu-emu`: builds a fake `libcuda.so` on the same emulation layer and runs the CUDA
//!   backend's GPU tests against it, with no GPU (see `gpu_emu.rs`).
//! - `fixtures [--python PATH] [--out DIR]`: regenerates the diffusers ground-truth fixtures
//!   (`fixtures/autoencoder_kl/`, `fixtures/wan/`, `fixtures/qwen_image/`) with `scripts/gen_fixtures.py`, after checking that the Python
//!   has the packages pinned in `scripts/requirements-fixtures.txt`. The Python is `--python`, else
//!   `$VAE_FIXTURES_PYTHON`, else `python3`.

#![allow(clippy::print_stdout, clippy::print_stderr)] // a terminal tool

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

mod gpu_emu;
mod kernels;
mod kernels_emu;

const USAGE: &str = "usage: cargo xtask <ci | kernels | kernels-emu | gpu-emu | bench [--python PATH] [--iters N] [--decode-only | --no-decode] \
                     | fixtures [--python PATH] [--out DIR]>";

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
        Some("bench") => bench(std::env::args().skip(2)),
        Some("kernels") => kernels::kernels(&repo_root()),
        Some("kernels-emu") => kernels_emu::kernels_emu(&repo_root()),
        Some("gpu-emu") => gpu_emu::gpu_emu(&repo_root()),
        Some("fixtures") => fixtures(std::env::args().skip(2)),
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

/// The decode benchmark's script, relative to the repository root.
const BENCH_SCRIPT: &str = "scripts/bench_diffusers.py";

/// Where the decode benchmark's model and latents go, relative to the repository root.
const BENCH_MODEL_DIR: &str = "target/bench-models/sd_geometry";

/// The Python tried when neither `--python` nor `$VAE_FIXTURES_PYTHON` names one.
const DEFAULT_BENCH_PYTHON: &str = "/work/venv-fixtures/bin/python";

/// Output sizes (pixels) and thread counts of the decode comparison.
const BENCH_SIZES: [u32; 2] = [256, 512];
const BENCH_THREADS: [u32; 2] = [1, 2];

/// The transport and failover benchmarks and the demo, then the decode comparison with
/// diffusers, in release mode.
fn bench(mut args: impl Iterator<Item = String>) -> anyhow::Result<()> {
    let (mut python, mut iters, mut transport, mut decode) = (None, 3usize, true, true);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--python" => python = Some(args.next().context("--python needs a path")?),
            "--iters" => iters = args.next().context("--iters needs a number")?.parse().context("--iters")?,
            "--decode-only" => transport = false,
            "--no-decode" => decode = false,
            other => bail!("unknown argument {other:?} to bench\n{USAGE}"),
        }
    }
    let root = repo_root();
    std::env::set_current_dir(&root).with_context(|| format!("entering {}", root.display()))?;
    cargo(&["build", "--release", "-p", "vae-parallel"])?;
    let exe = "target/release/vae-parallel";
    if transport {
        transport_benches(exe)?;
    }
    if decode {
        decode_comparison(exe, python, iters)?;
    }
    Ok(())
}

/// The transport and failover benchmarks and the demo.
fn transport_benches(exe: &str) -> anyhow::Result<()> {
    for (transport, ranks) in [("socket", "2"), ("socket", "4"), ("local", "4")] {
        run(exe, &["bench", "transport", "--transport", transport, "--ranks", ranks, "--mib", "32", "--iters", "5"])?;
    }
    for transport in ["socket", "local"] {
        run(exe, &["bench", "failover", "--transport", transport, "--ranks", "4"])?;
    }
    run(exe, &["demo", "--ranks", "4", "--work-ms", "20"])
}

/// Runs `cmd`, echoing it and its stdout to stderr, and returns its stdout (stderr passes through).
fn capture(cmd: &mut Command) -> anyhow::Result<String> {
    eprintln!("$ {cmd:?}");
    let output = cmd.stderr(std::process::Stdio::inherit()).output().with_context(|| format!("starting {cmd:?}"))?;
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    eprint!("{stdout}"); // the raw JSON lines, as they come
    if !output.status.success() {
        bail!("{cmd:?} failed with {}", output.status);
    }
    Ok(stdout)
}

/// A numeric field of a flat JSON object line (`"key": 1.5` or `"key":1.5`).
fn json_number(line: &str, key: &str) -> Option<f64> {
    let start = line.find(&format!("\"{key}\""))? + key.len() + 2;
    let rest = line[start..].trim_start().strip_prefix(':')?.trim_start();
    let end = rest.find(|c: char| !(c.is_ascii_digit() || "+-.eE".contains(c))).unwrap_or(rest.len());
    rest[..end].parse().ok()
}

/// The last line of `stdout` that is a JSON object of the given `"kind"`.
fn json_line<'a>(stdout: &'a str, kind: &str) -> anyhow::Result<&'a str> {
    stdout
        .lines()
        .rev()
        .find(|l| {
            l.trim_start().starts_with('{')
                && (l.contains(&format!("\"kind\": \"{kind}\"")) || l.contains(&format!("\"kind\":\"{kind}\"")))
        })
        .with_context(|| format!("no {kind:?} JSON line in:\n{stdout}"))
}

/// One side's numbers for one configuration.
struct Measured {
    best_ms: f64,
    median_ms: f64,
    decode_rss_mib: f64,
    peak_rss_mib: f64,
    peak_tensor_mib: Option<f64>,
}

fn measured(line: &str) -> anyhow::Result<Measured> {
    let get = |key: &str| json_number(line, key).with_context(|| format!("no number {key:?} in {line}"));
    Ok(Measured {
        best_ms: get("best_ms")?,
        median_ms: get("median_ms")?,
        decode_rss_mib: get("decode_rss_mib")?,
        peak_rss_mib: get("peak_rss_mib")?,
        peak_tensor_mib: json_number(line, "peak_tensor_mib"),
    })
}

/// The Python for the decode comparison, or why there is none.
fn bench_python(explicit: Option<String>) -> Result<String, String> {
    if let Some(p) = explicit.or_else(|| std::env::var(FIXTURE_PYTHON_ENV).ok().filter(|p| !p.is_empty())) {
        return Ok(p);
    }
    if Path::new(DEFAULT_BENCH_PYTHON).exists() {
        return Ok(DEFAULT_BENCH_PYTHON.into());
    }
    Err(format!(
        "no Python with diffusers: pass --python or set ${FIXTURE_PYTHON_ENV} (none at {DEFAULT_BENCH_PYTHON})"
    ))
}

/// Decode latency and peak memory of diffusers and of `vae-parallel bench decode`, each
/// configuration's pair run back to back, then a table.
fn decode_comparison(exe: &str, python: Option<String>, iters: usize) -> anyhow::Result<()> {
    let python = match bench_python(python) {
        Ok(p) => p,
        Err(why) => {
            eprintln!("skipping the decode comparison with diffusers: {why}");
            return Ok(());
        }
    };
    if let Err(err) = check_fixture_python(&python, &repo_root()) {
        eprintln!("skipping the decode comparison with diffusers: {err:#}");
        return Ok(());
    }
    let script = |extra: &[&str]| {
        let mut cmd = Command::new(&python);
        cmd.args([BENCH_SCRIPT, "--out", BENCH_MODEL_DIR]).args(extra);
        cmd
    };
    capture(&mut script(&["--prepare-only"]))?;
    let iters_arg = iters.to_string();
    let mut rows = Vec::new();
    for size in BENCH_SIZES {
        let latent = format!("{BENCH_MODEL_DIR}/z_{size}.npy");
        for threads in BENCH_THREADS {
            let (s, t) = (size.to_string(), threads.to_string());
            let theirs = capture(&mut script(&["--sizes", &s, "--threads", &t, "--iters", &iters_arg]))?;
            let theirs = measured(json_line(&theirs, "decode")?)?;
            let ours = capture(Command::new(exe).args([
                "bench",
                "decode",
                "--model",
                BENCH_MODEL_DIR,
                "--latent",
                &latent,
                "--iters",
                &iters_arg,
                "--threads",
                &t,
                "--json",
            ]))?;
            let ours = measured(json_line(&ours, "decode")?)?;
            rows.push((size, threads, theirs, ours));
        }
    }
    println!();
    println!(
        "decode, SD geometry (128,256,512,512; 2 layers/block), random weights, untiled; best of {iters} after a warm-up"
    );
    println!(
        "{:>5}  {:>3}  {:>17}  {:>17}  {:>6}  {:>6}  {:>21}  {:>21}  {:>9}",
        "size", "thr", "diffusers ms", "ours ms", "ratio", "(med)", "diffusers RSS MiB", "ours RSS MiB", "ours tens"
    );
    println!(
        "{:>5}  {:>3}  {:>17}  {:>17}  {:>6}  {:>6}  {:>21}  {:>21}  {:>9}",
        "", "", "best / median", "best / median", "best", "", "decode Δ / peak", "decode Δ / peak", "peak MiB"
    );
    for (size, threads, d, o) in &rows {
        println!(
            "{:>5}  {threads:>3}  {:>17}  {:>17}  {:>6.2}  {:>6.2}  {:>21}  {:>21}  {:>9}",
            format!("{size}²"),
            format!("{:.0} / {:.0}", d.best_ms, d.median_ms),
            format!("{:.0} / {:.0}", o.best_ms, o.median_ms),
            o.best_ms / d.best_ms,
            o.median_ms / d.median_ms,
            format!("{:.0} / {:.0}", d.decode_rss_mib, d.peak_rss_mib),
            format!("{:.0} / {:.0}", o.decode_rss_mib, o.peak_rss_mib),
            o.peak_tensor_mib.map_or("-".into(), |m| format!("{m:.0}")),
        );
    }
    println!("ratio = ours / diffusers latency (project goal: ≤ 0.8). RSS: decode Δ = peak resident set during the");
    println!("decodes minus the resident set after loading; peak = the process' whole high-water mark. Tensor peak:");
    println!("vae-tensor's high-water mark of live tensor bytes, weights included.");
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
    use super::{json_number, parse_pins};

    #[test]
    fn json_numbers_of_flat_lines() {
        let line = r#"{"kind": "decode", "best_ms": 12.5, "median_ms":1e3, "peak_rss_mib": -2}"#;
        assert_eq!(json_number(line, "best_ms"), Some(12.5));
        assert_eq!(json_number(line, "median_ms"), Some(1000.0));
        assert_eq!(json_number(line, "peak_rss_mib"), Some(-2.0));
        assert_eq!(json_number(line, "kind"), None);
        assert_eq!(json_number(line, "absent"), None);
    }

    #[test]
    fn pins_skip_comments_and_blanks() {
        let pins = parse_pins("# c\n\ntorch==2.15.0  # cpu\n diffusers == 0.38.0\n").unwrap();
        assert_eq!(pins, [("torch".to_owned(), "2.15.0".to_owned()), ("diffusers".to_owned(), "0.38.0".to_owned())]);
        assert!(parse_pins("numpy>=2\n").is_err());
    }
}
