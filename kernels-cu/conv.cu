// Convolution as an implicit GEMM (no im2col buffer): `out[co, col] = sum_k w[co, k] * x_col[k]`
// with `k = (ci, dt, dy, dx)` and `col = (n, to, ho, wo)`, the input element of each (k, col)
// computed while the tile is loaded (zero outside the padded input). One kernel covers the 2-D
// convs (kt = 1, T = 1) and Wan's causal 3-D convs (front-only temporal padding). An f32 path
// (CUDA cores, 64x64 tiles, 4x4 per thread) and a bf16 path on tensor cores (wmma 16x16x16,
// f32 accumulation, bf16 out).
#include "common.cuh"
#include <mma.h>
#include <cuda_bf16.h>

struct ConvGeom {
    u64 n, cin, t, h, w;
    u64 cout, kt, kh, kw;
    u64 to, ho, wo;
    u64 stride_t, stride;
    i64 pad_front, pad_top, pad_left;
};

// One GEMM column's receptive field in the input, decomposed once per thread: every thread loads
// the same column of each K slice, so the K loop only splits `k`, in 32-bit arithmetic (64-bit
// division is emulated on the GPU and costs several times more). The host refuses geometries
// whose K, extents or field origins do not fit 32 bits (`ConvGeom` checks in the backend).
struct Column {
    i64 base;        // offset of (batch, channel 0, frame 0, row 0, column 0)
    int t0, y0, x0;  // the field's first frame, row and column (negative in the padding)
    bool valid;      // a real output column (tiles overhang the last one)
};

__device__ __forceinline__ Column column_of(const ConvGeom& g, u64 col, u64 n_cols) {
    Column c = {0, 0, 0, 0, col < n_cols};
    if (!c.valid) return c;
    const u64 wo = col % g.wo, ho = (col / g.wo) % g.ho, to = (col / (g.wo * g.ho)) % g.to;
    const u64 b = col / (g.wo * g.ho * g.to);
    c.base = (i64)(b * g.cin * g.t * g.h * g.w);
    c.t0 = (int)((i64)(to * g.stride_t) - g.pad_front);
    c.y0 = (int)((i64)(ho * g.stride) - g.pad_top);
    c.x0 = (int)((i64)(wo * g.stride) - g.pad_left);
    return c;
}

// The input element of GEMM row `k` (k = (ci, dt, dy, dx)) for column `c`, or zero in the
// padding, past the last column or past the last row `n_rows`.
template <typename T>
__device__ __forceinline__ float im2col(const T* x, const ConvGeom& g, const Column& c, unsigned k, unsigned n_rows) {
    if (!c.valid || k >= n_rows) return 0.0f;
    const unsigned kw = (unsigned)g.kw, khw = (unsigned)g.kh * kw, taps = (unsigned)g.kt * khw;
    const unsigned ci = k / taps, r = k - ci * taps;
    const unsigned dt = r / khw, r2 = r - dt * khw;
    const unsigned dy = r2 / kw, dx = r2 - dy * kw;
    const int ti = c.t0 + (int)dt, yi = c.y0 + (int)dy, xi = c.x0 + (int)dx;
    if (ti < 0 || yi < 0 || xi < 0 || ti >= (int)g.t || yi >= (int)g.h || xi >= (int)g.w) return 0.0f;
    return load_f32(&x[c.base + (((i64)ci * (i64)g.t + ti) * (i64)g.h + yi) * (i64)g.w + xi]);
}

// Where output column `col` of channel `co` lives in `[N, Cout, To, Ho, Wo]`.
__device__ __forceinline__ u64 out_index(const ConvGeom& g, u64 co, u64 col) {
    const u64 plane = g.to * g.ho * g.wo;
    return ((col / plane) * g.cout + co) * plane + col % plane;
}

#define BM 64
#define BN 64
#define BK 16

