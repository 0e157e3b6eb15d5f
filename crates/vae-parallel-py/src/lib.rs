//! `vae_parallel`'s native module (`vae_parallel._native`): load a diffusers VAE directory
//! once, then decode and encode arrays on one or several ranks (threads of this process, or
//! processes joined over sockets, torchrun's way included), with the bits the CLI writes for the
//! same model, input and options.
//!
//! Inputs are read through DLPack ([`dlpack`]): any object with `__dlpack__` and
//! `__dlpack_device__` on the host (NumPy ≥ 1.22 arrays, torch tensors, CuPy's and JAX's host
//! arrays) of a float type, or on the CUDA device the model computes on (torch, CuPy, ...: read
//! there in place, on our stream; see [`dlpack::read`]). A torch tensor on another device is
//! copied to the host by torch first, a device tensor of another library is refused. Anything
//! else `numpy.asarray(x, dtype=float32)` accepts (lists, older NumPy) goes through NumPy. A
//! row-major float32 input is read in place, not copied (so it must not be written while the
//! request runs); any other is converted once. Results are [`dlpack::DlpackTensor`]s that own
//! the decoder's memory, adopted without a copy by `numpy.from_dlpack` (NumPy input, and the
//! default) or `torch.from_dlpack` (torch input; then moved to the input's device). An input on
//! the model's GPU gives a result on that GPU (which stays there on one rank untiled; see
//! `Vae::run` in the library for the paths that cross the host): a torch tensor on it, or the
//! `DLPackTensor` itself for other libraries (`cupy.from_dlpack` adopts it). The GIL is
//! released while a model loads and while a request runs. Errors are Python exceptions under
//! `VaeParallelError`, with the library's one-line messages (options named as the keywords).
//!
//! This crate is the bindings only: loading, resolving the keywords, running a request on a
//! group and its errors are the `vae-parallel` library's ([`Vae`], [`Settings`], [`Group`]).

mod devices;
mod dlpack;
mod errors;
mod interrupt;

