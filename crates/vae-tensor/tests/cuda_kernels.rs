//! The hand-written CUDA kernels (`kernels-cu/`) against the CPU backend, kernel by kernel.
//!
//! Runs on a machine with a GPU and a build that embeds the kernels (`cargo xtask kernels`
//! first); elsewhere every test says why it is skipped and passes. The tolerances are those of
//! the op-conformance suite for f32, and bf16's 8-bit mantissa for the tensor-core conv.
#![cfg(feature = "cuda")]
#![allow(clippy::print_stderr)] // a skipped GPU test says so

use std::sync::Arc;

use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg,
    ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;
use vae_tensor::abi::{Box8, ConvGeom};
use vae_tensor::cuda::{embedded_modules, embedded_sm90a_modules, probe};
use vae_tensor::{Conv2dParams, Conv3dParams, Device, Tensor};

struct Gpu {
    stream: Arc<CudaStream>,
    modules: Vec<(&'static str, Arc<CudaModule>)>,
    /// Compute capability 9.0: the sm_90a modules are loaded too.
    sm90: bool,
}

impl Gpu {
    /// The first GPU with every embedded module loaded, or `None` with the reason printed.
    fn get(test: &str) -> Option<Self> {
        let info = match probe(0) {
            Ok(info) => info,
            Err(reason) => {
                eprintln!("{test}: skipped, {reason}");
                return None;
            }
        };
        if embedded_modules().is_empty() {
            eprintln!("{test}: skipped, this build embeds no kernels (run `cargo xtask kernels` before building)");
            return None;
        }
        let ctx = CudaContext::new(0).expect("the probe opened this device");
        let sm90 = info.compute_capability == (9, 0);
        let mut modules: Vec<_> = embedded_modules()
            .iter()
            .map(|m| {
                // The SASS where it matches the device, PTX (JIT) elsewhere.
                let image =
                    if sm90 { Ptx::from_binary(m.cubin_sm_90.to_vec()) } else { Ptx::from_src(m.ptx_compute_80) };
                (m.name, ctx.load_module(image).unwrap_or_else(|e| panic!("loading {}: {e}", m.name)))
            })
            .collect();
        // The Hopper-only kernels, on compute capability 9.0 alone.
        if sm90 {
            for m in embedded_sm90a_modules() {
                let image = Ptx::from_binary(m.cubin_sm_90a.to_vec());
                modules.push((m.name, ctx.load_module(image).unwrap_or_else(|e| panic!("loading {}: {e}", m.name))));
            }
        }
        Some(Self { stream: ctx.default_stream(), modules, sm90 })
    }

    fn function(&self, module: &str, name: &str) -> CudaFunction {
        let m = &self.modules.iter().find(|(n, _)| *n == module).unwrap_or_else(|| panic!("no module {module}")).1;
        m.load_function(name).unwrap_or_else(|e| panic!("{module}.{name}: {e}"))
    }

    fn upload(&self, t: &Tensor) -> CudaSlice<f32> {
        self.stream.clone_htod(t.as_slice_f32().unwrap()).unwrap()
    }

    fn zeros(&self, n: usize) -> CudaSlice<f32> {
        self.stream.alloc_zeros::<f32>(n).unwrap()
    }

