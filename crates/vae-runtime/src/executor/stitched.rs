//! The tile strategy with a merge that streams, for an operator whose merge is diffusers' 2-D
//! stitch ([`TileOperator::stitch_layout`]): the ranks compute their tiles in rounds, one tile
//! each per round, and gather each round's results to the owner, which writes them into an
//! output allocated once and frees them. Two merges ([`TileMerge`]):
//!
//! - **Owner** (the default): tiles are dealt by LPT and computed in row-major order; whole
//!   tiles go to the owner, which stitches each as soon as its turn in diffusers' row-major order
//!   has come ([`Stitcher`]).
//! - **By edges** ([`EdgeMerge`], where the blend ramps stay within half a tile, as with
//!   diffusers' quarter-tile overlap): tiles are scheduled in rounds that follow the blending
//!   order; after each round the ranks exchange their new tiles' raw edges ([`EdgeRounds`]),
//!   blend their own tile and send the owner only its kept part, disjoint from the others
//!   ([`Assembly`]). The owner receives the output's size and blends nothing.
//!
//! A rank other than the owner so holds one tile output at a time (and, by edges, the edges of
//! its next tiles) instead of all of its tiles, and the owner the output, the round's tiles (or
//! kept parts) and, in the owner merge, the edges of one row of tiles. Each tile is computed
//! exactly as alone and each output element gets diffusers' blends in diffusers' order, so the
//! output is bit for bit the same for any number of ranks.

use std::time::{Duration, Instant};

use vae_planner::{Assignment, lpt_assign};
use vae_tensor::Tensor;
use vae_transport::CommunicatorExt;

use super::edges::EdgeRounds;
use super::failure::Failure;
use super::tile::{TileOutputs, cast_output, decode_summary, exec_tile, summary_message};
use super::{DistributedVaeExecutor, OWNER, TileMerge, guarded, inconsistent};
use crate::progress::{self, Progress};
use crate::stitch::{Assembly, EdgeMerge, StitchLayout, Stitcher};
use crate::{RuntimeError, Stage, TileOperator, TilePlan};

/// Time spent in each part of the rounds, for the rank's report.
#[derive(Debug, Default)]
pub(super) struct RoundTimes {
    pub(super) exec: Duration,
    /// Exchanging edges between the ranks (merge by edges).
    pub(super) edges: Duration,
    pub(super) gather: Duration,
    pub(super) merge: Duration,
}

/// How the ranks merge a stitch: by edges, or whole tiles on the owner.
pub(super) enum Rounds<'l> {
    Edges(Box<EdgeRounds>),
    Whole(&'l StitchLayout),
}

/// Deals `plan`'s tiles to `ranks` ranks: for a merge by edges (asked for, and allowed by
/// `layout` unless its ramps reach past half a tile), in rounds that respect the blending order
/// ([`EdgeRounds`]); otherwise by LPT on `workloads`.
pub(super) fn deal<'l, P, S>(
    plan: &TilePlan<P, S>,
    layout: &'l StitchLayout,
    merge: TileMerge,
    workloads: &[u64],
    ranks: usize,
) -> Result<(Assignment, Rounds<'l>), RuntimeError> {
    // A layout the merge refuses (an empty grid) is refused by the whole-tile merge, as before.
    if merge == TileMerge::Edges
        && let Ok(Some(merge)) = EdgeMerge::new(layout)
        && let Some(rounds) = EdgeRounds::new(merge, plan, ranks)
    {
        return Ok((rounds.assignment(plan), Rounds::Edges(Box::new(rounds))));
    }
    Ok((lpt_assign(workloads, ranks)?, Rounds::Whole(layout)))
}

