//! Helpers the conformance suites share: a seeded generator, tolerances, comparison with an
//! f64 reference.

#![allow(dead_code)] // each suite uses its own subset

use vae_tensor::{Device, Tensor};

/// A seeded splitmix64 generator.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next_u64() % (hi - lo + 1) as u64) as usize
    }

    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.uniform()).collect()
    }
}

/// Per-op tolerance; see the module docs.
#[derive(Clone, Copy)]
pub struct Tol {
    pub rel: f64,
    pub abs: f64,
}

pub const EXACT: Tol = Tol { rel: 0.0, abs: 0.0 };
/// f32 GEMM-based ops (conv, matmul, linear, attention) against f64 sums.
pub const GEMM_TOL: Tol = Tol { rel: 1e-4, abs: 1e-5 };

pub fn tensor(rng: &mut Rng, dims: &[usize], device: &Device) -> Tensor {
    let n = dims.iter().product();
    Tensor::from_vec(rng.vec(n), dims, device).unwrap()
}

pub fn host(t: &Tensor) -> Vec<f64> {
    t.to_vec_f32().unwrap().into_iter().map(f64::from).collect()
}

#[track_caller]
pub fn assert_close(what: &str, got: &Tensor, want_dims: &[usize], want: &[f64], tol: Tol) {
    assert_eq!(got.dims(), want_dims, "{what}: shape");
    let got = got.to_vec_f32().unwrap();
    assert_eq!(got.len(), want.len(), "{what}: length");
    let rms = (want.iter().map(|w| w * w).sum::<f64>() / want.len().max(1) as f64).sqrt();
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - w).abs();
        let bound = tol.rel * w.abs() + tol.abs * rms;
        let both_nan = g.is_nan() && w.is_nan();
        assert!(both_nan || err <= bound, "{what}: element {i}: got {g}, want {w} (error {err:e} > {bound:e})");
    }
}

// ---------------------------------------------------------------- references (f64)

/// `cuda:0` when ops can run there (a driver, a device, embedded kernels); `None` with the
/// reason printed otherwise, so the CUDA instantiation of a suite says why it did not run.
#[cfg(feature = "cuda")]
#[allow(clippy::print_stderr)] // a skipped GPU test says so
pub fn usable_cuda(check: &str) -> Option<Device> {
    match vae_tensor::cuda::resolve_device(Device::Cuda(0)) {
        (Device::Cuda(n), None) => Some(Device::Cuda(n)),
        (_, why) => {
            eprintln!("{check} on cuda: skipped, {}", why.unwrap_or_default());
            None
        }
    }
}

/// Instantiates each check (a `fn(&Device)` of the suite) as a `#[test]` for one device, in a
/// module of that name (candle's `test_device!` pattern).
macro_rules! conformance_tests {
    ($module:ident, $device:expr, [$($check:ident),* $(,)?]) => {
        mod $module {
            $(
                #[test]
                fn $check() {
                    super::$check(&$device);
                }
            )*
        }
    };
}

/// The same for `cuda:0`, in module `cuda`, each test skipped (with the reason) without a
/// usable GPU.
#[cfg(feature = "cuda")]
macro_rules! cuda_conformance_tests {
    ([$($check:ident),* $(,)?]) => {
        mod cuda {
            $(
                #[test]
                fn $check() {
                    if let Some(device) = super::support::usable_cuda(stringify!($check)) {
                        super::$check(&device);
                    }
                }
            )*
        }
    };
}
