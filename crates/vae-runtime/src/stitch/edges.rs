//! The diffusers merge done where the tiles are computed: each tile is blended from its own
//! output and the *raw* edges of its upper, left and upper-left neighbours, and only its kept
//! part, disjoint from every other tile's, goes to the owner (DistVAE's idea: exchange raw
//! edges, blend locally, gather disjoint crops).
//!
//! Diffusers blends in place and in row-major order, so a tile's blended edge could depend on a
//! chain of earlier tiles. It does not when every ramp stays within half a tile: a tile's last
//! rows and columns (what its lower and right neighbours read) are then outside its own leading
//! ramps, so they are raw, except where the upper-left neighbour's raw corner was blended into
//! them. [`EdgeMerge`] checks that condition on a [`StitchLayout`] (it holds for diffusers'
//! overlap of a quarter tile) and replays exactly the blends diffusers applies to each kept
//! element, in the same order and with the same weights, so the output is bit for bit
//! [`Stitcher`](super::Stitcher)'s.

use std::ops::Range;

use vae_planner::{AxisMerge, BlendRamp};
use vae_tensor::Tensor;

use super::{StitchLayout, StitchSpec};
use crate::RuntimeError;

/// Which neighbour of a tile an edge comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Edge {
    /// The tile above: its last rows, blended into this tile's first rows.
    Above,
    /// The tile to the left: its last columns, blended into this tile's first columns.
    Left,
    /// The tile above and to the left: its last rows and columns, blended into the other two
    /// edges before they are blended into this tile.
    Corner,
}

impl Edge {
    /// Every edge, in a fixed order.
    pub const ALL: [Edge; 3] = [Edge::Above, Edge::Left, Edge::Corner];

    /// How far up and left the neighbour lies: `[rows, columns]`.
    pub fn offset(self) -> [usize; 2] {
        match self {
            Edge::Above => [1, 0],
            Edge::Left => [0, 1],
            Edge::Corner => [1, 1],
        }
    }

    /// The tag of the edge on the wire.
    pub fn tag(self) -> u8 {
        match self {
            Edge::Above => 0,
            Edge::Left => 1,
            Edge::Corner => 2,
        }
    }

    /// The edge of a wire tag.
    pub fn from_tag(tag: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|e| e.tag() == tag)
    }
}

/// The merge of a [`StitchLayout`] split tile by tile: which raw edges each tile reads from its
/// neighbours, and how it blends them into its kept part.
#[derive(Debug, Clone)]
pub struct EdgeMerge {
    spec: StitchSpec,
    merges: [AxisMerge; 2],
}

impl EdgeMerge {
    /// The tile-by-tile merge of `layout`, or `None` when a tile's leading ramp reaches into the
    /// trailing positions its next neighbour reads (`e(i − 1) + e(i) > out(i − 1)` along either
    /// axis: ramps past half a tile), so that a blended edge depends on more than the raw edges
    /// of three neighbours (then only the owner's row-major [`Stitcher`](super::Stitcher) gives
    /// diffusers' bits).
    pub fn new(layout: &StitchLayout) -> Result<Option<Self>, RuntimeError> {
        let [rows, cols] = layout.grid_shape();
        if rows == 0 || cols == 0 {
            return Err(RuntimeError::Config("cannot stitch an empty grid".into()));
        }
        let merge = |axis: usize| AxisMerge::new(layout.tile_extents[axis].clone(), layout.spec.rules[axis]);
        let merges = [merge(0)?, merge(1)?];
        let local = merges.iter().all(|m| {
            (1..m.count()).all(|i| {
                // Tile i - 1's last `e(i)` positions (what tile i reads) must lie past its own
                // leading ramp of `e(i - 1)`.
                let (read, written) = (ramp(m, i), ramp(m, i - 1));
                m.tile_output_extents()[i - 1].checked_sub(read).is_some_and(|untouched| written <= untouched)
            })
        });
        Ok(local.then_some(Self { spec: layout.spec, merges }))
    }

