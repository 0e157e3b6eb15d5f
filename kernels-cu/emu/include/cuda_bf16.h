// Emulator stand-in for CUDA's <cuda_bf16.h>: the parts of `__nv_bfloat16` the kernels use, with
// the device's conversions (round to nearest even; a NaN becomes the canonical quiet NaN 0x7fff,
// as `cvt.rn.bf16.f32` gives).
#pragma once

#include <cstring>

struct __nv_bfloat16 {
    unsigned short __x;

    __nv_bfloat16() = default;
    __nv_bfloat16(float f) {  // NOLINT: implicit, as CUDA's
        unsigned u;
        std::memcpy(&u, &f, sizeof u);
        if ((u & 0x7fffffffu) > 0x7f800000u) {
            __x = 0x7fff;
        } else {
            __x = (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
        }
    }
    operator float() const {  // NOLINT: implicit, as CUDA's
        const unsigned u = (unsigned)__x << 16;
        float f;
        std::memcpy(&f, &u, sizeof f);
        return f;
    }
};

inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline float __bfloat162float(__nv_bfloat16 h) { return (float)h; }
