// layout.cu: box copies, nearest upsampling, Wan2.2's DupUp3D / AvgDown3D, and the tile blend, each
// under every grid-stride launch shape, against references written the other way round (the
// kernels map each output to its source; the references walk the sources and place them). All are
// defined bit for bit.
#include "layout.cu"

#include <cstddef>

#include "harness.h"

// The layout of `vae_tensor::cuda::abi::Box8` (`#[repr(C)]`): three arrays of 8, then an i32.
static_assert(sizeof(Box8) == 200 && offsetof(Box8, dst_stride) == 128 && offsetof(Box8, rank) == 192);

namespace {

using namespace emu_test;
using u16 = std::uint16_t;

// Values that differ everywhere: f32 from the generator, any u16 bit pattern for the raw copy.
template <typename T>
std::vector<T> distinct(std::size_t n, std::uint64_t seed) {
    if constexpr (std::is_same_v<T, float>) {
        return random_f32(n, seed, -10.0f, 10.0f);
    } else {
        Rng rng(seed);
        std::vector<T> v(n);
        for (auto& x : v) x = (T)rng.next();
        return v;
    }
}

// As the backend's Box8::new: unused trailing extents 1, strides 0.
Box8 make_box(const std::vector<u64>& extent, const std::vector<i64>& src, const std::vector<i64>& dst) {
    Box8 b{};
    for (int d = 0; d < 8; ++d) b.extent[d] = 1;
    for (std::size_t d = 0; d < extent.size(); ++d) {
        b.extent[d] = extent[d];
        b.src_stride[d] = src[d];
        b.dst_stride[d] = dst[d];
    }
    b.rank = (int)extent.size();
    return b;
}

// One copy of a box: `src_len` and `dst_len` elements, the box at the given offsets.
struct BoxCase {
    const char* name;
    std::size_t src_len, dst_len, src_offset, dst_offset;
    std::vector<u64> extent;
    std::vector<i64> src_stride, dst_stride;
};

std::vector<BoxCase> box_cases() {
    return {
        {"permute [2,3,4,5] -> [2,4,3,5]", 120, 120, 0, 0, {2, 4, 3, 5}, {60, 5, 20, 1}, {60, 15, 5, 1}},
        {"narrow dim 1 of [3,10,7] at 5", 210, 84, 35, 0, {3, 4, 7}, {70, 7, 1}, {28, 7, 1}},
        {"cat: second part of [2,9,6]", 60, 108, 0, 24, {2, 5, 6}, {30, 6, 1}, {54, 6, 1}},
        {"broadcast bias rows (stride 0)", 65, 70 * 65, 0, 0, {70, 65}, {0, 1}, {65, 1}},
        {"rank 8 transpose", 144, 144, 0, 0, {2, 1, 3, 2, 1, 2, 3, 2}, {1, 144, 2, 6, 144, 12, 24, 72},
         {72, 72, 24, 12, 12, 6, 2, 1}},
        {"strided column (halo pack)", 400, 130, 3, 0, {130}, {3}, {1}},
        {"halo unpack into a padded plane", 2 * 5 * 9 * 11, 2 * 5 * 11 * 13, 0, 14, {2, 5, 9, 11}, {495, 99, 11, 1},
         {715, 143, 13, 1}},
        // Rows of at least 32 elements take 32 lanes each (partial last pass of the lanes).
        {"narrow of rows of 70 in [3,4,80]", 3 * 4 * 80, 3 * 4 * 70, 5, 0, {3, 4, 70}, {320, 80, 1}, {280, 70, 1}},
        {"permute NCHW -> NHWC, 40 channels", 40 * 6, 40 * 6, 0, 0, {6, 40}, {1, 6}, {40, 1}},
        {"one row of 33", 33, 40, 0, 7, {33}, {1}, {1}},
        // Rows longer than a segment (2048): a whole contiguous tensor as one row, and rows of
        // two full segments and a partial one, between strided rows.
        {"one row of 5000 (three segments)", 5003, 5010, 3, 10, {5000}, {1}, {1}},
        {"two rows of 4100 in [2,4200]", 2 * 4200, 2 * 4100, 50, 0, {2, 4100}, {4200, 1}, {4100, 1}},
        {"a single element (rank 0)", 3, 3, 2, 1, {}, {}, {}},
    };
}

template <typename T>
void test_copy_box(Check& check, const char* name, void (*kernel)(const T*, T*, Box8, u64)) {
    for (const BoxCase& c : box_cases()) {
        const auto src = distinct<T>(c.src_len, 61);
        const auto init = distinct<T>(c.dst_len, 62);  // what the box must leave alone
        std::vector<T> want = init;
        u64 n = 1;
        for (const u64 e : c.extent) n *= e;
        // Odometer over the box.
        std::vector<u64> idx(c.extent.size(), 0);
        for (u64 count = 0; count < n; ++count) {
            i64 s = (i64)c.src_offset, d = (i64)c.dst_offset;
            for (std::size_t k = 0; k < idx.size(); ++k) s += (i64)idx[k] * c.src_stride[k], d += (i64)idx[k] * c.dst_stride[k];
            want[(std::size_t)d] = src[(std::size_t)s];
            for (std::size_t k = idx.size(); k-- > 0;) {
                if (++idx[k] < c.extent[k]) break;
                idx[k] = 0;
            }
        }
        const Box8 box = make_box(c.extent, c.src_stride, c.dst_stride);
        const u64 last = c.extent.empty() ? 1 : c.extent.back();
        for (const auto& s : streaming_shapes(n / last * ((last + 2047) / 2048) * (last >= 32 ? 32 : 1))) {
            std::vector<T> dst = init;
            emu::launch(name, kernel, s.grid, s.block, src.data() + c.src_offset, dst.data() + c.dst_offset, box, n);
            check.exact(std::string(c.name) + ", " + s.name, dst, want);
        }
    }
}

// A sentinel output that every kernel here overwrites completely.
template <typename T>
std::vector<T> unwritten(std::size_t n) {
    return std::vector<T>(n, Storage<T>::from_f32(-12345.0f));
}

template <typename T>
void test_upsample(Check& check, const char* name, void (*kernel)(const T*, T*, u64, u64, u64, u64)) {
    // planes, h, w, factor: rows shorter and longer than the 32 lanes, the paired stores of f = 2.
    const u64 cases[][4] = {{6, 5, 7, 3}, {2, 1, 4, 2}, {3, 4, 4, 1}, {2, 3, 45, 2}, {1, 2, 70, 3}};
    for (const auto& [planes, h, w, f] : cases) {
        const auto x = to_storage<T>(random_f32(planes * h * w, 63, -3.0f, 3.0f));
        const u64 oh = h * f, ow = w * f;
        std::vector<T> want(planes * oh * ow);
        for (u64 p = 0; p < planes; ++p)
            for (u64 y = 0; y < h; ++y)
                for (u64 xx = 0; xx < w; ++xx)
                    for (u64 dy = 0; dy < f; ++dy)
                        for (u64 dx = 0; dx < f; ++dx)
                            want[(p * oh + y * f + dy) * ow + xx * f + dx] = x[(p * h + y) * w + xx];
        const std::string what = std::to_string(planes) + "x" + std::to_string(h) + "x" + std::to_string(w) + " x" +
                                 std::to_string(f);
        for (const std::size_t off : {0, 1})  // an output off alignment: element stores
            for (const auto& s : streaming_shapes(planes * h * 32)) {
                auto out = unwritten<T>(want.size() + 1);
                emu::launch(name, kernel, s.grid, s.block, x.data(), out.data() + off, planes, h, w, f);
                const std::vector<T> got(out.begin() + (std::ptrdiff_t)off, out.begin() + (std::ptrdiff_t)(off + want.size()));
                check.exact(what + ", " + s.name + (off ? ", misaligned output" : ""), got, want);
                check.exact(what + ", " + s.name + ", untouched past the end", std::vector<T>{out[off ? 0 : want.size()]},
                            std::vector<T>{Storage<T>::from_f32(-12345.0f)});
            }
    }
}

// `[N, C, T, H, W]` with Wan2.2's factors.
struct VideoCase {
    u64 n, c, t, h, w, out_channels, ft, fs;
    bool first_chunk;

