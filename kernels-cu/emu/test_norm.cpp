// norm.cu: GroupNorm and Wan's channel RMS norm, f32 and bf16 storage, with and without the fused
// SiLU, against f64 references. GroupNorm's chunk sums and squared deviations run one block per
// (chunk, sample and group) with the backend's 256 threads and with 64 and 1024 (the f64 block
// reductions take any multiple of 32), over one chunk per group and several with a short last
// one; the groups are shorter than a warp, longer than the block, offset from zero, and
// constant; the statistics are checked on a hand example and the four launches together against
// the f64 GroupNorm. The RMS norm
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
    u64 chunk_len;  // as the backend picks it: the whole group, or shorter with a short last chunk
    float offset;
    bool constant, silu;
};

const GroupCase kGroupCases[] = {
    {"2x12x63, 4 groups, one chunk", 2, 12, 63, 4, 189, 0.0f, false, false},
    {"2x12x63, 4 groups, chunks of 50, SiLU", 2, 12, 63, 4, 50, 0.0f, false, true},
    {"1x6x1000, 3 groups, chunks of 333, offset 3, SiLU", 1, 6, 1000, 3, 333, 3.0f, false, true},
    {"1x8x5, 8 groups, chunks of 2", 1, 8, 5, 8, 2, 0.0f, false, false},
    {"2x4x7, constant groups", 2, 4, 7, 2, 5, 0.5f, true, false},
};

// One case's input and its f64 statistics per (sample, group) and chunk.
template <typename T>
struct GroupData {
    std::vector<T> x;
    std::vector<float> gamma, beta;
    std::vector<double> xv, sums, squares, means, vars;
    u64 group_len, groups_total, chunks;

    explicit GroupData(const GroupCase& c) {
        const u64 len = c.batch * c.channels * c.spatial;
        auto xf = random_f32(len, 41, c.offset - 1.0f, c.offset + 1.0f);
        if (c.constant) xf.assign(len, c.offset);
        x = to_storage<T>(xf);
        gamma = random_f32(c.channels, 42, 0.5f, 1.5f);
        beta = random_f32(c.channels, 43, -0.5f, 0.5f);
        xv = values(x);
        group_len = c.channels / c.groups * c.spatial;
        groups_total = c.batch * c.groups;
        chunks = (group_len + c.chunk_len - 1) / c.chunk_len;
        sums.assign(groups_total * chunks, 0.0);
        squares.assign(groups_total * chunks, 0.0);
        means.assign(groups_total, 0.0);
        vars.assign(groups_total, 0.0);
        for (u64 bg = 0; bg < groups_total; ++bg) {
            for (u64 i = 0; i < group_len; ++i) sums[bg * chunks + i / c.chunk_len] += xv[bg * group_len + i];
            for (u64 k = 0; k < chunks; ++k) means[bg] += sums[bg * chunks + k];
            means[bg] /= (double)group_len;
            for (u64 i = 0; i < group_len; ++i) {
                const double d = xv[bg * group_len + i] - means[bg];
                squares[bg * chunks + i / c.chunk_len] += d * d;
            }
            for (u64 k = 0; k < chunks; ++k) vars[bg] += squares[bg * chunks + k];
            vars[bg] /= (double)group_len;
        }
    }

    dim3 per_chunk() const { return dim3((unsigned)chunks, (unsigned)groups_total); }
};

// Bounds of f64 sums of n terms of magnitude up to `scale`, summed in another order.
double sum_bound(double scale, u64 n) { return 1e-13 * scale * (double)n; }

template <typename T>
void test_group_sums(Check& check, const char* name, void (*kernel)(const T*, double*, u64, u64)) {
    for (const GroupCase& c : kGroupCases) {
        const GroupData<T> d(c);
        for (const unsigned threads : {256u, 64u, 1024u}) {
            std::vector<double> sums(d.sums.size(), NAN);
            emu::launch(name, kernel, d.per_chunk(), dim3(threads), d.x.data(), sums.data(), d.group_len, c.chunk_len);
            check.near(std::string(c.name) + ", " + std::to_string(threads) + " threads", sums, d.sums,
                       sum_bound(std::fabs(c.offset) + 1.0, c.chunk_len), 0.0);
        }
    }
}

template <typename T>
void test_group_squares(Check& check, const char* name,
                        void (*kernel)(const T*, const double*, double*, u64, u64)) {
    for (const GroupCase& c : kGroupCases) {
        const GroupData<T> d(c);
        for (const unsigned threads : {256u, 64u, 1024u}) {
            std::vector<double> squares(d.squares.size(), NAN);
            emu::launch(name, kernel, d.per_chunk(), dim3(threads), d.x.data(), d.sums.data(), squares.data(),
                        d.group_len, c.chunk_len);
            check.near(std::string(c.name) + ", " + std::to_string(threads) + " threads", squares, d.squares,
                       sum_bound(4.0, c.chunk_len), 1e-12);
        }
    }
}

