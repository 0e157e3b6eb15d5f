//! conv2d throughput: the 3x3 128→128 conv at 128x128 of stack.md §4, diffusers' stride-2
//! downsample, and a 1x1 conv. Throughput is reported in FLOP (2 per multiply-add), so
//! criterion's "elem/s" reads as FLOP/s. Threads follow `RAYON_NUM_THREADS`.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use std::hint::black_box;
use vae_tensor::{Conv2dParams, Device, Tensor};

/// Deterministic pseudo-random values in [-1, 1).
fn random(dims: &[usize], seed: u64) -> Tensor {
    let n: usize = dims.iter().product();
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let data = (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect();
    Tensor::from_vec(data, dims, &Device::Cpu).expect("valid shape")
}

fn bench_conv(c: &mut Criterion, name: &str, input: [usize; 4], weight: [usize; 4], params: Conv2dParams) {
    let x = random(&input, 1);
    let w = random(&weight, 2);
    let b = random(&weight[..1], 3);
    let (ho, wo) = params.output_size(input[2], input[3], weight[2], weight[3]).expect("kernel fits");
    let flops = 2 * input[0] * weight.iter().product::<usize>() * ho * wo;
    let mut group = c.benchmark_group("conv2d");
    group.throughput(Throughput::Elements(flops as u64));
    group.sample_size(10);
    group.bench_function(name, |bench| bench.iter(|| black_box(x.conv2d(&w, Some(&b), &params).expect("conv"))));
    group.finish();
}

fn conv(c: &mut Criterion) {
    bench_conv(c, "3x3_128to128_128x128", [1, 128, 128, 128], [128, 128, 3, 3], Conv2dParams::same(3));
    let wino = Conv2dParams::same(3).band_aligned(4);
    bench_conv(c, "3x3_128to128_128x128_winograd", [1, 128, 128, 128], [128, 128, 3, 3], wino);
    bench_conv(c, "3x3_512to512_32x32", [1, 512, 32, 32], [512, 512, 3, 3], Conv2dParams::same(3));
    bench_conv(c, "3x3_512to512_32x32_winograd", [1, 512, 32, 32], [512, 512, 3, 3], wino);
    bench_conv(c, "3x3_256to256_64x64_winograd", [1, 256, 64, 64], [256, 256, 3, 3], wino);
    bench_conv(c, "3x3s2_128to128_128x128", [1, 128, 128, 128], [128, 128, 3, 3], Conv2dParams::diffusers_downsample());
    bench_conv(c, "1x1_256to128_128x128", [1, 256, 128, 128], [128, 256, 1, 1], Conv2dParams::default());
}

criterion_group!(benches, conv);
criterion_main!(benches);
