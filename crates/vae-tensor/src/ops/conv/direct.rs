//! Any convolution as an implicit GEMM: `out[co][q] = Σ_(dt, ky, kx, ci) W[co][ci][dt][ky][kx] ·
//! X[ci][frame(dt)][q shifted by (ky, kx)]`, with no im2col matrix and no padded copy.
//!
//! Output pixels `q = oy·Wo + ox` are cut into blocks of [`BLOCK_COLS`], in parallel on the
//! current rayon pool. A block packs [`K_CHUNK`] reduction rows at a time: row `(dt, ky, kx,
//! ci)` holds, for each of the block's pixels, the input value that tap reads (zero where it
//! reads padding), copied as contiguous runs for stride 1. Every output-channel block of the
//! packed weights is multiplied into them by [`microkernel::block`], accumulating in a
//! per-thread block of `C` that is then written out with the bias. Reduction order: temporal
//! tap, spatial tap, input channel; temporal taps that read padding frames are skipped. For
//! bf16 products the rows are packed in pairs, multiplied by AVX512-BF16's `vdpbf16ps` in the
//! micro-kernel or, on a CPU with AMX, by [`amx::Session::gemm`] on the whole block at once.

use std::cell::RefCell;
use std::sync::Arc;
use std::sync::Mutex;

use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use super::amx;
use super::microkernel::{self, NR};
use super::{ConvJob, Frames};
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

/// How a convolution's operands are stored for the micro-kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Operands {
    /// f32, one reduction step per element, with this instruction set's kernel.
    F32(Isa),
    /// bf16 pairs, two reduction steps per `u32` element (AVX512-BF16).
    Bf16,
    /// bf16 pairs multiplied on AMX tiles ([`amx::Session::gemm`]): the weights packed in 16 × 16 tiles,
    /// the reduction padded to whole tiles.
    #[cfg(target_arch = "x86_64")]
    Amx,
}

impl Operands {
    /// The operands of `job` on this machine, for the micro-kernel.
    pub(super) fn of(job: &ConvJob<'_>, isa: Isa) -> Self {
        if job.bf16 { Operands::Bf16 } else { Operands::F32(isa) }
    }

    /// The operands of `job` on this machine for the direct convolution: AMX tiles for bf16
    /// where the CPU has them.
    fn for_direct(job: &ConvJob<'_>, isa: Isa) -> Self {
        #[cfg(target_arch = "x86_64")]
        if job.bf16 && amx::supported() {
            return Operands::Amx;
        }
        Self::of(job, isa)
    }

    /// Rows of `C` per micro-kernel call (and of the packed lhs's blocks).
    pub(super) fn mr(self) -> usize {
        match self {
            Operands::F32(isa) => microkernel::mr(isa),
            Operands::Bf16 => microkernel::BF16_MR,
            #[cfg(target_arch = "x86_64")]
            Operands::Amx => amx::ROWS,
        }
    }

    /// Reduction steps per packed element.
    pub(super) fn steps(self) -> usize {
        match self {
            Operands::F32(_) => 1,
            _ => 2,
        }
    }

    /// Packed elements per temporal tap for `kseg` reduction steps: whole tiles for AMX.
    fn elems(self, kseg: usize) -> usize {
        let e = kseg.div_ceil(self.steps());
        match self {
            #[cfg(target_arch = "x86_64")]
            Operands::Amx => e.div_ceil(amx::COLS) * amx::COLS,
            _ => e,
        }
    }

    /// Packs `steps()` rows into one row of elements: the f32 row itself, or bf16 pairs.
    fn pack_rows(self, rows: [&[f32]; 2], out: &mut [f32]) {
        match self {
            Operands::F32(_) => out.copy_from_slice(rows[0]),
            _ => crate::ops::bf16::pack_pairs(rows[0], rows[1], bytemuck::cast_slice_mut(out)),
        }
    }

    /// One `mr × NR` block over `k` packed elements (see [`microkernel::block_raw`]).
    ///
    /// # Safety
    /// As [`microkernel::block_raw`].
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn block(
        self,
        k: usize,
        a: &[f32],
        b: &[f32],
        ldb: usize,
        c: *mut f32,
        ldc: usize,
        accumulate: bool,
    ) {
        match self {
            // SAFETY: the caller's contract.
            Operands::F32(isa) => unsafe { microkernel::block_raw(isa, k, a, b, ldb, c, ldc, accumulate) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the caller's contract; `Bf16` is only chosen where AVX512-BF16 exists
            // (`CpuBf16Scope::enter` checks).
            Operands::Bf16 => unsafe {
                microkernel::block_bf16_raw(
                    k,
                    bytemuck::cast_slice(a),
                    bytemuck::cast_slice(b),
                    ldb,
                    c,
                    ldc,
                    accumulate,
                )
            },
            #[cfg(not(target_arch = "x86_64"))]
            Operands::Bf16 => unreachable!("bf16 convolutions need AVX512-BF16"),
            #[cfg(target_arch = "x86_64")]
            Operands::Amx => unreachable!("AMX operands go to amx::gemm, not the micro-kernel"),
        }
    }
}

/// What a packing depends on: the weights (by address and length) and the layout they are
/// packed into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PackKey {
    weight: (usize, usize),
    kernel: [usize; 3],
    cin: usize,
    cout: usize,
    ops: Operands,
}

