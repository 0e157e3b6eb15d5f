// Convolution as an implicit GEMM (no im2col buffer): `out[co, col] = sum_k w[co, k] * x_col[k]`
// with `k = (dt, dy, dx, ci)` and `col = (n, to, ho, wo)`. One pipeline covers the 2-D convs
// (kt = 1, T = 1) and Wan's causal 3-D convs (front-only temporal padding): a zero-padded
// channels-last copy of the input, then tensor cores, in bf16 (mma.sync m16n8k16, f32
// accumulation) and in f32 (the same tiles on TF32 tensor cores, each operand split in two TF32
// parts, three products: f32 accuracy, see `mma_slice`). A CUDA-core f32 kernel that gathered
// every element from [N, C, T, H, W] with its own index arithmetic ran at 13-15 TFLOP/s on an
// H200; this one at 35-44 (f32) and 169-183 (bf16).
#include "conv_common.cuh"

// x[N, Cin, T, H, W] -> xp[N, Tp, Hp, Wp, Cp]: element (n, tp, yp, xq, c) is
// x[n, c, tp - pad_front, yp - pad_top, xq - pad_left], or zero outside x and for c >= Cin.
// The input's first `front_t` of its T = g.t frames may come from another tensor `front`
// [N, Cin, front_t, H, W] (Wan's causal cache: the conv of cat(front, x) along time without
// the cat); x then holds the other T - front_t.
// Grid (N * Tp * Hp, Wp / 64, Cp / 32), 256 threads: a block transposes a 32-channel x 64-column
// tile of one row through shared memory, reading along W and writing along C (both coalesced).
template <typename T>
__device__ __forceinline__ void conv_input_channels_last_impl(const T* front, u64 front_t, const T* x, T* xp,
                                                              const ConvGeom& g) {
    __shared__ T tile[32][64 + 4 / sizeof(T)];  // rows 33 words apart: no bank conflicts
    const Padded p = padded_of<T>(g);
    const u64 row = blockIdx.x;  // (n, tp, yp)
    const u64 n = row / (p.tp * p.hp), tp = (row / p.hp) % p.tp, yp = row % p.hp;
    const i64 t = (i64)tp - g.pad_front, y = (i64)yp - g.pad_top;
    const bool row_inside = t >= 0 && y >= 0 && t < (i64)g.t && y < (i64)g.h;
    // This row's frame: in `front` (of front_t frames) or in x (of the rest).
    const bool in_front = t < (i64)front_t;
    const T* src = in_front ? front : x;
    const u64 src_t = in_front ? (u64)t : (u64)t - front_t, src_frames = in_front ? front_t : g.t - front_t;
    const unsigned w0 = blockIdx.y * 64, c0 = blockIdx.z * 32;
    for (unsigned e = threadIdx.x; e < 32 * 64; e += 256) {
        const unsigned cl = e / 64, wl = e % 64, c = c0 + cl;
        const i64 xq = (i64)(w0 + wl) - g.pad_left;
        T v = T(0);
        if (row_inside && c < g.cin && xq >= 0 && xq < (i64)g.w) {
            v = src[(((n * g.cin + c) * src_frames + src_t) * g.h + (u64)y) * g.w + (u64)xq];
        }
        tile[cl][wl] = v;
    }
    __syncthreads();
    T* dst = xp + row * p.wp * p.cp;
    for (unsigned e = threadIdx.x; e < 32 * 64; e += 256) {
        const unsigned wl = e / 32, cl = e % 32;
        if (w0 + wl < p.wp && c0 + cl < p.cp) dst[(u64)(w0 + wl) * p.cp + c0 + cl] = tile[cl][wl];
    }
}

