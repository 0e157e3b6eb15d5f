//! The 2-D spatial-shard strategy: a model's [`ShardOperator`] on blocks of an `R × C` grid,
//! one per rank, with halo exchanges along both axes inside the computation (corners
//! included, [`ShardContext::with_halo`]); the output blocks gathered to the owner, put in
//! their places and finished there. Exact, as the 1-D shard: the output is the direct
//! computation's, bit for bit.

use std::ops::Range;
use std::time::Instant;

use vae_planner::{BlockGrid, ShardAxis};
use vae_tensor::Tensor;
use vae_transport::CommunicatorExt;
use vae_transport::wire::Reader;

use super::failure::Failure;
use super::report::{PhaseTimings, StrategyReport};
use super::sharded::{band_message, exec_part};
use super::{DistributedVaeExecutor, OWNER, RankWork, RequestStrategy, guarded, read_tensor_header};
use crate::shard::{ShardContext, ShardOperator, ShardTraffic};
use crate::{FailureKind, RuntimeError, Stage};

/// The block strategy of one request: `grid` is `[R, C]`.
pub(super) struct BlockStrategy<'o, O> {
    pub(super) op: &'o O,
    pub(super) grid: [usize; 2],
}

/// The blocks of a request, in units of `unit` input rows and columns.
#[derive(Debug, Clone)]
pub(super) struct BlockPlan {
    pub(super) grid: BlockGrid,
    pub(super) unit: usize,
}

impl<O: ShardOperator> RequestStrategy for BlockStrategy<'_, O> {
    type Plan = BlockPlan;
    /// This rank's output block (`None` beyond the grid).
    type Local = Option<Tensor>;

    /// Blocks from the input alone: no narrower than the operator's widest halo along either
    /// axis, cut between whole units, one per rank of the grid.
    fn plan(&self, exec: &DistributedVaeExecutor, input: &Tensor) -> Result<BlockPlan, Failure> {
        let [r, c] = self.grid;
        if !self.op.splits_blocks() {
            return Err(Failure::new(
                FailureKind::Unsupported,
                "this model cannot shard a 2-D grid of blocks yet (shard along the height or the width)".to_string(),
            ));
        }
        if r.checked_mul(c).is_none_or(|n| n > exec.parallel_size) {
            return Err(Failure::new(
                FailureKind::InvalidInput,
                format!(
                    "a {r} × {c} grid of blocks needs {} ranks; the parallel size is {}",
                    r.saturating_mul(c),
                    exec.parallel_size
                ),
            ));
        }
        let mut extents = [0; 2];
        let mut min_block = [0; 2];
        let mut units = [1; 2];
        for (a, axis) in [ShardAxis::Height, ShardAxis::Width].into_iter().enumerate() {
            let geometry = guarded(|| self.op.geometry(input, axis))?;
            let dim = axis
                .dim_in(input.rank())
                .ok_or_else(|| format!("cannot shard the {axis} of an input of shape {}", input.shape()))?;
            let unit = geometry.unit.max(1);
            units[a] = unit;
            let extent = input.dims()[dim];
            if !extent.is_multiple_of(unit) {
                return Err(format!("an input {axis} of {extent} is not a whole number of bands of {unit}").into());
            }
            extents[a] = extent / unit;
            min_block[a] = geometry.min_band;
        }
        // The context cuts both axes in one unit (the encoders halve H and W alike).
        if units[0] != units[1] {
            let message = format!("blocks of {} rows by {} columns per latent pixel", units[0], units[1]);
            return Err(Failure::new(FailureKind::Unsupported, message));
        }
        let grid = BlockGrid::new(extents, self.grid, min_block).map_err(|e| e.to_string())?;
        Ok(BlockPlan { grid, unit: units[0] })
    }

    fn plan_size(plan: &BlockPlan) -> usize {
        let [h, w] = plan.grid.extents();
        h * w * plan.unit * plan.unit
    }

    fn disagreement(sizes: &[usize]) -> Option<String> {
        sizes.iter().any(|e| *e != sizes[0]).then(|| format!("ranks planned blocks over different extents: {sizes:?}"))
    }

    /// This rank's block; the communication inside is timed separately. A failure here aborts
    /// the group: the neighbours may be waiting for this rank's halo.
    fn compute(
        &self,
        exec: &DistributedVaeExecutor,
        input: &Tensor,
        plan: &BlockPlan,
        timings: &mut PhaseTimings,
    ) -> Result<(Option<Tensor>, RankWork), RuntimeError> {
        let clock = Instant::now();
        let rank = exec.comm.rank();
        let block = plan.grid.block(rank);
        let (local, traffic) = match block {
            None => (None, ShardTraffic::default()),
            Some(_) => {
                let ctx = ShardContext::blocks(exec.comm.as_ref(), plan.grid.clone(), rank)
                    .with_unit(plan.unit)
                    .with_overlap(exec.halo_overlap);
                let (out, traffic) = exec_part(self.op, exec, input, ctx)?;
                (Some(out), traffic)
            }
        };
        timings.halo = traffic.comm_time();
        timings.exec = clock.elapsed().saturating_sub(timings.halo);
        tracing::debug!(rank, ?block, elapsed = ?timings.exec, halo = ?timings.halo, "computed block");
        let work = RankWork {
            tile_count: 0,
            tiles: Vec::new(),
            workload: block.as_ref().map_or(0, |[h, w]| (h.len() * w.len()) as u64),
            strategy: StrategyReport::Blocks { grid: plan.grid.grid(), block, traffic },
        };
        Ok((local, work))
    }

    /// Gathers the blocks to the owner, each with its shape; assembles and finishes there.
    fn collect(
        &self,
        exec: &DistributedVaeExecutor,
        _: &Tensor,
        plan: &BlockPlan,
        local: Option<Tensor>,
        timings: &mut PhaseTimings,
    ) -> Result<Option<Result<Tensor, RuntimeError>>, RuntimeError> {
        let comm = exec.comm.as_ref();
        let clock = Instant::now();
        let message = band_message(local.as_ref(), comm.rank())?;
        let gathered = comm.gather(OWNER, message.as_slice())?;
        drop(message);
        timings.gather = clock.elapsed();

        let clock = Instant::now();
        let merged = gathered.map(|parts| {
            local
                .ok_or_else(|| "the owner computed no block".to_string())
                .and_then(|own| assemble_blocks(own, &parts.parts().collect::<Vec<_>>(), &plan.grid))
                .map_err(Failure::from)
                .and_then(|full| guarded(|| self.op.finish(full)))
                .map_err(|failure| failure.at(Stage::Merge, OWNER))
        });
        timings.merge = clock.elapsed();
        Ok(merged)
    }
}

