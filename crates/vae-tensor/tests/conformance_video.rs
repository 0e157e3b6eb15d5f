//! Conformance of the video (NCTHW) ops of the Wan VAEs against naive references written here
//! with f64 accumulation, on seeded random shapes including odd sizes and `T = 1`, plus tiny
//! hand-computed examples of the diffusers semantics. Same pattern and tolerance rule as
//! `conformance.rs`: an element passes when `|got − want| ≤ rel · |want| + abs · rms(want)`.

use vae_tensor::{Conv3dParams, Device, Tensor, TensorError};

/// SplitMix64: small, seeded and dependency-free.
#[macro_use]
mod support;

use support::{EXACT, GEMM_TOL, Rng, Tol, assert_close, host, tensor};

/// Ops evaluated in f64 and rounded once.
const ROUND_TOL: Tol = Tol { rel: 1e-6, abs: 1e-7 };

fn iota(dims: &[usize], device: &Device) -> Tensor {
    let n: usize = dims.iter().product();
    Tensor::from_vec((0..n).map(|i| i as f32).collect(), dims, device).unwrap()
}

fn at(dims: &[usize], idx: &[usize]) -> usize {
    dims.iter().zip(idx).fold(0, |acc, (&d, &i)| acc * d + i)
}

// ---------------------------------------------------------------- references (f64)

fn ref_conv3d(
    x: &[f64],
    xd: [usize; 5],
    wt: &[f64],
    wd: [usize; 5],
    bias: Option<&[f64]>,
    p: &Conv3dParams,
) -> (Vec<usize>, Vec<f64>) {
    let [n, cin, t, h, w] = xd;
    let [cout, _, kt, kh, kw] = wd;
    let pad = p.padding;
    let s = p.stride;
    let to = (t + pad[0] + pad[1] - kt) / s[0] + 1;
    let ho = (h + pad[2] + pad[3] - kh) / s[1] + 1;
    let wo = (w + pad[4] + pad[5] - kw) / s[2] + 1;
    let od = [n, cout, to, ho, wo];
    let mut out = vec![0.0; od.iter().product()];
    for b in 0..n {
        for co in 0..cout {
            for ot in 0..to {
                for oy in 0..ho {
                    for ox in 0..wo {
                        let mut acc = bias.map_or(0.0, |b| b[co]);
                        for ci in 0..cin {
                            for dt in 0..kt {
                                for ky in 0..kh {
                                    for kx in 0..kw {
                                        let it = (ot * s[0] + dt) as isize - pad[0] as isize;
                                        let iy = (oy * s[1] + ky) as isize - pad[2] as isize;
                                        let ix = (ox * s[2] + kx) as isize - pad[4] as isize;
                                        let inside = (0..t as isize).contains(&it)
                                            && (0..h as isize).contains(&iy)
                                            && (0..w as isize).contains(&ix);
                                        if !inside {
                                            continue;
                                        }
                                        let xv = x[at(&xd, &[b, ci, it as usize, iy as usize, ix as usize])];
                                        acc += xv * wt[at(&wd, &[co, ci, dt, ky, kx])];
                                    }
                                }
                            }
                        }
                        out[at(&od, &[b, co, ot, oy, ox])] = acc;
                    }
                }
            }
        }
    }
    (od.to_vec(), out)
}

fn ref_rms_norm(x: &[f64], dims: &[usize], dim: usize, gamma: &[f64], bias: Option<&[f64]>, eps: f64) -> Vec<f64> {
    let c = dims[dim];
    let inner: usize = dims[dim + 1..].iter().product();
    let outer: usize = dims[..dim].iter().product();
    let mut out = vec![0.0; x.len()];
    for o in 0..outer {
        for i in 0..inner {
            let idx = |ch: usize| (o * c + ch) * inner + i;
            let norm = (0..c).map(|ch| x[idx(ch)] * x[idx(ch)]).sum::<f64>().sqrt();
            for ch in 0..c {
                out[idx(ch)] = x[idx(ch)] / norm.max(eps) * (c as f64).sqrt() * gamma[ch] + bias.map_or(0.0, |b| b[ch]);
            }
        }
    }
    out
}

