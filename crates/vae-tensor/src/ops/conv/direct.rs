//! Any convolution as an implicit GEMM: `out[co][q] = Σ_(dt, ky, kx, ci) W[co][ci][dt][ky][kx] ·
//! X[ci][frame(dt)][q shifted by (ky, kx)]`, with no im2col matrix and no padded copy.
//!
//! Output pixels `q = oy·Wo + ox` are cut into blocks of [`BLOCK_COLS`], in parallel on the
//! current rayon pool. A block packs [`K_CHUNK`] reduction rows at a time: row `(dt, ky, kx,
//! ci)` holds, for each of the block's pixels, the input value that tap reads (zero where it
//! reads padding), copied as contiguous runs for stride 1. Every output-channel block of the
//! packed weights is multiplied into them by [`microkernel::block`], accumulating in a
//! per-thread block of `C` that is then written out with the bias. Reduction order: temporal
//! tap, spatial tap, input channel; temporal taps that read padding frames are skipped.

use std::sync::Mutex;

use rayon::prelude::*;

use super::microkernel::{self, NR};
use super::{ConvJob, Frames};
use crate::Result;
use crate::memory::Buffer;
use crate::ops::OutPtr;
use crate::ops::simd::Isa;

/// Output columns per block: four micro-kernel panels.
const BLOCK_COLS: usize = 4 * NR;
/// Reduction rows packed at once: 256 rows of a block's columns are 192 KiB.
const K_CHUNK: usize = 256;

/// A buffer's elements from its first 64-byte boundary on (buffers are allocated with 16
/// elements to spare), so that vector loads do not straddle cache lines.
pub(super) fn aligned(buf: &mut Buffer) -> &mut [f32] {
    let data = buf.as_mut_slice();
    let skip = data.as_ptr().align_offset(64).min(16);
    &mut data[skip..]
}

/// Per-thread scratch, allocated up front by the calling thread (so it is charged to the
/// rank's memory account) and handed out to whichever pool thread runs a block.
pub(super) struct ScratchPool {
    free: Mutex<Vec<Buffer>>,
    len: usize,
}

impl ScratchPool {
    /// One buffer of `len` elements (plus alignment slack) for each pool thread that can run
    /// one of `tasks` at once.
    pub(super) fn new(len: usize, tasks: usize) -> Self {
        let n = rayon::current_num_threads().clamp(1, tasks.max(1));
        Self { free: Mutex::new((0..n).map(|_| Buffer::zeros(len + 16)).collect()), len: len + 16 }
    }

    /// Runs `f` with a buffer to itself.
    pub(super) fn with<R>(&self, f: impl FnOnce(&mut Buffer) -> R) -> R {
        let taken = self.free.lock().unwrap_or_else(|e| e.into_inner()).pop();
        // A pool thread runs one task at a time, so one is always free unless a task nests
        // parallel work; allocate rather than fail then.
        let mut buf = taken.unwrap_or_else(|| Buffer::zeros(self.len));
        let out = f(&mut buf);
        self.free.lock().unwrap_or_else(|e| e.into_inner()).push(buf);
        out
    }
}

/// Packs the weights `[Cout, Cin, kt, kh, kw]` as the micro-kernel's lhs:
/// `[Cout / mr][K][mr]` with `K` in (dt, ky, kx, ci) order, zero rows past `Cout`.
pub(super) fn pack_weights(job: &ConvJob<'_>, mr: usize) -> Buffer {
    let [kt, kh, kw] = job.kernel;
    let (cin, cout) = (job.frames.cin, job.cout);
    let taps = kt * kh * kw;
    let k = taps * cin;
    let blocks = cout.div_ceil(mr);
    let mut packed = Buffer::zeros(blocks * k * mr);
    packed.as_mut_slice().par_chunks_mut((k * mr).max(1)).enumerate().for_each(|(cb, dst)| {
        for r in 0..mr {
            let co = cb * mr + r;
            if co >= cout {
                break;
            }
            for ci in 0..cin {
                let src = &job.weight[(co * cin + ci) * taps..][..taps];
                for (tap, &v) in src.iter().enumerate() {
                    dst[(tap * cin + ci) * mr + r] = v;
                }
            }
        }
    });
    packed
}

/// One block of work: pixels `q0..q1` of output frame `o` of batch item `b`.
#[derive(Clone, Copy)]
struct Block {
    b: usize,
    o: usize,
    q0: usize,
    q1: usize,
}

/// A block's pixels on one output row: columns `x0..x1` of row `oy`, at `at` in the block.
#[derive(Clone, Copy)]
struct RowRun {
    oy: usize,
    x0: usize,
    x1: usize,
    at: usize,
}

