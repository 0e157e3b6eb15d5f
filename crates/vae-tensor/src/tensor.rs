//! The tensor type: a shape and a storage on the host or a device, and the ops that are not
//! kernels (construction, transfers, views of the elements, narrow / cat, the tile blend).

use crate::backend::{DeviceElementwise, DeviceLayout, DeviceStorage, DeviceStore};
use crate::memory::Buffer;
use crate::{DType, Device, DeviceMemory, Result, Shape, TensorError};

/// Backend storage, matched once per op: the host, or a device ([`DeviceStorage`], which
/// cannot exist in a build without the `cuda` feature).
#[derive(Debug, Clone)]
enum Storage {
    Cpu(CpuStorage),
    Cuda(DeviceStorage),
}

impl PartialEq for Storage {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Self::Cpu(a), Self::Cpu(b)) => a == b,
            // Equal contents on the same device (a download each: for tests, not hot paths).
            (Self::Cuda(a), Self::Cuda(b)) => {
                a.ordinal() == b.ordinal() && matches!((a.download(), b.download()), (Ok(x), Ok(y)) if x == y)
            }
            _ => false,
        }
    }
}

/// Host buffers, charged to the allocating thread's [`crate::memory`] counters.
#[derive(Debug, Clone, PartialEq)]
enum CpuStorage {
    F32(Buffer),
}

/// One box of [`Tensor::from_boxes`]: `extent` elements per dimension of `src` from `from`,
/// placed at `to`.
#[derive(Debug, Clone, Copy)]
pub struct BoxOf<'a> {
    /// The tensor the box is read from.
    pub src: &'a Tensor,
    /// Where the box starts in `src`, per dimension.
    pub from: &'a [usize],
    /// Where it lands in the new tensor.
    pub to: &'a [usize],
    /// Its extent per dimension.
    pub extent: &'a [usize],
}

/// A dense row-major tensor: NCHW images and NCTHW videos, as diffusers lays them out. f32 on
/// the host; f32 or bf16 on a CUDA device. Requests take and return host f32 tensors.
///
/// ```
/// use vae_tensor::{Device, Tensor};
///
/// // A latent from values (e.g. a NumPy array's), and one from a seed.
/// let z = Tensor::from_vec(vec![0.5; 2 * 4 * 8 * 8], vec![2, 4, 8, 8], &Device::Cpu)?;
/// let noise = Tensor::seeded_uniform([2, 4, 8, 8], 42, -1.0, 1.0, &Device::Cpu)?;
/// assert_eq!((z.dims(), z.elem_count()), (&[2, 4, 8, 8][..], 512));
/// // The second image of the batch, its values back as a vector.
/// let second = noise.narrow(0, 1, 1)?;
/// assert_eq!(second.to_vec_f32()?.len(), 256);
/// assert!(second.max_abs_diff(&noise.narrow(0, 1, 1)?)? == 0.0);
/// # Ok::<(), vae_tensor::TensorError>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    shape: Shape,
    storage: Storage,
}

/// A host-only op given device memory.
fn not_on_host(ordinal: usize) -> TensorError {
    TensorError::DeviceUnavailable {
        device: Device::Cuda(ordinal),
        reason: "this op reads host memory and has no CUDA path; copy the tensor with to_device(Cpu)".into(),
    }
}

impl Tensor {
    /// A tensor of zeros.
    pub fn zeros(shape: impl Into<Shape>, dtype: DType, device: &Device) -> Result<Self> {
        let shape = shape.into();
        if let Device::Cuda(ordinal) = device {
            let storage = DeviceStorage::zeros(*ordinal, shape.elem_count(), dtype)?;
            return Ok(Self::from_cuda(storage, shape));
        }
        match dtype {
            DType::F32 => Ok(Self::from_buffer(Buffer::zeros(shape.elem_count()), shape)),
            other => Err(TensorError::UnsupportedDType { op: "zeros", dtype: other, device: *device }),
        }
    }

    /// A tensor owning `data` (row-major) with the given shape.
    pub fn from_vec(data: Vec<f32>, shape: impl Into<Shape>, device: &Device) -> Result<Self> {
        let shape = shape.into();
        if data.len() != shape.elem_count() {
            return Err(TensorError::ElementCount {
                op: "from_vec",
                expected: shape.elem_count(),
                got: data.len(),
                shape,
            });
        }
        if let Device::Cuda(ordinal) = device {
            let storage = DeviceStorage::upload(*ordinal, &data)?;
            return Ok(Self::from_cuda(storage, shape));
        }
        Ok(Self::from_buffer(Buffer::from_vec(data), shape))
    }

