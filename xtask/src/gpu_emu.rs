//! `cargo xtask gpu-emu`: the CUDA backend's GPU tests, run on the CPU through a fake driver.
//!
//! Builds `kernels-cu/emu/fake_driver/` into `target/gpu-emu/*/lib/libcuda.so`: the slice of the
//! CUDA driver API that cudarc calls, whose launches run the unchanged `kernels-cu/*.cu`, compiled
//! for the host against the kernel emulator (`kernels-cu/emu/`). Each kernel is registered by a
//! generated translation unit that includes its `.cu` file and names every kernel the compiled
//! object defines (the same `nm` reading as `kernels-emu`), so no list is kept by hand. Then the
//! GPU test binaries run with that library first on the loader's path: cudarc loads it as the
//! driver, and the Rust side of the backend (launch configurations, argument lists, memory,
//! dtype dispatch, the models on CUDA) executes for real.
//!
//! Two builds of the fake, both optimised for this CPU and running a block's threads as fibers
//! (see `kernels-cu/emu/runtime.cpp`): `checked`, with AddressSanitizer and UBSan (their runtime
//! preloaded into the test binaries, which cargo therefore does not run itself), where device
//! memory comes from the sanitized allocator so that a launch reading or writing past a tensor
//! fails at the access; and `fast`, without them, for the end-to-end model tests (every fixture
//! model decoded and encoded on the device), which would take four times as long checked. The
//! op-level suites run checked on the sm_90 image (memory safety of every kernel and launch),
//! then fast on the compute_80 one (what the compute capability changes: the PTX loaded, the
//! kernels the backend picks).
//!
//! `FAKE_CUDA_DEVICE_COUNT` makes the fake report several identical devices, and
//! `kernels-cu/emu/fake_nccl/` is a fake `libnccl.so` (fast build only, next to its
//! `libcuda.so`): the NCCL calls cudarc makes, between ranks that are threads or processes,
//! over Unix-domain sockets, on the fake devices' memory. With four devices,
//! `vae-transport --test nccl` runs the NCCL transport at every world size from 1 to 4 and across
//! two processes; with three, the models shard over NCCL; with two, the CLI decodes over NCCL
//! with a rank process per device.
//!
//! `kernels-cu/emu/fake_cudnn/` is a fake `libcudnn.so` (fast build only, beside the fake NCCL):
//! the cuDNN calls of the backend's cuDNN convolutions, computed on the host from the
//! descriptors and checked against what the backend promises (layouts, types, workspaces,
//! buffers). The model tests run a second time with `VAE_CUDA_CONV=cudnn`, every convolution on
//! it. `VAE_GPU_EMU_ONLY=package/target[,...]` (`+cudnn` for that second pass) runs only the
//! suites named, for a quicker check of one.
//!
//! A GPU test that prints "skipped" fails the run, as in `scripts/gpu-check.sh` (only the tests
//! that need no GPU may say "this machine has a usable GPU").

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Instant, SystemTime};

use anyhow::{Context, bail};

use crate::kernels_emu::{
    KERNEL_DIR, compile_all, compiler, defined_kernels, files_with_extension, include_flags, newest_input,
};

/// Objects, generated registries and the library, relative to the repository root.
const OUT_DIR: &str = "target/gpu-emu";

/// The fake driver's sources, relative to the repository root.
const DRIVER_DIR: &str = "kernels-cu/emu/fake_driver";
/// The fake NCCL's sources, relative to the repository root.
const NCCL_DIR: &str = "kernels-cu/emu/fake_nccl";
/// The fake cuDNN's sources, relative to the repository root.
const CUDNN_DIR: &str = "kernels-cu/emu/fake_cudnn";
/// Host stand-ins for kernels, per `.cu` file (`<stem>.h`), relative to the kernels folder.
const DRIVER_STAND_INS: &str = "emu/fake_driver/stand_ins";

