//! 3×3 stride-1 convolutions by Winograd's minimal filtering (Lavin & Gray, 2016): every `m × m`
//! block of outputs is `Aᵀ [ (G g Gᵀ) ⊙ (Bᵀ d B) ] A` for the `(m + 2) × (m + 2)` input patch
//! `d` under it. Two variants: F(4×4, 3×3) (interpolation points 0, ±1, ±2, ∞; 36 products
//! per input channel instead of 144) and F(2×2, 3×3) (0, ±1, ∞; 16 instead of 36). Over
//! channels the element-wise products become `(m + 2)²` GEMMs
//! `M_p[co][tile] = Σ_ci U_p[co][ci] · V_p[ci][tile]`, run by the shared micro-kernel; temporal
//! taps of a 3-D kernel are more reduction rows of the same GEMMs (in `(dt, ci)` order).
//!
//! Tiles start at output row and column 0: the grid of the whole map when the caller's bands
//! fall on multiples of the tile (see [`super::Conv2dParams::band_aligned`]), so F(4×4) runs
//! where cuts fall on multiples of 4 and F(2×2) where they fall on even rows. The output is
//! computed in bands of [`tiles_per_band`] consecutive tiles (row-major over the frame's tile
//! grid): the band's input transform `V`, then the GEMMs into `M`, then the output transform,
//! each phase in parallel on the current rayon pool. Weights are transformed (in f64, rounded
//! once) per call, for at most [`U_BUDGET`] bytes of output channels at a time.
//!
//! Precision (measured in the tests against f64 sums, and against diffusers by the model
//! fixtures): F(4×4) errors are about 10× the direct kernel's, F(2×2) errors smaller than the
//! direct kernel's (its product sums are 9× shorter).

use rayon::prelude::*;

use super::direct::{Operands, ScratchPool, aligned};
use super::microkernel::{self, NR};
use super::{ConvJob, Frames};
use crate::memory::Buffer;
use crate::ops::OutPtr;
use crate::ops::lanes::{Lanes, Portable, WideLanes};
use crate::ops::simd::Isa;

/// Most element-wise products per tile and channel (F(4×4): 6 × 6).
const P_MAX: usize = 36;
/// Bytes of transformed weights held at once.
const U_BUDGET: usize = 64 << 20;
/// Widest vector (lanes) of any instruction set: row buffers keep this much slack.
const MAX_LANES: usize = 16;
/// Elements (one cache line) added between the planes of `V` and `M`.
const SKEW: usize = 16;

/// A row stride of at least `len` elements that is an odd number of cache lines, so that
/// successive rows spread over every cache set.
fn row_stride(len: usize) -> usize {
    let lines = len.div_ceil(16);
    16 * (lines | 1)
}

/// Whether `job` runs here: a 3×3 stride-1 spatial kernel whose bands fall on even rows and
/// columns (multiples of 4 for F(4×4)).
pub(super) fn applies(job: &ConvJob<'_>) -> bool {
    let [_, kh, kw] = job.kernel;
    kh == 3 && kw == 3 && job.stride[1] == 1 && job.band_align.is_multiple_of(2)
}

/// Tiles per band: four micro-kernel panels (fewer for a small map). Larger bands read the
/// transformed weights fewer times (once per band); smaller ones keep `V` and `M` smaller.
fn tiles_per_band(tiles: usize) -> usize {
    (4 * NR).min(tiles.div_ceil(NR) * NR)
}

/// One Winograd variant F(m × m, 3 × 3): its sizes and transforms, written for `A ≤ 6` vectors
/// (the arrays are sized for F(4×4); F(2×2) uses their first four entries).
trait Tile {
    /// Output rows and columns per tile.
    const M: usize;
    /// Input rows and columns per tile (`M + 2`).
    const A: usize;
    /// Element-wise products per tile and channel.
    const P: usize = Self::A * Self::A;

    /// `G · (g0, g1, g2)`: one column (or row) of kernels through the filter transform, in f64
    /// lanes (one kernel per lane).
    fn g3<W: WideLanes>(g0: W, g1: W, g2: W) -> [W; 6];
    /// `Bᵀ · d` for `A` vectors.
    fn bt<S: Lanes>(d: &[S; 6]) -> [S; 6];
    /// `Aᵀ · m`: `M` vectors from `A`.
    fn at<S: Lanes>(m: &[S; 6]) -> [S; 4];
    /// The `A` phases of `L` windows `M` apart from `M·L + 2` values.
    ///
    /// # Safety
    /// As [`Lanes::load_windows`] (`M = 4`) or [`Lanes::load_windows2`] (`M = 2`).
    unsafe fn windows<S: Lanes>(p: *const f32) -> [S; 6];
    /// `p[M·j + b] = v[b][j]` for `b < M`.
    ///
    /// # Safety
    /// `p..p + M·L` must be writable.
    unsafe fn interleave<S: Lanes>(p: *mut f32, v: [S; 4]);
}