    /// `[rows, cols]` of the grid.
    pub fn grid_shape(&self) -> [usize; 2] {
        [self.merges[0].count(), self.merges[1].count()]
    }

    /// The tiled dimensions and their rules.
    pub fn spec(&self) -> &StitchSpec {
        &self.spec
    }

    /// The neighbour of `to` that `edge` comes from, when `to` reads that edge at all (a tile
    /// in the first row reads nothing above, and a zero blend reads nothing).
    pub fn source(&self, to: [usize; 2], edge: Edge) -> Option<[usize; 2]> {
        let [di, dj] = edge.offset();
        let from = [to[0].checked_sub(di)?, to[1].checked_sub(dj)?];
        let [ev, eh] = self.ramps(to);
        let reads = match edge {
            Edge::Above => ev > 0,
            Edge::Left => eh > 0,
            Edge::Corner => ev > 0 && eh > 0,
        };
        reads.then_some(from)
    }

    /// The tiles that read an edge of `from`, each with the edge it reads.
    pub fn readers(&self, from: [usize; 2]) -> impl Iterator<Item = ([usize; 2], Edge)> + '_ {
        let [rows, cols] = self.grid_shape();
        Edge::ALL.into_iter().filter_map(move |edge| {
            let [di, dj] = edge.offset();
            let to = [from[0] + di, from[1] + dj];
            (to[0] < rows && to[1] < cols && self.source(to, edge).is_some()).then_some((to, edge))
        })
    }

    /// Checks that the output of tile `coord` has the extents of its row and column, as the
    /// owner's stitch does.
    pub fn check_tile(&self, coord: [usize; 2], tile: &Tensor) -> Result<(), RuntimeError> {
        super::check_in_grid(coord, self.grid_shape())?;
        super::check_tile_extents(coord, tile, &self.spec, &self.merges)
    }

    /// The part of `from`'s raw output that tile `to` reads as `edge`, as a tensor of its own.
    /// An edge `to` does not read, or a `from` that is not the output of its neighbour's
    /// extents, is an error.
    pub fn cut(&self, from: &Tensor, to: [usize; 2], edge: Edge) -> Result<Tensor, RuntimeError> {
        let source = self.source(to, edge).ok_or_else(|| {
            RuntimeError::Config(format!("tile [{}, {}] does not read a {edge:?} edge", to[0], to[1]))
        })?;
        self.check_tile(source, from)?;
        let [rows, cols] = self.edge_box(to, edge);
        cut_box(from, self.spec.dims, [rows, cols])
    }

    /// The extents along the two tiled dimensions of the edge `to` reads as `edge` (one it
    /// reads, [`Self::source`]).
    pub fn edge_extents(&self, to: [usize; 2], edge: Edge) -> [usize; 2] {
        if self.source(to, edge).is_none() {
            return [0, 0];
        }
        let [rows, cols] = self.edge_box(to, edge);
        [rows.len(), cols.len()]
    }

    /// Blends the raw output of tile `coord` with the raw edges its neighbours sent
    /// (`edge(e)` gives each that [`Self::source`] says it reads) and cuts its kept part: the
    /// same bits diffusers' in-place, row-major merge leaves there.
    pub fn blend_and_crop(
        &self,
        coord: [usize; 2],
        tile: Tensor,
        mut edge: impl FnMut(Edge) -> Result<Tensor, RuntimeError>,
    ) -> Result<Tensor, RuntimeError> {
        self.check_tile(coord, &tile)?;
        let [vdim, hdim] = self.spec.dims;
        let [ev, eh] = self.ramps(coord);
        let [rows, cols] = self.blended_extent(coord);
        let mut own = if [tile.dims()[vdim], tile.dims()[hdim]] == [rows, cols] {
            tile
        } else {
            // Only the blended and kept part: the rest of the tile is freed here.
            let part = cut_box(&tile, self.spec.dims, [0..rows, 0..cols])?;
            drop(tile);
            part
        };
        let corner = if ev > 0 && eh > 0 { Some(edge(Edge::Corner)?) } else { None };
        if ev > 0 {
            // Diffusers blended the tile above with its left neighbour before this tile read it.
            let mut above = edge(Edge::Above)?;
            if let Some(corner) = &corner {
                blend(corner, &mut above, hdim, eh)?;
            }
            blend(&above, &mut own, vdim, ev)?;
        }
        if eh > 0 {
            // ... and the tile to the left with its upper neighbour.
            let mut left = edge(Edge::Left)?;
            if let Some(corner) = &corner {
                blend(corner, &mut left, vdim, ev)?;
            }
            blend(&left, &mut own, hdim, eh)?;
        }
        let (v, h) = self.segments(coord);
        if [v.len(), h.len()] == [rows, cols] { Ok(own) } else { cut_box(&own, self.spec.dims, [v.src, h.src]) }
    }

    /// The merged output's extents along the two tiled dimensions.
    pub fn output_extents(&self) -> [usize; 2] {
        [self.merges[0].output_extent(), self.merges[1].output_extent()]
    }

    /// The extents of tile `coord`'s kept part along the two tiled dimensions.
    pub fn kept_extents(&self, coord: [usize; 2]) -> [usize; 2] {
        let (v, h) = self.segments(coord);
        [v.len(), h.len()]
    }

    /// The blend extents of tile `coord` with its upper and its left neighbour.
    fn ramps(&self, coord: [usize; 2]) -> [usize; 2] {
        [ramp(&self.merges[0], coord[0]), ramp(&self.merges[1], coord[1])]
    }

    /// The leading part of tile `coord` that is blended or kept: its kept part, or its ramps
    /// where a final crop leaves less than a ramp.
    fn blended_extent(&self, coord: [usize; 2]) -> [usize; 2] {
        let kept = self.kept_extents(coord);
        let ramps = self.ramps(coord);
        [kept[0].max(ramps[0]), kept[1].max(ramps[1])]
    }

    /// The crop segments of tile `coord` along the two axes.
    fn segments(&self, coord: [usize; 2]) -> (vae_planner::CropSegment, vae_planner::CropSegment) {
        let segment = |axis: usize| {
            self.merges[axis].crop_segment(coord[axis]).unwrap_or(vae_planner::CropSegment {
                tile: coord[axis],
                src: 0..0,
                dst: 0..0,
            })
        };
        (segment(0), segment(1))
    }

    /// The box of the source tile that `to` reads as `edge`, along `[vdim, hdim]`.
    fn edge_box(&self, to: [usize; 2], edge: Edge) -> [Range<usize>; 2] {
        let [ev, eh] = self.ramps(to);
        let [rows, cols] = self.blended_extent(to);
        let [di, dj] = edge.offset();
        let last = |axis: usize, e: usize| {
            let extent = self.merges[axis].tile_output_extents()[to[axis] - 1];
            extent - e..extent
        };
        let v = if di == 1 { last(0, ev) } else { 0..rows };
        let h = if dj == 1 { last(1, eh) } else { 0..cols };
        [v, h]
    }
}

