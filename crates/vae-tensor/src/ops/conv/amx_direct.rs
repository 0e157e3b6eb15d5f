//! bf16 convolutions on AMX tiles with the input read in place: no packed panel of reduction
//! rows, the tile loads themselves gather it.
//!
//! Output rows are cut into bands, one task each. A task converts the input rows its band reads
//! into bf16 channel pairs laid out tile by tile: for each temporal tap, column shift `kx`,
//! row, block of 16 channel pairs and block of 16 columns, one contiguous 16 × 16 tile (row:
//! channel pair, column: pixel), `kx` already applied. The `B` tile of tap `(dt, ky, kx)` for
//! output row `oy`, pixels `ox0..ox0 + 16` and a block of channels is then one aligned 1 KiB
//! run, which `tileloadd` reads at full speed (a load whose rows straddle cache lines runs at
//! less than half speed; one whose rows are far apart defeats the prefetchers). Each block of
//! 32 output channels × 32 pixels runs its whole reduction in the tile registers (temporal
//! tap, block of 16 channel pairs, spatial tap, pair: see [`amx::Session::conv_block`]) and is
//! stored once, plus the bias.
//!
//! Each output depends on its receptive field and that fixed order alone, so bands, blocks and
//! thread counts do not change a bit. Applies to stride-1 convolutions with `Cin` a multiple of
//! 32 (every VAE convolution past the first); the others take [`super::direct`]'s AMX path,
//! whose order differs (each convolution always takes the same path).

use rayon::prelude::*;

use super::ConvJob;
use super::amx::{self, A_TILE, COLS};
use crate::Result;
use crate::memory::Buffer;
use crate::ops::OutPtr;

/// Bytes of `B` tiles a column of blocks may read: they stay in the L2 cache while every
/// block of output channels passes over them, and each block's weights (also from L2) serve
/// every row of the column.
const COLUMN_BYTES: usize = 1 << 20;
/// Most output rows in a band.
const MAX_BAND: usize = 16;

/// Whether `job` runs here: bf16 products on a CPU with AMX, stride 1, `Cin` a multiple of 32.
pub(super) fn applies(job: &ConvJob<'_>) -> bool {
    job.bf16 && job.stride[1] == 1 && job.frames.cin.is_multiple_of(2 * COLS) && amx::supported()
}