/// F(4×4, 3×3).
struct F4;

impl Tile for F4 {
    const M: usize = 4;
    const A: usize = 6;

    #[inline(always)]
    fn g3<W: WideLanes>(g0: W, g1: W, g2: W) -> [W; 6] {
        // Products by the reciprocals, not divisions: f64 errors far below the f32 rounding.
        const SIXTH: f64 = 1.0 / 6.0;
        let even = g0.add(g2);
        let outer = g0.mul(W::splat(1.0 / 24.0)).add(g2.mul(W::splat(SIXTH)));
        let mid = g1.mul(W::splat(1.0 / 12.0));
        [
            g0.mul(W::splat(0.25)),
            even.add(g1).mul(W::splat(-SIXTH)),
            even.sub(g1).mul(W::splat(-SIXTH)),
            outer.add(mid),
            outer.sub(mid),
            g2,
        ]
    }

    #[inline(always)]
    fn bt<S: Lanes>(d: &[S; 6]) -> [S; 6] {
        let (four, minus4, minus5) = (S::splat(4.0), S::splat(-4.0), S::splat(-5.0));
        let t0 = S::fma(minus4, d[2], d[4]);
        let t1 = S::fma(minus4, d[1], d[3]);
        let t2 = d[4].sub(d[2]);
        let t3 = d[3].sub(d[1]);
        let t3 = t3.add(t3); // 2·(d3 − d1), exact
        [
            S::fma(four, d[0], S::fma(minus5, d[2], d[4])),
            t0.add(t1),
            t0.sub(t1),
            t2.add(t3),
            t2.sub(t3),
            S::fma(four, d[1], S::fma(minus5, d[3], d[5])),
        ]
    }

    #[inline(always)]
    fn at<S: Lanes>(m: &[S; 6]) -> [S; 4] {
        let s12 = m[1].add(m[2]);
        let d12 = m[1].sub(m[2]);
        let s34 = m[3].add(m[4]);
        let d34 = m[3].sub(m[4]);
        [
            m[0].add(s12).add(s34),
            S::fma(S::splat(2.0), d34, d12),
            S::fma(S::splat(4.0), s34, s12),
            S::fma(S::splat(8.0), d34, d12).add(m[5]),
        ]
    }

    #[inline(always)]
    unsafe fn windows<S: Lanes>(p: *const f32) -> [S; 6] {
        // SAFETY: the caller's contract.
        unsafe { S::load_windows(p) }
    }

    #[inline(always)]
    unsafe fn interleave<S: Lanes>(p: *mut f32, v: [S; 4]) {
        // SAFETY: the caller's contract.
        unsafe { S::store_interleaved(p, v) }
    }
}

/// F(2×2, 3×3).
struct F2;

impl Tile for F2 {
    const M: usize = 2;
    const A: usize = 4;

    #[inline(always)]
    fn g3<W: WideLanes>(g0: W, g1: W, g2: W) -> [W; 6] {
        let (even, half, zero) = (g0.add(g2), W::splat(0.5), W::splat(0.0));
        [g0, even.add(g1).mul(half), even.sub(g1).mul(half), g2, zero, zero]
    }

    #[inline(always)]
    fn bt<S: Lanes>(d: &[S; 6]) -> [S; 6] {
        let zero = S::splat(0.0);
        [d[0].sub(d[2]), d[1].add(d[2]), d[2].sub(d[1]), d[1].sub(d[3]), zero, zero]
    }

    #[inline(always)]
    fn at<S: Lanes>(m: &[S; 6]) -> [S; 4] {
        let zero = S::splat(0.0);
        [m[0].add(m[1]).add(m[2]), m[1].sub(m[2]).sub(m[3]), zero, zero]
    }

    #[inline(always)]
    unsafe fn windows<S: Lanes>(p: *const f32) -> [S; 6] {
        // SAFETY: the caller's contract.
        let [a, b, c, d] = unsafe { S::load_windows2(p) };
        [a, b, c, d, a, a]
    }

