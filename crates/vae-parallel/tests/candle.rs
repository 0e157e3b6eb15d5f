//! The `candle` feature: candle tensors in and out give bit for bit the plain `Tensor` path's
//! results, f32 inputs are copied by the safe path (and read in place by the unchecked one) and
//! results handed over without a copy, other float
//! types and layouts are converted, and what cannot be read is refused by kind.

use candle_core::{DType as CandleDType, Device as CandleDevice, Storage, Tensor as CandleTensor};
use vae_parallel::candle::{from_candle, from_candle_unchecked, to_candle};
use vae_parallel::{Decode, Device, Encode, EncodeOutput, ErrorKind, Group, Tensor, Vae};

const SD_LIKE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../fixtures/autoencoder_kl/sd_like");

/// The candle tensor's first element's address (a contiguous CPU f32 tensor).
fn address(t: &CandleTensor) -> usize {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else { panic!("not on the CPU") };
    let (start, _) = layout.contiguous_offsets().expect("contiguous");
    cpu.as_slice::<f32>().unwrap()[start..].as_ptr() as usize
}

fn candle_of(t: &Tensor) -> CandleTensor {
    CandleTensor::from_vec(t.to_vec_f32().unwrap(), t.dims(), &CandleDevice::Cpu).unwrap()
}

