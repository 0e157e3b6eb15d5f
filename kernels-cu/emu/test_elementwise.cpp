// elementwise.cu: each kernel under every grid-stride launch shape, on sizes that are no multiple
// of a block, a warp or a 16-byte pack (a tail after the packs), with NaN, infinities, signed
// zeros, subnormals and huge values mixed in, and with operands one element off 16-byte alignment
// (the element-by-element path; for add, one operand alone).
// Every kernel but SiLU has a defined result (f32 operations, then one rounding to the storage
// type), so those are compared bit for bit.
#include "elementwise.cu"

#include <iterator>

#include "harness.h"

namespace {

using namespace emu_test;
using u16 = std::uint16_t;

const std::uint64_t kSizes[] = {1000, 4099, 33, 1, 0};

// Uniform in [-scale, scale) with the special values scattered through.
std::vector<float> mixed_f32(std::size_t n, std::uint64_t seed, float scale) {
    auto v = random_f32(n, seed, -scale, scale);
    const float specials[] = {NAN, INFINITY, -INFINITY, 0.0f, -0.0f, 3.0e38f, -1e-40f, 1000.0f, -1000.0f};
    for (std::size_t i = 0; i < std::size(specials) && i < n; ++i) v[(i * 37 + 5) % n] = specials[i];
    return v;
}

// A copy of `v` that starts `off` elements into its buffer (vectors are 16-byte aligned, so
// `off = 1` misaligns every 16-byte access), with sentinels around it that must survive.
template <typename T>
struct At {
    std::vector<T> buf;
    std::size_t off, n;
    At(const std::vector<T>& v, std::size_t off_) : buf(v.size() + 2, Storage<T>::from_f32(-777.0f)), off(off_), n(v.size()) {
        std::copy(v.begin(), v.end(), buf.begin() + (std::ptrdiff_t)off);
    }
    T* ptr() { return buf.data() + off; }
    std::vector<T> get() const { return std::vector<T>(buf.begin() + (std::ptrdiff_t)off, buf.begin() + (std::ptrdiff_t)(off + n)); }
    bool pads_intact() const {
        const T pad = Storage<T>::from_f32(-777.0f);
        for (std::size_t i = 0; i < buf.size(); ++i)
            if ((i < off || i >= off + n) && std::memcmp(&buf[i], &pad, sizeof(T)) != 0) return false;
        return true;
    }
};

// A value no kernel writes, to see that an output was written exactly where expected.
template <typename T>
T sentinel() {
    return Storage<T>::from_f32(-12345.0f);
}

// Runs `launch(shape, out)` for every launch shape on a fresh copy of `init` and checks the
// result bit for bit against `want`.
// `launch(shape, out, off)` gets the output at element offset `off` (0 and 1) and puts its
// inputs at the same offset.
// The backend launches one thread per 16-byte pack of the output (4 elements for the casts).
template <typename T>
std::uint64_t packs(std::uint64_t n) {
    return (n + 16 / sizeof(T) - 1) / (16 / sizeof(T));
}

template <typename T, typename Launch>
void exact_all_shapes(Check& check, const std::string& what, std::uint64_t n, const std::vector<T>& init,
                      const std::vector<T>& want, Launch launch, std::uint64_t units = 0) {
    for (const std::size_t off : {0, 1})
        for (const auto& shape : streaming_shapes(units ? units : packs<T>(n))) {
            At<T> out(init, off);
            launch(shape, out.ptr(), off);
            const std::string name = what + ", " + shape.name + (off ? ", misaligned" : "");
            check.exact(name, out.get(), want);
            check.exact(name + ", padding", std::vector<T>{out.pads_intact() ? T(0) : T(1)}, std::vector<T>{T(0)});
        }
}

template <typename T>
void test_add(Check& check, const char* name, void (*kernel)(const T*, const T*, T*, u64)) {
    for (const std::uint64_t n : kSizes) {
        const auto a = to_storage<T>(mixed_f32(n, 1 + n, 4.0f));
        const auto b = to_storage<T>(random_f32(n, 2 + n, -4.0f, 4.0f));
        std::vector<T> want(n);
        for (std::size_t i = 0; i < n; ++i) {
            want[i] = Storage<T>::from_f32((float)Storage<T>::value(a[i]) + (float)Storage<T>::value(b[i]));
        }
        exact_all_shapes(check, "n " + std::to_string(n), n, std::vector<T>(n, sentinel<T>()), want,
                         [&](const LaunchShape& s, T* out, std::size_t off) {
                             At<T> da(a, off), db(b, off);
                             emu::launch(name, kernel, s.grid, s.block, da.ptr(), db.ptr(), out, n);
                         });
        // One operand off alignment, the others aligned: element by element.
        exact_all_shapes(check, "n " + std::to_string(n) + ", b alone misaligned", n,
                         std::vector<T>(n, sentinel<T>()), want, [&](const LaunchShape& s, T* out, std::size_t off) {
                             At<T> db(b, 1 - off);
                             emu::launch(name, kernel, s.grid, s.block, a.data(), db.ptr(), out, n);
                         });
    }
}

// `run(shape, x, n)` gives SiLU of `x` (in place or into a new vector); every result must also be
// bit-identical to the in-place kernel's on the aligned input (fused and separate paths agree).
template <typename T, typename Run>
void test_silu(Check& check, Run run) {
    for (const std::uint64_t n : kSizes) {
        const auto x = to_storage<T>(mixed_f32(n, 3 + n, 12.0f));
        std::vector<double> want(n), bound(n);
        for (std::size_t i = 0; i < n; ++i) {
            want[i] = silu_ref(Storage<T>::value(x[i]));
            // __expf is within about 1e-6 relative for these arguments; then the storage rounding.
            bound[i] = (1e-5 + Storage<T>::rounding) * std::fabs(want[i]) + 1e-37;
        }
        std::vector<T> first;
        for (const std::size_t off : {0, 1})
            for (const auto& s : streaming_shapes(packs<T>(n))) {
                At<T> in(x, off);
                const std::vector<T> y = run(s, in, n);
                const std::string what = "n " + std::to_string(n) + ", " + s.name + (off ? ", misaligned" : "");
                check.near(what, values(y), want, bound);
                if (first.empty()) first = y;
                check.exact(what + ", as the first launch", y, first);
            }
    }
}

template <typename T>
void test_silu_inplace(Check& check, const char* name, void (*kernel)(T*, u64)) {
    test_silu<T>(check, [&](const LaunchShape& s, At<T>& x, u64 n) {
        emu::launch(name, kernel, s.grid, s.block, x.ptr(), n);
        return x.get();
    });
}

template <typename T>
void test_silu_into(Check& check, const char* name, void (*kernel)(const T*, T*, u64)) {
    test_silu<T>(check, [&](const LaunchShape& s, At<T>& x, u64 n) {
        At<T> out(std::vector<T>(n, sentinel<T>()), x.off);
        emu::launch(name, kernel, s.grid, s.block, x.ptr(), out.ptr(), n);
        return x.pads_intact() && out.pads_intact() ? out.get() : std::vector<T>{};
    });
}

// PyTorch's clamp, as the CPU op: NaN stays NaN, `lo > hi` gives `hi` everywhere.
float clamp_ref(float x, float lo, float hi) {
    const float y = x < lo ? lo : x;
    return y > hi ? hi : y;
}

template <typename T>
void test_clamp(Check& check, const char* name, void (*kernel)(T*, u64, float, float)) {
    const float bounds[][2] = {{-0.5f, 0.75f}, {1.0f, 0.0f}, {-INFINITY, 2.0f}};
    for (const std::uint64_t n : kSizes) {
        const auto x = to_storage<T>(mixed_f32(n, 4 + n, 3.0f));
        for (const auto& [lo, hi] : bounds) {
            std::vector<T> want(n);
            for (std::size_t i = 0; i < n; ++i) want[i] = Storage<T>::from_f32(clamp_ref((float)Storage<T>::value(x[i]), lo, hi));
            const std::string what = "n " + std::to_string(n) + ", [" + num(lo) + ", " + num(hi) + "]";
            exact_all_shapes(check, what, n, x, want, [&](const LaunchShape& s, T* y, std::size_t) {
                emu::launch(name, kernel, s.grid, s.block, y, n, lo, hi);
            });
        }
    }
}

template <typename T>
void test_affine(Check& check, const char* name, void (*kernel)(const T*, T*, u64, float, float)) {
    // `add = -0.0` makes it exactly `x * mul` (how the backend scales), signed zeros included.
    const float params[][2] = {{0.5f, -0.25f}, {3.0f, -0.0f}, {-1.7f, 1e-3f}};
    for (const std::uint64_t n : kSizes) {
        const auto x = to_storage<T>(mixed_f32(n, 5 + n, 2.0f));
        for (const auto& [mul, add] : params) {
            std::vector<T> want(n);
            for (std::size_t i = 0; i < n; ++i) {
                const float product = (float)Storage<T>::value(x[i]) * mul;
                want[i] = Storage<T>::from_f32(product + add);
            }
            const std::string what = "n " + std::to_string(n) + ", x * " + num(mul) + " + " + num(add);
            exact_all_shapes(check, what, n, std::vector<T>(n, sentinel<T>()), want,
                             [&](const LaunchShape& s, T* out, std::size_t off) {
                                 At<T> dx(x, off);
                                 emu::launch(name, kernel, s.grid, s.block, dx.ptr(), out, n, mul, add);
                             });
        }
    }
}

template <typename T>
void test_channel_affine(Check& check, const char* name,
                         void (*kernel)(const T*, T*, const float*, const float*, u64, u64, u64)) {
    // [batch, channels, inner]
    const std::uint64_t dims[][3] = {{2, 5, 13}, {3, 7, 1}, {1, 1, 300}, {4, 33, 9}};
    for (const auto& [batch, channels, inner] : dims) {
        const std::uint64_t n = batch * channels * inner;
        const auto x = to_storage<T>(mixed_f32(n, 6 + n, 2.0f));
        const auto scale = random_f32(channels, 7 + channels, -2.0f, 2.0f);
        const auto shift = random_f32(channels, 8 + channels, -1.0f, 1.0f);
        std::vector<T> want(n);
        for (std::uint64_t b = 0; b < batch; ++b)
            for (std::uint64_t c = 0; c < channels; ++c)
                for (std::uint64_t s = 0; s < inner; ++s) {
                    const std::uint64_t i = (b * channels + c) * inner + s;
                    const float product = (float)Storage<T>::value(x[i]) * scale[c];
                    want[i] = Storage<T>::from_f32(product + shift[c]);
                }
        const std::string what =
            std::to_string(batch) + "x" + std::to_string(channels) + "x" + std::to_string(inner);
        exact_all_shapes(check, what, n, std::vector<T>(n, sentinel<T>()), want,
                         [&](const LaunchShape& s, T* out, std::size_t off) {
                             At<T> dx(x, off);
                             emu::launch(name, kernel, s.grid, s.block, dx.ptr(), out, scale.data(),
                                         shift.data(), channels, inner, n);
                         });
    }
}

}  // namespace

