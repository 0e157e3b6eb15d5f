//! CUDA tensor storage and the ops that run on it, through the embedded `kernels-cu/` modules.
//!
//! One [`CudaDevice`] per ordinal and process (context, one stream, the loaded modules), created
//! on first use. Storage is f32 for now. Every op checks its arguments on the host exactly as
//! the CPU op does (the CPU op's validation runs first; see the `Tensor` methods) and then
//! launches kernels on the device's stream; results come back to the host only when asked
//! (`to_device(Cpu)`, `to_vec_f32`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;

use super::abi::{Box8, ConvGeom};
use super::embedded_modules;
use crate::{Device, Result, TensorError};

/// A device's context, stream and kernels.
pub(crate) struct CudaDevice {
    ordinal: usize,
    stream: Arc<CudaStream>,
    modules: Vec<(&'static str, Arc<CudaModule>)>,
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
        let device = Arc::new(Self { ordinal, stream: ctx.default_stream(), modules, functions: Mutex::default() });
        devices.insert(ordinal, Arc::clone(&device));
        Ok(device)
    }

    fn function(&self, module: &str, name: &'static str) -> Result<CudaFunction> {
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
        cache.insert(name, f.clone());
        Ok(f)
    }

    fn alloc_zeros(&self, n: usize) -> Result<CudaSlice<f32>> {
        self.stream.alloc_zeros::<f32>(n.max(1)).map_err(|e| driver(self.ordinal, "alloc", e))
    }
}

/// f32 elements on a CUDA device.
#[derive(Clone)]
pub(crate) struct CudaStorage {
    pub(crate) data: CudaSlice<f32>,
    pub(crate) device: Arc<CudaDevice>,
    len: usize,
}

impl std::fmt::Debug for CudaStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaStorage(cuda:{}, {} f32)", self.device.ordinal, self.len)
    }
}

/// A null device pointer, for optional kernel arguments.
const NULL: u64 = 0;

/// A 1-D grid-stride launch over `n` elements.
fn elementwise(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 1 << 20) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

impl CudaStorage {
    /// Zeros on device `ordinal`.
    pub(crate) fn zeros(ordinal: usize, len: usize) -> Result<Self> {
        let device = CudaDevice::get(ordinal)?;
        Ok(Self { data: device.alloc_zeros(len)?, device, len })
    }

    /// A copy of host data on device `ordinal`.
    pub(crate) fn upload(ordinal: usize, host: &[f32]) -> Result<Self> {
        let device = CudaDevice::get(ordinal)?;
        if host.is_empty() {
            return Self::zeros(ordinal, 0);
        }
        let data = device.stream.clone_htod(host).map_err(|e| driver(ordinal, "upload", e))?;
        Ok(Self { data, device, len: host.len() })
    }

    /// The elements, copied to the host.
    pub(crate) fn download(&self) -> Result<Vec<f32>> {
        let mut v =
            self.device.stream.clone_dtoh(&self.data).map_err(|e| driver(self.device.ordinal, "download", e))?;
        v.truncate(self.len);
        Ok(v)
    }

    pub(crate) fn ordinal(&self) -> usize {
        self.device.ordinal
    }

    fn like(&self, len: usize) -> Result<Self> {
        Ok(Self { data: self.device.alloc_zeros(len)?, device: Arc::clone(&self.device), len })
    }