use std::any::Any;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use numpy::{PyArrayDyn, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use vae_parallel::models::Direction;
use vae_parallel::report::RequestReport;
use vae_parallel::settings::Settings;
use vae_parallel::{
    CancelToken, Decode, Device, Encode, EncodeOutput, FrameSink, Group, Options, ParallelMode, Request, Tensor,
    Tiling, Vae,
};

use crate::errors::{
    ConfigError, ExecutionError, GroupError, InputError, ModelError, VaeParallelError, config_error, message, to_py,
};

/// A loaded VAE and the group its requests run on: returned by [`load`].
#[pyclass(name = "Vae", module = "vae_parallel", frozen)]
struct PyVae {
    vae: Vae,
    group: Arc<Group>,
    /// The options of every request (a request may name another mode).
    options: Options,
    /// The report of the last request that succeeded (rank 0's view of every rank).
    last_report: Mutex<Option<RequestReport>>,
}

/// The socket group of this process: joined once, on the first model loaded with
/// `transport="socket"`, and shared by every such model after it (a process is one rank of one
/// group; joining again would need every other rank to join again too).
fn socket_group(py: Python<'_>) -> PyResult<Arc<Group>> {
    static GROUP: Mutex<Option<Arc<Group>>> = Mutex::new(None);
    // Locked without the GIL: a second thread loading meanwhile waits here, not holding it.
    py.detach(|| {
        let mut group = GROUP.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(g) = group.as_ref() {
            return Ok(Arc::clone(g));
        }
        let joined = Arc::new(Group::from_env().map_err(|e| to_py(&e))?);
        *group = Some(Arc::clone(&joined));
        Ok(joined)
    })
}

/// Loads the diffusers VAE directory `model`.
///
/// - `device`: `"cpu"`, `"cuda"` or `"cuda:N"` (`"cuda"` is `cuda:LOCAL_RANK` under torchrun);
///   `dtype`: `"f32"` or `"bf16"` (on the CPU, bf16 needs AVX512-BF16).
/// - `transport`: `"local"`, `ranks` threads of this process (default 1), or `"socket"`: this
///   process is one rank of a group of processes, which it joins on its first such load (every
///   model it loads later shares the group), from `VAE_RANK`, `VAE_WORLD_SIZE` and
///   `VAE_MASTER_ADDR` or torchrun's `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` (the
///   group listens one port above it), with `VAE_GROUP_SECRET` on TCP; every rank then calls each
///   request with the same input, and the results go to rank 0 (`None` elsewhere). `ranks`, if
///   given, must equal the world size.
/// - `mode`: the CLI's `--vae-parallel-mode` (`auto`, the default: the fastest strategy that
///   gives the pixels a request asks for, untiled or tiled; `tile`, `spatial_shard_height`,
///   `spatial_shard_width`, `spatial_shard_2d`, `pipeline`); `shard_grid`: `(rows, columns)` of
///   the blocks of `spatial_shard_2d` (default: the factorisation of the ranks whose blocks are
///   closest to square). Whatever the mode, a request's pixels follow its `use_tiling`, as
///   diffusers' do: off, the untiled decode's (several ranks split it exactly where the family
///   can); on, diffusers' tiled decode, the tiles spread over the ranks.
/// - `tile_sample_min_size`, `tile_overlap_factor` (AutoencoderKL-style) and
///   `tile_sample_min_height`, `tile_sample_min_width`, `tile_sample_stride_height`,
///   `tile_sample_stride_width` (video VAEs), `tile_latent_min_height`, `tile_latent_min_width`
///   (HunyuanVideo-1.5), `tile_sample_min_num_frames`, `tile_sample_stride_num_frames` (LTX;
///   giving one tiles the frames): the diffusers tiling keywords.
/// - `decode_timestep`: the timestep a timestep-conditioned decoder (LTX-Video) decodes at.
/// - `max_memory_per_rank`: bytes (an int) or a size such as `"512M"`: under `auto`, the
///   fastest strategy whose predicted peak per rank fits; `profile`: the device profile
///   `vae-parallel calibrate` wrote (default: the one in the default place, else built-in
///   constants). Every report carries the prediction for the strategy that ran.
#[pyfunction]
#[pyo3(signature = (
    model, *, device = "cpu", dtype = "f32", ranks = None, transport = "local", mode = "auto",
    shard_grid = None, tile_sample_min_size = None, tile_overlap_factor = None, tile_sample_min_height = None,
    tile_sample_min_width = None, tile_sample_stride_height = None, tile_sample_stride_width = None,
    tile_latent_min_height = None, tile_latent_min_width = None, tile_sample_min_num_frames = None,
    tile_sample_stride_num_frames = None, decode_timestep = None, max_memory_per_rank = None, profile = None,
))]
#[allow(clippy::too_many_arguments)]
fn load(
    py: Python<'_>,
    model: PathBuf,
    device: &str,
    dtype: &str,
    ranks: Option<usize>,
    transport: &str,
    mode: &str,
    shard_grid: Option<(usize, usize)>,
    tile_sample_min_size: Option<usize>,
    tile_overlap_factor: Option<f64>,
    tile_sample_min_height: Option<usize>,
    tile_sample_min_width: Option<usize>,
    tile_sample_stride_height: Option<usize>,
    tile_sample_stride_width: Option<usize>,
    tile_latent_min_height: Option<usize>,
    tile_latent_min_width: Option<usize>,
    tile_sample_min_num_frames: Option<usize>,
    tile_sample_stride_num_frames: Option<usize>,
    decode_timestep: Option<f64>,
    max_memory_per_rank: Option<Bound<'_, PyAny>>,
    profile: Option<PathBuf>,
) -> PyResult<PyVae> {
    // `"cuda"` on a rank torchrun started is that rank's GPU.
    let device = match (device.trim(), vae_parallel::launch::local_rank()) {
        ("cuda", Some(gpu)) if transport == "socket" => format!("cuda:{gpu}"),
        (name, _) => name.to_string(),
    };
    let max_memory_per_rank = match max_memory_per_rank {
        None => None,
        Some(v) => Some(match v.extract::<u64>() {
            Ok(bytes) => bytes.to_string(),
            Err(_) => v
                .extract::<String>()
                .map_err(|_| config_error("`max_memory_per_rank` must be bytes (an int) or a size such as \"512M\""))?,
        }),
    };
    // The library resolves the keywords as it resolves the CLI's flags: the same refusals, in
    // the same words.
    let settings = Settings {
        vae_patch_parallel_size: ranks,
        vae_parallel_mode: Some(mode.to_string()),
        shard_grid: shard_grid.map(|(r, c)| format!("{r}x{c}")),
        tile_sample_min_size,
        tile_overlap_factor,
        tile_sample_min_height,
        tile_sample_min_width,
        tile_sample_stride_height,
        tile_sample_stride_width,
        tile_latent_min_height,
        tile_latent_min_width,
        tile_sample_min_num_frames,
        tile_sample_stride_num_frames,
        decode_timestep,
        ranks,
        transport: Some(transport.to_string()),
        device: Some(device),
        dtype: Some(dtype.to_string()),
        max_memory_per_rank,
        profile,
        ..Settings::default()
    };
    let resolved = settings.resolve().map_err(|e| to_py(&e))?;
    if let Some(why) = &resolved.device_fallback {
        let warnings = py.import("warnings")?;
        warnings.call_method1("warn", (format!("device {}: {why}", resolved.requested_device),))?;
    }
    let group = match resolved.transport {
        vae_parallel::launch::TransportKind::Local => {
            Arc::new(py.detach(|| Group::local(resolved.ranks)).map_err(|e| to_py(&e))?)
        }
        vae_parallel::launch::TransportKind::Socket => {
            let group = socket_group(py)?;
            if let Some(n) = ranks.filter(|&n| n != group.size()) {
                return Err(config_error(format!("ranks={n} but the socket group's world size is {}", group.size())));
            }
            group
        }
        vae_parallel::launch::TransportKind::Nccl => {
            return Err(config_error("transport must be \"local\" or \"socket\", not \"nccl\""));
        }
    };
    let builder = resolved.vae_builder(&model, resolved.device);
    let vae = py
        .detach(|| -> vae_parallel::Result<Vae> {
            let vae = builder.build()?;
            vae.check_mode(resolved.options.mode)?;
            Ok(vae)
        })
        .map_err(|e| to_py(&e))?;
    // The group's ranks all compute; the pixels follow each request's `use_tiling`.
    let mut options = resolved.options;
    options.parallel_size = None;
    Ok(PyVae { vae, group, options, last_report: Mutex::new(None) })
}

