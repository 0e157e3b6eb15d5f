// The emulator's runtime: launches (blocks one after another), the two ways of running a block's
// threads, block and warp barriers, and warp exchanges. See cuda_emu.h for the model.
//
// OS threads (the default): every emulated thread runs on an OS thread of its own for as long as
// it lives, but OS threads are handed out lazily: a "runner" starts the block's threads one after
// another, and only when one of them blocks (at `__syncthreads`, a shuffle, an mma) is
// another runner woken to start the rest. A kernel without barriers thus runs its block on one OS
// thread without a context switch, and one with barriers gets one OS thread per thread, all
// waiting at the barrier at once, then really running at the same time.
//
// Fibers (`use_fibers`): the block's threads are fibers on the launching OS thread, started in the
// same lazy order; a thread that must wait hands over to the next one, and the waiting ones are
// resumed in turn until they can go on. The same barriers and exchanges with the same checks, at
// the cost of a few instructions instead of an OS context switch per wait (the fake driver's
// model tests, whose convolutions wait every 16-deep slice: 14 minutes on OS threads, one on
// fibers). Threads then never run at the same time, so this mode exposes fewer races.
#include <sys/mman.h>
#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

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

// Whether the calling thread runs a host stand-in (`run_on_host`) rather than a kernel's thread.
thread_local bool t_on_host = false;

// How many warp exchanges the calling thread has made (the lanes of a warp agree on it).
thread_local unsigned t_exchanges;

// Whether blocks run as fibers (`use_fibers`).
std::atomic<bool> g_fibers{false};

// Barrier phases completed and threads finished: fibers that all wait while this stays put can
// never go on.
std::atomic<std::uint64_t> g_progress{0};

// Blocks the calling emulated thread until `phase` moves on from `old`.
void wait_for_phase(std::atomic<unsigned>& phase, unsigned old);

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
        wait_for_phase(phase_, phase);
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
        g_progress.fetch_add(1, std::memory_order_relaxed);
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

// A fiber's saved execution context. On x86-64 a switch is a few instructions of our own:
// glibc's swapcontext also saves the signal mask, a system call that costs more than the rest.
#if defined(__x86_64__)
struct Context {
    void* sp = nullptr;  // the callee-saved registers and control words are on the stack
};

// Saves the callee-saved registers and the SSE / x87 control words on the current stack, stores
// its pointer in `*from`, and continues the stack saved in `to`.
extern "C" void emu_switch_stack(void** from, void* to);
asm(R"(
    .text
    .p2align 4
    .globl emu_switch_stack
    .hidden emu_switch_stack
    .type emu_switch_stack, @function
emu_switch_stack:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_switch_stack, .-emu_switch_stack
)");

void switch_context(Context& from, Context& to) { emu_switch_stack(&from.sp, to.sp); }

// A context that starts `entry` (which never returns) on `stack`: the frame emu_switch_stack
// pops, zero registers, the default control words, `entry` as the return address, aligned as
// after a call.
void make_context(Context& c, char* stack, std::size_t bytes, void (*entry)()) {
    auto* top = reinterpret_cast<std::uint64_t*>((reinterpret_cast<std::uintptr_t>(stack + bytes)) & ~std::uintptr_t{15});
    top[-1] = 0;  // entry's return address: none
    top[-2] = reinterpret_cast<std::uint64_t>(entry);
    for (int r = 3; r <= 8; ++r) top[-r] = 0;  // rbp, rbx, r12 .. r15
    top[-9] = 0x037full << 32 | 0x1f80;        // MXCSR, then the x87 control word
    c.sp = &top[-9];
}
#else
struct Context {
    ucontext_t uc;
};

void switch_context(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }

void make_context(Context& c, char* stack, std::size_t bytes, void (*entry)()) {
    getcontext(&c.uc);
    c.uc.uc_stack.ss_sp = stack;
    c.uc.uc_stack.ss_size = bytes;
    c.uc.uc_link = nullptr;
    makecontext(&c.uc, entry, 0);
}
#endif

// The fibers of one launching OS thread (each launching thread has its own, so a fiber never
// moves between OS threads). Fibers are reused across blocks and launches: each loops over the
// threads it is given.
class Fibers {
public:
    ~Fibers() {
        for (const auto& f : all_) {
#if defined(__SANITIZE_ADDRESS__)
            // Idle fibers are parked mid-function: their frames' redzones must not outlive the
            // mapping (a thread stack mapped there later would read as poisoned).
            ASAN_UNPOISON_MEMORY_REGION(f->stack, kStackBytes);
#endif
            munmap(f->mapping, kGuardBytes + kStackBytes);
        }
    }

