//! The device registry: one [`CudaDevice`] per ordinal and process (context, default stream,
//! the loaded modules), created on first use, and the calling thread's own streams.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DeviceRepr, LaunchConfig, ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;

use super::super::kernels::Kernel;
use super::super::{embedded_modules, embedded_sm90a_modules};
use super::select::{TensorCoreTile, WGMMA_MODULE, WgmmaTile};
use super::storage::CudaData;
use crate::{DType, Device, Result, TensorError};

/// A device's context, default stream and kernels.
pub(crate) struct CudaDevice {
    pub(super) ordinal: usize,
    /// Streaming multiprocessors: the memory-bound kernels launch a few waves of blocks per SM,
    /// the tensor-core conv picks its tile height to fill them.
    pub(super) sms: usize,
    /// The device's name and compute capability: the per-shape convolution choices are kept
    /// per name (`conv_choice`), so identical GPUs of a process share them.
    pub(super) name: String,
    /// Where work goes unless the calling thread has a stream of its own ([`OwnStream`]).
    default_stream: Arc<CudaStream>,
    modules: Vec<(&'static str, Arc<CudaModule>)>,
    /// Whether the Hopper-only kernels (`*_sm90a.cu`: `wgmma`) are loaded: compute capability 9.0
    /// and a build that embeds them.
    pub(super) wgmma: bool,
    functions: Mutex<HashMap<&'static str, CudaFunction>>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaDevice(cuda:{})", self.ordinal)
    }
}

pub(super) fn unavailable(ordinal: usize, reason: impl Into<String>) -> TensorError {
    TensorError::DeviceUnavailable { device: Device::Cuda(ordinal), reason: reason.into() }
}

pub(crate) fn driver(ordinal: usize, op: &'static str, e: impl std::fmt::Display) -> TensorError {
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
        let info = super::super::probe(ordinal).map_err(|reason| unavailable(ordinal, reason))?;
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
            name: format!("{} (sm_{}{})", info.name, info.compute_capability.0, info.compute_capability.1),
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

    pub(crate) fn function(&self, kernel: Kernel) -> Result<CudaFunction> {
        self.function_with_dynamic_shared(kernel.module, kernel.name, 0)
    }

    /// The tensor-core convolution kernel of `tile`, allowed its dynamic shared memory.
    pub(crate) fn tensor_core_function(&self, tile: TensorCoreTile) -> Result<CudaFunction> {
        self.function_with_dynamic_shared("conv", tile.name, tile.dynamic_shared_bytes())
    }

    /// The warpgroup-MMA convolution kernel of `tile`, allowed its dynamic shared memory.
    pub(crate) fn wgmma_function(&self, tile: WgmmaTile) -> Result<CudaFunction> {
        self.function_with_dynamic_shared(WGMMA_MODULE, tile.name, tile.dynamic_shared_bytes())
    }

    /// Kernel `name` of `module`, loaded once; where its launches give more than 48 KiB of
    /// dynamic shared memory (`dynamic_shared` bytes), the kernel is allowed that much when it
    /// loads (the driver refuses such launches otherwise).
    pub(super) fn function_with_dynamic_shared(
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
    pub(crate) fn stream(&self) -> Arc<CudaStream> {
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

    pub(super) fn alloc_zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>> {
        self.stream().alloc_zeros::<T>(n.max(1)).map_err(|e| driver(self.ordinal, "alloc", e))
    }

    pub(super) fn alloc(&self, n: usize, dtype: DType) -> Result<CudaData> {
        match dtype {
            DType::F32 => Ok(CudaData::F32(self.alloc_zeros(n)?)),
            DType::BF16 => Ok(CudaData::Bf16(self.alloc_zeros(n)?)),
        }
    }

    /// `n` elements of `dtype`, not cleared: only for an output that the next kernel on the
    /// stream writes in full (clearing it first would cost a whole extra pass over memory).
    pub(super) fn alloc_for_kernel(&self, n: usize, dtype: DType) -> Result<CudaData> {
        let err = |e| driver(self.ordinal, "alloc", e);
        match dtype {
            // SAFETY: the memory is only read after the kernel queued next on this stream has
            // written every element (the callers' contract); stream order makes that write happen
            // first. Any bits are a valid f32 besides.
            DType::F32 => Ok(CudaData::F32(unsafe { self.stream().alloc::<f32>(n.max(1)) }.map_err(err)?)),
            // SAFETY: as for f32; any bits are valid bf16 bits.
            DType::BF16 => Ok(CudaData::Bf16(unsafe { self.stream().alloc::<u16>(n.max(1)) }.map_err(err)?)),
        }
    }

    /// A grid-stride launch of blocks of 256 threads over `units` work items (packs of 16 bytes,
    /// rows, ...): one thread per item up to a few waves of blocks per SM (8 blocks of 256 fill
    /// an SM), then each thread takes several. The memory-bound kernels keep the device busy
    /// without a block per item (the old launch made up to 2^20 blocks of 256 scalar elements).
    pub(super) fn streaming(&self, units: usize) -> LaunchConfig {
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
