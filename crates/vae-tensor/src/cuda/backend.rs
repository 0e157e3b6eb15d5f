//! CUDA tensor storage and the ops that run on it, through the embedded `kernels-cu/` modules.
//!
//! One [`CudaDevice`] per ordinal and process (context, default stream, the loaded modules),
//! created on first use. Work goes to the device's default stream, or to the calling thread's own
//! stream while it holds an [`OwnStream`] for the device (several ranks on one GPU, one stream
//! each; see `crate::StreamScope`). Storage is f32 or bf16 ([`CudaData`]); every op with a bf16 variant picks the
//! kernel by the storage type, computes in f32 and rounds once, as PyTorch's bf16 kernels do.
//! Per-channel parameters (biases, norm scales) stay f32 in both: a bf16 model keeps them as the
//! f32 values of its bf16 parameters. Every op checks its arguments on the host exactly as the
//! CPU op does (the CPU op's validation runs first; see the `Tensor` methods) and then launches
//! kernels on the device's stream; results come back to the host only when asked
//! (`to_device(Cpu)`, `to_vec_f32`; bf16 widens exactly to f32 on the way).

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut,
    DeviceRepr, LaunchArgs, LaunchConfig, PushKernelArg, ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;

use super::abi::{Box8, ChannelsLast, ConvGeom};
use super::{ConvKernels, WGMMA_ENV, embedded_modules, embedded_sm90a_modules};
use crate::memory::DeviceCharge;
use crate::{DType, Device, Result, TensorError};

/// A device's context, default stream and kernels.
pub(crate) struct CudaDevice {
    ordinal: usize,
    /// Streaming multiprocessors: the memory-bound kernels launch a few waves of blocks per SM,
    /// the tensor-core conv picks its tile height to fill them.
    sms: usize,
    /// Where work goes unless the calling thread has a stream of its own ([`OwnStream`]).
    default_stream: Arc<CudaStream>,
    modules: Vec<(&'static str, Arc<CudaModule>)>,
    /// Whether the Hopper-only kernels (`*_sm90a.cu`: `wgmma`) are loaded: compute capability 9.0
    /// and a build that embeds them.
    wgmma: bool,
    functions: Mutex<HashMap<&'static str, CudaFunction>>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaDevice(cuda:{})", self.ordinal)
    }
}

fn unavailable(ordinal: usize, reason: impl Into<String>) -> TensorError {
    TensorError::DeviceUnavailable { device: Device::Cuda(ordinal), reason: reason.into() }
}

fn driver(ordinal: usize, op: &'static str, e: impl std::fmt::Display) -> TensorError {
    TensorError::InvalidArgument { op, reason: format!("CUDA driver error on cuda:{ordinal}: {e}") }
}

impl CudaDevice {
    /// The process's device `ordinal`, opened (and its kernels loaded) on first use.
    pub(crate) fn get(ordinal: usize) -> Result<Arc<Self>> {
        static DEVICES: OnceLock<Mutex<HashMap<usize, Arc<CudaDevice>>>> = OnceLock::new();
        let mut devices = DEVICES.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
        if let Some(d) = devices.get(&ordinal) {
            return Ok(Arc::clone(d));
        }
        let info = super::probe(ordinal).map_err(|reason| unavailable(ordinal, reason))?;
        if embedded_modules().is_empty() {
            return Err(unavailable(
                ordinal,
                "this build embeds no CUDA kernels (run `cargo xtask kernels`, then build)",
            ));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| unavailable(ordinal, e.to_string()))?;
        // The SASS where it matches the device; PTX, compiled by the driver, elsewhere.
        let sm90 = info.compute_capability == (9, 0);
        let mut modules = Vec::new();
        for m in embedded_modules() {
            let image = if sm90 {
                Ptx::from_binary(m.cubin_sm_90.to_vec())
            } else if info.compute_capability.0 >= 9 {
                Ptx::from_src(m.ptx_compute_90)
            } else {
                Ptx::from_src(m.ptx_compute_80)
            };
            let module =
                ctx.load_module(image).map_err(|e| unavailable(ordinal, format!("loading {}: {e}", m.name)))?;
            modules.push((m.name, module));
        }
        // sm_90a code runs on compute capability 9.0 exactly (not on later GPUs).
        let mut wgmma = false;
        if sm90 {
            for m in embedded_sm90a_modules() {
                let module = ctx
                    .load_module(Ptx::from_binary(m.cubin_sm_90a.to_vec()))
                    .map_err(|e| unavailable(ordinal, format!("loading {}: {e}", m.name)))?;
                modules.push((m.name, module));
                wgmma |= m.name == WGMMA_MODULE;
            }
        }
        let device = Arc::new(Self {
            ordinal,
            sms: (info.multiprocessors as usize).max(1),
            default_stream: ctx.default_stream(),
            modules,
            wgmma,
            functions: Mutex::default(),
        });
        devices.insert(ordinal, Arc::clone(&device));
        Ok(device)
    }

    /// Whether the warpgroup-MMA kernels are loaded.
    pub(crate) fn has_wgmma(&self) -> bool {
        self.wgmma
    }

    fn function(&self, module: &str, name: &'static str) -> Result<CudaFunction> {
        self.function_with_dynamic_shared(module, name, 0)
    }

    /// The tensor-core convolution kernel of `tile`, allowed its dynamic shared memory.
    fn tensor_core_function(&self, tile: TensorCoreTile) -> Result<CudaFunction> {
        self.function_with_dynamic_shared("conv", tile.name, tile.dynamic_shared_bytes())
    }

    /// The warpgroup-MMA convolution kernel of `tile`, allowed its dynamic shared memory.
    fn wgmma_function(&self, tile: WgmmaTile) -> Result<CudaFunction> {
        self.function_with_dynamic_shared(WGMMA_MODULE, tile.name, tile.dynamic_shared_bytes())
    }

    /// Kernel `name` of `module`, loaded once; where its launches give more than 48 KiB of
    /// dynamic shared memory (`dynamic_shared` bytes), the kernel is allowed that much when it
    /// loads (the driver refuses such launches otherwise).
    fn function_with_dynamic_shared(
        &self,
        module: &str,
        name: &'static str,
        dynamic_shared: u32,
    ) -> Result<CudaFunction> {
        let mut cache = self.functions.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = cache.get(name) {
            return Ok(f.clone());
        }
        let m = self
            .modules
            .iter()
            .find(|(n, _)| *n == module)
            .map(|(_, m)| m)
            .ok_or_else(|| unavailable(self.ordinal, format!("no kernel module {module}")))?;
        let f = m.load_function(name).map_err(|e| driver(self.ordinal, name, e))?;
        if dynamic_shared > 48 << 10 {
            f.set_attribute(
                cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                dynamic_shared as i32,
            )
            .map_err(|e| driver(self.ordinal, name, e))?;
        }
        cache.insert(name, f.clone());
        Ok(f)
    }

    /// Waits for everything queued on the device, on every stream.
    pub(crate) fn synchronize(&self) -> Result<()> {
        self.default_stream.context().synchronize().map_err(|e| driver(self.ordinal, "synchronize", e))
    }

    /// The stream the calling thread's work on this device goes to: the innermost of its
    /// [`OwnStream`]s for the device, else the default stream.
    fn stream(&self) -> Arc<CudaStream> {
        OWN_STREAMS
            .with_borrow(|own| own.iter().rev().find(|(o, _)| *o == self.ordinal).map(|(_, s)| Arc::clone(s)))
            .unwrap_or_else(|| Arc::clone(&self.default_stream))
    }

    /// Gives the calling thread a new stream on this device until the returned guard drops.
    pub(crate) fn own_stream(self: &Arc<Self>) -> Result<OwnStream> {
        // The first extra stream puts cudarc's context into multi-stream mode: from then on every
        // buffer records which stream last wrote and read it, and a launch on another stream
        // waits for those events. That is what orders a tensor one rank wrote and another reads
        // (a halo handed over device to device, a tile gathered to the owner, the weights).
        let stream = self.default_stream.context().new_stream().map_err(|e| driver(self.ordinal, "stream", e))?;
        // It starts after what the default stream holds so far. Buffers written there before
        // the context had a second stream recorded no events, and cudarc synchronizes the context
        // only for the first extra stream: a second thread's stream, created just then, would not
        // wait for them.
        stream.join(&self.default_stream).map_err(|e| driver(self.ordinal, "stream", e))?;
        OWN_STREAMS.with_borrow_mut(|own| own.push((self.ordinal, Arc::clone(&stream))));
        tracing::debug!(device = self.ordinal, "this thread's CUDA work goes to a stream of its own");
        Ok(OwnStream { device: Arc::clone(self), stream })
    }

    fn alloc_zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>> {
        self.stream().alloc_zeros::<T>(n.max(1)).map_err(|e| driver(self.ordinal, "alloc", e))
    }

    fn alloc(&self, n: usize, dtype: DType) -> Result<CudaData> {
        match dtype {
            DType::F32 => Ok(CudaData::F32(self.alloc_zeros(n)?)),
            DType::BF16 => Ok(CudaData::Bf16(self.alloc_zeros(n)?)),
            DType::F16 => Err(TensorError::UnsupportedDType { op: "alloc", dtype, device: Device::Cuda(self.ordinal) }),
        }
    }

