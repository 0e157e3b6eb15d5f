//! Tensor ops on a CUDA device against the same ops on the CPU: one list of cases, each run on
//! both devices. Needs a GPU and a build with the kernels embedded (`cargo xtask kernels`);
//! elsewhere each test says why it is skipped. Without a driver, a CUDA tensor is a typed error.
#![cfg(feature = "cuda")]
#![allow(clippy::print_stderr)] // a skipped GPU test says so

use vae_tensor::cuda::{embedded_modules, probe};
use vae_tensor::{Conv2dParams, Conv3dParams, DType, Device, StreamScope, Tensor, TensorError};

const CUDA: Device = Device::Cuda(0);

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

fn pattern(dims: &[usize], seed: u64) -> Tensor {
    Tensor::seeded_uniform(dims.to_vec(), seed, -1.0, 1.0, &Device::Cpu).unwrap()
}

fn gpu_of(t: &Tensor) -> Tensor {
    t.to_device(&CUDA).unwrap()
}

/// Runs `op` on CPU copies and on CUDA copies of `inputs` and compares within `tol`.
fn same_on_both(what: &str, inputs: &[Tensor], tol: f32, op: impl Fn(&[Tensor]) -> Tensor) {
    let want = op(inputs);
    let on_gpu: Vec<Tensor> = inputs.iter().map(gpu_of).collect();
    let got = op(&on_gpu);
    assert_eq!(got.device(), CUDA, "{what}: the result stays on the device");
    let got = got.to_device(&Device::Cpu).unwrap();
    assert_eq!(got.dims(), want.dims(), "{what}");
    let diff = got.max_abs_diff(&want).unwrap();
    assert!(diff <= tol, "{what}: max |cuda - cpu| = {diff} > {tol}");
}

#[test]
fn without_a_usable_gpu_cuda_tensors_are_typed_errors() {
    if probe(0).is_ok() && !embedded_modules().is_empty() {
        eprintln!("cuda errors: skipped, this machine has a usable GPU");
        return;
    }
    let err = Tensor::zeros(vec![2, 2], DType::F32, &CUDA).unwrap_err();
    assert!(matches!(err, TensorError::DeviceUnavailable { .. }), "{err}");
    assert!(pattern(&[3], 0).to_device(&CUDA).is_err());
}

#[test]
fn transfers_round_trip_exactly() {
    if !gpu("transfers") {
        return;
    }
    let x = pattern(&[3, 4, 5], 1);
    let back = gpu_of(&x).to_device(&Device::Cpu).unwrap();
    assert!(back.bit_eq(&x));
    assert!(Tensor::zeros(vec![7], DType::F32, &CUDA).unwrap().to_vec_f32().unwrap().iter().all(|v| *v == 0.0));
    // A host-only op on a device tensor is an error naming the device, not a crash.
    assert!(gpu_of(&x).as_slice_f32().is_err());
}

#[test]
fn elementwise_ops_match() {
    if !gpu("elementwise") {
        return;
    }
    let (a, b) = (pattern(&[2, 3, 33], 2), pattern(&[2, 3, 33], 3));
    same_on_both("add", &[a.clone(), b.clone()], 0.0, |t| t[0].add(&t[1]).unwrap());
    same_on_both("add_assign", &[a.clone(), b.clone()], 0.0, |t| {
        let mut x = t[0].clone();
        x.add_assign(&t[1]).unwrap();
        x
    });
    same_on_both("silu", std::slice::from_ref(&a), 1e-6, |t| t[0].silu().unwrap());
    same_on_both("clamp", &[a.affine(3.0, 0.0).unwrap()], 0.0, |t| t[0].clamp(-1.0, 1.0).unwrap());
    same_on_both("mul_scalar", std::slice::from_ref(&a), 0.0, |t| t[0].mul_scalar(-1.7).unwrap());
    same_on_both("mul_scalar_inplace", std::slice::from_ref(&a), 0.0, |t| {
        let mut x = t[0].clone();
        x.mul_scalar_inplace(0.3).unwrap();
        x
    });
    same_on_both("add_scalar", std::slice::from_ref(&a), 0.0, |t| t[0].add_scalar(0.125).unwrap());
    // Ops the CUDA backend declares it does not run: a typed error naming the device.
    let on_gpu = gpu_of(&a);
    for err in [
        on_gpu.div_scalar(2.0).unwrap_err(),
        on_gpu.channel_affine(&[1.0; 3], &[0.0; 3]).unwrap_err(),
        on_gpu.channel_normalize(&[0.0; 3], &[1.0; 3]).unwrap_err(),
    ] {
        assert!(matches!(err, TensorError::DeviceUnavailable { device: Device::Cuda(0), .. }), "{err}");
    }
}

