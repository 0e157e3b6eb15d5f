//! Tile geometry reproducing diffusers' tiled encode/decode loops exactly.
//!
//! Along one axis diffusers does:
//!
//! ```text
//! for i in range(0, extent, stride):          # AxisTiling
//!     tiles.append(model(x[..., i:i + tile]))  # tile clipped at the edge
//! for each tile (row-major):                   # AxisMerge
//!     e = min(prev_out, cur_out, blend)        # blend with previous tile
//!     kept.append(tile[:keep])                 # "row limit" / crop to stride
//! out = cat(kept)[:final_crop]                 # crop only for Wan / Qwen
//! ```
//!
//! [`AxisTiling`] is the input side, [`AxisMerge`] the output side (it needs
//! each tile's output extent, which only the model knows, so the caller
//! supplies it), [`AxisPlan`] ties the two together and [`TileLayout2d`] is
//! the product of a row plan and a column plan. [`AutoencoderKlTiling`] and
//! [`WanTiling`] derive these from the diffusers model attributes.

use std::ops::Range;

use crate::error::PlanError;
use crate::grid::{GridCoord, TileTask};

/// The input side of one axis: Python's `range(0, extent, stride)` with
/// tiles `x[p : p + tile]`, clipped at `extent`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct AxisTiling {
    // Private so the `stride > 0` / `tile > 0` invariants cannot be broken
    // after construction (a zero stride would make `positions` loop forever
    // in spirit and panic in `step_by`).
    extent: usize,
    tile: usize,
    stride: usize,
}

impl AxisTiling {
    /// Tiles of `tile` elements every `stride` elements over `extent`.
    ///
    /// `stride > tile` is accepted (diffusers runs it; the input then has
    /// gaps), a zero `tile` or `stride` is not (Python raises on a zero
    /// `range` step; a zero tile is always empty).
    pub fn new(extent: usize, tile: usize, stride: usize) -> Result<Self, PlanError> {
        if stride == 0 {
            return Err(PlanError::tiling("tile stride must be positive"));
        }
        if tile == 0 {
            return Err(PlanError::tiling("tile size must be positive"));
        }
        Ok(Self { extent, tile, stride })
    }

    /// Length of the tiled axis.
    #[must_use]
    pub fn extent(&self) -> usize {
        self.extent
    }

    /// Nominal tile size (edge tiles may be shorter).
    #[must_use]
    pub fn tile(&self) -> usize {
        self.tile
    }

    /// Distance between tile starts.
    #[must_use]
    pub fn stride(&self) -> usize {
        self.stride
    }

    /// Number of tiles, `len(range(0, extent, stride))`.
    #[must_use]
    pub fn count(&self) -> usize {
        self.extent.div_ceil(self.stride)
    }

    /// Tile start positions, `list(range(0, extent, stride))`; empty for a
    /// zero extent.
    #[must_use]
    pub fn positions(&self) -> Vec<usize> {
        (0..self.extent).step_by(self.stride).collect()
    }

    /// Input range of tile `i`, `[p, min(p + tile, extent))`; `None` past the
    /// last tile.
    #[must_use]
    pub fn input_range(&self, i: usize) -> Option<Range<usize>> {
        if i >= self.count() {
            return None;
        }
        // `i < count` implies `i * stride < extent`, so this cannot overflow.
        let start = i * self.stride;
        Some(start..start.saturating_add(self.tile).min(self.extent))
    }
}

/// How tiles are merged along one axis (model constants, not per tile).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MergeRule {
    /// Requested blend extent; the effective one is additionally clamped to
    /// both neighbours' output extents.
    pub blend: usize,
    /// Leading output elements kept from every tile (diffusers' `row_limit`,
    /// or the sample stride for Wan).
    pub keep: usize,
    /// Final crop of the concatenated output, if the model applies one.
    pub final_crop: Option<usize>,
}

/// Where one tile's kept output lands in the final output along one axis.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CropSegment {
    /// Index of the tile along this axis.
    pub tile: usize,
    /// Range of the tile's (blended) output that survives; always starts at 0.
    pub src: Range<usize>,
    /// Range of the final output it is written to; same length as `src`.
    pub dst: Range<usize>,
}

impl CropSegment {
    /// Number of elements copied.
    #[must_use]
    pub fn len(&self) -> usize {
        self.src.len()
    }

