//! Convolutions the kernels' unit tests share: inputs made from seeds, and the exact result.

use super::{ConvJob, Frames, OutWindow};
use crate::ops::test_values as values;

/// A `k × k` (× `kt` in time) stride-1 convolution of an `[n, cin, t, h, w]` input.
pub(super) struct Case {
    pub n: usize,
    pub cin: usize,
    pub cout: usize,
    pub t: usize,
    pub kt: usize,
    pub k: usize,
    pub h: usize,
    pub w: usize,
    pub padding: [usize; 4],
    pub pad_front: usize,
}

/// A case's operands.
pub(super) struct Operands {
    pub x: Vec<f32>,
    pub weight: Vec<f32>,
    pub bias: Vec<f32>,
}

impl Case {
    /// The input, weights (scaled to keep sums near 1) and bias.
    pub fn operands(&self) -> Operands {
        let x = values(self.n * self.cin * self.t * self.h * self.w, 1);
        let weight = values(self.cout * self.cin * self.kt * self.k * self.k, 2).iter().map(|v| v * 0.1).collect();
        Operands { x, weight, bias: values(self.cout, 3) }
    }

    /// `[To, Ho, Wo]`.
    pub fn out(&self) -> [usize; 3] {
        let [top, bottom, left, right] = self.padding;
        [self.t + self.pad_front + 1 - self.kt, self.h + top + bottom + 1 - self.k, self.w + left + right + 1 - self.k]
    }

    /// The job of this case on `ops`, with the given band alignment and products.
    pub fn job<'a>(&self, ops: &'a Operands, band_align: usize, bf16: bool) -> ConvJob<'a> {
        ConvJob {
            frames: Frames {
                parts: [&[], &ops.x],
                part_t: [0, self.t],
                n: self.n,
                cin: self.cin,
                h: self.h,
                w: self.w,
            },
            weight: &ops.weight,
            bias: Some(&ops.bias),
            cout: self.cout,
            kernel: [self.kt, self.k, self.k],
            stride: [1, 1],
            pad_front: self.pad_front,
            padding: self.padding,
            out: self.out(),
            band_align,
            bf16,
            upsample: false,
            window: OutWindow::whole(self.out()[1], self.out()[2]),
        }
    }

    /// The exact result (f64 sums).
    pub fn reference(&self) -> Vec<f64> {
        self.reference_of(|v| v)
    }

    /// The exact result with every input and weight passed through `round` first.
    pub fn reference_of(&self, round: impl Fn(f32) -> f32) -> Vec<f64> {
        let ops = self.operands();
        let x: Vec<f32> = ops.x.into_iter().map(&round).collect();
        let wt: Vec<f32> = ops.weight.into_iter().map(&round).collect();
        let [top, _, left, _] = self.padding;
        let [to, ho, wo] = self.out();
        let k = self.k;
        let mut out = vec![0.0f64; self.n * self.cout * to * ho * wo];
        for b in 0..self.n {
            for co in 0..self.cout {
                for o in 0..to {
                    for oy in 0..ho {
                        for ox in 0..wo {
                            let mut acc = ops.bias[co] as f64;
                            for ci in 0..self.cin {
                                for dt in 0..self.kt {
                                    let Some(ti) = (o + dt).checked_sub(self.pad_front) else { continue };
                                    for ky in 0..k {
                                        for kx in 0..k {
                                            let (y, xx) = ((oy + ky).wrapping_sub(top), (ox + kx).wrapping_sub(left));
                                            if y >= self.h || xx >= self.w {
                                                continue;
                                            }
                                            let xv =
                                                x[(((b * self.cin + ci) * self.t + ti) * self.h + y) * self.w + xx];
                                            let wv = wt[(((co * self.cin + ci) * self.kt + dt) * k + ky) * k + kx];
                                            acc += xv as f64 * wv as f64;
                                        }
                                    }
                                }
                            }
                            out[(((b * self.cout + co) * to + o) * ho + oy) * wo + ox] = acc;
                        }
                    }
                }
            }
        }
        out
    }
}

/// The largest absolute difference.
pub(super) fn max_err(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    got.iter().zip(want).fold(0.0f64, |m, (&a, &b)| m.max((a as f64 - b).abs()))
}

/// The largest magnitude.
pub(super) fn scale(v: &[f64]) -> f64 {
    v.iter().fold(0.0f64, |m, x| m.max(x.abs()))
}

/// Rows `r0 − 1 ..= r1` of a `[cin, h, w]` map (zeros past its edges): what a spatial-shard
/// band computing output rows `r0..r1` of a 3×3 convolution reads, halos included.
pub(super) fn row_band(x: &[f32], [cin, h, w]: [usize; 3], (r0, r1): (usize, usize)) -> Vec<f32> {
    let bh = r1 - r0 + 2;
    let mut band = vec![0.0f32; cin * bh * w];
    for c in 0..cin {
        for (i, y) in (r0 as isize - 1..=r1 as isize).enumerate() {
            if (0..h as isize).contains(&y) {
                band[(c * bh + i) * w..][..w].copy_from_slice(&x[(c * h + y as usize) * w..][..w]);
            }
        }
    }
    band
}

/// Columns `c0 − 1 ..= c1` of a `[cin, h, w]` map (zeros past its edges), as [`row_band`].
pub(super) fn col_band(x: &[f32], [cin, h, w]: [usize; 3], (c0, c1): (usize, usize)) -> Vec<f32> {
    let bw = c1 - c0 + 2;
    let mut band = vec![0.0f32; cin * h * bw];
    for c in 0..cin {
        for y in 0..h {
            for (i, xx) in (c0 as isize - 1..=c1 as isize).enumerate() {
                if (0..w as isize).contains(&xx) {
                    band[(c * h + y) * bw + i] = x[(c * h + y) * w + xx as usize];
                }
            }
        }
    }
    band
}
