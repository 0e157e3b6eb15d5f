//! Which SIMD instruction set the CPU kernels run with, chosen once at run time from the CPU's
//! features (one binary for every x86-64 machine; never a compile-time `target-cpu`).
//!
//! Every kernel written for several instruction sets performs the same arithmetic, operation
//! for operation, on each element whatever the vector width (products and sums as fused
//! multiply-adds in the same order; the portable fallback calls [`f32::mul_add`]), so a tile
//! decoded on an AVX-512 rank is bit-identical to the same tile on an AVX2 rank. The tests run
//! every path the machine has and compare them bit for bit.
//!
//! `VAE_CPU_ISA=avx512|avx2|portable` caps the choice (to compare paths or to reproduce a
//! smaller machine); asking for more than the CPU has falls back to the best it has, with a
//! warning.

use std::sync::OnceLock;

/// An instruction set the CPU kernels are written for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Isa {
    /// Plain Rust, every element through [`f32::mul_add`]: any CPU.
    Portable,
    /// x86-64 AVX2 with FMA: 8 lanes of f32.
    Avx2,
    /// x86-64 AVX-512 (F): 16 lanes of f32.
    Avx512,
}

impl Isa {
    /// The name `VAE_CPU_ISA` takes.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    fn parse(s: &str) -> Option<Isa> {
        match s.trim().to_ascii_lowercase().as_str() {
            "portable" | "scalar" | "none" => Some(Isa::Portable),
            "avx2" => Some(Isa::Avx2),
            "avx512" | "avx512f" => Some(Isa::Avx512),
            _ => None,
        }
    }

    /// Whether this CPU can run `self`.
    pub(crate) fn supported(self) -> bool {
        match self {
            Isa::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma"),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => std::is_x86_feature_detected!("avx512f") && Isa::Avx2.supported(),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// Every instruction set this CPU can run, narrowest first (the tests compare them).
    #[cfg(test)]
    pub(crate) fn all_supported() -> Vec<Isa> {
        [Isa::Portable, Isa::Avx2, Isa::Avx512].into_iter().filter(|i| i.supported()).collect()
    }

    fn best_supported() -> Isa {
        [Isa::Avx512, Isa::Avx2].into_iter().find(|i| i.supported()).unwrap_or(Isa::Portable)
    }
}

/// The instruction set decided for this process ([`isa`]).
static CHOSEN: OnceLock<Isa> = OnceLock::new();
/// The cap [`crate::process::configure`] set, over `VAE_CPU_ISA`.
static REQUESTED: OnceLock<String> = OnceLock::new();

/// Caps the instruction set as `VAE_CPU_ISA` does, before the first kernel decides it; `false`
/// once it was decided (or capped) already.
pub(crate) fn request(cap: &str) -> bool {
    CHOSEN.get().is_none() && REQUESTED.set(cap.to_string()).is_ok()
}

/// Whether `cap` names an instruction set.
pub(crate) fn is_isa_name(cap: &str) -> bool {
    Isa::parse(cap).is_some()
}

/// The instruction set the kernels use on this machine: the widest the CPU has, capped by
/// [`crate::process::configure`] or else `VAE_CPU_ISA`. Decided once per process.
pub(crate) fn isa() -> Isa {
    *CHOSEN.get_or_init(|| {
        let best = Isa::best_supported();
        let wanted = match REQUESTED.get() {
            Some(cap) => cap.clone(),
            None => match std::env::var("VAE_CPU_ISA") {
                Ok(cap) => cap,
                Err(_) => return best,
            },
        };
        match Isa::parse(&wanted) {
            Some(isa) if isa.supported() => isa,
            Some(isa) => {
                tracing::warn!("VAE_CPU_ISA={wanted}: this CPU has no {}; using {}", isa.name(), best.name());
                best
            }
            None => {
                tracing::warn!("VAE_CPU_ISA={wanted} is not avx512, avx2 or portable; using {}", best.name());
                best
            }
        }
    })
}

/// Whether the CPU convolutions can multiply in bf16 here: AVX512-BF16 (with AVX-512F/BW), and
/// `VAE_CPU_ISA` not capping the kernels below AVX-512.
pub(crate) fn bf16_supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static SUPPORTED: OnceLock<bool> = OnceLock::new();
        *SUPPORTED.get_or_init(|| {
            isa() == Isa::Avx512
                && std::is_x86_feature_detected!("avx512bw")
                && std::is_x86_feature_detected!("avx512bf16")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Why bf16 CPU convolutions cannot run here (the missing CPU features, or the cap), or `None`
/// where they can.
pub(crate) fn bf16_missing() -> Option<String> {
    if bf16_supported() {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let missing: Vec<&str> = [
            ("AVX-512F", std::is_x86_feature_detected!("avx512f")),
            ("AVX-512BW", std::is_x86_feature_detected!("avx512bw")),
            ("AVX512-BF16", std::is_x86_feature_detected!("avx512bf16")),
        ]
        .into_iter()
        .filter(|(_, has)| !has)
        .map(|(name, _)| name)
        .collect();
        if missing.is_empty() {
            return Some(format!("VAE_CPU_ISA caps the CPU kernels at {}", isa().name()));
        }
        Some(format!("this CPU has no {}", missing.join(", ")))
    }
    #[cfg(not(target_arch = "x86_64"))]
    Some("bf16 CPU convolutions need x86-64 AVX512-BF16".into())
}

/// The instruction set the CPU kernels run with, by name (`avx512`, `avx2` or `portable`), for
/// reports and benchmark tables.
pub fn cpu_isa_name() -> &'static str {
    isa().name()
}

/// Defines `fn $name(isa, args..)` that runs the generic kernel `$generic::<S: Lanes>(args..)`
/// with `isa`'s lanes, inside a `#[target_feature]` function for the x86 instruction sets so
/// that the lanes' operations inline to single instructions.
macro_rules! isa_kernel {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? = $generic:ident;) => {
        $(#[$meta])*
        #[allow(clippy::too_many_arguments)]
        $vis fn $name(isa: $crate::ops::simd::Isa, $($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f")]
            #[allow(clippy::too_many_arguments)]
            fn avx512($($arg: $ty),*) $(-> $ret)? {
                $generic::<$crate::ops::lanes::Avx512>($($arg),*)
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            #[allow(clippy::too_many_arguments)]
            fn avx2($($arg: $ty),*) $(-> $ret)? {
                $generic::<$crate::ops::lanes::Avx2>($($arg),*)
            }
            match isa {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `isa` is only ever an instruction set this CPU supports (`simd::isa`).
                $crate::ops::simd::Isa::Avx512 => unsafe { avx512($($arg),*) },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: as above.
                $crate::ops::simd::Isa::Avx2 => unsafe { avx2($($arg),*) },
                _ => $generic::<$crate::ops::lanes::Portable>($($arg),*),
            }
        }
    };
}
pub(crate) use isa_kernel;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_the_portable_path_is_always_there() {
        for isa in [Isa::Portable, Isa::Avx2, Isa::Avx512] {
            assert_eq!(Isa::parse(isa.name()), Some(isa));
        }
        assert_eq!(Isa::parse(" AVX2 "), Some(Isa::Avx2));
        assert_eq!(Isa::parse("sse9"), None);
        assert!(Isa::all_supported().contains(&Isa::Portable));
        assert!(isa().supported());
    }
}
