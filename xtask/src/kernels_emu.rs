//! `cargo xtask kernels-emu`: runs every CUDA kernel of `kernels-cu/` on the CPU, with no GPU.
//!
//! The unchanged `.cu` files compile with the system C++ compiler (`$CXX`, else `c++`, `g++` or
//! `clang++`) against the emulation layer in `kernels-cu/emu/` (blocks run one at a time, each
//! thread an OS thread, and in a second process at the same time a fiber; real barriers and warp
//! exchanges; see `kernels-cu/README.md`), under the
//! address and undefined-behaviour sanitizers, so an out-of-bounds index fails the run. Each
//! `kernels-cu/<stem>.cu` has its tests in `kernels-cu/emu/test_<stem>.cpp`, which includes it: one
//! test per kernel, launched as the Rust backend launches it, against a naive reference. The
//! kernels are found in the compiled test objects (their unmangled `extern "C"` symbols, macro-made
//! ones included) and handed to the harness, which fails on any kernel without a test.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::SystemTime;

use anyhow::{Context, bail};

/// Where the objects and the test binary go, relative to the repository root.
const OUT_DIR: &str = "target/kernels-emu";

/// The kernels, relative to the repository root; the emulator and its tests are in `emu/`.
pub(crate) const KERNEL_DIR: &str = "kernels-cu";

/// Compilers tried, in order, when `$CXX` is not set.
const COMPILERS: [&str; 3] = ["c++", "g++", "clang++"];

/// Flags of every compile and of the link. No contraction into fused multiply-adds: the kernels
/// spell out where they want one (`fmaf`) and where not (`__fmul_rn`, `__fadd_rn`). The
/// sanitizers turn a stray index into a failure at the access.
const FLAGS: [&str; 11] = [
    "-std=c++20",
    "-O2",
    "-g",
    "-pthread",
    "-ffp-contract=off",
    "-fsanitize=address,undefined",
    "-fno-sanitize-recover=all",
    "-Wall",
    "-Wextra",
    "-Werror",
    "-Wno-unknown-pragmas", // `#pragma unroll`
];

/// Builds the emulator's test binary and runs it.
pub fn kernels_emu(root: &Path) -> anyhow::Result<()> {
    let cxx = compiler()?;
    let kernels = root.join(KERNEL_DIR);
    let emu = kernels.join("emu");
    let out = root.join(OUT_DIR);
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;

    let missing: Vec<String> = files_with_extension(&kernels, "cu")?
        .iter()
        .filter_map(|cu| cu.file_stem()?.to_str())
        .filter(|stem| !emu.join(format!("test_{stem}.cpp")).is_file())
        .map(|stem| format!("{KERNEL_DIR}/{stem}.cu (add {KERNEL_DIR}/emu/test_{stem}.cpp)"))
        .collect();
    if !missing.is_empty() {
        bail!("kernel files without emulator tests: {}", missing.join(", "));
    }

    let sources = files_with_extension(&emu, "cpp")?;
    let include = include_flags(&kernels);
    let jobs: Vec<(PathBuf, PathBuf)> = sources
        .iter()
        .map(|source| Ok((source.clone(), out.join(source.file_stem().context("source name")?).with_extension("o"))))
        .collect::<anyhow::Result<_>>()?;
    let args: Vec<String> = FLAGS.iter().map(|f| f.to_string()).chain(include).collect();
    compile_all(&cxx, &args, &jobs, newest_input(root)?)?;
    let objects: Vec<PathBuf> = jobs.into_iter().map(|(_, object)| object).collect();

    let mut names = Vec::new();
    for object in objects.iter().filter(|o| o.file_name().is_some_and(|n| n.to_string_lossy().starts_with("test_"))) {
        names.extend(defined_kernels(object)?);
    }
    let binary = out.join("kernel-tests");
    let link = Command::new(&cxx).args(FLAGS).args(&objects).arg("-o").arg(&binary).status();
    if !link.with_context(|| format!("starting {cxx}"))?.success() {
        bail!("linking {} failed", binary.display());
    }

    // The two ways of running a block's threads as processes at once: the fibers keep one core
    // busy, while a block's OS threads mostly wait on each other's barriers, so they run as two
    // shards beside the fibers. Each process's lines are printed whole when it ends.
    eprintln!(
        "$ {} --fibers | --threads --shard 0/2 | --threads --shard 1/2 <{} kernels>",
        binary.display(),
        names.len()
    );
    let run = |mode: &[&str]| {
        // LeakSanitizer needs ptrace, which containers often forbid; leaks are not what this checks.
        Command::new(&binary)
            .args(mode)
            .args(&names)
            .env("ASAN_OPTIONS", "detect_leaks=0")
            .env("UBSAN_OPTIONS", "print_stacktrace=1")
            .stdout(std::process::Stdio::piped())
            .spawn()
            .with_context(|| format!("running {}", binary.display()))
    };
    let children =
        [run(&["--threads", "--shard", "0/2"])?, run(&["--threads", "--shard", "1/2"])?, run(&["--fibers"])?];
    let mut failed = false;
    for child in children {
        let output = child.wait_with_output().with_context(|| format!("running {}", binary.display()))?;
        print!("{}", String::from_utf8_lossy(&output.stdout));
        failed |= !output.status.success();
    }
    if failed {
        bail!("kernel emulator tests failed");
    }
    Ok(())
}

