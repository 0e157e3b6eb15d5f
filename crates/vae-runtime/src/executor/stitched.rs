//! The tile strategy with a merge that streams: for an operator whose merge is diffusers' 2-D
//! stitch ([`TileOperator::stitch_layout`]), the ranks compute their tiles in rounds, one tile
//! each per round in row-major order, and gather each round's tiles to the owner, which
//! stitches every tile into an output allocated once ([`Stitcher`]) as soon as its turn in
//! diffusers' row-major order has come, and frees it.
//!
//! A rank other than the owner so holds one tile output at a time instead of all of its tiles,
//! and the owner the output, the tiles of one round, any that arrived ahead of their turn (how
//! many depends on how LPT spread the tiles; in row-major rounds, few) and the `blend` rows of
//! one row of tiles that their lower neighbours read (growing with the width, not the area). The tiles are dealt by LPT as in the whole-map
//! merge and computed exactly as alone, and the stitch replays diffusers' order, so the output
//! is bit for bit the same for any number of ranks.

use std::time::{Duration, Instant};

use vae_planner::Assignment;
use vae_tensor::Tensor;
use vae_transport::CommunicatorExt;

use super::failure::Failure;
use super::tile::{TileOutputs, cast_output, decode_summary, exec_tile, summary_message};
use super::{DistributedVaeExecutor, OWNER, guarded, inconsistent};
use crate::progress::{self, Progress};
use crate::stitch::{StitchLayout, Stitcher};
use crate::{RuntimeError, Stage, TileOperator, TilePlan};

/// Time spent in each part of the rounds, for the rank's report.
#[derive(Debug, Default)]
pub(super) struct RoundTimes {
    pub(super) exec: Duration,
    pub(super) gather: Duration,
    pub(super) merge: Duration,
}

/// Computes this rank's tiles (`assignment`'s, in row-major order) a round at a time and
/// gathers every round to the owner, which stitches them into the output. Returns the owner's
/// outcome (the finished output, or the agreed error), `None` on the other ranks. A tile that
/// fails stops this rank's tiles; the owner fails the request with the failure of the lowest
/// rank that had one, as the whole-map merge does.
pub(super) fn compute_and_stitch<O: TileOperator>(
    op: &O,
    exec: &DistributedVaeExecutor,
    input: &Tensor,
    plan: &TilePlan<O::Payload, O::TileSpec>,
    layout: &StitchLayout,
    assignment: &Assignment,
    times: &mut RoundTimes,
) -> Result<Option<Result<Tensor, RuntimeError>>, RuntimeError> {
    let comm = exec.comm.as_ref();
    let rank = comm.rank();
    let mine = scan_order(plan, assignment.per_rank.get(rank).map_or(&[], Vec::as_slice));
    let rounds = assignment.per_rank.iter().map(Vec::len).max().unwrap_or(0);
    let mut owner = (rank == OWNER).then(|| OwnerMerge::new(layout, plan.tasks.len(), comm.size()));
    let mut failed = false;
    progress::report(Progress::Tiles { done: 0, total: mine.len() });
    for round in 0..rounds {
        // A failed group stops this rank between tiles, not after its last.
        crate::cancel::check()?;
        let clock = Instant::now();
        let mut local = TileOutputs { outputs: Vec::with_capacity(1), error: None };
        if let Some(&tile_id) = mine.get(round).filter(|_| !failed) {
            match exec_tile(op, input, &plan.tasks[tile_id]) {
                Ok(out) => local.outputs.push((tile_id, out)),
                Err(failure) => local.error = Some((tile_id, failure)),
            }
            failed = local.error.is_some();
            if !failed {
                progress::report(Progress::Tiles { done: round + 1, total: mine.len() });
            }
        }
        times.exec += clock.elapsed();

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

/// `tiles` in row-major order of their grid coordinates: the order the owner merges in, so
/// that every round brings it the next tiles it can merge.
fn scan_order<P, S>(plan: &TilePlan<P, S>, tiles: &[usize]) -> Vec<usize> {
    let mut ordered = tiles.to_vec();
    ordered.sort_by(|&a, &b| plan.tasks[a].grid_coord.cmp(&plan.tasks[b].grid_coord));
    ordered
}

/// The owner's side of the rounds: the stitch so far, and what went wrong.
struct OwnerMerge {
    stitcher: Result<Stitcher, RuntimeError>,
    /// Per rank, the first tile that failed there.
    exec_failures: Vec<Option<RuntimeError>>,
    /// Whether each planned tile came back.
    seen: Vec<bool>,
}

impl OwnerMerge {
    fn new(layout: &StitchLayout, tiles: usize, ranks: usize) -> Self {
        let stitcher = Stitcher::new(layout).map_err(|e| Failure::from(e.to_string()).at(Stage::Merge, OWNER));
        Self { stitcher, exec_failures: (0..ranks).map(|_| None).collect(), seen: vec![false; tiles] }
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
        self.stitcher.is_err() || self.exec_failures.iter().any(Option::is_some)
    }

    /// Merges a tile, unless the request has already failed.
    fn stitch(&mut self, coord: [usize; 2], tile: Tensor) {
        if self.exec_failures.iter().any(Option::is_some) {
            return;
        }
        if let Ok(stitcher) = &mut self.stitcher
            && let Err(err) = stitcher.push(coord, tile)
        {
            self.fail(Failure::from(err.to_string()).at(Stage::Merge, OWNER));
        }
    }

    /// Records the first merge failure.
    fn fail(&mut self, err: RuntimeError) {
        if self.stitcher.is_ok() {
            self.stitcher = Err(err);
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
        let stitcher = self.stitcher?;
        if let Some(missing) = self.seen.iter().position(|s| !s) {
            return Err(RuntimeError::Inconsistent(format!("tile {missing} was not executed by any rank")));
        }
        stitcher.finish().map_err(|e| Failure::from(e.to_string()).at(Stage::Merge, OWNER))
    }
}