/// The weights whose packings are kept ([`with_packed_weights`]), and those packings.
#[derive(Default)]
struct PackReuse {
    weight: Option<(usize, usize)>,
    packs: Vec<(PackKey, Arc<PackedWeights>)>,
}

thread_local! {
    static REUSE: RefCell<PackReuse> = RefCell::new(PackReuse::default());
}

#[cfg(test)]
thread_local! {
    /// Packings made on this thread, for the tests.
    pub(super) static PACKINGS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Runs `f` with the direct convolutions' packings of `weight` kept and reused on this thread:
/// a convolution computed in pieces (a shard's interior while its halo travels, then its edges)
/// packs its weights once instead of once per piece. `weight` stays borrowed, so it can neither
/// change nor be freed meanwhile; the packings are dropped when `f` returns. Nested calls keep
/// the outer weight's packings (one weight at a time).
pub fn with_packed_weights<R>(weight: &crate::Tensor, f: impl FnOnce() -> R) -> R {
    let Ok(data) = weight.as_slice_f32() else { return f() };
    let key = (data.as_ptr() as usize, data.len());
    let outer = REUSE.with(|r| {
        let mut r = r.borrow_mut();
        if r.weight.is_some() {
            return true;
        }
        r.weight = Some(key);
        false
    });
    if outer {
        return f();
    }
    /// Drops the packings however `f` ends.
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            REUSE.with(|r| *r.borrow_mut() = PackReuse::default());
        }
    }
    let _reset = Reset;
    f()
}

/// `job`'s packed weights: the kept packing when [`with_packed_weights`] covers its weights and
/// they were packed alike before, otherwise packed now (and kept when covered).
fn packed_weights(job: &ConvJob<'_>, ops: Operands) -> Arc<PackedWeights> {
    let key = PackKey {
        weight: (job.weight.as_ptr() as usize, job.weight.len()),
        kernel: job.kernel,
        cin: job.frames.cin,
        cout: job.cout,
        ops,
    };
    let covered = REUSE.with(|r| {
        let r = r.borrow();
        if r.weight != Some(key.weight) {
            return None;
        }
        Some(r.packs.iter().find(|(k, _)| *k == key).map(|(_, p)| Arc::clone(p)))
    });
    #[cfg(test)]
    PACKINGS.with(|n| n.set(n.get() + usize::from(!matches!(covered, Some(Some(_))))));
    match covered {
        Some(Some(packed)) => packed,
        Some(None) => {
            let packed = Arc::new(pack_weights(job, ops));
            REUSE.with(|r| r.borrow_mut().packs.push((key, Arc::clone(&packed))));
            packed
        }
        None => Arc::new(pack_weights(job, ops)),
    }
}

/// A convolution's packed weights, starting on a 64-byte boundary.
pub(super) struct PackedWeights {
    buf: Buffer,
    at: usize,
    len: usize,
    /// Packed elements per temporal tap.
    pub elems: usize,
}

impl PackedWeights {
    /// The packed elements.
    pub(super) fn as_slice(&self) -> &[f32] {
        &self.buf.as_slice()[self.at..][..self.len]
    }
}

