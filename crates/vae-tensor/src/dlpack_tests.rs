//! DLPack import and export against a producer written here: what is read in place, what is
//! copied and how, what is refused, and that every deleter runs exactly once.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::*;

/// A producer's allocation and description, as a library behind DLPack would hold them; its
/// deleter counts its calls in `deleted`.
struct Producer {
    bytes: Vec<u8>,
    shape: Vec<i64>,
    strides: Option<Vec<i64>>,
    deleted: Arc<AtomicUsize>,
}

unsafe extern "C" fn producer_delete_versioned(managed: *mut DLManagedTensorVersioned) {
    // SAFETY: made by `versioned` below with `Box::leak`; called once by the consumer (the count
    // proves it).
    unsafe {
        let managed = Box::from_raw(managed);
        let producer = Box::from_raw(managed.manager_ctx.cast::<Producer>());
        producer.deleted.fetch_add(1, Ordering::SeqCst);
    }
}

unsafe extern "C" fn producer_delete_legacy(managed: *mut DLManagedTensor) {
    // SAFETY: made by `legacy` below with `Box::leak`.
    unsafe {
        let managed = Box::from_raw(managed);
        let producer = Box::from_raw(managed.manager_ctx.cast::<Producer>());
        producer.deleted.fetch_add(1, Ordering::SeqCst);
    }
}

fn describe(p: &mut Producer, dtype: DLDataType, device: DLDevice, byte_offset: u64) -> DLTensor {
    DLTensor {
        data: p.bytes.as_mut_ptr().cast(),
        device,
        ndim: p.shape.len() as i32,
        dtype,
        shape: p.shape.as_mut_ptr(),
        strides: p.strides.as_mut().map_or(std::ptr::null_mut(), |s| s.as_mut_ptr()),
        byte_offset,
    }
}

const F32: DLDataType = DLDataType { code: DL_FLOAT, bits: 32, lanes: 1 };
const HOST: DLDevice = DLDevice { device_type: DL_CPU, device_id: 0 };

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_ne_bytes()).collect()
}

struct Made {
    deleted: Arc<AtomicUsize>,
}

impl Made {
    fn deleted(&self) -> usize {
        self.deleted.load(Ordering::SeqCst)
    }
}

#[allow(clippy::too_many_arguments)]
fn versioned(
    bytes: Vec<u8>,
    shape: &[i64],
    strides: Option<&[i64]>,
    dtype: DLDataType,
    device: DLDevice,
    byte_offset: u64,
    major: u32,
    flags: u64,
) -> (*mut DLManagedTensorVersioned, Made) {
    let deleted = Arc::new(AtomicUsize::new(0));
    let mut producer = Box::new(Producer {
        bytes,
        shape: shape.to_vec(),
        strides: strides.map(<[i64]>::to_vec),
        deleted: Arc::clone(&deleted),
    });
    let dl_tensor = describe(&mut producer, dtype, device, byte_offset);
    let managed = Box::new(DLManagedTensorVersioned {
        version: DLPackVersion { major, minor: 0 },
        manager_ctx: Box::into_raw(producer).cast(),
        deleter: Some(producer_delete_versioned),
        flags,
        dl_tensor,
    });
    (Box::leak(managed), Made { deleted })
}

fn simple(values: &[f32], shape: &[i64]) -> (*mut DLManagedTensorVersioned, Made) {
    versioned(f32_bytes(values), shape, None, F32, HOST, 0, 1, 0)
}

fn import(ptr: *mut DLManagedTensorVersioned) -> Result<Tensor, DlpackError> {
    // SAFETY: `ptr` comes from `versioned`, handed over here once.
    unsafe { Imported::from_versioned(ptr) }?.into_tensor()
}

#[test]
fn a_row_major_f32_tensor_is_read_in_place_and_its_deleter_runs_once_when_the_tensor_goes() {
    let values: Vec<f32> = (0..24).map(|i| i as f32 * 0.25 - 1.0).collect();
    let (ptr, made) = versioned(f32_bytes(&values), &[2, 3, 4], None, F32, HOST, 0, 1, FLAG_READ_ONLY);
    // SAFETY: handed over once.
    let data = unsafe { (*ptr).dl_tensor.data } as usize;
    let t = import(ptr).unwrap();
    assert_eq!(t.dims(), &[2, 3, 4]);
    assert_eq!(t.as_slice_f32().unwrap().as_ptr() as usize, data, "read in place");
    assert_eq!(t.to_vec_f32().unwrap(), values);
    // A clone is a copy of its own (tensors own what they may write).
    let copy = t.clone();
    assert_eq!(made.deleted(), 0);
    drop(t);
    assert_eq!(made.deleted(), 1);
    assert_eq!(copy.to_vec_f32().unwrap(), values);
}