/// AvgDown3D by its definition: output `(b, o, t, h, w)` averages the folded channels
/// `k = o·group + g`, `k = ((c·ft + dt)·fs + dh)·fs + dw`, reading padded frame `t·ft + dt`.
fn ref_avg_down(x: &[f64], xd: [usize; 5], ft: usize, fs: usize, out_c: usize) -> (Vec<usize>, Vec<f64>) {
    let [n, c, t, h, w] = xd;
    let pad = (ft - t % ft) % ft;
    let group = c * ft * fs * fs / out_c;
    let od = [n, out_c, (t + pad) / ft, h / fs, w / fs];
    let mut out = vec![0.0; od.iter().product()];
    for b in 0..n {
        for o in 0..out_c {
            for t2 in 0..od[2] {
                for h2 in 0..od[3] {
                    for w2 in 0..od[4] {
                        let mut sum = 0.0;
                        for g in 0..group {
                            let k = o * group + g;
                            let (dw, k) = (k % fs, k / fs);
                            let (dh, k) = (k % fs, k / fs);
                            let (dt, ci) = (k % ft, k / ft);
                            let tp = t2 * ft + dt;
                            if tp >= pad {
                                sum += x[at(&xd, &[b, ci, tp - pad, h2 * fs + dh, w2 * fs + dw])];
                            }
                        }
                        out[at(&od, &[b, o, t2, h2, w2])] = sum / group as f64;
                    }
                }
            }
        }
    }
    (od.to_vec(), out)
}

fn ref_dup_up(x: &[f64], xd: [usize; 5], ft: usize, fs: usize, out_c: usize, first: bool) -> (Vec<usize>, Vec<f64>) {
    let [n, c, t, h, w] = xd;
    let repeats = out_c * ft * fs * fs / c;
    let drop = if first { ft - 1 } else { 0 };
    let od = [n, out_c, t * ft - drop, h * fs, w * fs];
    let mut out = vec![0.0; od.iter().product()];
    for b in 0..n {
        for o in 0..out_c {
            for ty in 0..od[2] {
                for y in 0..od[3] {
                    for xx in 0..od[4] {
                        let tt = ty + drop;
                        let j = ((o * ft + tt % ft) * fs + y % fs) * fs + xx % fs;
                        out[at(&od, &[b, o, ty, y, xx])] = x[at(&xd, &[b, j / repeats, tt / ft, y / fs, xx / fs])];
                    }
                }
            }
        }
    }
    (od.to_vec(), out)
}

fn ref_patchify(x: &[f64], xd: [usize; 5], p: usize) -> (Vec<usize>, Vec<f64>) {
    let [n, c, t, h, w] = xd;
    let od = [n, c * p * p, t, h / p, w / p];
    let mut out = vec![0.0; x.len()];
    for b in 0..n {
        for ci in 0..c {
            for f in 0..t {
                for y in 0..h {
                    for xx in 0..w {
                        let ch = ci * p * p + (xx % p) * p + y % p;
                        out[at(&od, &[b, ch, f, y / p, xx / p])] = x[at(&xd, &[b, ci, f, y, xx])];
                    }
                }
            }
        }
    }
    (od.to_vec(), out)
}

// ---------------------------------------------------------------- checks, per device

