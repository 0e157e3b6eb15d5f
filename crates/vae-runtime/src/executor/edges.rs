//! The ranks' side of a tile merge done where the tiles are computed ([`EdgeMerge`]): the tiles
//! are scheduled in rounds of at most one per rank such that every tile's upper, left and
//! upper-left neighbours are computed in its own round or an earlier one. After each round's
//! tiles, every rank sends the raw edges of its tile to the ranks of the tiles that read them (one
//! paired exchange), keeps what it receives until the reading tile is computed, and blends its
//! own tile into its kept part, which alone goes to the owner.
//!
//! A round lasts as long as its largest tile (its exchange waits for it), so the schedule puts
//! tiles of like size together: each round takes the largest tiles whose neighbours are
//! scheduled (a neighbour in the same round will do: edges are raw), and gives them to the
//! ranks with the least work so far, largest first. Full tiles run before the ragged last row
//! and column, instead of a full tile and a sliver sharing a round.
//!
//! Compared with sending whole tiles to the owner, the owner receives the output's size instead
//! of whole overlapping tiles and does no blending; each rank holds, besides its tile, the edges
//! of the tiles it has yet to compute (at most a row of tiles' worth across the group).

use std::collections::BTreeMap;

use vae_planner::Assignment;
use vae_tensor::{Shape, Tensor};
use vae_transport::wire::{Reader, Writer};
use vae_transport::{Communicator, PeerExchange};

use super::{read_tensor_header, write_tensor_header};
use crate::stitch::{Edge, EdgeMerge};
use crate::{RuntimeError, TilePlan};

/// The deal and the edges in flight of a merge by edges.
pub(super) struct EdgeRounds {
    merge: EdgeMerge,
    /// Tile ids by row-major index of their grid coordinates.
    order: Vec<usize>,
    /// The ranks the tiles are dealt to (`0..ranks`).
    ranks: usize,
    /// Per round, each rank's tile (row-major index).
    rounds: Vec<Vec<Option<usize>>>,
    /// The rank of each tile (row-major index).
    rank_of: Vec<usize>,
    /// Edges that arrived (or that this rank cut from its own tiles) for tiles it has yet to
    /// blend, by the reading tile's row-major index; `None` where the neighbour has no output.
    pending: BTreeMap<(usize, Edge), Option<Tensor>>,
}

impl EdgeRounds {
    /// The rounds of `plan` over `ranks` ranks, or `None` when its tiles are not exactly one per
    /// cell of `merge`'s grid.
    pub(super) fn new<P, S>(merge: EdgeMerge, plan: &TilePlan<P, S>, ranks: usize) -> Option<Self> {
        let [rows, cols] = merge.grid_shape();
        let mut order = vec![None; rows.checked_mul(cols)?];
        for task in &plan.tasks {
            let &[i, j] = task.grid_coord.as_slice() else { return None };
            let cell = order.get_mut(i.checked_mul(cols)?.checked_add(j)?).filter(|_| j < cols)?;
            if cell.replace(task.tile_id).is_some() {
                return None;
            }
        }
        let order = order.into_iter().collect::<Option<Vec<_>>>()?;
        if ranks == 0 {
            return None;
        }
        let work: Vec<u64> = order.iter().map(|&id| plan.tasks[id].workload).collect();
        let (rounds, rank_of) = schedule(&merge, &work, ranks);
        Some(Self { merge, order, ranks, rounds, rank_of, pending: BTreeMap::new() })
    }

    /// The number of rounds.
    pub(super) fn round_count(&self) -> usize {
        self.rounds.len()
    }

    /// The tile (by id) `rank` computes in `round`.
    pub(super) fn tile_id_of(&self, rank: usize, round: usize) -> Option<usize> {
        self.tile_of(rank, round).map(|k| self.order[k])
    }

    /// The merge these rounds carry out.
    pub(super) fn merge(&self) -> &EdgeMerge {
        &self.merge
    }