// w[Cout, Cin, kt, kh, kw] -> wr[Cout, kt, kh, kw, Cp], zero for c >= Cin.
template <typename T>
__device__ __forceinline__ void conv_weight_channels_last_impl(const T* w, T* wr, const ConvGeom& g) {
    const Padded p = padded_of<T>(g);
    const u64 taps = g.kt * g.kh * g.kw;
    GRID_STRIDE(i, g.cout * taps * p.cp) {
        const u64 c = i % p.cp, tap = (i / p.cp) % taps, co = i / (p.cp * taps);
        wr[i] = c < g.cin ? w[(co * g.cin + c) * taps + tap] : T(0);
    }
}

// The tile geometry: a block owns BM = 32 * MT output channels x BN output pixels; 8 warps in a
// 2 (M) x 4 (N) grid, each a (16 * MT) x (BN / 4) tile of MT x BN / 32 mma fragments. K advances
// one 64-byte slice per stage, STAGES stages in flight. Two shapes: BN = 128 with 3 stages in 48
// KiB of static shared memory (two blocks per multiprocessor), and BN = 256 with 4 stages in
// dynamic shared memory (one block per multiprocessor, up to 255 registers a thread): half the
// operand bytes per product from L2 and from shared memory, for grids of enough blocks.
template <int MT, int BN, int STAGES>
struct TcShape {
    static constexpr int BM = 32 * MT;
    static constexpr int FRAGS_N = BN / 32;  // n8 fragments per warp
    static constexpr int STAGE_BYTES = (BM + BN) * 64;
    static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES;
    static_assert(BN == 128 || BN == 256, "a warp's pixels are whole pairs of n8 fragments per ldmatrix");
    static_assert(TC_THREADS % BN == 0, "the epilogue gives every thread one pixel column");
};

// The dynamic shared memory of the BN = 256 kernels (the backend launches with these bytes).
#define TC_WIDE_STAGES 4
#define TC_WIDE_SMEM(MT) (TC_WIDE_STAGES * (32 * (MT) + 256) * 64)

// f32 products on TF32 tensor cores with f32 accuracy ("3xTF32"): each operand x splits into
// hi = tf32(x) and lo = tf32(x - hi), and a b = a_hi b_hi + a_hi b_lo + a_lo b_hi (the small
// terms first), dropping a_lo b_lo and the rounding of lo, both near 2^-22 relative: below the
// f32 accumulation's own error over a conv's thousands of terms. One TF32 product alone (10-bit
// mantissas, PyTorch's default for f32 convolutions) would be 2^-11.
__device__ __forceinline__ void split_tf32(unsigned x, unsigned& hi, unsigned& lo) {
    hi = to_tf32(__uint_as_float(x));
    lo = to_tf32(__uint_as_float(x) - __uint_as_float(hi));
}

// One k slice of 16 bytes per row pair (k16 of bf16, k8 of f32) for fragments a[4], b[2].
__device__ __forceinline__ void mma_slice(float c[4], const unsigned a[4], const unsigned b[2], unsigned short) {
    mma_bf16_16816(c, a, b);
}

__device__ __forceinline__ void mma_slice(float c[4], const unsigned a[4], const unsigned b[2], float) {
    unsigned a_hi[4], a_lo[4], b_hi[2], b_lo[2];
#pragma unroll
    for (int i = 0; i < 4; ++i) split_tf32(a[i], a_hi[i], a_lo[i]);
#pragma unroll
    for (int i = 0; i < 2; ++i) split_tf32(b[i], b_hi[i], b_lo[i]);
    mma_tf32_1688(c, a_hi, b_lo);
    mma_tf32_1688(c, a_lo, b_hi);
    mma_tf32_1688(c, a_hi, b_hi);
}

// Operands of type T, output of type TO (T, or f32 for bf16 operands: attention's scores).
// One TF32 product per f32 product ("TF32" mode, PyTorch's default for f32 convolutions on these
// GPUs): each operand rounded to a 10-bit mantissa (2^-11 relative), f32 accumulation; three
// times fewer tensor-core instructions than 3xTF32.
struct Tf32 {};

