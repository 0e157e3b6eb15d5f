// norm.cu: GroupNorm and Wan's channel RMS norm, f32 and bf16 storage, with and without the fused
// SiLU, against f64 references. GroupNorm runs one block per (sample, group) with the backend's
// 256 threads and with 64 and 1024 (its block reductions take any multiple of 32); the groups
// are shorter than a warp, longer than the block, offset from zero, and constant. The RMS norm
// runs under every grid-stride launch shape, with and without a bias, over one channel and many,
// and over a pixel whose channels are all zero (divided by eps, not by zero).
#include "norm.cu"

#include "harness.h"

namespace {

using namespace emu_test;
using u16 = std::uint16_t;

double maybe_silu(double y, bool fuse) { return fuse ? silu_ref(y) : y; }

struct GroupCase {
    const char* name;
    u64 batch, channels, spatial, groups;
    float offset;
    bool constant, silu;
};

const GroupCase kGroupCases[] = {
    {"2x12x63, 4 groups", 2, 12, 63, 4, 0.0f, false, false},
    {"2x12x63, 4 groups, SiLU", 2, 12, 63, 4, 0.0f, false, true},
    {"1x6x1000, 3 groups, offset 3, SiLU", 1, 6, 1000, 3, 3.0f, false, true},
    {"1x8x5, 8 groups", 1, 8, 5, 8, 0.0f, false, false},
    {"2x4x7, constant groups", 2, 4, 7, 2, 0.5f, true, false},
};

template <typename T>
void test_group_norm(Check& check, const char* name,
                     void (*kernel)(const T*, T*, const float*, const float*, u64, u64, u64, float, int)) {
    const float eps = 1e-6f;
    for (const GroupCase& c : kGroupCases) {
        const u64 len = c.batch * c.channels * c.spatial;
        auto xf = random_f32(len, 41, c.offset - 1.0f, c.offset + 1.0f);
        if (c.constant) xf.assign(len, c.offset);
        const auto x = to_storage<T>(xf);
        const auto gamma = random_f32(c.channels, 42, 0.5f, 1.5f);
        const auto beta = random_f32(c.channels, 43, -0.5f, 0.5f);
        const auto xv = values(x);
        const u64 per_group = c.channels / c.groups, group_len = per_group * c.spatial;
        std::vector<double> want(len), bound(len);
        for (u64 b = 0; b < c.batch; ++b)
            for (u64 g = 0; g < c.groups; ++g) {
                const std::size_t base = (b * c.channels + g * per_group) * c.spatial;
                double mean = 0.0, var = 0.0;
                for (u64 i = 0; i < group_len; ++i) mean += xv[base + i];
                mean /= (double)group_len;
                for (u64 i = 0; i < group_len; ++i) var += (xv[base + i] - mean) * (xv[base + i] - mean);
                var /= (double)group_len;
                const double rstd = 1.0 / std::sqrt(var + eps);
                for (u64 i = 0; i < group_len; ++i) {
                    const u64 ch = g * per_group + i / c.spatial;
                    const double y = (xv[base + i] - mean) * rstd * gamma[ch] + beta[ch];
                    want[base + i] = maybe_silu(y, c.silu);
                    // f32 statistics and arithmetic on values of order one.
                    bound[base + i] = 1e-5 * (1.0 + std::fabs(y)) + Storage<T>::rounding * std::fabs(want[base + i]);
                }
            }
        for (const unsigned threads : {256u, 64u, 1024u}) {
            std::vector<T> out(len, Storage<T>::from_f32(NAN));
            emu::launch(name, kernel, dim3((unsigned)(c.batch * c.groups)), dim3(threads), x.data(), out.data(),
                        gamma.data(), beta.data(), c.channels, c.spatial, c.groups, eps, c.silu ? 1 : 0);
            check.near(std::string(c.name) + ", " + std::to_string(threads) + " threads", values(out), want, bound);
        }
    }
}

struct RmsCase {
    const char* name;
    u64 batch, channels, inner;
    bool bias, silu, zero_pixel;
};

const RmsCase kRmsCases[] = {
    {"2x12x90", 2, 12, 90, false, false, false},
    {"3x5x67, bias, SiLU", 3, 5, 67, true, true, false},
    {"1x96x130, a zero pixel, bias", 1, 96, 130, true, false, true},
    {"2x1x33", 2, 1, 33, false, false, false},
};

template <typename T>
void test_rms_norm(Check& check, const char* name,
                   void (*kernel)(const T*, T*, const float*, const float*, u64, u64, u64, float, int)) {
    const float eps = 1e-12f;
    for (const RmsCase& c : kRmsCases) {
        const u64 len = c.batch * c.channels * c.inner;
        auto xf = random_f32(len, 51, -2.0f, 2.0f);
        if (c.zero_pixel) {
            for (u64 ch = 0; ch < c.channels; ++ch) xf[ch * c.inner + 17] = 0.0f;
        }
        const auto x = to_storage<T>(xf);
        const auto gamma = random_f32(c.channels, 52, 0.5f, 1.5f);
        const auto bias = random_f32(c.channels, 53, -0.5f, 0.5f);
        const auto xv = values(x);
        std::vector<double> want(len), bound(len);
        for (u64 b = 0; b < c.batch; ++b)
            for (u64 s = 0; s < c.inner; ++s) {
                double sq = 0.0;
                for (u64 ch = 0; ch < c.channels; ++ch) sq += xv[(b * c.channels + ch) * c.inner + s] * xv[(b * c.channels + ch) * c.inner + s];
                const double inv = 1.0 / std::max(std::sqrt(sq), (double)eps);
                for (u64 ch = 0; ch < c.channels; ++ch) {
                    const std::size_t i = (b * c.channels + ch) * c.inner + s;
                    const double scaled = xv[i] * inv * std::sqrt((double)c.channels) * gamma[ch];
                    const double y = scaled + (c.bias ? bias[ch] : 0.0);
                    want[i] = maybe_silu(y, c.silu);
                    bound[i] = 1e-5 * (std::fabs(scaled) + std::fabs(y)) + 1e-30 +
                               Storage<T>::rounding * std::fabs(want[i]);
                }
            }
        const u64 pixels = c.batch * c.inner;
        for (const auto& shape : grid_stride_shapes(pixels)) {
            std::vector<T> out(len, Storage<T>::from_f32(NAN));
            emu::launch(name, kernel, shape.grid, shape.block, x.data(), out.data(), gamma.data(),
                        c.bias ? bias.data() : nullptr, c.batch, c.channels, c.inner, eps, c.silu ? 1 : 0);
            check.near(std::string(c.name) + ", " + shape.name, values(out), want, bound);
        }
    }
}

}  // namespace

KERNEL_TEST(group_norm_f32) { test_group_norm<float>(check, KERNEL(group_norm_f32)); }
KERNEL_TEST(group_norm_bf16) { test_group_norm<u16>(check, KERNEL(group_norm_bf16)); }
KERNEL_TEST(rms_norm_channels_f32) { test_rms_norm<float>(check, KERNEL(rms_norm_channels_f32)); }
KERNEL_TEST(rms_norm_channels_bf16) { test_rms_norm<u16>(check, KERNEL(rms_norm_channels_bf16)); }
