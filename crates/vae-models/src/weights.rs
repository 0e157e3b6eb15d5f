//! Loading diffusers weights: `diffusion_pytorch_model.safetensors`, or shards listed in
//! `diffusion_pytorch_model.safetensors.index.json`; memory-mapped; f32, f16 and bf16 stored
//! weights become f32 tensors.
//!
//! Modules take their weights by state-dict key with the shape they need; afterwards
//! [`WeightStore::finish`] reports every key nobody took, so a checkpoint that does not match the
//! config fails loudly instead of silently running with half its weights.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use vae_tensor::{DType, Device, SafetensorsError, Tensor};

use crate::{ModelError, Result};

/// File name of a single-file diffusers checkpoint.
pub const WEIGHTS_FILE: &str = "diffusion_pytorch_model.safetensors";
/// File name of the index of a sharded diffusers checkpoint.
pub const WEIGHTS_INDEX_FILE: &str = "diffusion_pytorch_model.safetensors.index.json";

struct Shard {
    path: PathBuf,
    mmap: Mmap,
    data_start: usize,
}

struct Entry {
    shard: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    range: (usize, usize),
}

/// The weights of one model directory, by state-dict key — or, for presets and tests, seeded
/// random weights generated on request ([`WeightStore::synthetic`]).
pub struct WeightStore {
    shards: Vec<Shard>,
    entries: BTreeMap<String, Entry>,
    taken: BTreeSet<String>,
    /// `Some(seed)`: every `take` makes up a tensor instead of reading one.
    synthetic: Option<u64>,
    synthetic_params: usize,
    /// Where `take` puts the tensors it returns.
    device: Device,
    /// The element type of the weight matrices `take` returns (see [`WeightStore::set_dtype`]).
    dtype: DType,
}

impl std::fmt::Debug for WeightStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeightStore").field("shards", &self.shards.len()).field("tensors", &self.entries.len()).finish()
    }
}