#[test]
fn norms_match() {
    if !gpu("norms") {
        return;
    }
    let x = pattern(&[1, 16, 2, 5, 7], 4);
    let gamma = pattern(&[16, 1, 1, 1], 5);
    let bias = pattern(&[16], 6);
    same_on_both("rms_norm", &[x.clone(), gamma.clone()], 1e-5, |t| {
        t[0].rms_norm_channels(&t[1], None, 1, 1e-12).unwrap()
    });
    same_on_both("rms_norm + bias", &[x, gamma, bias], 1e-5, |t| {
        t[0].rms_norm_channels(&t[1], Some(&t[2]), 1, 1e-12).unwrap()
    });
    let img = pattern(&[2, 8, 9, 11], 7);
    let (w, b) = (pattern(&[8], 8), pattern(&[8], 9));
    same_on_both("group_norm", &[img, w, b], 1e-5, |t| t[0].group_norm(4, &t[1], &t[2], 1e-6).unwrap());
}

#[test]
fn convolutions_match() {
    if !gpu("convolutions") {
        return;
    }
    let x = pattern(&[2, 6, 13, 9], 10);
    let w = pattern(&[10, 6, 3, 3], 11).affine(0.2, 0.0).unwrap();
    let b = pattern(&[10], 12);
    same_on_both("conv2d same(3)", &[x.clone(), w.clone(), b.clone()], 1e-4, |t| {
        t[0].conv2d(&t[1], Some(&t[2]), &Conv2dParams::same(3)).unwrap()
    });
    same_on_both("conv2d downsample", &[x.clone(), w, b], 1e-4, |t| {
        t[0].conv2d(&t[1], Some(&t[2]), &Conv2dParams::diffusers_downsample()).unwrap()
    });
    let w1 = pattern(&[4, 6, 1, 1], 13);
    same_on_both("conv2d 1x1 no bias", &[x, w1], 1e-5, |t| t[0].conv2d(&t[1], None, &Conv2dParams::default()).unwrap());
    let v = pattern(&[1, 5, 3, 7, 6], 14);
    let w3 = pattern(&[7, 5, 3, 3, 3], 15).affine(0.1, 0.0).unwrap();
    let b3 = pattern(&[7], 16);
    same_on_both("causal conv3d", &[v.clone(), w3, b3], 1e-4, |t| {
        t[0].conv3d(&t[1], Some(&t[2]), &Conv3dParams::causal([1, 1, 1], [1, 1, 1])).unwrap()
    });
    // An RGB head: 3 output channels on CUDA cores.
    let (w_rgb, b_rgb) = (pattern(&[3, 5, 3, 3, 3], 17).affine(0.1, 0.0).unwrap(), pattern(&[3], 18));
    same_on_both("causal conv3d to 3 channels", &[v, w_rgb, b_rgb], 1e-4, |t| {
        t[0].conv3d(&t[1], Some(&t[2]), &Conv3dParams::causal([1, 1, 1], [1, 1, 1])).unwrap()
    });
}

