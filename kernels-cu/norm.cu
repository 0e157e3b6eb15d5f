// Normalisations: GroupNorm (AutoencoderKL / FLUX) and Wan's channel RMS norm, each with an
// optional fused SiLU (every norm of the decoders' resnets is followed by one). Written once over
// the storage type (f32 or bf16 bits). Statistics and the affine map are evaluated in f64 and the
// result is rounded once to f32 (then to the storage type), as the CPU backend evaluates them, so
// the two agree to an f32 ulp however large a mean is against its deviation; the norms are bound
// by memory traffic, where f64 arithmetic costs nothing on sm_80 / sm_90. The affine parameters
// are f32 in both variants.
#include "common.cuh"

// `nn.GroupNorm` on `[N, C, spatial]` in three launches, so that a few large groups (32 groups
// of 16 M elements in an SD decoder at 1024 px) still spread over every SM, reading the input
// twice (the least without holding a whole group on chip):
//   1. `group_norm_partials`: each block takes one chunk of `chunk_len` consecutive elements of a
//      group (the last one shorter; grid (chunks, N * groups), the backend's chunks at most
//      256 * GN_PER_THREAD long) into registers as f64 and writes its sum and the sum of squared deviations from its
//      own mean (a two-pass variance over data already on chip: one read of the input);
//   2. `group_norm_stats`: one block per group combines its chunks (Chan et al.: the group's
//      M2 is the chunks' M2 plus n_i (mean_i - mean)^2), all in f64: mean and 1 / sqrt(var + eps);
//   3. `group_norm_apply`: grid (x: pieces of a row, y: rows of `spatial` elements, one per
//      (sample, channel)): the row's mean, gamma * rstd and beta are loaded once, and each element
//      is (x - mean) * (gamma * rstd) + beta in f64, rounded once (then SiLU when fused), 16 bytes
//      per access where the row allows, without any per-element index division.
// The statistics equal the exact two-pass f64 ones to f64 rounding (about 1e-16 relative), far
// inside the f32 ulp the results are rounded to.
#define GN_PER_THREAD 16

template <typename T>
__device__ __forceinline__ void group_norm_partials_impl(const T* x, double* partials, u64 group_len, u64 chunk_len) {
    __shared__ double scratch[32];
    const u64 bg = blockIdx.y, chunk = blockIdx.x;
    const u64 start = chunk * chunk_len, end = start + chunk_len < group_len ? start + chunk_len : group_len;
    const T* xc = x + bg * group_len + start;
    const u64 len = end - start, held = (u64)GN_PER_THREAD * blockDim.x;
    // Element k * blockDim.x + t of the chunk in register k of thread t: consecutive threads read
    // consecutive elements. The backend's chunks fit in the registers (256 threads); elements
    // beyond them (a smaller block) are read again for the deviations.
    double v[GN_PER_THREAD];
    double acc = 0.0;
#pragma unroll
    for (int k = 0; k < GN_PER_THREAD; ++k) {
        const u64 i = (u64)k * blockDim.x + threadIdx.x;
        v[k] = i < len ? (double)load_f32(&xc[i]) : 0.0;
        acc += v[k];
    }
    for (u64 i = held + threadIdx.x; i < len; i += blockDim.x) acc += (double)load_f32(&xc[i]);
    const double sum = block_sum(acc, scratch);
    const double mean = sum / (double)len;
    acc = 0.0;
#pragma unroll
    for (int k = 0; k < GN_PER_THREAD; ++k) {
        const u64 i = (u64)k * blockDim.x + threadIdx.x;
        const double d = v[k] - mean;
        if (i < len) acc += d * d;
    }
    for (u64 i = held + threadIdx.x; i < len; i += blockDim.x) {
        const double d = (double)load_f32(&xc[i]) - mean;
        acc += d * d;
    }
    const double m2 = block_sum(acc, scratch);
    if (threadIdx.x == 0) {
        partials[2 * (bg * gridDim.x + chunk)] = sum;
        partials[2 * (bg * gridDim.x + chunk) + 1] = m2;
    }
}

