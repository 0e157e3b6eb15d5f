//! Block grids for a 2-D spatial shard: the map cut into `R × C` blocks, `R` bands of rows
//! by `C` bands of columns, one block per rank (rank `r` holds block `(r / C, r % C)`).
//!
//! Each axis is a [`BandPartition`], so blocks are uneven only by whole rows or columns and
//! every block must be at least the widest halo along both axes, checked from global
//! quantities before any communication. A `k`-tap convolution then needs `(k − 1) / 2` rows
//! from the blocks above and below, the same columns from the blocks left and right, and the
//! corners from the diagonal blocks. On `N` ranks a square map cut into `√N × √N` blocks sends
//! each rank about `4 / √N` of its side in halo rows and columns, against 2 sides for `N` bands:
//! half as many halo bytes at `N = 4`.

use std::ops::Range;

use crate::{BandPartition, PlanError};

/// An `R × C` grid of blocks over an `H × W` extent (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockGrid {
    rows: BandPartition,
    cols: BandPartition,
}

impl BlockGrid {
    /// `extents` (`[H, W]`) cut into `grid` (`[R, C]`) blocks, each at least `min_block`
    /// (`[rows, columns]`, the widest halo along each axis).
    pub fn new(extents: [usize; 2], grid: [usize; 2], min_block: [usize; 2]) -> Result<Self, PlanError> {
        let axis = |a: usize| {
            BandPartition::new(extents[a], grid[a], min_block[a])
                .map_err(|e| PlanError::tiling(format!("a {} × {} grid of blocks: {e}", grid[0], grid[1])))
        };
        Ok(Self { rows: axis(0)?, cols: axis(1)? })
    }

    /// True when `extents` can be cut into `grid` blocks of at least `min_block`.
    pub fn fits(extents: [usize; 2], grid: [usize; 2], min_block: [usize; 2]) -> bool {
        (0..2).all(|a| BandPartition::fits(extents[a], grid[a], min_block[a]))
    }

    /// `[R, C]`.
    pub fn grid(&self) -> [usize; 2] {
        [self.rows.len(), self.cols.len()]
    }

    /// Ranks taking part, `R · C`.
    pub fn ranks(&self) -> usize {
        self.rows.len() * self.cols.len()
    }

    /// `[H, W]`.
    pub fn extents(&self) -> [usize; 2] {
        [self.rows.extent(), self.cols.extent()]
    }

    /// The row bands.
    pub fn rows(&self) -> &BandPartition {
        &self.rows
    }

    /// The column bands.
    pub fn cols(&self) -> &BandPartition {
        &self.cols
    }

    /// Rank `r`'s place `[i, j]` in the grid, `None` beyond the grid.
    pub fn coord(&self, rank: usize) -> Option<[usize; 2]> {
        (rank < self.ranks()).then(|| [rank / self.cols.len(), rank % self.cols.len()])
    }

    /// The rank holding block `[i, j]`, `None` outside the grid.
    pub fn rank_at(&self, [i, j]: [usize; 2]) -> Option<usize> {
        (i < self.rows.len() && j < self.cols.len()).then(|| i * self.cols.len() + j)
    }

    /// Rank `r`'s rows and columns.
    pub fn block(&self, rank: usize) -> Option<[Range<usize>; 2]> {
        let [i, j] = self.coord(rank)?;
        Some([self.rows.band(i)?, self.cols.band(j)?])
    }

    /// The same grid after every row became `factor[0]` rows and every column `factor[1]`.
    pub fn scaled(&self, factor: [usize; 2]) -> Self {
        Self { rows: self.rows.scaled(factor[0]), cols: self.cols.scaled(factor[1]) }
    }
}

