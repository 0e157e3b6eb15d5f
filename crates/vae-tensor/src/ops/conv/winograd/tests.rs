//! Winograd against the f64 reference and the direct kernel: accuracy, bands cut on tile
//! boundaries (bit-identical to the whole map), bf16 products, the same bits on every
//! instruction set.

use super::super::testing::{Case, col_band, max_err, row_band, scale};
use super::*;
use crate::ops::conv::{ConvJob, Frames, OutWindow};

use crate::ops::test_values as values;

/// The convolution of `case` with `isa`'s kernels: Winograd with tiles of `align` (2 or 4),
/// or the direct kernel for `align` 1; bf16 products when `bf16`.
fn run_in(case: &Case, isa: Isa, align: usize, bf16: bool) -> Vec<f32> {
    let ops = case.operands();
    let job = case.job(&ops, align, bf16);
    let mut out = vec![0.0; job.out_len().unwrap()];
    if align > 1 {
        super::run(&job, isa, &mut out)
    } else {
        super::super::direct::run(&job, isa, &mut out)
    }
    out
}

fn run_case(case: &Case, isa: Isa, align: usize) -> Vec<f32> {
    run_in(case, isa, align, false)
}

const CASES: [Case; 4] = [
    Case { n: 1, cin: 16, cout: 24, t: 1, kt: 1, k: 3, h: 13, w: 19, padding: [1; 4], pad_front: 0 },
    Case { n: 2, cin: 8, cout: 9, t: 1, kt: 1, k: 3, h: 8, w: 70, padding: [0, 0, 1, 1], pad_front: 0 },
    Case { n: 1, cin: 12, cout: 16, t: 3, kt: 3, k: 3, h: 9, w: 11, padding: [1; 4], pad_front: 2 },
    Case { n: 1, cin: 64, cout: 40, t: 1, kt: 1, k: 3, h: 40, w: 45, padding: [1; 4], pad_front: 0 },
];

#[test]
fn winograd_and_direct_are_close_to_the_exact_result() {
    let isa = crate::ops::simd::isa();
    for (i, case) in CASES.iter().enumerate() {
        let exact = case.reference();
        let scale = scale(&exact);
        for align in [1, 2, 4] {
            let err = max_err(&run_case(case, isa, align), &exact);
            // Measured: direct ≤ 9e-7, F(2×2) ≤ 3e-7 (its sums are 9× shorter), F(4×4) ≤
            // 6e-6 of the largest output (10× direct, as expected of F(4×4, 3×3) in f32).
            let bound = [3e-6, 2e-6, 2e-5][align / 2];
            assert!(err <= bound * scale, "case {i} align {align}: max error {err:e} (relative {:e})", err / scale);
        }
    }
}

/// A band of output rows computed from its input rows plus one halo row on each side (the
/// spatial shard's way) equals those rows of the whole map's output bit for bit when the
/// band starts on a multiple of 4, in height and in width.
#[test]
fn bands_cut_on_tile_boundaries_are_bit_identical_to_the_whole_map() {
    for (align, rows, cols) in [
        (4, [(0, 8), (8, 16), (16, 21), (4, 12)], [(0, 4), (4, 16), (16, 18)]),
        (2, [(0, 2), (2, 10), (10, 21), (6, 14)], [(0, 6), (6, 8), (8, 18)]),
    ] {
        check_bands(align, &rows, &cols);
    }
}

fn check_bands(align: usize, row_bands: &[(usize, usize)], col_bands: &[(usize, usize)]) {
    let isa = crate::ops::simd::isa();
    let (cin, cout, h, w) = (8, 12, 21, 18);
    let x = values(cin * h * w, 7);
    let wt: Vec<f32> = values(cout * cin * 9, 8).iter().map(|v| v * 0.1).collect();
    let conv = |x: &[f32], h: usize, w: usize, padding: [usize; 4]| {
        let [top, bottom, left, right] = padding;
        let job = ConvJob {
            frames: Frames { parts: [&[], x], part_t: [0, 1], n: 1, cin, h, w },
            weight: &wt,
            bias: None,
            cout,
            kernel: [1, 3, 3],
            stride: [1, 1],
            pad_front: 0,
            padding,
            out: [1, h + top + bottom - 2, w + left + right - 2],
            band_align: align,
            bf16: false,
            upsample: false,
            window: OutWindow::whole(h + top + bottom - 2, w + left + right - 2),
        };
        let mut out = vec![0.0; job.out_len().unwrap()];
        run(&job, isa, &mut out);
        out
    };
    let whole = conv(&x, h, w, [1; 4]);
    // Rows r0..r1 of the output from input rows r0 − 1 ..= r1 (zeros past the edges).
    for &(r0, r1) in row_bands {
        let got = conv(&row_band(&x, [cin, h, w], (r0, r1)), r1 - r0 + 2, w, [0, 0, 1, 1]);
        for c in 0..cout {
            for oy in r0..r1 {
                let a = &whole[(c * h + oy) * w..][..w];
                let b = &got[(c * (r1 - r0) + oy - r0) * w..][..w];
                assert!(
                    a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits()),
                    "rows {r0}..{r1}, channel {c}, row {oy}"
                );
            }
        }
    }
    // Columns c0..c1 likewise.
    for &(c0, c1) in col_bands {
        let got = conv(&col_band(&x, [cin, h, w], (c0, c1)), h, c1 - c0 + 2, [1, 1, 0, 0]);
        for c in 0..cout {
            for y in 0..h {
                let a = &whole[(c * h + y) * w + c0..][..c1 - c0];
                let b = &got[(c * h + y) * (c1 - c0)..][..c1 - c0];
                assert!(
                    a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits()),
                    "cols {c0}..{c1}, channel {c}, row {y}"
                );
            }
        }
    }
}

/// bf16 products: the direct kernel sums the bf16-rounded operands' exact products to f32
/// accuracy; against the f32 operands both it and F(2×2) stay within bf16's precision.
#[test]
fn bf16_products_are_within_bf16_precision() {
    if !crate::ops::simd::bf16_supported() {
        return; // no AVX512-BF16 here: bf16 convolutions are refused on this CPU
    }
    let isa = crate::ops::simd::isa();
    let round = |v: f32| crate::ops::bf16::value(crate::ops::bf16::bits(v));
    for (i, case) in CASES.iter().enumerate() {
        let exact = case.reference();
        let rounded = case.reference_of(round);
        let scale = scale(&exact);
        let direct = run_in(case, isa, 1, true);
        assert!(max_err(&direct, &rounded) <= 3e-6 * scale, "case {i}: direct bf16 vs its rounded operands");
        for (align, bound) in [(1, 8e-3), (2, 1.2e-2), (4, 1.2e-2)] {
            let err = max_err(&run_in(case, isa, align, true), &exact) / scale;
            // Measured: direct ≤ 3e-3, F(2×2) ≤ 5e-3 (align 4 takes F(4×4) in f32).
            assert!(err <= bound, "case {i} align {align}: bf16 relative error {err:e}");
        }
    }
}

#[test]
fn every_instruction_set_gives_the_same_bits() {
    let isas = Isa::all_supported();
    for (i, case) in CASES.iter().enumerate() {
        for align in [2, 4] {
            let first = run_case(case, isas[0], align);
            for &isa in &isas[1..] {
                let other = run_case(case, isa, align);
                assert!(first.iter().zip(&other).all(|(a, b)| a.to_bits() == b.to_bits()), "case {i}: {isa:?}");
            }
        }
    }
}