// `accumulate`: add to what `out` holds (a temporal tap run as its own launch, say).
extern "C" __global__ void __launch_bounds__(256) conv3d_f32(
    const float* x, const float* wgt, const float* bias, float* out, ConvGeom g, int accumulate) {
    __shared__ float As[BK][BM + 4];
    __shared__ float Bs[BK][BN + 4];
    const u64 M = g.cout, N = g.n * g.to * g.ho * g.wo, K = g.cin * g.kt * g.kh * g.kw;
    const u64 m0 = (u64)blockIdx.y * BM, n0 = (u64)blockIdx.x * BN;
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    float acc[4][4];
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[r][c] = 0.0f;

    // This thread's column of every B slice (256 threads = 4 rows of 64 columns per pass).
    const int j = threadIdx.x % BN;
    const Column col = column_of(g, n0 + j, N);
    for (u64 k0 = 0; k0 < K; k0 += BK) {
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            const int e = threadIdx.x + l * 256;
            const int i = e / BK, kk = e % BK;
            const u64 gi = m0 + i, gk = k0 + kk;
            As[kk][i] = (gi < M && gk < K) ? wgt[gi * K + gk] : 0.0f;
        }
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            const int kk = threadIdx.x / BN + l * (256 / BN);
            Bs[kk][j] = im2col<float>(x, g, col, (unsigned)(k0 + kk), (unsigned)K);
        }
        __syncthreads();
        fma_tile_4x4<BM + 4>(As, Bs, BK, acc, tx, ty);
        __syncthreads();
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const u64 co = m0 + ty * 4 + r;
        if (co >= M) continue;
        const float bv = bias ? bias[co] : 0.0f;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const u64 col = n0 + tx * 4 + c;
            if (col >= N) continue;
            float* dst = &out[out_index(g, co, col)];
            *dst = accumulate ? *dst + acc[r][c] + bv : acc[r][c] + bv;
        }
    }
}

#undef BK
#define BK 32
#define WMMA 16

// bf16 in, f32 accumulation on tensor cores, bf16 out (rounded once). 4 warps in a 2x2 grid,
// each owning a 32x32 block of the 64x64 tile as 2x2 wmma fragments.
extern "C" __global__ void __launch_bounds__(128) conv3d_bf16_wmma(
    const unsigned short* x, const unsigned short* wgt, const float* bias, unsigned short* out, ConvGeom g,
    int accumulate) {
    using namespace nvcuda;
    __shared__ __align__(32) __nv_bfloat16 As[BM][BK + 8];
    __shared__ __align__(32) __nv_bfloat16 Bs[BK][BN + 8];
    __shared__ __align__(32) float Cs[BM][BN + 4];
    const u64 M = g.cout, N = g.n * g.to * g.ho * g.wo, K = g.cin * g.kt * g.kh * g.kw;
    const u64 m0 = (u64)blockIdx.y * BM, n0 = (u64)blockIdx.x * BN;
    const int warp = threadIdx.x / 32, warp_m = warp / 2, warp_n = warp % 2;

    wmma::fragment<wmma::accumulator, WMMA, WMMA, WMMA, float> acc[2][2];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.0f);

    // This thread's column of every B slice (128 threads = 2 rows of 64 columns per pass).
    const int j = threadIdx.x % BN;
    const Column col = column_of(g, n0 + j, N);
    for (u64 k0 = 0; k0 < K; k0 += BK) {
        for (int e = threadIdx.x; e < BM * BK; e += blockDim.x) {
            const int i = e / BK, kk = e % BK;
            const u64 gi = m0 + i, gk = k0 + kk;
            const float v = (gi < M && gk < K) ? bf16_to_f32(wgt[gi * K + gk]) : 0.0f;
            As[i][kk] = __float2bfloat16_rn(v);
        }
        for (int kk = threadIdx.x / BN; kk < BK; kk += blockDim.x / BN) {
            const float v = im2col<unsigned short>(x, g, col, (unsigned)(k0 + kk), (unsigned)K);
            Bs[kk][j] = __float2bfloat16_rn(v);
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < BK; kk += WMMA) {
            wmma::fragment<wmma::matrix_a, WMMA, WMMA, WMMA, __nv_bfloat16, wmma::row_major> a[2];
            wmma::fragment<wmma::matrix_b, WMMA, WMMA, WMMA, __nv_bfloat16, wmma::row_major> b[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(a[i], &As[warp_m * 32 + i * WMMA][kk], BK + 8);
#pragma unroll
            for (int j = 0; j < 2; ++j) wmma::load_matrix_sync(b[j], &Bs[kk][warp_n * 32 + j * WMMA], BN + 8);
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j)
            wmma::store_matrix_sync(&Cs[warp_m * 32 + i * WMMA][warp_n * 32 + j * WMMA], acc[i][j], BN + 4,
                                    wmma::mem_row_major);
    __syncthreads();
    for (int e = threadIdx.x; e < BM * BN; e += blockDim.x) {
        const int i = e / BN, j = e % BN;
        const u64 co = m0 + i, col = n0 + j;
        if (co >= M || col >= N) continue;
        unsigned short* dst = &out[out_index(g, co, col)];
        float v = Cs[i][j] + (bias ? bias[co] : 0.0f);
        if (accumulate) v += bf16_to_f32(*dst);
        *dst = f32_to_bf16(v);
    }
}
