//! Op conformance suite: every op against a naive reference written here with f64
//! accumulation, on seeded random shapes that include odd sizes and 1-pixel extents.
//!
//! The checks are functions of a `&Device`, instantiated per device by
//! `conformance_tests!` (candle's `test_device!` pattern), so a CUDA backend runs the same
//! suite by adding one line behind its feature. Tolerances are explicit per op: an element
//! passes when `|got − want| ≤ rel · |want| + abs · rms(want)`, the second term covering
//! outputs near zero after cancellation.

use vae_tensor::{Conv2dParams, Device, Tensor, TensorError};

/// SplitMix64: small, seeded and dependency-free.
#[macro_use]
mod support;

use support::{EXACT, GEMM_TOL, Rng, Tol, assert_close, host, tensor};

/// Group norm: evaluated in f64 and rounded once.
const NORM_TOL: Tol = Tol { rel: 1e-6, abs: 1e-7 };
/// Element-wise transcendental ops (silu, softmax): a few ulps.
const ULP_TOL: Tol = Tol { rel: 1e-6, abs: 1e-7 };

fn ref_conv2d(
    x: &[f64],
    [n, cin, h, w]: [usize; 4],
    wt: &[f64],
    [cout, _, kh, kw]: [usize; 4],
    bias: Option<&[f64]>,
    p: &Conv2dParams,
) -> (Vec<usize>, Vec<f64>) {
    let [top, bottom, left, right] = p.padding;
    let ho = (h + top + bottom - kh) / p.stride + 1;
    let wo = (w + left + right - kw) / p.stride + 1;
    let mut out = vec![0.0; n * cout * ho * wo];
    for b in 0..n {
        for co in 0..cout {
            for oy in 0..ho {
                for ox in 0..wo {
                    let mut acc = bias.map_or(0.0, |b| b[co]);
                    for ci in 0..cin {
                        for ky in 0..kh {
                            for kx in 0..kw {
                                let (iy, ix) = (
                                    (oy * p.stride + ky) as isize - top as isize,
                                    (ox * p.stride + kx) as isize - left as isize,
                                );
                                if iy < 0 || ix < 0 || iy >= h as isize || ix >= w as isize {
                                    continue;
                                }
                                let xv = x[((b * cin + ci) * h + iy as usize) * w + ix as usize];
                                acc += xv * wt[((co * cin + ci) * kh + ky) * kw + kx];
                            }
                        }
                    }
                    out[((b * cout + co) * ho + oy) * wo + ox] = acc;
                }
            }
        }
    }
    (vec![n, cout, ho, wo], out)
}

fn ref_group_norm(x: &[f64], dims: &[usize], groups: usize, gamma: &[f64], beta: &[f64], eps: f64) -> Vec<f64> {
    let (n, c) = (dims[0], dims[1]);
    let spatial: usize = dims[2..].iter().product();
    let per = c / groups * spatial;
    let mut out = vec![0.0; x.len()];
    for i in 0..n * groups {
        let g = &x[i * per..][..per];
        let mean = g.iter().sum::<f64>() / per as f64;
        let var = g.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / per as f64;
        for (j, v) in g.iter().enumerate() {
            let ch = (i % groups) * (c / groups) + j / spatial;
            out[i * per + j] = (v - mean) / (var + eps).sqrt() * gamma[ch] + beta[ch];
        }
    }
    out
}

/// `[batch, m, k] · [batch, k, n]`; `b_transposed` reads b as `[batch, n, k]`.
fn ref_matmul(a: &[f64], b: &[f64], batch: usize, m: usize, k: usize, n: usize, b_transposed: bool) -> Vec<f64> {
    let mut out = vec![0.0; batch * m * n];
    for z in 0..batch {
        for i in 0..m {
            for j in 0..n {
                out[(z * m + i) * n + j] = (0..k)
                    .map(|l| {
                        let bv = if b_transposed { b[(z * n + j) * k + l] } else { b[(z * k + l) * n + j] };
                        a[(z * m + i) * k + l] * bv
                    })
                    .sum();
            }
        }
    }
    out
}

