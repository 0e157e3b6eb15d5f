//! bf16 operands for the CPU convolutions: rounding f32 to bf16 the way AVX512-BF16 does, and
//! packing two reduction steps into one `u32` for `vdpbf16ps` (step `2q` in the low half).
//!
//! Only the products of a convolution are in bf16 (its input and weights rounded to nearest,
//! ties to even, once); sums, biases, the output and every other op stay f32. That is
//! PyTorch's bf16 convolution arithmetic without its rounding of every activation to bf16.

/// The bf16 bits of `x` as `vcvtne2ps2bf16` makes them: round to nearest even, denormal
/// inputs taken as (signed) zero, NaN made quiet.
pub(crate) fn bits(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        ((b >> 16) | 0x40) as u16
    } else if x.is_subnormal() {
        ((b >> 16) & 0x8000) as u16
    } else {
        ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) as u16
    }
}

/// The f32 value of bf16 bits.
#[cfg(test)]
pub(crate) fn value(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// One `vdpbf16ps` operand of two steps: `lo` in the low half, `hi` in the high half.
pub(crate) fn pair(lo: f32, hi: f32) -> u32 {
    bits(lo) as u32 | (bits(hi) as u32) << 16
}

/// `out[j] = pair(lo[j], hi[j])` for every `j`, with AVX512-BF16 (the same bits as [`pair`]).
///
/// # Panics
/// If the slices differ in length, or (a bug) the CPU lacks AVX512-BF16.
pub(crate) fn pack_pairs(lo: &[f32], hi: &[f32], out: &mut [u32]) {
    assert!(lo.len() == out.len() && hi.len() == out.len(), "pair rows of different lengths");
    #[cfg(target_arch = "x86_64")]
    if crate::ops::simd::bf16_supported() {
        // SAFETY: the features were detected, and the slices are as long as `out`.
        unsafe { x86::pack_pairs(lo, hi, out) };
        return;
    }
    unreachable!("bf16 convolutions run only where AVX512-BF16 was detected");
}

/// `out[c] = pair(src[first + 2c·stride], src[first + (2c + 1)·stride])` for `c < 16`: 32
/// values `stride` apart as bf16 pairs, with AVX512-BF16 (the same bits as [`pair`]).
///
/// # Panics
/// If `src` ends before the last value, or (a bug) the CPU lacks AVX512-BF16.
pub(crate) fn gather_pairs(src: &[f32], first: usize, stride: usize, out: &mut [u32; 16]) {
    let last = first + 31 * stride;
    assert!(last < src.len() && i32::try_from(31 * stride).is_ok(), "gather past the end");
    #[cfg(target_arch = "x86_64")]
    if crate::ops::simd::bf16_supported() {
        // SAFETY: the features were detected; the 32 indices lie in `src` (checked).
        unsafe { x86::gather_pairs(&src[first..=last], stride, out) };
        return;
    }
    unreachable!("bf16 convolutions run only where AVX512-BF16 was detected");
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// # Safety
    /// AVX-512F/BW and AVX512-BF16 must be available; `src` holds `31·stride + 1` values and
    /// `31·stride` fits an `i32`.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn gather_pairs(src: &[f32], stride: usize, out: &mut [u32; 16]) {
        let s = stride as i32;
        let even = _mm512_mullo_epi32(
            _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30),
            _mm512_set1_epi32(s),
        );
        let odd = _mm512_add_epi32(even, _mm512_set1_epi32(s));
        // SAFETY: every index is at most 31·stride, inside `src` (the caller's contract).
        unsafe {
            let lo = _mm512_i32gather_ps::<4>(even, src.as_ptr().cast());
            let hi = _mm512_i32gather_ps::<4>(odd, src.as_ptr().cast());
            let words: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
            _mm512_storeu_si512(out.as_mut_ptr().cast(), _mm512_permutexvar_epi16(pair_order(), words));
        }
    }

    /// `vpermw` indices that interleave `cvtne2ps`'s two halves into pairs: word 2j takes word
    /// j (the low operand's lane j), word 2j + 1 word j + 16.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn pair_order() -> __m512i {
        _mm512_setr_epi32(
            0x0010_0000,
            0x0011_0001,
            0x0012_0002,
            0x0013_0003,
            0x0014_0004,
            0x0015_0005,
            0x0016_0006,
            0x0017_0007,
            0x0018_0008,
            0x0019_0009,
            0x001A_000A,
            0x001B_000B,
            0x001C_000C,
            0x001D_000D,
            0x001E_000E,
            0x001F_000F,
        )
    }

    /// # Safety
    /// AVX-512F/BW and AVX512-BF16 must be available; the three slices are equally long.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn pack_pairs(lo: &[f32], hi: &[f32], out: &mut [u32]) {
        let n = out.len();
        let idx = pair_order();
        // cvtne2ps: words 0..16 from its second operand, 16..32 from its first. (Written out
        // twice rather than in a closure, which would not share this function's features.)
        let full = n / 16 * 16;
        let mut j = 0;
        while j < full {
            // SAFETY: `j + 16 ≤ n` for the three slices.
            unsafe {
                let (l, h) = (_mm512_loadu_ps(lo.as_ptr().add(j)), _mm512_loadu_ps(hi.as_ptr().add(j)));
                let words: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(h, l));
                _mm512_storeu_si512(out.as_mut_ptr().add(j).cast(), _mm512_permutexvar_epi16(idx, words));
            }
            j += 16;
        }
        if full < n {
            let rest = n - full;
            let (mut l, mut h, mut o) = ([0.0f32; 16], [0.0f32; 16], [0u32; 16]);
            l[..rest].copy_from_slice(&lo[full..]);
            h[..rest].copy_from_slice(&hi[full..]);
            // SAFETY: the stack arrays hold 16 values each.
            unsafe {
                let (l, h) = (_mm512_loadu_ps(l.as_ptr()), _mm512_loadu_ps(h.as_ptr()));
                let words: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(h, l));
                _mm512_storeu_si512(o.as_mut_ptr().cast(), _mm512_permutexvar_epi16(idx, words));
            }
            out[full..].copy_from_slice(&o[..rest]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples() -> Vec<f32> {
        let mut v: Vec<f32> = (0..20000).map(|i| ((i as f32) * 0.37).sin() * 10f32.powi(i % 9 - 4)).collect();
        v.extend([
            0.0,
            -0.0,
            1.0,
            -1.0,
            f32::MAX,
            -f32::MAX,
            f32::MIN_POSITIVE,
            1e-40,
            -1e-40,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            1.0 + 2f32.powi(-8),         // a tie: rounds to even (1.0)
            1.0 + 3.0 * 2f32.powi(-8),   // a tie: rounds to even (1 + 2^-6)
            f32::from_bits(0x3F80_8001), // just above a tie: rounds up
            f32::from_bits(0x7F7F_FFFF), // rounds to infinity
        ]);
        v
    }

    #[test]
    fn rounding_is_to_nearest_even_with_denormals_as_zero() {
        assert_eq!(value(bits(1.0 + 2f32.powi(-8))), 1.0);
        assert_eq!(value(bits(1.0 + 3.0 * 2f32.powi(-8))), 1.0 + 2f32.powi(-6));
        assert_eq!(value(bits(f32::from_bits(0x3F80_8001))), 1.0 + 2f32.powi(-7));
        assert_eq!(value(bits(f32::MAX)), f32::INFINITY);
        assert_eq!(bits(-1e-40), 0x8000);
        assert!(value(bits(f32::NAN)).is_nan());
        for x in samples().into_iter().filter(|x| x.is_normal() && x.abs() < 1e38) {
            let r = value(bits(x));
            // Within half a bf16 ulp (8 significant bits) of x.
            let half_ulp = 2f32.powi(x.abs().log2().floor() as i32 - 8);
            assert!((r - x).abs() <= half_ulp, "{x} -> {r}");
        }
    }

    #[test]
    fn gathered_pairs_give_the_scalar_bits() {
        if !crate::ops::simd::bf16_supported() {
            return; // no AVX512-BF16 here: bf16 convolutions are refused on this CPU
        }
        let xs = samples();
        for (first, stride) in [(0, 1), (3, 9), (100, 27), (xs.len() - 1 - 31 * 600, 600)] {
            let mut out = [0u32; 16];
            gather_pairs(&xs, first, stride, &mut out);
            for (c, &o) in out.iter().enumerate() {
                let want = pair(xs[first + 2 * c * stride], xs[first + (2 * c + 1) * stride]);
                let same = |a: u16, b: u16| a == b || (value(a).is_nan() && value(b).is_nan());
                assert!(
                    same(o as u16, want as u16) && same((o >> 16) as u16, (want >> 16) as u16),
                    "{first} {stride} {c}"
                );
            }
        }
    }

    #[test]
    fn the_vector_packing_gives_the_scalar_bits() {
        if !crate::ops::simd::bf16_supported() {
            return; // no AVX512-BF16 here: bf16 convolutions are refused on this CPU
        }
        let xs = samples();
        let (lo, hi) = (&xs[..xs.len() - 7], &xs[7..]);
        let mut out = vec![0u32; lo.len()];
        pack_pairs(lo, hi, &mut out);
        for (j, &o) in out.iter().enumerate() {
            let want = pair(lo[j], hi[j]);
            let same = |a: u16, b: u16| a == b || (value(a).is_nan() && value(b).is_nan());
            let ok = same(o as u16, want as u16) && same((o >> 16) as u16, (want >> 16) as u16);
            assert!(ok, "{j}: {o:#010x} vs {want:#010x} for {} {}", lo[j], hi[j]);
        }
    }
}