    /// Whether the tile contributes nothing (kept part empty or cropped away).
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.src.is_empty()
    }
}

/// The output side of one axis: blend extents, kept parts and their offsets.
///
/// Reproduces the diffusers quirk that the kept length is `min(keep, out)`,
/// not the stride: with unusual overlap factors the concatenation can be
/// *longer* than `extent * scale`. Only the final crop (when the model has
/// one) trims it; nothing here "fixes" it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct AxisMerge {
    tile_out: Vec<usize>,
    rule: MergeRule,
    /// Prefix sums of the kept lengths (`count + 1` entries), computed once
    /// with overflow checks so the accessors cannot overflow.
    offsets: Vec<usize>,
}

impl AxisMerge {
    /// Merge plan for tiles whose outputs along this axis have the given
    /// extents, in tile order.
    ///
    /// Errors only if the concatenated length overflows `usize`.
    pub fn new(tile_output_extents: Vec<usize>, rule: MergeRule) -> Result<Self, PlanError> {
        let mut offsets = Vec::with_capacity(tile_output_extents.len() + 1);
        let mut total = 0usize;
        offsets.push(total);
        for &out in &tile_output_extents {
            total = total
                .checked_add(rule.keep.min(out))
                .ok_or_else(|| PlanError::tiling("merged output length overflows usize"))?;
            offsets.push(total);
        }
        Ok(Self { tile_out: tile_output_extents, rule, offsets })
    }

    /// Number of tiles.
    #[must_use]
    pub fn count(&self) -> usize {
        self.tile_out.len()
    }

    /// The merge constants.
    #[must_use]
    pub fn rule(&self) -> MergeRule {
        self.rule
    }

    /// Output extent of every tile, in tile order.
    #[must_use]
    pub fn tile_output_extents(&self) -> &[usize] {
        &self.tile_out
    }

    /// Output extent of tile `i`.
    #[must_use]
    pub fn tile_output_extent(&self, i: usize) -> Option<usize> {
        self.tile_out.get(i).copied()
    }

    /// Effective blend extent between tile `i - 1` and tile `i`:
    /// `min(out[i - 1], out[i], blend)`, and 0 for the first tile.
    #[must_use]
    pub fn blend_with_prev(&self, i: usize) -> Option<usize> {
        let cur = *self.tile_out.get(i)?;
        Some(match i.checked_sub(1) {
            None => 0,
            Some(p) => self.tile_out[p].min(cur).min(self.rule.blend),
        })
    }

    /// Rows of tile `i - 1`'s output that the blend into tile `i` reads:
    /// its *last* `blend_with_prev(i)` rows (empty for the first tile).
    ///
    /// This is what a rank needs from its neighbour; those rows may lie past
    /// the neighbour's kept part, and may themselves have been blended.
    #[must_use]
    pub fn blend_source(&self, i: usize) -> Option<Range<usize>> {
        let e = self.blend_with_prev(i)?;
        Some(match i.checked_sub(1) {
            None => 0..0,
            Some(p) => self.tile_out[p] - e..self.tile_out[p],
        })
    }

    /// Kept length of tile `i`: `min(keep, out[i])`.
    #[must_use]
    pub fn kept(&self, i: usize) -> Option<usize> {
        self.tile_out.get(i).map(|&out| self.rule.keep.min(out))
    }

    /// Offset of tile `i`'s kept part in the concatenation (before the final
    /// crop): the sum of the previous kept lengths.
    #[must_use]
    pub fn output_offset(&self, i: usize) -> Option<usize> {
        (i < self.count()).then(|| self.offsets[i])
    }

    /// Length of the concatenation of all kept parts, before the final crop.
    #[must_use]
    pub fn concat_extent(&self) -> usize {
        self.offsets.last().copied().unwrap_or(0)
    }

    /// Length of the merged output: the concatenation, cut to the final crop
    /// if there is one (Python slicing never pads, hence the `min`).
    #[must_use]
    pub fn output_extent(&self) -> usize {
        let concat = self.concat_extent();
        self.rule.final_crop.map_or(concat, |crop| concat.min(crop))
    }

    /// For every tile (index-aligned), which part of its output lands where
    /// in the final output. The final crop can shorten or empty the segments
    /// of trailing tiles; such tiles still get an (empty) entry.
    #[must_use]
    pub fn crop_segments(&self) -> Vec<CropSegment> {
        (0..self.count()).filter_map(|tile| self.crop_segment(tile)).collect()
    }

