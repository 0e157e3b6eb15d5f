//! Process-wide settings of the tensor core: the CPU kernels' instruction set, AMX for bf16
//! convolutions, the pool of recycled buffers, and the memory a request may plan for. Each is
//! decided once per process, at its first use, from its environment variable
//! (`VAE_CPU_ISA`, `VAE_CPU_AMX`, `VAE_RECYCLE`, `VAE_MEMORY_LIMIT`) unless [`configure`] said
//! otherwise before: a program that embeds the library sets them in code, the environment
//! stays the default.

/// Settings for [`configure`]; `None` leaves a setting to its environment variable.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProcessSettings {
    /// Caps the CPU kernels' instruction set: `avx512`, `avx2` or `portable` (asking for more
    /// than the CPU has gives the best it has, with a warning). `VAE_CPU_ISA`.
    pub cpu_isa: Option<String>,
    /// Whether bf16 convolutions may use AMX tiles where the CPU has them. `VAE_CPU_AMX`.
    pub amx: Option<bool>,
    /// Whether large freed buffers are kept for reuse (bounded; [`crate::recycle::trim`] gives
    /// them back). `VAE_RECYCLE`.
    pub recycle: Option<bool>,
    /// The most memory, in bytes, a request may plan for (the lower of it and what the system
    /// has available). `VAE_MEMORY_LIMIT`.
    pub memory_limit: Option<u64>,
}

/// Errors of [`configure`].
#[derive(Debug, thiserror::Error)]
pub enum ProcessSettingsError {
    /// The setting was decided already (by an earlier call, or by the work it governs).
    #[error("{0} was decided already: configure the process before its first request")]
    AlreadyDecided(&'static str),
    /// A value the setting does not take.
    #[error("{0}")]
    Invalid(String),
}

/// Applies `settings`, each before the first use decides it. A setting decided already is an
/// error (and so is setting one twice); the others still apply.
pub fn configure(settings: &ProcessSettings) -> Result<(), ProcessSettingsError> {
    let mut first_error = None;
    let mut fail = |e: ProcessSettingsError| {
        first_error.get_or_insert(e);
    };
    if let Some(cap) = &settings.cpu_isa {
        if !crate::ops::simd::is_isa_name(cap) {
            fail(ProcessSettingsError::Invalid(format!("cpu_isa {cap:?} is not avx512, avx2 or portable")));
        } else if !crate::ops::simd::request(cap) {
            fail(ProcessSettingsError::AlreadyDecided("the CPU kernels' instruction set"));
        }
    }
    // AMX exists on x86-64 only; elsewhere there is nothing to allow.
    #[cfg(target_arch = "x86_64")]
    if let Some(on) = settings.amx
        && !crate::ops::conv::amx::request(on)
    {
        fail(ProcessSettingsError::AlreadyDecided("AMX for bf16 convolutions"));
    }
    if let Some(on) = settings.recycle
        && !crate::recycle::request(on)
    {
        fail(ProcessSettingsError::AlreadyDecided("the recycled-buffer pool"));
    }
    if let Some(bytes) = settings.memory_limit {
        if bytes == 0 {
            fail(ProcessSettingsError::Invalid("memory_limit must be positive".into()));
        } else if !crate::memory::request_limit(bytes) {
            fail(ProcessSettingsError::AlreadyDecided("the memory limit"));
        }
    }
    first_error.map_or(Ok(()), Err)
}
