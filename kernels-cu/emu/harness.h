// The test harness of the kernel emulator: a registry with one test per kernel, deterministic
// data, independent bf16 rounding, launch configurations, and element-wise comparisons.
//
// A test file `test_<stem>.cpp` includes `<stem>.cu` and defines `KERNEL_TEST(name) { ... }` for
// each of its kernels; `cargo xtask kernels-emu` fails on a kernel without one.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "launch.h"

namespace emu_test {

// What one kernel's test found: the cases it ran and a line per failed one.
class Check {
public:
    // `got[i]` within `bound[i]` of `want[i]`; a NaN matches a NaN, an infinity only itself.
    void near(const std::string& what, const std::vector<double>& got, const std::vector<double>& want,
              const std::vector<double>& bound);
    // The same with `bound[i] = atol + rtol * |want[i]|`.
    void near(const std::string& what, const std::vector<double>& got, const std::vector<double>& want, double atol,
              double rtol);
    // Bit for bit (signed zeros and NaN payloads included).
    void exact(const std::string& what, const std::vector<float>& got, const std::vector<float>& want);
    void exact(const std::string& what, const std::vector<std::uint16_t>& got, const std::vector<std::uint16_t>& want);

    int cases() const { return cases_; }
    const std::vector<std::string>& failures() const { return failures_; }

private:
    template <typename T>
    void exact_bits(const std::string& what, const std::vector<T>& got, const std::vector<T>& want);
    void failed(std::string line);

    int cases_ = 0;
    std::vector<std::string> failures_;
};

using TestFn = void (*)(Check&);

struct Test {
    const char* kernel;
    TestFn fn;
};

std::vector<Test>& registry();

struct Register {
    Register(const char* kernel, TestFn fn) { registry().push_back({kernel, fn}); }
};

// The test of kernel `kernel` (which must be declared: the file includes its .cu).
#define KERNEL_TEST(kernel)                                                                       \
    static_assert(std::is_function_v<decltype(kernel)>, #kernel " is not a kernel");             \
    static void test_##kernel(::emu_test::Check& check);                                          \
    static const ::emu_test::Register register_##kernel(#kernel, test_##kernel);                  \
    static void test_##kernel(::emu_test::Check& check)

// A kernel's name and its function, for the launch helpers: `KERNEL(add_f32)`.
#define KERNEL(kernel) #kernel, kernel

// splitmix64: the same data on every machine and compiler.
class Rng {
public:
    explicit Rng(std::uint64_t seed) : s_(seed) {}
    std::uint64_t next();
    // Uniform in [lo, hi), rounded to f32.
    float uniform(float lo, float hi);

private:
    std::uint64_t s_;
};

std::vector<float> random_f32(std::size_t n, std::uint64_t seed, float lo = -1.0f, float hi = 1.0f);

// bf16 by an independent route: the two neighbouring bf16 values of `x`, compared in f64 (ties
// to the even one, values from the midpoint below 2^128 up to infinity), rather than the bit
// trick of common.cuh. Any NaN gives the quiet NaN with the same sign and top payload bits.
std::uint16_t bf16_from_f32(float x);
// The value of bf16 bits, built from sign, exponent and significand with ldexp.
double bf16_value(std::uint16_t b);

// Storage types as the kernels spell them: `float`, and bf16 bits in `unsigned short`.
template <typename T>
struct Storage;

template <>
struct Storage<float> {
    static constexpr const char* name = "f32";
    // Relative error of rounding a result to the storage type.
    static constexpr double rounding = 0.0;
    static float from_f32(float v) { return v; }
    static double value(float v) { return v; }
};

template <>
struct Storage<std::uint16_t> {
    static constexpr const char* name = "bf16";
    static constexpr double rounding = 1.0 / 256.0;
    static std::uint16_t from_f32(float v) { return bf16_from_f32(v); }
    static double value(std::uint16_t v) { return bf16_value(v); }
};

template <typename T>
std::vector<T> to_storage(const std::vector<float>& v) {
    std::vector<T> out(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) out[i] = Storage<T>::from_f32(v[i]);
    return out;
}

template <typename T>
std::vector<double> values(const std::vector<T>& v) {
    std::vector<double> out(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) out[i] = Storage<T>::value(v[i]);
    return out;
}

// The 1-D grid-stride launch of the Rust backend (`elementwise()` in cuda/backend/storage.rs): 256
// threads, one per element, between 1 and 2^20 blocks.
dim3 elementwise_grid(std::uint64_t n);

struct LaunchShape {
    const char* name;
    dim3 grid, block;
};

// Launches a grid-stride kernel must give the same result under: the backend's, a grid far too
// small (every thread loops), a block size that is no multiple of the warp size, and the largest
// block.
std::vector<LaunchShape> grid_stride_shapes(std::uint64_t n);

// The backend's launch of the memory-bound kernels over `units` work items (`streaming()` in
// cuda/backend/device.rs, on the fake driver's 132 SMs): blocks of 256, at most 32 per SM.
dim3 streaming_grid(std::uint64_t units);

// `grid_stride_shapes` with the backend's streaming launch over `units` first.
std::vector<LaunchShape> streaming_shapes(std::uint64_t units);

// A number as %g prints it, for case names.
std::string num(double v);

// `x / (1 + e^-x)` in f64.
double silu_ref(double x);

}  // namespace emu_test