/// Computes this rank's tiles (`assignment`'s; by edges, in the rounds' order, otherwise in
/// row-major order) a round at a time and gathers every round to the owner, which merges them
/// into the output. Returns the owner's
/// outcome (the finished output, or the agreed error), `None` on the other ranks. A tile that
/// fails stops this rank's tiles (and, by edges, those of every rank that reads an edge it no
/// longer sends, and so on); the owner fails the request with the failure of the lowest rank
/// that had one, as the whole-map merge does.
pub(super) fn compute_and_stitch<O: TileOperator>(
    op: &O,
    exec: &DistributedVaeExecutor,
    input: &Tensor,
    plan: &TilePlan<O::Payload, O::TileSpec>,
    mut merge: Rounds<'_>,
    assignment: &Assignment,
    times: &mut RoundTimes,
) -> Result<Option<Result<Tensor, RuntimeError>>, RuntimeError> {
    let comm = exec.comm.as_ref();
    let rank = comm.rank();
    let mine = scan_order(plan, assignment.per_rank.get(rank).map_or(&[], Vec::as_slice));
    let rounds = match &merge {
        Rounds::Edges(edges) => edges.round_count(),
        Rounds::Whole(_) => assignment.per_rank.iter().map(Vec::len).max().unwrap_or(0),
    };
    let mut done = 0;
    let mut owner = (rank == OWNER).then(|| {
        let sink: Result<Box<dyn Sink>, RuntimeError> = match &merge {
            Rounds::Edges(edges) => Ok(Box::new(Assembly::new(edges.merge().clone()))),
            Rounds::Whole(layout) => Stitcher::new(layout).map(|s| Box::new(s) as Box<dyn Sink>),
        };
        OwnerMerge::new(sink, plan.tasks.len(), comm.size())
    });
    let mut failed = false;
    progress::report(Progress::Tiles { done: 0, total: mine.len() });
    for round in 0..rounds {
        // A failed group stops this rank between tiles, not after its last.
        crate::cancel::check()?;
        let clock = Instant::now();
        let mut local = TileOutputs { outputs: Vec::with_capacity(1), error: None };
        let tile = match &merge {
            Rounds::Edges(edges) => edges.tile_id_of(rank, round),
            Rounds::Whole(_) => mine.get(round).copied(),
        };
        if let Some(tile_id) = tile.filter(|_| !failed) {
            match exec_tile(op, input, &plan.tasks[tile_id]) {
                Ok(out) => local.outputs.push((tile_id, out)),
                Err(failure) => local.error = Some((tile_id, failure)),
            }
            failed = local.error.is_some();
            if !failed {
                done += 1;
                progress::report(Progress::Tiles { done, total: mine.len() });
            }
        }
        times.exec += clock.elapsed();

        if let Rounds::Edges(edges) = &mut merge {
            let clock = Instant::now();
            let raw = local.outputs.pop();
            let raw = match raw.map(|(id, t)| (edges.index_of(id), id, t)) {
                Some((Some(k), id, t)) => match edges.merge().check_tile(edges.coord(k), &t) {
                    Ok(()) => Some((k, id, t)),
                    Err(err) => {
                        local.error = Some((id, Failure::from(err.to_string())));
                        failed = true;
                        edges.stop();
                        None
                    }
                },
                Some((None, id, _)) => return Err(RuntimeError::Protocol(format!("tile {id} is not in the grid"))),
                None => None,
            };
            edges.exchange(comm, round, raw.as_ref().map(|(_, _, t)| t))?;
            times.edges += clock.elapsed();
            let clock = Instant::now();
            if let Some((k, id, t)) = raw {
                match edges.take_edges(k)? {
                    // A neighbour failed: the request fails with its error.
                    None => {
                        failed = true;
                        edges.stop();
                    }
                    Some(mut got) => {
                        let part = edges.merge().blend_and_crop(edges.coord(k), t, |edge| {
                            got.remove(&edge).ok_or_else(|| RuntimeError::Inconsistent(format!("no {edge:?} edge")))
                        });
                        match part {
                            Ok(part) => local.outputs.push((id, part)),
                            Err(err) => {
                                local.error = Some((id, Failure::from(err.to_string())));
                                failed = true;
                                edges.stop();
                            }
                        }
                    }
                }
            }
            times.merge += clock.elapsed();
        }

        let clock = Instant::now();
        let message = summary_message(&local, rank)?;
        // The owner keeps its own tile as it is; elsewhere it went into the message.
        let own = if rank == OWNER { local.outputs.pop() } else { None };
        drop(local);
        let gathered = comm.gather(OWNER, message.as_slice())?;
        drop(message);
        times.gather += clock.elapsed();

        let clock = Instant::now();
        if let (Some(owner), Some(parts)) = (owner.as_mut(), gathered) {
            owner.take_round(plan, parts.parts(), own, &input.device());
        }
        times.merge += clock.elapsed();
    }
    let clock = Instant::now();
    let outcome = owner.map(|owner| {
        owner.finish().and_then(|stitched| {
            guarded(|| op.finish_stitched(stitched, &plan.grid))
                .and_then(|out| cast_output(out, plan.grid.output_dtype).map_err(Failure::from))
                .map_err(|failure| failure.at(Stage::Merge, OWNER))
        })
    });
    times.merge += clock.elapsed();
    Ok(outcome)
}