    #[inline(always)]
    unsafe fn interleave<S: Lanes>(p: *mut f32, v: [S; 4]) {
        // SAFETY: the caller's contract.
        unsafe { S::store_interleaved2(p, [v[0], v[1]]) }
    }
}

/// `G g Gᵀ` for eight 3×3 kernels at once, in f64 lanes, each value rounded once to f32:
/// `g[i][j]` is weight `i` (row-major) of kernel `j`, and `out[j][p]` gets its transform.
#[inline(always)]
fn transform_kernels<T: Tile, W: WideLanes>(g: &[[f64; 8]; 9], out: &mut [[f32; P_MAX]; 8]) {
    let mut half = 0;
    while half < 8 {
        let mut gv = [W::splat(0.0); 9];
        for (v, row) in gv.iter_mut().zip(g) {
            // SAFETY: `half + L ≤ 8` values of the row.
            *v = unsafe { W::load(row.as_ptr().add(half)) };
        }
        let cols = [T::g3(gv[0], gv[3], gv[6]), T::g3(gv[1], gv[4], gv[7]), T::g3(gv[2], gv[5], gv[8])];
        let mut lanes = [0.0f64; 8];
        for i in 0..T::A {
            let row = T::g3(cols[0][i], cols[1][i], cols[2][i]);
            for (jj, v) in row.iter().take(T::A).enumerate() {
                v.store_to(&mut lanes);
                for (lane, o) in out[half..half + W::L].iter_mut().enumerate() {
                    o[i * T::A + jj] = lanes[lane] as f32;
                }
            }
        }
        half += W::L;
    }
}

/// Transformed weights of output channels `co0..co0 + blocks·mr`, packed as the micro-kernel's
/// lhs: `[p][block][dt][ci][mr]` (zeros past `Cout`), one task per block.
fn transform_weights<T: Tile>(isa: Isa, job: &ConvJob<'_>, co0: usize, blocks: usize, mr: usize, u: &mut [f32]) {
    let dst = OutPtr::new(u);
    (0..blocks).into_par_iter().for_each(|cb| {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx512f")]
        fn avx512<T: Tile>(job: &ConvJob<'_>, at: (usize, usize, usize, usize), dst: OutPtr<'_>) {
            transform_block::<T, crate::ops::lanes::Avx512>(job, at, dst)
        }
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma")]
        fn avx2<T: Tile>(job: &ConvJob<'_>, at: (usize, usize, usize, usize), dst: OutPtr<'_>) {
            transform_block::<T, crate::ops::lanes::Avx2>(job, at, dst)
        }
        let at = (co0, blocks, mr, cb);
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `isa` is only ever an instruction set this CPU supports (`simd::isa`).
            Isa::Avx512 => unsafe { avx512::<T>(job, at, dst) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Isa::Avx2 => unsafe { avx2::<T>(job, at, dst) },
            _ => transform_block::<T, Portable>(job, at, dst),
        }
    });
}

/// Block `cb` of [`transform_weights`]: its run of `K·mr` values in each of the `P` planes, a
/// chunk of the run at a time. The chunk's kernels are transformed eight at a time into a small
/// buffer, then copied plane by plane (the planes are far apart, and writing all of them per
/// kernel thrashes the caches).
#[inline(always)]
fn transform_block<T: Tile, S: Lanes>(
    job: &ConvJob<'_>,
    (co0, blocks, mr, cb): (usize, usize, usize, usize),
    dst: OutPtr<'_>,
) {
    const CHUNK: usize = 256;
    let (cin, cout, kt) = (job.frames.cin, job.cout, job.kernel[0]);
    let run = kt * cin * mr;
    let per_p = blocks * run;
    let mut local = [[0.0f32; P_MAX]; CHUNK];
    for c0 in (0..run).step_by(CHUNK) {
        let len = CHUNK.min(run - c0);
        for e0 in (0..len).step_by(8) {
            let n = 8.min(len - e0);
            let mut g = [[0.0f64; 8]; 9];
            for j in 0..n {
                let kk = c0 + e0 + j;
                let (r, dt, ci) = (kk % mr, kk / mr / cin, kk / mr % cin);
                let co = co0 + cb * mr + r;
                if co < cout {
                    let w = &job.weight[((co * cin + ci) * kt + dt) * 9..][..9];
                    for (gi, &wv) in g.iter_mut().zip(w) {
                        gi[j] = wv as f64;
                    }
                }
            }
            let mut out = [[0.0f32; P_MAX]; 8];
            transform_kernels::<T, S::Wide>(&g, &mut out);
            local[e0..e0 + n].copy_from_slice(&out[..n]);
        }
        for p in 0..T::P {
            // SAFETY: block `cb` owns `[p·per_p + cb·run ..][..run]` of every plane `p`.
            let plane = unsafe { dst.slice(p * per_p + cb * run + c0, len) };
            for (d, t) in plane.iter_mut().zip(&local[..len]) {
                *d = t[p];
            }
        }
    }
}