/// A request's input on the host, and where its output goes back to: a torch tensor's device,
/// or `None` for numpy.
struct Input<'py> {
    tensor: Tensor,
    torch_device: Option<Bound<'py, PyAny>>,
}

/// Whether `x` is a torch tensor (checked by its type, without importing torch).
fn is_torch_tensor(x: &Bound<'_, PyAny>) -> PyResult<bool> {
    let ty = x.get_type();
    Ok(ty.module()?.to_cow()?.starts_with("torch") && ty.name()?.to_cow()? == "Tensor")
}

/// `x` as a request's input tensor. A producer on the CUDA device `cuda` names (the model's,
/// with its compute type) is read there in place ([`dlpack::read`]). A DLPack producer on the host (NumPy ≥ 1.22, torch, CuPy's and
/// JAX's host arrays, ...) is read through DLPack ([`dlpack::read`]): f32 in row-major order in
/// place, other float types and layouts converted once. A torch tensor is detached first, and
/// one on a device is copied to the host by torch (the requests compute on host tensors); a
/// device tensor of any other library is an `InputError`. Anything else (lists, NumPy before
/// 1.22, read-only arrays NumPy before 2.1 will not export) goes through
/// `numpy.asarray(x, dtype=float32)`, a row-major result read in place.
fn input<'py>(x: &Bound<'py, PyAny>, cuda: Option<(usize, vae_parallel::DType)>) -> PyResult<Input<'py>> {
    let py = x.py();
    let torch = is_torch_tensor(x)?;
    let torch_device = if torch { Some(x.getattr("device")?) } else { None };
    // A tensor that requires grad exports nothing: its values, detached.
    let x = if torch { x.call_method0("detach")? } else { x.clone() };
    match dlpack::read(&x, cuda)? {
        dlpack::Read::Tensor(tensor) => return Ok(Input { tensor, torch_device }),
        dlpack::Read::OnDevice(..) if torch => {
            if let dlpack::Read::Tensor(tensor) = dlpack::read(&x.call_method0("cpu")?, None)? {
                return Ok(Input { tensor, torch_device });
            }
            return Err(InputError::new_err("torch did not export the tensor it copied to the host"));
        }
        dlpack::Read::OnDevice(device_type, device_id) => {
            return Err(InputError::new_err(format!(
                "the input is on DLPack device {}: only host tensors are read (requests compute on host \
                 tensors); copy it to the host first",
                dlpack::device_name(device_type, device_id)
            )));
        }
        dlpack::Read::NotExported => {}
    }
    let kwargs = PyDict::new(py);
    kwargs.set_item("dtype", "float32")?;
    let array = py.import("numpy")?.call_method("asarray", (x,), Some(&kwargs))?;
    let array = array.cast_into::<PyArrayDyn<f32>>().map_err(PyErr::from)?;
    let shape = array.shape().to_vec();
    // A row-major, aligned float32 array is read in place: the tensor holds a reference to the
    // array, and an op that would write it copies it first.
    let aligned = (array.data() as usize).is_multiple_of(std::mem::align_of::<f32>());
    if array.is_c_contiguous() && aligned {
        let data = array.data().cast_const();
        let owner: Arc<dyn Any + Send + Sync> = Arc::new(array.clone().unbind());
        // SAFETY: `data` is the aligned start of the array's `shape` elements, which `owner`
        // keeps alive for as long as the tensor lives; the request only reads them, and the
        // documented contract is that the caller does not write the array while it runs.
        let tensor = unsafe { Tensor::lent(data, shape, owner) };
        return Ok(Input { tensor, torch_device });
    }
    // Any other layout: one copy, in logical order.
    let data: Vec<f32> = array.readonly().as_array().iter().copied().collect();
    let tensor = Tensor::from_vec(data, shape, &Device::Cpu).map_err(|e| InputError::new_err(e.to_string()))?;
    Ok(Input { tensor, torch_device })
}

