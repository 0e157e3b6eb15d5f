//! `candle_core::Tensor`s in and out (feature `candle`), so that a candle-based engine (the
//! candle examples, mistral.rs) decodes and encodes with the tensors it holds:
//! [`Group::decode_candle`] and [`Group::encode_candle`], and the conversions under them,
//! [`from_candle`] and [`to_candle`].
//!
//! - In: a CPU tensor of f32 elements in a contiguous layout is copied once by [`from_candle`]
//!   (the caller keeps its handle and may write the storage in place meanwhile), or read in
//!   place by the `unsafe` [`from_candle_unchecked`] (our tensor holds a clone of the candle
//!   tensor, which keeps its storage alive); any other float type (bf16, f16, f64) or layout is
//!   converted by candle once (`to_dtype(F32)` / `contiguous()`) and that fresh tensor is read
//!   in place, as the CPU backend computes in f32. Integer tensors are refused
//!   ([`ErrorKind::InvalidInput`]).
//! - Out: an f32 CPU tensor over our result's memory, handed over without a copy.
//! - Devices: CPU only; a tensor on another device is refused ([`ErrorKind::Unsupported`]), so a
//!   CUDA engine moves it to the CPU first. An engine built with candle's `cuda` feature still
//!   links this crate, CUDA backend included (see `vae_tensor::cuda` on cudarc's linking); this
//!   project does not build candle's CUDA backend (nvcc, and 10 minutes of it on two cores), so
//!   candle CUDA tensors do not go in or out on the device (docs/embedding.md).
//!
//! ```
//! # let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../fixtures/autoencoder_kl/sd_like");
//! use vae_parallel::{Decode, Group, Vae};
//!
//! let vae = Vae::load(dir)?;
//! let latent = candle_core::Tensor::zeros((1, 4, 16, 16), candle_core::DType::F32, &candle_core::Device::Cpu)
//!     .expect("a candle tensor");
//! let image = Group::local(2)?.decode_candle(&vae, &latent, &Decode::default())?.expect("rank 0's");
//! assert_eq!(image.dims(), &[1, 3, 128, 128]);
//! # Ok::<(), vae_parallel::Error>(())
//! ```
//!
//! [`ErrorKind::InvalidInput`]: crate::ErrorKind::InvalidInput
//! [`ErrorKind::Unsupported`]: crate::ErrorKind::Unsupported

use std::sync::Arc;

use candle_core::{DType as CandleDType, Device as CandleDevice, Storage, Tensor as CandleTensor};
use vae_models::ModelError;
use vae_tensor::Tensor;

use crate::{Decode, Encode, Error, Group, Result, Vae};

/// A candle tensor as a host f32 tensor of ours. An f32 tensor in a contiguous layout on the
/// CPU is copied once (under candle's read lock of its storage), since the caller keeps its
/// handle and may write the storage in place (`slice_set`, ...) while ours lives; any other
/// float type or layout is converted once by candle, and that fresh tensor, which only ours
/// holds, is read in place. [`from_candle_unchecked`] reads an f32 tensor in place instead.
pub fn from_candle(t: &CandleTensor) -> Result<Tensor> {
    let (t, fresh) = f32_contiguous(t)?;
    if fresh {
        // SAFETY: `t` was made by candle's conversion just now (new storage) and this function
        // holds its only handle, which it hands to ours: nothing else can write its storage.
        return unsafe { lend(t) };
    }
    let dims = t.dims().to_vec();
    let data = {
        let (storage, layout) = t.storage_and_layout();
        contiguous_values(&storage, layout)?.to_vec()
    };
    Ok(Tensor::from_vec(data, dims, &vae_tensor::Device::Cpu)?)
}

/// [`from_candle`] without its copy: an f32 tensor in a contiguous layout on the CPU is read in
/// place (ours holds a clone of the candle tensor, which keeps its storage alive).
///
/// # Safety
///
/// No handle of the candle tensor's storage (the caller's `t`, its clones, views of it) may
/// write it in place (`slice_set`, in-place ops, ...) from any thread while the returned tensor
/// or anything lent from it lives: ours reads that memory without candle's lock.
pub unsafe fn from_candle_unchecked(t: &CandleTensor) -> Result<Tensor> {
    let (t, _) = f32_contiguous(t)?;
    // SAFETY: the caller does not write the storage in place while ours lives (this
    // function's contract); a converted tensor is fresh and held by ours only.
    unsafe { lend(t) }
}