/// Runs `job` (checked by [`applies`]); the result is `[N, Cout, To, Ho, Wo]`.
pub(super) fn run(job: &ConvJob<'_>, out_len: usize) -> Result<Buffer> {
    let f = &job.frames;
    let [kt, kh, kw] = job.kernel;
    let [to, ho, wo] = job.out;
    let (cin, cout) = (f.cin, job.cout);
    let [top, _, left, _] = job.padding;
    let mut out = Buffer::for_overwrite(out_len);
    if out_len == 0 {
        return Ok(out);
    }
    // The input extent the convolution reads: the frames', or twice it when it reads them
    // upsampled (each row and column twice).
    let up = 1 + job.upsample as usize;
    let (ih, iw) = (up * f.h, up * f.w);
    let cp = cin / 2;
    let kb = cp / COLS;
    let taps2 = kh * kw;
    // Output columns the tiles cover, in blocks of 16; a padded input row's width.
    let wb = wo.next_multiple_of(COLS);
    let xbs = wb / COLS;
    let wq = wb + kw - 1;

    // The weights in pairs of 16 × 16 tiles, `[Cout / 32][dt][Cp / 16][tap][2]`.
    let blocks16 = cout.div_ceil(amx::ROWS);
    let pairs_of_blocks = blocks16.div_ceil(2);
    let a_stride = kt * kb * taps2 * 2 * A_TILE;
    let mut packed_buf = Buffer::for_overwrite(pairs_of_blocks * a_stride + 16);
    let packed = &mut super::direct::aligned(&mut packed_buf)[..pairs_of_blocks * a_stride];
    pack_weights(job, packed);
    let packed: &[u32] = bytemuck::cast_slice(&*packed);
    // Each block's accumulators start from the bias: `[Cout / 32][32 rows][32 columns]`.
    let bias_tiles: Vec<f32> = (0..pairs_of_blocks * 32)
        .flat_map(|co| {
            let v = if co < cout { job.bias.map_or(0.0, |b| b[co]) } else { 0.0 };
            [v; 2 * COLS]
        })
        .collect();

    // Tasks: bands of output rows of one output frame, every output channel.
    let threads = rayon::current_num_threads().max(1);
    // One input row's B tiles for one block of 32 columns, every temporal and column tap.
    let row_bytes = kt * kw * kb * 2 * A_TILE * 4;
    let band =
        (COLUMN_BYTES / row_bytes).saturating_sub(kh - 1).clamp(1, MAX_BAND).min(ho.div_ceil(2 * threads)).max(1);
    let bands = ho.div_ceil(band);
    let band_rows = band + kh - 1;
    // A band's tiles: `[column of 32][temporal tap][kx][row][channel block][2]`, each column's
    // contiguous (tiles far apart in powers of two would share the cache's sets).
    let columns = xbs.div_ceil(2);
    let row_tiles = kb * 2 * A_TILE;
    let column_len = kt * kw * band_rows * row_tiles;
    let tiles_len = columns * column_len;
    let scratch = super::direct::ScratchPool::new(tiles_len + wq + f.w + 32, f.n * to * bands);
    let dst = OutPtr::new(out.as_mut_slice());
    let plane_out = ho * wo;
    (0..f.n * to * bands).into_par_iter().for_each(|task| {
        let (bi, o, b) = (task % bands, task / bands % to, task / bands / to);
        let rows = bi * band..((bi + 1) * band).min(ho);
        let dts: Vec<(usize, usize)> = (0..kt).filter_map(|dt| job.input_frame(o, dt).map(|ti| (dt, ti))).collect();
        // Row `oy`, columns `ox0..ox0 + n` of channel `co` of this output frame.
        let out_at = |co: usize, oy: usize, ox0: usize| ((b * cout + co) * to + o) * plane_out + oy * wo + ox0;
        if dts.is_empty() {
            // Every temporal tap reads padding: the bias alone.
            for co in 0..cout {
                for oy in rows.clone() {
                    // SAFETY: this row of this channel of this output frame belongs to this
                    // task's band alone.
                    unsafe { dst.slice(out_at(co, oy, 0), wo) }.fill(job.bias.map_or(0.0, |bias| bias[co]));
                }
            }
            return;
        }
        scratch.with(|buf| {
            let (tiles, rest) = super::direct::aligned(buf)[..tiles_len + wq + f.w].split_at_mut(tiles_len);
            let (row, low) = rest.split_at_mut(wq);
            let tiles: &mut [u32] = bytemuck::cast_slice_mut(tiles);
            let row: &mut [u32] = bytemuck::cast_slice_mut(row);
            let low: &mut [u32] = bytemuck::cast_slice_mut(low);
            // The band's input rows, one padded row of channel pairs at a time, into tiles.
            for (d, &(_, ti)) in dts.iter().enumerate() {
                for y in 0..band_rows {
                    // The frames' row this input row is (upsampled: each is read twice).
                    let src_y = (rows.start + y).checked_sub(top).filter(|&y| y < ih).map(|y| y / up);
                    for q in 0..cp {
                        match src_y {
                            None => row.fill(0),
                            Some(sy) => {
                                let at = |c: usize| &f.plane(b, c, ti)[sy * f.w..][..f.w];
                                row[..left].fill(0);
                                if job.upsample {
                                    crate::ops::bf16::pack_pairs(at(2 * q), at(2 * q + 1), low);
                                    for (d, &v) in row[left..left + iw].chunks_exact_mut(2).zip(&*low) {
                                        d.fill(v);
                                    }
                                } else {
                                    crate::ops::bf16::pack_pairs(at(2 * q), at(2 * q + 1), &mut row[left..left + f.w]);
                                }
                                row[left + iw..].fill(0);
                            }
                        }
                        let (j, r) = (q / COLS, q % COLS);
                        for kx in 0..kw {
                            let base = (((d * kw + kx) * band_rows + y) * kb + j) * 2 * A_TILE + r * COLS;
                            for xb in 0..xbs {
                                let at = (xb / 2) * column_len + base + (xb % 2) * A_TILE;
                                tiles[at..][..COLS].copy_from_slice(&row[kx + xb * COLS..][..COLS]);
                            }
                        }
                    }
                }
            }
            let tiles = &*tiles;
            let dt_lo = dts[0].0;
            let mut taps: Vec<*const u32> = Vec::with_capacity(dts.len() * taps2);
            let mut c = Aligned([0.0f32; 32 * 32]);
            // SAFETY: `applies` checked AMX; this task's thread opens no other session meanwhile.
            let session = unsafe { amx::Session::start() };
            // A column of blocks (32 columns, the band's rows) reads a few input rows' tiles,
            // which stay in the L2 cache while each block of output channels passes over them.
            for ox0 in (0..wb).step_by(2 * COLS) {
                let two_n = ox0 + COLS < wb;
                for cb in (0..blocks16).step_by(2) {
                    let two_m = cb + 1 < blocks16;
                    let a = packed[cb / 2 * a_stride + dt_lo * kb * taps2 * 2 * A_TILE..].as_ptr();
                    for oy in rows.clone() {
                        let ry = oy - rows.start;
                        taps.clear();
                        for d in 0..dts.len() {
                            for ky in 0..kh {
                                for kx in 0..kw {
                                    let at = ox0 / (2 * COLS) * column_len
                                        + ((d * kw + kx) * band_rows + ry + ky) * row_tiles;
                                    taps.push(tiles[at..].as_ptr());
                                }
                            }
                        }
                        let init = (bias_tiles[cb * amx::ROWS * 2 * COLS..].as_ptr(), 2 * COLS);
                        let (m, n) = ((cout - cb * amx::ROWS).min(32), (wo - ox0).min(2 * COLS));
                        // Both calls below: `a` starts the tile pairs of blocks `cb`, `cb + 1`
                        // from the first temporal tap listed on, in `conv_block`'s order; every
                        // B tile named lies in this column's tiles (rows `ry + ky < band_rows`,
                        // channel blocks `< kb`, the second of a pair only where `two_n`);
                        // `init` in the bias tiles (rows `cb·16..+32`); `session` is this
                        // thread's only one.
                        if m == 16 * (1 + two_m as usize) && n == 16 * (1 + two_n as usize) {
                            // Whole tiles: stored straight into the output, channels a plane
                            // apart: row `oy`, columns `ox0..+n` of channels `cb·16..+m` of this
                            // output frame, which belong to this task alone.
                            let out = dst.raw(out_at(cb * amx::ROWS, oy, ox0), (m - 1) * to * plane_out + n);
                            // SAFETY: `a`, the B tiles of `taps` and `init` as above; `out` holds
                            // the `m` rows of `n` columns, a channel plane apart, that this task
                            // alone writes.
                            unsafe {
                                session.conv_block((two_m, two_n), a, &taps, (kb, taps2), init, (out, to * plane_out))
                            };
                        } else {
                            // Into this task's own block, then the part inside the output.
                            // SAFETY: `a`, the B tiles of `taps` and `init` as above; `c` is this
                            // task's own 32 × 32 block.
                            unsafe {
                                session.conv_block((two_m, two_n), a, &taps, (kb, taps2), init, (c.0.as_mut_ptr(), 32))
                            };
                            for r in 0..m {
                                // SAFETY: row `oy`, columns `ox0..+n` of channel `cb·16 + r` of
                                // this output frame belong to this task alone.
                                let out = unsafe { dst.slice(out_at(cb * amx::ROWS + r, oy, ox0), n) };
                                out.copy_from_slice(&c.0[r * 32..][..n]);
                            }
                        }
                    }
                }
            }
        })
    });
    Ok(out)
}

