//! Vectors of f32 (and f64) lanes with the operations the CPU kernels need, for each
//! instruction set, and the math built on them once ([`exp`], [`silu`]).
//!
//! Kernels are written once, generically over [`Lanes`], and instantiated inside a
//! `#[target_feature]` function per instruction set (see [`crate::ops::simd`]), so every
//! operation inlines to one instruction. Each lane sees the same operations in the same order on
//! every path, fused multiply-adds included, so the paths agree bit for bit. (Reductions that
//! must not depend on the vector width, or on how a map is split, are exact: see
//! `ops::group_stats`.)
//!
//! The x86 lane types are only ever built inside those `#[target_feature]` kernels, which run
//! only where [`crate::ops::simd::Isa::supported`] confirmed the features: that is what makes
//! their safe methods sound.

/// `L` lanes of f32.
pub(crate) trait Lanes: Copy {
    /// Lanes per vector: 8 or 16.
    const L: usize;
    /// `L / 2` lanes of f64.
    type Wide: WideLanes;

    /// Loads `L` values.
    ///
    /// # Safety
    /// `p..p + L` must be readable.
    unsafe fn load(p: *const f32) -> Self;

    /// Stores `L` values.
    ///
    /// # Safety
    /// `p..p + L` must be writable.
    unsafe fn store(self, p: *mut f32);

    /// Every lane `v`.
    fn splat(v: f32) -> Self;
    /// `self + o`.
    fn add(self, o: Self) -> Self;
    /// `self − o`.
    fn sub(self, o: Self) -> Self;
    /// `self · o`.
    fn mul(self, o: Self) -> Self;
    /// `self / o`.
    fn div(self, o: Self) -> Self;
    /// `a · b + c`, rounded once.
    fn fma(a: Self, b: Self, c: Self) -> Self;
    /// The smaller of each pair; `o` where either is NaN.
    fn min(self, o: Self) -> Self;
    /// The larger of each pair; `o` where either is NaN.
    fn max(self, o: Self) -> Self;
    /// Rounded to the nearest integer, ties to even.
    fn round(self) -> Self;
    /// `2^n` for lanes holding integers `n` in `-126..=127`.
    fn pow2(self) -> Self;
    /// Lanes of `if_true` where `self > o`, else of `if_false`.
    fn select_gt(self, o: Self, if_true: Self, if_false: Self) -> Self;
    /// Lanes of `self` where `self` is NaN, else of `other`.
    fn keep_nan(self, other: Self) -> Self;
    /// The lanes as f64, the first half then the second.
    fn widen(self) -> [Self::Wide; 2];
    /// Two halves of f64 lanes rounded to f32.
    fn narrow(halves: [Self::Wide; 2]) -> Self;

    /// From `4·L + 2` consecutive values `x`, the six phases of `L` overlapping 6-wide windows
    /// 4 apart: lane `j` of phase `m` is `x[4j + m]`.
    ///
    /// # Safety
    /// `p..p + 4·L + 2` must be readable.
    unsafe fn load_windows(p: *const f32) -> [Self; 6];

    /// Stores four vectors interleaved: `p[4j + b] = v[b][j]`.
    ///
    /// # Safety
    /// `p..p + 4·L` must be writable.
    unsafe fn store_interleaved(p: *mut f32, v: [Self; 4]);

    /// From `2·L + 2` consecutive values `x`, the four phases of `L` overlapping 4-wide windows
    /// 2 apart: lane `j` of phase `m` is `x[2j + m]`.
    ///
    /// # Safety
    /// `p..p + 2·L + 2` must be readable.
    unsafe fn load_windows2(p: *const f32) -> [Self; 4];

    /// Stores two vectors interleaved: `p[2j + b] = v[b][j]`.
    ///
    /// # Safety
    /// `p..p + 2·L` must be writable.
    unsafe fn store_interleaved2(p: *mut f32, v: [Self; 2]);
}