/// The force-included emulation header and the include directories of every compile: the
/// kernels, the emulator, its stand-ins for CUDA's headers.
pub(crate) fn include_flags(kernels: &Path) -> Vec<String> {
    let emu = kernels.join("emu");
    vec![
        "-include".to_string(),
        emu.join("cuda_emu.h").display().to_string(),
        format!("-I{}", kernels.display()),
        format!("-I{}", emu.display()),
        format!("-I{}", emu.join("include").display()),
    ]
}

/// The newest input of an emulator build: anything under `kernels-cu/`, or the running task
/// (which holds the flags). An object older than this is rebuilt.
pub(crate) fn newest_input(root: &Path) -> anyhow::Result<SystemTime> {
    Ok(newest_mtime(&root.join(KERNEL_DIR))?.max(modified(&std::env::current_exe()?)?))
}

/// Compiles each `(source, object)` of `jobs` (any source as C++, `.cu` included) whose object
/// is older than `newest_input`, as many at once as there are CPUs.
pub(crate) fn compile_all(
    cxx: &str,
    args: &[String],
    jobs: &[(PathBuf, PathBuf)],
    newest_input: SystemTime,
) -> anyhow::Result<()> {
    let parallel = std::thread::available_parallelism().map_or(2, |n| n.get());
    let mut running: Vec<(PathBuf, Child)> = Vec::new();
    for (source, object) in jobs {
        if modified(object).is_ok_and(|m| m >= newest_input) {
            continue;
        }
        if running.len() == parallel {
            finish(running.remove(0))?;
        }
        eprintln!("compiling {}", source.display());
        let child = Command::new(cxx)
            .args(args)
            .args(["-x", "c++", "-c"])
            .arg(source)
            .arg("-o")
            .arg(object)
            .spawn()
            .with_context(|| format!("starting {cxx}"))?;
        running.push((source.clone(), child));
    }
    for job in running {
        finish(job)?;
    }
    Ok(())
}

/// `$CXX`, else the first of [`COMPILERS`] that runs.
pub(crate) fn compiler() -> anyhow::Result<String> {
    if let Some(cxx) = std::env::var("CXX").ok().filter(|c| !c.is_empty()) {
        return Ok(cxx);
    }
    COMPILERS
        .iter()
        .find(|c| Command::new(c).arg("--version").output().is_ok_and(|o| o.status.success()))
        .map(|c| (*c).to_string())
        .with_context(|| format!("no C++ compiler: set $CXX or install one of {}", COMPILERS.join(", ")))
}

/// Waits for one compile, failing if it failed.
fn finish((source, mut child): (PathBuf, Child)) -> anyhow::Result<()> {
    let status = child.wait().with_context(|| format!("compiling {}", source.display()))?;
    if !status.success() {
        bail!("compiling {} failed ({status})", source.display());
    }
    Ok(())
}

/// The files of `dir` (not recursive) ending in `.ext`, sorted.
pub(crate) fn files_with_extension(dir: &Path, ext: &str) -> anyhow::Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.extension().is_some_and(|e| e == ext))
        .collect();
    files.sort();
    Ok(files)
}

fn modified(path: &Path) -> anyhow::Result<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).with_context(|| format!("reading {}", path.display()))
}

/// The latest modification time of any file under `dir`.
fn newest_mtime(dir: &Path) -> anyhow::Result<SystemTime> {
    let mut newest = SystemTime::UNIX_EPOCH;
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        newest = newest.max(if path.is_dir() { newest_mtime(&path)? } else { modified(&path)? });
    }
    Ok(newest)
}

/// The kernels an object defines: its global text symbols that are not mangled C++ names.
pub(crate) fn defined_kernels(object: &Path) -> anyhow::Result<Vec<String>> {
    let nm = std::env::var("NM").unwrap_or_else(|_| "nm".into());
    let output = Command::new(&nm)
        .args(["-g", "--defined-only", "-P"])
        .arg(object)
        .output()
        .with_context(|| format!("running {nm} (binutils) on {}", object.display()))?;
    if !output.status.success() {
        bail!("{nm} failed on {}: {}", object.display(), String::from_utf8_lossy(&output.stderr));
    }
    Ok(parse_nm(&String::from_utf8_lossy(&output.stdout)))
}

/// Parses `nm -P` lines (`name type [value size]`): the `T` symbols without the `_Z` of a
/// mangled C++ name.
fn parse_nm(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let (name, kind) = (fields.next()?, fields.next()?);
            (kind == "T" && !name.starts_with("_Z")).then(|| name.to_string())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::parse_nm;

    #[test]
    fn kernels_are_the_unmangled_text_symbols() {
        let text = "add_f32 T 0000000000000100 0000000000000080\n\
                    _Z9load_f32PKf W 0000000000000000 0000000000000010\n\
                    _ZN3emu6launchEv T 0000000000000200 0000000000000010\n\
                    _ZZ15group_norm_implIfEvE7scratch u 0000000000000000 0000000000000080\n\
                    conv3d_f32 T 0000000000000300 0000000000000400\n";
        assert_eq!(parse_nm(text), ["add_f32", "conv3d_f32"]);
    }
}
