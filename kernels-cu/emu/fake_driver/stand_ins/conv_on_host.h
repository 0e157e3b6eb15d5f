// The host computation behind the fake driver's stand-ins for the tensor-core convolutions
// (stand_ins/conv.h for conv.cu, stand_ins/conv_sm90a.h for conv_sm90a.cu).
//
// Emulated lane by lane, a tensor-core conv block stops at a warp-wide exchange for every
// `ldmatrix` and `mma` (about 60 per K slice and warp); the model tests under the fake driver
// would take half an hour. Here each block of the launched grid computes its tile of outputs on
// the host from the same operands (the channels-last copies the real `conv_input_channels_last_*`
// and `conv_weight_channels_last_*` kernels made) with the same arithmetic; the bias added, then
// one rounding to the storage type. A grid that misses a tile leaves its outputs unwritten (NaN
// in the fake's fresh allocations), as the kernel would. `cargo xtask kernels-emu` tests the
// kernels themselves, fragment by fragment, against a plain convolution.
#pragma once

#include "registry.h"

namespace fake_cuda {

// A bf16 product on the tensor cores: exact in f32, added in f32.
struct Bf16Product {
    static float apply(unsigned short w, unsigned short x, float acc) { return acc + bf16_to_f32(w) * bf16_to_f32(x); }
};

// The grid of a kernel with tiles of 32 * MT output channels x `bn` pixels that needs
// `shared_needed` bytes of dynamic shared memory (the launch gave `shared`; a GPU would trap on
// less), each output the f32 sum over K in the kernels' order of `Product::apply(w, x, acc)`.
template <typename T, typename TO, int MT, typename Product>
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
                                for (unsigned ci = 0; ci < p.cp; ++ci) acc = Product::apply(w[ci], x[ci], acc);
                            }
                    store_f32(&out[(b * g.cout + co) * plane + col % plane], acc + (bias ? bias[co] : 0.0f));
                }
            }
}

}  // namespace fake_cuda