impl PyVae {
    /// The CUDA device (and compute type) whose DLPack producers are read in place: the model's,
    /// when it computes on a GPU.
    fn cuda(&self) -> Option<(usize, vae_parallel::DType)> {
        match self.vae.device() {
            Device::Cuda(ordinal) => Some((ordinal, self.vae.compute_dtype())),
            Device::Cpu => None,
        }
    }

    /// A request's options: the model's, with this request's mode when it names one, the
    /// pixels diffusers gives with or without `enable_tiling()` (`use_tiling`), and the
    /// pipeline's normalisation when `latents_normalized`.
    fn options(&self, mode: Option<&str>, use_tiling: bool, latents_normalized: bool) -> PyResult<Options> {
        let mut options = self.options.clone();
        if let Some(name) = mode {
            options.mode = vae_parallel::settings::parse_mode(name).map_err(|e| to_py(&e))?;
            // The grid goes with the 2-D mode only: a request in another mode ignores it.
            if options.mode != ParallelMode::SpatialShard2d {
                options.shard_grid = None;
            }
        }
        options.tiling = if use_tiling { Tiling::On } else { Tiling::Off };
        options.latents_normalized = latents_normalized;
        Ok(options)
    }

    /// Runs a request on the group (interruptible); keeps its report for
    /// [`PyVae::last_report`].
    fn request<'a>(
        &self,
        py: Python<'_>,
        make: impl FnOnce(&'a CancelToken) -> Request<'a> + Send,
        token: &'a CancelToken,
    ) -> PyResult<Option<Tensor>> {
        let finished = interrupt::run(py, &self.group, &self.vae, make, token)?;
        self.keep_report(py, finished.report)?;
        Ok(finished.output)
    }

    /// Keeps a request's report for [`PyVae::last_report`], and warns (Python's `warnings`)
    /// when what ran is not what the request asked for, with the library's reason.
    fn keep_report(&self, py: Python<'_>, report: Option<RequestReport>) -> PyResult<()> {
        let Some(report) = report else { return Ok(()) };
        if report.fallback {
            py.import("warnings")?.call_method1("warn", (message(&report.reason),))?;
        }
        *self.last_report.lock().unwrap_or_else(|e| e.into_inner()) = Some(report);
        Ok(())
    }
}