/// Runs `job` as an implicit GEMM; the result is `[N, Cout, To, Ho, Wo]`.
pub(super) fn run(job: &ConvJob<'_>, isa: Isa, out_len: usize) -> Result<Buffer> {
    let f: &Frames<'_> = &job.frames;
    let [kt, kh, kw] = job.kernel;
    let [to, ho, wo] = job.out;
    let (cin, cout) = (f.cin, job.cout);
    let s = job.stride[1];
    let [top, _, left, _] = job.padding;
    let mut out = Buffer::zeros(out_len);
    if out_len == 0 {
        return Ok(out);
    }
    let mr = microkernel::mr(isa);
    let taps2 = kh * kw;
    let k_full = kt * taps2 * cin;
    let packed = pack_weights(job, mr);
    let blocks_of_c = cout.div_ceil(mr);
    let cout_pad = blocks_of_c * mr;
    let plane_out = ho * wo;
    let blocks: Vec<Block> = (0..f.n)
        .flat_map(|b| (0..to).map(move |o| (b, o)))
        .flat_map(|(b, o)| {
            (0..plane_out).step_by(BLOCK_COLS).map(move |q0| Block { b, o, q0, q1: (q0 + BLOCK_COLS).min(plane_out) })
        })
        .collect();
    let ldb = BLOCK_COLS;
    let scratch = ScratchPool::new(K_CHUNK * ldb + cout_pad * ldb + 16, blocks.len());
    let dst = OutPtr::new(out.as_mut_slice());

    blocks.par_iter().for_each(|blk| {
        // Temporal taps that read real frames form one contiguous range.
        let dts: Vec<(usize, usize)> = (0..kt).filter_map(|dt| job.input_frame(blk.o, dt).map(|ti| (dt, ti))).collect();
        let k_lo = dts.first().map_or(0, |&(dt, _)| dt * taps2 * cin);
        let k_len = dts.len() * taps2 * cin;
        let width = blk.q1 - blk.q0;
        let panels = width.div_ceil(NR);
        let runs: Vec<RowRun> = (blk.q0 / wo..=(blk.q1 - 1) / wo)
            .map(|oy| {
                let (x0, x1) = (blk.q0.saturating_sub(oy * wo), (blk.q1 - oy * wo).min(wo));
                RowRun { oy, x0, x1, at: oy * wo + x0 - blk.q0 }
            })
            .collect();
        scratch.with(|buf| {
            let buf = &mut aligned(buf)[..K_CHUNK * ldb + cout_pad * ldb];
            let (bpanel, cblock) = buf.split_at_mut(K_CHUNK * ldb);
            for k0 in (0..k_len).step_by(K_CHUNK) {
                let kc = K_CHUNK.min(k_len - k0);
                for kk in 0..kc {
                    let kg = k0 + kk; // within the valid taps
                    let (dti, rest) = (kg / (taps2 * cin), kg % (taps2 * cin));
                    let (tap, ci) = (rest / cin, rest % cin);
                    let (ky, kx) = (tap / kw, tap % kw);
                    let src = f.plane(blk.b, ci, dts[dti].1);
                    let row = &mut bpanel[kk * ldb..][..width];
                    for run in &runs {
                        let dst = &mut row[run.at..][..run.x1 - run.x0];
                        let y = (run.oy * s + ky).checked_sub(top).filter(|&y| y < f.h);
                        let Some(y) = y else {
                            dst.fill(0.0);
                            continue;
                        };
                        gather_row(&src[y * f.w..][..f.w], run.x0 * s + kx, left, s, dst);
                    }
                }
                for cb in 0..blocks_of_c {
                    let a = &packed.as_slice()[(cb * k_full + k_lo + k0) * mr..][..kc * mr];
                    for p in 0..panels {
                        let c = &mut cblock[cb * mr * ldb + p * NR..];
                        microkernel::block(isa, kc, a, &bpanel[p * NR..], ldb, c, ldb, k0 > 0);
                    }
                }
            }
            for co in 0..cout {
                let bias = job.bias.map_or(0.0, |b| b[co]);
                let base = ((blk.b * cout + co) * to + blk.o) * plane_out;
                // SAFETY: pixels `q0..q1` of this frame and channel belong to this block alone.
                let out = unsafe { dst.slice(base + blk.q0, width) };
                if k_len == 0 {
                    out.fill(bias);
                } else {
                    let acc = &cblock[co * ldb..][..width];
                    out.iter_mut().zip(acc).for_each(|(o, &a)| *o = a + bias);
                }
            }
        });
    });
    Ok(out)
}

/// `dst[i] = row[first + i·s − left]`, zero where that index falls outside the row.
fn gather_row(row: &[f32], first: usize, left: usize, s: usize, dst: &mut [f32]) {
    let w = row.len();
    // Leading outputs that read left padding: first + i·s < left.
    let lead = left.saturating_sub(first).div_ceil(s).min(dst.len());
    dst[..lead].fill(0.0);
    if lead == dst.len() {
        return;
    }
    let start = first + lead * s - left; // input column of output `lead`
    // Outputs from `lead` on that read inside the row.
    let inside = if start < w { (w - start).div_ceil(s).min(dst.len() - lead) } else { 0 };
    let body = &mut dst[lead..lead + inside];
    if s == 1 {
        body.copy_from_slice(&row[start..start + inside]);
    } else {
        body.iter_mut().zip(row[start..].iter().step_by(s)).for_each(|(d, &v)| *d = v);
    }
    dst[lead + inside..].fill(0.0);
}