impl WeightStore {
    /// Opens the weights of a diffusers model directory (single file or sharded).
    pub fn open_dir(dir: &Path) -> Result<Self> {
        let single = dir.join(WEIGHTS_FILE);
        let index = dir.join(WEIGHTS_INDEX_FILE);
        if single.is_file() {
            return Self::open_files(&[single]);
        }
        if index.is_file() {
            let text =
                std::fs::read_to_string(&index).map_err(|source| ModelError::Io { path: index.clone(), source })?;
            let parsed: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| ModelError::Config { path: index.clone(), message: e.to_string() })?;
            let map = parsed.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| ModelError::Config {
                path: index.clone(),
                message: "no \"weight_map\" object".into(),
            })?;
            let mut files: Vec<String> = Vec::new();
            for (key, file) in map {
                let file = file.as_str().ok_or_else(|| ModelError::Config {
                    path: index.clone(),
                    message: format!("weight_map entry {key:?} is not a file name"),
                })?;
                if !files.iter().any(|f| f == file) {
                    files.push(file.to_string());
                }
            }
            files.sort();
            let paths: Vec<PathBuf> = files.iter().map(|f| dir.join(f)).collect();
            return Self::open_files(&paths);
        }
        Err(ModelError::Io {
            path: single,
            source: std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("neither it nor {WEIGHTS_INDEX_FILE} exists"),
            ),
        })
    }

    /// Opens one or more safetensors files whose keys together form the state dict.
    pub fn open_files(paths: &[PathBuf]) -> Result<Self> {
        let mut shards = Vec::with_capacity(paths.len());
        let mut entries = BTreeMap::new();
        for path in paths {
            let file = File::open(path).map_err(|source| ModelError::Io { path: path.clone(), source })?;
            // SAFETY: the map is read-only and lives as long as the store; like every reader
            // of model files (PyTorch, candle) we rely on nobody truncating the file meanwhile.
            let mmap = unsafe { Mmap::map(&file) }.map_err(|source| ModelError::Io { path: path.clone(), source })?;
            let bad = |e: safetensors::SafeTensorError| ModelError::Safetensors {
                path: path.clone(),
                message: e.to_string(),
            };
            let (header_len, metadata) = SafeTensors::read_metadata(&mmap).map_err(bad)?;
            let shard = shards.len();
            for (name, info) in metadata.tensors() {
                let entry = Entry { shard, dtype: info.dtype, shape: info.shape.clone(), range: info.data_offsets };
                if entries.insert(name.clone(), entry).is_some() {
                    return Err(ModelError::Safetensors {
                        path: path.clone(),
                        message: format!("weight {name:?} appears in more than one file"),
                    });
                }
            }
            shards.push(Shard { path: path.clone(), mmap, data_start: 8 + header_len });
        }
        Ok(Self {
            shards,
            entries,
            taken: BTreeSet::new(),
            synthetic: None,
            synthetic_params: 0,
            device: Device::Cpu,
            dtype: DType::F32,
        })
    }

    /// A store that answers every request with seeded random weights: weights and biases of
    /// convolutions and linear layers uniform in ±1/√fan_in (PyTorch's default scale), norm
    /// scales near 1 and shifts near 0, BatchNorm variances positive. The same seed and key
    /// always give the same tensor, so a preset model is identical on every rank and run.
    pub fn synthetic(seed: u64) -> Self {
        Self {
            shards: Vec::new(),
            entries: BTreeMap::new(),
            taken: BTreeSet::new(),
            synthetic: Some(seed),
            synthetic_params: 0,
            device: Device::Cpu,
            dtype: DType::F32,
        }
    }

    fn make_up(&mut self, seed: u64, key: &str, shape: &[usize]) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        self.synthetic_params += n;
        let mut state = seed ^ 0x9e37_79b9_7f4a_7c15;
        for b in key.bytes() {
            state = (state ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
        let mut uniform = move || {
            // splitmix64: small, seedable, good enough for weights.
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            (z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        };
        // The module the tensor belongs to: `norm1`, `group_norm`, `conv_norm_out` are norms;
        // `conv1`, `conv_in`, `to_q` are not.
        let module = key.rsplit('.').nth(1).unwrap_or("");
        let is_norm = module.contains("norm");
        let data: Vec<f32> = if key.ends_with("running_var") {
            (0..n).map(|_| 0.75 + 0.25 * uniform()).collect()
        } else if key.ends_with("running_mean") || (is_norm && key.ends_with("bias")) {
            (0..n).map(|_| 0.1 * uniform()).collect()
        } else if is_norm {
            (0..n).map(|_| 1.0 + 0.1 * uniform()).collect()
        } else {
            // Conv weight [out, in, kh, kw], linear [out, in], or a bias [out]: scale by the
            // fan-in the layer's weight has (unknown for a bias; its layer's width will do).
            let fan_in = if shape.len() > 1 { shape[1..].iter().product::<usize>() } else { shape[0].max(1) };
            let bound = 1.0 / (fan_in as f32).sqrt();
            (0..n).map(|_| bound * uniform()).collect()
        };
        self.taken.insert(key.to_string());
        Ok(Tensor::from_vec(data, shape.to_vec(), &Device::Cpu)?)
    }

    /// Number of tensors in the checkpoint.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True for an empty checkpoint.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Whether the checkpoint has `key` (a synthetic store has every key).
    pub fn contains(&self, key: &str) -> bool {
        self.synthetic.is_some() || self.entries.contains_key(key)
    }

    /// The stored element types, with how many tensors use each (for `inspect`).
    pub fn dtypes(&self) -> HashMap<String, usize> {
        let mut counts = HashMap::new();
        for e in self.entries.values() {
            *counts.entry(format!("{:?}", e.dtype).to_lowercase()).or_insert(0) += 1;
        }
        counts
    }

    /// Total number of scalar parameters (for a synthetic store: made up so far).
    pub fn parameter_count(&self) -> usize {
        self.synthetic_params + self.entries.values().map(|e| e.shape.iter().product::<usize>()).sum::<usize>()
    }

    /// The tensor `key`, which must have shape `expected`, on the store's device: f32, or with
    /// [`WeightStore::set_dtype`] bf16 (see there).
    pub fn take(&mut self, key: &str, expected: &[usize]) -> Result<Tensor> {
        let host = self.take_on_host(key, expected)?;
        if self.dtype == DType::F32 {
            return if self.device.is_cpu() { Ok(host) } else { Ok(host.to_device(&self.device)?) };
        }
        // A per-channel vector (a bias, a norm's scale: at most one extent above 1) keeps f32
        // storage, holding the values a bf16 model has; the kernels take such parameters in f32.
        let per_channel = expected.iter().filter(|&&d| d > 1).count() <= 1;
        if per_channel {
            let rounded: Vec<f32> = host.to_vec_f32()?.into_iter().map(|v| half::bf16::from_f32(v).to_f32()).collect();
            return Ok(Tensor::from_vec(rounded, expected.to_vec(), &self.device)?);
        }
        Ok(host.to_device(&self.device)?.to_dtype(self.dtype)?)
    }

    /// Weight matrices taken from now on have type `dtype` (`vae.to(dtype)`); per-channel
    /// vectors keep f32 storage rounded to `dtype`'s values. Anything but f32 needs a device
    /// backend with that type: taking a weight is then an [`vae_tensor::TensorError::UnsupportedDType`]
    /// error elsewhere (the CPU backend is f32 only).
    pub fn set_dtype(&mut self, dtype: DType) {
        self.dtype = dtype;
    }

    /// Tensors taken from now on are placed on `device` (uploaded once, at load).
    pub fn set_device(&mut self, device: Device) {
        self.device = device;
    }

    /// Where tensors taken now are placed.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The element type of weight matrices taken now.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    fn take_on_host(&mut self, key: &str, expected: &[usize]) -> Result<Tensor> {
        if let Some(seed) = self.synthetic {
            return self.make_up(seed, key, expected);
        }
        let entry = self
            .entries
            .get(key)
            .ok_or_else(|| ModelError::MissingWeight { key: key.to_string(), expected: expected.to_vec() })?;
        if entry.shape != expected {
            return Err(ModelError::WeightShape {
                key: key.to_string(),
                expected: expected.to_vec(),
                found: entry.shape.clone(),
            });
        }
        let shard = &self.shards[entry.shard];
        let (start, end) = (shard.data_start + entry.range.0, shard.data_start + entry.range.1);
        let bytes = shard.mmap.get(start..end).ok_or_else(|| ModelError::Safetensors {
            path: shard.path.clone(),
            message: format!("weight {key:?} lies outside the file"),
        })?;
        let view = TensorView::new(entry.dtype, entry.shape.clone(), bytes).map_err(|e| ModelError::Safetensors {
            path: shard.path.clone(),
            message: format!("weight {key:?}: {e}"),
        })?;
        let tensor = Tensor::from_safetensors_view(&view).map_err(|e| match e {
            SafetensorsError::NotFloat { dtype } => {
                ModelError::WeightDtype { key: key.to_string(), dtype: format!("{dtype:?}").to_lowercase() }
            }
            SafetensorsError::Tensor(e) => ModelError::Tensor(e),
        })?;
        // A NaN or infinity in a weight would silently poison every output: refused at load.
        let data = tensor.as_slice_f32()?;
        if let Some(first) = data.iter().position(|v| !v.is_finite()) {
            let count = data.iter().filter(|v| !v.is_finite()).count();
            return Err(ModelError::NonFiniteWeight { key: key.to_string(), count, first: data[first] });
        }
        self.taken.insert(key.to_string());
        Ok(tensor)
    }

    /// Marks `key` as accounted for without loading it (bookkeeping buffers such as
    /// BatchNorm's `num_batches_tracked`). Absent keys are fine.
    pub fn skip(&mut self, key: &str) {
        if self.entries.contains_key(key) {
            self.taken.insert(key.to_string());
        }
    }

    /// Marks every key starting with `prefix` as accounted for (a sub-model not loaded).
    pub fn skip_prefix(&mut self, prefix: &str) {
        let keys: Vec<String> = self.entries.keys().filter(|k| k.starts_with(prefix)).cloned().collect();
        self.taken.extend(keys);
    }

    /// Fails with every key that no module took.
    pub fn finish(self) -> Result<()> {
        let unused: Vec<String> = self.entries.keys().filter(|k| !self.taken.contains(*k)).cloned().collect();
        if unused.is_empty() { Ok(()) } else { Err(ModelError::UnexpectedWeights { keys: unused }) }
    }
}

