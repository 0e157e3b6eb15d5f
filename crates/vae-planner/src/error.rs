//! The one error type of the planner.

use crate::grid::GridCoord;

/// Everything that can be wrong with a plan's inputs.
///
/// The planner never panics on bad input: callers (often a rank of a
/// distributed job) need a value they can report or broadcast, not an abort.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PlanError {
    /// Balancing was asked to spread work over zero ranks.
    #[error("cannot balance work over zero ranks")]
    ZeroRanks,

    /// The task at `position` does not carry tile id `position`.
    #[error("tile ids must be 0..n in order: position {position} holds tile id {found}")]
    NonDenseTileIds {
        /// Index of the offending task in the task list.
        position: usize,
        /// The tile id found there.
        found: usize,
    },

    /// A grid coordinate has the wrong number of axes.
    #[error("tile {tile_id}: coordinate has {found} axes, the grid has {expected}")]
    CoordRankMismatch {
        /// Tile whose coordinate is malformed.
        tile_id: usize,
        /// Number of split dimensions of the grid.
        expected: usize,
        /// Number of axes in the coordinate.
        found: usize,
    },

    /// A grid coordinate lies outside the grid shape.
    #[error("tile {tile_id}: coordinate {index} on axis {axis} is outside the grid extent {extent}")]
    CoordOutOfGrid {
        /// Tile whose coordinate is out of range.
        tile_id: usize,
        /// Axis (index into `split_dims`) that is out of range.
        axis: usize,
        /// The coordinate value on that axis.
        index: usize,
        /// The grid's extent on that axis.
        extent: usize,
    },

    /// Two tiles claim the same grid cell.
    #[error("tiles {first} and {second} share the grid coordinate {coord:?}")]
    DuplicateCoord {
        /// The earlier tile at this coordinate.
        first: usize,
        /// The later tile at this coordinate.
        second: usize,
        /// The shared coordinate.
        coord: GridCoord,
    },

    /// A tensor dimension appears more than once among the split dims.
    #[error("split dimension {dim} is listed more than once")]
    DuplicateSplitDim {
        /// The repeated tensor dimension.
        dim: usize,
    },

    /// `grid_shape` and `split_dims` disagree on the number of axes.
    #[error("grid shape has {grid_axes} axes but there are {split_axes} split dimensions")]
    GridRankMismatch {
        /// `grid_shape.len()`.
        grid_axes: usize,
        /// `split_dims.len()`.
        split_axes: usize,
    },

    /// A grid shape was asked of an empty task list.
    #[error("cannot derive a grid shape from an empty task list")]
    NoTasks,

    /// Summing workloads overflowed `u64`.
    #[error("total workload overflows u64")]
    WorkloadOverflow,

    /// A layer sequence that cannot be cut into the pipeline stages asked for.
    #[error("invalid pipeline stages: {reason}")]
    InvalidStages {
        /// What is wrong, in words.
        reason: String,
    },

    /// Tiling or merge parameters that diffusers itself could not run, or
    /// that overflow `usize`.
    #[error("invalid tiling: {reason}")]
    InvalidTiling {
        /// What is wrong, in words.
        reason: String,
    },
}

impl PlanError {
    /// Shorthand for [`PlanError::InvalidTiling`].
    pub(crate) fn tiling(reason: impl Into<String>) -> Self {
        Self::InvalidTiling { reason: reason.into() }
    }
}