    fn err(&self, op: &'static str) -> impl Fn(cudarc::driver::DriverError) -> TensorError + '_ {
        move |e| driver(self.device.ordinal, op, e)
    }

    /// `self + other`, element-wise.
    pub(crate) fn add(&self, other: &Self) -> Result<Self> {
        let mut out = self.like(self.len)?;
        let f = self.device.function("elementwise", "add_f32")?;
        let n = self.len as u64;
        unsafe {
            self.device
                .stream
                .launch_builder(&f)
                .arg(&self.data)
                .arg(&other.data)
                .arg(&mut out.data)
                .arg(&n)
                .launch(elementwise(self.len))
        }
        .map_err(self.err("add"))?;
        Ok(out)
    }

    /// `x * mul + add`, two roundings (`affine_f32`). With `add = -0.0` this is exactly `x * mul`,
    /// signed zeros included.
    pub(crate) fn affine(&self, mul: f32, add: f32) -> Result<Self> {
        let mut out = self.like(self.len)?;
        let f = self.device.function("elementwise", "affine_f32")?;
        let n = self.len as u64;
        unsafe {
            self.device
                .stream
                .launch_builder(&f)
                .arg(&self.data)
                .arg(&mut out.data)
                .arg(&n)
                .arg(&mul)
                .arg(&add)
                .launch(elementwise(self.len))
        }
        .map_err(self.err("affine"))?;
        Ok(out)
    }

    /// SiLU in place.
    pub(crate) fn silu_inplace(&mut self) -> Result<()> {
        let f = self.device.function("elementwise", "silu_f32")?;
        let n = self.len as u64;
        let stream = Arc::clone(&self.device.stream);
        unsafe { stream.launch_builder(&f).arg(&mut self.data).arg(&n).launch(elementwise(self.len)) }
            .map_err(|e| driver(self.device.ordinal, "silu", e))?;
        Ok(())
    }

    /// Clamp to `[lo, hi]` in place.
    pub(crate) fn clamp_inplace(&mut self, lo: f32, hi: f32) -> Result<()> {
        let f = self.device.function("elementwise", "clamp_f32")?;
        let n = self.len as u64;
        let stream = Arc::clone(&self.device.stream);
        unsafe {
            stream.launch_builder(&f).arg(&mut self.data).arg(&n).arg(&lo).arg(&hi).launch(elementwise(self.len))
        }
        .map_err(|e| driver(self.device.ordinal, "clamp", e))?;
        Ok(())
    }

    /// Wan's channel RMS norm over `[batch, channels, inner]`.
    pub(crate) fn rms_norm_channels(
        &self,
        gamma: &Self,
        bias: Option<&Self>,
        [batch, channels, inner]: [usize; 3],
        eps: f32,
    ) -> Result<Self> {
        let mut out = self.like(self.len)?;
        let f = self.device.function("norm", "rms_norm_channels_f32")?;
        let (b, c, i, silu) = (batch as u64, channels as u64, inner as u64, 0i32);
        let mut launch = self.device.stream.launch_builder(&f);
        launch.arg(&self.data).arg(&mut out.data).arg(&gamma.data);
        match bias {
            Some(bias) => launch.arg(&bias.data),
            None => launch.arg(&NULL),
        };
        launch.arg(&b).arg(&c).arg(&i).arg(&eps).arg(&silu);
        unsafe { launch.launch(elementwise(batch * inner)) }.map_err(self.err("rms_norm_channels"))?;
        Ok(out)
    }

    /// `nn.GroupNorm` over `[batch, channels, spatial]`.
    pub(crate) fn group_norm(
        &self,
        gamma: &Self,
        beta: &Self,
        [batch, channels, spatial]: [usize; 3],
        groups: usize,
        eps: f32,
    ) -> Result<Self> {
        let mut out = self.like(self.len)?;
        let f = self.device.function("norm", "group_norm_f32")?;
        let (c, s, g, silu) = (channels as u64, spatial as u64, groups as u64, 0i32);
        let cfg =
            LaunchConfig { grid_dim: ((batch * groups) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        unsafe {
            self.device
                .stream
                .launch_builder(&f)
                .arg(&self.data)
                .arg(&mut out.data)
                .arg(&gamma.data)
                .arg(&beta.data)
                .arg(&c)
                .arg(&s)
                .arg(&g)
                .arg(&eps)
                .arg(&silu)
                .launch(cfg)
        }
        .map_err(self.err("group_norm"))?;
        Ok(out)
    }

    /// The implicit-GEMM convolution (2-D convs are one frame, one temporal tap).
    pub(crate) fn conv3d(&self, weight: &Self, bias: Option<&Self>, g: ConvGeom) -> Result<Self> {
        let len = (g.n * g.cout * g.to * g.ho * g.wo) as usize;
        let mut out = self.like(len)?;
        let f = self.device.function("conv", "conv3d_f32")?;
        let cols = g.n * g.to * g.ho * g.wo;
        let grid_x = cols.div_ceil(64);
        let grid_y = g.cout.div_ceil(64);
        if grid_x > u32::MAX as u64 || grid_y > 65_535 {
            return Err(TensorError::InvalidArgument { op: "conv3d", reason: "too large for one launch".into() });
        }
        let cfg =
            LaunchConfig { grid_dim: (grid_x as u32, grid_y as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let accumulate = 0i32;
        let mut launch = self.device.stream.launch_builder(&f);
        launch.arg(&self.data).arg(&weight.data);
        match bias {
            Some(b) => launch.arg(&b.data),
            None => launch.arg(&NULL),
        };
        launch.arg(&mut out.data).arg(&g).arg(&accumulate);
        unsafe { launch.launch(cfg) }.map_err(self.err("conv3d"))?;
        Ok(out)
    }

    /// Nearest upsampling of the last two dimensions of `planes` planes of `h × w`.
    pub(crate) fn upsample_nearest2d(&self, planes: usize, h: usize, w: usize, factor: usize) -> Result<Self> {
        let len = planes * h * w * factor * factor;
        let mut out = self.like(len)?;
        let f = self.device.function("layout", "upsample_nearest2d_f32")?;
        let (p, hh, ww, k) = (planes as u64, h as u64, w as u64, factor as u64);
        unsafe {
            self.device
                .stream
                .launch_builder(&f)
                .arg(&self.data)
                .arg(&mut out.data)
                .arg(&p)
                .arg(&hh)
                .arg(&ww)
                .arg(&k)
                .launch(elementwise(len))
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
        let b = Box8::new(extent, src_strides, dst_strides).ok_or_else(|| TensorError::InvalidArgument {
            op: "copy_box",
            reason: format!("rank {} > 8 on CUDA", extent.len()),
        })?;
        let f = self.device.function("layout", "copy_box_f32")?;
        let total = n as u64;
        let src = self.data.slice(src_offset..);
        let mut dst_view = dst.data.slice_mut(dst_offset..);
        unsafe {
            self.device
                .stream
                .launch_builder(&f)
                .arg(&src)
                .arg(&mut dst_view)
                .arg(&b)
                .arg(&total)
                .launch(elementwise(n))
        }
        .map_err(self.err("copy_box"))?;
        Ok(())
    }

    /// Wan2.2's `DupUp3D` (see `layout.cu`): `dims` = `[batch, channels, t, h, w]`,
    /// `[out_channels, ft, fs, repeats, drop]`.
    pub(crate) fn dup_up3d(&self, dims: [usize; 5], params: [usize; 5], out_len: usize) -> Result<Self> {
        self.layout_kernel("dup_up3d_f32", dims, params, out_len)
    }

    /// Wan2.2's `AvgDown3D` (see `layout.cu`): `dims` = `[batch, channels, t, h, w]`,
    /// `[out_channels, ft, fs, group, pad_t]`.
    pub(crate) fn avg_down3d(&self, dims: [usize; 5], params: [usize; 5], out_len: usize) -> Result<Self> {
        self.layout_kernel("avg_down3d_f32", dims, params, out_len)
    }

    /// A `layout.cu` kernel taking `(x, out, five dims, five parameters)` as u64s.
    fn layout_kernel(&self, name: &'static str, dims: [usize; 5], params: [usize; 5], out_len: usize) -> Result<Self> {
        let mut out = self.like(out_len)?;
        let f = self.device.function("layout", name)?;
        let args: Vec<u64> = dims.iter().chain(&params).map(|&v| v as u64).collect();
        let mut launch = self.device.stream.launch_builder(&f);
        launch.arg(&self.data).arg(&mut out.data);
        for a in &args {
            launch.arg(a);
        }
        unsafe { launch.launch(elementwise(out_len)) }.map_err(self.err(name))?;
        Ok(out)
    }

    /// An empty (zero) tensor of `len` elements on the same device.
    pub(crate) fn zeros_like(&self, len: usize) -> Result<Self> {
        self.like(len)
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
        let f = self.device.function("gemm", "gemm_batched_f32")?;
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(64) as u32, m.div_ceil(64) as u32, batch as u32),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let dims = [m as u64, n as u64, k as u64];
        let strides: Vec<i64> = a_strides.iter().chain(&b_strides).chain(&[m * n, n]).map(|&v| v as i64).collect();
        let mut launch = self.device.stream.launch_builder(&f);
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

    /// Batched matrix product `[batch, m, k] · [batch, k, n]`, both dense.
    pub(crate) fn matmul(&self, rhs: &Self, [batch, m, n, k]: [usize; 4]) -> Result<Self> {
        let mut out = self.like(batch * m * n)?;
        self.gemm_batched(rhs, &mut out, [batch, m, n, k], [m * k, k, 1], [k * n, n, 1], 1.0, 0.0)?;
        Ok(out)
    }

    /// `F.linear` over `rows` rows: `x [rows, k] · weightᵀ [k, n] + bias`. As on the CPU (and in
    /// PyTorch's `addmm`), the bias is the value the product is added onto: the output starts
    /// as the bias broadcast over the rows (a box copy with row stride 0), then the GEMM adds to
    /// it with `beta = 1`.
    pub(crate) fn linear(&self, weight: &Self, bias: Option<&Self>, [rows, n, k]: [usize; 3]) -> Result<Self> {
        let mut out = self.like(rows * n)?;
        let beta = match bias {
            Some(b) => {
                b.copy_box_into(&[0, 1], 0, &mut out, &[n, 1], 0, &[rows, n])?;
                1.0
            }
            None => 0.0,
        };
        // Element (kk, j) of weightᵀ is weight[j, kk]: row stride 1, column stride k.
        self.gemm_batched(weight, &mut out, [1, rows, n, k], [0, k, 1], [0, 1, k], 1.0, beta)?;
        Ok(out)
    }

    /// Single-head attention `softmax(q kᵀ · scale) v` for `[batch, n, d]`, `[batch, m, d]`,
    /// `[batch, m, dv]`: two batched GEMMs around the row softmax.
    pub(crate) fn attention(
        q: &Self,
        k: &Self,
        v: &Self,
        [batch, n, m, d, dv]: [usize; 5],
        scale: f32,
    ) -> Result<Self> {
        let mut scores = q.like(batch * n * m)?;
        // Element (i, j) of kᵀ is k[j, i]: row stride 1, column stride d.
        q.gemm_batched(k, &mut scores, [batch, n, m, d], [n * d, d, 1], [m * d, 1, d], scale, 0.0)?;
        let softmax = q.device.function("attention", "softmax_rows_f32")?;
        let (rows, cols, one) = ((batch * n) as u64, m as u64, 1.0f32);
        let blocks = (batch * n).clamp(1, 1 << 20) as u32;
        let cfg_rows = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        unsafe {
            q.device
                .stream
                .launch_builder(&softmax)
                .arg(&mut scores.data)
                .arg(&rows)
                .arg(&cols)
                .arg(&one)
                .launch(cfg_rows)
        }
        .map_err(q.err("attention"))?;
        let mut out = q.like(batch * n * dv)?;
        scores.gemm_batched(v, &mut out, [batch, n, dv, m], [n * m, m, 1], [m * dv, dv, 1], 1.0, 0.0)?;
        Ok(out)
    }
}