fn conv3d_matches_reference(device: &Device) {
    let mut rng = Rng(101);
    // (input, weight with Cin filled in, params)
    let mut cases: Vec<([usize; 5], [usize; 5], Conv3dParams)> = vec![
        // WanCausalConv3d 3x3x3, padding 1: T = 1 and odd sizes.
        ([1, 3, 1, 5, 7], [4, 0, 3, 3, 3], Conv3dParams::causal([1; 3], [1, 1, 1])),
        ([2, 2, 5, 4, 3], [3, 0, 3, 3, 3], Conv3dParams::causal([1; 3], [1, 1, 1])),
        // Cache of 2 frames prepended: no front padding left.
        ([1, 2, 4, 3, 3], [2, 0, 3, 3, 3], Conv3dParams::new([1; 3], [0, 0, 1, 1, 1, 1])),
        // upsample3d time_conv (3, 1, 1), padding (1, 0, 0).
        ([1, 4, 3, 2, 5], [8, 0, 3, 1, 1], Conv3dParams::causal([1; 3], [1, 0, 0])),
        // downsample3d time_conv (3, 1, 1), stride (2, 1, 1), no padding.
        ([1, 3, 5, 3, 2], [3, 0, 3, 1, 1], Conv3dParams::new([2, 1, 1], [0; 6])),
        ([2, 3, 7, 1, 1], [3, 0, 3, 1, 1], Conv3dParams::new([2, 1, 1], [0; 6])),
        // 1x1x1 (head / shortcut).
        ([2, 5, 3, 4, 3], [2, 0, 1, 1, 1], Conv3dParams::default()),
        // Per-frame stride-2 downsample as a 1x3x3 conv3d with ZeroPad2d((0, 1, 0, 1)).
        ([1, 3, 2, 7, 6], [3, 0, 1, 3, 3], Conv3dParams::new([1, 2, 2], [0, 0, 0, 1, 0, 1])),
        // Front padding beyond the kernel: leading output frames are bias only.
        ([1, 2, 2, 3, 3], [2, 0, 2, 3, 3], Conv3dParams::new([1; 3], [3, 1, 1, 1, 1, 1])),
    ];
    for _ in 0..30 {
        let (kt, kh, kw) = (rng.range(1, 3), rng.range(1, 3), rng.range(1, 3));
        let (st, ss) = (rng.range(1, 2), rng.range(1, 2));
        let padding: [usize; 6] = std::array::from_fn(|_| rng.range(0, 2));
        let (t, h, w) = (rng.range(1, 5).max(kt), rng.range(1, 6).max(kh), rng.range(1, 6).max(kw));
        cases.push((
            [rng.range(1, 2), rng.range(1, 4), t, h, w],
            [rng.range(1, 4), 0, kt, kh, kw],
            Conv3dParams::new([st, ss, ss], padding),
        ));
    }
    for (i, (xd, mut wd, p)) in cases.into_iter().enumerate() {
        wd[1] = xd[1];
        let x = tensor(&mut rng, &xd, device);
        let w = tensor(&mut rng, &wd, device);
        let b = tensor(&mut rng, &wd[..1], device);
        let use_bias = i % 3 != 1;
        let got = x.conv3d(&w, use_bias.then_some(&b), &p).unwrap();
        let hb = host(&b);
        let (dims, want) = ref_conv3d(&host(&x), xd, &host(&w), wd, use_bias.then_some(&hb[..]), &p);
        assert_close(&format!("conv3d case {i}: x {xd:?} w {wd:?} {p:?}"), &got, &dims, &want, GEMM_TOL);
    }
}

