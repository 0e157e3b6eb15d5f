// What the convolution kernels share (conv.cu, and conv_sm90a.cu for Hopper's warpgroup MMA):
// the geometry the backend passes, the zero-padded channels-last operands and the loader that
// streams their K slices into shared memory, 64 bytes per row in the 64-byte swizzle.
#pragma once

#include "common.cuh"
#include "ptx.cuh"

struct ConvGeom {
    u64 n, cin, t, h, w;
    u64 cout, kt, kh, kw;
    u64 to, ho, wo;
    u64 stride_t, stride;
    i64 pad_front, pad_top, pad_left;
};

// ---------------------------------------------------------------------------------------------
// The tensor-core pipeline. The input is first copied into a zero-padded channels-last buffer
// `xp[N, Tp, Hp, Wp, Cp]` (the padding materialised, channels rounded up to a whole 16-byte
// chunk with zeros) and the weights into `wr[Cout, kt, kh, kw, Cp]`. Then every GEMM K slice is
// one tap (dt, dy, dx) and 64 bytes of consecutive channels (32 bf16 or 16 f32): for an output
// pixel, 64 contiguous bytes of `xp` at a per-pixel origin plus a per-tap offset, with no bounds
// checks and no divisions in the K loop; four 16-byte `cp.async` copies. This is what lets the
// loads keep up with the tensor cores (a wmma kernel that gathered every element with its own
// index arithmetic ran at 12 TFLOP/s on an H200). Written once over the storage type T.
// ---------------------------------------------------------------------------------------------

// A 16-byte chunk holds Wide<T>::N elements (common.cuh: 8 bf16, 4 f32); a K slice is four chunks.

// The padded channels-last geometry of a convolution's input.
struct Padded {
    u64 tp, hp, wp;
    unsigned cp;
};

template <typename T>
__device__ __forceinline__ Padded padded_of(const ConvGeom& g) {
    const u64 e = (unsigned)Wide<T>::N;
    return Padded{(g.to - 1) * g.stride_t + g.kt, (g.ho - 1) * g.stride + g.kh, (g.wo - 1) * g.stride + g.kw,
                  (unsigned)((g.cin + e - 1) / e * e)};
}

#define TC_THREADS 256

// Shared-memory rows are 64 bytes = four 16-byte chunks; chunk c of row r is stored at
// c ^ ((r >> 1) & 3), so the eight rows an `ldmatrix` reads at one logical chunk fall in eight
// different bank groups (unswizzled, rows 64 bytes apart would conflict four ways). On a region
// that starts at a multiple of 512 bytes this is the hardware's 64-byte swizzle (address bits 4-5
// XOR bits 7-8), the K-major layout `wgmma` reads through a descriptor (conv_sm90a.cu).
__device__ __forceinline__ unsigned swizzled(unsigned row, unsigned chunk) {
    return row * 64 + ((chunk ^ ((row >> 1) & 3)) * 16);
}

// The copies of one thread, stage after stage. Everything that does not change along K is fixed
// once: the thread's chunk (t % 4) of weight rows t / 4 (+ 64, + 128, ...), its half (t % 2) of
// both 32-byte sectors of pixel t / 2 (+ 128 where BN = 256), their source rows and their
// swizzled places in a stage. The two lanes of a pixel read one whole sector per copy
// instruction (a lane reading one 16-byte half of each of two sectors made L2 send every sector
// twice). Along K only the tap (dt, dy, dx) and the channel offset c0 advance, incrementally (the
// K loop is short of issue slots: no divisions, no 64-bit multiplies per step).
template <typename T, int MT, int BN>
struct TcLoader {
    static constexpr int BM = 32 * MT;
    static constexpr int A_COPIES = (BM * 4 + TC_THREADS - 1) / TC_THREADS;
    static constexpr int PIXELS = BN / (TC_THREADS / 2);
    static constexpr unsigned E = (unsigned)Wide<T>::N;

    const T* a_row[A_COPIES];  // weight row (at tap 0, this thread's chunk), or null
    unsigned a_chunk, a_smem[A_COPIES];
    const T* b_pixel[PIXELS];  // the receptive field's origin in xp, or null
    unsigned b_half, b_smem[PIXELS][2];
    // The K position of the next step to load: tap (dt, dy, dx) and channel c0; the tap's
    // offsets into a weight row and (relative to the pixel's origin) into xp.
    unsigned dt, dy, dx, c0;
    u64 a_tap, b_tap;

    __device__ __forceinline__ TcLoader(const T* xp, const T* wr, const ConvGeom& g, const Padded& p, unsigned m0,
                                        u64 n0, u64 n_cols) {
        const u64 ktot = g.kt * g.kh * g.kw * (u64)p.cp;
        a_chunk = threadIdx.x & 3;
#pragma unroll
        for (int q = 0; q < A_COPIES; ++q) {
            const unsigned row = (threadIdx.x + q * TC_THREADS) >> 2;
            const bool ok = row < BM && m0 + row < g.cout;
            a_row[q] = ok ? wr + (u64)(m0 + row) * ktot + a_chunk * E : nullptr;
            a_smem[q] = swizzled(row < BM ? row : 0, a_chunk);
        }
        b_half = threadIdx.x & 1;
#pragma unroll
        for (int k = 0; k < PIXELS; ++k) {
            const unsigned pixel = (threadIdx.x >> 1) + k * (TC_THREADS / 2);
            const u64 col = n0 + pixel;
            b_pixel[k] = nullptr;
            if (col < n_cols) {
                const u64 wo = col % g.wo, ho = (col / g.wo) % g.ho, to = (col / (g.wo * g.ho)) % g.to;
                const u64 b = col / (g.wo * g.ho * g.to);
                b_pixel[k] =
                    xp + (((b * p.tp + to * g.stride_t) * p.hp + ho * g.stride) * p.wp + wo * g.stride) * p.cp;
            }
#pragma unroll
            for (unsigned q = 0; q < 2; ++q) b_smem[k][q] = swizzled(pixel, 2 * q + b_half);
        }
        dt = dy = dx = c0 = 0;
        a_tap = b_tap = 0;
    }

    // Issues the copies of the next K step into `stage` and advances to the one after.
    __device__ __forceinline__ void load(unsigned char* stage, const T* xp, const T* wr, const ConvGeom& g,
                                         const Padded& p) {
        unsigned char* As = stage;
        unsigned char* Bs = stage + BM * 64;
        const bool a_in = c0 + a_chunk * E < p.cp;
#pragma unroll
        for (int q = 0; q < A_COPIES; ++q) {
            if (q * TC_THREADS + threadIdx.x >= BM * 4) break;
            const bool ok = a_row[q] && a_in;
            cp_async_16(As + a_smem[q], ok ? a_row[q] + a_tap + c0 : wr, ok);
        }
#pragma unroll
        for (int k = 0; k < PIXELS; ++k)
#pragma unroll
            for (unsigned q = 0; q < 2; ++q) {
                const unsigned c = c0 + (2 * q + b_half) * E;
                const bool ok = b_pixel[k] && c < p.cp;
                cp_async_16(Bs + b_smem[k][q], ok ? b_pixel[k] + b_tap + c : xp, ok);
            }
        c0 += 4 * E;
        if (c0 >= p.cp) {
            c0 = 0;
            a_tap += p.cp;
            if (++dx == g.kw) {
                dx = 0;
                if (++dy == g.kh) {
                    dy = 0;
                    ++dt;
                }
            }
            b_tap = (((u64)dt * p.hp + dy) * p.wp + dx) * p.cp;
        }
    }
};