    /// A device tensor over `storage` (its length the shape's element count).
    pub(crate) fn from_cuda(storage: DeviceStorage, shape: Shape) -> Self {
        Self { shape, storage: Storage::Cuda(storage) }
    }

    /// A host tensor of `shape` that reads the f32 values at `data` in place, without a copy,
    /// while `owner` keeps them alive: memory a caller lends (a numpy array). It is never
    /// written: an op that would write it in place copies it first. Not charged to the memory
    /// account (the caller's memory, not a tensor's).
    ///
    /// # Safety
    /// `data` must be non-null, aligned for f32, and point to `shape`'s element count of
    /// initialised values that stay valid, and that nobody writes, for as long as `owner` lives
    /// (the tensor holds it until it is dropped).
    pub unsafe fn lent(
        data: *const f32,
        shape: impl Into<Shape>,
        owner: std::sync::Arc<dyn std::any::Any + Send + Sync>,
    ) -> Self {
        let shape = shape.into();
        // SAFETY: the caller's contract.
        let buffer = unsafe { Buffer::lent(data, shape.elem_count(), owner) };
        Self::from_buffer(buffer, shape)
    }

    /// The device storage, for a tensor on a CUDA device.
    pub(crate) fn cuda(&self) -> Option<&DeviceStorage> {
        match &self.storage {
            Storage::Cuda(c) => Some(c),
            Storage::Cpu(_) => None,
        }
    }

    /// The device storage, mutable, for a write in place: device memory another library lent
    /// (a DLPack import) is first copied into memory of our own, so it is never written.
    pub(crate) fn cuda_mut(&mut self) -> Option<&mut DeviceStorage> {
        match &mut self.storage {
            Storage::Cuda(c) => {
                #[cfg(feature = "cuda")]
                if c.is_lent() {
                    *c = c.clone();
                }
                Some(c)
            }
            Storage::Cpu(_) => None,
        }
    }

    /// Where the elements of a tensor on a GPU are, to hand them to something that moves device
    /// memory itself (a transport's device-to-device exchange): `None` on the CPU. Returns once
    /// every write queued to this tensor so far, on any stream, has finished.
    ///
    /// The address is valid while the tensor lives; the caller must not write through it.
    pub fn device_memory(&self) -> Result<Option<DeviceMemory>> {
        match &self.storage {
            Storage::Cpu(_) => Ok(None),
            Storage::Cuda(c) => {
                let address = c.settled_address()?;
                Ok(Some(DeviceMemory { ordinal: c.ordinal(), address, len: self.size_in_bytes() }))
            }
        }
    }

    /// As [`Self::device_memory`], for memory something else is about to write (a receive
    /// buffer): returns once every read and write queued to this tensor so far has finished.
    /// The caller must write only within it, and finish before the tensor is used again.
    pub fn device_memory_mut(&mut self) -> Result<Option<DeviceMemory>> {
        let bytes = self.size_in_bytes();
        match self.cuda_mut() {
            None => Ok(None),
            Some(c) => {
                let address = c.settled_address_mut()?;
                Ok(Some(DeviceMemory { ordinal: c.ordinal(), address, len: bytes }))
            }
        }
    }

    /// A copy on `device` (the tensor itself, cloned, when it is there already). The CPU backend
    /// is f32 only, so a bf16 tensor arrives there widened (exactly) to f32; between CUDA
    /// devices the type is kept.
    pub fn to_device(&self, device: &Device) -> Result<Tensor> {
        if self.device() == *device {
            return Ok(self.clone());
        }
        let host = self.to_vec_f32()?;
        let moved = Tensor::from_vec(host, self.shape.clone(), device)?;
        if device.is_cpu() { Ok(moved) } else { moved.to_dtype(self.dtype()) }
    }

