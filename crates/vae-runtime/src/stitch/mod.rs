//! The diffusers tiled merge, shared by every tiled VAE: blend each tile with its upper and
//! left neighbours in row-major order (in place, so already-blended rows feed later blends),
//! crop each tile to its kept part, place the parts side by side, and apply the final crop.
//!
//! [`Stitcher`] does it one tile at a time into an output allocated up front, from a
//! [`StitchLayout`] that knows every tile's output extent in advance, so that a distributed
//! merge can free each tile as soon as it is merged; [`stitch`] is the same over a whole map
//! of tiles, with the extents the tiles actually have, as diffusers uses the tensor shapes.
//!
//! [`edges`] splits the same merge tile by tile, for ranks that blend their own tiles from
//! their neighbours' raw edges and send the owner only the disjoint kept parts.
//!
//! Tile geometry comes from [`vae_planner`]: blend ramps from [`BlendRamp`], kept lengths and
//! output offsets from [`AxisMerge`].

mod edges;

use std::collections::BTreeMap;

use vae_planner::{AxisMerge, BlendRamp, CropSegment, MergeRule};
use vae_tensor::Tensor;

use crate::{RuntimeError, TileMap};

pub use edges::{Assembly, Edge, EdgeMerge};

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
/// exactly as diffusers' `tiled_decode` / `tiled_encode` loops do, with the tiles' actual
/// output extents (heights from the first column, widths from the first row).
pub fn stitch(tiles: TileMap, grid_shape: [usize; 2], spec: &StitchSpec) -> Result<Tensor, RuntimeError> {
    let [rows, cols] = grid_shape;
    let [vdim, hdim] = spec.dims;
    if rows == 0 || cols == 0 {
        return Err(RuntimeError::Config("cannot stitch an empty grid".into()));
    }
    let extent = |coord: [usize; 2], dim: usize| -> Result<usize, RuntimeError> {
        let tile = tiles
            .get(&coord)
            .ok_or_else(|| RuntimeError::Config(format!("tile [{}, {}] is missing", coord[0], coord[1])))?;
        tile.dims().get(dim).copied().ok_or_else(|| lacks_dims(coord, tile, spec))
    };
    let heights = (0..rows).map(|i| extent([i, 0], vdim)).collect::<Result<Vec<_>, _>>()?;
    let widths = (0..cols).map(|j| extent([0, j], hdim)).collect::<Result<Vec<_>, _>>()?;
    stitch_layout(tiles, &StitchLayout { spec: *spec, tile_extents: [heights, widths] })
}

/// A diffusers 2-D tiling's merge with the output extent of every row and column of tiles
/// known in advance (from the plan), so that the output can be allocated before the first
/// tile arrives and each tile merged into it as soon as its upper and left neighbours are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StitchLayout {
    /// The tiled dimensions and their merge rules.
    pub spec: StitchSpec,
    /// `[heights, widths]`: the output extent of every row of tiles along `spec.dims[0]` and
    /// of every column along `spec.dims[1]`. A tile that comes out another size is an error.
    pub tile_extents: [Vec<usize>; 2],
}

impl StitchLayout {
    /// `[rows, cols]` of the grid.
    pub fn grid_shape(&self) -> [usize; 2] {
        [self.tile_extents[0].len(), self.tile_extents[1].len()]
    }
}

/// The diffusers merge done tile by tile: tiles may be pushed in any order; each is blended
/// (with its upper, then its left neighbour, as already blended) and its kept part copied into
/// the output as soon as every tile before it in row-major order has been, which is the order
/// diffusers blends in, so the output is bit for bit [`stitch`]'s. Besides the output it holds
/// only the tiles that arrived ahead of that order, the last `blend` rows of the latest merged
/// tile of every column (what the tile below reads) and the last `blend` columns of the tile
/// just merged (what its right neighbour reads).
#[derive(Debug)]
pub struct Stitcher {
    spec: StitchSpec,
    merges: [AxisMerge; 2],
    /// Row-major index of the next tile to merge.
    next: usize,
    /// Tiles that arrived before their turn, by row-major index.
    pending: BTreeMap<usize, Tensor>,
    /// Per column: the trailing rows of the merged tile above the next one to merge there.
    above: Vec<Option<Tensor>>,
    /// The trailing columns of the tile merged last, for its right neighbour.
    left: Option<Tensor>,
    /// The output, allocated when the first tile is merged (it gives the other extents).
    out: Option<Tensor>,
}

