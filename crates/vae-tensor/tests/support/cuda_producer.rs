//! A DLPack producer of CUDA tensors, written as another library would lend its device memory
//! (its memory allocated through our backend, held by the producer until its deleter runs, which
//! counts its calls), and the driver-level checks the device DLPack tests make: the fake driver's
//! count of host copies (`fake_cuda_host_copies`, looked up with `dlsym`) and reading device
//! memory back with the driver's own `cuMemcpyDtoH`. Included by path from the tests that need
//! it (`#[path = ...] mod cuda_producer;`).
#![allow(dead_code)] // each including test uses part of it

use std::ffi::{CStr, c_void};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use vae_tensor::dlpack::{
    DL_BFLOAT, DL_CUDA, DL_FLOAT, DLDataType, DLDevice, DLManagedTensorVersioned, DLPACK_VERSION, DLTensor,
};
use vae_tensor::{DType, Device, Tensor};

/// What the producer holds for one lent tensor: the memory (a tensor of ours standing for the
/// other library's), the description, and the deleter's call count.
struct Held {
    _memory: Arc<Tensor>,
    shape: Vec<i64>,
    strides: Option<Vec<i64>>,
    deleted: Arc<AtomicUsize>,
}

unsafe extern "C" fn delete(managed: *mut DLManagedTensorVersioned) {
    // SAFETY: made by `lend` with `Box::leak` / `Box::into_raw`; the count proves it is called
    // once.
    unsafe {
        let managed = Box::from_raw(managed);
        let held = Box::from_raw(managed.manager_ctx.cast::<Held>());
        held.deleted.fetch_add(1, Ordering::SeqCst);
    }
}

/// How a lent tensor describes itself, where a test makes the description lie or differ.
pub struct Lend {
    /// The values, row-major in `dims`.
    pub values: Vec<f32>,
    /// The extents.
    pub dims: Vec<usize>,
    /// The element type of the memory (f32, or bf16 rounded from `values`).
    pub dtype: DType,
    /// The device the description names (the memory is on `cuda:0` whatever it says).
    pub device: DLDevice,
    /// The element type the description names (`None`: the memory's).
    pub claimed_dtype: Option<DLDataType>,
    /// The strides the description gives (`None`: null, row-major).
    pub strides: Option<Vec<i64>>,
    /// Bytes between the allocation's start and the first element (the memory is allocated
    /// that much larger, zeros first).
    pub byte_offset: u64,
}

impl Lend {
    /// `values` in `dims` as f32 on `cuda:0`, described truthfully.
    pub fn f32(values: Vec<f32>, dims: &[usize]) -> Self {
        Self {
            values,
            dims: dims.to_vec(),
            dtype: DType::F32,
            device: DLDevice { device_type: DL_CUDA, device_id: 0 },
            claimed_dtype: None,
            strides: None,
            byte_offset: 0,
        }
    }
}

/// A lent tensor: the managed tensor to hand to the consumer, the count of its deleter's calls,
/// the device address of its first element, and the memory (which the test holds too, so that
/// it can read what the producer's memory holds after the deleter ran).
pub struct Lent {
    pub managed: *mut DLManagedTensorVersioned,
    pub deleted: Arc<AtomicUsize>,
    pub address: u64,
    pub memory: Arc<Tensor>,
}

impl Lent {
    /// How many times the deleter ran.
    pub fn deleted(&self) -> usize {
        self.deleted.load(Ordering::SeqCst)
    }
}

