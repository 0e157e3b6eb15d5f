// Elementwise kernels: residual adds, SiLU, clamp, affine maps, per-channel affine (pipeline
// latent normalisation), and f32 <-> bf16 casts. Each is written once over the storage type and
// instantiated for f32 and bf16; bf16 computes in f32 and rounds once.
//
// They are bound by memory traffic alone, so each moves 16 bytes per load and store (4 f32 or
// 8 bf16: the widest access, fewest instructions per byte) through `map_unary` / `map_binary`,
// with no index arithmetic beyond a 64-bit grid-stride counter. The backend launches a few waves
// of blocks per SM over the packs (`streaming()` in cuda/backend/device.rs); any launch is correct. Whole
// tensors are 16-byte aligned (allocations are 256-byte aligned); pointers that are not take the
// element-by-element loop, which also covers the tail shorter than a pack. Every element gets the
// same f32 operation either way, so the results are bit-identical to the scalar kernels'.
#include "common.cuh"

// `out[i] = f(x[i])` for `n` elements of `A` into `O`, `N` elements per access.
template <int N, typename A, typename O, typename F>
__device__ __forceinline__ void map_unary(const A* x, O* out, u64 n, F f) {
    constexpr int BA = N * (int)sizeof(A), BO = N * (int)sizeof(O);
    u64 done = 0;
    if (aligned(x, BA) && aligned(out, BO)) {
        const u64 packs = n / N;
        GRID_STRIDE(p, packs) {
            const Pack<BA> a = pack_load<BA>(x + p * N);
            Pack<BO> o = {};
#pragma unroll
            for (int k = 0; k < N; ++k) pack_set(o.w, k, f(pack_get(a.w, k, x)), out);
            pack_store<BO>(out + p * N, o);
        }
        done = packs * N;
    }
    GRID_STRIDE_FROM(i, done, n) store_f32(&out[i], f(load_f32(&x[i])));
}

// `out[i] = f(a[i], b[i])`, as `map_unary`.
template <int N, typename T, typename F>
__device__ __forceinline__ void map_binary(const T* a, const T* b, T* out, u64 n, F f) {
    constexpr int B = N * (int)sizeof(T);
    u64 done = 0;
    if (aligned(a, B) && aligned(b, B) && aligned(out, B)) {
        const u64 packs = n / N;
        GRID_STRIDE(p, packs) {
            const Pack<B> x = pack_load<B>(a + p * N), y = pack_load<B>(b + p * N);
            Pack<B> o = {};
#pragma unroll
            for (int k = 0; k < N; ++k) pack_set(o.w, k, f(pack_get(x.w, k, a), pack_get(y.w, k, b)), out);
            pack_store<B>(out + p * N, o);
        }
        done = packs * N;
    }
    GRID_STRIDE_FROM(i, done, n) store_f32(&out[i], f(load_f32(&a[i]), load_f32(&b[i])));
}

template <typename T>
__device__ __forceinline__ void add_impl(const T* a, const T* b, T* out, u64 n) {
    map_binary<Wide<T>::N>(a, b, out, n, [](float x, float y) { return x + y; });
}

// In place (`silu_*`, `x == out`) or into another tensor (`silu_into_*`, which saves the copy an
// out-of-place SiLU would otherwise make first).
template <typename T>
__device__ __forceinline__ void silu_impl(const T* x, T* out, u64 n) {
    map_unary<Wide<T>::N>(x, out, n, [](float v) { return silu(v); });
}

// PyTorch's clamp, as the CPU op: NaN stays NaN (fmaxf / fminf would return a bound), and
// `lo > hi` gives `hi` everywhere.
template <typename T>
__device__ __forceinline__ void clamp_impl(T* x, u64 n, float lo, float hi) {
    map_unary<Wide<T>::N>(x, x, n, [lo, hi](float v) {
        const float y = v < lo ? lo : v;
        return y > hi ? hi : y;
    });
}

// `x * mul + add`, rounded after each operation (two PyTorch ops, no fused multiply-add).
template <typename T>
__device__ __forceinline__ void affine_impl(const T* x, T* out, u64 n, float mul, float add) {
    map_unary<Wide<T>::N>(x, out, n, [mul, add](float v) { return __fadd_rn(__fmul_rn(v, mul), add); });
}

// Per-channel `x * scale[c] + shift[c]` on `[N, C, inner...]`.
template <typename T>
__device__ __forceinline__ void channel_affine_impl(
    const T* x, T* out, const float* scale, const float* shift, u64 channels, u64 inner, u64 n) {
    GRID_STRIDE(i, n) {
        const u64 c = (i / inner) % channels;
        store_f32(&out[i], __fadd_rn(__fmul_rn(load_f32(&x[i]), scale[c]), shift[c]));
    }
}

#define ELEMENTWISE(SUFFIX, T)                                                                          \
    extern "C" __global__ void add_##SUFFIX(const T* a, const T* b, T* out, u64 n) { add_impl(a, b, out, n); } \
    extern "C" __global__ void silu_##SUFFIX(T* x, u64 n) { silu_impl(x, x, n); }                            \
    extern "C" __global__ void silu_into_##SUFFIX(const T* x, T* out, u64 n) { silu_impl(x, out, n); }       \
    extern "C" __global__ void clamp_##SUFFIX(T* x, u64 n, float lo, float hi) { clamp_impl(x, n, lo, hi); } \
    extern "C" __global__ void affine_##SUFFIX(const T* x, T* out, u64 n, float mul, float add) {            \
        affine_impl(x, out, n, mul, add);                                                                   \
    }                                                                                                       \
    extern "C" __global__ void channel_affine_##SUFFIX(                                                     \
        const T* x, T* out, const float* scale, const float* shift, u64 channels, u64 inner, u64 n) {       \
        channel_affine_impl(x, out, scale, shift, channels, inner, n);                                      \
    }

ELEMENTWISE(f32, float)
ELEMENTWISE(bf16, unsigned short)

// Four elements per access: 16 bytes of f32 against 8 of bf16.
extern "C" __global__ void cast_f32_bf16(const float* x, unsigned short* out, u64 n) {
    map_unary<4>(x, out, n, [](float v) { return v; });
}

extern "C" __global__ void cast_bf16_f32(const unsigned short* x, float* out, u64 n) {
    map_unary<4>(x, out, n, [](float v) { return v; });
}
