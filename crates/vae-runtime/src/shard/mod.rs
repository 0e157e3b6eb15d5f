//! Spatial-shard execution (the second strategy of the specification): the input is cut into
//! bands along one spatial axis, or into the blocks of a 2-D grid, one per rank, and every
//! feature map stays sharded the same way through the whole network. Each convolution takes its
//! missing neighbour rows (the halo) from the adjacent ranks, and on a grid the columns and
//! corners too; per-pixel ops run locally; GroupNorm exchanges exact statistics; ops that need
//! the whole map (attention) gather it. The output equals the single-device direct (untiled)
//! computation: there are no tiles, seams or blends.
//!
//! This module is mechanism only: [`ShardContext`] carries the request-scoped state (the bands
//! or the grid, halo statistics) and the communication primitives a model's sharded forward
//! calls; [`ShardOperator`] is what a model implements. Which requests shard, along which axis
//! or on which grid, is model policy and lives in the adapters.

mod halo;

use std::ops::Range;
use std::time::{Duration, Instant};

use vae_planner::{BandPartition, BlockGrid, ShardAxis};
use vae_tensor::{DType, Device, DeviceMemory, GroupExtrema, GroupMoments, GroupPartial, Shape, Tensor};
use vae_transport::wire::{Reader, Writer};
use vae_transport::{Communicator, DeviceBytes, DeviceExchange, PeerExchange};

use crate::RuntimeError;
use crate::executor::OperatorError;

pub use halo::{HaloPiece, HaloWindow};

/// What a model's sharded computation needs to know before it starts, from the (validated)
/// input alone, so that every rank reaches the same verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardGeometry {
    /// The widest halo (rows from each neighbour) any op of the network needs at the input's
    /// resolution: every band must be at least this wide.
    pub min_band: usize,
    /// Input rows per band row: 1 for a decode; `2^k` for an encoder that halves the map `k`
    /// times, so that bands are cut only between whole output rows and every strided
    /// convolution sees band edges on its stride grid. The input's extent must be a multiple.
    pub unit: usize,
}

/// A model's computation, sharded along one spatial axis.
///
/// Every rank taking part calls [`exec`](Self::exec) on its own band; the calls of different
/// ranks must make the same sequence of [`ShardContext`] communication calls (the model's
/// layer order guarantees it). The executor gathers the output bands to the owner, which
/// calls [`finish`](Self::finish) on the assembled output.
pub trait ShardOperator {
    /// Checks the input and reports the widest halo. Runs on every rank.
    fn geometry(&self, input: &Tensor, axis: ShardAxis) -> Result<ShardGeometry, OperatorError>;
    /// Computes this rank's band of the output (before [`finish`](Self::finish)), taking its
    /// band of the input with [`ShardContext::local_input`].
    fn exec(&self, input: &Tensor, ctx: &mut ShardContext<'_>) -> Result<Tensor, OperatorError>;
    /// Turns the assembled output (bands concatenated along the axis) into the result (crop,
    /// unpatchify, clamp, ...). Runs on the owner only.
    fn finish(&self, assembled: Tensor) -> Result<Tensor, OperatorError>;
    /// The device the operator computes on (its model's): in-process ranks that share a GPU
    /// each get a stream of their own there for the request.
    fn device(&self) -> Device;

    /// Whether [`exec`](Self::exec) handles a block of a 2-D grid
    /// ([`ShardContext::halo_axes`] both true, [`ShardContext::axis`] `None`): its convolutions
    /// then take halos along both axes and pad neither. `false`, the default, refuses the
    /// 2-D shard with an agreed error before any work.
    fn splits_blocks(&self) -> bool {
        false
    }

    /// For a streamed computation ([`exec_streaming`](Self::exec_streaming)): how many runs
    /// of frames it emits for `input`, and how many output frames they make in all (after
    /// [`finish`](Self::finish)). `None`, the default, for an operator that does not stream.
    fn stream_runs(&self, _input: &Tensor) -> Option<StreamRuns> {
        None
    }

    /// [`exec`](Self::exec) run by run: this rank's band of each run of output frames (a causal
    /// video decoder's latent frame), handed to `emit` as soon as it is computed, in order, on
    /// the host. Every rank emits the same number of runs ([`stream_runs`](Self::stream_runs));
    /// `emit` gathers each run to the owner, which finishes it and passes it on.
    fn exec_streaming(
        &self,
        _input: &Tensor,
        _ctx: &mut ShardContext<'_>,
        _emit: &mut dyn FnMut(Tensor) -> Result<(), OperatorError>,
    ) -> Result<(), OperatorError> {
        Err("this operator does not stream its output".into())
    }
}

/// The runs of a streamed sharded computation ([`ShardOperator::stream_runs`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamRuns {
    /// Runs emitted (and gathered), the same on every rank.
    pub runs: usize,
    /// Output frames in all, after `finish`.
    pub frames: usize,
}

