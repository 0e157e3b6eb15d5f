//! What one request of [`DistributedVaeExecutor::run`] runs and where its output goes: a
//! [`Job`] is a strategy carrying the operator it runs (tiles, bands along an axis, blocks of
//! a 2-D grid, pipeline stages), an [`Output`] says whether the output is returned (to the
//! ranks a placement names) or streamed into a sink. Every strategy takes either output, so a
//! family picks the two independently.

use std::cell::RefCell;

use vae_planner::ShardAxis;
use vae_tensor::Tensor;

use super::blocked::BlockStrategy;
use super::pipelined::PipelineStrategy;
use super::report::{ExecOutput, OutputPlacement};
use super::sharded::ShardStrategy;
use super::streamed::{Cut, StreamedShardStrategy, StreamedTileStrategy};
use super::tile::{TileOperator, TileStrategy};
use super::{DistributedVaeExecutor, RequestStrategy};
use crate::RuntimeError;
use crate::pipeline::PipelineOperator;
use crate::shard::ShardOperator;
use crate::stream::FrameSink;

/// Where a request's output goes.
pub enum Output<'s> {
    /// Returned: the owner merges the output and gives it to the ranks the placement names
    /// ([`ExecOutput::tensor`]); the others get `None`.
    Placed(OutputPlacement),
    /// Streamed: the owner (rank 0, which needs the sink; `None` elsewhere) finishes the output
    /// a run (a latent frame of a causal video decoder) at a time, as the ranks compute it, and
    /// hands each run to the sink. No rank holds more than one run of the output, so memory does
    /// not grow with the frame count; the frames are bit for bit those of [`Output::Placed`]. A
    /// tile or shard operator must say how it streams (its `stream_runs`). The returned
    /// [`ExecOutput`] holds no tensor, and a failure while streaming (the sink's included)
    /// aborts the group.
    Streamed(Option<&'s mut dyn FrameSink>),
}

impl std::fmt::Debug for Output<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Placed(placement) => f.debug_tuple("Placed").field(placement).finish(),
            Self::Streamed(sink) => f.debug_tuple("Streamed").field(&sink.as_ref().map(|_| "sink")).finish(),
        }
    }
}

/// One request's strategy with the operator it runs: made by [`Job::tiles`], [`Job::bands`],
/// [`Job::blocks`] or [`Job::pipeline`], run by [`DistributedVaeExecutor::run`]. The strategy
/// types ([`Tiles`], [`Bands`], [`Blocks`], [`Pipeline`]) carry each its own kind of operator.
#[derive(Debug, Clone, Copy)]
pub struct Job<S>(S);

/// A strategy a [`Job`] can carry (the four of this module; sealed).
pub trait JobStrategy: sealed::Run {}

impl<S: sealed::Run> JobStrategy for S {}

mod sealed {
    use super::{DistributedVaeExecutor, ExecOutput, Output, RuntimeError, Tensor};

    /// Runs a strategy as one request of `exec`.
    pub trait Run {
        fn run(
            self,
            exec: &DistributedVaeExecutor,
            input: &Tensor,
            output: Output<'_>,
        ) -> Result<ExecOutput, RuntimeError>;
    }
}

/// Tile-parallel: the operator's tiles dealt to the ranks ([`Job::tiles`]).
#[derive(Debug)]
pub struct Tiles<'o, O> {
    op: &'o O,
}

/// Spatial shard: the map cut into bands along an axis, one per rank ([`Job::bands`]).
#[derive(Debug)]
pub struct Bands<'o, O> {
    op: &'o O,
    axis: ShardAxis,
}

/// Spatial shard over a 2-D grid of blocks, one per rank ([`Job::blocks`]).
#[derive(Debug)]
pub struct Blocks<'o, O> {
    op: &'o O,
    grid: [usize; 2],
}

/// The model's layers cut into stages, one per rank, over runs of frames ([`Job::pipeline`]).
#[derive(Debug)]
pub struct Pipeline<'o, O> {
    op: &'o O,
}