    /// `n` elements of `dtype`, not cleared: only for an output that the next kernel on the
    /// stream writes in full (clearing it first would cost a whole extra pass over memory).
    fn alloc_for_kernel(&self, n: usize, dtype: DType) -> Result<CudaData> {
        let err = |e| driver(self.ordinal, "alloc", e);
        // SAFETY: the memory is only read after the kernel queued next on this stream has written
        // every element (the callers' contract); stream order makes that write happen first.
        match dtype {
            DType::F32 => Ok(CudaData::F32(unsafe { self.stream().alloc::<f32>(n.max(1)) }.map_err(err)?)),
            DType::BF16 => Ok(CudaData::Bf16(unsafe { self.stream().alloc::<u16>(n.max(1)) }.map_err(err)?)),
            DType::F16 => Err(TensorError::UnsupportedDType { op: "alloc", dtype, device: Device::Cuda(self.ordinal) }),
        }
    }

    /// A grid-stride launch of blocks of 256 threads over `units` work items (packs of 16 bytes,
    /// rows, ...): one thread per item up to a few waves of blocks per SM (8 blocks of 256 fill
    /// an SM), then each thread takes several. The memory-bound kernels keep the device busy
    /// without a block per item (the old launch made up to 2^20 blocks of 256 scalar elements).
    fn streaming(&self, units: usize) -> LaunchConfig {
        let blocks = units.div_ceil(256).clamp(1, self.sms * 8 * 4) as u32;
        LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
    }
}

thread_local! {
    /// The streams of the calling thread's live [`OwnStream`]s, by ordinal, innermost last.
    static OWN_STREAMS: RefCell<Vec<(usize, Arc<CudaStream>)>> = const { RefCell::new(Vec::new()) };
}

/// A thread's own stream on one device, in use while this lives (see [`CudaDevice::own_stream`]).
/// Not `Send`: it belongs to the thread that opened it.
pub(crate) struct OwnStream {
    device: Arc<CudaDevice>,
    stream: Arc<CudaStream>,
}

impl Drop for OwnStream {
    /// Hands the device back to the default stream, ordered after everything queued on this one:
    /// the default stream waits for it (on the device; the host does not block), so work the
    /// thread queues next, and [`CudaDevice::synchronize`], see this stream's results.
    fn drop(&mut self) {
        OWN_STREAMS.with_borrow_mut(|own| {
            if let Some(i) = own.iter().rposition(|(_, s)| Arc::ptr_eq(s, &self.stream)) {
                own.remove(i);
            }
        });
        if let Err(e) = self.device.default_stream.join(&self.stream) {
            // Buffers still order themselves by their events; only a later synchronize could
            // return early. A driver that fails here has failed the work queued before it too.
            tracing::warn!(device = self.device.ordinal, "ordering the default stream after a rank's stream: {e}");
        }
    }
}

/// Elements per 16-byte access of the vectorised elementwise kernels (`map_unary` /
/// `map_binary` in elementwise.cu), by storage type.
fn per_pack(dtype: DType) -> usize {
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

// A storage of either type is one device pointer to the kernels (which are instantiated per
// type), so it is pushed as whichever slice it holds.
unsafe impl<'a, 'b: 'a> PushKernelArg<&'b CudaData> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b CudaData) -> &mut Self {
        match arg {
            CudaData::F32(s) => self.arg(s),
            CudaData::Bf16(s) => self.arg(s),
        }
    }
}

unsafe impl<'a, 'b: 'a> PushKernelArg<&'b mut CudaData> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut CudaData) -> &mut Self {
        match arg {
            CudaData::F32(s) => self.arg(s),
            CudaData::Bf16(s) => self.arg(s),
        }
    }
}

/// A storage from an element on, as a kernel argument (a batch's operand inside a batched
/// tensor).
enum DataView<'a> {
    F32(CudaView<'a, f32>),
    Bf16(CudaView<'a, u16>),
}

enum DataViewMut<'a> {
    F32(CudaViewMut<'a, f32>),
    Bf16(CudaViewMut<'a, u16>),
}

impl CudaData {
    fn view(&self, from: usize) -> DataView<'_> {
        match self {
            CudaData::F32(s) => DataView::F32(s.slice(from..)),
            CudaData::Bf16(s) => DataView::Bf16(s.slice(from..)),
        }
    }

    fn view_mut(&mut self, from: usize) -> DataViewMut<'_> {
        match self {
            CudaData::F32(s) => DataViewMut::F32(s.slice_mut(from..)),
            CudaData::Bf16(s) => DataViewMut::Bf16(s.slice_mut(from..)),
        }
    }
}

unsafe impl<'a, 'b: 'a, 'c: 'b> PushKernelArg<&'b DataView<'c>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b DataView<'c>) -> &mut Self {
        match arg {
            DataView::F32(v) => self.arg(v),
            DataView::Bf16(v) => self.arg(v),
        }
    }
}

unsafe impl<'a, 'b: 'a, 'c: 'b> PushKernelArg<&'b mut DataViewMut<'c>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut DataViewMut<'c>) -> &mut Self {
        match arg {
            DataViewMut::F32(v) => self.arg(v),
            DataViewMut::Bf16(v) => self.arg(v),
        }
    }
}

/// Elements on a CUDA device, charged to the allocating thread's device-memory account
/// ([`crate::memory::device_peak_bytes`]) while they live.
pub(crate) struct CudaStorage {
    pub(crate) data: CudaData,
    pub(crate) device: Arc<CudaDevice>,
    len: usize,
    _charge: DeviceCharge,
}

impl Clone for CudaStorage {
    /// A device copy: a new allocation, charged to the thread that makes it.
    fn clone(&self) -> Self {
        Self::new(self.data.clone(), Arc::clone(&self.device), self.len)
    }
}

impl std::fmt::Debug for CudaStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaStorage(cuda:{}, {} {})", self.device.ordinal, self.len, self.dtype())
    }
}

/// The same box copy with fewer dimensions (`copy_box` in layout.cu walks rows of the last one):
/// dimensions of extent 1 dropped, and each dimension merged into the next where both source and
/// destination step over it as over one longer row. At least one dimension remains. `extent`
/// holds no zero (the caller returns first).
fn merged_box(extent: &[usize], src: &[usize], dst: &[usize]) -> (Vec<usize>, Vec<usize>, Vec<usize>) {
    if src.len() != extent.len() || dst.len() != extent.len() {
        return (extent.to_vec(), src.to_vec(), dst.to_vec()); // refused by `Box8::new`
    }
    let (mut e, mut s, mut d): (Vec<usize>, Vec<usize>, Vec<usize>) = (Vec::new(), Vec::new(), Vec::new());
    for k in 0..extent.len() {
        if extent[k] == 1 {
            continue;
        }
        match e.len().checked_sub(1) {
            Some(j) if s[j] == src[k] * extent[k] && d[j] == dst[k] * extent[k] => {
                e[j] *= extent[k];
                s[j] = src[k];
                d[j] = dst[k];
            }
            _ => {
                e.push(extent[k]);
                s.push(src[k]);
                d.push(dst[k]);
            }
        }
    }
    if e.is_empty() { (vec![1], vec![0], vec![0]) } else { (e, s, d) }
}

/// `COPY_SEGMENT` of layout.cu: the longest piece of a row one group of 32 lanes copies.
const COPY_SEGMENT: usize = 2048;

/// `SMALL_COUT_SMEM` of conv.cu: the bytes of weights (4 output channels' worth) the small-Cout
/// convolution stages in shared memory.
const SMALL_COUT_SMEM: u64 = 45056;

/// A null device pointer, for optional kernel arguments.
const NULL: u64 = 0;

/// How the tensor-core conv multiplies: bf16 products, f32 products as three TF32 products (f32
/// accuracy), or one TF32 product each (TF32 mode, see [`Tf32Guard`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TensorCoreMath {
    Bf16,
    F32,
    Tf32,
}

impl TensorCoreMath {
    /// The storage type of the operands.
    fn dtype(self) -> DType {
        match self {
            Self::Bf16 => DType::BF16,
            Self::F32 | Self::Tf32 => DType::F32,
        }
    }

    /// A convolution's products for operands of `dtype` on the calling thread.
    fn for_conv(dtype: DType) -> Self {
        match dtype {
            DType::BF16 => Self::Bf16,
            _ if TF32_CONVOLUTIONS.get() => Self::Tf32,
            _ => Self::F32,
        }
    }
}

