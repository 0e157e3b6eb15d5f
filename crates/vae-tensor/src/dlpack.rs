//! DLPack, the C ABI through which array libraries (PyTorch, CuPy, JAX, NumPy, candle's
//! neighbours) lend each other tensors without a copy: the structs of `dlpack.h` (v1.1, with the
//! legacy unversioned `DLManagedTensor`), reading a producer's tensor as a [`Tensor`]
//! ([`Imported`]), and lending one of ours ([`Exported`]).
//!
//! What is read in place and what is copied:
//! - A host f32 tensor in row-major order, aligned, is read in place: the [`Tensor`] holds the
//!   producer's memory (and through it the producer's deleter, called once when the last
//!   holder drops it). It is never written.
//! - A host tensor of another float type (f64, f16, bf16) or in another layout (any strides,
//!   a byte offset) is copied once, in logical order, into an f32 tensor of our own: the CPU
//!   backend computes in f32 only.
//! - Integer, boolean and complex tensors, vector lanes, and tensors on other devices than the
//!   host are refused by [`Imported::into_tensor`] ([`DlpackError`]).
//! - CUDA tensors are read by [`Imported::into_device_tensor`] (builds with the `cuda`
//!   feature): f32 or bf16, row-major, on the device asked for, read in place (the producer's
//!   memory, never written, released once the device has finished with it); another of those
//!   two types, or an address not 16-byte aligned, costs one copy on the device; other types,
//!   strides and devices are refused. Never through the host.
//!
//! Our tensors are lent as [`DLManagedTensorVersioned`] (or the legacy struct for consumers
//! that ask no version), in row-major order with explicit strides: host tensors as f32, CUDA
//! tensors as `kDLCUDA` in their own type (f32 or bf16) without a copy, ordered before the
//! consumer's stream (see [`Exported::to_versioned`]). The memory stays alive until the
//! consumer calls the deleter, however long that is after the tensor's model or group is gone.

use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::{DType, Device, Tensor, TensorError};

#[path = "dlpack_cuda.rs"]
mod cuda;

pub use cuda::consumer_stream;

/// The DLPack ABI version this module implements (1.1).
pub const DLPACK_VERSION: DLPackVersion = DLPackVersion { major: 1, minor: 1 };

/// `kDLCPU`: host memory.
pub const DL_CPU: i32 = 1;
/// `kDLCUDA`: CUDA device memory.
pub const DL_CUDA: i32 = 2;
/// `kDLCUDAHost`: pinned host memory (read like host memory).
pub const DL_CUDA_HOST: i32 = 3;
/// `kDLCUDAManaged`: CUDA managed memory.
pub const DL_CUDA_MANAGED: i32 = 13;

/// `kDLInt`: signed integers.
pub const DL_INT: u8 = 0;
/// `kDLUInt`: unsigned integers.
pub const DL_UINT: u8 = 1;
/// `kDLFloat`: IEEE floats.
pub const DL_FLOAT: u8 = 2;
/// `kDLBfloat`: bfloat16.
pub const DL_BFLOAT: u8 = 4;
/// `kDLBool`: booleans.
pub const DL_BOOL: u8 = 6;

/// `DLPACK_FLAG_BITMASK_READ_ONLY`: the consumer must not write the tensor.
pub const FLAG_READ_ONLY: u64 = 1 << 0;
/// `DLPACK_FLAG_BITMASK_IS_COPIED`: the producer copied the data for this export.
pub const FLAG_IS_COPIED: u64 = 1 << 1;

/// `DLPackVersion`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DLPackVersion {
    /// Major version: a consumer refuses a tensor of a major version it does not know.
    pub major: u32,
    /// Minor version.
    pub minor: u32,
}

/// `DLDevice`: a device type (`DL_CPU`, `DL_CUDA`, ...) and its ordinal.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DLDevice {
    /// `DLDeviceType`.
    pub device_type: i32,
    /// The device's ordinal (0 on the host).
    pub device_id: i32,
}