// Derived `Clone` would ask the operator to be `Clone`; the strategies hold a reference.
macro_rules! copy_strategy {
    ($($name:ident),*) => {$(
        impl<O> Clone for $name<'_, O> {
            fn clone(&self) -> Self {
                *self
            }
        }
        impl<O> Copy for $name<'_, O> {}
    )*};
}
copy_strategy!(Tiles, Bands, Blocks, Pipeline);

impl<'o, O: TileOperator> Job<Tiles<'o, O>> {
    /// Tile-parallel: split on every rank, check that the ranks hold the same input, assign the
    /// tiles (LPT), execute, gather to the owner and merge there. The output is bit-identical
    /// to what one rank computes alone ([`crate::execute_serial`]), for any number of ranks,
    /// because tiles are computed exactly as alone and every output element gets the operator's
    /// blends in the operator's own order ([`crate::TileMerge`]). Ranks beyond the parallel
    /// size (or without tiles) join every collective. An error on any rank becomes an error on
    /// every rank.
    ///
    /// Streamed ([`Output::Streamed`]), every rank starts its tiles (dealt by LPT as
    /// unstreamed) and advances them a run at a time ([`TileOperator::exec_run`], each tile
    /// keeping its own state); each run of every tile is gathered to the owner, merged there
    /// and handed to the sink.
    pub fn tiles(op: &'o O) -> Self {
        Self(Tiles { op })
    }
}

impl<'o, O: ShardOperator> Job<Bands<'o, O>> {
    /// Spatial shard along `axis` over the first `parallel_size` ranks: check that the ranks
    /// hold the same input and that it can be cut into bands no narrower than the operator's
    /// widest halo, compute every band (with halo exchanges between neighbours), gather the
    /// output bands to the owner and finish there. The output is the direct computation's, bit
    /// for bit. Ranks beyond the parallel size join the agreement, the gather and the broadcast.
    ///
    /// Errors found before the computation (bad input, too few rows for the ranks) are agreed:
    /// every rank returns the same error and the group stays usable. A failure during the
    /// computation (a bug, since the input was validated) aborts the group, so that no
    /// neighbour waits for a halo that never comes: the others get a transport error that
    /// names this rank.
    ///
    /// Streamed ([`Output::Streamed`]), every rank computes its band run by run
    /// ([`ShardOperator::exec_streaming`]); each run is gathered to the owner as soon as it is
    /// computed, finished there and handed to the sink.
    pub fn bands(op: &'o O, axis: ShardAxis) -> Self {
        Self(Bands { op, axis })
    }
}

impl<'o, O: ShardOperator> Job<Blocks<'o, O>> {
    /// Spatial shard over a 2-D grid: the input cut into `grid` (`[R, C]`) blocks, rank `r`
    /// holding block `(r / C, r % C)` through every layer, each convolution taking its halo
    /// rows and columns (and corners) from the neighbouring blocks. The output is the direct
    /// computation's, bit for bit. The operator must say it handles blocks
    /// ([`ShardOperator::splits_blocks`]), the grid must fit in the parallel size (ranks beyond
    /// it join the agreement, gather and broadcast) and every block must be at least the widest
    /// halo along both axes; otherwise an agreed error. Errors otherwise as for
    /// [`Job::bands`].
    ///
    /// Streamed ([`Output::Streamed`]), every rank computes its block run by run; each run's
    /// blocks are gathered to the owner, put in their places, finished and handed to the sink.
    pub fn blocks(op: &'o O, grid: [usize; 2]) -> Self {
        Self(Blocks { op, grid })
    }
}

impl<'o, O: PipelineOperator> Job<Pipeline<'o, O>> {
    /// Pipeline: the operator's steps cut into stages balanced on their predicted cost, stage
    /// `s` on rank `s` (as many stages as the parallel size, fewer when the model has fewer
    /// steps), each run (latent frame) handed from stage to stage while the earlier stages work
    /// on the next runs. The owner receives the last stage's output of every run and assembles
    /// the output; it is bit for bit the direct computation's. Errors found before the
    /// computation are agreed; a failure during it aborts the group.
    ///
    /// Streamed ([`Output::Streamed`]), the owner finishes each run's output as the last stage
    /// hands it over and passes it to the sink: no rank holds more than its stage's activations
    /// and one run of the output.
    pub fn pipeline(op: &'o O) -> Self {
        Self(Pipeline { op })
    }
}

