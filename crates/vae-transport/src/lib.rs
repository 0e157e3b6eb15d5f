//! Collective communication between the ranks of a vae-parallel group.
//!
//! The [`Communicator`] trait is the only thing the layers above see. It is small on purpose:
//! `all_gather`, `gather`, `broadcast`, `all_reduce`, paired neighbour exchange and `barrier`,
//! on byte buffers tagged with their element type, plus typed helpers in [`CommunicatorExt`].
//!
//! Backends:
//! - [`local`]: N ranks as threads of one process ([`local::run_local`]).
//! - [`socket`]: N processes on one or more hosts over TCP or Unix sockets, with a rendezvous at
//!   a master address.
//! - `nccl` (feature `nccl`): one rank per GPU; across processes, the NCCL unique id travels
//!   over an already-joined group such as a socket group.
//!
//! # Failure semantics
//! Every blocking wait has a deadline, and every backend has an abort path: when a rank returns
//! an error ([`Communicator::abort`]), panics, or its process dies, every other rank's pending or
//! next collective returns [`TransportError::PeerFailed`] naming that rank within
//! [`TransportConfig::failure_timeout`]. Ranks that call different collectives get
//! [`TransportError::CollectiveMismatch`]. Nothing hangs.
//!
//! # Determinism
//! `all_reduce` reduces in rank order on every rank, so floating-point sums are bit-identical
//! across ranks.

pub mod auth;
mod config;
mod error;
pub mod local;
pub mod mailbox;
mod mesh;
#[cfg(feature = "nccl")]
pub mod nccl;
mod pool;
pub mod socket;
mod stats;
pub mod wire;

use std::fmt;

pub use config::{ENV_COLLECTIVE_TIMEOUT, ENV_CONNECT_TIMEOUT, ENV_FAILURE_TIMEOUT, TransportConfig};

/// The most ranks a group may have. Far beyond any VAE decode (a rank needs at least a band of
/// latent rows or a tile), and small enough that a mistyped size is a clear error instead of a
/// process that allocates a mesh of billions of queues.
pub const MAX_WORLD_SIZE: usize = 4096;

/// An error unless `size` ranks can form a group: at least one, at most [`MAX_WORLD_SIZE`].
pub fn check_world_size(size: usize) -> Result<()> {
    if size == 0 {
        return Err(TransportError::InvalidArgument("a group needs at least one rank".into()));
    }
    if size > MAX_WORLD_SIZE {
        return Err(TransportError::InvalidArgument(format!(
            "a group of {size} ranks is larger than the limit of {MAX_WORLD_SIZE}"
        )));
    }
    Ok(())
}
pub use auth::GroupSecret;
pub use error::{Result, TransportError};
pub use local::{LocalComm, local_group, panic_message, run_local};
pub use mailbox::{Mailbox, Parcel};
#[cfg(feature = "nccl")]
pub use nccl::{NcclComm, nccl_available};
pub use socket::{Endpoint, SocketComm, SocketOptions};
pub use stats::{CommStats, OpStats};

/// Element types a buffer can hold on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DataType {
    /// Raw bytes.
    U8 = 1,
    /// Signed 64-bit integers.
    I64 = 2,
    /// Unsigned 64-bit integers.
    U64 = 3,
    /// 32-bit floats.
    F32 = 4,
    /// 64-bit floats.
    F64 = 5,
}

impl DataType {
    /// Size of one element in bytes.
    pub const fn size_in_bytes(self) -> usize {
        match self {
            Self::U8 => 1,
            Self::F32 => 4,
            Self::I64 | Self::U64 | Self::F64 => 8,
        }
    }

    pub(crate) fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => Self::U8,
            2 => Self::I64,
            3 => Self::U64,
            4 => Self::F32,
            5 => Self::F64,
            _ => return None,
        })
    }
}

impl fmt::Display for DataType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            Self::U8 => "u8",
            Self::I64 => "i64",
            Self::U64 => "u64",
            Self::F32 => "f32",
            Self::F64 => "f64",
        };
        f.write_str(name)
    }
}

