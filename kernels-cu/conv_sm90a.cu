// The bf16 convolution on Hopper's warpgroup MMA (`wgmma.mma_async`, compiled for sm_90a only and
// loaded on compute capability 9.0): the same implicit GEMM as conv.cu's `conv3d_tc_bf16_*`, from
// the same channels-last operands, with the roles of the operands swapped. Output pixels are the
// M side (a warpgroup multiplies 64 of them per instruction, which every grid fills) and output
// channels the N side, of any multiple of 8: the N of a kernel is the channels of a tile (96, 128,
// 192 or 256), so Wan's 96- and 192-channel convolutions run without idle rows.
//
// Why: mma.sync reads both operands through registers, `ldmatrix` by `ldmatrix`, and on the H200
// the conv.cu kernels reached 169-183 TFLOP/s of a dense bf16 peak near 990. A `wgmma` reads its
// operands from shared memory itself (descriptors, no register fragments), runs asynchronously
// while the warpgroup issues the next copies, and multiplies 64 x N x 16 per instruction.
//
// A block is two warpgroups (256 threads) over 128 output pixels x N output channels; K advances
// one 64-byte slice (32 channels of one tap) per stage, as in conv.cu, loaded by the same
// `TcLoader` (weights as its "rows", pixels as its "pixels") into the 64-byte swizzle that `wgmma`
// reads. Every output element is summed in the K order of conv.cu's kernels (slice after slice,
// k16 after k16); whether the tensor cores of both instructions round the same is for a GPU to
// show.
#include "conv_common.cuh"
#include "wgmma.cuh"

// Stages in flight: deep enough that a stage's copies have a few K steps to arrive (a step of a
// 256-channel tile is about 500 cycles of tensor-core work, less for narrower tiles).
template <int N>
struct WgmmaShape {
    static_assert(N % 32 == 0 && N >= 96 && N <= 256, "a tile's channels are whole TcLoader rows of 32");
    static constexpr int STAGES = N >= 192 ? 5 : 6;
    static constexpr int STAGE_BYTES = (N + 128) * 64;  // weights (N rows), then pixels (128 rows)
    // Blocks per multiprocessor: two where the accumulators (N / 2 registers a thread) leave room.
    static constexpr int MIN_BLOCKS = N <= 128 ? 2 : 1;
};

// The dynamic shared memory a launch must give: the stages, plus 512 bytes to start them on a
// multiple of 512 in the shared window (the swizzle is taken on the address bits).
#define WGMMA_SMEM(N) (((N) >= 192 ? 5 : 6) * ((N) + 128) * 64 + 512)

template <int N>
__device__ __forceinline__ void conv3d_wgmma_impl(const unsigned short* xp, const unsigned short* wr,
                                                  const float* bias, unsigned short* out, const ConvGeom& g) {
    using Shape = WgmmaShape<N>;
    constexpr int STAGES = Shape::STAGES, STAGE_BYTES = Shape::STAGE_BYTES, R = N / 2;
    static_assert(STAGES * STAGE_BYTES + 512 == WGMMA_SMEM(N), "WGMMA_SMEM");
    unsigned char* raw = dynamic_shared(WGMMA_SMEM(N));
    unsigned char* smem = raw + ((512 - (shared_address(raw) & 511)) & 511);

    const Padded p = padded_of<unsigned short>(g);
    const u64 n_cols = g.n * g.to * g.ho * g.wo;
    const unsigned steps = (unsigned)(g.kt * g.kh * g.kw) * ((p.cp + 31) / 32);
    const u64 n0 = (u64)blockIdx.x * 128;
    const unsigned m0 = blockIdx.y * N;  // the tile's first output channel
    const unsigned group = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    TcLoader<unsigned short, N / 32, 128> loader(xp, wr, g, p, m0, n0, n_cols);

    float acc[R];
#pragma unroll
    for (int i = 0; i < R; ++i) acc[i] = 0.0f;

    // Step s's copies go into stage s % STAGES, STAGES - 2 steps ahead of the products: the stage
    // a load overwrites was read by the products of two steps back, which every warpgroup has
    // waited for (wgmma_wait<1> below) before the barrier that precedes the load. The products
    // of this step read another stage, so the copies may be issued while they run.
#pragma unroll
    for (int s = 0; s < STAGES - 2; ++s) {
        if ((unsigned)s < steps) loader.load(smem + s * STAGE_BYTES, xp, wr, g, p);
        cp_async_commit();
    }
    for (unsigned step = 0; step < steps; ++step) {
        cp_async_wait<STAGES - 3>();
        fence_proxy_async();
        __syncthreads();
        // The products first, so that the tensor cores start while this thread issues the copies.
        const unsigned char* stage = smem + (step % STAGES) * STAGE_BYTES;
        const unsigned char* pixels = stage + N * 64 + group * 64 * 64;
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < 2; ++ks) {
            wgmma_bf16<N>(acc, wgmma_desc_sw64(pixels + ks * 32), wgmma_desc_sw64(stage + ks * 32));
        }
        wgmma_commit();
        const unsigned next = step + STAGES - 2;
        if (next < steps) loader.load(smem + (next % STAGES) * STAGE_BYTES, xp, wr, g, p);
        cp_async_commit();
        // The products of this step may still run; those of the last step are done.
        wgmma_wait<1>();
    }
    wgmma_wait<0>();
    wgmma_fence_operands(acc);
    cp_async_wait<0>();
    __syncthreads();

    // The tile, biased and rounded once to bf16, through shared memory as [channel][pixel] so
    // that the stores to [N, Cout, To, Ho, Wo] run along the pixels (N x 136 x 2 bytes fit the
    // stages).
    constexpr unsigned LDC = 128 + 8;
    static_assert(N * LDC * 2 <= STAGES * STAGE_BYTES, "the output tile fits the stages");
    unsigned short* Cs = (unsigned short*)smem;
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const unsigned pixel = group * 64 + warp * 16 + (lane >> 2) + (q >= 2 ? 8 : 0);
            const unsigned ch = j * 8 + (lane & 3) * 2 + (q & 1);
            const unsigned co = m0 + ch;
            const float bv = (bias && co < g.cout) ? bias[co] : 0.0f;
            store_f32(&Cs[ch * LDC + pixel], acc[4 * j + q] + bv);
        }
    __syncthreads();
    const unsigned c = threadIdx.x & 127;
    const u64 out_col = n0 + c;
    if (out_col < n_cols) {
        const u64 plane = g.to * g.ho * g.wo;
        const u64 base = (out_col / plane) * g.cout * plane + out_col % plane;
        for (unsigned ch = threadIdx.x >> 7; ch < (unsigned)N; ch += 2) {
            if (m0 + ch < g.cout) out[base + (u64)(m0 + ch) * plane] = Cs[ch * LDC + c];
        }
    }
}

// `xp` and `wr` as conv.cu's `conv_input_channels_last_bf16` and `conv_weight_channels_last_bf16`
// made them; 256 threads, grid (columns / 128, cout / N), WGMMA_SMEM(N) bytes of dynamic shared
// memory.
#define CONV_WGMMA(N)                                                                                 \
    extern "C" __global__ void __launch_bounds__(TC_THREADS, WgmmaShape<N>::MIN_BLOCKS)                \
        conv3d_wgmma_bf16_n##N(const unsigned short* xp, const unsigned short* wr, const float* bias,    \
                               unsigned short* out, ConvGeom g) {                                       \
        conv3d_wgmma_impl<N>(xp, wr, bias, out, g);                                                   \
    }

CONV_WGMMA(96)
CONV_WGMMA(128)
CONV_WGMMA(192)
CONV_WGMMA(256)