impl<S: JobStrategy> Job<S> {
    /// Runs the job as one request of `exec` (see [`DistributedVaeExecutor::run`]).
    pub(super) fn run(
        self,
        exec: &DistributedVaeExecutor,
        input: &Tensor,
        output: Output<'_>,
    ) -> Result<ExecOutput, RuntimeError> {
        self.0.run(exec, input, output)
    }
}

impl<O: TileOperator> sealed::Run for Tiles<'_, O> {
    fn run(
        self,
        exec: &DistributedVaeExecutor,
        input: &Tensor,
        output: Output<'_>,
    ) -> Result<ExecOutput, RuntimeError> {
        let op = self.op;
        match output {
            Output::Placed(placement) => placed(exec, input, &TileStrategy { op }, op.device(), placement),
            Output::Streamed(sink) => {
                streamed(exec, input, &StreamedTileStrategy { op, sink: RefCell::new(sink) }, op.device())
            }
        }
    }
}

impl<O: ShardOperator> sealed::Run for Bands<'_, O> {
    fn run(
        self,
        exec: &DistributedVaeExecutor,
        input: &Tensor,
        output: Output<'_>,
    ) -> Result<ExecOutput, RuntimeError> {
        let Self { op, axis } = self;
        match output {
            Output::Placed(placement) => placed(exec, input, &ShardStrategy { op, axis }, op.device(), placement),
            Output::Streamed(sink) => {
                let strategy = StreamedShardStrategy { op, cut: Cut::Bands(axis), sink: RefCell::new(sink) };
                streamed(exec, input, &strategy, op.device())
            }
        }
    }
}

impl<O: ShardOperator> sealed::Run for Blocks<'_, O> {
    fn run(
        self,
        exec: &DistributedVaeExecutor,
        input: &Tensor,
        output: Output<'_>,
    ) -> Result<ExecOutput, RuntimeError> {
        let Self { op, grid } = self;
        match output {
            Output::Placed(placement) => placed(exec, input, &BlockStrategy { op, grid }, op.device(), placement),
            Output::Streamed(sink) => {
                let strategy = StreamedShardStrategy { op, cut: Cut::Blocks(grid), sink: RefCell::new(sink) };
                streamed(exec, input, &strategy, op.device())
            }
        }
    }
}

impl<O: PipelineOperator> sealed::Run for Pipeline<'_, O> {
    fn run(
        self,
        exec: &DistributedVaeExecutor,
        input: &Tensor,
        output: Output<'_>,
    ) -> Result<ExecOutput, RuntimeError> {
        let op = self.op;
        match output {
            Output::Placed(placement) => {
                let strategy = PipelineStrategy { op, sink: RefCell::new(None), streamed: false };
                placed(exec, input, &strategy, op.device(), placement)
            }
            Output::Streamed(sink) => {
                let strategy = PipelineStrategy { op, sink: RefCell::new(sink), streamed: true };
                streamed(exec, input, &strategy, op.device())
            }
        }
    }
}

/// Runs a request whose output goes to the ranks `placement` names.
fn placed<S: RequestStrategy>(
    exec: &DistributedVaeExecutor,
    input: &Tensor,
    strategy: &S,
    device: vae_tensor::Device,
    placement: OutputPlacement,
) -> Result<ExecOutput, RuntimeError> {
    exec.abort_unless_known(exec.run_request(input, strategy, device, placement))
}

/// Runs a request whose strategy streams the output into the owner's sink: nothing is
/// broadcast, and the output returned holds no tensor.
fn streamed<S: RequestStrategy>(
    exec: &DistributedVaeExecutor,
    input: &Tensor,
    strategy: &S,
    device: vae_tensor::Device,
) -> Result<ExecOutput, RuntimeError> {
    let mut out = placed(exec, input, strategy, device, OutputPlacement::OwnerOnly)?;
    out.tensor = None;
    Ok(out)
}
