// Normalisations: GroupNorm (AutoencoderKL / FLUX) and Wan's channel RMS norm, each with an
// optional fused SiLU (every norm of the decoders' resnets is followed by one). Written once over
// the storage type (f32 or bf16 bits); statistics and the affine map are computed in f32 (f64 sums
// for GroupNorm) and the result is rounded once, as PyTorch's bf16 norms do. The affine
// parameters are f32 in both variants.
#include "common.cuh"

// `nn.GroupNorm` on `[N, C, spatial]`: one block per (batch, group); two passes over the group
// (mean, then the biased variance of the deviations) accumulated in f64 per thread and reduced in
// f32 partial sums of those, so a 16 M-element group keeps its precision.
template <typename T>
__device__ __forceinline__ void group_norm_impl(
    const T* x, T* out, const float* gamma, const float* beta,
    u64 channels, u64 spatial, u64 groups, float eps, int fuse_silu) {
    __shared__ float scratch[32];
    const u64 per_group = channels / groups;
    const u64 len = per_group * spatial;
    const u64 b = blockIdx.x / groups, g = blockIdx.x % groups;
    const T* xg = x + (b * channels + g * per_group) * spatial;
    T* og = out + (b * channels + g * per_group) * spatial;

    double acc = 0.0;
    for (u64 i = threadIdx.x; i < len; i += blockDim.x) acc += (double)load_f32(&xg[i]);
    const float mean = block_sum((float)acc, scratch) / (float)len;
    acc = 0.0;
    for (u64 i = threadIdx.x; i < len; i += blockDim.x) {
        const double d = (double)load_f32(&xg[i]) - (double)mean;
        acc += d * d;
    }
    const float var = block_sum((float)acc, scratch) / (float)len;
    const float rstd = rsqrtf(var + eps);
    for (u64 i = threadIdx.x; i < len; i += blockDim.x) {
        const u64 c = g * per_group + i / spatial;
        float y = (load_f32(&xg[i]) - mean) * (gamma[c] * rstd) + beta[c];
        store_f32(&og[i], fuse_silu ? silu(y) : y);
    }
}

// Wan's `WanRMS_norm` on `[N, C, inner]`: each pixel's channel vector divided by
// `max(||x||_2, eps)`, times `sqrt(C) * gamma[c]` (+ `bias[c]` when given). One thread per pixel;
// consecutive threads read consecutive pixels of a channel, so loads coalesce.
template <typename T>
__device__ __forceinline__ void rms_norm_channels_impl(
    const T* x, T* out, const float* gamma, const float* bias,
    u64 batch, u64 channels, u64 inner, float eps, int fuse_silu) {
    const float scale = sqrtf((float)channels);
    GRID_STRIDE(p, batch * inner) {
        const u64 b = p / inner, s = p % inner;
        const T* xp = x + b * channels * inner + s;
        T* op = out + b * channels * inner + s;
        float sq = 0.0f;
        for (u64 c = 0; c < channels; ++c) {
            const float v = load_f32(&xp[c * inner]);
            sq = fmaf(v, v, sq);
        }
        const float inv = 1.0f / fmaxf(sqrtf(sq), eps);
        for (u64 c = 0; c < channels; ++c) {
            float y = load_f32(&xp[c * inner]) * inv * scale * gamma[c];
            if (bias) y += bias[c];
            store_f32(&op[c * inner], fuse_silu ? silu(y) : y);
        }
    }
}

#define NORMS(SUFFIX, T)                                                                                  \
    extern "C" __global__ void group_norm_##SUFFIX(                                                       \
        const T* x, T* out, const float* gamma, const float* beta,                                        \
        u64 channels, u64 spatial, u64 groups, float eps, int fuse_silu) {                                \
        group_norm_impl(x, out, gamma, beta, channels, spatial, groups, eps, fuse_silu);                  \
    }                                                                                                     \
    extern "C" __global__ void rms_norm_channels_##SUFFIX(                                                \
        const T* x, T* out, const float* gamma, const float* bias,                                        \
        u64 batch, u64 channels, u64 inner, float eps, int fuse_silu) {                                   \
        rms_norm_channels_impl(x, out, gamma, bias, batch, channels, inner, eps, fuse_silu);              \
    }

NORMS(f32, float)
NORMS(bf16, unsigned short)
