// Shared helpers of the vae-parallel kernels. Every kernel is `extern "C"` (stable names for
// the module loader), indexes with 64-bit integers (a 480x832x96-channel video activation
// passes 2^31 elements) and walks its range with a grid-stride loop, so any launch size is
// correct and the host picks one for occupancy alone.
#pragma once

typedef unsigned long long u64;
typedef long long i64;

// bf16 as raw bits: the elementwise kernels need no CUDA header, and the rounding is spelled
// out (round to nearest even, NaN kept quiet), the same as PyTorch's `float -> bfloat16`.
__device__ __forceinline__ float bf16_to_f32(unsigned short b) {
    return __uint_as_float(((unsigned int)b) << 16);
}

__device__ __forceinline__ unsigned short f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (unsigned short)((u >> 16) | 0x0040u);  // quiet NaN
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

// Storage-type-generic access: every kernel with a bf16 variant computes in f32 and rounds once
// when it stores (`unsigned short` holds bf16 bits).
__device__ __forceinline__ float load_f32(const float* p) { return *p; }
__device__ __forceinline__ float load_f32(const unsigned short* p) { return bf16_to_f32(*p); }
__device__ __forceinline__ void store_f32(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_f32(unsigned short* p, float v) { *p = f32_to_bf16(v); }

// -inf without <math.h> (NVRTC has no standard headers).
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float silu(float x) {
    return x / (1.0f + __expf(-x));
}

#define GRID_STRIDE(i, n) \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (u64)(n); i += (u64)blockDim.x * gridDim.x)

// Block-wide sum of one value per thread (blockDim.x a multiple of 32, at most 1024); every
// thread gets the result. `scratch` holds 32 values of shared memory. f32 for softmax, f64 for
// statistics that must not lose precision over millions of elements.
template <typename T>
__device__ __forceinline__ T block_sum(T v, T* scratch) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    const int warps = (blockDim.x + 31) >> 5;
    v = lane < warps ? scratch[lane] : T(0);
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    const int warps = (blockDim.x + 31) >> 5;
    v = lane < warps ? scratch[lane] : NEG_INF;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// The register tiling shared by the f32 GEMM and the f32 implicit-GEMM conv: 256 threads own a
// 64x64 output tile, thread (tx, ty) = (t % 16, t / 16) a 4x4 block of it. One call adds a
// `bk`-deep slice held in shared memory as `As[k][row]` and `Bs[k][col]` (rows padded to `LD`).
template <int LD>
__device__ __forceinline__ void fma_tile_4x4(const float (*As)[LD], const float (*Bs)[LD], int bk, float acc[4][4],
                                             int tx, int ty) {
#pragma unroll
    for (int kk = 0; kk < bk; ++kk) {
        float a[4], b[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) a[r] = As[kk][ty * 4 + r];
#pragma unroll
        for (int c = 0; c < 4; ++c) b[c] = Bs[kk][tx * 4 + c];
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[r][c] = fmaf(a[r], b[c], acc[r][c]);
    }
}

// ---- Vectorised access for the memory-bound kernels (elementwise, norms, layout) ----
// A memory-bound kernel reaches the device's bandwidth only with wide accesses: one 16-byte
// load or store moves 4 f32 or 8 bf16 elements in one instruction. `Pack<B>` is B bytes (8 or 16)
// as 32-bit words; `pack_load` / `pack_store` need `p` aligned to B bytes (the callers check with
// `aligned`), and element k of a pack is read and written as f32 whatever the storage type.
template <int B>
struct __align__(B) Pack {
    unsigned int w[B / 4];
};

__device__ __forceinline__ bool aligned(const void* p, int bytes) {
    return ((unsigned long long)p & (unsigned long long)(bytes - 1)) == 0;
}

template <int B>
__device__ __forceinline__ Pack<B> pack_load(const void* p) {
#ifdef __CUDA_ARCH__
    return *reinterpret_cast<const Pack<B>*>(p);
#else  // the CPU emulator: no aliasing through the struct, and a misaligned access fails as on the GPU
    if (!aligned(p, B)) ::emu::fail("misaligned %d-byte load", B);
    Pack<B> v;
    std::memcpy(&v, p, B);
    return v;
#endif
}

template <int B>
__device__ __forceinline__ void pack_store(void* p, const Pack<B>& v) {
#ifdef __CUDA_ARCH__
    *reinterpret_cast<Pack<B>*>(p) = v;
#else
    if (!aligned(p, B)) ::emu::fail("misaligned %d-byte store", B);
    std::memcpy(p, &v, B);
#endif
}

// Elements of T in 16 bytes (4 f32, 8 bf16): one widest access, one `cp.async` chunk.
template <typename T>
struct Wide {
    static constexpr int N = 16 / (int)sizeof(T);
};

// Element k of a pack as f32 (k a constant after unrolling, so these are register moves).
// `pack_set` writes into a zeroed pack.
__device__ __forceinline__ float pack_get(const unsigned int* w, int k, const float*) { return __uint_as_float(w[k]); }
__device__ __forceinline__ float pack_get(const unsigned int* w, int k, const unsigned short*) {
    return bf16_to_f32((unsigned short)(k & 1 ? w[k >> 1] >> 16 : w[k >> 1] & 0xffffu));
}
__device__ __forceinline__ void pack_set(unsigned int* w, int k, float v, const float*) { w[k] = __float_as_uint(v); }
__device__ __forceinline__ void pack_set(unsigned int* w, int k, float v, const unsigned short*) {
    const unsigned int b = f32_to_bf16(v);  // into a zeroed pack: the two halves of a word are ORed in
    w[k >> 1] |= k & 1 ? b << 16 : b;
}

// Grid-stride over `units` with a thread's first unit and the stride, as 64-bit counters (a
// video activation passes 2^31 elements); no division anywhere.
#define GRID_STRIDE_FROM(i, first, n) \
    for (u64 i = (u64)(first) + (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (u64)(n); i += (u64)blockDim.x * gridDim.x)
