//! Device memory ([`CudaData`], f32 or bf16) and [`CudaStorage`], the tensor storage every op
//! launcher works on: allocation (charged to the allocating thread), upload, download, and the
//! argument checks and launch shapes the launchers share.

use std::mem::ManuallyDrop;
use std::sync::Arc;

use cudarc::driver::{
    CudaSlice, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, LaunchArgs, LaunchConfig, PushKernelArg,
};

use super::device::{CudaDevice, driver};
use crate::backend::DeviceStore;
use crate::kernel_args::LaunchError;
use crate::memory::DeviceCharge;
use crate::{DType, Result, TensorError};

/// Elements per 16-byte access of the vectorised elementwise kernels (`map_unary` /
/// `map_binary` in elementwise.cu), by storage type.
pub(super) fn per_pack(dtype: DType) -> usize {
    if dtype == DType::BF16 { 8 } else { 4 }
}

/// Device memory of one storage type (bf16 as its raw bits).
#[derive(Clone)]
pub(crate) enum CudaData {
    /// f32 elements.
    F32(CudaSlice<f32>),
    /// bf16 elements as `u16` bits, the kernels' `unsigned short`.
    Bf16(CudaSlice<u16>),
}

/// A storage from an element on, as a kernel argument the kernel reads (a `const` pointer; a
/// batch's operand inside a batched tensor, or the whole storage from element 0).
pub(crate) enum DataView<'a> {
    F32(CudaView<'a, f32>),
    Bf16(CudaView<'a, u16>),
}

/// A storage from an element on, as a kernel argument the kernel writes.
pub(crate) enum DataViewMut<'a> {
    F32(CudaViewMut<'a, f32>),
    Bf16(CudaViewMut<'a, u16>),
}

impl CudaData {
    /// The elements from `from` on, for a kernel to read.
    pub(crate) fn view(&self, from: usize) -> DataView<'_> {
        match self {
            CudaData::F32(s) => DataView::F32(s.slice(from..)),
            CudaData::Bf16(s) => DataView::Bf16(s.slice(from..)),
        }
    }

    /// The elements from `from` on, for a kernel to write.
    pub(crate) fn view_mut(&mut self, from: usize) -> DataViewMut<'_> {
        match self {
            CudaData::F32(s) => DataViewMut::F32(s.slice_mut(from..)),
            CudaData::Bf16(s) => DataViewMut::Bf16(s.slice_mut(from..)),
        }
    }
}

impl DataView<'_> {
    /// Elements from the view's start to the allocation's end.
    pub(crate) fn len(&self) -> usize {
        match self {
            DataView::F32(v) => v.len(),
            DataView::Bf16(v) => v.len(),
        }
    }

    /// The storage type.
    pub(crate) fn dtype(&self) -> DType {
        if matches!(self, DataView::F32(_)) { DType::F32 } else { DType::BF16 }
    }
}

impl DataViewMut<'_> {
    /// Elements from the view's start to the allocation's end.
    pub(crate) fn len(&self) -> usize {
        match self {
            DataViewMut::F32(v) => v.len(),
            DataViewMut::Bf16(v) => v.len(),
        }
    }

    /// The storage type.
    pub(crate) fn dtype(&self) -> DType {
        if matches!(self, DataViewMut::F32(_)) { DType::F32 } else { DType::BF16 }
    }
}

// SAFETY: a view of either type is one device pointer to the kernels (which are instantiated
// per storage type), so it pushes exactly what cudarc's impl for the view it holds pushes: the
// pointer, with the view's events recorded as a read.
unsafe impl<'a, 'b: 'a, 'c: 'b> PushKernelArg<&'b DataView<'c>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b DataView<'c>) -> &mut Self {
        match arg {
            DataView::F32(v) => self.arg(v),
            DataView::Bf16(v) => self.arg(v),
        }
    }
}

// SAFETY: as for `DataView`, the events recorded as a write.
unsafe impl<'a, 'b: 'a, 'c: 'b> PushKernelArg<&'b mut DataViewMut<'c>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut DataViewMut<'c>) -> &mut Self {
        match arg {
            DataViewMut::F32(v) => self.arg(v),
            DataViewMut::Bf16(v) => self.arg(v),
        }
    }
}