    /// A copy with elements of `dtype` (the tensor itself, cloned, when it has that type
    /// already). f32 → bf16 rounds to nearest even, as PyTorch's `.to(torch.bfloat16)`; bf16 →
    /// f32 is exact. CUDA tensors only: the CPU backend computes in f32 and refuses other types
    /// with [`TensorError::UnsupportedDType`].
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if self.dtype() == dtype {
            return Ok(self.clone());
        }
        if let Some(c) = self.cuda() {
            return Ok(Self::from_cuda(c.to_dtype(dtype)?, self.shape.clone()));
        }
        Err(TensorError::UnsupportedDType { op: "to_dtype", dtype, device: self.device() })
    }

    /// A host f32 tensor over `buffer`, whose length the caller has made equal to the shape's
    /// element count.
    pub(crate) fn from_buffer(buffer: Buffer, shape: Shape) -> Self {
        debug_assert_eq!(buffer.as_slice().len(), shape.elem_count());
        Self { shape, storage: Storage::Cpu(CpuStorage::F32(buffer)) }
    }

    /// A deterministic tensor, uniform in `[low, high)`, from a 64-bit LCG seeded with `seed`:
    /// the same values on every platform, process and rank, with no random-number dependency
    /// (test inputs, benchmark latents).
    pub fn seeded_uniform(shape: impl Into<Shape>, seed: u64, low: f32, high: f32, device: &Device) -> Result<Self> {
        const A: u64 = 6364136223846793005;
        const C: u64 = 1442695040888963407;
        let shape = shape.into();
        let mut state = seed.wrapping_mul(A).wrapping_add(C);
        let data = (0..shape.elem_count())
            .map(|_| {
                state = state.wrapping_mul(A).wrapping_add(C);
                ((state >> 40) as f32 / (1u64 << 24) as f32) * (high - low) + low
            })
            .collect();
        Self::from_vec(data, shape, device)
    }

    /// A tensor from raw native-endian element bytes, as [`Tensor::as_bytes`] produces.
    pub fn from_bytes(dtype: DType, shape: impl Into<Shape>, bytes: &[u8], device: &Device) -> Result<Self> {
        let shape = shape.into();
        let expected = shape.checked_elem_count().and_then(|n| n.checked_mul(dtype.size_in_bytes()));
        let Some(expected) = expected else {
            return Err(TensorError::InvalidArgument {
                op: "from_bytes",
                reason: format!("shape {shape} has more elements than memory can hold"),
            });
        };
        if bytes.len() != expected {
            return Err(TensorError::ElementCount { op: "from_bytes", shape, expected, got: bytes.len() });
        }
        match dtype {
            DType::F32 => {
                let data = bytes.chunks_exact(4).map(|c| f32::from_ne_bytes(c.try_into().expect("4 bytes"))).collect();
                Self::from_vec(data, shape, device)
            }
            other => Err(TensorError::UnsupportedDType { op: "from_bytes", dtype: other, device: *device }),
        }
    }

    /// The shape.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    /// The extents.
    pub fn dims(&self) -> &[usize] {
        self.shape.dims()
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.shape.rank()
    }

    /// Number of elements.
    pub fn elem_count(&self) -> usize {
        self.shape.elem_count()
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        match &self.storage {
            Storage::Cpu(CpuStorage::F32(_)) => DType::F32,
            Storage::Cuda(c) => c.dtype(),
        }
    }

    /// The device.
    pub fn device(&self) -> Device {
        match &self.storage {
            Storage::Cpu(_) => Device::Cpu,
            Storage::Cuda(c) => Device::Cuda(c.ordinal()),
        }
    }

    /// Size of the data in bytes.
    pub fn size_in_bytes(&self) -> usize {
        self.elem_count() * self.dtype().size_in_bytes()
    }

    /// The f32 elements, for host-resident f32 tensors (a CUDA tensor is an error naming its
    /// device: the op has no CUDA path yet, or the caller must copy it to the CPU first).
    pub fn as_slice_f32(&self) -> Result<&[f32]> {
        match &self.storage {
            Storage::Cpu(CpuStorage::F32(v)) => Ok(v.as_slice()),
            Storage::Cuda(c) => Err(not_on_host(c.ordinal())),
        }
    }

    /// The f32 elements, mutable, for host-resident f32 tensors.
    pub(crate) fn as_mut_slice_f32(&mut self) -> Result<&mut [f32]> {
        match &mut self.storage {
            Storage::Cpu(CpuStorage::F32(v)) => Ok(v.as_mut_slice()),
            Storage::Cuda(c) => Err(not_on_host(c.ordinal())),
        }
    }

    /// A copy of the elements as f32 (from any device).
    pub fn to_vec_f32(&self) -> Result<Vec<f32>> {
        match &self.storage {
            Storage::Cpu(CpuStorage::F32(v)) => Ok(v.as_slice().to_vec()),
            Storage::Cuda(c) => c.download(),
        }
    }

    /// The elements as a vector, consuming the tensor: host memory is handed over without a
    /// copy; device memory is downloaded.
    pub fn into_vec_f32(self) -> Result<Vec<f32>> {
        match self.storage {
            Storage::Cpu(CpuStorage::F32(v)) => Ok(v.into_vec()),
            Storage::Cuda(c) => c.download(),
        }
    }

    /// The raw element bytes (native endian), for transport.
    pub fn as_bytes(&self) -> Result<&[u8]> {
        Ok(bytemuck::cast_slice(self.as_slice_f32()?))
    }

    /// A 64-bit content hash of dtype, shape and data (xxh3), to check that ranks hold the
    /// same input without sending it.
    pub fn content_hash(&self) -> Result<u64> {
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        hasher.update(&[self.dtype().code()]);
        hasher.update(&(self.rank() as u64).to_le_bytes());
        for d in self.dims() {
            hasher.update(&(*d as u64).to_le_bytes());
        }
        hasher.update(self.as_bytes()?);
        Ok(hasher.digest())
    }

    /// Replaces the shape; the caller has checked that the element count is unchanged.
    pub(crate) fn set_shape(&mut self, shape: Shape) {
        debug_assert_eq!(shape.elem_count(), self.elem_count());
        self.shape = shape;
    }

    /// An error unless `other` lives on the same device as `self`.
    pub(crate) fn check_same_device(&self, op: &'static str, other: &Tensor) -> Result<()> {
        if self.device() != other.device() {
            return Err(TensorError::DeviceMismatch { op, lhs: self.device(), rhs: other.device() });
        }
        Ok(())
    }

    /// An error unless `other` has the same shape and device as `self` (element-wise ops).
    pub(crate) fn check_same_shape(&self, op: &'static str, other: &Tensor) -> Result<()> {
        self.check_same_device(op, other)?;
        if self.shape != other.shape {
            return Err(TensorError::ShapeMismatch { op, lhs: self.shape.clone(), rhs: other.shape.clone() });
        }
        Ok(())
    }

    pub(crate) fn check_dim(&self, op: &'static str, dim: usize) -> Result<()> {
        if dim >= self.rank() {
            return Err(TensorError::DimOutOfRange { op, dim, shape: self.shape.clone() });
        }
        Ok(())
    }

    /// A copy of `len` positions from `start` along `dim`.
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Self> {
        let _profile = crate::profile::Scope::new("narrow");
        self.check_dim("narrow", dim)?;
        if start + len > self.dims()[dim] {
            return Err(TensorError::RangeOutOfBounds {
                op: "narrow",
                dim,
                start,
                end: start + len,
                shape: self.shape.clone(),
            });
        }
        let mut dims = self.dims().to_vec();
        dims[dim] = len;
        let mut out = Self::for_overwrite(dims.clone(), self.dtype(), &self.device())?;
        let mut src_off = vec![0; self.rank()];
        src_off[dim] = start;
        copy_box(self, &src_off, &mut out, &vec![0; self.rank()], &dims)?;
        Ok(out)
    }

    /// Concatenation along `dim`; all other extents must agree.
    pub fn cat(tensors: &[&Tensor], dim: usize) -> Result<Self> {
        let _profile = crate::profile::Scope::new("cat");
        let first = tensors.first().ok_or(TensorError::InvalidArgument { op: "cat", reason: "no tensors".into() })?;
        first.check_dim("cat", dim)?;
        let mut dims = first.dims().to_vec();
        dims[dim] = 0;
        for t in tensors {
            let same_rest = t.rank() == first.rank()
                && t.dims().iter().zip(first.dims()).enumerate().all(|(i, (a, b))| i == dim || a == b);
            if !same_rest {
                return Err(TensorError::ShapeMismatch { op: "cat", lhs: first.shape.clone(), rhs: t.shape.clone() });
            }
            dims[dim] += t.dims()[dim];
        }
        let mut out = Self::for_overwrite(dims, first.dtype(), &first.device())?;
        let mut at = vec![0; first.rank()];
        for t in tensors {
            copy_box(t, &vec![0; t.rank()], &mut out, &at, t.dims())?;
            at[dim] += t.dims()[dim];
        }
        Ok(out)
    }

    /// Copies the box of `extent` at `src_offset` in `src` to `dst_offset` in `self`.
    pub fn copy_box_from(
        &mut self,
        dst_offset: &[usize],
        src: &Tensor,
        src_offset: &[usize],
        extent: &[usize],
    ) -> Result<()> {
        let _profile = crate::profile::Scope::new("copy_box");
        copy_box(src, src_offset, self, dst_offset, extent)
    }

    /// A tensor of `dims` assembled from boxes of other tensors, zeros where none lies: each
    /// [`BoxOf`] is copied to its place in order (a later one wins where two overlap). Only
    /// what the largest box leaves uncovered is zeroed first, not the whole tensor (a halo
    /// exchange assembles a part into its haloed copy this way).
    pub fn from_boxes(dims: Vec<usize>, dtype: DType, device: &Device, boxes: &[BoxOf<'_>]) -> Result<Self> {
        let _profile = crate::profile::Scope::new("copy_box");
        let largest =
            boxes.iter().filter(|b| b.extent.len() == dims.len()).max_by_key(|b| b.extent.iter().product::<usize>());
        let mut out = match largest {
            Some(largest)
                if device.is_cpu()
                    && dims.iter().zip(largest.to).zip(largest.extent).all(|((d, t), e)| t + e <= *d) =>
            {
                let mut out = Self::for_overwrite(dims.clone(), dtype, device)?;
                let inner: Vec<_> = largest.to.iter().zip(largest.extent).map(|(&t, &e)| t..t + e).collect();
                let strides = out.shape.strides();
                let data = out.as_mut_slice_f32()?;
                for (off, extent) in crate::boxes::complement(&dims, &inner) {
                    crate::boxes::zero(data, &strides, &off, &extent);
                }
                out
            }
            _ => Self::zeros(dims, dtype, device)?,
        };
        for b in boxes {
            copy_box(b.src, b.from, &mut out, b.to, b.extent)?;
        }
        Ok(out)
    }

    /// A tensor whose contents are unspecified, for an op that writes every element: on the
    /// host a recycled buffer is not cleared first; on a device it is [`Self::zeros`].
    fn for_overwrite(dims: Vec<usize>, dtype: DType, device: &Device) -> Result<Self> {
        match (device, dtype) {
            (Device::Cpu, DType::F32) => {
                let shape = Shape::from(dims);
                Ok(Self::from_buffer(Buffer::for_overwrite(shape.elem_count()), shape))
            }
            _ => Self::zeros(dims, dtype, device),
        }
    }

    /// `x * mul + add` element-wise, rounded after each operation (as two PyTorch ops).
    pub fn affine(&self, mul: f32, add: f32) -> Result<Self> {
        let _profile = crate::profile::Scope::new("scalar");
        if let Some(x) = self.cuda() {
            return Ok(Self::from_cuda(x.affine(mul, add)?, self.shape.clone()));
        }
        let data = self.as_slice_f32()?.iter().map(|x| (x * mul) + add).collect();
        Self::from_vec(data, self.shape.clone(), &self.device())
    }

    /// Nearest-neighbour upsampling of the last two dimensions by an integer factor (the
    /// `F.interpolate(scale_factor=k, mode="nearest")` of the VAE decoders). Any leading
    /// dimensions are batch-like, so Wan's per-frame `[N·T, C, H, W]` and NCTHW inputs work
    /// alike. For an integer factor this is also `mode="nearest-exact"` (Wan's `WanUpsample`):
    /// nearest-exact reads `floor((y + 0.5) / k)`, which equals `floor(y / k)` for integer `y`
    /// and `k`.
    pub fn upsample_nearest2d(&self, factor: usize) -> Result<Self> {
        let _profile = crate::profile::Scope::new("upsample_nearest");
        if self.rank() < 2 || factor == 0 {
            return Err(TensorError::InvalidArgument {
                op: "upsample_nearest2d",
                reason: format!("needs rank >= 2 and factor >= 1, got shape {} and factor {factor}", self.shape),
            });
        }
        let n = self.rank();
        let (h, w) = (self.dims()[n - 2], self.dims()[n - 1]);
        let planes = self.elem_count() / (h * w).max(1);
        let mut dims = self.dims().to_vec();
        dims[n - 2] = h * factor;
        dims[n - 1] = w * factor;
        if let Some(x) = self.cuda() {
            return Ok(Self::from_cuda(x.upsample_nearest2d(planes, h, w, factor)?, Shape::new(dims)));
        }
        let src = self.as_slice_f32()?;
        let (oh, ow) = (h * factor, w * factor);
        let mut out = Buffer::for_overwrite(planes * oh * ow);
        if planes > 0 && oh * ow > 0 {
            // One plane per task: the decoder's last upsample writes hundreds of MB.
            use rayon::prelude::*;
            out.as_mut_slice().par_chunks_mut(oh * ow).zip(src.par_chunks(h * w)).for_each(|(dst, plane)| {
                // Each source row becomes `factor` equal rows of `factor` copies of each value.
                for (rows, src_row) in dst.chunks_exact_mut(factor * ow).zip(plane.chunks_exact(w)) {
                    let (first, rest) = rows.split_at_mut(ow);
                    first.chunks_exact_mut(factor).zip(src_row).for_each(|(d, &v)| d.fill(v));
                    rest.chunks_exact_mut(ow).for_each(|row| row.copy_from_slice(first));
                }
            });
        }
        Ok(Self::from_buffer(out, Shape::new(dims)))
    }

    /// diffusers' `blend_v` / `blend_h` along `dim`, in place: for `y` in `0..weights.len()`,
    /// `self[y] = prev[len_prev - e + y] * w_prev + self[y] * w_cur` where `e = weights.len()`
    /// and `(w_prev, w_cur) = weights[y]`. Two roundings per element, no fused multiply-add,
    /// exactly as PyTorch evaluates the expression. Only the first `e` positions of `self` are
    /// written; `prev` is read from its last `e` positions. All extents but `dim` must agree.
    pub fn blend_leading(&mut self, prev: &Tensor, dim: usize, weights: &[(f32, f32)]) -> Result<()> {
        let _profile = crate::profile::Scope::new("blend");
        const OP: &str = "blend_leading";
        self.check_dim(OP, dim)?;
        let e = weights.len();
        let same_rest = prev.rank() == self.rank()
            && prev.dims().iter().zip(self.dims()).enumerate().all(|(i, (a, b))| i == dim || a == b);
        if !same_rest || e > prev.dims()[dim] || e > self.dims()[dim] {
            return Err(TensorError::ShapeMismatch { op: OP, lhs: prev.shape.clone(), rhs: self.shape.clone() });
        }
        let outer: usize = self.dims()[..dim].iter().product();
        let inner: usize = self.dims()[dim + 1..].iter().product();
        let (len_cur, len_prev) = (self.dims()[dim], prev.dims()[dim]);
        let prev_data = prev.as_slice_f32()?;
        let cur = self.as_mut_slice_f32()?;
        for o in 0..outer {
            for (y, &(w_prev, w_cur)) in weights.iter().enumerate() {
                let a = &prev_data[(o * len_prev + len_prev - e + y) * inner..][..inner];
                let b = &mut cur[(o * len_cur + y) * inner..][..inner];
                for (bv, av) in b.iter_mut().zip(a) {
                    let from_prev = *av * w_prev;
                    let from_cur = *bv * w_cur;
                    *bv = from_prev + from_cur;
                }
            }
        }
        Ok(())
    }

    /// Largest absolute element-wise difference (infinite if shapes differ, NaN-aware: a NaN
    /// anywhere gives NaN).
    pub fn max_abs_diff(&self, other: &Tensor) -> Result<f32> {
        if self.shape != other.shape {
            return Ok(f32::INFINITY);
        }
        // Either side may live on a device: compare host copies.
        let (a, b) = (self.to_vec_f32()?, other.to_vec_f32()?);
        Ok(a.iter().zip(b).fold(0.0f32, |m, (x, y)| {
            let d = (x - y).abs();
            if d.is_nan() || m.is_nan() { f32::NAN } else { m.max(d) }
        }))
    }

    /// True when shape, dtype and every bit of the data are equal.
    pub fn bit_eq(&self, other: &Tensor) -> bool {
        if self.shape != other.shape || self.dtype() != other.dtype() {
            return false;
        }
        match (self.as_bytes(), other.as_bytes()) {
            (Ok(a), Ok(b)) => a == b,
            // A device tensor: compare the bits of host copies.
            _ => match (self.to_vec_f32(), other.to_vec_f32()) {
                (Ok(a), Ok(b)) => a.iter().map(|v| v.to_bits()).eq(b.iter().map(|v| v.to_bits())),
                _ => false,
            },
        }
    }
}

