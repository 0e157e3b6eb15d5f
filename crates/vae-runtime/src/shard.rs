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
use vae_tensor::{DType, Device, Shape, Tensor};
use vae_transport::{Communicator, PeerExchange};

use crate::RuntimeError;
use crate::executor::OperatorError;

/// What a model's sharded computation needs to know before it starts, from the (validated)
/// input alone, so that every rank reaches the same verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardGeometry {
    /// The widest halo (rows from each neighbour) any op of the network needs at the input's
    /// resolution: every band must be at least this wide.
    pub min_band: usize,
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
}

impl ShardTraffic {
    /// Time spent communicating inside the computation.
    pub fn comm_time(&self) -> Duration {
        self.halo_time + self.map_time
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
        Self { comm, axis, bands, rank, traffic: ShardTraffic::default() }
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
        if input.dims()[dim] != self.bands.extent() {
            return Err(invalid(format!(
                "input {} does not have the planned extent {}",
                input.shape(),
                self.bands.extent()
            )));
        }
        Ok(input.narrow(dim, band.start, band.len())?)
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
        // Rows leave through host memory (a download for a device tensor), where they are f32
        // whatever the device type (the CPU backend is f32 only): a bf16 band's halo rows travel
        // at 4 bytes per element.
        let first = if has_prev { Some(on_host(x.narrow(dim, 0, halo)?)?) } else { None };
        let last = if has_next { Some(on_host(x.narrow(dim, len - halo, halo)?)?) } else { None };
        let mut from_prev = Vec::<u8>::new();
        let mut from_next = Vec::<u8>::new();
        {
            let mut legs = Vec::with_capacity(2);
            if let Some(rows) = &first {
                legs.push(PeerExchange { peer: self.rank - 1, send: rows.as_bytes()?, recv: &mut from_prev });
            }
            if let Some(rows) = &last {
                legs.push(PeerExchange { peer: self.rank + 1, send: rows.as_bytes()?, recv: &mut from_next });
            }
            self.comm.exchange_bytes(vae_transport::DataType::F32, &mut legs)?;
        }
        let sent = first.iter().chain(&last).map(|t| t.size_in_bytes() as u64).sum::<u64>();
        let mut halo_dims = x.dims().to_vec();
        halo_dims[dim] = halo;
        let mut padded_dims = x.dims().to_vec();
        padded_dims[dim] = len + 2 * halo;
        // Zero-initialised: the rows no neighbour fills are the global zero padding.
        let mut padded = Tensor::zeros(padded_dims, x.dtype(), &x.device())?;
        let origin = vec![0; x.rank()];
        let mut at = origin.clone();
        at[dim] = halo;
        padded.copy_box_from(&at, x, &origin, x.dims())?;
        for (bytes, row) in [(has_prev.then_some(&from_prev), 0), (has_next.then_some(&from_next), len + halo)] {
            let Some(bytes) = bytes else { continue };
            let rows = self.tensor_from_peer(x, &halo_dims, bytes)?;
            at[dim] = row;
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
        let mut received: Vec<Vec<u8>> = vec![Vec::new(); self.ranks()];
        let staged = if x.device().is_cpu() { None } else { Some(x.to_device(&Device::Cpu)?) };
        {
            let send = staged.as_ref().unwrap_or(x).as_bytes()?;
            let mut legs: Vec<PeerExchange<'_>> = received
                .iter_mut()
                .enumerate()
                .filter(|(peer, _)| *peer != self.rank)
                .map(|(peer, recv)| PeerExchange { peer, send, recv })
                .collect();
            self.comm.exchange_bytes(vae_transport::DataType::F32, &mut legs)?;
        }
        let sent_each = staged.as_ref().unwrap_or(x).size_in_bytes();
        let mut parts = Vec::with_capacity(self.ranks());
        for (peer, bytes) in received.iter().enumerate() {
            if peer == self.rank {
                parts.push(x.clone());
                continue;
            }
            let mut dims = x.dims().to_vec();
            dims[dim] = bands.bands()[peer].len();
            parts.push(self.tensor_from_peer(x, &dims, bytes)?);
        }
        let refs: Vec<&Tensor> = parts.iter().collect();
        let full = Tensor::cat(&refs, dim)?;
        self.traffic.map_gathers += 1;
        self.traffic.map_bytes_sent += (sent_each * (self.ranks() - 1)) as u64;
        self.traffic.map_time += clock.elapsed();
        Ok(full)
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

    /// Rows a peer sent (f32 host bytes) as a tensor on `like`'s device with `like`'s type.
    fn tensor_from_peer(&self, like: &Tensor, dims: &[usize], bytes: &[u8]) -> Result<Tensor, RuntimeError> {
        let expected = Shape::new(dims.to_vec()).elem_count() * DType::F32.size_in_bytes();
        if bytes.len() != expected {
            return Err(RuntimeError::Protocol(format!(
                "rank {} expected {expected} bytes of {dims:?} rows from a neighbour, got {}",
                self.rank,
                bytes.len()
            )));
        }
        Ok(Tensor::from_bytes(DType::F32, dims.to_vec(), bytes, &like.device())?.to_dtype(like.dtype())?)
    }
}

/// `t` in host memory (no copy when it is there already).
fn on_host(t: Tensor) -> Result<Tensor, RuntimeError> {
    if t.device().is_cpu() { Ok(t) } else { Ok(t.to_device(&Device::Cpu)?) }
}