/// Geometry of one call, shared by the phases.
struct Plan {
    /// Tiles per row and column of the window of a frame ([`ConvJob::window`]).
    tw: usize,
    th: usize,
    /// The output row and column the window's first tile starts at.
    r0: usize,
    c0: usize,
    /// Row-buffer width: the padded row plus slack for the last vector's over-read.
    rw: usize,
    /// Stride between `V` / `M` rows (a band's tiles, padded, plus slack for over-writes).
    ld: usize,
}

/// One task of the input transform: channel `ci` of input frame `ti` of batch item `b`, for
/// tiles `t0..t1` of the frame's grid.
#[derive(Debug, Clone, Copy)]
struct InputTask {
    b: usize,
    ti: usize,
    ci: usize,
    tiles: (usize, usize),
}

/// One task of the output transform: output channel `co` of output frame `(b, o)`, for tiles
/// `t0..t1` of the frame's grid.
#[derive(Debug, Clone, Copy)]
struct OutputTask {
    frame: (usize, usize),
    co: usize,
    tiles: (usize, usize),
}

/// The input transform of `task` into `v`: element `(p, t)` at `v + p·p_stride + t − t0`.
///
/// # Safety
/// `v` must be valid for writes at `p·p_stride + 0..ld` for every `p < P`, and no other
/// thread may access those elements meanwhile.
#[inline(always)]
unsafe fn input_transform<T: Tile, S: Lanes>(
    job: &ConvJob<'_>,
    plan: &Plan,
    task: InputTask,
    rows: &mut [f32],
    v: *mut f32,
    p_stride: usize,
) {
    let InputTask { b, ti, ci, tiles: (t0, t1) } = task;
    let f: &Frames<'_> = &job.frames;
    let [top, _, left, _] = job.padding;
    let plane = f.plane(b, ci, ti);
    let rw = plan.rw;
    for ty in t0 / plan.tw..=(t1 - 1) / plan.tw {
        let tx0 = t0.saturating_sub(ty * plan.tw);
        let tx1 = (t1 - ty * plan.tw).min(plan.tw);
        // The input rows under this tile row, zero outside the image.
        for i in 0..T::A {
            let dst = &mut rows[i * rw + left..][..f.w];
            match (plan.r0 + T::M * ty + i).checked_sub(top).filter(|&y| y < f.h) {
                Some(y) => dst.copy_from_slice(&plane[y * f.w..][..f.w]),
                None => dst.fill(0.0),
            }
        }
        let mut tx = tx0;
        while tx < tx1 {
            let col = plan.c0 + tx * T::M;
            // Bᵀ along each row's windows, then along the rows.
            let mut u = [[S::splat(0.0); 6]; 6]; // u[l][i]: phase l of row i
            for i in 0..T::A {
                // SAFETY: the row buffer holds `rw ≥ M·(tw + L) + 2` values per row.
                let d = unsafe { T::windows::<S>(rows.as_ptr().add(i * rw + col)) };
                for (ul, rl) in u.iter_mut().zip(T::bt(&d)).take(T::A) {
                    ul[i] = rl;
                }
            }
            let idx = ty * plan.tw + tx - t0;
            for (l, ul) in u.iter().take(T::A).enumerate() {
                let r = T::bt(ul);
                for (k, rk) in r.iter().take(T::A).enumerate() {
                    debug_assert!(idx + S::L <= plan.ld);
                    // SAFETY: the caller's contract; `idx + L ≤ ld` (a band plus slack).
                    unsafe { rk.store(v.add((k * T::A + l) * p_stride + idx)) };
                }
            }
            tx += S::L;
        }
    }
}

