//! The cost model's account of what a CPU convolution holds besides its maps
//! (`vae_planner::cost::kernels`) against the kernels' own memory accounting: direct,
//! Winograd F(2×2) and F(4×4), 2-D and 3-D kernels, maps smaller and larger than a band of
//! tiles, and transformed weights larger than the budget held at once. A change to the kernels'
//! buffers that the model does not follow fails here.

use vae_parallel::planner::cost::kernels::cpu_conv_scratch_bytes;
use vae_parallel::tensor::memory::Account;
use vae_parallel::tensor::{Conv2dParams, Conv3dParams, Device, Tensor};

/// Threads of the pool the convolutions run on.
const THREADS: usize = 2;

/// One convolution: `[frames, rows, columns]` kernel, band alignment, channels, and the output's
/// frames and map.
struct Case {
    kernel: [usize; 3],
    align: usize,
    channels: [usize; 2],
    frames: usize,
    map: [usize; 2],
}

/// Bytes the convolution of `case` held at its peak beyond its output, as the rank's account
/// sees it.
fn measured(case: &Case) -> u64 {
    let [kt, kh, kw] = case.kernel;
    let [cin, cout] = case.channels;
    let [h, w] = case.map;
    let uniform = |dims: Vec<usize>, seed: u64| Tensor::seeded_uniform(dims, seed, -1.0, 1.0, &Device::Cpu).unwrap();
    let weight = uniform(vec![cout, cin, kt, kh, kw], 2);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(THREADS).build().unwrap();
    pool.install(|| {
        let (x, weight) = if kt > 1 {
            (uniform(vec![1, cin, case.frames + kt - 1, h, w], 1), weight)
        } else {
            (uniform(vec![1, cin, h, w], 1), weight.reshape(vec![cout, cin, kh, kw]).unwrap())
        };
        let account = Account::new();
        let _charged = account.enter();
        let out = if kt > 1 {
            let params = Conv3dParams::new([1, 1, 1], [0, 0, kh / 2, kh / 2, kw / 2, kw / 2]).band_aligned(case.align);
            x.conv3d(&weight, None, &params).unwrap()
        } else {
            x.conv2d(&weight, None, &Conv2dParams::same(kh).band_aligned(case.align)).unwrap()
        };
        let output = out.dims().iter().product::<usize>() * 4;
        assert_eq!(out.dims(), &if kt > 1 { vec![1, cout, case.frames, h, w] } else { vec![1, cout, h, w] }[..]);
        drop(out);
        (account.peak_bytes() - output) as u64
    })
}

#[test]
fn the_model_holds_what_the_cpu_kernels_hold() {
    // Output channels divide by every instruction set's row block (4, 6, 8), so the padding
    // to whole blocks is the same on any CPU.
    let cases = [
        // F(4×4) on a map of 256 tiles (a full band), and on one of 60 (a short one).
        Case { kernel: [1, 3, 3], align: 4, channels: [96, 96], frames: 1, map: [64, 64] },
        Case { kernel: [3, 3, 3], align: 4, channels: [48, 96], frames: 2, map: [24, 40] },
        // F(2×2).
        Case { kernel: [1, 3, 3], align: 2, channels: [96, 48], frames: 1, map: [40, 24] },
        // 3×3×3 weights transformed are 99.5 MB: a budget's worth at a time.
        Case { kernel: [3, 3, 3], align: 4, channels: [480, 480], frames: 1, map: [8, 8] },
        // The direct kernel: 3×3 on odd bands, and 1×1.
        Case { kernel: [1, 3, 3], align: 1, channels: [96, 24], frames: 1, map: [32, 32] },
        Case { kernel: [1, 1, 1], align: 1, channels: [96, 48], frames: 1, map: [32, 32] },
    ];
    for case in &cases {
        let model = cpu_conv_scratch_bytes(case.kernel, case.align, case.channels, case.map, THREADS);
        let held = measured(case);
        // Within 2 % (and the kernels' row buffers, a few KiB a thread).
        let slack = model / 50 + (64 << 10);
        assert!(
            held.abs_diff(model) <= slack,
            "kernel {:?} align {} channels {:?} map {:?}: the kernel held {held} B, the model says {model} B",
            case.kernel,
            case.align,
            case.channels,
            case.map
        );
    }
}
