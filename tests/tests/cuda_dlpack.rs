//! A request whose input is a CUDA tensor lent through DLPack, through the facade: on one rank
//! untiled the model reads the producer's memory in place and the result stays on the device,
//! lent back as `kDLCUDA` (the fake driver's host-copy count proves the request made no copy
//! through the host, and the bytes read back equal the host path's bit for bit); tiled, the
//! input crosses to the host once and the result comes back to the device. Needs a GPU and a
//! build with the kernels embedded (`cargo xtask gpu-emu` runs it under the fake driver).
#![allow(clippy::print_stderr)] // a skipped GPU test says so

#[path = "../../crates/vae-tensor/tests/support/cuda_producer.rs"]
mod cuda_producer;

use std::sync::{Arc, Mutex, MutexGuard};

use cuda_producer::{Lend, f32s, host_copies, lend, read_device};
use vae_integration_tests::{cuda, fixtures_dir};
use vae_parallel::io::read_npy;
use vae_parallel::tensor::dlpack::{DL_CUDA, DL_FLOAT, DLDataType, DLDevice, Exported, Imported, consumer_stream};
use vae_parallel::{CostProfile, Decode, Encode, EncodeOutput, Group, Tensor, Vae};
use vae_tensor::DType;

/// The host-copy count is the process's: one test at a time reads it.
fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// A fixture tensor lent by the producer on `cuda:0` and read as the Python side reads it: the
/// producer ordered before our stream, the tensor in the model's dtype.
fn lent_input(values: &Tensor, dtype: DType) -> (cuda_producer::Lent, Tensor) {
    let lent = lend(Lend::f32(values.to_vec_f32().unwrap(), values.dims()));
    // SAFETY: a managed tensor of the producer, handed over once; its description is true and
    // the stream is the thread's own.
    let tensor = unsafe {
        Imported::from_versioned(lent.managed).unwrap().into_device_tensor(0, dtype, Some(consumer_stream(0).unwrap()))
    }
    .unwrap();
    (lent, tensor)
}

/// A device result lent as `kDLCUDA` f32 (host synchronised), its elements' bits read back by
/// the driver, and its description checked.
fn lent_back_bits(result: Tensor) -> Vec<u32> {
    let n = result.elem_count();
    let exported = Arc::new(Exported::new(result).unwrap());
    let managed = host_copies_unchanged("lending the result", || exported.to_versioned(None).unwrap());
    // SAFETY: ours, live until its deleter below.
    let t = unsafe { &managed.as_ref().dl_tensor };
    assert_eq!(t.device, DLDevice { device_type: DL_CUDA, device_id: 0 });
    assert_eq!(t.dtype, DLDataType { code: DL_FLOAT, bits: 32, lanes: 1 });
    let bytes = read_device(t.data as u64, n * 4);
    // SAFETY: our own managed tensor's deleter, called once.
    unsafe { (managed.as_ref().deleter.unwrap())(managed.as_ptr()) };
    bits(&f32s(&bytes))
}

/// Runs `path`, asserting that it made no copy between the host and the device (under the fake
/// driver, which counts them; a real driver has no count).
fn host_copies_unchanged<T>(what: &str, path: impl FnOnce() -> T) -> T {
    let before = host_copies();
    let out = path();
    assert_eq!(host_copies(), before, "{what}: (host-to-device, device-to-host) copies before and after");
    out
}

#[test]
fn a_device_latent_decodes_in_place_and_the_image_stays_on_the_device_bit_for_bit() {
    let Some(device) = cuda("DLPack decode on the device") else { return };
    let _serial = serial();
    let dir = fixtures_dir().join("autoencoder_kl");
    let vae = Vae::builder(dir.join("sd_like")).device(device).cost_profile(CostProfile::Off).build().unwrap();
    let group = Group::local(1).unwrap();
    let z = read_npy(dir.join("sd_like.decode.in.npy")).unwrap();
    let want = group.decode(&vae, &z, &Decode::default()).unwrap().expect("rank 0's image");
    assert!(want.device().is_cpu(), "a host input's result is on the host");
    let diffusers = read_npy(dir.join("sd_like.decode.out.npy")).unwrap();
    assert!(want.max_abs_diff(&diffusers).unwrap() <= 1e-3, "the host path is diffusers'");

    let (lent, latent) = lent_input(&z, vae.compute_dtype());
    let image = host_copies_unchanged("the decode of a device latent", || {
        group.decode(&vae, &latent, &Decode::default()).unwrap().expect("rank 0's image")
    });
    assert_eq!(image.device(), device, "the image stays on the device");
    assert_eq!(lent.deleted(), 0, "the latent is still held");
    drop(latent);
    assert_eq!(lent.deleted(), 1, "the producer's deleter ran once the latent was dropped");
    assert_eq!(lent_back_bits(image), bits(&want.to_vec_f32().unwrap()), "the device path's image is the host path's");
    assert_eq!(lent.deleted(), 1, "and only once");
}