/// The output transform of `task`, plus the bias, into the output: the channel's `P` rows of
/// `M` are `m[p·m_stride..][..ld]`.
#[inline(always)]
fn output_transform<T: Tile, S: Lanes>(
    job: &ConvJob<'_>,
    plan: &Plan,
    task: OutputTask,
    m: &[f32],
    m_stride: usize,
    rows: &mut [f32],
    out: OutPtr,
) {
    let OutputTask { frame: (b, o), co, tiles: (t0, t1) } = task;
    let to = job.out[0];
    let window = &job.window;
    let (wh, ww) = (window.rows.len(), window.cols.len());
    let bias = S::splat(job.bias.map_or(0.0, |bias| bias[co]));
    let rw = plan.rw;
    let frame = (b * job.cout + co) * to + o;
    for ty in t0 / plan.tw..=(t1 - 1) / plan.tw {
        let tx0 = t0.saturating_sub(ty * plan.tw);
        let tx1 = (t1 - ty * plan.tw).min(plan.tw);
        let mut tx = tx0;
        while tx < tx1 {
            let idx = ty * plan.tw + tx - t0;
            let mut w = [[S::splat(0.0); 6]; 4]; // w[a][l] = Σ_k Aᵀ[a][k] m[k][l]
            for l in 0..T::A {
                let mut col = [S::splat(0.0); 6];
                for (k, v) in col.iter_mut().take(T::A).enumerate() {
                    let at = (k * T::A + l) * m_stride + idx;
                    assert!(at + S::L <= m.len());
                    // SAFETY: in bounds (checked).
                    *v = unsafe { S::load(m.as_ptr().add(at)) };
                }
                for (wa, ra) in w.iter_mut().zip(T::at(&col)).take(T::M) {
                    wa[l] = ra;
                }
            }
            for (a, wa) in w.iter().take(T::M).enumerate() {
                let r = T::at(wa);
                let r = [r[0].add(bias), r[1].add(bias), r[2].add(bias), r[3].add(bias)];
                // SAFETY: the row buffer holds `rw ≥ M·(tw + L)` values per row.
                unsafe { T::interleave::<S>(rows.as_mut_ptr().add(a * rw + tx * T::M), r) };
            }
            tx += S::L;
        }
        let (x0, x1) = (tx0 * T::M, (tx1 * T::M).min(ww));
        for a in 0..T::M {
            let ry = ty * T::M + a;
            if ry >= wh || x0 >= x1 {
                continue;
            }
            // SAFETY: tile row `ty`, columns of tiles `tx0..tx1`, of this frame and channel
            // belong to this band alone, each output channel to one task, and distinct outputs
            // go to distinct places.
            let dst = unsafe { out.slice(window.index(frame, plan.r0 + ry, plan.c0 + x0), x1 - x0) };
            dst.copy_from_slice(&rows[a * rw + x0..][..x1 - x0]);
        }
    }
}

/// The transforms instantiated for one instruction set inside a function with its features on.
macro_rules! transforms {
    ($name_in:ident, $name_out:ident, $lanes:ty, $features:literal) => {
        #[target_feature(enable = $features)]
        unsafe fn $name_in<T: Tile>(
            job: &ConvJob<'_>,
            plan: &Plan,
            task: InputTask,
            rows: &mut [f32],
            v: *mut f32,
            p_stride: usize,
        ) {
            // SAFETY: the caller's contract, as `input_transform`'s.
            unsafe { input_transform::<T, $lanes>(job, plan, task, rows, v, p_stride) }
        }

        #[target_feature(enable = $features)]
        unsafe fn $name_out<T: Tile>(
            job: &ConvJob<'_>,
            plan: &Plan,
            task: OutputTask,
            m: &[f32],
            m_stride: usize,
            rows: &mut [f32],
            out: OutPtr,
        ) {
            output_transform::<T, $lanes>(job, plan, task, m, m_stride, rows, out)
        }
    };
}

#[cfg(target_arch = "x86_64")]
transforms!(input_avx512, output_avx512, crate::ops::lanes::Avx512, "avx512f");
#[cfg(target_arch = "x86_64")]
transforms!(input_avx2, output_avx2, crate::ops::lanes::Avx2, "avx2,fma");

