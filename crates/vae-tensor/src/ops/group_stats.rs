//! GroupNorm statistics that do not depend on how a group's elements are split.
//!
//! A sharded decode cuts every feature map into bands of rows (or columns) on several ranks,
//! and its output must equal the single-device decode bit for bit, whatever the cut. Floating
//! sums depend on their order, so the mean and the variance are summed in fixed point instead:
//! each term is scaled by a power of two, rounded to an integer, and the integers are added
//! exactly. Any split into bands, tiles or threads, and any order of adding their partial
//! sums, then gives the same mean and variance. Two passes, as exact two-pass statistics need:
//! the sum (with the extrema, in the same pass), then the squared deviations around the mean
//! (`nn.GroupNorm`'s biased variance).
//!
//! The sum's terms are multiples of 2^-36 (values below 2^15; larger ones, never seen in a
//! VAE, are summed again at a scale from the group's extrema): the mean is within 2^-37 of
//! exact, which moves the output `(x − mean) · rstd` (with `var + eps ≥ 10⁻⁶`) by at most
//! 0.06 f32 ulp. The squared deviations are scaled from the group's largest one (known from the
//! extrema and the mean), so the variance keeps 2^-51 of it. Terms are below 2^51; `i64` vector
//! lanes add 2^11 of them exactly, then `i128`.
//!
//! [`GroupMoments::local`] computes the statistics of one tensor; a distributed caller passes
//! [`GroupMoments::compute`] a reduction across its parts (merge the extrema, add the sums),
//! then normalises with [`Tensor::group_norm_with`].

use rayon::prelude::*;

use crate::ops::simd::Isa;
use crate::{Result, Tensor, TensorError};

/// Largest magnitude of a term, as a power of two.
const TERM_BITS: i32 = 51;

/// Terms each `i64` lane adds before its sum moves to `i128` (2^51 · 2^11 < 2^63).
const LANE_TERMS: usize = 1 << 11;

/// 1.5 · 2^52: for a real `y` with `|y| < 2^51`, `fma(a, b, MAGIC)` with `a · b = y` rounds
/// `y + MAGIC` once, to the f64 whose bits, less `MAGIC`'s, are `y` rounded to the nearest
/// integer (ties to even). One fused operation per term, with the same result on every
/// instruction set.
const MAGIC: f64 = 6755399441055744.0;

/// `MAGIC`'s bits: each term is added with them, and they are taken off once per block.
const MAGIC_BITS: i64 = 0x4338_0000_0000_0000;

/// The sum's fixed scale, for groups whose values stay below 2^(51 − 36).
const FIXED_SUM: i32 = 36;

/// The bits of `a · b + MAGIC` (rounded once): the term `round(a · b)` plus [`MAGIC_BITS`].
#[inline(always)]
fn biased_term(a: f64, b: f64) -> i64 {
    a.mul_add(b, MAGIC).to_bits() as i64
}

/// What a pass sums: `round(v · 2^36)` (`Sum`), or `round(d²)` with `d = round((v − mean) ·
/// 2^(s/2))` (`Squares`, for an even scale exponent `s`: the same `d` as scaling the rounded
/// deviation, since powers of two scale exactly).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Terms {
    Sum { scale: f64 },
    Squares { root_scale: f64, scaled_mean: f64 },
}

impl Terms {
    fn sum(scale_exponent: i32) -> Self {
        Self::Sum { scale: pow2(scale_exponent) }
    }

    /// `scale_exponent` even.
    fn squares(mean: f64, scale_exponent: i32) -> Self {
        let root_scale = pow2(scale_exponent / 2);
        Self::Squares { root_scale, scaled_mean: mean * root_scale }
    }

    #[inline(always)]
    fn biased(self, v: f32) -> i64 {
        let v = f64::from(v);
        match self {
            Self::Sum { scale } => biased_term(v, scale),
            Self::Squares { root_scale, scaled_mean } => {
                let d = v.mul_add(root_scale, -scaled_mean);
                biased_term(d, d)
            }
        }
    }
}

/// The smallest and largest value of each (sample, group), in that order.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GroupExtrema {
    /// Smallest value.
    pub min: f32,
    /// Largest value.
    pub max: f32,
}