/// Flags of every compile and of the link. As `kernels-emu` (no contraction into fused
/// multiply-adds, so `-march=native` only makes `fmaf` one instruction), position-independent,
/// exporting only the driver API.
const FLAGS: [&str; 13] = [
    "-std=c++20",
    "-O2",
    "-g",
    "-march=native",
    "-pthread",
    "-fPIC",
    "-fvisibility=hidden",
    "-fvisibility-inlines-hidden",
    "-ffp-contract=off",
    "-Wall",
    "-Wextra",
    "-Werror",
    "-Wno-unknown-pragmas", // `#pragma unroll`
];

/// A build of the fake driver: its directory under [`OUT_DIR`] and its extra flags.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Flavor {
    /// AddressSanitizer and UBSan on the driver and the kernels.
    Checked,
    /// No sanitizers: four times faster.
    Fast,
}

impl Flavor {
    fn name(self) -> &'static str {
        match self {
            Flavor::Checked => "checked",
            Flavor::Fast => "fast",
        }
    }

    fn flags(self) -> &'static [&'static str] {
        match self {
            Flavor::Checked => &["-fsanitize=address,undefined", "-fno-sanitize-recover=all"],
            Flavor::Fast => &[],
        }
    }
}

/// One run of a GPU test binary.
struct Suite {
    package: &'static str,
    /// The test target (`lib`: the library's unit tests).
    target: &'static str,
    /// A test-name filter: the conformance suites run their CPU instantiation too, only their
    /// `cuda::` tests matter here.
    filter: Option<&'static str>,
    flavor: Flavor,
    /// The compute capability the fake reports (`FAKE_CUDA_COMPUTE_CAPABILITY`): on 9.0 the
    /// backend loads the sm_90 cubins, on 8.0 the compute_80 PTX, as on an A100.
    compute_capability: &'static str,
    /// How many devices the fake reports (`FAKE_CUDA_DEVICE_COUNT`).
    devices: usize,
    /// Extra environment of the run (the second pass of the model tests forces cuDNN's
    /// convolutions through `VAE_CUDA_CONV`).
    env: &'static [(&'static str, &'static str)],
}

const fn suite(
    package: &'static str,
    target: &'static str,
    filter: Option<&'static str>,
    flavor: Flavor,
    compute_capability: &'static str,
    devices: usize,
) -> Suite {
    Suite { package, target, filter, flavor, compute_capability, devices, env: &[] }
}

/// The model tests again with every convolution on the fake cuDNN (`kernels-cu/emu/fake_cudnn/`),
/// which computes each on the host from the descriptors the backend gives it and checks them:
/// the cuDNN path's layouts, types, workspaces and buffers, against the same fixtures and
/// tolerances as our kernels, and its bit-identity across rank counts (the shard and tile tests).
const CUDNN_MODELS: Suite = Suite {
    package: "vae-integration-tests",
    target: "cuda_models",
    filter: None,
    flavor: Flavor::Fast,
    compute_capability: "9.0",
    devices: 3,
    env: &[("VAE_CUDA_CONV", "cudnn")],
};

/// The runs of the GPU test binaries. The op-level suites run checked against the sm_90 image
/// and fast against the compute_80 one (the same kernels, already checked), the model, CLI and
/// NCCL tests fast. The NCCL tests run every world size up to the
/// device count (one rank per device, as NCCL requires) and two rank processes; the models
/// shard over NCCL on up to three devices; the CLI decodes over NCCL on two. The model tests run
/// twice: on our kernels, then with every convolution on the fake cuDNN ([`CUDNN_MODELS`]).
/// The DLPack device tests (`cuda_dlpack`: the tensor layer's checked, the facade's fast) read
/// the fake's count of host copies (`fake_cuda_host_copies`) to prove a path made none.
const SUITES: [Suite; 17] = [
    suite("vae-tensor", "lib", None, Flavor::Checked, "9.0", 1),
    // The cuDNN wrapper's tests again where the fake cuDNN is (the fast build): its refusals.
    suite("vae-tensor", "lib", Some("cuda::backend::cudnn::"), Flavor::Fast, "9.0", 1),
    suite("vae-tensor", "cuda_dlpack", None, Flavor::Checked, "9.0", 1),
    suite("vae-tensor", "cuda_kernels", None, Flavor::Checked, "9.0", 1),
    suite("vae-tensor", "cuda_ops", None, Flavor::Checked, "9.0", 1),
    suite("vae-tensor", "conformance", Some("cuda::"), Flavor::Checked, "9.0", 1),
    suite("vae-tensor", "conformance_video", Some("cuda::"), Flavor::Checked, "9.0", 1),
    suite("vae-tensor", "cuda_kernels", None, Flavor::Fast, "8.0", 1),
    suite("vae-tensor", "cuda_ops", None, Flavor::Fast, "8.0", 1),
    suite("vae-tensor", "conformance", Some("cuda::"), Flavor::Fast, "8.0", 1),
    suite("vae-tensor", "conformance_video", Some("cuda::"), Flavor::Fast, "8.0", 1),
    suite("vae-integration-tests", "cuda_models", None, Flavor::Fast, "9.0", 3),
    suite("vae-integration-tests", "cuda_dlpack", None, Flavor::Fast, "9.0", 1),
    CUDNN_MODELS,
    suite("vae-parallel", "cuda_cli", None, Flavor::Fast, "9.0", 2),
    suite("vae-transport", "nccl", None, Flavor::Fast, "9.0", 4),
    suite("vae-transport", "nccl_device", None, Flavor::Fast, "9.0", 4),
];