thread_local! {
    /// Whether this thread's f32 convolutions take one TF32 product per product.
    static TF32_CONVOLUTIONS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// TF32 mode for the calling thread's f32 convolutions while this lives (see `crate::Tf32Scope`).
pub(crate) struct Tf32Guard {
    previous: bool,
}

impl Tf32Guard {
    pub(crate) fn enter() -> Self {
        Self { previous: TF32_CONVOLUTIONS.replace(true) }
    }
}

impl Drop for Tf32Guard {
    fn drop(&mut self) {
        TF32_CONVOLUTIONS.set(self.previous);
    }
}

thread_local! {
    /// The kernels this thread's tensor-core convolutions must take (see [`ConvTilesGuard`]).
    static CONV_KERNELS: std::cell::Cell<Option<ConvKernels>> = const { std::cell::Cell::new(None) };
}

/// Restricts the calling thread's tensor-core convolutions to `kernels` while this lives
/// (`crate::cuda::ConvTilesScope`).
pub(crate) struct ConvTilesGuard {
    previous: Option<ConvKernels>,
}

impl ConvTilesGuard {
    pub(crate) fn enter(kernels: Option<ConvKernels>) -> Self {
        Self { previous: CONV_KERNELS.replace(kernels) }
    }
}

impl Drop for ConvTilesGuard {
    fn drop(&mut self) {
        CONV_KERNELS.set(self.previous);
    }
}

/// The module of the warpgroup-MMA convolutions (`kernels-cu/conv_sm90a.cu`).
const WGMMA_MODULE: &str = "conv_sm90a";

/// Whether this thread's bf16 convolutions take the warpgroup-MMA kernels where a device has them:
/// as a [`ConvTilesGuard`] says, else as [`WGMMA_ENV`] says (read once per process).
fn wgmma_wanted() -> bool {
    static DEFAULT: OnceLock<bool> = OnceLock::new();
    match CONV_KERNELS.get() {
        Some(kernels) => kernels == ConvKernels::Wgmma,
        None => *DEFAULT.get_or_init(|| wgmma_env_says(std::env::var(WGMMA_ENV).ok().as_deref())),
    }
}

/// What a value of [`WGMMA_ENV`] asks for: `1`, `true`, `yes` or `on` (any case) turn the
/// warpgroup-MMA kernels on; unset, empty, `0`, `false`, `no` and `off` leave them off; anything
/// else leaves them off with a warning, rather than being read as either.
fn wgmma_env_says(value: Option<&str>) -> bool {
    let Some(value) = value.map(str::trim) else { return false };
    match value.to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => true,
        "" | "0" | "false" | "no" | "off" => false,
        _ => {
            tracing::warn!("{WGMMA_ENV}={value:?} is not 1/true/yes/on or 0/false/no/off: the wgmma kernels stay off");
            false
        }
    }
}

/// Whether the warpgroup-MMA kernels take convolutions of `dtype`: bf16 only (TF32 `wgmma` reads
/// f32 operands unrounded, and the 3xTF32 split needs register operands).
pub(crate) fn wgmma_takes(dtype: DType) -> bool {
    dtype == DType::BF16
}

/// A warpgroup-MMA convolution kernel (conv_sm90a.cu's `conv3d_wgmma_bf16_n<N>`): tiles of 128
/// output pixels by `channels` output channels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WgmmaTile {
    pub(crate) channels: u64,
    pub(crate) name: &'static str,
}

impl WgmmaTile {
    /// conv_sm90a.cu's `WGMMA_SMEM(N)`: its stages (5 of 192 and 256 channels, 6 of fewer) of
    /// `channels + 128` rows of 64 bytes, and 512 bytes to align them.
    pub(crate) fn dynamic_shared_bytes(&self) -> u32 {
        let stages = if self.channels >= 192 { 5 } else { 6 };
        (stages * (self.channels + 128) * 64 + 512) as u32
    }

    fn grid(&self, cols: u64, cout: u64) -> (u32, u32, u32) {
        (cols.div_ceil(128) as u32, cout.div_ceil(self.channels) as u32, 1)
    }
}

/// The warpgroup-MMA kernel for `cout` output channels: the tile width (96, 128, 192 or 256
/// channels) that pads `cout` least, the widest of those. It depends on `cout` alone, never on the
/// grid, so that every rank of a sharded or tiled decode runs a given convolution on the same
/// kernel as one device would.
fn wgmma_tile(cout: u64) -> WgmmaTile {
    const TILES: [WgmmaTile; 4] = [
        WgmmaTile { channels: 256, name: "conv3d_wgmma_bf16_n256" },
        WgmmaTile { channels: 192, name: "conv3d_wgmma_bf16_n192" },
        WgmmaTile { channels: 128, name: "conv3d_wgmma_bf16_n128" },
        WgmmaTile { channels: 96, name: "conv3d_wgmma_bf16_n96" },
    ];
    *TILES.iter().min_by_key(|t| cout.div_ceil(t.channels) * t.channels).expect("tiles")
}

/// A tensor-core convolution kernel (conv.cu's `conv3d_tc_*`): tiles of `rows` output channels
/// by `pixels` output pixels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TensorCoreTile {
    pub(crate) rows: u64,
    pub(crate) pixels: u64,
    pub(crate) name: &'static str,
}

impl TensorCoreTile {
    const fn new(rows: u64, pixels: u64, name: &'static str) -> Self {
        Self { rows, pixels, name }
    }

    /// The dynamic shared memory its launch gives: conv.cu's `TC_WIDE_SMEM(MT)` for tiles of 256
    /// pixels (four stages of `rows + 256` rows of 64 bytes); tiles of 128 pixels use static
    /// shared memory.
    pub(crate) fn dynamic_shared_bytes(&self) -> u32 {
        if self.pixels == 256 { (4 * (self.rows + 256) * 64) as u32 } else { 0 }
    }

    /// The launch grid over `cols` output pixels and `cout` output channels.
    fn grid(&self, cols: u64, cout: u64) -> (u32, u32, u32) {
        (cols.div_ceil(self.pixels) as u32, cout.div_ceil(self.rows) as u32, 1)
    }
}

/// How much faster a tile of 256 pixels multiplies than two of 128 (one block per
/// multiprocessor against two): half the operand bytes per product from L2 and from shared
/// memory. An estimate, as a ratio 5/4, until `bench kernels` (which times both shapes side by
/// side on the GPU) measures it; both shapes give bit-identical results.
const WIDE_TILE_SPEEDUP: (u64, u64) = (5, 4);

/// The tensor-core conv's kernel for `cout` output channels and `cols` output pixels on `sms`
/// multiprocessors. Heights are 128 (not with 3xTF32: its operand split leaves no registers
/// for it), 96 and 64 output channels; widths 128 pixels (two blocks per multiprocessor) and
/// 256 (one, [`WIDE_TILE_SPEEDUP`] faster per product). The choice is the one whose busiest
/// multiprocessor has the least to do, `ceil(blocks / sms) * (rows + 32) * pixels / speed`. A
/// block's cost is its rows plus a fixed part for the pixel tile every block loads whatever its
/// height (worth about 32 rows: it is why taller tiles multiply more per byte loaded). That
/// leaves no idle rows where a height divides `cout` (Wan's 96 and 192 channels take 96) and,
/// on small grids (a 60x104 frame at 384 channels is 49 tiles of 128 pixels), prefers more,
/// smaller tiles to a second, nearly empty wave. Ties go to the taller, then the wider tile. A
/// [`ConvTilesGuard`] on the calling thread restricts the widths.
fn tensor_core_tile(math: TensorCoreMath, cout: u64, cols: u64, sms: u64) -> TensorCoreTile {
    const T: fn(u64, u64, &'static str) -> TensorCoreTile = TensorCoreTile::new;
    let tiles: &[TensorCoreTile] = match math {
        TensorCoreMath::Bf16 => &[
            T(128, 128, "conv3d_tc_bf16_m4"),
            T(96, 128, "conv3d_tc_bf16_m3"),
            T(64, 128, "conv3d_tc_bf16_m2"),
            T(128, 256, "conv3d_tc_bf16_m4_n256"),
            T(96, 256, "conv3d_tc_bf16_m3_n256"),
            T(64, 256, "conv3d_tc_bf16_m2_n256"),
        ],
        TensorCoreMath::F32 => &[
            T(96, 128, "conv3d_tc_f32_m3"),
            T(64, 128, "conv3d_tc_f32_m2"),
            T(96, 256, "conv3d_tc_f32_m3_n256"),
            T(64, 256, "conv3d_tc_f32_m2_n256"),
        ],
        TensorCoreMath::Tf32 => &[
            T(128, 128, "conv3d_tc_tf32_m4"),
            T(96, 128, "conv3d_tc_tf32_m3"),
            T(64, 128, "conv3d_tc_tf32_m2"),
            T(128, 256, "conv3d_tc_tf32_m4_n256"),
            T(96, 256, "conv3d_tc_tf32_m3_n256"),
            T(64, 256, "conv3d_tc_tf32_m2_n256"),
        ],
    };
    let only = CONV_KERNELS.get().and_then(ConvKernels::mma_pixels);
    let (fast, slow) = WIDE_TILE_SPEEDUP;
    tiles
        .iter()
        .copied()
        .filter(|t| only.is_none_or(|p| p == t.pixels))
        .min_by_key(|t| {
            let blocks = cols.div_ceil(t.pixels) * cout.div_ceil(t.rows);
            let speed = if t.pixels == 256 { fast } else { slow };
            let cost = blocks.div_ceil(sms) * (t.rows + 32) * t.pixels * (fast * slow / speed);
            (cost, u64::MAX - t.rows, u64::MAX - t.pixels)
        })
        .expect("tile shapes")
}

/// The kernel of a convolution's product (after the channels-last copies).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ConvKernel {
    /// The tensor-core implicit GEMM on `mma.sync`.
    TensorCores(TensorCoreTile),
    /// The same on Hopper's warpgroup MMA (bf16).
    Wgmma(WgmmaTile),
    /// At most 4 output channels on CUDA cores (`conv3d_small_cout_*_c4`).
    SmallCout,
}