/// Reduction applied by [`Communicator::all_reduce_bytes`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ReduceOp {
    /// Element-wise sum (wrapping for integers), in rank order.
    Sum = 1,
    /// Element-wise maximum (`f32::max` semantics for floats: a NaN loses to a number).
    Max = 2,
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Sum => "sum",
            Self::Max => "max",
        })
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A plain-data element type that can travel through a [`Communicator`].
pub trait Element: bytemuck::Pod + Send + Sync + sealed::Sealed + 'static {
    /// The wire tag of this type.
    const DTYPE: DataType;
}

macro_rules! element {
    ($($t:ty => $d:ident),*) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DataType = DataType::$d;
        }
    )*};
}
element!(u8 => U8, i64 => I64, u64 => U64, f32 => F32, f64 => F64);

/// A receive buffer, seen as bytes. Implemented for `Vec<T>` of every [`Element`], so that
/// backends write straight into a correctly aligned, typed vector, without zero-filling it
/// first.
pub trait ByteBuf {
    /// The current contents as bytes.
    fn as_bytes(&self) -> &[u8];
    /// Replaces the contents with the concatenation of `parts`. Fails when a part is not a
    /// whole number of elements (the sender used another element type).
    fn assign_concat(&mut self, parts: &[&[u8]]) -> Result<()>;
}

impl<T: Element> ByteBuf for Vec<T> {
    fn as_bytes(&self) -> &[u8] {
        bytemuck::cast_slice(self)
    }

    fn assign_concat(&mut self, parts: &[&[u8]]) -> Result<()> {
        let size = std::mem::size_of::<T>();
        if let Some(bad) = parts.iter().find(|p| !p.len().is_multiple_of(size)) {
            return Err(TransportError::InvalidArgument(format!(
                "received {} bytes, not a whole number of {} elements",
                bad.len(),
                T::DTYPE
            )));
        }
        self.clear();
        self.reserve_exact(parts.iter().map(|p| p.len() / size).sum());
        for part in parts {
            match bytemuck::try_cast_slice::<u8, T>(part) {
                Ok(elements) => self.extend_from_slice(elements),
                // Payload buffers are byte vectors: alignment is likely but not promised.
                Err(_) => self.extend(part.chunks_exact(size).map(bytemuck::pod_read_unaligned::<T>)),
            }
        }
        Ok(())
    }
}

/// One leg of a paired exchange: send `send` to `peer` and receive what `peer` sends back.
pub struct PeerExchange<'a> {
    /// The other rank.
    pub peer: usize,
    /// What this rank sends to `peer`.
    pub send: &'a [u8],
    /// Where the bytes from `peer` go (resized to what arrives).
    pub recv: &'a mut dyn ByteBuf,
}

impl fmt::Debug for PeerExchange<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PeerExchange").field("peer", &self.peer).field("send_bytes", &self.send.len()).finish()
    }
}

/// GPU memory named by its address, for a transport that moves device buffers itself
/// ([`Communicator::exchange_device`]): `len` bytes at `address` on GPU `ordinal`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceBytes {
    /// The GPU, by CUDA ordinal.
    pub ordinal: usize,
    /// The device address of the first byte.
    pub address: u64,
    /// The number of bytes.
    pub len: usize,
}

/// One leg of a paired exchange of device buffers: `send` goes to `peer`, and what `peer` sends
/// back lands in `recv`, which must be exactly as long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceExchange {
    /// The other rank.
    pub peer: usize,
    /// What this rank sends to `peer`.
    pub send: DeviceBytes,
    /// Where the bytes from `peer` go.
    pub recv: DeviceBytes,
}