__device__ __forceinline__ void mma_slice(float c[4], const unsigned a[4], const unsigned b[2], Tf32) {
    unsigned at[4], bt[2];
#pragma unroll
    for (int i = 0; i < 4; ++i) at[i] = to_tf32(__uint_as_float(a[i]));
#pragma unroll
    for (int i = 0; i < 2; ++i) bt[i] = to_tf32(__uint_as_float(b[i]));
    mma_tf32_1688(c, at, bt);
}

// Operands of type T, output of type TO (T, or f32 for bf16 operands: attention's scores), the
// products as `Math` says (the storage type's own, or Tf32 for f32 operands), tiles of
// 32 * MT x BN, STAGES stages in `smem` (TcShape<MT, BN, STAGES>::SMEM_BYTES of them). Every
// output element is summed over K in the same order whatever the tile: the kernels of one Math
// give bit-identical results.
template <typename T, typename TO, int MT, typename Math, int BN, int STAGES>
__device__ __forceinline__ void conv3d_tc_impl(unsigned char* smem, const T* xp, const T* wr, const float* bias,
                                               TO* out, const ConvGeom& g) {
    using Shape = TcShape<MT, BN, STAGES>;
    constexpr int BM = Shape::BM, FN = Shape::FRAGS_N, STAGE_BYTES = Shape::STAGE_BYTES;
    constexpr unsigned LDC = BN + 16 / sizeof(TO);
    static_assert(16 * MT * LDC * sizeof(TO) <= Shape::SMEM_BYTES, "the output half-tile fits the stages");

    const Padded p = padded_of<T>(g);
    const u64 n_cols = g.n * g.to * g.ho * g.wo;
    const unsigned csteps = (p.cp + 4 * (unsigned)Wide<T>::N - 1) / (4 * (unsigned)Wide<T>::N);
    const unsigned steps = (unsigned)(g.kt * g.kh * g.kw) * csteps;
    const u64 n0 = (u64)blockIdx.x * BN;
    const unsigned m0 = blockIdx.y * BM;
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warp_m = warp >> 2, warp_n = warp & 3;
    TcLoader<T, MT, BN> loader(xp, wr, g, p, m0, n0, n_cols);

    float acc[MT][FN][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < FN; ++j)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.0f;

#pragma unroll
    for (unsigned s = 0; s < STAGES - 1; ++s) {
        if (s < steps) loader.load(smem + s * STAGE_BYTES, xp, wr, g, p);
        cp_async_commit();
    }
    for (unsigned step = 0; step < steps; ++step) {
        // Step `step` has landed (for every thread, after the barrier), and every warp is done
        // with the stage the next prefetch overwrites (the one computed in the last iteration).
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        const unsigned next = step + STAGES - 1;
        if (next < steps) loader.load(smem + (next % STAGES) * STAGE_BYTES, xp, wr, g, p);
        cp_async_commit();
        const unsigned char* As = smem + (step % STAGES) * STAGE_BYTES;
        const unsigned char* Bs = As + BM * 64;
#pragma unroll
        for (unsigned ks = 0; ks < 2; ++ks) {
            // Each slice is two chunks of every row: k16 of bf16 (one m16n8k16), k8 of f32 (one
            // m16n8k8). Fragments of 32-bit elements load with the same 16-bit `ldmatrix`: each
            // lane then holds one element per register, the layout the TF32 mma expects.
            unsigned a[MT][4], b[FN][2];
#pragma unroll
            for (int i = 0; i < MT; ++i) {
                // Matrices: rows 0-7 / 8-15 (lane bit 3) x chunk lo / hi (lane bit 4).
                const unsigned row = warp_m * 16 * MT + i * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
                ldmatrix_x4(a[i], As + swizzled(row, ks * 2 + (lane >> 4)));
            }
#pragma unroll
            for (int j = 0; j < FN / 2; ++j) {
                // Matrices: pixels 0-7 x chunk lo, 0-7 x hi, 8-15 x lo, 8-15 x hi of a pair of
                // n8 fragments (B is stored pixel-major, k contiguous: PTX's "col" operand).
                const unsigned pix = warp_n * (BN / 4) + j * 16 + (lane & 7) + (lane >> 4) * 8;
                unsigned r[4];
                ldmatrix_x4(r, Bs + swizzled(pix, ks * 2 + ((lane >> 3) & 1)));
                b[2 * j][0] = r[0];
                b[2 * j][1] = r[1];
                b[2 * j + 1][0] = r[2];
                b[2 * j + 1][1] = r[3];
            }
#pragma unroll
            for (int i = 0; i < MT; ++i)
#pragma unroll
                for (int j = 0; j < FN; ++j) mma_slice(acc[i][j], a[i], b[j], Math{});
        }
    }
    cp_async_wait<0>();
    __syncthreads();

    // The tile, biased and rounded once to T, through shared memory in row halves (an f32 tile
    // of 128 x 128 would not fit), so that the stores to [N, Cout, To, Ho, Wo] run along the
    // pixels. Every element a thread stores is in one pixel column (TC_THREADS is a multiple of
    // BN): one output offset, stepped by a channel plane per row.
    TO* Cs = (TO*)smem;
    const unsigned c = threadIdx.x % BN;
    const u64 out_col = n0 + c;
    const u64 plane = g.to * g.ho * g.wo;
    const u64 base = out_col < n_cols ? (out_col / plane) * g.cout * plane + out_col % plane : 0;
#pragma unroll
    for (unsigned half = 0; half < 2; ++half) {
        if (warp_m == half) {
#pragma unroll
            for (int i = 0; i < MT; ++i)
#pragma unroll
                for (int j = 0; j < FN; ++j)
#pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        const unsigned row = i * 16 + (lane >> 2) + (q >= 2 ? 8 : 0);
                        const unsigned col = warp_n * (BN / 4) + j * 8 + (lane & 3) * 2 + (q & 1);
                        const unsigned co = m0 + half * 16 * MT + row;
                        const float bv = (bias && co < g.cout) ? bias[co] : 0.0f;
                        store_f32(&Cs[row * LDC + col], acc[i][j][q] + bv);
                    }
        }
        __syncthreads();
        if (out_col < n_cols) {
            for (unsigned row = threadIdx.x / BN; row < 16 * MT; row += TC_THREADS / BN) {
                const unsigned co = m0 + half * 16 * MT + row;
                if (co < g.cout) out[base + (u64)co * plane] = Cs[row * LDC + c];
            }
        }
        __syncthreads();
    }
}

