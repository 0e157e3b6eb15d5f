//! The Python DLPack protocol on both sides of a request: inputs are read through
//! `__dlpack__` / `__dlpack_device__` (NumPy ≥ 1.22, PyTorch, CuPy, JAX, ... tensors on the
//! host), outputs are [`DlpackTensor`]s that `torch.from_dlpack` and `numpy.from_dlpack` adopt
//! without a copy. The capsules follow the Python specification
//! (<https://dmlc.github.io/dlpack/latest/python_spec.html>): a versioned capsule
//! (`"dltensor_versioned"`) when the consumer passes `max_version` ≥ 1.0, the legacy one
//! (`"dltensor"`) otherwise; a consumer renames the capsule it adopts (`"used_..."`), and the
//! capsule's destructor calls the deleter only when nobody did adopt it, so each deleter runs
//! exactly once.
//!
//! A producer on the CUDA device the model computes on (`__dlpack_device__() == (kDLCUDA, id)`)
//! is asked for its tensor on our stream (`__dlpack__(stream=<our stream>, max_version=(1, 0))`,
//! so that it orders its writes before our work) and read in place there; a result on that
//! device is a [`DlpackTensor`] on `kDLCUDA` whose `__dlpack__(stream=...)` orders our writes
//! before the consumer's stream.
//!
//! What [`vae_parallel::tensor::dlpack`] reads in place or copies, and what it refuses, is its
//! own documentation; this module adds the Python side: which producers are asked, with which
//! arguments, and the `BufferError` fallbacks.

use std::ffi::{CStr, c_void};
use std::sync::Arc;

