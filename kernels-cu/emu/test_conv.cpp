// conv.cu: the tensor-core convolution pipeline in bf16 and f32, launched as the Rust backend
// does (the channels-last copies of input and weights, checked element by element, then the
// GEMM at each tile height) against a plain-loop convolution in f64 with PyTorch's padding and
// strides. The shapes leave partial tiles in M, N and K, channel counts that are no multiple of
// 4, 8 or 32, and cover the causal front padding, temporal and spatial strides, padding on one
// side only, a missing bias, and batches.
#include "conv.cu"

#include <cstddef>

#include "conv_cases.h"
#include "harness.h"

// The layout of `vae_tensor::cuda::abi::ConvGeom` (`#[repr(C)]`): 14 u64, then 3 i64.
static_assert(sizeof(ConvGeom) == 17 * 8);
static_assert(offsetof(ConvGeom, cout) == 5 * 8 && offsetof(ConvGeom, to) == 9 * 8);
static_assert(offsetof(ConvGeom, stride) == 13 * 8 && offsetof(ConvGeom, pad_left) == 16 * 8);

namespace {

using namespace conv_cases;
using u16 = std::uint16_t;

// The small-Cout kernel's own: Wan's RGB head, 96 -> 3, causal 3x3x3 (slow to emulate on the
// tensor-core kernels, which kCases already cover).
const Case kRgbHead = {"96 -> 3 channels, causal 3x3x3", 1, 96, 2, 5, 9, 3, 3, 3, 3, 1, 1, {2, 0, 1, 1, 1, 1}, true};

template <typename T>
using InputKernel = void (*)(const T*, T*, ConvGeom);

// `conv_input_channels_last_*` as the backend launches it (grid (N Tp Hp, Wp / 64, Cp / 32)).
template <typename T>
std::vector<T> input_channels_last(const ConvGeom& g, const std::vector<T>& x, const char* name,
                                   InputKernel<T> kernel) {
    const PaddedHost<T> p(g);
    std::vector<T> xp(p.len(g), Storage<T>::from_f32(NAN));  // an unwritten element shows
    const dim3 grid((unsigned)(g.n * p.tp * p.hp), (unsigned)((p.wp + 63) / 64), (unsigned)((p.cp + 31) / 32));
    emu::launch(name, kernel, grid, dim3(256), x.data(), xp.data(), g);
    return xp;
}

template <typename T>
std::vector<T> weight_channels_last(const ConvGeom& g, const std::vector<T>& w, const char* name,
                                    InputKernel<T> kernel) {
    const PaddedHost<T> p(g);
    const u64 len = g.cout * g.kt * g.kh * g.kw * p.cp;
    std::vector<T> wr(len, Storage<T>::from_f32(NAN));
    emu::launch(name, kernel, elementwise_grid(len), dim3(256), w.data(), wr.data(), g);
    return wr;
}

template <typename T>
using SplitInputKernel = void (*)(const T*, u64, const T*, T*, ConvGeom);

// The kernels of one storage type: the layout copies (the input's from one tensor or two).
template <typename T>
struct Pipeline {
    const char* input_name;
    InputKernel<T> input;
    const char* weight_name;
    InputKernel<T> weight;
    const char* split_name;
    SplitInputKernel<T> split;
};

const Pipeline<u16> kBf16{"conv_input_channels_last_bf16",       conv_input_channels_last_bf16,
                          "conv_weight_channels_last_bf16",      conv_weight_channels_last_bf16,
                          "conv_input_channels_last_split_bf16", conv_input_channels_last_split_bf16};
const Pipeline<float> kF32{"conv_input_channels_last_f32",       conv_input_channels_last_f32,
                           "conv_weight_channels_last_f32",      conv_weight_channels_last_f32,
                           "conv_input_channels_last_split_f32", conv_input_channels_last_split_f32};

template <typename T>
const Pipeline<T>& pipeline();
template <>
const Pipeline<u16>& pipeline<u16>() { return kBf16; }
template <>
const Pipeline<float>& pipeline<float>() { return kF32; }

// One case's operands as the backend hands them to a GEMM kernel (channels-last copies made by
// the pipeline's own kernels), and the reference with its bound: the f32 accumulation's error
// (1.01e-5 of the magnitude summed), `product_error` of it per product, and the output type's
// rounding.
template <typename T, typename TO>
struct Operands {
    ConvGeom g;
    std::vector<T> xp, wr;
    std::vector<float> bias;
    std::vector<double> want, bound;