    // Runs every thread of the block and returns when all have returned.
    void run_block(const BlockJob& job) {
        job_ = &job;
        blockIdx = job.block;
        blockDim = job.block_dim;
        gridDim = job.grid_dim;
        unsigned next = 0;
        std::size_t stalled = 0;  // resumptions in a row after which nothing moved
        for (;;) {
            Fiber* f;
            if (next < job.threads) {
                f = take();
                f->id = next++;
                f->exchanges = 0;
                f->done = false;
            } else if (!waiting_.empty()) {
                f = waiting_.front();
                waiting_.pop_front();
            } else {
                break;
            }
            const std::uint64_t before = g_progress.load(std::memory_order_relaxed);
            resume(f);
            if (f->done) {
                idle_.push_back(f);
                stalled = 0;
                continue;
            }
            waiting_.push_back(f);
            stalled = g_progress.load(std::memory_order_relaxed) == before ? stalled + 1 : 0;
            if (next == job.threads && stalled > waiting_.size()) {
                fail("every live thread of the block waits and none can go on (%zu threads)", waiting_.size());
            }
        }
    }

    // Called on a fiber: hands over to the other threads until `phase` moves on.
    void wait_for_phase(std::atomic<unsigned>& phase, unsigned old) {
        while (phase.load(std::memory_order_acquire) == old) switch_to_scheduler();
    }

private:
    static constexpr std::size_t kStackBytes = 256 << 10;
    static constexpr std::size_t kGuardBytes = 64 << 10;  // unmapped below the stack: an overflow faults

    struct Fiber {
        Context context;
        void* mapping;
        char* stack;
        unsigned id = 0, exchanges = 0;
        bool done = true;
        void* fake_stack = nullptr;  // AddressSanitizer's, while switched out
    };

    // An idle fiber, or a new one.
    Fiber* take() {
        if (!idle_.empty()) {
            Fiber* f = idle_.back();
            idle_.pop_back();
            return f;
        }
        auto f = std::make_unique<Fiber>();
        f->mapping = mmap(nullptr, kGuardBytes + kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (f->mapping == MAP_FAILED || mprotect(f->mapping, kGuardBytes, PROT_NONE) != 0) {
            fail("no memory for the stack of emulated thread %zu", all_.size());
        }
        f->stack = static_cast<char*>(f->mapping) + kGuardBytes;
#if defined(__SANITIZE_ADDRESS__)
        // The address range may have been a stack before, whose redzones the shadow still marks.
        ASAN_UNPOISON_MEMORY_REGION(f->stack, kStackBytes);
#endif
        make_context(f->context, f->stack, kStackBytes, &Fibers::entry);
        all_.push_back(std::move(f));
        return all_.back().get();
    }

    // Runs `f` as its emulated thread until it waits or returns.
    void resume(Fiber* f) {
        current_ = f;
        const uint3 bd = job_->block_dim;
        threadIdx = {f->id % bd.x, (f->id / bd.x) % bd.y, f->id / (bd.x * bd.y)};
        t_linear = f->id;
        t_exchanges = f->exchanges;
        start_switch(&scheduler_fake_stack_, f->stack, kStackBytes);
        switch_context(scheduler_, f->context);
        finish_switch(scheduler_fake_stack_, nullptr, nullptr);
        f->exchanges = t_exchanges;
    }

    void switch_to_scheduler() {
        Fiber* f = current_;
        start_switch(&f->fake_stack, scheduler_stack_, scheduler_stack_bytes_);
        switch_context(f->context, scheduler_);
        finish_switch(f->fake_stack, &scheduler_stack_, &scheduler_stack_bytes_);
    }

    // Every fiber's body: the threads it is given, one after another.
    static void entry();

    // AddressSanitizer must know which stack runs (else it reports the switch as an overflow).
    static void start_switch(void** fake_stack, const void* bottom, std::size_t bytes) {
#if defined(__SANITIZE_ADDRESS__)
        __sanitizer_start_switch_fiber(fake_stack, bottom, bytes);
#else
        (void)fake_stack, (void)bottom, (void)bytes;
#endif
    }

    static void finish_switch(void* fake_stack, const void** bottom, std::size_t* bytes) {
#if defined(__SANITIZE_ADDRESS__)
        __sanitizer_finish_switch_fiber(fake_stack, bottom, bytes);
#else
        (void)fake_stack, (void)bottom, (void)bytes;
#endif
    }

    std::vector<std::unique_ptr<Fiber>> all_;
    std::vector<Fiber*> idle_;
    std::deque<Fiber*> waiting_;
    Context scheduler_;
    void* scheduler_fake_stack_ = nullptr;
    const void* scheduler_stack_ = nullptr;
    std::size_t scheduler_stack_bytes_ = 0;
    Fiber* current_ = nullptr;
    const BlockJob* job_ = nullptr;
};

Fibers& fibers() {
    thread_local Fibers f;
    return f;
}

void Fibers::entry() {
    Fibers& self = fibers();
    finish_switch(nullptr, &self.scheduler_stack_, &self.scheduler_stack_bytes_);
    for (;;) {
        (*self.job_->body)();
        g_block_barrier.drop();
        my_warp().barrier.drop();
        g_progress.fetch_add(1, std::memory_order_relaxed);
        self.current_->done = true;
        self.switch_to_scheduler();
    }
}

void wait_for_phase(std::atomic<unsigned>& phase, unsigned old) {
    if (g_fibers.load(std::memory_order_relaxed)) {
        fibers().wait_for_phase(phase, old);
        return;
    }
    pool().before_waiting();
    while (phase.load(std::memory_order_acquire) == old) phase.wait(old, std::memory_order_acquire);
}

}  // namespace