/// Packs the weights `[Cout, Cin, kt, kh, kw]` into `dst` as bf16 pair tiles: for each block of
/// 32 output channels, temporal tap, block of 16 channel pairs and spatial tap, two 16 × 16
/// tiles (row: output channel, column: channel pair), zeros past `Cout`.
fn pack_weights(job: &ConvJob<'_>, dst: &mut [f32]) {
    let [kt, kh, kw] = job.kernel;
    let (cin, cout) = (job.frames.cin, job.cout);
    let taps2 = kh * kw;
    let kb = cin / (2 * COLS);
    let per_pair = kt * kb * taps2 * 2 * A_TILE;
    let per_channel = cin * kt * taps2;
    dst.par_chunks_mut(per_pair).enumerate().for_each(|(pb, dst)| {
        let dst: &mut [u32] = bytemuck::cast_slice_mut(dst);
        for (i, row) in dst.chunks_exact_mut(COLS).enumerate() {
            // Row `r` of half `h` of the tile pair of step (dt, j, tap): input channels
            // 32j..32j + 32 of output channel `co`, `kt·taps` apart in the weights.
            let (r, h, step) = (i % amx::ROWS, i / amx::ROWS % 2, i / amx::ROWS / 2);
            let (tap, j, dt) = (step % taps2, step / taps2 % kb, step / taps2 / kb);
            let co = (2 * pb + h) * amx::ROWS + r;
            let row: &mut [u32; COLS] = row.try_into().expect("16 elements");
            if co < cout {
                let w = &job.weight[co * per_channel..][..per_channel];
                crate::ops::bf16::gather_pairs(w, 2 * COLS * j * kt * taps2 + dt * taps2 + tap, kt * taps2, row);
            } else {
                row.fill(0);
            }
        }
    });
}