impl Stitcher {
    /// A merge of `layout`'s grid, with no tile yet.
    pub fn new(layout: &StitchLayout) -> Result<Self, RuntimeError> {
        let [rows, cols] = layout.grid_shape();
        if rows == 0 || cols == 0 {
            return Err(RuntimeError::Config("cannot stitch an empty grid".into()));
        }
        let merge = |axis: usize| AxisMerge::new(layout.tile_extents[axis].clone(), layout.spec.rules[axis]);
        Ok(Self {
            spec: layout.spec,
            merges: [merge(0)?, merge(1)?],
            next: 0,
            pending: BTreeMap::new(),
            above: vec![None; cols],
            left: None,
            out: None,
        })
    }

    /// `[rows, cols]` of the grid.
    pub fn grid_shape(&self) -> [usize; 2] {
        [self.merges[0].count(), self.merges[1].count()]
    }

    /// Tiles held because a tile before them has not arrived.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Whether every tile has been merged.
    pub fn is_complete(&self) -> bool {
        let [rows, cols] = self.grid_shape();
        self.next == rows * cols
    }

    /// Takes the output of tile `coord`, and merges it and every held tile whose turn has
    /// come. A tile outside the grid, one already given, or one whose extents are not the
    /// layout's is an error.
    pub fn push(&mut self, coord: [usize; 2], tile: Tensor) -> Result<(), RuntimeError> {
        check_in_grid(coord, self.grid_shape())?;
        let [i, j] = coord;
        let index = i * self.grid_shape()[1] + j;
        if index < self.next || self.pending.contains_key(&index) {
            return Err(RuntimeError::Config(format!("tile [{i}, {j}] was given twice")));
        }
        check_tile_extents(coord, &tile, &self.spec, &self.merges)?;
        self.pending.insert(index, tile);
        while let Some(tile) = self.pending.remove(&self.next) {
            self.merge_next(tile)?;
        }
        Ok(())
    }

    /// The merged output, once every tile has been pushed.
    pub fn finish(self) -> Result<Tensor, RuntimeError> {
        let cols = self.merges[1].count();
        match self.out {
            Some(out) if self.is_complete() => Ok(out),
            _ => Err(RuntimeError::Config(format!("tile [{}, {}] is missing", self.next / cols, self.next % cols))),
        }
    }

    /// Blends tile number `self.next` with its upper and left neighbours, keeps the edges its
    /// lower and right neighbours will read, and copies its kept part into the output.
    fn merge_next(&mut self, mut tile: Tensor) -> Result<(), RuntimeError> {
        let [rows, cols] = self.grid_shape();
        let (i, j) = (self.next / cols, self.next % cols);
        let [vdim, hdim] = self.spec.dims;
        let [vblend, hblend] = [self.spec.rules[0].blend, self.spec.rules[1].blend];
        let extents = [self.merges[0].output_extent(), self.merges[1].output_extent()];
        output_for(&mut self.out, [i, j], &tile, &self.spec, extents)?;
        if let Some(above) = self.above[j].take() {
            blend(&above, &mut tile, vdim, vblend)?;
        }
        if j > 0
            && let Some(left) = self.left.take()
        {
            blend(&left, &mut tile, hdim, hblend)?;
        }
        if i + 1 < rows {
            self.above[j] = Some(trailing(&tile, vdim, vblend)?);
        }
        self.left = if j + 1 < cols { Some(trailing(&tile, hdim, hblend)?) } else { None };

        if let (Some(v), Some(h), Some(out)) =
            (self.merges[0].crop_segment(i), self.merges[1].crop_segment(j), self.out.as_mut())
        {
            place_kept(out, &tile, &self.spec, [&v, &h])?;
        }
        self.next += 1;
        Ok(())
    }
}

/// A tile outside a `[rows, cols]` grid is an error.
fn check_in_grid(coord: [usize; 2], [rows, cols]: [usize; 2]) -> Result<(), RuntimeError> {
    let [i, j] = coord;
    if i >= rows || j >= cols {
        return Err(RuntimeError::Config(format!("tile [{i}, {j}] is outside the {rows} × {cols} grid")));
    }
    Ok(())
}