    fn download(&self, d: &CudaSlice<f32>, dims: &[usize]) -> Tensor {
        let v = self.stream.clone_dtoh(d).unwrap();
        Tensor::from_vec(v, dims.to_vec(), &Device::Cpu).unwrap()
    }
}

/// A deterministic tensor in about [-1, 1].
fn pattern(dims: &[usize], seed: u64) -> Tensor {
    Tensor::seeded_uniform(dims.to_vec(), seed, -1.0, 1.0, &Device::Cpu).unwrap()
}

fn grid(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((n as u32).div_ceil(256).clamp(1, 65535), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn close(got: &Tensor, want: &Tensor, tol: f32, what: &str) {
    assert_eq!(got.dims(), want.dims(), "{what}");
    let diff = got.max_abs_diff(want).unwrap();
    assert!(diff <= tol, "{what}: max |gpu - cpu| = {diff} > {tol}");
}

const NULL: u64 = 0;

#[test]
fn every_module_loads_and_has_its_entry_points() {
    let Some(gpu) = Gpu::get("entry points") else { return };
    let expected: &[(&str, &[&str])] = &[
        ("attention", &["softmax_rows_f32", "softmax_rows_to_bf16"]),
        (
            "conv",
            &[
                "conv_input_channels_last_bf16",
                "conv_weight_channels_last_bf16",
                "conv3d_tc_bf16_m4",
                "conv3d_tc_bf16_m3",
                "conv3d_tc_bf16_m2",
                "conv_input_channels_last_f32",
                "conv_weight_channels_last_f32",
                "conv3d_tc_f32_m3",
                "conv3d_tc_f32_m2",
                "conv3d_tc_tf32_m4",
                "conv3d_tc_tf32_m3",
                "conv3d_tc_tf32_m2",
                "conv3d_tc_bf16_m4_n256",
                "conv3d_tc_bf16_m3_n256",
                "conv3d_tc_bf16_m2_n256",
                "conv3d_tc_f32_m3_n256",
                "conv3d_tc_f32_m2_n256",
                "conv3d_tc_tf32_m4_n256",
                "conv3d_tc_tf32_m3_n256",
                "conv3d_tc_tf32_m2_n256",
                "conv3d_tc_bf16_f32out_m4",
                "conv3d_small_cout_f32_c4",
                "conv3d_small_cout_bf16_c4",
            ],
        ),
        (
            "elementwise",
            &[
                "add_f32",
                "add_bf16",
                "silu_f32",
                "silu_bf16",
                "silu_into_f32",
                "silu_into_bf16",
                "clamp_f32",
                "clamp_bf16",
                "affine_f32",
                "channel_affine_f32",
                "cast_f32_bf16",
                "cast_bf16_f32",
            ],
        ),
        ("gemm", &["gemm_batched_f32"]),
        (
            "layout",
            &[
                "copy_box_f32",
                "copy_box_u16",
                "upsample_nearest2d_f32",
                "dup_up3d_f32",
                "avg_down3d_f32",
                "blend_leading_f32",
            ],
        ),
        (
            "norm",
            &[
                "group_norm_partials_f32",
                "group_norm_partials_bf16",
                "group_norm_stats",
                "group_norm_apply_f32",
                "group_norm_apply_bf16",
                "rms_norm_channels_f32",
                "rms_norm_channels_bf16",
                "rms_norm_channels_x4_bf16",
            ],
        ),
    ];
    for (module, names) in expected {
        for name in *names {
            gpu.function(module, name);
        }
    }
    if gpu.sm90 {
        for n in WGMMA_CHANNELS {
            gpu.function("conv_sm90a", &format!("conv3d_wgmma_bf16_n{n}"));
        }
    }
}

/// The output channels of conv_sm90a.cu's tiles.
const WGMMA_CHANNELS: [u64; 4] = [96, 128, 192, 256];

#[test]
fn elementwise_kernels_match_the_cpu() {
    let Some(gpu) = Gpu::get("elementwise") else { return };
    let (a, b) = (pattern(&[3, 5, 7], 1), pattern(&[3, 5, 7], 2));
    let n = a.elem_count() as u64;
    let (da, db, mut out) = (gpu.upload(&a), gpu.upload(&b), gpu.zeros(a.elem_count()));
    let f = gpu.function("elementwise", "add_f32");
    // SAFETY: `add_f32(const float* a, const float* b, float* out, u64 n)`: three f32 buffers of
    // `n` elements, then `n`; the kernel touches elements below `n` whatever the grid.
    unsafe { gpu.stream.launch_builder(&f).arg(&da).arg(&db).arg(&mut out).arg(&n).launch(grid(n as usize)) }.unwrap();
    close(&gpu.download(&out, a.dims()), &a.add(&b).unwrap(), 0.0, "add");

    let f = gpu.function("elementwise", "silu_f32");
    let mut x = gpu.upload(&a);
    // SAFETY: `silu_f32(float* x, u64 n)`: `x` holds `n` f32, and the kernel touches no more.
    unsafe { gpu.stream.launch_builder(&f).arg(&mut x).arg(&n).launch(grid(n as usize)) }.unwrap();
    close(&gpu.download(&x, a.dims()), &a.silu().unwrap(), 1e-6, "silu");

    let f = gpu.function("elementwise", "clamp_f32");
    let mut x = gpu.upload(&a.affine(3.0, 0.0).unwrap());
    let (lo, hi) = (-1.0f32, 1.0f32);
    // SAFETY: `clamp_f32(float* x, u64 n, float lo, float hi)`: `x` holds `n` f32, and the
    // kernel touches no more.
    unsafe { gpu.stream.launch_builder(&f).arg(&mut x).arg(&n).arg(&lo).arg(&hi).launch(grid(n as usize)) }.unwrap();
    close(&gpu.download(&x, a.dims()), &a.affine(3.0, 0.0).unwrap().clamp(-1.0, 1.0).unwrap(), 0.0, "clamp");
}

#[test]
fn the_rms_norm_matches_the_cpu() {
    let Some(gpu) = Gpu::get("norms") else { return };
    let x = pattern(&[2, 12, 3, 5, 6], 3);
    let gamma = pattern(&[12], 4);
    let (dx, dg, mut out) = (gpu.upload(&x), gpu.upload(&gamma), gpu.zeros(x.elem_count()));
    let (batch, channels, inner) = (2u64, 12u64, 90u64);
    let (eps, silu) = (1e-12f32, 0i32);
    let f = gpu.function("norm", "rms_norm_channels_f32");
    // SAFETY: `rms_norm_channels_f32(const float* x, float* out, const float* gamma, const float*
    // bias, u64 batch, u64 channels, u64 inner, float eps, int fuse_silu)`, pushed in that order:
    // `x` and `out` hold `batch · channels · inner` f32, `gamma` a value per channel, `bias` is
    // null; blocks of 256 threads are within the kernel's launch bound of 768.
    unsafe {
        gpu.stream
            .launch_builder(&f)
            .arg(&dx)
            .arg(&mut out)
            .arg(&dg)
            .arg(&NULL)
            .arg(&batch)
            .arg(&channels)
            .arg(&inner)
            .arg(&eps)
            .arg(&silu)
            .launch(grid((batch * inner) as usize))
    }
    .unwrap();
    close(&gpu.download(&out, x.dims()), &x.rms_norm_channels(&gamma, None, 1, 1e-12).unwrap(), 1e-5, "rms norm");

    // GroupNorm is four launches (chunk sums, squared deviations, statistics, apply): checked
    // through the op in cuda_ops and the conformance suite, and kernel by kernel in the emulator.
}

/// The `ConvGeom` of an NCTHW input, a `[Cout, Cin, kt, kh, kw]` weight and `p`.
fn geometry(x: &Tensor, w: &Tensor, p: &Conv3dParams) -> ConvGeom {
    let (d, k) = (x.dims(), w.dims());
    let [to, ho, wo] = p.output_size([d[2], d[3], d[4]], [k[2], k[3], k[4]]).unwrap();
    let u = |v: usize| v as u64;
    ConvGeom {
        n: u(d[0]),
        cin: u(d[1]),
        t: u(d[2]),
        h: u(d[3]),
        w: u(d[4]),
        cout: u(k[0]),
        kt: u(k[2]),
        kh: u(k[3]),
        kw: u(k[4]),
        to: u(to),
        ho: u(ho),
        wo: u(wo),
        stride_t: u(p.stride[0]),
        stride: u(p.stride[1]),
        pad_front: p.padding[0] as i64,
        pad_top: p.padding[2] as i64,
        pad_left: p.padding[4] as i64,
    }
}

/// A GEMM kernel of the tensor-core conv pipeline.
#[derive(Debug, Clone, Copy)]
enum Gemm {
    /// conv.cu's `conv3d_tc_{gemm}_m{mt}`: tiles of `32 * mt` output channels by `pixels` output
    /// pixels (256: the `_n256` kernel, allowed and given its four stages of dynamic shared
    /// memory, conv.cu's `TC_WIDE_SMEM`).
    Mma { mt: u64, pixels: u64 },
    /// conv_sm90a.cu's `conv3d_wgmma_bf16_n{channels}`: tiles of 128 pixels by `channels`, with
    /// `WGMMA_SMEM(channels)` bytes of dynamic shared memory.
    Wgmma { channels: u64 },
}

/// The tensor-core conv pipeline kernel by kernel, as the backend launches it: input and
/// weights into their zero-padded channels-last copies ([`ConvGeom::channels_last`],
/// `conv_*_channels_last_{copies}`), then the GEMM of `tile` (`{gemm}` names the mma.sync
/// kernels' products). `T` is the storage type (`f32`, or `u16` holding bf16 bits); the bias is
/// f32.
#[allow(clippy::too_many_arguments)] // the pipeline's operands and its three kernels
fn tensor_core_conv<T: DeviceRepr + ValidAsZeroBits>(
    gpu: &Gpu,
    x: &CudaSlice<T>,
    w: &CudaSlice<T>,
    bias: &CudaSlice<f32>,
    g: &ConvGeom,
    copies: &str,
    gemm: &str,
    tile: Gemm,
) -> CudaSlice<T> {
    let p = g.channels_last(std::mem::size_of::<T>() as u64);
    let mut xp = gpu.stream.alloc_zeros::<T>((g.n * p.t * p.h * p.w * p.c) as usize).unwrap();
    let f = gpu.function("conv", &format!("conv_input_channels_last_{copies}"));
    let cfg = LaunchConfig {
        grid_dim: ((g.n * p.t * p.h) as u32, p.w.div_ceil(64) as u32, p.c.div_ceil(32) as u32),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: `conv_input_channels_last_{copies}(const T* x, T* xp, ConvGeom g)`, `T` the type of
    // the `{copies}` the callers name: `x` holds the `[n, cin, t, h, w]` input `g` describes (the
    // callers build `g` from its tensor), `xp` the padded `[n, tp, hp, wp, cp]`, and the grid has
    // one block per padded row.
    unsafe { gpu.stream.launch_builder(&f).arg(x).arg(&mut xp).arg(g).launch(cfg) }.unwrap();
    let wr_len = (g.cout * g.kt * g.kh * g.kw * p.c) as usize;
    let mut wr = gpu.stream.alloc_zeros::<T>(wr_len).unwrap();
    let f = gpu.function("conv", &format!("conv_weight_channels_last_{copies}"));
    // SAFETY: `conv_weight_channels_last_{copies}(const T* w, T* wr, ConvGeom g)`: `w` holds the
    // `[cout, cin, kt, kh, kw]` weights of `g`, `wr` the `cout · taps · cp` the kernel writes.
    unsafe { gpu.stream.launch_builder(&f).arg(w).arg(&mut wr).arg(g).launch(grid(wr_len)) }.unwrap();
    let mut out = gpu.stream.alloc_zeros::<T>((g.n * g.cout * g.to * g.ho * g.wo) as usize).unwrap();
    let cols = g.n * g.to * g.ho * g.wo;
    let (module, name, shared, (pixels, rows)) = match tile {
        Gemm::Mma { mt, pixels: 128 } => ("conv", format!("conv3d_tc_{gemm}_m{mt}"), 0, (128, 32 * mt)),
        Gemm::Mma { mt, pixels: 256 } => {
            ("conv", format!("conv3d_tc_{gemm}_m{mt}_n256"), 4 * (32 * mt as u32 + 256) * 64, (256, 32 * mt))
        }
        Gemm::Mma { pixels, .. } => panic!("no tiles of {pixels} pixels"),
        Gemm::Wgmma { channels } => {
            let stages = if channels >= 192 { 5 } else { 6 };
            let shared = (stages * (channels + 128) * 64 + 512) as u32;
            ("conv_sm90a", format!("conv3d_wgmma_bf16_n{channels}"), shared, (128, channels))
        }
    };
    let cfg = LaunchConfig {
        grid_dim: (cols.div_ceil(pixels) as u32, g.cout.div_ceil(rows) as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: shared,
    };
    let f = gpu.function(module, &name);
    if shared > 0 {
        f.set_attribute(CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared as i32)
            .unwrap();
    }
    // SAFETY: every GEMM kernel is `(const T* xp, const T* wr, const float* bias, T* out, ConvGeom
    // g)`, `T` that of the `{gemm}` the callers name: `xp` and `wr` as made above, `bias` a value
    // per output channel, `out` the whole `[n, cout, to, ho, wo]`; the grid covers the tiles and
    // the kernel was allowed, and is given, the dynamic shared memory its stages take.
    unsafe { gpu.stream.launch_builder(&f).arg(&xp).arg(&wr).arg(bias).arg(&mut out).arg(g).launch(cfg) }.unwrap();
    out
}

/// An f32 pipeline (`suffix` `f32` or `tf32`) for an NCTHW input with the given padding and
/// strides, tiles of `32 * mt` output channels by `pixels`.
fn gpu_conv3d(gpu: &Gpu, x: &Tensor, w: &Tensor, bias: &Tensor, p: &Conv3dParams, suffix: &str, tile: Gemm) -> Tensor {
    let g = geometry(x, w, p);
    let out_dims = [x.dims()[0], w.dims()[0], g.to as usize, g.ho as usize, g.wo as usize];
    // The TF32 kernels read the f32 pipeline's channels-last copies.
    let copies = if suffix == "tf32" { "f32" } else { suffix };
    let out = tensor_core_conv(gpu, &gpu.upload(x), &gpu.upload(w), &gpu.upload(bias), &g, copies, suffix, tile);
    gpu.download(&out, &out_dims)
}

/// f32 on TF32 tensor cores with each operand split in two (three products, heights 96 and 64):
/// within 1e-4 of the CPU's f32 conv, as the CUDA-core kernel it replaced. TF32 mode (one product,
/// heights 128, 96 and 64): within 2^-10 of the magnitude summed, at most 216 products of at most
/// 0.1 here, about 0.021. Every height at both tile widths (128 and 256 pixels).
#[test]
fn the_implicit_gemm_conv_matches_the_cpu_conv3d_and_conv2d() {
    let Some(gpu) = Gpu::get("conv") else { return };
    let runs = [("f32", 3, 1e-4), ("f32", 2, 1e-4), ("tf32", 4, 0.025), ("tf32", 3, 0.025), ("tf32", 2, 0.025)];
    for ((suffix, mt, tol), pixels) in runs.into_iter().flat_map(|r| [(r, 128), (r, 256)]) {
        let tile = Gemm::Mma { mt, pixels };
        let label = format!("{suffix} m{mt} x {pixels}");
        // Wan's causal 3x3x3 conv: two zero frames in front, one row / column each side.
        let x = pattern(&[1, 8, 3, 9, 11], 8);
        let w = pattern(&[70, 8, 3, 3, 3], 9).affine(0.1, 0.0).unwrap();
        let b = pattern(&[70], 10);
        let p = Conv3dParams::causal([1, 1, 1], [1, 1, 1]);
        let got = gpu_conv3d(&gpu, &x, &w, &b, &p, suffix, tile);
        close(&got, &x.conv3d(&w, Some(&b), &p).unwrap(), tol, &format!("causal conv3d, {label}"));
        // diffusers' stride-2 downsample as a one-frame conv3d (5 channels: padded to 8).
        let img = pattern(&[2, 5, 1, 12, 10], 11);
        let w2 = pattern(&[7, 5, 1, 3, 3], 12).affine(0.2, 0.0).unwrap();
        let b2 = pattern(&[7], 13);
        let p2 = Conv3dParams::new([1, 2, 2], [0, 0, 0, 1, 0, 1]);
        let cpu = img
            .reshape(vec![2, 5, 12, 10])
            .unwrap()
            .conv2d(&w2.reshape(vec![7, 5, 3, 3]).unwrap(), Some(&b2), &Conv2dParams::diffusers_downsample())
            .unwrap();
        let got = gpu_conv3d(&gpu, &img, &w2, &b2, &p2, suffix, tile);
        close(&got.reshape(cpu.dims().to_vec()).unwrap(), &cpu, tol, &format!("stride-2 conv2d, {label}"));
    }
}

/// `c[b] = alpha · a[b] · b[b]` through `gemm_batched_f32`, operands given by their
/// `[batch, row, column]` element strides.
#[allow(clippy::too_many_arguments)] // the kernel's own parameters
fn gemm(
    gpu: &Gpu,
    a: &CudaSlice<f32>,
    b: &CudaSlice<f32>,
    c: &mut CudaSlice<f32>,
    [batch, m, n, k]: [usize; 4],
    a_strides: [usize; 3],
    b_strides: [usize; 3],
    alpha: f32,
) {
    let f = gpu.function("gemm", "gemm_batched_f32");
    let cfg = LaunchConfig {
        grid_dim: ((n as u32).div_ceil(64), (m as u32).div_ceil(64), batch as u32),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let dims = [m as u64, n as u64, k as u64];
    let strides: Vec<i64> = a_strides.iter().chain(&b_strides).chain(&[m * n, n]).map(|&v| v as i64).collect();
    let beta = 0.0f32;
    let mut launch = gpu.stream.launch_builder(&f);
    launch.arg(a).arg(b).arg(c);
    for d in &dims {
        launch.arg(d);
    }
    for st in &strides {
        launch.arg(st);
    }
    launch.arg(&alpha).arg(&beta);
    // SAFETY: `gemm_batched_f32(const float* A, const float* B, float* C, u64 M, u64 N, u64 K,
    // i64 a_batch, a_rs, a_cs, b_batch, b_rs, b_cs, c_batch, ldc, float alpha, float beta)`,
    // pushed in that order; the callers' strides keep every `[batch, m, k]`, `[batch, k, n]` and
    // dense `[batch, m, n]` element inside `a`, `b` and `c`, and blocks are the 256 threads the
    // kernel's tiles take.
    unsafe { launch.launch(cfg) }.unwrap();
}

#[test]
fn gemm_and_softmax_make_the_cpu_attention() {
    let Some(gpu) = Gpu::get("attention") else { return };
    let (batch, len, dim) = (2usize, 37usize, 24usize);
    let q = pattern(&[batch, len, dim], 14);
    let k = pattern(&[batch, len, dim], 15);
    let v = pattern(&[batch, len, dim], 16);
    let (dq, dk, dv) = (gpu.upload(&q), gpu.upload(&k), gpu.upload(&v));
    let mut scores = gpu.zeros(batch * len * len);
    // K^T: element (i, j) of the right operand is K[j, i].
    gemm(&gpu, &dq, &dk, &mut scores, [batch, len, len, dim], [len * dim, dim, 1], [len * dim, 1, dim], 1.0);
    let softmax = gpu.function("attention", "softmax_rows_f32");
    let (rows, cols, scale) = ((batch * len) as u64, len as u64, 1.0f32 / (dim as f32).sqrt());
    let cfg_rows = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: `softmax_rows_f32(float* x, u64 rows, u64 cols, float scale)`: `scores` holds
    // `rows · cols` f32; blocks of 128 threads are whole warps.
    unsafe { gpu.stream.launch_builder(&softmax).arg(&mut scores).arg(&rows).arg(&cols).arg(&scale).launch(cfg_rows) }
        .unwrap();
    let mut out = gpu.zeros(batch * len * dim);
    gemm(&gpu, &scores, &dv, &mut out, [batch, len, dim, len], [len * len, len, 1], [len * dim, dim, 1], 1.0);
    close(&gpu.download(&out, q.dims()), &Tensor::attention(&q, &k, &v).unwrap(), 1e-5, "attention");
}

/// The tensor-core conv pipeline (bf16 in, f32 accumulation, bf16 out), launched kernel by
/// kernel as the backend does: input and weights into channels-last copies, then the GEMM at
/// each of the three tile heights. Inputs and weights are rounded to bf16 on the device
/// (`cast_f32_bf16`), the result compared with the f32 CPU conv of the same rounded values within
/// bf16's output rounding. 20 input channels (not a multiple of 8: zero-padded) and 200 output
/// channels (a partial last tile at every height).
#[test]
fn the_tensor_core_conv_matches_the_cpu_conv_within_bf16_rounding() {
    let Some(gpu) = Gpu::get("bf16 conv") else { return };
    let (cin, cout) = (20usize, 200usize);
    let x = pattern(&[1, cin, 2, 9, 11], 23);
    let w = pattern(&[cout, cin, 3, 3, 3], 24).affine(0.1, 0.0).unwrap();
    let b = pattern(&[cout], 25);
    let p = Conv3dParams::causal([1, 1, 1], [1, 1, 1]);
    let to_bf16 = |t: &Tensor| -> CudaSlice<u16> {
        let src = gpu.upload(t);
        let mut out = gpu.stream.alloc_zeros::<u16>(t.elem_count()).unwrap();
        let f = gpu.function("elementwise", "cast_f32_bf16");
        let n = t.elem_count() as u64;
        // SAFETY: `cast_f32_bf16(const float* x, unsigned short* out, u64 n)`: both hold `n`
        // elements.
        unsafe { gpu.stream.launch_builder(&f).arg(&src).arg(&mut out).arg(&n).launch(grid(n as usize)) }.unwrap();
        out
    };
    let to_f32 = |d: &CudaSlice<u16>, dims: &[usize]| -> Tensor {
        let n: usize = dims.iter().product();
        let mut out = gpu.zeros(n);
        let f = gpu.function("elementwise", "cast_bf16_f32");
        let n64 = n as u64;
        // SAFETY: `cast_bf16_f32(const unsigned short* x, float* out, u64 n)`: both hold `n`
        // elements (`d` holds the `dims` its callers name).
        unsafe { gpu.stream.launch_builder(&f).arg(d).arg(&mut out).arg(&n64).launch(grid(n)) }.unwrap();
        gpu.download(&out, dims)
    };
    let (xb, wb) = (to_bf16(&x), to_bf16(&w));
    let want = to_f32(&xb, x.dims()).conv3d(&to_f32(&wb, w.dims()), Some(&b), &p).unwrap();
    let g = geometry(&x, &w, &p);
    let out_dims = [1, cout, g.to as usize, g.ho as usize, g.wo as usize];
    let db = gpu.upload(&b);
    let mut reference = None;
    for mt in [4, 3, 2] {
        let narrow = tensor_core_conv(&gpu, &xb, &wb, &db, &g, "bf16", "bf16", Gemm::Mma { mt, pixels: 128 });
        let got = to_f32(&narrow, &out_dims);
        // Output rounding to bf16: 2^-8 relative; the values here stay below 8.
        close(&got, &want, 8.0 / 256.0, &format!("conv3d_tc_bf16_m{mt}"));
        // The wide tiles sum every output in the same order: the same bits.
        let wide = tensor_core_conv(&gpu, &xb, &wb, &db, &g, "bf16", "bf16", Gemm::Mma { mt, pixels: 256 });
        let (narrow, wide) = (gpu.stream.clone_dtoh(&narrow).unwrap(), gpu.stream.clone_dtoh(&wide).unwrap());
        assert!(narrow == wide, "conv3d_tc_bf16_m{mt}_n256 differs from conv3d_tc_bf16_m{mt}");
        reference = Some((got, narrow));
    }
    // Hopper's warpgroup MMA at every tile width (200 channels: one partial tile of 256, two of
    // 96 and 128 with a partial one, a partial tile of 192). Every width runs and reports before
    // any fails, with where its wrong outputs fall (a wrong operand layout shows as a pattern in
    // the channels or in the pixels).
    if gpu.sm90 {
        let (mma, mma_bits) = reference.expect("the mma.sync kernels ran");
        let plane = out_dims[2..].iter().product::<usize>();
        let mut failed = Vec::new();
        for channels in WGMMA_CHANNELS {
            let name = format!("conv3d_wgmma_bf16_n{channels}");
            let out = tensor_core_conv(&gpu, &xb, &wb, &db, &g, "bf16", "bf16", Gemm::Wgmma { channels });
            let got = to_f32(&out, &out_dims);
            let same = gpu.stream.clone_dtoh(&out).unwrap() == mma_bits;
            let (got_v, want_v) = (got.to_vec_f32().unwrap(), want.to_vec_f32().unwrap());
            // NaN counts as off.
            let off = |i: usize| (got_v[i] - want_v[i]).abs().is_nan() || (got_v[i] - want_v[i]).abs() > 8.0 / 256.0;
            let wrong: Vec<usize> = (0..got_v.len()).filter(|&i| off(i)).collect();
            eprintln!(
                "{name}: {} from the CPU, {} from mma.sync (bit-identical: {same}); {} of {} outputs off",
                got.max_abs_diff(&want).unwrap(),
                got.max_abs_diff(&mma).unwrap(),
                wrong.len(),
                got_v.len()
            );
            if !wrong.is_empty() {
                let mut channels_off: Vec<usize> = wrong.iter().map(|i| i / plane).collect();
                let mut pixels_off: Vec<usize> = wrong.iter().map(|i| i % plane).collect();
                channels_off.dedup();
                pixels_off.sort_unstable();
                pixels_off.dedup();
                eprintln!(
                    "  {} channels off (first {:?}), {} pixels off (first {:?})",
                    channels_off.len(),
                    &channels_off[..channels_off.len().min(16)],
                    pixels_off.len(),
                    &pixels_off[..pixels_off.len().min(16)]
                );
                failed.push(name);
            }
        }
        assert!(failed.is_empty(), "outside bf16 rounding of the CPU: {failed:?}");
    }
}

#[test]
fn layout_kernels_match_the_cpu() {
    let Some(gpu) = Gpu::get("layout") else { return };
    // A permute through the generic box copy: [2, 3, 4, 5] -> [2, 4, 3, 5].
    let x = pattern(&[2, 3, 4, 5], 17);
    let want = x.permute(&[0, 2, 1, 3]).unwrap();
    let b = Box8::new(&[2, 4, 3, 5], &[60, 5, 20, 1], &[60, 15, 5, 1]).unwrap();
    let (dx, mut out) = (gpu.upload(&x), gpu.zeros(120));
    let n = 120u64;
    let f = gpu.function("layout", "copy_box_f32");
    // SAFETY: `copy_box_f32(const float* src, float* dst, Box8 box, u64 n)`: the box's farthest
    // element is at offset 1·60 + 3·5 + 2·20 + 4 = 119 in `src` and 1·60 + 3·15 + 2·5 + 4 = 119 in
    // `dst`, both of 120 f32.
    unsafe { gpu.stream.launch_builder(&f).arg(&dx).arg(&mut out).arg(&b).arg(&n).launch(grid(120)) }.unwrap();
    close(&gpu.download(&out, want.dims()), &want, 0.0, "permute");

    let up = x.upsample_nearest2d(2).unwrap();
    let mut out = gpu.zeros(up.elem_count());
    let (planes, h, w, f2) = (6u64, 4u64, 5u64, 2u64);
    let f = gpu.function("layout", "upsample_nearest2d_f32");
    // SAFETY: `upsample_nearest2d_f32(const float* x, float* out, u64 planes, u64 h, u64 w, u64
    // f)`: `dx` holds the 6 · 4 · 5 inputs, `out` the `up` tensor's 6 · 8 · 10 outputs.
    unsafe {
        gpu.stream
            .launch_builder(&f)
            .arg(&dx)
            .arg(&mut out)
            .arg(&planes)
            .arg(&h)
            .arg(&w)
            .arg(&f2)
            .launch(grid(up.elem_count()))
    }
    .unwrap();
    close(&gpu.download(&out, up.dims()), &up, 0.0, "upsample");

    // Wan2.2's DupUp3D of the first chunk and AvgDown3D with a zero frame in front.
    let v = pattern(&[1, 8, 2, 3, 4], 18);
    let want = v.dup_up3d(2, 2, 4, true).unwrap();
    let mut out = gpu.zeros(want.elem_count());
    let dv = gpu.upload(&v);
    let args = [1u64, 8, 2, 3, 4, 4, 2, 2, 4 * 8 / 8, 1];
    let f = gpu.function("layout", "dup_up3d_f32");
    let mut launch = gpu.stream.launch_builder(&f);
    launch.arg(&dv).arg(&mut out);
    for a in &args {
        launch.arg(a);
    }
    // SAFETY: `dup_up3d_f32(const float* x, float* out, u64 batch, channels, t, h, w,
    // out_channels, ft, fs, repeats, drop)`: `dv` holds the `[1, 8, 2, 3, 4]` input, `out` the
    // `[1, 4, 3, 6, 8]` output, and the 4 · 2 · 2 · 2 folded channels read 32 / 4 = 8 inputs.
    unsafe { launch.launch(grid(want.elem_count())) }.unwrap();
    close(&gpu.download(&out, want.dims()), &want, 0.0, "dup_up3d");

    let v = pattern(&[1, 4, 3, 4, 6], 19);
    let want = v.avg_down3d(2, 2, 8).unwrap();
    let mut out = gpu.zeros(want.elem_count());
    let dv = gpu.upload(&v);
    // 4 channels x 8 = 32 folded channels averaged in groups of 4; one zero frame in front.
    let args = [1u64, 4, 3, 4, 6, 8, 2, 2, 4, 1];
    let f = gpu.function("layout", "avg_down3d_f32");
    let mut launch = gpu.stream.launch_builder(&f);
    launch.arg(&dv).arg(&mut out);
    for a in &args {
        launch.arg(a);
    }
    // SAFETY: `avg_down3d_f32(const float* x, float* out, u64 batch, channels, t, h, w,
    // out_channels, ft, fs, group, pad_t)`: `dv` holds the `[1, 4, 3, 4, 6]` input, `out` the
    // `[1, 8, 2, 2, 3]` output, whose 8 · 4 folded channels are the input's 4 · 2 · 2 · 2.
    unsafe { launch.launch(grid(want.elem_count())) }.unwrap();
    close(&gpu.download(&out, want.dims()), &want, 1e-7, "avg_down3d");
}