    std::string name() const {
        return std::to_string(n) + "x" + std::to_string(c) + "x" + std::to_string(t) + "x" + std::to_string(h) + "x" +
               std::to_string(w) + " -> " + std::to_string(out_channels) + " ch, ft " + std::to_string(ft) + ", fs " +
               std::to_string(fs) + (first_chunk ? ", first chunk" : "");
    }
};

// DupUp3D as ops/video.rs defines it: channels repeated (`repeat_interleave`), unfolded in the
// order (c_out, dt, dh, dw) into time and space; the first chunk drops `ft - 1` leading frames.
template <typename T>
void test_dup_up3d(Check& check, const char* name,
                   void (*kernel)(const T*, T*, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64)) {
    const VideoCase cases[] = {
        {2, 8, 2, 3, 5, 4, 2, 2, true}, {2, 8, 2, 3, 5, 4, 2, 2, false}, {1, 6, 3, 2, 3, 3, 2, 2, true},
        {1, 4, 1, 3, 3, 2, 1, 2, false}, {2, 16, 2, 2, 2, 8, 2, 2, true},
    };
    for (const VideoCase& c : cases) {
        const u64 unfolded = c.out_channels * c.ft * c.fs * c.fs, repeats = unfolded / c.c;
        const u64 drop = c.first_chunk && c.ft > 1 ? std::min(c.ft - 1, c.t * c.ft) : 0;
        const u64 to = c.t * c.ft - drop, ho = c.h * c.fs, wo = c.w * c.fs;
        const auto x = to_storage<T>(random_f32(c.n * c.c * c.t * c.h * c.w, 64, -3.0f, 3.0f));
        std::vector<T> want(c.n * c.out_channels * to * ho * wo);
        for (u64 b = 0; b < c.n; ++b)
            for (u64 j = 0; j < unfolded; ++j) {
                const u64 dw = j % c.fs, dh = j / c.fs % c.fs, dt = j / (c.fs * c.fs) % c.ft;
                const u64 o = j / (c.fs * c.fs * c.ft), src_c = j / repeats;
                for (u64 tt = 0; tt < c.t; ++tt)
                    for (u64 hh = 0; hh < c.h; ++hh)
                        for (u64 ww = 0; ww < c.w; ++ww) {
                            const u64 ot = tt * c.ft + dt;
                            if (ot < drop) continue;
                            want[(((b * c.out_channels + o) * to + ot - drop) * ho + hh * c.fs + dh) * wo + ww * c.fs +
                                 dw] = x[(((b * c.c + src_c) * c.t + tt) * c.h + hh) * c.w + ww];
                        }
            }
        for (const auto& s : grid_stride_shapes(want.size())) {
            auto out = unwritten<T>(want.size());
            emu::launch(name, kernel, s.grid, s.block, x.data(), out.data(), c.n, c.c, c.t, c.h, c.w, c.out_channels,
                        c.ft, c.fs, repeats, drop);
            check.exact(c.name() + ", " + s.name, out, want);
        }
    }
}

// AvgDown3D as ops/video.rs defines it: zero frames in front up to a multiple of `ft`, each
// `ft x fs x fs` block folded into channels (c, dt, dh, dw), groups of consecutive folded channels
// averaged: summed in f64 in channel order, divided, rounded to f32 (then to the storage type).
template <typename T>
void test_avg_down3d(Check& check, const char* name,
                     void (*kernel)(const T*, T*, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64)) {
    const VideoCase cases[] = {
        {1, 4, 3, 4, 6, 8, 2, 2, false},
        {2, 3, 4, 2, 4, 6, 2, 2, false},
        {1, 3, 5, 4, 2, 6, 1, 2, false},
        {1, 2, 5, 2, 2, 1, 4, 1, false},
    };
    for (const VideoCase& c : cases) {
        const u64 pad_t = (c.ft - c.t % c.ft) % c.ft, tp = c.t + pad_t;
        const u64 t2 = tp / c.ft, h2 = c.h / c.fs, w2 = c.w / c.fs;
        const u64 folded = c.c * c.ft * c.fs * c.fs, group = folded / c.out_channels;
        const auto x = to_storage<T>(random_f32(c.n * c.c * c.t * c.h * c.w, 65, -3.0f, 3.0f));
        const auto xv = values(x);
        // The zero-padded input, then the folded one.
        std::vector<double> padded(c.n * c.c * tp * c.h * c.w, 0.0);
        for (u64 b = 0; b < c.n; ++b)
            for (u64 ch = 0; ch < c.c; ++ch)
                for (u64 i = 0; i < c.t * c.h * c.w; ++i) {
                    padded[((b * c.c + ch) * tp + pad_t) * c.h * c.w + i] = xv[(b * c.c + ch) * c.t * c.h * c.w + i];
                }
        const u64 plane = t2 * h2 * w2;
        std::vector<double> fold(c.n * folded * plane);
        for (u64 b = 0; b < c.n; ++b)
            for (u64 ch = 0; ch < c.c; ++ch)
                for (u64 tt = 0; tt < tp; ++tt)
                    for (u64 hh = 0; hh < c.h; ++hh)
                        for (u64 ww = 0; ww < c.w; ++ww) {
                            const u64 k = ((ch * c.ft + tt % c.ft) * c.fs + hh % c.fs) * c.fs + ww % c.fs;
                            fold[(b * folded + k) * plane + (tt / c.ft * h2 + hh / c.fs) * w2 + ww / c.fs] =
                                padded[(((b * c.c + ch) * tp + tt) * c.h + hh) * c.w + ww];
                        }
        std::vector<T> want(c.n * c.out_channels * plane);
        for (u64 b = 0; b < c.n; ++b)
            for (u64 o = 0; o < c.out_channels; ++o)
                for (u64 p = 0; p < plane; ++p) {
                    double sum = 0.0;
                    for (u64 g = 0; g < group; ++g) sum += fold[(b * folded + o * group + g) * plane + p];
                    want[(b * c.out_channels + o) * plane + p] = Storage<T>::from_f32((float)(sum / (double)group));
                }
        for (const auto& s : grid_stride_shapes(want.size())) {
            auto out = unwritten<T>(want.size());
            emu::launch(name, kernel, s.grid, s.block, x.data(), out.data(), c.n, c.c, c.t, c.h, c.w, c.out_channels,
                        c.ft, c.fs, group, pad_t);
            check.exact(c.name() + ", " + s.name, out, want);
        }
    }
}

}  // namespace