/// What keeps memory lent by another library (a DLPack producer) alive; dropped, it lets the
/// lender free the memory.
pub(crate) type Lender = Arc<dyn std::any::Any + Send + Sync>;

/// Elements on a CUDA device, charged to the allocating thread's device-memory account
/// ([`crate::memory::device_peak_bytes`]) while they live; or device memory another library
/// lent ([`CudaStorage::lent`]): not charged, never freed here, and never written (the tensor
/// copies it before any write in place, see [`crate::Tensor`]'s `cuda_mut`).
pub(crate) struct CudaStorage {
    /// The elements. Dropped by hand in `drop`: lent memory is leaked back to its lender
    /// instead of freed.
    pub(crate) data: ManuallyDrop<CudaData>,
    pub(crate) device: Arc<CudaDevice>,
    pub(super) len: usize,
    /// The lender of `data`'s memory, when it is lent.
    lender: Option<Lender>,
    _charge: DeviceCharge,
}

impl Clone for CudaStorage {
    /// A device copy: a new allocation of our own (also of lent memory), charged to the thread
    /// that makes it.
    fn clone(&self) -> Self {
        Self::new(CudaData::clone(&self.data), Arc::clone(&self.device), self.len)
    }
}

impl Drop for CudaStorage {
    fn drop(&mut self) {
        // SAFETY: `data` is taken once, here, and not used after.
        let data = unsafe { ManuallyDrop::take(&mut self.data) };
        let Some(lender) = self.lender.take() else {
            drop(data);
            return;
        };
        // Lent memory: not ours to free. `leak` orders the stream after the slice's last
        // reader and writer; the lender may reuse the memory as soon as it is released, on
        // streams that know nothing of ours, so the device finishes with it first.
        match data {
            CudaData::F32(s) => drop(s.leak()),
            CudaData::Bf16(s) => drop(s.leak()),
        }
        if let Err(e) = self.device.synchronize() {
            tracing::warn!(device = self.device.ordinal, "finishing with lent device memory: {e}");
        }
        drop(lender);
    }
}

impl std::fmt::Debug for CudaStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaStorage(cuda:{}, {} {})", self.device.ordinal, self.len, self.dtype())
    }
}

/// A stream's handle as the DLPack Python protocol names it: the legacy default stream (cudarc's
/// null handle) is `1` there (`0` is ambiguous and not allowed).
pub(crate) fn stream_handle(stream: &cudarc::driver::CudaStream) -> u64 {
    match stream.cu_stream() as u64 {
        0 => 1,
        handle => handle,
    }
}

/// A 1-D grid-stride launch over `n` elements.
pub(super) fn elementwise(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 1 << 20) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

impl DeviceStore for CudaStorage {
    /// Zeros of `dtype` on device `ordinal`.
    fn zeros(ordinal: usize, len: usize, dtype: DType) -> Result<Self> {
        let device = CudaDevice::get(ordinal)?;
        Ok(Self::new(device.alloc(len, dtype)?, device, len))
    }

    /// A copy of host data on device `ordinal`, as f32.
    fn upload(ordinal: usize, host: &[f32]) -> Result<Self> {
        let device = CudaDevice::get(ordinal)?;
        if host.is_empty() {
            return Self::zeros(ordinal, 0, DType::F32);
        }
        let data = device.stream().clone_htod(host).map_err(|e| driver(ordinal, "upload", e))?;
        Ok(Self::new(CudaData::F32(data), device, host.len()))
    }

    /// The elements, copied to the host as f32 (bf16 widens exactly).
    fn download(&self) -> Result<Vec<f32>> {
        let err = |e| driver(self.device.ordinal, "download", e);
        let mut v = match &*self.data {
            CudaData::F32(d) => self.device.stream().clone_dtoh(d).map_err(err)?,
            CudaData::Bf16(d) => {
                let bits = self.device.stream().clone_dtoh(d).map_err(err)?;
                bits.into_iter().map(|b| f32::from_bits(u32::from(b) << 16)).collect()
            }
        };
        v.truncate(self.len);
        Ok(v)
    }