/// A 32 × 32 block of `C`, on a cache line boundary.
#[repr(C, align(64))]
struct Aligned([f32; 32 * 32]);

#[cfg(test)]
mod tests {
    use super::super::testing::{Case, col_band, max_err, row_band, scale};
    use super::super::{ConvJob, Frames};
    use super::*;

    /// 3×3 and 1×1, several blocks of 32 channels and columns with ragged ends, two batch
    /// items, and a causal 3-D convolution whose first frames' taps read padding.
    const CASES: [Case; 4] = [
        Case { n: 1, cin: 64, cout: 40, t: 1, kt: 1, k: 3, h: 13, w: 37, padding: [1; 4], pad_front: 0 },
        Case { n: 2, cin: 32, cout: 16, t: 1, kt: 1, k: 3, h: 5, w: 16, padding: [0, 0, 1, 1], pad_front: 0 },
        Case { n: 1, cin: 32, cout: 48, t: 3, kt: 3, k: 3, h: 6, w: 20, padding: [1; 4], pad_front: 2 },
        Case { n: 1, cin: 64, cout: 33, t: 1, kt: 1, k: 1, h: 7, w: 50, padding: [0; 4], pad_front: 0 },
    ];

    fn conv(job: &ConvJob<'_>) -> Vec<f32> {
        assert!(applies(job));
        run(job, job.out_len().unwrap()).unwrap().as_slice().to_vec()
    }

    #[test]
    fn sums_the_bf16_operands_products_to_f32_accuracy() {
        if !amx::supported() {
            return; // no AMX here: bf16 convolutions take AVX512-BF16 (tested in direct)
        }
        let round = |v: f32| crate::ops::bf16::value(crate::ops::bf16::bits(v));
        for (i, case) in CASES.iter().enumerate() {
            let ops = case.operands();
            let got = conv(&case.job(&ops, 1, true));
            let exact = case.reference();
            let s = scale(&exact);
            // The products of the rounded operands, summed in f32: as close as f32 sums get.
            let err = max_err(&got, &case.reference_of(round)) / s;
            assert!(err <= 3e-6, "case {i}: {err:e} from the rounded operands' exact result");
            // Against the f32 operands: bf16's precision (measured ≤ 3e-3).
            let err = max_err(&got, &exact) / s;
            assert!(err <= 8e-3, "case {i}: {err:e} from the exact result");
        }
    }

