//! cuDNN, as the CUDA backend calls it: the library loaded at run time (cudarc's `cudnn`
//! bindings dlopen it on first use, as the driver), one handle per thread and device, the
//! descriptors of a convolution of our tensors, the algorithms cuDNN offers for it, and the
//! forward convolution with its bias.
//!
//! Where the library comes from: the loader's path (`LD_LIBRARY_PATH`, the system's
//! `libcudnn.so.9`), or [`CUDNN_PATH_ENV`]: a `libcudnn.so*` file or a directory holding one,
//! such as NVIDIA's `nvidia-cudnn-cu12` wheel's `site-packages/nvidia/cudnn/lib`, which is
//! loaded (with the `libcudnn_*` sub-libraries beside it) before cudarc looks for the library by
//! name, so that its lookup finds the one already loaded. cuDNN 9 is required (cudarc's bindings
//! are of 9.2's API: its status codes and `cudnnGetLastErrorString`).
//!
//! Layout: our tensors as they are, `NCDHW` contiguous (cuDNN's `CUDNN_TENSOR_NCHW` format in 5
//! dimensions, fully packed strides), and the weights `[Cout, Cin, kt, kh, kw]` as stored
//! (`CUDNN_TENSOR_NCHW` filters), so a convolution whose padding cuDNN can express (the same
//! before and after in every dimension) reads our tensors in place with no copy at all; ours
//! copies both into channels-last buffers. f32 runs with `CUDNN_FMA_MATH` (no tensor cores:
//! f32 accuracy), TF32 mode and bf16 with `CUDNN_TENSOR_OP_MATH`; the compute type is f32
//! throughout. The bias is added by `cudnnAddTensor` after the convolution (cuDNN's fused
//! bias-activation forward takes its identity activation with one algorithm only), in the
//! output's type: in bf16 that rounds twice (the product, then the sum), as PyTorch's cuDNN
//! path does.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{CString, c_int, c_void};
use std::os::unix::ffi::OsStrExt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::sync::OnceLock;

use cudarc::cudnn::sys;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

use super::conv_choice::Candidate;
use super::device::CudaDevice;
use super::storage::{DataView, DataViewMut};
use crate::{DType, Result, TensorError};

/// The environment variable naming the cuDNN library to load: a `libcudnn.so*` file, or a
/// directory holding `libcudnn.so.9` (the `nvidia-cudnn-cu12` wheel's `nvidia/cudnn/lib`).
pub const CUDNN_PATH_ENV: &str = "VAE_CUDNN_PATH";

/// The lowest cuDNN version these bindings run on (9.0.0).
const MIN_VERSION: usize = 90000;

/// cuDNN's version once loaded, or why it cannot be used (loaded once per process).
pub(crate) fn library() -> std::result::Result<usize, String> {
    static LOADED: OnceLock<std::result::Result<usize, String>> = OnceLock::new();
    LOADED.get_or_init(load).clone()
}

fn load() -> std::result::Result<usize, String> {
    if let Some(path) = std::env::var_os(CUDNN_PATH_ENV).filter(|p| !p.is_empty()) {
        preload(Path::new(&path))?;
    }
    if !crate::cuda::library_loadable("cudnn") {
        return Err(format!(
            "no cuDNN library (libcudnn.so.9) on the loader's path; set {CUDNN_PATH_ENV} to the nvidia-cudnn-cu12 \
             wheel's nvidia/cudnn/lib or add it to LD_LIBRARY_PATH"
        ));
    }
    // SAFETY: cudnnGetVersion takes nothing and returns a number; a library without it makes
    // cudarc's loader panic, which is caught.
    let version = catch_unwind(|| unsafe { sys::cudnnGetVersion() })
        .map_err(|_| "the cuDNN library has no cudnnGetVersion".to_string())?;
    if version < MIN_VERSION {
        return Err(format!("cuDNN {version} is older than 9.0, which these bindings need"));
    }
    tracing::debug!(version, "cuDNN loaded");
    Ok(version)
}