/// The owner's side of a merge by edges: the output, allocated when the first kept part
/// arrives, and each tile's kept part copied to its place in it, in any order.
#[derive(Debug)]
pub struct Assembly {
    merge: EdgeMerge,
    /// Whether each tile's kept part has arrived, in row-major order.
    placed: Vec<bool>,
    out: Option<Tensor>,
}

impl Assembly {
    /// An empty output for `merge`'s grid.
    pub fn new(merge: EdgeMerge) -> Self {
        let [rows, cols] = merge.grid_shape();
        Self { merge, placed: vec![false; rows * cols], out: None }
    }

    /// Copies the kept part of tile `coord` ([`EdgeMerge::blend_and_crop`]'s) into the output.
    /// A tile outside the grid, one given twice, or a part of another shape is an error.
    pub fn push(&mut self, coord: [usize; 2], part: Tensor) -> Result<(), RuntimeError> {
        super::check_in_grid(coord, self.merge.grid_shape())?;
        let [i, j] = coord;
        if std::mem::replace(&mut self.placed[i * self.merge.grid_shape()[1] + j], true) {
            return Err(RuntimeError::Config(format!("tile [{i}, {j}] was given twice")));
        }
        let spec = self.merge.spec;
        let kept = self.merge.kept_extents(coord);
        if super::tiled_extents(coord, &part, &spec)? != kept {
            let [vdim, hdim] = spec.dims;
            return Err(RuntimeError::Config(format!(
                "the kept part of tile [{i}, {j}] has shape {}, not {} × {} along dimensions {vdim} and {hdim}",
                part.shape(),
                kept[0],
                kept[1]
            )));
        }
        let out = super::output_for(&mut self.out, coord, &part, &spec, self.merge.output_extents())?;
        let (v, h) = self.merge.segments(coord);
        super::place_kept(out, &part, &spec, [&v, &h])
    }