#[test]
fn explicit_row_major_strides_and_unit_extents_with_any_stride_are_read_in_place() {
    let values: Vec<f32> = (0..6).map(|i| i as f32).collect();
    let (ptr, made) = versioned(f32_bytes(&values), &[1, 2, 3], Some(&[99, 3, 1]), F32, HOST, 0, 1, 0);
    // SAFETY: handed over once.
    let data = unsafe { (*ptr).dl_tensor.data } as usize;
    let t = import(ptr).unwrap();
    assert_eq!(t.as_slice_f32().unwrap().as_ptr() as usize, data);
    drop(t);
    assert_eq!(made.deleted(), 1);
}

#[test]
fn strides_and_a_byte_offset_are_copied_in_logical_order_and_the_deleter_runs_at_once() {
    // A [3, 2] transposed view of a row-major [2, 3], one element into the allocation.
    let stored = [100.0f32, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0];
    let (ptr, made) = versioned(f32_bytes(&stored), &[3, 2], Some(&[1, 3]), F32, HOST, 4, 1, 0);
    let t = import(ptr).unwrap();
    assert_eq!(made.deleted(), 1, "a copy needs the producer's memory no longer");
    assert_eq!(t.dims(), &[3, 2]);
    assert_eq!(t.to_vec_f32().unwrap(), vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
    // A misaligned start (an odd byte offset) is copied too.
    let mut bytes = vec![0u8];
    bytes.extend(f32_bytes(&[1.5, -2.5]));
    let (ptr, made) = versioned(bytes, &[2], None, F32, HOST, 1, 1, 0);
    assert_eq!(import(ptr).unwrap().to_vec_f32().unwrap(), vec![1.5, -2.5]);
    assert_eq!(made.deleted(), 1);
}

#[test]
fn other_float_types_are_converted_to_f32_as_numpy_does() {
    let values = [1.0f32, -0.5, 3.25, 65504.0, 1e-3];
    let f16: Vec<u8> = values.iter().flat_map(|v| half::f16::from_f32(*v).to_ne_bytes()).collect();
    let bf16: Vec<u8> = values.iter().flat_map(|v| half::bf16::from_f32(*v).to_ne_bytes()).collect();
    let f64: Vec<u8> = values.iter().flat_map(|v| (*v as f64 + 1e-12).to_ne_bytes()).collect();
    let cases = [
        (DLDataType { code: DL_FLOAT, bits: 16, lanes: 1 }, f16, values.map(|v| half::f16::from_f32(v).to_f32())),
        (DLDataType { code: DL_BFLOAT, bits: 16, lanes: 1 }, bf16, values.map(|v| half::bf16::from_f32(v).to_f32())),
        (DLDataType { code: DL_FLOAT, bits: 64, lanes: 1 }, f64, values.map(|v| (v as f64 + 1e-12) as f32)),
    ];
    for (dtype, bytes, want) in cases {
        let (ptr, made) = versioned(bytes, &[5], None, dtype, HOST, 0, 1, 0);
        assert_eq!(import(ptr).unwrap().to_vec_f32().unwrap(), want, "{dtype:?}");
        assert_eq!(made.deleted(), 1);
    }
}

#[test]
fn refusals_are_typed_and_still_call_the_deleter_once() {
    let int32 = DLDataType { code: DL_INT, bits: 32, lanes: 1 };
    let lanes = DLDataType { code: DL_FLOAT, bits: 32, lanes: 2 };
    let cuda = DLDevice { device_type: DL_CUDA, device_id: 1 };
    type Check = fn(&DlpackError) -> bool;
    let cases: [(_, Check, &str); 4] = [
        (versioned(vec![0; 16], &[4], None, int32, HOST, 0, 1, 0), |e| matches!(e, DlpackError::DType(_)), "int32"),
        (versioned(vec![0; 32], &[4], None, lanes, HOST, 0, 1, 0), |e| matches!(e, DlpackError::DType(_)), "float32x2"),
        (versioned(vec![0; 16], &[4], None, F32, cuda, 0, 1, 0), |e| matches!(e, DlpackError::Device(_)), "cuda:1"),
        (versioned(vec![0; 16], &[4], None, F32, HOST, 0, 2, 0), |e| matches!(e, DlpackError::Version { .. }), "2.0"),
    ];
    for ((ptr, made), is, named) in cases {
        let err = import(ptr).unwrap_err();
        assert!(is(&err), "{err}");
        assert!(err.to_string().contains(named), "{err}");
        assert_eq!(made.deleted(), 1, "{err}");
    }
    // SAFETY: null is refused before anything is read.
    let err = unsafe { Imported::from_versioned(std::ptr::null_mut()) }.unwrap_err();
    assert!(matches!(err, DlpackError::Malformed(_)), "{err}");
    let (ptr, made) = versioned(vec![0; 16], &[-4], None, F32, HOST, 0, 1, 0);
    assert!(matches!(import(ptr).unwrap_err(), DlpackError::Malformed(_)));
    assert_eq!(made.deleted(), 1);
}

#[test]
fn empty_tensors_and_scalars_are_read() {
    let (ptr, made) = versioned(Vec::new(), &[0, 3], None, F32, HOST, 0, 1, 0);
    assert_eq!(import(ptr).unwrap().dims(), &[0, 3]);
    assert_eq!(made.deleted(), 1);
    let (ptr, made) = simple(&[7.0], &[]);
    let t = import(ptr).unwrap();
    assert_eq!((t.rank(), t.to_vec_f32().unwrap()), (0, vec![7.0]));
    drop(t);
    assert_eq!(made.deleted(), 1);
}

#[test]
fn a_legacy_managed_tensor_is_read_alike() {
    let deleted = Arc::new(AtomicUsize::new(0));
    let mut producer = Box::new(Producer {
        bytes: f32_bytes(&[1.0, 2.0, 3.0, 4.0]),
        shape: vec![2, 2],
        strides: None,
        deleted: Arc::clone(&deleted),
    });
    let dl_tensor = describe(&mut producer, F32, HOST, 0);
    let managed = Box::leak(Box::new(DLManagedTensor {
        dl_tensor,
        manager_ctx: Box::into_raw(producer).cast(),
        deleter: Some(producer_delete_legacy),
    }));
    // SAFETY: handed over once.
    let imported = unsafe { Imported::from_legacy(managed) }.unwrap();
    assert!(!imported.read_only());
    let t = imported.into_tensor().unwrap();
    assert_eq!(t.to_vec_f32().unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
    drop(t);
    assert_eq!(deleted.load(Ordering::SeqCst), 1);
}

#[test]
fn an_exported_tensor_outlives_its_source_and_reads_back_bit_for_bit() {
    let values: Vec<f32> = (0..12).map(|i| (i as f32).sin()).collect();
    let source = Tensor::from_vec(values.clone(), vec![3, 4], &Device::Cpu).unwrap();
    let exported = Arc::new(Exported::new(source).unwrap());
    assert_eq!(exported.dims(), vec![3, 4]);
    let versioned = exported.to_versioned(None).unwrap();
    let legacy = exported.to_legacy(None).unwrap();
    let weak = Arc::downgrade(&exported);
    drop(exported);
    // SAFETY: ours, handed over once each.
    let (a, b) = unsafe { (Imported::from_versioned(versioned.as_ptr()), Imported::from_legacy(legacy.as_ptr())) };
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a.strides(), vec![4, 1]);
    assert_eq!(a.flags(), 0, "consumers may write our memory");
    assert_eq!(a.into_tensor().unwrap().to_vec_f32().unwrap(), values);
    assert!(weak.upgrade().is_some(), "the legacy tensor still holds the memory");
    assert_eq!(b.into_tensor().unwrap().to_vec_f32().unwrap(), values);
    assert!(weak.upgrade().is_none(), "the last deleter freed it");
}

#[test]
fn a_lent_tensor_is_exported_as_a_copy_of_its_own() {
    let (ptr, made) = simple(&[1.0, 2.0], &[2]);
    let lent = import(ptr).unwrap();
    let exported = Exported::new(lent).unwrap();
    assert_eq!(made.deleted(), 1, "the producer's memory is not lent on");
    assert_eq!(exported.to_vec().unwrap(), [1.0, 2.0]);
}

#[test]
fn a_consumers_write_through_the_lent_pointer_is_what_we_read_and_copy() {
    let source = Tensor::from_vec(vec![1.0, 2.0, 3.0], vec![3], &Device::Cpu).unwrap();
    let exported = Arc::new(Exported::new(source).unwrap());
    let versioned = exported.to_versioned(None).unwrap();
    // SAFETY: ours, live until its deleter below; 3 f32s, lent writable (flags 0), as a
    // consumer such as PyTorch writes them in place.
    unsafe {
        let data = (*versioned.as_ptr()).dl_tensor.data.cast::<f32>();
        *data.add(1) = 20.0;
    }
    assert_eq!(exported.to_vec().unwrap(), [1.0, 20.0, 3.0]);
    assert_eq!(exported.copied().unwrap().to_vec().unwrap(), [1.0, 20.0, 3.0]);
    // SAFETY: the deleter of our own managed tensor, called once.
    unsafe { (*versioned.as_ptr()).deleter.unwrap()(versioned.as_ptr()) };
}