/// A group of ranks that run collectives together.
///
/// Every rank of the group calls every collective in the same order (idle ranks included);
/// paired exchanges involve only the ranks named. Calls on one communicator are serialised:
/// a rank is one sequential program. All methods are object safe; the typed helpers live in
/// [`CommunicatorExt`].
pub trait Communicator: Send + Sync {
    /// This rank, in `0..size()`.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn size(&self) -> usize;
    /// Backend name for reports ("local", "socket", ...).
    fn backend(&self) -> &'static str;

    /// Every rank contributes `send` (lengths may differ); every rank receives all
    /// contributions concatenated in rank order into `recv`. Returns the byte count per rank.
    fn all_gather_bytes(&self, dtype: DataType, send: &[u8], recv: &mut dyn ByteBuf) -> Result<Vec<usize>>;

    /// Like [`Self::all_gather_bytes`], but only `root` receives (and returns `Some(counts)`);
    /// other ranks send and return `None` without allocating anything.
    fn gather_bytes(
        &self,
        root: usize,
        dtype: DataType,
        send: &[u8],
        recv: &mut dyn ByteBuf,
    ) -> Result<Option<Vec<usize>>>;

    /// `root`'s `buf` replaces every other rank's `buf` (whose length may differ before).
    fn broadcast_bytes(&self, root: usize, dtype: DataType, buf: &mut dyn ByteBuf) -> Result<()>;

    /// Element-wise reduction of equal-length buffers, reduced in rank order, result on every
    /// rank (bit-identical across ranks).
    fn all_reduce_bytes(&self, dtype: DataType, op: ReduceOp, buf: &mut [u8]) -> Result<()>;

