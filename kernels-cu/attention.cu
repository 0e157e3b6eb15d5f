// The softmax of single-head attention (the mid blocks'): the two GEMMs around it run as the
// batched GEMM of gemm.cu.
#include "common.cuh"

// In place, row by row: `x[r] = softmax(x[r] * scale)`; one block per row.
extern "C" __global__ void softmax_rows_f32(float* x, u64 rows, u64 cols, float scale) {
    __shared__ float scratch[32];
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        float* row = x + r * cols;
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
        for (u64 j = threadIdx.x; j < cols; j += blockDim.x) row[j] *= inv;
        __syncthreads();
    }
}