/// Loads `path` (a file, or a directory's `libcudnn.so.9` / `libcudnn.so` and the
/// `libcudnn_*` sub-libraries beside it) for good, its symbols global.
fn preload(path: &Path) -> std::result::Result<(), String> {
    let main = if path.is_dir() {
        ["libcudnn.so.9", "libcudnn.so"]
            .iter()
            .map(|n| path.join(n))
            .find(|p| p.is_file())
            .ok_or_else(|| format!("{CUDNN_PATH_ENV}={}: no libcudnn.so.9 or libcudnn.so there", path.display()))?
    } else {
        path.to_path_buf()
    };
    dlopen_global(&main).map_err(|e| format!("{CUDNN_PATH_ENV}={}: {e}", path.display()))?;
    if let Some(Ok(entries)) = main.parent().map(std::fs::read_dir) {
        for entry in entries.flatten() {
            let name = entry.file_name();
            if name.as_bytes().starts_with(b"libcudnn_")
                && let Err(e) = dlopen_global(&entry.path())
            {
                tracing::debug!("preloading {}: {e}", entry.path().display());
            }
        }
    }
    Ok(())
}

/// `dlopen(path, RTLD_NOW | RTLD_GLOBAL)`, never closed.
fn dlopen_global(path: &Path) -> std::result::Result<(), String> {
    let c = CString::new(path.as_os_str().as_bytes()).map_err(|_| "a NUL byte in the path".to_string())?;
    // SAFETY: `c` is a NUL-terminated path; the handle is kept open for the process's life (a
    // library cuDNN's own lookups must find).
    let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns the calling thread's last loader error, a C string or null.
        let why = unsafe { libc::dlerror() };
        let why = if why.is_null() {
            "dlopen failed".to_string()
        } else {
            // SAFETY: non-null: a NUL-terminated string the loader owns until the next call.
            unsafe { std::ffi::CStr::from_ptr(why) }.to_string_lossy().into_owned()
        };
        return Err(why);
    }
    Ok(())
}

/// A cuDNN failure as the backend's error: the status, and cuDNN's own last message.
fn failed(ordinal: usize, call: &str, status: sys::cudnnStatus_t) -> TensorError {
    let mut message = [0 as std::ffi::c_char; 1024];
    // SAFETY: cuDNN writes at most `message.len()` bytes, NUL-terminated, into the buffer; a
    // missing symbol panics in cudarc's loader, which is caught.
    let last = catch_unwind(AssertUnwindSafe(|| unsafe {
        sys::cudnnGetLastErrorString(message.as_mut_ptr(), message.len());
    }));
    let text = if last.is_ok() {
        // SAFETY: the buffer was zeroed and cuDNN NUL-terminates what it writes.
        unsafe { std::ffi::CStr::from_ptr(message.as_ptr()) }.to_string_lossy().into_owned()
    } else {
        String::new()
    };
    TensorError::InvalidArgument {
        op: "conv3d (cuDNN)",
        reason: format!(
            "{call} on cuda:{ordinal}: {status:?}{}",
            if text.is_empty() { String::new() } else { format!(": {text}") }
        ),
    }
}

/// `Ok` for a successful status, else [`failed`].
fn check(ordinal: usize, call: &str, status: sys::cudnnStatus_t) -> Result<()> {
    match status {
        sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS => Ok(()),
        s => Err(failed(ordinal, call, s)),
    }
}

/// A cuDNN handle of one thread and device.
struct Handle(sys::cudnnHandle_t);

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: the handle was created by cudnnCreate and is destroyed once, here.
        unsafe { sys::cudnnDestroy(self.0) };
    }
}

thread_local! {
    /// The calling thread's cuDNN handles, by device ordinal (a handle is not shared between
    /// threads: cuDNN's rule).
    static HANDLES: RefCell<HashMap<usize, Handle>> = RefCell::new(HashMap::new());
}

