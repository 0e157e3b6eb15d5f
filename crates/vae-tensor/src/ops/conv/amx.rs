//! Intel AMX tile products for the bf16 convolutions: `C (+)= A · B` with `A` and `B` in bf16
//! pairs and `C` in f32, on the CPU's tile registers (`tdpbf16ps`: a 16 × 16 block of `C`
//! times 32 reduction steps per instruction, eight times the rate of AVX512-BF16's
//! `vdpbf16ps`). This is what oneDNN, and so PyTorch, runs bf16 convolutions with on Xeons
//! since Sapphire Rapids.
//!
//! The instructions are issued with `asm!` (the AMX intrinsics are not stable Rust); the tile
//! registers are touched by nothing else in the process, so the tiles' configuration and
//! contents carry from one `asm!` block to the next within a call. Linux hands the tile state
//! out only on request (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`), made once per
//! process by [`supported`].
//!
//! Arithmetic: each `tdpbf16ps` adds 32 exact bf16 products to each `C` element with f32
//! rounding, but its internal summation order is the hardware's own, not `vdpbf16ps`'s pair by
//! pair (measured: they differ in the last bit on about one element in ten). The result of an
//! element depends only on its row of `A`, its column of `B`, and the reduction split into
//! instructions of 16 pairs, which this module fixes: so a convolution gives the same bits
//! whatever the tile position of a pixel, the block it falls in or the thread count, on every
//! machine with AMX. Machines without AMX compute bf16 convolutions with `vdpbf16ps`, whose
//! bits differ in that last place; `VAE_CPU_AMX=0` makes an AMX machine use `vdpbf16ps` too.

use std::arch::asm;
use std::sync::OnceLock;

/// Rows of a tile: output channels of an `A` tile and of a `C` tile, pairs of reduction steps
/// of a `B` tile.
pub(crate) const ROWS: usize = 16;
/// `u32` elements of a tile row: 16 bf16 pairs of `A` and `B`, 16 f32 of `C`.
pub(crate) const COLS: usize = 16;
/// `u32` elements of one packed `A` tile.
pub(crate) const A_TILE: usize = ROWS * COLS;

/// Bytes of a tile row.
const ROW_BYTES: usize = COLS * 4;

/// Whether AMX is used, once decided ([`supported`]).
static SUPPORTED: OnceLock<bool> = OnceLock::new();
/// Whether [`crate::process::configure`] allowed AMX, over `VAE_CPU_AMX`.
static REQUESTED: OnceLock<bool> = OnceLock::new();

/// Allows or forbids AMX as `VAE_CPU_AMX` does, before the first bf16 convolution decides;
/// `false` once it was decided (or set) already.
pub(crate) fn request(on: bool) -> bool {
    SUPPORTED.get().is_none() && REQUESTED.set(on).is_ok()
}

/// Whether the bf16 convolutions run on AMX here: the CPU has AMX-TILE and AMX-BF16 (and the
/// AVX512-BF16 the operands are packed with), Linux granted the tile state, and
/// `VAE_CPU_AMX` does not turn it off (`0`, `off`, `false`, `no`). Decided once per process.
pub(crate) fn supported() -> bool {
    *SUPPORTED.get_or_init(|| {
        if !crate::ops::simd::bf16_supported() || !cpu_has_amx_bf16() {
            return false;
        }
        if REQUESTED.get() == Some(&false) {
            return false;
        }
        if let Some(v) = std::env::var("VAE_CPU_AMX").ok().filter(|_| REQUESTED.get().is_none()) {
            match v.trim().to_ascii_lowercase().as_str() {
                "0" | "off" | "false" | "no" => return false,
                "1" | "on" | "true" | "yes" | "" => {}
                _ => tracing::warn!("VAE_CPU_AMX={v} is not 0/off or 1/on; AMX stays on"),
            }
        }
        let granted = request_tile_state();
        if !granted {
            tracing::warn!("the CPU has AMX but the kernel refused its tile state; bf16 convolutions use AVX512-BF16");
        }
        granted
    })
}

/// CPUID leaf 7: EDX bit 22 (AMX-BF16) and bit 24 (AMX-TILE).
fn cpu_has_amx_bf16() -> bool {
    // SAFETY: CPUID exists on every x86-64 CPU; leaf 7 exists where AVX-512 was detected.
    // (Safe to call since Rust 1.94; the block keeps older compilers of the MSRV building.)
    #[allow(unused_unsafe)]
    let leaf = unsafe { std::arch::x86_64::__cpuid_count(7, 0) };
    leaf.edx & (1 << 22) != 0 && leaf.edx & (1 << 24) != 0
}