// `stats[2 * bg]` = mean, `stats[2 * bg + 1]` = 1 / sqrt(var + eps), one block per group (grid-
// stride over `groups_total`), blockDim.x a multiple of 32.
extern "C" __global__ void group_norm_stats(
    const double* partials, double* stats, u64 groups_total, u64 chunks, u64 group_len, u64 chunk_len, float eps) {
    __shared__ double scratch[32];
    for (u64 bg = blockIdx.x; bg < groups_total; bg += gridDim.x) {
        const double* p = partials + 2 * bg * chunks;
        double acc = 0.0;
        for (u64 c = threadIdx.x; c < chunks; c += blockDim.x) acc += p[2 * c];
        const double mean = block_sum(acc, scratch) / (double)group_len;
        acc = 0.0;
        for (u64 c = threadIdx.x; c < chunks; c += blockDim.x) {
            const u64 n = c + 1 < chunks ? chunk_len : group_len - c * chunk_len;
            const double d = p[2 * c] / (double)n - mean;
            acc += p[2 * c + 1] + (double)n * d * d;
        }
        const double var = block_sum(acc, scratch) / (double)group_len;
        if (threadIdx.x == 0) {
            stats[2 * bg] = mean;
            stats[2 * bg + 1] = 1.0 / sqrt(var + (double)eps);
        }
    }
}

template <typename T>
__device__ __forceinline__ void group_norm_apply_impl(
    const T* x, T* out, const float* gamma, const float* beta, const double* stats,
    u64 rows, u64 channels, u64 spatial, u64 groups, int fuse_silu) {
    constexpr int N = 16 / (int)sizeof(T);
    const u64 per_group = channels / groups;
    // Rows of `spatial` elements start 16-byte aligned when the tensors do and `spatial` is a
    // multiple of a pack; then whole packs, else element by element.
    const bool wide = aligned(x, 16) && aligned(out, 16) && spatial % N == 0;
    for (u64 row = blockIdx.y; row < rows; row += gridDim.y) {
        const u64 c = row % channels, bg = (row / channels) * groups + c / per_group;
        const double mean = stats[2 * bg], scale = (double)gamma[c] * stats[2 * bg + 1], shift = (double)beta[c];
        const T* xr = x + row * spatial;
        T* orow = out + row * spatial;
        const u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x, step = (u64)blockDim.x * gridDim.x;
        if (wide) {
            for (u64 p = first; p < spatial / N; p += step) {
                const Pack<16> a = pack_load<16>(xr + p * N);
                Pack<16> o = {};
#pragma unroll
                for (int k = 0; k < N; ++k) {
                    const float y = (float)(((double)pack_get(a.w, k, x) - mean) * scale + shift);
                    pack_set(o.w, k, fuse_silu ? silu(y) : y, out);
                }
                pack_store<16>(orow + p * N, o);
            }
        } else {
            for (u64 i = first; i < spatial; i += step) {
                const float y = (float)(((double)load_f32(&xr[i]) - mean) * scale + shift);
                store_f32(&orow[i], fuse_silu ? silu(y) : y);
            }
        }
    }
}

// Wan's `WanRMS_norm` on `[N, C, inner]`: each pixel's channel vector divided by
// `max(||x||_2, eps)`, times `sqrt(C) * gamma[c]` (+ `bias[c]` when given).
//
// A block is `blockDim.x` pixel lanes by `blockDim.y` channel slices and takes tiles of
// `blockDim.x * PIX` consecutive pixels of one sample, grid-stride: lane x of slice y reads PIX
// consecutive pixels of channels y, y + blockDim.y, ... (a warp reads 32 * PIX consecutive pixels
// of one channel: coalesced), keeps the first RMS_HELD channels in registers, sums their squares
// in f64 per pixel, and the slices' sums meet in shared memory; then the same thread scales the
// values it holds (channels beyond the registers are read again, mostly from L2). So the input is
// read once and written once with all of the device's threads busy. Any launch shape is correct
// (at most the launch bound's threads); both pixel widths give the same bits.
//
// The kernel is bound by the bytes each multiprocessor has in flight. One bf16 pixel per lane is
// 2 bytes per access, 12 held channels 24 bytes per thread: a quarter of the H200's bandwidth
// where f32 reached a half. The bf16 `_x4` kernel takes 4 pixels per lane in one 8-byte access
// (`inner` a multiple of 4) and holds them packed as loaded, 8 channels: 64 bytes per thread.
template <typename T, int PIX>
struct RmsPixels;

