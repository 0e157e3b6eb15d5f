//! `cargo xtask kernels`: compiles every `kernels-cu/*.cu` with NVRTC, with no GPU and no CUDA
//! install, into what the CUDA backend embeds: PTX for each virtual architecture in
//! [`PTX_ARCHS`] and an `sm_90` cubin (files `*_sm90a.cu`, Hopper's wgmma: an `sm_90a` cubin only). Then `ptxas -v` reports every kernel's registers and
//! spills, and the task fails on a compile error, a warning, or a spill above
//! [`SPILL_BUDGET_BYTES`].
//!
//! The compiler comes from NVIDIA's pip wheels (pinned in [`WHEELS`]), installed into a venv under
//! `target/` on first use: `libnvrtc.so.12` (loaded through cudarc), the runtime headers that
//! `cuda_bf16.h` and `mma.h` need, and `ptxas`. cudarc finds libraries through the loader's search
//! path, so the task re-runs itself once with the wheel's library folder on `LD_LIBRARY_PATH`.

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use cudarc::nvrtc::{result, sys};

/// NVIDIA's CUDA 12.9 wheels: NVRTC, the runtime headers, and ptxas (PTX 8.8, which the H200's
/// driver 580 accepts; 13.x PTX would be refused by it).
const WHEELS: [&str; 3] =
    ["nvidia-cuda-nvrtc-cu12==12.9.86", "nvidia-cuda-runtime-cu12==12.9.79", "nvidia-cuda-nvcc-cu12==12.9.86"];

/// The venv holding the wheels, relative to the repository root.
const TOOLCHAIN_DIR: &str = "target/cuda-toolchain";

/// Where the PTX, cubins and the register report go, relative to the repository root.
pub const OUT_DIR: &str = "target/kernels";

/// Virtual architectures whose PTX is produced (Ampere and Hopper; the driver JITs newer GPUs).
const PTX_ARCHS: [&str; 2] = ["compute_80", "compute_90"];

/// The real architecture of the shipped cubin (H100 / H200).
const CUBIN_ARCH: &str = "sm_90";

/// Kernel files `<stem>_sm90a.cu` use Hopper-only instructions: they compile for sm_90a alone.
pub const SM90A_SUFFIX: &str = "_sm90a";

/// Spill stores plus loads allowed per kernel, in bytes: none. A spill in these kernels means a
/// register tile too large for the launch bounds, which costs more than it saves.
const SPILL_BUDGET_BYTES: u64 = 0;

/// Set on the re-run with the library path, so a missing library is reported, not looped on.
const REEXEC_ENV: &str = "VAE_XTASK_NVRTC_REEXEC";

/// One kernel's resource use, from `ptxas -v`.
#[derive(Debug, Default)]
struct KernelReport {
    name: String,
    registers: u64,
    spill_bytes: u64,
    shared_bytes: u64,
}

