//! CUDA tensors through DLPack: a producer's device memory read in place, computed on, and our
//! result lent back as `kDLCUDA`, without the host; the conversions that stay on the device; the
//! refusals. Needs a GPU and a build with the kernels embedded; under `cargo xtask gpu-emu` the
//! fake driver counts host copies, and every test here proves its path made none.
#![cfg(feature = "cuda")]
#![allow(clippy::print_stderr)] // a skipped GPU test says so

#[path = "support/cuda_producer.rs"]
mod cuda_producer;

use std::sync::{Arc, Mutex, MutexGuard};

use cuda_producer::{Lend, f32s, host_copies, lend, read_device};
use vae_tensor::cuda::{embedded_modules, probe};
use vae_tensor::dlpack::{
    DL_BFLOAT, DL_CPU, DL_CUDA, DL_FLOAT, DLDataType, DLDevice, DlpackError, Exported, Imported, consumer_stream,
};
use vae_tensor::{DType, Device, Tensor};

const CUDA: Device = Device::Cuda(0);

/// The host-copy count is the process's: one test at a time reads it.
fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// True when ops can run on `cuda:0`; otherwise prints why `test` is skipped.
fn gpu(test: &str) -> bool {
    if let Err(reason) = probe(0) {
        eprintln!("{test}: skipped, {reason}");
        return false;
    }
    if embedded_modules().is_empty() {
        eprintln!("{test}: skipped, this build embeds no kernels (run `cargo xtask kernels` before building)");
        return false;
    }
    true
}

fn pattern(n: usize, seed: u64) -> Vec<f32> {
    Tensor::seeded_uniform(vec![n], seed, -2.0, 2.0, &Device::Cpu).unwrap().to_vec_f32().unwrap()
}

