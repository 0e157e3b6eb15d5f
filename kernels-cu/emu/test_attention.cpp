// attention.cu: the in-place scaled row softmax, one block per row as the Rust backend launches it
// (256 threads; the GPU test uses 128), and with a grid smaller than the rows (grid-stride over
// rows), rows shorter than a warp and longer than the block, masked (-inf) entries, and one warp
// or 32 warps per block (the block reductions' two extremes). Against f64; `__expf` costs up to
// about 2e-6 relative here.
#include "attention.cu"

#include "harness.h"

namespace {

using namespace emu_test;

struct Case {
    const char* name;
    u64 rows, cols;
    float scale, spread;
    unsigned grid, block;
    bool masked;
};

const Case kCases[] = {
    {"backend launch, 74 x 37", 74, 37, 0.2041241f, 4.0f, 74, 256, false},
    {"128 threads", 74, 37, 0.2041241f, 4.0f, 74, 128, false},
    {"1000 columns, 4 blocks for 9 rows", 9, 1000, 0.3f, 40.0f, 4, 256, false},
    {"one column", 5, 1, 1.0f, 3.0f, 5, 256, false},
    {"masked entries, 1024 threads", 3, 3000, 1.0f, 8.0f, 3, 1024, true},
    {"one warp", 4, 100, 0.5f, 6.0f, 2, 32, false},
};

}  // namespace

// The softmax of every case against f64. `run(c, x, p)` launches the kernel on the scores `x`,
// leaving the probabilities in `p` (the f32 kernel works in place: it is launched on `p`, a copy
// of the scores); bf16 probabilities are the f32 value within one bf16 rounding.
template <typename TP, typename Run>
void check_softmax(Check& check, Run run) {
    for (const Case& c : kCases) {
        auto x = random_f32(c.rows * c.cols, 31, -c.spread, c.spread);
        if (c.masked) {
            for (std::size_t i = 0; i < x.size(); i += 7) x[i] = -INFINITY;
        }
        std::vector<double> want(x.size());
        for (u64 r = 0; r < c.rows; ++r) {
            const float* row = &x[r * c.cols];
            double m = -INFINITY, sum = 0.0;
            for (u64 j = 0; j < c.cols; ++j) m = std::max(m, (double)row[j] * c.scale);
            for (u64 j = 0; j < c.cols; ++j) sum += std::exp((double)row[j] * c.scale - m);
            for (u64 j = 0; j < c.cols; ++j) want[r * c.cols + j] = std::exp((double)row[j] * c.scale - m) / sum;
        }
        std::vector<TP> p(x.size(), Storage<TP>::from_f32(NAN));
        run(c, x, p);
        check.near(c.name, values(p), want, 1e-12, 1e-5 + Storage<TP>::rounding);
    }
}

KERNEL_TEST(softmax_rows_to_bf16) {
    check_softmax<std::uint16_t>(check, [](const Case& c, std::vector<float>& x, std::vector<std::uint16_t>& p) {
        EMU_LAUNCH(softmax_rows_to_bf16, dim3(c.grid), dim3(c.block), x.data(), p.data(), c.rows, c.cols, c.scale);
    });
}

KERNEL_TEST(softmax_rows_f32) {
    check_softmax<float>(check, [](const Case& c, std::vector<float>& x, std::vector<float>& p) {
        p = x;
        EMU_LAUNCH(softmax_rows_f32, dim3(c.grid), dim3(c.block), p.data(), c.rows, c.cols, c.scale);
    });
}