/// The kernel for `cout` output channels whose weights are `taps * cp` elements of `elem_bytes`
/// each per channel, over `cols` output pixels, on a device of `sms` multiprocessors that has the
/// warpgroup-MMA kernels or not (`wgmma`): at most 4 output channels (the RGB heads) on CUDA
/// cores when 4 channels' weights fit the kernel's shared memory (a tensor-core tile would
/// multiply 60 and more rows of zeros); bf16 with at least 96 output channels on the
/// warpgroup-MMA tile of [`wgmma_tile`] where the device has it and the thread wants it
/// ([`wgmma_wanted`]); else the `mma.sync` tile of [`tensor_core_tile`].
fn conv_kernel(
    math: TensorCoreMath,
    cout: u64,
    weights_per_channel: u64,
    elem_bytes: u64,
    cols: u64,
    sms: u64,
    wgmma: bool,
) -> ConvKernel {
    if cout <= 4 && 4 * weights_per_channel * elem_bytes <= SMALL_COUT_SMEM {
        return ConvKernel::SmallCout;
    }
    if wgmma && wgmma_takes(math.dtype()) && cout >= 96 && wgmma_wanted() {
        return ConvKernel::Wgmma(wgmma_tile(cout));
    }
    ConvKernel::TensorCores(tensor_core_tile(math, cout, cols, sms))
}

/// A 1-D grid-stride launch over `n` elements.
fn elementwise(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 1 << 20) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

impl CudaStorage {
    /// The one constructor: every allocation is charged here.
    fn new(data: CudaData, device: Arc<CudaDevice>, len: usize) -> Self {
        let bytes = len * if matches!(data, CudaData::F32(_)) { 4 } else { 2 };
        Self { data, device, len, _charge: DeviceCharge::new(bytes) }
    }

    /// Zeros of `dtype` on device `ordinal`.
    pub(crate) fn zeros(ordinal: usize, len: usize, dtype: DType) -> Result<Self> {
        let device = CudaDevice::get(ordinal)?;
        Ok(Self::new(device.alloc(len, dtype)?, device, len))
    }

    /// A copy of host data on device `ordinal`, as f32.
    pub(crate) fn upload(ordinal: usize, host: &[f32]) -> Result<Self> {
        let device = CudaDevice::get(ordinal)?;
        if host.is_empty() {
            return Self::zeros(ordinal, 0, DType::F32);
        }
        let data = device.stream().clone_htod(host).map_err(|e| driver(ordinal, "upload", e))?;
        Ok(Self::new(CudaData::F32(data), device, host.len()))
    }

    /// The elements, copied to the host as f32 (bf16 widens exactly).
    pub(crate) fn download(&self) -> Result<Vec<f32>> {
        let err = |e| driver(self.device.ordinal, "download", e);
        let mut v = match &self.data {
            CudaData::F32(d) => self.device.stream().clone_dtoh(d).map_err(err)?,
            CudaData::Bf16(d) => {
                let bits = self.device.stream().clone_dtoh(d).map_err(err)?;
                bits.into_iter().map(|b| f32::from_bits(u32::from(b) << 16)).collect()
            }
        };
        v.truncate(self.len);
        Ok(v)
    }

    pub(crate) fn ordinal(&self) -> usize {
        self.device.ordinal
    }

    /// The device address of the elements, once every write queued before (on any stream) has
    /// finished. See [`crate::Tensor::device_memory`].
    pub(crate) fn settled_address(&self) -> Result<u64> {
        let stream = self.device.stream();
        // The pointer call makes `stream` wait for the buffer's last writer on another stream;
        // synchronising the stream then waits for all of it.
        let address = match &self.data {
            CudaData::F32(d) => d.device_ptr(&stream).0,
            CudaData::Bf16(d) => d.device_ptr(&stream).0,
        };
        stream.synchronize().map_err(|e| driver(self.device.ordinal, "synchronize", e))?;
        Ok(address)
    }

    /// As [`Self::settled_address`], for memory something else is about to write: once every
    /// read and write queued before has finished.
    pub(crate) fn settled_address_mut(&mut self) -> Result<u64> {
        let stream = self.device.stream();
        let address = match &mut self.data {
            CudaData::F32(d) => d.device_ptr_mut(&stream).0,
            CudaData::Bf16(d) => d.device_ptr_mut(&stream).0,
        };
        stream.synchronize().map_err(|e| driver(self.device.ordinal, "synchronize", e))?;
        Ok(address)
    }

    /// The storage type.
    pub(crate) fn dtype(&self) -> DType {
        match self.data {
            CudaData::F32(_) => DType::F32,
            CudaData::Bf16(_) => DType::BF16,
        }
    }

    /// `len` zeros of the same type on the same device.
    fn like(&self, len: usize) -> Result<Self> {
        self.like_typed(len, self.dtype())
    }

    fn like_typed(&self, len: usize, dtype: DType) -> Result<Self> {
        Ok(Self::new(self.device.alloc(len, dtype)?, Arc::clone(&self.device), len))
    }

    /// `len` uncleared elements of `dtype` on the same device, for an output that the kernel
    /// launched next writes in full (see [`CudaDevice::alloc_for_kernel`]).
    fn output_typed(&self, len: usize, dtype: DType) -> Result<Self> {
        Ok(Self::new(self.device.alloc_for_kernel(len, dtype)?, Arc::clone(&self.device), len))
    }

    fn output(&self, len: usize) -> Result<Self> {
        self.output_typed(len, self.dtype())
    }

    /// An uncleared tensor of `len` elements of this type on the same device, for a caller that
    /// writes every element (a permute's box copy over the whole output) before reading any.
    pub(crate) fn uninit_like(&self, len: usize) -> Result<Self> {
        self.output(len)
    }

    /// The kernel `f32` or `bf16` of `module`, by this storage's type.
    fn kernel(&self, module: &str, f32: &'static str, bf16: &'static str) -> Result<CudaFunction> {
        self.device.function(module, if self.dtype() == DType::BF16 { bf16 } else { f32 })
    }

    /// An error unless every storage in `others` has this one's type (`op`'s operands).
    fn same_dtype(&self, op: &'static str, others: &[&Self]) -> Result<()> {
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
    fn f32_param(op: &'static str, param: &Self) -> Result<()> {
        if param.dtype() != DType::F32 {
            return Err(TensorError::InvalidArgument {
                op,
                reason: format!("per-channel parameters are f32 on CUDA, got {}", param.dtype()),
            });
        }
        Ok(())
    }

    /// A copy converted to `dtype` (f32 → bf16 rounds to nearest even; bf16 → f32 is exact).
    pub(crate) fn to_dtype(&self, dtype: DType) -> Result<Self> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        let mut out = self.output_typed(self.len, dtype)?;
        let name = match dtype {
            DType::BF16 => "cast_f32_bf16",
            DType::F32 => "cast_bf16_f32",
            DType::F16 => {
                return Err(TensorError::UnsupportedDType {
                    op: "to_dtype",
                    dtype,
                    device: Device::Cuda(self.ordinal()),
                });
            }
        };
        let f = self.device.function("elementwise", name)?;
        let n = self.len as u64;
        unsafe {
            self.device
                .stream()
                .launch_builder(&f)
                .arg(&self.data)
                .arg(&mut out.data)
                .arg(&n)
                .launch(self.device.streaming(self.len.div_ceil(4)))
        }
        .map_err(self.err("to_dtype"))?;
        Ok(out)
    }

