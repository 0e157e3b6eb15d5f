//! The x86-64 lane types: eight AVX2 lanes and sixteen AVX-512 lanes (and their f64 halves),
//! each operation one instruction inside the `#[target_feature]` kernels that build them.

use std::arch::x86_64::*;

use super::{Lanes, WideLanes};

/// Eight AVX2 lanes.
#[derive(Clone, Copy)]
pub(crate) struct Avx2(__m256);

/// Four AVX2 f64 lanes.
#[derive(Clone, Copy)]
pub(crate) struct Avx2Wide(__m256d);

// Every method inlines into the AVX2 + FMA kernels alone (see the module docs): the `unsafe`
// blocks that touch no memory need nothing more.
impl WideLanes for Avx2Wide {
    const L: usize = 4;
    #[inline(always)]
    unsafe fn load(p: *const f64) -> Self {
        // SAFETY: the caller's contract.
        Self(unsafe { _mm256_loadu_pd(p) })
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f64) {
        // SAFETY: the caller's contract.
        unsafe { _mm256_storeu_pd(p, self.0) }
    }
    #[inline(always)]
    fn splat(v: f64) -> Self {
        // SAFETY: register operands only, and AVX2 and FMA are enabled wherever this inlines (module docs).
        Self(unsafe { _mm256_set1_pd(v) })
    }
    #[inline(always)]
    fn mul(self, o: Self) -> Self {
        // SAFETY: register operands only, and AVX2 and FMA are enabled wherever this inlines (module docs).
        Self(unsafe { _mm256_mul_pd(self.0, o.0) })
    }
    #[inline(always)]
    fn add(self, o: Self) -> Self {
        // SAFETY: register operands only, and AVX2 and FMA are enabled wherever this inlines (module docs).
        Self(unsafe { _mm256_add_pd(self.0, o.0) })
    }
    #[inline(always)]
    fn sub(self, o: Self) -> Self {
        // SAFETY: register operands only, and AVX2 and FMA are enabled wherever this inlines (module docs).
        Self(unsafe { _mm256_sub_pd(self.0, o.0) })
    }
    #[inline(always)]
    fn fma(a: Self, b: Self, c: Self) -> Self {
        // SAFETY: register operands only, and AVX2 and FMA are enabled wherever this inlines (module docs).
        Self(unsafe { _mm256_fmadd_pd(a.0, b.0, c.0) })
    }
    #[inline(always)]
    fn store_to(self, out: &mut [f64]) {
        assert!(out.len() >= 4);
        // SAFETY: four values fit (checked).
        unsafe { _mm256_storeu_pd(out.as_mut_ptr(), self.0) }
    }
}