KERNEL_TEST(add_f32) { test_add<float>(check, KERNEL(add_f32)); }
KERNEL_TEST(add_bf16) { test_add<u16>(check, KERNEL(add_bf16)); }
KERNEL_TEST(silu_f32) { test_silu_inplace<float>(check, KERNEL(silu_f32)); }
KERNEL_TEST(silu_bf16) { test_silu_inplace<u16>(check, KERNEL(silu_bf16)); }
KERNEL_TEST(silu_into_f32) { test_silu_into<float>(check, KERNEL(silu_into_f32)); }
KERNEL_TEST(silu_into_bf16) { test_silu_into<u16>(check, KERNEL(silu_into_bf16)); }
KERNEL_TEST(clamp_f32) { test_clamp<float>(check, KERNEL(clamp_f32)); }
KERNEL_TEST(clamp_bf16) { test_clamp<u16>(check, KERNEL(clamp_bf16)); }
KERNEL_TEST(affine_f32) { test_affine<float>(check, KERNEL(affine_f32)); }
KERNEL_TEST(affine_bf16) { test_affine<u16>(check, KERNEL(affine_bf16)); }
KERNEL_TEST(channel_affine_f32) { test_channel_affine<float>(check, KERNEL(channel_affine_f32)); }
KERNEL_TEST(channel_affine_bf16) { test_channel_affine<u16>(check, KERNEL(channel_affine_bf16)); }