    /// Each rank's tiles (ids, in round order) and work.
    pub(super) fn assignment<P, S>(&self, plan: &TilePlan<P, S>) -> Assignment {
        let mut per_rank = vec![Vec::new(); self.ranks];
        let mut loads = vec![0u64; self.ranks];
        for round in &self.rounds {
            for (r, k) in round.iter().enumerate() {
                if let Some(&k) = k.as_ref() {
                    let tile_id = self.order[k];
                    per_rank[r].push(tile_id);
                    loads[r] = loads[r].saturating_add(plan.tasks[tile_id].workload);
                }
            }
        }
        Assignment { per_rank, loads }
    }

    /// The row-major index of a tile, by id.
    pub(super) fn index_of(&self, tile_id: usize) -> Option<usize> {
        self.order.iter().position(|&id| id == tile_id)
    }

    fn coord(&self, k: usize) -> [usize; 2] {
        let cols = self.merge.grid_shape()[1];
        [k / cols, k % cols]
    }

    fn index(&self, coord: [usize; 2]) -> usize {
        coord[0] * self.merge.grid_shape()[1] + coord[1]
    }

    /// The tile `rank` computes in `round`, by row-major index.
    fn tile_of(&self, rank: usize, round: usize) -> Option<usize> {
        *self.rounds.get(round)?.get(rank)?
    }

    /// After `round`'s tiles: sends the edges of this rank's tile (cut from `raw`, its checked
    /// output; absent when it has none because it or a neighbour failed) to the ranks of the
    /// tiles that read them, and takes the edges the other tiles of the round send this rank.
    pub(super) fn exchange(
        &mut self,
        comm: &dyn Communicator,
        round: usize,
        raw: Option<&Tensor>,
    ) -> Result<(), RuntimeError> {
        let me = comm.rank();
        let mut outgoing: BTreeMap<usize, Vec<(usize, Edge, Option<Tensor>)>> = BTreeMap::new();
        if let Some(k) = self.tile_of(me, round) {
            let readers: Vec<_> = self.merge.readers(self.coord(k)).collect();
            for (to, edge) in readers {
                let reader = self.index(to);
                let piece = raw.map(|t| self.merge.cut(t, to, edge)).transpose()?;
                if self.rank_of[reader] == me {
                    self.keep(reader, edge, piece)?;
                } else {
                    outgoing.entry(self.rank_of[reader]).or_default().push((reader, edge, piece));
                }
            }
        }
        let sends_me = |q: usize| {
            self.tile_of(q, round)
                .is_some_and(|p| self.merge.readers(self.coord(p)).any(|(to, _)| self.rank_of[self.index(to)] == me))
        };
        let peers: Vec<usize> =
            (0..self.ranks).filter(|&q| q != me && (outgoing.contains_key(&q) || sends_me(q))).collect();
        if peers.is_empty() {
            return Ok(());
        }
        let messages = peers
            .iter()
            .map(|q| edge_message(outgoing.get(q).map_or(&[], Vec::as_slice)))
            .collect::<Result<Vec<_>, _>>()?;
        drop(outgoing);
        let mut recvs = vec![Vec::<u8>::new(); peers.len()];
        let mut legs: Vec<PeerExchange<'_>> = peers
            .iter()
            .zip(&messages)
            .zip(recvs.iter_mut())
            .map(|((&peer, message), recv)| PeerExchange { peer, send: message.as_slice(), recv })
            .collect();
        comm.exchange_bytes(vae_transport::DataType::U8, &mut legs)?;
        drop(legs);
        drop(messages);
        for (q, bytes) in peers.into_iter().zip(recvs) {
            self.take_message(me, q, round, &bytes)?;
        }
        Ok(())
    }

    /// The edges tile `k` reads, all of which this rank must hold by now; `None` when a
    /// neighbour has no output (its failure fails the request).
    pub(super) fn take_edges(&mut self, k: usize) -> Result<Option<BTreeMap<Edge, Tensor>>, RuntimeError> {
        let coord = self.coord(k);
        let mut edges = BTreeMap::new();
        let mut complete = true;
        for edge in Edge::ALL {
            if self.merge.source(coord, edge).is_none() {
                continue;
            }
            match self.pending.remove(&(k, edge)) {
                Some(Some(t)) => {
                    edges.insert(edge, t);
                }
                Some(None) => complete = false,
                None => {
                    return Err(RuntimeError::Inconsistent(format!(
                        "the {edge:?} edge of tile [{}, {}] never arrived",
                        coord[0], coord[1]
                    )));
                }
            }
        }
        Ok(complete.then_some(edges))
    }

