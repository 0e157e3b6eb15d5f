//! The diffusers tiled merge, shared by every tiled VAE: blend each tile with its upper and
//! left neighbours in row-major order (in place, so already-blended rows feed later blends),
//! crop each tile to its kept part, place the parts side by side, and apply the final crop.
//!
//! Tile geometry comes from [`vae_planner`]: blend ramps from [`BlendRamp`], kept lengths and
//! output offsets from [`AxisMerge`], built from the tiles' actual output extents exactly as
//! diffusers uses the actual tensor shapes.

use vae_planner::{AxisMerge, BlendRamp, MergeRule};
use vae_tensor::Tensor;

use crate::{RuntimeError, TileMap};

/// Merge metadata of a diffusers-style tiling over two tensor dimensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StitchSpec {
    /// The two tiled tensor dimensions, vertical then horizontal (e.g. `[2, 3]` for NCHW,
    /// `[3, 4]` for NCTHW).
    pub dims: [usize; 2],
    /// Blend, keep and final crop along each of them.
    pub rules: [MergeRule; 2],
}

/// Merges a `grid_shape[0] × grid_shape[1]` grid of tile outputs (coordinates `[i, j]`)
/// exactly as diffusers' `tiled_decode` / `tiled_encode` loops do.
pub fn stitch(mut tiles: TileMap, grid_shape: [usize; 2], spec: &StitchSpec) -> Result<Tensor, RuntimeError> {
    let [rows, cols] = grid_shape;
    let [vdim, hdim] = spec.dims;
    if rows == 0 || cols == 0 {
        return Err(RuntimeError::Config("cannot stitch an empty grid".into()));
    }
    let mut grid: Vec<Vec<Tensor>> = Vec::with_capacity(rows);
    for i in 0..rows {
        let mut row = Vec::with_capacity(cols);
        for j in 0..cols {
            let tile =
                tiles.take(&[i, j]).ok_or_else(|| RuntimeError::Config(format!("tile [{i}, {j}] is missing")))?;
            if tile.rank() <= vdim.max(hdim) {
                return Err(RuntimeError::Config(format!(
                    "tile [{i}, {j}] has shape {}, which lacks dimensions {vdim} and {hdim}",
                    tile.shape()
                )));
            }
            row.push(tile);
        }
        grid.push(row);
    }

    // Blend in scan order; each tile reads its neighbours as already blended.
    for i in 0..rows {
        for j in 0..cols {
            if i > 0 {
                let (above, below) = grid.split_at_mut(i);
                blend(&above[i - 1][j], &mut below[0][j], vdim, spec.rules[0].blend)?;
            }
            if j > 0 {
                let (left, right) = grid[i].split_at_mut(j);
                blend(&left[j - 1], &mut right[0], hdim, spec.rules[1].blend)?;
            }
        }
    }

    // Kept parts and their places, from the actual output extents.
    let heights: Vec<usize> = grid.iter().map(|row| row[0].dims()[vdim]).collect();
    let widths: Vec<usize> = grid[0].iter().map(|t| t.dims()[hdim]).collect();
    let vmerge = AxisMerge::new(heights.clone(), spec.rules[0])?;
    let hmerge = AxisMerge::new(widths.clone(), spec.rules[1])?;
    let mut out_dims = grid[0][0].dims().to_vec();
    out_dims[vdim] = vmerge.output_extent();
    out_dims[hdim] = hmerge.output_extent();
    let first = &grid[0][0];
    let mut out = Tensor::zeros(out_dims.clone(), first.dtype(), &first.device())?;
    let (vsegs, hsegs) = (vmerge.crop_segments(), hmerge.crop_segments());
    for (i, row) in grid.iter().enumerate() {
        for (j, tile) in row.iter().enumerate() {
            // torch.cat would refuse tiles that do not line up; so do we.
            let lines_up = tile.rank() == out_dims.len()
                && tile.dims()[vdim] == heights[i]
                && tile.dims()[hdim] == widths[j]
                && tile.dims().iter().zip(&out_dims).enumerate().all(|(d, (a, b))| d == vdim || d == hdim || a == b);
            if !lines_up {
                return Err(RuntimeError::Config(format!(
                    "tile [{i}, {j}] of shape {} does not line up with its row and column (first tile {})",
                    tile.shape(),
                    first.shape()
                )));
            }
            let (v, h) = (&vsegs[i], &hsegs[j]);
            if v.is_empty() || h.is_empty() {
                continue;
            }
            let mut src_off = vec![0; out_dims.len()];
            let mut dst_off = vec![0; out_dims.len()];
            let mut extent = out_dims.clone();
            src_off[vdim] = v.src.start;
            dst_off[vdim] = v.dst.start;
            extent[vdim] = v.len();
            src_off[hdim] = h.src.start;
            dst_off[hdim] = h.dst.start;
            extent[hdim] = h.len();
            out.copy_box_from(&dst_off, tile, &src_off, &extent)?;
        }
    }
    Ok(out)
}