/// Runs `path` and asserts that it made no copy between the host and the device (under the fake
/// driver; a real driver has no count, and only the results are checked there).
fn without_host_copies<T>(what: &str, path: impl FnOnce() -> T) -> T {
    let before = host_copies();
    let out = path();
    let after = host_copies();
    assert_eq!(before, after, "{what}: (host-to-device, device-to-host) copies before and after");
    out
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// Takes over a lent managed tensor.
fn import(lent: &cuda_producer::Lent) -> Imported {
    // SAFETY: a managed tensor of the producer, handed over once.
    unsafe { Imported::from_versioned(lent.managed) }.unwrap()
}

/// Reads a lent tensor as the consumer does, ordered after our stream.
fn read_on_device(lent: &cuda_producer::Lent, dtype: DType) -> Result<Tensor, DlpackError> {
    let ready = consumer_stream(0).unwrap();
    // SAFETY: the producer's description is true (the memory is on cuda:0 as described), and
    // `ready` is the thread's own stream.
    unsafe { import(lent).into_device_tensor(0, dtype, Some(ready)) }
}

/// A lent managed tensor's description: `(address, device, dtype, byte_offset)`; its deleter
/// is called once by `release`.
struct Description {
    managed: std::ptr::NonNull<vae_tensor::dlpack::DLManagedTensorVersioned>,
}

impl Description {
    fn lend(exported: &Arc<Exported>, stream: Option<u64>) -> Self {
        Self { managed: exported.to_versioned(stream).unwrap() }
    }

    fn tensor(&self) -> &vae_tensor::dlpack::DLTensor {
        // SAFETY: ours, live until `drop`.
        unsafe { &self.managed.as_ref().dl_tensor }
    }

    /// The f32 elements' bits (bf16 ones widened), read back by the driver.
    fn bits(&self, n: usize) -> Vec<u32> {
        let t = self.tensor();
        let width = if t.dtype.code == DL_BFLOAT { 2 } else { 4 };
        let bytes = read_device(t.data as u64 + t.byte_offset, n * width);
        match width {
            4 => f32s(&bytes).iter().map(|v| v.to_bits()).collect(),
            _ => bytes.chunks_exact(2).map(|c| u32::from(u16::from_ne_bytes([c[0], c[1]])) << 16).collect(),
        }
    }
}

impl Drop for Description {
    fn drop(&mut self) {
        // SAFETY: our own managed tensor's deleter, called once.
        unsafe { (self.managed.as_ref().deleter.unwrap())(self.managed.as_ptr()) };
    }
}

#[test]
fn a_producers_cuda_tensor_is_computed_on_in_place_and_lent_back_without_the_host() {
    if !gpu("dlpack round trip") {
        return;
    }
    let _serial = serial();
    let dims = [1, 8, 6, 6];
    let values = pattern(8 * 36, 1);
    let (gamma, beta) = (pattern(8, 2), pattern(8, 3));
    let gamma = Tensor::from_vec(gamma, vec![8], &CUDA).unwrap();
    let beta = Tensor::from_vec(beta, vec![8], &CUDA).unwrap();
    let op = |x: &Tensor| x.group_norm_silu(4, &gamma, &beta, 1e-6).unwrap().affine(0.5, 0.25).unwrap();
    // The host path: the values uploaded, the result downloaded.
    let want = op(&Tensor::from_vec(values.clone(), dims.to_vec(), &CUDA).unwrap()).to_vec_f32().unwrap();

    let lent = lend(Lend::f32(values.clone(), &dims));
    let (exported, lent_back) = without_host_copies("import, compute, export", || {
        let x = read_on_device(&lent, DType::F32).unwrap();
        assert_eq!((x.device(), x.dims(), x.dtype()), (CUDA, &dims[..], DType::F32));
        let y = op(&x);
        assert_eq!(lent.deleted(), 0, "the producer's memory is held while the tensor reads it");
        drop(x);
        assert_eq!(lent.deleted(), 1, "the deleter runs once the tensor is dropped");
        let exported = Arc::new(Exported::new(y).unwrap());
        let lent_back = Description::lend(&exported, None);
        (exported, lent_back)
    });
    let t = lent_back.tensor();
    assert_eq!(t.device, DLDevice { device_type: DL_CUDA, device_id: 0 });
    assert_eq!(t.dtype, DLDataType { code: DL_FLOAT, bits: 32, lanes: 1 });
    assert_eq!((t.ndim, t.byte_offset), (4, 0));
    assert_eq!(lent_back.bits(want.len()), bits(&want), "the lent result, read back by the driver, is the host path's");
    // A second consumer on a stream of its own (the legacy default stream): ordered on the device.
    let on_stream = without_host_copies("lending to a stream", || Description::lend(&exported, Some(1)));
    assert_eq!(on_stream.bits(want.len()), bits(&want));
    let weak = Arc::downgrade(&exported);
    drop((exported, lent_back));
    assert!(weak.upgrade().is_some(), "a consumer still holds the result");
    drop(on_stream);
    assert!(weak.upgrade().is_none(), "the last deleter released it");
    assert_eq!(lent.deleted(), 1, "the producer's deleter ran once");
}

#[test]
fn writing_an_imported_tensor_in_place_leaves_the_producers_memory_alone() {
    if !gpu("dlpack write in place") {
        return;
    }
    let _serial = serial();
    let values = pattern(64, 4);
    let want = Tensor::from_vec(values.clone(), vec![4, 16], &CUDA).unwrap().silu().unwrap().to_vec_f32().unwrap();
    let lent = lend(Lend::f32(values.clone(), &[4, 16]));
    let x = without_host_copies("import and a SiLU in place", || {
        let mut x = read_on_device(&lent, DType::F32).unwrap();
        // A kernel that writes its operand in place.
        x.silu_inplace().unwrap();
        x
    });
    assert_eq!(lent.deleted(), 1, "the write copied the memory on the device and let the producer's go");
    assert_eq!(bits(&x.to_vec_f32().unwrap()), bits(&want));
    let producers = f32s(&read_device(lent.address, 64 * 4));
    assert_eq!(bits(&producers), bits(&values), "the producer's memory holds what it lent");
}

#[test]
fn other_float_types_and_alignments_cost_one_copy_on_the_device() {
    if !gpu("dlpack conversions") {
        return;
    }
    let _serial = serial();
    let values = pattern(48, 5);
    let rounded: Vec<f32> = values.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
    for (stored, wanted) in [(DType::BF16, DType::BF16), (DType::BF16, DType::F32), (DType::F32, DType::BF16)] {
        let lent = lend(Lend { dtype: stored, ..Lend::f32(values.clone(), &[3, 16]) });
        let x = without_host_copies("import", || read_on_device(&lent, wanted).unwrap());
        assert_eq!((x.dtype(), x.device()), (wanted, CUDA), "{stored} read as {wanted}");
        assert_eq!(lent.deleted(), usize::from(stored != wanted), "{stored} as {wanted}: a conversion lets go at once");
        let want = if stored == DType::F32 && wanted == DType::F32 { values.clone() } else { rounded.clone() };
        assert_eq!(bits(&x.to_vec_f32().unwrap()), bits(&want), "{stored} read as {wanted}");
        let exported = Arc::new(Exported::new(x).unwrap());
        let lent_back = without_host_copies("export", || Description::lend(&exported, None));
        let code = if wanted == DType::BF16 { DL_BFLOAT } else { DL_FLOAT };
        assert_eq!(lent_back.tensor().dtype.code, code, "lent in its own type");
        assert_eq!(lent_back.bits(48), bits(&want));
        drop((lent_back, exported));
        assert_eq!(lent.deleted(), 1);
    }
    // 4 bytes into an allocation: not 16-byte aligned, copied device to device first.
    let lent = lend(Lend { byte_offset: 4, ..Lend::f32(values.clone(), &[48]) });
    let x = without_host_copies("misaligned import", || read_on_device(&lent, DType::F32).unwrap());
    assert_eq!(lent.deleted(), 1, "copied, the producer's memory let go");
    assert_eq!(
        bits(&x.silu().unwrap().to_vec_f32().unwrap()),
        bits(&Tensor::from_vec(values, vec![48], &CUDA).unwrap().silu().unwrap().to_vec_f32().unwrap())
    );
}

#[test]
fn device_tensors_it_cannot_read_in_place_are_refused_by_type() {
    if !gpu("dlpack refusals") {
        return;
    }
    let _serial = serial();
    let values = pattern(6, 6);
    let refused = |spec: Lend| {
        let lent = lend(spec);
        let err = without_host_copies("a refusal", || read_on_device(&lent, DType::F32).unwrap_err());
        assert_eq!(lent.deleted(), 1, "a refused tensor's deleter runs once: {err}");
        err
    };
    let other =
        refused(Lend { device: DLDevice { device_type: DL_CUDA, device_id: 1 }, ..Lend::f32(values.clone(), &[2, 3]) });
    assert!(matches!(&other, DlpackError::OtherDevice { got, want } if got == "cuda:1" && want == "cuda:0"), "{other}");
    let f16 = DLDataType { code: DL_FLOAT, bits: 16, lanes: 1 };
    let err = refused(Lend { claimed_dtype: Some(f16), ..Lend::f32(values.clone(), &[2, 3]) });
    assert!(matches!(&err, DlpackError::DType(name) if name.starts_with("float16")), "{err}");
    let err = refused(Lend { strides: Some(vec![1, 2]), ..Lend::f32(values.clone(), &[2, 3]) });
    assert!(matches!(&err, DlpackError::Layout(_)), "{err}");
    let err =
        refused(Lend { device: DLDevice { device_type: DL_CPU, device_id: 0 }, ..Lend::f32(values.clone(), &[2, 3]) });
    assert!(matches!(&err, DlpackError::Device(_)), "{err}");
    // Extents of 1 may have any stride (as PyTorch gives them): read in place.
    let lent = lend(Lend { strides: Some(vec![99, 1]), ..Lend::f32(values.clone(), &[1, 6]) });
    let x = without_host_copies("a unit extent's stride", || read_on_device(&lent, DType::F32).unwrap());
    assert_eq!(x.to_vec_f32().unwrap(), values);
}
