//! The spatial-shard strategy: a model's [`ShardOperator`] on bands of the input, one per rank,
//! with halo exchanges between neighbours inside the computation ([`ShardContext`]); the output
//! bands gathered to the owner, concatenated in rank order and finished there.

use std::time::Instant;

use vae_planner::{BandPartition, ShardAxis};
use vae_tensor::Tensor;
use vae_transport::CommunicatorExt;
use vae_transport::wire::{Reader, Writer};

use super::failure::Failure;
use super::report::{PhaseTimings, StrategyReport};
use super::{
    DistributedVaeExecutor, OWNER, RankWork, RequestStrategy, guarded, read_tensor_header, write_tensor_header,
};
use crate::shard::{ShardContext, ShardOperator, ShardTraffic};
use crate::{RuntimeError, Stage};

/// The shard strategy of one request.
pub(super) struct ShardStrategy<'o, O> {
    pub(super) op: &'o O,
    pub(super) axis: ShardAxis,
}

/// The bands of a request, in units of `unit` input rows.
#[derive(Debug, Clone)]
pub(super) struct BandPlan {
    pub(super) bands: BandPartition,
    pub(super) unit: usize,
}

impl<O: ShardOperator> RequestStrategy for ShardStrategy<'_, O> {
    type Plan = BandPlan;
    /// This rank's output band (`None` beyond the parallel size).
    type Local = Option<Tensor>;

    /// Bands from the input alone: no narrower than the operator's widest halo, cut between
    /// whole units.
    fn plan(&self, exec: &DistributedVaeExecutor, input: &Tensor) -> Result<BandPlan, Failure> {
        let axis = self.axis;
        guarded(|| self.op.geometry(input, axis)).and_then(|geometry| {
            let dim = axis
                .dim_in(input.rank())
                .ok_or_else(|| format!("cannot shard the {axis} of an input of shape {}", input.shape()))?;
            let (extent, unit) = (input.dims()[dim], geometry.unit.max(1));
            if !extent.is_multiple_of(unit) {
                return Err(format!("an input {axis} of {extent} is not a whole number of bands of {unit}").into());
            }
            let bands =
                BandPartition::new(extent / unit, exec.parallel_size, geometry.min_band).map_err(|e| e.to_string())?;
            Ok(BandPlan { bands, unit })
        })
    }

    fn plan_size(plan: &BandPlan) -> usize {
        plan.bands.extent() * plan.unit
    }

    fn disagreement(extents: &[usize]) -> Option<String> {
        extents
            .iter()
            .any(|e| *e != extents[0])
            .then(|| format!("ranks planned bands over different extents: {extents:?}"))
    }

    /// This rank's band; the communication inside is timed separately. A failure here aborts
    /// the group: the neighbours may be waiting for this rank's halo.
    fn compute(
        &self,
        exec: &DistributedVaeExecutor,
        input: &Tensor,
        plan: &BandPlan,
        timings: &mut PhaseTimings,
    ) -> Result<(Option<Tensor>, RankWork), RuntimeError> {
        let clock = Instant::now();
        let rank = exec.comm.rank();
        let band = plan.bands.band(rank);
        let (local, traffic) = match band {
            None => (None, ShardTraffic::default()),
            Some(_) => {
                let ctx = ShardContext::new(exec.comm.as_ref(), self.axis, plan.bands.clone(), rank)
                    .with_unit(plan.unit)
                    .with_overlap(exec.halo_overlap);
                let (out, traffic) = exec_part(self.op, exec, input, ctx)?;
                (Some(out), traffic)
            }
        };
        timings.halo = traffic.comm_time();
        timings.exec = clock.elapsed().saturating_sub(timings.halo);
        tracing::debug!(rank, ?band, elapsed = ?timings.exec, halo = ?timings.halo, "computed band");
        let work = RankWork {
            tile_count: 0,
            tiles: Vec::new(),
            workload: band.as_ref().map_or(0, |b| b.len() as u64),
            strategy: StrategyReport::Shard { axis: self.axis, band, traffic },
        };
        Ok((local, work))
    }

    /// Gathers the bands to the owner, each with its shape; assembles and finishes there.
    fn collect(
        &self,
        exec: &DistributedVaeExecutor,
        _: &Tensor,
        plan: &BandPlan,
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
        // The owner's band moves into the assembly (no copy); other ranks drop theirs here.
        let merged = gathered.map(|parts| {
            local
                .ok_or_else(|| "the owner computed no band".to_string())
                .and_then(|own| assemble_bands(own, &parts.parts().collect::<Vec<_>>(), self.axis, &plan.bands))
                .map_err(Failure::from)
                .and_then(|full| guarded(|| self.op.finish(full)))
                .map_err(|failure| failure.at(Stage::Merge, OWNER))
        });
        timings.merge = clock.elapsed();
        Ok(merged)
    }
}

