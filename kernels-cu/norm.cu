// Normalisations: GroupNorm (AutoencoderKL / FLUX) and Wan's channel RMS norm, each with an
// optional fused SiLU (every norm of the decoders' resnets is followed by one).
#include "common.cuh"

// `nn.GroupNorm` on `[N, C, spatial]`: one block per (batch, group); two passes over the group
// (mean, then the biased variance of the deviations) accumulated in f64 per thread and reduced in
// f32 partial sums of those, so a 16 M-element group keeps its precision.
extern "C" __global__ void group_norm_f32(
    const float* x, float* out, const float* gamma, const float* beta,
    u64 channels, u64 spatial, u64 groups, float eps, int fuse_silu) {
    __shared__ float scratch[32];
    const u64 per_group = channels / groups;
    const u64 len = per_group * spatial;
    const u64 b = blockIdx.x / groups, g = blockIdx.x % groups;
    const float* xg = x + (b * channels + g * per_group) * spatial;
    float* og = out + (b * channels + g * per_group) * spatial;

    double acc = 0.0;
    for (u64 i = threadIdx.x; i < len; i += blockDim.x) acc += (double)xg[i];
    const float mean = block_sum((float)acc, scratch) / (float)len;
    acc = 0.0;
    for (u64 i = threadIdx.x; i < len; i += blockDim.x) {
        const double d = (double)xg[i] - (double)mean;
        acc += d * d;
    }
    const float var = block_sum((float)acc, scratch) / (float)len;
    const float rstd = rsqrtf(var + eps);
    for (u64 i = threadIdx.x; i < len; i += blockDim.x) {
        const u64 c = g * per_group + i / spatial;
        float y = (xg[i] - mean) * (gamma[c] * rstd) + beta[c];
        og[i] = fuse_silu ? silu(y) : y;
    }
}

// Wan's `WanRMS_norm` on `[N, C, inner]`: each pixel's channel vector divided by
// `max(||x||_2, eps)`, times `sqrt(C) * gamma[c]` (+ `bias[c]` when given). One thread per pixel;
// consecutive threads read consecutive pixels of a channel, so loads coalesce.
extern "C" __global__ void rms_norm_channels_f32(
    const float* x, float* out, const float* gamma, const float* bias,
    u64 batch, u64 channels, u64 inner, float eps, int fuse_silu) {
    const float scale = sqrtf((float)channels);
    GRID_STRIDE(p, batch * inner) {
        const u64 b = p / inner, s = p % inner;
        const float* xp = x + b * channels * inner + s;
        float* op = out + b * channels * inner + s;
        float sq = 0.0f;
        for (u64 c = 0; c < channels; ++c) {
            const float v = xp[c * inner];
            sq = fmaf(v, v, sq);
        }
        const float inv = 1.0f / fmaxf(sqrtf(sq), eps);
        for (u64 c = 0; c < channels; ++c) {
            float y = xp[c * inner] * inv * scale * gamma[c];
            if (bias) y += bias[c];
            op[c * inner] = fuse_silu ? silu(y) : y;
        }
    }
}

extern "C" __global__ void rms_norm_channels_bf16(
    const unsigned short* x, unsigned short* out, const float* gamma, const float* bias,
    u64 batch, u64 channels, u64 inner, float eps, int fuse_silu) {
    const float scale = sqrtf((float)channels);
    GRID_STRIDE(p, batch * inner) {
        const u64 b = p / inner, s = p % inner;
        const unsigned short* xp = x + b * channels * inner + s;
        unsigned short* op = out + b * channels * inner + s;
        float sq = 0.0f;
        for (u64 c = 0; c < channels; ++c) {
            const float v = bf16_to_f32(xp[c * inner]);
            sq = fmaf(v, v, sq);
        }
        const float inv = 1.0f / fmaxf(sqrtf(sq), eps);
        for (u64 c = 0; c < channels; ++c) {
            float y = bf16_to_f32(xp[c * inner]) * inv * scale * gamma[c];
            if (bias) y += bias[c];
            op[c * inner] = f32_to_bf16(fuse_silu ? silu(y) : y);
        }
    }
}