/// The calling thread's handle for `device`, its work going to `stream`.
fn handle(device: &CudaDevice, stream: &CudaStream) -> Result<sys::cudnnHandle_t> {
    let ordinal = device.ordinal;
    stream.context().bind_to_thread().map_err(|e| super::device::driver(ordinal, "conv3d (cuDNN)", e))?;
    let handle = HANDLES.with_borrow_mut(|handles| -> Result<sys::cudnnHandle_t> {
        if let Some(h) = handles.get(&ordinal) {
            return Ok(h.0);
        }
        let mut h = std::ptr::null_mut();
        // SAFETY: cudnnCreate writes a new handle to `h`; the device's context is current.
        check(ordinal, "cudnnCreate", unsafe { sys::cudnnCreate(&mut h) })?;
        handles.insert(ordinal, Handle(h));
        Ok(h)
    })?;
    // SAFETY: a live handle of this thread, and the device's live stream.
    check(ordinal, "cudnnSetStream", unsafe { sys::cudnnSetStream(handle, stream.cu_stream() as _) })?;
    Ok(handle)
}

/// A convolution as cuDNN is asked it: input `x` `[n, cin, t, h, w]`, filters `w`
/// `[cout, cin, kt, kh, kw]`, padding (both sides) and strides per spatial dimension, output
/// `y` `[n, cout, to, ho, wo]`, all contiguous.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Problem {
    pub(crate) x: [c_int; 5],
    pub(crate) w: [c_int; 5],
    pub(crate) pads: [c_int; 3],
    pub(crate) strides: [c_int; 3],
    pub(crate) y: [c_int; 5],
    pub(crate) dtype: DType,
    /// TF32 mode for f32 (tensor-op math); f32 otherwise runs with FMA math only.
    pub(crate) tf32: bool,
}

/// The strides of a contiguous tensor of `dims`, refused (a [`TensorError::InvalidArgument`])
/// when a stride or the element count does not fit cuDNN's 32-bit `int`.
pub(crate) fn packed(dims: [c_int; 5]) -> Result<[c_int; 5]> {
    let too_large = || TensorError::InvalidArgument {
        op: "conv3d (cuDNN)",
        reason: format!("a tensor of {dims:?} has more elements than cuDNN's 32-bit int counts"),
    };
    let mut s: [c_int; 5] = [1; 5];
    for d in (0..4).rev() {
        s[d] = s[d + 1].checked_mul(dims[d + 1]).ok_or_else(too_large)?;
    }
    s[0].checked_mul(dims[0]).ok_or_else(too_large)?;
    Ok(s)
}

macro_rules! descriptor {
    ($name:ident, $ty:ty, $create:ident, $destroy:ident) => {
        /// A cuDNN descriptor, destroyed when dropped.
        struct $name($ty);

        impl $name {
            fn new(ordinal: usize) -> Result<Self> {
                let mut d = std::ptr::null_mut();
                // SAFETY: the create call writes a new descriptor to `d`.
                check(ordinal, stringify!($create), unsafe { sys::$create(&mut d) })?;
                Ok(Self(d))
            }
        }

        impl Drop for $name {
            fn drop(&mut self) {
                // SAFETY: created by the matching create call, destroyed once, here.
                unsafe { sys::$destroy(self.0) };
            }
        }
    };
}

descriptor!(TensorDesc, sys::cudnnTensorDescriptor_t, cudnnCreateTensorDescriptor, cudnnDestroyTensorDescriptor);
descriptor!(FilterDesc, sys::cudnnFilterDescriptor_t, cudnnCreateFilterDescriptor, cudnnDestroyFilterDescriptor);
descriptor!(
    ConvDesc,
    sys::cudnnConvolutionDescriptor_t,
    cudnnCreateConvolutionDescriptor,
    cudnnDestroyConvolutionDescriptor
);

/// The descriptors of one [`Problem`].
pub(crate) struct Descriptors {
    x: TensorDesc,
    w: FilterDesc,
    conv: ConvDesc,
    y: TensorDesc,
    bias: TensorDesc,
    ordinal: usize,
}

fn data_type(dtype: DType) -> sys::cudnnDataType_t {
    match dtype {
        DType::F32 => sys::cudnnDataType_t::CUDNN_DATA_FLOAT,
        DType::BF16 => sys::cudnnDataType_t::CUDNN_DATA_BFLOAT16,
    }
}

