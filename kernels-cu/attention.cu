// The softmax of single-head attention (the mid blocks'): the two products around it run on
// the tensor-core convolution of conv.cu (as 1x1 convolutions) or the batched GEMM of gemm.cu.
#include "common.cuh"

// Row by row: `p[r] = softmax(x[r] * scale)`, from f32 scores into P of type TP (f32 in place, or
// bf16 for the tensor cores' P V product, as flash attention rounds it); one block per row.
template <typename TP>
__device__ __forceinline__ void softmax_rows_impl(float* x, TP* p, u64 rows, u64 cols, float scale) {
    __shared__ float scratch[32];
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        float* row = x + r * cols;
        TP* out = p + r * cols;
        float m = NEG_INF;
        for (u64 j = threadIdx.x; j < cols; j += blockDim.x) m = fmaxf(m, row[j] * scale);
        m = block_max(m, scratch);
        float s = 0.0f;
        for (u64 j = threadIdx.x; j < cols; j += blockDim.x) {
            const float e = __expf(row[j] * scale - m);
            row[j] = e;
            s += e;
        }
        s = block_sum(s, scratch);
        const float inv = 1.0f / s;
        for (u64 j = threadIdx.x; j < cols; j += blockDim.x) store_f32(&out[j], row[j] * inv);
        __syncthreads();
    }
}

// In place.
extern "C" __global__ void softmax_rows_f32(float* x, u64 rows, u64 cols, float scale) {
    softmax_rows_impl<float>(x, x, rows, cols, scale);
}

// Into bf16 probabilities (`x` is left holding the exponentials).
extern "C" __global__ void softmax_rows_to_bf16(float* x, unsigned short* p, u64 rows, u64 cols, float scale) {
    softmax_rows_impl<unsigned short>(x, p, rows, cols, scale);
}