/// Runs the task from the repository root.
pub fn kernels(root: &Path) -> anyhow::Result<()> {
    let nvidia = toolchain(root)?;
    let nvrtc_lib = nvidia.join("cuda_nvrtc/lib");
    // SAFETY: only dlopens candidate library names.
    if !unsafe { sys::is_culib_present() } {
        if std::env::var_os(REEXEC_ENV).is_some() {
            bail!("libnvrtc is not loadable even with {} on LD_LIBRARY_PATH", nvrtc_lib.display());
        }
        let mut path = nvrtc_lib.into_os_string();
        if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
            path.push(":");
            path.push(old);
        }
        let status = Command::new(std::env::current_exe()?)
            .args(std::env::args_os().skip(1))
            .env("LD_LIBRARY_PATH", path)
            .env(REEXEC_ENV, "1")
            .status()
            .context("re-running xtask with the NVRTC library path")?;
        if !status.success() {
            bail!("kernels failed ({status})");
        }
        return Ok(());
    }
    let sources = root.join("kernels-cu");
    let out = root.join(OUT_DIR);
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    // `mma.h` (runtime wheel) includes `crt/mma.h` (nvcc wheel).
    let include_dirs = [sources.clone(), nvidia.join("cuda_runtime/include"), nvidia.join("cuda_nvcc/include")];
    let ptxas = nvidia.join("cuda_nvcc/bin/ptxas");

    let mut files: Vec<PathBuf> = std::fs::read_dir(&sources)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .collect();
    files.sort();
    if files.is_empty() {
        bail!("no .cu files in {}", sources.display());
    }
    // Every (file, architecture) compile is a job, and so is each file's resource report; the
    // jobs run on one worker per core (NVRTC compiles distinct programs on distinct threads),
    // and their results come back in order.
    let sources: Vec<(String, String)> = files
        .iter()
        .map(|file| {
            let stem = file.file_stem().and_then(|s| s.to_str()).context("kernel file name")?.to_string();
            let source = std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
            Ok((stem, source))
        })
        .collect::<anyhow::Result<_>>()?;
    // Hopper-only instructions (wgmma): PTX for compute_90a (for the report) and the sm_90a
    // cubin the backend loads on compute capability 9.0; nothing for other GPUs. The other files:
    // PTX for each of PTX_ARCHS and the CUBIN_ARCH cubin.
    let targets = |stem: &str| -> Vec<(String, bool)> {
        if stem.ends_with(SM90A_SUFFIX) {
            vec![("compute_90a".into(), false), ("sm_90a".into(), true)]
        } else {
            PTX_ARCHS.iter().map(|a| (a.to_string(), false)).chain([(CUBIN_ARCH.to_string(), true)]).collect()
        }
    };
    let jobs: Vec<(usize, String, bool)> = sources
        .iter()
        .enumerate()
        .flat_map(|(i, (stem, _))| targets(stem).into_iter().map(move |(arch, cubin)| (i, arch, cubin)))
        .collect();
    let sizes = parallel(&jobs, |(i, arch, cubin)| {
        let (stem, source) = &sources[*i];
        let bytes = compile(source, stem, &format!("--gpu-architecture={arch}"), &include_dirs, *cubin)?;
        let kind = if *cubin { "cubin" } else { "ptx" };
        std::fs::write(out.join(format!("{stem}.{arch}.{kind}")), &bytes)?;
        Ok(bytes.len())
    })?;
    let reports = parallel(&sources, |(stem, _)| {
        let (arch, ptx) =
            if stem.ends_with(SM90A_SUFFIX) { ("sm_90a", "compute_90a") } else { (CUBIN_ARCH, "compute_90") };
        resource_report(&ptxas, &out.join(format!("{stem}.{ptx}.ptx")), arch)
    })?;
    for (i, (stem, _)) in sources.iter().enumerate() {
        let cubin_bytes: usize =
            jobs.iter().zip(&sizes).filter(|((j, _, cubin), _)| *j == i && *cubin).map(|(_, n)| n).sum();
        let what = if stem.ends_with(SM90A_SUFFIX) {
            "sm_90a cubin".to_string()
        } else {
            format!("PTX for {}, {CUBIN_ARCH} cubin", PTX_ARCHS.join(", "))
        };
        eprintln!("compiled {stem}.cu: {what} ({cubin_bytes} bytes)");
    }
    let reports: Vec<KernelReport> = reports.into_iter().flatten().collect();

    let mut table = String::from("kernel                              registers  spill bytes  shared bytes\n");
    for r in &reports {
        table.push_str(&format!("{:<36}{:>9}  {:>11}  {:>12}\n", r.name, r.registers, r.spill_bytes, r.shared_bytes));
    }
    std::fs::write(out.join("resources.txt"), &table)?;
    print!("{table}");
    let over: Vec<&KernelReport> = reports.iter().filter(|r| r.spill_bytes > SPILL_BUDGET_BYTES).collect();
    if !over.is_empty() {
        let names: Vec<String> = over.iter().map(|r| format!("{} ({} bytes)", r.name, r.spill_bytes)).collect();
        bail!("register spills over the budget of {SPILL_BUDGET_BYTES} bytes: {}", names.join(", "));
    }
    println!("{} kernels in {} files compiled to {}", reports.len(), files.len(), out.display());
    Ok(())
}