KERNEL_TEST(copy_box_f32) { test_copy_box<float>(check, KERNEL(copy_box_f32)); }
KERNEL_TEST(copy_box_u16) { test_copy_box<u16>(check, KERNEL(copy_box_u16)); }
KERNEL_TEST(upsample_nearest2d_f32) { test_upsample<float>(check, KERNEL(upsample_nearest2d_f32)); }
KERNEL_TEST(upsample_nearest2d_bf16) { test_upsample<u16>(check, KERNEL(upsample_nearest2d_bf16)); }
KERNEL_TEST(dup_up3d_f32) { test_dup_up3d<float>(check, KERNEL(dup_up3d_f32)); }
KERNEL_TEST(dup_up3d_bf16) { test_dup_up3d<u16>(check, KERNEL(dup_up3d_bf16)); }
KERNEL_TEST(avg_down3d_f32) { test_avg_down3d<float>(check, KERNEL(avg_down3d_f32)); }
KERNEL_TEST(avg_down3d_bf16) { test_avg_down3d<u16>(check, KERNEL(avg_down3d_bf16)); }

// diffusers' blend_v / blend_h along the middle dimension of `[outer, len, inner]`: the first `e`
// rows of the current tile become `prev_row * w_prev + cur_row * w_cur` (each product rounded to
// f32, then the sum), the ramp's weights rounded from f64 as the planner's BlendRamp makes them;
// the rest of the tile and the previous tile stay as they are.
KERNEL_TEST(blend_leading_f32) {
    const u64 cases[][5] = {{3, 7, 9, 5, 4}, {6, 10, 6, 1, 6}, {2, 3, 5, 4, 3}, {1, 1, 1, 7, 1}};
    for (const auto& [outer, len_cur, len_prev, inner, e] : cases) {
        std::vector<float> w_prev(e), w_cur(e);
        for (u64 y = 0; y < e; ++y) {
            const double t = (double)y / (double)e;
            w_prev[y] = (float)(1.0 - t);
            w_cur[y] = (float)t;
        }
        const auto cur0 = random_f32(outer * len_cur * inner, 66, -2.0f, 2.0f);
        const auto prev = random_f32(outer * len_prev * inner, 67, -2.0f, 2.0f);
        std::vector<float> want = cur0;
        for (u64 o = 0; o < outer; ++o)
            for (u64 y = 0; y < e; ++y)
                for (u64 i = 0; i < inner; ++i) {
                    const float a = prev[(o * len_prev + len_prev - e + y) * inner + i] * w_prev[y];
                    const float b = cur0[(o * len_cur + y) * inner + i] * w_cur[y];
                    want[(o * len_cur + y) * inner + i] = a + b;
                }
        const std::string what = std::to_string(outer) + "x" + std::to_string(len_cur) + "x" + std::to_string(inner) +
                                 ", e " + std::to_string(e);
        for (const auto& s : grid_stride_shapes(outer * e * inner)) {
            std::vector<float> cur = cur0, prev_copy = prev;
            EMU_LAUNCH(blend_leading_f32, s.grid, s.block, cur.data(), prev_copy.data(), w_prev.data(), w_cur.data(),
                       outer, len_cur, len_prev, inner, e);
            check.exact(what + ", " + s.name, cur, want);
            check.exact(what + ", previous tile, " + s.name, prev_copy, prev);
        }
    }
}