    /// The merged output, once every tile's kept part has arrived.
    pub fn finish(self) -> Result<Tensor, RuntimeError> {
        let cols = self.merge.grid_shape()[1];
        match (self.placed.iter().position(|p| !p), self.out) {
            (None, Some(out)) => Ok(out),
            (missing, _) => {
                let k = missing.unwrap_or(0);
                Err(RuntimeError::Config(format!("tile [{}, {}] is missing", k / cols, k % cols)))
            }
        }
    }
}

/// The effective blend extent between tile `i - 1` and tile `i` along one axis (0 for the first).
fn ramp(merge: &AxisMerge, i: usize) -> usize {
    merge.blend_with_prev(i).unwrap_or(0)
}

/// The box `ranges` (along `dims`) of `t`, as a tensor of its own.
fn cut_box(t: &Tensor, dims: [usize; 2], ranges: [Range<usize>; 2]) -> Result<Tensor, RuntimeError> {
    let mut extent = t.dims().to_vec();
    let mut src = vec![0; t.rank()];
    for (r, d) in ranges.into_iter().zip(dims) {
        src[d] = r.start;
        extent[d] = r.len();
    }
    let mut out = Tensor::zeros(extent.clone(), t.dtype(), &t.device())?;
    out.copy_box_from(&vec![0; t.rank()], t, &src, &extent)?;
    Ok(out)
}

