//! Spatial-shard execution (the second strategy of the specification): the input is cut into
//! bands along one spatial axis, one per rank, and every feature map stays sharded the same way
//! through the whole network. Each convolution takes its missing neighbour rows (the halo) from
//! the adjacent ranks; per-pixel ops run locally; ops that need the whole map (attention) gather
//! it. The output equals the single-device direct (untiled) computation: there are no tiles,
//! seams or blends.
//!
//! This module is mechanism only: [`ShardContext`] carries the request-scoped state (the axis,
//! the band table, halo statistics) and the communication primitives a model's sharded forward
//! calls; [`ShardOperator`] is what a model implements. Which requests shard, along which axis,
//! is model policy and lives in the adapters.

use std::ops::Range;
use std::time::{Duration, Instant};

use vae_planner::{BandPartition, ShardAxis};
use vae_tensor::{DType, Device, DeviceMemory, GroupExtrema, GroupMoments, GroupPartial, Shape, Tensor};
use vae_transport::wire::{Reader, Writer};
use vae_transport::{Communicator, DeviceBytes, DeviceExchange, PeerExchange};

use crate::RuntimeError;
use crate::executor::OperatorError;

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
    /// Time spent in halo exchanges (packing included).
    pub halo_time: Duration,
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

/// The request-scoped state of one rank's sharded computation: the split axis, the band table
/// and the traffic counters. Created by the executor for one request and dropped after it, so
/// nothing outlives a request (one loaded model serves tile, shard and direct requests in any
/// order).
pub struct ShardContext<'c> {
    comm: &'c dyn Communicator,
    axis: ShardAxis,
    bands: BandPartition,
    /// Input rows per band row ([`ShardGeometry::unit`]).
    unit: usize,
    rank: usize,
    traffic: ShardTraffic,
}

impl std::fmt::Debug for ShardContext<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardContext")
            .field("rank", &self.rank)
            .field("axis", &self.axis)
            .field("bands", &self.bands)
            .finish()
    }
}

fn invalid(message: String) -> RuntimeError {
    RuntimeError::Inconsistent(message)
}

impl<'c> ShardContext<'c> {
    /// A context for `rank` of the ranks `0..bands.len()` of `comm`, splitting `axis` as
    /// `bands` (at the input's resolution) says.
    pub(crate) fn new(comm: &'c dyn Communicator, axis: ShardAxis, bands: BandPartition, rank: usize) -> Self {
        Self { comm, axis, bands, unit: 1, rank, traffic: ShardTraffic::default() }
    }