    /// The grid coordinate of tile `k`.
    pub(super) fn coord_of(&self, k: usize) -> [usize; 2] {
        self.coord(k)
    }

    /// Holds an edge for this rank's tile `reader`.
    fn keep(&mut self, reader: usize, edge: Edge, piece: Option<Tensor>) -> Result<(), RuntimeError> {
        match self.pending.insert((reader, edge), piece) {
            None => Ok(()),
            Some(_) => {
                let [i, j] = self.coord(reader);
                Err(RuntimeError::Inconsistent(format!("the {edge:?} edge of tile [{i}, {j}] came twice")))
            }
        }
    }

    /// Reads what rank `q` sent this rank (`me`) in `round`: each edge must be one that `q`'s tile of the round
    /// owes a tile of this rank.
    fn take_message(&mut self, me: usize, q: usize, round: usize, bytes: &[u8]) -> Result<(), RuntimeError> {
        let mut rd = Reader::new(bytes, "tile edges");
        let count = rd.usize()?;
        let from = self.tile_of(q, round);
        for _ in 0..count {
            let reader = rd.usize()?;
            let tag = rd.u8()?;
            let edge = Edge::from_tag(tag)
                .ok_or_else(|| RuntimeError::Protocol(format!("rank {q} sent an edge of unknown kind {tag}")))?;
            let owed = reader < self.order.len()
                && self.rank_of[reader] == me
                && from.is_some_and(|p| self.merge.source(self.coord(reader), edge) == Some(self.coord(p)));
            if !owed {
                return Err(RuntimeError::Protocol(format!(
                    "rank {q} sent an edge ({edge:?} of tile {reader}) it does not owe"
                )));
            }
            let piece = match rd.u8()? {
                0 => None,
                _ => {
                    let (dtype, dims) = read_tensor_header(&mut rd)?;
                    let shape = Shape::new(dims);
                    let len = shape
                        .checked_elem_count()
                        .and_then(|n| n.checked_mul(dtype.size_in_bytes()))
                        .ok_or_else(|| RuntimeError::Protocol(format!("rank {q} sent an edge of shape {shape}")))?;
                    Some(Tensor::from_bytes(dtype, shape, rd.bytes(len)?, &vae_tensor::Device::Cpu)?)
                }
            };
            self.keep(reader, edge, piece)?;
        }
        if !rd.rest().is_empty() {
            return Err(RuntimeError::Protocol(format!("rank {q} sent bytes after its edges")));
        }
        Ok(())
    }
}

/// Rounds of at most `ranks` tiles (row-major indices, by rank) in which every tile's neighbours
/// that it reads are in its round or an earlier one, and the rank of each tile. Each round takes,
/// while it has room, the largest tile (by `work`; the first in row-major order among equals)
/// whose neighbours are scheduled, then gives its tiles, largest first, to the ranks with the
/// least work so far.
fn schedule(merge: &EdgeMerge, work: &[u64], ranks: usize) -> (Vec<Vec<Option<usize>>>, Vec<usize>) {
    let cols = merge.grid_shape()[1];
    let count = work.len();
    let mut scheduled = vec![false; count];
    let mut rank_of = vec![0; count];
    let mut loads = vec![0u64; ranks];
    let mut rounds = Vec::new();
    let mut left = count;
    let ready = |k: usize, scheduled: &[bool]| {
        let to = [k / cols, k % cols];
        !scheduled[k] && Edge::ALL.into_iter().all(|e| merge.source(to, e).is_none_or(|[i, j]| scheduled[i * cols + j]))
    };
    while left > 0 {
        let mut chosen: Vec<usize> = Vec::with_capacity(ranks);
        while chosen.len() < ranks {
            // The first among equals: `max_by_key` keeps the last maximum, so scan backwards.
            let Some(k) = (0..count).rev().filter(|&k| ready(k, &scheduled)).max_by_key(|&k| work[k]) else { break };
            scheduled[k] = true;
            chosen.push(k);
        }
        left -= chosen.len();
        let mut round = vec![None; ranks];
        // Largest first (stable: row-major among equals), each to the least loaded free rank.
        chosen.sort_by_key(|&k| std::cmp::Reverse(work[k]));
        for k in chosen {
            let r = (0..ranks).filter(|&r| round[r].is_none()).min_by_key(|&r| loads[r]).expect("a free rank");
            round[r] = Some(k);
            rank_of[k] = r;
            loads[r] = loads[r].saturating_add(work[k]);
        }
        rounds.push(round);
    }
    (rounds, rank_of)
}