    /// The [`CropSegment`] of tile `i` alone.
    #[must_use]
    pub fn crop_segment(&self, i: usize) -> Option<CropSegment> {
        if i >= self.count() {
            return None;
        }
        let end = self.output_extent();
        let start = self.offsets[i].min(end);
        let stop = self.offsets[i + 1].min(end);
        Some(CropSegment { tile: i, src: 0..stop - start, dst: start..stop })
    }
}

/// Input tiling and output merge of one axis, checked to agree on the tile
/// count.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct AxisPlan {
    tiling: AxisTiling,
    merge: AxisMerge,
}

impl AxisPlan {
    /// Pairs a tiling with its merge plan; they must have as many tiles.
    pub fn new(tiling: AxisTiling, merge: AxisMerge) -> Result<Self, PlanError> {
        if tiling.count() != merge.count() {
            return Err(PlanError::tiling(format!(
                "{} input tiles but {} tile output extents",
                tiling.count(),
                merge.count()
            )));
        }
        Ok(Self { tiling, merge })
    }

    /// Plan whose tile outputs are `out_extent(input_len)` long.
    pub fn with_output_fn(
        tiling: AxisTiling,
        rule: MergeRule,
        mut out_extent: impl FnMut(usize) -> usize,
    ) -> Result<Self, PlanError> {
        let outs = (0..tiling.count()).filter_map(|i| tiling.input_range(i)).map(|r| out_extent(r.len())).collect();
        Self::new(tiling, AxisMerge::new(outs, rule)?)
    }

    /// Plan whose tile outputs are `input_len * scale` long (a decoder with
    /// an integer upscale factor).
    pub fn with_scale(tiling: AxisTiling, rule: MergeRule, scale: usize) -> Result<Self, PlanError> {
        // Every tile is at most `tile` long, so checking the largest product
        // once makes the per-tile multiplications below overflow-free.
        tiling
            .tile()
            .min(tiling.extent())
            .checked_mul(scale)
            .ok_or_else(|| PlanError::tiling("tile output extent overflows usize"))?;
        Self::with_output_fn(tiling, rule, |len| len * scale)
    }

    /// The input side.
    #[must_use]
    pub fn tiling(&self) -> &AxisTiling {
        &self.tiling
    }

    /// The output side.
    #[must_use]
    pub fn merge(&self) -> &AxisMerge {
        &self.merge
    }

    /// Number of tiles along this axis.
    #[must_use]
    pub fn count(&self) -> usize {
        self.tiling.count()
    }

    /// Length of the merged output along this axis.
    #[must_use]
    pub fn output_extent(&self) -> usize {
        self.merge.output_extent()
    }
}

/// One tile of a [`TileLayout2d`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Tile2d {
    /// Row-major id, `i * cols + j`.
    pub tile_id: usize,
    /// `[i, j]`: row and column on the grid.
    pub coord: [usize; 2],
    /// Input ranges `[rows, cols]` along the two tiled axes.
    pub input: [Range<usize>; 2],
    /// Input area, the balancing weight (saturates at `u64::MAX`).
    pub workload: u64,
}

/// A 2-D tiling: the product of a row plan and a column plan.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TileLayout2d {
    /// Plan along the height axis.
    pub rows: AxisPlan,
    /// Plan along the width axis.
    pub cols: AxisPlan,
}

impl TileLayout2d {
    /// Combines two axis plans.
    #[must_use]
    pub fn new(rows: AxisPlan, cols: AxisPlan) -> Self {
        Self { rows, cols }
    }

    /// `[rows, cols]` tile counts.
    #[must_use]
    pub fn grid_shape(&self) -> [usize; 2] {
        [self.rows.count(), self.cols.count()]
    }

    /// Total number of tiles.
    #[must_use]
    pub fn tile_count(&self) -> usize {
        self.rows.count() * self.cols.count()
    }

    /// `[height, width]` of the input.
    #[must_use]
    pub fn input_shape(&self) -> [usize; 2] {
        [self.rows.tiling().extent(), self.cols.tiling().extent()]
    }

    /// `[height, width]` of the merged output.
    #[must_use]
    pub fn output_shape(&self) -> [usize; 2] {
        [self.rows.output_extent(), self.cols.output_extent()]
    }

