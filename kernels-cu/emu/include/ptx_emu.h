// Emulator stand-in for the inline PTX of kernels-cu/ptx.cuh: asynchronous global-to-shared
// copies, `ldmatrix` and the bf16 `mma.sync` of shape m16n8k16, with their per-lane fragment
// layouts, so a kernel that gets a fragment index, a swizzle or a wait wrong fails here too.
//
// Asynchronous copies are deferred as on the GPU: `cp_async_16` reads its source at once but
// writes shared memory only when a `cp_async_wait<N>` retires its group, so a kernel that reads a
// stage before waiting for it reads stale data (the shared memory of the previous stage or block).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <vector>

namespace emu_ptx {

struct PendingCopy {
    void* dst;
    unsigned char bytes[16];
};

// One thread's copies: committed groups, oldest first, and the group being issued.
struct Pending {
    std::deque<std::vector<PendingCopy>> groups;
    std::vector<PendingCopy> open;
};

inline Pending g_pending[1024];

inline Pending& mine() { return g_pending[::emu::thread_linear()]; }

// Shared-memory writes not yet fenced for the async proxy (`fence.proxy.async`), per 16-byte chunk
// of dynamic shared memory: the writing thread + 1, or 0. A `wgmma` that reads such a chunk fails
// (emu/include/wgmma_emu.h). Each thread lists the chunks it marked, to clear them at its fence.
constexpr std::size_t kDynamicChunks = (227u << 10) / 16;
inline std::atomic<unsigned> g_unfenced[kDynamicChunks];
inline std::vector<std::size_t> g_marked[1024];

// Per 16-byte chunk of dynamic shared memory: how many `wgmma` products in flight read it (their
// warpgroups' first threads count them, see wgmma_emu.h). A copy issued into such a chunk races
// with the product and fails.
inline std::atomic<unsigned> g_read_in_flight[kDynamicChunks];

// The dynamic shared-memory chunk of `p`, or kDynamicChunks outside it.
inline std::size_t dynamic_chunk(const void* p) {
    const auto base = (std::uintptr_t)::emu::dynamic_shared(0), at = (std::uintptr_t)p;
    return at < base || at >= base + kDynamicChunks * 16 ? kDynamicChunks : (at - base) / 16;
}

// Marks a landed copy to `dst` as unfenced when it is in dynamic shared memory.
inline void landed(const void* dst) {
    const std::size_t chunk = dynamic_chunk(dst);
    if (chunk == kDynamicChunks) return;
    const unsigned me = ::emu::thread_linear();
    g_unfenced[chunk].store(me + 1, std::memory_order_relaxed);
    auto& marked = g_marked[me];
    // Kernels without async-proxy readers never fence: keep their lists bounded (their marks stay
    // until a later copy to the same chunk replaces them).
    if (marked.size() >= 4096) marked.clear();
    marked.push_back(chunk);
}

// One lane's operand registers of an mma, exchanged across the warp in one step.
struct Operands {
    unsigned a[4];
    unsigned b[2];
};

inline float bf16_value(unsigned reg, int half) {
    const unsigned bits = ((reg >> (16 * half)) & 0xffffu) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

// This lane's accumulators of an m16n8 product over `K`, `A(row, k)` and `B(k, col)` read from
// the gathered fragments: c0, c1 = C[g][2t, 2t+1], c2, c3 = C[g+8][2t, 2t+1] (g = lane / 4,
// t = lane % 4), each summed in k order in f32.
template <int K, typename FA, typename FB>
inline void accumulate(float c[4], const FA& A, const FB& B) {
    const int lane = ::emu::lane_id(), g = lane / 4, t = lane % 4;
    for (int q = 0; q < 4; ++q) {
        const int row = g + (q >= 2 ? 8 : 0), col = 2 * t + (q % 2);
        float sum = c[q];
        for (int k = 0; k < K; ++k) sum += A(row, k) * B(k, col);
        c[q] = sum;
    }
}

}  // namespace emu_ptx

// The block's dynamic shared memory (the launch's bytes, not cleared between blocks), which
// must hold `bytes`: the emulator fails where the GPU would trap.
inline unsigned char* dynamic_shared(unsigned bytes) { return ::emu::dynamic_shared(bytes); }

// `cp.async.cg.shared.global [smem], [gmem], 16, full ? 16 : 0`: 16 bytes, or 16 zero bytes
// (the source is then not read).
inline void cp_async_16(void* smem, const void* gmem, bool full) {
    if ((std::uintptr_t)smem % 16 != 0 || (full && (std::uintptr_t)gmem % 16 != 0)) {
        ::emu::fail("cp.async of 16 bytes between unaligned addresses %p <- %p", smem, gmem);
    }
    const std::size_t chunk = emu_ptx::dynamic_chunk(smem);
    if (chunk != emu_ptx::kDynamicChunks && emu_ptx::g_read_in_flight[chunk].load(std::memory_order_relaxed) != 0) {
        ::emu::fail("cp.async into shared memory that a wgmma in flight reads (wait for its group first)");
    }
    emu_ptx::PendingCopy c{smem, {}};
    if (full) std::memcpy(c.bytes, gmem, 16);
    emu_ptx::mine().open.push_back(c);
}

// `cp.async.commit_group`.
inline void cp_async_commit() {
    auto& p = emu_ptx::mine();
    p.groups.push_back(std::move(p.open));
    p.open.clear();
}

// `cp.async.wait_group N`: every committed group but the newest `N` has landed.
template <int N>
inline void cp_async_wait() {
    auto& p = emu_ptx::mine();
    while (p.groups.size() > (std::size_t)N) {
        for (const auto& c : p.groups.front()) {
            std::memcpy(c.dst, c.bytes, 16);
            emu_ptx::landed(c.dst);
        }
        p.groups.pop_front();
    }
}

// `ldmatrix.sync.aligned.m8n8.x4.shared.b16`: lanes 8i..8i+7 give the rows of matrix i; lane l
// gets, of each matrix i, the two 16-bit elements (l % 4) * 2, +1 of row l / 4 in `r[i]`.
inline void ldmatrix_x4(unsigned r[4], const void* row) {
    if ((std::uintptr_t)row % 16 != 0) ::emu::fail("ldmatrix: row address %p is not 16-byte aligned", row);
    const void* rows[32];
    ::emu::warp_gather(&row, sizeof row, rows);
    const int lane = ::emu::lane_id();
    for (int i = 0; i < 4; ++i) {
        const auto* src = (const std::uint16_t*)rows[i * 8 + lane / 4];
        r[i] = (unsigned)src[(lane % 4) * 2] | ((unsigned)src[(lane % 4) * 2 + 1] << 16);
    }
}

// `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`, `c += a b`, with PTX's fragments (g =
// lane / 4, t = lane % 4): a0 = A[g][2t..], a1 = A[g+8][2t..], a2 = A[g][2t+8..],
// a3 = A[g+8][2t+8..]; b0 = B[2t..][g], b1 = B[2t+8..][g]; c0, c1 = C[g][2t, 2t+1],
// c2, c3 = C[g+8][2t, 2t+1]. Products of bf16 are exact in f32; the sum runs in k order in f32
// (the tensor cores' order and intermediate precision differ within f32 rounding).
inline void mma_bf16_16816(float c[4], const unsigned a[4], const unsigned b[2]) {
    const emu_ptx::Operands mine{{a[0], a[1], a[2], a[3]}, {b[0], b[1]}};
    emu_ptx::Operands all[32];
    ::emu::warp_gather(&mine, sizeof mine, all);
    auto A = [&](int r, int k) {
        const int reg = (r >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0), lane = (r % 8) * 4 + (k % 8) / 2;
        return emu_ptx::bf16_value(all[lane].a[reg], k % 2);
    };
    auto B = [&](int k, int n) {
        const int lane = n * 4 + (k % 8) / 2;
        return emu_ptx::bf16_value(all[lane].b[k >= 8 ? 1 : 0], k % 2);
    };
    emu_ptx::accumulate<16>(c, A, B);
}

// `cvt.rna.tf32.f32`: 10 mantissa bits, to nearest with ties away from zero; the low 13 bits of
// the result are zero. NaN and infinity pass unchanged.
inline unsigned to_tf32(float x) {
    unsigned u;
    std::memcpy(&u, &x, sizeof u);
    if ((u & 0x7f800000u) == 0x7f800000u) return u;
    return (u + 0x1000u) & ~0x1fffu;
}

// `mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32`, `c += a b` (g = lane / 4, t = lane % 4):
// a0 = A[g][t], a1 = A[g+8][t], a2 = A[g][t+4], a3 = A[g+8][t+4]; b0 = B[t][g], b1 = B[t+4][g];
// c as for the bf16 shape. The tensor cores read only the TF32 bits of each operand (the low 13
// bits are ignored); products of TF32 values are exact in f32, summed in k order in f32.
inline void mma_tf32_1688(float c[4], const unsigned a[4], const unsigned b[2]) {
    const emu_ptx::Operands mine{{a[0], a[1], a[2], a[3]}, {b[0], b[1]}};
    emu_ptx::Operands all[32];
    ::emu::warp_gather(&mine, sizeof mine, all);
    auto value = [](unsigned bits) {
        bits &= ~0x1fffu;
        float f;
        std::memcpy(&f, &bits, sizeof f);
        return f;
    };
    auto A = [&](int r, int k) { return value(all[(r % 8) * 4 + k % 4].a[(r >= 8 ? 1 : 0) + (k >= 4 ? 2 : 0)]); };
    auto B = [&](int k, int n) { return value(all[n * 4 + k % 4].b[k >= 4 ? 1 : 0]); };
    emu_ptx::accumulate<8>(c, A, B);
}
