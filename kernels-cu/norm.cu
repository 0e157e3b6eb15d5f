// Normalisations: GroupNorm (AutoencoderKL / FLUX) and Wan's channel RMS norm, each with an
// optional fused SiLU (every norm of the decoders' resnets is followed by one). Written once over
// the storage type (f32 or bf16 bits). Statistics and the affine map are evaluated in f64 and the
// result is rounded once to f32 (then to the storage type), as the CPU backend evaluates them, so
// the two agree to an f32 ulp however large a mean is against its deviation; the norms are bound
// by memory traffic, where f64 arithmetic costs nothing on sm_80 / sm_90. The affine parameters
// are f32 in both variants.
#include "common.cuh"

// `nn.GroupNorm` on `[N, C, spatial]` in four launches, so that a few large groups (32 groups of
// 16 M elements in an SD decoder at 1024 px) still spread over every SM:
//   1. `group_norm_sums`: each block sums one chunk of one group (f64), grid (chunks, N * groups);
//   2. `group_norm_squares`: each block derives its group's mean from the chunk sums and sums the
//      squared deviations of its chunk (f64): the two-pass variance, exact to f64;
//   3. `group_norm_stats`: one thread per group: mean and 1 / sqrt(var + eps), in f64;
//   4. `group_norm_apply`: every element, grid-stride: (x - mean) * (gamma * rstd) + beta in f64,
//      rounded once (then SiLU when fused).
// Chunks are `chunk_len` consecutive elements of a group (the last one shorter).
template <typename T>
__device__ __forceinline__ void group_norm_sums_impl(const T* x, double* sums, u64 group_len, u64 chunk_len) {
    __shared__ double scratch[32];
    const u64 bg = blockIdx.y, chunk = blockIdx.x;
    const T* xg = x + bg * group_len;
    const u64 start = chunk * chunk_len, end = start + chunk_len < group_len ? start + chunk_len : group_len;
    double acc = 0.0;
    for (u64 i = start + threadIdx.x; i < end; i += blockDim.x) acc += (double)load_f32(&xg[i]);
    acc = block_sum(acc, scratch);
    if (threadIdx.x == 0) sums[bg * gridDim.x + chunk] = acc;
}

// The mean of group `bg` from its `chunks` chunk sums (every thread reads them: a few hundred
// doubles, cached).
__device__ __forceinline__ double group_mean(const double* sums, u64 bg, u64 chunks, u64 group_len) {
    double total = 0.0;
    for (u64 c = 0; c < chunks; ++c) total += sums[bg * chunks + c];
    return total / (double)group_len;
}

template <typename T>
__device__ __forceinline__ void group_norm_squares_impl(
    const T* x, const double* sums, double* squares, u64 group_len, u64 chunk_len) {
    __shared__ double scratch[32];
    const u64 bg = blockIdx.y, chunk = blockIdx.x, chunks = gridDim.x;
    const double mean = group_mean(sums, bg, chunks, group_len);
    const T* xg = x + bg * group_len;
    const u64 start = chunk * chunk_len, end = start + chunk_len < group_len ? start + chunk_len : group_len;
    double acc = 0.0;
    for (u64 i = start + threadIdx.x; i < end; i += blockDim.x) {
        const double d = (double)load_f32(&xg[i]) - mean;
        acc += d * d;
    }
    acc = block_sum(acc, scratch);
    if (threadIdx.x == 0) squares[bg * chunks + chunk] = acc;
}

// `stats[2 * bg]` = mean, `stats[2 * bg + 1]` = 1 / sqrt(var + eps), for `groups_total` groups.
extern "C" __global__ void group_norm_stats(
    const double* sums, const double* squares, double* stats, u64 groups_total, u64 chunks, u64 group_len, float eps) {
    GRID_STRIDE(bg, groups_total) {
        const double mean = group_mean(sums, bg, chunks, group_len);
        double var = 0.0;
        for (u64 c = 0; c < chunks; ++c) var += squares[bg * chunks + c];
        var /= (double)group_len;
        stats[2 * bg] = mean;
        stats[2 * bg + 1] = 1.0 / sqrt(var + (double)eps);
    }
}

template <typename T>
__device__ __forceinline__ void group_norm_apply_impl(
    const T* x, T* out, const float* gamma, const float* beta, const double* stats,
    u64 n, u64 channels, u64 spatial, u64 groups, int fuse_silu) {
    const u64 per_group = channels / groups;
    GRID_STRIDE(i, n) {
        const u64 c = (i / spatial) % channels, b = i / (spatial * channels);
        const u64 bg = b * groups + c / per_group;
        const double mean = stats[2 * bg], rstd = stats[2 * bg + 1];
        const float y = (float)(((double)load_f32(&x[i]) - mean) * ((double)gamma[c] * rstd) + (double)beta[c]);
        store_f32(&out[i], fuse_silu ? silu(y) : y);
    }
}

// Wan's `WanRMS_norm` on `[N, C, inner]`: each pixel's channel vector divided by
// `max(||x||_2, eps)`, times `sqrt(C) * gamma[c]` (+ `bias[c]` when given). One thread per pixel;
// consecutive threads read consecutive pixels of a channel, so loads coalesce.
template <typename T>
__device__ __forceinline__ void rms_norm_channels_impl(
    const T* x, T* out, const float* gamma, const float* bias,
    u64 batch, u64 channels, u64 inner, float eps, int fuse_silu) {
    const double scale = sqrt((double)channels);
    GRID_STRIDE(p, batch * inner) {
        const u64 b = p / inner, s = p % inner;
        const T* xp = x + b * channels * inner + s;
        T* op = out + b * channels * inner + s;
        double sq = 0.0;
        for (u64 c = 0; c < channels; ++c) {
            const double v = load_f32(&xp[c * inner]);
            sq += v * v;
        }
        const double inv = 1.0 / fmax(sqrt(sq), (double)eps);
        for (u64 c = 0; c < channels; ++c) {
            double y = (double)load_f32(&xp[c * inner]) * inv * ((double)gamma[c] * scale);
            if (bias) y += (double)bias[c];
            const float yf = (float)y;
            store_f32(&op[c * inner], fuse_silu ? silu(yf) : yf);
        }
    }
}

#define NORMS(SUFFIX, T)                                                                                  \
    extern "C" __global__ void group_norm_sums_##SUFFIX(const T* x, double* sums, u64 group_len, u64 chunk_len) { \
        group_norm_sums_impl(x, sums, group_len, chunk_len);                                               \
    }                                                                                                     \
    extern "C" __global__ void group_norm_squares_##SUFFIX(                                               \
        const T* x, const double* sums, double* squares, u64 group_len, u64 chunk_len) {                  \
        group_norm_squares_impl(x, sums, squares, group_len, chunk_len);                                  \
    }                                                                                                     \
    extern "C" __global__ void group_norm_apply_##SUFFIX(                                                 \
        const T* x, T* out, const float* gamma, const float* beta, const double* stats,                  \
        u64 n, u64 channels, u64 spatial, u64 groups, int fuse_silu) {                                    \
        group_norm_apply_impl(x, out, gamma, beta, stats, n, channels, spatial, groups, fuse_silu);       \
    }                                                                                                     \
    extern "C" __global__ void rms_norm_channels_##SUFFIX(                                                \
        const T* x, T* out, const float* gamma, const float* bias,                                        \
        u64 batch, u64 channels, u64 inner, float eps, int fuse_silu) {                                   \
        rms_norm_channels_impl(x, out, gamma, bias, batch, channels, inner, eps, fuse_silu);              \
    }

NORMS(f32, float)
NORMS(bf16, unsigned short)