    Operands(const Case& c, double product_error) : g(c.geometry()) {
        const auto x = to_storage<T>(random_f32(g.n * g.cin * g.t * g.h * g.w, 11, -1.0f, 1.0f));
        const auto w = to_storage<T>(random_f32(g.cout * g.cin * g.kt * g.kh * g.kw, 12, -0.3f, 0.3f));
        bias = random_f32(g.cout, 13, -1.0f, 1.0f);
        std::vector<double> magnitude;
        reference(c, g, values(x), values(w), bias, want, magnitude);
        bound.resize(want.size());
        for (std::size_t i = 0; i < want.size(); ++i) {
            bound[i] = (1.01e-5 + product_error) * magnitude[i] + Storage<TO>::rounding * std::fabs(want[i]);
        }
        const Pipeline<T>& p = pipeline<T>();
        xp = input_channels_last<T>(g, x, p.input_name, p.input);
        wr = weight_channels_last<T>(g, w, p.weight_name, p.weight);
    }
    u64 cols() const { return g.n * g.to * g.ho * g.wo; }
};

// The tensor-core pipeline with tiles of `32 * mt` output channels. bf16: f32 accumulation of
// exact products, then one rounding to bf16. f32: the three TF32 products lose about 2^-21 of
// each product's magnitude, inside the bound of f32 accumulation error (one TF32 product alone,
// 2^-11, would not be). Outputs of type TO: T, or f32 for bf16 operands (attention's scores).
// `product_error`: the relative error of one product (TF32 mode rounds both f32 operands to
// 10-bit mantissas: 2^-11 each).
template <typename T, typename TO = T>
using TensorCoreKernel = void (*)(const T*, const T*, const float*, TO*, ConvGeom);

template <typename T, typename TO = T>
void run_tensor_core_cases(Check& check, const char* name, TensorCoreKernel<T, TO> kernel, unsigned mt,
                           double product_error = 0.0) {
    for (const Case& c : cases_for_pass()) {
        const Operands<T, TO> d(c, product_error);
        std::vector<TO> out(d.want.size(), Storage<TO>::from_f32(NAN));
        const dim3 grid((unsigned)((d.cols() + 127) / 128), (unsigned)((d.g.cout + 32 * mt - 1) / (32 * mt)));
        emu::launch(name, kernel, grid, dim3(256), d.xp.data(), d.wr.data(), c.bias ? d.bias.data() : nullptr,
                    out.data(), d.g);
        check.near(std::string(c.name) + ", tile of " + num(32 * mt), values(out), d.want, d.bound);
    }
}

// The same GEMM with tiles of 256 pixels (`*_n256`: dynamic shared memory of TC_WIDE_SMEM(mt)
// bytes, four stages), against the reference on the pass's cases and, bit for bit, against the
// 128-pixel kernel `narrow` on its first and last (the K order per output is the same, so the backend may pick
// either shape). Grids of 256-pixel tiles end in a partial tile here too.
template <typename T, typename TO = T>
void run_wide_tensor_core_cases(Check& check, const char* name, TensorCoreKernel<T, TO> kernel,
                                TensorCoreKernel<T, TO> narrow, unsigned mt, double product_error = 0.0) {
    const std::vector<Case> cases = cases_for_pass();
    for (const Case& c : cases) {
        const Operands<T, TO> d(c, product_error);
        const unsigned row_tiles = (unsigned)((d.g.cout + 32 * mt - 1) / (32 * mt));
        const float* bias = c.bias ? d.bias.data() : nullptr;
        std::vector<TO> out(d.want.size(), Storage<TO>::from_f32(NAN));
        emu::launch_shared(name, kernel, dim3((unsigned)((d.cols() + 255) / 256), row_tiles), dim3(256),
                           TC_WIDE_SMEM(mt), d.xp.data(), d.wr.data(), bias, out.data(), d.g);
        const std::string what = std::string(c.name) + ", tile of " + num(32 * mt) + " x 256";
        check.near(what, values(out), d.want, d.bound);
        if (&c == &cases.front() || &c == &cases.back()) {
            std::vector<TO> same(d.want.size(), Storage<TO>::from_f32(NAN));
            emu::launch("narrow", narrow, dim3((unsigned)((d.cols() + 127) / 128), row_tiles), dim3(256),
                        d.xp.data(), d.wr.data(), bias, same.data(), d.g);
            check.exact(what + " = tile of " + num(32 * mt) + " x 128", out, same);
        }
    }
}

// The CUDA-core kernel for at most 4 output channels (`conv3d_small_cout_*_c4`) on the cases it
// takes (weights of 4 channels within its shared memory), launched as the backend does (blocks of
// 256 over the pixels, a few waves) and with fewer blocks than pixels need (grid-stride): f32
// accumulation in another order than the reference's.
template <typename T>
void run_small_cout_cases(Check& check, const char* name,
                          void (*kernel)(const T*, const T*, const float*, T*, ConvGeom)) {
    std::vector<Case> cases(std::begin(kCases), std::end(kCases));
    cases.push_back(kRgbHead);
    for (const Case& c : cases) {
        const ConvGeom g = c.geometry();
        if (g.cout > 4 || 4 * g.kt * g.kh * g.kw * PaddedHost<T>(g).cp * sizeof(T) > 45056) continue;
        const Operands<T, T> d(c, 0.0);
        const LaunchShape shapes[] = {
            {"backend launch", dim3((unsigned)std::min<u64>((d.cols() + 255) / 256, 132 * 8)), dim3(256)},
            {"2 blocks of 64", dim3(2), dim3(64)},
        };
        for (const auto& shape : shapes) {
            std::vector<T> out(d.want.size(), Storage<T>::from_f32(NAN));
            emu::launch(name, kernel, shape.grid, shape.block, d.xp.data(), d.wr.data(),
                        c.bias ? d.bias.data() : nullptr, out.data(), d.g);
            check.near(std::string(c.name) + ", " + shape.name, values(out), d.want, d.bound);
        }
    }
}

// Every element of xp against its definition: the input element the padding shifts in, or zero.
// `split`: the split copy (`*_split_*`: the first front_t frames from another tensor) for every
// split of the frames, none and all of them included.
template <typename T>
void check_input_channels_last(Check& check, bool split) {
    for (const Case& c : cases_for_pass()) {
        const ConvGeom g = c.geometry();
        const PaddedHost<T> p(g);
        const auto x = to_storage<T>(random_f32(g.n * g.cin * g.t * g.h * g.w, 21, -1.0f, 1.0f));
        const std::vector<T> want = input_channels_last_definition(g, x);
        const Pipeline<T>& pl = pipeline<T>();
        if (!split) {
            check.exact(c.name, input_channels_last<T>(g, x, pl.input_name, pl.input), want);
            continue;
        }
        for (u64 front_t = 0; front_t <= g.t; ++front_t) {
            const std::size_t frame = g.h * g.w;
            std::vector<T> front, rest;
            for (u64 b = 0; b < g.n; ++b)
                for (u64 ch = 0; ch < g.cin; ++ch)
                    for (u64 t = 0; t < g.t; ++t) {
                        const auto from = x.begin() + (std::ptrdiff_t)(((b * g.cin + ch) * g.t + t) * frame);
                        (t < front_t ? front : rest).insert((t < front_t ? front : rest).end(), from,
                                                            from + (std::ptrdiff_t)frame);
                    }
            std::vector<T> xp(p.len(g), Storage<T>::from_f32(NAN));
            const dim3 grid((unsigned)(g.n * p.tp * p.hp), (unsigned)((p.wp + 63) / 64), (unsigned)((p.cp + 31) / 32));
            emu::launch(pl.split_name, pl.split, grid, dim3(256), front_t ? front.data() : nullptr, front_t,
                        rest.empty() ? nullptr : rest.data(), xp.data(), g);
            check.exact(std::string(c.name) + ", " + num(front_t) + " frames in front", xp, want);
        }
    }
}

template <typename T>
void check_weight_channels_last(Check& check) {
    for (const Case& c : cases_for_pass()) {
        const ConvGeom g = c.geometry();
        const auto w = to_storage<T>(random_f32(g.cout * g.cin * g.kt * g.kh * g.kw, 22, -1.0f, 1.0f));
        const std::vector<T> want = weight_channels_last_definition(g, w);
        const Pipeline<T>& pl = pipeline<T>();
        check.exact(c.name, weight_channels_last<T>(g, w, pl.weight_name, pl.weight), want);
    }
}

}  // namespace