    /// Paired exchange: for every leg, send to `peer` and receive from it. Both sides of a pair
    /// must list each other. All sends are posted before any receive, so a ring or a halo
    /// exchange cannot deadlock.
    fn exchange_bytes(&self, dtype: DataType, legs: &mut [PeerExchange<'_>]) -> Result<()>;

    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<()>;

    /// Marks this rank failed with `reason` and tells every other rank, whose pending or next
    /// collective then returns [`TransportError::PeerFailed`] naming this rank. Idempotent.
    fn abort(&self, reason: &str);

    /// Traffic counters of this rank since creation.
    fn stats(&self) -> CommStats;

    /// The failure this rank already knows of (its own, or one a peer announced or its
    /// connection revealed), without waiting: a long computation polls it between steps to stop
    /// early instead of at its next collective. `None` (the default) when there is none, or the
    /// backend cannot tell without communicating.
    fn failure(&self) -> Option<TransportError> {
        None
    }

    /// For groups whose ranks are threads of one process: the mailbox through which they hand
    /// each other values without serialising them (see [`mailbox`]). `None` (the default) for
    /// groups across processes or devices.
    fn mailbox(&self) -> Option<&Mailbox> {
        None
    }

    /// Whether [`Self::exchange_device`] moves buffers on GPU `ordinal` itself, device to device
    /// with no copy through the host (NCCL, for the GPU the rank was opened on). `false` (the
    /// default): exchange host bytes instead.
    fn exchanges_device_buffers(&self, _ordinal: usize) -> bool {
        false
    }

    /// A paired exchange of device buffers, as [`Self::exchange_bytes`] (both sides of a pair
    /// list each other; no order of legs can deadlock), for a backend whose
    /// [`Self::exchanges_device_buffers`] says so. Each pair first checks that what one side sends
    /// is what the other expects: on a mismatch both ranks still complete the exchange (with
    /// the shorter length, so that neither waits for bytes that never come) and both return
    /// [`TransportError::LengthMismatch`].
    ///
    /// # Safety
    /// Every `send` must be device memory of at least its length on its GPU, not written by
    /// anything until this returns; every `recv` device memory of its length, not read or written
    /// by anything else until this returns, and no two overlapping. Work that writes a `send` must
    /// be complete when this is called. When it returns, the received bytes are in place.
    unsafe fn exchange_device(&self, _legs: &[DeviceExchange]) -> Result<()> {
        Err(TransportError::Unavailable(format!("the {} backend does not move device buffers", self.backend())))
    }
}

/// The same group with its shortcuts hidden: no [`Mailbox`] of in-process ranks, no device
/// exchange of NCCL ([`Communicator::exchanges_device_buffers`] is `false`), so that everything
/// moves through the byte collectives, as between processes of a group without them. For
/// comparing the paths, and measuring what a shortcut saves.
#[derive(Debug)]
pub struct BytePathOnly<C>(pub C);

impl<C: Communicator> Communicator for BytePathOnly<C> {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn size(&self) -> usize {
        self.0.size()
    }
    fn backend(&self) -> &'static str {
        self.0.backend()
    }
    fn all_gather_bytes(&self, dtype: DataType, send: &[u8], recv: &mut dyn ByteBuf) -> Result<Vec<usize>> {
        self.0.all_gather_bytes(dtype, send, recv)
    }
    fn gather_bytes(
        &self,
        root: usize,
        dtype: DataType,
        send: &[u8],
        recv: &mut dyn ByteBuf,
    ) -> Result<Option<Vec<usize>>> {
        self.0.gather_bytes(root, dtype, send, recv)
    }
    fn broadcast_bytes(&self, root: usize, dtype: DataType, buf: &mut dyn ByteBuf) -> Result<()> {
        self.0.broadcast_bytes(root, dtype, buf)
    }
    fn all_reduce_bytes(&self, dtype: DataType, op: ReduceOp, buf: &mut [u8]) -> Result<()> {
        self.0.all_reduce_bytes(dtype, op, buf)
    }
    fn exchange_bytes(&self, dtype: DataType, legs: &mut [PeerExchange<'_>]) -> Result<()> {
        self.0.exchange_bytes(dtype, legs)
    }
    fn barrier(&self) -> Result<()> {
        self.0.barrier()
    }
    fn abort(&self, reason: &str) {
        self.0.abort(reason)
    }
    fn stats(&self) -> CommStats {
        self.0.stats()
    }
}

/// Gathered contributions of every rank, in rank order.
#[derive(Debug, Clone, PartialEq)]
pub struct Gathered<T> {
    data: Vec<T>,
    offsets: Vec<usize>,
}

impl<T> Gathered<T> {
    fn new(data: Vec<T>, byte_counts: &[usize]) -> Self {
        let size = std::mem::size_of::<T>().max(1);
        let mut offsets = Vec::with_capacity(byte_counts.len() + 1);
        let mut at = 0;
        offsets.push(0);
        for count in byte_counts {
            at += count / size;
            offsets.push(at);
        }
        Self { data, offsets }
    }

    /// Number of contributions (the group size).
    pub fn len(&self) -> usize {
        self.offsets.len() - 1
    }

    /// True when there are no contributions.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The contribution of `rank`.
    pub fn part(&self, rank: usize) -> &[T] {
        &self.data[self.offsets[rank]..self.offsets[rank + 1]]
    }

    /// All contributions in rank order.
    pub fn parts(&self) -> impl ExactSizeIterator<Item = &[T]> + '_ {
        (0..self.len()).map(|r| self.part(r))
    }

    /// The concatenation of all contributions.
    pub fn as_flat(&self) -> &[T] {
        &self.data
    }

    /// The concatenation, by value.
    pub fn into_flat(self) -> Vec<T> {
        self.data
    }
}

/// What a [`CommunicatorExt::neighbour_exchange`] received.
#[derive(Debug, Clone, PartialEq)]
pub struct Halo<T> {
    /// From `rank - 1`; `None` on rank 0.
    pub from_prev: Option<Vec<T>>,
    /// From `rank + 1`; `None` on the last rank.
    pub from_next: Option<Vec<T>>,
}

/// Typed helpers over any [`Communicator`].
pub trait CommunicatorExt: Communicator {
    /// Typed [`Communicator::all_gather_bytes`].
    fn all_gather<T: Element>(&self, send: &[T]) -> Result<Gathered<T>> {
        let mut recv = Vec::<T>::new();
        let counts = self.all_gather_bytes(T::DTYPE, bytemuck::cast_slice(send), &mut recv)?;
        Ok(Gathered::new(recv, &counts))
    }