fn ref_softmax(x: &[f64], len: usize) -> Vec<f64> {
    let mut out = x.to_vec();
    for row in out.chunks_mut(len) {
        let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = row.iter().map(|v| (v - max).exp()).sum();
        row.iter_mut().for_each(|v| *v = (*v - max).exp() / sum);
    }
    out
}

fn ref_permute(x: &[f64], dims: &[usize], perm: &[usize]) -> (Vec<usize>, Vec<f64>) {
    let out_dims: Vec<usize> = perm.iter().map(|&p| dims[p]).collect();
    let mut strides = vec![1; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * dims[i + 1];
    }
    let total: usize = dims.iter().product();
    let mut out = Vec::with_capacity(total);
    for flat in 0..total {
        let (mut rest, mut off) = (flat, 0);
        for d in (0..out_dims.len()).rev() {
            off += (rest % out_dims[d]) * strides[perm[d]];
            rest /= out_dims[d];
        }
        out.push(x[off]);
    }
    (out_dims, out)
}

// ---------------------------------------------------------------- checks, per device

fn conv2d_matches_reference(device: &Device) {
    let mut rng = Rng(1);
    let mut cases: Vec<([usize; 4], [usize; 4], Conv2dParams)> = vec![
        ([1, 3, 1, 1], [4, 3, 3, 3], Conv2dParams::same(3)),
        ([1, 2, 1, 7], [3, 2, 3, 3], Conv2dParams::same(3)),
        ([2, 3, 7, 5], [4, 3, 3, 3], Conv2dParams::diffusers_downsample()),
        ([1, 2, 3, 3], [2, 2, 3, 3], Conv2dParams::diffusers_downsample()),
        ([2, 5, 6, 4], [3, 5, 1, 1], Conv2dParams::default()),
        ([1, 4, 9, 9], [6, 4, 5, 5], Conv2dParams::same(5)),
        ([1, 3, 8, 8], [2, 3, 3, 3], Conv2dParams::default()),
        ([1, 2, 5, 5], [2, 2, 1, 1], Conv2dParams::new(2, [1, 0, 0, 2])),
        ([1, 16, 24, 20], [12, 16, 3, 3], Conv2dParams::same(3)),
    ];
    for _ in 0..40 {
        let (kh, kw, stride) = (rng.range(1, 3), rng.range(1, 3), rng.range(1, 3));
        let padding = [rng.range(0, 2), rng.range(0, 2), rng.range(0, 2), rng.range(0, 2)];
        let (h, w) = (rng.range(1, 9).max(kh), rng.range(1, 9).max(kw));
        cases.push((
            [rng.range(1, 2), rng.range(1, 5), h, w],
            [rng.range(1, 5), 0, kh, kw],
            Conv2dParams::new(stride, padding),
        ));
    }
    for (i, (xd, mut wd, p)) in cases.into_iter().enumerate() {
        wd[1] = xd[1];
        let x = tensor(&mut rng, &xd, device);
        let w = tensor(&mut rng, &wd, device);
        let b = tensor(&mut rng, &wd[..1], device);
        let use_bias = i % 3 != 1;
        let got = x.conv2d(&w, use_bias.then_some(&b), &p).unwrap();
        let hb = host(&b);
        let (dims, want) = ref_conv2d(&host(&x), xd, &host(&w), wd, use_bias.then_some(&hb[..]), &p);
        assert_close(&format!("conv2d case {i}: x {xd:?} w {wd:?} {p:?}"), &got, &dims, &want, GEMM_TOL);
    }
}