impl Descriptors {
    /// Describes `p` to cuDNN, and checks that cuDNN's output extents are `p.y`.
    pub(crate) fn new(ordinal: usize, p: &Problem) -> Result<Self> {
        let dt = data_type(p.dtype);
        let tensor = |dims: [c_int; 5]| -> Result<TensorDesc> {
            let t = TensorDesc::new(ordinal)?;
            let strides = packed(dims)?;
            // SAFETY: a live descriptor; 5 dimensions and 5 strides.
            let s = unsafe { sys::cudnnSetTensorNdDescriptor(t.0, dt, 5, dims.as_ptr(), strides.as_ptr()) };
            check(ordinal, "cudnnSetTensorNdDescriptor", s)?;
            Ok(t)
        };
        let x = tensor(p.x)?;
        let y = tensor(p.y)?;
        let bias = tensor([1, p.y[1], 1, 1, 1])?;
        let w = FilterDesc::new(ordinal)?;
        let format = sys::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW;
        // SAFETY: a live descriptor; 5 dimensions.
        let s = unsafe { sys::cudnnSetFilterNdDescriptor(w.0, dt, format, 5, p.w.as_ptr()) };
        check(ordinal, "cudnnSetFilterNdDescriptor", s)?;
        let conv = ConvDesc::new(ordinal)?;
        let dilations = [1; 3];
        let (mode, compute) =
            (sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION, sys::cudnnDataType_t::CUDNN_DATA_FLOAT);
        // SAFETY: a live descriptor; 3 pads, strides and dilations.
        let s = unsafe {
            sys::cudnnSetConvolutionNdDescriptor(
                conv.0,
                3,
                p.pads.as_ptr(),
                p.strides.as_ptr(),
                dilations.as_ptr(),
                mode,
                compute,
            )
        };
        check(ordinal, "cudnnSetConvolutionNdDescriptor", s)?;
        let math = if p.dtype == DType::F32 && !p.tf32 {
            sys::cudnnMathType_t::CUDNN_FMA_MATH
        } else {
            sys::cudnnMathType_t::CUDNN_TENSOR_OP_MATH
        };
        // SAFETY: a live descriptor.
        check(ordinal, "cudnnSetConvolutionMathType", unsafe { sys::cudnnSetConvolutionMathType(conv.0, math) })?;
        let mut out = [0 as c_int; 5];
        // SAFETY: live descriptors; cuDNN writes 5 extents.
        let s = unsafe { sys::cudnnGetConvolutionNdForwardOutputDim(conv.0, x.0, w.0, 5, out.as_mut_ptr()) };
        check(ordinal, "cudnnGetConvolutionNdForwardOutputDim", s)?;
        if out != p.y {
            return Err(TensorError::InvalidArgument {
                op: "conv3d (cuDNN)",
                reason: format!("cuDNN's output extents {out:?} are not the convolution's {:?}", p.y),
            });
        }
        Ok(Self { x, w, conv, y, bias, ordinal })
    }

    /// The algorithms cuDNN's heuristics offer (`cudnnGetConvolutionForwardAlgorithm_v7`), best
    /// first, those it says would fail dropped, each with the workspace
    /// `cudnnGetConvolutionForwardWorkspaceSize` gives.
    pub(crate) fn candidates(&self, handle: sys::cudnnHandle_t) -> Result<Vec<Candidate>> {
        const SLOTS: usize = 8;
        let mut count: c_int = 0;
        // SAFETY: plain-old-data; cuDNN overwrites the slots it returns.
        let mut perf: [sys::cudnnConvolutionFwdAlgoPerf_t; SLOTS] = unsafe { std::mem::zeroed() };
        // SAFETY: live handle and descriptors; room for SLOTS results.
        let s = unsafe {
            sys::cudnnGetConvolutionForwardAlgorithm_v7(
                handle,
                self.x.0,
                self.w.0,
                self.conv.0,
                self.y.0,
                SLOTS as c_int,
                &mut count,
                perf.as_mut_ptr(),
            )
        };
        check(self.ordinal, "cudnnGetConvolutionForwardAlgorithm_v7", s)?;
        let mut out = Vec::new();
        for p in &perf[..(count.clamp(0, SLOTS as c_int) as usize)] {
            if p.status != sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
                continue;
            }
            let mut workspace = 0usize;
            // SAFETY: live handle and descriptors; cuDNN writes one size.
            let s = unsafe {
                sys::cudnnGetConvolutionForwardWorkspaceSize(
                    handle,
                    self.x.0,
                    self.w.0,
                    self.conv.0,
                    self.y.0,
                    p.algo,
                    &mut workspace,
                )
            };
            check(self.ordinal, "cudnnGetConvolutionForwardWorkspaceSize", s)?;
            out.push(Candidate {
                algorithm: p.algo as u32,
                workspace,
                deterministic: p.determinism == sys::cudnnDeterminism_t::CUDNN_DETERMINISTIC,
            });
        }
        Ok(out)
    }
}