/// Two threads, each with a stream of its own on the device (as two ranks of one process share a
/// GPU), hand each other device tensors whose producing work may not have run yet, and drop their
/// own buffers at once. Under the fake driver, which runs a stream's work only when something
/// waits for it, a missing wait reads NaN (fresh memory) and a missing one before a free is a
/// fault; on a GPU it is a race. Either way the result must equal the CPU's.
#[test]
fn threads_on_streams_of_their_own_hand_each_other_device_tensors() {
    if !gpu("streams of their own") {
        return;
    }
    let (x, w) = (pattern(&[1, 6, 20, 24], 40), pattern(&[6, 6, 3, 3], 41).affine(0.2, 0.0).unwrap());
    let stage_a = |x: &Tensor, w: &Tensor| x.conv2d(w, None, &Conv2dParams::same(3)).unwrap().silu().unwrap();
    let stage_b = |y: &Tensor, w: &Tensor| y.conv2d(w, None, &Conv2dParams::same(3)).unwrap().add(y).unwrap();
    let want = stage_b(&stage_a(&x, &w), &w);

    let (w_gpu, x_gpu) = (&gpu_of(&w), &gpu_of(&x));
    let (to_b, from_a) = std::sync::mpsc::channel::<Tensor>();
    let (to_main, results) = std::sync::mpsc::channel::<Tensor>();
    std::thread::scope(|s| {
        s.spawn(move || {
            let _own = StreamScope::own(&CUDA).unwrap();
            // Intermediates die here, freed on this thread's stream.
            to_b.send(stage_a(x_gpu, w_gpu)).unwrap();
        });
        s.spawn(move || {
            let _own = StreamScope::own(&CUDA).unwrap();
            let y = from_a.recv().unwrap();
            to_main.send(stage_b(&y, w_gpu)).unwrap();
        });
    });
    let got = results.recv().unwrap();
    assert_eq!(got.device(), CUDA);
    let diff = got.to_device(&Device::Cpu).unwrap().max_abs_diff(&want).unwrap();
    assert!(diff <= 1e-4, "max |cuda - cpu| across streams = {diff}");
}

/// TF32 mode (`Tf32Scope`): f32 convolutions with one TF32 product each stay within the TF32
/// bound of the CPU's f32 result, differ from the default f32 path (three products, f32
/// accuracy), and only on the thread that holds the scope.
#[test]
fn tf32_convolutions_keep_the_tf32_bound_on_their_thread_only() {
    if !gpu("tf32") {
        return;
    }
    let x = pattern(&[1, 40, 3, 9, 11], 60);
    let w = pattern(&[70, 40, 3, 3, 3], 61).affine(0.05, 0.0).unwrap();
    let params = Conv3dParams::causal([1, 1, 1], [1, 1, 1]);
    let want = x.conv3d(&w, None, &params).unwrap();
    let (xg, wg) = (gpu_of(&x), gpu_of(&w));
    let strict = xg.conv3d(&wg, None, &params).unwrap().to_device(&Device::Cpu).unwrap();
    let tf32 = {
        let _tf32 = vae_tensor::Tf32Scope::enter();
        xg.conv3d(&wg, None, &params).unwrap().to_device(&Device::Cpu).unwrap()
    };
    let after = xg.conv3d(&wg, None, &params).unwrap().to_device(&Device::Cpu).unwrap();
    let other_thread = std::thread::scope(|s| {
        s.spawn(|| xg.conv3d(&wg, None, &params).unwrap().to_device(&Device::Cpu).unwrap()).join().unwrap()
    });
    // Each output sums 1080 products of magnitude up to 0.05: 2^-10 of that is the TF32 bound.
    let magnitude = 1080.0 * 0.05;
    let diff = |t: &Tensor| t.max_abs_diff(&want).unwrap();
    assert!(diff(&strict) <= 1e-4, "f32: {}", diff(&strict));
    assert!(diff(&tf32) <= magnitude * 2f32.powi(-10), "tf32: {}", diff(&tf32));
    assert!(!tf32.bit_eq(&strict), "TF32 mode changed the products");
    assert!(after.bit_eq(&strict) && other_thread.bit_eq(&strict), "the mode ends with its scope, on its thread");
}