/// The extents of `t` along the two tiled dimensions; a tensor without them is an error.
fn tiled_extents(coord: [usize; 2], t: &Tensor, spec: &StitchSpec) -> Result<[usize; 2], RuntimeError> {
    let [vdim, hdim] = spec.dims;
    if t.rank() <= vdim.max(hdim) {
        return Err(lacks_dims(coord, t, spec));
    }
    Ok([t.dims()[vdim], t.dims()[hdim]])
}

/// Checks that tile `coord` (inside the grid) came out with the output extents of its row and
/// column, as `merges` predict them.
fn check_tile_extents(
    coord: [usize; 2],
    tile: &Tensor,
    spec: &StitchSpec,
    merges: &[AxisMerge; 2],
) -> Result<(), RuntimeError> {
    let [i, j] = coord;
    let expected = [merges[0].tile_output_extents()[i], merges[1].tile_output_extents()[j]];
    if tiled_extents(coord, tile, spec)? != expected {
        let [vdim, hdim] = spec.dims;
        return Err(RuntimeError::Config(format!(
            "tile [{i}, {j}] of shape {} does not line up with its row and column ({} × {} along dimensions {vdim} and {hdim})",
            tile.shape(),
            expected[0],
            expected[1]
        )));
    }
    Ok(())
}

/// The merged output: allocated like `tile` the first time (with `extents` along the tiled
/// dimensions). Like `torch.cat`, refuses a tile whose other dimensions differ from it.
fn output_for<'o>(
    out: &'o mut Option<Tensor>,
    coord: [usize; 2],
    tile: &Tensor,
    spec: &StitchSpec,
    extents: [usize; 2],
) -> Result<&'o mut Tensor, RuntimeError> {
    let [vdim, hdim] = spec.dims;
    let out = match out {
        Some(out) => out,
        empty => {
            let mut dims = tile.dims().to_vec();
            [dims[vdim], dims[hdim]] = extents;
            empty.insert(Tensor::zeros(dims, tile.dtype(), &tile.device())?)
        }
    };
    let lines_up = tile.rank() == out.rank()
        && tile.dims().iter().zip(out.dims()).enumerate().all(|(d, (a, b))| d == vdim || d == hdim || a == b);
    if !lines_up {
        return Err(RuntimeError::Config(format!(
            "tile [{}, {}] of shape {} does not line up with the output {:?}",
            coord[0],
            coord[1],
            tile.shape(),
            out.dims()
        )));
    }
    Ok(out)
}

/// Copies the kept part of `tile` (its leading `v.len() × h.len()`: a crop segment's source
/// always starts at 0) to the segments' place in `out`.
fn place_kept(
    out: &mut Tensor,
    tile: &Tensor,
    spec: &StitchSpec,
    [v, h]: [&CropSegment; 2],
) -> Result<(), RuntimeError> {
    if v.is_empty() || h.is_empty() {
        return Ok(());
    }
    let [vdim, hdim] = spec.dims;
    let mut at = vec![0; out.rank()];
    let mut extent = out.dims().to_vec();
    [at[vdim], at[hdim]] = [v.dst.start, h.dst.start];
    [extent[vdim], extent[hdim]] = [v.len(), h.len()];
    out.copy_box_from(&at, tile, &vec![0; out.rank()], &extent)?;
    Ok(())
}

/// The error for a tile without both tiled dimensions.
fn lacks_dims(coord: [usize; 2], tile: &Tensor, spec: &StitchSpec) -> RuntimeError {
    let [vdim, hdim] = spec.dims;
    RuntimeError::Config(format!(
        "tile [{}, {}] has shape {}, which lacks dimensions {vdim} and {hdim}",
        coord[0],
        coord[1],
        tile.shape()
    ))
}

