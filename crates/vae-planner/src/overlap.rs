//! Whether a shard convolution overlaps its halo exchange with its interior's compute: the rule
//! the runtime follows and the cost model predicts.
//!
//! Overlapping splits a part's output into pieces, the interior and then an edge strip per side
//! that has a neighbour, and each piece is one kernel call. The direct kernel packs its weights
//! once for all of them. Winograd transforms the weights again on every call: on one core of
//! an AVX-512 guest, about as long as computing 400–1,500 outputs (16 ms for a 384-channel
//! 3×3×3 kernel; `vae-parallel calibrate` prints each shape's fixed cost and rate), and keeping
//! the transformed weights across calls would take four times the weights' memory. So a
//! Winograd convolution (band alignment 2 or more) overlaps only where each extra piece costs a
//! few per cent of its part's compute: [`WINOGRAD_OUTPUTS_PER_EXTRA_PIECE`] outputs.
//! Either way the output is the same, bit for bit.

use std::ops::Range;

/// The interior of a part `len` rows long along a cut axis: the output rows that read no
/// neighbour's row through a kernel reaching `halo` rows out, cut on multiples of `align` from
/// the part's start. `neighbours`: whether the part has one before and after. All of it where
/// the halo is 0; None where nothing is left (a part too thin to overlap).
pub fn interior(len: usize, halo: usize, [before, after]: [bool; 2], align: usize) -> Option<Range<usize>> {
    if halo == 0 {
        return Some(0..len);
    }
    let align = align.max(1);
    let lo = if before { halo.next_multiple_of(align) } else { 0 };
    let hi = if after { len.checked_sub(halo)? / align * align } else { len };
    (lo < hi).then_some(lo..hi)
}

/// The pieces of an overlapped convolution's output, as `[rows, columns]` of a part of
/// `lens`: the interior first, which reads no neighbour's rows (`halos` along the cut axes, 0
/// along the others; at a global edge, `neighbours` false, it reaches the edge, whose halo is
/// zeros), then the edge strips around it (the rows above and below across the whole width, the
/// columns left and right beside the interior). Cuts fall on multiples of `align`. `None` where
/// the part is too small to leave an interior.
pub fn pieces(
    lens: [usize; 2],
    halos: [usize; 2],
    neighbours: [[bool; 2]; 2],
    align: usize,
) -> Option<Vec<[Range<usize>; 2]>> {
    let inner =
        [interior(lens[0], halos[0], neighbours[0], align)?, interior(lens[1], halos[1], neighbours[1], align)?];
    let [rows, cols] = inner.clone();
    let mut pieces = vec![inner];
    if rows.start > 0 {
        pieces.push([0..rows.start, 0..lens[1]]);
    }
    if rows.end < lens[0] {
        pieces.push([rows.end..lens[0], 0..lens[1]]);
    }
    if cols.start > 0 {
        pieces.push([rows.clone(), 0..cols.start]);
    }
    if cols.end < lens[1] {
        pieces.push([rows, cols.end..lens[1]]);
    }
    Some(pieces)
}

/// [`pieces`] where overlapping them pays ([`overlap_pays`]) for a part that computes `outputs`
/// outputs (positions × frames): the runtime's default rule, which the cost model predicts.
pub fn pieces_where_pays(
    lens: [usize; 2],
    halos: [usize; 2],
    neighbours: [[bool; 2]; 2],
    align: usize,
    outputs: usize,
) -> Option<Vec<[Range<usize>; 2]>> {
    pieces(lens, halos, neighbours, align).filter(|p| overlap_pays(align, outputs, p.len() - 1))
}

/// Outputs (positions × frames of the part) a Winograd convolution needs per extra piece before
/// it overlaps; an extra piece then costs at most about 5 % of the part's compute.
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
    fn the_interior_keeps_clear_of_the_neighbours_rows_on_the_alignment() {
        assert_eq!(interior(10, 1, [true, true], 1), Some(1..9));
        assert_eq!(interior(10, 1, [true, true], 4), Some(4..8));
        assert_eq!(interior(10, 1, [false, true], 4), Some(0..8));
        assert_eq!(interior(8, 1, [true, true], 4), None);
        assert_eq!(interior(2, 1, [true, true], 1), None);
        assert_eq!(interior(0, 1, [false, true], 1), None);
        assert_eq!(interior(7, 0, [true, true], 4), Some(0..7));
    }

    #[test]
    fn direct_convolutions_always_overlap_winograd_ones_only_on_large_parts() {
        assert!(overlap_pays(1, 1, 4));
        assert!(!overlap_pays(4, 20 * 6 * 4, 1), "Wan2.2's latent bands at 192x320");
        assert!(overlap_pays(4, 416 * 240 * 4, 2), "Wan2.1's last stage at 480x832");
        assert!(overlap_pays(2, 32_768, 1));
        assert!(!overlap_pays(2, 32_768, 2));
    }

    /// Pieces cover the part once, the interior first, with cuts on the alignment; at a
    /// global edge the interior reaches the edge.
    #[test]
    fn pieces_tile_the_part() {
        let both = [[true, true], [true, true]];
        assert_eq!(pieces([10, 7], [1, 0], both, 1), Some(vec![[1..9, 0..7], [0..1, 0..7], [9..10, 0..7]]));
        assert_eq!(pieces([10, 7], [1, 0], both, 4), Some(vec![[4..8, 0..7], [0..4, 0..7], [8..10, 0..7]]));
        assert_eq!(pieces([10, 7], [1, 0], [[false, true], [true, true]], 4), Some(vec![[0..8, 0..7], [8..10, 0..7]]));
        assert_eq!(pieces([8, 8], [1, 1], both, 4), None);
        assert_eq!(
            pieces([8, 8], [1, 1], [[false, true], [true, false]], 4),
            Some(vec![[0..4, 4..8], [4..8, 0..8], [0..4, 0..4]])
        );
        let grid = pieces([12, 9], [1, 1], both, 2).unwrap();
        assert_eq!(grid[0], [2..10, 2..8]);
        let covered: usize = grid.iter().map(|[r, c]| r.len() * c.len()).sum();
        assert_eq!(covered, 12 * 9);
        assert_eq!(pieces([2, 9], [1, 0], both, 1), None);
        assert_eq!(pieces([0, 9], [1, 0], both, 1), None);
        // Where the overlap pays: a direct convolution's pieces always, a Winograd one's on a
        // part of enough outputs per edge strip.
        assert_eq!(pieces_where_pays([10, 7], [1, 0], both, 1, 70), pieces([10, 7], [1, 0], both, 1));
        assert_eq!(pieces_where_pays([12, 9], [1, 1], both, 2, 108), None);
        assert_eq!(pieces_where_pays([12, 9], [1, 1], both, 2, 4 << 15), pieces([12, 9], [1, 1], both, 2));
    }
}