/// What the owner merges each round's results into: whole tiles stitched in turn, or kept
/// parts copied into place.
trait Sink {
    fn push(&mut self, coord: [usize; 2], tile: Tensor) -> Result<(), RuntimeError>;
    fn finish(self: Box<Self>) -> Result<Tensor, RuntimeError>;
}

impl Sink for Stitcher {
    fn push(&mut self, coord: [usize; 2], tile: Tensor) -> Result<(), RuntimeError> {
        Stitcher::push(self, coord, tile)
    }

    fn finish(self: Box<Self>) -> Result<Tensor, RuntimeError> {
        Stitcher::finish(*self)
    }
}

impl Sink for Assembly {
    fn push(&mut self, coord: [usize; 2], part: Tensor) -> Result<(), RuntimeError> {
        Assembly::push(self, coord, part)
    }

    fn finish(self: Box<Self>) -> Result<Tensor, RuntimeError> {
        Assembly::finish(*self)
    }
}

/// `tiles` in row-major order of their grid coordinates: the order the owner merges in, so
/// that every round brings it the next tiles it can merge.
fn scan_order<P, S>(plan: &TilePlan<P, S>, tiles: &[usize]) -> Vec<usize> {
    let mut ordered = tiles.to_vec();
    ordered.sort_by(|&a, &b| plan.tasks[a].grid_coord.cmp(&plan.tasks[b].grid_coord));
    ordered
}

/// The owner's side of the rounds: the merge so far, and what went wrong.
struct OwnerMerge {
    sink: Result<Box<dyn Sink>, RuntimeError>,
    /// Per rank, the first tile that failed there.
    exec_failures: Vec<Option<RuntimeError>>,
    /// Whether each planned tile came back.
    seen: Vec<bool>,
}

impl OwnerMerge {
    fn new(sink: Result<Box<dyn Sink>, RuntimeError>, tiles: usize, ranks: usize) -> Self {
        let sink = sink.map_err(|e| Failure::from(e.to_string()).at(Stage::Merge, OWNER));
        Self { sink, exec_failures: (0..ranks).map(|_| None).collect(), seen: vec![false; tiles] }
    }