impl GroupExtrema {
    /// Extrema of nothing: the identity of [`Self::merge`].
    pub const EMPTY: Self = Self { min: f32::INFINITY, max: f32::NEG_INFINITY };

    /// The extrema of two parts together (exact, in any order).
    pub fn merge(self, other: Self) -> Self {
        Self { min: self.min.min(other.min), max: self.max.max(other.max) }
    }

    /// The sum's scale: fixed, or from the extrema for values beyond its range.
    fn sum_scale(&self) -> i32 {
        let bound = f64::from(self.min.abs()).max(f64::from(self.max.abs()));
        if bound < pow2(TERM_BITS - FIXED_SUM) { FIXED_SUM } else { scale_for(bound) }
    }

    /// The squared deviations' scale (even), from the largest: the largest deviation from
    /// `mean` is at an extremum, and rounding is monotonic, so no term exceeds the bound.
    fn square_scale(&self, mean: f64) -> i32 {
        let d = (f64::from(self.max) - mean).abs().max((f64::from(self.min) - mean).abs());
        scale_for(d * d) & !1
    }
}

/// One part's statistics of one (sample, group): what parts exchange and merge.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GroupPartial {
    /// The part's extrema ([`GroupExtrema::EMPTY`] where a step does not need them).
    pub extrema: GroupExtrema,
    /// The part's fixed-point sum (of values, or of squared deviations).
    pub sum: i128,
}

impl GroupPartial {
    /// Two parts together (exact, in any order).
    pub fn merge(self, other: Self) -> Self {
        Self { extrema: self.extrema.merge(other.extrema), sum: self.sum.wrapping_add(other.sum) }
    }
}

/// The exponent `s` with `bound · 2^s < 2^TERM_BITS`, from `bound`'s exponent bits (exact and
/// the same on every machine, unlike a library `log2`); 0 for a zero or non-finite bound.
fn scale_for(bound: f64) -> i32 {
    if bound.is_nan() || bound <= 0.0 || !bound.is_finite() {
        return 0;
    }
    // A normal bound lies in [2^(b − 1023), 2^(b − 1022)) for its biased exponent b; a
    // subnormal one below 2^-1022.
    let biased = ((bound.to_bits() >> 52) & 0x7ff) as i32;
    TERM_BITS - (biased.max(1) - 1022)
}

/// `2^s` as an f64, exact for −1000 < s < 1100: the product of two powers built from their
/// exponent bits.
fn pow2(s: i32) -> f64 {
    let bits = |e: i32| f64::from_bits(((e + 1023) as u64) << 52);
    let half = s / 2;
    bits(half) * bits(s - half)
}

/// The mean and `1 / √(var + eps)` of each (sample, group).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GroupMoments {
    /// The mean.
    pub mean: f64,
    /// The reciprocal standard deviation, with `eps` added to the variance.
    pub rstd: f64,
}

impl GroupMoments {
    /// The statistics of `x` alone (`[N, C, *]`, `num_groups` groups): what
    /// [`Tensor::group_norm`] normalises with.
    pub fn local(x: &Tensor, num_groups: usize, eps: f32) -> Result<Vec<Self>> {
        let count = x.group_len(num_groups)? as u64;
        Self::compute(x, num_groups, eps, count, Ok)
    }