/// The blocked multi-threaded path of conv2d, with many row blocks: the same results in pools of
/// several sizes (bit-identical, since each output element sums in the same order).
fn conv2d_is_independent_of_thread_count(device: &Device) {
    let mut rng = Rng(2);
    let x = tensor(&mut rng, &[1, 6, 13, 11], device);
    let w = tensor(&mut rng, &[5, 6, 3, 3], device);
    let b = tensor(&mut rng, &[5], device);
    for p in [Conv2dParams::same(3), Conv2dParams::diffusers_downsample()] {
        let run = |threads| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| x.conv2d(&w, Some(&b), &p).unwrap())
        };
        let one = run(1);
        let (dims, want) = ref_conv2d(&host(&x), [1, 6, 13, 11], &host(&w), [5, 6, 3, 3], Some(&host(&b)), &p);
        assert_close("conv2d 1 thread", &one, &dims, &want, GEMM_TOL);
        for threads in [2, 3, 7] {
            assert!(run(threads).bit_eq(&one), "{threads} threads, {p:?}");
        }
    }
}

fn group_norm_matches_reference(device: &Device) {
    let mut rng = Rng(3);
    let mut cases: Vec<(Vec<usize>, usize)> =
        vec![(vec![1, 4], 2), (vec![2, 6, 1, 1], 3), (vec![1, 8, 3, 5], 8), (vec![2, 4, 2, 3, 3], 1)];
    for _ in 0..20 {
        let groups = rng.range(1, 4);
        let c = groups * rng.range(1, 3);
        let mut dims = vec![rng.range(1, 2), c];
        for _ in 0..rng.range(0, 3) {
            dims.push(rng.range(1, 6));
        }
        cases.push((dims, groups));
    }
    for (dims, groups) in cases {
        let c = dims[1];
        let x = tensor(&mut rng, &dims, device);
        let (gamma, beta) = (tensor(&mut rng, &[c], device), tensor(&mut rng, &[c], device));
        let got = x.group_norm(groups, &gamma, &beta, 1e-6).unwrap();
        let want = ref_group_norm(&host(&x), &dims, groups, &host(&gamma), &host(&beta), 1e-6);
        assert_close(&format!("group_norm {dims:?} / {groups}"), &got, &dims, &want, NORM_TOL);
        // The fused SiLU is the same computation in one pass: identical bits.
        let fused = x.group_norm_silu(groups, &gamma, &beta, 1e-6).unwrap();
        assert!(fused.bit_eq(&got.silu().unwrap()), "group_norm_silu {dims:?} / {groups}");
    }
    // A large common offset: a one-pass f32 variance would cancel catastrophically.
    let dims = [1, 4, 16, 16];
    let data: Vec<f32> = Rng(4).vec(1024).into_iter().map(|v| 1000.0 + v).collect();
    let x = Tensor::from_vec(data, dims, device).unwrap();
    let ones = Tensor::from_vec(vec![1.0; 4], [4], device).unwrap();
    let zeros = Tensor::from_vec(vec![0.0; 4], [4], device).unwrap();
    let got = x.group_norm(2, &ones, &zeros, 1e-5).unwrap();
    let want = ref_group_norm(&host(&x), &dims, 2, &[1.0; 4], &[0.0; 4], 1e-5);
    assert_close("group_norm offset", &got, &dims, &want, NORM_TOL);
}

