// Emulator stand-in for CUDA's <mma.h>: `nvcuda::wmma` for bf16 inputs and f32 accumulation,
// row-major operands (what conv3d_bf16_wmma uses; anything else fails to compile).
//
// On the GPU a fragment is spread over the 32 lanes of a warp. Here every lane holds the whole
// tile, which keeps each call's result independent of how the hardware distributes elements. The
// warp-collective contract is checked: all 32 lanes must call a load or a store with the same
// pointer and leading dimension, with the pointer 256-bit aligned and the leading dimension a
// multiple of 16 bytes, as the CUDA programming guide requires.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>

namespace nvcuda::wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};

enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
    static_assert((M == 16 && N == 16 && K == 16) || (M == 32 && N == 8 && K == 16) || (M == 8 && N == 32 && K == 16),
                  "not a bf16 wmma shape");
    static_assert(std::is_same_v<Use, accumulator> ? std::is_same_v<T, float> : std::is_same_v<T, __nv_bfloat16>,
                  "only bf16 operands with f32 accumulators are emulated");
    static_assert(std::is_same_v<Use, accumulator> || std::is_same_v<Layout, row_major>,
                  "only row-major operands are emulated");
    // A is M x K, B is K x N, the accumulator M x N; row-major.
    static constexpr int rows = std::is_same_v<Use, matrix_b> ? K : M;
    static constexpr int cols = std::is_same_v<Use, matrix_a> ? K : N;
    static constexpr int num_elements = rows * cols;
    T x[num_elements];
};

namespace detail {

// The arguments every lane of a warp must agree on.
struct MemArgs {
    const void* ptr;
    unsigned ldm;
    int layout;
};

template <typename T>
inline void check_and_agree(const char* op, const T* p, unsigned ldm, int layout) {
    if ((std::uintptr_t)p % 32 != 0) ::emu::fail("%s: pointer %p is not 256-bit aligned", op, (const void*)p);
    if (ldm * sizeof(T) % 16 != 0) ::emu::fail("%s: leading dimension %u is not a multiple of 16 bytes", op, ldm);
    const MemArgs args{p, ldm, layout};
    ::emu::warp_collective(op, &args, sizeof args);
}

}  // namespace detail

template <typename Use, int M, int N, int K, typename T, typename Layout>
inline void fill_fragment(fragment<Use, M, N, K, T, Layout>& f, const T& v) {
    for (auto& e : f.x) e = v;
}

template <typename Use, int M, int N, int K, typename Layout>
inline void load_matrix_sync(fragment<Use, M, N, K, __nv_bfloat16, Layout>& f, const __nv_bfloat16* p,
                             unsigned ldm) {
    using F = fragment<Use, M, N, K, __nv_bfloat16, Layout>;
    detail::check_and_agree("load_matrix_sync", p, ldm, mem_row_major);
    for (int r = 0; r < F::rows; ++r)
        for (int c = 0; c < F::cols; ++c) f.x[r * F::cols + c] = p[(std::size_t)r * ldm + c];
}

// `d = a b + c`: products of bf16 values are exact in f32, summed in f32 in k order (the tensor
// cores' order and intermediate precision differ within f32 rounding). `d` may be `c`.
template <int M, int N, int K>
inline void mma_sync(fragment<accumulator, M, N, K, float>& d,
                     const fragment<matrix_a, M, N, K, __nv_bfloat16, row_major>& a,
                     const fragment<matrix_b, M, N, K, __nv_bfloat16, row_major>& b,
                     const fragment<accumulator, M, N, K, float>& c) {
    float out[M * N];
    for (int i = 0; i < M * N; ++i) out[i] = c.x[i];
    for (int i = 0; i < M; ++i)
        for (int k = 0; k < K; ++k) {
            const float av = (float)a.x[i * K + k];
            for (int j = 0; j < N; ++j) out[i * N + j] += av * (float)b.x[k * N + j];
        }
    for (int i = 0; i < M * N; ++i) d.x[i] = out[i];
}

// One lane writes the tile (every lane holds the same one) between two warp barriers, so no lane
// reads the destination before the whole warp has stored it.
template <int M, int N, int K>
inline void store_matrix_sync(float* p, const fragment<accumulator, M, N, K, float>& f, unsigned ldm,
                              layout_t layout) {
    if (layout != mem_row_major) ::emu::fail("store_matrix_sync: only mem_row_major is emulated");
    detail::check_and_agree("store_matrix_sync", p, ldm, layout);
    if (::emu::lane_id() == 0) {
        for (int r = 0; r < M; ++r)
            for (int c = 0; c < N; ++c) p[(std::size_t)r * ldm + c] = f.x[r * N + c];
    }
    ::emu::sync_warp("store_matrix_sync");
}

}  // namespace nvcuda::wmma