impl Lanes for Avx2 {
    const L: usize = 8;
    type Wide = Avx2Wide;

    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        // SAFETY: the caller's contract.
        Self(unsafe { _mm256_loadu_ps(p) })
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        // SAFETY: the caller's contract.
        unsafe { _mm256_storeu_ps(p, self.0) }
    }
    #[inline(always)]
    fn splat(v: f32) -> Self {
        // SAFETY: register operands only, and AVX2 and FMA are enabled wherever this inlines (module docs).
        Self(unsafe { _mm256_set1_ps(v) })
    }
    #[inline(always)]
    fn add(self, o: Self) -> Self {
        // SAFETY: register operands only, and AVX2 and FMA are enabled wherever this inlines (module docs).
        Self(unsafe { _mm256_add_ps(self.0, o.0) })
    }
    #[inline(always)]
    fn sub(self, o: Self) -> Self {
        // SAFETY: register operands only, and AVX2 and FMA are enabled wherever this inlines (module docs).
        Self(unsafe { _mm256_sub_ps(self.0, o.0) })
    }
    #[inline(always)]
    fn mul(self, o: Self) -> Self {
        // SAFETY: register operands only, and AVX2 and FMA are enabled wherever this inlines (module docs).
        Self(unsafe { _mm256_mul_ps(self.0, o.0) })
    }
    #[inline(always)]
    fn div(self, o: Self) -> Self {
        // SAFETY: register operands only, and AVX2 and FMA are enabled wherever this inlines (module docs).
        Self(unsafe { _mm256_div_ps(self.0, o.0) })
    }
    #[inline(always)]
    fn fma(a: Self, b: Self, c: Self) -> Self {
        // SAFETY: register operands only, and AVX2 and FMA are enabled wherever this inlines (module docs).
        Self(unsafe { _mm256_fmadd_ps(a.0, b.0, c.0) })
    }
    #[inline(always)]
    fn min(self, o: Self) -> Self {
        // SAFETY: register operands only, and AVX2 and FMA are enabled wherever this inlines (module docs).
        Self(unsafe { _mm256_min_ps(self.0, o.0) })
    }
    #[inline(always)]
    fn max(self, o: Self) -> Self {
        // SAFETY: register operands only, and AVX2 and FMA are enabled wherever this inlines (module docs).
        Self(unsafe { _mm256_max_ps(self.0, o.0) })
    }
    #[inline(always)]
    fn round(self) -> Self {
        // SAFETY: register operands only, and AVX2 and FMA are enabled wherever this inlines (module docs).
        Self(unsafe { _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(self.0) })
    }
    #[inline(always)]
    fn pow2(self) -> Self {
        // SAFETY: register operands only, and AVX2 and FMA are enabled wherever this inlines (module docs).
        unsafe {
            let n = _mm256_cvtps_epi32(self.0);
            Self(_mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(n, _mm256_set1_epi32(127)))))
        }
    }
    #[inline(always)]
    fn select_gt(self, o: Self, if_true: Self, if_false: Self) -> Self {
        // SAFETY: register operands only, and AVX2 and FMA are enabled wherever this inlines (module docs).
        unsafe { Self(_mm256_blendv_ps(if_false.0, if_true.0, _mm256_cmp_ps::<_CMP_GT_OQ>(self.0, o.0))) }
    }
    #[inline(always)]
    fn keep_nan(self, other: Self) -> Self {
        // SAFETY: register operands only, and AVX2 and FMA are enabled wherever this inlines (module docs).
        unsafe { Self(_mm256_blendv_ps(other.0, self.0, _mm256_cmp_ps::<_CMP_UNORD_Q>(self.0, self.0))) }
    }
    #[inline(always)]
    fn widen(self) -> [Avx2Wide; 2] {
        // SAFETY: register operands only, and AVX2 and FMA are enabled wherever this inlines (module docs).
        unsafe {
            [
                Avx2Wide(_mm256_cvtps_pd(_mm256_castps256_ps128(self.0))),
                Avx2Wide(_mm256_cvtps_pd(_mm256_extractf128_ps::<1>(self.0))),
            ]
        }
    }
    #[inline(always)]
    fn narrow([a, b]: [Avx2Wide; 2]) -> Self {
        // SAFETY: register operands only, and AVX2 and FMA are enabled wherever this inlines (module docs).
        unsafe { Self(_mm256_set_m128(_mm256_cvtpd_ps(b.0), _mm256_cvtpd_ps(a.0))) }
    }
    #[inline(always)]
    unsafe fn load_windows(p: *const f32) -> [Self; 6] {
        // SAFETY: the caller's contract covers `p..p + 34`.
        unsafe {
            let v0 = _mm256_loadu_ps(p);
            let v1 = _mm256_loadu_ps(p.add(8));
            let v2 = _mm256_loadu_ps(p.add(16));
            let v3 = _mm256_loadu_ps(p.add(24));
            // Windows (0 | 4), (1 | 5), (2 | 6), (3 | 7) in the two 128-bit halves.
            let t0 = _mm256_permute2f128_ps::<0x20>(v0, v2);
            let t1 = _mm256_permute2f128_ps::<0x31>(v0, v2);
            let t2 = _mm256_permute2f128_ps::<0x20>(v1, v3);
            let t3 = _mm256_permute2f128_ps::<0x31>(v1, v3);
            // A 4×4 transpose within each half.
            let u0 = _mm256_unpacklo_ps(t0, t1);
            let u1 = _mm256_unpackhi_ps(t0, t1);
            let u2 = _mm256_unpacklo_ps(t2, t3);
            let u3 = _mm256_unpackhi_ps(t2, t3);
            let p0 = _mm256_shuffle_ps::<0x44>(u0, u2);
            let p1 = _mm256_shuffle_ps::<0xEE>(u0, u2);
            let p2 = _mm256_shuffle_ps::<0x44>(u1, u3);
            let p3 = _mm256_shuffle_ps::<0xEE>(u1, u3);
            // The next window's first two values: rotate one lane, the last from x[32..34].
            let rot = _mm256_setr_epi32(1, 2, 3, 4, 5, 6, 7, 0);
            let p4 = _mm256_blend_ps::<0x80>(_mm256_permutevar8x32_ps(p0, rot), _mm256_set1_ps(*p.add(32)));
            let p5 = _mm256_blend_ps::<0x80>(_mm256_permutevar8x32_ps(p1, rot), _mm256_set1_ps(*p.add(33)));
            [Self(p0), Self(p1), Self(p2), Self(p3), Self(p4), Self(p5)]
        }
    }
    #[inline(always)]
    unsafe fn store_interleaved(p: *mut f32, v: [Self; 4]) {
        // SAFETY: the caller's contract covers `p..p + 32`.
        unsafe {
            let u0 = _mm256_unpacklo_ps(v[0].0, v[1].0);
            let u1 = _mm256_unpackhi_ps(v[0].0, v[1].0);
            let u2 = _mm256_unpacklo_ps(v[2].0, v[3].0);
            let u3 = _mm256_unpackhi_ps(v[2].0, v[3].0);
            // Windows (0 | 4), (1 | 5), (2 | 6), (3 | 7).
            let t0 = _mm256_shuffle_ps::<0x44>(u0, u2);
            let t1 = _mm256_shuffle_ps::<0xEE>(u0, u2);
            let t2 = _mm256_shuffle_ps::<0x44>(u1, u3);
            let t3 = _mm256_shuffle_ps::<0xEE>(u1, u3);
            _mm256_storeu_ps(p, _mm256_permute2f128_ps::<0x20>(t0, t1));
            _mm256_storeu_ps(p.add(8), _mm256_permute2f128_ps::<0x20>(t2, t3));
            _mm256_storeu_ps(p.add(16), _mm256_permute2f128_ps::<0x31>(t0, t1));
            _mm256_storeu_ps(p.add(24), _mm256_permute2f128_ps::<0x31>(t2, t3));
        }
    }
    #[inline(always)]
    unsafe fn load_windows2(p: *const f32) -> [Self; 4] {
        // SAFETY: the caller's contract covers `p..p + 18`.
        unsafe {
            let v0 = _mm256_loadu_ps(p);
            let v1 = _mm256_loadu_ps(p.add(8));
            // x0 x2 x8 x10 | x4 x6 x12 x14, then the 64-bit pairs in order. (No closures
            // in kernels: they do not inherit the target features.)
            let e = _mm256_castps_pd(_mm256_shuffle_ps::<0x88>(v0, v1));
            let o = _mm256_castps_pd(_mm256_shuffle_ps::<0xDD>(v0, v1));
            let p0 = _mm256_castpd_ps(_mm256_permute4x64_pd::<0xD8>(e));
            let p1 = _mm256_castpd_ps(_mm256_permute4x64_pd::<0xD8>(o));
            let rot = _mm256_setr_epi32(1, 2, 3, 4, 5, 6, 7, 0);
            let p2 = _mm256_blend_ps::<0x80>(_mm256_permutevar8x32_ps(p0, rot), _mm256_set1_ps(*p.add(16)));
            let p3 = _mm256_blend_ps::<0x80>(_mm256_permutevar8x32_ps(p1, rot), _mm256_set1_ps(*p.add(17)));
            [Self(p0), Self(p1), Self(p2), Self(p3)]
        }
    }
    #[inline(always)]
    unsafe fn store_interleaved2(p: *mut f32, v: [Self; 2]) {
        // SAFETY: the caller's contract covers `p..p + 16`.
        unsafe {
            let u0 = _mm256_unpacklo_ps(v[0].0, v[1].0);
            let u1 = _mm256_unpackhi_ps(v[0].0, v[1].0);
            _mm256_storeu_ps(p, _mm256_permute2f128_ps::<0x20>(u0, u1));
            _mm256_storeu_ps(p.add(8), _mm256_permute2f128_ps::<0x31>(u0, u1));
        }
    }
}