/// Runs `job` (checked by [`applies`]) with the largest tile its band alignment allows; the
/// result is `[N, Cout, To, Ho, Wo]`.
///
/// F(4×4) always multiplies in f32: its transformed operands rounded to bf16 would err about
/// ten times more than the direct convolution in bf16, and with a quarter of the products it
/// runs as fast in f32 as F(2×2) in bf16. So a bf16 request gets F(4×4) in f32 where the
/// alignment allows it, F(2×2) with bf16 products where it allows only that.
pub(super) fn run(job: &ConvJob<'_>, isa: Isa, out: &mut [f32]) {
    if job.band_align.is_multiple_of(F4::M) {
        run_tiles::<F4>(job, Operands::F32(isa), isa, out)
    } else {
        run_tiles::<F2>(job, Operands::of(job, isa), isa, out)
    }
}

fn run_tiles<T: Tile>(job: &ConvJob<'_>, ops: Operands, isa: Isa, out: &mut [f32]) {
    let (m_, a_, p_) = (T::M, T::A, T::P);
    let f = &job.frames;
    let [kt, _, _] = job.kernel;
    let to = job.out[0];
    let (cin, cout) = (f.cin, job.cout);
    // The window's tiles are the whole output's: it starts on the band alignment, a multiple
    // of the tile (checked by the op).
    let (rows, cols) = (&job.window.rows, &job.window.cols);
    if out.is_empty() || rows.is_empty() || cols.is_empty() {
        return;
    }
    debug_assert!(rows.start.is_multiple_of(m_) && cols.start.is_multiple_of(m_));
    let (tw, th) = (cols.len().div_ceil(m_), rows.len().div_ceil(m_));
    let tiles = tw * th;
    let k = kt * cin;
    let band = tiles_per_band(tiles);
    let plan = Plan {
        tw,
        th,
        r0: rows.start,
        c0: cols.start,
        rw: cols.start + m_ * (tw + MAX_LANES) + 4 + f.w,
        ld: row_stride(band + MAX_LANES),
    };
    debug_assert!(plan.th > 0);
    let mr = ops.mr();
    // Packed elements per temporal tap: input channels, or pairs of them in bf16.
    let cin_e = cin.div_ceil(ops.steps());
    let blocks_total = cout.div_ceil(mr);
    let blocks_per_chunk = (U_BUDGET / 4 / (p_ * k * mr)).clamp(1, blocks_total);
    let chunk_rows = blocks_per_chunk * mr;
    let mut u = Buffer::zeros(p_ * blocks_per_chunk * k * mr);
    // V: [dt][p][ci][ld]; M: [p][co][ld] for one chunk of output channels.
    // The 36 planes of V and M sit `SKEW` apart from the power-of-two multiples their sizes
    // often are, so that the transforms' 36 streams do not all fall into one cache set.
    let p_stride_v = cin * plan.ld + SKEW; // between the p planes of one dt's V
    // M is [co][p][ld]: the output transform reads one channel's 36 rows as one block.
    let co_stride = p_ * plan.ld + SKEW;
    let v_len = kt * p_ * p_stride_v;
    let m_len = chunk_rows * co_stride;
    // bf16: V's rows of channel pairs (`[dt][p][ci / 2][ld]`) and U's (`[p][block][dt][ci / 2][mr]`).
    let bf16 = ops == Operands::Bf16;
    let p_stride_e = if bf16 { cin_e * plan.ld + SKEW } else { p_stride_v };
    let pairs_len = if bf16 { kt * p_ * p_stride_e } else { 0 };
    let mut u_pairs = Buffer::zeros(if bf16 { p_ * blocks_per_chunk * kt * cin_e * mr } else { 0 });
    // Input rows need zeros around the image and the output transform overwrites its rows
    // whole, so the two phases keep separate row buffers.
    let in_rows = ScratchPool::new(a_ * plan.rw, cin);
    let out_rows = ScratchPool::new(m_ * plan.rw, cout);
    let dst = OutPtr::new(out);

    for co0 in (0..cout).step_by(chunk_rows) {
        let blocks = (cout - co0).div_ceil(mr).min(blocks_per_chunk);
        let u = &mut u.as_mut_slice()[..p_ * blocks * k * mr];
        transform_weights::<T>(isa, job, co0, blocks, mr, u);
        let u: &[f32] = if bf16 {
            let pairs = &mut u_pairs.as_mut_slice()[..p_ * blocks * kt * cin_e * mr];
            pair_weights(u, pairs, cin, kt, mr);
            pairs
        } else {
            u
        };
        // Bands of every output frame, one after the other, each phase of a band parallel. (Whole
        // bands per thread synchronise less but need a V and M per thread, and the shard ranks'
        // memory then no longer falls as 1/N.)
        let bands: Vec<(usize, usize, usize, usize)> = (0..f.n)
            .flat_map(|b| (0..to).map(move |o| (b, o)))
            .flat_map(|(b, o)| (0..tiles).step_by(band).map(move |t0| (b, o, t0, (t0 + band).min(tiles))))
            .collect();
        let band_scratch = ScratchPool::new(v_len + m_len + pairs_len + 48, 1);
        let run_band = |&(b, o, t0, t1): &(usize, usize, usize, usize)| {
            band_scratch.with(|buf| {
                let buf = &mut aligned(buf)[..v_len + m_len + pairs_len + 32];
                let (v, rest) = buf.split_at_mut(v_len + 16);
                let (mbuf, v_pairs) = rest.split_at_mut(m_len + 16);
                let dts: Vec<(usize, usize)> =
                    (0..kt).filter_map(|dt| job.input_frame(o, dt).map(|ti| (dt, ti))).collect();
                // 1. V for every temporal tap that reads a real frame, one task per
                //    (tap, input channel).
                let vs = &mut v[..v_len];
                let vptr = OutPtr::new(vs);
                dts.par_iter().flat_map_iter(|&(dt, ti)| (0..cin).map(move |ci| (dt, ti, ci))).for_each(
                    |(dt, ti, ci)| {
                        in_rows.with(|rows| {
                            let at = dt * p_ * p_stride_v + ci * plan.ld;
                            // SAFETY: task (dt, ci) writes rows `dt, p, ci` (36 rows of
                            // `ld`, `p_stride_v` apart from `at`), inside `vs`, which no
                            // other task of this phase touches.
                            let base = unsafe { vptr.slice(at, p_ * p_stride_v - ci * plan.ld) }.as_mut_ptr();
                            // SAFETY: as above.
                            unsafe {
                                let task = InputTask { b, ti, ci, tiles: (t0, t1) };
                                run_input::<T>(isa, job, &plan, task, rows.as_mut_slice(), base, p_stride_v)
                            };
                        })
                    },
                );
                let panels = (t1 - t0).div_ceil(NR);
                let vs = &v[..v_len];
                // bf16: the band's V in channel pairs.
                let vs: &[f32] = if bf16 {
                    let pairs = &mut v_pairs[..pairs_len];
                    pair_rows(vs, pairs, [p_stride_v, p_stride_e], cin, panels * NR, plan.ld, &dts, p_);
                    pairs
                } else {
                    vs
                };
                // 2. M_p[co][t] = Σ_(dt, ci) U_p[co][dt, ci] · V[dt][p][ci][t], one task per
                //    (p, block of output channels).
                let ms = &mut mbuf[..m_len];
                let mptr = OutPtr::new(ms);
                (0..p_ * blocks).into_par_iter().for_each(|task| {
                    let (p, cb) = (task / blocks, task % blocks);
                    let a_p = &u[(p * blocks + cb) * kt * cin_e * mr..][..kt * cin_e * mr];
                    // SAFETY: task (p, cb) alone writes rows (co, p) of its `mr` channels:
                    // `NR`-wide panels at `co·co_stride + p·ld`, inside `ms`.
                    let c0 = unsafe { mptr.slice(cb * mr * co_stride + p * plan.ld, (mr - 1) * co_stride + plan.ld) }
                        .as_mut_ptr();
                    for panel in 0..panels {
                        // SAFETY: as above; panel columns lie within the row's `ld`.
                        let c = unsafe { c0.add(panel * NR) };
                        if dts.is_empty() {
                            // SAFETY: as above.
                            unsafe { microkernel::block_raw(isa, 0, &[], &[], plan.ld, c, co_stride, false) };
                        }
                        for (seg, &(dt, _)) in dts.iter().enumerate() {
                            let a = &a_p[dt * cin_e * mr..][..cin_e * mr];
                            let bpan = &vs[dt * p_ * p_stride_e + p * p_stride_e + panel * NR..];
                            // SAFETY: as above.
                            unsafe { ops.block(cin_e, a, bpan, plan.ld, c, co_stride, seg > 0) };
                        }
                    }
                });
                // 3. The output transform, one task per output channel.
                let ms = &*ms;
                (0..(cout - co0).min(chunk_rows)).into_par_iter().for_each(|cl| {
                    out_rows.with(|rows| {
                        let m = &ms[cl * co_stride..][..p_ * plan.ld];
                        let task = OutputTask { frame: (b, o), co: co0 + cl, tiles: (t0, t1) };
                        run_output::<T>(isa, job, &plan, task, m, plan.ld, rows.as_mut_slice(), dst);
                    })
                });
            })
        };
        bands.iter().for_each(run_band);
    }
}

