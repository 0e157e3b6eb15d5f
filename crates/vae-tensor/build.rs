//! Embeds the CUDA kernels that `cargo xtask kernels` compiled (PTX per virtual architecture and
//! an `sm_90` cubin per `kernels-cu/*.cu`; an `sm_90a` cubin per `kernels-cu/*_sm90a.cu`), when
//! they exist. Without them the crate still builds: the CUDA layer then reports that this build
//! carries no kernels.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// The names in `dir` that end in `suffix`, without it, sorted (none when `dir` is missing).
fn stems_with_suffix(dir: &Path, suffix: &str) -> Vec<String> {
    let mut stems: Vec<String> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter_map(|f| f.strip_suffix(suffix).map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    stems.sort();
    stems
}

fn main() {
    println!("cargo::rerun-if-env-changed=VAE_KERNELS_DIR");
    let dir = std::env::var_os("VAE_KERNELS_DIR").map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo")).join("../../target/kernels")
    });
    println!("cargo::rerun-if-changed={}", dir.display());
    let names = stems_with_suffix(&dir, ".sm_90.cubin");
    let mut code = String::from("/// Kernels embedded at build time (empty when `cargo xtask kernels` has not run).\n");
    code.push_str("pub(crate) static EMBEDDED: &[EmbeddedModule] = &[\n");
    for name in &names {
        let file = |suffix: &str| dir.join(format!("{name}.{suffix}"));
        let (ptx80, ptx90, cubin) = (file("compute_80.ptx"), file("compute_90.ptx"), file("sm_90.cubin"));
        if !(ptx80.is_file() && ptx90.is_file()) {
            continue;
        }
        for f in [&ptx80, &ptx90, &cubin] {
            println!("cargo::rerun-if-changed={}", f.display());
        }
        let _ = writeln!(
            code,
            "    EmbeddedModule {{ name: {name:?}, ptx_compute_80: include_str!({:?}), ptx_compute_90: include_str!({:?}), cubin_sm_90: include_bytes!({:?}) }},",
            ptx80.display().to_string(),
            ptx90.display().to_string(),
            cubin.display().to_string()
        );
    }
    code.push_str("];\n");
    // Files of Hopper-only kernels (`*_sm90a.cu`): an sm_90a cubin each, nothing else.
    let hopper = stems_with_suffix(&dir, ".sm_90a.cubin");
    code.push_str("/// Hopper-only kernels embedded at build time (sm_90a cubins).\n");
    code.push_str("pub(crate) static EMBEDDED_SM90A: &[Sm90aModule] = &[\n");
    for name in &hopper {
        let cubin = dir.join(format!("{name}.sm_90a.cubin"));
        println!("cargo::rerun-if-changed={}", cubin.display());
        let _ = writeln!(
            code,
            "    Sm90aModule {{ name: {name:?}, cubin_sm_90a: include_bytes!({:?}) }},",
            cubin.display().to_string()
        );
    }
    code.push_str("];\n");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("set by cargo")).join("kernels.rs");
    std::fs::write(out, code).expect("write the kernel table");
}