fn elementwise_ops_match_reference(device: &Device) {
    let mut rng = Rng(5);
    for dims in [vec![1], vec![3, 1, 5], vec![2, 3, 4, 7], vec![40_000]] {
        let a = tensor(&mut rng, &dims, device).mul_scalar(20.0).unwrap();
        let b = tensor(&mut rng, &dims, device);
        let (ha, hb) = (host(&a), host(&b));
        let silu: Vec<f64> = ha.iter().map(|x| x / (1.0 + (-x).exp())).collect();
        assert_close("silu", &a.silu().unwrap(), &dims, &silu, ULP_TOL);
        let mut c = a.clone();
        c.silu_inplace().unwrap();
        assert_close("silu_inplace", &c, &dims, &silu, ULP_TOL);

        let sum: Vec<f64> = ha.iter().zip(&hb).map(|(x, y)| (*x as f32 + *y as f32) as f64).collect();
        assert_close("add", &a.add(&b).unwrap(), &dims, &sum, EXACT);
        let mut c = a.clone();
        c.add_assign(&b).unwrap();
        assert_close("add_assign", &c, &dims, &sum, EXACT);

        let scaled: Vec<f64> = ha.iter().map(|x| (*x as f32 * 0.3f32) as f64).collect();
        assert_close("mul_scalar", &a.mul_scalar(0.3).unwrap(), &dims, &scaled, EXACT);
        let mut c = a.clone();
        c.mul_scalar_inplace(0.3).unwrap();
        assert_close("mul_scalar_inplace", &c, &dims, &scaled, EXACT);

        let clamped: Vec<f64> = ha.iter().map(|x| x.clamp(-5.0, 7.5)).collect();
        assert_close("clamp", &a.clamp(-5.0, 7.5).unwrap(), &dims, &clamped, EXACT);
        let mut c = a.clone();
        c.clamp_inplace(-5.0, 7.5).unwrap();
        assert_close("clamp_inplace", &c, &dims, &clamped, EXACT);
    }
    // Scalar and per-channel affine ops, each rounding as PyTorch's two-op expressions.
    let dims = [2, 3, 4, 5];
    let x = tensor(&mut rng, &dims, device);
    let hx = x.to_vec_f32().unwrap();
    let (s, t) = ([0.5f32, -2.0, 3.0], [1.0f32, 0.25, -1.5]);
    let want = |f: &dyn Fn(f32, usize) -> f32| -> Vec<f64> {
        hx.iter().enumerate().map(|(i, &v)| f64::from(f(v, (i / 20) % 3))).collect()
    };
    assert_close("div_scalar", &x.div_scalar(0.3).unwrap(), &dims, &want(&|v, _| v / 0.3), EXACT);
    assert_close("add_scalar", &x.add_scalar(-0.7).unwrap(), &dims, &want(&|v, _| v + -0.7), EXACT);
    let affine = want(&|v, c| (v * s[c]) + t[c]);
    assert_close("channel_affine", &x.channel_affine(&s, &t).unwrap(), &dims, &affine, EXACT);
    let normalized = want(&|v, c| (v - t[c]) / s[c]);
    assert_close("channel_normalize", &x.channel_normalize(&t, &s).unwrap(), &dims, &normalized, EXACT);

    // torch.clamp semantics at the edges: NaN stays NaN; min > max gives max.
    let t = Tensor::from_vec(vec![f32::NAN, -3.0, 3.0], [3], device).unwrap();
    let c = t.clamp(1.0, 0.0).unwrap().to_vec_f32().unwrap();
    assert!(c[0].is_nan() && c[1] == 0.0 && c[2] == 0.0, "{c:?}");
    // silu saturates without NaN.
    let t = Tensor::from_vec(vec![-1000.0, 1000.0, 0.0], [3], device).unwrap();
    assert_eq!(t.silu().unwrap().to_vec_f32().unwrap(), vec![-0.0, 1000.0, 0.0]);
}

fn pad2d_matches_reference(device: &Device) {
    let mut rng = Rng(6);
    for (dims, pad) in [
        (vec![1, 1], [0, 0, 0, 0]),
        (vec![2, 3, 1, 4], [1, 0, 2, 1]),
        (vec![5, 7], [2, 2, 0, 3]),
        (vec![1, 2, 2, 3, 3], [0, 1, 0, 1]),
    ] {
        let x = tensor(&mut rng, &dims, device);
        let hx = host(&x);
        let r = dims.len();
        let (h, w) = (dims[r - 2], dims[r - 1]);
        let [t, b, l, rt] = pad;
        let (hp, wp) = (h + t + b, w + l + rt);
        let planes = hx.len() / (h * w);
        let mut want = vec![0.0; planes * hp * wp];
        for p in 0..planes {
            for y in 0..h {
                for xx in 0..w {
                    want[(p * hp + y + t) * wp + xx + l] = hx[(p * h + y) * w + xx];
                }
            }
        }
        let mut out_dims = dims.clone();
        out_dims[r - 2] = hp;
        out_dims[r - 1] = wp;
        assert_close(&format!("pad2d {dims:?} {pad:?}"), &x.pad2d(pad).unwrap(), &out_dims, &want, EXACT);
    }
}