KERNEL_TEST(conv_input_channels_last_bf16) { check_input_channels_last<u16>(check, false); }
KERNEL_TEST(conv_input_channels_last_f32) { check_input_channels_last<float>(check, false); }
KERNEL_TEST(conv_input_channels_last_split_bf16) { check_input_channels_last<u16>(check, true); }
KERNEL_TEST(conv_input_channels_last_split_f32) { check_input_channels_last<float>(check, true); }
KERNEL_TEST(conv_weight_channels_last_bf16) { check_weight_channels_last<u16>(check); }
KERNEL_TEST(conv_weight_channels_last_f32) { check_weight_channels_last<float>(check); }
KERNEL_TEST(conv3d_tc_bf16_m4) { run_tensor_core_cases<u16>(check, KERNEL(conv3d_tc_bf16_m4), 4); }
KERNEL_TEST(conv3d_tc_bf16_m3) { run_tensor_core_cases<u16>(check, KERNEL(conv3d_tc_bf16_m3), 3); }
KERNEL_TEST(conv3d_tc_bf16_m2) { run_tensor_core_cases<u16>(check, KERNEL(conv3d_tc_bf16_m2), 2); }
KERNEL_TEST(conv3d_small_cout_bf16_c4) { run_small_cout_cases<u16>(check, KERNEL(conv3d_small_cout_bf16_c4)); }
KERNEL_TEST(conv3d_small_cout_f32_c4) { run_small_cout_cases<float>(check, KERNEL(conv3d_small_cout_f32_c4)); }
KERNEL_TEST(conv3d_tc_bf16_f32out_m4) {
    run_tensor_core_cases<u16, float>(check, KERNEL(conv3d_tc_bf16_f32out_m4), 4);
}
KERNEL_TEST(conv3d_tc_f32_m3) { run_tensor_core_cases<float>(check, KERNEL(conv3d_tc_f32_m3), 3); }
KERNEL_TEST(conv3d_tc_f32_m2) { run_tensor_core_cases<float>(check, KERNEL(conv3d_tc_f32_m2), 2); }
KERNEL_TEST(conv3d_tc_tf32_m4) { run_tensor_core_cases<float>(check, KERNEL(conv3d_tc_tf32_m4), 4, 0x1p-10); }
KERNEL_TEST(conv3d_tc_tf32_m3) { run_tensor_core_cases<float>(check, KERNEL(conv3d_tc_tf32_m3), 3, 0x1p-10); }
KERNEL_TEST(conv3d_tc_tf32_m2) { run_tensor_core_cases<float>(check, KERNEL(conv3d_tc_tf32_m2), 2, 0x1p-10); }

