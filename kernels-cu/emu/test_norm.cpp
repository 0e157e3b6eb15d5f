// norm.cu: GroupNorm and Wan's channel RMS norm, f32 and bf16 storage, with and without the fused
// SiLU, against f64 references. GroupNorm's chunk partials (sum, squared deviations from the
// chunk's own mean) run one block per (chunk, sample and group) with the backend's 256 threads
// and with 64 and 128 (chunks longer than the registers hold: the rest is read twice), over one
// chunk per group and several with a short last one; the groups are shorter than a warp, longer
// than the block, offset from zero, and constant; the statistics (one block per group, Chan's
// combination) against the exact two-pass f64 ones, and the three launches together against the
// f64 GroupNorm, with the apply under its backend grid (rows in y, pieces of a row in x), grids
// too small in either direction, rows that are and are not whole 16-byte packs, and tensors off
// alignment. The RMS norm runs under the backend's 32 x slices blocks (channels held in registers
// and channels read again), other 2-D and 1-D blocks and grids too small, with and without a bias,
// over one channel and many, and over a pixel whose channels are all zero (divided by eps).
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
    {"1x4x4096, 2 groups, chunks of 4096, offset 1000", 1, 4, 4096, 2, 4096, 1000.0f, false, false},
    {"2x6x64, 3 groups, chunks of 100 (whole packs per row), SiLU", 2, 6, 64, 3, 100, 0.0f, false, true},
};

// One case's input and its f64 statistics per (sample, group) and chunk.
template <typename T>
struct GroupData {
    std::vector<T> x;
    std::vector<float> gamma, beta;
    std::vector<double> xv, partials, means, vars;
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
        partials.assign(2 * groups_total * chunks, 0.0);
        means.assign(groups_total, 0.0);
        vars.assign(groups_total, 0.0);
        for (u64 bg = 0; bg < groups_total; ++bg) {
            const double* g = &xv[bg * group_len];
            for (u64 k = 0; k < chunks; ++k) {
                const u64 start = k * c.chunk_len, end = std::min(start + c.chunk_len, group_len);
                double sum = 0.0, m2 = 0.0;
                for (u64 i = start; i < end; ++i) sum += g[i];
                const double mean = sum / (double)(end - start);
                for (u64 i = start; i < end; ++i) m2 += (g[i] - mean) * (g[i] - mean);
                partials[2 * (bg * chunks + k)] = sum;
                partials[2 * (bg * chunks + k) + 1] = m2;
            }
            // The exact two-pass statistics of the whole group.
            for (u64 i = 0; i < group_len; ++i) means[bg] += g[i];
            means[bg] /= (double)group_len;
            for (u64 i = 0; i < group_len; ++i) vars[bg] += (g[i] - means[bg]) * (g[i] - means[bg]);
            vars[bg] /= (double)group_len;
        }
    }

    dim3 per_chunk() const { return dim3((unsigned)chunks, (unsigned)groups_total); }
};

// Bounds of f64 sums of n terms of magnitude up to `scale`, summed in another order.
double sum_bound(double scale, u64 n) { return 1e-13 * scale * (double)n; }

template <typename T>
void test_group_partials(Check& check, const char* name, void (*kernel)(const T*, double*, u64, u64)) {
    for (const GroupCase& c : kGroupCases) {
        const GroupData<T> d(c);
        for (const unsigned threads : {256u, 64u, 128u}) {
            std::vector<double> partials(d.partials.size(), NAN);
            emu::launch(name, kernel, d.per_chunk(), dim3(threads), d.x.data(), partials.data(), d.group_len,
                        c.chunk_len);
            std::vector<double> bound(partials.size());
            for (std::size_t i = 0; i < bound.size(); ++i)
                bound[i] = i % 2 == 0 ? sum_bound(std::fabs(c.offset) + 1.0, c.chunk_len) : sum_bound(4.0, c.chunk_len) + 1e-12 * std::fabs(d.partials[i]);
            check.near(std::string(c.name) + ", " + std::to_string(threads) + " threads", partials, d.partials, bound);
        }
    }
}