template <typename T>
struct RmsPixels<T, 1> {
    float v;
    __device__ __forceinline__ void load(const T* p) { v = load_f32(p); }
    __device__ __forceinline__ float get(int) const { return v; }
    __device__ __forceinline__ void clear() { v = 0.0f; }
    __device__ __forceinline__ void forget() {}
};

template <>
struct RmsPixels<unsigned short, 4> {
    Pack<8> q;  // 4 bf16 as loaded: 2 registers
    __device__ __forceinline__ void load(const unsigned short* p) { q = pack_load<8>(p); }
    __device__ __forceinline__ float get(int k) const { return pack_get(q.w, k, (const unsigned short*)nullptr); }
    __device__ __forceinline__ void clear() { q.w[0] = q.w[1] = 0u; }
    // Hides from the compiler that the values are the ones it widened for the sums: kept as
    // widened, 4 pixels x 8 channels of f64 would need 64 registers (it spilled).
    __device__ __forceinline__ void forget() { asm volatile("" : "+r"(q.w[0]), "+r"(q.w[1])); }
};

template <typename T, int PIX>
__device__ __forceinline__ void store_pixels(T* p, const float (&v)[PIX]) {
    if constexpr (PIX == 1) {
        store_f32(p, v[0]);
    } else {
        Pack<PIX * (int)sizeof(T)> q = {};
#pragma unroll
        for (int k = 0; k < PIX; ++k) pack_set(q.w, k, v[k], p);
        pack_store(p, q);
    }
}

// y = x * inv * (gamma * sqrt(C)) (+ beta) in f64, rounded once, SiLU'd in f32, stored at `op`.
template <typename T, int PIX>
__device__ __forceinline__ void rms_finish(T* op, RmsPixels<T, PIX> w, const double (&inv)[PIX], double g,
                                           const float* beta, int fuse_silu) {
    float y[PIX];
#pragma unroll
    for (int p = 0; p < PIX; ++p) {
        double yd = (double)w.get(p) * inv[p] * g;
        if (beta) yd += (double)*beta;
        const float yf = (float)yd;
        y[p] = fuse_silu ? silu(yf) : yf;
    }
    store_pixels<T, PIX>(op, y);
}

// Channels a thread holds in registers, and the most threads of a block, per pixel width: the
// backend's slices are ceil(C / RMS_HELD) up to RMS_THREADS / 32.
#define RMS_HELD(PIX) ((PIX) == 1 ? 12 : 8)
#define RMS_THREADS(PIX) ((PIX) == 1 ? 768 : 512)