// Eight kernels: the wide tiles of every tensor-core family but attention's scores.
KERNEL_TEST(conv3d_tc_bf16_m4_n256) {
    run_wide_tensor_core_cases<u16>(check, KERNEL(conv3d_tc_bf16_m4_n256), conv3d_tc_bf16_m4, 4);
}
KERNEL_TEST(conv3d_tc_bf16_m3_n256) {
    run_wide_tensor_core_cases<u16>(check, KERNEL(conv3d_tc_bf16_m3_n256), conv3d_tc_bf16_m3, 3);
}
KERNEL_TEST(conv3d_tc_bf16_m2_n256) {
    run_wide_tensor_core_cases<u16>(check, KERNEL(conv3d_tc_bf16_m2_n256), conv3d_tc_bf16_m2, 2);
}
KERNEL_TEST(conv3d_tc_f32_m3_n256) {
    run_wide_tensor_core_cases<float>(check, KERNEL(conv3d_tc_f32_m3_n256), conv3d_tc_f32_m3, 3);
}
KERNEL_TEST(conv3d_tc_f32_m2_n256) {
    run_wide_tensor_core_cases<float>(check, KERNEL(conv3d_tc_f32_m2_n256), conv3d_tc_f32_m2, 2);
}
KERNEL_TEST(conv3d_tc_tf32_m4_n256) {
    run_wide_tensor_core_cases<float>(check, KERNEL(conv3d_tc_tf32_m4_n256), conv3d_tc_tf32_m4, 4, 0x1p-10);
}
KERNEL_TEST(conv3d_tc_tf32_m3_n256) {
    run_wide_tensor_core_cases<float>(check, KERNEL(conv3d_tc_tf32_m3_n256), conv3d_tc_tf32_m3, 3, 0x1p-10);
}
KERNEL_TEST(conv3d_tc_tf32_m2_n256) {
    run_wide_tensor_core_cases<float>(check, KERNEL(conv3d_tc_tf32_m2_n256), conv3d_tc_tf32_m2, 2, 0x1p-10);
}