// The three launches as the backend makes them (the apply under several grids), against the f64
// GroupNorm (then SiLU).
template <typename T>
void test_group_apply(Check& check, const char* name,
                      void (*kernel)(const T*, T*, const float*, const float*, const double*, u64, u64, u64, u64, int),
                      void (*partials_kernel)(const T*, double*, u64, u64)) {
    const float eps = 1e-6f;
    for (const GroupCase& c : kGroupCases) {
        const GroupData<T> d(c);
        const u64 len = d.x.size(), per_group = c.channels / c.groups, rows = c.batch * c.channels;
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
        std::vector<double> partials(d.partials.size()), stats(2 * d.groups_total);
        EMU_LAUNCH(partials_kernel, d.per_chunk(), dim3(256), d.x.data(), partials.data(), d.group_len, c.chunk_len);
        EMU_LAUNCH(group_norm_stats, dim3((unsigned)d.groups_total), dim3(256), partials.data(), stats.data(),
                   d.groups_total, d.chunks, d.group_len, c.chunk_len, eps);
        // The backend's grid: rows in y, enough pieces of a row in x for 132 * 32 blocks.
        const u64 pack = 16 / sizeof(T), per_row = std::max<u64>(1, (c.spatial + pack * 256 - 1) / (pack * 256));
        const u64 backend_x = std::max<u64>(1, std::min<u64>(per_row, (132 * 32 + rows - 1) / rows));
        const LaunchShape shapes[] = {
            {"backend launch", dim3((unsigned)backend_x, (unsigned)rows), dim3(256)},
            {"1 x 1 blocks of 64", dim3(1, 1), dim3(64)},
            {"3 x 2 blocks of 100", dim3(3, 2), dim3(100)},
            {"2 x rows blocks of 1024", dim3(2, (unsigned)rows), dim3(1024)},
        };
        for (const std::size_t off : {0, 1})
            for (const auto& shape : shapes) {
                // At element offset `off`: 1 is off 16-byte alignment (element by element).
                std::vector<T> xs(len + 1), out(len + 1, Storage<T>::from_f32(NAN));
                std::copy(d.x.begin(), d.x.end(), xs.begin() + (std::ptrdiff_t)off);
                emu::launch(name, kernel, shape.grid, shape.block, xs.data() + off, out.data() + off, d.gamma.data(),
                            d.beta.data(), stats.data(), rows, c.channels, c.spatial, c.groups, c.silu ? 1 : 0);
                const std::vector<T> got(out.begin() + (std::ptrdiff_t)off, out.begin() + (std::ptrdiff_t)(off + len));
                check.near(std::string(c.name) + ", " + shape.name + (off ? ", misaligned" : ""), values(got), want,
                           bound);
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
    {"1x300x40, SiLU (more channels than 24 slices hold)", 1, 300, 40, false, true, false},
    {"1x96x132, a zero pixel, bias", 1, 96, 132, true, false, true},
    {"2x192x64, SiLU (more channels than 16 slices hold in 4-pixel lanes)", 2, 192, 64, false, true, false},
};

// `pix` pixels per lane (4: the `_x4` kernels, for pixel counts that are multiples of 4), whose
// lanes hold `held` channels each in blocks of at most `max_threads`.
template <typename T>
void test_rms_norm(Check& check, const char* name,
                   void (*kernel)(const T*, T*, const float*, const float*, u64, u64, u64, float, int), u64 pix,
                   u64 held, unsigned max_threads) {
    const float eps = 1e-12f;
    for (const RmsCase& c : kRmsCases) {
        if (c.inner % pix != 0) continue;
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
        // The backend's block: 32 pixel lanes by ceil(C / held) slices (as many as the launch
        // bound allows), a block per tile of 32 lanes; then other 2-D blocks, 1-D blocks (one
        // slice) and grids too small.
        const u64 most = max_threads / 32;
        const u64 slices = std::clamp<u64>((c.channels + held - 1) / held, 1, most);
        const u64 tiles = c.batch * ((c.inner + 32 * pix - 1) / (32 * pix));
        const std::string widest = "3 blocks of 32 x " + std::to_string(most);
        const LaunchShape shapes[] = {
            {"backend launch", dim3((unsigned)tiles), dim3(32, (unsigned)slices)},
            {"1 block of 32 x 3", dim3(1), dim3(32, 3)},
            {"2 blocks of 16 x 7", dim3(2), dim3(16, 7)},
            {widest.c_str(), dim3(3), dim3(32, (unsigned)most)},
            {"2 blocks of 100", dim3(2), dim3(100)},
            {"backend grid of 256 x 1", dim3((unsigned)((c.batch * c.inner + 255) / 256)), dim3(256)},
        };
        for (const auto& shape : shapes) {
            std::vector<T> out(len, Storage<T>::from_f32(NAN));
            emu::launch(name, kernel, shape.grid, shape.block, x.data(), out.data(), gamma.data(),
                        c.bias ? bias.data() : nullptr, c.batch, c.channels, c.inner, eps, c.silu ? 1 : 0);
            check.near(std::string(c.name) + ", " + shape.name, values(out), want, bound);
        }
    }
}

}  // namespace

KERNEL_TEST(group_norm_partials_f32) { test_group_partials<float>(check, KERNEL(group_norm_partials_f32)); }
KERNEL_TEST(group_norm_partials_bf16) { test_group_partials<u16>(check, KERNEL(group_norm_partials_bf16)); }
KERNEL_TEST(group_norm_stats) {
    // Each case's exact chunk partials combined into mean and 1 / sqrt(var + eps), against the
    // two-pass f64 statistics of the whole group (Chan's combination agrees to f64 rounding), one
    // block per group and fewer blocks than groups, blocks of 256, 64 and 1024.
    const float eps = 1e-6f;
    for (const GroupCase& c : kGroupCases) {
        const GroupData<float> d(c);
        std::vector<double> want(2 * d.groups_total), bound(2 * d.groups_total);
        for (u64 bg = 0; bg < d.groups_total; ++bg) {
            want[2 * bg] = d.means[bg];
            want[2 * bg + 1] = 1.0 / std::sqrt(d.vars[bg] + (double)eps);
            bound[2 * bg] = 1e-14 * (std::fabs(c.offset) + 1.0);
            // Relative to the variance, the error is that of the squares against the mean's.
            bound[2 * bg + 1] = 1e-12 * want[2 * bg + 1] * (1.0 + c.offset * c.offset / (d.vars[bg] + (double)eps));
        }
        const LaunchShape shapes[] = {
            {"backend launch", dim3((unsigned)d.groups_total), dim3(256)},
            {"1 block of 64", dim3(1), dim3(64)},
            {"2 blocks of 1024", dim3(2), dim3(1024)},
        };
        for (const auto& shape : shapes) {
            std::vector<double> stats(want.size(), NAN);
            emu::launch("group_norm_stats", group_norm_stats, shape.grid, shape.block, d.partials.data(), stats.data(),
                        d.groups_total, d.chunks, d.group_len, c.chunk_len, eps);
            check.near(std::string(c.name) + ", " + shape.name, stats, want, bound);
        }
    }
}
KERNEL_TEST(group_norm_apply_f32) {
    test_group_apply<float>(check, KERNEL(group_norm_apply_f32), group_norm_partials_f32);
}
KERNEL_TEST(group_norm_apply_bf16) {
    test_group_apply<u16>(check, KERNEL(group_norm_apply_bf16), group_norm_partials_bf16);
}
KERNEL_TEST(rms_norm_channels_f32) { test_rms_norm<float>(check, KERNEL(rms_norm_channels_f32), 1, 12, 768); }
KERNEL_TEST(rms_norm_channels_bf16) { test_rms_norm<u16>(check, KERNEL(rms_norm_channels_bf16), 1, 12, 768); }
KERNEL_TEST(rms_norm_channels_x4_bf16) { test_rms_norm<u16>(check, KERNEL(rms_norm_channels_x4_bf16), 4, 8, 512); }