/// Both tile widths of the tensor-core convolution (`ConvTilesScope`) give the same bits as the
/// backend's own choice, in every dtype, for a conv whose grid ends in partial tiles of either
/// width, and each within its bound of the CPU.
#[test]
fn both_conv_tile_widths_give_the_same_bits() {
    if !gpu("conv tile widths") {
        return;
    }
    use vae_tensor::cuda::{ConvKernels, ConvTilesScope};
    let x = pattern(&[1, 40, 3, 17, 23], 62);
    let w = pattern(&[200, 40, 3, 3, 3], 63).affine(0.05, 0.0).unwrap();
    let b = pattern(&[200], 64);
    let params = Conv3dParams::causal([1, 1, 1], [1, 1, 1]);
    let want = x.conv3d(&w, Some(&b), &params).unwrap();
    for (dtype, tf32, tol) in [(DType::F32, false, 1e-4), (DType::F32, true, 0.06), (DType::BF16, false, 0.25)] {
        let _tf32 = tf32.then(vae_tensor::Tf32Scope::enter);
        let (xg, wg, bg) = (gpu_of(&x).to_dtype(dtype).unwrap(), gpu_of(&w).to_dtype(dtype).unwrap(), gpu_of(&b));
        let conv = || xg.conv3d(&wg, Some(&bg), &params).unwrap().to_dtype(DType::F32).unwrap();
        let auto = conv().to_device(&Device::Cpu).unwrap();
        let what = format!("{dtype}{}", if tf32 { " (tf32)" } else { "" });
        assert!(auto.max_abs_diff(&want).unwrap() <= tol, "{what}: {}", auto.max_abs_diff(&want).unwrap());
        for width in [ConvKernels::Pixels128, ConvKernels::Pixels256] {
            let _only = ConvTilesScope::only(width);
            let got = conv().to_device(&Device::Cpu).unwrap();
            assert!(got.bit_eq(&auto), "{what}: tiles of {width} pixels change the result");
        }
    }
}

/// cuDNN's convolutions (`ConvKernels::Cudnn`; under `cargo xtask gpu-emu` the fake cuDNN, which
/// computes each from the descriptors it is given and checks them) against the CPU and next to
/// ours: convolutions cuDNN reads in place (3x3 "same", 1x1) and those it reads through a padded
/// copy (Wan's causal time padding, a causal cache in front, diffusers' stride-2 downsample padded
/// bottom/right), with and without a bias, in f32, TF32 and bf16; within each type's bound of the
/// CPU. `ConvKernels::Fastest` stays within the same bound and reports its choices. Without cuDNN on this
/// machine, it says so and checks that ours run instead, unless `VAE_CUDNN_REQUIRED=1` (set by
/// gpu-emu, where the fake is beside the fake driver), which makes that a failure.
#[test]
fn cudnn_convolutions_match_the_cpu() {
    if !gpu("cuDNN convolutions") {
        return;
    }
    use vae_tensor::cuda::{ConvKernels, ConvTilesScope, cudnn_convolutions, cudnn_version, export_conv_choices};
    let available = cudnn_version();
    let required = std::env::var("VAE_CUDNN_REQUIRED").is_ok_and(|v| v == "1");
    assert!(available.is_ok() || !required, "VAE_CUDNN_REQUIRED=1, but cuDNN does not load: {available:?}");
    if let Err(why) = &available {
        eprintln!("cuDNN convolutions: not run, {why}; ours run in their place");
    }
    let x = pattern(&[1, 12, 3, 13, 10], 80);
    let front = pattern(&[1, 12, 2, 13, 10], 81);
    let w3 = pattern(&[20, 12, 3, 3, 3], 82).affine(0.1, 0.0).unwrap();
    let b = pattern(&[20], 83);
    let x2 = pattern(&[2, 12, 13, 10], 84);
    let w2 = pattern(&[20, 12, 3, 3], 85).affine(0.1, 0.0).unwrap();
    let w1 = pattern(&[20, 12, 1, 1], 86).affine(0.3, 0.0).unwrap();
    let causal = Conv3dParams::causal([1, 1, 1], [1, 1, 1]);
    let after = Conv3dParams::new([1, 1, 1], [0, 0, 1, 1, 1, 1]);
    type Case<'a> = (&'a str, Box<dyn Fn(&[Tensor]) -> Tensor + 'a>, Vec<&'a Tensor>);
    let cases: Vec<Case> = vec![
        (
            "3x3 same, bias",
            Box::new(|t: &[Tensor]| t[0].conv2d(&t[1], Some(&t[2]), &Conv2dParams::same(3)).unwrap()),
            vec![&x2, &w2, &b],
        ),
        (
            "1x1, no bias",
            Box::new(|t: &[Tensor]| t[0].conv2d(&t[1], None, &Conv2dParams::default()).unwrap()),
            vec![&x2, &w1],
        ),
        (
            "stride-2 downsample",
            Box::new(|t: &[Tensor]| t[0].conv2d(&t[1], Some(&t[2]), &Conv2dParams::diffusers_downsample()).unwrap()),
            vec![&x2, &w2, &b],
        ),
        (
            "causal 3x3x3, bias",
            Box::new(|t: &[Tensor]| t[0].conv3d(&t[1], Some(&t[2]), &causal).unwrap()),
            vec![&x, &w3, &b],
        ),
        (
            "causal cache in front",
            Box::new(|t: &[Tensor]| t[0].conv3d_after(&t[1], &t[2], None, &after).unwrap()),
            vec![&x, &front, &w3],
        ),
    ];
    for (dtype, tf32, tol) in [(DType::F32, false, 1e-4), (DType::F32, true, 0.03), (DType::BF16, false, 0.25)] {
        let _tf32 = tf32.then(vae_tensor::Tf32Scope::enter);
        let what = format!("{dtype}{}", if tf32 { " (tf32)" } else { "" });
        for (name, op, inputs) in &cases {
            let cpu: Vec<Tensor> = inputs.iter().map(|t| (*t).clone()).collect();
            let want = op(&cpu);
            // Weights and inputs in the dtype; biases stay f32 (the backend's rule).
            let on: Vec<Tensor> = inputs
                .iter()
                .map(|t| {
                    let g = gpu_of(t);
                    if t.dims().len() == 1 { g } else { g.to_dtype(dtype).unwrap() }
                })
                .collect();
            let run = |kernels: Option<ConvKernels>| {
                let _only = kernels.map(ConvTilesScope::only);
                op(&on).to_dtype(DType::F32).unwrap().to_device(&Device::Cpu).unwrap()
            };
            let ours = run(None);
            let before = cudnn_convolutions();
            let cudnn = run(Some(ConvKernels::Cudnn));
            let ran = cudnn_convolutions() > before;
            assert_eq!(ran, available.is_ok(), "{what} {name}: cuDNN ran where it loads, not elsewhere");
            let err = cudnn.max_abs_diff(&want).unwrap();
            assert!(err <= tol, "{what} {name}: max |cudnn - cpu| = {err} > {tol}");
            if available.is_err() {
                assert!(cudnn.bit_eq(&ours), "{what} {name}: without cuDNN, ours run");
            }
            let fastest = run(Some(ConvKernels::Fastest));
            let err = fastest.max_abs_diff(&want).unwrap();
            assert!(err <= tol, "{what} {name}: max |fastest - cpu| = {err} > {tol}");
        }
    }
    if available.is_ok() {
        let choices = export_conv_choices();
        assert!(choices.lines().count() >= cases.len(), "one choice per layer timed: {choices}");
        eprintln!("cuDNN convolutions: per-layer choices\n{choices}");
    }
}

