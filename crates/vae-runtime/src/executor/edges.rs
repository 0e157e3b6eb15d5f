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
//! of the tiles it has yet to compute (about a row and a column of tiles' worth across the
//! group: the ragged last column runs last). A malformed or missing edge is a protocol error,
//! which aborts the group.

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
    /// Whether this rank has stopped computing (a tile of its, or one it reads, failed): it
    /// keeps exchanging, but holds nothing more.
    stopped: bool,
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
        Some(Self { merge, order, ranks, rounds, rank_of, pending: BTreeMap::new(), stopped: false })
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

    /// The grid coordinate of tile `k` (row-major).
    pub(super) fn coord(&self, k: usize) -> [usize; 2] {
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
        // Each peer's message: the edges in it, then their bytes, each written as it is cut.
        let mut outgoing: BTreeMap<usize, (usize, Writer)> = BTreeMap::new();
        if let Some(k) = self.tile_of(me, round) {
            let readers: Vec<_> = self.merge.readers(self.coord(k)).collect();
            for (to, edge) in readers {
                let reader = self.index(to);
                let piece = raw.map(|t| self.merge.cut(t, to, edge)).transpose()?;
                if self.rank_of[reader] == me {
                    self.keep(reader, edge, piece)?;
                    continue;
                }
                let (count, w) = outgoing.entry(self.rank_of[reader]).or_insert_with(|| (0, Writer::new()));
                *count += 1;
                w.usize(reader).u8(edge.tag());
                match piece {
                    None => {
                        w.u8(0);
                    }
                    Some(t) => {
                        write_tensor_header(w.u8(1), t.dtype(), t.dims()).bytes(t.as_bytes()?);
                    }
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
        let messages: Vec<Writer> = peers
            .iter()
            .map(|q| {
                let mut w = Writer::new();
                match outgoing.remove(q) {
                    Some((count, body)) => w.usize(count).bytes(body.as_slice()),
                    None => w.usize(0),
                };
                w
            })
            .collect();
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
                    return Err(RuntimeError::Protocol(format!(
                        "the {edge:?} edge of tile [{}, {}] never arrived",
                        coord[0], coord[1]
                    )));
                }
            }
        }
        Ok(complete.then_some(edges))
    }

    /// From now on this rank computes nothing more: it drops the edges it holds and those that
    /// arrive.
    pub(super) fn stop(&mut self) {
        self.stopped = true;
        self.pending.clear();
    }

    /// Holds an edge for this rank's tile `reader` (unless it has stopped).
    fn keep(&mut self, reader: usize, edge: Edge, piece: Option<Tensor>) -> Result<(), RuntimeError> {
        if self.stopped {
            return Ok(());
        }
        match self.pending.insert((reader, edge), piece) {
            None => Ok(()),
            Some(_) => {
                let [i, j] = self.coord(reader);
                Err(RuntimeError::Protocol(format!("the {edge:?} edge of tile [{i}, {j}] came twice")))
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
                    let [vdim, hdim] = self.merge.spec().dims;
                    let expected = self.merge.edge_extents(self.coord(reader), edge);
                    if dims.len() <= vdim.max(hdim) || [dims[vdim], dims[hdim]] != expected {
                        return Err(RuntimeError::Protocol(format!(
                            "rank {q} sent the {edge:?} edge of tile {reader} with shape {dims:?}, not {} × {} \
                             along dimensions {vdim} and {hdim}",
                            expected[0], expected[1]
                        )));
                    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A 2 × 2 grid of full tiles on two ranks: rounds [0, 1] and [2, 3], so rank 1 computes
    /// tiles 1 and 3, and in round 0 rank 0's tile 0 owes rank 1 tile 1's Left edge.
    fn two_by_two() -> EdgeRounds {
        let merge = merge(vec![8, 8], vec![8, 8]);
        let tasks = (0..4).map(|k| vae_planner::TileTask::new(k, vec![k / 2, k % 2], (), 64)).collect();
        let grid = vae_planner::GridSpec {
            split_dims: vec![2, 3],
            grid_shape: vec![2, 2],
            tile_spec: (),
            output_dtype: Some(vae_tensor::DType::F32),
        };
        EdgeRounds::new(merge, &TilePlan { tasks, grid }, 2).unwrap()
    }

    fn edge(reader: usize, tag: u8, dims: Option<&[usize]>) -> Writer {
        let mut w = Writer::new();
        w.usize(1).usize(reader).u8(tag);
        match dims {
            None => {
                w.u8(0);
            }
            Some(dims) => {
                let t = Tensor::zeros(dims.to_vec(), vae_tensor::DType::F32, &vae_tensor::Device::Cpu).unwrap();
                write_tensor_header(w.u8(1), t.dtype(), t.dims()).bytes(t.as_bytes().unwrap());
            }
        }
        w
    }

    /// What a peer sends is checked against what it owes: the tile, the edge, the shape, once.
    #[test]
    fn an_edge_not_owed_of_another_shape_or_twice_is_a_protocol_error() {
        let protocol = |r: Result<(), RuntimeError>| matches!(r, Err(RuntimeError::Protocol(_)));
        // Tile 1's Left edge: its 6 kept rows (keep 6, ramp 2) by the 2-column ramp.
        let good = [1, 1, 6, 2];
        let mut rounds = two_by_two();
        assert!(rounds.take_message(1, 0, 0, edge(1, Edge::Left.tag(), Some(&good)).as_slice()).is_ok());
        assert!(protocol(rounds.take_message(1, 0, 0, edge(1, Edge::Left.tag(), Some(&good)).as_slice())));
        let mut rounds = two_by_two();
        // Tile 1 reads no Above edge; tile 3 is not read in round 0; tile 9 does not exist.
        assert!(protocol(rounds.take_message(1, 0, 0, edge(1, Edge::Above.tag(), Some(&good)).as_slice())));
        assert!(protocol(rounds.take_message(1, 0, 0, edge(3, Edge::Left.tag(), Some(&good)).as_slice())));
        assert!(protocol(rounds.take_message(1, 0, 0, edge(9, Edge::Left.tag(), None).as_slice())));
        assert!(protocol(rounds.take_message(1, 0, 0, edge(1, 7, None).as_slice())));
        // The right tile and edge, with another shape along the tiled dimensions.
        assert!(protocol(rounds.take_message(1, 0, 0, edge(1, Edge::Left.tag(), Some(&[1, 1, 8, 2])).as_slice())));
        // Bytes after the edges.
        let mut trailing = edge(1, Edge::Left.tag(), None);
        trailing.u8(0);
        assert!(protocol(rounds.take_message(1, 0, 0, trailing.as_slice())));
        // An edge that never came.
        let mut rounds = two_by_two();
        assert!(protocol(rounds.take_edges(1).map(|_| ())));
        // A neighbour without output: the reading tile stops, with no error of its own.
        assert!(rounds.take_message(1, 0, 0, edge(1, Edge::Left.tag(), None).as_slice()).is_ok());
        assert!(matches!(rounds.take_edges(1), Ok(None)));
    }

    fn merge(heights: Vec<usize>, widths: Vec<usize>) -> EdgeMerge {
        EdgeMerge::new(&crate::stitch::tests::layout(heights, widths, 2, 6, None)).unwrap().unwrap()
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