    /// Tile `tile_id` (row-major), or `None` past the last one.
    #[must_use]
    pub fn tile(&self, tile_id: usize) -> Option<Tile2d> {
        let cols = self.cols.count();
        if cols == 0 || tile_id >= self.tile_count() {
            return None;
        }
        let coord = [tile_id / cols, tile_id % cols];
        let input = [self.rows.tiling().input_range(coord[0])?, self.cols.tiling().input_range(coord[1])?];
        let workload = (input[0].len() as u64).saturating_mul(input[1].len() as u64);
        Some(Tile2d { tile_id, coord, input, workload })
    }

    /// All tiles in row-major order, the order diffusers decodes and blends
    /// them in.
    pub fn tiles(&self) -> impl ExactSizeIterator<Item = Tile2d> + '_ {
        (0..self.tile_count()).filter_map(|id| self.tile(id)).collect::<Vec<_>>().into_iter()
    }

    /// Where tile `[i, j]`'s output lands: `[row segment, column segment]`.
    #[must_use]
    pub fn placement(&self, coord: [usize; 2]) -> Option<[CropSegment; 2]> {
        Some([self.rows.merge().crop_segment(coord[0])?, self.cols.merge().crop_segment(coord[1])?])
    }

    /// Executor tasks for every tile, with the payload built by `payload`.
    pub fn to_tasks<T>(&self, mut payload: impl FnMut(&Tile2d) -> T) -> Vec<TileTask<T>> {
        self.tiles()
            .map(|tile| {
                let grid_coord: GridCoord = tile.coord.to_vec();
                TileTask::new(tile.tile_id, grid_coord, payload(&tile), tile.workload)
            })
            .collect()
    }
}

/// Python's `int(x)` for the non-negative floats the tiling formulas produce.
fn py_int(x: f64, what: &str) -> Result<usize, PlanError> {
    // `usize::MAX as f64` rounds up to 2^64, hence the strict bound.
    if x.is_finite() && x >= 0.0 && x < usize::MAX as f64 {
        // `as` truncates toward zero, exactly like Python's `int(float)`.
        Ok(x as usize)
    } else {
        Err(PlanError::tiling(format!("{what} = {x} is not a valid size")))
    }
}

/// Tiling of diffusers' `AutoencoderKL` family (SD, FLUX.1, Z-Image,
/// FLUX.2): square tiles, overlap given as a fraction, no final crop.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AutoencoderKlTiling {
    /// Tile size in sample (pixel) space.
    pub tile_sample_min_size: usize,
    /// Tile size in latent space.
    pub tile_latent_min_size: usize,
    /// Fraction of a tile that overlaps its neighbour (0.25 in diffusers).
    pub tile_overlap_factor: f64,
}

impl AutoencoderKlTiling {
    /// diffusers' default `tile_overlap_factor`.
    pub const DEFAULT_OVERLAP_FACTOR: f64 = 0.25;

    /// The attributes diffusers derives from the model config:
    /// `tile_sample_min_size = sample_size`,
    /// `tile_latent_min_size = int(sample_size / 2 ** (n - 1))` with
    /// `n = len(block_out_channels)`, overlap 0.25.
    #[must_use]
    pub fn from_config(sample_size: usize, num_block_out_channels: usize) -> Self {
        // Python divides as floats: reproduce that rather than shifting, so
        // odd sizes and `n == 0` (a factor of 0.5) truncate the same way.
        // Exponents beyond f64's range give 0 in both languages.
        let exponent = i32::try_from(num_block_out_channels).unwrap_or(i32::MAX) - 1;
        let latent = sample_size as f64 / 2f64.powi(exponent);
        Self {
            tile_sample_min_size: sample_size,
            tile_latent_min_size: py_int(latent, "tile_latent_min_size").unwrap_or(0),
            tile_overlap_factor: Self::DEFAULT_OVERLAP_FACTOR,
        }
    }

    /// Whether diffusers takes the tiled decode path for a latent of this
    /// size (it only tiles inputs larger than one tile).
    #[must_use]
    pub fn needs_tiling_decode(&self, latent_h: usize, latent_w: usize) -> bool {
        latent_h > self.tile_latent_min_size || latent_w > self.tile_latent_min_size
    }