/// U's runs of `kt · cin` elements (`[p][block][dt·cin + ci][mr]`) as bf16 pairs of input
/// channels (`[p][block][dt][ci / 2][mr]`, a zero channel after an odd last one).
fn pair_weights(u: &[f32], pairs: &mut [f32], cin: usize, kt: usize, mr: usize) {
    let cin_p = cin.div_ceil(2);
    let runs = u.chunks_exact(kt * cin * mr).zip(pairs.chunks_exact_mut(kt * cin_p * mr));
    runs.collect::<Vec<_>>().into_par_iter().for_each(|(src, dst)| {
        let dst: &mut [u32] = bytemuck::cast_slice_mut(dst);
        for dt in 0..kt {
            for q in 0..cin_p {
                for r in 0..mr {
                    let at = |ci: usize| if ci < cin { src[(dt * cin + ci) * mr + r] } else { 0.0 };
                    dst[(dt * cin_p + q) * mr + r] = crate::ops::bf16::pair(at(2 * q), at(2 * q + 1));
                }
            }
        }
    });
}

/// The band's V rows (`[dt][p][ci][..]`, planes `strides[0]` apart) as bf16 pairs of input
/// channels (`[dt][p][ci / 2][..]`, planes `strides[1]` apart), the first `cols` columns, for
/// the temporal taps that read real frames.
#[allow(clippy::too_many_arguments)]
fn pair_rows(
    v: &[f32],
    pairs: &mut [f32],
    strides: [usize; 2],
    cin: usize,
    cols: usize,
    ld: usize,
    dts: &[(usize, usize)],
    planes: usize,
) {
    let cin_p = cin.div_ceil(2);
    let zeros = vec![0.0f32; cols];
    let dst = OutPtr::new(pairs);
    let tasks: Vec<(usize, usize)> = dts.iter().flat_map(|&(dt, _)| (0..planes).map(move |p| (dt, p))).collect();
    tasks.into_par_iter().for_each(|(dt, p)| {
        let src = &v[(dt * planes + p) * strides[0]..];
        for q in 0..cin_p {
            let lo = &src[2 * q * ld..][..cols];
            let hi = if 2 * q + 1 < cin { &src[(2 * q + 1) * ld..][..cols] } else { &zeros[..] };
            // SAFETY: task (dt, p) alone writes plane (dt, p) of the pairs.
            let out = unsafe { dst.slice((dt * planes + p) * strides[1] + q * ld, cols) };
            crate::ops::bf16::pack_pairs(lo, hi, bytemuck::cast_slice_mut(out));
        }
    });
}

