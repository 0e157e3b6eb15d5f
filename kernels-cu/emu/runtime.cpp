// The emulator's runtime: launches (blocks one after another), the pool of OS threads that run a
// block's threads, block and warp barriers, and warp exchanges. See cuda_emu.h for the model.
//
// Every emulated thread runs on an OS thread of its own for as long as it lives, but OS threads
// are handed out lazily: a "runner" starts the block's threads one after another, and only when
// one of them blocks (at `__syncthreads`, a shuffle, a wmma call) is another runner woken to start
// the rest. A kernel without barriers thus runs its block on one OS thread without a context
// switch, and one with barriers gets one OS thread per thread, all waiting at the barrier at once.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "launch.h"

namespace emu {
namespace {

constexpr unsigned kMaxThreads = 1024;
constexpr unsigned kWarpSize = 32;
constexpr std::size_t kMaxCollectiveArgs = 64;

// The kernel being run, for error messages.
const char* g_kernel = "(no kernel)";

// The calling thread's index within its block, row-major over (x, y, z).
thread_local unsigned t_linear;

// How many warp exchanges the calling thread has made (the lanes of a warp agree on it).
thread_local unsigned t_exchanges;

void before_waiting();

// A reusable barrier whose parties may leave (a thread that returns from the kernel no longer
// counts, as on the GPU). Every party of a phase must arrive from the same site.
class Barrier {
public:
    // Only between blocks, when no thread waits.
    void reset(unsigned parties) {
        parties_ = parties;
        arrived_ = 0;
    }

    // Waits until every remaining party has arrived; returns how many took part in the phase.
    unsigned arrive_and_wait(const char* file, int line) {
        std::unique_lock lock(m_);
        if (arrived_ == 0) {
            file_ = file;
            line_ = line;
        } else if (line != line_ || std::strcmp(file, file_) != 0) {
            fail("threads wait at different barriers: %s:%d and %s:%d", file_, line_, file, line);
        }
        const unsigned phase = phase_.load(std::memory_order_relaxed);
        if (++arrived_ == parties_) {
            complete();
            return last_parties_;
        }
        lock.unlock();
        before_waiting();
        while (phase_.load(std::memory_order_acquire) == phase) phase_.wait(phase, std::memory_order_acquire);
        return last_parties_;  // written before the phase advanced; the next phase needs this thread
    }

    // The calling party is gone; a phase waiting only for it completes.
    void drop() {
        std::lock_guard lock(m_);
        --parties_;
        if (arrived_ > 0 && arrived_ == parties_) complete();
    }

private:
    void complete() {
        last_parties_ = arrived_;
        arrived_ = 0;
        phase_.fetch_add(1, std::memory_order_release);
        phase_.notify_all();
    }

    std::mutex m_;
    std::atomic<unsigned> phase_{0};
    unsigned parties_ = 0, arrived_ = 0, last_parties_ = 0;
    const char* file_ = "";
    int line_ = 0;
};

// A warp's barrier and exchange slots. Exchanges alternate between two sets of slots, so one
// barrier per exchange suffices: a lane writes a set again only two exchanges later, after the
// barrier of the exchange in between, which every lane reaches only once done reading.
struct Warp {
    Barrier barrier;
    std::uint64_t shfl[2][kWarpSize];
    unsigned char args[2][kWarpSize][kMaxCollectiveArgs];
};

// The running block's barriers (one block at a time).
Barrier g_block_barrier;
Warp g_warps[kMaxThreads / kWarpSize];

Warp& my_warp() { return g_warps[t_linear / kWarpSize]; }

// Waits at the calling warp's barrier, which all 32 lanes must reach.
void sync_full_warp(const char* op) {
    const unsigned n = my_warp().barrier.arrive_and_wait(op, 0);
    if (n != kWarpSize) fail("%s with %u live lanes in the warp (it needs all 32)", op, n);
}

// One block's work.
struct BlockJob {
    const std::function<void()>* body;
    uint3 block, block_dim, grid_dim;
    unsigned threads;
};

// OS threads reused across blocks and launches (never more than a block's threads plus one).
class Pool {
public:
    ~Pool() {
        {
            std::lock_guard lock(m_);
            stop_ = true;
        }
        wake_.notify_all();
        for (auto& w : workers_) w.join();
    }

    // Runs every thread of the block and returns when all have returned.
    void run_block(const BlockJob& job) {
        job_ = &job;
        next_.store(0, std::memory_order_release);
        request_runner();
        std::unique_lock lock(m_);
        done_.wait(lock, [&] { return runners_ == 0; });
    }

    // A thread of the running block is about to wait: another runner must start the threads
    // not yet started, or the wait could never end.
    void before_waiting() {
        if (next_.load(std::memory_order_acquire) < job_->threads) request_runner();
    }

private:
    void request_runner() {
        std::lock_guard lock(m_);
        ++runners_;
        if (idle_ == 0) {
            workers_.emplace_back([this] { work(); });
        } else {
            --idle_;
            ++requests_;
            wake_.notify_one();
        }
    }