/// `DLDataType`: a type code, bits per lane and lanes per element.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DLDataType {
    /// `DLDataTypeCode` (`DL_FLOAT`, `DL_BFLOAT`, ...).
    pub code: u8,
    /// Bits per lane.
    pub bits: u8,
    /// Lanes per element (1 for scalars).
    pub lanes: u16,
}

/// `DLTensor`: where the elements are and how they are laid out.
#[repr(C)]
#[derive(Debug)]
pub struct DLTensor {
    /// The allocation's start (the elements begin `byte_offset` bytes after it).
    pub data: *mut c_void,
    /// Where the memory lives.
    pub device: DLDevice,
    /// Number of dimensions.
    pub ndim: i32,
    /// Element type.
    pub dtype: DLDataType,
    /// `ndim` extents.
    pub shape: *mut i64,
    /// `ndim` strides in elements, or null for row-major order.
    pub strides: *mut i64,
    /// Bytes from `data` to the first element.
    pub byte_offset: u64,
}

/// `DLManagedTensor`: the legacy (unversioned) managed tensor, the capsule `"dltensor"`.
#[repr(C)]
#[derive(Debug)]
pub struct DLManagedTensor {
    /// The tensor.
    pub dl_tensor: DLTensor,
    /// The producer's context.
    pub manager_ctx: *mut c_void,
    /// Called once by the consumer when it no longer needs the tensor.
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// `DLManagedTensorVersioned`: the managed tensor of DLPack 1.x, the capsule
/// `"dltensor_versioned"`.
#[repr(C)]
#[derive(Debug)]
pub struct DLManagedTensorVersioned {
    /// The ABI version the producer wrote.
    pub version: DLPackVersion,
    /// The producer's context.
    pub manager_ctx: *mut c_void,
    /// Called once by the consumer when it no longer needs the tensor.
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    /// `FLAG_READ_ONLY`, `FLAG_IS_COPIED`.
    pub flags: u64,
    /// The tensor.
    pub dl_tensor: DLTensor,
}

/// Why a DLPack tensor was not read, or one of ours not lent.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DlpackError {
    /// A null managed tensor, or null shape or data where elements are expected.
    #[error("DLPack tensor: {0}")]
    Malformed(String),
    /// A managed tensor of a major version this module does not know.
    #[error("DLPack tensor of version {major}.{minor}: only major version 1 is read")]
    Version {
        /// The producer's major version.
        major: u32,
        /// The producer's minor version.
        minor: u32,
    },
    /// An element type that is not f32, f64, f16 or bf16.
    #[error("DLPack tensor of element type {0}: expected float32, float64, float16 or bfloat16")]
    DType(String),
    /// Memory on a device this module does not read.
    #[error("DLPack tensor on {0}: only host (CPU) tensors are read; move it to the CPU first")]
    Device(String),
    /// A device tensor on another device than the one asked for.
    #[error("DLPack tensor on {got}, expected one on {want}")]
    OtherDevice {
        /// Where the tensor is.
        got: String,
        /// Where it was expected.
        want: String,
    },
    /// A device tensor in a layout read only by a copy through the host (strides that are not
    /// row-major): refused rather than copied silently.
    #[error("DLPack device tensor: {0}")]
    Layout(String),
    /// A tensor op failed (an allocation, a shape).
    #[error(transparent)]
    Tensor(#[from] TensorError),
}

/// A DLPack device as a name for messages (`cuda:0`, `rocm:1`, ...).
pub fn device_name(device: DLDevice) -> String {
    let kind = match device.device_type {
        DL_CPU => "cpu",
        DL_CUDA => "cuda",
        DL_CUDA_HOST => "cuda_host",
        4 => "opencl",
        7 => "vulkan",
        8 => "metal",
        10 => "rocm",
        DL_CUDA_MANAGED => "cuda_managed",
        _ => "device type",
    };
    format!("{kind}:{}", device.device_id)
}

/// An element type as DLPack names it, for messages.
fn dtype_name(dtype: DLDataType) -> String {
    let kind = match dtype.code {
        DL_INT => "int",
        DL_UINT => "uint",
        DL_FLOAT => "float",
        DL_BFLOAT => "bfloat",
        DL_BOOL => "bool",
        5 => "complex",
        _ => "code",
    };
    match dtype.lanes {
        1 => format!("{kind}{}", dtype.bits),
        lanes => format!("{kind}{}x{lanes}", dtype.bits),
    }
}

/// The element types read, each widened or narrowed to f32 on the way in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Elem {
    F32,
    F64,
    F16,
    Bf16,
}