/// Packs the weights `[Cout, Cin, kt, kh, kw]` as the micro-kernel's lhs:
/// `[Cout / mr][dt][E][mr]`, where each temporal tap's `kh·kw·Cin` reduction rows (in
/// `(ky, kx, ci)` order) make `E` elements of `steps` rows (the last padded with zeros); zero
/// rows past `Cout`. For AMX each block of 16 output channels is a row of 16 × 16 tiles
/// instead, `[Cout / 16][dt·E / 16][16 channels][16 elements]`.
pub(super) fn pack_weights(job: &ConvJob<'_>, ops: Operands) -> PackedWeights {
    let [kt, kh, kw] = job.kernel;
    let (cin, cout) = (job.frames.cin, job.cout);
    let mr = ops.mr();
    let (taps2, taps) = (kh * kw, kt * kh * kw);
    let kseg = taps2 * cin;
    let elems = ops.elems(kseg);
    let blocks = cout.div_ceil(mr);
    // Where reduction step k = (tap, ci) of temporal tap 0 sits in a `[Cin, kt, kh, kw]` row.
    let offset: Vec<usize> = (0..kseg).map(|k| (k % cin) * taps + k / cin).collect();
    let steps = ops.steps();
    let len = blocks * kt * elems * mr;
    let mut buf = Buffer::for_overwrite(len + 16);
    let at = buf.as_slice().as_ptr().align_offset(64).min(16);
    let chunk = (kt * elems * mr).max(1);
    buf.as_mut_slice()[at..][..len].par_chunks_mut(chunk).enumerate().for_each(|(cb, dst)| {
        // The `steps` f32 values of element `e` of temporal tap `dt` for output channel `co`.
        let mut lo = [0.0f32; 16];
        let mut hi = [0.0f32; 16];
        let value = |co: usize, dt: usize, k: usize| {
            if co < cout && k < kseg { job.weight[co * cin * taps + dt * taps2 + offset[k]] } else { 0.0 }
        };
        match ops {
            Operands::F32(_) => {
                for (i, run) in dst.chunks_exact_mut(mr).enumerate() {
                    let (dt, e) = (i / elems, i % elems);
                    for (r, d) in run.iter_mut().enumerate() {
                        *d = value(cb * mr + r, dt, e);
                    }
                }
            }
            #[cfg(target_arch = "x86_64")]
            Operands::Amx => {
                // Rows of 16 elements: tile t (of temporal tap dt = 16t / E), channel row r.
                for (i, run) in dst.chunks_exact_mut(amx::COLS).enumerate() {
                    let (r, t) = (i % amx::ROWS, i / amx::ROWS);
                    let (dt, e0) = (t * amx::COLS / elems, t * amx::COLS % elems);
                    for c in 0..amx::COLS {
                        lo[c] = value(cb * mr + r, dt, steps * (e0 + c));
                        hi[c] = value(cb * mr + r, dt, steps * (e0 + c) + 1);
                    }
                    crate::ops::bf16::pack_pairs(&lo, &hi, bytemuck::cast_slice_mut(run));
                }
            }
            _ => {
                for (i, run) in dst.chunks_exact_mut(mr).enumerate() {
                    let (dt, e) = (i / elems, i % elems);
                    for r in 0..mr {
                        lo[r] = value(cb * mr + r, dt, steps * e);
                        hi[r] = value(cb * mr + r, dt, steps * e + 1);
                    }
                    crate::ops::bf16::pack_pairs(&lo[..mr], &hi[..mr], bytemuck::cast_slice_mut(run));
                }
            }
        }
    });
    PackedWeights { buf, at, len, elems }
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

/// Runs `job` as an implicit GEMM: the outputs of its window ([`ConvJob::window`]) into `out`.
pub(super) fn run(job: &ConvJob<'_>, isa: Isa, out: &mut [f32]) {
    let f: &Frames<'_> = &job.frames;
    let [kt, kh, kw] = job.kernel;
    let to = job.out[0];
    let (cin, cout) = (f.cin, job.cout);
    let s = job.stride[1];
    let [top, _, left, _] = job.padding;
    let window = &job.window;
    let (r0, c0, wo) = (window.rows.start, window.cols.start, window.cols.len());
    let plane_out = window.rows.len() * wo;
    if out.is_empty() || plane_out == 0 {
        return;
    }
    let ops = Operands::for_direct(job, isa);
    let mr = ops.mr();
    let taps2 = kh * kw;
    let kseg = taps2 * cin;
    let packed = packed_weights(job, ops);
    let elems = packed.elems;
    let blocks_of_c = cout.div_ceil(mr);
    let cout_pad = blocks_of_c * mr;
    let blocks: Vec<Block> = (0..f.n)
        .flat_map(|b| (0..to).map(move |o| (b, o)))
        .flat_map(|(b, o)| {
            (0..plane_out).step_by(BLOCK_COLS).map(move |q0| Block { b, o, q0, q1: (q0 + BLOCK_COLS).min(plane_out) })
        })
        .collect();
    let ldb = BLOCK_COLS;
    // Per thread: the packed rows, the block of C, and two gathered input rows.
    let scratch = ScratchPool::new(K_CHUNK * ldb + cout_pad * ldb + 2 * ldb + 16, blocks.len());
    let dst = OutPtr::new(out);

    blocks.par_iter().for_each(|blk| {
        // Temporal taps that read real frames form one contiguous range.
        let dts: Vec<(usize, usize)> = (0..kt).filter_map(|dt| job.input_frame(blk.o, dt).map(|ti| (dt, ti))).collect();
        let e_lo = dts.first().map_or(0, |&(dt, _)| dt * elems);
        let e_len = dts.len() * elems;
        let width = blk.q1 - blk.q0;
        let panels = width.div_ceil(NR);
        // Pixel `q` of the window is output row `r0 + q / wo`, column `c0 + q % wo`.
        let runs: Vec<RowRun> = (blk.q0 / wo..=(blk.q1 - 1) / wo)
            .map(|ry| {
                let (x0, x1) = (blk.q0.saturating_sub(ry * wo), (blk.q1 - ry * wo).min(wo));
                RowRun { oy: r0 + ry, x0: c0 + x0, x1: c0 + x1, at: ry * wo + x0 - blk.q0 }
            })
            .collect();
        // Reduction row `k` of temporal tap index `dti`, gathered for the block's pixels.
        let gather = |dti: usize, k: usize, row: &mut [f32]| {
            if k >= kseg {
                row.fill(0.0);
                return;
            }
            let (tap, ci) = (k / cin, k % cin);
            let (ky, kx) = (tap / kw, tap % kw);
            let src = f.plane(blk.b, ci, dts[dti].1);
            for run in &runs {
                let dst = &mut row[run.at..][..run.x1 - run.x0];
                match (run.oy * s + ky).checked_sub(top).filter(|&y| y < f.h) {
                    Some(y) => gather_row(&src[y * f.w..][..f.w], run.x0 * s + kx, left, s, dst),
                    None => dst.fill(0.0),
                }
            }
        };
        scratch.with(|buf| {
            let buf = &mut aligned(buf)[..K_CHUNK * ldb + cout_pad * ldb + 2 * ldb];
            let (bpanel, rest) = buf.split_at_mut(K_CHUNK * ldb);
            let (cblock, rows) = rest.split_at_mut(cout_pad * ldb);
            let (row0, row1) = rows.split_at_mut(ldb);
            for e0 in (0..e_len).step_by(K_CHUNK) {
                let kc = K_CHUNK.min(e_len - e0);
                for ee in 0..kc {
                    let (dti, e) = ((e0 + ee) / elems, (e0 + ee) % elems);
                    let packed_row = &mut bpanel[ee * ldb..][..width];
                    match ops {
                        Operands::F32(_) => gather(dti, e, packed_row),
                        _ => {
                            gather(dti, 2 * e, &mut row0[..width]);
                            gather(dti, 2 * e + 1, &mut row1[..width]);
                            ops.pack_rows([&row0[..width], &row1[..width]], packed_row);
                        }
                    }
                }
                #[cfg(target_arch = "x86_64")]
                if ops == Operands::Amx {
                    let a = &packed.as_slice()[(e_lo + e0) * mr..];
                    let (mb, nb, kb) = (blocks_of_c, width.div_ceil(amx::COLS), kc / amx::COLS);
                    // SAFETY: AMX was detected (`for_direct`); the packed weights hold `mb` rows
                    // of tiles `kt·elems·16` apart, from `e_lo + e0` on `kb` tiles each (`elems`
                    // and K_CHUNK are multiples of 16); the panel `kc` rows of `ldb ≥ 16·nb`;
                    // `cblock` `cout_pad = 16·mb` rows of `ldb`, this thread's alone.
                    unsafe {
                        amx::Session::start().gemm(
                            (mb, nb, kb),
                            a.as_ptr().cast(),
                            kt * elems * mr,
                            bpanel.as_ptr().cast(),
                            ldb,
                            cblock.as_mut_ptr(),
                            ldb,
                            e0 > 0,
                        )
                    };
                    continue;
                }
                for cb in 0..blocks_of_c {
                    let a = &packed.as_slice()[(cb * kt * elems + e_lo + e0) * mr..][..kc * mr];
                    for p in 0..panels {
                        let c = &mut cblock[cb * mr * ldb + p * NR..][..(mr - 1) * ldb + NR];
                        // SAFETY: `c` is this thread's block of C, covering the micro-kernel's
                        // `mr` rows of `NR` values `ldb` apart.
                        unsafe { ops.block(kc, a, &bpanel[p * NR..], ldb, c.as_mut_ptr(), ldb, e0 > 0) };
                    }
                }
            }
            for co in 0..cout {
                let bias = job.bias.map_or(0.0, |b| b[co]);
                let frame = (blk.b * cout + co) * to + blk.o;
                for run in &runs {
                    let len = run.x1 - run.x0;
                    // SAFETY: the window's pixels `q0..q1` of this frame and channel belong to
                    // this block alone, and distinct outputs go to distinct places.
                    let out = unsafe { dst.slice(window.index(frame, run.oy, run.x0), len) };
                    if e_len == 0 {
                        out.fill(bias);
                    } else {
                        let acc = &cblock[co * ldb + run.at..][..len];
                        out.iter_mut().zip(acc).for_each(|(o, &a)| *o = a + bias);
                    }
                }
            }
        });
    });
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