/// `L / 2` lanes of f64: the wide half of a [`Lanes`].
pub(crate) trait WideLanes: Copy {
    /// Lanes per vector: 4 or 8.
    const L: usize;
    /// Loads as many values as the vector has lanes.
    ///
    /// # Safety
    /// That many values from `p` must be readable.
    unsafe fn load(p: *const f64) -> Self;
    /// Stores the lanes.
    ///
    /// # Safety
    /// As many values as the vector has lanes from `p` must be writable.
    unsafe fn store(self, p: *mut f64);
    /// Every lane `v`.
    fn splat(v: f64) -> Self;
    /// `self · o`.
    fn mul(self, o: Self) -> Self;
    /// `self + o`.
    fn add(self, o: Self) -> Self;
    /// `self − o`.
    fn sub(self, o: Self) -> Self;
    /// `a · b + c`, rounded once.
    fn fma(a: Self, b: Self, c: Self) -> Self;
    /// Stores the lanes into `out` (which holds at least as many).
    fn store_to(self, out: &mut [f64]);
}

/// `e^x` to within about one ulp (Cephes' `expf` polynomial on a Cody–Waite reduction), the same
/// bits on every instruction set. `x > 88.72` gives +∞; `x < −86.6` gives 0 (the exact values
/// there are below 2.4·10⁻³⁸); NaN stays NaN.
#[inline(always)]
pub(crate) fn exp<S: Lanes>(x: S) -> S {
    const HI: f32 = 88.722_83;
    const LO: f32 = -86.6;
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let xc = x.max(S::splat(LO)).min(S::splat(HI));
    let n = xc.mul(S::splat(LOG2E)).round();
    let r = S::fma(n, S::splat(-LN2_HI), xc);
    let r = S::fma(n, S::splat(-LN2_LO), r);
    let mut p = S::splat(1.987_569_1e-4);
    for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5] {
        p = S::fma(p, r, S::splat(c));
    }
    let e = S::fma(p, r.mul(r), r).add(S::splat(1.0));
    // e · 2^n as (e · 2^(n−1)) · 2, so that n = 128 (x near HI) still has a normal power.
    let y = e.mul(n.sub(S::splat(1.0)).pow2()).mul(S::splat(2.0));
    let y = x.select_gt(S::splat(HI), S::splat(f32::INFINITY), y);
    let y = S::splat(LO).select_gt(x, S::splat(0.0), y);
    x.keep_nan(y)
}

/// SiLU, `x / (1 + e^(−x))`: for very negative `x` the exponential is +∞ and the quotient a
/// correctly signed zero, as in PyTorch.
#[inline(always)]
pub(crate) fn silu<S: Lanes>(x: S) -> S {
    x.div(S::splat(1.0).add(exp(S::splat(0.0).sub(x))))
}

/// A function of lanes, for [`map`]. (A trait with an always-inlined method rather than a
/// closure: closures are functions of their own that do not inherit the caller's target
/// features, and once not inlined every lane operation in them becomes a call.)
pub(crate) trait LaneMap<S: Lanes> {
    /// The function.
    fn apply(&self, x: S) -> S;
}

/// [`silu`] as a [`LaneMap`].
pub(crate) struct Silu;

impl<S: Lanes> LaneMap<S> for Silu {
    #[inline(always)]
    fn apply(&self, x: S) -> S {
        silu(x)
    }
}

/// `dst[i] = f(src[i])` lane by lane; the last partial vector goes through a zero-padded copy,
/// so every element sees the same operations.
#[inline(always)]
pub(crate) fn map<S: Lanes, F: LaneMap<S>>(src: &[f32], dst: &mut [f32], f: &F) {
    assert_eq!(src.len(), dst.len());
    let full = src.len() / S::L * S::L;
    let mut i = 0;
    while i < full {
        // SAFETY: `i + L ≤ full ≤ len` for both slices.
        unsafe { f.apply(S::load(src.as_ptr().add(i))).store(dst.as_mut_ptr().add(i)) };
        i += S::L;
    }
    if full < src.len() {
        let mut buf = [0.0f32; 16];
        let rest = src.len() - full;
        buf[..rest].copy_from_slice(&src[full..]);
        // SAFETY: `buf` holds 16 ≥ L values.
        unsafe { f.apply(S::load(buf.as_ptr())).store(buf.as_mut_ptr()) };
        dst[full..].copy_from_slice(&buf[..rest]);
    }
}

/// Eight lanes in plain Rust (the portable path), every product-sum through `mul_add`.
#[derive(Clone, Copy)]
pub(crate) struct Portable([f32; 8]);

/// Four f64 lanes in plain Rust.
#[derive(Clone, Copy)]
pub(crate) struct PortableWide([f64; 4]);