/// The warpgroup-MMA convolutions (`ConvKernels::Wgmma`, compute capability 9.0) at every tile
/// width they take (96, 128, 192 and 256 channels, 384 as two tiles of 192, 200 as a partial tile
/// of 256), causal 3x3x3 over a grid that ends in a partial tile of pixels, with and without a
/// bias: within bf16's bound of the CPU, and next to the mma.sync kernels (the difference is
/// printed; whether both tensor-core paths round alike is for the GPU to show). Elsewhere the
/// choice falls back to mma.sync, bit for bit.
#[test]
fn wgmma_convolutions_match_the_cpu() {
    if !gpu("wgmma convolutions") {
        return;
    }
    use vae_tensor::cuda::{ConvKernels, ConvTilesScope, wgmma_available, wgmma_runs};
    let sm90 = probe(0).unwrap().compute_capability == (9, 0);
    let available = wgmma_available(0).unwrap();
    assert_eq!(wgmma_runs(0, DType::BF16).unwrap(), available, "bf16 runs where the kernels are");
    assert!(!wgmma_runs(0, DType::F32).unwrap(), "f32 stays on mma.sync");
    assert_eq!(
        available,
        sm90 && !vae_tensor::cuda::embedded_sm90a_modules().is_empty(),
        "the sm_90a kernels load exactly on compute capability 9.0"
    );
    let params = Conv3dParams::causal([1, 1, 1], [1, 1, 1]);
    for (cout, cin, bias) in
        [(96, 96, true), (128, 40, false), (192, 64, true), (256, 33, true), (384, 96, true), (200, 40, false)]
    {
        let x = pattern(&[1, cin, 3, 9, 23], 70 + cout as u64);
        let w = pattern(&[cout, cin, 3, 3, 3], 71).affine(0.05, 0.0).unwrap();
        let b = bias.then(|| pattern(&[cout], 72));
        let want = x.conv3d(&w, b.as_ref(), &params).unwrap();
        let (xg, wg) = (gpu_of(&x).to_dtype(DType::BF16).unwrap(), gpu_of(&w).to_dtype(DType::BF16).unwrap());
        let bg = b.as_ref().map(gpu_of);
        let conv = |kernels| {
            let _only = ConvTilesScope::only(kernels);
            xg.conv3d(&wg, bg.as_ref(), &params).unwrap().to_dtype(DType::F32).unwrap().to_device(&Device::Cpu).unwrap()
        };
        let (wgmma, mma) = (conv(ConvKernels::Wgmma), conv(ConvKernels::Pixels128));
        if !available {
            // Elsewhere the choice falls back to mma.sync, whose widths give the same bits.
            assert!(wgmma.bit_eq(&mma), "{cout} channels: the fallback differs from mma.sync");
            continue;
        }
        let err = wgmma.max_abs_diff(&want).unwrap();
        assert!(err <= 0.25, "{cout} channels: wgmma is {err} from the CPU");
        eprintln!(
            "wgmma, {cout} output channels: {err} from the CPU, {} from mma.sync (bit-identical: {})",
            wgmma.max_abs_diff(&mma).unwrap(),
            wgmma.bit_eq(&mma)
        );
    }
}