fn layout_ops_match_reference(device: &Device) {
    let mut rng = Rng(7);
    let cases: Vec<(Vec<usize>, Vec<usize>)> = vec![
        (vec![5], vec![0]),
        (vec![3, 4], vec![1, 0]),
        (vec![2, 3, 4], vec![0, 2, 1]),
        (vec![2, 3, 4], vec![2, 0, 1]),
        (vec![2, 1, 3, 5], vec![0, 2, 3, 1]),
        (vec![1, 7, 1, 3, 2], vec![4, 3, 2, 1, 0]),
        // Large enough for the tiled and parallel transpose paths.
        (vec![1, 70, 600], vec![0, 2, 1]),
        (vec![3, 40, 300], vec![0, 2, 1]),
        (vec![200, 300], vec![1, 0]),
    ];
    for (dims, perm) in cases {
        let x = tensor(&mut rng, &dims, device);
        let (out_dims, want) = ref_permute(&host(&x), &dims, &perm);
        assert_close(&format!("permute {dims:?} {perm:?}"), &x.permute(&perm).unwrap(), &out_dims, &want, EXACT);
    }
    let x = tensor(&mut rng, &[2, 3, 4, 5], device);
    let (out_dims, want) = ref_permute(&host(&x), x.dims(), &[0, 3, 2, 1]);
    assert_close("transpose", &x.transpose(1, 3).unwrap(), &out_dims, &want, EXACT);
    let r = x.reshape([6, 20]).unwrap();
    assert_close("reshape", &r, &[6, 20], &host(&x), EXACT);
    assert_close("into_reshaped", &x.clone().into_reshaped([120]).unwrap(), &[120], &host(&x), EXACT);

    let moments = tensor(&mut rng, &[2, 6, 3, 1], device);
    let hm = host(&moments);
    let want: Vec<f64> = (0..2).flat_map(|b| hm[b * 18..b * 18 + 9].to_vec()).collect();
    assert_close("diag_gaussian_mean", &moments.diag_gaussian_mean().unwrap(), &[2, 3, 3, 1], &want, EXACT);
}

fn matmul_and_linear_match_reference(device: &Device) {
    let mut rng = Rng(8);
    for i in 0..25 {
        let batch: Vec<usize> = (0..i % 3).map(|_| rng.range(1, 3)).collect();
        let (m, k, n) = (rng.range(1, 9), rng.range(1, 17), rng.range(1, 9));
        let nb: usize = batch.iter().product();
        let a = tensor(&mut rng, &[batch.clone(), vec![m, k]].concat(), device);
        let b = tensor(&mut rng, &[batch.clone(), vec![k, n]].concat(), device);
        let want = ref_matmul(&host(&a), &host(&b), nb, m, k, n, false);
        let dims = [batch.clone(), vec![m, n]].concat();
        assert_close(&format!("matmul {:?}·{:?}", a.dims(), b.dims()), &a.matmul(&b).unwrap(), &dims, &want, GEMM_TOL);

        // linear over the last dim: x [.., m, k], weight [n, k].
        let wgt = tensor(&mut rng, &[n, k], device);
        let bias = tensor(&mut rng, &[n], device);
        let mut want = ref_matmul(&host(&a), &host(&wgt), 1, nb * m, k, n, true);
        let plain = want.clone();
        let hb = host(&bias);
        want.iter_mut().enumerate().for_each(|(j, v)| *v += hb[j % n]);
        assert_close("linear", &a.linear(&wgt, Some(&bias)).unwrap(), &dims, &want, GEMM_TOL);
        assert_close("linear without bias", &a.linear(&wgt, None).unwrap(), &dims, &plain, GEMM_TOL);
    }
    // A larger product so that gemm takes its blocked, threaded path.
    let a = tensor(&mut rng, &[70, 300], device);
    let b = tensor(&mut rng, &[300, 90], device);
    let want = ref_matmul(&host(&a), &host(&b), 1, 70, 300, 90, false);
    assert_close("matmul large", &a.matmul(&b).unwrap(), &[70, 90], &want, GEMM_TOL);
}