/// The frame sink of a socket rank other than the owner's, which the group never calls.
struct NoFrames;

impl FrameSink for NoFrames {
    fn begin(&mut self, _dims: &[usize]) -> Result<(), vae_parallel::SinkError> {
        Ok(())
    }

    fn frames(&mut self, _first: usize, _run: Tensor) -> Result<(), vae_parallel::SinkError> {
        Ok(())
    }
}

/// A host tensor as a [`dlpack::DlpackTensor`] that owns its memory (no copy), adopted through
/// DLPack by numpy (`numpy.from_dlpack`: a float32 array; copied once only where NumPy before
/// 2.1 adopts it read-only) or, for a torch input, by torch (`torch.from_dlpack`, then moved to
/// the input's device: no copy on the CPU).
fn to_python<'py>(py: Python<'py>, t: Tensor, torch_device: Option<&Bound<'py, PyAny>>) -> PyResult<Bound<'py, PyAny>> {
    let on_gpu = !t.device().is_cpu();
    let tensor = Bound::new(py, dlpack::DlpackTensor::new(t)?)?;
    match torch_device {
        // A result on the GPU for another library than torch: its `from_dlpack` adopts it.
        None if on_gpu => Ok(tensor.into_any()),
        None => {
            let array = py.import("numpy")?.call_method1("from_dlpack", (tensor,))?;
            if array.getattr("flags")?.getattr("writeable")?.extract::<bool>()? {
                Ok(array)
            } else {
                array.call_method0("copy")
            }
        }
        Some(device) => py.import("torch")?.call_method1("from_dlpack", (tensor,))?.call_method1("to", (device,)),
    }
}