    /// Like [`Self::all_gather`], into a caller-owned vector (its capacity is reused, which
    /// spares the page faults of a fresh allocation per call). Returns the element count per
    /// rank.
    fn all_gather_into<T: Element>(&self, send: &[T], recv: &mut Vec<T>) -> Result<Vec<usize>> {
        let counts = self.all_gather_bytes(T::DTYPE, bytemuck::cast_slice(send), recv)?;
        Ok(counts.into_iter().map(|c| c / std::mem::size_of::<T>()).collect())
    }

    /// Typed [`Communicator::gather_bytes`]: `Some` on `root`, `None` elsewhere.
    fn gather<T: Element>(&self, root: usize, send: &[T]) -> Result<Option<Gathered<T>>> {
        let mut recv = Vec::<T>::new();
        let counts = self.gather_bytes(root, T::DTYPE, bytemuck::cast_slice(send), &mut recv)?;
        Ok(counts.map(|c| Gathered::new(recv, &c)))
    }

    /// Typed [`Communicator::broadcast_bytes`].
    fn broadcast<T: Element>(&self, root: usize, data: &mut Vec<T>) -> Result<()> {
        self.broadcast_bytes(root, T::DTYPE, data)
    }

    /// Typed [`Communicator::all_reduce_bytes`].
    fn all_reduce<T: Element>(&self, op: ReduceOp, data: &mut [T]) -> Result<()> {
        self.all_reduce_bytes(T::DTYPE, op, bytemuck::cast_slice_mut(data))
    }

    /// Sends `send` to `peer` and returns what `peer` sent back; `peer` must call it too.
    fn send_recv<T: Element>(&self, peer: usize, send: &[T]) -> Result<Vec<T>> {
        let mut recv = Vec::<T>::new();
        let mut legs = [PeerExchange { peer, send: bytemuck::cast_slice(send), recv: &mut recv }];
        self.exchange_bytes(T::DTYPE, &mut legs)?;
        Ok(recv)
    }

    /// Halo-style exchange with the previous and next rank of a line (no wrap-around): sends
    /// `to_prev` to `rank - 1` and `to_next` to `rank + 1` where they exist, and returns what
    /// they sent (`None` at the ends of the line).
    fn neighbour_exchange<T: Element>(&self, to_prev: &[T], to_next: &[T]) -> Result<Halo<T>> {
        let rank = self.rank();
        let has_prev = rank > 0;
        let has_next = rank + 1 < self.size();
        let mut from_prev = Vec::<T>::new();
        let mut from_next = Vec::<T>::new();
        {
            let mut legs = Vec::with_capacity(2);
            if has_prev {
                legs.push(PeerExchange { peer: rank - 1, send: bytemuck::cast_slice(to_prev), recv: &mut from_prev });
            }
            if has_next {
                legs.push(PeerExchange { peer: rank + 1, send: bytemuck::cast_slice(to_next), recv: &mut from_next });
            }
            self.exchange_bytes(T::DTYPE, &mut legs)?;
        }
        Ok(Halo { from_prev: has_prev.then_some(from_prev), from_next: has_next.then_some(from_next) })
    }
}

impl<C: Communicator + ?Sized> CommunicatorExt for C {}

#[cfg(test)]
mod world_size_tests {
    use super::*;

    #[test]
    fn groups_are_between_one_and_the_limit() {
        assert!(check_world_size(1).is_ok() && check_world_size(MAX_WORLD_SIZE).is_ok());
        for size in [0, MAX_WORLD_SIZE + 1, 100_000_000_000] {
            assert!(matches!(check_world_size(size), Err(TransportError::InvalidArgument(_))), "{size}");
        }
        assert!(local_group(MAX_WORLD_SIZE + 1, TransportConfig::default()).is_err());
    }
}