/// A causal conv over a whole clip equals the chunked run with the last two input frames of
/// the previous chunk prepended as cache (front padding reduced accordingly), as the Wan
/// decoder runs it; `conv3d_after` (the cache in front without the concatenation) gives the
/// concatenation's bits.
fn conv3d_causal_cache_matches_whole_clip(device: &Device) {
    let mut rng = Rng(102);
    let x = tensor(&mut rng, &[1, 3, 5, 4, 4], device);
    let w = tensor(&mut rng, &[2, 3, 3, 3, 3], device);
    let b = tensor(&mut rng, &[2], device);
    let whole = x.conv3d(&w, Some(&b), &Conv3dParams::causal([1; 3], [1, 1, 1])).unwrap();
    let first = x.narrow(2, 0, 1).unwrap().conv3d(&w, Some(&b), &Conv3dParams::causal([1; 3], [1, 1, 1])).unwrap();
    let mut parts = vec![first];
    for t in 1..5 {
        let cache_len = t.min(2);
        let chunk = x.narrow(2, t - cache_len, cache_len + 1).unwrap();
        let p = Conv3dParams::new([1; 3], [2 - cache_len, 0, 1, 1, 1, 1]);
        let joined = chunk.conv3d(&w, Some(&b), &p).unwrap();
        let (cache, new) = (x.narrow(2, t - cache_len, cache_len).unwrap(), x.narrow(2, t, 1).unwrap());
        let behind = new.conv3d_after(&cache, &w, Some(&b), &p).unwrap();
        assert!(behind.bit_eq(&joined), "conv3d_after at frame {t}: {}", behind.max_abs_diff(&joined).unwrap());
        parts.push(joined);
    }
    // Two new frames behind one cached, and the edge cases: nothing in front, nothing behind.
    let p = Conv3dParams::new([1; 3], [1, 0, 1, 1, 1, 1]);
    let (cache, new) = (x.narrow(2, 0, 1).unwrap(), x.narrow(2, 1, 2).unwrap());
    let joined = x.narrow(2, 0, 3).unwrap().conv3d(&w, Some(&b), &p).unwrap();
    assert!(new.conv3d_after(&cache, &w, Some(&b), &p).unwrap().bit_eq(&joined));
    let none = x.narrow(2, 0, 0).unwrap();
    let all = x.narrow(2, 0, 3).unwrap();
    assert!(all.conv3d_after(&none, &w, Some(&b), &p).unwrap().bit_eq(&joined));
    assert!(none.conv3d_after(&all, &w, Some(&b), &p).unwrap().bit_eq(&joined));
    let refs: Vec<&Tensor> = parts.iter().collect();
    let chunked = Tensor::cat(&refs, 2).unwrap();
    assert!(chunked.max_abs_diff(&whole).unwrap() <= 1e-5, "{}", chunked.max_abs_diff(&whole).unwrap());
}

fn rms_norm_matches_reference(device: &Device) {
    let mut rng = Rng(103);
    let mut cases: Vec<(Vec<usize>, usize, Vec<usize>)> = vec![
        (vec![1, 4, 1, 3, 5], 1, vec![4, 1, 1, 1]),
        (vec![2, 3, 2, 5], 1, vec![3, 1, 1]),
        (vec![2, 5, 7], 2, vec![7]),
        (vec![1, 1, 1, 1, 1], 1, vec![1, 1, 1, 1]),
        (vec![6], 0, vec![6, 1]),
    ];
    for _ in 0..20 {
        let mut dims = vec![rng.range(1, 2), rng.range(1, 6)];
        for _ in 0..rng.range(0, 3) {
            dims.push(rng.range(1, 5));
        }
        let dim = rng.range(0, dims.len() - 1);
        let mut gd = vec![dims[dim]];
        gd.extend(std::iter::repeat_n(1, rng.range(0, 3)));
        cases.push((dims, dim, gd));
    }
    for (i, (dims, dim, gd)) in cases.into_iter().enumerate() {
        let mut x = tensor(&mut rng, &dims, device);
        if i == 1 {
            // An all-zero channel vector: divided by eps, stays 0 (+ bias).
            x = x.mul_scalar(0.0).unwrap();
        }
        let (g, b) = (tensor(&mut rng, &gd, device), tensor(&mut rng, &gd, device));
        let use_bias = i % 2 == 0;
        let got = x.rms_norm_channels(&g, use_bias.then_some(&b), dim, 1e-12).unwrap();
        // The fused SiLU is the same computation in one pass: identical bits.
        let fused = x.rms_norm_channels_silu(&g, use_bias.then_some(&b), dim, 1e-12).unwrap();
        assert!(fused.bit_eq(&got.silu().unwrap()), "rms_norm_channels_silu {dims:?} dim {dim}");
        let hb = host(&b);
        let want = ref_rms_norm(&host(&x), &dims, dim, &host(&g), use_bias.then_some(&hb[..]), 1e-12);
        assert_close(&format!("rms_norm {dims:?} dim {dim}"), &got, &dims, &want, ROUND_TOL);
    }
    // Hand example: x = (3, 4) along C=2, gamma 1: (3, 4) / 5 · sqrt(2).
    let x = Tensor::from_vec(vec![3.0, 4.0], [1, 2, 1, 1, 1], device).unwrap();
    let g = Tensor::from_vec(vec![1.0, 1.0], [2, 1, 1, 1], device).unwrap();
    let got = x.rms_norm_channels(&g, None, 1, 1e-12).unwrap();
    let s = 2f64.sqrt();
    assert_close("rms_norm hand", &got, &[1, 2, 1, 1, 1], &[0.6 * s, 0.8 * s], ROUND_TOL);
}