    /// The same context over an input of `unit` rows per band row ([`ShardGeometry::unit`]).
    pub(crate) fn with_unit(self, unit: usize) -> Self {
        Self { unit: unit.max(1), ..self }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks taking part.
    pub fn ranks(&self) -> usize {
        self.bands.len()
    }

    /// The split axis.
    pub fn axis(&self) -> ShardAxis {
        self.axis
    }

    /// The band table at the input's resolution.
    pub fn bands(&self) -> &BandPartition {
        &self.bands
    }

    /// This rank's rows of the input.
    pub fn band(&self) -> Range<usize> {
        self.bands.band(self.rank).expect("the rank takes part")
    }

    /// The traffic so far.
    pub fn traffic(&self) -> ShardTraffic {
        self.traffic
    }

    fn dim(&self, x: &Tensor) -> Result<usize, RuntimeError> {
        self.axis.dim_in(x.rank()).ok_or_else(|| invalid(format!("cannot shard the {} of {}", self.axis, x.shape())))
    }

    /// How many rows each input row has become in `x`, a local band (nearest upsampling scales
    /// every band alike).
    fn scale_of(&self, x: &Tensor) -> Result<usize, RuntimeError> {
        let local = x.dims()[self.dim(x)?];
        let band = self.band().len();
        if local == 0 || !local.is_multiple_of(band) {
            return Err(invalid(format!(
                "rank {}'s band of {local} rows is not a whole multiple of its input band of {band}",
                self.rank
            )));
        }
        Ok(local / band)
    }

    /// This rank's band of the input along the axis.
    pub fn local_input(&self, input: &Tensor) -> Result<Tensor, RuntimeError> {
        let dim = self.dim(input)?;
        let band = self.band();
        if input.dims()[dim] != self.bands.extent() * self.unit {
            return Err(invalid(format!(
                "input {} does not have the planned extent {}",
                input.shape(),
                self.bands.extent() * self.unit
            )));
        }
        Ok(input.narrow(dim, band.start * self.unit, band.len() * self.unit)?)
    }

    /// `x` (this rank's band) with `halo` rows of each neighbour on either side along the axis,
    /// and zero rows at the global edges: the input of a convolution whose padding along the
    /// axis is then 0. Written into one buffer of the padded size.
    ///
    /// Every rank taking part must call it in the same order with the same `halo`.
    pub fn with_halo(&mut self, x: &Tensor, halo: usize) -> Result<Tensor, RuntimeError> {
        if halo == 0 {
            return Ok(x.clone());
        }
        let clock = Instant::now();
        let dim = self.dim(x)?;
        let len = x.dims()[dim];
        if len < halo {
            return Err(invalid(format!("rank {}'s band of {len} rows is narrower than the halo {halo}", self.rank)));
        }
        let (has_prev, has_next) = (self.rank > 0, self.rank + 1 < self.ranks());
        let mut halo_dims = x.dims().to_vec();
        halo_dims[dim] = halo;
        let mut legs = Vec::with_capacity(2);
        if has_prev {
            legs.push((self.rank - 1, x.narrow(dim, 0, halo)?, halo_dims.clone()));
        }
        if has_next {
            legs.push((self.rank + 1, x.narrow(dim, len - halo, halo)?, halo_dims.clone()));
        }
        let (received, sent) = self.swap(x, legs)?;
        let mut padded_dims = x.dims().to_vec();
        padded_dims[dim] = len + 2 * halo;
        // Zero-initialised: the rows no neighbour fills are the global zero padding.
        let mut padded = Tensor::zeros(padded_dims, x.dtype(), &x.device())?;
        let origin = vec![0; x.rank()];
        let mut at = origin.clone();
        at[dim] = halo;
        padded.copy_box_from(&at, x, &origin, x.dims())?;
        for (peer, rows) in received {
            at[dim] = if peer < self.rank { 0 } else { len + halo };
            padded.copy_box_from(&at, &rows, &origin, &halo_dims)?;
        }
        self.traffic.halo_exchanges += 1;
        self.traffic.halo_bytes_sent += sent;
        self.traffic.halo_time += clock.elapsed();
        Ok(padded)
    }

    /// Records that `cached`, a conv input kept from an earlier chunk with its `halo` rows
    /// already in place, was not exchanged again (for the traffic report).
    pub fn note_reused_halo(&mut self, cached: &Tensor, halo: usize) {
        let Ok(dim) = self.dim(cached) else { return };
        let rows = cached.dims()[dim];
        if halo == 0 || rows == 0 {
            return;
        }
        let neighbours = usize::from(self.rank > 0) + usize::from(self.rank + 1 < self.ranks());
        self.traffic.halo_bytes_reused += (neighbours * halo * (cached.size_in_bytes() / rows)) as u64;
    }

    /// The whole map along the axis on every rank taking part: each band sent to every other
    /// rank, concatenated in rank order. Every rank taking part must call it at the same point.
    pub fn all_gather_map(&mut self, x: &Tensor) -> Result<Tensor, RuntimeError> {
        let clock = Instant::now();
        let dim = self.dim(x)?;
        let scale = self.scale_of(x)?;
        let bands = self.bands.scaled(scale);
        let legs = (0..self.ranks())
            .filter(|&peer| peer != self.rank)
            .map(|peer| {
                let mut dims = x.dims().to_vec();
                dims[dim] = bands.bands()[peer].len();
                (peer, x.clone(), dims)
            })
            .collect();
        let (received, sent) = self.swap(x, legs)?;
        let mut parts: Vec<Tensor> = received.into_iter().map(|(_, t)| t).collect();
        parts.insert(self.rank, x.clone());
        let refs: Vec<&Tensor> = parts.iter().collect();
        let full = Tensor::cat(&refs, dim)?;
        self.traffic.map_gathers += 1;
        self.traffic.map_bytes_sent += sent;
        self.traffic.map_time += clock.elapsed();
        Ok(full)
    }

    /// GroupNorm (then SiLU, if `silu`) of the whole map of which `x` is this rank's band, on
    /// this band: the statistics are the whole map's, exchanged between the ranks taking part
    /// ([`GroupMoments::compute`]: fixed-point sums, so the result is bit-identical to
    /// [`Tensor::group_norm`] of the whole map, whatever the bands). CPU tensors only.
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
        let dim = self.dim(x)?;
        let scale = self.scale_of(x)?;
        let local = x.group_len(num_groups)?;
        let count = if x.dims()[dim] == 0 { 0 } else { local / x.dims()[dim] * self.bands.extent() * scale };
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

    /// This rank's band of a whole map (the inverse of [`Self::all_gather_map`]).
    pub fn own_band(&self, full: &Tensor) -> Result<Tensor, RuntimeError> {
        let dim = self.dim(full)?;
        let extent = full.dims()[dim];
        if extent == 0 || !extent.is_multiple_of(self.bands.extent()) {
            return Err(invalid(format!("a map of {extent} rows is not a multiple of the input extent")));
        }
        let band = self.bands.scaled(extent / self.bands.extent()).bands()[self.rank].clone();
        Ok(full.narrow(dim, band.start, band.len())?)
    }

    /// Sends each leg's tensor to its peer and receives a tensor of the leg's dims from it
    /// (legs in ascending peer order; the peers list this rank in turn). Returns what arrived,
    /// by peer, on `like`'s device in `like`'s type, and the bytes sent.
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
        &mut self,
        like: &Tensor,
        legs: Vec<(usize, Tensor, Vec<usize>)>,
    ) -> Result<(Vec<(usize, Tensor)>, u64), RuntimeError> {
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
                let t = if t.device() == like.device() { t } else { t.to_device(&like.device())? };
                received.push((peer, t.to_dtype(like.dtype())?));
            }
            return Ok((received, sent));
        }
        if let Device::Cuda(ordinal) = like.device()
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
            let t = Tensor::from_bytes(DType::F32, dims, &bytes, &like.device())?.to_dtype(like.dtype())?;
            received.push((peer, t));
        }
        Ok((received, sent))
    }

    /// [`Self::swap`] over a transport that moves device memory itself: each leg's tensor, on
    /// `like`'s device in `like`'s type, goes from GPU to GPU; what arrives lands in a fresh
    /// tensor of the leg's dims.
    #[allow(clippy::type_complexity)] // as `swap`
    fn swap_on_device(
        &mut self,
        like: &Tensor,
        legs: Vec<(usize, Tensor, Vec<usize>)>,
    ) -> Result<(Vec<(usize, Tensor)>, u64), RuntimeError> {
        let device = like.device();
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
            let t = if t.dtype() == like.dtype() { t } else { t.to_dtype(like.dtype())? };
            sends.push((peer, t));
            recvs.push(Tensor::zeros(dims, like.dtype(), &device)?);
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
    use vae_transport::{BytePathOnly, TransportConfig, run_local};

    /// Each rank's halo'd band and gathered map of a [1, 2, 7, 5] map split in 3 height bands.
    fn halos_and_maps(comm: &dyn Communicator) -> (Tensor, Tensor, ShardTraffic) {
        let global = Tensor::seeded_uniform(vec![1, 2, 7, 5], 3, -1.0, 1.0, &Device::Cpu).unwrap();
        let bands = BandPartition::new(7, 3, 2).unwrap();
        let rank = comm.rank();
        let mut ctx = ShardContext::new(comm, ShardAxis::Height, bands, rank);
        let band = ctx.local_input(&global).unwrap();
        let padded = ctx.with_halo(&band, 2).unwrap();
        let map = ctx.all_gather_map(&band).unwrap();
        assert!(map.bit_eq(&global), "rank {rank}: the gathered map is the global one");
        (padded, map, ctx.traffic())
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(24))]
        /// The distributed GroupNorm of bands, on any number of ranks and along either axis,
        /// is the whole map's GroupNorm bit for bit.
        #[test]
        fn a_banded_group_norm_is_the_whole_maps(
            ranks in 1usize..5, groups in 1usize..4, per_group in 1usize..3, n in 1usize..3,
            h in 4usize..14, w in 4usize..14, seed in 0u64..1000, width in proptest::prelude::any::<bool>(),
            big in proptest::prelude::any::<bool>(),
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
            let results = run_local(ranks, TransportConfig::default(), |comm| {
                let rank = comm.rank();
                let mut ctx = ShardContext::new(&comm, axis, bands.clone(), rank);
                let band = ctx.local_input(&map).unwrap();
                (ctx.group_norm(&band, groups, &gamma, &beta, 1e-6, true).unwrap(), ctx.traffic())
            })
            .unwrap();
            for (rank, result) in results.into_iter().enumerate() {
                let (got, traffic) = result.unwrap();
                let range = bands.bands()[rank].clone();
                let want = whole.narrow(dim, range.start, range.len()).unwrap();
                proptest::prop_assert!(got.bit_eq(&want), "rank {} of {}", rank, ranks);
                // Sums, squares, and the sums again where values pass the fixed range.
                proptest::prop_assert_eq!(traffic.norm_exchanges, if big { 3 } else { 2 });
            }
        }
    }

    #[test]
    fn the_mailbox_and_the_byte_path_give_the_same_halos() {
        let config = TransportConfig::default();
        let by_mailbox = run_local(3, config, |comm| {
            assert!(comm.mailbox().is_some(), "local ranks share a mailbox");
            halos_and_maps(&comm)
        })
        .unwrap();
        let by_bytes = run_local(3, config, |comm| halos_and_maps(&BytePathOnly(comm))).unwrap();
        let global = Tensor::seeded_uniform(vec![1, 2, 7, 5], 3, -1.0, 1.0, &Device::Cpu).unwrap();
        // Bands of 3, 2 and 2 rows; the halo is 2 rows, zeros beyond the global edges.
        for (rank, (m, b)) in by_mailbox.into_iter().zip(by_bytes).enumerate() {
            let ((mp, _, mt), (bp, _, bt)) = (m.unwrap(), b.unwrap());
            assert!(mp.bit_eq(&bp), "rank {rank}: same halo'd band on both paths");
            assert_eq!((mt.halo_bytes_sent, mt.map_bytes_sent), (bt.halo_bytes_sent, bt.map_bytes_sent));
            let (start, len) = [(0, 3), (3, 2), (5, 2)][rank];
            let (lo, hi) = (start as isize - 2, (start + len + 2) as isize);
            for row in lo..hi {
                let got = mp.narrow(2, (row - lo) as usize, 1).unwrap();
                let want = if (0..7).contains(&row) {
                    global.narrow(2, row as usize, 1).unwrap()
                } else {
                    Tensor::zeros(vec![1, 2, 1, 5], DType::F32, &Device::Cpu).unwrap()
                };
                assert!(got.bit_eq(&want), "rank {rank}, global row {row}");
            }
        }
    }
}