/// A view of the store under a key prefix, as diffusers' module tree nests them
/// (`decoder.up_blocks.0.resnets.1.conv1.weight`).
pub struct Weights<'a> {
    store: &'a mut WeightStore,
    prefix: String,
}

impl<'a> Weights<'a> {
    /// The root of `store`.
    pub fn new(store: &'a mut WeightStore) -> Self {
        Self { store, prefix: String::new() }
    }

    /// The sub-tree `name` (a module or an index).
    pub fn pp(&mut self, name: impl std::fmt::Display) -> Weights<'_> {
        let prefix = if self.prefix.is_empty() { name.to_string() } else { format!("{}.{name}", self.prefix) };
        Weights { store: self.store, prefix }
    }

    /// The tensor `name` under this prefix, with shape `shape`.
    pub fn get(&mut self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let key = if self.prefix.is_empty() { name.to_string() } else { format!("{}.{name}", self.prefix) };
        self.store.take(&key, shape)
    }

    /// Accounts for `name` under this prefix without loading it (see [`WeightStore::skip`]).
    pub fn skip(&mut self, name: &str) {
        let key = if self.prefix.is_empty() { name.to_string() } else { format!("{}.{name}", self.prefix) };
        self.store.skip(&key);
    }

    /// Whether the tensor `name` exists under this prefix.
    pub fn contains(&self, name: &str) -> bool {
        let key = if self.prefix.is_empty() { name.to_string() } else { format!("{}.{name}", self.prefix) };
        self.store.contains(&key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_float_types_load_as_f32_and_others_are_refused_by_key() {
        let dir = std::env::temp_dir().join(format!("vae-weights-dtypes-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f16: Vec<u8> = [0.5f32, -3.0].iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect();
        let int = [0u8; 8];
        let views = [
            ("conv.bias", TensorView::new(Dtype::F16, vec![2], &f16).unwrap()),
            ("conv.count", TensorView::new(Dtype::I32, vec![2], &int).unwrap()),
        ];
        let path = dir.join(WEIGHTS_FILE);
        std::fs::write(&path, safetensors::serialize(views, None).unwrap()).unwrap();
        let mut store = WeightStore::open_dir(&dir).unwrap();
        assert_eq!(store.take("conv.bias", &[2]).unwrap().to_vec_f32().unwrap(), vec![0.5, -3.0]);
        let err = store.take("conv.count", &[2]).unwrap_err();
        assert!(
            matches!(&err, ModelError::WeightDtype { key, dtype } if key == "conv.count" && dtype == "i32"),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_bf16_store_rounds_per_channel_vectors_and_types_weight_matrices() {
        let mut f32_store = WeightStore::synthetic(7);
        let mut bf16_store = WeightStore::synthetic(7);
        bf16_store.set_dtype(DType::BF16);
        // A bias and a Wan-style [C, 1, 1] scale: f32 storage holding bf16 values.
        for (key, shape) in [("conv.bias", &[16][..]), ("norm.gamma", &[16, 1, 1][..])] {
            let exact = f32_store.take(key, shape).unwrap().to_vec_f32().unwrap();
            let rounded = bf16_store.take(key, shape).unwrap();
            assert_eq!(rounded.dtype(), DType::F32);
            let rounded = rounded.to_vec_f32().unwrap();
            for (e, r) in exact.iter().zip(&rounded) {
                assert_eq!(*r, half::bf16::from_f32(*e).to_f32(), "{key}");
            }
            assert!(exact.iter().zip(&rounded).any(|(e, r)| e != r), "{key}: the values were rounded");
        }
        // A weight matrix becomes a bf16 tensor, which the (f32-only) CPU backend refuses.
        let err = bf16_store.take("conv.weight", &[16, 8, 3, 3]).unwrap_err();
        assert!(
            matches!(err, ModelError::Tensor(vae_tensor::TensorError::UnsupportedDType { dtype: DType::BF16, .. })),
            "{err}"
        );
    }
}