/// cuDNN convolutions queued by this process.
static CONVOLUTIONS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many convolutions this process has queued on cuDNN.
pub(crate) fn convolutions() -> u64 {
    CONVOLUTIONS.load(std::sync::atomic::Ordering::Relaxed)
}

/// A forward convolution's operands.
pub(crate) struct Operands<'v, 'a> {
    pub(crate) x: &'v DataView<'a>,
    pub(crate) w: &'v DataView<'a>,
    pub(crate) bias: Option<&'v DataView<'a>>,
    pub(crate) y: &'v mut DataViewMut<'a>,
    pub(crate) workspace: Option<&'v mut CudaSlice<u8>>,
}

/// A view's device address for reading on `stream` (ordered after its last write), and the
/// guard that records the read when dropped.
fn read<'s>(v: &'s DataView<'_>, stream: &'s std::sync::Arc<CudaStream>) -> (u64, cudarc::driver::SyncOnDrop<'s>) {
    match v {
        DataView::F32(v) => v.device_ptr(stream),
        DataView::Bf16(v) => v.device_ptr(stream),
    }
}

/// The same for writing.
fn write<'s>(
    v: &'s mut DataViewMut<'_>,
    stream: &'s std::sync::Arc<CudaStream>,
) -> (u64, cudarc::driver::SyncOnDrop<'s>) {
    match v {
        DataViewMut::F32(v) => v.device_ptr_mut(stream),
        DataViewMut::Bf16(v) => v.device_ptr_mut(stream),
    }
}

/// Queues `y = conv(x, w) (+ bias)` with `algorithm` on the calling thread's stream for
/// `device`. The operands' types and lengths were checked against the problem by the caller
/// ([`super::conv_cudnn`]); the workspace is the candidate's.
pub(crate) fn forward(device: &CudaDevice, d: &Descriptors, algorithm: u32, ops: Operands<'_, '_>) -> Result<()> {
    let stream = device.stream();
    let handle = handle(device, &stream)?;
    let algo = algorithm_enum(algorithm).ok_or_else(|| TensorError::InvalidArgument {
        op: "conv3d (cuDNN)",
        reason: format!("no cuDNN forward algorithm {algorithm}"),
    })?;
    let (one, zero) = (1.0f32, 0.0f32);
    let Operands { x, w, bias, y, workspace } = ops;
    let (x, _x) = read(x, &stream);
    let (w, _w) = read(w, &stream);
    let (y, _y) = write(y, &stream);
    let bytes = workspace.as_ref().map_or(0, |w| w.len());
    let (space, _space) = workspace.map(|w| w.device_ptr_mut(&stream)).unzip();
    // SAFETY: live handle and descriptors of the operands' extents and type (the caller's
    // checks); the device addresses stay valid until the guards drop, after the call is queued;
    // alpha and beta are f32, as cuDNN reads them for f32 and bf16 data.
    let s = unsafe {
        sys::cudnnConvolutionForward(
            handle,
            (&one as *const f32).cast::<c_void>(),
            d.x.0,
            x as *const c_void,
            d.w.0,
            w as *const c_void,
            d.conv.0,
            algo,
            space.map_or(std::ptr::null_mut(), |p| p as *mut c_void),
            bytes,
            (&zero as *const f32).cast::<c_void>(),
            d.y.0,
            y as *mut c_void,
        )
    };
    check(d.ordinal, "cudnnConvolutionForward", s)?;
    CONVOLUTIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    if let Some(bias) = bias {
        let (b, _b) = read(bias, &stream);
        // SAFETY: as above; the bias is `[1, cout, 1, 1, 1]` of the output's type.
        let s = unsafe {
            sys::cudnnAddTensor(
                handle,
                (&one as *const f32).cast::<c_void>(),
                d.bias.0,
                b as *const c_void,
                (&one as *const f32).cast::<c_void>(),
                d.y.0,
                y as *mut c_void,
            )
        };
        check(d.ordinal, "cudnnAddTensor", s)?;
    }
    Ok(())
}