fn softmax_and_attention_match_reference(device: &Device) {
    let mut rng = Rng(9);
    for dims in [vec![1], vec![3, 1], vec![2, 3, 17], vec![4, 1000]] {
        let x = tensor(&mut rng, &dims, device).mul_scalar(10.0).unwrap();
        let want = ref_softmax(&host(&x), *dims.last().unwrap());
        assert_close(&format!("softmax {dims:?}"), &x.softmax_last_dim().unwrap(), &dims, &want, ULP_TOL);
    }
    let mut cases: Vec<[usize; 5]> = vec![[1, 1, 1, 1, 1], [2, 5, 3, 4, 2]];
    for _ in 0..10 {
        cases.push([rng.range(1, 2), rng.range(1, 40), rng.range(1, 40), rng.range(1, 8), rng.range(1, 8)]);
    }
    // More queries than one block holds: exercises the query blocking and the short last block.
    cases.push([1, 1100, 5, 3, 2]);
    for [b, n, m, d, dv] in cases {
        let q = tensor(&mut rng, &[b, n, d], device);
        let k = tensor(&mut rng, &[b, m, d], device);
        let v = tensor(&mut rng, &[b, m, dv], device);
        let scale = 1.0 / (d as f64).sqrt();
        let mut scores = ref_matmul(&host(&q), &host(&k), b, n, d, m, true);
        scores.iter_mut().for_each(|s| *s *= scale);
        let p = ref_softmax(&scores, m);
        let want = ref_matmul(&p, &host(&v), b, n, m, dv, false);
        let got = Tensor::attention(&q, &k, &v).unwrap();
        assert_close(&format!("attention b{b} n{n} m{m} d{d} dv{dv}"), &got, &[b, n, dv], &want, GEMM_TOL);
    }
}

