//! `cargo xtask wheel [--profile NAME] [--out DIR]`: the Python package as users install it, one
//! wheel that needs no Rust toolchain: `vae_parallel-<version>-cp39-abi3-manylinux_2_28_x86_64.whl`.
//!
//! It holds the extension (`vae_parallel._native`, abi3: one build for CPython 3.9 and later)
//! with the CUDA backend and its kernels compiled in, the Python sources with their type stubs
//! and `py.typed`, the license files, and the `vae-parallel` command in the wheel's scripts (pip
//! puts it on the environment's PATH). The command is the cargo-built CLI itself, not a Python
//! entry point: the CLI starts its rank processes by re-running its own executable
//! (`launch::launch_processes`), which a console script would make the Python interpreter.
//!
//! Both ELF files are linked by zig (PyPI's `ziglang`, through maturin's `--zig`) against
//! glibc 2.28's symbols, so the wheel is `manylinux_2_28`: every distribution NVIDIA's CUDA 12.9
//! driver supports has glibc 2.28 or newer (RHEL 8, Ubuntu 20.04), PyTorch's wheels ask for the
//! same, and CUDA, NVRTC and NCCL are loaded with `dlopen` when first used (cudarc), so the
//! wheel links nothing of CUDA's. manylinux2014 (glibc 2.17) would only add CentOS 7, which no
//! supported CUDA 12.9 driver runs on.
//!
//! Steps: the CUDA kernels (`cargo xtask kernels`, when `target/kernels/` has none: a build
//! without them runs on the CPU only), a tool venv under `target/wheel-tools` with the pinned
//! [`TOOLS`], maturin's extension wheel and a wheel of the CLI (`-b bin --features command` on
//! the same package, profile, target and zig: the command is the library's `cli::main`, built
//! from the Python package's crate so that every dependency resolves with the extension's
//! features and the release tree compiles once for both), the CLI moved into the first one's
//! `.data/scripts/` (`wheel unpack` / `wheel pack`, which rewrites the RECORD), then `auditwheel
//! show`, which must find the wheel consistent with its `manylinux_2_28_x86_64` tag. The wheel goes to `target/wheels/` (or `--out`).
//!
//! `--profile` is a Cargo profile (default `release`, what users get and what CI checks).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

/// The tools, pinned: maturin builds, zig links for glibc 2.28, `wheel` repacks, auditwheel checks.
pub const TOOLS: [&str; 4] = ["maturin==1.16.0", "ziglang==0.17.1", "wheel==0.48.0", "auditwheel==6.8.2"];

/// The tool venv, relative to the repository root.
const TOOLS_DIR: &str = "target/wheel-tools";

/// Where the finished wheel goes by default, relative to the repository root.
const OUT_DIR: &str = "target/wheels";

/// The platform policy every ELF file in the wheel must meet.
pub const MANYLINUX: &str = "manylinux_2_28";

/// The one target built here (aarch64 needs a Rust standard library this toolchain lacks).
const TARGET: &str = "x86_64-unknown-linux-gnu";

/// The Python package's crate (the extension), relative to the repository root.
const PY_CRATE: &str = "crates/vae-parallel-py/Cargo.toml";

