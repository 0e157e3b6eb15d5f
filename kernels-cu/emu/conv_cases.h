// The convolution cases of the emulator's conv tests (test_conv.cpp, test_conv_sm90a.cpp): shapes
// with partial tiles in M, N and K, channel counts that are no multiple of 4, 8 or 32, the causal
// front padding, temporal and spatial strides, padding on one side only, a missing bias and
// batches; a plain-loop reference in f64 with PyTorch's padding and strides; and the padded
// channels-last operands by their definition.
#pragma once

#include <cmath>
#include <cstddef>
#include <vector>

#include "harness.h"

namespace conv_cases {

using namespace emu_test;

struct Case {
    const char* name;
    u64 n, cin, t, h, w, cout, kt, kh, kw, stride_t, stride;
    // front, back, top, bottom, left, right, as F.pad would add them.
    i64 pad[6];
    bool bias;

    u64 out_extent(u64 in, i64 before, i64 after, u64 k, u64 s) const {
        return (u64)(((i64)in + before + after - (i64)k) / (i64)s + 1);
    }
    ConvGeom geometry() const {
        return ConvGeom{n,
                        cin,
                        t,
                        h,
                        w,
                        cout,
                        kt,
                        kh,
                        kw,
                        out_extent(t, pad[0], pad[1], kt, stride_t),
                        out_extent(h, pad[2], pad[3], kh, stride),
                        out_extent(w, pad[4], pad[5], kw, stride),
                        stride_t,
                        stride,
                        pad[0],
                        pad[2],
                        pad[4]};
    }
};

const Case kCases[] = {
    // Wan's CausalConv3d 3x3x3: two frames of zeros in front, none behind; 67 output channels.
    {"causal 3x3x3, batch 2", 2, 5, 3, 9, 11, 67, 3, 3, 3, 1, 1, {2, 0, 1, 1, 1, 1}, true},
    // diffusers' Downsample2D: F.pad(0, 1, 0, 1), then a stride-2 3x3 conv.
    {"stride 2, pad bottom/right", 2, 3, 1, 13, 10, 7, 1, 3, 3, 1, 2, {0, 0, 0, 1, 0, 1}, true},
    // Wan's time_conv: 3x1x1, temporal stride 2, causal padding.
    {"temporal stride 2", 1, 4, 7, 3, 5, 65, 3, 1, 1, 2, 1, {2, 0, 0, 0, 0, 0}, true},
    {"1x1, no bias", 3, 130, 1, 5, 7, 5, 1, 1, 1, 1, 1, {0, 0, 0, 0, 0, 0}, false},
    {"2x3x1, uneven padding", 1, 6, 4, 8, 6, 64, 2, 3, 1, 1, 1, {1, 0, 2, 0, 0, 0}, true},
    {"3x3x3, spatial stride 2", 2, 2, 3, 7, 9, 3, 3, 3, 3, 1, 2, {2, 0, 1, 1, 1, 1}, true},
    // Several K slices per tap (40 channels: one full slice of 32, one of 8) and 200 output
    // channels (a partial last tile at every tile height).
    {"40 -> 200 channels, 3x3", 1, 40, 1, 6, 23, 200, 1, 3, 3, 1, 1, {0, 0, 1, 1, 1, 1}, true},
};

// The cases a conv test runs in this pass: every case on fibers; under OS threads, where each
// barrier is a context switch of 256 threads, two small ones (a sixteenth of the blocks x K
// steps of all seven): between them a K loop long enough for the tensor-core pipeline's
// shared-memory stages to wrap around several times (27 taps), a partial last K slice (130
// channels), partial tiles in M and N, batches, a spatial stride and a missing bias. The kernels
// synchronise the same way on every case; the others differ in extent and indexing, which the
// fiber pass checks. (A launch runs its blocks one after another, so more blocks add no
// concurrency.)
inline std::vector<Case> cases_for_pass() {
    static_assert(std::size(kCases) == 7, "choose the OS-thread cases again");
    if (emu::fibers_on()) return {std::begin(kCases), std::end(kCases)};
    return {kCases[3], kCases[5]};
}

// out = bias + conv(x, w) in f64, with the sum of the magnitudes of everything added (the scale
// of the f32 accumulation error).
inline void reference(const Case& c, const ConvGeom& g, const std::vector<double>& x, const std::vector<double>& w,
               const std::vector<float>& bias, std::vector<double>& out,
               std::vector<double>& magnitude) {
    const std::size_t len = g.n * g.cout * g.to * g.ho * g.wo;
    out.assign(len, 0.0);
    magnitude.assign(len, 0.0);
    std::size_t o = 0;
    for (u64 b = 0; b < g.n; ++b)
        for (u64 co = 0; co < g.cout; ++co)
            for (u64 to = 0; to < g.to; ++to)
                for (u64 ho = 0; ho < g.ho; ++ho)
                    for (u64 wo = 0; wo < g.wo; ++wo, ++o) {
                        double sum = 0.0, mag = 0.0;
                        if (c.bias) sum += bias[co], mag += std::fabs(bias[co]);
                        for (u64 ci = 0; ci < g.cin; ++ci)
                            for (u64 dt = 0; dt < g.kt; ++dt)
                                for (u64 dy = 0; dy < g.kh; ++dy)
                                    for (u64 dx = 0; dx < g.kw; ++dx) {
                                        const i64 ti = (i64)(to * g.stride_t + dt) - c.pad[0];
                                        const i64 yi = (i64)(ho * g.stride + dy) - c.pad[2];
                                        const i64 xi = (i64)(wo * g.stride + dx) - c.pad[4];
                                        if (ti < 0 || yi < 0 || xi < 0 || ti >= (i64)g.t || yi >= (i64)g.h ||
                                            xi >= (i64)g.w) {
                                            continue;
                                        }
                                        const double p =
                                            w[(((co * g.cin + ci) * g.kt + dt) * g.kh + dy) * g.kw + dx] *
                                            x[(((b * g.cin + ci) * g.t + (u64)ti) * g.h + (u64)yi) * g.w + (u64)xi];
                                        sum += p;
                                        mag += std::fabs(p);
                                    }
                        out[o] = sum;
                        magnitude[o] = mag;
                    }
}

// The padded channels-last geometry, as the host computes it (`Padded` in conv.cu): channels
// rounded up to a 16-byte chunk of T.
template <typename T>
struct PaddedHost {
    u64 tp, hp, wp, cp;
    explicit PaddedHost(const ConvGeom& g)
        : tp((g.to - 1) * g.stride_t + g.kt),
          hp((g.ho - 1) * g.stride + g.kh),
          wp((g.wo - 1) * g.stride + g.kw),
          cp((g.cin + 16 / sizeof(T) - 1) / (16 / sizeof(T)) * (16 / sizeof(T))) {}
    u64 len(const ConvGeom& g) const { return g.n * tp * hp * wp * cp; }
};


// xp[N, Tp, Hp, Wp, Cp] by its definition: the input element the padding shifts in, or zero.
template <typename T>
std::vector<T> input_channels_last_definition(const ConvGeom& g, const std::vector<T>& x) {
    const PaddedHost<T> p(g);
    std::vector<T> xp(p.len(g));
    std::size_t o = 0;
    for (u64 b = 0; b < g.n; ++b)
        for (u64 tp = 0; tp < p.tp; ++tp)
            for (u64 yp = 0; yp < p.hp; ++yp)
                for (u64 xq = 0; xq < p.wp; ++xq)
                    for (u64 ch = 0; ch < p.cp; ++ch, ++o) {
                        const i64 t = (i64)tp - g.pad_front, y = (i64)yp - g.pad_top, xi = (i64)xq - g.pad_left;
                        const bool inside = ch < g.cin && t >= 0 && y >= 0 && xi >= 0 && t < (i64)g.t &&
                                            y < (i64)g.h && xi < (i64)g.w;
                        xp[o] = inside ? x[(((b * g.cin + ch) * g.t + (u64)t) * g.h + (u64)y) * g.w + (u64)xi] : T(0);
                    }
    return xp;
}

// wr[Cout, kt, kh, kw, Cp] by its definition: zero for channels >= Cin.
template <typename T>
std::vector<T> weight_channels_last_definition(const ConvGeom& g, const std::vector<T>& w) {
    const PaddedHost<T> p(g);
    const u64 taps = g.kt * g.kh * g.kw;
    std::vector<T> wr(g.cout * taps * p.cp);
    for (u64 co = 0; co < g.cout; ++co)
        for (u64 tap = 0; tap < taps; ++tap)
            for (u64 ch = 0; ch < p.cp; ++ch)
                wr[(co * taps + tap) * p.cp + ch] = ch < g.cin ? w[(co * g.cin + ch) * taps + tap] : T(0);
    return wr;
}

}  // namespace conv_cases