impl Elem {
    fn of(dtype: DLDataType) -> Result<Self, DlpackError> {
        match (dtype.code, dtype.bits, dtype.lanes) {
            (DL_FLOAT, 32, 1) => Ok(Self::F32),
            (DL_FLOAT, 64, 1) => Ok(Self::F64),
            (DL_FLOAT, 16, 1) => Ok(Self::F16),
            (DL_BFLOAT, 16, 1) => Ok(Self::Bf16),
            _ => Err(DlpackError::DType(dtype_name(dtype))),
        }
    }

    fn size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F64 => 8,
            Self::F16 | Self::Bf16 => 2,
        }
    }

    /// The element at `p` as f32 (f64 rounded to nearest, as NumPy's `astype(float32)`).
    ///
    /// # Safety
    /// `p` must point to a readable element of this type (any alignment).
    unsafe fn read(self, p: *const u8) -> f32 {
        // SAFETY: the caller's contract, for every arm; unaligned reads allow any alignment.
        unsafe {
            match self {
                Self::F32 => p.cast::<f32>().read_unaligned(),
                Self::F64 => p.cast::<f64>().read_unaligned() as f32,
                Self::F16 => half::f16::from_bits(p.cast::<u16>().read_unaligned()).to_f32(),
                Self::Bf16 => half::bf16::from_bits(p.cast::<u16>().read_unaligned()).to_f32(),
            }
        }
    }
}

/// The producer's managed tensor, of either struct.
#[derive(Debug)]
enum Managed {
    Legacy(NonNull<DLManagedTensor>),
    Versioned(NonNull<DLManagedTensorVersioned>),
}

/// A producer's tensor taken over from its managed struct: its deleter is called exactly once,
/// when this is dropped (or when the last [`Tensor`] reading it in place is).
#[derive(Debug)]
pub struct Imported {
    managed: Managed,
}

// SAFETY: the struct is only read through shared references after construction, and DLPack
// lets the consumer call the deleter from any thread (a Python producer's deleter takes the GIL
// itself, as the Python specification requires of it).
unsafe impl Send for Imported {}
// SAFETY: as above; nothing here is written after construction.
unsafe impl Sync for Imported {}

impl Imported {
    /// Takes over a versioned managed tensor (the content of a `"dltensor_versioned"` capsule).
    /// Refuses (calling its deleter) a major version other than 1.
    ///
    /// # Safety
    /// `ptr` must be a valid managed tensor whose ownership the caller hands over: nothing else
    /// may call its deleter, and its memory must stay valid until this module calls it.
    pub unsafe fn from_versioned(ptr: *mut DLManagedTensorVersioned) -> Result<Self, DlpackError> {
        let ptr = NonNull::new(ptr).ok_or_else(|| DlpackError::Malformed("null managed tensor".into()))?;
        let imported = Self { managed: Managed::Versioned(ptr) };
        // SAFETY: the caller's contract: a valid managed tensor.
        let version = unsafe { ptr.as_ref() }.version;
        if version.major != DLPACK_VERSION.major {
            // Dropping `imported` calls the deleter, which every major version keeps in place.
            return Err(DlpackError::Version { major: version.major, minor: version.minor });
        }
        imported.check()?;
        Ok(imported)
    }

    /// Takes over a legacy managed tensor (the content of a `"dltensor"` capsule).
    ///
    /// # Safety
    /// As for [`Self::from_versioned`].
    pub unsafe fn from_legacy(ptr: *mut DLManagedTensor) -> Result<Self, DlpackError> {
        let ptr = NonNull::new(ptr).ok_or_else(|| DlpackError::Malformed("null managed tensor".into()))?;
        let imported = Self { managed: Managed::Legacy(ptr) };
        imported.check()?;
        Ok(imported)
    }

