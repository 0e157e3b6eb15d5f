// Emulator stand-in for kernels-cu/wgmma.cuh: Hopper's warpgroup MMA, with its descriptor
// decoding, register layout and asynchrony, so that a kernel that encodes a descriptor, a swizzle
// or a fragment index wrongly, reads a stage before its copies landed or were fenced for the async
// proxy, overwrites a stage a product still reads, or uses the accumulators before waiting, fails
// here too.
//
// The model: dynamic shared memory sits at window address kWindowBase (not a multiple of 512, as
// nothing promises one on the GPU), and `shared_address` maps only that memory. A `wgmma` reads
// its operands when it is issued (the copies must have landed and been fenced by then) and
// computes its result at once, but the accumulators change only when a `wgmma_wait` retires its
// group; the first thread of each warpgroup keeps the operands it read, fails a `cp.async` issued
// into them before then, and fails the wait if they changed in between. Only the 64-byte swizzle, K-major, is emulated (all the kernels use).
#pragma once

#include <cstdint>
#include <cstring>
#include <deque>
#include <vector>

namespace emu_wgmma {

constexpr unsigned kWindowBase = 0x410;

inline unsigned char* window() { return ::emu::dynamic_shared(0); }

// One issued product of one thread: where its accumulators live and what they become.
struct Product {
    float* d;
    std::vector<float> result;
    // The first thread of the warpgroup: the operand bytes read, to compare at retirement.
    std::vector<std::pair<const std::uint16_t*, std::uint16_t>> read;
    std::vector<std::size_t> chunks;  // the 16-byte chunks of `read`, counted in flight
};

struct State {
    uint3 block{~0u, ~0u, ~0u};  // the block of the products in flight
    bool fenced = false;
    std::vector<Product> open;
    std::deque<std::vector<Product>> groups;
};

inline State g_state[1024];

// This thread's state; fails if products of an earlier block were never waited for (the block
// ended with its accumulators still changing).
inline State& mine() {
    State& s = g_state[::emu::thread_linear()];
    const bool same = s.block.x == blockIdx.x && s.block.y == blockIdx.y && s.block.z == blockIdx.z;
    if (!same) {
        if (!s.open.empty() || !s.groups.empty()) {
            ::emu::fail("block (%u, %u, %u) ended with wgmma products it never waited for", s.block.x, s.block.y,
                        s.block.z);
        }
        s = State{};
        s.block = blockIdx;
    }
    return s;
}

// The element (row, k) of a K-major bf16 operand in the 64-byte swizzle: rows of 64 bytes in
// groups of 8 `sbo` bytes apart, 16-byte chunks XORed with the address bits 7-8.
inline const std::uint16_t* element(std::uint64_t desc, unsigned row, unsigned k) {
    const unsigned start = (unsigned)(desc & 0x3fff) << 4;
    const unsigned sbo = (unsigned)((desc >> 32) & 0x3fff) << 4;
    if ((desc >> 62) != 2) ::emu::fail("wgmma: descriptor %#llx is not the 64-byte swizzle", (unsigned long long)desc);
    if (((desc >> 49) & 7) != 0) ::emu::fail("wgmma: descriptor %#llx has a base offset", (unsigned long long)desc);
    const unsigned logical = start + (row / 8) * sbo + (row % 8) * 64 + k * 2;
    const unsigned physical = logical ^ (((logical >> 7) & 3) << 4);
    if (physical < kWindowBase || physical + 2 > kWindowBase + emu_ptx::kDynamicChunks * 16) {
        ::emu::fail("wgmma: operand element at window address %#x is outside dynamic shared memory", physical);
    }
    const std::size_t offset = physical - kWindowBase;
    const unsigned writer = emu_ptx::g_unfenced[offset / 16].load(std::memory_order_relaxed);
    if (writer != 0) {
        ::emu::fail("wgmma reads shared memory that thread %u wrote (cp.async) and did not fence for the async "
                    "proxy (fence.proxy.async)",
                    writer - 1);
    }
    return (const std::uint16_t*)(window() + offset);
}

inline float value(const std::uint16_t* p) {
    const unsigned bits = (unsigned)*p << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

// Retires the oldest committed group of this thread: its accumulators take their results.
inline void retire() {
    State& s = mine();
    for (Product& p : s.groups.front()) {
        for (const auto& [at, was] : p.read) {
            if (*at != was) {
                ::emu::fail("shared memory that a running wgmma reads changed before wgmma.wait_group retired it");
            }
        }
        std::memcpy(p.d, p.result.data(), p.result.size() * sizeof(float));
        for (const std::size_t chunk : p.chunks) emu_ptx::g_read_in_flight[chunk].fetch_sub(1);
    }
    s.groups.pop_front();
}

}  // namespace emu_wgmma

// The shared-window address of `p`, which must be in dynamic shared memory here.
inline unsigned shared_address(const void* p) {
    const auto at = (std::uintptr_t)p, base = (std::uintptr_t)emu_wgmma::window();
    if (at < base || at >= base + emu_ptx::kDynamicChunks * 16) {
        ::emu::fail("shared_address(%p): the emulator maps only dynamic shared memory", p);
    }
    return emu_wgmma::kWindowBase + (unsigned)(at - base);
}

inline void wgmma_fence() { emu_wgmma::mine().fenced = true; }

inline void wgmma_commit() {
    auto& s = emu_wgmma::mine();
    s.groups.push_back(std::move(s.open));
    s.open.clear();
}

template <int N>
inline void wgmma_wait() {
    auto& s = emu_wgmma::mine();
    if (!s.open.empty()) ::emu::fail("wgmma.wait_group with products issued but not committed");
    while (s.groups.size() > (std::size_t)N) emu_wgmma::retire();
    // Reading the accumulators, or a next product, needs a wgmma.fence again.
    s.fenced = false;
}

inline void fence_proxy_async() {
    auto& marked = emu_ptx::g_marked[::emu::thread_linear()];
    for (const std::size_t chunk : marked) {
        unsigned mine = ::emu::thread_linear() + 1;
        emu_ptx::g_unfenced[chunk].compare_exchange_strong(mine, 0u, std::memory_order_relaxed);
    }
    marked.clear();
}

template <int R>
inline void wgmma_fence_operands(float (&)[R]) {}

// `wgmma.mma_async.sync.aligned.m64nNk16.f32.bf16.bf16 d, a, b, 1, 1, 1, 0, 0`.
template <int N>
inline void wgmma_bf16(float (&d)[N / 2], u64 a, u64 b) {
    auto& s = emu_wgmma::mine();
    if (!s.fenced) ::emu::fail("wgmma.mma_async without a wgmma.fence since the accumulators were last waited for");
    const u64 descs[2] = {a, b};
    ::emu::warp_collective("wgmma.mma_async (a warp's lanes give different descriptors)", descs, sizeof descs);
    const unsigned t = ::emu::thread_linear() % 128, warp = t / 32, lane = t % 32;
    // The accumulators as the newest of the products in flight on them leaves them.
    std::vector<float> base(d, d + N / 2);
    for (const auto& group : s.groups) {
        for (const auto& p : group) {
            if (p.d == d) base = p.result;
        }
    }
    for (const auto& p : s.open) {
        if (p.d == d) base = p.result;
    }
    emu_wgmma::Product product{d, base, {}, {}};
    for (int j = 0; j < N / 8; ++j)
        for (int q = 0; q < 4; ++q) {
            const unsigned row = 16 * warp + lane / 4 + (q >= 2 ? 8 : 0), col = 8 * j + 2 * (lane % 4) + q % 2;
            float sum = product.result[4 * j + q];
            for (unsigned k = 0; k < 16; ++k) {
                sum += emu_wgmma::value(emu_wgmma::element(a, row, k)) * emu_wgmma::value(emu_wgmma::element(b, col, k));
            }
            product.result[4 * j + q] = sum;
        }
    if (t == 0) {
        for (unsigned k = 0; k < 16; ++k) {
            for (unsigned row = 0; row < 64 + (unsigned)N; ++row) {
                const auto* at = row < 64 ? emu_wgmma::element(a, row, k) : emu_wgmma::element(b, row - 64, k);
                product.read.push_back({at, *at});
                if (k % 8 == 0) {
                    product.chunks.push_back(emu_ptx::dynamic_chunk(at));
                    emu_ptx::g_read_in_flight[product.chunks.back()].fetch_add(1);
                }
            }
        }
    }
    s.open.push_back(std::move(product));
}