    void work() {
        for (;;) {
            run_threads();
            std::unique_lock lock(m_);
            if (--runners_ == 0) done_.notify_one();
            ++idle_;
            wake_.wait(lock, [&] { return stop_ || requests_ > 0; });
            if (stop_) return;
            --requests_;
        }
    }

    // Starts the block's threads not yet started, one after another. The block cannot end while
    // a runner is here (run_block waits for all), so the job is alive.
    void run_threads() {
        for (;;) {
            const unsigned id = next_.fetch_add(1, std::memory_order_acq_rel);
            if (id >= job_->threads) return;
            const BlockJob& job = *job_;
            const uint3 bd = job.block_dim;
            threadIdx = {id % bd.x, (id / bd.x) % bd.y, id / (bd.x * bd.y)};
            blockIdx = job.block;
            blockDim = bd;
            gridDim = job.grid_dim;
            t_linear = id;
            t_exchanges = 0;
            (*job.body)();
            g_block_barrier.drop();
            my_warp().barrier.drop();
        }
    }

    std::vector<std::thread> workers_;
    std::mutex m_;
    std::condition_variable wake_, done_;
    unsigned runners_ = 0, idle_ = 0, requests_ = 0;
    bool stop_ = false;
    const BlockJob* job_ = nullptr;
    std::atomic<unsigned> next_{0};
};

Pool& pool() {
    static Pool p;
    return p;
}

void before_waiting() { pool().before_waiting(); }

}  // namespace

void fail(const char* fmt, ...) {
    std::fprintf(stderr, "emulator error in %s, block (%u, %u, %u), thread (%u, %u, %u): ", g_kernel, blockIdx.x,
                 blockIdx.y, blockIdx.z, threadIdx.x, threadIdx.y, threadIdx.z);
    va_list ap;
    va_start(ap, fmt);
    std::vfprintf(stderr, fmt, ap);
    va_end(ap);
    std::fputc('\n', stderr);
    std::abort();
}

void sync_block(const char* file, int line) { g_block_barrier.arrive_and_wait(file, line); }

int lane_id() { return (int)(t_linear % kWarpSize); }

void sync_warp(const char* op) { sync_full_warp(op); }

void warp_collective(const char* op, const void* args, std::size_t size) {
    if (size > kMaxCollectiveArgs) fail("%s: %zu bytes of arguments (at most %zu)", op, size, kMaxCollectiveArgs);
    auto& slots = my_warp().args[t_exchanges++ % 2];
    std::memcpy(slots[lane_id()], args, size);
    sync_full_warp(op);
    if (std::memcmp(slots[lane_id()], slots[0], size) != 0) fail("lanes of one warp call %s with different arguments", op);
}

std::uint64_t shfl_xor(unsigned mask, std::uint64_t bits, int lane_mask, int width) {
    if (mask != 0xffffffffu || width != (int)kWarpSize) {
        fail("__shfl_xor_sync(mask %#x, width %d): only the full mask and width 32 are emulated", mask, width);
    }
    if (lane_mask < 0 || lane_mask >= (int)kWarpSize) fail("__shfl_xor_sync: lane mask %d out of 0..31", lane_mask);
    auto& slots = my_warp().shfl[t_exchanges++ % 2];
    const int lane = lane_id();
    slots[lane] = bits;
    sync_full_warp("__shfl_xor_sync");
    return slots[lane ^ lane_mask];
}

void run_grid(const char* kernel, dim3 grid, dim3 block, const std::function<void()>& body) {
    g_kernel = kernel;
    // The hardware's limits (compute capability 8.x and 9.x); a launch outside them fails there.
    const std::uint64_t threads = (std::uint64_t)block.x * block.y * block.z;
    if (threads == 0 || threads > kMaxThreads || block.x > 1024 || block.y > 1024 || block.z > 64) {
        fail("invalid block (%u, %u, %u)", block.x, block.y, block.z);
    }
    if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535) {
        fail("invalid grid (%u, %u, %u)", grid.x, grid.y, grid.z);
    }
    const std::uint64_t blocks = (std::uint64_t)grid.x * grid.y * grid.z;
    if (blocks > (1u << 22)) fail("%llu blocks: more than the emulator runs", (unsigned long long)blocks);
    // Blocks run in a shuffled (seeded, so reproducible) order: on the GPU they run in any order
    // and at once, and a kernel must not depend on either.
    std::vector<std::uint32_t> order(blocks);
    std::iota(order.begin(), order.end(), 0u);
    static std::mt19937 rng(20261130);
    std::shuffle(order.begin(), order.end(), rng);
    for (const std::uint32_t b : order) {
        g_block_barrier.reset((unsigned)threads);
        for (unsigned w = 0; w * kWarpSize < threads; ++w) {
            g_warps[w].barrier.reset((unsigned)std::min<std::uint64_t>(kWarpSize, threads - w * kWarpSize));
        }
        const BlockJob job{&body,
                           {b % grid.x, (b / grid.x) % grid.y, b / (grid.x * grid.y)},
                           {block.x, block.y, block.z},
                           {grid.x, grid.y, grid.z},
                           (unsigned)threads};
        pool().run_block(job);
    }
    g_kernel = "(no kernel)";
}

}  // namespace emu
