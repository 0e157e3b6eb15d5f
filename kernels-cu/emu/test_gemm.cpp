// gemm.cu: the batched GEMM `C[b] = alpha A[b] B[b] + beta C[b]` for each combination of storage
// types, launched as the Rust backend does (grid (N / 64, M / 64, batch), 256 threads), against
// f64 sums. The operands are strided views: the backend's attention products (K transposed),
// `nn.Linear` (batch strides 0, the bias already in C, beta 1), a transposed A with gaps between
// batches and a padded C (whose padding must stay untouched), and negative strides.
#include "gemm.cu"

#include <algorithm>

#include "harness.h"

namespace {

using namespace emu_test;
using u16 = std::uint16_t;

// One operand: element (b, i, j) at `origin + b * batch + i * rows + j * cols` of a buffer just
// large enough for the extents (so any read outside them is caught by the address sanitizer).
struct View {
    i64 batch, rows, cols;
    i64 origin = 0;
    std::size_t size = 0;

    void fit(u64 batches, u64 nrows, u64 ncols) {
        i64 lo = 0, hi = 0;
        const std::pair<i64, u64> dims[] = {{batch, batches}, {rows, nrows}, {cols, ncols}};
        for (const auto& [stride, extent] : dims) {
            const i64 reach = stride * ((i64)extent - 1);
            (reach < 0 ? lo : hi) += reach;
        }
        origin = -lo;
        size = (std::size_t)(hi - lo + 1);
    }
    std::size_t at(u64 b, u64 i, u64 j) const {
        return (std::size_t)(origin + (i64)b * batch + (i64)i * rows + (i64)j * cols);
    }
};

struct Case {
    const char* name;
    u64 batch, m, n, k;
    View a, b, c;
    float alpha, beta;
};

std::vector<Case> cases() {
    const u64 len = 37, dim = 24;
    std::vector<Case> all = {
        // Q K^T: element (kk, j) of K^T is K[j, kk].
        {"attention Q K^T", 2, len, len, dim, {(i64)(len * dim), (i64)dim, 1}, {(i64)(len * dim), 1, (i64)dim},
         {(i64)(len * len), (i64)len, 1}, 0.2041241f, 0.0f},
        {"attention P V", 2, len, dim, len, {(i64)(len * len), (i64)len, 1}, {(i64)(len * dim), (i64)dim, 1},
         {(i64)(len * dim), (i64)dim, 1}, 1.0f, 0.0f},
        // x [70, 33] times weight^T ([65, 33] read transposed) onto the bias.
        {"linear, beta 1", 1, 70, 65, 33, {0, 33, 1}, {0, 1, 33}, {0, 65, 1}, 1.0f, 1.0f},
        {"transposed A, padded C, beta 0.5", 3, 67, 130, 37, {67 * 37 + 3, 1, 67}, {37 * 135, 135, 1},
         {67 * 133 + 7, 133, 1}, 0.7f, 0.5f},
        {"negative strides", 2, 5, 70, 17, {5 * 17, -17, 1}, {-(17 * 70), 70, 1}, {5 * 70, 70, 1}, -1.25f, 0.0f},
        {"1x1x1", 1, 1, 1, 1, {1, 1, 1}, {1, 1, 1}, {1, 1, 1}, 2.0f, 0.0f},
    };
    for (auto& c : all) {
        c.a.fit(c.batch, c.m, c.k);
        c.b.fit(c.batch, c.k, c.n);
        c.c.fit(c.batch, c.m, c.n);
    }
    return all;
}

template <typename TA, typename TB, typename TC>
void run_cases(Check& check, const char* name,
               void (*kernel)(const TA*, const TB*, TC*, u64, u64, u64, i64, i64, i64, i64, i64, i64, i64, i64, float,
                              float)) {
    for (const Case& c : cases()) {
        const auto a = to_storage<TA>(random_f32(c.a.size, 21, -1.0f, 1.0f));
        const auto b = to_storage<TB>(random_f32(c.b.size, 22, -1.0f, 1.0f));
        // With beta 0 the kernel must not read C (PyTorch's rule): NaN there would show it.
        const auto c0 = c.beta == 0.0f ? std::vector<TC>(c.c.size, Storage<TC>::from_f32(NAN))
                                       : to_storage<TC>(random_f32(c.c.size, 23, -1.0f, 1.0f));
        const auto av = values(a), bv = values(b);
        std::vector<double> want = values(c0), bound(c.c.size, 0.0);
        for (u64 bb = 0; bb < c.batch; ++bb)
            for (u64 i = 0; i < c.m; ++i)
                for (u64 j = 0; j < c.n; ++j) {
                    double sum = 0.0, mag = 0.0;
                    for (u64 kk = 0; kk < c.k; ++kk) {
                        const double p = av[c.a.at(bb, i, kk)] * bv[c.b.at(bb, kk, j)];
                        sum += p;
                        mag += std::fabs(p);
                    }
                    const std::size_t o = c.c.at(bb, i, j);
                    double v = c.alpha * sum, m = std::fabs(c.alpha) * mag;
                    if (c.beta != 0.0f) v += c.beta * want[o], m += std::fabs(c.beta * want[o]);
                    want[o] = v;
                    bound[o] = 1.01e-5 * m + Storage<TC>::rounding * std::fabs(v);
                }
        std::vector<TC> out = c0;
        const dim3 grid((unsigned)((c.n + 63) / 64), (unsigned)((c.m + 63) / 64), (unsigned)c.batch);
        emu::launch(name, kernel, grid, dim3(256), a.data() + c.a.origin, b.data() + c.b.origin,
                    out.data() + c.c.origin, c.m, c.n, c.k, c.a.batch, c.a.rows, c.a.cols, c.b.batch, c.b.rows,
                    c.b.cols, c.c.batch, c.c.rows, c.alpha, c.beta);
        check.near(c.name, values(out), want, bound);
    }
}

}  // namespace

KERNEL_TEST(gemm_batched_f32) { run_cases<float, float, float>(check, KERNEL(gemm_batched_f32)); }
KERNEL_TEST(gemm_batched_bf16_bf16_f32) { run_cases<u16, u16, float>(check, KERNEL(gemm_batched_bf16_bf16_f32)); }
KERNEL_TEST(gemm_batched_f32_bf16_bf16) { run_cases<float, u16, u16>(check, KERNEL(gemm_batched_f32_bf16_bf16)); }