/// Wan's per-frame upsample: `[N·T, C, H, W]` and 5-D inputs scale their last two dims.
/// `nearest-exact` with factor 2 reads `floor((y + 0.5) / 2) = floor(y / 2)`, i.e. nearest.
fn upsample_nearest_on_video(device: &Device) {
    let mut rng = Rng(104);
    for dims in [vec![1, 2, 3, 3, 5], vec![6, 3, 1, 4], vec![2, 1, 1, 1, 1]] {
        let x = tensor(&mut rng, &dims, device);
        let got = x.upsample_nearest2d(2).unwrap();
        let r = dims.len();
        let (h, w) = (dims[r - 2], dims[r - 1]);
        let mut od = dims.clone();
        od[r - 2] *= 2;
        od[r - 1] *= 2;
        let hx = host(&x);
        let planes: usize = dims[..r - 2].iter().product();
        let mut want = Vec::new();
        for pl in 0..planes {
            for y in 0..2 * h {
                for xx in 0..2 * w {
                    // nearest-exact source index, as PyTorch computes it.
                    let (sy, sx) =
                        (((y as f64 + 0.5) / 2.0).floor() as usize, ((xx as f64 + 0.5) / 2.0).floor() as usize);
                    want.push(hx[(pl * h + sy) * w + sx]);
                }
            }
        }
        assert_close(&format!("upsample {dims:?}"), &got, &od, &want, EXACT);
    }
    // Hand example on a [1, 1, 1, 1, 2] clip.
    let x = Tensor::from_vec(vec![1.0, 2.0], [1, 1, 1, 1, 2], device).unwrap();
    let got = x.upsample_nearest2d(2).unwrap();
    assert_close("upsample hand", &got, &[1, 1, 1, 2, 4], &[1., 1., 2., 2., 1., 1., 2., 2.], EXACT);
}