    /// Whether diffusers takes the tiled encode path for a sample of this
    /// size.
    #[must_use]
    pub fn needs_tiling_encode(&self, sample_h: usize, sample_w: usize) -> bool {
        sample_h > self.tile_sample_min_size || sample_w > self.tile_sample_min_size
    }

    fn overlap(&self) -> Result<f64, PlanError> {
        let f = self.tile_overlap_factor;
        if f.is_finite() && f >= 0.0 {
            Ok(f)
        } else {
            Err(PlanError::tiling(format!("tile_overlap_factor {f} must be finite and non-negative")))
        }
    }

    /// `int(size * (1 - f))`: the loop stride, in the units of `size`.
    fn stride_of(&self, size: usize, what: &str) -> Result<usize, PlanError> {
        // Same operation order as Python: `1 - f` first, then the product.
        py_int(size as f64 * (1.0 - self.overlap()?), what)
    }

    /// Blend `int(out_tile * f)` and keep `out_tile - blend`, in output units.
    fn rule_of(&self, out_tile: usize) -> Result<MergeRule, PlanError> {
        let blend = py_int(out_tile as f64 * self.overlap()?, "blend_extent")?;
        let keep =
            out_tile.checked_sub(blend).ok_or_else(|| PlanError::tiling("blend extent exceeds the tile size"))?;
        Ok(MergeRule { blend, keep, final_crop: None })
    }

    /// Decode loop stride in latent elements (diffusers' `overlap_size`).
    pub fn decode_stride(&self) -> Result<usize, PlanError> {
        self.stride_of(self.tile_latent_min_size, "decode overlap_size")
    }

    /// Decode merge rule, in sample elements (`blend_extent`, `row_limit`).
    pub fn decode_rule(&self) -> Result<MergeRule, PlanError> {
        self.rule_of(self.tile_sample_min_size)
    }

    /// Encode loop stride in sample elements.
    pub fn encode_stride(&self) -> Result<usize, PlanError> {
        self.stride_of(self.tile_sample_min_size, "encode overlap_size")
    }

    /// Encode merge rule, in latent elements.
    pub fn encode_rule(&self) -> Result<MergeRule, PlanError> {
        self.rule_of(self.tile_latent_min_size)
    }

    /// Layout of `tiled_decode` on a `latent_h x latent_w` latent; each tile
    /// decodes to `scale` (= `2 ** (n - 1)`) times its latent size.
    pub fn decode_layout(&self, latent_h: usize, latent_w: usize, scale: usize) -> Result<TileLayout2d, PlanError> {
        let (tile, stride, rule) = (self.tile_latent_min_size, self.decode_stride()?, self.decode_rule()?);
        let axis = |extent| AxisPlan::with_scale(AxisTiling::new(extent, tile, stride)?, rule, scale);
        Ok(TileLayout2d::new(axis(latent_h)?, axis(latent_w)?))
    }

    /// Layout of `_tiled_encode` on a `sample_h x sample_w` sample; a tile
    /// of input length `n` encodes to `out_extent(n)` latent elements (e.g.
    /// `n / 8` for the SD encoder).
    pub fn encode_layout(
        &self,
        sample_h: usize,
        sample_w: usize,
        out_extent: impl Fn(usize) -> usize,
    ) -> Result<TileLayout2d, PlanError> {
        let (tile, stride, rule) = (self.tile_sample_min_size, self.encode_stride()?, self.encode_rule()?);
        let axis = |extent| AxisPlan::with_output_fn(AxisTiling::new(extent, tile, stride)?, rule, &out_extent);
        Ok(TileLayout2d::new(axis(sample_h)?, axis(sample_w)?))
    }
}

/// Tiling of diffusers' `AutoencoderKLWan` / `AutoencoderKLQwenImage`:
/// tile and stride given in sample pixels, final crop to the exact size.
///
/// With `patch_size = Some(p)` (Wan2.2) the decoder emits patchified tiles
/// and the merge runs in patchified space; see [`WanTiling::decode_layout`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WanTiling {
    /// Tile height in sample pixels.
    pub tile_sample_min_height: usize,
    /// Tile width in sample pixels.
    pub tile_sample_min_width: usize,
    /// Vertical tile stride in sample pixels.
    pub tile_sample_stride_height: usize,
    /// Horizontal tile stride in sample pixels.
    pub tile_sample_stride_width: usize,
    /// The model's `spatial_compression_ratio` (8 for Wan2.1 / Qwen-Image,
    /// 16 for Wan2.2), i.e. sample pixels per latent pixel.
    pub spatial_compression_ratio: usize,
    /// Wan2.2's `patch_size`, `None` for unpatchified models.
    pub patch_size: Option<usize>,
}

