//! Executor data types: a model's tiles and the grid they form.
//!
//! These mirror the task/grid description of vllm-omni's
//! `DistributedVaeExecutor`: a model cuts its input into [`TileTask`]s laid
//! out on a grid over some tensor dimensions, and describes in a [`GridSpec`]
//! how the per-tile results are merged back.

use std::collections::HashMap;

use crate::error::PlanError;

/// Position of a tile on the grid, one index per split dimension.
pub type GridCoord = Vec<usize>;

/// One unit of work: a tile to be encoded or decoded by some rank.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TileTask<T> {
    /// Dense id; the tasks of a grid carry ids `0..n` in order.
    pub tile_id: usize,
    /// Where the tile sits on the grid (one entry per split dimension).
    pub grid_coord: GridCoord,
    /// Model-specific description of the tile (typically input ranges).
    pub payload: T,
    /// Balancing weight, normally the tile's latent area. An integer so that
    /// every rank computes the very same assignment without talking.
    pub workload: u64,
}

impl<T> TileTask<T> {
    /// Builds a task.
    #[must_use]
    pub fn new(tile_id: usize, grid_coord: GridCoord, payload: T, workload: u64) -> Self {
        Self { tile_id, grid_coord, payload, workload }
    }
}

/// Shape of the tile grid and the metadata needed to merge the tiles back.
///
/// * `S` is the model's typed merge metadata (blend extents, crops, ...).
/// * `D` is the tensor layer's element-type tag. The planner never looks at
///   it; it only carries it so the executor knows which dtype to gather in.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct GridSpec<S, D> {
    /// Tensor dimensions the grid splits, e.g. `[2, 3]` for NCHW height/width.
    pub split_dims: Vec<usize>,
    /// Number of tiles along each split dimension.
    pub grid_shape: Vec<usize>,
    /// Model-specific merge metadata.
    pub tile_spec: S,
    /// Element type of the merged output, if the model pins one.
    pub output_dtype: Option<D>,
}

impl<S, D> GridSpec<S, D> {
    /// Checks the spec on its own: distinct split dims, and one grid extent
    /// per split dim.
    pub fn validate(&self) -> Result<(), PlanError> {
        if self.grid_shape.len() != self.split_dims.len() {
            return Err(PlanError::GridRankMismatch {
                grid_axes: self.grid_shape.len(),
                split_axes: self.split_dims.len(),
            });
        }
        for (k, dim) in self.split_dims.iter().enumerate() {
            if self.split_dims[..k].contains(dim) {
                return Err(PlanError::DuplicateSplitDim { dim: *dim });
            }
        }
        Ok(())
    }

    /// Checks `tasks` against this spec: ids are exactly `0..n` in order,
    /// every coordinate has one entry per split dim and lies inside
    /// `grid_shape`, and no two tiles share a coordinate.
    ///
    /// Coverage of every grid cell is *not* required: a model may leave
    /// cells without work.
    pub fn validate_tasks<T>(&self, tasks: &[TileTask<T>]) -> Result<(), PlanError> {
        self.validate()?;
        let mut seen: HashMap<&[usize], usize> = HashMap::with_capacity(tasks.len());
        for (position, task) in tasks.iter().enumerate() {
            if task.tile_id != position {
                return Err(PlanError::NonDenseTileIds { position, found: task.tile_id });
            }
            if task.grid_coord.len() != self.grid_shape.len() {
                return Err(PlanError::CoordRankMismatch {
                    tile_id: task.tile_id,
                    expected: self.grid_shape.len(),
                    found: task.grid_coord.len(),
                });
            }
            for (axis, (&index, &extent)) in task.grid_coord.iter().zip(&self.grid_shape).enumerate() {
                if index >= extent {
                    return Err(PlanError::CoordOutOfGrid { tile_id: task.tile_id, axis, index, extent });
                }
            }
            if let Some(&first) = seen.get(task.grid_coord.as_slice()) {
                return Err(PlanError::DuplicateCoord { first, second: task.tile_id, coord: task.grid_coord.clone() });
            }
            seen.insert(&task.grid_coord, task.tile_id);
        }
        Ok(())
    }
}