impl WideLanes for PortableWide {
    const L: usize = 4;
    #[inline(always)]
    unsafe fn load(p: *const f64) -> Self {
        // SAFETY: the caller's contract.
        Self(unsafe { std::ptr::read_unaligned(p.cast::<[f64; 4]>()) })
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f64) {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::write_unaligned(p.cast::<[f64; 4]>(), self.0) }
    }
    #[inline(always)]
    fn splat(v: f64) -> Self {
        Self([v; 4])
    }
    #[inline(always)]
    fn mul(self, o: Self) -> Self {
        Self(std::array::from_fn(|i| self.0[i] * o.0[i]))
    }
    #[inline(always)]
    fn add(self, o: Self) -> Self {
        Self(std::array::from_fn(|i| self.0[i] + o.0[i]))
    }
    #[inline(always)]
    fn sub(self, o: Self) -> Self {
        Self(std::array::from_fn(|i| self.0[i] - o.0[i]))
    }
    #[inline(always)]
    fn fma(a: Self, b: Self, c: Self) -> Self {
        Self(std::array::from_fn(|i| a.0[i].mul_add(b.0[i], c.0[i])))
    }
    #[inline(always)]
    fn store_to(self, out: &mut [f64]) {
        out[..4].copy_from_slice(&self.0);
    }
}

impl Portable {
    #[inline(always)]
    fn map(self, f: impl Fn(f32) -> f32) -> Self {
        Self(self.0.map(f))
    }

    #[inline(always)]
    fn zip(self, o: Self, f: impl Fn(f32, f32) -> f32) -> Self {
        Self(std::array::from_fn(|i| f(self.0[i], o.0[i])))
    }
}