/// Asks Linux for the AMX tile data state for this process.
#[cfg(target_os = "linux")]
fn request_tile_state() -> bool {
    const ARCH_REQ_XCOMP_PERM: usize = 0x1023;
    const XFEATURE_XTILEDATA: usize = 18;
    const SYS_ARCH_PRCTL: usize = 158;
    let ret: isize;
    // SAFETY: arch_prctl(ARCH_REQ_XCOMP_PERM) only changes which register state the kernel
    // saves for this process; it reads no memory. `syscall` clobbers rcx and r11.
    unsafe {
        asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL as isize => ret,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    ret == 0
}

/// Other systems: not attempted (their ways of granting the tile state are not wired up).
#[cfg(not(target_os = "linux"))]
fn request_tile_state() -> bool {
    false
}

/// The tile configuration (`ldtilecfg`'s 64-byte operand, palette 1): tiles 0..4 hold `C`,
/// 4 and 5 `A`, 6 and 7 `B`, each 16 rows of 64 bytes.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

static CONFIG: TileConfig = {
    let mut colsb = [0u16; 16];
    let mut rows = [0u8; 16];
    let mut t = 0;
    while t < 8 {
        colsb[t] = ROW_BYTES as u16;
        rows[t] = ROWS as u8;
        t += 1;
    }
    TileConfig { palette: 1, start_row: 0, reserved: [0; 14], colsb, rows }
};

/// The tile registers of the calling thread, configured for this module's kernels from
/// [`Session::start`] until the session drops (`tilerelease`). One session per thread at a
/// time: a nested one would release the outer one's tiles when it ends.
pub(crate) struct Session {
    /// The tiles belong to the thread that configured them.
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Session {
    /// Loads the tile configuration.
    ///
    /// # Safety
    /// [`supported`] must have returned true, and no other session may be open on this thread.
    pub(crate) unsafe fn start() -> Self {
        // SAFETY: AMX is usable (the caller's contract); `CONFIG` is a valid palette-1 operand.
        unsafe { asm!("ldtilecfg [{0}]", in(reg) &CONFIG, options(nostack, readonly, preserves_flags)) };
        Self { _not_send: std::marker::PhantomData }
    }

    /// `C[m][n] (+)= Σ_q A[m][q] · B[q][n]` for `m < 16·mb`, `n < 16·nb`, `q < 16·kb`, each `A`
    /// and `B` element a bf16 pair (step `2q` low, `2q + 1` high).
    ///
    /// - `a`: packed tiles, `A[16i + r][16j + c]` at `a[i·a_stride + j·A_TILE + r·16 + c]`.
    /// - `b`: `B[q][n]` at `b[q·ldb + n]`.
    /// - `c`: `C[m][n]` at `c[m·ldc + n]`; read first when `accumulate`, else overwritten.
    ///
    /// # Safety
    /// Every element named above must be valid (`c` for reads and writes, by this thread alone).
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn gemm(
        &self,
        (mb, nb, kb): (usize, usize, usize),
        a: *const u32,
        a_stride: usize,
        b: *const u32,
        ldb: usize,
        c: *mut f32,
        ldc: usize,
        accumulate: bool,
    ) {
        for n0 in (0..nb).step_by(2) {
            for m0 in (0..mb).step_by(2) {
                let shape = (m0 + 1 < mb, n0 + 1 < nb);
                // SAFETY: the caller's contract covers the tiles of C at (m0, n0) and
                // the A and B tiles of every step.
                unsafe {
                    let c0 = c.add(16 * m0 * ldc + 16 * n0);
                    Block::start(shape, c0, ldc, accumulate);
                    let (a0, b0) = (a.add(m0 * a_stride), b.add(16 * n0));
                    for k in 0..kb {
                        let b = b0.add(16 * k * ldb);
                        let a = a0.add(k * A_TILE);
                        step(shape, [a, a.add(a_stride)], [b, b.add(16)], ldb);
                    }
                    Block::store(shape, c0, ldc);
                }
            }
        }
    }

    /// One block of up to 32 × 32 outputs of a convolution, `C[m][n] = Σ_(g, j, t, q)
    /// A[m][g, j, t, q] · B_(g, t)[16j + q][n]` over groups `g` (the temporal taps), blocks
    /// `j < kb` of 16 channel pairs, spatial taps `t < taps` and pairs `q < 16`, in that
    /// order, for `m < 16·(1 + two_m)`, `n < 16·(1 + two_n)`. Taking every spatial tap of one
    /// block of channels before the next keeps the input rows those taps read close together.
    ///
    /// Operands come in pairs of contiguous 16 × 16 tiles (1 KiB each, rows 64 bytes apart),
    /// the first for rows (columns) 0..16, the second for 16..32:
    /// - `a`: the pair of step `(g, j, t)` at `a + 2·((g·kb + j)·taps + t)·A_TILE`;
    /// - `b[g·taps + t] = p`: the pair of channel block `j` at `p + 2·j·A_TILE`.
    ///
    /// `C` starts as `init` (`C[m][n]` at `init.0[m·init.1 + n]`: the bias) and ends in `c`
    /// (`C[m][n]` at `c.0[m·c.1 + n]`).
    ///
    /// # Safety
    /// Every tile named above must be readable (the second of a pair only where `two_m`,
    /// `two_n`), and `c`'s elements writable by this thread alone.
    pub(crate) unsafe fn conv_block(
        &self,
        (two_m, two_n): (bool, bool),
        a: *const u32,
        b: &[*const u32],
        (kb, taps): (usize, usize),
        init: (*const f32, usize),
        c: (*mut f32, usize),
    ) {
        let shape = (two_m, two_n);
        // SAFETY: the caller's contract covers every tile named.
        unsafe {
            Block::start(shape, init.0, init.1, true);
            let mut a = a;
            for group in b.chunks_exact(taps) {
                for j in 0..kb {
                    for &bt in group {
                        let b0 = bt.add(2 * j * A_TILE);
                        step(shape, [a, a.add(A_TILE)], [b0, b0.add(A_TILE)], COLS);
                        a = a.add(2 * A_TILE);
                    }
                }
            }
            Block::store(shape, c.0, c.1);
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // SAFETY: the tiles were configured by `start` on this thread; releasing them only
        // returns the registers to their initial state.
        unsafe { asm!("tilerelease", options(nostack, nomem, preserves_flags)) };
    }
}

/// The accumulator tiles of one block of `C`: tile 0 at rows 0..16, columns 0..16; tile 1
/// columns 16..32; tiles 2 and 3 the same 16 rows further. `shape` = (rows 16..32 present,
/// columns 16..32 present).
struct Block;

impl Block {
    /// Loads the block's tiles of `C` from `c` (rows `ldc` apart), or zeroes them.
    ///
    /// # Safety
    /// A session is open; with `accumulate`, the block's elements are readable.
    #[inline(always)]
    unsafe fn start((two_m, two_n): (bool, bool), c: *const f32, ldc: usize, accumulate: bool) {
        let s = ldc * 4;
        // SAFETY: the caller's contract.
        unsafe {
            if !accumulate {
                asm!(
                    "tilezero tmm0",
                    "tilezero tmm1",
                    "tilezero tmm2",
                    "tilezero tmm3",
                    options(nostack, nomem, preserves_flags)
                );
                return;
            }
            asm!("tileloadd tmm0, [{p} + {s}*1]", p = in(reg) c, s = in(reg) s, options(nostack, readonly, preserves_flags));
            if two_n {
                asm!("tileloadd tmm1, [{p} + {s}*1]", p = in(reg) c.add(16), s = in(reg) s, options(nostack, readonly, preserves_flags));
            }
            if two_m {
                let c = c.add(16 * ldc);
                asm!("tileloadd tmm2, [{p} + {s}*1]", p = in(reg) c, s = in(reg) s, options(nostack, readonly, preserves_flags));
                if two_n {
                    asm!("tileloadd tmm3, [{p} + {s}*1]", p = in(reg) c.add(16), s = in(reg) s, options(nostack, readonly, preserves_flags));
                }
            }
        }
    }

    /// Stores the block's tiles to `c`.
    ///
    /// # Safety
    /// A session is open; the block's elements are writable by this thread alone.
    #[inline(always)]
    unsafe fn store((two_m, two_n): (bool, bool), c: *mut f32, ldc: usize) {
        let s = ldc * 4;
        // SAFETY: the caller's contract.
        unsafe {
            asm!("tilestored [{p} + {s}*1], tmm0", p = in(reg) c, s = in(reg) s, options(nostack, preserves_flags));
            if two_n {
                asm!("tilestored [{p} + {s}*1], tmm1", p = in(reg) c.add(16), s = in(reg) s, options(nostack, preserves_flags));
            }
            if two_m {
                let c = c.add(16 * ldc);
                asm!("tilestored [{p} + {s}*1], tmm2", p = in(reg) c, s = in(reg) s, options(nostack, preserves_flags));
                if two_n {
                    asm!("tilestored [{p} + {s}*1], tmm3", p = in(reg) c.add(16), s = in(reg) s, options(nostack, preserves_flags));
                }
            }
        }
    }
}

/// One reduction step of 16 pairs on a block: `A` tiles at `a` (64-byte rows), `B` tiles at
/// `b` (rows `ldb` elements apart); the second of each only where `shape` has it.
///
/// # Safety
/// A session is open; the tiles named are readable.
#[inline(always)]
unsafe fn step((two_m, two_n): (bool, bool), a: [*const u32; 2], b: [*const u32; 2], ldb: usize) {
    let (sa, sb) = (ROW_BYTES, ldb * 4);
    // SAFETY: the caller's contract.
    unsafe {
        asm!(
            "tileloadd tmm4, [{a} + {sa}*1]",
            "tileloadd tmm6, [{b} + {sb}*1]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            a = in(reg) a[0], b = in(reg) b[0], sa = in(reg) sa, sb = in(reg) sb,
            options(nostack, readonly, preserves_flags),
        );
        if two_n {
            asm!(
                "tileloadd tmm7, [{b} + {sb}*1]",
                "tdpbf16ps tmm1, tmm4, tmm7",
                b = in(reg) b[1], sb = in(reg) sb,
                options(nostack, readonly, preserves_flags),
            );
        }
        if two_m {
            asm!(
                "tileloadd tmm5, [{a} + {sa}*1]",
                "tdpbf16ps tmm2, tmm5, tmm6",
                a = in(reg) a[1], sa = in(reg) sa,
                options(nostack, readonly, preserves_flags),
            );
            if two_n {
                asm!("tdpbf16ps tmm3, tmm5, tmm7", options(nostack, nomem, preserves_flags));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::bf16::{pair, value};

    fn values(n: usize, seed: u32) -> Vec<f32> {
        crate::ops::test_values(n, seed)
    }

    /// `A` (`rows × 2kq` f32) rounded to bf16 pairs and packed as [`Session::gemm`] reads it.
    fn pack_a(av: &[f32], rows: usize, kq: usize) -> (Vec<u32>, usize) {
        let (mb, kb) = (rows.div_ceil(16), kq.div_ceil(16));
        let stride = kb * A_TILE;
        let mut a = vec![0u32; mb * stride];
        for m in 0..rows {
            for q in 0..kq {
                let at = (m / 16) * stride + (q / 16) * A_TILE + (m % 16) * 16 + q % 16;
                a[at] = pair(av[m * 2 * kq + 2 * q], av[m * 2 * kq + 2 * q + 1]);
            }
        }
        (a, stride)
    }

    /// One element the way [`Session::gemm`] computes it, but on a single row and column: the bits must
    /// not depend on where in the tiles the element sits.
    fn alone(arow: &[u32], bcol: &[u32], init: f32, accumulate: bool) -> f32 {
        let kq = arow.len();
        let kb = kq / 16;
        let mut a = vec![0u32; kb * A_TILE];
        let mut b = vec![0u32; kq * 16];
        for q in 0..kq {
            a[(q / 16) * A_TILE + q % 16] = arow[q];
            b[q * 16] = bcol[q];
        }
        let mut c = vec![0.0f32; 16 * 16];
        c[0] = init;
        // SAFETY: `supported()` was checked by the caller; the buffers cover one tile each.
        unsafe {
            Session::start().gemm((1, 1, kb), a.as_ptr(), kb * A_TILE, b.as_ptr(), 16, c.as_mut_ptr(), 16, accumulate)
        };
        c[0]
    }

    #[test]
    fn tile_products_match_an_exact_sum_closely_and_do_not_depend_on_the_tile_position() {
        if !supported() {
            return; // no AMX here: the bf16 convolutions use AVX512-BF16 (tested elsewhere)
        }
        let (rows, cols, kq) = (48, 40, 48); // 3 × 3 tiles of C (the last half used), 3 steps of k
        let (mb, nb, kb) = (3, 3, 3);
        let av = values(rows * 2 * kq, 11);
        let bv = values(kq * 2 * cols, 12);
        let (a, a_stride) = pack_a(&av, rows, kq);
        let ldb = 56;
        let mut b = vec![0u32; kq * ldb];
        for q in 0..kq {
            for n in 0..cols {
                b[q * ldb + n] = pair(bv[(2 * q) * cols + n], bv[(2 * q + 1) * cols + n]);
            }
        }
        let ldc = 50;
        let init = values(rows * ldc, 13);
        for accumulate in [false, true] {
            let mut c = init.clone();
            // SAFETY: AMX is supported; `c` has 48 rows of `ldc ≥ 48`, `b` 48 rows of `ldb ≥ 48`.
            unsafe {
                Session::start().gemm(
                    (mb, nb, kb),
                    a.as_ptr(),
                    a_stride,
                    b.as_ptr(),
                    ldb,
                    c.as_mut_ptr(),
                    ldc,
                    accumulate,
                )
            };
            for m in 0..rows {
                for n in 0..cols {
                    let arow: Vec<u32> =
                        (0..kq).map(|q| a[(m / 16) * a_stride + (q / 16) * A_TILE + (m % 16) * 16 + q % 16]).collect();
                    let bcol: Vec<u32> = (0..kq).map(|q| b[q * ldb + n]).collect();
                    let start = if accumulate { init[m * ldc + n] } else { 0.0 };
                    let got = c[m * ldc + n];
                    assert_eq!(got.to_bits(), alone(&arow, &bcol, start, accumulate).to_bits(), "m={m} n={n}");
                    let products: Vec<f64> = (0..kq)
                        .flat_map(|q| {
                            let (pa, pb) = (arow[q], bcol[q]);
                            let half = |x: u32, hi: bool| value(if hi { (x >> 16) as u16 } else { x as u16 }) as f64;
                            [half(pa, false) * half(pb, false), half(pa, true) * half(pb, true)]
                        })
                        .collect();
                    let exact = start as f64 + products.iter().sum::<f64>();
                    // Each of the 2·kq f32 sums errs by at most half an ulp of a partial sum.
                    let bound = 2.0
                        * kq as f64
                        * f64::from(f32::EPSILON)
                        * (start.abs() as f64 + products.iter().map(|p| p.abs()).sum::<f64>());
                    assert!((got as f64 - exact).abs() <= bound, "m={m} n={n}: {got} vs {exact}");
                }
            }
            // Columns and rows outside the blocks are untouched.
            for m in 0..rows {
                assert_eq!(&c[m * ldc + 48..(m + 1) * ldc], &init[m * ldc + 48..(m + 1) * ldc]);
            }
        }
    }

    #[test]
    fn splitting_the_reduction_at_tile_steps_changes_nothing() {
        if !supported() {
            return;
        }
        let kq = 64;
        let av = values(16 * 2 * kq, 21);
        let bv = values(kq * 2 * 16, 22);
        let (a, stride) = pack_a(&av, 16, kq);
        let b: Vec<u32> = (0..kq * 16).map(|i| pair(bv[2 * i], bv[2 * i + 1])).collect();
        let mut whole = vec![0.0f32; 256];
        let mut split = vec![0.0f32; 256];
        // SAFETY: AMX is supported; one tile of C, 4 (then 1 and 3) steps of k.
        unsafe {
            let tiles = Session::start();
            tiles.gemm((1, 1, 4), a.as_ptr(), stride, b.as_ptr(), 16, whole.as_mut_ptr(), 16, false);
            tiles.gemm((1, 1, 1), a.as_ptr(), stride, b.as_ptr(), 16, split.as_mut_ptr(), 16, false);
            tiles.gemm(
                (1, 1, 3),
                a.as_ptr().add(A_TILE),
                stride,
                b.as_ptr().add(256),
                16,
                split.as_mut_ptr(),
                16,
                true,
            );
        }
        assert!(whole.iter().zip(&split).all(|(x, y)| x.to_bits() == y.to_bits()));
    }
}