// The two tile shapes over shared memory of their own: static for BN = 128 (3 stages, 48 KiB at
// most), dynamic for BN = 256 (TC_WIDE_STAGES stages, TC_WIDE_SMEM(MT) bytes, which the launch
// must give; `dynamic_shared` checks it).
template <typename T, typename TO, int MT, typename Math = T>
__device__ __forceinline__ void conv3d_tc_narrow(const T* xp, const T* wr, const float* bias, TO* out,
                                                 const ConvGeom& g) {
    constexpr int bytes = TcShape<MT, 128, 3>::SMEM_BYTES;
    static_assert(bytes <= 48 * 1024, "static shared memory is limited to 48 KiB");
    __shared__ __align__(128) unsigned char smem[bytes];
    conv3d_tc_impl<T, TO, MT, Math, 128, 3>(smem, xp, wr, bias, out, g);
}

template <typename T, typename TO, int MT, typename Math = T>
__device__ __forceinline__ void conv3d_tc_wide(const T* xp, const T* wr, const float* bias, TO* out,
                                               const ConvGeom& g) {
    static_assert(TcShape<MT, 256, TC_WIDE_STAGES>::SMEM_BYTES == TC_WIDE_SMEM(MT), "TC_WIDE_SMEM");
    unsigned char* smem = dynamic_shared(TC_WIDE_SMEM(MT));
    conv3d_tc_impl<T, TO, MT, Math, 256, TC_WIDE_STAGES>(smem, xp, wr, bias, out, g);
}

