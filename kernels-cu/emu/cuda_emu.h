// Host emulation of the CUDA C++ that the kernels in kernels-cu/ use, so the unchanged .cu files
// compile with g++ or clang++ and run on the CPU. Force-included (`-include`) before every
// translation unit of the emulator; `emu/include/ptx_emu.h` stands in for the inline PTX of
// kernels-cu/ptx.cuh (cp.async, ldmatrix, mma.sync).
//
// The model (see runtime.cpp): a launch runs its blocks one after another, in a shuffled order;
// every thread of the running block is an OS thread (or a fiber on the launching thread, with
// `emu::use_fibers`), so `__shared__` is plain static storage that all of them see, `__syncthreads()` is a real barrier of the block's threads, and warp
// operations (`__shfl_xor_sync`, ldmatrix and mma) are real exchanges among the 32 threads of a
// warp. What the emulator cannot see (timing, coalescing, bank conflicts, real warp scheduling,
// registers) stays for the GPU tests.
#pragma once

#include <math.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
// Checked by ptxas in `cargo xtask kernels`; here the launcher checks blockDim against the
// hardware limits only.
#define __launch_bounds__(...)
// One block runs at a time, so static storage is exactly "one copy per running block". It is not
// cleared between blocks: a kernel reading shared memory it did not write sees stale data here,
// garbage on the GPU.
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __restrict__ __restrict

struct uint3 {
    unsigned x, y, z;
};

struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

// Set by the launcher on every emulated thread before it enters the kernel. Defined here (inline)
// and of a trivial type: an `extern thread_local` of another translation unit is reached through
// an initialisation wrapper, which g++'s -fsanitize=null misreads as a null pointer.
inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local uint3 blockDim;
inline thread_local uint3 gridDim;

constexpr int warpSize = 32;

namespace emu {

// Reports a misuse the GPU would not survive either (a divergent barrier, a shuffle with absent
// lanes, a misaligned ldmatrix row) with the running kernel, block and thread, and aborts.
[[noreturn]] void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// `__syncthreads()`: waits for every live thread of the block. All of them must wait at the same
// call site (file, line), as on the GPU.
void sync_block(const char* file, int line);

// The calling thread's lane (0..31) within its warp.
int lane_id();

// A barrier of the calling thread's warp inside the warp-collective operation `op`; all 32 lanes
// must take part.
void sync_warp(const char* op);

// The start of a warp-collective operation `op`: every lane of a full warp must call it with the
// same `size` bytes at `args` (an operation's shared arguments); returns once
// all 32 lanes have arrived and agreed.
void warp_collective(const char* op, const void* args, std::size_t size);

// `__shfl_xor_sync` on raw bits: every lane of a full warp deposits `bits` and gets those of lane
// `lane ^ lane_mask`. Only the full mask and width 32 are emulated (all the kernels use).
std::uint64_t shfl_xor(unsigned mask, std::uint64_t bits, int lane_mask, int width);

// A full warp's exchange of `size` bytes per lane (at most 64): every lane deposits `mine` and
// gets all 32 deposits in lane order in `all` (the warp-collective PTX instructions of
// emu/include/ptx_emu.h are built on it: one exchange per instruction).
void warp_gather(const void* mine, std::size_t size, void* all);

// The calling thread's linear index within its block.
unsigned thread_linear();

// The running launch's dynamic shared memory (one block at a time, like `__shared__`); fails
// unless the launch gave at least `bytes`.
unsigned char* dynamic_shared(std::size_t bytes);

}  // namespace emu

// Kernels select the emulated forms of their inline PTX with this (see kernels-cu/ptx.cuh).
#define VAE_KERNELS_EMULATOR 1

#define __syncthreads() ::emu::sync_block(__FILE__, __LINE__)

template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = warpSize) {
    static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "shuffles move at most 8 bytes");
    std::uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    bits = ::emu::shfl_xor(mask, bits, lane_mask, width);
    T out;
    std::memcpy(&out, &bits, sizeof(T));
    return out;
}

inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, sizeof f);
    return f;
}

inline unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, sizeof u);
    return u;
}

inline int __float_as_int(float f) {
    int i;
    std::memcpy(&i, &f, sizeof i);
    return i;
}

// The device's `__expf` is `ex2.approx(x * log2(e))`: the product rounded to f32 first, which is
// where most of its error comes from; the emulation keeps that step.
inline float __expf(float x) { return exp2f(x * 1.44269504088896340736f); }

// IEEE single operations, never contracted into a fused multiply-add (the emulator is compiled
// with -ffp-contract=off, as these intrinsics promise on the device).
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }

// The device's `rsqrtf` is an approximation within 2 ulp; the exactly rounded value is one of
// the results it may give.
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