    /// Takes one round's parts (rank order; the owner's own tile apart, unserialised) and
    /// stitches its tiles. Once anything failed, tiles are dropped unmerged: the request fails.
    fn take_round<'a, P, S>(
        &mut self,
        plan: &TilePlan<P, S>,
        parts: impl Iterator<Item = &'a [u8]>,
        mut own: Option<(usize, Tensor)>,
        device: &vae_tensor::Device,
    ) {
        for (r, part) in parts.enumerate() {
            let tiles = match decode_summary(r, part).map_err(inconsistent) {
                Ok((Ok(tiles), payload)) => (tiles, payload),
                Ok((Err((tile_id, failure)), _)) => {
                    self.exec_failures[r].get_or_insert(failure.at(Stage::Exec { tile_id }, r));
                    continue;
                }
                Err(err) => {
                    self.fail(err);
                    continue;
                }
            };
            let (produced, payload) = tiles;
            let mut at = 0usize;
            for (tile_id, dtype, shape) in produced {
                let tensor = if r == OWNER {
                    match own.take() {
                        Some((id, t)) if id == tile_id => Ok(t),
                        _ => Err(RuntimeError::Inconsistent(format!(
                            "the owner announced tile {tile_id} it does not hold"
                        ))),
                    }
                } else {
                    // Each shape was checked for overflow when the summary was decoded; their sum
                    // is checked here.
                    let len = shape.elem_count() * dtype.size_in_bytes();
                    match at.checked_add(len).and_then(|end| Some((end, payload.get(at..end)?))) {
                        Some((end, bytes)) => {
                            at = end;
                            if self.failed() {
                                continue;
                            }
                            Tensor::from_bytes(dtype, shape, bytes, device).map_err(RuntimeError::from)
                        }
                        None => {
                            self.fail(RuntimeError::Inconsistent(format!("rank {r} sent too few bytes for its tiles")));
                            break;
                        }
                    }
                };
                match tensor.and_then(|t| self.coord_of(plan, r, tile_id).map(|c| (c, t))) {
                    Ok((coord, tile)) => self.stitch(coord, tile),
                    Err(err) => self.fail(err),
                }
            }
            if r != OWNER && at != payload.len() && !self.failed() {
                self.fail(RuntimeError::Inconsistent(format!(
                    "rank {r} sent {} bytes, its tiles need {at}",
                    payload.len()
                )));
            }
        }
    }

    /// The grid coordinate of a tile that came back for the first time.
    fn coord_of<P, S>(&mut self, plan: &TilePlan<P, S>, r: usize, tile_id: usize) -> Result<[usize; 2], RuntimeError> {
        match self.seen.get_mut(tile_id) {
            Some(s) if !*s => *s = true,
            Some(_) => return Err(RuntimeError::Inconsistent(format!("tile {tile_id} came back twice (rank {r})"))),
            None => return Err(RuntimeError::Inconsistent(format!("rank {r} returned unknown tile {tile_id}"))),
        }
        match plan.tasks[tile_id].grid_coord.as_slice() {
            &[i, j] => Ok([i, j]),
            other => Err(RuntimeError::Inconsistent(format!("tile {tile_id} has a {}-d grid coordinate", other.len()))),
        }
    }

    /// Whether the request has already failed (a tile on any rank, or the merge).
    fn failed(&self) -> bool {
        self.sink.is_err() || self.exec_failures.iter().any(Option::is_some)
    }

    /// Merges a tile, unless the request has already failed.
    fn stitch(&mut self, coord: [usize; 2], tile: Tensor) {
        if self.exec_failures.iter().any(Option::is_some) {
            return;
        }
        if let Ok(sink) = &mut self.sink
            && let Err(err) = sink.push(coord, tile)
        {
            self.fail(Failure::from(err.to_string()).at(Stage::Merge, OWNER));
        }
    }

    /// Records the first merge failure.
    fn fail(&mut self, err: RuntimeError) {
        if self.sink.is_ok() {
            self.sink = Err(err);
        }
    }

    /// The stitched output; a tile failure on any rank first (the lowest rank's, as the
    /// whole-map merge reports), then the first merge or protocol failure in arrival order, then
    /// a tile that never came. (The whole-map merge, which reads every summary at once, reports
    /// a malformed summary before a later rank's tile failure; here a tile failure wins.)
    fn finish(self) -> Result<Tensor, RuntimeError> {
        if let Some(err) = self.exec_failures.into_iter().flatten().next() {
            return Err(err);
        }
        let sink = self.sink?;
        if let Some(missing) = self.seen.iter().position(|s| !s) {
            return Err(RuntimeError::Inconsistent(format!("tile {missing} was not executed by any rank")));
        }
        sink.finish().map_err(|e| Failure::from(e.to_string()).at(Stage::Merge, OWNER))
    }
}