/// `blend_v` / `blend_h`: `e = min(prev, cur, blend)` leading rows of `cur` along `dim`.
fn blend(prev: &Tensor, cur: &mut Tensor, dim: usize, blend: usize) -> Result<(), RuntimeError> {
    let e = blend.min(prev.dims()[dim]).min(cur.dims()[dim]);
    if e > 0 {
        cur.blend_leading(prev, dim, BlendRamp::new(e).weights())?;
    }
    Ok(())
}

/// Input ranges of one tile along the two tiled dimensions.
pub type TileRanges = std::ops::Range<usize>;

/// The plan of a diffusers-style tiled operator: tiles with their input ranges, stitched on
/// merge (`Some` spec), or the whole input as one tile (`None`).
pub type StitchPlan = crate::TilePlan<[TileRanges; 2], Option<StitchSpec>>;

/// The whole input as one tile: the untiled path, computed once by one rank.
pub fn untiled_plan(dims: [usize; 2], extents: [usize; 2]) -> StitchPlan {
    let [h, w] = extents;
    let task = vae_planner::TileTask::new(0, vec![0, 0], [0..h, 0..w], (h * w) as u64);
    let grid = vae_planner::GridSpec {
        split_dims: dims.to_vec(),
        grid_shape: vec![1, 1],
        tile_spec: None,
        output_dtype: Some(vae_tensor::DType::F32),
    };
    crate::TilePlan { tasks: vec![task], grid }
}

/// The tiles of `layout` over tensor dimensions `dims`, merged by [`stitch`] with the layout's
/// blend, keep and crop rules.
pub fn tiled_plan(dims: [usize; 2], layout: &vae_planner::TileLayout2d) -> StitchPlan {
    let rules = [layout.rows.merge().rule(), layout.cols.merge().rule()];
    let [rows, cols] = layout.grid_shape();
    let grid = vae_planner::GridSpec {
        split_dims: dims.to_vec(),
        grid_shape: vec![rows, cols],
        tile_spec: Some(StitchSpec { dims, rules }),
        output_dtype: Some(vae_tensor::DType::F32),
    };
    crate::TilePlan { tasks: layout.to_tasks(|tile| tile.input.clone()), grid }
}

/// Merges the tiles of a [`StitchPlan`]: the single tile as it is, or the stitched grid.
pub fn merge_plan(
    mut tiles: TileMap,
    grid: &vae_planner::GridSpec<Option<StitchSpec>, vae_tensor::DType>,
) -> Result<Tensor, RuntimeError> {
    match &grid.tile_spec {
        None => tiles.take(&[0, 0]).ok_or_else(|| RuntimeError::Config("the single tile is missing".into())),
        Some(spec) => stitch(tiles, [grid.grid_shape[0], grid.grid_shape[1]], spec),
    }
}