/// Lends `spec`'s values as a versioned managed tensor on `cuda:0`.
pub fn lend(spec: Lend) -> Lent {
    let cuda = Device::Cuda(0);
    let elem = if spec.dtype == DType::F32 { 4 } else { 2 };
    assert_eq!(spec.byte_offset % elem as u64, 0, "whole elements before the first");
    let lead = spec.byte_offset as usize / elem;
    let mut padded = vec![0.0; lead];
    padded.extend_from_slice(&spec.values);
    let memory = Tensor::from_vec(padded, vec![lead + spec.values.len()], &cuda).unwrap().to_dtype(spec.dtype).unwrap();
    let base = memory.device_memory().unwrap().expect("device memory").address;
    let memory = Arc::new(memory);
    let deleted = Arc::new(AtomicUsize::new(0));
    let mut held = Box::new(Held {
        _memory: Arc::clone(&memory),
        shape: spec.dims.iter().map(|&d| d as i64).collect(),
        strides: spec.strides,
        deleted: Arc::clone(&deleted),
    });
    let dtype = spec.claimed_dtype.unwrap_or(match spec.dtype {
        DType::F32 => DLDataType { code: DL_FLOAT, bits: 32, lanes: 1 },
        DType::BF16 => DLDataType { code: DL_BFLOAT, bits: 16, lanes: 1 },
    });
    let dl_tensor = DLTensor {
        data: base as *mut c_void,
        device: spec.device,
        ndim: held.shape.len() as i32,
        dtype,
        shape: held.shape.as_mut_ptr(),
        strides: held.strides.as_mut().map_or(std::ptr::null_mut(), |s| s.as_mut_ptr()),
        byte_offset: spec.byte_offset,
    };
    let managed = Box::leak(Box::new(DLManagedTensorVersioned {
        version: DLPACK_VERSION,
        manager_ctx: Box::into_raw(held).cast(),
        deleter: Some(delete),
        flags: 0,
        dl_tensor,
    }));
    Lent { managed, deleted, address: base + spec.byte_offset, memory }
}

/// The loaded driver library, found by the names cudarc opens it by (already loaded: no new
/// load).
fn driver() -> Option<*mut c_void> {
    for name in [c"libcuda.so", c"libcuda.so.1"] {
        // SAFETY: RTLD_NOLOAD only looks up a library already loaded.
        let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
        if !handle.is_null() {
            return Some(handle);
        }
    }
    None
}

fn symbol(name: &CStr) -> Option<*mut c_void> {
    let handle = driver()?;
    // SAFETY: a live handle and a NUL-terminated name.
    let f = unsafe { libc::dlsym(handle, name.as_ptr()) };
    (!f.is_null()).then_some(f)
}

/// Whether the driver is the fake one (`cargo xtask gpu-emu` sets this for its runs).
pub fn under_fake_driver() -> bool {
    std::env::var_os("FAKE_CUDA_DEVICE_COUNT").is_some()
}

/// The fake driver's counts of host-to-device and device-to-host copies so far; `None` from a
/// real driver, which has no such count (under the fake, a missing count fails the test).
pub fn host_copies() -> Option<(u64, u64)> {
    let Some(f) = symbol(c"fake_cuda_host_copies") else {
        assert!(!under_fake_driver(), "the fake driver exports fake_cuda_host_copies");
        return None;
    };
    // SAFETY: the fake driver's `CUresult fake_cuda_host_copies(unsigned long long*, unsigned
    // long long*)` (kernels-cu/emu/fake_driver/fake_cuda.h).
    let f: unsafe extern "C" fn(*mut u64, *mut u64) -> i32 = unsafe { std::mem::transmute(f) };
    let (mut to_device, mut to_host) = (0u64, 0u64);
    // SAFETY: two valid outputs.
    assert_eq!(unsafe { f(&mut to_device, &mut to_host) }, 0);
    Some((to_device, to_host))
}

/// `bytes` bytes of device memory at `address`, read by the driver's `cuMemcpyDtoH_v2` (the
/// thread's current context is the backend's, which opened the device).
pub fn read_device(address: u64, bytes: usize) -> Vec<u8> {
    let f = symbol(c"cuMemcpyDtoH_v2").expect("the driver's cuMemcpyDtoH_v2");
    // SAFETY: `CUresult cuMemcpyDtoH_v2(void*, CUdeviceptr, size_t)` of the CUDA driver API.
    let f: unsafe extern "C" fn(*mut c_void, u64, usize) -> i32 = unsafe { std::mem::transmute(f) };
    let mut out = vec![0u8; bytes];
    // SAFETY: `out` holds `bytes` bytes; the driver checks the device range.
    assert_eq!(unsafe { f(out.as_mut_ptr().cast(), address, bytes) }, 0, "cuMemcpyDtoH");
    out
}

/// f32 values from their native-endian bytes.
pub fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_ne_bytes(c.try_into().unwrap())).collect()
}
