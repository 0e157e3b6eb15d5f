//! Timing the kernels whose rates a device profile holds: one convolution at a map size,
//! GroupNorm + SiLU, attention, and the link between two local ranks. `vae-parallel
//! calibrate` measures a whole profile with them; the first-use probe
//! ([`super::probe`]) times a few of the same kernels to scale the built-in one.

use std::sync::Arc;
use std::time::Instant;

use vae_tensor::cuda::synchronize;
use vae_tensor::{Conv2dParams, Conv3dParams, DType, Device, Tensor, TensorError};
use vae_transport::{Communicator, CommunicatorExt, TransportConfig, TransportError, run_local};

/// What a measurement can fail on.
#[derive(Debug, thiserror::Error)]
pub enum MeasureError {
    /// A tensor op (or the device) failed.
    #[error(transparent)]
    Tensor(#[from] TensorError),
    /// The link between the two measuring ranks failed.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// A measuring rank panicked.
    #[error("a measuring rank failed: {0}")]
    Rank(String),
    /// The measured constants cannot predict anything (a rate that is not positive).
    #[error("the measured constants are not usable: {0}")]
    Impossible(String),
    /// A thread pool for the measurement could not be built.
    #[error("a thread pool for the measurement: {0}")]
    Pool(#[from] rayon::ThreadPoolBuildError),
}

/// A measurement's result.
pub type Result<T, E = MeasureError> = std::result::Result<T, E>;

/// A convolution: kernel extent `[t, h, w]`, alignment class (1 direct, 2 and 4 Winograd: the
/// CPU's algorithm), input and output channels.
pub type ConvShape = ([usize; 3], usize, usize, usize);

/// How a device's convolutions are timed.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// Where the convolutions run.
    pub device: Device,
    /// Their element type.
    pub dtype: DType,
    /// The large map's side lies within these.
    pub sides: [usize; 2],
    /// Sides are multiples of this (on the CPU 8, so that every band alignment divides them).
    pub multiple: usize,
    /// Calls back to back per timed batch, on the large map and on the small one.
    pub calls: [usize; 2],
    /// Timed batches, the best kept.
    pub reps: usize,
}

impl Timing {
    /// One thread of the CPU (the calling pool's), in f32: one call a batch, the best of two.
    pub const CPU: Self =
        Self { device: Device::Cpu, dtype: DType::F32, sides: [8, 512], multiple: 8, calls: [1, 1], reps: 2 };
}

/// A seeded CPU tensor of `dims`, uniform in [-1, 1].
pub fn uniform(dims: Vec<usize>, seed: u64) -> Result<Tensor> {
    Ok(Tensor::seeded_uniform(dims, seed, -1.0, 1.0, &Device::Cpu)?)
}

/// One convolution on `timing`'s device: its seconds per call at a map of `side`² pixels (a 3-D
/// one over `frames` output frames), `calls` back to back, and the multiply-adds of a call.
pub fn conv_call(
    timing: &Timing,
    &(kernel, align, cin, cout): &ConvShape,
    (side, frames): (usize, usize),
    calls: usize,
) -> Result<(f64, f64)> {
    let [kt, k, _] = kernel;
    let frames = if kt > 1 { frames } else { 1 };
    let (device, dtype) = (timing.device, timing.dtype);
    let on = |t: Tensor| -> Result<Tensor> { Ok(t.to_device(&device)?.to_dtype(dtype)?) };
    let w = on(uniform(vec![cout, cin, kt, k, k], 2)?.mul_scalar(0.05)?)?;
    let b = uniform(vec![cout], 3)?.to_device(&device)?;
    let seconds = if kt > 1 {
        let x = on(uniform(vec![1, cin, frames + kt - 1, side, side], 1)?)?;
        let p = k / 2;
        let params = Conv3dParams::new([1, 1, 1], [0, 0, p, p, p, p]).band_aligned(align);
        per_call(device, calls, timing.reps, || Ok(x.conv3d(&w, Some(&b), &params)?))?
    } else {
        let x = on(uniform(vec![1, cin, side, side], 1)?)?;
        let w = w.reshape(vec![cout, cin, k, k])?;
        let params = Conv2dParams::same(k).band_aligned(align);
        per_call(device, calls, timing.reps, || Ok(x.conv2d(&w, Some(&b), &params)?))?
    };
    Ok((seconds, (cin * cout * kernel.iter().product::<usize>() * frames * side * side) as f64))
}

/// The side of a square map on which a convolution does about `budget` multiply-adds (a 3-D
/// one over `frames` output frames), within `least..=most`, rounded up to a multiple of
/// `multiple` (on the CPU 8, so that every band alignment divides it).
pub fn side_for(
    &(kernel, _, cin, cout): &ConvShape,
    budget: f64,
    frames: usize,
    [least, most]: [usize; 2],
    multiple: usize,
) -> usize {
    let frames = if kernel[0] > 1 { frames as f64 } else { 1.0 };
    let per_pixel = (cin * cout * kernel.iter().product::<usize>()) as f64;
    let least = least.max(multiple);
    ((budget / per_pixel / frames).sqrt() as usize).clamp(least, most.max(least)).next_multiple_of(multiple)
}

/// Seconds per call of `f` on `device` when `calls` run back to back (as a decode queues
/// them) and the device is waited for once: the best of `reps` such batches after one
/// untimed call. The outputs live until the wait, so that no buffer is reused early.
pub fn per_call<T>(device: Device, calls: usize, reps: usize, mut f: impl FnMut() -> Result<T>) -> Result<f64> {
    drop(f()?);
    synchronize(device)?;
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        let outs = (0..calls.max(1)).map(|_| f()).collect::<Result<Vec<T>>>()?;
        synchronize(device)?;
        best = best.min(t.elapsed().as_secs_f64() / calls.max(1) as f64);
        drop(outs);
    }
    Ok(best)
}