fn avg_down_dup_up_match_reference(device: &Device) {
    let mut rng = Rng(105);
    // (input, factor_t, factor_s, out_channels) for AvgDown3D.
    let mut downs: Vec<([usize; 5], usize, usize, usize)> = vec![
        ([1, 4, 1, 2, 2], 2, 2, 8), // T = 1 padded to 2
        ([2, 3, 5, 4, 6], 2, 2, 6), // odd T
        ([1, 2, 3, 3, 3], 1, 3, 6), // spatial only
        ([1, 3, 4, 2, 2], 2, 1, 2), // temporal only, group 3
        ([1, 1, 3, 1, 1], 3, 1, 1), // whole clip into one frame
    ];
    let mut ups: Vec<([usize; 5], usize, usize, usize, bool)> = vec![
        ([1, 8, 1, 2, 2], 2, 2, 4, true),
        ([1, 8, 2, 1, 3], 2, 2, 4, false),
        ([2, 6, 3, 2, 1], 2, 1, 6, true),
        ([1, 3, 2, 2, 2], 1, 2, 3, true),
        ([1, 12, 1, 1, 1], 2, 2, 6, false),
    ];
    for _ in 0..15 {
        let (ft, fs) = (rng.range(1, 3), rng.range(1, 2));
        let factor = ft * fs * fs;
        let c = rng.range(1, 4);
        let divisors: Vec<usize> = (1..=c * factor).filter(|&d| (c * factor).is_multiple_of(d)).collect();
        let out_c = divisors[rng.range(0, divisors.len() - 1)];
        let xd = [rng.range(1, 2), c, rng.range(1, 5), fs * rng.range(1, 3), fs * rng.range(1, 3)];
        downs.push((xd, ft, fs, out_c));
        // DupUp: out_c·factor must be a multiple of the input channels.
        let ups_c = divisors[rng.range(0, divisors.len() - 1)];
        let xu = [rng.range(1, 2), ups_c, rng.range(1, 3), rng.range(1, 3), rng.range(1, 3)];
        ups.push((xu, ft, fs, c, rng.range(0, 1) == 1));
    }
    for (xd, ft, fs, oc) in downs {
        let x = tensor(&mut rng, &xd, device);
        let got = x.avg_down3d(ft, fs, oc).unwrap();
        let (dims, want) = ref_avg_down(&host(&x), xd, ft, fs, oc);
        assert_close(&format!("avg_down3d {xd:?} ft {ft} fs {fs} out {oc}"), &got, &dims, &want, ROUND_TOL);
    }
    for (xd, ft, fs, oc, first) in ups {
        let x = tensor(&mut rng, &xd, device);
        let got = x.dup_up3d(ft, fs, oc, first).unwrap();
        let (dims, want) = ref_dup_up(&host(&x), xd, ft, fs, oc, first);
        assert_close(&format!("dup_up3d {xd:?} ft {ft} fs {fs} out {oc} first {first}"), &got, &dims, &want, EXACT);
    }
}

/// Tiny examples worked out by hand from the Python's view/permute sequences.
fn avg_down_dup_up_hand_examples(device: &Device) {
    // AvgDown3D(1, 1, factor_t=2): T = 3 gets one zero frame in front: [0, a, b, c] -> means
    // [(0 + a) / 2, (b + c) / 2].
    let x = Tensor::from_vec(vec![2.0, 4.0, 6.0], [1, 1, 3, 1, 1], device).unwrap();
    let got = x.avg_down3d(2, 1, 1).unwrap();
    assert_close("avg_down hand t", &got, &[1, 1, 2, 1, 1], &[1.0, 5.0], EXACT);
    // AvgDown3D(1, 2, factor_t=1, factor_s=2) on a 2x2 frame [[0, 1], [2, 3]]: folded channels
    // (dh, dw) = (0,0),(0,1),(1,0),(1,1) -> 0, 1, 2, 3; two groups of two: (0+1)/2, (2+3)/2.
    let x = iota(&[1, 1, 1, 2, 2], device);
    let got = x.avg_down3d(1, 2, 2).unwrap();
    assert_close("avg_down hand s", &got, &[1, 2, 1, 1, 1], &[0.5, 2.5], EXACT);
    // DupUp3D(2, 1, factor_t=1, factor_s=2): repeats = 1·4/2 = 2 -> channels [a, a, b, b]
    // unfold to (dh, dw) = (0,0) a, (0,1) a, (1,0) b, (1,1) b: the frame [[a, a], [b, b]].
    let x = Tensor::from_vec(vec![7.0, 9.0], [1, 2, 1, 1, 1], device).unwrap();
    let got = x.dup_up3d(1, 2, 1, false).unwrap();
    assert_close("dup_up hand s", &got, &[1, 1, 1, 2, 2], &[7., 7., 9., 9.], EXACT);
    // DupUp3D(2, 1, factor_t=2): repeats 1 -> frames t·2 + dt = channel dt: [a, b] per input
    // frame; first_chunk drops the first frame.
    let x = Tensor::from_vec(vec![1.0, 2.0, 10.0, 20.0], [1, 2, 2, 1, 1], device).unwrap();
    let got = x.dup_up3d(2, 1, 1, false).unwrap();
    assert_close("dup_up hand t", &got, &[1, 1, 4, 1, 1], &[1., 10., 2., 20.], EXACT);
    let got = x.dup_up3d(2, 1, 1, true).unwrap();
    assert_close("dup_up hand t first", &got, &[1, 1, 3, 1, 1], &[10., 2., 20.], EXACT);
}