#[test]
fn layout_ops_and_attention_match() {
    if !gpu("layout") {
        return;
    }
    let x = pattern(&[2, 3, 4, 5], 17);
    same_on_both("permute", std::slice::from_ref(&x), 0.0, |t| t[0].permute(&[0, 2, 3, 1]).unwrap());
    same_on_both("transpose", std::slice::from_ref(&x), 0.0, |t| t[0].transpose(2, 3).unwrap());
    same_on_both("narrow", std::slice::from_ref(&x), 0.0, |t| t[0].narrow(2, 1, 2).unwrap());
    same_on_both("cat", &[x.clone(), x.clone()], 0.0, |t| Tensor::cat(&[&t[0], &t[1]], 3).unwrap());
    same_on_both("upsample", &[x], 0.0, |t| t[0].upsample_nearest2d(2).unwrap());
    let video = pattern(&[1, 8, 2, 3, 4], 21);
    same_on_both("dup_up3d first chunk", std::slice::from_ref(&video), 0.0, |t| t[0].dup_up3d(2, 2, 4, true).unwrap());
    same_on_both("dup_up3d", std::slice::from_ref(&video), 0.0, |t| t[0].dup_up3d(2, 2, 4, false).unwrap());
    let odd = pattern(&[1, 4, 3, 4, 6], 22);
    same_on_both("avg_down3d", &[odd], 1e-7, |t| t[0].avg_down3d(2, 2, 8).unwrap());
    let (q, k, v) = (pattern(&[2, 29, 16], 18), pattern(&[2, 31, 16], 19), pattern(&[2, 31, 8], 20));
    same_on_both("attention (31 keys: CUDA cores)", &[q, k, v], 1e-5, |t| {
        Tensor::attention(&t[0], &t[1], &t[2]).unwrap()
    });
    // Key and channel counts in whole 16-byte chunks: both products on the tensor cores (f32 as
    // three TF32 products), 300 queries over three row tiles, 200 keys over two pixel tiles.
    let (q, k, v) = (pattern(&[2, 300, 24], 23), pattern(&[2, 200, 24], 24), pattern(&[2, 200, 12], 25));
    same_on_both("attention (tensor cores)", &[q, k, v], 1e-5, |t| Tensor::attention(&t[0], &t[1], &t[2]).unwrap());
}

#[test]
fn matrix_products_match() {
    if !gpu("matrix products") {
        return;
    }
    // 67 and 130 rows / columns: partial 64x64 tiles on both sides.
    let (a, b) = (pattern(&[3, 67, 20], 23), pattern(&[3, 20, 130], 24));
    same_on_both("matmul", &[a, b], 1e-5, |t| t[0].matmul(&t[1]).unwrap());
    let (x, w, bias) = (pattern(&[2, 67, 24], 25), pattern(&[33, 24], 26), pattern(&[33], 27));
    same_on_both("linear", &[x.clone(), w.clone(), bias], 1e-5, |t| t[0].linear(&t[1], Some(&t[2])).unwrap());
    same_on_both("linear no bias", &[x, w], 1e-5, |t| t[0].linear(&t[1], None).unwrap());
}