use pyo3::exceptions::{PyBufferError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use vae_parallel::tensor::dlpack::{
    DL_CPU, DL_CUDA, DL_CUDA_HOST, DLDevice, DLManagedTensor, DLManagedTensorVersioned, DlpackError, Exported,
    Imported, consumer_stream,
};
use vae_parallel::{DType, Tensor};

use crate::errors::InputError;

const VERSIONED: &CStr = c"dltensor_versioned";
const USED_VERSIONED: &CStr = c"used_dltensor_versioned";
const LEGACY: &CStr = c"dltensor";
const USED_LEGACY: &CStr = c"used_dltensor";

/// A DLPack device `(type, id)` as a name for messages (`cuda:0`).
pub(crate) fn device_name(device_type: i32, device_id: i32) -> String {
    vae_parallel::tensor::dlpack::device_name(DLDevice { device_type, device_id })
}

/// A DLPack refusal as the package's `InputError`.
fn input_error(e: DlpackError) -> PyErr {
    InputError::new_err(e.to_string())
}

/// What reading `x` through DLPack gave.
pub(crate) enum Read {
    /// The tensor (on the host).
    Tensor(Tensor),
    /// `x` is no DLPack producer, or one that cannot export this tensor (NumPy before 2.1
    /// refuses read-only arrays): read it another way.
    NotExported,
    /// A producer on a device other than the host, with its DLPack device `(type, id)`.
    OnDevice(i32, i32),
}

/// Reads `x` through DLPack when it is a producer whose tensor lives on the host: f32 in
/// row-major order in place (the producer's memory, held until the request's tensor is
/// dropped), other float types and layouts converted once; non-float types are an
/// `InputError`. With `cuda = Some((ordinal, dtype))` (the model computes on that CUDA device
/// in that type), a producer on that device is read there, in place ([`read_on_device`]).
pub(crate) fn read(x: &Bound<'_, PyAny>, cuda: Option<(usize, DType)>) -> PyResult<Read> {
    if !x.hasattr("__dlpack__")? || !x.hasattr("__dlpack_device__")? {
        return Ok(Read::NotExported);
    }
    let (device_type, device_id): (i32, i32) = x.call_method0("__dlpack_device__")?.extract()?;
    if let Some((ordinal, dtype)) = cuda
        && device_type == DL_CUDA
        && usize::try_from(device_id).ok() == Some(ordinal)
    {
        return read_on_device(x, ordinal, dtype).map(Read::Tensor);
    }
    if device_type != DL_CPU && device_type != DL_CUDA_HOST {
        return Ok(Read::OnDevice(device_type, device_id));
    }
    let py = x.py();
    // Host memory: no stream to name (the specification's `stream=None` for the CPU).
    let kwargs = PyDict::new(py);
    kwargs.set_item("max_version", (1, 1))?;
    let capsule = match x.call_method("__dlpack__", (), Some(&kwargs)) {
        Ok(capsule) => capsule,
        // A producer of the protocol before `max_version` (NumPy < 2.1, PyTorch < 2.4).
        Err(e) if e.is_instance_of::<PyTypeError>(py) => match x.call_method0("__dlpack__") {
            Ok(capsule) => capsule,
            Err(e) if e.is_instance_of::<PyBufferError>(py) => return Ok(Read::NotExported),
            Err(e) => return Err(e),
        },
        Err(e) if e.is_instance_of::<PyBufferError>(py) => return Ok(Read::NotExported),
        Err(e) => return Err(e),
    };
    let imported = take(&capsule)?;
    imported.into_tensor().map(Read::Tensor).map_err(input_error)
}

/// Reads a producer's tensor on CUDA device `ordinal` in place: asks for it on our stream (the
/// Python specification's `stream` argument: the producer orders its writes before it), DLPack
/// 1.0 or the legacy capsule, and reads it as [`Imported::into_device_tensor`] does (f32 or
/// bf16 row-major in place; the other of the two converted on the device; anything else an
/// `InputError`, never a copy through the host).
fn read_on_device(x: &Bound<'_, PyAny>, ordinal: usize, dtype: DType) -> PyResult<Tensor> {
    let py = x.py();
    let stream = consumer_stream(ordinal).map_err(input_error)?;
    let kwargs = PyDict::new(py);
    kwargs.set_item("stream", stream)?;
    kwargs.set_item("max_version", (1, 0))?;
    let capsule = match x.call_method("__dlpack__", (), Some(&kwargs)) {
        Ok(capsule) => capsule,
        // A producer of the protocol before `max_version`.
        Err(e) if e.is_instance_of::<PyTypeError>(py) => {
            let kwargs = PyDict::new(py);
            kwargs.set_item("stream", stream)?;
            x.call_method("__dlpack__", (), Some(&kwargs))?
        }
        Err(e) => return Err(e),
    };
    let imported = take(&capsule)?;
    // SAFETY: the producer describes its own memory, as DLPack has it, and ordered its writes
    // before `stream`, our stream of that device, as the Python specification requires of it.
    unsafe { imported.into_device_tensor(ordinal, dtype, Some(stream)) }.map_err(input_error)
}

/// Takes over the managed tensor of a capsule `__dlpack__` returned, renaming the capsule so
/// that its destructor leaves the deleter to us.
fn take(capsule: &Bound<'_, PyAny>) -> PyResult<Imported> {
    let ptr = capsule.as_ptr();
    // SAFETY: `ptr` is a live object (borrowed from `capsule`); `PyCapsule_IsValid` accepts any
    // object and sets no exception.
    let versioned = unsafe { pyo3::ffi::PyCapsule_IsValid(ptr, VERSIONED.as_ptr()) } == 1;
    // SAFETY: as above.
    let legacy = !versioned && unsafe { pyo3::ffi::PyCapsule_IsValid(ptr, LEGACY.as_ptr()) } == 1;
    if !versioned && !legacy {
        return Err(InputError::new_err(
            "__dlpack__ returned no unused DLPack capsule (\"dltensor\" or \"dltensor_versioned\")",
        ));
    }
    let (name, used) = if versioned { (VERSIONED, USED_VERSIONED) } else { (LEGACY, USED_LEGACY) };
    // SAFETY: the capsule is valid under `name` (checked above).
    let managed = unsafe { pyo3::ffi::PyCapsule_GetPointer(ptr, name.as_ptr()) };
    // SAFETY: a valid capsule; `used` is a static string, as the capsule keeps the pointer.
    if unsafe { pyo3::ffi::PyCapsule_SetName(ptr, used.as_ptr()) } != 0 {
        return Err(PyErr::fetch(capsule.py()));
    }
    // SAFETY: the capsule held a managed tensor of this kind (its name says so) that nobody had
    // adopted; renamed, it is ours alone, and `Imported` calls its deleter once.
    unsafe {
        match versioned {
            true => Imported::from_versioned(managed.cast::<DLManagedTensorVersioned>()),
            false => Imported::from_legacy(managed.cast::<DLManagedTensor>()),
        }
    }
    .map_err(input_error)
}

/// A result of this package as a DLPack producer, row-major, owning its memory: float32 on the
/// host, or on the CUDA device the model computes on (float32, or bfloat16 for a bf16 model)
/// when the request's input was there. `torch.from_dlpack(t)` (and `numpy.from_dlpack(t)` on
/// the host, `cupy.from_dlpack(t)` on a GPU) adopt it without a copy; the memory lives until
/// this object and every tensor adopted from it are gone (however long after the model or
/// group that computed it).
#[pyclass(name = "DLPackTensor", module = "vae_parallel", frozen)]
pub(crate) struct DlpackTensor {
    exported: Arc<Exported>,
}

impl DlpackTensor {
    /// A tensor of a request's result, its memory handed over (no copy when the tensor owns it).
    pub(crate) fn new(t: Tensor) -> PyResult<Self> {
        let exported = Exported::new(t).map_err(|e| crate::errors::ExecutionError::new_err(e.to_string()))?;
        Ok(Self { exported: Arc::new(exported) })
    }
}

/// The capsule destructor: calls the deleter of a managed tensor nobody adopted (a consumer
/// renames the capsule when it does, and then calls the deleter itself).
unsafe extern "C" fn capsule_destructor(capsule: *mut pyo3::ffi::PyObject) {
    // SAFETY: Python calls the destructor with the capsule, the GIL held; `IsValid` sets no
    // exception, and a valid capsule of either name holds the managed tensor we put there.
    unsafe {
        if pyo3::ffi::PyCapsule_IsValid(capsule, VERSIONED.as_ptr()) == 1 {
            let managed =
                pyo3::ffi::PyCapsule_GetPointer(capsule, VERSIONED.as_ptr()).cast::<DLManagedTensorVersioned>();
            if let Some(deleter) = (*managed).deleter {
                deleter(managed);
            }
        } else if pyo3::ffi::PyCapsule_IsValid(capsule, LEGACY.as_ptr()) == 1 {
            let managed = pyo3::ffi::PyCapsule_GetPointer(capsule, LEGACY.as_ptr()).cast::<DLManagedTensor>();
            if let Some(deleter) = (*managed).deleter {
                deleter(managed);
            }
        }
    }
}

/// A new capsule named `name` over `managed`, whose destructor frees it unless adopted.
fn capsule(py: Python<'_>, managed: *mut c_void, name: &'static CStr) -> PyResult<Py<PyAny>> {
    // SAFETY: `managed` is a managed tensor of the kind `name` says, `name` is static, and the
    // destructor above matches both.
    let ptr = unsafe { pyo3::ffi::PyCapsule_New(managed, name.as_ptr(), Some(capsule_destructor)) };
    if ptr.is_null() {
        // SAFETY: not in a capsule: the caller's managed tensor is still ours to free.
        unsafe { capsule_free(managed, name) };
        return Err(PyErr::fetch(py));
    }
    // SAFETY: a new reference, just made.
    Ok(unsafe { Bound::from_owned_ptr(py, ptr) }.unbind())
}

/// Frees a managed tensor that never reached a capsule.
///
/// # Safety
/// `managed` is one of ours of the kind `name` says, adopted by nobody.
unsafe fn capsule_free(managed: *mut c_void, name: &CStr) {
    // SAFETY: the caller's contract.
    unsafe {
        if name == VERSIONED {
            let m = managed.cast::<DLManagedTensorVersioned>();
            if let Some(d) = (*m).deleter {
                d(m);
            }
        } else {
            let m = managed.cast::<DLManagedTensor>();
            if let Some(d) = (*m).deleter {
                d(m);
            }
        }
    }
}

#[pymethods]
impl DlpackTensor {
    /// A DLPack capsule over the elements (the Python specification's `__dlpack__`): versioned
    /// when `max_version` is 1.0 or later, else the legacy capsule. On the host `stream` must be
    /// `None` (or -1). On a CUDA device `stream` is the consumer's stream (an integer handle,
    /// `1` the legacy default stream), which waits on the device for our writes; `None` or -1:
    /// the host waits for them before the capsule is made. `dl_device` may only name the
    /// tensor's own device; `copy=True` lends a copy of the elements of its own (on the same
    /// device).
    #[pyo3(signature = (*, stream = None, max_version = None, dl_device = None, copy = None))]
    fn __dlpack__(
        &self,
        py: Python<'_>,
        stream: Option<Bound<'_, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        let here = self.exported.device();
        let stream = match stream.filter(|s| !s.is_none()) {
            None => None,
            Some(s) => match s.extract::<i64>() {
                Ok(-1) => None,
                Ok(handle) if here.device_type == DL_CUDA && handle > 0 => Some(handle as u64),
                Ok(handle) if here.device_type == DL_CUDA => {
                    return Err(PyBufferError::new_err(format!(
                        "stream {handle}: a CUDA consumer names its stream (1: the legacy default stream)"
                    )));
                }
                _ if here.device_type == DL_CUDA => {
                    return Err(PyTypeError::new_err("stream must be an integer CUDA stream handle or None"));
                }
                _ => return Err(PyBufferError::new_err("a host tensor takes no stream (stream=None)")),
            },
        };
        if let Some(device) = dl_device
            && device != (here.device_type, here.device_id)
        {
            return Err(PyBufferError::new_err(format!(
                "the tensor is on {}, not on DLPack device {device:?}",
                device_name(here.device_type, here.device_id)
            )));
        }
        let failed = |e: DlpackError| PyBufferError::new_err(e.to_string());
        let exported = match copy {
            Some(true) => Arc::new(self.exported.copied().map_err(failed)?),
            _ => Arc::clone(&self.exported),
        };
        match max_version {
            Some((major, _)) if major >= 1 => {
                capsule(py, exported.to_versioned(stream).map_err(failed)?.as_ptr().cast(), VERSIONED)
            }
            _ => capsule(py, exported.to_legacy(stream).map_err(failed)?.as_ptr().cast(), LEGACY),
        }
    }

    /// `(kDLCPU, 0)` for a result on the host, `(kDLCUDA, ordinal)` for one on a GPU.
    fn __dlpack_device__(&self) -> (i32, i32) {
        let device = self.exported.device();
        (device.device_type, device.device_id)
    }

    /// Whether the elements are on a CUDA device (else on the host).
    #[getter]
    fn is_cuda(&self) -> bool {
        self.exported.device().device_type == DL_CUDA
    }

    /// The extents.
    #[getter]
    fn shape(&self) -> Vec<usize> {
        self.exported.dims()
    }

    fn __repr__(&self) -> String {
        let dtype = if self.exported.dtype() == DType::BF16 { "bfloat16" } else { "float32" };
        let device = self.exported.device();
        format!(
            "DLPackTensor(shape={:?}, dtype={dtype}, device={})",
            self.exported.dims(),
            device_name(device.device_type, device.device_id).replace("cpu:0", "cpu")
        )
    }
}