/// What a rank sends the owner in a band gather: its output band with its shape (the owner
/// keeps its own; a rank without a band sends nothing), for [`assemble_bands`].
pub(super) fn band_message(band: Option<&Tensor>, rank: usize) -> Result<Writer, RuntimeError> {
    let mut message = Writer::new();
    match band {
        Some(out) if rank != OWNER => {
            write_tensor_header(message.u8(1), out.dtype(), out.dims()).bytes(out.as_bytes()?);
        }
        _ => {
            message.u8(0);
        }
    }
    Ok(message)
}

/// Runs `op` on this rank's band (or block) with `ctx`: its output, which must have the input's
/// rank, and the traffic inside. A failure aborts the group ([`abort_shard`]).
pub(super) fn exec_part<O: ShardOperator>(
    op: &O,
    exec: &DistributedVaeExecutor,
    input: &Tensor,
    mut ctx: ShardContext<'_>,
) -> Result<(Tensor, ShardTraffic), RuntimeError> {
    let rank = exec.comm.rank();
    let out = guarded(|| op.exec(input, &mut ctx));
    let traffic = ctx.traffic();
    match out {
        Ok(out) if out.rank() == input.rank() => Ok((out, traffic)),
        Ok(out) => {
            let message = format!("the shard's output has rank {}, the input has rank {}", out.rank(), input.rank());
            Err(abort_shard(exec, rank, message.into()))
        }
        Err(failure) => Err(abort_shard(exec, rank, failure)),
    }
}

/// A failure inside a sharded computation: the neighbours may be waiting for this rank's
/// halo, so the group is aborted and they fail fast with a transport error naming it.
pub(super) fn abort_shard(exec: &DistributedVaeExecutor, rank: usize, failure: Failure) -> RuntimeError {
    debug_assert_eq!(rank, exec.comm.rank());
    super::abort_at(exec, Stage::Shard, failure)
}

/// The owner's output band and the other ranks' gathered bands, concatenated along the axis
/// in rank order; every band must have the owner's shape except along the axis, where it has
/// its own band's share of the owner's scale.
pub(super) fn assemble_bands(
    own: Tensor,
    parts: &[&[u8]],
    axis: ShardAxis,
    bands: &BandPartition,
) -> Result<Tensor, String> {
    let dim = axis.dim_in(own.rank()).ok_or("the output has no such axis")?;
    let own_band = bands.bands()[OWNER].len();
    let local = own.dims()[dim];
    if local == 0 || !local.is_multiple_of(own_band) {
        return Err(format!("the owner's output band of {local} rows is not a multiple of its input band {own_band}"));
    }
    let scale = local / own_band;
    let mut tensors = Vec::with_capacity(bands.len());
    for (r, part) in parts.iter().enumerate().take(bands.len()).skip(1) {
        let mut rd = Reader::new(part, "output band");
        let parsed = (|| -> Result<Tensor, RuntimeError> {
            if rd.u8()? != 1 {
                return Err(RuntimeError::Protocol("no band".into()));
            }
            let (dtype, dims) = read_tensor_header(&mut rd)?;
            let mut expected = own.dims().to_vec();
            expected[dim] = bands.bands()[r].len() * scale;
            if dims != expected || dtype != own.dtype() {
                return Err(RuntimeError::Protocol(format!("band of shape {dims:?}, expected {expected:?}")));
            }
            Ok(Tensor::from_bytes(dtype, dims, rd.rest(), &own.device())?)
        })();
        tensors.push(parsed.map_err(|e| format!("rank {r}'s output band: {e}"))?);
    }
    let mut refs: Vec<&Tensor> = vec![&own];
    refs.extend(tensors.iter());
    Tensor::cat(&refs, dim).map_err(|e| e.to_string())
}