/// [`input_transform`] with `isa`'s instructions.
///
/// # Safety
/// As [`input_transform`].
unsafe fn run_input<T: Tile>(
    isa: Isa,
    job: &ConvJob<'_>,
    plan: &Plan,
    task: InputTask,
    rows: &mut [f32],
    v: *mut f32,
    p_stride: usize,
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa` is supported by this CPU (`simd::isa` checked it), and `v` meets
        // `input_transform`'s contract (the caller's).
        Isa::Avx512 => unsafe { input_avx512::<T>(job, plan, task, rows, v, p_stride) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { input_avx2::<T>(job, plan, task, rows, v, p_stride) },
        // SAFETY: portable code; `v` meets `input_transform`'s contract (the caller's).
        _ => unsafe { input_transform::<T, Portable>(job, plan, task, rows, v, p_stride) },
    }
}

/// [`output_transform`] with `isa`'s instructions.
#[allow(clippy::too_many_arguments)]
fn run_output<T: Tile>(
    isa: Isa,
    job: &ConvJob<'_>,
    plan: &Plan,
    task: OutputTask,
    m: &[f32],
    m_stride: usize,
    rows: &mut [f32],
    out: OutPtr,
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa` was checked to be supported by this CPU (`simd::isa`).
        Isa::Avx512 => unsafe { output_avx512::<T>(job, plan, task, m, m_stride, rows, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { output_avx2::<T>(job, plan, task, m, m_stride, rows, out) },
        _ => output_transform::<T, Portable>(job, plan, task, m, m_stride, rows, out),
    }
}

#[cfg(test)]
mod tests;