/// The venv's `site-packages/nvidia`, creating the venv with the pinned wheels first if needed.
fn toolchain(root: &Path) -> anyhow::Result<PathBuf> {
    let venv = root.join(TOOLCHAIN_DIR);
    let find = || -> Option<PathBuf> {
        let lib = std::fs::read_dir(venv.join("lib")).ok()?;
        lib.filter_map(|e| e.ok()).map(|e| e.path().join("site-packages/nvidia")).find(|p| p.is_dir())
    };
    let ready = |nvidia: &Path| {
        nvidia.join("cuda_nvrtc/lib").is_dir()
            && nvidia.join("cuda_runtime/include/cuda_bf16.h").is_file()
            && nvidia.join("cuda_nvcc/include/crt/mma.h").is_file()
            && nvidia.join("cuda_nvcc/bin/ptxas").is_file()
    };
    if let Some(nvidia) = find().filter(|n| ready(n)) {
        return Ok(nvidia);
    }
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    crate::run(&python, &["-m", "venv", venv.to_str().context("venv path")?])?;
    let pip = venv.join("bin/pip");
    let mut args = vec!["install", "--quiet", "--disable-pip-version-check"];
    args.extend(WHEELS);
    crate::run(pip.to_str().context("pip path")?, &args)?;
    find()
        .filter(|n| ready(n))
        .with_context(|| format!("the wheels did not install NVRTC, headers and ptxas in {}", venv.display()))
}

/// `f` over `items` on one worker per core (each taking the next item); the results in the
/// items' order, or the first item's error.
fn parallel<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> anyhow::Result<R> + Sync) -> anyhow::Result<Vec<R>> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: Vec<std::sync::Mutex<Option<anyhow::Result<R>>>> = items.iter().map(|_| Default::default()).collect();
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get()).min(items.len());
    std::thread::scope(|scope| {
        for _ in 0..workers {
            scope.spawn(|| {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(item) = items.get(i) else { break };
                    *results[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(f(item));
                }
            });
        }
    });
    results
        .into_iter()
        .map(|r| r.into_inner().unwrap_or_else(|e| e.into_inner()).context("a job did not run")?)
        .collect()
}

/// Compiles one translation unit; warnings are errors. `cubin` takes the SASS instead of the PTX.
fn compile(source: &str, name: &str, arch: &str, include_dirs: &[PathBuf], cubin: bool) -> anyhow::Result<Vec<u8>> {
    let src = CString::new(source).context("a NUL byte in the source")?;
    let cname = CString::new(format!("{name}.cu"))?;
    let prog = result::create_program(&src, Some(&cname)).map_err(|e| anyhow::anyhow!("{name}: {e}"))?;
    let mut options = vec![arch.to_string(), "--std=c++17".into()];
    options.extend(include_dirs.iter().map(|d| format!("--include-path={}", d.display())));
    // SAFETY: `prog` was created above and is destroyed once, below; `src` and `cname` outlive it.
    let outcome = unsafe { result::compile_program(prog, &options) };
    // SAFETY: `prog` is live (created above, destroyed below); the log comes back as a copy.
    let log = unsafe { result::get_program_log(prog) }.map(|l| c_text(&l)).unwrap_or_default();
    let output =
        outcome.map_err(|e| anyhow::anyhow!("{name}.cu ({arch}) failed to compile: {e}\n{log}")).and_then(|()| {
            if !log.trim().is_empty() {
                bail!("{name}.cu ({arch}) compiled with diagnostics:\n{log}");
            }
            if cubin {
                // SAFETY: `prog` is live, and compiled (the outcome above is `Ok`).
                unsafe { cubin_bytes(prog) }
            } else {
                // SAFETY: as above; the PTX comes back as a copy.
                Ok(unsafe { result::get_ptx(prog) }
                    .map_err(|e| anyhow::anyhow!("{name}: {e}"))?
                    .into_iter()
                    .map(|c| c as u8)
                    .take_while(|b| *b != 0)
                    .collect())
            }
        });
    // SAFETY: `prog` was created above, is destroyed once, here, and not used afterwards.
    unsafe { result::destroy_program(prog) }.map_err(|e| anyhow::anyhow!("{name}: {e}"))?;
    output
}