/// GroupNorm (32 groups) + SiLU over a `[1, 128, side, side]` map on `timing`'s device, `calls`
/// back to back: bytes read plus written per second, in billions.
pub fn norm_silu_gbps(timing: &Timing, side: usize, calls: usize) -> Result<f64> {
    let device = timing.device;
    let map = uniform(vec![1, 128, side, side], 4)?.to_device(&device)?.to_dtype(timing.dtype)?;
    let (gamma, beta) = (uniform(vec![128], 5)?.to_device(&device)?, uniform(vec![128], 6)?.to_device(&device)?);
    let seconds = per_call(device, calls, timing.reps, || Ok(map.group_norm_silu(32, &gamma, &beta, 1e-6)?))?;
    Ok(2.0 * (map.dims().iter().product::<usize>() * timing.dtype.size_in_bytes()) as f64 / seconds / 1e9)
}

/// Attention of `tokens` queries over as many keys, 512 channels, on `timing`'s device, `calls`
/// back to back: multiply-adds per second, in billions.
pub fn attention_gmacs(timing: &Timing, tokens: usize, calls: usize) -> Result<f64> {
    let q = uniform(vec![1, tokens, 512], 7)?.to_device(&timing.device)?.to_dtype(timing.dtype)?;
    let seconds = per_call(timing.device, calls, timing.reps, || Ok(Tensor::attention(&q, &q, &q)?))?;
    Ok(2.0 * (tokens * tokens * 512) as f64 / seconds / 1e9)
}

/// The link between two local ranks: one message's latency, microseconds (the mean of 200
/// barriers), and bytes per second, in billions (an all-gather of 32 MiB each way).
pub fn link() -> Result<(f64, f64)> {
    let results = run_local(2, TransportConfig::default(), |comm| -> Result<(f64, f64)> {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let rounds = 200;
        let t = Instant::now();
        for _ in 0..rounds {
            comm.barrier()?;
        }
        let latency_us = t.elapsed().as_secs_f64() / rounds as f64 * 1e6;
        let data = vec![1.0f32; 8 << 20];
        let mut gathered = Vec::new();
        comm.all_gather_into(&data, &mut gathered)?;
        let t = Instant::now();
        comm.all_gather_into(&data, &mut gathered)?;
        let gbps = (data.len() * 4) as f64 / t.elapsed().as_secs_f64() / 1e9;
        Ok((latency_us, gbps))
    })?;
    let mut out = (0.0f64, f64::INFINITY);
    for r in results {
        let (l, g) = r.map_err(MeasureError::Rank)??;
        out = (out.0.max(l), out.1.min(g));
    }
    Ok(out)
}

/// The CPU's model name (`/proc/cpuinfo`'s, where there is one) and the SIMD features the
/// kernels choose from.
pub fn cpu_name() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = info
        .lines()
        .find_map(|l| l.strip_prefix("model name").and_then(|r| r.split(':').nth(1)))
        .map_or("unknown CPU".to_string(), |m| m.trim().to_string());
    let flags: Vec<&str> = info
        .lines()
        .find_map(|l| l.strip_prefix("flags").and_then(|r| r.split(':').nth(1)))
        .map(|f| {
            f.split_whitespace().filter(|f| ["avx2", "fma", "avx512f", "avx512_bf16", "amx_tile"].contains(f)).collect()
        })
        .unwrap_or_default();
    format!("{model} ({})", flags.join(", "))
}
