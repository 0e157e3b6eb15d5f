// Host stand-ins for the tensor-core conv GEMMs of conv.cu under the fake driver.
//
// Emulated lane by lane, a `conv3d_tc_*` block stops at a warp-wide exchange for every `ldmatrix`
// and `mma` (about 60 per K slice and warp); the model tests under the fake driver would take
// half an hour. Here each block of the launched grid computes its tile of outputs on the host
// from the same operands (the channels-last copies the real `conv_input_channels_last_*` and
// `conv_weight_channels_last_*` kernels made) with the same arithmetic: f32 sums of exact bf16
// products, or of the three TF32 partial products of each f32 product; the bias added, then one
// rounding to the storage type. A grid that misses a tile leaves its outputs unwritten (NaN in
// the fake's fresh allocations), as the kernel would. `cargo xtask kernels-emu` tests the kernels
// themselves, fragment by fragment, against a plain convolution.
#pragma once

#include "registry.h"

namespace fake_cuda {

inline float tf32_value(unsigned bits) { return __uint_as_float(bits & ~0x1fffu); }

// One product as the kernel's `mma_slice` forms it.
inline float tensor_core_product(unsigned short w, unsigned short x, float acc) {
    return acc + bf16_to_f32(w) * bf16_to_f32(x);
}

inline float tensor_core_product(float w, float x, float acc) {
    unsigned w_hi, w_lo, x_hi, x_lo;
    split_tf32(__float_as_uint(w), w_hi, w_lo);
    split_tf32(__float_as_uint(x), x_hi, x_lo);
    acc += tf32_value(w_hi) * tf32_value(x_lo);
    acc += tf32_value(w_lo) * tf32_value(x_hi);
    return acc + tf32_value(w_hi) * tf32_value(x_hi);
}

// One TF32 product (the `Tf32` kernels): both operands rounded to 10-bit mantissas.
inline float tensor_core_product(float w, float x, float acc, Tf32) {
    return acc + tf32_value(to_tf32(w)) * tf32_value(to_tf32(x));
}

template <typename T>
inline float tensor_core_product(T w, T x, float acc, T) {
    return tensor_core_product(w, x, acc);
}

// The grid of a kernel with tiles of 32 * MT x `bn` pixels that needs `shared_needed` bytes of
// dynamic shared memory (the launch gave `shared`; a GPU would trap on less).
template <typename T, typename TO, int MT, typename Math = T>
void conv3d_tc_on_host(dim3 grid, unsigned bn, unsigned shared, unsigned shared_needed, const T* xp, const T* wr,
                       const float* bias, TO* out, ConvGeom g) {
    if (shared < shared_needed) {
        ::emu::fail("the kernel needs %u bytes of dynamic shared memory; the launch gave %u", shared_needed, shared);
    }
    const unsigned bm = 32 * MT;
    const Padded p = padded_of<T>(g);
    const u64 n_cols = g.n * g.to * g.ho * g.wo, plane = g.to * g.ho * g.wo;
    const u64 taps = g.kt * g.kh * g.kw, ktot = taps * p.cp;
    for (unsigned by = 0; by < grid.y; ++by)
        for (unsigned bx = 0; bx < grid.x; ++bx)
            for (unsigned c = 0; c < bn; ++c) {
                const u64 col = (u64)bx * bn + c;
                if (col >= n_cols) continue;
                const u64 wo = col % g.wo, ho = (col / g.wo) % g.ho, to = (col / (g.wo * g.ho)) % g.to;
                const u64 b = col / plane;
                const T* origin =
                    xp + (((b * p.tp + to * g.stride_t) * p.hp + ho * g.stride) * p.wp + wo * g.stride) * p.cp;
                for (unsigned row = 0; row < bm; ++row) {
                    const u64 co = (u64)by * bm + row;
                    if (co >= g.cout) continue;
                    float acc = 0.0f;
                    for (u64 dt = 0; dt < g.kt; ++dt)
                        for (u64 dy = 0; dy < g.kh; ++dy)
                            for (u64 dx = 0; dx < g.kw; ++dx) {
                                const u64 tap = (dt * g.kh + dy) * g.kw + dx;
                                const T* w = wr + co * ktot + tap * p.cp;
                                const T* x = origin + ((dt * p.hp + dy) * p.wp + dx) * p.cp;
                                for (unsigned ci = 0; ci < p.cp; ++ci) acc = tensor_core_product(w[ci], x[ci], acc, Math{});
                            }
                    store_f32(&out[(b * g.cout + co) * plane + col % plane], acc + (bias ? bias[co] : 0.0f));
                }
            }
}

#define FAKE_CUDA_STAND_IN_SHAPE(kernel, T, TO, MT, BN, SHARED, ...)                                   \
    template <>                                                                                       \
    struct StandIn<&kernel> {                                                                         \
        static constexpr bool present = true;                                                         \
        static void run(dim3 grid, unsigned shared, const T* xp, const T* wr, const float* bias, TO* out, \
                        ConvGeom g) {                                                                 \
            conv3d_tc_on_host<T, TO, MT __VA_OPT__(, ) __VA_ARGS__>(grid, BN, shared, SHARED, xp, wr, bias, out, g); \
        }                                                                                             \
    };

// Both tile shapes of one kernel family (conv.cu's CONV_TC).
#define FAKE_CUDA_STAND_IN(kernel, T, TO, MT, ...)                                                      \
    FAKE_CUDA_STAND_IN_SHAPE(kernel, T, TO, MT, 128, 0 __VA_OPT__(, ) __VA_ARGS__)                    \
    FAKE_CUDA_STAND_IN_SHAPE(kernel##_n256, T, TO, MT, 256, TC_WIDE_SMEM(MT) __VA_OPT__(, ) __VA_ARGS__)

FAKE_CUDA_STAND_IN(conv3d_tc_bf16_m4, unsigned short, unsigned short, 4)
FAKE_CUDA_STAND_IN(conv3d_tc_bf16_m3, unsigned short, unsigned short, 3)
FAKE_CUDA_STAND_IN(conv3d_tc_bf16_m2, unsigned short, unsigned short, 2)
FAKE_CUDA_STAND_IN_SHAPE(conv3d_tc_bf16_f32out_m4, unsigned short, float, 4, 128, 0)
FAKE_CUDA_STAND_IN(conv3d_tc_f32_m3, float, float, 3)
FAKE_CUDA_STAND_IN(conv3d_tc_f32_m2, float, float, 2)
FAKE_CUDA_STAND_IN(conv3d_tc_tf32_m4, float, float, 4, Tf32)
FAKE_CUDA_STAND_IN(conv3d_tc_tf32_m3, float, float, 3, Tf32)
FAKE_CUDA_STAND_IN(conv3d_tc_tf32_m2, float, float, 2, Tf32)

#undef FAKE_CUDA_STAND_IN
#undef FAKE_CUDA_STAND_IN_SHAPE

}  // namespace fake_cuda