/// The cubin of a program compiled for a real architecture (cudarc wraps only PTX).
///
/// # Safety
/// `prog` must be a live, compiled program.
unsafe fn cubin_bytes(prog: sys::nvrtcProgram) -> anyhow::Result<Vec<u8>> {
    let mut size = 0usize;
    // SAFETY: `prog` is live and compiled (the caller's contract); `size` is a valid place for the
    // size NVRTC writes.
    unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) }.result().map_err(|e| anyhow::anyhow!("cubin size: {e}"))?;
    let mut bytes = vec![0u8; size];
    // SAFETY: `prog` as above; `bytes` holds the `size` bytes NVRTC writes.
    unsafe { sys::nvrtcGetCUBIN(prog, bytes.as_mut_ptr().cast()) }
        .result()
        .map_err(|e| anyhow::anyhow!("cubin: {e}"))?;
    Ok(bytes)
}

fn c_text(chars: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = chars.iter().map(|c| *c as u8).take_while(|b| *b != 0).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Registers, spills and shared memory of every kernel in a PTX file, from `ptxas -v` for `arch`.
/// Fails where ptxas reports a performance loss it had to accept (wgmma products serialised
/// because the accumulators are touched while a product runs: the kernel would be correct and
/// several times slower).
fn resource_report(ptxas: &Path, ptx: &Path, arch: &str) -> anyhow::Result<Vec<KernelReport>> {
    let output = Command::new(ptxas)
        .args(["-v", &format!("-arch={arch}"), "-o", "/dev/null"])
        .arg(ptx)
        .output()
        .with_context(|| format!("running {}", ptxas.display()))?;
    let text = String::from_utf8_lossy(&output.stderr).into_owned() + &String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        bail!("ptxas rejected {}:\n{text}", ptx.display());
    }
    if let Some(line) = text.lines().find(|l| l.contains("Potential Performance Loss")) {
        bail!("ptxas, {}: {line}", ptx.display());
    }
    Ok(parse_ptxas(&text))
}

/// Parses `ptxas -v` output: a "Compiling entry function 'name'" line, then lines with
/// "N bytes spill stores, M bytes spill loads" and "Used R registers, ... S bytes smem".
fn parse_ptxas(text: &str) -> Vec<KernelReport> {
    let number_before = |line: &str, unit: &str| -> u64 {
        line.split(',')
            .find_map(|part| part.trim().strip_suffix(unit).and_then(|n| n.trim().rsplit(' ').next()?.parse().ok()))
            .unwrap_or(0)
    };
    let mut reports: Vec<KernelReport> = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or("").to_string();
            reports.push(KernelReport { name, ..KernelReport::default() });
            continue;
        }
        let Some(report) = reports.last_mut() else { continue };
        if line.contains("spill stores") {
            report.spill_bytes = number_before(line, "bytes spill stores") + number_before(line, "bytes spill loads");
        }
        if line.contains("Used") && line.contains("registers") {
            let after = line.split("Used ").nth(1).unwrap_or("");
            report.registers = after.split(' ').next().and_then(|n| n.parse().ok()).unwrap_or(0);
            report.shared_bytes = number_before(line, "bytes smem");
        }
    }
    reports
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptxas_reports_are_parsed() {
        let text = "ptxas info    : 0 bytes gmem\n\
                    ptxas info    : Compiling entry function 'conv3d_f32' for 'sm_90'\n\
                    ptxas info    : Function properties for conv3d_f32\n\
                    ptxas         .     8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n\
                    ptxas info    : Used 96 registers, used 0 barriers, 8704 bytes smem, 440 bytes cmem[0]\n\
                    ptxas info    : Compiling entry function 'add_f32' for 'sm_90'\n\
                    ptxas info    : Function properties for add_f32\n\
                    ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
                    ptxas info    : Used 10 registers, used 0 barriers, 380 bytes cmem[0]\n";
        let r = parse_ptxas(text);
        assert_eq!(r.len(), 2);
        assert_eq!(
            (r[0].name.as_str(), r[0].registers, r[0].spill_bytes, r[0].shared_bytes),
            ("conv3d_f32", 96, 16, 8704)
        );
        assert_eq!((r[1].name.as_str(), r[1].registers, r[1].spill_bytes, r[1].shared_bytes), ("add_f32", 10, 0, 0));
    }
}