    fn err(&self, op: &'static str) -> impl Fn(cudarc::driver::DriverError) -> TensorError + '_ {
        move |e| driver(self.device.ordinal, op, e)
    }

    /// `self + other`, element-wise.
    pub(crate) fn add(&self, other: &Self) -> Result<Self> {
        self.same_dtype("add", &[other])?;
        let mut out = self.output(self.len)?;
        let f = self.kernel("elementwise", "add_f32", "add_bf16")?;
        let n = self.len as u64;
        unsafe {
            self.device
                .stream()
                .launch_builder(&f)
                .arg(&self.data)
                .arg(&other.data)
                .arg(&mut out.data)
                .arg(&n)
                .launch(self.packs())
        }
        .map_err(self.err("add"))?;
        Ok(out)
    }

    /// `x * mul + add`, two roundings (`affine_f32`). With `add = -0.0` this is exactly `x * mul`,
    /// signed zeros included.
    pub(crate) fn affine(&self, mul: f32, add: f32) -> Result<Self> {
        let mut out = self.output(self.len)?;
        let f = self.kernel("elementwise", "affine_f32", "affine_bf16")?;
        let n = self.len as u64;
        unsafe {
            self.device
                .stream()
                .launch_builder(&f)
                .arg(&self.data)
                .arg(&mut out.data)
                .arg(&n)
                .arg(&mul)
                .arg(&add)
                .launch(self.packs())
        }
        .map_err(self.err("affine"))?;
        Ok(out)
    }

    /// A streaming launch with one thread per 16-byte pack of this tensor's elements.
    fn packs(&self) -> LaunchConfig {
        self.device.streaming(self.len.div_ceil(per_pack(self.dtype())))
    }

    /// SiLU in place.
    pub(crate) fn silu_inplace(&mut self) -> Result<()> {
        let f = self.kernel("elementwise", "silu_f32", "silu_bf16")?;
        let n = self.len as u64;
        let (stream, cfg) = (self.device.stream(), self.packs());
        unsafe { stream.launch_builder(&f).arg(&mut self.data).arg(&n).launch(cfg) }
            .map_err(|e| driver(self.device.ordinal, "silu", e))?;
        Ok(())
    }

    /// SiLU into a new tensor: one pass (read, write) instead of a copy and an in-place pass.
    pub(crate) fn silu(&self) -> Result<Self> {
        let mut out = self.output(self.len)?;
        let f = self.kernel("elementwise", "silu_into_f32", "silu_into_bf16")?;
        let n = self.len as u64;
        unsafe {
            self.device.stream().launch_builder(&f).arg(&self.data).arg(&mut out.data).arg(&n).launch(self.packs())
        }
        .map_err(self.err("silu"))?;
        Ok(out)
    }

    /// Clamp to `[lo, hi]` in place.
    pub(crate) fn clamp_inplace(&mut self, lo: f32, hi: f32) -> Result<()> {
        let f = self.kernel("elementwise", "clamp_f32", "clamp_bf16")?;
        let n = self.len as u64;
        let (stream, cfg) = (self.device.stream(), self.packs());
        unsafe { stream.launch_builder(&f).arg(&mut self.data).arg(&n).arg(&lo).arg(&hi).launch(cfg) }
            .map_err(|e| driver(self.device.ordinal, "clamp", e))?;
        Ok(())
    }

    /// Wan's channel RMS norm over `[batch, channels, inner]`, optionally followed by SiLU.
    pub(crate) fn rms_norm_channels(
        &self,
        gamma: &Self,
        bias: Option<&Self>,
        [batch, channels, inner]: [usize; 3],
        eps: f32,
        fuse_silu: bool,
    ) -> Result<Self> {
        Self::f32_param("rms_norm_channels", gamma)?;
        if let Some(b) = bias {
            Self::f32_param("rms_norm_channels", b)?;
        }
        let mut out = self.output(self.len)?;
        if self.len == 0 {
            return Ok(out);
        }
        // bf16 takes four pixels per lane (one 8-byte access) where the pixel count allows it.
        let four = self.dtype() == DType::BF16 && inner % 4 == 0;
        let f = if four {
            self.device.function("norm", "rms_norm_channels_x4_bf16")?
        } else {
            self.kernel("norm", "rms_norm_channels_f32", "rms_norm_channels_bf16")?
        };
        let (b, c, i, silu) = (batch as u64, channels as u64, inner as u64, i32::from(fuse_silu));
        let stream = self.device.stream();
        let mut launch = stream.launch_builder(&f);
        launch.arg(&self.data).arg(&mut out.data).arg(&gamma.data);
        match bias {
            Some(bias) => launch.arg(&bias.data),
            None => launch.arg(&NULL),
        };
        launch.arg(&b).arg(&c).arg(&i).arg(&eps).arg(&silu);
        // Blocks of 32 pixel lanes by enough channel slices that each thread holds at most
        // RMS_HELD channels in registers (12 with one pixel per lane, 8 with four), as many slices
        // as the launch bound allows (768 or 512 threads; more channels are read twice, the
        // second time mostly from L2); one block per tile of 32 lanes up to several waves,
        // grid-stride beyond (see norm.cu).
        let (held, most, pixels) = if four { (8, 16, 4) } else { (12, 24, 1) };
        let slices = channels.div_ceil(held).clamp(1, most);
        let tiles = batch * inner.div_ceil(32 * pixels);
        let cfg = LaunchConfig {
            grid_dim: (tiles.clamp(1, self.device.sms * 16) as u32, 1, 1),
            block_dim: (32, slices as u32, 1),
            shared_mem_bytes: 0,
        };
        unsafe { launch.launch(cfg) }.map_err(self.err("rms_norm_channels"))?;
        Ok(out)
    }

    /// `nn.GroupNorm` over `[batch, channels, spatial]`, optionally followed by SiLU.
    pub(crate) fn group_norm(
        &self,
        gamma: &Self,
        beta: &Self,
        [batch, channels, spatial]: [usize; 3],
        groups: usize,
        eps: f32,
        fuse_silu: bool,
    ) -> Result<Self> {
        Self::f32_param("group_norm", gamma)?;
        Self::f32_param("group_norm", beta)?;
        let mut out = self.output(self.len)?;
        if self.len == 0 {
            return Ok(out);
        }
        // Three launches (see norm.cu): per-chunk sums and squared deviations, per-group
        // statistics, then every element. Chunks of at most 4096 elements (256 threads of 16
        // registers each); shorter ones, down to 1024 elements, where that puts about a thousand
        // blocks on the device.
        let group_len = channels / groups * spatial;
        let groups_total = batch * groups;
        let spread = 1024usize.div_ceil(groups_total).min(group_len.div_ceil(1024));
        let wanted = group_len.div_ceil(4096).max(spread).max(1);
        let chunk_len = group_len.div_ceil(wanted);
        let chunks = group_len.div_ceil(chunk_len);
        let rows = batch * channels;
        if groups_total > 65_535 {
            return Err(TensorError::InvalidArgument {
                op: "group_norm",
                reason: format!("{groups_total} (sample, group) pairs exceed one launch's 65535"),
            });
        }
        let stream = &self.device.stream();
        let mut partials = self.device.alloc_zeros::<f64>(2 * groups_total * chunks)?;
        let mut stats = self.device.alloc_zeros::<f64>(2 * groups_total)?;
        let per_chunk = LaunchConfig {
            grid_dim: (chunks as u32, groups_total as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (gl, cl, ch, gt) = (group_len as u64, chunk_len as u64, chunks as u64, groups_total as u64);
        let f = self.kernel("norm", "group_norm_partials_f32", "group_norm_partials_bf16")?;
        unsafe { stream.launch_builder(&f).arg(&self.data).arg(&mut partials).arg(&gl).arg(&cl).launch(per_chunk) }
            .map_err(self.err("group_norm"))?;
        let f = self.device.function("norm", "group_norm_stats")?;
        let per_group = LaunchConfig {
            grid_dim: (groups_total.clamp(1, 65_535) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        unsafe {
            stream
                .launch_builder(&f)
                .arg(&partials)
                .arg(&mut stats)
                .arg(&gt)
                .arg(&ch)
                .arg(&gl)
                .arg(&cl)
                .arg(&eps)
                .launch(per_group)
        }
        .map_err(self.err("group_norm"))?;
        // Rows of `spatial` elements (one per sample and channel) in grid y, pieces of a row in
        // grid x: enough blocks for a few waves over the whole tensor, each thread about one
        // 16-byte pack per row it visits.
        let f = self.kernel("norm", "group_norm_apply_f32", "group_norm_apply_bf16")?;
        let grid_y = rows.clamp(1, 65_535);
        let per_row = spatial.div_ceil(per_pack(self.dtype()) * 256).max(1);
        let grid_x = per_row.min((self.device.sms * 32).div_ceil(grid_y)).max(1);
        let apply =
            LaunchConfig { grid_dim: (grid_x as u32, grid_y as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let (r, c, sp, g, silu) = (rows as u64, channels as u64, spatial as u64, groups as u64, i32::from(fuse_silu));
        unsafe {
            stream
                .launch_builder(&f)
                .arg(&self.data)
                .arg(&mut out.data)
                .arg(&gamma.data)
                .arg(&beta.data)
                .arg(&stats)
                .arg(&r)
                .arg(&c)
                .arg(&sp)
                .arg(&g)
                .arg(&silu)
                .launch(apply)
        }
        .map_err(self.err("group_norm"))?;
        Ok(out)
    }

    /// The convolution (2-D convs are one frame, one temporal tap) on tensor cores, in three
    /// launches: the input into a zero-padded channels-last buffer `[N, Tp, Hp, Wp, Cp]`
    /// (channels rounded up to a 16-byte chunk), the weights into `[Cout, kt, kh, kw, Cp]`, then
    /// the implicit GEMM, whose K loop reads 64 contiguous bytes per pixel and tap with no bounds
    /// checks (`conv3d_tc_*` in conv.cu). bf16 multiplies on bf16 tensor cores; f32 on TF32
    /// tensor cores with each operand split in two TF32 parts (three products: f32 accuracy).
    /// Accumulation is f32 and the bias is f32 in both; the tile height is chosen by
    /// [`tensor_core_tile`].
    ///
    /// With `front = Some((f, ft))` the input is `f` (`ft` frames) followed by `self` along time,
    /// `g.t` frames in all: the conv of their concatenation, whose frames the channels-last copy
    /// reads from both (`conv_input_channels_last_split_*`) instead of a copy of the whole.
    pub(crate) fn conv3d(
        &self,
        front: Option<(&Self, u64)>,
        weight: &Self,
        bias: Option<&Self>,
        g: ConvGeom,
    ) -> Result<Self> {
        self.same_dtype("conv3d", &[weight])?;
        if let Some((f, _)) = front {
            self.same_dtype("conv3d", &[f])?;
        }
        if let Some(b) = bias {
            Self::f32_param("conv3d", b)?;
        }
        let len = (g.n * g.cout * g.to * g.ho * g.wo) as usize;
        if len == 0 {
            return self.like(0);
        }
        let bf16 = self.dtype() == DType::BF16;
        let ChannelsLast { t: tp, h: hp, w: wp, c: cp } = g.channels_last(if bf16 { 2 } else { 4 });
        let taps = g.kt * g.kh * g.kw;
        let cols = g.n * g.to * g.ho * g.wo;
        let rows_padded = g.n * tp * hp;
        // The K loop counts slices and places channels in 32-bit arithmetic; offsets are 64-bit.
        if taps * cp + 64 > u32::MAX as u64 || [tp, hp, wp].iter().any(|&e| e >= i32::MAX as u64) {
            return Err(TensorError::InvalidArgument {
                op: "conv3d",
                reason: format!(
                    "{taps} taps of {cp} channels or extents {:?} exceed the kernels' 32-bit range",
                    [tp, hp, wp]
                ),
            });
        }
        let math = TensorCoreMath::for_conv(self.dtype());
        let elem = if bf16 { 2 } else { 4 };
        let kernel = conv_kernel(math, g.cout, taps * cp, elem, cols, self.device.sms as u64, self.device.wgmma);
        let row_tiles = match kernel {
            ConvKernel::TensorCores(tile) => g.cout.div_ceil(tile.rows),
            ConvKernel::Wgmma(tile) => g.cout.div_ceil(tile.channels),
            ConvKernel::SmallCout => 1,
        };
        if rows_padded > i32::MAX as u64
            || wp.div_ceil(64) > 65_535
            || cp.div_ceil(32) > 65_535
            || cols.div_ceil(128) > i32::MAX as u64
            || row_tiles > 65_535
        {
            return Err(TensorError::InvalidArgument { op: "conv3d", reason: "too large for one launch".into() });
        }
        // The three kernels write every element of their outputs (the padding as zeros).
        let mut padded = self.output((rows_padded * wp * cp) as usize)?;
        let cfg = LaunchConfig {
            grid_dim: (rows_padded as u32, wp.div_ceil(64) as u32, cp.div_ceil(32) as u32),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let stream = self.device.stream();
        match front {
            None => {
                let f = self.kernel("conv", "conv_input_channels_last_f32", "conv_input_channels_last_bf16")?;
                unsafe { stream.launch_builder(&f).arg(&self.data).arg(&mut padded.data).arg(&g).launch(cfg) }
            }
            Some((front, front_t)) => {
                let f =
                    self.kernel("conv", "conv_input_channels_last_split_f32", "conv_input_channels_last_split_bf16")?;
                let mut launch = stream.launch_builder(&f);
                launch.arg(&front.data).arg(&front_t).arg(&self.data).arg(&mut padded.data).arg(&g);
                unsafe { launch.launch(cfg) }
            }
        }
        .map_err(self.err("conv3d"))?;
        let weight_len = (g.cout * taps * cp) as usize;
        let mut reordered = self.output(weight_len)?;
        let f = self.kernel("conv", "conv_weight_channels_last_f32", "conv_weight_channels_last_bf16")?;
        unsafe {
            self.device
                .stream()
                .launch_builder(&f)
                .arg(&weight.data)
                .arg(&mut reordered.data)
                .arg(&g)
                .launch(elementwise(weight_len))
        }
        .map_err(self.err("conv3d"))?;

        let mut out = self.output(len)?;
        let (f, grid_dim, shared_mem_bytes) = match kernel {
            ConvKernel::SmallCout => {
                let f = self.kernel("conv", "conv3d_small_cout_f32_c4", "conv3d_small_cout_bf16_c4")?;
                (f, (cols.div_ceil(256).min(self.device.sms as u64 * 8) as u32, 1, 1), 0)
            }
            ConvKernel::TensorCores(tile) => {
                (self.device.tensor_core_function(tile)?, tile.grid(cols, g.cout), tile.dynamic_shared_bytes())
            }
            ConvKernel::Wgmma(tile) => {
                (self.device.wgmma_function(tile)?, tile.grid(cols, g.cout), tile.dynamic_shared_bytes())
            }
        };
        let cfg = LaunchConfig { grid_dim, block_dim: (256, 1, 1), shared_mem_bytes };
        let mut launch = stream.launch_builder(&f);
        launch.arg(&padded.data).arg(&reordered.data);
        match bias {
            Some(b) => launch.arg(&b.data),
            None => launch.arg(&NULL),
        };
        launch.arg(&mut out.data).arg(&g);
        unsafe { launch.launch(cfg) }.map_err(self.err("conv3d"))?;
        Ok(out)
    }

    /// Nearest upsampling of the last two dimensions of `planes` planes of `h × w`.
    pub(crate) fn upsample_nearest2d(&self, planes: usize, h: usize, w: usize, factor: usize) -> Result<Self> {
        let len = planes * h * w * factor * factor;
        let mut out = self.output(len)?;
        let f = self.kernel("layout", "upsample_nearest2d_f32", "upsample_nearest2d_bf16")?;
        let (p, hh, ww, k) = (planes as u64, h as u64, w as u64, factor as u64);
        unsafe {
            self.device
                .stream()
                .launch_builder(&f)
                .arg(&self.data)
                .arg(&mut out.data)
                .arg(&p)
                .arg(&hh)
                .arg(&ww)
                .arg(&k)
                // 32 lanes per input row (see layout.cu).
                .launch(self.device.streaming(planes * h * 32))
        }
        .map_err(self.err("upsample_nearest2d"))?;
        Ok(out)
    }

    /// Copies a box of `extent` at `src_offset` (row-major `src_dims`) into `dst` at
    /// `dst_offset` (row-major `dst_dims`): narrow, cat, permute (with permuted strides).
    pub(crate) fn copy_box_into(
        &self,
        src_strides: &[usize],
        src_offset: usize,
        dst: &mut Self,
        dst_strides: &[usize],
        dst_offset: usize,
        extent: &[usize],
    ) -> Result<()> {
        let n: usize = extent.iter().product();
        if n == 0 {
            return Ok(());
        }
        let (extent, src_strides, dst_strides) = merged_box(extent, src_strides, dst_strides);
        let b = Box8::new(&extent, &src_strides, &dst_strides).ok_or_else(|| TensorError::InvalidArgument {
            op: "copy_box",
            reason: format!("rank {} > 8 on CUDA", extent.len()),
        })?;
        // Rows of the last dimension in segments of at most 2048 elements, 32 lanes each when a
        // row is at least that long (`copy_box` in layout.cu).
        let last = extent[extent.len() - 1];
        let cfg = self.device.streaming(n / last * last.div_ceil(COPY_SEGMENT) * if last >= 32 { 32 } else { 1 });
        self.same_dtype("copy_box", &[dst])?;
        let f = self.kernel("layout", "copy_box_f32", "copy_box_u16")?;
        let total = n as u64;
        let stream = &self.device.stream();
        let launched = match (&self.data, &mut dst.data) {
            (CudaData::F32(s), CudaData::F32(d)) => {
                let (src, mut dst) = (s.slice(src_offset..), d.slice_mut(dst_offset..));
                unsafe { stream.launch_builder(&f).arg(&src).arg(&mut dst).arg(&b).arg(&total).launch(cfg) }
            }
            (CudaData::Bf16(s), CudaData::Bf16(d)) => {
                let (src, mut dst) = (s.slice(src_offset..), d.slice_mut(dst_offset..));
                unsafe { stream.launch_builder(&f).arg(&src).arg(&mut dst).arg(&b).arg(&total).launch(cfg) }
            }
            _ => return Err(TensorError::InvalidArgument { op: "copy_box", reason: "operand types differ".into() }),
        };
        launched.map_err(self.err("copy_box"))?;
        Ok(())
    }

    /// Wan2.2's `DupUp3D` (see `layout.cu`): `dims` = `[batch, channels, t, h, w]`,
    /// `[out_channels, ft, fs, repeats, drop]`.
    pub(crate) fn dup_up3d(&self, dims: [usize; 5], params: [usize; 5], out_len: usize) -> Result<Self> {
        let name = if self.dtype() == DType::BF16 { "dup_up3d_bf16" } else { "dup_up3d_f32" };
        self.layout_kernel(name, dims, params, out_len)
    }

    /// Wan2.2's `AvgDown3D` (see `layout.cu`): `dims` = `[batch, channels, t, h, w]`,
    /// `[out_channels, ft, fs, group, pad_t]`.
    pub(crate) fn avg_down3d(&self, dims: [usize; 5], params: [usize; 5], out_len: usize) -> Result<Self> {
        let name = if self.dtype() == DType::BF16 { "avg_down3d_bf16" } else { "avg_down3d_f32" };
        self.layout_kernel(name, dims, params, out_len)
    }

    /// A `layout.cu` kernel taking `(x, out, five dims, five parameters)` as u64s.
    fn layout_kernel(&self, name: &'static str, dims: [usize; 5], params: [usize; 5], out_len: usize) -> Result<Self> {
        let mut out = self.like(out_len)?;
        let f = self.device.function("layout", name)?;
        let args: Vec<u64> = dims.iter().chain(&params).map(|&v| v as u64).collect();
        let stream = self.device.stream();
        let mut launch = stream.launch_builder(&f);
        launch.arg(&self.data).arg(&mut out.data);
        for a in &args {
            launch.arg(a);
        }
        unsafe { launch.launch(elementwise(out_len)) }.map_err(self.err(name))?;
        Ok(out)
    }

    /// `c[b] = alpha · a[b] · b[b] + beta · c[b]` for every batch `b` (`gemm_batched_f32`; `c`
    /// is only read when `beta ≠ 0`), operands given by their `[batch, row, column]` element
    /// strides, `c` dense.
    #[allow(clippy::too_many_arguments)] // the GEMM's own parameter list
    fn gemm_batched(
        &self,
        b: &Self,
        c: &mut Self,
        [batch, m, n, k]: [usize; 4],
        a_strides: [usize; 3],
        b_strides: [usize; 3],
        alpha: f32,
        beta: f32,
    ) -> Result<()> {
        let name = match (self.dtype(), b.dtype(), c.dtype()) {
            (DType::F32, DType::F32, DType::F32) => "gemm_batched_f32",
            (DType::BF16, DType::BF16, DType::F32) => "gemm_batched_bf16_bf16_f32",
            (DType::F32, DType::BF16, DType::BF16) => "gemm_batched_f32_bf16_bf16",
            (x, y, z) => {
                return Err(TensorError::InvalidArgument {
                    op: "gemm",
                    reason: format!("no GEMM kernel for {x} x {y} -> {z}"),
                });
            }
        };
        let f = self.device.function("gemm", name)?;
        // One block per 64x64 tile of one batch entry: rows in grid y and batches in grid z,
        // both limited to 65535 by the hardware.
        if m.div_ceil(64) > 65_535 || batch > 65_535 {
            return Err(TensorError::InvalidArgument {
                op: "gemm",
                reason: format!(
                    "{batch} batches of {m} rows exceed one launch (at most 65535 batches and 65535 x 64 rows)"
                ),
            });
        }
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(64) as u32, m.div_ceil(64) as u32, batch as u32),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let dims = [m as u64, n as u64, k as u64];
        let strides: Vec<i64> = a_strides.iter().chain(&b_strides).chain(&[m * n, n]).map(|&v| v as i64).collect();
        let stream = self.device.stream();
        let mut launch = stream.launch_builder(&f);
        launch.arg(&self.data).arg(&b.data).arg(&mut c.data);
        for d in &dims {
            launch.arg(d);
        }
        for st in &strides {
            launch.arg(st);
        }
        launch.arg(&alpha).arg(&beta);
        unsafe { launch.launch(cfg) }.map_err(self.err("gemm"))?;
        Ok(())
    }

    /// Batched matrix product `[batch, m, k] · [batch, k, n]`, both dense and of one type. bf16
    /// accumulates into f32 and rounds once at the end.
    pub(crate) fn matmul(&self, rhs: &Self, [batch, m, n, k]: [usize; 4]) -> Result<Self> {
        self.same_dtype("matmul", &[rhs])?;
        let mut out = self.like_typed(batch * m * n, DType::F32)?;
        self.gemm_batched(rhs, &mut out, [batch, m, n, k], [m * k, k, 1], [k * n, n, 1], 1.0, 0.0)?;
        out.to_dtype(self.dtype())
    }

    /// `F.linear` over `rows` rows: `x [rows, k] · weightᵀ [k, n] + bias` (x and weight of one
    /// type, the bias f32). As on the CPU (and in PyTorch's `addmm`), the bias is the value the
    /// product is added onto: an f32 output starts as the bias broadcast over the rows (a box
    /// copy with row stride 0), the GEMM adds to it with `beta = 1`, and bf16 rounds once at
    /// the end.
    pub(crate) fn linear(&self, weight: &Self, bias: Option<&Self>, [rows, n, k]: [usize; 3]) -> Result<Self> {
        self.same_dtype("linear", &[weight])?;
        let mut out = self.like_typed(rows * n, DType::F32)?;
        let beta = match bias {
            Some(b) => {
                Self::f32_param("linear", b)?;
                b.copy_box_into(&[0, 1], 0, &mut out, &[n, 1], 0, &[rows, n])?;
                1.0
            }
            None => 0.0,
        };
        // Element (kk, j) of weightᵀ is weight[j, kk]: row stride 1, column stride k.
        self.gemm_batched(weight, &mut out, [1, rows, n, k], [0, k, 1], [0, 1, k], 1.0, beta)?;
        out.to_dtype(self.dtype())
    }

    /// Single-head attention `softmax(q kᵀ · scale) v` for `[batch, n, d]`, `[batch, m, d]`,
    /// `[batch, m, dv]`: two products around the row softmax, on the tensor cores where the rows
    /// allow it ([`Self::attention_on_tensor_cores`]), else the CUDA-core batched GEMM.
    pub(crate) fn attention(
        q: &Self,
        k: &Self,
        v: &Self,
        [batch, n, m, d, dv]: [usize; 5],
        scale: f32,
    ) -> Result<Self> {
        q.same_dtype("attention", &[k, v])?;
        // The tensor cores take rows of whole 16-byte chunks: d (Q and K rows) and m (rows of P
        // and of Vᵀ) in multiples of 8 bf16 or 4 f32 (Wan's mid block: d 384, m 60 x 104).
        let chunk = 16 / q.dtype().size_in_bytes();
        let shortest_tile = 64;
        if d % chunk == 0 && m % chunk == 0 && n.max(m) < i32::MAX as usize && n.div_ceil(shortest_tile) <= 65_535 {
            return Self::attention_on_tensor_cores(q, k, v, [batch, n, m, d, dv], scale);
        }
        // Scores and probabilities in f32 whatever the operands' type (as flash attention keeps
        // them); only the output is rounded to the operands' type.
        let mut scores = q.like_typed(batch * n * m, DType::F32)?;
        // Element (i, j) of kᵀ is k[j, i]: row stride 1, column stride d.
        q.gemm_batched(k, &mut scores, [batch, n, m, d], [n * d, d, 1], [m * d, 1, d], scale, 0.0)?;
        q.softmax_rows(&mut scores, None, batch * n, m, 1.0)?;
        let mut out = q.like(batch * n * dv)?;
        scores.gemm_batched(v, &mut out, [batch, n, dv, m], [n * m, m, 1], [m * dv, dv, 1], 1.0, 0.0)?;
        Ok(out)
    }

    /// `softmax(scores * scale)` row by row: in place (`probabilities` none), or into bf16
    /// probabilities.
    fn softmax_rows(
        &self,
        scores: &mut Self,
        probabilities: Option<&mut Self>,
        rows: usize,
        cols: usize,
        scale: f32,
    ) -> Result<()> {
        let blocks = rows.clamp(1, 1 << 20) as u32;
        let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let (rows, cols) = (rows as u64, cols as u64);
        let stream = self.device.stream();
        let launched = match probabilities {
            None => {
                let f = self.device.function("attention", "softmax_rows_f32")?;
                unsafe { stream.launch_builder(&f).arg(&mut scores.data).arg(&rows).arg(&cols).arg(&scale).launch(cfg) }
            }
            Some(p) => {
                let f = self.device.function("attention", "softmax_rows_to_bf16")?;
                unsafe {
                    stream
                        .launch_builder(&f)
                        .arg(&mut scores.data)
                        .arg(&mut p.data)
                        .arg(&rows)
                        .arg(&cols)
                        .arg(&scale)
                        .launch(cfg)
                }
            }
        };
        launched.map_err(self.err("attention"))?;
        Ok(())
    }

    /// Attention with both products on the tensor-core convolution, as 1x1 convolutions of one
    /// batch each: the scores `Q Kᵀ` (`n` filters `Q[i]` over `m` pixels `K[j]` of `d` channels),
    /// f32 from bf16 operands as flash attention keeps them; the softmax into probabilities P of
    /// the operands' type (bf16 rounds them, as flash attention does); then `P V` (`n` filters
    /// `P[i]` over `dv` pixels `Vᵀ[c]` of `m` channels), which writes `[n, dv]` row by row.
    fn attention_on_tensor_cores(
        q: &Self,
        k: &Self,
        v: &Self,
        [batch, n, m, d, dv]: [usize; 5],
        scale: f32,
    ) -> Result<Self> {
        let bf16 = q.dtype() == DType::BF16;
        let sms = q.device.sms as u64;
        // Every product below writes all of its output.
        let mut scores = q.output_typed(batch * n * m, DType::F32)?;
        let tile = if bf16 {
            TensorCoreTile::new(128, 128, "conv3d_tc_bf16_f32out_m4")
        } else {
            // Full f32 products in TF32 mode too, as PyTorch leaves matrix products in f32.
            tensor_core_tile(TensorCoreMath::F32, n as u64, m as u64, sms)
        };
        for b in 0..batch {
            q.tensor_core_gemm(tile, (k, b * m * d), (q, b * n * d), (&mut scores, b * n * m), [n, m, d])?;
        }
        let mut bf16_probabilities = if bf16 { Some(q.output(batch * n * m)?) } else { None };
        q.softmax_rows(&mut scores, bf16_probabilities.as_mut(), batch * n, m, scale)?;
        let p = bf16_probabilities.as_ref().unwrap_or(&scores);
        let mut vt = v.output(batch * dv * m)?;
        v.copy_box_into(&[m * dv, 1, dv], 0, &mut vt, &[dv * m, m, 1], 0, &[batch, dv, m])?;
        let mut out = q.output(batch * n * dv)?;
        let math = if bf16 { TensorCoreMath::Bf16 } else { TensorCoreMath::F32 };
        let tile = tensor_core_tile(math, n as u64, dv as u64, sms);
        for b in 0..batch {
            q.tensor_core_gemm(tile, (&vt, b * dv * m), (p, b * n * m), (&mut out, b * n * dv), [n, dv, m])?;
        }
        Ok(out)
    }

    /// `out[o][p] = Σ_c filters[o][c] · pixels[p][c]` for `[outs, pixels, channels]` (rows of
    /// whole 16-byte chunks), each operand from an element on: a 1x1 convolution on the
    /// tensor-core kernel `tile`, no bias.
    fn tensor_core_gemm(
        &self,
        tile: TensorCoreTile,
        (pixels, pixels_from): (&Self, usize),
        (filters, filters_from): (&Self, usize),
        (out, out_from): (&mut Self, usize),
        [outs, cols, channels]: [usize; 3],
    ) -> Result<()> {
        let (outs, cols) = (outs as u64, cols as u64);
        let g = ConvGeom::pointwise(outs, cols, channels as u64);
        let f = self.device.tensor_core_function(tile)?;
        let cfg = LaunchConfig {
            grid_dim: tile.grid(cols, outs),
            block_dim: (256, 1, 1),
            shared_mem_bytes: tile.dynamic_shared_bytes(),
        };
        let (xp, wr, mut dst) =
            (pixels.data.view(pixels_from), filters.data.view(filters_from), out.data.view_mut(out_from));
        let stream = self.device.stream();
        let mut launch = stream.launch_builder(&f);
        launch.arg(&xp).arg(&wr).arg(&NULL).arg(&mut dst).arg(&g);
        unsafe { launch.launch(cfg) }.map_err(self.err("attention"))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{
        ConvKernel, ConvKernels, ConvTilesGuard, SMALL_COUT_SMEM, TensorCoreMath, conv_kernel, tensor_core_tile,
        wgmma_env_says, wgmma_tile,
    };

    /// A large Wan2.1 chunk (4 frames of 480x832) and an H200's multiprocessors.
    const BIG: u64 = 4 * 480 * 832;
    const SMS: u64 = 132;

    #[test]
    fn tensor_core_tiles_leave_no_idle_rows_and_fill_small_grids() {
        for math in [TensorCoreMath::Bf16, TensorCoreMath::F32, TensorCoreMath::Tf32] {
            assert_eq!(tensor_core_tile(math, 96, BIG, SMS).rows, 96);
            assert_eq!(tensor_core_tile(math, 192, BIG, SMS).rows, 96);
            // Fewer output channels than any tile: the shortest (the RGB heads whose weights do
            // not fit the small-Cout kernel; see the test below).
            assert_eq!(tensor_core_tile(math, 3, BIG, SMS).rows, 64);
            // Large grids take the wide tiles (a few partial waves cost little there).
            assert_eq!(tensor_core_tile(math, 96, BIG, SMS).pixels, 256);
        }
        // 384 channels of one 60x104 frame (6240 pixels): 25 x 3 wide tiles of 128 rows would
        // leave 57 multiprocessors idle, 49 x 3 narrow ones two blocks on 15 of them; 25 x 4
        // wide tiles of 96 rows give 100 multiprocessors one each.
        let small = tensor_core_tile(TensorCoreMath::Bf16, 384, 60 * 104, SMS);
        assert_eq!((small.rows, small.pixels), (96, 256));
        let wide = tensor_core_tile(TensorCoreMath::Bf16, 384, BIG, SMS);
        assert_eq!((wide.rows, wide.pixels, wide.name), (128, 256, "conv3d_tc_bf16_m4_n256"));
        assert_eq!(tensor_core_tile(TensorCoreMath::Bf16, 768, BIG, SMS).rows, 128);
        assert_eq!(tensor_core_tile(TensorCoreMath::F32, 384, BIG, SMS).name, "conv3d_tc_f32_m3_n256");
        assert_eq!(tensor_core_tile(TensorCoreMath::Tf32, 384, BIG, SMS).name, "conv3d_tc_tf32_m4_n256");
        // Tiny grids (one tile of pixels): the narrow tiles, more of them.
        let tiny = tensor_core_tile(TensorCoreMath::Bf16, 384, 100, SMS);
        assert_eq!((tiny.rows, tiny.pixels), (64, 128));
    }

    #[test]
    fn a_guard_restricts_the_tile_width_on_its_thread_only() {
        let narrow = {
            let _only = ConvTilesGuard::enter(Some(ConvKernels::Pixels128));
            let t = tensor_core_tile(TensorCoreMath::Bf16, 384, BIG, SMS);
            let other = std::thread::spawn(|| tensor_core_tile(TensorCoreMath::Bf16, 384, BIG, SMS)).join();
            assert_eq!(other.expect("thread").pixels, 256);
            t
        };
        assert_eq!((narrow.rows, narrow.pixels, narrow.name), (128, 128, "conv3d_tc_bf16_m4"));
        assert_eq!(tensor_core_tile(TensorCoreMath::Bf16, 384, BIG, SMS).pixels, 256);
        let _only = ConvTilesGuard::enter(Some(ConvKernels::Pixels256));
        assert_eq!(tensor_core_tile(TensorCoreMath::Bf16, 384, 100, SMS).pixels, 256);
    }

    #[test]
    fn wide_tiles_ask_for_their_four_stages_of_dynamic_shared_memory() {
        let _only = ConvTilesGuard::enter(Some(ConvKernels::Pixels256));
        // conv.cu's TC_WIDE_SMEM(MT) = 4 * (32 * MT + 256) * 64; narrow tiles use static memory.
        assert_eq!(tensor_core_tile(TensorCoreMath::Bf16, 384, BIG, SMS).dynamic_shared_bytes(), 98_304);
        assert_eq!(tensor_core_tile(TensorCoreMath::Bf16, 96, BIG, SMS).dynamic_shared_bytes(), 90_112);
        assert_eq!(tensor_core_tile(TensorCoreMath::Bf16, 3, BIG, SMS).dynamic_shared_bytes(), 81_920);
        drop(_only);
        let _only = ConvTilesGuard::enter(Some(ConvKernels::Pixels128));
        assert_eq!(tensor_core_tile(TensorCoreMath::Bf16, 384, BIG, SMS).dynamic_shared_bytes(), 0);
    }

    #[test]
    fn rgb_heads_run_on_cuda_cores_when_their_weights_fit() {
        // Wan's head: 96 channels, 27 taps, in bf16 and in f32 (41.5 KiB of 44).
        assert_eq!(conv_kernel(TensorCoreMath::Bf16, 3, 27 * 96, 2, BIG, SMS, true), ConvKernel::SmallCout);
        assert_eq!(conv_kernel(TensorCoreMath::F32, 3, 27 * 96, 4, BIG, SMS, false), ConvKernel::SmallCout);
        assert_eq!(conv_kernel(TensorCoreMath::Bf16, 4, 9 * 128, 2, BIG, SMS, false), ConvKernel::SmallCout);
        // Too many weights for the kernel's shared memory, or more than 4 channels: tensor cores.
        let over = SMALL_COUT_SMEM / (4 * 4) + 4;
        assert!(matches!(
            conv_kernel(TensorCoreMath::F32, 3, over, 4, BIG, SMS, false),
            ConvKernel::TensorCores(t) if t.rows == 64
        ));
        assert!(matches!(
            conv_kernel(TensorCoreMath::Bf16, 5, 27 * 96, 2, BIG, SMS, false),
            ConvKernel::TensorCores(_)
        ));
    }

    #[test]
    fn wgmma_tiles_pad_the_channels_least_and_ignore_the_grid() {
        let channels = |cout| wgmma_tile(cout).channels;
        // Wan's 96 and 192, AutoencoderKL's 128, 256 and 512: no idle channels.
        assert_eq!([channels(96), channels(128), channels(192), channels(256)], [96, 128, 192, 256]);
        // Ties go to the widest: 384 = 2 x 192 (not 3 x 128 or 4 x 96), 768 = 3 x 256.
        assert_eq!([channels(384), channels(512), channels(768)], [192, 256, 256]);
        // 200 channels: 256 pads 56, 128 x 2 pads as much, 96 x 3 more.
        assert_eq!(channels(200), 256);
        assert_eq!(wgmma_tile(96).name, "conv3d_wgmma_bf16_n96");
        // conv_sm90a.cu's WGMMA_SMEM(N): 6 stages below 192 channels, 5 from there, + 512.
        assert_eq!(wgmma_tile(96).dynamic_shared_bytes(), 6 * 224 * 64 + 512);
        assert_eq!(wgmma_tile(256).dynamic_shared_bytes(), 5 * 384 * 64 + 512);
    }

    #[test]
    fn wgmma_takes_bf16_convolutions_of_96_channels_and_more_where_the_device_has_it() {
        let _wgmma = ConvTilesGuard::enter(Some(ConvKernels::Wgmma));
        let kernel = |math, cout, wgmma| conv_kernel(math, cout, 27 * 96, 2, BIG, SMS, wgmma);
        assert!(matches!(kernel(TensorCoreMath::Bf16, 96, true), ConvKernel::Wgmma(t) if t.channels == 96));
        assert!(matches!(kernel(TensorCoreMath::Bf16, 384, true), ConvKernel::Wgmma(t) if t.channels == 192));
        // Without the kernels (not compute capability 9.0), fewer channels, other products.
        assert!(matches!(kernel(TensorCoreMath::Bf16, 96, false), ConvKernel::TensorCores(_)));
        assert!(matches!(kernel(TensorCoreMath::Bf16, 64, true), ConvKernel::TensorCores(_)));
        assert!(matches!(kernel(TensorCoreMath::F32, 96, true), ConvKernel::TensorCores(_)));
        assert!(matches!(kernel(TensorCoreMath::Tf32, 96, true), ConvKernel::TensorCores(_)));
        assert_eq!(kernel(TensorCoreMath::Bf16, 3, true), ConvKernel::SmallCout);
        // A thread that forces an mma.sync width gets it.
        let _narrow = ConvTilesGuard::enter(Some(ConvKernels::Pixels128));
        assert!(matches!(kernel(TensorCoreMath::Bf16, 96, true), ConvKernel::TensorCores(t) if t.pixels == 128));
    }

    #[test]
    fn the_wgmma_variable_turns_the_kernels_on_only_when_it_says_so() {
        for on in ["1", "true", "TRUE", "yes", "On", " 1 "] {
            assert!(wgmma_env_says(Some(on)), "{on:?}");
        }
        // Unset, off, and what is neither (a typo is not read as a yes).
        for off in ["", "0", "false", "No", "off", "2", "ture", "enable"] {
            assert!(!wgmma_env_says(Some(off)), "{off:?}");
        }
        assert!(!wgmma_env_says(None));
    }
}