// `xp` and `wr` as `conv_input_channels_last_*` and `conv_weight_channels_last_*` made them;
// 256 threads. `conv3d_tc_<type>_m<MT>`: grid (columns / 128, cout / BM), two blocks per
// multiprocessor (at most 128 registers). `conv3d_tc_<type>_m<MT>_n256`: grid (columns / 256,
// cout / BM), TC_WIDE_SMEM(MT) bytes of dynamic shared memory, one block per multiprocessor.
// Tile heights (the backend picks one per launch): 128 (not with 3xTF32), 96 and 64 output
// channels.
#define CONV_TC(SUFFIX, T, MT, MATH)                                                                \
    extern "C" __global__ void __launch_bounds__(TC_THREADS, 2)                                     \
        conv3d_tc_##SUFFIX##_m##MT(const T* xp, const T* wr, const float* bias, T* out, ConvGeom g) { \
        conv3d_tc_narrow<T, T, MT, MATH>(xp, wr, bias, out, g);                                     \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(TC_THREADS, 1) conv3d_tc_##SUFFIX##_m##MT##_n256(   \
        const T* xp, const T* wr, const float* bias, T* out, ConvGeom g) {                          \
        conv3d_tc_wide<T, T, MT, MATH>(xp, wr, bias, out, g);                                       \
    }

#define CONV_INPUT_COPIES(SUFFIX, T)                                                                \
    extern "C" __global__ void __launch_bounds__(256)                                               \
        conv_input_channels_last_##SUFFIX(const T* x, T* xp, ConvGeom g) {                          \
        conv_input_channels_last_impl<T>(nullptr, 0, x, xp, g);                                     \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(256) conv_input_channels_last_split_##SUFFIX(      \
        const T* front, u64 front_t, const T* x, T* xp, ConvGeom g) {                               \
        conv_input_channels_last_impl<T>(front, front_t, x, xp, g);                                 \
    }                                                                                               \
    extern "C" __global__ void conv_weight_channels_last_##SUFFIX(const T* w, T* wr, ConvGeom g) {  \
        conv_weight_channels_last_impl<T>(w, wr, g);                                                \
    }

CONV_INPUT_COPIES(bf16, unsigned short)
CONV_INPUT_COPIES(f32, float)
CONV_TC(bf16, unsigned short, 4, unsigned short)
CONV_TC(bf16, unsigned short, 3, unsigned short)
CONV_TC(bf16, unsigned short, 2, unsigned short)
// The f32 kernels have no 128-row tile: with the TF32 split its 128 accumulators and operand
// halves need more than the 128 registers that let two blocks share a multiprocessor.
CONV_TC(f32, float, 3, float)
CONV_TC(f32, float, 2, float)
// f32 operands in TF32 mode (`--dtype tf32`): one TF32 product each. The 128-row tile fits the
// registers here (no operand split).
CONV_TC(tf32, float, 4, Tf32)
CONV_TC(tf32, float, 3, Tf32)
CONV_TC(tf32, float, 2, Tf32)

// ---------------------------------------------------------------------------------------------
// Few output channels (the RGB heads: Wan's 96 -> 3 causal 3x3x3 at full resolution, SD's
// 128 -> 3): the shortest tensor-core tile has 64 rows, 61 of which would multiply zeros. Here
// CUDA cores compute every output channel of one pixel per thread from the same channels-last
// operands, the weights staged in shared memory (every thread reads the same weight: broadcast),
// 16 bytes of a pixel's channels per load. f32 accumulation of f32 products in the order tap,
// channel; bf16 products are exact in f32, as on the tensor cores. Grid-stride over the output
// pixels (the weights are staged once per block); the backend uses it for at most CO = 4 output
// channels whose weights fit SMALL_COUT_SMEM bytes. (An 8-channel variant spilled registers.)
// ---------------------------------------------------------------------------------------------
#define SMALL_COUT_SMEM 45056