#[pymethods]
impl PyVae {
    /// Decodes a latent `[B, C, H, W]` (images) or `[B, C, T, H, W]` (video) into pixels in
    /// [-1, 1] (as diffusers' `vae.decode(z).sample`). `use_tiling`: diffusers' tiled decode
    /// (`enable_tiling()`), the tiles spread over the ranks; without it the untiled decode's
    /// pixels, split exactly over the ranks where the family can (else computed on one rank,
    /// with a warning). `mode`: this request's parallel mode (default: the model's);
    /// `latents_normalized`: `z` is as the pipeline produced it, and the family's scaling and
    /// shift are undone first.
    #[pyo3(signature = (z, *, mode = None, use_tiling = false, latents_normalized = false))]
    fn decode<'py>(
        &self,
        py: Python<'py>,
        z: &Bound<'py, PyAny>,
        mode: Option<&str>,
        use_tiling: bool,
        latents_normalized: bool,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let latent = input(z, self.cuda())?;
        let decode = Decode::default().with_options(self.options(mode, use_tiling, latents_normalized)?);
        let token = CancelToken::new();
        let z = &latent.tensor;
        let out = self.request(py, |t| Request::decode(z, &decode).cancel_on(t), &token)?;
        out.map(|t| to_python(py, t, latent.torch_device.as_ref())).transpose()
    }

    /// Encodes pixels in [-1, 1] (`[B, 3, H, W]` or `[B, 3, T, H, W]`): `output="mean"` gives
    /// the latent distribution's mean (normalised with `latents_normalized`), `"moments"` the
    /// raw mean and log-variance; `mode` and `use_tiling` as for [`PyVae::decode`].
    #[pyo3(signature = (x, *, output = "mean", mode = None, use_tiling = false, latents_normalized = false))]
    fn encode<'py>(
        &self,
        py: Python<'py>,
        x: &Bound<'py, PyAny>,
        output: &str,
        mode: Option<&str>,
        use_tiling: bool,
        latents_normalized: bool,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let kind: EncodeOutput = output.parse().map_err(|e| to_py(&e))?;
        let image = input(x, self.cuda())?;
        let encode = Encode::default().with_options(self.options(mode, use_tiling, latents_normalized)?).output(kind);
        let token = CancelToken::new();
        let x = &image.tensor;
        let out = self.request(py, |t| Request::encode(x, &encode).cancel_on(t), &token)?;
        out.map(|t| to_python(py, t, image.torch_device.as_ref())).transpose()
    }

    /// Decodes a video latent with its frames written to `path` as they are decoded (`.npy`,
    /// `.png` frames, `.mp4` or `.gif` at `fps`, as `vae-parallel decode --stream`): memory
    /// does not grow with the frame count, and the files are those the whole decode would
    /// write, in any `mode` over the group's ranks. Files appear only once the request
    /// succeeded; returns the paths written (none on a socket rank other than 0).
    #[pyo3(signature = (path, z, *, fps = vae_parallel::video::DEFAULT_FPS, mode = None, use_tiling = false, latents_normalized = false))]
    #[allow(clippy::too_many_arguments)]
    fn decode_to(
        &self,
        py: Python<'_>,
        path: PathBuf,
        z: &Bound<'_, PyAny>,
        fps: u32,
        mode: Option<&str>,
        use_tiling: bool,
        latents_normalized: bool,
    ) -> PyResult<Vec<PathBuf>> {
        use vae_parallel::runtime::OnOwnThread;
        use vae_parallel::stream_out::StreamedOutput;
        let io_error = |e: vae_parallel::io::IoError| to_py(&e.into());
        // What every rank would refuse alike is refused here, before any rank starts (an error
        // inside the group would abort a socket group for good): a family that does not
        // stream, the path and rate (the directory by rank 0, the one that writes).
        if !self.vae.streams() {
            return Err(ConfigError::new_err(format!(
                "{} does not stream its decode (the video families do): use decode() and save()",
                self.vae.class_name()
            )));
        }
        drop(StreamedOutput::new(&path, fps).map_err(io_error)?);
        let owner = self.group.rank() == 0;
        // A streamed decode reads its latent on the host (its frames go to files).
        let latent = input(z, None)?;
        let decode = Decode::default().with_options(self.options(mode, use_tiling, latents_normalized)?);
        let z = &latent.tensor;
        // The owner's frames go to the files, written on a thread of their own. Only the owner
        // checks where they go: when it cannot write there, it aborts a group of processes with
        // the reason, so that the other ranks, which will make the request, fail with it rather
        // than wait for a rank that never joins.
        let owner_sink = || -> PyResult<OnOwnThread<StreamedOutput>> {
            vae_parallel::output::check_writable(&path).map_err(io_error)?;
            OnOwnThread::start(StreamedOutput::new(&path, fps).map_err(io_error)?, 1)
                .map_err(|e| ExecutionError::new_err(e.to_string()))
        };
        let mut sink = match owner {
            true => Some(owner_sink().inspect_err(|e| self.group.abort(&e.to_string()))?),
            false => None,
        };
        let mut elsewhere = NoFrames;
        let token = CancelToken::new();
        let finished = {
            let frames: &mut (dyn FrameSink + Send) = match sink.as_mut() {
                Some(sink) => sink,
                None => &mut elsewhere,
            };
            interrupt::run(py, &self.group, &self.vae, |t| Request::decode_to(z, &decode, frames).cancel_on(t), &token)
        };
        // On a failure nothing is written: the staged files go with the sink.
        let finished = finished?;
        self.keep_report(py, finished.report)?;
        let Some(sink) = sink else { return Ok(Vec::new()) };
        let written = sink.finish().map_err(|e| ExecutionError::new_err(message(&e.to_string())))?;
        let staged = written.finish().map_err(io_error)?;
        py.detach(|| staged.commit()).map_err(io_error)
    }

    /// What `vae-parallel inspect` prints, as a dict: class, the models it serves, its
    /// configuration, the modes it accepts and who receives outputs.
    fn inspect<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let model = self.vae.model();
        let d = PyDict::new(py);
        d.set_item("model", self.vae.dir())?;
        d.set_item("class", model.class_name())?;
        d.set_item("models", model.models())?;
        for (label, value) in model.describe() {
            d.set_item(label, value)?;
        }
        let modes: Vec<String> = self.vae.supported_modes().iter().map(ToString::to_string).collect();
        d.set_item("modes", modes)?;
        d.set_item("decode_placement", format!("{:?}", model.default_placement(Direction::Decode)))?;
        d.set_item("encode_placement", format!("{:?}", model.default_placement(Direction::Encode)))?;
        d.set_item("ranks", self.group.size())?;
        d.set_item("rank", self.group.rank())?;
        d.set_item("transport", self.group.backend())?;
        d.set_item("mode", self.options.mode.to_string())?;
        Ok(d)
    }

    /// This process's rank in the group (0 for a local group, whose ranks are its threads).
    #[getter]
    fn rank(&self) -> usize {
        self.group.rank()
    }

    /// Ranks every request runs on.
    #[getter]
    fn world_size(&self) -> usize {
        self.group.size()
    }

    /// The report of the last request that succeeded, as the CLI's `--report FILE.json` holds
    /// it (mode, strategy and why, backend, sizes, and per rank its phases, memory and bytes),
    /// as a dict; `None` before the first, and on socket ranks other than 0.
    fn last_report<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let report = self.last_report.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let Some(report) = report else { return Ok(None) };
        let text = serde_json::to_string(&report).map_err(|e| ExecutionError::new_err(e.to_string()))?;
        Ok(Some(py.import("json")?.call_method1("loads", (text,))?))
    }

    fn __repr__(&self) -> String {
        format!(
            "Vae({:?}, class={}, ranks={}, mode={})",
            self.vae.dir(),
            self.vae.class_name(),
            self.group.size(),
            self.options.mode
        )
    }
}