    /// The tensor's description.
    pub fn dl_tensor(&self) -> &DLTensor {
        // SAFETY: the managed tensor is valid until its deleter runs, in `drop`.
        unsafe {
            match self.managed {
                Managed::Legacy(p) => &p.as_ref().dl_tensor,
                Managed::Versioned(p) => &p.as_ref().dl_tensor,
            }
        }
    }

    /// The producer's flags (`FLAG_READ_ONLY`, ...; none for a legacy tensor).
    pub fn flags(&self) -> u64 {
        match self.managed {
            Managed::Legacy(_) => 0,
            // SAFETY: valid until `drop`.
            Managed::Versioned(p) => unsafe { p.as_ref() }.flags,
        }
    }

    /// Whether the producer forbids writing the tensor (this module never writes it).
    pub fn read_only(&self) -> bool {
        self.flags() & FLAG_READ_ONLY != 0
    }

    /// The extents.
    pub fn dims(&self) -> Vec<usize> {
        let t = self.dl_tensor();
        (0..t.ndim as usize)
            // SAFETY: `check` verified a non-null shape of `ndim` non-negative extents.
            .map(|i| unsafe { *t.shape.add(i) } as usize)
            .collect()
    }

    /// The strides in elements (row-major ones when the producer gave none).
    pub fn strides(&self) -> Vec<i64> {
        let t = self.dl_tensor();
        if t.strides.is_null() {
            return row_major(&self.dims());
        }
        // SAFETY: a non-null `strides` holds `ndim` values (DLPack).
        (0..t.ndim as usize).map(|i| unsafe { *t.strides.add(i) }).collect()
    }

    /// Where the memory lives: [`Device::Cpu`] for host (and pinned host) memory, else the
    /// DLPack device as an error naming it.
    pub fn device(&self) -> Result<Device, DlpackError> {
        let device = self.dl_tensor().device;
        match device.device_type {
            DL_CPU | DL_CUDA_HOST => Ok(Device::Cpu),
            _ => Err(DlpackError::Device(device_name(device))),
        }
    }

    /// The shape and element type make sense; a tensor of elements has its data.
    fn check(&self) -> Result<(), DlpackError> {
        let t = self.dl_tensor();
        if t.ndim < 0 || (t.ndim > 0 && t.shape.is_null()) {
            return Err(DlpackError::Malformed(format!("{} dimensions and no shape", t.ndim)));
        }
        for i in 0..t.ndim as usize {
            // SAFETY: a non-null shape holds `ndim` extents (DLPack).
            let extent = unsafe { *t.shape.add(i) };
            if extent < 0 {
                return Err(DlpackError::Malformed(format!("extent {extent} of dimension {i}")));
            }
        }
        let count = self.dims().iter().try_fold(1usize, |n, &d| n.checked_mul(d));
        let Some(count) = count else {
            return Err(DlpackError::Malformed("more elements than memory can hold".into()));
        };
        if count > 0 && t.data.is_null() {
            return Err(DlpackError::Malformed(format!("{count} elements at a null address")));
        }
        Ok(())
    }