/// `t` with every value rounded to bf16 (what a bf16 tensor of it holds), still f32 on the host.
fn bf16_values(t: &Tensor) -> Tensor {
    let v = t.to_vec_f32().unwrap().into_iter().map(|x| half::bf16::from_f32(x).to_f32()).collect();
    Tensor::from_vec(v, t.dims().to_vec(), &Device::Cpu).unwrap()
}

/// Runs `op` in bf16 on the GPU (the inputs flagged `true` in `typed` as bf16 tensors, the
/// others — biases, norm scales — as f32 tensors of bf16 values, as a bf16 model holds them) and
/// in f32 on the CPU on the same rounded values, then rounds the CPU result to bf16. The two
/// agree to one bf16 step at the result's largest magnitude: both accumulate in f32 and round
/// once, so only a rounding boundary between two accumulation orders can differ.
fn same_in_bf16(what: &str, inputs: &[Tensor], typed: &[bool], op: impl Fn(&[Tensor]) -> Tensor) {
    let rounded: Vec<Tensor> = inputs.iter().map(bf16_values).collect();
    let want = bf16_values(&op(&rounded));
    let on_gpu: Vec<Tensor> = rounded
        .iter()
        .zip(typed)
        .map(|(t, &typed)| if typed { gpu_of(t).to_dtype(DType::BF16).unwrap() } else { gpu_of(t) })
        .collect();
    let got = op(&on_gpu);
    assert_eq!(got.dtype(), DType::BF16, "{what}: a bf16 result");
    let got = got.to_device(&Device::Cpu).unwrap();
    assert_eq!(got.dims(), want.dims(), "{what}");
    let top = want.to_vec_f32().unwrap().iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let tol = top * 2f32.powi(-7);
    let diff = got.max_abs_diff(&want).unwrap();
    assert!(diff <= tol, "{what} in bf16: max |cuda - cpu| = {diff} > {tol}");
}

