//! What one CPU convolution call holds while it runs besides its input and its output: the
//! weights as its kernel lays them out, and the kernel's working buffers.
//!
//! A shard's maps shrink with the rank count but a convolution's weights and working buffers do
//! not, so on a part these are often what its peak is made of. Winograd's are large: F(4×4)
//! transforms each 3×3 kernel into 36 values (a 3×3×3 kernel into 108), held for up to
//! [`WINOGRAD_WEIGHT_BUDGET`] bytes of output channels at a time, and one band of tiles keeps
//! its transformed input `V` (every temporal tap, every input channel) and its products `M`.
//! The figures follow vae-tensor's f32 kernels with the AVX-512 blocking (a row block of 8
//! output channels, panels of 48 tiles); `vae-parallel`'s tests measure them against the
//! kernels' own memory accounting, so a change to the kernels' buffers fails there.

use super::network::align_class;

/// Bytes of transformed Winograd weights a call holds at once.
pub const WINOGRAD_WEIGHT_BUDGET: usize = 64 << 20;
/// Output channels per micro-kernel row block (f32, AVX-512).
const MR: usize = 8;
/// Tiles (output columns of the GEMMs) per micro-kernel panel.
const NR: usize = 48;
/// Slack the kernels add to a row of tiles for the widest vector, in elements.
const LANES: usize = 16;
/// Elements between two planes of `V` or `M`.
const SKEW: usize = 16;
/// Output columns per block of the direct kernel, and the reduction rows it packs at once.
const DIRECT_BLOCK_COLS: usize = 4 * NR;
const DIRECT_K_CHUNK: usize = 256;

/// A row stride of at least `len` elements that is an odd number of 16-element cache lines.
fn row_stride(len: usize) -> usize {
    16 * (len.div_ceil(16) | 1)
}

/// Bytes one f32 CPU convolution call holds besides its input and output: a `kernel`
/// (`[frames, rows, columns]`) from `cin` to `cout` channels, of band alignment `align` (which
/// picks direct, F(2×2) or F(4×4) for a 3×3 kernel: [`StepKind::Conv`](super::StepKind::Conv)),
/// computing `rows × cols` output positions per frame. `threads`: the rank's pool, each of
/// whose threads keeps a direct call's row buffers.
pub fn cpu_conv_scratch_bytes(
    kernel: [usize; 3],
    align: usize,
    [cin, cout]: [usize; 2],
    [rows, cols]: [usize; 2],
    threads: usize,
) -> u64 {
    let [kt, kh, kw] = kernel;
    let cout_pad = cout.div_ceil(MR) * MR;
    let winograd = kh == 3 && kw == 3 && align_class(align) >= 2;
    let elems = if !winograd {
        // The packed weights, and per thread a block's packed rows, its outputs and two input
        // rows.
        let packed = cout_pad * kt * kh * kw * cin;
        let per_thread = (DIRECT_K_CHUNK + cout_pad + 2) * DIRECT_BLOCK_COLS + 32;
        packed + 16 + per_thread * threads.max(1)
    } else {
        let m = align_class(align);
        let p = (m + 2) * (m + 2);
        let k = kt * cin;
        // The transformed weights of as many row blocks of output channels as the budget holds.
        let blocks = (WINOGRAD_WEIGHT_BUDGET / 4 / (p * k * MR)).clamp(1, cout_pad / MR);
        let u = p * blocks * k * MR;
        // One band of tiles: `V` for every tap and input channel, `M` for the block of outputs.
        let tiles = rows.div_ceil(m) * cols.div_ceil(m);
        let band = (4 * NR).min(tiles.div_ceil(NR) * NR);
        let ld = row_stride(band + LANES);
        let v = kt * p * (cin * ld + SKEW);
        let mm = blocks * MR * (p * ld + SKEW);
        u + v + mm + 64
    };
    elems as u64 * 4
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn winograd_holds_its_transformed_weights_and_one_band() {
        // F(4×4), 128 → 128, a 128² map: 36·128·128 transformed values, and a band of 192
        // tiles (rows of 208) for V (128 channels) and M (128 outputs).
        let ld = 208;
        let expect = 36 * 128 * 128 + 36 * (128 * ld + 16) + 128 * (36 * ld + 16) + 64;
        assert_eq!(cpu_conv_scratch_bytes([1, 3, 3], 4, [128, 128], [128, 128], 2), 4 * expect as u64);
        // A 3×3×3 kernel keeps every temporal tap: three times the weights and V.
        let three = cpu_conv_scratch_bytes([3, 3, 3], 4, [128, 128], [128, 128], 2);
        assert_eq!(three, 4 * (3 * 36 * 128 * 128 + 3 * 36 * (128 * ld + 16) + 128 * (36 * ld + 16) + 64) as u64);
        // F(2×2): 16 values a kernel.
        assert!(cpu_conv_scratch_bytes([1, 3, 3], 2, [128, 128], [128, 128], 2) < three / 4);
    }

    #[test]
    fn winograd_weights_are_held_a_budget_at_a_time_and_small_maps_take_short_bands() {
        // 512 → 512 × 3×3×3 transformed is 108 MiB: 64 MiB of output channels at a time.
        let big = cpu_conv_scratch_bytes([3, 3, 3], 4, [512, 512], [64, 64], 1);
        let per_block = 36 * 3 * 512 * MR * 4;
        let blocks = WINOGRAD_WEIGHT_BUDGET / per_block;
        assert!(big as usize >= blocks * per_block && (big as usize) < WINOGRAD_WEIGHT_BUDGET + (80 << 20));
        // A 12 × 20 map is 15 tiles: one panel, rows of 80 instead of 208.
        let small = cpu_conv_scratch_bytes([1, 3, 3], 4, [64, 64], [12, 20], 1);
        let expect = 36 * 64 * 64 + 36 * (64 * 80 + 16) + 64 * (36 * 80 + 16) + 64;
        assert_eq!(small, 4 * expect as u64);
    }

    #[test]
    fn direct_calls_hold_their_packed_weights_and_row_buffers_per_thread() {
        let one = cpu_conv_scratch_bytes([1, 3, 3], 1, [16, 3], [64, 64], 1);
        let two = cpu_conv_scratch_bytes([1, 3, 3], 1, [16, 3], [64, 64], 2);
        // Three outputs pad to a row block of 8.
        assert_eq!(one, 4 * (8 * 9 * 16 + 16 + (256 + 8 + 2) * 192 + 32) as u64);
        assert_eq!(two - one, 4 * ((256 + 8 + 2) * 192 + 32) as u64);
    }
}