#[test]
fn a_device_image_encodes_in_place_to_a_latent_on_the_device() {
    let Some(device) = cuda("DLPack encode on the device") else { return };
    let _serial = serial();
    let dir = fixtures_dir().join("autoencoder_kl");
    let vae = Vae::builder(dir.join("sd_like")).device(device).cost_profile(CostProfile::Off).build().unwrap();
    let group = Group::local(1).unwrap();
    let x = read_npy(dir.join("sd_like.encode.in.npy")).unwrap();
    for output in [EncodeOutput::Moments, EncodeOutput::Mean] {
        let options = Encode::default().output(output);
        let want = group.encode(&vae, &x, &options).unwrap().expect("rank 0's latent");
        let (lent, image) = lent_input(&x, vae.compute_dtype());
        let latent = host_copies_unchanged("the encode of a device image", || {
            group.encode(&vae, &image, &options).unwrap().expect("rank 0's latent")
        });
        assert_eq!(latent.device(), device, "{output:?}: the latent stays on the device");
        drop(image);
        assert_eq!(lent.deleted(), 1);
        assert_eq!(lent_back_bits(latent), bits(&want.to_vec_f32().unwrap()), "{output:?}");
    }
}

#[test]
fn a_tiled_decode_of_a_device_latent_crosses_the_host_and_returns_to_the_device() {
    let Some(device) = cuda("DLPack tiled decode") else { return };
    let _serial = serial();
    let dir = fixtures_dir().join("autoencoder_kl");
    let tiling = vae_parallel::TileOverrides { sample_min_size: Some(32), ..Default::default() };
    let vae =
        Vae::builder(dir.join("sd_like")).device(device).tiling(tiling).cost_profile(CostProfile::Off).build().unwrap();
    let group = Group::local(1).unwrap();
    let z = read_npy(dir.join("sd_like.decode_tiled.in.npy")).unwrap();
    let options = Decode::default().tiled();
    let want = group.decode(&vae, &z, &options).unwrap().expect("rank 0's image");
    let (lent, latent) = lent_input(&z, vae.compute_dtype());
    let before = host_copies();
    let image = group.decode(&vae, &latent, &options).unwrap().expect("rank 0's image");
    if let (Some(before), Some(after)) = (before, host_copies()) {
        assert!(after.1 > before.1, "the tiled path reads the latent on the host");
    }
    assert_eq!(image.device(), device, "the result comes back to the latent's device");
    drop(latent);
    assert_eq!(lent.deleted(), 1);
    assert_eq!(bits(&image.to_vec_f32().unwrap()), bits(&want.to_vec_f32().unwrap()));
}

#[test]
fn a_latent_on_another_device_is_refused() {
    let Some(_) = cuda("DLPack device mismatch") else { return };
    let _serial = serial();
    let dir = fixtures_dir().join("autoencoder_kl");
    let vae = Vae::builder(dir.join("sd_like")).cost_profile(CostProfile::Off).build().unwrap();
    let z = read_npy(dir.join("sd_like.decode.in.npy")).unwrap();
    let (lent, latent) = lent_input(&z, DType::F32);
    let err = Group::local(1).unwrap().decode(&vae, &latent, &Decode::default()).unwrap_err();
    assert!(err.to_string().contains("the input is on cuda:0, the model on cpu"), "{err}");
    drop(latent);
    assert_eq!(lent.deleted(), 1);
}