/// The candle tensor as a contiguous f32 CPU tensor, and whether candle made it anew (a
/// conversion: no other handle of it exists) rather than cloning the caller's handle.
fn f32_contiguous(t: &CandleTensor) -> Result<(CandleTensor, bool)> {
    if !matches!(t.device(), CandleDevice::Cpu) {
        return Err(Error::Model(ModelError::Unsupported(format!(
            "a candle tensor on {:?}: only CPU tensors are read (the candle feature is built without CUDA)",
            t.device().location()
        ))));
    }
    let (t, converted) = match t.dtype() {
        CandleDType::F32 => (t.clone(), false),
        CandleDType::BF16 | CandleDType::F16 | CandleDType::F64 => {
            (t.to_dtype(CandleDType::F32).map_err(candle_error)?, true)
        }
        other => {
            return Err(Error::Model(ModelError::InvalidInput(format!(
                "a candle tensor of {other:?}: expected f32, bf16, f16 or f64"
            ))));
        }
    };
    // `contiguous` copies into new storage when the layout is not contiguous, else it clones.
    let relaid = !t.is_contiguous();
    let t = t.contiguous().map_err(candle_error)?;
    Ok((t, converted || relaid))
}

/// The elements of a contiguous f32 CPU storage's view.
fn contiguous_values<'a>(storage: &'a Storage, layout: &candle_core::Layout) -> Result<&'a [f32]> {
    let Storage::Cpu(cpu) = storage else {
        return Err(Error::Model(ModelError::Unsupported("a candle tensor off the CPU".into())));
    };
    let values = cpu.as_slice::<f32>().map_err(candle_error)?;
    let Some((start, end)) = layout.contiguous_offsets() else {
        return Err(Error::Model(ModelError::InvalidInput("a candle tensor that is not contiguous".into())));
    };
    Ok(&values[start..end])
}

/// Ours over a contiguous f32 CPU candle tensor's memory, holding the tensor.
///
/// # Safety
///
/// Nothing may write the tensor's storage in place while the returned tensor lives.
unsafe fn lend(t: CandleTensor) -> Result<Tensor> {
    let dims = t.dims().to_vec();
    let data = {
        let (storage, layout) = t.storage_and_layout();
        contiguous_values(&storage, layout)?.as_ptr()
    };
    let owner: Arc<dyn std::any::Any + Send + Sync> = Arc::new(t);
    // SAFETY: `data` starts the tensor's elements (`dims`' count of f32, contiguous, aligned as
    // a `Vec<f32>`'s) in the candle storage that `owner`, a clone of the tensor held by ours,
    // keeps alive; a CPU storage's vector is never reallocated, and nothing writes it in place
    // while our tensor lives (this function's contract). Our tensors never write lent memory.
    Ok(unsafe { Tensor::lent(data, dims, owner) })
}

/// A host tensor of ours as an f32 candle tensor on the CPU, over the same memory (no copy when
/// the tensor owns it).
pub fn to_candle(t: Tensor) -> Result<CandleTensor> {
    let dims = t.dims().to_vec();
    if !t.device().is_cpu() {
        return Err(Error::Model(ModelError::Unsupported(format!(
            "a tensor on {}: only CPU tensors become candle tensors (the candle feature is built without CUDA)",
            t.device()
        ))));
    }
    let data = t.into_vec_f32()?;
    CandleTensor::from_vec(data, dims, &CandleDevice::Cpu).map_err(candle_error)
}

/// A candle failure (a conversion of the caller's tensor) as an invalid input.
fn candle_error(e: candle_core::Error) -> Error {
    Error::Model(ModelError::InvalidInput(format!("candle: {e}")))
}

impl Group {
    /// [`Group::decode`] of a candle tensor (read by [`from_candle`], which copies an f32 input:
    /// the caller keeps its handle and could write it from another thread during the decode):
    /// the pixels as an f32 candle tensor on the CPU, on the ranks the output goes to.
    pub fn decode_candle(&self, vae: &Vae, latent: &CandleTensor, options: &Decode) -> Result<Option<CandleTensor>> {
        let latent = from_candle(latent)?;
        self.decode(vae, &latent, options)?.map(to_candle).transpose()
    }

    /// [`Group::encode`] of a candle tensor (read by [`from_candle`], a copy of an f32 input): the latent (or moments) as
    /// an f32 candle tensor on the CPU, on the ranks it goes to.
    pub fn encode_candle(&self, vae: &Vae, image: &CandleTensor, options: &Encode) -> Result<Option<CandleTensor>> {
        let image = from_candle(image)?;
        self.encode(vae, &image, options)?.map(to_candle).transpose()
    }
}
