//! CUDA tensors through DLPack: a producer's `kDLCUDA` memory read in place as a CUDA
//! [`Tensor`], our CUDA tensors' addresses lent to a consumer, and the stream handle a consumer
//! names to a producer. Built with the `cuda` feature; without it, a device tensor is refused
//! with [`DlpackError::Device`].
//!
//! Streams: our work runs on the calling thread's stream of the device ([`consumer_stream`]).
//! A producer orders its writes before a stream it is told of (the Python protocol's
//! `__dlpack__(stream=...)`); [`Imported::into_device_tensor`] takes that stream as `ready`
//! and, when it is not ours, makes ours wait for it on the device. The export side is
//! [`super::Exported::to_versioned`]'s `stream`.

use super::{DL_BFLOAT, DL_CUDA, DL_FLOAT, DLDevice, DlpackError, Imported, device_name, dtype_name, is_row_major};
use crate::{DType, Device, Tensor};

/// The handle of the stream the calling thread's work on CUDA device `ordinal` goes to, as the
/// DLPack Python protocol's `stream` argument names it (`1`: the legacy default stream): what
/// a consumer passes to a producer's `__dlpack__` so that the producer orders its writes before
/// our work. Opens the device on first use.
pub fn consumer_stream(ordinal: usize) -> Result<u64, DlpackError> {
    #[cfg(feature = "cuda")]
    {
        let device = crate::cuda::backend::CudaDevice::get(ordinal)?;
        Ok(crate::cuda::backend::stream_handle(&device.stream()))
    }
    #[cfg(not(feature = "cuda"))]
    Err(DlpackError::Device(format!("cuda:{ordinal} (this build has no CUDA backend)")))
}

/// The address of a CUDA tensor's elements for a consumer on `stream` (see
/// [`super::Exported::to_versioned`]).
pub(super) fn address_for(t: &Tensor, stream: Option<u64>) -> Result<u64, DlpackError> {
    #[cfg(feature = "cuda")]
    if let Some(storage) = t.cuda() {
        return Ok(storage.address_for(stream)?);
    }
    let _ = stream;
    Err(DlpackError::Device(format!("{} (not a CUDA tensor)", t.device())))
}

/// Device addresses the kernels read in 16-byte packs from: memory at another alignment is
/// copied (on the device) into an allocation of our own first.
const ALIGNMENT: u64 = 16;

impl Imported {
    /// The tensor as a CUDA tensor on device `ordinal` with elements of `dtype`, never through
    /// the host:
    /// - f32 or bf16 (`kDLCUDA`, `device_id == ordinal`), row-major (extents of 1 may have any
    ///   stride), at a 16-byte aligned address: read in place. The returned tensor holds
    ///   `self`; the producer's deleter runs once the tensor is dropped and the device has
    ///   finished with the memory. The memory is never written (a write in place copies it).
    /// - Of the other of those two types than `dtype`: converted by one cast on the device.
    ///   At another alignment: one device-to-device copy.
    /// - Refused: a tensor that is not `kDLCUDA` ([`DlpackError::Device`]), of another ordinal
    ///   ([`DlpackError::OtherDevice`]), of another element type ([`DlpackError::DType`]), or
    ///   with strides that are not row-major ([`DlpackError::Layout`]).
    ///
    /// `ready`: the stream the producer ordered its writes before (the `stream` passed to its
    /// `__dlpack__`, normally [`consumer_stream`]'s); `None` when they have finished already.
    ///
    /// # Safety
    /// The producer's description must be true: `data + byte_offset` starts the elements in
    /// device memory of that device, valid until the deleter runs, and `ready`, when given, is a
    /// stream of that device's context.
    pub unsafe fn into_device_tensor(
        self,
        ordinal: usize,
        dtype: DType,
        ready: Option<u64>,
    ) -> Result<Tensor, DlpackError> {
        let t = self.dl_tensor();
        let want = DLDevice { device_type: DL_CUDA, device_id: ordinal as i32 };
        if t.device.device_type != DL_CUDA {
            return Err(DlpackError::Device(format!(
                "{} (a CUDA tensor on {} was expected)",
                device_name(t.device),
                device_name(want)
            )));
        }
        if t.device != want {
            return Err(DlpackError::OtherDevice { got: device_name(t.device), want: device_name(want) });
        }
        let stored = match (t.dtype.code, t.dtype.bits, t.dtype.lanes) {
            (DL_FLOAT, 32, 1) => DType::F32,
            (DL_BFLOAT, 16, 1) => DType::BF16,
            _ => {
                return Err(DlpackError::DType(format!(
                    "{} on the device (read there: float32 and bfloat16)",
                    dtype_name(t.dtype)
                )));
            }
        };
        let dims = self.dims();
        let strides = self.strides();
        if !is_row_major(&dims, &strides) {
            return Err(DlpackError::Layout(format!(
                "strides {strides:?} for extents {dims:?} are not row-major; make it contiguous on the device first"
            )));
        }
        let count: usize = dims.iter().product();
        let device = Device::Cuda(ordinal);
        if count == 0 {
            return Ok(Tensor::zeros(dims, dtype, &device)?);
        }
        let address = (t.data as u64)
            .checked_add(t.byte_offset)
            .ok_or_else(|| DlpackError::Malformed(format!("byte offset {}", t.byte_offset)))?;
        // SAFETY: the caller's contract (the producer's description and `ready`).
        let mut tensor = unsafe { lend(self, address, count, stored, ready, dims, ordinal) }?;
        if !address.is_multiple_of(ALIGNMENT) {
            tracing::debug!(address, "a DLPack device tensor not 16-byte aligned: copied on the device");
            // A device tensor's clone is a device-to-device copy into memory of our own.
            tensor = tensor.clone();
        }
        if stored != dtype {
            tracing::debug!(%stored, %dtype, "a DLPack device tensor converted on the device");
            return Ok(tensor.to_dtype(dtype)?);
        }
        Ok(tensor)
    }
}

/// The producer's elements as a tensor reading them in place, `imported` its lender.
///
/// # Safety
/// As for [`Imported::into_device_tensor`]; `address` starts `count` elements of `stored`.
#[cfg(feature = "cuda")]
unsafe fn lend(
    imported: Imported,
    address: u64,
    count: usize,
    stored: DType,
    ready: Option<u64>,
    dims: Vec<usize>,
    ordinal: usize,
) -> Result<Tensor, DlpackError> {
    use crate::cuda::backend::{CudaStorage, Lender};
    let lender: Lender = std::sync::Arc::new(imported);
    // SAFETY: the caller's contract; `lender` keeps the memory valid until the storage drops
    // it, and a lent storage is never written.
    let storage = unsafe { CudaStorage::lent(ordinal, address, count, stored, ready, lender) }?;
    Ok(Tensor::from_cuda(storage, crate::Shape::from(dims)))
}

/// Without a CUDA backend no device tensor is read.
///
/// # Safety
/// None needed; the signature matches the CUDA build's.
#[cfg(not(feature = "cuda"))]
unsafe fn lend(
    imported: Imported,
    _: u64,
    _: usize,
    _: DType,
    _: Option<u64>,
    _: Vec<usize>,
    ordinal: usize,
) -> Result<Tensor, DlpackError> {
    drop(imported);
    Err(DlpackError::Device(format!("cuda:{ordinal} (this build has no CUDA backend)")))
}
