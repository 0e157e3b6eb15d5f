// Elementwise kernels: residual adds, SiLU, clamp, affine maps, per-channel affine (pipeline
// latent normalisation), and f32 <-> bf16 casts. f32 and bf16 variants; bf16 computes in f32
// and rounds once.
#include "common.cuh"

extern "C" __global__ void add_f32(const float* a, const float* b, float* out, u64 n) {
    GRID_STRIDE(i, n) out[i] = a[i] + b[i];
}

extern "C" __global__ void add_bf16(const unsigned short* a, const unsigned short* b, unsigned short* out, u64 n) {
    GRID_STRIDE(i, n) out[i] = f32_to_bf16(bf16_to_f32(a[i]) + bf16_to_f32(b[i]));
}

extern "C" __global__ void silu_f32(float* x, u64 n) {
    GRID_STRIDE(i, n) x[i] = silu(x[i]);
}

extern "C" __global__ void silu_bf16(unsigned short* x, u64 n) {
    GRID_STRIDE(i, n) x[i] = f32_to_bf16(silu(bf16_to_f32(x[i])));
}

extern "C" __global__ void clamp_f32(float* x, u64 n, float lo, float hi) {
    GRID_STRIDE(i, n) x[i] = fminf(fmaxf(x[i], lo), hi);
}

extern "C" __global__ void clamp_bf16(unsigned short* x, u64 n, float lo, float hi) {
    GRID_STRIDE(i, n) x[i] = f32_to_bf16(fminf(fmaxf(bf16_to_f32(x[i]), lo), hi));
}

// `x * mul + add`, rounded after each operation (two PyTorch ops, no fused multiply-add).
extern "C" __global__ void affine_f32(const float* x, float* out, u64 n, float mul, float add) {
    GRID_STRIDE(i, n) out[i] = __fadd_rn(__fmul_rn(x[i], mul), add);
}

// Per-channel `x * scale[c] + shift[c]` on `[N, C, inner...]`.
extern "C" __global__ void channel_affine_f32(
    const float* x, float* out, const float* scale, const float* shift, u64 channels, u64 inner, u64 n) {
    GRID_STRIDE(i, n) {
        const u64 c = (i / inner) % channels;
        out[i] = __fadd_rn(__fmul_rn(x[i], scale[c]), shift[c]);
    }
}

extern "C" __global__ void cast_f32_bf16(const float* x, unsigned short* out, u64 n) {
    GRID_STRIDE(i, n) out[i] = f32_to_bf16(x[i]);
}

extern "C" __global__ void cast_bf16_f32(const unsigned short* x, float* out, u64 n) {
    GRID_STRIDE(i, n) out[i] = bf16_to_f32(x[i]);
}