impl WanTiling {
    /// diffusers' default `tile_sample_min_height` / `_width`.
    pub const DEFAULT_TILE_SAMPLE_MIN: usize = 256;
    /// diffusers' default `tile_sample_stride_height` / `_width`.
    pub const DEFAULT_TILE_SAMPLE_STRIDE: usize = 192;

    /// diffusers' default tiling (256 tiles, 192 stride) for a model with
    /// the given compression ratio and patch size.
    #[must_use]
    pub fn new(spatial_compression_ratio: usize, patch_size: Option<usize>) -> Self {
        Self {
            tile_sample_min_height: Self::DEFAULT_TILE_SAMPLE_MIN,
            tile_sample_min_width: Self::DEFAULT_TILE_SAMPLE_MIN,
            tile_sample_stride_height: Self::DEFAULT_TILE_SAMPLE_STRIDE,
            tile_sample_stride_width: Self::DEFAULT_TILE_SAMPLE_STRIDE,
            spatial_compression_ratio,
            patch_size,
        }
    }

    fn ratio(&self) -> Result<usize, PlanError> {
        match self.spatial_compression_ratio {
            0 => Err(PlanError::tiling("spatial_compression_ratio must be positive")),
            r => Ok(r),
        }
    }

    fn patch(&self) -> Result<Option<usize>, PlanError> {
        match self.patch_size {
            Some(0) => Err(PlanError::tiling("patch_size must be positive")),
            p => Ok(p),
        }
    }

    /// `[height, width]` of a tile in latent elements
    /// (`tile_sample_min // ratio`).
    pub fn tile_latent_min(&self) -> Result<[usize; 2], PlanError> {
        let r = self.ratio()?;
        Ok([self.tile_sample_min_height / r, self.tile_sample_min_width / r])
    }

    /// `[height, width]` of the decode stride in latent elements
    /// (`tile_sample_stride // ratio`).
    pub fn tile_latent_stride(&self) -> Result<[usize; 2], PlanError> {
        let r = self.ratio()?;
        Ok([self.tile_sample_stride_height / r, self.tile_sample_stride_width / r])
    }

    /// Whether diffusers takes the tiled decode path: latent width or height
    /// above `tile_sample_min // spatial_compression_ratio`.
    ///
    /// For Wan2.2 diffusers compares against the *unpatchified* ratio (16),
    /// and so do we: this predicate mirrors `_decode`, not the merge space.
    pub fn needs_tiling_decode(&self, latent_h: usize, latent_w: usize) -> Result<bool, PlanError> {
        let [min_h, min_w] = self.tile_latent_min()?;
        Ok(latent_w > min_w || latent_h > min_h)
    }

    /// Whether diffusers takes the tiled encode path: sample width or height
    /// above `tile_sample_min`. `sample_h`/`sample_w` are the *unpatchified*
    /// video dimensions, as `_encode` reads them before patchifying.
    #[must_use]
    pub fn needs_tiling_encode(&self, sample_h: usize, sample_w: usize) -> bool {
        sample_w > self.tile_sample_min_width || sample_h > self.tile_sample_min_height
    }

    /// Layout of `tiled_decode` on a `latent_h x latent_w` latent.
    ///
    /// Latent tiles of `tile_sample_min // ratio` every
    /// `tile_sample_stride // ratio`. Without patching, tile outputs are
    /// `latent * ratio`, blend `tile_sample_min - tile_sample_stride`, keep
    /// `tile_sample_stride`, crop to `latent_extent * ratio`. With patch size
    /// `p`, the same quantities in patchified space: outputs
    /// `latent * ratio / p`, blend `tile_sample_min // p -
    /// tile_sample_stride // p`, keep `tile_sample_stride // p`, crop
    /// `latent_extent * ratio // p` (unpatchify happens after the merge).
    ///
    /// A negative Python blend (stride larger than the tile) makes
    /// `range(blend)` empty, i.e. no blending; it is reproduced as 0.
    pub fn decode_layout(&self, latent_h: usize, latent_w: usize) -> Result<TileLayout2d, PlanError> {
        let [tile_h, tile_w] = self.tile_latent_min()?;
        let [stride_h, stride_w] = self.tile_latent_stride()?;
        let rows =
            self.decode_axis(latent_h, tile_h, stride_h, self.tile_sample_min_height, self.tile_sample_stride_height)?;
        let cols =
            self.decode_axis(latent_w, tile_w, stride_w, self.tile_sample_min_width, self.tile_sample_stride_width)?;
        Ok(TileLayout2d::new(rows, cols))
    }