// The four launches as the backend makes them, against the f64 GroupNorm (then SiLU).
template <typename T>
void test_group_apply(Check& check, const char* name,
                      void (*kernel)(const T*, T*, const float*, const float*, const double*, u64, u64, u64, u64, int),
                      void (*sums_kernel)(const T*, double*, u64, u64),
                      void (*squares_kernel)(const T*, const double*, double*, u64, u64)) {
    const float eps = 1e-6f;
    for (const GroupCase& c : kGroupCases) {
        const GroupData<T> d(c);
        const u64 len = d.x.size(), per_group = c.channels / c.groups;
        std::vector<double> want(len), bound(len);
        for (u64 i = 0; i < len; ++i) {
            const u64 ch = (i / c.spatial) % c.channels, bg = (i / (c.spatial * c.channels)) * c.groups + ch / per_group;
            const double y = (d.xv[i] - d.means[bg]) / std::sqrt(d.vars[bg] + eps) * d.gamma[ch] + d.beta[ch];
            want[i] = maybe_silu(y, c.silu);
            // Evaluated in f64 and rounded once to f32 (half an ulp), then SiLU in f32 (`__expf`),
            // then the storage rounding.
            bound[i] = (c.silu ? 2e-6 : 0x1p-24) * std::fabs(want[i]) + 1e-12 * (1.0 + std::fabs(y)) +
                       Storage<T>::rounding * std::fabs(want[i]);
        }
        std::vector<double> sums(d.sums.size()), squares(d.squares.size());
        std::vector<double> stats(2 * d.groups_total);
        EMU_LAUNCH(sums_kernel, d.per_chunk(), dim3(256), d.x.data(), sums.data(), d.group_len, c.chunk_len);
        EMU_LAUNCH(squares_kernel, d.per_chunk(), dim3(256), d.x.data(), sums.data(), squares.data(), d.group_len,
                   c.chunk_len);
        EMU_LAUNCH(group_norm_stats, dim3(1), dim3(256), sums.data(), squares.data(), stats.data(), d.groups_total,
                   d.chunks, d.group_len, eps);
        for (const auto& shape : grid_stride_shapes(len)) {
            std::vector<T> out(len, Storage<T>::from_f32(NAN));
            emu::launch(name, kernel, shape.grid, shape.block, d.x.data(), out.data(), d.gamma.data(), d.beta.data(),
                        stats.data(), (u64)len, c.channels, c.spatial, c.groups, c.silu ? 1 : 0);
            check.near(std::string(c.name) + ", " + shape.name, values(out), want, bound);
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
                    // As the GroupNorm bound; the f64 terms here can cancel against the bias.
                    bound[i] = (c.silu ? 2e-6 : 0x1p-24) * std::fabs(want[i]) +
                               1e-12 * (std::fabs(scaled) + std::fabs(y)) + 1e-30 +
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

KERNEL_TEST(group_norm_sums_f32) { test_group_sums<float>(check, KERNEL(group_norm_sums_f32)); }
KERNEL_TEST(group_norm_sums_bf16) { test_group_sums<u16>(check, KERNEL(group_norm_sums_bf16)); }
KERNEL_TEST(group_norm_squares_f32) { test_group_squares<float>(check, KERNEL(group_norm_squares_f32)); }
KERNEL_TEST(group_norm_squares_bf16) { test_group_squares<u16>(check, KERNEL(group_norm_squares_bf16)); }
KERNEL_TEST(group_norm_stats) {
    // Partial sums of two groups in three chunks: mean and 1 / sqrt(var + eps), in f64, summed in
    // chunk order (so exactly these values).
    const std::vector<double> sums = {1.0, 2.0, 3.0, -4.0, 0.5, 0.25};
    const std::vector<double> squares = {0.5, 0.25, 0.125, 8.0, 4.0, 2.0};
    const double eps = 1e-6;
    for (const auto& shape : grid_stride_shapes(2)) {
        std::vector<double> stats(4, NAN);
        emu::launch("group_norm_stats", group_norm_stats, shape.grid, shape.block, sums.data(), squares.data(),
                    stats.data(), (u64)2, (u64)3, (u64)10, (float)eps);
        const std::vector<double> want = {6.0 / 10.0, 1.0 / std::sqrt(0.875 / 10.0 + (double)(float)eps), -3.25 / 10.0,
                                          1.0 / std::sqrt(14.0 / 10.0 + (double)(float)eps)};
        check.near(std::string("two groups, ") + shape.name, stats, want, 0.0, 0.0);
    }
}
KERNEL_TEST(group_norm_apply_f32) {
    test_group_apply<float>(check, KERNEL(group_norm_apply_f32), group_norm_sums_f32, group_norm_squares_f32);
}
KERNEL_TEST(group_norm_apply_bf16) {
    test_group_apply<u16>(check, KERNEL(group_norm_apply_bf16), group_norm_sums_bf16, group_norm_squares_bf16);
}
KERNEL_TEST(rms_norm_channels_f32) { test_rms_norm<float>(check, KERNEL(rms_norm_channels_f32)); }
KERNEL_TEST(rms_norm_channels_bf16) { test_rms_norm<u16>(check, KERNEL(rms_norm_channels_bf16)); }