/// Builds the wheel; prints its path, size and auditwheel's report.
pub fn wheel(root: &Path, mut args: impl Iterator<Item = String>) -> anyhow::Result<()> {
    let mut profile = "release".to_string();
    let mut out = root.join(OUT_DIR);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--profile" => profile = args.next().context("--profile needs a Cargo profile name")?,
            "--out" => out = PathBuf::from(args.next().context("--out needs a directory")?),
            other => bail!("unknown argument {other:?} to wheel\n{}", crate::USAGE),
        }
    }
    let started = std::time::Instant::now();
    ensure_kernels(root)?;
    let tools = tools(root)?;
    let staging = root.join("target/wheel-staging").join(&profile);
    if staging.exists() {
        std::fs::remove_dir_all(&staging).with_context(|| format!("clearing {}", staging.display()))?;
    }

    let ext_dir = staging.join("extension");
    let cli_dir = staging.join("cli");
    maturin(root, &tools, &profile, PY_CRATE, &[], &ext_dir)?;
    maturin(root, &tools, &profile, PY_CRATE, &["-b", "bin", "--features", "command"], &cli_dir)?;
    let ext_wheel = only_wheel(&ext_dir)?;
    let cli_wheel = only_wheel(&cli_dir)?;

    // Both unpack to `vae_parallel-<version>/`: the CLI's scripts go into the extension's tree.
    let ext_tree = unpack(&tools, &ext_wheel, &staging.join("unpacked"))?;
    let cli_tree = unpack(&tools, &cli_wheel, &staging.join("unpacked-cli"))?;
    let data = data_dir(&ext_tree)?;
    let scripts = data.join("scripts");
    let cli = data_dir(&cli_tree)?.join("scripts/vae-parallel");
    std::fs::create_dir_all(&scripts)?;
    std::fs::copy(&cli, scripts.join("vae-parallel"))
        .with_context(|| format!("copying the CLI from {}", cli.display()))?;

    std::fs::create_dir_all(&out)?;
    let name = ext_wheel.file_name().context("wheel name")?;
    let finished = out.join(name);
    if finished.exists() {
        std::fs::remove_file(&finished)?;
    }
    tool(&tools, "wheel", &["pack".as_ref(), ext_tree.as_os_str(), "-d".as_ref(), out.as_os_str()])?;
    if !finished.is_file() {
        bail!("wheel pack did not write {}", finished.display());
    }
    audit(&tools, &finished)?;
    let size = std::fs::metadata(&finished)?.len();
    println!(
        "wheel: {} ({:.1} MiB, profile {profile}, {:.0} s)",
        finished.display(),
        size as f64 / (1 << 20) as f64,
        started.elapsed().as_secs_f64()
    );
    std::fs::remove_dir_all(&staging).ok();
    Ok(())
}

/// Runs `cargo xtask kernels` unless `target/kernels/` holds compiled kernels already: the
/// wheel's extension and CLI embed what is there when they build.
fn ensure_kernels(root: &Path) -> anyhow::Result<()> {
    let dir = root.join(crate::kernels::OUT_DIR);
    let compiled = std::fs::read_dir(&dir)
        .map(|entries| {
            entries.filter_map(|e| e.ok()).any(|e| e.file_name().to_string_lossy().ends_with(".sm_90.cubin"))
        })
        .unwrap_or(false);
    if compiled {
        return Ok(());
    }
    eprintln!("no compiled kernels in {}: running the kernels task first", dir.display());
    // A process of its own: the task may re-run itself with the NVRTC library path.
    let status = Command::new(std::env::current_exe()?).arg("kernels").status().context("starting xtask kernels")?;
    if !status.success() {
        bail!("xtask kernels failed ({status}): the wheel would carry no CUDA kernels");
    }
    Ok(())
}

/// The tool venv's `bin/`, made and filled with [`TOOLS`] unless it holds them already.
fn tools(root: &Path) -> anyhow::Result<PathBuf> {
    let venv = root.join(TOOLS_DIR);
    let bin = venv.join("bin");
    let stamp = venv.join("tools.txt");
    let want = TOOLS.join("\n");
    if std::fs::read_to_string(&stamp).is_ok_and(|have| have == want) {
        return Ok(bin);
    }
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    crate::run(&python, &["-m", "venv", venv.to_str().context("venv path")?])?;
    let mut args = vec!["install", "--quiet", "--disable-pip-version-check"];
    args.extend(TOOLS);
    crate::run(bin.join("pip").to_str().context("pip path")?, &args)?;
    std::fs::write(&stamp, want)?;
    Ok(bin)
}