void fail(const char* fmt, ...) {
    if (t_on_host) {
        std::fprintf(stderr, "emulator error in %s (its host stand-in): ", g_kernel);
    } else {
        std::fprintf(stderr, "emulator error in %s, block (%u, %u, %u), thread (%u, %u, %u): ", g_kernel,
                     blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x, threadIdx.y, threadIdx.z);
    }
    va_list ap;
    va_start(ap, fmt);
    std::vfprintf(stderr, fmt, ap);
    va_end(ap);
    std::fputc('\n', stderr);
    std::abort();
}

void use_fibers(bool on) { g_fibers.store(on, std::memory_order_relaxed); }

bool fibers_on() { return g_fibers.load(std::memory_order_relaxed); }

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

void warp_gather(const void* mine, std::size_t size, void* all) {
    if (size > kMaxCollectiveArgs) fail("warp exchange of %zu bytes per lane (at most %zu)", size, kMaxCollectiveArgs);
    auto& slots = my_warp().args[t_exchanges++ % 2];
    std::memcpy(slots[lane_id()], mine, size);
    sync_full_warp("warp-collective PTX instruction");
    for (unsigned l = 0; l < kWarpSize; ++l) std::memcpy((unsigned char*)all + l * size, slots[l], size);
}

unsigned thread_linear() { return t_linear; }

namespace {
// Dynamic shared memory: the most a block may opt in to on compute capability 9.0, and the
// running launch's size.
constexpr std::size_t kMaxDynamicShared = 227 << 10;
alignas(128) unsigned char g_dynamic_shared[kMaxDynamicShared];
std::size_t g_dynamic_shared_bytes = 0;
}  // namespace

unsigned char* dynamic_shared(std::size_t bytes) {
    if (bytes > g_dynamic_shared_bytes) {
        fail("the kernel needs %zu bytes of dynamic shared memory; the launch gave %zu", bytes,
             g_dynamic_shared_bytes);
    }
    return g_dynamic_shared;
}

void run_on_host(const char* kernel, const std::function<void()>& body) {
    g_kernel = kernel;
    t_on_host = true;
    body();
    t_on_host = false;
    g_kernel = "(no kernel)";
}

void run_grid(const char* kernel, dim3 grid, dim3 block, std::size_t dynamic_shared,
              const std::function<void()>& body) {
    g_kernel = kernel;
    if (dynamic_shared > kMaxDynamicShared) {
        fail("%zu bytes of dynamic shared memory: more than a block may have (%zu)", dynamic_shared,
             kMaxDynamicShared);
    }
    g_dynamic_shared_bytes = dynamic_shared;
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
        if (g_fibers.load(std::memory_order_relaxed)) {
            fibers().run_block(job);
        } else {
            pool().run_block(job);
        }
    }
    g_kernel = "(no kernel)";
}

}  // namespace emu