/// Grid shape as the reference executor derives it: the last task's
/// coordinate plus one on every axis.
///
/// This is only right for row-major task lists whose last task sits in the
/// grid's far corner, which is how every diffusers tiling loop emits them;
/// run [`GridSpec::validate_tasks`] afterwards to catch anything else.
pub fn grid_shape_from_last<T>(tasks: &[TileTask<T>]) -> Result<Vec<usize>, PlanError> {
    let last = tasks.last().ok_or(PlanError::NoTasks)?;
    last.grid_coord
        .iter()
        .map(|&c| c.checked_add(1).ok_or_else(|| PlanError::tiling("grid coordinate overflows usize")))
        .collect()
}

/// The tasks' workloads, in task order, ready for [`crate::lpt_assign`].
#[must_use]
pub fn workloads<T>(tasks: &[TileTask<T>]) -> Vec<u64> {
    tasks.iter().map(|t| t.workload).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(split_dims: Vec<usize>, grid_shape: Vec<usize>) -> GridSpec<(), ()> {
        GridSpec { split_dims, grid_shape, tile_spec: (), output_dtype: None }
    }

    fn grid_tasks(rows: usize, cols: usize) -> Vec<TileTask<()>> {
        (0..rows * cols).map(|id| TileTask::new(id, vec![id / cols, id % cols], (), 1)).collect()
    }

    #[test]
    fn row_major_grid_is_valid() {
        let tasks = grid_tasks(2, 3);
        let shape = grid_shape_from_last(&tasks).unwrap();
        assert_eq!(shape, vec![2, 3]);
        spec(vec![2, 3], shape).validate_tasks(&tasks).unwrap();
        assert_eq!(workloads(&tasks), vec![1; 6]);
    }

    #[test]
    fn empty_task_list() {
        assert_eq!(grid_shape_from_last::<()>(&[]).unwrap_err(), PlanError::NoTasks);
        spec(vec![2, 3], vec![0, 0]).validate_tasks::<()>(&[]).unwrap();
    }

    #[test]
    fn rejects_bad_ids() {
        let mut tasks = grid_tasks(2, 2);
        tasks[2].tile_id = 7;
        assert_eq!(
            spec(vec![2, 3], vec![2, 2]).validate_tasks(&tasks),
            Err(PlanError::NonDenseTileIds { position: 2, found: 7 })
        );
    }

    #[test]
    fn rejects_bad_coords() {
        let s = spec(vec![2, 3], vec![2, 2]);
        let mut tasks = grid_tasks(2, 2);
        tasks[1].grid_coord = vec![0];
        assert!(matches!(s.validate_tasks(&tasks), Err(PlanError::CoordRankMismatch { tile_id: 1, .. })));
        let mut tasks = grid_tasks(2, 2);
        tasks[3].grid_coord = vec![1, 2];
        assert_eq!(
            s.validate_tasks(&tasks),
            Err(PlanError::CoordOutOfGrid { tile_id: 3, axis: 1, index: 2, extent: 2 })
        );
        let mut tasks = grid_tasks(2, 2);
        tasks[3].grid_coord = vec![0, 1];
        assert_eq!(s.validate_tasks(&tasks), Err(PlanError::DuplicateCoord { first: 1, second: 3, coord: vec![0, 1] }));
    }

    #[test]
    fn rejects_bad_spec() {
        let tasks = grid_tasks(1, 1);
        assert_eq!(spec(vec![2, 2], vec![1, 1]).validate_tasks(&tasks), Err(PlanError::DuplicateSplitDim { dim: 2 }));
        assert_eq!(
            spec(vec![2, 3], vec![1]).validate_tasks(&tasks),
            Err(PlanError::GridRankMismatch { grid_axes: 1, split_axes: 2 })
        );
    }
}
