//! CPU implementations of the tensor ops, one module per op family. Each module adds methods to
//! [`crate::Tensor`]; the shared GEMM wrapper lives in `gemm`.

pub(crate) mod attention;
pub(crate) mod bf16;
pub(crate) mod conv;
pub(crate) mod elementwise;
pub(crate) mod gemm;
pub(crate) mod group_stats;
pub(crate) mod lanes;
pub(crate) mod layout;
pub(crate) mod linalg;
pub(crate) mod norm;
pub(crate) mod simd;
pub(crate) mod video;

use rayon::prelude::*;

/// Below this many elements a parallel loop costs more than it saves.
pub(crate) const PAR_MIN_ELEMS: usize = 1 << 15;

simd::isa_kernel! {
    /// SiLU of every element of `src` into `dst` ([`lanes::silu`]: one definition for `silu` and
    /// the norms' fused SiLU, so fusing never changes a bit).
    pub(crate) fn silu_into(src: &[f32], dst: &mut [f32]) = silu_kernel;
}

#[inline(always)]
fn silu_kernel<S: lanes::Lanes>(src: &[f32], dst: &mut [f32]) {
    lanes::map::<S, _>(src, dst, &lanes::Silu);
}

/// A buffer that parallel tasks write at disjoint positions (a strided set of rows each, which
/// safe splitting cannot express). Borrows the buffer mutably for `'a`.
#[derive(Clone, Copy)]
pub(crate) struct OutPtr<'a>(*mut f32, usize, std::marker::PhantomData<&'a mut [f32]>);

// SAFETY: tasks write disjoint elements (each caller documents why), and the borrow keeps the
// buffer alive and otherwise untouched meanwhile.
unsafe impl Send for OutPtr<'_> {}
// SAFETY: as above.
unsafe impl Sync for OutPtr<'_> {}

impl<'a> OutPtr<'a> {
    pub(crate) fn new(out: &'a mut [f32]) -> Self {
        Self(out.as_mut_ptr(), out.len(), std::marker::PhantomData)
    }

    /// The `len` elements from `start`.
    ///
    /// # Safety
    /// No other task may access these elements while the slice lives.
    pub(crate) unsafe fn slice(self, start: usize, len: usize) -> &'a mut [f32] {
        assert!(start <= self.1 && len <= self.1 - start, "output range out of bounds");
        // SAFETY: in bounds (checked); exclusivity is the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(start), len) }
    }

    /// A pointer to element `start`, for writes scattered over `start..start + span` (other
    /// tasks may own elements in between, so no slice over the span is made).
    ///
    /// # Panics
    /// If the span is out of bounds.
    pub(crate) fn raw(self, start: usize, span: usize) -> *mut f32 {
        assert!(start <= self.1 && span <= self.1 - start, "output range out of bounds");
        // SAFETY: in bounds (checked); `add` makes no reference.
        unsafe { self.0.add(start) }
    }
}

/// Applies `f` to `data` in chunks, in parallel when the data is large enough to pay for it.
pub(crate) fn par_chunks_apply(data: &mut [f32], f: impl Fn(&mut [f32]) + Sync + Send) {
    if data.len() < PAR_MIN_ELEMS {
        f(data);
    } else {
        data.par_chunks_mut(PAR_MIN_ELEMS / 2).for_each(f);
    }
}

/// Deterministic pseudo-random values in `[−1, 1)` for the kernels' unit tests (xorshift).
#[cfg(test)]
pub(crate) fn test_values(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2654435761) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0
        })
        .collect()
}