/// The owner's output block and the other ranks' gathered blocks, each put in its place; every
/// block must have the owner's shape except along H and W, where it has its own block's share
/// of the owner's scale.
pub(super) fn assemble_blocks(own: Tensor, parts: &[&[u8]], grid: &BlockGrid) -> Result<Tensor, String> {
    let rank = own.rank();
    let dims = [ShardAxis::Height, ShardAxis::Width].map(|a| a.dim_in(rank));
    let [Some(hd), Some(wd)] = dims else { return Err("the output has no height and width".into()) };
    let own_block = grid.block(OWNER).ok_or("the owner holds no block")?;
    let scale = |dim: usize, band: &Range<usize>| -> Result<usize, String> {
        let local = own.dims()[dim];
        if local == 0 || !local.is_multiple_of(band.len()) {
            return Err(format!(
                "the owner's output block of {local} is not a multiple of its input block {}",
                band.len()
            ));
        }
        Ok(local / band.len())
    };
    let (sh, sw) = (scale(hd, &own_block[0])?, scale(wd, &own_block[1])?);
    let [eh, ew] = grid.extents();
    let mut whole = own.dims().to_vec();
    whole[hd] = eh * sh;
    whole[wd] = ew * sw;
    let mut out = Tensor::zeros(whole, own.dtype(), &own.device()).map_err(|e| e.to_string())?;
    let origin = vec![0; rank];
    let place = |out: &mut Tensor, r: usize, block: &Tensor| -> Result<(), String> {
        let [rows, cols] = grid.block(r).ok_or("a rank beyond the grid")?;
        let mut at = origin.clone();
        at[hd] = rows.start * sh;
        at[wd] = cols.start * sw;
        out.copy_box_from(&at, block, &origin, block.dims()).map_err(|e| e.to_string())
    };
    place(&mut out, OWNER, &own)?;
    for (r, part) in parts.iter().enumerate().take(grid.ranks()).skip(1) {
        let [rows, cols] = grid.block(r).ok_or("a rank beyond the grid")?;
        let mut rd = Reader::new(part, "output block");
        let parsed = (|| -> Result<Tensor, RuntimeError> {
            if rd.u8()? != 1 {
                return Err(RuntimeError::Protocol("no block".into()));
            }
            let (dtype, dims) = read_tensor_header(&mut rd)?;
            let mut expected = own.dims().to_vec();
            expected[hd] = rows.len() * sh;
            expected[wd] = cols.len() * sw;
            if dims != expected || dtype != own.dtype() {
                return Err(RuntimeError::Protocol(format!("block of shape {dims:?}, expected {expected:?}")));
            }
            Ok(Tensor::from_bytes(dtype, dims, rd.rest(), &own.device())?)
        })();
        let block = parsed.map_err(|e| format!("rank {r}'s output block: {e}"))?;
        place(&mut out, r, &block)?;
    }
    Ok(out)
}
