//! CPU implementations of the tensor ops, one module per op family. Each module adds methods to
//! [`crate::Tensor`]; the shared GEMM wrapper lives in `gemm`.

pub(crate) mod attention;
pub(crate) mod conv;
pub(crate) mod elementwise;
pub(crate) mod gemm;
pub(crate) mod layout;
pub(crate) mod linalg;
pub(crate) mod norm;
pub(crate) mod video;

use rayon::prelude::*;

/// Below this many elements a parallel loop costs more than it saves.
pub(crate) const PAR_MIN_ELEMS: usize = 1 << 15;

/// `x · sigmoid(x)`, written as `x / (1 + e^(−x))`: for very negative `x` the exponential
/// overflows to infinity and the quotient is a correctly signed zero, as in PyTorch. One
/// definition for `silu` and the norms' fused SiLU, so fusing never changes a bit.
#[inline]
pub(crate) fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Applies `f` to `data` in chunks, in parallel when the data is large enough to pay for it.
pub(crate) fn par_chunks_apply(data: &mut [f32], f: impl Fn(&mut [f32]) + Sync + Send) {
    if data.len() < PAR_MIN_ELEMS {
        f(data);
    } else {
        data.par_chunks_mut(PAR_MIN_ELEMS / 2).for_each(f);
    }
}