/// The edges one rank sends another in a round: each with the reading tile, the edge, and the
/// tensor (absent when the sending tile has no output).
fn edge_message(edges: &[(usize, Edge, Option<Tensor>)]) -> Result<Writer, RuntimeError> {
    let mut w = Writer::new();
    w.usize(edges.len());
    for (reader, edge, piece) in edges {
        w.usize(*reader).u8(edge.tag());
        match piece {
            None => {
                w.u8(0);
            }
            Some(t) => {
                write_tensor_header(w.u8(1), t.dtype(), t.dims()).bytes(t.as_bytes()?);
            }
        }
    }
    Ok(w)
}

#[cfg(test)]
mod tests {
    use vae_planner::MergeRule;

    use super::*;
    use crate::stitch::{StitchLayout, StitchSpec};

    fn merge(heights: Vec<usize>, widths: Vec<usize>) -> EdgeMerge {
        let rule = MergeRule { blend: 2, keep: 6, final_crop: None };
        let layout =
            StitchLayout { spec: StitchSpec { dims: [2, 3], rules: [rule, rule] }, tile_extents: [heights, widths] };
        EdgeMerge::new(&layout).unwrap().unwrap()
    }

    /// Every tile runs once, in a round no earlier than the neighbours it reads, at most one per
    /// rank and round; full tiles run before ragged ones.
    #[test]
    fn the_schedule_follows_the_blending_order_and_runs_like_tiles_together() {
        for (heights, widths) in [(vec![8, 8, 3], vec![8, 8, 8, 2]), (vec![8; 5], vec![8, 4]), (vec![3], vec![8, 8, 8])]
        {
            let merge = merge(heights.clone(), widths.clone());
            let work: Vec<u64> = heights.iter().flat_map(|&h| widths.iter().map(move |&w| (h * w) as u64)).collect();
            for ranks in 1..=5 {
                let (rounds, rank_of) = schedule(&merge, &work, ranks);
                let mut round_of = vec![None; work.len()];
                for (n, round) in rounds.iter().enumerate() {
                    assert_eq!(round.len(), ranks);
                    for (r, k) in round.iter().enumerate() {
                        if let Some(k) = *k {
                            assert!(round_of[k].replace(n).is_none(), "tile {k} twice");
                            assert_eq!(rank_of[k], r);
                        }
                    }
                }
                let cols = widths.len();
                for k in 0..work.len() {
                    let round = round_of[k].expect("every tile runs");
                    for edge in Edge::ALL {
                        if let Some([i, j]) = merge.source([k / cols, k % cols], edge) {
                            assert!(round_of[i * cols + j].unwrap() <= round, "{edge:?} of tile {k}");
                        }
                    }
                }
                // No ragged tile runs in a round before a full one that was ready with it.
                let first_ragged = (0..work.len()).filter(|&k| work[k] < 64).filter_map(|k| round_of[k]).min();
                let last_full = (0..work.len()).filter(|&k| work[k] == 64).filter_map(|k| round_of[k]).max();
                if let (Some(ragged), Some(full)) = (first_ragged, last_full) {
                    assert!(ragged + 1 >= full, "{heights:?} × {widths:?} on {ranks}: {rounds:?}");
                }
            }
        }
    }
}