    /// The statistics of a map of which `x` is one part (a band; `count` elements per group in
    /// the whole map), `reduce` merging every part's [`GroupPartial`]s (one per (sample,
    /// group), sample-major) into the whole map's. Every part must call it alike: `reduce`
    /// runs two or three times, the same number on every part (the third only for values
    /// beyond the fixed range, decided from the merged extrema).
    pub fn compute<E: From<TensorError>>(
        x: &Tensor,
        num_groups: usize,
        eps: f32,
        count: u64,
        mut reduce: impl FnMut(Vec<GroupPartial>) -> std::result::Result<Vec<GroupPartial>, E>,
    ) -> std::result::Result<Vec<Self>, E> {
        let groups = x.dims().first().copied().unwrap_or(0) * num_groups;
        let merged = |parts: Vec<GroupPartial>| -> std::result::Result<Vec<GroupPartial>, E> {
            if parts.len() != groups {
                return Err(TensorError::InvalidArgument {
                    op: "group_norm",
                    reason: format!("{} merged statistics for {groups} groups", parts.len()),
                }
                .into());
            }
            Ok(parts)
        };
        // Pass 1: extrema and the sum at the fixed scale.
        let first = merged(reduce(x.group_partials(num_groups)?)?)?;
        let extrema: Vec<GroupExtrema> = first.iter().map(|p| p.extrema).collect();
        let scales: Vec<i32> = extrema.iter().map(GroupExtrema::sum_scale).collect();
        let mut sums: Vec<i128> = first.iter().map(|p| p.sum).collect();
        if scales.iter().any(|&s| s != FIXED_SUM) {
            // Values beyond the fixed range: those groups summed again at their own scale.
            sums = merged(reduce(x.group_sums_at(num_groups, &scales, &[])?)?)?.iter().map(|p| p.sum).collect();
        }
        let means: Vec<f64> = sums.iter().zip(&scales).map(|(&s, &k)| mean_of(s, k, count)).collect();
        // Pass 2: the squared deviations around the mean.
        let square_scales: Vec<i32> = extrema.iter().zip(&means).map(|(e, &m)| e.square_scale(m)).collect();
        let squares = merged(reduce(x.group_sums_at(num_groups, &square_scales, &means)?)?)?;
        Ok(means
            .iter()
            .zip(squares.iter().zip(&square_scales))
            .map(|(&mean, (sq, &k))| Self { mean, rstd: 1.0 / (mean_of(sq.sum, k, count) + f64::from(eps)).sqrt() })
            .collect())
    }
}

/// A fixed-point sum of `count` terms at `2^scale`, divided by `count`.
fn mean_of(sum: i128, scale: i32, count: u64) -> f64 {
    if count == 0 { 0.0 } else { sum as f64 / pow2(scale) / count as f64 }
}

/// The first pass over one group: its extrema, and its sum at the fixed scale.
fn first_pass(isa: Isa, x: &[f32]) -> GroupPartial {
    pass(isa, x, Terms::sum(FIXED_SUM), true)
}

/// One group's sum of `terms`.
fn sum_pass(isa: Isa, x: &[f32], terms: Terms) -> i128 {
    pass(isa, x, terms, false).sum
}