    /// The tensor as an f32 host tensor: read in place when it is f32, row-major and aligned
    /// (the returned tensor then holds `self`, and the deleter runs when it is dropped), else
    /// copied once in logical order. Device memory is refused with [`DlpackError::Device`].
    pub fn into_tensor(self) -> Result<Tensor, DlpackError> {
        self.device()?;
        let elem = Elem::of(self.dl_tensor().dtype)?;
        let dims = self.dims();
        let count: usize = dims.iter().product();
        if count == 0 {
            return Ok(Tensor::from_vec(Vec::new(), dims, &Device::Cpu)?);
        }
        let t = self.dl_tensor();
        let offset = usize::try_from(t.byte_offset)
            .map_err(|_| DlpackError::Malformed(format!("byte offset {}", t.byte_offset)))?;
        // SAFETY: DLPack: the elements begin `byte_offset` bytes into the allocation at `data`.
        let first = unsafe { t.data.cast::<u8>().add(offset) };
        let strides = self.strides();
        let dense = is_row_major(&dims, &strides);
        if elem == Elem::F32 && dense && (first as usize).is_multiple_of(std::mem::align_of::<f32>()) {
            let data = first.cast_const().cast::<f32>();
            let owner: Arc<dyn std::any::Any + Send + Sync> = Arc::new(self);
            // SAFETY: `data` is non-null (checked), aligned, and starts `count` row-major f32
            // elements that the producer keeps valid until its deleter runs, which `owner`
            // (held by the tensor) delays until the tensor is dropped; tensors never write lent
            // memory.
            return Ok(unsafe { Tensor::lent(data, dims, owner) });
        }
        let mut values = Vec::with_capacity(count);
        let mut index = vec![0usize; dims.len()];
        for _ in 0..count {
            let at: i64 = index.iter().zip(&strides).map(|(&i, &s)| i as i64 * s).sum();
            let bytes = at as isize * elem.size() as isize;
            // SAFETY: DLPack: every index within the extents, through the strides, addresses
            // an element of the producer's allocation, valid until the deleter (in `drop`).
            values.push(unsafe { elem.read(first.offset(bytes)) });
            for d in (0..dims.len()).rev() {
                index[d] += 1;
                if index[d] < dims[d] {
                    break;
                }
                index[d] = 0;
            }
        }
        Ok(Tensor::from_vec(values, dims, &Device::Cpu)?)
    }
}

impl Drop for Imported {
    fn drop(&mut self) {
        // SAFETY: we own the managed tensor (the constructors' contract) and this is the one
        // place its deleter is called; a null deleter means the producer frees nothing.
        unsafe {
            match self.managed {
                Managed::Legacy(p) => {
                    if let Some(deleter) = p.as_ref().deleter {
                        deleter(p.as_ptr());
                    }
                }
                Managed::Versioned(p) => {
                    if let Some(deleter) = p.as_ref().deleter {
                        deleter(p.as_ptr());
                    }
                }
            }
        }
    }
}

/// Row-major strides of `dims`, in elements.
fn row_major(dims: &[usize]) -> Vec<i64> {
    let mut strides = vec![1i64; dims.len()];
    for d in (0..dims.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * dims[d + 1] as i64;
    }
    strides
}

/// Whether `strides` lay `dims` out in row-major order (a dimension of extent 1 may have any
/// stride, as PyTorch and NumPy give it).
fn is_row_major(dims: &[usize], strides: &[i64]) -> bool {
    let want = row_major(dims);
    dims.iter().zip(strides.iter().zip(&want)).all(|(&d, (&s, &w))| d == 1 || s == w)
}

/// A tensor of ours to lend through DLPack: each managed tensor made from it holds it, so its
/// memory lives until the last consumer's deleter (and this value) are gone.
#[derive(Debug)]
pub struct Exported {
    memory: Memory,
    shape: Vec<i64>,
    strides: Vec<i64>,
    /// The flags of every managed tensor made from it (`FLAG_IS_COPIED` for a copy).
    flags: u64,
}

/// Where an exported tensor's elements are.
#[derive(Debug)]
enum Memory {
    /// Host f32 elements. The memory is lent writable (consumers such as PyTorch may write it
    /// in place), so this value reads it only through `ptr`, never through a shared reference.
    Host {
        /// Owns the elements (freed when this value goes); never read or moved from after
        /// `ptr` was taken, only its length.
        data: Vec<f32>,
        /// The elements' start, taken once with `Vec::as_mut_ptr` (so writes through it are
        /// allowed); valid for `data.len()` elements while `data` lives.
        ptr: NonNull<f32>,
    },
    /// A CUDA tensor (f32 or bf16), lent in place: its device memory lives while this does.
    Device(Tensor),
}

// SAFETY: `ptr` points into `data`, which this value owns; the elements are plain f32s, read
// here only by copy through `ptr` (no references), so sharing or sending the value across
// threads is as sound as sending the `Vec` (concurrent writes by consumers are theirs to order,
// as with any DLPack memory lent writable). A device tensor is `Send + Sync` itself.
unsafe impl Send for Exported {}
// SAFETY: as for `Send`: `&Exported` gives no reference into the elements.
unsafe impl Sync for Exported {}

