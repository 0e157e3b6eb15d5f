// Host stand-ins for the warpgroup-MMA convolutions of conv_sm90a.cu under the fake driver (see
// conv_on_host.h): tiles of N output channels x 128 pixels, f32 sums of exact bf16 products.
#pragma once

#include "conv_on_host.h"
#include "registry.h"

namespace fake_cuda {

#define FAKE_CUDA_WGMMA_STAND_IN(N)                                                                        \
    template <>                                                                                            \
    struct StandIn<&conv3d_wgmma_bf16_n##N> {                                                              \
        static constexpr bool present = true;                                                              \
        static void run(dim3 grid, unsigned shared, const unsigned short* xp, const unsigned short* wr,     \
                        const float* bias, unsigned short* out, ConvGeom g) {                              \
            conv3d_tc_on_host<unsigned short, unsigned short, (N) / 32, Bf16Product>(grid, 128, shared,     \
                                                                                   WGMMA_SMEM(N), xp, wr,  \
                                                                                   bias, out, g);          \
        }                                                                                                  \
    };

FAKE_CUDA_WGMMA_STAND_IN(96)
FAKE_CUDA_WGMMA_STAND_IN(128)
FAKE_CUDA_WGMMA_STAND_IN(192)
FAKE_CUDA_WGMMA_STAND_IN(256)

#undef FAKE_CUDA_WGMMA_STAND_IN

}  // namespace fake_cuda