/// A command of the tool venv, run with the venv first on `PATH` (maturin finds zig there as
/// `python -m ziglang`).
fn tool_command(tools: &Path, program: &str) -> anyhow::Result<Command> {
    let mut path = tools.as_os_str().to_owned();
    if let Some(old) = std::env::var_os("PATH") {
        path.push(":");
        path.push(old);
    }
    let mut command = Command::new(tools.join(program));
    command.env("PATH", path).env("VIRTUAL_ENV", tools.parent().context("venv")?);
    Ok(command)
}

/// Runs a tool of the venv, failing unless it succeeds.
fn tool(tools: &Path, program: &str, args: &[&std::ffi::OsStr]) -> anyhow::Result<()> {
    let shown: Vec<_> = args.iter().map(|a| a.to_string_lossy()).collect();
    eprintln!("$ {program} {}", shown.join(" "));
    let status = tool_command(tools, program)?.args(args).status().with_context(|| format!("starting {program}"))?;
    if !status.success() {
        bail!("{program} {} failed with {status}", shown.join(" "));
    }
    Ok(())
}

/// One maturin build of `manifest` into `out`: zig linking for [`MANYLINUX`], stripped.
fn maturin(root: &Path, tools: &Path, profile: &str, manifest: &str, extra: &[&str], out: &Path) -> anyhow::Result<()> {
    let manifest = root.join(manifest);
    let mut args: Vec<&std::ffi::OsStr> = vec!["build".as_ref(), "-m".as_ref(), manifest.as_os_str()];
    for a in ["--profile", profile, "--target", TARGET, "--zig", "--compatibility", MANYLINUX, "--strip", "--out"] {
        args.push(a.as_ref());
    }
    args.push(out.as_os_str());
    args.extend(extra.iter().map(|a| std::ffi::OsStr::new(*a)));
    tool(tools, "maturin", &args)
}

/// The one `.whl` in `dir`.
fn only_wheel(dir: &Path) -> anyhow::Result<PathBuf> {
    let wheels: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "whl"))
        .collect();
    match wheels.as_slice() {
        [one] => Ok(one.clone()),
        other => bail!("expected one wheel in {}, found {}", dir.display(), other.len()),
    }
}

/// Unpacks `wheel` under `into`; returns the tree (`<name>-<version>/`).
fn unpack(tools: &Path, wheel: &Path, into: &Path) -> anyhow::Result<PathBuf> {
    tool(tools, "wheel", &["unpack".as_ref(), wheel.as_os_str(), "-d".as_ref(), into.as_os_str()])?;
    let trees: Vec<PathBuf> = std::fs::read_dir(into)?.filter_map(|e| e.ok().map(|e| e.path())).collect();
    match trees.as_slice() {
        [one] => Ok(one.clone()),
        _ => bail!("{} did not unpack to one folder", wheel.display()),
    }
}

/// The wheel tree's `<name>-<version>.data` folder (named after its `.dist-info`).
fn data_dir(tree: &Path) -> anyhow::Result<PathBuf> {
    for entry in std::fs::read_dir(tree)? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if let Some(stem) = name.strip_suffix(".dist-info") {
            return Ok(tree.join(format!("{stem}.data")));
        }
    }
    bail!("{} has no .dist-info", tree.display())
}

/// `auditwheel show`, printed; fails unless the wheel is consistent with its manylinux tag.
fn audit(tools: &Path, wheel: &Path) -> anyhow::Result<()> {
    let output = tool_command(tools, "auditwheel")?
        .args(["show".as_ref(), wheel.as_os_str()])
        .output()
        .context("starting auditwheel")?;
    let report = String::from_utf8_lossy(&output.stdout);
    println!("$ auditwheel show {}\n{}", wheel.display(), report.trim_end());
    eprint!("{}", String::from_utf8_lossy(&output.stderr));
    let tag = format!("{MANYLINUX}_x86_64");
    // auditwheel wraps its lines: compare with the whitespace folded.
    let folded: String = report.split_whitespace().collect::<Vec<_>>().join(" ");
    if !output.status.success()
        || !folded.contains(&format!("is consistent with the following platform tag: \"{tag}\""))
    {
        bail!("auditwheel does not find {} consistent with {tag}", wheel.display());
    }
    Ok(())
}