fn values(t: &CandleTensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

#[test]
fn decode_and_encode_give_the_plain_paths_bits_on_two_ranks() {
    let vae = Vae::load(SD_LIKE).unwrap();
    let group = Group::local(2).unwrap();
    let latent = Tensor::seeded_uniform([1, 4, 16, 16], 3, -1.0, 1.0, &Device::Cpu).unwrap();
    let want = group.decode(&vae, &latent, &Decode::default()).unwrap().unwrap();
    let got = group.decode_candle(&vae, &candle_of(&latent), &Decode::default()).unwrap().unwrap();
    assert_eq!(got.dims(), want.dims());
    assert_eq!(got.dtype(), CandleDType::F32);
    assert!(got.device().is_cpu());
    assert_eq!(values(&got), want.to_vec_f32().unwrap(), "bit for bit");

    let image = Tensor::seeded_uniform([1, 3, 64, 64], 4, -1.0, 1.0, &Device::Cpu).unwrap();
    for output in [EncodeOutput::Mean, EncodeOutput::Moments] {
        let encode = Encode::default().output(output);
        let want = group.encode(&vae, &image, &encode).unwrap().unwrap();
        let got = group.encode_candle(&vae, &candle_of(&image), &encode).unwrap().unwrap();
        assert_eq!(values(&got), want.to_vec_f32().unwrap(), "{output:?}");
    }
}

#[test]
fn f32_inputs_are_copied_by_the_safe_path_and_untouched_by_later_writes() {
    let latent = CandleTensor::zeros((2, 3, 4), CandleDType::F32, &CandleDevice::Cpu).unwrap();
    let ours = from_candle(&latent).unwrap();
    assert_ne!(ours.as_slice_f32().unwrap().as_ptr() as usize, address(&latent), "copied");
    // The caller writes its tensor in place: ours keeps the values it was given.
    let ones = CandleTensor::ones((2, 3, 4), CandleDType::F32, &CandleDevice::Cpu).unwrap();
    latent.slice_set(&ones, 0, 0).unwrap();
    assert_eq!(values(&latent), vec![1.0; 24]);
    assert_eq!(ours.to_vec_f32().unwrap(), vec![0.0; 24]);
    // A converted input (a fresh tensor only ours holds) is read in place, with no second copy.
    let bf16 = CandleTensor::arange(0f32, 24.0, &CandleDevice::Cpu).unwrap().to_dtype(CandleDType::BF16).unwrap();
    assert_eq!(from_candle(&bf16).unwrap().to_vec_f32().unwrap(), (0..24).map(|i| i as f32).collect::<Vec<_>>());
}

#[test]
fn f32_inputs_are_read_in_place_by_the_unchecked_path_and_results_handed_over() {
    let latent = CandleTensor::arange(0f32, 24.0, &CandleDevice::Cpu).unwrap().reshape((2, 3, 4)).unwrap();
    // SAFETY: nothing writes `latent`'s storage in place while `ours` lives.
    let ours = unsafe { from_candle_unchecked(&latent) }.unwrap();
    assert_eq!(ours.as_slice_f32().unwrap().as_ptr() as usize, address(&latent), "read in place");
    // The candle tensor may go: ours holds its storage.
    drop(latent);
    assert_eq!(ours.to_vec_f32().unwrap(), (0..24).map(|i| i as f32).collect::<Vec<_>>());

    let result = Tensor::seeded_uniform([2, 5], 1, -1.0, 1.0, &Device::Cpu).unwrap();
    let (at, want) = (result.as_slice_f32().unwrap().as_ptr() as usize, result.to_vec_f32().unwrap());
    let theirs = to_candle(result).unwrap();
    assert_eq!(address(&theirs), at, "handed over, no copy");
    assert_eq!(values(&theirs), want);
}

#[test]
fn other_float_types_and_layouts_are_converted_once() {
    let vae = Vae::load(SD_LIKE).unwrap();
    let group = Group::local(1).unwrap();
    let latent = Tensor::seeded_uniform([1, 4, 8, 8], 5, -1.0, 1.0, &Device::Cpu).unwrap();
    let candle = candle_of(&latent);
    // bf16: the values bf16 holds, widened exactly.
    let bf16 = candle.to_dtype(CandleDType::BF16).unwrap();
    let widened = Tensor::from_vec(values(&bf16.to_dtype(CandleDType::F32).unwrap()), latent.dims(), &Device::Cpu);
    let want = group.decode(&vae, &widened.unwrap(), &Decode::default()).unwrap().unwrap();
    let got = group.decode_candle(&vae, &bf16, &Decode::default()).unwrap().unwrap();
    assert_eq!(values(&got), want.to_vec_f32().unwrap());
    // A transposed view: read in logical order.
    let transposed = candle.transpose(2, 3).unwrap().contiguous().unwrap().transpose(2, 3).unwrap();
    assert!(!transposed.is_contiguous());
    let want = group.decode(&vae, &latent, &Decode::default()).unwrap().unwrap();
    let got = group.decode_candle(&vae, &transposed, &Decode::default()).unwrap().unwrap();
    assert_eq!(values(&got), want.to_vec_f32().unwrap());
    // f64 and f16 too.
    for dtype in [CandleDType::F64, CandleDType::F16] {
        let t = candle.to_dtype(dtype).unwrap();
        let want: Vec<f32> = values(&t.to_dtype(CandleDType::F32).unwrap());
        assert_eq!(from_candle(&t).unwrap().to_vec_f32().unwrap(), want, "{dtype:?}");
    }
}

#[test]
fn integer_tensors_and_wrong_shapes_are_refused_by_kind() {
    let vae = Vae::load(SD_LIKE).unwrap();
    let group = Group::local(1).unwrap();
    let ints = CandleTensor::zeros((1, 4, 8, 8), CandleDType::U32, &CandleDevice::Cpu).unwrap();
    let err = group.decode_candle(&vae, &ints, &Decode::default()).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    assert!(err.to_line().contains("U32"), "{err}");
    let three_channels = CandleTensor::zeros((1, 3, 8, 8), CandleDType::F32, &CandleDevice::Cpu).unwrap();
    let err = group.decode_candle(&vae, &three_channels, &Decode::default()).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    let flat = CandleTensor::zeros(16, CandleDType::F32, &CandleDevice::Cpu).unwrap();
    let err = group.decode_candle(&vae, &flat, &Decode::default()).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
}

#[test]
fn a_result_outlives_its_model_and_group() {
    let (got, want) = {
        let vae = Vae::load(SD_LIKE).unwrap();
        let group = Group::local(2).unwrap();
        let latent = Tensor::seeded_uniform([1, 4, 8, 8], 6, -1.0, 1.0, &Device::Cpu).unwrap();
        let want = group.decode(&vae, &latent, &Decode::default()).unwrap().unwrap().to_vec_f32().unwrap();
        (group.decode_candle(&vae, &candle_of(&latent), &Decode::default()).unwrap().unwrap(), want)
    };
    assert_eq!(values(&got), want);
}