/// Sixteen AVX-512 lanes.
#[derive(Clone, Copy)]
pub(crate) struct Avx512(__m512);

/// Eight AVX-512 f64 lanes.
#[derive(Clone, Copy)]
pub(crate) struct Avx512Wide(__m512d);

// Every method inlines into the AVX-512 kernels alone (see the module docs): the `unsafe`
// blocks that touch no memory need nothing more.
impl WideLanes for Avx512Wide {
    const L: usize = 8;
    #[inline(always)]
    unsafe fn load(p: *const f64) -> Self {
        // SAFETY: the caller's contract.
        Self(unsafe { _mm512_loadu_pd(p) })
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f64) {
        // SAFETY: the caller's contract.
        unsafe { _mm512_storeu_pd(p, self.0) }
    }
    #[inline(always)]
    fn splat(v: f64) -> Self {
        // SAFETY: register operands only, and AVX-512F is enabled wherever this inlines (module docs).
        Self(unsafe { _mm512_set1_pd(v) })
    }
    #[inline(always)]
    fn mul(self, o: Self) -> Self {
        // SAFETY: register operands only, and AVX-512F is enabled wherever this inlines (module docs).
        Self(unsafe { _mm512_mul_pd(self.0, o.0) })
    }
    #[inline(always)]
    fn add(self, o: Self) -> Self {
        // SAFETY: register operands only, and AVX-512F is enabled wherever this inlines (module docs).
        Self(unsafe { _mm512_add_pd(self.0, o.0) })
    }
    #[inline(always)]
    fn sub(self, o: Self) -> Self {
        // SAFETY: register operands only, and AVX-512F is enabled wherever this inlines (module docs).
        Self(unsafe { _mm512_sub_pd(self.0, o.0) })
    }
    #[inline(always)]
    fn fma(a: Self, b: Self, c: Self) -> Self {
        // SAFETY: register operands only, and AVX-512F is enabled wherever this inlines (module docs).
        Self(unsafe { _mm512_fmadd_pd(a.0, b.0, c.0) })
    }
    #[inline(always)]
    fn store_to(self, out: &mut [f64]) {
        assert!(out.len() >= 8);
        // SAFETY: eight values fit (checked).
        unsafe { _mm512_storeu_pd(out.as_mut_ptr(), self.0) }
    }
}