fn bad_inputs_are_errors(device: &Device) {
    let mut rng = Rng(10);
    let x = tensor(&mut rng, &[1, 4, 5, 5], device);
    let w = tensor(&mut rng, &[2, 4, 3, 3], device);
    let shape_mismatch = |r: Result<Tensor, TensorError>| matches!(r, Err(TensorError::ShapeMismatch { .. }));
    let invalid = |r: Result<Tensor, TensorError>| matches!(r, Err(TensorError::InvalidArgument { .. }));

    // conv2d
    assert!(shape_mismatch(x.conv2d(&tensor(&mut rng, &[2, 3, 3, 3], device), None, &Conv2dParams::same(3))));
    assert!(shape_mismatch(x.conv2d(&tensor(&mut rng, &[2, 4, 3], device), None, &Conv2dParams::same(3))));
    assert!(shape_mismatch(x.conv2d(&w, Some(&tensor(&mut rng, &[3], device)), &Conv2dParams::same(3))));
    assert!(invalid(tensor(&mut rng, &[4, 5, 5], device).conv2d(&w, None, &Conv2dParams::same(3))));
    assert!(invalid(x.conv2d(&tensor(&mut rng, &[2, 4, 7, 3], device), None, &Conv2dParams::default())));
    assert!(invalid(x.conv2d(&w, None, &Conv2dParams::new(0, [1; 4]))));
    assert!(invalid(x.conv2d(&w, None, &Conv2dParams::new(1, [usize::MAX, 1, 0, 0]))));

    // group_norm
    let g = tensor(&mut rng, &[4], device);
    assert!(invalid(x.group_norm(3, &g, &g, 1e-6)));
    assert!(invalid(x.group_norm(0, &g, &g, 1e-6)));
    assert!(shape_mismatch(x.group_norm(2, &tensor(&mut rng, &[5], device), &g, 1e-6)));
    assert!(invalid(tensor(&mut rng, &[4], device).group_norm(1, &g, &g, 1e-6)));

    // element-wise
    let y = tensor(&mut rng, &[1, 4, 5, 4], device);
    assert!(shape_mismatch(x.add(&y)));
    assert!(matches!(x.clone().add_assign(&y), Err(TensorError::ShapeMismatch { .. })));
    assert!(invalid(x.clamp(f32::NAN, 1.0)));
    assert!(shape_mismatch(x.channel_affine(&[1.0; 3], &[0.0; 4])));
    assert!(invalid(tensor(&mut rng, &[4], device).channel_normalize(&[0.0; 4], &[1.0; 4])));
    assert!(invalid(tensor(&mut rng, &[3], device).pad2d([1; 4])));

    // layout
    assert!(shape_mismatch(x.reshape([3, 33])));
    assert!(invalid(x.permute(&[0, 1, 2])));
    assert!(invalid(x.permute(&[0, 1, 1, 2])));
    assert!(invalid(x.permute(&[0, 1, 2, 4])));
    assert!(matches!(x.transpose(0, 4), Err(TensorError::DimOutOfRange { .. })));
    assert!(invalid(tensor(&mut rng, &[1, 3, 2], device).diag_gaussian_mean()));

    // matmul / linear
    let a = tensor(&mut rng, &[2, 3, 4], device);
    assert!(shape_mismatch(a.matmul(&tensor(&mut rng, &[2, 5, 6], device))));
    assert!(shape_mismatch(a.matmul(&tensor(&mut rng, &[3, 4, 6], device))));
    assert!(shape_mismatch(a.matmul(&tensor(&mut rng, &[4, 6], device))));
    assert!(shape_mismatch(a.linear(&tensor(&mut rng, &[6, 5], device), None)));
    assert!(shape_mismatch(a.linear(&tensor(&mut rng, &[6, 4], device), Some(&tensor(&mut rng, &[5], device)))));

    // softmax / attention
    assert!(invalid(Tensor::from_vec(vec![1.0], Vec::<usize>::new(), device).unwrap().softmax_last_dim()));
    let q = tensor(&mut rng, &[1, 3, 4], device);
    assert!(shape_mismatch(Tensor::attention(
        &q,
        &tensor(&mut rng, &[1, 5, 3], device),
        &tensor(&mut rng, &[1, 5, 2], device)
    )));
    assert!(shape_mismatch(Tensor::attention(
        &q,
        &tensor(&mut rng, &[1, 5, 4], device),
        &tensor(&mut rng, &[1, 6, 2], device)
    )));
    assert!(invalid(Tensor::attention(&a.reshape([24]).unwrap(), &q, &q)));
}

conformance_tests!(
    cpu,
    vae_tensor::Device::Cpu,
    [
        conv2d_matches_reference,
        conv2d_is_independent_of_thread_count,
        group_norm_matches_reference,
        elementwise_ops_match_reference,
        pad2d_matches_reference,
        layout_ops_match_reference,
        matmul_and_linear_match_reference,
        softmax_and_attention_match_reference,
        bad_inputs_are_errors,
    ]
);

// The checks whose ops have CUDA paths; the others are CPU-only so far.
#[cfg(feature = "cuda")]
cuda_conformance_tests!([
    conv2d_matches_reference,
    conv2d_is_independent_of_thread_count,
    group_norm_matches_reference
]);