impl Lanes for Portable {
    const L: usize = 8;
    type Wide = PortableWide;

    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        // SAFETY: the caller's contract.
        Self(unsafe { std::ptr::read_unaligned(p.cast::<[f32; 8]>()) })
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::write_unaligned(p.cast::<[f32; 8]>(), self.0) }
    }
    #[inline(always)]
    fn splat(v: f32) -> Self {
        Self([v; 8])
    }
    #[inline(always)]
    fn add(self, o: Self) -> Self {
        self.zip(o, |a, b| a + b)
    }
    #[inline(always)]
    fn sub(self, o: Self) -> Self {
        self.zip(o, |a, b| a - b)
    }
    #[inline(always)]
    fn mul(self, o: Self) -> Self {
        self.zip(o, |a, b| a * b)
    }
    #[inline(always)]
    fn div(self, o: Self) -> Self {
        self.zip(o, |a, b| a / b)
    }
    #[inline(always)]
    fn fma(a: Self, b: Self, c: Self) -> Self {
        Self(std::array::from_fn(|i| a.0[i].mul_add(b.0[i], c.0[i])))
    }
    #[inline(always)]
    fn min(self, o: Self) -> Self {
        // As x86's `minps`: the second operand unless the first is strictly smaller.
        self.zip(o, |a, b| if a < b { a } else { b })
    }
    #[inline(always)]
    fn max(self, o: Self) -> Self {
        self.zip(o, |a, b| if a > b { a } else { b })
    }
    #[inline(always)]
    fn round(self) -> Self {
        self.map(f32::round_ties_even)
    }
    #[inline(always)]
    fn pow2(self) -> Self {
        self.map(|n| f32::from_bits(((n as i32 + 127) as u32) << 23))
    }
    #[inline(always)]
    fn select_gt(self, o: Self, if_true: Self, if_false: Self) -> Self {
        Self(std::array::from_fn(|i| if self.0[i] > o.0[i] { if_true.0[i] } else { if_false.0[i] }))
    }
    #[inline(always)]
    fn keep_nan(self, other: Self) -> Self {
        self.zip(other, |a, b| if a.is_nan() { a } else { b })
    }
    #[inline(always)]
    fn widen(self) -> [PortableWide; 2] {
        [
            PortableWide(std::array::from_fn(|i| self.0[i] as f64)),
            PortableWide(std::array::from_fn(|i| self.0[4 + i] as f64)),
        ]
    }
    #[inline(always)]
    fn narrow([a, b]: [PortableWide; 2]) -> Self {
        Self(std::array::from_fn(|i| if i < 4 { a.0[i] as f32 } else { b.0[i - 4] as f32 }))
    }
    #[inline(always)]
    unsafe fn load_windows(p: *const f32) -> [Self; 6] {
        // SAFETY: the caller's contract covers `p + 4·7 + 5`.
        std::array::from_fn(|m| Self(std::array::from_fn(|j| unsafe { *p.add(4 * j + m) })))
    }
    #[inline(always)]
    unsafe fn store_interleaved(p: *mut f32, v: [Self; 4]) {
        for j in 0..8 {
            for (b, vb) in v.iter().enumerate() {
                // SAFETY: the caller's contract covers `p + 4·7 + 3`.
                unsafe { *p.add(4 * j + b) = vb.0[j] };
            }
        }
    }
    #[inline(always)]
    unsafe fn load_windows2(p: *const f32) -> [Self; 4] {
        // SAFETY: the caller's contract covers `p + 2·7 + 3`.
        std::array::from_fn(|m| Self(std::array::from_fn(|j| unsafe { *p.add(2 * j + m) })))
    }
    #[inline(always)]
    unsafe fn store_interleaved2(p: *mut f32, v: [Self; 2]) {
        for j in 0..8 {
            for (b, vb) in v.iter().enumerate() {
                // SAFETY: the caller's contract covers `p + 2·7 + 1`.
                unsafe { *p.add(2 * j + b) = vb.0[j] };
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::{Avx2, Avx512};

#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::simd::Isa;

    crate::ops::simd::isa_kernel! {
        fn exp_into(src: &[f32], dst: &mut [f32]) = exp_kernel;
    }

    struct Exp;

    impl<S: Lanes> LaneMap<S> for Exp {
        #[inline(always)]
        fn apply(&self, x: S) -> S {
            exp(x)
        }
    }

    #[inline(always)]
    fn exp_kernel<S: Lanes>(src: &[f32], dst: &mut [f32]) {
        map::<S, _>(src, dst, &Exp);
    }

    /// Every f32 from −104 to 90 in steps of about 1e-4, the edges, and the specials.
    fn inputs() -> Vec<f32> {
        let mut xs: Vec<f32> = (0..1_940_000).map(|i| -104.0 + i as f32 * 1e-4).collect();
        xs.extend([
            0.0,
            -0.0,
            88.72,
            88.7228,
            88.73,
            -86.59,
            -86.61,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            1e-30,
        ]);
        xs
    }

    #[test]
    fn exp_is_within_two_ulps_and_the_same_on_every_instruction_set() {
        let xs = inputs();
        let mut first: Option<Vec<f32>> = None;
        for isa in Isa::all_supported() {
            let mut got = vec![0.0f32; xs.len()];
            exp_into(isa, &xs, &mut got);
            for (&x, &y) in xs.iter().zip(&got) {
                let want = (x as f64).exp();
                if x.is_nan() {
                    assert!(y.is_nan());
                } else if x > 88.722_83 {
                    assert_eq!(y, f32::INFINITY, "{x}");
                } else if x < -86.6 {
                    assert_eq!(y, 0.0, "{x}");
                } else {
                    let ulp = f32::from_bits((want as f32).to_bits() + 1) as f64 - want as f32 as f64;
                    assert!(((y as f64) - want).abs() <= 2.0 * ulp, "{isa:?} exp({x}) = {y}, want {want}");
                }
            }
            match &first {
                None => first = Some(got),
                Some(f) => assert!(f.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits()), "{isa:?}"),
            }
        }
    }

    #[test]
    fn silu_keeps_pytorchs_limits() {
        for isa in Isa::all_supported() {
            let xs = [-1e4f32, -100.0, -88.8, 0.0, -0.0, 1.0, 100.0, 1e4, f32::NAN];
            let mut got = [0.0f32; 9];
            crate::ops::silu_into(isa, &xs, &mut got);
            assert_eq!(got[0].to_bits(), (-0.0f32).to_bits(), "x / inf is a negative zero");
            assert!(got[1] <= 0.0 && got[1] > -1e-30);
            assert_eq!(got[3], 0.0);
            assert_eq!(got[6], 100.0);
            assert_eq!(got[7], 1e4);
            assert!(got[8].is_nan());
            assert!((got[5] - 0.731_058_6).abs() < 1e-6);
        }
    }
}
