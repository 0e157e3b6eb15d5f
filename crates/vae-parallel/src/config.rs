//! Process-wide settings: [`init`] with a [`Config`]. Each setting is decided once per process;
//! a program that embeds the library calls `init` first thing in `main`, and whatever it leaves
//! unset keeps its environment variable's value (or the default).
//!
//! | setting | environment | default |
//! |---|---|---|
//! | [`Config::threads`] | `RAYON_NUM_THREADS` | every core |
//! | [`Config::cpu_isa`] | `VAE_CPU_ISA` | the widest the CPU has |
//! | [`Config::amx`] | `VAE_CPU_AMX` | on where the CPU has it |
//! | [`Config::recycle`] | `VAE_RECYCLE` | on |
//! | [`Config::memory_limit`] | `VAE_MEMORY_LIMIT` | what the system has available |
//! | [`Config::map_large_allocations`] | | on (glibc) |

use crate::error::{Error, Result};

/// Process-wide settings for [`init`]; `None` keeps the environment's value.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Config {
    /// Compute threads of the process (rayon's global pool): what a group of processes' rank
    /// uses, and what local ranks share.
    pub threads: Option<usize>,
    /// Caps the CPU kernels' instruction set: `avx512`, `avx2` or `portable`.
    pub cpu_isa: Option<String>,
    /// Whether bf16 convolutions may use AMX tiles where the CPU has them.
    pub amx: Option<bool>,
    /// Whether large freed buffers are kept for reuse (bounded; give them back with
    /// [`trim_recycled`]).
    pub recycle: Option<bool>,
    /// The most memory, in bytes, a request may plan for: one whose output and largest feature
    /// map cannot fit is refused before any work.
    pub memory_limit: Option<u64>,
    /// glibc only: map every allocation of 1 MiB and more from the system and return it when
    /// freed (instead of glibc's dynamic threshold, which keeps some freed ones in its heap), so
    /// that the process's resident size stays under its high-water mark. Applied only while
    /// the process has a single thread (glibc's `mallopt` is not safe beside other threads);
    /// otherwise skipped, with a log line.
    pub map_large_allocations: bool,
}

impl Default for Config {
    fn default() -> Self {
        Self { threads: None, cpu_isa: None, amx: None, recycle: None, memory_limit: None, map_large_allocations: true }
    }
}

impl Config {
    /// The compute threads.
    pub fn threads(mut self, threads: usize) -> Self {
        self.threads = Some(threads);
        self
    }

    /// The cap on the CPU kernels' instruction set.
    pub fn cpu_isa(mut self, isa: impl Into<String>) -> Self {
        self.cpu_isa = Some(isa.into());
        self
    }

    /// Whether bf16 convolutions may use AMX.
    pub fn amx(mut self, on: bool) -> Self {
        self.amx = Some(on);
        self
    }

    /// Whether freed large buffers are recycled.
    pub fn recycle(mut self, on: bool) -> Self {
        self.recycle = Some(on);
        self
    }

    /// The memory a request may plan for, in bytes.
    pub fn memory_limit(mut self, bytes: u64) -> Self {
        self.memory_limit = Some(bytes);
        self
    }

    /// Whether glibc maps large allocations (see the field).
    pub fn map_large_allocations(mut self, on: bool) -> Self {
        self.map_large_allocations = on;
        self
    }
}

/// Applies `config` to this process. Call it once, first thing (before any request, and before
/// the program starts threads of its own): a setting that its first use has decided already is
/// an error naming it, and the others still apply.
///
/// ```
/// vae_parallel::init(vae_parallel::Config::default().recycle(true))?;
/// # Ok::<(), vae_parallel::Error>(())
/// ```
pub fn init(config: Config) -> Result<()> {
    if config.map_large_allocations {
        map_large_allocations();
    }
    let mut first_error = None;
    if let Some(threads) = config.threads {
        if threads == 0 {
            first_error = Some(Error::invalid_option("`threads` must be at least 1"));
        } else if rayon::ThreadPoolBuilder::new().num_threads(threads).build_global().is_err() {
            let current = rayon::current_num_threads();
            if current != threads {
                first_error = Some(Error::invalid_option(format!(
                    "`threads` {threads}: the process's thread pool was started already with {current}"
                )));
            }
        }
    }
    let tensor = vae_tensor::process::ProcessSettings {
        cpu_isa: config.cpu_isa,
        amx: config.amx,
        recycle: config.recycle,
        memory_limit: config.memory_limit,
    };
    if let Err(e) = vae_tensor::process::configure(&tensor) {
        first_error.get_or_insert(Error::invalid_option(e.to_string()));
    }
    first_error.map_or(Ok(()), Err)
}

/// Gives the recycled buffers back to the system (a long-lived process between bursts of
/// requests); returns the bytes freed.
pub fn trim_recycled() -> usize {
    vae_tensor::recycle::trim()
}

/// Has glibc map every allocation of 1 MiB and more from the system and return it when freed,
/// while this process has one thread.
fn map_large_allocations() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let threads = std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| s.lines().find_map(|l| l.strip_prefix("Threads:").map(|n| n.trim().parse::<usize>().ok())))
            .flatten();
        if threads != Some(1) {
            tracing::debug!(?threads, "not setting glibc's mmap threshold: the process has other threads");
            return;
        }
        // SAFETY: mallopt only changes glibc's allocation policy; it is not safe beside other
        // threads that allocate, and the check above found this process has no other thread
        // (none can start while this one runs this call).
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, vae_tensor::recycle::MIN_BYTES as i32);
        }
    }
}