fn pass(isa: Isa, x: &[f32], terms: Terms, track: bool) -> GroupPartial {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa` is only ever an instruction set this CPU supports (`simd::isa`).
        Isa::Avx512 => unsafe { x86::pass_avx512(x, terms, track) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { x86::pass_avx2(x, terms, track) },
        _ => scalar_pass(x, terms, track, 0),
    }
}

/// Lane sums of `per_lane` biased terms each, less their bias, added in `i128` (a lane's sum
/// fits `i64` once its bias is off, so the wrapping arithmetic is exact).
fn unbias(lanes: &[i64], per_lane: usize) -> i128 {
    let bias = MAGIC_BITS.wrapping_mul(per_lane as i64);
    lanes.iter().map(|&v| i128::from(v.wrapping_sub(bias))).sum()
}

/// The passes in plain Rust (the portable path, and the vector paths' tails from `from`).
fn scalar_pass(x: &[f32], terms: Terms, track: bool, from: usize) -> GroupPartial {
    let mut extrema = GroupExtrema::EMPTY;
    let mut total = 0i128;
    for chunk in x[from..].chunks(LANE_TERMS) {
        let mut acc = 0i64;
        for &v in chunk {
            if track {
                extrema = extrema.merge(GroupExtrema { min: v, max: v });
            }
            acc = acc.wrapping_add(terms.biased(v));
        }
        total += unbias(&[acc], chunk.len());
    }
    GroupPartial { extrema, sum: total }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{GroupExtrema, GroupPartial, LANE_TERMS, MAGIC, Terms, scalar_pass, unbias};

    /// [`super::scalar_pass`] 16 values at a time (AVX-512F).
    ///
    /// # Safety
    /// The CPU must have AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn pass_avx512(x: &[f32], terms: Terms, track: bool) -> GroupPartial {
        let full = x.len() / 16 * 16;
        let magic = _mm512_set1_pd(MAGIC);
        let (mut lo, mut hi) = (_mm512_set1_ps(f32::INFINITY), _mm512_set1_ps(f32::NEG_INFINITY));
        let biased = |v: __m512d| -> __m512i {
            _mm512_castpd_si512(match terms {
                Terms::Sum { scale } => _mm512_fmadd_pd(v, _mm512_set1_pd(scale), magic),
                Terms::Squares { root_scale, scaled_mean } => {
                    let d = _mm512_fmsub_pd(v, _mm512_set1_pd(root_scale), _mm512_set1_pd(scaled_mean));
                    _mm512_fmadd_pd(d, d, magic)
                }
            })
        };
        let mut total = 0i128;
        for block in (0..full).step_by(16 * LANE_TERMS) {
            let end = full.min(block + 16 * LANE_TERMS);
            let (mut a, mut b) = (_mm512_setzero_si512(), _mm512_setzero_si512());
            for i in (block..end).step_by(16) {
                // SAFETY: `i + 16 ≤ full ≤ x.len()`.
                let v = unsafe { _mm512_loadu_ps(x.as_ptr().add(i)) };
                if track {
                    lo = _mm512_min_ps(lo, v);
                    hi = _mm512_max_ps(hi, v);
                }
                let low = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
                let high = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
                a = _mm512_add_epi64(a, biased(low));
                b = _mm512_add_epi64(b, biased(high));
            }
            let mut lanes = [0i64; 16];
            // SAFETY: 16 lanes.
            unsafe {
                _mm512_storeu_si512(lanes.as_mut_ptr().cast(), a);
                _mm512_storeu_si512(lanes.as_mut_ptr().add(8).cast(), b);
            }
            total += unbias(&lanes, (end - block) / 16);
        }
        let mut rest = scalar_pass(x, terms, track, full);
        if track && full > 0 {
            let lanes = GroupExtrema { min: _mm512_reduce_min_ps(lo), max: _mm512_reduce_max_ps(hi) };
            rest.extrema = rest.extrema.merge(lanes);
        }
        GroupPartial { extrema: rest.extrema, sum: total + rest.sum }
    }

    /// [`super::scalar_pass`] 8 values at a time (AVX2 and FMA).
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn pass_avx2(x: &[f32], terms: Terms, track: bool) -> GroupPartial {
        let full = x.len() / 8 * 8;
        let magic = _mm256_set1_pd(MAGIC);
        let (mut lo, mut hi) = (_mm256_set1_ps(f32::INFINITY), _mm256_set1_ps(f32::NEG_INFINITY));
        let biased = |v: __m256d| -> __m256i {
            _mm256_castpd_si256(match terms {
                Terms::Sum { scale } => _mm256_fmadd_pd(v, _mm256_set1_pd(scale), magic),
                Terms::Squares { root_scale, scaled_mean } => {
                    let d = _mm256_fmsub_pd(v, _mm256_set1_pd(root_scale), _mm256_set1_pd(scaled_mean));
                    _mm256_fmadd_pd(d, d, magic)
                }
            })
        };
        let mut total = 0i128;
        for block in (0..full).step_by(8 * LANE_TERMS) {
            let end = full.min(block + 8 * LANE_TERMS);
            let (mut a, mut b) = (_mm256_setzero_si256(), _mm256_setzero_si256());
            for i in (block..end).step_by(8) {
                // SAFETY: `i + 8 ≤ full ≤ x.len()`.
                let v = unsafe { _mm256_loadu_ps(x.as_ptr().add(i)) };
                if track {
                    lo = _mm256_min_ps(lo, v);
                    hi = _mm256_max_ps(hi, v);
                }
                a = _mm256_add_epi64(a, biased(_mm256_cvtps_pd(_mm256_castps256_ps128(v))));
                b = _mm256_add_epi64(b, biased(_mm256_cvtps_pd(_mm256_extractf128_ps(v, 1))));
            }
            let mut lanes = [0i64; 8];
            // SAFETY: 8 lanes.
            unsafe {
                _mm256_storeu_si256(lanes.as_mut_ptr().cast(), a);
                _mm256_storeu_si256(lanes.as_mut_ptr().add(4).cast(), b);
            }
            total += unbias(&lanes, (end - block) / 8);
        }
        let mut rest = scalar_pass(x, terms, track, full);
        if track && full > 0 {
            let (mut l, mut h) = ([0.0f32; 8], [0.0f32; 8]);
            // SAFETY: 8 lanes each.
            unsafe {
                _mm256_storeu_ps(l.as_mut_ptr(), lo);
                _mm256_storeu_ps(h.as_mut_ptr(), hi);
            }
            for (&min, &max) in l.iter().zip(&h) {
                rest.extrema = rest.extrema.merge(GroupExtrema { min, max });
            }
        }
        GroupPartial { extrema: rest.extrema, sum: total + rest.sum }
    }
}

impl Tensor {
    /// Elements per (sample, group) of `[N, C, *]` cut into `num_groups` groups of channels.
    pub fn group_len(&self, num_groups: usize) -> Result<usize> {
        let (_, per_group, spatial) = self.group_geometry("group_len", num_groups)?;
        Ok(per_group * spatial)
    }

    /// `(N, C / num_groups, positions)`, checked.
    pub(crate) fn group_geometry(&self, op: &'static str, num_groups: usize) -> Result<(usize, usize, usize)> {
        if self.rank() < 2 {
            return Err(TensorError::InvalidArgument { op, reason: format!("needs [N, C, *], got {}", self.shape()) });
        }
        let c = self.dims()[1];
        if num_groups == 0 || !c.is_multiple_of(num_groups) {
            return Err(TensorError::InvalidArgument {
                op,
                reason: format!("{c} channels do not divide into {num_groups} groups"),
            });
        }
        Ok((self.dims()[0], c / num_groups, self.dims()[2..].iter().product()))
    }

    /// Each (sample, group)'s contiguous elements (possibly none), in order.
    fn groups(&self, op: &'static str, num_groups: usize) -> Result<impl IndexedParallelIterator<Item = &[f32]>> {
        let (n, per_group, spatial) = self.group_geometry(op, num_groups)?;
        let (x, len) = (self.as_slice_f32()?, per_group * spatial);
        Ok((0..n * num_groups).into_par_iter().map(move |i| &x[i * len..(i + 1) * len]))
    }

    /// The first pass of the exact GroupNorm statistics over this tensor (one part of a map):
    /// each (sample, group)'s extrema and sum at the fixed scale, sample-major. CPU only.
    pub(crate) fn group_partials(&self, num_groups: usize) -> Result<Vec<GroupPartial>> {
        let isa = crate::ops::simd::isa();
        Ok(self.groups("group_norm", num_groups)?.map(|g| first_pass(isa, g)).collect())
    }

    /// Each (sample, group) `i`'s sum of values (`means` empty) or of squared deviations from
    /// `means[i]`, at `scales[i]`, with empty extrema. CPU only.
    fn group_sums_at(&self, num_groups: usize, scales: &[i32], means: &[f64]) -> Result<Vec<GroupPartial>> {
        let isa = crate::ops::simd::isa();
        let groups = self.groups("group_norm", num_groups)?;
        Ok(groups
            .enumerate()
            .map(|(i, g)| GroupPartial {
                extrema: GroupExtrema::EMPTY,
                sum: sum_pass(
                    isa,
                    g,
                    match means.get(i) {
                        None => Terms::sum(scales[i]),
                        Some(&m) => Terms::squares(m, scales[i]),
                    },
                ),
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::Device;

    /// Values in `[-0.3, 0.7) · spread + offset`.
    fn tensor(dims: &[usize], seed: u64, spread: f32, offset: f32) -> Tensor {
        Tensor::seeded_uniform(dims.to_vec(), seed, offset - 0.3 * spread, offset + 0.7 * spread, &Device::Cpu).unwrap()
    }

    #[test]
    fn scales_and_powers_of_two_are_exact() {
        for s in [-1000, -1022, -200, -1, 0, 1, 40, 300, 1062] {
            assert_eq!(pow2(s), 2f64.powi(s), "{s}");
        }
        assert_eq!(scale_for(1.0), TERM_BITS - 1); // 1 < 2^1
        assert_eq!(scale_for(0.75), TERM_BITS);
        assert_eq!(scale_for(1024.0), TERM_BITS - 11);
        assert_eq!(scale_for(f64::MIN_POSITIVE / 4.0), TERM_BITS + 1021);
        assert_eq!((scale_for(0.0), scale_for(f64::INFINITY), scale_for(f64::NAN)), (0, 0, 0));
        for bound in [1e-30, 0.3, 1.0, 7.9, 8.0, 1e20] {
            let s = scale_for(bound);
            assert!(bound * pow2(s) < 2f64.powi(TERM_BITS) && bound * pow2(s + 1) >= 2f64.powi(TERM_BITS), "{bound}");
        }
        let e = |v: f32| GroupExtrema { min: -v, max: v / 2.0 };
        assert_eq!(e(32000.0).sum_scale(), FIXED_SUM);
        assert_eq!(e(33000.0).sum_scale(), scale_for(33000.0));
    }

    #[test]
    fn rounding_is_to_the_nearest_integer_ties_to_even() {
        for (y, want) in [(2.5, 2), (3.5, 4), (-2.5, -2), (-0.4, 0), (1e12 + 0.6, 1_000_000_000_001), (-7.0, -7)] {
            assert_eq!(biased_term(y, 1.0).wrapping_sub(MAGIC_BITS), want, "{y}");
        }
        assert_eq!(MAGIC.to_bits() as i64, MAGIC_BITS);
    }

    /// Against f64 sums, for values in the fixed range and beyond it (a data scale).
    #[test]
    fn the_moments_match_an_f64_reference() {
        for (spread, offset) in [(4.0, 0.0), (1e-3, 1e-4), (3.0, 200.0), (1e10, 0.0)] {
            let x = tensor(&[2, 8, 5, 7], 3, spread, offset);
            let moments = GroupMoments::local(&x, 4, 1e-6).unwrap();
            let data = x.as_slice_f32().unwrap();
            for (i, g) in data.chunks(2 * 35).enumerate() {
                let mean = g.iter().map(|&v| f64::from(v)).sum::<f64>() / g.len() as f64;
                let var = g.iter().map(|&v| (f64::from(v) - mean).powi(2)).sum::<f64>() / g.len() as f64;
                let scale = f64::from(spread) + f64::from(offset);
                // Terms rounded to 2^-36 (or, beyond 2^15, to 2^-51 of the largest value).
                let tolerance = 2f64.powi(-37) + 1e-12 * scale;
                assert!((moments[i].mean - mean).abs() <= tolerance, "{spread}: {} vs {mean}", moments[i].mean);
                let rstd = 1.0 / (var + f64::from(1e-6f32)).sqrt();
                assert!((moments[i].rstd - rstd).abs() <= 1e-9 * rstd, "{spread}: {} vs {rstd}", moments[i].rstd);
            }
        }
    }

    #[test]
    fn every_instruction_set_gives_the_same_sums() {
        let xs: Vec<f32> = (0..100_001).map(|i| ((i * 37 % 101) as f32 - 50.0) * 1.37e-3).collect();
        let isas = crate::ops::simd::Isa::all_supported();
        let first: Vec<GroupPartial> = isas.iter().map(|&isa| first_pass(isa, &xs)).collect();
        assert!(first.windows(2).all(|w| w[0] == w[1]), "{first:?}");
        assert_eq!(first[0], scalar_pass(&xs, Terms::sum(FIXED_SUM), true, 0));
        // Terms at the top of the range, many per lane: no lane overflows.
        let big = vec![-32767.5f32; 100_003];
        for &isa in &isas {
            assert_eq!(first_pass(isa, &big).sum, -100_003 * (32767.5 * 2f64.powi(FIXED_SUM)) as i128);
            let scale = GroupExtrema { min: -32767.5, max: 0.0 }.square_scale(0.0);
            let want = 100_003 * ((32767.5f64 * 32767.5) * pow2(scale)).round() as i128;
            assert_eq!(sum_pass(isa, &big, Terms::squares(0.0, scale)), want);
        }
        for scale in [FIXED_SUM, 30, -4] {
            let sq: Vec<i128> = isas.iter().map(|&isa| sum_pass(isa, &xs, Terms::squares(0.01, scale))).collect();
            assert!(sq.windows(2).all(|w| w[0] == w[1]), "{sq:?}");
        }
    }

    #[test]
    fn constant_and_empty_groups_are_exact() {
        let x = Tensor::from_vec(vec![0.75; 2 * 4 * 3], vec![2, 4, 3], &Device::Cpu).unwrap();
        for m in GroupMoments::local(&x, 2, 1e-6).unwrap() {
            assert_eq!(m.mean, 0.75);
            assert_eq!(m.rstd, 1.0 / f64::from(1e-6f32).sqrt());
        }
        let zeros = Tensor::zeros([1, 2, 3], crate::DType::F32, &Device::Cpu).unwrap();
        assert!(GroupMoments::local(&zeros, 1, 1e-6).unwrap().iter().all(|m| m.mean == 0.0));
        let empty = Tensor::zeros([1, 2, 0], crate::DType::F32, &Device::Cpu).unwrap();
        assert_eq!(GroupMoments::local(&empty, 2, 1e-6).unwrap().len(), 2);
    }

    proptest! {
        /// Cut along rows or columns anywhere, the parts' statistics merged in any order give
        /// the whole map's, bit for bit: what makes a sharded GroupNorm equal the direct one.
        #[test]
        fn any_split_gives_the_whole_maps_statistics(
            n in 1usize..3, groups in 1usize..4, per_group in 1usize..4,
            h in 1usize..20, w in 1usize..40, cuts in prop::collection::vec(0usize..40, 0..4),
            along_rows in any::<bool>(), seed in any::<u64>(),
            (spread, offset) in prop::sample::select(vec![(1e-6f32, 0.0f32), (1.0, 0.0), (3.0, 100.0), (3e4, 0.0), (1e10, 0.0)]),
        ) {
            let c = groups * per_group;
            let x = tensor(&[n, c, h, w], seed, spread, offset);
            let whole = GroupMoments::local(&x, groups, 1e-6).unwrap();
            let (dim, extent) = if along_rows { (2, h) } else { (3, w) };
            let mut edges: Vec<usize> = cuts.into_iter().map(|c| c % (extent + 1)).collect();
            edges.extend([0, extent]);
            edges.sort_unstable();
            edges.dedup();
            let parts: Vec<Tensor> = edges.windows(2).map(|e| x.narrow(dim, e[0], e[1] - e[0]).unwrap()).collect();
            let count = (per_group * h * w) as u64;
            for (rank, got) in distributed(&parts, groups, count).into_iter().enumerate() {
                for i in 0..n * groups {
                    prop_assert_eq!(got[i].mean.to_bits(), whole[i].mean.to_bits(), "part {}", rank);
                    prop_assert_eq!(got[i].rstd.to_bits(), whole[i].rstd.to_bits(), "part {}", rank);
                }
            }
        }
    }

    /// Each part on a thread of its own, as ranks: `reduce` posts this part's partials, waits
    /// for every part's, and merges them (in reverse order: any order gives the same).
    fn distributed(parts: &[Tensor], groups: usize, count: u64) -> Vec<Vec<GroupMoments>> {
        let barrier = std::sync::Barrier::new(parts.len());
        let slots = std::sync::Mutex::new(vec![Vec::new(); parts.len()]);
        let (barrier, slots) = (&barrier, &slots);
        std::thread::scope(|s| {
            let handles: Vec<_> = parts
                .iter()
                .enumerate()
                .map(|(rank, part)| {
                    s.spawn(move || {
                        GroupMoments::compute::<TensorError>(part, groups, 1e-6, count, |own| {
                            slots.lock().unwrap()[rank] = own;
                            barrier.wait();
                            let all: Vec<Vec<GroupPartial>> = slots.lock().unwrap().clone();
                            barrier.wait();
                            Ok(all
                                .into_iter()
                                .rev()
                                .reduce(|a, b| a.iter().zip(b).map(|(x, y)| x.merge(y)).collect())
                                .unwrap())
                        })
                        .unwrap()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }
}
