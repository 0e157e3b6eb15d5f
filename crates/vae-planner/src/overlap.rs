//! Whether a shard convolution overlaps its halo exchange with its interior's compute: the rule
//! the runtime follows and the cost model predicts.
//!
//! Overlapping splits a part's output into pieces, the interior and then an edge strip per side
//! that has a neighbour, and each piece is one kernel call. The direct kernel packs its weights
//! once for all of them. Winograd transforms the weights again on every call: for a 384-channel
//! 3×3×3 kernel that takes about 50 ms on one core, as long as computing some 1,500 outputs,
//! and keeping the transformed weights across calls would take four times the weights' memory.
//! So a Winograd convolution (band alignment 2 or more) overlaps only where each extra piece
//! costs a few per cent of its part's compute: [`WINOGRAD_OUTPUTS_PER_EXTRA_PIECE`] outputs.
//! Either way the output is the same, bit for bit.

/// Outputs (positions × frames of the part) a Winograd convolution needs per extra piece before
/// it overlaps; an extra piece then costs about 5 % of the part's compute.
pub const WINOGRAD_OUTPUTS_PER_EXTRA_PIECE: usize = 32_768;

/// Whether a convolution of band alignment `align` whose part computes `outputs` outputs
/// (positions × frames) overlaps its exchange, computing `extra_pieces` edge strips besides the
/// interior.
pub fn overlap_pays(align: usize, outputs: usize, extra_pieces: usize) -> bool {
    align < 2 || outputs >= WINOGRAD_OUTPUTS_PER_EXTRA_PIECE.saturating_mul(extra_pieces)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn direct_convolutions_always_overlap_winograd_ones_only_on_large_parts() {
        assert!(overlap_pays(1, 1, 4));
        assert!(!overlap_pays(4, 20 * 6 * 4, 1), "Wan2.2's latent bands at 192x320");
        assert!(overlap_pays(4, 416 * 240 * 4, 2), "Wan2.1's last stage at 480x832");
        assert!(overlap_pays(2, 32_768, 1));
        assert!(!overlap_pays(2, 32_768, 2));
    }
}