/// Builds the fake driver, then runs every GPU test binary against it.
pub fn gpu_emu(root: &Path) -> anyhow::Result<()> {
    require_fresh_kernels(root)?;
    let start = Instant::now();
    let registries = generate_registries(root)?;
    let libraries = [Flavor::Checked, Flavor::Fast]
        .into_iter()
        .map(|flavor| Ok((flavor, build_fake_driver(root, &registries, flavor)?)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let fast = &libraries.iter().find(|(f, _)| *f == Flavor::Fast).context("no fast build")?.1;
    build_fake_library(root, fast, NCCL_DIR, "libnccl.so")?;
    build_fake_library(root, fast, CUDNN_DIR, "libcudnn.so")?;
    eprintln!("fake driver, NCCL and cuDNN built in {:.1} s", start.elapsed().as_secs_f64());
    let binaries = build_tests(root)?;
    let asan = sanitizer_runtime()?;
    let (mut passed, mut problems) = (0, Vec::new());
    // `VAE_GPU_EMU_ONLY=package/target[,...]` runs those suites alone (a quicker check of one).
    let only = std::env::var("VAE_GPU_EMU_ONLY").ok();
    let wanted = |s: &Suite| {
        let name = format!("{}/{}{}", s.package, s.target, if s.env.is_empty() { "" } else { "+cudnn" });
        only.as_deref().is_none_or(|o| o.split(',').any(|w| w.trim() == name))
    };
    for suite in SUITES.iter().filter(|s| wanted(s)) {
        let Suite { package, target, flavor, compute_capability, devices, env, .. } = *suite;
        let (binary, dir) = binaries
            .iter()
            .find(|b| b.package == package && b.target == target)
            .map(|b| (&b.executable, &b.dir))
            .with_context(|| format!("cargo built no test binary {package}/{target}"))?;
        let lib_dir = &libraries.iter().find(|(f, _)| *f == flavor).context("a flavor without a build")?.1;
        let preload = (flavor == Flavor::Checked).then_some(asan.as_path());
        let start = Instant::now();
        let run = run_suite(binary, dir, suite, lib_dir, preload)?;
        let forced = env.iter().map(|(k, v)| format!(", {k}={v}")).collect::<String>();
        let what =
            format!("{package}/{target} on compute capability {compute_capability}, {devices} device(s){forced}");
        eprintln!("{what}: {} passed in {:.1} s", run.passed, start.elapsed().as_secs_f64());
        passed += run.passed;
        problems.extend(run.problems.into_iter().map(|p| format!("{what}: {p}")));
    }
    if !problems.is_empty() {
        bail!("GPU tests under the fake driver failed:\n  {}", problems.join("\n  "));
    }
    eprintln!("gpu-emu: {passed} test runs passed under the fake driver, none skipped");
    Ok(())
}

/// The embedded kernels must be those of the current sources: the test binaries embed
/// `target/kernels/`, the fake runs `kernels-cu/`.
fn require_fresh_kernels(root: &Path) -> anyhow::Result<()> {
    let kernels = root.join(KERNEL_DIR);
    let mut sources = files_with_extension(&kernels, "cu")?;
    sources.extend(files_with_extension(&kernels, "cuh")?);
    let newest_source = sources.iter().map(|s| modified(s)).collect::<anyhow::Result<Vec<_>>>()?.into_iter().max();
    for cu in files_with_extension(&kernels, "cu")? {
        let stem = cu.file_stem().context("kernel file name")?.to_string_lossy().into_owned();
        let arch = if stem.ends_with(crate::kernels::SM90A_SUFFIX) { "sm_90a" } else { "sm_90" };
        let cubin = root.join(crate::kernels::OUT_DIR).join(format!("{stem}.{arch}.cubin"));
        if !modified(&cubin).is_ok_and(|m| Some(m) >= newest_source) {
            bail!("{} is missing or older than {KERNEL_DIR}/: run `cargo xtask kernels` first", cubin.display());
        }
    }
    Ok(())
}

fn modified(path: &Path) -> anyhow::Result<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).with_context(|| format!("reading {}", path.display()))
}