    fn ordinal(&self) -> usize {
        self.device.ordinal
    }

    /// The device address of the elements, once every write queued before (on any stream) has
    /// finished. See [`crate::Tensor::device_memory`].
    fn settled_address(&self) -> Result<u64> {
        let stream = self.device.stream();
        // The pointer call makes `stream` wait for the buffer's last writer on another stream;
        // synchronising the stream then waits for all of it.
        let address = match &*self.data {
            CudaData::F32(d) => d.device_ptr(&stream).0,
            CudaData::Bf16(d) => d.device_ptr(&stream).0,
        };
        stream.synchronize().map_err(|e| driver(self.device.ordinal, "synchronize", e))?;
        Ok(address)
    }

    /// As [`Self::settled_address`], for memory something else is about to write: once every
    /// read and write queued before has finished.
    fn settled_address_mut(&mut self) -> Result<u64> {
        let stream = self.device.stream();
        let address = match &mut *self.data {
            CudaData::F32(d) => d.device_ptr_mut(&stream).0,
            CudaData::Bf16(d) => d.device_ptr_mut(&stream).0,
        };
        stream.synchronize().map_err(|e| driver(self.device.ordinal, "synchronize", e))?;
        Ok(address)
    }

    /// The storage type.
    fn dtype(&self) -> DType {
        match *self.data {
            CudaData::F32(_) => DType::F32,
            CudaData::Bf16(_) => DType::BF16,
        }
    }

    /// An uncleared tensor of `len` elements of this type on the same device, for a caller that
    /// writes every element (a permute's box copy over the whole output) before reading any.
    fn uninit_like(&self, len: usize) -> Result<Self> {
        self.output(len)
    }
}

impl CudaStorage {
    /// The one constructor: every allocation is charged here.
    pub(super) fn new(data: CudaData, device: Arc<CudaDevice>, len: usize) -> Self {
        let bytes = len * if matches!(data, CudaData::F32(_)) { 4 } else { 2 };
        Self { data: ManuallyDrop::new(data), device, len, lender: None, _charge: DeviceCharge::new(bytes) }
    }

    /// `len` elements of `dtype` at `address` on device `ordinal`, memory another library
    /// lends: read in place, never freed here (dropping the storage waits until the device has
    /// finished with it, then drops `lender`), never written (see [`Self::is_lent`]).
    ///
    /// `ready`: a stream (a handle of this device's context; `1` the legacy default stream)
    /// that the lender ordered its writes before; when it is not the calling thread's stream,
    /// that stream waits for it on the device. `None`: the writes have finished.
    ///
    /// # Safety
    /// `address` must be the start of `len` elements of `dtype` in device memory of `ordinal`
    /// that stay valid, and that nobody writes, while `lender` lives; `ready` as above.
    pub(crate) unsafe fn lent(
        ordinal: usize,
        address: u64,
        len: usize,
        dtype: DType,
        ready: Option<u64>,
        lender: Lender,
    ) -> Result<Self> {
        let device = CudaDevice::get(ordinal)?;
        let stream = device.stream();
        if let Some(handle) = ready
            && handle != stream_handle(&stream)
        {
            use cudarc::driver::sys;
            let event = stream.context().new_event(None).map_err(|e| driver(ordinal, "event", e))?;
            // SAFETY: `handle` is a stream of this device's context (the caller's contract), the
            // event is live until the calls return; both only queue work.
            let recorded = unsafe { sys::cuEventRecord(event.cu_event(), handle as sys::CUstream) };
            recorded.result().map_err(|e| driver(ordinal, "event record", e))?;
            stream.wait(&event).map_err(|e| driver(ordinal, "stream wait", e))?;
        }
        // SAFETY: the caller's contract: a valid allocation of `len` elements of `dtype` (the
        // slice is leaked, never freed, in `drop`).
        let data = unsafe {
            match dtype {
                DType::F32 => CudaData::F32(stream.upgrade_device_ptr(address, len)),
                DType::BF16 => CudaData::Bf16(stream.upgrade_device_ptr(address, len)),
            }
        };
        Ok(Self { data: ManuallyDrop::new(data), device, len, lender: Some(lender), _charge: DeviceCharge::new(0) })
    }