    fn decode_axis(
        &self,
        latent_extent: usize,
        latent_tile: usize,
        latent_stride: usize,
        sample_tile: usize,
        sample_stride: usize,
    ) -> Result<AxisPlan, PlanError> {
        let ratio = self.ratio()?;
        let sample =
            latent_extent.checked_mul(ratio).ok_or_else(|| PlanError::tiling("sample size overflows usize"))?;
        let (scale, rule) = match self.patch()? {
            None => (
                ratio,
                MergeRule {
                    blend: sample_tile.saturating_sub(sample_stride),
                    keep: sample_stride,
                    final_crop: Some(sample),
                },
            ),
            Some(p) => {
                if ratio % p != 0 {
                    return Err(PlanError::tiling(format!(
                        "spatial_compression_ratio {ratio} is not a multiple of patch_size {p}"
                    )));
                }
                (
                    ratio / p,
                    MergeRule {
                        blend: (sample_tile / p).saturating_sub(sample_stride / p),
                        keep: sample_stride / p,
                        final_crop: Some(sample / p),
                    },
                )
            }
        };
        let tiling = AxisTiling::new(latent_extent, latent_tile, latent_stride)?;
        AxisPlan::with_scale(tiling, rule, scale)
    }

    /// The encoder's compression ratio on the input `tiled_encode` tiles:
    /// `spatial_compression_ratio / p` with patching (the input is already
    /// patchified), else the ratio itself.
    pub fn encode_compression_ratio(&self) -> Result<usize, PlanError> {
        let ratio = self.ratio()?;
        match self.patch()? {
            None => Ok(ratio),
            Some(p) if ratio % p == 0 => Ok(ratio / p),
            Some(p) => {
                Err(PlanError::tiling(format!("spatial_compression_ratio {ratio} is not a multiple of patch_size {p}")))
            }
        }
    }

    /// Layout of `tiled_encode` with [`WanTiling::encode_compression_ratio`];
    /// see [`WanTiling::encode_layout_with_ratio`].
    pub fn encode_layout(
        &self,
        sample_h: usize,
        sample_w: usize,
        out_extent: impl Fn(usize) -> usize,
    ) -> Result<TileLayout2d, PlanError> {
        self.encode_layout_with_ratio(sample_h, sample_w, self.encode_compression_ratio()?, out_extent)
    }

    /// Layout of `tiled_encode` on the `sample_h x sample_w` input it tiles
    /// (patchified when the model patches), with encoder ratio `ratio`.
    ///
    /// The pixel loop steps `tile_sample_stride` with tiles of
    /// `tile_sample_min` — *not* divided by the patch size even though the
    /// input is patchified (a diffusers quirk kept on purpose). The merge
    /// works in latents: blend `tile_sample_min // ratio -
    /// tile_sample_stride // ratio`, keep `tile_sample_stride // ratio`,
    /// crop to `sample // ratio`. A tile of input length `n` encodes to
    /// `out_extent(n)` latent elements.
    pub fn encode_layout_with_ratio(
        &self,
        sample_h: usize,
        sample_w: usize,
        ratio: usize,
        out_extent: impl Fn(usize) -> usize,
    ) -> Result<TileLayout2d, PlanError> {
        if ratio == 0 {
            return Err(PlanError::tiling("encode compression ratio must be positive"));
        }
        let axis = |extent: usize, tile: usize, stride: usize| {
            let rule = MergeRule {
                blend: (tile / ratio).saturating_sub(stride / ratio),
                keep: stride / ratio,
                final_crop: Some(extent / ratio),
            };
            AxisPlan::with_output_fn(AxisTiling::new(extent, tile, stride)?, rule, &out_extent)
        };
        Ok(TileLayout2d::new(
            axis(sample_h, self.tile_sample_min_height, self.tile_sample_stride_height)?,
            axis(sample_w, self.tile_sample_min_width, self.tile_sample_stride_width)?,
        ))
    }
}
