//! Band partitions for spatial-shard decode.
//!
//! A shard decode cuts the latent into contiguous bands of whole rows (or columns), one per
//! rank, and keeps every feature map sharded the same way through the decoder. Bands are
//! uneven when the extent does not divide: the first `extent % ranks` bands hold one row more.
//! There is no zero-padded tail (the reference pads to a multiple of the rank count and must
//! then re-zero the padding after every conv).
//!
//! Each `k`-tap convolution along the split axis needs `(k − 1) / 2` rows from each
//! neighbour ([`halo_width`]). A band narrower than that halo would need rows from a rank
//! beyond its neighbour, so every band must be at least the widest halo of the network;
//! [`BandPartition::new`] checks it from global quantities, so every rank reaches the same
//! verdict before any communication. Nearest upsampling scales every band by the same
//! factor, so a partition valid at the latent is valid at every later resolution.

use std::fmt;
use std::ops::Range;

use crate::PlanError;

/// The spatial axis a shard decode splits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ShardAxis {
    /// Bands of rows.
    Height,
    /// Bands of columns.
    Width,
}

impl ShardAxis {
    /// Position of the axis counted from the last dimension (`H` is second to last in both
    /// NCHW and NCTHW, `W` last), so one value addresses image and video tensors alike.
    pub fn dim_in(self, rank: usize) -> Option<usize> {
        let from_end = match self {
            Self::Height => 2,
            Self::Width => 1,
        };
        rank.checked_sub(from_end)
    }

    /// "height" or "width".
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Height => "height",
            Self::Width => "width",
        }
    }
}

impl fmt::Display for ShardAxis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Rows a `k`-tap, stride-1, "same"-padded convolution needs from each neighbour.
pub const fn halo_width(kernel: usize) -> usize {
    kernel.saturating_sub(1) / 2
}

/// Contiguous, uneven bands of an extent, one per rank, in rank order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BandPartition {
    extent: usize,
    bands: Vec<Range<usize>>,
}

impl BandPartition {
    /// Splits `extent` rows over `ranks` bands whose lengths differ by at most one (longer
    /// bands first), refusing a partition in which a band is narrower than `min_band` rows
    /// (the widest halo; at least 1, since every rank must hold rows).
    pub fn new(extent: usize, ranks: usize, min_band: usize) -> Result<Self, PlanError> {
        if ranks == 0 {
            return Err(PlanError::ZeroRanks);
        }
        let min_band = min_band.max(1);
        let shortest = extent / ranks;
        if shortest < min_band {
            return Err(PlanError::tiling(format!(
                "an extent of {extent} cannot give {ranks} ranks a band of at least {min_band} row(s) each \
                 (the shortest would be {shortest})"
            )));
        }
        let extra = extent % ranks;
        let mut start = 0;
        let bands = (0..ranks)
            .map(|r| {
                let len = shortest + usize::from(r < extra);
                let band = start..start + len;
                start += len;
                band
            })
            .collect();
        Ok(Self { extent, bands })
    }

    /// True when `extent` can be split over `ranks` bands of at least `min_band` rows.
    pub fn fits(extent: usize, ranks: usize, min_band: usize) -> bool {
        ranks > 0 && extent / ranks >= min_band.max(1)
    }

    /// The total extent.
    pub fn extent(&self) -> usize {
        self.extent
    }

    /// Number of bands (ranks).
    pub fn len(&self) -> usize {
        self.bands.len()
    }

    /// Always false: a partition has at least one band.
    pub fn is_empty(&self) -> bool {
        self.bands.is_empty()
    }

    /// Rank `r`'s rows.
    pub fn band(&self, r: usize) -> Option<Range<usize>> {
        self.bands.get(r).cloned()
    }

    /// Every band, in rank order.
    pub fn bands(&self) -> &[Range<usize>] {
        &self.bands
    }

    /// The shortest band.
    pub fn min_len(&self) -> usize {
        self.bands.iter().map(|b| b.len()).min().unwrap_or(0)
    }

    /// The same partition after every row became `factor` rows (a nearest upsample).
    pub fn scaled(&self, factor: usize) -> Self {
        Self {
            extent: self.extent * factor,
            bands: self.bands.iter().map(|b| b.start * factor..b.end * factor).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn uneven_extents_give_the_first_bands_one_more_row() {
        let p = BandPartition::new(5, 3, 1).unwrap();
        assert_eq!(p.bands(), &[0..2, 2..4, 4..5]);
        assert_eq!(p.min_len(), 1);
        assert_eq!(p.scaled(8).bands(), &[0..16, 16..32, 32..40]);
        assert_eq!(BandPartition::new(60, 4, 1).unwrap().bands(), &[0..15, 15..30, 30..45, 45..60]);
    }

    #[test]
    fn a_band_narrower_than_the_halo_is_refused() {
        assert!(BandPartition::new(3, 4, 1).is_err());
        assert!(BandPartition::new(7, 4, 2).is_err());
        assert!(BandPartition::new(8, 4, 2).is_ok());
        assert!(!BandPartition::fits(2, 4, 1));
        assert!(BandPartition::fits(4, 4, 0));
        assert_eq!(BandPartition::new(4, 0, 1), Err(PlanError::ZeroRanks));
    }

    #[test]
    fn halo_widths_follow_the_kernel() {
        assert_eq!(halo_width(1), 0);
        assert_eq!(halo_width(3), 1);
        assert_eq!(halo_width(5), 2);
        assert_eq!(ShardAxis::Height.dim_in(5), Some(3));
        assert_eq!(ShardAxis::Width.dim_in(4), Some(3));
        assert_eq!(ShardAxis::Height.dim_in(1), None);
    }

    proptest! {
        #[test]
        fn bands_tile_the_extent_and_differ_by_at_most_one(extent in 1usize..500, ranks in 1usize..17) {
            prop_assume!(extent >= ranks);
            let p = BandPartition::new(extent, ranks, 1).unwrap();
            prop_assert_eq!(p.len(), ranks);
            let mut next = 0;
            for b in p.bands() {
                prop_assert_eq!(b.start, next);
                prop_assert!(!b.is_empty());
                next = b.end;
            }
            prop_assert_eq!(next, extent);
            let max = p.bands().iter().map(|b| b.len()).max().unwrap();
            prop_assert!(max - p.min_len() <= 1);
        }
    }
}