/// The last `min(extent, blend)` positions of `tile` along `dim`: all a later blend reads.
fn trailing(tile: &Tensor, dim: usize, blend: usize) -> Result<Tensor, RuntimeError> {
    let extent = tile.dims()[dim];
    let keep = extent.min(blend);
    Ok(tile.narrow(dim, extent - keep, keep)?)
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
/// merge (`Some` layout), or the whole input as one tile (`None`).
pub type StitchPlan = crate::TilePlan<[TileRanges; 2], Option<StitchLayout>>;

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
/// blend, keep and crop rules; the layout's predicted tile output extents go with them, for a
/// [`Stitcher`].
pub fn tiled_plan(dims: [usize; 2], layout: &vae_planner::TileLayout2d) -> StitchPlan {
    let rules = [layout.rows.merge().rule(), layout.cols.merge().rule()];
    let tile_extents =
        [layout.rows.merge().tile_output_extents().to_vec(), layout.cols.merge().tile_output_extents().to_vec()];
    let [rows, cols] = layout.grid_shape();
    let grid = vae_planner::GridSpec {
        split_dims: dims.to_vec(),
        grid_shape: vec![rows, cols],
        tile_spec: Some(StitchLayout { spec: StitchSpec { dims, rules }, tile_extents }),
        output_dtype: Some(vae_tensor::DType::F32),
    };
    crate::TilePlan { tasks: layout.to_tasks(|tile| tile.input.clone()), grid }
}

/// Merges the tiles of a [`StitchPlan`]: the single tile as it is, or the stitched grid.
pub fn merge_plan(
    mut tiles: TileMap,
    grid: &vae_planner::GridSpec<Option<StitchLayout>, vae_tensor::DType>,
) -> Result<Tensor, RuntimeError> {
    match &grid.tile_spec {
        None => tiles.take(&[0, 0]).ok_or_else(|| RuntimeError::Config("the single tile is missing".into())),
        Some(layout) => stitch_layout(tiles, layout),
    }
}

/// [`stitch`] with the extents `layout` predicts rather than those the tiles have: the same
/// contract as a [`Stitcher`] merging them one by one (a tile of another size is an error), so a
/// serial merge and a distributed one accept and refuse the same tiles.
pub fn stitch_layout(mut tiles: TileMap, layout: &StitchLayout) -> Result<Tensor, RuntimeError> {
    let [rows, cols] = layout.grid_shape();
    let mut stitcher = Stitcher::new(layout)?;
    for i in 0..rows {
        for j in 0..cols {
            let tile =
                tiles.take(&[i, j]).ok_or_else(|| RuntimeError::Config(format!("tile [{i}, {j}] is missing")))?;
            stitcher.push([i, j], tile)?;
        }
    }
    stitcher.finish()
}

/// Layouts and tiles for the merges' tests (here and in [`edges`] and the executor).
#[cfg(test)]
pub(crate) mod tests {
    use proptest::prelude::*;
    use vae_tensor::Device;

    use super::*;

    /// A layout over NCHW tiles with rows and columns of the given output extents.
    pub(crate) fn layout(
        heights: Vec<usize>,
        widths: Vec<usize>,
        blend: usize,
        keep: usize,
        crop: Option<usize>,
    ) -> StitchLayout {
        let rule = MergeRule { blend, keep, final_crop: crop };
        StitchLayout { spec: StitchSpec { dims: [2, 3], rules: [rule, rule] }, tile_extents: [heights, widths] }
    }

    /// Seeded `[1, 2, h, w]` values.
    pub(crate) fn tile(h: usize, w: usize, seed: u64) -> Tensor {
        Tensor::seeded_uniform(vec![1, 2, h, w], seed, -1.0, 1.0, &Device::Cpu).unwrap()
    }

    /// `n` extents of `full`, the last one `last` (at most `full`): a ragged last tile.
    pub(crate) fn ragged(n: usize, full: usize, last: usize) -> Vec<usize> {
        (0..n).map(|k| if k + 1 == n { last.min(full) } else { full }).collect()
    }

    fn tiles_of(layout: &StitchLayout) -> Vec<([usize; 2], Tensor)> {
        let [heights, widths] = &layout.tile_extents;
        let mut tiles = Vec::new();
        for (i, &h) in heights.iter().enumerate() {
            for (j, &w) in widths.iter().enumerate() {
                tiles.push(([i, j], tile(h, w, (i * widths.len() + j) as u64)));
            }
        }
        tiles
    }

    fn whole_map(tiles: &[([usize; 2], Tensor)]) -> TileMap {
        let mut map = TileMap::new();
        for (coord, t) in tiles {
            map.insert(coord.to_vec(), t.clone());
        }
        map
    }

    proptest! {
        /// Tiles pushed in any order stitch to the same bits as the whole map in one go, and
        /// every tile is merged by the end: the order they arrive in (which rank finished
        /// first) cannot change the output.
        #[test]
        fn any_arrival_order_gives_the_stitch_of_the_whole_map(
            rows in 1usize..4,
            cols in 1usize..4,
            full in 4usize..12,
            last in 1usize..12,
            blend in 0usize..10,
            keep in 1usize..12,
            crop in prop::option::of(1usize..40),
            order_seed in any::<u64>(),
        ) {
            let layout = layout(ragged(rows, full, last), ragged(cols, full, last), blend, keep, crop);
            let tiles = tiles_of(&layout);
            let expected = stitch(whole_map(&tiles), layout.grid_shape(), &layout.spec).unwrap();

            let mut order: Vec<usize> = (0..tiles.len()).collect();
            let mut state = order_seed | 1;
            for k in (1..order.len()).rev() {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                order.swap(k, (state % (k as u64 + 1)) as usize);
            }
            let mut stitcher = Stitcher::new(&layout).unwrap();
            for &k in &order {
                stitcher.push(tiles[k].0, tiles[k].1.clone()).unwrap();
            }
            prop_assert!(stitcher.is_complete());
            prop_assert_eq!(stitcher.pending(), 0);
            let got = stitcher.finish().unwrap();
            prop_assert!(got.bit_eq(&expected));
        }
    }

    /// In row-major order no tile waits: each is merged as it comes, and only the edges its
    /// neighbours read are kept.
    #[test]
    fn tiles_in_row_major_order_are_merged_at_once() {
        let layout = layout(vec![8, 8, 5], vec![8, 8, 8, 3], 2, 6, None);
        let mut stitcher = Stitcher::new(&layout).unwrap();
        for (coord, t) in tiles_of(&layout) {
            stitcher.push(coord, t).unwrap();
            assert_eq!(stitcher.pending(), 0);
        }
        let out = stitcher.finish().unwrap();
        assert_eq!(out.dims(), &[1, 2, 6 + 6 + 5, 6 + 6 + 6 + 3]);
    }

    #[test]
    fn a_tile_twice_outside_the_grid_or_of_another_size_is_an_error() {
        let layout = layout(vec![8, 8], vec![8, 8], 2, 6, None);
        let mut stitcher = Stitcher::new(&layout).unwrap();
        stitcher.push([0, 1], tile(8, 8, 1)).unwrap();
        let twice = stitcher.push([0, 1], tile(8, 8, 1)).unwrap_err();
        assert!(twice.to_string().contains("given twice"), "{twice}");
        let outside = stitcher.push([2, 0], tile(8, 8, 1)).unwrap_err();
        assert!(outside.to_string().contains("outside"), "{outside}");
        let size = stitcher.push([1, 0], tile(7, 8, 1)).unwrap_err();
        assert!(size.to_string().contains("does not line up"), "{size}");
        let flat = stitcher.push([1, 1], Tensor::zeros(vec![8, 8], vae_tensor::DType::F32, &Device::Cpu).unwrap());
        assert!(flat.unwrap_err().to_string().contains("lacks dimensions"));
        stitcher.push([0, 0], tile(8, 8, 2)).unwrap();
        let missing = stitcher.finish().unwrap_err();
        assert!(missing.to_string().contains("tile [1, 0] is missing"), "{missing}");
    }

    #[test]
    fn a_tile_whose_other_dimensions_differ_from_the_first_is_an_error() {
        let layout = layout(vec![8], vec![8, 8], 2, 6, None);
        let mut stitcher = Stitcher::new(&layout).unwrap();
        stitcher.push([0, 0], tile(8, 8, 1)).unwrap();
        let other = Tensor::zeros(vec![1, 3, 8, 8], vae_tensor::DType::F32, &Device::Cpu).unwrap();
        let err = stitcher.push([0, 1], other).unwrap_err();
        assert!(err.to_string().contains("does not line up with the output"), "{err}");
        assert!(Stitcher::new(&layout_empty()).is_err());
    }

    fn layout_empty() -> StitchLayout {
        layout(Vec::new(), vec![8], 2, 6, None)
    }
}