/// Copies a box between two tensors of equal rank and dtype, in contiguous runs of the last
/// dimension.
fn copy_box(src: &Tensor, src_off: &[usize], dst: &mut Tensor, dst_off: &[usize], extent: &[usize]) -> Result<()> {
    const OP: &str = "copy_box";
    let rank = src.rank();
    if dst.rank() != rank || src_off.len() != rank || dst_off.len() != rank || extent.len() != rank {
        return Err(TensorError::InvalidArgument {
            op: OP,
            reason: format!(
                "ranks differ: src {}, dst {}, offsets {}/{}, extent {}",
                src.shape,
                dst.shape,
                src_off.len(),
                dst_off.len(),
                extent.len()
            ),
        });
    }
    for d in 0..rank {
        for (t, off) in [(src, src_off), (&*dst, dst_off)] {
            if off[d] + extent[d] > t.dims()[d] {
                return Err(TensorError::RangeOutOfBounds {
                    op: OP,
                    dim: d,
                    start: off[d],
                    end: off[d] + extent[d],
                    shape: t.shape.clone(),
                });
            }
        }
    }
    if extent.contains(&0) {
        return Ok(());
    }
    if src.cuda().is_some() || dst.cuda().is_some() {
        let (src_strides, dst_strides) = (src.shape.strides(), dst.shape.strides());
        let linear = |off: &[usize], strides: &[usize]| off.iter().zip(strides).map(|(o, s)| o * s).sum::<usize>();
        let (src_at, dst_at) = (linear(src_off, &src_strides), linear(dst_off, &dst_strides));
        let (lhs, rhs) = (src.device(), dst.device());
        let mismatch = TensorError::DeviceMismatch { op: OP, lhs, rhs };
        let (Some(s), Some(d)) = (src.cuda(), dst.cuda_mut()) else { return Err(mismatch) };
        return s.copy_box_into(&src_strides, src_at, d, &dst_strides, dst_at, extent);
    }
    if rank == 0 {
        dst.as_mut_slice_f32()?[0] = src.as_slice_f32()?[0];
        return Ok(());
    }
    let (src_strides, dst_strides) = (src.shape.strides(), dst.shape.strides());
    crate::boxes::copy(
        src.as_slice_f32()?,
        &src_strides,
        src_off,
        dst.as_mut_slice_f32()?,
        &dst_strides,
        dst_off,
        extent,
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iota(dims: &[usize]) -> Tensor {
        let n: usize = dims.iter().product();
        Tensor::from_vec((0..n).map(|i| i as f32).collect(), dims, &Device::Cpu).unwrap()
    }

    #[test]
    fn narrow_then_cat_round_trips() {
        let t = iota(&[2, 3, 5, 7]);
        for dim in 0..4 {
            let len = t.dims()[dim];
            let a = t.narrow(dim, 0, len / 2).unwrap();
            let b = t.narrow(dim, len / 2, len - len / 2).unwrap();
            assert!(Tensor::cat(&[&a, &b], dim).unwrap().bit_eq(&t), "dim {dim}");
        }
    }

    #[test]
    fn narrow_picks_the_right_elements() {
        let t = iota(&[1, 1, 3, 4]);
        let n = t.narrow(3, 1, 2).unwrap();
        assert_eq!(n.to_vec_f32().unwrap(), vec![1.0, 2.0, 5.0, 6.0, 9.0, 10.0]);
        assert!(matches!(t.narrow(2, 2, 2), Err(TensorError::RangeOutOfBounds { .. })));
        assert!(matches!(t.narrow(4, 0, 1), Err(TensorError::DimOutOfRange { .. })));
    }

    /// Boxes land where they are placed, later ones over earlier ones, zeros elsewhere; a
    /// large tensor too, whose buffer the recycle pool may take from one that held sevens.
    #[test]
    fn from_boxes_places_the_boxes_over_zeros() {
        let big = iota(&[1, 1, 3, 4]);
        let small = Tensor::from_vec(vec![-1.0, -2.0], vec![1, 1, 2, 1], &Device::Cpu).unwrap();
        let boxes = [
            BoxOf { src: &big, from: &[0, 0, 0, 1], to: &[0, 0, 1, 1], extent: &[1, 1, 3, 3] },
            BoxOf { src: &small, from: &[0, 0, 0, 0], to: &[0, 0, 0, 0], extent: &[1, 1, 2, 1] },
            BoxOf { src: &small, from: &[0, 0, 1, 0], to: &[0, 0, 2, 2], extent: &[1, 1, 1, 1] },
        ];
        let t = Tensor::from_boxes(vec![1, 1, 5, 5], DType::F32, &Device::Cpu, &boxes).unwrap();
        #[rustfmt::skip]
        let want = vec![
            -1.0, 0.0, 0.0, 0.0, 0.0,
            -2.0, 1.0, 2.0, 3.0, 0.0,
            0.0, 5.0, -2.0, 7.0, 0.0,
            0.0, 9.0, 10.0, 11.0, 0.0,
            0.0, 0.0, 0.0, 0.0, 0.0,
        ];
        assert_eq!(t.to_vec_f32().unwrap(), want);
        let big_box = vec![1usize << 19];
        let at = vec![0usize];
        let large = Tensor::from_vec(vec![3.0; 1 << 19], vec![1 << 19], &Device::Cpu).unwrap();
        let b = BoxOf { src: &large, from: &at, to: &[1 << 19], extent: &big_box };
        drop(Tensor::from_vec(vec![7.0; 1 << 20], vec![1 << 20], &Device::Cpu).unwrap());
        let t = Tensor::from_boxes(vec![1 << 20], DType::F32, &Device::Cpu, &[b]).unwrap();
        let v = t.to_vec_f32().unwrap();
        assert!(v[..1 << 19].iter().all(|&x| x == 0.0) && v[1 << 19..].iter().all(|&x| x == 3.0));
    }

    #[test]
    fn upsample_repeats_pixels() {
        let t = iota(&[1, 1, 2, 2]);
        let u = t.upsample_nearest2d(2).unwrap();
        assert_eq!(u.dims(), &[1, 1, 4, 4]);
        assert_eq!(u.to_vec_f32().unwrap(), vec![0., 0., 1., 1., 0., 0., 1., 1., 2., 2., 3., 3., 2., 2., 3., 3.]);
    }

    #[test]
    #[allow(clippy::needless_range_loop)] // index arithmetic mirrors the layout being checked
    fn blend_matches_the_pytorch_expression_and_touches_only_leading_rows() {
        let prev = iota(&[1, 2, 4, 3]).mul_scalar(0.37).unwrap();
        let mut cur = iota(&[1, 2, 5, 3]).mul_scalar(-1.3).unwrap();
        let before = cur.clone();
        let e = 3;
        let weights: Vec<(f32, f32)> =
            (0..e).map(|y| ((1.0 - y as f64 / e as f64) as f32, (y as f64 / e as f64) as f32)).collect();
        cur.blend_leading(&prev, 2, &weights).unwrap();
        for c in 0..2 {
            for y in 0..5 {
                for x in 0..3 {
                    let i = (c * 5 + y) * 3 + x;
                    let got = cur.as_slice_f32().unwrap()[i];
                    let old = before.as_slice_f32().unwrap()[i];
                    if y < e {
                        let a = prev.as_slice_f32().unwrap()[(c * 4 + 4 - e + y) * 3 + x];
                        let (wp, wc) = weights[y];
                        assert_eq!(got.to_bits(), ((a * wp) + (old * wc)).to_bits());
                    } else {
                        assert_eq!(got.to_bits(), old.to_bits());
                    }
                }
            }
        }
    }

    #[test]
    fn bytes_round_trip_and_hash_sees_shape() {
        let t = iota(&[2, 3]);
        let back = Tensor::from_bytes(DType::F32, [2, 3], t.as_bytes().unwrap(), &Device::Cpu).unwrap();
        assert!(back.bit_eq(&t));
        let reshaped = Tensor::from_bytes(DType::F32, [3, 2], t.as_bytes().unwrap(), &Device::Cpu).unwrap();
        assert_ne!(t.content_hash().unwrap(), reshaped.content_hash().unwrap());
        assert_eq!(t.content_hash().unwrap(), back.content_hash().unwrap());
    }

    #[test]
    fn devices_parse_and_an_unusable_cuda_device_is_a_typed_error() {
        assert_eq!("cuda:1".parse::<Device>().unwrap(), Device::Cuda(1));
        assert!("gpu".parse::<Device>().is_err());
        // Device 999 exists nowhere: the error is the same with or without a GPU.
        let err = Tensor::zeros([1], DType::F32, &Device::Cuda(999)).unwrap_err();
        assert!(matches!(err, TensorError::DeviceUnavailable { .. }), "{err}");
    }

    #[test]
    fn the_cpu_backend_is_f32_only() {
        let t = iota(&[2, 3]);
        assert!(t.to_dtype(DType::F32).unwrap().bit_eq(&t), "converting to its own type is a copy");
        let err = t.to_dtype(DType::BF16).unwrap_err();
        assert!(matches!(err, TensorError::UnsupportedDType { dtype: DType::BF16, device: Device::Cpu, .. }), "{err}");
        assert!(Tensor::zeros([2], DType::BF16, &Device::Cpu).is_err());
    }
}