/// What a managed tensor of ours points at: the exported tensor and its own shape and strides.
struct Context {
    tensor: Arc<Exported>,
    shape: Vec<i64>,
    strides: Vec<i64>,
}

impl Exported {
    /// A tensor's elements, handed over without a copy: a host tensor that owns them gives its
    /// buffer (one reading lent memory is copied once, so that consumers may write theirs); a
    /// CUDA tensor is kept whole and lent where it is, in its own type.
    pub fn new(tensor: Tensor) -> Result<Self, DlpackError> {
        let dims = tensor.dims().to_vec();
        let shape = dims.iter().map(|&d| d as i64).collect();
        if !tensor.device().is_cpu() {
            return Ok(Self { memory: Memory::Device(tensor), shape, strides: row_major(&dims), flags: 0 });
        }
        let data = tensor.into_vec_f32()?;
        Ok(Self::owning(data, shape, row_major(&dims), 0))
    }

    /// Takes the elements' mutable pointer once, before any consumer can see them.
    fn owning(mut data: Vec<f32>, shape: Vec<i64>, strides: Vec<i64>, flags: u64) -> Self {
        let ptr = NonNull::from(data.as_mut_slice()).cast::<f32>();
        Self { memory: Memory::Host { data, ptr }, shape, strides, flags }
    }

    /// A copy of the elements as f32 as they are now (read through `ptr` on the host: a
    /// consumer may hold them; downloaded from a device).
    fn read(&self) -> Result<Vec<f32>, DlpackError> {
        match &self.memory {
            Memory::Host { data, ptr } => {
                let mut out = Vec::with_capacity(data.len());
                // SAFETY: `ptr` is valid for `data.len()` f32s while `data` lives, and `out` has
                // that capacity, disjoint from them; the copy makes no reference to the lent
                // memory.
                unsafe {
                    std::ptr::copy_nonoverlapping(ptr.as_ptr(), out.as_mut_ptr(), data.len());
                    out.set_len(data.len());
                }
                Ok(out)
            }
            Memory::Device(t) => Ok(t.to_vec_f32()?),
        }
    }

    /// A copy of the elements of its own (on the same device), lent with `FLAG_IS_COPIED` (for
    /// a consumer that asks for a copy: the Python protocol's `copy=True`).
    pub fn copied(&self) -> Result<Self, DlpackError> {
        let (shape, strides) = (self.shape.clone(), self.strides.clone());
        Ok(match &self.memory {
            Memory::Host { .. } => Self::owning(self.read()?, shape, strides, FLAG_IS_COPIED),
            // A device copy: `Tensor::clone` of device memory is a new allocation.
            Memory::Device(t) => Self { memory: Memory::Device(t.clone()), shape, strides, flags: FLAG_IS_COPIED },
        })
    }

    /// The extents.
    pub fn dims(&self) -> Vec<usize> {
        self.shape.iter().map(|&d| d as usize).collect()
    }

    /// A copy of the elements as f32, row-major, as they are now (a device tensor's downloaded).
    pub fn to_vec(&self) -> Result<Vec<f32>, DlpackError> {
        self.read()
    }

    /// The element type lent: f32, or bf16 for a bf16 device tensor.
    pub fn dtype(&self) -> DType {
        match &self.memory {
            Memory::Host { .. } => DType::F32,
            Memory::Device(t) => t.dtype(),
        }
    }

    /// The DLPack device: the host, or `kDLCUDA` and the tensor's ordinal.
    pub fn device(&self) -> DLDevice {
        match &self.memory {
            Memory::Device(t) => match t.device() {
                Device::Cuda(ordinal) => DLDevice { device_type: DL_CUDA, device_id: ordinal as i32 },
                Device::Cpu => DLDevice { device_type: DL_CPU, device_id: 0 },
            },
            Memory::Host { .. } => DLDevice { device_type: DL_CPU, device_id: 0 },
        }
    }