/// Writes a registry translation unit per `kernels-cu/*.cu` (see [`registry_source`]), after
/// compiling each .cu alone to read its kernels' names from the object.
fn generate_registries(root: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let cxx = compiler()?;
    let kernels = root.join(KERNEL_DIR);
    let out = root.join(OUT_DIR);
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let mut args: Vec<String> = FLAGS.iter().map(|f| f.to_string()).collect();
    args.extend(include_flags(&kernels));
    let named: Vec<(PathBuf, PathBuf)> = files_with_extension(&kernels, "cu")?
        .iter()
        .map(|cu| Ok((cu.clone(), out.join(format!("{}.names.o", stem(cu)?)))))
        .collect::<anyhow::Result<_>>()?;
    compile_all(&cxx, &args, &named, newest_input(root)?)?;
    let mut registries = Vec::new();
    for (cu, names_object) in &named {
        let names = defined_kernels(names_object)?;
        if names.is_empty() {
            bail!("{} defines no extern \"C\" kernel", cu.display());
        }
        let registry = out.join(format!("registry_{}.cpp", stem(cu)?));
        write_if_changed(&registry, &registry_source(cu, &names))?;
        registries.push(registry);
    }
    Ok(registries)
}

/// Compiles and links one build of the fake driver; returns the directory holding its
/// `libcuda.so` (and, for the fast build, the fake `libnccl.so`: nothing else, so that it can
/// lead the loader's path).
fn build_fake_driver(root: &Path, registries: &[PathBuf], flavor: Flavor) -> anyhow::Result<PathBuf> {
    let cxx = compiler()?;
    let kernels = root.join(KERNEL_DIR);
    let out = root.join(OUT_DIR).join(flavor.name());
    let lib_dir = out.join("lib");
    std::fs::create_dir_all(&lib_dir).with_context(|| format!("creating {}", lib_dir.display()))?;
    let driver = root.join(DRIVER_DIR);
    let mut args: Vec<String> = FLAGS.iter().chain(flavor.flags()).map(|f| f.to_string()).collect();
    args.extend(include_flags(&kernels));
    args.push(format!("-I{}", driver.display()));

    // The registries (each compiles its kernels), the emulator's runtime, the driver.
    let mut jobs = Vec::new();
    for registry in registries {
        jobs.push((registry.clone(), out.join(format!("{}.o", stem(registry)?))));
    }
    jobs.push((kernels.join("emu/runtime.cpp"), out.join("runtime.o")));
    for source in files_with_extension(&driver, "cpp")? {
        jobs.push((source.clone(), out.join(format!("driver_{}.o", stem(&source)?))));
    }
    // A rewritten registry is newer than anything under kernels-cu/.
    let mut newest = newest_input(root)?;
    for registry in registries {
        newest = newest.max(modified(registry)?);
    }
    compile_all(&cxx, &args, &jobs, newest)?;

    let library = lib_dir.join("libcuda.so");
    let status = Command::new(&cxx)
        .args(FLAGS.iter().chain(flavor.flags()))
        .args(["-shared", "-Wl,--no-undefined", "-o"])
        .arg(&library)
        .args(jobs.iter().map(|(_, object)| object))
        .status()
        .with_context(|| format!("starting {cxx}"))?;
    if !status.success() {
        bail!("linking {} failed", library.display());
    }
    Ok(lib_dir)
}