/// Communication inside one rank's sharded computation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ShardTraffic {
    /// Halo exchanges made (one per halo conv call).
    pub halo_exchanges: u64,
    /// Bytes this rank sent as halo rows.
    pub halo_bytes_sent: u64,
    /// Time spent in halo exchanges (packing included; for an overlapped exchange, the time
    /// the computation waited for it, and the packing and placing of the edge pieces).
    pub halo_time: Duration,
    /// Of [`Self::halo_time`], the time this rank's computation was blocked waiting for its
    /// neighbours' rows: a whole blocking exchange, or the wait after an overlapped
    /// convolution's interior ([`ShardContext::conv_with_halo`]).
    pub halo_wait: Duration,
    /// Halo exchanges that ran while the rows needing no halo were computed.
    pub halo_overlapped: u64,
    /// Halo bytes this rank did not send because the neighbour already had them (rows of
    /// cached frames, which keep their halos); the reference sends them again every chunk.
    pub halo_bytes_reused: u64,
    /// Full-map gathers made (attention).
    pub map_gathers: u64,
    /// Bytes this rank sent for full-map gathers.
    pub map_bytes_sent: u64,
    /// Time spent in full-map gathers (assembly included).
    pub map_time: Duration,
    /// Exchanges of GroupNorm statistics (two or three per norm, 32 bytes per sample and group
    /// to each peer).
    pub norm_exchanges: u64,
    /// Bytes this rank sent as GroupNorm statistics.
    pub norm_bytes_sent: u64,
    /// Time spent exchanging GroupNorm statistics.
    pub norm_time: Duration,
}

impl ShardTraffic {
    /// Time spent communicating inside the computation.
    pub fn comm_time(&self) -> Duration {
        self.halo_time + self.map_time + self.norm_time
    }
}

/// The request-scoped state of one rank's sharded computation: the split axis and the band
/// table (or the grid of blocks) and the traffic counters. Created by the executor for one request and dropped after it, so
/// nothing outlives a request (one loaded model serves tile, shard and direct requests in any
/// order).
pub struct ShardContext<'c> {
    comm: &'c dyn Communicator,
    split: Split,
    /// Input rows per band row ([`ShardGeometry::unit`]).
    unit: usize,
    rank: usize,
    traffic: ShardTraffic,
    /// Whether [`Self::conv_with_halo`] computes the rows that need no halo while the exchange
    /// is in flight (on the CPU), or exchanges first.
    overlap: HaloOverlap,
}

/// When a shard convolution computes the rows that need no halo while its exchange is in flight
/// (on the CPU), rather than exchanging first. The outputs are the same bits in every case.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum HaloOverlap {
    /// Exchange first, always: the computation waits for its neighbours at every convolution.
    Never,
    /// Overlap where it pays ([`vae_planner::overlap_pays`]): every direct convolution, and a
    /// Winograd one whose part is large enough that computing it in pieces costs little.
    #[default]
    WherePays,
    /// Overlap every convolution that leaves its part an interior (for tests and measurement).
    Always,
}

/// How the map is cut: bands along one axis, or blocks of a 2-D grid.
#[derive(Debug, Clone)]
enum Split {
    Bands { axis: ShardAxis, bands: BandPartition },
    Blocks(BlockGrid),
}

/// The two spatial axes, in the order of [`BlockGrid`]'s extents.
const AXES: [ShardAxis; 2] = [ShardAxis::Height, ShardAxis::Width];

impl std::fmt::Debug for ShardContext<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardContext").field("rank", &self.rank).field("split", &self.split).finish()
    }
}

fn invalid(message: String) -> RuntimeError {
    RuntimeError::Inconsistent(message)
}