    /// Whether the memory is lent ([`Self::lent`]): a write in place must copy it first.
    pub(crate) fn is_lent(&self) -> bool {
        self.lender.is_some()
    }

    /// The device address of the elements, for a consumer on `consumer` (a stream of this
    /// device, or the legacy default stream `1`), or on any stream when `None`: the consumer's
    /// stream waits (on the device) until every write queued to the elements so far has run;
    /// with `None` the host waits. The address is valid while the storage lives.
    pub(crate) fn address_for(&self, consumer: Option<u64>) -> Result<u64> {
        let stream = self.device.stream();
        let ordinal = self.device.ordinal;
        // The pointer call makes `stream` wait for the last writer on another stream.
        let address = match &*self.data {
            CudaData::F32(d) => d.device_ptr(&stream).0,
            CudaData::Bf16(d) => d.device_ptr(&stream).0,
        };
        match consumer {
            None => stream.synchronize().map_err(|e| driver(ordinal, "synchronize", e))?,
            Some(handle) => {
                let event = stream.record_event(None).map_err(|e| driver(ordinal, "event", e))?;
                // SAFETY: `handle` is a stream of this device's context (the consumer's word, as
                // the DLPack protocol has it) and the event is live until this call returns;
                // cuStreamWaitEvent only queues the wait.
                let waited = unsafe {
                    cudarc::driver::sys::cuStreamWaitEvent(handle as cudarc::driver::sys::CUstream, event.cu_event(), 0)
                };
                waited.result().map_err(|e| driver(ordinal, "stream wait", e))?;
            }
        }
        Ok(address)
    }

    /// `len` zeros of the same type on the same device.
    pub(super) fn like(&self, len: usize) -> Result<Self> {
        self.like_typed(len, self.dtype())
    }

    pub(super) fn like_typed(&self, len: usize, dtype: DType) -> Result<Self> {
        Ok(Self::new(self.device.alloc(len, dtype)?, Arc::clone(&self.device), len))
    }

    /// `len` uncleared elements of `dtype` on the same device, for an output that the kernel
    /// launched next writes in full (see [`CudaDevice::alloc_for_kernel`]).
    pub(super) fn output_typed(&self, len: usize, dtype: DType) -> Result<Self> {
        Ok(Self::new(self.device.alloc_for_kernel(len, dtype)?, Arc::clone(&self.device), len))
    }

    pub(super) fn output(&self, len: usize) -> Result<Self> {
        self.output_typed(len, self.dtype())
    }

    /// An error unless every storage in `others` has this one's type (`op`'s operands).
    pub(super) fn same_dtype(&self, op: &'static str, others: &[&Self]) -> Result<()> {
        match others.iter().find(|o| o.dtype() != self.dtype()) {
            None => Ok(()),
            Some(o) => Err(TensorError::InvalidArgument {
                op,
                reason: format!("operands are {} and {}; convert one with to_dtype", self.dtype(), o.dtype()),
            }),
        }
    }

    /// An error unless `param` (a bias or a norm's scale) is f32: both variants of a kernel take
    /// f32 parameters.
    pub(super) fn f32_param(op: &'static str, param: &Self) -> Result<()> {
        if param.dtype() != DType::F32 {
            return Err(TensorError::InvalidArgument {
                op,
                reason: format!("per-channel parameters are f32 on CUDA, got {}", param.dtype()),
            });
        }
        Ok(())
    }

    /// A failed launch as an error of `op`.
    pub(super) fn err(&self, op: &'static str) -> impl Fn(LaunchError) -> TensorError + '_ {
        move |e| e.into_tensor(self.device.ordinal, op)
    }

    /// A streaming launch with one thread per 16-byte pack of this tensor's elements.
    pub(super) fn packs(&self) -> LaunchConfig {
        self.device.streaming(self.len.div_ceil(per_pack(self.dtype())))
    }
}