impl Lanes for Avx512 {
    const L: usize = 16;
    type Wide = Avx512Wide;

    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        // SAFETY: the caller's contract.
        Self(unsafe { _mm512_loadu_ps(p) })
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        // SAFETY: the caller's contract.
        unsafe { _mm512_storeu_ps(p, self.0) }
    }
    #[inline(always)]
    fn splat(v: f32) -> Self {
        // SAFETY: register operands only, and AVX-512F is enabled wherever this inlines (module docs).
        Self(unsafe { _mm512_set1_ps(v) })
    }
    #[inline(always)]
    fn add(self, o: Self) -> Self {
        // SAFETY: register operands only, and AVX-512F is enabled wherever this inlines (module docs).
        Self(unsafe { _mm512_add_ps(self.0, o.0) })
    }
    #[inline(always)]
    fn sub(self, o: Self) -> Self {
        // SAFETY: register operands only, and AVX-512F is enabled wherever this inlines (module docs).
        Self(unsafe { _mm512_sub_ps(self.0, o.0) })
    }
    #[inline(always)]
    fn mul(self, o: Self) -> Self {
        // SAFETY: register operands only, and AVX-512F is enabled wherever this inlines (module docs).
        Self(unsafe { _mm512_mul_ps(self.0, o.0) })
    }
    #[inline(always)]
    fn div(self, o: Self) -> Self {
        // SAFETY: register operands only, and AVX-512F is enabled wherever this inlines (module docs).
        Self(unsafe { _mm512_div_ps(self.0, o.0) })
    }
    #[inline(always)]
    fn fma(a: Self, b: Self, c: Self) -> Self {
        // SAFETY: register operands only, and AVX-512F is enabled wherever this inlines (module docs).
        Self(unsafe { _mm512_fmadd_ps(a.0, b.0, c.0) })
    }
    #[inline(always)]
    fn min(self, o: Self) -> Self {
        // SAFETY: register operands only, and AVX-512F is enabled wherever this inlines (module docs).
        Self(unsafe { _mm512_min_ps(self.0, o.0) })
    }
    #[inline(always)]
    fn max(self, o: Self) -> Self {
        // SAFETY: register operands only, and AVX-512F is enabled wherever this inlines (module docs).
        Self(unsafe { _mm512_max_ps(self.0, o.0) })
    }
    #[inline(always)]
    fn round(self) -> Self {
        // SAFETY: register operands only, and AVX-512F is enabled wherever this inlines (module docs).
        Self(unsafe { _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(self.0) })
    }
    #[inline(always)]
    fn pow2(self) -> Self {
        // SAFETY: register operands only, and AVX-512F is enabled wherever this inlines (module docs).
        unsafe {
            let n = _mm512_cvtps_epi32(self.0);
            Self(_mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(n, _mm512_set1_epi32(127)))))
        }
    }
    #[inline(always)]
    fn select_gt(self, o: Self, if_true: Self, if_false: Self) -> Self {
        // SAFETY: register operands only, and AVX-512F is enabled wherever this inlines (module docs).
        unsafe {
            let m = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(self.0, o.0);
            Self(_mm512_mask_blend_ps(m, if_false.0, if_true.0))
        }
    }
    #[inline(always)]
    fn keep_nan(self, other: Self) -> Self {
        // SAFETY: register operands only, and AVX-512F is enabled wherever this inlines (module docs).
        unsafe {
            let m = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(self.0, self.0);
            Self(_mm512_mask_blend_ps(m, other.0, self.0))
        }
    }
    #[inline(always)]
    fn widen(self) -> [Avx512Wide; 2] {
        // SAFETY: register operands only, and AVX-512F is enabled wherever this inlines (module docs).
        unsafe {
            [
                Avx512Wide(_mm512_cvtps_pd(_mm512_castps512_ps256(self.0))),
                Avx512Wide(_mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(self.0))))),
            ]
        }
    }
    #[inline(always)]
    fn narrow([a, b]: [Avx512Wide; 2]) -> Self {
        // SAFETY: register operands only, and AVX-512F is enabled wherever this inlines (module docs).
        unsafe {
            let lo = _mm512_castps256_ps512(_mm512_cvtpd_ps(a.0));
            let hi = _mm512_cvtpd_ps(b.0);
            Self(_mm512_castpd_ps(_mm512_insertf64x4::<1>(_mm512_castps_pd(lo), _mm256_castps_pd(hi))))
        }
    }
    #[inline(always)]
    unsafe fn load_windows(p: *const f32) -> [Self; 6] {
        // SAFETY: the caller's contract covers `p..p + 66`.
        unsafe {
            let v0 = _mm512_loadu_ps(p);
            let v1 = _mm512_loadu_ps(p.add(16));
            let v2 = _mm512_loadu_ps(p.add(32));
            let v3 = _mm512_loadu_ps(p.add(48));
            let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
            let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
            let a = _mm512_permutex2var_ps(v0, even, v1); // x0, x2, .., x30
            let b = _mm512_permutex2var_ps(v0, odd, v1); // x1, x3, .., x31
            let c = _mm512_permutex2var_ps(v2, even, v3); // x32, .., x62
            let d = _mm512_permutex2var_ps(v2, odd, v3); // x33, .., x63
            let p0 = _mm512_permutex2var_ps(a, even, c);
            let p2 = _mm512_permutex2var_ps(a, odd, c);
            let p1 = _mm512_permutex2var_ps(b, even, d);
            let p3 = _mm512_permutex2var_ps(b, odd, d);
            // The next window's first two values: shift one lane, the last from x[64..66].
            let p4 = _mm512_castsi512_ps(_mm512_alignr_epi32::<1>(
                _mm512_castps_si512(_mm512_set1_ps(*p.add(64))),
                _mm512_castps_si512(p0),
            ));
            let p5 = _mm512_castsi512_ps(_mm512_alignr_epi32::<1>(
                _mm512_castps_si512(_mm512_set1_ps(*p.add(65))),
                _mm512_castps_si512(p1),
            ));
            [Self(p0), Self(p1), Self(p2), Self(p3), Self(p4), Self(p5)]
        }
    }
    #[inline(always)]
    unsafe fn store_interleaved(p: *mut f32, v: [Self; 4]) {
        // SAFETY: the caller's contract covers `p..p + 64`.
        unsafe {
            let lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
            let hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
            let lo02 = _mm512_permutex2var_ps(v[0].0, lo, v[2].0);
            let hi02 = _mm512_permutex2var_ps(v[0].0, hi, v[2].0);
            let lo13 = _mm512_permutex2var_ps(v[1].0, lo, v[3].0);
            let hi13 = _mm512_permutex2var_ps(v[1].0, hi, v[3].0);
            _mm512_storeu_ps(p, _mm512_permutex2var_ps(lo02, lo, lo13));
            _mm512_storeu_ps(p.add(16), _mm512_permutex2var_ps(lo02, hi, lo13));
            _mm512_storeu_ps(p.add(32), _mm512_permutex2var_ps(hi02, lo, hi13));
            _mm512_storeu_ps(p.add(48), _mm512_permutex2var_ps(hi02, hi, hi13));
        }
    }
    #[inline(always)]
    unsafe fn load_windows2(p: *const f32) -> [Self; 4] {
        // SAFETY: the caller's contract covers `p..p + 34`.
        unsafe {
            let v0 = _mm512_loadu_ps(p);
            let v1 = _mm512_loadu_ps(p.add(16));
            let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
            let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
            let p0 = _mm512_permutex2var_ps(v0, even, v1);
            let p1 = _mm512_permutex2var_ps(v0, odd, v1);
            let p2 = _mm512_castsi512_ps(_mm512_alignr_epi32::<1>(
                _mm512_castps_si512(_mm512_set1_ps(*p.add(32))),
                _mm512_castps_si512(p0),
            ));
            let p3 = _mm512_castsi512_ps(_mm512_alignr_epi32::<1>(
                _mm512_castps_si512(_mm512_set1_ps(*p.add(33))),
                _mm512_castps_si512(p1),
            ));
            [Self(p0), Self(p1), Self(p2), Self(p3)]
        }
    }
    #[inline(always)]
    unsafe fn store_interleaved2(p: *mut f32, v: [Self; 2]) {
        // SAFETY: the caller's contract covers `p..p + 32`.
        unsafe {
            let lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
            let hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
            _mm512_storeu_ps(p, _mm512_permutex2var_ps(v[0].0, lo, v[1].0));
            _mm512_storeu_ps(p.add(16), _mm512_permutex2var_ps(v[0].0, hi, v[1].0));
        }
    }
}
