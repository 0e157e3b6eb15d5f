// conv_sm90a.cu: the bf16 convolution on warpgroup MMA, at each tile width N, on the cases of
// conv_cases.h against the f64 reference, from channels-last operands made by their definition
// (test_conv.cpp checks conv.cu's copies against the same definition), launched as the backend
// launches it: grid (columns / 128, cout / N), WGMMA_SMEM(N) bytes of dynamic shared memory.
// The emulation (emu/include/wgmma_emu.h) also fails a kernel that reads a stage before its
// copies landed and were fenced for the async proxy, or overwrites one a product still reads.
#include "conv_sm90a.cu"

#include "conv_cases.h"
#include "harness.h"

namespace {

using namespace conv_cases;
using u16 = std::uint16_t;

using WgmmaKernel = void (*)(const u16*, const u16*, const float*, u16*, ConvGeom);

void run_wgmma_cases(Check& check, const char* name, WgmmaKernel kernel, unsigned n, unsigned shared) {
    for (const Case& c : cases_for_pass()) {
        const ConvGeom g = c.geometry();
        const auto x = to_storage<u16>(random_f32(g.n * g.cin * g.t * g.h * g.w, 11, -1.0f, 1.0f));
        const auto w = to_storage<u16>(random_f32(g.cout * g.cin * g.kt * g.kh * g.kw, 12, -0.3f, 0.3f));
        const auto bias = random_f32(g.cout, 13, -1.0f, 1.0f);
        std::vector<double> want, magnitude;
        reference(c, g, values(x), values(w), bias, want, magnitude);
        std::vector<double> bound(want.size());
        for (std::size_t i = 0; i < want.size(); ++i) {
            bound[i] = 1.01e-5 * magnitude[i] + Storage<u16>::rounding * std::fabs(want[i]);
        }
        const std::vector<u16> xp = input_channels_last_definition(g, x);
        const std::vector<u16> wr = weight_channels_last_definition(g, w);
        const u64 cols = g.n * g.to * g.ho * g.wo;
        std::vector<u16> out(want.size(), Storage<u16>::from_f32(NAN));
        const dim3 grid((unsigned)((cols + 127) / 128), (unsigned)((g.cout + n - 1) / n));
        emu::launch_shared(name, kernel, grid, dim3(256), shared, xp.data(), wr.data(),
                           c.bias ? bias.data() : nullptr, out.data(), g);
        check.near(std::string(c.name) + ", tile of 128 x " + num(n), values(out), want, bound);
    }
}

}  // namespace

KERNEL_TEST(conv3d_wgmma_bf16_n96) {
    run_wgmma_cases(check, KERNEL(conv3d_wgmma_bf16_n96), 96, WGMMA_SMEM(96));
}
KERNEL_TEST(conv3d_wgmma_bf16_n128) {
    run_wgmma_cases(check, KERNEL(conv3d_wgmma_bf16_n128), 128, WGMMA_SMEM(128));
}
KERNEL_TEST(conv3d_wgmma_bf16_n192) {
    run_wgmma_cases(check, KERNEL(conv3d_wgmma_bf16_n192), 192, WGMMA_SMEM(192));
}
KERNEL_TEST(conv3d_wgmma_bf16_n256) {
    run_wgmma_cases(check, KERNEL(conv3d_wgmma_bf16_n256), 256, WGMMA_SMEM(256));
}