    fn context(self: &Arc<Self>) -> Box<Context> {
        Box::new(Context { tensor: Arc::clone(self), shape: self.shape.clone(), strides: self.strides.clone() })
    }

    /// The description of the elements for a consumer on `stream` (see [`Self::to_versioned`]).
    fn dl_tensor(context: &mut Context, stream: Option<u64>) -> Result<DLTensor, DlpackError> {
        let (data, dtype) = match &context.tensor.memory {
            Memory::Host { ptr, .. } => (ptr.as_ptr().cast(), DLDataType { code: DL_FLOAT, bits: 32, lanes: 1 }),
            Memory::Device(t) => {
                let dtype = match t.dtype() {
                    DType::F32 => DLDataType { code: DL_FLOAT, bits: 32, lanes: 1 },
                    DType::BF16 => DLDataType { code: DL_BFLOAT, bits: 16, lanes: 1 },
                };
                (cuda::address_for(t, stream)? as *mut c_void, dtype)
            }
        };
        Ok(DLTensor {
            data,
            device: context.tensor.device(),
            ndim: context.shape.len() as i32,
            dtype,
            shape: context.shape.as_mut_ptr(),
            strides: context.strides.as_mut_ptr(),
            byte_offset: 0,
        })
    }

    /// A versioned managed tensor over these elements, writable, for a consumer to adopt; the
    /// consumer calls its deleter once (which releases this hold on the elements).
    ///
    /// `stream` matters for a device tensor only: the consumer's stream (a handle of the
    /// device's context; `1` the legacy default stream), which waits on the device until every
    /// write to the elements queued so far has run (an event recorded on ours,
    /// `cuStreamWaitEvent` on theirs); `None`: the host waits for those writes before this
    /// returns. The consumer must finish with the memory before it calls the deleter (the
    /// memory may be reused by later work on our stream).
    pub fn to_versioned(
        self: &Arc<Self>,
        stream: Option<u64>,
    ) -> Result<NonNull<DLManagedTensorVersioned>, DlpackError> {
        let mut context = self.context();
        let dl_tensor = Self::dl_tensor(&mut context, stream)?;
        let managed = Box::new(DLManagedTensorVersioned {
            version: DLPACK_VERSION,
            manager_ctx: Box::into_raw(context).cast(),
            deleter: Some(delete_versioned),
            flags: self.flags,
            dl_tensor,
        });
        Ok(NonNull::from(Box::leak(managed)))
    }

    /// A legacy managed tensor over these elements, for consumers that ask for no version;
    /// `stream` as for [`Self::to_versioned`].
    pub fn to_legacy(self: &Arc<Self>, stream: Option<u64>) -> Result<NonNull<DLManagedTensor>, DlpackError> {
        let mut context = self.context();
        let dl_tensor = Self::dl_tensor(&mut context, stream)?;
        let managed = Box::new(DLManagedTensor {
            dl_tensor,
            manager_ctx: Box::into_raw(context).cast(),
            deleter: Some(delete_legacy),
        });
        Ok(NonNull::from(Box::leak(managed)))
    }
}

/// The deleter of our versioned managed tensors.
unsafe extern "C" fn delete_versioned(managed: *mut DLManagedTensorVersioned) {
    if managed.is_null() {
        return;
    }
    // SAFETY: `managed` and its context were made by `Exported::to_versioned` with
    // `Box::into_raw`/`Box::leak`, and DLPack's consumer calls the deleter once.
    unsafe {
        let managed = Box::from_raw(managed);
        drop(Box::from_raw(managed.manager_ctx.cast::<Context>()));
    }
}

/// The deleter of our legacy managed tensors.
unsafe extern "C" fn delete_legacy(managed: *mut DLManagedTensor) {
    if managed.is_null() {
        return;
    }
    // SAFETY: as for `delete_versioned`, from `Exported::to_legacy`.
    unsafe {
        let managed = Box::from_raw(managed);
        drop(Box::from_raw(managed.manager_ctx.cast::<Context>()));
    }
}

#[cfg(test)]
#[path = "dlpack_tests.rs"]
mod tests;
