// Host stand-ins for the tensor-core conv GEMMs of conv.cu under the fake driver (see
// conv_on_host.h): f32 sums of exact bf16 products, or of the three TF32 partial products of each
// f32 product, or of one TF32 product in TF32 mode.
#pragma once

#include "conv_on_host.h"
#include "registry.h"

namespace fake_cuda {

inline float tf32_value(unsigned bits) { return __uint_as_float(bits & ~0x1fffu); }

// One f32 product as the kernel's `mma_slice` forms it: three TF32 products.
struct F32Product {
    static float apply(float w, float x, float acc) {
        unsigned w_hi, w_lo, x_hi, x_lo;
        split_tf32(__float_as_uint(w), w_hi, w_lo);
        split_tf32(__float_as_uint(x), x_hi, x_lo);
        acc += tf32_value(w_hi) * tf32_value(x_lo);
        acc += tf32_value(w_lo) * tf32_value(x_hi);
        return acc + tf32_value(w_hi) * tf32_value(x_hi);
    }
};

// One TF32 product (the `Tf32` kernels): both operands rounded to 10-bit mantissas.
struct Tf32Product {
    static float apply(float w, float x, float acc) { return acc + tf32_value(to_tf32(w)) * tf32_value(to_tf32(x)); }
};

#define FAKE_CUDA_STAND_IN_SHAPE(kernel, T, TO, MT, BN, SHARED, PRODUCT)                                   \
    template <>                                                                                       \
    struct StandIn<&kernel> {                                                                         \
        static constexpr bool present = true;                                                         \
        static void run(dim3 grid, unsigned shared, const T* xp, const T* wr, const float* bias, TO* out, \
                        ConvGeom g) {                                                                 \
            conv3d_tc_on_host<T, TO, MT, PRODUCT>(grid, BN, shared, SHARED, xp, wr, bias, out, g); \
        }                                                                                             \
    };

// Both tile shapes of one kernel family (conv.cu's CONV_TC).
#define FAKE_CUDA_STAND_IN(kernel, T, TO, MT, PRODUCT)                                              \
    FAKE_CUDA_STAND_IN_SHAPE(kernel, T, TO, MT, 128, 0, PRODUCT)                                  \
    FAKE_CUDA_STAND_IN_SHAPE(kernel##_n256, T, TO, MT, 256, TC_WIDE_SMEM(MT), PRODUCT)

FAKE_CUDA_STAND_IN(conv3d_tc_bf16_m4, unsigned short, unsigned short, 4, Bf16Product)
FAKE_CUDA_STAND_IN(conv3d_tc_bf16_m3, unsigned short, unsigned short, 3, Bf16Product)
FAKE_CUDA_STAND_IN(conv3d_tc_bf16_m2, unsigned short, unsigned short, 2, Bf16Product)
FAKE_CUDA_STAND_IN_SHAPE(conv3d_tc_bf16_f32out_m4, unsigned short, float, 4, 128, 0, Bf16Product)
FAKE_CUDA_STAND_IN(conv3d_tc_f32_m3, float, float, 3, F32Product)
FAKE_CUDA_STAND_IN(conv3d_tc_f32_m2, float, float, 2, F32Product)
FAKE_CUDA_STAND_IN(conv3d_tc_tf32_m4, float, float, 4, Tf32Product)
FAKE_CUDA_STAND_IN(conv3d_tc_tf32_m3, float, float, 3, Tf32Product)
FAKE_CUDA_STAND_IN(conv3d_tc_tf32_m2, float, float, 2, Tf32Product)

#undef FAKE_CUDA_STAND_IN
#undef FAKE_CUDA_STAND_IN_SHAPE

}  // namespace fake_cuda
