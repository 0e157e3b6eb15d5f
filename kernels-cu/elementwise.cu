// Elementwise kernels: residual adds, SiLU, clamp, affine maps, per-channel affine (pipeline
// latent normalisation), and f32 <-> bf16 casts. Each is written once over the storage type and
// instantiated for f32 and bf16; bf16 computes in f32 and rounds once.
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void add_impl(const T* a, const T* b, T* out, u64 n) {
    GRID_STRIDE(i, n) store_f32(&out[i], load_f32(&a[i]) + load_f32(&b[i]));
}

template <typename T>
__device__ __forceinline__ void silu_impl(T* x, u64 n) {
    GRID_STRIDE(i, n) store_f32(&x[i], silu(load_f32(&x[i])));
}

// PyTorch's clamp, as the CPU op: NaN stays NaN (fmaxf / fminf would return a bound), and
// `lo > hi` gives `hi` everywhere.
template <typename T>
__device__ __forceinline__ void clamp_impl(T* x, u64 n, float lo, float hi) {
    GRID_STRIDE(i, n) {
        const float v = load_f32(&x[i]);
        const float y = v < lo ? lo : v;
        store_f32(&x[i], y > hi ? hi : y);
    }
}

// `x * mul + add`, rounded after each operation (two PyTorch ops, no fused multiply-add).
template <typename T>
__device__ __forceinline__ void affine_impl(const T* x, T* out, u64 n, float mul, float add) {
    GRID_STRIDE(i, n) store_f32(&out[i], __fadd_rn(__fmul_rn(load_f32(&x[i]), mul), add));
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
    extern "C" __global__ void silu_##SUFFIX(T* x, u64 n) { silu_impl(x, n); }                               \
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

extern "C" __global__ void cast_f32_bf16(const float* x, unsigned short* out, u64 n) {
    GRID_STRIDE(i, n) out[i] = f32_to_bf16(x[i]);
}

extern "C" __global__ void cast_bf16_f32(const unsigned short* x, float* out, u64 n) {
    GRID_STRIDE(i, n) out[i] = bf16_to_f32(x[i]);
}
