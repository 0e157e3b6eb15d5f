//! What a request returns: the output on the ranks that receive it, and each rank's report
//! (what it computed, time per phase, traffic, memory).

use std::ops::Range;
use std::time::Duration;

use vae_planner::ShardAxis;
use vae_tensor::Tensor;
use vae_transport::CommStats;

use crate::pipeline::PipelineStage;
use crate::shard::ShardTraffic;

/// Which ranks receive the merged output (a per-model contract: e.g. AutoencoderKL and Wan
/// decode to the owner only, Qwen-Image and FLUX.2 decode to all ranks, encoders to all).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputPlacement {
    /// Only the owner (rank 0) gets the tensor; the others get `None`.
    OwnerOnly,
    /// The owner broadcasts the tensor to every rank.
    AllRanks,
}

/// Time spent in each phase of one request on one rank.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PhaseTimings {
    /// Splitting the input.
    pub split: Duration,
    /// Agreeing on the input (hash exchange).
    pub agree: Duration,
    /// Computing: this rank's tiles, its band of a shard computation or its pipeline stage
    /// (without the communication inside it, which is [`Self::halo`]).
    pub exec: Duration,
    /// Shard mode: communication inside the computation (halo exchanges and full-map gathers);
    /// pipeline mode: the hand-overs between stages (waiting for the neighbours included); tile
    /// mode merged by edges: exchanging the tiles' edges (waiting included).
    pub halo: Duration,
    /// Exchanging tile shapes and gathering tiles to the owner.
    pub gather: Duration,
    /// Merging: on the owner; in tile mode merged by edges, also each rank blending its tiles.
    pub merge: Duration,
    /// Final status / output broadcast.
    pub broadcast: Duration,
}

impl PhaseTimings {
    /// Sum of all phases.
    pub fn total(&self) -> Duration {
        self.split + self.agree + self.exec + self.halo + self.gather + self.merge + self.broadcast
    }
}

/// What one rank did for one request.
#[derive(Debug, Clone, PartialEq)]
pub struct RankReport {
    /// This rank.
    pub rank: usize,
    /// Ranks in the group.
    pub world_size: usize,
    /// Ranks that executed tiles (`min(requested, world)`).
    pub parallel_size: usize,
    /// Tiles in the plan.
    pub tile_count: usize,
    /// The tiles this rank executed, in execution order.
    pub tiles: Vec<usize>,
    /// Sum of their workloads.
    pub workload: u64,
    /// True on the rank that merged.
    pub is_owner: bool,
    /// Time per phase.
    pub timings: PhaseTimings,
    /// Traffic of this request.
    pub traffic: CommStats,
    /// High-water mark of this rank's tensor memory during the request, in bytes (the
    /// allocation accounting of `vae_tensor::memory`; includes tensors alive before it).
    pub peak_bytes: usize,
    /// The same high-water mark at the end of the computation, before outputs are gathered
    /// (the activation peak: it excludes the assembled output the owner holds afterwards). Tiles
    /// stitched as they arrive ([`TileOperator::stitch_layout`](crate::TileOperator::stitch_layout))
    /// are merged during the computation: there the owner's includes its output.
    pub exec_peak_bytes: usize,
    /// Tensor bytes alive on this rank when the request started (its input, and weights or
    /// caches charged to it): `peak_bytes - start_bytes` is the most the request itself held.
    pub start_bytes: usize,
    /// High-water mark of this rank's device (CUDA) tensor memory during the request, in bytes
    /// (0 when it computes on the CPU; includes weights and tensors alive before it).
    pub device_peak_bytes: usize,
    /// How the request was computed.
    pub strategy: StrategyReport,
    /// Why that strategy: the model policy's choice or fallback (set by the caller that chose).
    pub reason: Option<String>,
    /// The strategy is not what the request asked for (a forced mode that fell back, untiled
    /// pixels computed on one rank): `reason` says why, and the caller warns (set by the caller
    /// that chose).
    pub fallback: bool,
    /// The cost model's figures for the strategy that ran (set by the caller that has one).
    pub predicted: Option<Predicted>,
}

impl RankReport {
    /// The report of a request computed whole on a group of one rank outside the executor (one
    /// direct tile: a device input decoded in place), its computation taking `exec` and
    /// producing `workload` output elements; the memory figures are read now, against
    /// `start_bytes` (what was alive when the request began).
    pub fn whole_on_one_rank(exec: std::time::Duration, workload: u64, start_bytes: usize) -> Self {
        let peak_bytes = vae_tensor::memory::peak_bytes();
        Self {
            rank: 0,
            world_size: 1,
            parallel_size: 1,
            tile_count: 1,
            tiles: vec![0],
            workload,
            is_owner: true,
            timings: PhaseTimings { exec, ..Default::default() },
            traffic: Default::default(),
            peak_bytes,
            exec_peak_bytes: peak_bytes,
            start_bytes,
            device_peak_bytes: vae_tensor::memory::device_peak_bytes(),
            strategy: StrategyReport::Tile,
            reason: None,
            fallback: false,
            predicted: None,
        }
    }
}

/// A cost model's prediction for one request (`vae_planner::cost`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Predicted {
    /// End-to-end latency, milliseconds.
    pub ms: f64,
    /// The busiest rank's peak bytes above what was alive when the request started.
    pub peak_bytes: u64,
}

/// How a request was computed, for the report.
#[derive(Debug, Clone, PartialEq)]
pub enum StrategyReport {
    /// Tile-parallel (a request below the tile size is one direct tile).
    Tile,
    /// Spatial shard.
    Shard {
        /// The split axis.
        axis: ShardAxis,
        /// This rank's rows of the input (`None` on ranks beyond the parallel size).
        band: Option<Range<usize>>,
        /// Communication inside the computation.
        traffic: ShardTraffic,
    },
    /// Spatial shard over a 2-D grid of blocks.
    Blocks {
        /// `[R, C]`.
        grid: [usize; 2],
        /// This rank's rows and columns of the input (`None` on ranks beyond the grid).
        block: Option<[Range<usize>; 2]>,
        /// Communication inside the computation.
        traffic: ShardTraffic,
    },
    /// A pipeline over runs of frames: this rank's stage.
    Pipeline(PipelineStage),
}

impl StrategyReport {
    /// "tile", "shard-height", "shard-width", "shard-RxC" (blocks) or "pipeline".
    pub fn label(&self) -> String {
        match self {
            Self::Tile => "tile".into(),
            Self::Shard { axis, .. } => format!("shard-{axis}"),
            Self::Blocks { grid: [r, c], .. } => format!("shard-{r}x{c}"),
            Self::Pipeline(_) => "pipeline".into(),
        }
    }
}

/// A request's result on one rank.
#[derive(Debug)]
pub struct ExecOutput {
    /// The merged output, on the ranks the placement gives it to.
    pub tensor: Option<Tensor>,
    /// What this rank did.
    pub report: RankReport,
}