template <typename T, int PIX>
__device__ __forceinline__ void rms_norm_channels_impl(
    const T* x, T* out, const float* gamma, const float* bias,
    u64 batch, u64 channels, u64 inner, float eps, int fuse_silu) {
    constexpr unsigned HELD = RMS_HELD(PIX);
    __shared__ double partial[RMS_THREADS(PIX) * PIX];
    const double scale = sqrt((double)channels);
    const unsigned lanes = blockDim.x, slices = blockDim.y, tx = threadIdx.x, ty = threadIdx.y;
    // This thread's channels: ty, ty + slices, ... (`mine` of them), the first HELD in registers;
    // walked by pointer steps of `step` elements.
    const u64 mine = channels > ty ? (channels - ty + slices - 1) / slices : 0, step = (u64)slices * inner;
    const u64 span = (u64)lanes * PIX;
    const u64 tiles_per_sample = (inner + span - 1) / span, tiles = batch * tiles_per_sample;
    for (u64 tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const u64 b = tile / tiles_per_sample, s = (tile - b * tiles_per_sample) * span + (u64)tx * PIX;
        // With PIX > 1, `inner` is a multiple of PIX: a thread's pixels are all in or all out.
        const unsigned held = s < inner ? (unsigned)(mine < HELD ? mine : HELD) : 0u;
        const u64 rest = s < inner ? mine : 0;
        const u64 at = (b * channels + ty) * inner + s;  // element (b, ty, s)
        RmsPixels<T, PIX> v[HELD];
        double sq[PIX];
#pragma unroll
        for (int p = 0; p < PIX; ++p) sq[p] = 0.0;
        const T* xp = x + at;
#pragma unroll
        for (unsigned k = 0; k < HELD; ++k) {
            v[k].clear();
            if (k < held) v[k].load(xp + k * step);
        }
#pragma unroll
        for (unsigned k = 0; k < HELD; ++k)
#pragma unroll
            for (int p = 0; p < PIX; ++p) sq[p] += (double)v[k].get(p) * (double)v[k].get(p);
        for (u64 k = HELD; k < rest; ++k) {
            RmsPixels<T, PIX> w;
            w.load(xp + k * step);
#pragma unroll
            for (int p = 0; p < PIX; ++p) sq[p] += (double)w.get(p) * (double)w.get(p);
        }
#pragma unroll
        for (int p = 0; p < PIX; ++p) partial[(ty * lanes + tx) * PIX + p] = sq[p];
        __syncthreads();
        double inv[PIX];
#pragma unroll
        for (int p = 0; p < PIX; ++p) {
            double total = 0.0;
            for (unsigned j = 0; j < slices; ++j) total += partial[(j * lanes + tx) * PIX + p];
            inv[p] = 1.0 / fmax(sqrt(total), (double)eps);
        }
        __syncthreads();  // every thread has its totals before the next tile overwrites `partial`
#pragma unroll
        for (unsigned k = 0; k < HELD; ++k) v[k].forget();
        T* op = out + at;
        const float* gp = gamma + ty;
        const float* bp = bias ? bias + ty : nullptr;
#pragma unroll
        for (unsigned k = 0; k < HELD; ++k) {
            if (k < held) rms_finish<T, PIX>(op + k * step, v[k], inv, gp[k * slices] * scale, bp ? bp + k * slices : nullptr, fuse_silu);
        }
        for (u64 k = HELD; k < rest; ++k) {
            RmsPixels<T, PIX> w;
            w.load(xp + k * step);
            rms_finish<T, PIX>(op + k * step, w, inv, gp[k * slices] * scale, bp ? bp + k * slices : nullptr, fuse_silu);
        }
    }
}

#define NORMS(SUFFIX, T)                                                                                  \
    extern "C" __global__ void __launch_bounds__(256) group_norm_partials_##SUFFIX(                       \
        const T* x, double* partials, u64 group_len, u64 chunk_len) {                                     \
        group_norm_partials_impl(x, partials, group_len, chunk_len);                                       \
    }                                                                                                     \
    extern "C" __global__ void group_norm_apply_##SUFFIX(                                                 \
        const T* x, T* out, const float* gamma, const float* beta, const double* stats,                  \
        u64 rows, u64 channels, u64 spatial, u64 groups, int fuse_silu) {                                 \
        group_norm_apply_impl(x, out, gamma, beta, stats, rows, channels, spatial, groups, fuse_silu);    \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(RMS_THREADS(1)) rms_norm_channels_##SUFFIX(             \
        const T* x, T* out, const float* gamma, const float* bias,                                        \
        u64 batch, u64 channels, u64 inner, float eps, int fuse_silu) {                                   \
        rms_norm_channels_impl<T, 1>(x, out, gamma, bias, batch, channels, inner, eps, fuse_silu);        \
    }

NORMS(f32, float)
NORMS(bf16, unsigned short)

// `inner` a multiple of 4. (f32 has no such kernel: one f32 pixel per lane already keeps 48 bytes
// per thread in flight, and four would not fit the registers.)
extern "C" __global__ void __launch_bounds__(RMS_THREADS(4)) rms_norm_channels_x4_bf16(
    const unsigned short* x, unsigned short* out, const float* gamma, const float* bias,
    u64 batch, u64 channels, u64 inner, float eps, int fuse_silu) {
    rms_norm_channels_impl<unsigned short, 4>(x, out, gamma, bias, batch, channels, inner, eps, fuse_silu);
}
