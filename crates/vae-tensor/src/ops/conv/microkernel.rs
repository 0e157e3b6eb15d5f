//! The register-blocked product at the heart of every CPU convolution: `MR` rows of a packed
//! left-hand side (output channels) times a panel of [`NR`] columns (pixels or Winograd tiles),
//! `C[r][j] (+)= Σ_k A[k][r] · B[k][j]`, with the `MR × NR` block of `C` held in registers for
//! the whole `k` loop.
//!
//! Each element of `C` is one chain of fused multiply-adds over `k` in increasing order
//! (starting from zero, or from the value in `C` when accumulating), whatever the instruction
//! set, the register block or how a caller splits `k` into chunks: results do not depend on the
//! machine, the thread count or the blocking. `A` is packed as `[k][MR]` (the `MR` values one
//! step broadcasts are adjacent); `B` rows are `NR` contiguous values, `ldb` apart.

use crate::ops::simd::Isa;

/// Columns of `C` one call computes (3 AVX-512 vectors, 6 AVX2 vectors).
pub(crate) const NR: usize = 48;

const AVX2_MR: usize = 6;

/// Rows of `C` (output channels) one call computes, and so the row block `A` is packed in.
pub(crate) const fn mr(isa: Isa) -> usize {
    match isa {
        Isa::Avx512 => 8,
        Isa::Avx2 => AVX2_MR,
        Isa::Portable => 4,
    }
}

/// One `mr(isa) × NR` block: `C[r·ldc + j] = (accumulate ? C[r·ldc + j] : 0) + Σ_k a[k·mr + r] ·
/// b[k·ldb + j]`.
///
/// # Panics
/// If a slice is too short for `k`, `ldb` and `ldc` (callers size them; this is a bug check,
/// made once per call against work of `k · mr · NR` multiply-adds).
#[cfg(test)]
#[inline]
#[allow(clippy::too_many_arguments)]
pub(crate) fn block(isa: Isa, k: usize, a: &[f32], b: &[f32], ldb: usize, c: &mut [f32], ldc: usize, accumulate: bool) {
    let m = mr(isa);
    assert!(ldc >= NR && c.len() >= (m - 1) * ldc + NR, "output block too short");
    // SAFETY: `c` covers the block (checked), and the unique borrow keeps others off it.
    unsafe { block_raw(isa, k, a, b, ldb, c.as_mut_ptr(), ldc, accumulate) }
}