/// Compiles the C++ sources of `dir` and links them into `lib_dir/name` (the fast build's, next
/// to its `libcuda.so`, which the library links against for the device memory it reads and writes,
/// whatever the loader's path says). Only the fast build has the fake NCCL and cuDNN: their tests
/// exercise the backend's logic, not kernels, and both fakes check every buffer's range with the
/// fake driver before they touch it.
fn build_fake_library(root: &Path, lib_dir: &Path, dir: &str, name: &str) -> anyhow::Result<()> {
    let cxx = compiler()?;
    let out = root.join(OUT_DIR).join(Flavor::Fast.name());
    let mut args: Vec<String> = FLAGS.iter().map(|f| f.to_string()).collect();
    args.push(format!("-I{}", root.join(DRIVER_DIR).display()));
    let prefix = name.trim_start_matches("lib").trim_end_matches(".so");
    let jobs = files_with_extension(&root.join(dir), "cpp")?
        .into_iter()
        .map(|source| Ok((source.clone(), out.join(format!("{prefix}_{}.o", stem(&source)?)))))
        .collect::<anyhow::Result<Vec<_>>>()?;
    compile_all(&cxx, &args, &jobs, newest_input(root)?)?;
    let library = lib_dir.join(name);
    let status = Command::new(&cxx)
        .args(FLAGS)
        .args(["-shared", "-Wl,--no-undefined", "-o"])
        .arg(&library)
        .args(jobs.iter().map(|(_, object)| object))
        .arg(format!("-L{}", lib_dir.display()))
        .args(["-lcuda", "-Wl,-rpath,$ORIGIN"])
        .status()
        .with_context(|| format!("starting {cxx}"))?;
    if !status.success() {
        bail!("linking {} failed", library.display());
    }
    Ok(())
}

fn stem(path: &Path) -> anyhow::Result<String> {
    Ok(path.file_stem().with_context(|| format!("no file name in {}", path.display()))?.to_string_lossy().into_owned())
}

/// The translation unit registering the kernels `names` of `cu` with the fake driver.
fn registry_source(cu: &Path, names: &[String]) -> String {
    let mut text = format!(
        "// Generated by `cargo xtask gpu-emu`: the kernels of {} for the fake driver.\n#include \"{}\"\n#include \"registry.h\"\n",
        cu.display(),
        cu.display()
    );
    // Host stand-ins for some of the file's kernels (see `StandIn` in registry.h).
    let stand_ins = cu
        .parent()
        .map(|k| k.join(DRIVER_STAND_INS).join(format!("{}.h", cu.file_stem().unwrap_or_default().to_string_lossy())));
    if let Some(header) = stand_ins.filter(|h| h.is_file()) {
        text.push_str(&format!("#include \"{}\"\n", header.display()));
    }
    text.push('\n');
    for name in names {
        text.push_str(&format!("FAKE_CUDA_KERNEL({name})\n"));
    }
    text
}

fn write_if_changed(path: &Path, text: &str) -> anyhow::Result<()> {
    if std::fs::read_to_string(path).is_ok_and(|old| old == text) {
        return Ok(());
    }
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// A test binary cargo built, and the directory cargo would run it in (its package's).
struct TestBinary {
    package: String,
    /// The test target's name, or `lib` for the library's unit tests.
    target: String,
    executable: PathBuf,
    dir: PathBuf,
}

/// Builds the workspace's test binaries and says where they are. All of them, as `cargo test
/// --workspace` does: a subset would resolve features differently, and CI's test run after this
/// would build everything again.
fn build_tests(root: &Path) -> anyhow::Result<Vec<TestBinary>> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(&cargo);
    cmd.current_dir(root).args(["test", "--workspace", "--no-run", "--message-format=json-render-diagnostics"]);
    eprintln!("$ {cmd:?}");
    let output = cmd.stderr(Stdio::inherit()).output().with_context(|| format!("starting {cargo}"))?;
    if !output.status.success() {
        bail!("building the GPU test binaries failed ({})", output.status);
    }
    Ok(String::from_utf8_lossy(&output.stdout).lines().filter_map(test_binary).collect())
}

