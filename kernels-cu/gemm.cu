// Batched GEMM for attention (`Q K^T` and `P V`) and `nn.Linear`:
// `C[b] = alpha * A[b] B[b] + beta * C[b]`, any strides (so either operand may be a transposed
// view). 64x64 output tiles, 16-deep K slices in shared memory (f32), 256 threads with a 4x4
// register tile each. Written once over the three storage types; instantiated for f32 and for
// the bf16 attention's two products (bf16 Q, K -> f32 scores; f32 probabilities, bf16 V -> bf16).
#include "common.cuh"

#define BM 64
#define BN 64
#define BK 16

template <typename TA, typename TB, typename TC>
__device__ __forceinline__ void gemm_batched_impl(
    const TA* A, const TB* B, TC* C, u64 M, u64 N, u64 K,
    i64 a_batch, i64 a_rs, i64 a_cs, i64 b_batch, i64 b_rs, i64 b_cs, i64 c_batch, i64 ldc,
    float alpha, float beta) {
    __shared__ float As[BK][BM + 4];
    __shared__ float Bs[BK][BN + 4];
    const i64 batch = blockIdx.z;
    A += batch * a_batch;
    B += batch * b_batch;
    C += batch * c_batch;
    const u64 m0 = (u64)blockIdx.y * BM, n0 = (u64)blockIdx.x * BN;
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    float acc[4][4];
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[r][c] = 0.0f;

    for (u64 k0 = 0; k0 < K; k0 += BK) {
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            const int e = threadIdx.x + l * 256;
            const int i = e / BK, kk = e % BK;
            const u64 gi = m0 + i, gk = k0 + kk;
            As[kk][i] = (gi < M && gk < K) ? load_f32(&A[(i64)gi * a_rs + (i64)gk * a_cs]) : 0.0f;
        }
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            const int e = threadIdx.x + l * 256;
            const int kk = e / BN, j = e % BN;
            const u64 gk = k0 + kk, gj = n0 + j;
            Bs[kk][j] = (gk < K && gj < N) ? load_f32(&B[(i64)gk * b_rs + (i64)gj * b_cs]) : 0.0f;
        }
        __syncthreads();
        fma_tile_4x4<BM + 4>(As, Bs, BK, acc, tx, ty);
        __syncthreads();
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const u64 i = m0 + ty * 4 + r;
        if (i >= M) continue;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const u64 j = n0 + tx * 4 + c;
            if (j >= N) continue;
            TC* dst = &C[(i64)i * ldc + (i64)j];
            store_f32(dst, beta == 0.0f ? alpha * acc[r][c] : alpha * acc[r][c] + beta * load_f32(dst));
        }
    }
}

#define GEMM(NAME, TA, TB, TC)                                                                            \
    extern "C" __global__ void __launch_bounds__(256) NAME(                                               \
        const TA* A, const TB* B, TC* C, u64 M, u64 N, u64 K, i64 a_batch, i64 a_rs, i64 a_cs,           \
        i64 b_batch, i64 b_rs, i64 b_cs, i64 c_batch, i64 ldc, float alpha, float beta) {                 \
        gemm_batched_impl(A, B, C, M, N, K, a_batch, a_rs, a_cs, b_batch, b_rs, b_cs, c_batch, ldc, alpha, beta); \
    }

GEMM(gemm_batched_f32, float, float, float)
GEMM(gemm_batched_bf16_bf16_f32, unsigned short, unsigned short, float)
GEMM(gemm_batched_f32_bf16_bf16, float, unsigned short, unsigned short)