/// Blends all `e` positions of `prev` along `dim` (its last `e` in diffusers' terms) into the
/// first `e` of `cur`, with diffusers' ramp.
fn blend(prev: &Tensor, cur: &mut Tensor, dim: usize, e: usize) -> Result<(), RuntimeError> {
    if e > 0 {
        cur.blend_leading(prev, dim, BlendRamp::new(e).weights())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use vae_tensor::Device;

    use super::*;
    use crate::TileMap;
    use crate::stitch::stitch_layout;
    use crate::stitch::tests::{layout, ragged, tile};

    /// Merges every tile from its raw output and its neighbours' raw edges alone, as ranks do,
    /// the kept parts assembled in reverse order.
    fn merge_by_edges(merge: &EdgeMerge, tiles: &[Vec<Tensor>]) -> Tensor {
        let [vdim, hdim] = merge.spec().dims;
        let mut assembly = Assembly::new(merge.clone());
        for (i, row) in tiles.iter().enumerate().rev() {
            for (j, t) in row.iter().enumerate().rev() {
                merge.check_tile([i, j], t).unwrap();
                let part = merge
                    .blend_and_crop([i, j], t.clone(), |edge| {
                        let from = merge.source([i, j], edge).expect("an edge the tile does not read");
                        merge.cut(&tiles[from[0]][from[1]], [i, j], edge)
                    })
                    .unwrap();
                assert_eq!(merge.kept_extents([i, j]), [part.dims()[vdim], part.dims()[hdim]]);
                assembly.push([i, j], part).unwrap();
            }
        }
        assembly.finish().unwrap()
    }

    proptest! {
        /// Wherever the condition holds, merging each tile from raw edges gives the bits of the
        /// owner's row-major stitch, ragged last tiles and final crops included; and the
        /// condition holds for every overlap up to half a tile.
        #[test]
        fn blending_from_raw_edges_gives_the_stitch(
            rows in 1usize..4,
            cols in 1usize..4,
            full in 4usize..14,
            last in 1usize..14,
            blend in 0usize..10,
            keep in 1usize..14,
            crop in prop::option::of(1usize..40),
        ) {
            let layout = layout(ragged(rows, full, last), ragged(cols, full, last), blend, keep, crop);
            let merge = EdgeMerge::new(&layout).unwrap();
            if 2 * blend <= full {
                prop_assert!(merge.is_some());
            }
            if let Some(merge) = merge {
                let tiles: Vec<Vec<Tensor>> = layout.tile_extents[0]
                    .iter()
                    .enumerate()
                    .map(|(i, &h)| {
                        layout.tile_extents[1].iter().enumerate().map(|(j, &w)| tile(h, w, (i * cols + j) as u64)).collect()
                    })
                    .collect();
                let mut map = TileMap::new();
                for (i, row) in tiles.iter().enumerate() {
                    for (j, t) in row.iter().enumerate() {
                        map.insert(vec![i, j], t.clone());
                    }
                }
                let expected = stitch_layout(map, &layout).unwrap();
                prop_assert!(merge_by_edges(&merge, &tiles).bit_eq(&expected));
            }
        }
    }

    #[test]
    fn an_overlap_past_half_a_tile_is_refused() {
        assert!(EdgeMerge::new(&layout(vec![8, 8, 8], vec![8], 5, 3, None)).unwrap().is_none());
        // Two rows: the first tile has no leading ramp, so the second reads it raw.
        assert!(EdgeMerge::new(&layout(vec![8, 8], vec![8], 5, 3, None)).unwrap().is_some());
        assert!(EdgeMerge::new(&layout(vec![8, 8], vec![8], 4, 4, None)).unwrap().is_some());
    }

    #[test]
    fn a_part_twice_outside_the_grid_of_another_shape_or_missing_is_an_error() {
        let merge = EdgeMerge::new(&layout(vec![8, 8], vec![8, 8], 2, 6, None)).unwrap().unwrap();
        let mut assembly = Assembly::new(merge);
        assembly.push([0, 1], tile(6, 6, 1)).unwrap();
        let twice = assembly.push([0, 1], tile(6, 6, 1)).unwrap_err();
        assert!(twice.to_string().contains("given twice"), "{twice}");
        let outside = assembly.push([2, 0], tile(6, 6, 1)).unwrap_err();
        assert!(outside.to_string().contains("outside"), "{outside}");
        let size = assembly.push([1, 0], tile(8, 6, 1)).unwrap_err();
        assert!(size.to_string().contains("not 6 × 6"), "{size}");
        let other = Tensor::zeros(vec![1, 3, 6, 6], vae_tensor::DType::F32, &Device::Cpu).unwrap();
        let err = assembly.push([1, 1], other).unwrap_err();
        assert!(err.to_string().contains("does not line up with the output"), "{err}");
        let missing = assembly.finish().unwrap_err();
        assert!(missing.to_string().contains("tile [0, 0] is missing"), "{missing}");
    }

    #[test]
    fn edges_name_their_readers_and_only_those() {
        let merge = EdgeMerge::new(&layout(vec![8, 8], vec![8, 8], 2, 6, None)).unwrap().unwrap();
        let readers: Vec<_> = merge.readers([0, 0]).collect();
        assert_eq!(readers, vec![([1, 0], Edge::Above), ([0, 1], Edge::Left), ([1, 1], Edge::Corner)]);
        assert_eq!(merge.readers([1, 1]).count(), 0);
        assert_eq!(merge.source([0, 1], Edge::Above), None);
        let merge = EdgeMerge::new(&layout(vec![8, 8], vec![8, 8], 0, 8, None)).unwrap().unwrap();
        assert_eq!(merge.readers([0, 0]).count(), 0);
        for tag in 0..3 {
            assert_eq!(Edge::from_tag(tag).map(Edge::tag), Some(tag));
        }
        assert_eq!(Edge::from_tag(3), None);
    }
}