// Every f32 bit pattern class: random bits (all exponents, subnormals, NaNs), and the rounding
// edges: ties to even both ways, the largest finite values (one rounds to infinity), subnormal
// ties, signalling NaNs (must stay NaN, not become infinity).
KERNEL_TEST(cast_f32_bf16) {
    const std::uint32_t edges[] = {0x3f808000u, 0x3f818000u, 0x3f808001u, 0x3f807fffu, 0xbf808000u, 0xbf818000u,
                                   0x7f7fffffu, 0x7f7f7fffu, 0x7f7f8000u, 0xff7fffffu, 0x00008000u, 0x00018000u,
                                   0x80008000u, 0x7f800001u, 0xff800001u, 0x7fc00000u, 0x7f800000u, 0xff800000u,
                                   0x00000000u, 0x80000000u, 0x00000001u, 0x007fffffu};
    std::vector<float> x(4099);
    Rng rng(9);
    for (std::size_t i = 0; i < x.size(); ++i) {
        const std::uint32_t bits = i < std::size(edges) ? edges[i] : (std::uint32_t)rng.next();
        std::memcpy(&x[i], &bits, sizeof bits);
    }
    const std::uint64_t n = x.size();
    std::vector<u16> want(n);
    for (std::size_t i = 0; i < n; ++i) want[i] = bf16_from_f32(x[i]);
    exact_all_shapes(check, "4099 patterns", n, std::vector<u16>(n, 0x1234), want,
                     [&](const LaunchShape& s, u16* out, std::size_t off) {
                         At<float> dx(x, off);
                         EMU_LAUNCH(cast_f32_bf16, s.grid, s.block, dx.ptr(), out, n);
                     }, (n + 3) / 4);
}

// All 65536 bf16 patterns; a NaN keeps its payload (shifted), as PyTorch's widening does.
KERNEL_TEST(cast_bf16_f32) {
    const std::uint64_t n = 65536;
    std::vector<u16> x(n);
    std::vector<float> want(n);
    for (std::uint64_t i = 0; i < n; ++i) {
        x[i] = (u16)i;
        want[i] = (float)bf16_value((u16)i);
        if (std::isnan(want[i])) {
            const std::uint32_t bits = (std::uint32_t)i << 16;
            std::memcpy(&want[i], &bits, sizeof bits);
        }
    }
    exact_all_shapes(check, "65536 patterns", n, std::vector<float>(n, -1.0f), want,
                     [&](const LaunchShape& s, float* out, std::size_t off) {
                         At<u16> dx(x, off);
                         EMU_LAUNCH(cast_bf16_f32, s.grid, s.block, dx.ptr(), out, n);
                     }, (n + 3) / 4);
}