/// Writes decoded pixels (`[B, 3, H, W]` or `[B, 3, T, H, W]` in [-1, 1], as `Vae.decode`
/// returns them) to `path` as the CLI's `--out` would: `.npy` (the values), `.png` (one image
/// per batch item or frame), `.mp4` (H.264 through ffmpeg: on PATH or named by `VAE_FFMPEG`) or
/// `.gif` (a video per batch item, `fps` frames a second). Files appear only once all are
/// written. Returns the paths written.
#[pyfunction]
#[pyo3(signature = (path, pixels, *, fps = vae_parallel::video::DEFAULT_FPS))]
fn save(py: Python<'_>, path: PathBuf, pixels: &Bound<'_, PyAny>, fps: u32) -> PyResult<Vec<PathBuf>> {
    use vae_parallel::io;
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("").to_ascii_lowercase();
    if !io::DECODED_EXTENSIONS.contains(&ext.as_str()) {
        return Err(ConfigError::new_err(format!("{} must end in .npy, .png, .mp4 or .gif", path.display())));
    }
    let pixels = input(pixels, None)?.tensor;
    let io_error = |e: io::IoError| to_py(&e.into());
    py.detach(|| {
        let mut staged = vae_parallel::output::Staged::new();
        io::stage_decoded(&mut staged, &path, &pixels, fps).map_err(io_error)?;
        staged.commit().map_err(io_error)
    })
}

/// Reads an image to encode as the CLI's `encode --input` does: an 8-bit PNG (no resizing) or a
/// `.npy` / `.safetensors` tensor, as a float32 array `[1, 3, H, W]` in [-1, 1] (diffusers'
/// `x / 255 * 2 - 1` for a PNG).
#[pyfunction]
fn read_image<'py>(py: Python<'py>, path: PathBuf) -> PyResult<Bound<'py, PyAny>> {
    let image = py.detach(|| vae_parallel::io::read_image(&path)).map_err(|e| to_py(&e.into()))?;
    to_python(py, image, None)
}

/// The module.
#[pymodule(name = "_native")]
fn init(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_function(wrap_pyfunction!(load, m)?)?;
    m.add_function(wrap_pyfunction!(save, m)?)?;
    m.add_function(wrap_pyfunction!(read_image, m)?)?;
    m.add_function(wrap_pyfunction!(devices::devices, m)?)?;
    m.add_class::<PyVae>()?;
    m.add_class::<dlpack::DlpackTensor>()?;
    m.add("VaeParallelError", py.get_type::<VaeParallelError>())?;
    m.add("InputError", py.get_type::<InputError>())?;
    m.add("ModelError", py.get_type::<ModelError>())?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("ExecutionError", py.get_type::<ExecutionError>())?;
    m.add("GroupError", py.get_type::<GroupError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