/// A `compiler-artifact` message of a test executable: its package, target and paths.
fn test_binary(line: &str) -> Option<TestBinary> {
    if !line.contains(r#""reason":"compiler-artifact""#) || !line.contains(r#""test":true"#) {
        return None;
    }
    let executable = json_string(line, "executable")?;
    let manifest = PathBuf::from(json_string(line, "manifest_path")?);
    let target_json = &line[line.find(r#""target":{"#)?..];
    let target = if target_json.starts_with(r#""target":{"kind":["lib"]"#) {
        "lib".to_string()
    } else {
        json_string(target_json, "name")?
    };
    // `package_id` is `path+file:///dir#name@version` (or `...#version` when the directory is
    // the package's name): the package is the manifest's directory's package.
    let dir = manifest.parent()?.to_path_buf();
    let id = json_string(line, "package_id")?;
    let package = match id.rsplit_once('#')?.1.split_once('@') {
        Some((name, _)) => name.to_string(),
        None => dir.file_name()?.to_string_lossy().into_owned(),
    };
    Some(TestBinary { package, target, executable: executable.into(), dir })
}

/// The first string value of `"key":` in a line of cargo's JSON (paths and names: no escapes
/// but `\\` and `\"`, which these never contain).
fn json_string(line: &str, key: &str) -> Option<String> {
    let start = line.find(&format!("\"{key}\":\""))? + key.len() + 4;
    let len = line[start..].find('"')?;
    Some(line[start..start + len].to_string())
}

/// The AddressSanitizer runtime the compiler links, which must be loaded before anything else.
fn sanitizer_runtime() -> anyhow::Result<PathBuf> {
    let cxx = compiler()?;
    let output = Command::new(&cxx).arg("-print-file-name=libasan.so").output().context("asking for libasan.so")?;
    let path = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
    if !path.is_absolute() || !path.exists() {
        bail!("{cxx} has no shared AddressSanitizer runtime (libasan.so)");
    }
    Ok(path)
}

/// What one test binary's run came to.
struct SuiteRun {
    passed: usize,
    problems: Vec<String>,
}

/// Runs one test binary against the fake driver in `lib_dir` (with the sanitizer runtime
/// `preload` loaded first, for the checked build), echoing its output, and reads it.
fn run_suite(
    binary: &Path,
    dir: &Path,
    suite: &Suite,
    lib_dir: &Path,
    preload: Option<&Path>,
) -> anyhow::Result<SuiteRun> {
    let Suite { filter, compute_capability, devices, env, .. } = *suite;
    let mut path = lib_dir.as_os_str().to_owned();
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
        path.push(":");
        path.push(old);
    }
    let (reader, writer) = std::io::pipe().context("creating a pipe")?;
    let mut cmd = Command::new(binary);
    cmd.current_dir(dir)
        .arg("--nocapture")
        .args(filter)
        .env("LD_LIBRARY_PATH", path)
        .env("FAKE_CUDA_COMPUTE_CAPABILITY", compute_capability)
        .env("FAKE_CUDA_DEVICE_COUNT", devices.to_string())
        // Leak checking needs ptrace, which containers often forbid; the Rust side owns most
        // allocations anyway. Rust installs its own SIGSEGV handler (stack overflows).
        .env("ASAN_OPTIONS", "detect_leaks=0:handle_segv=0")
        .env("UBSAN_OPTIONS", "print_stacktrace=1")
        .envs(env.iter().copied())
        .stdout(writer.try_clone().context("duplicating a pipe")?)
        .stderr(writer);
    if let Some(runtime) = preload {
        cmd.env("LD_PRELOAD", runtime);
    } else {
        // The fast build has the fake cuDNN beside its driver: a cuDNN test that finds no
        // cuDNN there fails rather than checking the fallback only.
        cmd.env("VAE_CUDNN_REQUIRED", "1");
    }
    let forced: String = env.iter().map(|(k, v)| format!("{k}={v} ")).collect();
    eprintln!(
        "$ {forced}FAKE_CUDA_COMPUTE_CAPABILITY={compute_capability} FAKE_CUDA_DEVICE_COUNT={devices} LD_LIBRARY_PATH={} {} \
         --nocapture {}",
        lib_dir.display(),
        binary.display(),
        filter.unwrap_or("")
    );
    let mut child = cmd.spawn().with_context(|| format!("starting {}", binary.display()))?;
    drop(cmd); // the pipe's writing ends: the reader sees the end when the test binary exits
    let mut lines = Vec::new();
    let mut echo = std::io::stderr().lock();
    for line in BufReader::new(reader).lines() {
        let line = line.context("reading the test output")?;
        writeln!(echo, "{line}")?;
        lines.push(line);
    }
    drop(echo);
    let status = child.wait().context("waiting for the tests")?;
    let mut run = read_output(&lines);
    if !status.success() {
        run.problems.push(format!("exited with {status}"));
    }
    Ok(run)
}

/// The passed tests (`test result:` lines) and the problems: a GPU test that was skipped.
fn read_output(lines: &[String]) -> SuiteRun {
    let mut run = SuiteRun { passed: 0, problems: Vec::new() };
    for line in lines {
        if let Some(rest) = line.strip_prefix("test result: ") {
            run.passed += rest
                .split(';')
                .find_map(|part| part.trim().strip_suffix(" passed")?.rsplit(' ').next()?.parse::<usize>().ok())
                .unwrap_or(0);
        }
        if line.contains("skipped") && !line.contains("this machine has a usable GPU") {
            run.problems.push(format!("a GPU test was skipped: {line}"));
        }
    }
    run
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_binaries_are_read_from_cargo_messages() {
        let line = r#"{"reason":"compiler-artifact","package_id":"path+file:///w/crates/vae-tensor#0.1.0","manifest_path":"/w/crates/vae-tensor/Cargo.toml","target":{"kind":["test"],"crate_types":["bin"],"name":"cuda_ops","src_path":"/w/crates/vae-tensor/tests/cuda_ops.rs","edition":"2024","doctest":false,"test":true},"profile":{"test":true},"features":[],"filenames":["/w/target/debug/deps/cuda_ops-1"],"executable":"/w/target/debug/deps/cuda_ops-1","fresh":true}"#;
        let b = test_binary(line).expect("a test binary");
        assert_eq!((b.package.as_str(), b.target.as_str()), ("vae-tensor", "cuda_ops"));
        assert_eq!(b.executable, PathBuf::from("/w/target/debug/deps/cuda_ops-1"));
        assert_eq!(b.dir, PathBuf::from("/w/crates/vae-tensor"));
        let renamed = line.replace("vae-tensor#0.1.0", "tests#vae-integration-tests@0.1.0");
        assert_eq!(test_binary(&renamed).unwrap().package, "vae-integration-tests");
        assert!(test_binary(&line.replace(r#""test":true"#, r#""test":false"#)).is_none());
        let lib = line.replace(r#"{"kind":["test"]"#, r#"{"kind":["lib"]"#);
        assert_eq!(test_binary(&lib).unwrap().target, "lib");
    }

    #[test]
    fn skipped_gpu_tests_fail_and_results_add_up() {
        let lines: Vec<String> = [
            "cuda errors: skipped, this machine has a usable GPU",
            "test result: ok. 7 passed; 0 failed; 0 ignored; 0 measured; 2 filtered out; finished in 1.00s",
            "conv: skipped, no CUDA driver (libcuda.so was not found)",
            "test result: ok. 3 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.10s",
        ]
        .map(String::from)
        .into();
        let run = read_output(&lines);
        assert_eq!(run.passed, 10);
        assert_eq!(run.problems.len(), 1, "{:?}", run.problems);
        assert!(run.problems[0].contains("conv: skipped"));
    }
}
