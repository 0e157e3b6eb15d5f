//! A synthetic tile operator: a stand-in for a VAE decoder that exercises the executor, the
//! transports and the diffusers merge without a model, for the CLI `demo` and the tests (feature
//! `synthetic`; not compiled into the library otherwise).
//!
//! Each tile is upsampled by `scale` (nearest), doubled, and shifted by `tile_id ×
//! tile_offset`, so overlapping tiles disagree and the blend visibly matters; tiles are merged
//! with [`crate::stitch::stitch_layout`] using Wan-style geometry (blend the overlap, keep the
//! stride, crop to the full size).

use std::ops::Range;
use std::time::Duration;

use vae_planner::{AxisTiling, GridSpec, MergeRule, TileTask};
use vae_tensor::{DType, Device, Tensor};

use crate::stitch::{StitchLayout, StitchSpec, stitch_layout};
use crate::{OperatorError, TileMap, TileOperator, TilePlan};

/// The synthetic "decoder" (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct SyntheticDecoder {
    /// Tile extent in input units.
    pub tile: usize,
    /// Tile stride in input units (`< tile` for overlapping tiles).
    pub stride: usize,
    /// Output units per input unit.
    pub scale: usize,
    /// Added to every output element, per tile id.
    pub tile_offset: f32,
    /// Extra time each tile takes, to make the work visible in reports.
    pub work_per_tile: Duration,
}

impl Default for SyntheticDecoder {
    /// Wan-like geometry: 32-unit tiles every 24 units, 8× output.
    fn default() -> Self {
        Self { tile: 32, stride: 24, scale: 8, tile_offset: 1.0 / 64.0, work_per_tile: Duration::ZERO }
    }
}

impl SyntheticDecoder {
    fn stitch_spec(&self, rank: usize, extents: [usize; 2]) -> StitchSpec {
        let rule = |extent: usize| MergeRule {
            blend: (self.tile - self.stride.min(self.tile)) * self.scale,
            keep: self.stride * self.scale,
            final_crop: Some(extent * self.scale),
        };
        StitchSpec { dims: [rank - 2, rank - 1], rules: [rule(extents[0]), rule(extents[1])] }
    }

    /// What one tile computes, also usable directly to build a serial reference.
    pub fn tile_output(
        &self,
        input: &Tensor,
        rows: Range<usize>,
        cols: Range<usize>,
        tile_id: usize,
    ) -> Result<Tensor, OperatorError> {
        let r = input.rank();
        let tile = input.narrow(r - 2, rows.start, rows.len())?.narrow(r - 1, cols.start, cols.len())?;
        Ok(tile.upsample_nearest2d(self.scale)?.affine(2.0, tile_id as f32 * self.tile_offset)?)
    }
}

impl TileOperator for SyntheticDecoder {
    type Payload = [Range<usize>; 2];
    type TileSpec = StitchLayout;

    fn split(&self, input: &Tensor) -> Result<TilePlan<Self::Payload, StitchLayout>, OperatorError> {
        let r = input.rank();
        if r < 2 {
            return Err(format!("synthetic decoder needs at least 2 dimensions, got shape {}", input.shape()).into());
        }
        let (h, w) = (input.dims()[r - 2], input.dims()[r - 1]);
        let rows = AxisTiling::new(h, self.tile, self.stride)?;
        let cols = AxisTiling::new(w, self.tile, self.stride)?;
        let mut tasks = Vec::with_capacity(rows.count() * cols.count());
        for i in 0..rows.count() {
            for j in 0..cols.count() {
                let (rr, cr) = (rows.input_range(i).expect("in range"), cols.input_range(j).expect("in range"));
                let workload = (rr.len() * cr.len()) as u64;
                tasks.push(TileTask::new(tasks.len(), vec![i, j], [rr, cr], workload));
            }
        }
        let grid = GridSpec {
            split_dims: vec![r - 2, r - 1],
            grid_shape: vec![rows.count(), cols.count()],
            tile_spec: StitchLayout {
                spec: self.stitch_spec(r, [h, w]),
                tile_extents: [rows, cols].map(|axis| {
                    (0..axis.count()).map(|i| axis.input_range(i).map_or(0, |r| r.len() * self.scale)).collect()
                }),
            },
            output_dtype: Some(DType::F32),
        };
        Ok(TilePlan { tasks, grid })
    }

    fn exec(&self, input: &Tensor, task: &TileTask<Self::Payload>) -> Result<Tensor, OperatorError> {
        if !self.work_per_tile.is_zero() {
            std::thread::sleep(self.work_per_tile);
        }
        let [rows, cols] = &task.payload;
        self.tile_output(input, rows.clone(), cols.clone(), task.tile_id)
    }

    fn merge(&self, tiles: TileMap, grid: &GridSpec<StitchLayout, DType>) -> Result<Tensor, OperatorError> {
        Ok(stitch_layout(tiles, &grid.tile_spec)?)
    }

    fn stitch_layout<'g>(&self, grid: &'g GridSpec<StitchLayout, DType>) -> Option<&'g StitchLayout> {
        Some(&grid.tile_spec)
    }

    fn device(&self) -> Device {
        Device::Cpu
    }
}