/// The `R × C` factorisation of `ranks` whose blocks of an `h × w` map are closest to square
/// (the ratio of the longer block side to the shorter is smallest; more columns on ties, as
/// the 1-D `auto` prefers the width), among those whose every block holds `min_block` (`[rows,
/// columns]`, at least one of each). `None` when no factorisation does.
pub fn square_grid(ranks: usize, h: usize, w: usize, min_block: [usize; 2]) -> Option<[usize; 2]> {
    (1..=ranks)
        .filter(|r| ranks.is_multiple_of(*r))
        .map(|r| [r, ranks / r])
        .filter(|&g| BlockGrid::fits([h, w], g, min_block))
        // Block sides are h / R and w / C: compare (h·C) against (w·R), longer over shorter,
        // as exact fractions.
        .map(|[r, c]| {
            let (a, b) = (h as u128 * c as u128, w as u128 * r as u128);
            ([r, c], if a >= b { (a, b) } else { (b, a) })
        })
        .min_by(|(ga, (na, da)), (gb, (nb, db))| (na * db).cmp(&(nb * da)).then(gb[1].cmp(&ga[1])))
        .map(|(g, _)| g)
}

/// Parses `"RxC"` (also `"R×C"` and `"R,C"`), both at least 1.
pub fn parse_grid(text: &str) -> Result<[usize; 2], PlanError> {
    let parts: Vec<&str> = text.split(['x', 'X', '×', ',']).map(str::trim).collect();
    let bad = || PlanError::tiling(format!("a shard grid is written RxC with R, C ≥ 1 (e.g. 2x2), not {text:?}"));
    match parts.as_slice() {
        [r, c] => {
            let (r, c) = (r.parse::<usize>().map_err(|_| bad())?, c.parse::<usize>().map_err(|_| bad())?);
            if r == 0 || c == 0 { Err(bad()) } else { Ok([r, c]) }
        }
        _ => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_fill_the_grid_row_major() {
        let g = BlockGrid::new([7, 10], [2, 3], [1, 1]).unwrap();
        assert_eq!(g.grid(), [2, 3]);
        assert_eq!(g.ranks(), 6);
        assert_eq!(g.coord(4), Some([1, 1]));
        assert_eq!(g.coord(6), None);
        assert_eq!(g.rank_at([1, 2]), Some(5));
        assert_eq!(g.rank_at([2, 0]), None);
        assert_eq!(g.block(0), Some([0..4, 0..4]));
        assert_eq!(g.block(5), Some([4..7, 7..10]));
        assert_eq!(g.scaled([8, 8]).block(5), Some([32..56, 56..80]));
    }

    #[test]
    fn every_block_must_hold_the_halo_along_both_axes() {
        assert!(BlockGrid::new([8, 3], [2, 2], [2, 2]).is_err());
        assert!(!BlockGrid::fits([8, 3], [2, 2], [2, 2]));
        assert!(BlockGrid::fits([8, 4], [2, 2], [2, 2]));
        assert!(BlockGrid::new([8, 4], [2, 0], [1, 1]).is_err());
    }

    #[test]
    fn the_default_grid_makes_blocks_closest_to_square() {
        let one = [1, 1];
        assert_eq!(square_grid(4, 64, 64, one), Some([2, 2]));
        assert_eq!(square_grid(2, 64, 64, one), Some([1, 2]));
        assert_eq!(square_grid(4, 32, 128, one), Some([1, 4]));
        assert_eq!(square_grid(6, 60, 104, one), Some([2, 3]));
        assert_eq!(square_grid(4, 1, 8, one), Some([1, 4]));
        assert_eq!(square_grid(5, 2, 2, one), None);
        assert_eq!(square_grid(1, 3, 3, one), Some([1, 1]));
        // The squarest grid (2 × 2: blocks of 2 × 2) cannot hold 3 rows; 1 × 4 (4 × 1) can.
        assert_eq!(square_grid(4, 4, 4, [3, 1]), Some([1, 4]));
        assert_eq!(square_grid(4, 4, 4, [3, 3]), None);
    }

    #[test]
    fn grids_parse_as_rows_by_columns() {
        assert_eq!(parse_grid("2x3").unwrap(), [2, 3]);
        assert_eq!(parse_grid(" 4 × 1 ").unwrap(), [4, 1]);
        assert_eq!(parse_grid("1,2").unwrap(), [1, 2]);
        for bad in ["2", "0x2", "2x", "axb", "2x2x2", ""] {
            assert!(parse_grid(bad).is_err(), "{bad}");
        }
    }
}