template <typename T, int CO>
__device__ __forceinline__ void conv3d_small_cout_impl(const T* xp, const T* wr, const float* bias, T* out,
                                                       const ConvGeom& g) {
    constexpr unsigned E = (unsigned)Wide<T>::N;
    __shared__ __align__(16) T ws[SMALL_COUT_SMEM / sizeof(T)];
    const Padded p = padded_of<T>(g);
    const u64 row = g.kt * g.kh * g.kw * (u64)p.cp;  // one output channel's weights
    for (u64 i = threadIdx.x; i < CO * row; i += blockDim.x) ws[i] = i / row < g.cout ? wr[i] : T(0);
    __syncthreads();
    const u64 plane = g.to * g.ho * g.wo, n_cols = g.n * plane;
    for (u64 col = (u64)blockIdx.x * blockDim.x + threadIdx.x; col < n_cols; col += (u64)gridDim.x * blockDim.x) {
        const u64 wo = col % g.wo, ho = (col / g.wo) % g.ho, to = (col / (g.wo * g.ho)) % g.to, b = col / plane;
        const T* origin = xp + (((b * p.tp + to * g.stride_t) * p.hp + ho * g.stride) * p.wp + wo * g.stride) * p.cp;
        float acc[CO];
#pragma unroll
        for (int co = 0; co < CO; ++co) acc[co] = 0.0f;
        const T* w = ws;
        for (u64 dt = 0; dt < g.kt; ++dt)
            for (u64 dy = 0; dy < g.kh; ++dy)
                for (u64 dx = 0; dx < g.kw; ++dx) {
                    const T* x = origin + ((dt * p.hp + dy) * p.wp + dx) * p.cp;
                    for (unsigned c = 0; c < p.cp; c += E, w += E) {
                        const Pack<16> xv = pack_load<16>(x + c);
#pragma unroll
                        for (int co = 0; co < CO; ++co) {
                            const Pack<16> wv = pack_load<16>(w + co * row);
#pragma unroll
                            for (unsigned k = 0; k < E; ++k) {
                                acc[co] = fmaf(pack_get(xv.w, k, x), pack_get(wv.w, k, x), acc[co]);
                            }
                        }
                    }
                }
#pragma unroll
        for (int co = 0; co < CO; ++co) {
            if ((u64)co < g.cout) {
                store_f32(&out[(b * g.cout + co) * plane + col % plane], acc[co] + (bias ? bias[co] : 0.0f));
            }
        }
    }
}

#define CONV_SMALL_COUT(SUFFIX, T, CO)                                                                    \
    extern "C" __global__ void __launch_bounds__(256) conv3d_small_cout_##SUFFIX##_c##CO(                   \
        const T* xp, const T* wr, const float* bias, T* out, ConvGeom g) {                                  \
        conv3d_small_cout_impl<T, CO>(xp, wr, bias, out, g);                                                \
    }

CONV_SMALL_COUT(bf16, unsigned short, 4)
CONV_SMALL_COUT(f32, float, 4)

// bf16 operands, f32 output: attention's scores Q K^T as a 1x1 "convolution" (Q the weights, K
// the channels-last pixels), kept in f32 for the softmax as flash attention keeps them.
extern "C" __global__ void __launch_bounds__(TC_THREADS, 2)
    conv3d_tc_bf16_f32out_m4(const unsigned short* xp, const unsigned short* wr, const float* bias, float* out,
                             ConvGeom g) {
    conv3d_tc_narrow<unsigned short, float, 4>(xp, wr, bias, out, g);
}