#[test]
fn bf16_ops_match_the_cpu_on_bf16_values() {
    if !gpu("bf16 ops") {
        return;
    }
    let (a, b) = (pattern(&[2, 3, 33], 30), pattern(&[2, 3, 33], 31));
    same_in_bf16("add", &[a.clone(), b], &[true, true], |t| t[0].add(&t[1]).unwrap());
    same_in_bf16("silu", std::slice::from_ref(&a), &[true], |t| t[0].silu().unwrap());
    same_in_bf16("clamp", std::slice::from_ref(&a), &[true], |t| t[0].clamp(-0.5, 0.25).unwrap());
    same_in_bf16("scale", std::slice::from_ref(&a), &[true], |t| t[0].mul_scalar(0.37).unwrap());
    let x = pattern(&[2, 8, 5, 7], 32);
    let (g, bt) = (pattern(&[8], 33), pattern(&[8], 34));
    same_in_bf16("group_norm", &[x.clone(), g.clone(), bt], &[true, false, false], |t| {
        t[0].group_norm(4, &t[1], &t[2], 1e-6).unwrap()
    });
    // 60 pixels: four per lane (the `_x4` kernel); 75: one per lane; 150 channels: more than
    // the 16 slices of four-pixel lanes hold in registers.
    for (i, dims) in [[1, 8, 3, 4, 5], [1, 8, 3, 5, 5], [1, 150, 1, 2, 4]].into_iter().enumerate() {
        let v = pattern(&dims, 35 + 10 * i as u64);
        let gamma = pattern(&[dims[1], 1, 1, 1], 36);
        same_in_bf16(&format!("rms_norm_channels {dims:?}"), &[v, gamma], &[true, false], |t| {
            t[0].rms_norm_channels(&t[1], None, 1, 1e-12).unwrap()
        });
    }
    let v = pattern(&[1, 8, 3, 4, 5], 35);
    let w = pattern(&[70, 8, 3, 3], 37).affine(0.2, 0.0).unwrap();
    let bias = pattern(&[70], 38);
    same_in_bf16("conv2d (tensor cores)", &[x.clone(), w, bias], &[true, true, false], |t| {
        t[0].conv2d(&t[1], Some(&t[2]), &Conv2dParams::same(3)).unwrap()
    });
    let w3 = pattern(&[9, 8, 3, 3, 3], 39).affine(0.1, 0.0).unwrap();
    same_in_bf16("causal conv3d (tensor cores)", &[v.clone(), w3], &[true, true], |t| {
        t[0].conv3d(&t[1], None, &Conv3dParams::causal([1, 1, 1], [1, 1, 1])).unwrap()
    });
    let (w_rgb, b_rgb) = (pattern(&[3, 8, 3, 3, 3], 52).affine(0.1, 0.0).unwrap(), pattern(&[3], 53));
    same_in_bf16("causal conv3d to 3 channels (CUDA cores)", &[v.clone(), w_rgb, b_rgb], &[true, true, false], |t| {
        t[0].conv3d(&t[1], Some(&t[2]), &Conv3dParams::causal([1, 1, 1], [1, 1, 1])).unwrap()
    });
    same_in_bf16("upsample", std::slice::from_ref(&x), &[true], |t| t[0].upsample_nearest2d(2).unwrap());
    same_in_bf16("permute", std::slice::from_ref(&x), &[true], |t| t[0].permute(&[0, 2, 3, 1]).unwrap());
    same_in_bf16("cat of narrows", std::slice::from_ref(&x), &[true], |t| {
        Tensor::cat(&[&t[0].narrow(3, 4, 3).unwrap(), &t[0].narrow(3, 0, 4).unwrap()], 3).unwrap()
    });
    same_in_bf16("dup_up3d", std::slice::from_ref(&v), &[true], |t| t[0].dup_up3d(2, 2, 4, true).unwrap());
    let odd = pattern(&[1, 4, 3, 4, 6], 40);
    same_in_bf16("avg_down3d", &[odd], &[true], |t| t[0].avg_down3d(2, 2, 8).unwrap());
    let (q, k, vv) = (pattern(&[2, 29, 16], 41), pattern(&[2, 31, 16], 42), pattern(&[2, 31, 8], 43));
    same_in_bf16("attention (CUDA cores)", &[q, k, vv], &[true, true, true], |t| {
        Tensor::attention(&t[0], &t[1], &t[2]).unwrap()
    });
    // 200 keys of 24 channels: both products on the tensor cores, the probabilities rounded to
    // bf16 for P V (as flash attention does), inside the same bound.
    let (q, k, vv) = (pattern(&[2, 300, 24], 49), pattern(&[2, 200, 24], 50), pattern(&[2, 200, 12], 51));
    same_in_bf16("attention (tensor cores)", &[q, k, vv], &[true, true, true], |t| {
        Tensor::attention(&t[0], &t[1], &t[2]).unwrap()
    });
    let (xs, wl, bl) = (pattern(&[2, 67, 24], 44), pattern(&[33, 24], 45), pattern(&[33], 46));
    same_in_bf16("linear", &[xs, wl, bl], &[true, true, false], |t| t[0].linear(&t[1], Some(&t[2])).unwrap());
    let (ma, mb) = (pattern(&[3, 67, 20], 47), pattern(&[3, 20, 130], 48));
    same_in_bf16("matmul", &[ma, mb], &[true, true], |t| t[0].matmul(&t[1]).unwrap());
}

#[test]
fn bf16_and_f32_operands_do_not_mix() {
    if !gpu("bf16 type checks") {
        return;
    }
    let a = gpu_of(&pattern(&[4, 4], 49));
    let b = a.to_dtype(DType::BF16).unwrap();
    assert!(a.add(&b).is_err(), "an f32 + bf16 add is a typed error");
    assert!(
        b.to_dtype(DType::F32).unwrap().to_device(&Device::Cpu).unwrap().bit_eq(&bf16_values(&pattern(&[4, 4], 49)))
    );
    // A bf16 bias is refused: the kernels take f32 per-channel parameters.
    let x = gpu_of(&pattern(&[1, 2, 3, 3], 50)).to_dtype(DType::BF16).unwrap();
    let w = gpu_of(&pattern(&[2, 2, 1, 1], 51)).to_dtype(DType::BF16).unwrap();
    let bias = gpu_of(&pattern(&[2], 52)).to_dtype(DType::BF16).unwrap();
    assert!(x.conv2d(&w, Some(&bias), &Conv2dParams::default()).is_err());
}