/// [`block`] into a block of `C` given by pointer, for callers whose tasks write interleaved
/// rows of one buffer.
///
/// # Safety
/// `c + r·ldc + j` for `r < mr(isa)`, `j < NR` must be valid for reads and writes, and no other
/// thread may access those elements during the call.
#[inline]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn block_raw(
    isa: Isa,
    k: usize,
    a: &[f32],
    b: &[f32],
    ldb: usize,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    let m = mr(isa);
    if k == 0 {
        if !accumulate {
            for r in 0..m {
                // SAFETY: the caller's contract.
                unsafe { std::slice::from_raw_parts_mut(c.add(r * ldc), NR) }.fill(0.0);
            }
        }
        return;
    }
    assert!(a.len() >= k * m, "packed lhs too short");
    assert!(ldb >= NR && b.len() >= (k - 1) * ldb + NR, "rhs panel too short");
    assert!(ldc >= NR, "output rows overlap");
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa` is only ever an instruction set `Isa::supported` confirmed on this CPU
        // (see `simd::isa`); the asserts above and the caller's contract keep every access in
        // bounds.
        Isa::Avx512 => unsafe { x86::block_8x48(k, a.as_ptr(), b.as_ptr(), ldb, c, ldc, accumulate) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above, in three 16-column strips.
        Isa::Avx2 => unsafe {
            for j in (0..NR).step_by(16) {
                x86::block_mx16::<AVX2_MR>(k, a.as_ptr(), b.as_ptr().add(j), ldb, c.add(j), ldc, accumulate);
            }
        },
        _ => {
            // SAFETY: the caller's contract covers rows `0..4` of `NR` from `c`, `ldc` apart.
            let c = unsafe { std::slice::from_raw_parts_mut(c, 3 * ldc + NR) };
            portable_block(k, a, b, ldb, c, ldc, accumulate)
        }
    }
}

/// Rows of `C` one bf16 call computes.
pub(crate) const BF16_MR: usize = 8;

/// The bf16 block: `C[r][j] (+)= Σ_q a[q][r] · b[q][j]` over `kp` pairs of reduction steps,
/// where each `u32` of `a` (`[kp][8]`) and `b` (`[kp][ldb]`) holds two bf16 values, step `2q`
/// in the low half and `2q + 1` in the high half. Each pair is one AVX512-BF16 `vdpbf16ps`:
/// both products exact in f32, added to the accumulator one after the other (the high half
/// first), each sum rounded to nearest; denormals are flushed. `C` stays f32.
///
/// # Safety
/// The CPU must have AVX512-BF16 ([`crate::ops::simd::bf16_supported`]); `c + r·ldc + j` for
/// `r < 8`, `j < NR` must be valid for reads and writes, and no other thread may access those
/// elements during the call.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn block_bf16_raw(
    kp: usize,
    a: &[u32],
    b: &[u32],
    ldb: usize,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    assert!(a.len() >= kp * BF16_MR, "packed lhs too short");
    assert!(kp == 0 || (ldb >= NR && b.len() >= (kp - 1) * ldb + NR), "rhs panel too short");
    assert!(ldc >= NR, "output rows overlap");
    // SAFETY: the caller's contract (features and `c`); the asserts bound `a` and `b`.
    unsafe { x86::block_bf16_8x48(kp, a.as_ptr(), b.as_ptr(), ldb, c, ldc, accumulate) }
}

/// [`block`] in plain Rust (`mr = 4`), one `mul_add` chain per element as the vector kernels.
fn portable_block(k: usize, a: &[f32], b: &[f32], ldb: usize, c: &mut [f32], ldc: usize, accumulate: bool) {
    const M: usize = 4;
    let mut acc = [[0.0f32; NR]; M];
    if accumulate {
        for (r, row) in acc.iter_mut().enumerate() {
            row.copy_from_slice(&c[r * ldc..][..NR]);
        }
    }
    for kk in 0..k {
        let brow = &b[kk * ldb..][..NR];
        for (r, row) in acc.iter_mut().enumerate() {
            let av = a[kk * M + r];
            for (x, &bv) in row.iter_mut().zip(brow) {
                *x = av.mul_add(bv, *x);
            }
        }
    }
    for (r, row) in acc.iter().enumerate() {
        c[r * ldc..][..NR].copy_from_slice(row);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// The 8 × 48 block of `C` at `c` (rows `ldc` apart) in 24 registers, or zeros.
    ///
    /// # Safety
    /// AVX-512F must be available; with `accumulate`, `c` rows `0..8` of 48 values are readable.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load_block_8x48(c: *const f32, ldc: usize, accumulate: bool) -> [[__m512; 3]; 8] {
        let mut acc = [[_mm512_setzero_ps(); 3]; 8];
        if accumulate {
            for (r, row) in acc.iter_mut().enumerate() {
                for (j, v) in row.iter_mut().enumerate() {
                    // SAFETY: the caller's contract.
                    *v = unsafe { _mm512_loadu_ps(c.add(r * ldc + 16 * j)) };
                }
            }
        }
        acc
    }

    /// Stores [`load_block_8x48`]'s block back.
    ///
    /// # Safety
    /// AVX-512F must be available; `c` rows `0..8` of 48 values are writable.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn store_block_8x48(acc: &[[__m512; 3]; 8], c: *mut f32, ldc: usize) {
        for (r, row) in acc.iter().enumerate() {
            for (j, v) in row.iter().enumerate() {
                // SAFETY: the caller's contract.
                unsafe { _mm512_storeu_ps(c.add(r * ldc + 16 * j), *v) };
            }
        }
    }

    /// 8 rows × 48 columns: 24 accumulators, 3 panel loads and 8 broadcasts per step.
    ///
    /// # Safety
    /// AVX-512F must be available; `a` holds `k · 8` values, `b` rows `0..k` of 48 values `ldb`
    /// apart, `c` rows `0..8` of 48 values `ldc` apart.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn block_8x48(
        k: usize,
        a: *const f32,
        b: *const f32,
        ldb: usize,
        c: *mut f32,
        ldc: usize,
        accumulate: bool,
    ) {
        // SAFETY: the caller's contract bounds every pointer offset below, and this function's
        // target features are the ones its intrinsics need.
        unsafe {
            let mut acc = load_block_8x48(c, ldc, accumulate);
            let (mut pa, mut pb) = (a, b);
            for _ in 0..k {
                let b0 = _mm512_loadu_ps(pb);
                let b1 = _mm512_loadu_ps(pb.add(16));
                let b2 = _mm512_loadu_ps(pb.add(32));
                for (r, row) in acc.iter_mut().enumerate() {
                    let av = _mm512_set1_ps(*pa.add(r));
                    row[0] = _mm512_fmadd_ps(av, b0, row[0]);
                    row[1] = _mm512_fmadd_ps(av, b1, row[1]);
                    row[2] = _mm512_fmadd_ps(av, b2, row[2]);
                }
                pa = pa.add(8);
                pb = pb.add(ldb);
            }
            store_block_8x48(&acc, c, ldc);
        }
    }

    /// 8 rows × 48 columns of bf16 pairs: 24 accumulators, 3 panel loads and 8 pair
    /// broadcasts per pair of steps.
    ///
    /// # Safety
    /// AVX512-BF16 must be available; `a` holds `kp · 8` pairs, `b` rows `0..kp` of 48 pairs
    /// `ldb` apart, `c` rows `0..8` of 48 values `ldc` apart.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn block_bf16_8x48(
        kp: usize,
        a: *const u32,
        b: *const u32,
        ldb: usize,
        c: *mut f32,
        ldc: usize,
        accumulate: bool,
    ) {
        // SAFETY: the caller's contract bounds every pointer offset below, and this function's
        // target features are the ones its intrinsics need.
        unsafe {
            let mut acc = load_block_8x48(c, ldc, accumulate);
            let (mut pa, mut pb) = (a, b);
            for _ in 0..kp {
                let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(pb.cast()));
                let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(pb.add(16).cast()));
                let b2: __m512bh = std::mem::transmute(_mm512_loadu_si512(pb.add(32).cast()));
                for (r, row) in acc.iter_mut().enumerate() {
                    let av: __m512bh = std::mem::transmute(_mm512_set1_epi32(*pa.add(r) as i32));
                    row[0] = _mm512_dpbf16_ps(row[0], av, b0);
                    row[1] = _mm512_dpbf16_ps(row[1], av, b1);
                    row[2] = _mm512_dpbf16_ps(row[2], av, b2);
                }
                pa = pa.add(8);
                pb = pb.add(ldb);
            }
            store_block_8x48(&acc, c, ldc);
        }
    }

    /// `M` rows × 16 columns: `2·M` accumulators, 2 panel loads and `M` broadcasts per step.
    ///
    /// # Safety
    /// AVX2 and FMA must be available; `a` holds `k · M` values, `b` rows `0..k` of 16 values
    /// `ldb` apart, `c` rows `0..M` of 16 values `ldc` apart.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn block_mx16<const M: usize>(
        k: usize,
        a: *const f32,
        b: *const f32,
        ldb: usize,
        c: *mut f32,
        ldc: usize,
        accumulate: bool,
    ) {
        // SAFETY: the caller's contract bounds every pointer offset below, and this function's
        // target features are the ones its intrinsics need.
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); 2]; M];
            if accumulate {
                for (r, row) in acc.iter_mut().enumerate() {
                    for (j, v) in row.iter_mut().enumerate() {
                        *v = _mm256_loadu_ps(c.add(r * ldc + 8 * j));
                    }
                }
            }
            let (mut pa, mut pb) = (a, b);
            for _ in 0..k {
                let b0 = _mm256_loadu_ps(pb);
                let b1 = _mm256_loadu_ps(pb.add(8));
                for (r, row) in acc.iter_mut().enumerate() {
                    let av = _mm256_broadcast_ss(&*pa.add(r));
                    row[0] = _mm256_fmadd_ps(av, b0, row[0]);
                    row[1] = _mm256_fmadd_ps(av, b1, row[1]);
                }
                pa = pa.add(M);
                pb = pb.add(ldb);
            }
            for (r, row) in acc.iter().enumerate() {
                for (j, v) in row.iter().enumerate() {
                    _mm256_storeu_ps(c.add(r * ldc + 8 * j), *v);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values in [−0.5, 0.5).
    fn values(n: usize, seed: u32) -> Vec<f32> {
        crate::ops::test_values(n, seed).into_iter().map(|v| v * 0.5).collect()
    }

    #[test]
    fn every_instruction_set_gives_the_same_bits_as_the_reference_chain() {
        for isa in Isa::all_supported() {
            let m = mr(isa);
            for (k, ldb, ldc) in [(1, NR, NR), (7, 64, 50), (300, NR, 96)] {
                let a = values(k * m, 1);
                let b = values(k * ldb, 2);
                for accumulate in [false, true] {
                    let init = values(m * ldc, 3);
                    let mut c = init.clone();
                    block(isa, k, &a, &b, ldb, &mut c, ldc, accumulate);
                    for r in 0..m {
                        for j in 0..NR {
                            let mut want = if accumulate { init[r * ldc + j] } else { 0.0 };
                            for kk in 0..k {
                                want = a[kk * m + r].mul_add(b[kk * ldb + j], want);
                            }
                            assert_eq!(c[r * ldc + j].to_bits(), want.to_bits(), "{isa:?} k={k} r={r} j={j}");
                        }
                    }
                    // Columns past the block are untouched.
                    for r in 0..m {
                        let gap = r * ldc + NR..(r + 1) * ldc;
                        assert_eq!(&c[gap.clone()], &init[gap]);
                    }
                }
            }
        }
    }

    #[test]
    fn splitting_k_into_chunks_changes_nothing() {
        for isa in Isa::all_supported() {
            let m = mr(isa);
            let k = 100;
            let a = values(k * m, 4);
            let b = values(k * NR, 5);
            let mut whole = vec![0.0; m * NR];
            block(isa, k, &a, &b, NR, &mut whole, NR, false);
            let mut split = vec![0.0; m * NR];
            block(isa, 37, &a, &b, NR, &mut split, NR, false);
            block(isa, k - 37, &a[37 * m..], &b[37 * NR..], NR, &mut split, NR, true);
            assert!(whole.iter().zip(&split).all(|(x, y)| x.to_bits() == y.to_bits()), "{isa:?}");
        }
    }

    /// `vdpbf16ps` as documented: both products exact in f32, the high pair's added to the
    /// accumulator first, each sum rounded to nearest. Checked here on this CPU, bit for bit.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_bf16_kernel_adds_the_high_product_then_the_low_one() {
        if !crate::ops::simd::bf16_supported() {
            return; // no AVX512-BF16 here: bf16 convolutions are refused on this CPU
        }
        use crate::ops::bf16::{pair, value};
        let kp = 37;
        let (av, bv) = (values(kp * 2 * BF16_MR, 6), values(kp * 2 * NR, 7));
        let a: Vec<u32> = (0..kp * BF16_MR).map(|i| pair(av[2 * i], av[2 * i + 1])).collect();
        let b: Vec<u32> = (0..kp * NR).map(|i| pair(bv[2 * i], bv[2 * i + 1])).collect();
        let init = values(BF16_MR * NR, 8);
        let mut c = init.clone();
        // SAFETY: `c` holds 8 rows of NR, ldc = NR.
        unsafe { block_bf16_raw(kp, &a, &b, NR, c.as_mut_ptr(), NR, true) };
        for r in 0..BF16_MR {
            for j in 0..NR {
                let mut want = init[r * NR + j];
                for q in 0..kp {
                    let (pa, pb) = (a[q * BF16_MR + r], b[q * NR + j]);
                    let half = |x: u32, hi: bool| value(if hi { (x >> 16) as u16 } else { x as u16 });
                    want += half(pa, true) * half(pb, true);
                    want += half(pa, false) * half(pb, false);
                }
                assert_eq!(c[r * NR + j].to_bits(), want.to_bits(), "r={r} j={j}");
            }
        }
    }
}