fn patchify_matches_reference(device: &Device) {
    let mut rng = Rng(106);
    let mut cases: Vec<([usize; 5], usize)> = vec![([1, 3, 1, 4, 6], 2), ([2, 1, 3, 3, 3], 3), ([1, 2, 2, 2, 2], 1)];
    for _ in 0..10 {
        let p = rng.range(1, 3);
        cases.push(([rng.range(1, 2), rng.range(1, 3), rng.range(1, 3), p * rng.range(1, 3), p * rng.range(1, 3)], p));
    }
    for (xd, p) in cases {
        let x = tensor(&mut rng, &xd, device);
        let got = x.patchify(p).unwrap();
        let (dims, want) = ref_patchify(&host(&x), xd, p);
        assert_close(&format!("patchify {xd:?} p {p}"), &got, &dims, &want, EXACT);
        assert!(got.unpatchify(p).unwrap().bit_eq(&x), "unpatchify {xd:?} p {p}");
    }
    // Hand example: one 2x2 frame [[a, b], [c, d]] (a at h=0,w=0; b at h=0,w=1). Python:
    // view [1,1,1,1,2(ph),1,2(pw)], permute(0,1,6,4,2,3,5) -> channel pw·2 + ph:
    // ch0 = (ph0, pw0) = a, ch1 = (ph1, pw0) = c, ch2 = (ph0, pw1) = b, ch3 = d.
    let x = Tensor::from_vec(vec![1.0, 2.0, 3.0, 4.0], [1, 1, 1, 2, 2], device).unwrap();
    let got = x.patchify(2).unwrap();
    assert_close("patchify hand", &got, &[1, 4, 1, 1, 1], &[1., 3., 2., 4.], EXACT);
    assert!(got.unpatchify(2).unwrap().bit_eq(&x));
}