    /// Bands of output rows or columns computed from their input plus halos (the spatial
    /// shard's way), cut anywhere, and any thread count, give the whole map's bits.
    #[test]
    fn bands_and_thread_counts_do_not_change_a_bit() {
        if !amx::supported() {
            return;
        }
        let case = &CASES[0];
        let ops = case.operands();
        let whole = conv(&case.job(&ops, 1, true));
        let (cin, cout, h, w) = (case.cin, case.cout, case.h, case.w);
        for threads in [1, 3] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let again = pool.install(|| conv(&case.job(&ops, 1, true)));
            assert!(whole.iter().zip(&again).all(|(a, b)| a.to_bits() == b.to_bits()), "{threads} threads");
        }
        let band_conv = |x: &[f32], bh: usize, bw: usize, padding: [usize; 4]| {
            let job = ConvJob {
                frames: Frames { parts: [&[], x], part_t: [0, 1], n: 1, cin, h: bh, w: bw },
                padding,
                out: [1, bh + padding[0] + padding[1] - 2, bw + padding[2] + padding[3] - 2],
                ..case.job(&ops, 1, true)
            };
            conv(&job)
        };
        // Rows r0..r1 from input rows r0 − 1 ..= r1 (zeros past the edges).
        for (r0, r1) in [(0, 3), (3, 10), (10, 13), (5, 6)] {
            let band = row_band(&ops.x, [cin, h, w], (r0, r1));
            let got = band_conv(&band, r1 - r0 + 2, w, [0, 0, 1, 1]);
            for c in 0..cout {
                let a = &whole[(c * h + r0) * w..][..(r1 - r0) * w];
                let b = &got[c * (r1 - r0) * w..][..(r1 - r0) * w];
                assert!(a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits()), "rows {r0}..{r1}, channel {c}");
            }
        }
        // Columns c0..c1 likewise.
        for (c0, c1) in [(0, 5), (5, 33), (33, 37)] {
            let band = col_band(&ops.x, [cin, h, w], (c0, c1));
            let got = band_conv(&band, h, c1 - c0 + 2, [1, 1, 0, 0]);
            for c in 0..cout {
                for y in 0..h {
                    let a = &whole[(c * h + y) * w + c0..][..c1 - c0];
                    let b = &got[(c * h + y) * (c1 - c0)..][..c1 - c0];
                    assert!(a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits()), "cols {c0}..{c1}, channel {c}");
                }
            }
        }
    }

    /// Reading the input upsampled 2× while packing it gives the bits of the convolution of
    /// the upsampled map, for odd and even extents, one-sided padding (a shard band's) and
    /// batches.
    #[test]
    fn reading_the_input_upsampled_gives_the_upsampled_maps_bits() {
        if !amx::supported() {
            return;
        }
        for (n, h, w, padding) in [(1, 5, 11, [1; 4]), (2, 4, 16, [0, 0, 1, 1]), (1, 7, 9, [1, 1, 0, 0])] {
            let case = Case { n, cin: 64, cout: 40, t: 1, kt: 1, k: 3, h, w, padding, pad_front: 0 };
            let ops = case.operands();
            // The upsampled map, `[n, cin, 2h, 2w]`.
            let big: Vec<f32> = (0..n * case.cin * 2 * h)
                .flat_map(|row| {
                    let src = &ops.x[row / 2 * w..][..w];
                    src.iter().flat_map(|&v| [v, v]).collect::<Vec<_>>()
                })
                .collect();
            let out = |h: usize, w: usize| [1, h + padding[0] + padding[1] - 2, w + padding[2] + padding[3] - 2];
            let materialised = ConvJob {
                frames: Frames { parts: [&[], &big], part_t: [0, 1], n, cin: case.cin, h: 2 * h, w: 2 * w },
                out: out(2 * h, 2 * w),
                ..case.job(&ops, 1, true)
            };
            let fused = ConvJob { out: out(2 * h, 2 * w), upsample: true, ..case.job(&ops, 1, true) };
            let (a, b) = (conv(&materialised), conv(&fused));
            assert_eq!(a.len(), b.len());
            assert!(a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits()), "{n}×{h}×{w} {padding:?}");
        }
    }

    /// A causal 3-D convolution run chunk by chunk, each chunk reading the previous chunk's
    /// last frames as its cache (Wan's decode), gives the whole clip's bits.
    #[test]
    fn the_causal_cache_gives_the_whole_clips_bits() {
        if !amx::supported() {
            return;
        }
        let case = Case { n: 1, cin: 32, cout: 32, t: 5, kt: 3, k: 3, h: 4, w: 18, padding: [1; 4], pad_front: 2 };
        let ops = case.operands();
        let whole = conv(&case.job(&ops, 1, true));
        let plane = case.h * case.w;
        let frame = case.cin * plane; // one frame, every channel
        // Frames `t0..t1` of the input, `[1, cin, t1 − t0, h, w]`.
        let frames = |t0: usize, t1: usize| -> Vec<f32> {
            (0..case.cin).flat_map(|c| ops.x[(c * case.t + t0) * plane..(c * case.t + t1) * plane].to_vec()).collect()
        };
        let (first, rest, cache) = (frames(0, 2), frames(2, 5), frames(0, 2));
        assert_eq!(first.len(), 2 * frame);
        let chunk = |parts: [&[f32]; 2], part_t: [usize; 2], pad_front: usize| {
            let t = part_t[0] + part_t[1];
            let job = ConvJob {
                frames: Frames { parts, part_t, n: 1, cin: case.cin, h: case.h, w: case.w },
                pad_front,
                out: [t + pad_front + 1 - 3, case.h, case.w],
                ..case.job(&ops, 1, true)
            };
            conv(&job)
        };
        let a = chunk([&[], &first], [0, 2], 2); // output frames 0, 1
        let b = chunk([&cache, &rest], [2, 3], 0); // output frames 2, 3, 4
        for c in 0..case.cout {
            let want = &whole[c * 5 * plane..][..5 * plane];
            let got: Vec<f32> =
                a[c * 2 * plane..][..2 * plane].iter().chain(&b[c * 3 * plane..][..3 * plane]).copied().collect();
            assert!(want.iter().zip(&got).all(|(p, q)| p.to_bits() == q.to_bits()), "channel {c}");
        }
    }
}