impl<'c> ShardContext<'c> {
    /// A context for `rank` of the ranks `0..bands.len()` of `comm`, splitting `axis` as
    /// `bands` (at the input's resolution) says.
    pub(crate) fn new(comm: &'c dyn Communicator, axis: ShardAxis, bands: BandPartition, rank: usize) -> Self {
        Self {
            comm,
            split: Split::Bands { axis, bands },
            unit: 1,
            rank,
            traffic: ShardTraffic::default(),
            overlap: HaloOverlap::default(),
        }
    }

    /// A context for `rank` of the ranks `0..grid.ranks()` of `comm`, holding its block of
    /// `grid` (at the input's resolution).
    pub(crate) fn blocks(comm: &'c dyn Communicator, grid: BlockGrid, rank: usize) -> Self {
        Self {
            comm,
            split: Split::Blocks(grid),
            unit: 1,
            rank,
            traffic: ShardTraffic::default(),
            overlap: HaloOverlap::default(),
        }
    }

    /// The same context over an input of `unit` rows (and columns) per band row
    /// ([`ShardGeometry::unit`]).
    pub(crate) fn with_unit(self, unit: usize) -> Self {
        Self { unit: unit.max(1), ..self }
    }

    /// The same context with halo exchanges overlapped with the interior's computation as
    /// `overlap` says.
    pub(crate) fn with_overlap(self, overlap: HaloOverlap) -> Self {
        Self { overlap, ..self }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks taking part.
    pub fn ranks(&self) -> usize {
        match &self.split {
            Split::Bands { bands, .. } => bands.len(),
            Split::Blocks(grid) => grid.ranks(),
        }
    }

    /// The split axis of a context of bands; `None` for blocks of a 2-D grid, which are cut
    /// along both ([`Self::halo_axes`]).
    pub fn axis(&self) -> Option<ShardAxis> {
        match &self.split {
            Split::Bands { axis, .. } => Some(*axis),
            Split::Blocks(_) => None,
        }
    }

    /// Whether the map is cut along the height and along the width: the axes along which
    /// [`Self::with_halo`] brings the neighbours' rows, so that a convolution must not pad them.
    pub fn halo_axes(&self) -> [bool; 2] {
        match &self.split {
            Split::Bands { axis: ShardAxis::Height, .. } => [true, false],
            Split::Bands { axis: ShardAxis::Width, .. } => [false, true],
            Split::Blocks(_) => [true, true],
        }
    }

    /// The traffic so far.
    pub fn traffic(&self) -> ShardTraffic {
        self.traffic
    }

    /// The tensor dimension of `axis` in `x`.
    fn dim_of(&self, x: &Tensor, axis: ShardAxis) -> Result<usize, RuntimeError> {
        axis.dim_in(x.rank()).ok_or_else(|| invalid(format!("cannot shard the {axis} of {}", x.shape())))
    }

    /// This rank's part of each split axis at the input's resolution: `(axis, its band, the
    /// whole extent)`.
    fn parts(&self) -> Vec<(ShardAxis, Range<usize>, usize)> {
        match &self.split {
            Split::Bands { axis, bands } => {
                vec![(*axis, bands.band(self.rank).expect("the rank takes part"), bands.extent())]
            }
            Split::Blocks(grid) => {
                let block = grid.block(self.rank).expect("the rank takes part");
                let extents = grid.extents();
                AXES.into_iter().zip(block).zip(extents).map(|((a, b), e)| (a, b, e)).collect()
            }
        }
    }

    /// How many rows each input row has become in `x`, a local band or block, along `axis`
    /// (nearest upsampling scales every band alike).
    fn scale_along(&self, x: &Tensor, axis: ShardAxis, band: usize) -> Result<usize, RuntimeError> {
        let local = x.dims()[self.dim_of(x, axis)?];
        if local == 0 || !local.is_multiple_of(band) {
            return Err(invalid(format!(
                "rank {}'s {axis} of {local} is not a whole multiple of its input band of {band}",
                self.rank
            )));
        }
        Ok(local / band)
    }

    /// This rank's band (or block) of the input.
    pub fn local_input(&self, input: &Tensor) -> Result<Tensor, RuntimeError> {
        // Borrowed until the first cut: a clone of the whole input would be a copy.
        let mut local = std::borrow::Cow::Borrowed(input);
        for (axis, band, extent) in self.parts() {
            let dim = self.dim_of(input, axis)?;
            if input.dims()[dim] != extent * self.unit {
                return Err(invalid(format!(
                    "input {} does not have the planned {axis} {}",
                    input.shape(),
                    extent * self.unit
                )));
            }
            local = std::borrow::Cow::Owned(local.narrow(dim, band.start * self.unit, band.len() * self.unit)?);
        }
        Ok(local.into_owned())
    }

    /// Where every rank's part of a map lies, given `x`, this rank's part: per rank, its dims
    /// (`x`'s, with the split axes set to that rank's share: nearest upsampling scales every
    /// band alike) and its offset in the whole map; and the whole map's dims.
    #[allow(clippy::type_complexity)] // (dims, offsets) per rank
    fn layout_of(&self, x: &Tensor) -> Result<(Vec<(Vec<usize>, Vec<usize>)>, Vec<usize>), RuntimeError> {
        let mut per_rank = vec![(x.dims().to_vec(), vec![0; x.rank()]); self.ranks()];
        let mut whole = x.dims().to_vec();
        for (axis, band, extent) in self.parts() {
            let (dim, scale) = (self.dim_of(x, axis)?, self.scale_along(x, axis, band.len())?);
            whole[dim] = extent * scale;
            let bands: Vec<Range<usize>> = match &self.split {
                Split::Bands { bands, .. } => bands.bands().to_vec(),
                Split::Blocks(grid) => (0..grid.ranks())
                    .map(|r| grid.block(r).expect("in the grid")[usize::from(axis == ShardAxis::Width)].clone())
                    .collect(),
            };
            for ((dims, offsets), band) in per_rank.iter_mut().zip(bands) {
                dims[dim] = band.len() * scale;
                offsets[dim] = band.start * scale;
            }
        }
        Ok((per_rank, whole))
    }

    /// The whole map on every rank taking part: each band (or block) sent to every other rank
    /// and put in its place. Every rank taking part must call it at the same point.
    pub fn all_gather_map(&mut self, x: &Tensor) -> Result<Tensor, RuntimeError> {
        let clock = Instant::now();
        let (layout, whole) = self.layout_of(x)?;
        let legs = (0..self.ranks())
            .filter(|&peer| peer != self.rank)
            .map(|peer| (peer, x.clone(), layout[peer].0.clone()))
            .collect();
        let (received, sent) = self.swap((&x.device(), x.dtype()), legs)?;
        let mut full = Tensor::zeros(whole, x.dtype(), &x.device())?;
        let origin = vec![0; x.rank()];
        full.copy_box_from(&layout[self.rank].1, x, &origin, x.dims())?;
        for (peer, part) in received {
            full.copy_box_from(&layout[peer].1, &part, &origin, part.dims())?;
        }
        self.traffic.map_gathers += 1;
        self.traffic.map_bytes_sent += sent;
        self.traffic.map_time += clock.elapsed();
        Ok(full)
    }

    /// GroupNorm (then SiLU, if `silu`) of the whole map of which `x` is this rank's band, on
    /// this band: the statistics are the whole map's, exchanged between the ranks taking part
    /// ([`GroupMoments::compute`]: fixed-point sums, so the result is bit-identical to
    /// [`Tensor::group_norm`] of the whole map, whatever the bands or blocks). CPU tensors only.
    ///
    /// Every rank taking part must call it at the same point with the same parameters.
    pub fn group_norm(
        &mut self,
        x: &Tensor,
        num_groups: usize,
        weight: &Tensor,
        bias: &Tensor,
        eps: f32,
        silu: bool,
    ) -> Result<Tensor, RuntimeError> {
        let mut count = x.group_len(num_groups)?;
        for (axis, band, extent) in self.parts() {
            let len = x.dims()[self.dim_of(x, axis)?];
            let scale = self.scale_along(x, axis, band.len())?;
            count = count.checked_div(len).map_or(0, |per_row| per_row * extent * scale);
        }
        let moments = GroupMoments::compute(x, num_groups, eps, count as u64, |own| self.merge_partials(own))?;
        Ok(x.group_norm_with(num_groups, weight, bias, &moments, silu)?)
    }

    /// Sends this rank's partial statistics to every other rank taking part and merges
    /// everyone's (exact, so the order does not matter; rank order is kept anyway).
    fn merge_partials(&mut self, own: Vec<GroupPartial>) -> Result<Vec<GroupPartial>, RuntimeError> {
        let clock = Instant::now();
        let mut message = Writer::new();
        for p in &own {
            let sum = p.sum as u128;
            message.u64(u64::from(p.extrema.min.to_bits())).u64(u64::from(p.extrema.max.to_bits()));
            message.u64(sum as u64).u64((sum >> 64) as u64);
        }
        let message = message.into_bytes();
        let peers: Vec<usize> = (0..self.ranks()).filter(|&r| r != self.rank).collect();
        let mut received: Vec<Vec<u8>> = vec![Vec::new(); peers.len()];
        {
            let mut legs: Vec<PeerExchange<'_>> = peers
                .iter()
                .zip(received.iter_mut())
                .map(|(&peer, recv)| PeerExchange { peer, send: &message, recv })
                .collect();
            self.comm.exchange_bytes(vae_transport::DataType::U8, &mut legs)?;
        }
        let mut merged = own;
        for bytes in &received {
            let mut rd = Reader::new(bytes, "GroupNorm statistics");
            for m in merged.iter_mut() {
                let bits = |v: u64| f32::from_bits(v as u32);
                let extrema = GroupExtrema { min: bits(rd.u64()?), max: bits(rd.u64()?) };
                let sum = (u128::from(rd.u64()?) | (u128::from(rd.u64()?) << 64)) as i128;
                *m = m.merge(GroupPartial { extrema, sum });
            }
            if !rd.rest().is_empty() {
                return Err(RuntimeError::Protocol(format!(
                    "rank {}: GroupNorm statistics of another size",
                    self.rank
                )));
            }
        }
        self.traffic.norm_exchanges += 1;
        self.traffic.norm_bytes_sent += (message.len() * peers.len()) as u64;
        self.traffic.norm_time += clock.elapsed();
        Ok(merged)
    }

    /// This rank's band (or block) of a whole map (the inverse of [`Self::all_gather_map`]).
    pub fn own_band(&self, full: &Tensor) -> Result<Tensor, RuntimeError> {
        let mut own = full.clone();
        for (axis, band, extent) in self.parts() {
            let dim = self.dim_of(full, axis)?;
            let len = full.dims()[dim];
            if len == 0 || !len.is_multiple_of(extent) {
                return Err(invalid(format!("a map {axis} of {len} is not a multiple of the input's {extent}")));
            }
            let scale = len / extent;
            own = own.narrow(dim, band.start * scale, band.len() * scale)?;
        }
        Ok(own)
    }

    /// Sends each leg's tensor to its peer and receives a tensor of the leg's dims from it
    /// (legs in ascending peer order; the peers list this rank in turn). Returns what arrived,
    /// by peer, on the device and in the type `like` names, and the bytes sent.
    ///
    /// Ranks that are threads of this process hand each other the tensors themselves through
    /// the group's mailbox, with a token exchange for ordering and failure detection: a device
    /// tensor stays on its device and is copied device-to-device into the receiver's buffer.
    /// A transport that moves device memory itself (NCCL, one GPU per rank) sends a device
    /// tensor's elements from GPU to GPU in their own type. Other groups send f32 host bytes (a
    /// download for a device tensor: the CPU backend is f32 only, so a bf16 band's rows travel
    /// at 4 bytes per element).
    #[allow(clippy::type_complexity)] // (peer, tensor, dims) legs
    fn swap(
        &self,
        like: (&Device, DType),
        legs: Vec<(usize, Tensor, Vec<usize>)>,
    ) -> Result<(Vec<(usize, Tensor)>, u64), RuntimeError> {
        let (device, dtype) = like;
        let rank = self.rank;
        let mismatch =
            |peer: usize, what: String| RuntimeError::Protocol(format!("rank {rank} expected {what} from rank {peer}"));
        if let Some(mailbox) = self.comm.mailbox() {
            let sent = legs.iter().map(|(_, t, _)| t.size_in_bytes() as u64).sum();
            let expected: Vec<(usize, Vec<usize>)> = legs.iter().map(|(p, _, d)| (*p, d.clone())).collect();
            for (peer, t, _) in legs {
                mailbox.post(rank, peer, Box::new(t));
            }
            let mut tokens: Vec<Vec<u8>> = vec![Vec::new(); expected.len()];
            let mut token_legs: Vec<PeerExchange<'_>> = expected
                .iter()
                .zip(tokens.iter_mut())
                .map(|((peer, _), recv)| PeerExchange { peer: *peer, send: &[], recv })
                .collect();
            self.comm.exchange_bytes(vae_transport::DataType::U8, &mut token_legs)?;
            let mut received = Vec::with_capacity(expected.len());
            for (peer, dims) in expected {
                let parcel = mailbox.take(peer, rank).ok_or_else(|| mismatch(peer, "a tensor".into()))?;
                let t = *parcel.downcast::<Tensor>().map_err(|_| mismatch(peer, "a tensor".into()))?;
                if t.dims() != dims.as_slice() {
                    return Err(mismatch(peer, format!("rows {dims:?}, got {}", t.shape())));
                }
                // Converted only where needed: `to_device` and `to_dtype` copy even when nothing
                // changes.
                let t = if t.device() == *device { t } else { t.to_device(device)? };
                let t = if t.dtype() == dtype { t } else { t.to_dtype(dtype)? };
                received.push((peer, t));
            }
            return Ok((received, sent));
        }
        if let Device::Cuda(ordinal) = *device
            && self.comm.exchanges_device_buffers(ordinal)
        {
            return self.swap_on_device(like, legs);
        }
        let staged: Vec<(usize, Tensor, Vec<usize>)> =
            legs.into_iter().map(|(p, t, d)| Ok((p, on_host(t)?, d))).collect::<Result<_, RuntimeError>>()?;
        let sent = staged.iter().map(|(_, t, _)| t.size_in_bytes() as u64).sum();
        let mut bytes: Vec<Vec<u8>> = vec![Vec::new(); staged.len()];
        {
            let mut byte_legs = staged
                .iter()
                .zip(bytes.iter_mut())
                .map(|((peer, t, _), recv)| Ok(PeerExchange { peer: *peer, send: t.as_bytes()?, recv }))
                .collect::<Result<Vec<_>, RuntimeError>>()?;
            self.comm.exchange_bytes(vae_transport::DataType::F32, &mut byte_legs)?;
        }
        let mut received = Vec::with_capacity(staged.len());
        for ((peer, _, dims), bytes) in staged.into_iter().zip(bytes) {
            let expected = Shape::new(dims.clone()).elem_count() * DType::F32.size_in_bytes();
            if bytes.len() != expected {
                return Err(mismatch(peer, format!("{expected} bytes of {dims:?} rows, got {}", bytes.len())));
            }
            let t = Tensor::from_bytes(DType::F32, dims, &bytes, device)?.to_dtype(dtype)?;
            received.push((peer, t));
        }
        Ok((received, sent))
    }

    /// [`Self::swap`] over a transport that moves device memory itself: each leg's tensor, on
    /// the device and in the type `like` names, goes from GPU to GPU; what arrives lands in a fresh
    /// tensor of the leg's dims.
    #[allow(clippy::type_complexity)] // as `swap`
    fn swap_on_device(
        &self,
        like: (&Device, DType),
        legs: Vec<(usize, Tensor, Vec<usize>)>,
    ) -> Result<(Vec<(usize, Tensor)>, u64), RuntimeError> {
        let (device, dtype) = (*like.0, like.1);
        // vae-tensor names a tensor's memory, vae-transport moves it: the same three fields.
        let bytes = |m: Option<DeviceMemory>| {
            m.map(|m| DeviceBytes { ordinal: m.ordinal, address: m.address, len: m.len })
                .ok_or_else(|| invalid(format!("a halo exchange on {device} with a tensor not on a GPU")))
        };
        let mut sends = Vec::with_capacity(legs.len());
        let mut recvs = Vec::with_capacity(legs.len());
        for (peer, t, dims) in legs {
            // Converted only where needed: `to_device` and `to_dtype` copy even when nothing changes.
            let t = if t.device() == device { t } else { t.to_device(&device)? };
            let t = if t.dtype() == dtype { t } else { t.to_dtype(dtype)? };
            sends.push((peer, t));
            recvs.push(Tensor::zeros(dims, dtype, &device)?);
        }
        let mut exchange = Vec::with_capacity(sends.len());
        for ((peer, send), recv) in sends.iter().zip(recvs.iter_mut()) {
            let (send, recv) = (bytes(send.device_memory()?)?, bytes(recv.device_memory_mut()?)?);
            exchange.push(DeviceExchange { peer: *peer, send, recv });
        }
        // SAFETY: the sends and receive buffers are tensors owned here until after the call, and
        // nothing else uses them meanwhile (this thread waits in it); `device_memory` returned
        // once their pending work had finished; each receive buffer is a tensor of its own, of
        // exactly its leg's dims, so none overlap.
        unsafe { self.comm.exchange_device(&exchange) }?;
        let sent = sends.iter().map(|(_, t)| t.size_in_bytes() as u64).sum();
        Ok((sends.into_iter().map(|(peer, _)| peer).zip(recvs).collect(), sent))
    }
}

/// `t` in host memory (no copy when it is there already).
fn on_host(t: Tensor) -> Result<Tensor, RuntimeError> {
    if t.device().is_cpu() { Ok(t) } else { Ok(t.to_device(&Device::Cpu)?) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vae_transport::{TransportConfig, run_local};

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(24))]
        /// The distributed GroupNorm of bands, on any number of ranks and along either axis, or
        /// of blocks of a grid, is the whole map's GroupNorm bit for bit.
        #[test]
        fn a_banded_group_norm_is_the_whole_maps(
            ranks in 1usize..5, groups in 1usize..4, per_group in 1usize..3, n in 1usize..3,
            h in 4usize..14, w in 4usize..14, seed in 0u64..1000, width in proptest::prelude::any::<bool>(),
            big in proptest::prelude::any::<bool>(), blocks in proptest::prelude::any::<bool>(),
        ) {
            let c = groups * per_group;
            let (lo, hi) = if big { (-4e4, 1e5) } else { (-1.0, 3.0) };
            let map = Tensor::seeded_uniform(vec![n, c, h, w], seed, lo, hi, &Device::Cpu).unwrap();
            let gamma = Tensor::seeded_uniform(vec![c], seed + 1, 0.5, 1.5, &Device::Cpu).unwrap();
            let beta = Tensor::seeded_uniform(vec![c], seed + 2, -0.5, 0.5, &Device::Cpu).unwrap();
            let whole = map.group_norm_silu(groups, &gamma, &beta, 1e-6).unwrap();
            let (axis, extent, dim) = if width { (ShardAxis::Width, w, 3) } else { (ShardAxis::Height, h, 2) };
            let ranks = ranks.min(extent);
            let bands = BandPartition::new(extent, ranks, 1).unwrap();
            // Or blocks of the grid closest to square, over the same ranks.
            let grid = BlockGrid::new([h, w], vae_planner::square_grid(ranks, h, w, [1, 1]).unwrap(), [1, 1]).unwrap();
            let results = run_local(ranks, TransportConfig::default(), |comm| {
                let rank = comm.rank();
                let mut ctx = if blocks {
                    ShardContext::blocks(&comm, grid.clone(), rank)
                } else {
                    ShardContext::new(&comm, axis, bands.clone(), rank)
                };
                let band = ctx.local_input(&map).unwrap();
                (ctx.group_norm(&band, groups, &gamma, &beta, 1e-6, true).unwrap(), ctx.traffic())
            })
            .unwrap();
            for (rank, result) in results.into_iter().enumerate() {
                let (got, traffic) = result.unwrap();
                let want = if blocks {
                    let [rows, cols] = grid.block(rank).unwrap();
                    whole.narrow(2, rows.start, rows.len()).unwrap().narrow(3, cols.start, cols.len()).unwrap()
                } else {
                    let range = bands.bands()[rank].clone();
                    whole.narrow(dim, range.start, range.len()).unwrap()
                };
                proptest::prop_assert!(got.bit_eq(&want), "rank {} of {}", rank, ranks);
                // Sums, squares, and the sums again where values pass the fixed range.
                proptest::prop_assert_eq!(traffic.norm_exchanges, if big { 3 } else { 2 });
            }
        }
    }
}