fn bad_video_inputs_are_errors(device: &Device) {
    let mut rng = Rng(107);
    let shape_mismatch = |r: Result<Tensor, TensorError>| matches!(r, Err(TensorError::ShapeMismatch { .. }));
    let invalid = |r: Result<Tensor, TensorError>| matches!(r, Err(TensorError::InvalidArgument { .. }));
    let x = tensor(&mut rng, &[1, 2, 3, 4, 4], device);
    let w = tensor(&mut rng, &[3, 2, 3, 3, 3], device);
    let causal = Conv3dParams::causal([1; 3], [1, 1, 1]);

    // conv3d
    assert!(invalid(tensor(&mut rng, &[2, 3, 4, 4], device).conv3d(&w, None, &causal)));
    assert!(shape_mismatch(x.conv3d(&tensor(&mut rng, &[3, 3, 3, 3, 3], device), None, &causal)));
    assert!(shape_mismatch(x.conv3d(&tensor(&mut rng, &[3, 2, 3, 3], device), None, &causal)));
    assert!(shape_mismatch(x.conv3d(&w, Some(&tensor(&mut rng, &[2], device)), &causal)));
    assert!(invalid(x.conv3d(&tensor(&mut rng, &[3, 2, 4, 3, 3], device), None, &Conv3dParams::default())));
    assert!(invalid(x.conv3d(&w, None, &Conv3dParams::new([0, 1, 1], [2, 0, 1, 1, 1, 1]))));
    assert!(invalid(x.conv3d(&w, None, &Conv3dParams::new([1, 1, 2], [2, 0, 1, 1, 1, 1]))));
    assert!(invalid(x.conv3d(&w, None, &Conv3dParams::new([1; 3], [usize::MAX, 1, 1, 1, 1, 1]))));
    // conv3d_after: the frames in front must match in everything but time.
    assert!(shape_mismatch(x.conv3d_after(&tensor(&mut rng, &[1, 2, 2, 4, 5], device), &w, None, &causal)));
    assert!(shape_mismatch(x.conv3d_after(&tensor(&mut rng, &[1, 3, 2, 4, 4], device), &w, None, &causal)));
    assert!(invalid(x.conv3d_after(&tensor(&mut rng, &[1, 2, 4, 4], device), &w, None, &causal)));

    // rms_norm_channels
    let g = tensor(&mut rng, &[2, 1, 1, 1], device);
    assert!(matches!(x.rms_norm_channels(&g, None, 5, 1e-12), Err(TensorError::DimOutOfRange { .. })));
    assert!(shape_mismatch(x.rms_norm_channels(&tensor(&mut rng, &[3, 1, 1, 1], device), None, 1, 1e-12)));
    assert!(shape_mismatch(x.rms_norm_channels(&tensor(&mut rng, &[1, 2], device), None, 1, 1e-12)));
    assert!(shape_mismatch(x.rms_norm_channels(&g, Some(&tensor(&mut rng, &[2, 2], device)), 1, 1e-12)));
    assert!(invalid(x.rms_norm_channels(&g, None, 1, f32::NAN)));

    // avg_down3d / dup_up3d
    assert!(invalid(tensor(&mut rng, &[2, 4, 4], device).avg_down3d(2, 2, 1)));
    assert!(invalid(x.avg_down3d(0, 2, 2)));
    assert!(invalid(x.avg_down3d(2, 3, 2)));
    assert!(invalid(x.avg_down3d(2, 2, 3)));
    assert!(invalid(x.avg_down3d(2, 2, 0)));
    assert!(invalid(tensor(&mut rng, &[2, 4, 4], device).dup_up3d(2, 2, 1, false)));
    assert!(invalid(x.dup_up3d(2, 0, 2, false)));
    assert!(invalid(tensor(&mut rng, &[1, 3, 1, 2, 2], device).dup_up3d(2, 1, 1, true)));
    assert!(invalid(x.dup_up3d(2, 2, 0, true)));

    // patchify / unpatchify
    assert!(invalid(x.patchify(0)));
    assert!(invalid(x.patchify(3)));
    assert!(invalid(tensor(&mut rng, &[2, 4, 4], device).patchify(2)));
    assert!(invalid(x.unpatchify(0)));
    assert!(invalid(x.unpatchify(2)));
    assert!(invalid(tensor(&mut rng, &[4, 4, 4], device).unpatchify(2)));
}

conformance_tests!(
    cpu,
    vae_tensor::Device::Cpu,
    [
        conv3d_matches_reference,
        conv3d_causal_cache_matches_whole_clip,
        rms_norm_matches_reference,
        upsample_nearest_on_video,
        avg_down_dup_up_match_reference,
        avg_down_dup_up_hand_examples,
        patchify_matches_reference,
        bad_video_inputs_are_errors,
    ]
);

// Every check but the bad-input one (its errors come before any device work).
#[cfg(feature = "cuda")]
cuda_conformance_tests!([
    conv3d_matches_reference,
    conv3d_causal_cache_matches_whole_clip,
    rms_norm_matches_reference,
    upsample_nearest_on_video,
    avg_down_dup_up_match_reference,
    avg_down_dup_up_hand_examples,
    patchify_matches_reference,
]);