/// The handle of the calling thread for `device` (for [`Descriptors::candidates`]).
pub(crate) fn thread_handle(device: &CudaDevice) -> Result<sys::cudnnHandle_t> {
    handle(device, &device.stream())
}

fn algorithm_enum(algorithm: u32) -> Option<sys::cudnnConvolutionFwdAlgo_t> {
    use sys::cudnnConvolutionFwdAlgo_t::*;
    Some(match algorithm {
        0 => CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM,
        1 => CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM,
        2 => CUDNN_CONVOLUTION_FWD_ALGO_GEMM,
        3 => CUDNN_CONVOLUTION_FWD_ALGO_DIRECT,
        4 => CUDNN_CONVOLUTION_FWD_ALGO_FFT,
        5 => CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING,
        6 => CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD,
        7 => CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_strides_and_algorithm_numbers_follow_cudnn() {
        assert_eq!(packed([2, 3, 4, 5, 6]), Ok([360, 120, 30, 6, 1]));
        for a in 0..8 {
            assert_eq!(algorithm_enum(a).map(|e| e as u32), Some(a));
        }
        assert_eq!(algorithm_enum(8), None);
    }

    #[test]
    fn element_counts_past_cudnns_int_are_refused() {
        // 2^31 - 1 elements fit; 2^31 (every extent small) and a stride past it do not.
        assert_eq!(packed([1, 1, 1, 1, i32::MAX]), Ok([i32::MAX, i32::MAX, i32::MAX, i32::MAX, 1]));
        for dims in [[2, 4, 16, 4096, 4096], [1, 2, 1, 1 << 16, 1 << 15], [1 << 20, 1, 1, 1, 1 << 11]] {
            let err = packed(dims).unwrap_err();
            assert!(matches!(err, TensorError::InvalidArgument { .. }), "{dims:?}: {err}");
            assert!(err.to_string().contains("32-bit int"), "{err}");
        }
    }

    /// The fake cuDNN of `cargo xtask gpu-emu` (`kernels-cu/emu/fake_cudnn/`) refuses what the
    /// backend must never pass: a forward convolution through cuDNN's own entry points with an
    /// output of other extents, a workspace a byte short, an algorithm it did not offer, and an
    /// input whose strides are not the packed ones, each an error status (and a well-formed call
    /// of the same problem succeeds), so that its checks are known to bite. Against the fake only
    /// (NVIDIA's library accepts strided tensors and may run other algorithms): elsewhere it says
    /// it did not run.
    #[test]
    #[allow(clippy::print_stderr)] // a test that does not run says why
    fn the_fake_cudnn_refuses_descriptors_the_backend_must_never_pass() {
        let required = std::env::var("VAE_CUDNN_REQUIRED").is_ok_and(|v| v == "1");
        let fake = std::env::var_os("FAKE_CUDA_COMPUTE_CAPABILITY").is_some();
        if let Err(why) = library() {
            assert!(!required, "VAE_CUDNN_REQUIRED=1, but cuDNN does not load: {why}");
            eprintln!("the fake cuDNN's refusals: not run, {why}");
            return;
        }
        if !fake {
            eprintln!("the fake cuDNN's refusals: not run, cuDNN here is not the fake of `cargo xtask gpu-emu`");
            return;
        }
        let device = CudaDevice::get(0).unwrap();
        let p = Problem {
            x: [1, 4, 1, 6, 6],
            w: [8, 4, 1, 3, 3],
            pads: [0, 1, 1],
            strides: [1, 1, 1],
            y: [1, 8, 1, 6, 6],
            dtype: DType::F32,
            tf32: false,
        };
        let d = Descriptors::new(0, &p).unwrap();
        let h = thread_handle(&device).unwrap();
        let precomp = d.candidates(h).unwrap().into_iter().find(|c| c.algorithm == 1).expect("the fake offers 1");
        assert!(precomp.workspace > 0, "{precomp:?}");
        let count = |dims: [c_int; 5]| dims.iter().product::<c_int>() as usize;
        let x = device.alloc_zeros::<f32>(count(p.x) * 2).unwrap();
        let w = device.alloc_zeros::<f32>(count(p.w)).unwrap();
        let mut y = device.alloc_zeros::<f32>(count(p.y)).unwrap();
        let mut space = device.alloc_zeros::<u8>(precomp.workspace).unwrap();
        let stream = device.stream();
        let forward = |xd: sys::cudnnTensorDescriptor_t,
                       yd: sys::cudnnTensorDescriptor_t,
                       algorithm: u32,
                       bytes: usize,
                       y: &mut CudaSlice<f32>,
                       space: &mut CudaSlice<u8>| {
            let (one, zero) = (1.0f32, 0.0f32);
            let (xp, _x) = x.device_ptr(&stream);
            let (wp, _w) = w.device_ptr(&stream);
            let (yp, _y) = y.device_ptr_mut(&stream);
            let (sp, _s) = space.device_ptr_mut(&stream);
            // SAFETY: live handle and descriptors; device buffers at least as large as the
            // problem's operands (x twice over, for the strided case) and the workspace
            // `bytes` at most, valid until the guards drop after the call.
            unsafe {
                sys::cudnnConvolutionForward(
                    h,
                    (&one as *const f32).cast::<c_void>(),
                    xd,
                    xp as *const c_void,
                    d.w.0,
                    wp as *const c_void,
                    d.conv.0,
                    algorithm_enum(algorithm).unwrap(),
                    sp as *mut c_void,
                    bytes,
                    (&zero as *const f32).cast::<c_void>(),
                    yd,
                    yp as *mut c_void,
                )
            }
        };
        let ok = sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS;
        let all = precomp.workspace;
        // The well-formed call runs: the refusals below are the fake's checks, not a broken call.
        assert_eq!(forward(d.x.0, d.y.0, 1, all, &mut y, &mut space), ok);
        // A workspace a byte short of what the fake reported for the algorithm.
        assert_ne!(forward(d.x.0, d.y.0, 1, all - 1, &mut y, &mut space), ok, "a short workspace");
        // Winograd: not among the algorithms the fake offers.
        assert_ne!(forward(d.x.0, d.y.0, 6, all, &mut y, &mut space), ok, "an algorithm not offered");
        // An output of other extents than the convolution gives.
        let small = TensorDesc::new(0).unwrap();
        let dims: [c_int; 5] = [1, 8, 1, 5, 5];
        let strides = packed(dims).unwrap();
        // SAFETY: a live descriptor; 5 dimensions and 5 strides.
        let s = unsafe {
            sys::cudnnSetTensorNdDescriptor(small.0, data_type(DType::F32), 5, dims.as_ptr(), strides.as_ptr())
        };
        assert_eq!(s, ok);
        assert_ne!(forward(d.x.0, small.0, 1, all, &mut y, &mut space), ok, "wrong output extents");
        // An input whose rows are 12 elements apart (a view of a wider tensor), not packed: refused
        // when described or when used.
        let strided = TensorDesc::new(0).unwrap();
        let strides: [c_int; 5] = [288, 72, 72, 12, 1];
        // SAFETY: as above.
        let s = unsafe {
            sys::cudnnSetTensorNdDescriptor(strided.0, data_type(DType::F32), 5, p.x.as_ptr(), strides.as_ptr())
        };
        let refused = s != ok || forward(strided.0, d.y.0, 1, all, &mut y, &mut space) != ok;
        assert!(refused, "a non-packed input");
    }

    #[test]
    fn a_missing_library_is_a_reason_not_a_panic() {
        // Whatever this machine has: loading never panics, and a failure says what to set.
        if let Err(why) = library() {
            assert!(why.contains("cuDNN") || why.contains(CUDNN_PATH_ENV), "{why}");
        }
        assert!(preload(Path::new("/nonexistent/dir/libcudnn.so.9")).is_err());
    }
}
