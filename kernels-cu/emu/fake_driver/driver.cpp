// A fake libcuda.so: the slice of CUDA's driver API that cudarc's safe layer calls for the
// vae-parallel CUDA backend, on the CPU. One emulated device, or FAKE_CUDA_DEVICE_COUNT (1 to 8)
// identical ones, each with its primary context, its memory, streams and modules; device memory
// is host memory; every call runs under one lock; a launch runs the kernel compiled into this
// library from the unchanged kernels-cu/*.cu on the kernel emulator (../runtime.cpp). The fake
// NCCL (../fake_nccl/) moves device memory through the few calls of fake_cuda.h.
//
// Streams are as lazy as CUDA allows: what a call queues on a stream (launches, async copies and
// sets, stream-ordered frees, event records) runs only when something must see it done: a
// synchronize of the stream, the context or an event, a download to the host, a stream that
// reaches a wait on an event recorded after it, a synchronous call. So work on two streams that
// nothing orders does not happen in call order; a reader that should have waited for another
// stream's writer reads what was there before (fresh memory is NaN, see below) instead of
// passing by luck. Each context's legacy default stream is ordered with its blocking streams,
// as in CUDA (cudarc's own streams are non-blocking); the per-thread default stream is treated
// as the legacy one, a stricter order than CUDA's. A context synchronize runs only its own
// context's work, so a device that reads another's results without waiting for them sees NaN.
//
// What the real driver refuses, this refuses with the same error code and says why on stderr:
// calls before cuInit or without a current context, a kernel the loaded image does not contain,
// an image for another architecture, launches beyond the device's or the kernel's limits
// (launch bounds, registers, shared memory), a pointer argument that is not device memory (or
// is another device's: there is no peer access; copies between devices are allowed, addresses
// being unified), a launch of a module or on a stream of another device's context, copies
// outside an allocation, double frees. Fresh allocations are filled with 0xff bytes (NaN
// as f32 and as bf16), so reading memory nobody wrote shows in the results.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdarg>
#include <deque>
#include <functional>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "driver_api.h"
#include "fake_cuda.h"
#include "image.h"
#include "registry.h"

#define FAKE_API extern "C" __attribute__((visibility("default")))

namespace fake_cuda {

// What is queued on one stream, in order: each operation runs when something waits for it.
struct Queue {
    std::deque<std::function<void()>> pending;
    std::uint64_t queued = 0;  // operations ever queued
    std::uint64_t done = 0;    // operations ever run (the first `done` of `queued`)
    bool blocking = true;      // ordered with its context's legacy default stream
    CUctx_st* ctx = nullptr;   // the context whose stream this is
};

}  // namespace fake_cuda

// The handle types are the driver's opaque structs, defined here.

// A device's primary context (the only contexts there are): what the device's streams, memory
// and modules belong to.
struct CUctx_st {
    int retains = 0;
    int device = 0;
    // This context's legacy default stream (the null stream; also stands for the per-thread
    // default stream). Each context has its own, as in CUDA.
    std::shared_ptr<fake_cuda::Queue> legacy;
    // The first error of queued work in this context, returned by every later synchronizing
    // call, as a faulted context's error is on a GPU.
    CUresult sticky = CUDA_SUCCESS;
    std::size_t allocated = 0;  // bytes of this device's memory in use
};

struct CUfunc_st {
    const fake_cuda::Kernel* kernel;
    fake_cuda::ImageKernel image;
    unsigned max_threads;  // per block: the device limit, the launch bounds, the registers
    // The most dynamic shared memory a launch may give (what is left of the default 48 KiB
    // until cuFuncSetAttribute opts in to more).
    std::size_t max_dynamic_shared;
    CUctx_st* ctx;  // the context its module was loaded in, the only one it can be launched in
};

struct CUmod_st {
    fake_cuda::Image image;
    std::map<std::string, std::unique_ptr<CUfunc_st>> functions;
    CUctx_st* ctx = nullptr;
};

struct CUstream_st {
    unsigned flags;
    std::shared_ptr<fake_cuda::Queue> queue;  // its context is the queue's
};

struct CUevent_st {
    unsigned flags;
    CUctx_st* ctx;  // the context it was created in
    // The last record: the stream's queue and how much of it the event waits for.
    std::shared_ptr<fake_cuda::Queue> queue;
    std::uint64_t upto = 0;
    bool recorded = false;  // the record has run (the time below is set)
    std::chrono::steady_clock::time_point at;
};

namespace fake_cuda {

// ---------------------------------------------------------------- the kernel registry

namespace {

std::vector<Kernel>& kernels() {
    static std::vector<Kernel> k;
    return k;
}

}  // namespace

// Runs while the library loads (static initialisers), before any API call.
void register_kernel(Kernel kernel) { kernels().push_back(std::move(kernel)); }

const Kernel* find_kernel(const char* name) {
    for (const Kernel& k : kernels()) {
        if (std::strcmp(k.name, name) == 0) return &k;
    }
    return nullptr;
}

namespace {

// ---------------------------------------------------------------- the device

// An H200 as its driver describes it (132 SMs at 1.98 GHz, HBM3e at 3.2 GHz on 6144 bits), so
// code that sizes work from these numbers sees real ones.
constexpr int kSmCount = 132, kClockKhz = 1980000, kMemoryClockKhz = 3201000, kBusBits = 6144;
constexpr int kMaxThreads = 1024, kMaxSharedPerBlock = 48 << 10, kRegistersPerSm = 65536;
// Shared memory a block may opt in to (cuFuncSetAttribute) on compute capability 9.0.
constexpr int kMaxSharedPerBlockOptIn = 227 << 10;
constexpr int kDriverVersion = 12090;
// Blocks of one launch the emulator runs (it runs them one after another).
constexpr std::uint64_t kMaxEmulatedBlocks = 1u << 22;

// The most devices FAKE_CUDA_DEVICE_COUNT may ask for (a DGX's eight).
constexpr int kMaxDevices = 8;

// What every device is (they are identical), and how many there are.
struct Device {
    int cc_major = 9, cc_minor = 0;
    std::string name;
    std::size_t total_memory = 0;
    // FAKE_CUDA_DEVICE_COUNT (default 1); 0 when it is not a count the fake offers, which cuInit
    // refuses.
    int count = 1;
};

const Device& device() {
    static const Device d = [] {
        Device d;
        // The PTX path (devices other than sm_90) is taken when a test asks for another
        // compute capability, e.g. FAKE_CUDA_COMPUTE_CAPABILITY=8.0.
        if (const char* cc = std::getenv("FAKE_CUDA_COMPUTE_CAPABILITY")) {
            if (std::sscanf(cc, "%d.%d", &d.cc_major, &d.cc_minor) != 2) d.cc_major = 9, d.cc_minor = 0;
        }
        // Several devices for multi-GPU code (NCCL groups, one rank per device), each with its
        // own primary context, memory and streams.
        if (const char* n = std::getenv("FAKE_CUDA_DEVICE_COUNT")) {
            char* end = nullptr;
            const long v = std::strtol(n, &end, 10);
            d.count = end != n && *end == '\0' && v >= 1 && v <= kMaxDevices ? (int)v : 0;
        }
        d.name = "CPU emulation of sm_" + std::to_string(d.cc_major * 10 + d.cc_minor) + " (vae-parallel kernels-emu)";
        d.total_memory = (std::size_t)sysconf(_SC_PHYS_PAGES) * (std::size_t)sysconf(_SC_PAGESIZE);
        return d;
    }();
    return d;
}

// Every piece of state below, and every operation, is under this lock.
std::mutex g_mutex;
bool g_initialized = false;
// The devices' primary contexts, by ordinal (the first device().count exist).
CUctx_st g_contexts[kMaxDevices];
thread_local CUctx_st* t_current = nullptr;
struct Allocation {
    std::size_t bytes;
    int device;  // the device whose memory it is
};
std::map<CUdeviceptr, Allocation> g_allocations;  // by base address
std::set<CUmod_st*> g_modules;
std::set<CUfunc_st*> g_functions;
std::set<CUstream_st*> g_streams;
std::set<CUevent_st*> g_events;
// Copies between host and device memory made through the driver API (cuMemcpyHtoD*,
// cuMemcpyDtoH*), each way: fake_cuda_host_copies lets a test prove a path made none.
unsigned long long g_copies_to_device = 0;
unsigned long long g_copies_to_host = 0;
// Allocations whose stream-ordered free is queued and has not run.
std::set<CUdeviceptr> g_freeing;
// The context whose queued work is running (a fault is that context's sticky error).
CUctx_st* g_running = nullptr;

// One line on stderr about a failed call or queued operation (the real driver only returns the
// code; the message is what makes a failure under the fake quick to diagnose).
void report(const char* what, const char* api, CUresult code, const char* fmt, va_list ap) {
    std::fprintf(stderr, "fake libcuda: %s%s failed (%d): ", what, api, (int)code);
    std::vfprintf(stderr, fmt, ap);
    std::fputc('\n', stderr);
}

// Reports a refused call and returns `code`.
CUresult refuse(CUresult code, const char* api, const char* fmt, ...) __attribute__((format(printf, 3, 4)));
CUresult refuse(CUresult code, const char* api, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    report("", api, code, fmt, ap);
    va_end(ap);
    return code;
}

CUresult initialized(const char* api) {
    return g_initialized ? CUDA_SUCCESS : refuse(CUDA_ERROR_NOT_INITIALIZED, api, "cuInit has not been called");
}

// The calling thread's current context, which most calls act on.
CUresult current_context(const char* api) {
    if (CUresult r = initialized(api)) return r;
    if (!t_current) return refuse(CUDA_ERROR_INVALID_CONTEXT, api, "no current context on this thread");
    if (t_current->retains == 0) {
        return refuse(CUDA_ERROR_INVALID_CONTEXT, api, "the current context is the released primary context");
    }
    return CUDA_SUCCESS;
}

CUresult check_device(const char* api, CUdevice dev) {
    if (CUresult r = initialized(api)) return r;
    if (dev >= 0 && dev < device().count) return CUDA_SUCCESS;
    return refuse(CUDA_ERROR_INVALID_DEVICE, api, "no device %d (there %s %d)", dev,
                  device().count == 1 ? "is" : "are", device().count);
}

bool is_default_stream(CUstream s) { return s == nullptr || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD; }

// A stream: a created one (of any context: its handle says which), or a default stream (null,
// legacy, per-thread) of the current context.
CUresult check_stream(const char* api, CUstream s) {
    if (CUresult r = current_context(api)) return r;
    if (is_default_stream(s) || g_streams.count(s)) return CUDA_SUCCESS;
    return refuse(CUDA_ERROR_INVALID_HANDLE, api, "unknown stream %p", (void*)s);
}

// A default stream is the current context's legacy stream.
std::shared_ptr<Queue> queue_of(CUstream s) { return is_default_stream(s) ? t_current->legacy : s->queue; }

// Runs `q`'s operations until `upto` of them have run. An operation may be a wait that runs
// another queue first; those point back only at operations queued before them, so this ends.
void flush(Queue& q, std::uint64_t upto) {
    CUctx_st* const outer = g_running;
    g_running = q.ctx;
    while (q.done < upto && !q.pending.empty()) {
        std::function<void()> op = std::move(q.pending.front());
        q.pending.pop_front();
        ++q.done;
        op();
    }
    g_running = outer;
}

void flush(Queue& q) { flush(q, q.queued); }

// Everything queued in context `ctx`, as a context synchronize does.
void flush_context(CUctx_st* ctx) {
    flush(*ctx->legacy);
    for (CUstream_st* s : g_streams) {
        if (s->queue->ctx == ctx) flush(*s->queue);
    }
}

// Everything queued in every context: what the synchronous calls run first (see "memory" below).
void flush_all() {
    for (int d = 0; d < device().count; ++d) flush(*g_contexts[d].legacy);
    for (CUstream_st* s : g_streams) flush(*s->queue);
}

// Runs what the legacy stream's ordering puts before new work on `q`: the blocking streams' work
// of the same context before legacy work, and legacy work before a blocking stream's.
void run_predecessors(Queue& q) {
    if (&q == q.ctx->legacy.get()) {
        for (CUstream_st* other : g_streams) {
            if (other->queue->blocking && other->queue->ctx == q.ctx) flush(*other->queue);
        }
    } else if (q.blocking) {
        flush(*q.ctx->legacy);
    }
}

// Queues `op` on stream `s`, after what the legacy stream's ordering puts before it.
void enqueue(CUstream s, std::function<void()> op) {
    const std::shared_ptr<Queue> q = queue_of(s);
    run_predecessors(*q);
    q->pending.push_back(std::move(op));
    ++q->queued;
}

// Records a failure of queued work (on stderr now, as the sticky error of the next
// synchronizing call in the context whose work it was).
void fault(CUresult code, const char* api, const char* fmt, ...) __attribute__((format(printf, 3, 4)));
void fault(CUresult code, const char* api, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    report("queued ", api, code, fmt, ap);
    va_end(ap);
    if (g_running && g_running->sticky == CUDA_SUCCESS) g_running->sticky = code;
}

// The live allocation `[ptr, ptr + bytes)` lies in, or null.
const Allocation* find_allocation(CUdeviceptr ptr, std::size_t bytes) {
    auto it = g_allocations.upper_bound(ptr);
    if (it == g_allocations.begin()) return nullptr;
    --it;
    const std::size_t size = it->second.bytes;
    const bool inside = ptr >= it->first && ptr - it->first < size && bytes <= size - (ptr - it->first);
    return inside ? &it->second : nullptr;
}

// Whether `[ptr, ptr + bytes)` lies in one live allocation (of any device: copies between
// devices are allowed, their addresses being unified).
bool inside_allocation(CUdeviceptr ptr, std::size_t bytes) { return find_allocation(ptr, bytes) != nullptr; }

CUresult check_range(const char* api, const char* what, CUdeviceptr ptr, std::size_t bytes) {
    if (inside_allocation(ptr, std::max<std::size_t>(bytes, 1))) return CUDA_SUCCESS;
    return refuse(CUDA_ERROR_INVALID_VALUE, api, "%s [%#llx, +%zu bytes) is not inside one device allocation", what,
                  ptr, bytes);
}

CUresult allocate(const char* api, CUdeviceptr* out, std::size_t bytes) {
    if (CUresult r = current_context(api)) return r;
    if (!out) return refuse(CUDA_ERROR_INVALID_VALUE, api, "no output pointer");
    if (bytes == 0) return refuse(CUDA_ERROR_INVALID_VALUE, api, "0 bytes (the driver refuses empty allocations)");
    CUctx_st& ctx = *t_current;
    if (bytes > device().total_memory - ctx.allocated) {
        return refuse(CUDA_ERROR_OUT_OF_MEMORY, api, "%zu bytes with %zu of %zu in use", bytes, ctx.allocated,
                      device().total_memory);
    }
    void* p = nullptr;
    // 256-byte aligned, as cuMemAlloc's allocations are (cp.async and ldmatrix need 16).
    if (posix_memalign(&p, 256, bytes) != 0) {
        return refuse(CUDA_ERROR_OUT_OF_MEMORY, api, "the host has no %zu bytes to spare", bytes);
    }
    std::memset(p, 0xff, bytes);
    *out = (CUdeviceptr)p;
    g_allocations[*out] = Allocation{bytes, ctx.device};
    ctx.allocated += bytes;
    return CUDA_SUCCESS;
}

CUresult check_releasable(const char* api, CUdeviceptr ptr) {
    if (CUresult r = current_context(api)) return r;
    if (!g_allocations.count(ptr) || g_freeing.count(ptr)) {
        return refuse(CUDA_ERROR_INVALID_VALUE, api, "%#llx is not a live allocation (freed twice?)", ptr);
    }
    return CUDA_SUCCESS;
}

void release(CUdeviceptr ptr) {
    const auto it = g_allocations.find(ptr);
    g_contexts[it->second.device].allocated -= it->second.bytes;
    g_allocations.erase(it);
    g_freeing.erase(ptr);
    std::free((void*)ptr);
}

// The most threads a block of `f` may have on this device: its launch bounds, and the registers
// (allocated per warp in units of 256) that 64 K per SM leave.
unsigned max_threads_of(const ImageKernel& k) {
    unsigned limit = kMaxThreads;
    if (k.max_threads) limit = std::min(limit, k.max_threads);
    if (k.registers) {
        const unsigned per_warp = (k.registers * 32 + 255) / 256 * 256;
        limit = std::min(limit, kRegistersPerSm / per_warp * 32);
    }
    return limit;
}

std::string sizes(const std::vector<std::size_t>& v) {
    std::string s;
    for (std::size_t x : v) s += (s.empty() ? "" : ", ") + std::to_string(x);
    return "[" + s + "]";
}

int attribute(int attr, bool& known) {
    known = true;
    const Device& d = device();
    switch (attr) {
        case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: return kMaxThreads;
        case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X: return 1024;
        case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y: return 1024;
        case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z: return 64;
        case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X: return 0x7fffffff;
        case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y: return 65535;
        case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z: return 65535;
        case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: return kMaxSharedPerBlock;
        case CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY: return 64 << 10;
        case CU_DEVICE_ATTRIBUTE_WARP_SIZE: return 32;
        case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK: return kRegistersPerSm;
        case CU_DEVICE_ATTRIBUTE_CLOCK_RATE: return kClockKhz;
        case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: return kSmCount;
        case CU_DEVICE_ATTRIBUTE_INTEGRATED: return 0;
        case CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE: return kMemoryClockKhz;
        case CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: return kBusBits;
        case CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE: return 50 << 20;
        case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR: return 2048;
        case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: return 1;
        case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: return d.cc_major;
        case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: return d.cc_minor;
        case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: return 228 << 10;
        case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR: return kRegistersPerSm;
        case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: return kMaxSharedPerBlockOptIn;
        // As the H200 answers: cudarc then allocates and frees with cuMemAllocAsync /
        // cuMemFreeAsync, the calls it makes on the real device.
        case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: return 1;
        default: known = false; return 0;
    }
}

const char* error_name(CUresult r) {
    switch (r) {
        case CUDA_SUCCESS: return "CUDA_SUCCESS";
        case CUDA_ERROR_INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
        case CUDA_ERROR_OUT_OF_MEMORY: return "CUDA_ERROR_OUT_OF_MEMORY";
        case CUDA_ERROR_NOT_INITIALIZED: return "CUDA_ERROR_NOT_INITIALIZED";
        case CUDA_ERROR_NO_DEVICE: return "CUDA_ERROR_NO_DEVICE";
        case CUDA_ERROR_INVALID_DEVICE: return "CUDA_ERROR_INVALID_DEVICE";
        case CUDA_ERROR_INVALID_IMAGE: return "CUDA_ERROR_INVALID_IMAGE";
        case CUDA_ERROR_INVALID_CONTEXT: return "CUDA_ERROR_INVALID_CONTEXT";
        case CUDA_ERROR_NO_BINARY_FOR_GPU: return "CUDA_ERROR_NO_BINARY_FOR_GPU";
        case CUDA_ERROR_INVALID_PTX: return "CUDA_ERROR_INVALID_PTX";
        case CUDA_ERROR_UNSUPPORTED_PTX_VERSION: return "CUDA_ERROR_UNSUPPORTED_PTX_VERSION";
        case CUDA_ERROR_INVALID_HANDLE: return "CUDA_ERROR_INVALID_HANDLE";
        case CUDA_ERROR_NOT_FOUND: return "CUDA_ERROR_NOT_FOUND";
        case CUDA_ERROR_NOT_READY: return "CUDA_ERROR_NOT_READY";
        case CUDA_ERROR_ILLEGAL_ADDRESS: return "CUDA_ERROR_ILLEGAL_ADDRESS";
        case CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: return "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES";
        case CUDA_ERROR_NOT_SUPPORTED: return "CUDA_ERROR_NOT_SUPPORTED";
        case CUDA_ERROR_UNKNOWN: return "CUDA_ERROR_UNKNOWN";
    }
    return nullptr;
}

const char* error_string(CUresult r) {
    switch (r) {
        case CUDA_SUCCESS: return "no error";
        case CUDA_ERROR_INVALID_VALUE: return "invalid argument";
        case CUDA_ERROR_OUT_OF_MEMORY: return "out of memory";
        case CUDA_ERROR_NOT_INITIALIZED: return "initialization error";
        case CUDA_ERROR_NO_DEVICE: return "no CUDA-capable device is detected";
        case CUDA_ERROR_INVALID_DEVICE: return "invalid device ordinal";
        case CUDA_ERROR_INVALID_IMAGE: return "device kernel image is invalid";
        case CUDA_ERROR_INVALID_CONTEXT: return "invalid device context";
        case CUDA_ERROR_NO_BINARY_FOR_GPU: return "no kernel image is available for execution on the device";
        case CUDA_ERROR_INVALID_PTX: return "a PTX JIT compilation failed";
        case CUDA_ERROR_UNSUPPORTED_PTX_VERSION: return "the provided PTX was compiled with an unsupported toolchain.";
        case CUDA_ERROR_INVALID_HANDLE: return "invalid resource handle";
        case CUDA_ERROR_NOT_FOUND: return "named symbol not found";
        case CUDA_ERROR_NOT_READY: return "device not ready";
        case CUDA_ERROR_ILLEGAL_ADDRESS: return "an illegal memory access was encountered";
        case CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: return "too many resources requested for launch";
        case CUDA_ERROR_NOT_SUPPORTED: return "operation not supported";
        case CUDA_ERROR_UNKNOWN: return "unknown error";
    }
    return nullptr;
}

}  // namespace
}  // namespace fake_cuda

using namespace fake_cuda;
using Lock = std::lock_guard<std::mutex>;

// ---------------------------------------------------------------- initialisation, devices

FAKE_API CUresult cuInit(unsigned flags) {
    Lock lock(g_mutex);
    if (flags != 0) return refuse(CUDA_ERROR_INVALID_VALUE, "cuInit", "flags must be 0, got %u", flags);
    // Threads as fibers: the backend's tests launch thousands of blocks that synchronise every
    // few hundred instructions, which OS threads would spend in the scheduler.
    emu::use_fibers(true);
    if (device().count == 0) {
        return refuse(CUDA_ERROR_NO_DEVICE, "cuInit", "FAKE_CUDA_DEVICE_COUNT=%s: the fake offers 1 to %d devices",
                      std::getenv("FAKE_CUDA_DEVICE_COUNT"), kMaxDevices);
    }
    if (!g_initialized) {
        for (int d = 0; d < device().count; ++d) {
            g_contexts[d].device = d;
            g_contexts[d].legacy = std::make_shared<Queue>();
            g_contexts[d].legacy->ctx = &g_contexts[d];
        }
    }
    g_initialized = true;
    return CUDA_SUCCESS;
}

FAKE_API CUresult cuDriverGetVersion(int* version) {
    if (!version) return refuse(CUDA_ERROR_INVALID_VALUE, "cuDriverGetVersion", "null output");
    *version = kDriverVersion;
    return CUDA_SUCCESS;
}

FAKE_API CUresult cuDeviceGetCount(int* count) {
    Lock lock(g_mutex);
    if (CUresult r = initialized("cuDeviceGetCount")) return r;
    if (!count) return refuse(CUDA_ERROR_INVALID_VALUE, "cuDeviceGetCount", "null output");
    *count = device().count;
    return CUDA_SUCCESS;
}

FAKE_API CUresult cuDeviceGet(CUdevice* dev, int ordinal) {
    Lock lock(g_mutex);
    if (CUresult r = check_device("cuDeviceGet", ordinal)) return r;
    if (!dev) return refuse(CUDA_ERROR_INVALID_VALUE, "cuDeviceGet", "null output");
    *dev = ordinal;
    return CUDA_SUCCESS;
}

FAKE_API CUresult cuDeviceGetName(char* name, int len, CUdevice dev) {
    Lock lock(g_mutex);
    if (CUresult r = check_device("cuDeviceGetName", dev)) return r;
    if (!name || len <= 0) return refuse(CUDA_ERROR_INVALID_VALUE, "cuDeviceGetName", "no buffer");
    std::snprintf(name, (std::size_t)len, "%s", device().name.c_str());
    return CUDA_SUCCESS;
}

FAKE_API CUresult cuDeviceTotalMem_v2(std::size_t* bytes, CUdevice dev) {
    Lock lock(g_mutex);
    if (CUresult r = check_device("cuDeviceTotalMem", dev)) return r;
    if (!bytes) return refuse(CUDA_ERROR_INVALID_VALUE, "cuDeviceTotalMem", "null output");
    *bytes = device().total_memory;
    return CUDA_SUCCESS;
}

FAKE_API CUresult cuDeviceGetAttribute(int* value, int attr, CUdevice dev) {
    Lock lock(g_mutex);
    if (CUresult r = check_device("cuDeviceGetAttribute", dev)) return r;
    if (!value) return refuse(CUDA_ERROR_INVALID_VALUE, "cuDeviceGetAttribute", "null output");
    bool known = false;
    const int v = attribute(attr, known);
    if (!known) return refuse(CUDA_ERROR_NOT_SUPPORTED, "cuDeviceGetAttribute", "attribute %d is not emulated", attr);
    *value = v;
    return CUDA_SUCCESS;
}

// ---------------------------------------------------------------- contexts

FAKE_API CUresult cuDevicePrimaryCtxRetain(CUcontext* ctx, CUdevice dev) {
    Lock lock(g_mutex);
    if (CUresult r = check_device("cuDevicePrimaryCtxRetain", dev)) return r;
    if (!ctx) return refuse(CUDA_ERROR_INVALID_VALUE, "cuDevicePrimaryCtxRetain", "null output");
    ++g_contexts[dev].retains;
    *ctx = &g_contexts[dev];
    return CUDA_SUCCESS;
}

FAKE_API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    Lock lock(g_mutex);
    if (CUresult r = check_device("cuDevicePrimaryCtxRelease", dev)) return r;
    if (g_contexts[dev].retains == 0) {
        return refuse(CUDA_ERROR_INVALID_CONTEXT, "cuDevicePrimaryCtxRelease", "released more often than retained");
    }
    --g_contexts[dev].retains;
    return CUDA_SUCCESS;
}

FAKE_API CUresult cuCtxGetCurrent(CUcontext* ctx) {
    Lock lock(g_mutex);
    if (CUresult r = initialized("cuCtxGetCurrent")) return r;
    if (!ctx) return refuse(CUDA_ERROR_INVALID_VALUE, "cuCtxGetCurrent", "null output");
    *ctx = t_current;
    return CUDA_SUCCESS;
}

FAKE_API CUresult cuCtxSetCurrent(CUcontext ctx) {
    Lock lock(g_mutex);
    if (CUresult r = initialized("cuCtxSetCurrent")) return r;
    if (ctx && (ctx < g_contexts || ctx >= g_contexts + device().count)) {
        return refuse(CUDA_ERROR_INVALID_CONTEXT, "cuCtxSetCurrent", "unknown context");
    }
    t_current = ctx;
    return CUDA_SUCCESS;
}

FAKE_API CUresult cuCtxGetDevice(CUdevice* dev) {
    Lock lock(g_mutex);
    if (CUresult r = current_context("cuCtxGetDevice")) return r;
    if (!dev) return refuse(CUDA_ERROR_INVALID_VALUE, "cuCtxGetDevice", "null output");
    *dev = t_current->device;
    return CUDA_SUCCESS;
}

// Only this context's work: another device's queues run when something waits for them.
FAKE_API CUresult cuCtxSynchronize() {
    Lock lock(g_mutex);
    if (CUresult r = current_context("cuCtxSynchronize")) return r;
    flush_context(t_current);
    return t_current->sticky;
}

// ---------------------------------------------------------------- memory
//
// Allocation is immediate (the address is the call's result). Synchronous calls first run
// everything queued, in every context, as they are ordered after it on a GPU (a stricter order
// than CUDA's for non-blocking streams and other devices, which only hides bugs the lazy streams
// would show, never invents one).

FAKE_API CUresult cuMemAlloc_v2(CUdeviceptr* ptr, std::size_t bytes) {
    Lock lock(g_mutex);
    return allocate("cuMemAlloc", ptr, bytes);
}

FAKE_API CUresult cuMemAllocAsync(CUdeviceptr* ptr, std::size_t bytes, CUstream s) {
    Lock lock(g_mutex);
    if (CUresult r = check_stream("cuMemAllocAsync", s)) return r;
    return allocate("cuMemAllocAsync", ptr, bytes);
}

FAKE_API CUresult cuMemFree_v2(CUdeviceptr ptr) {
    Lock lock(g_mutex);
    if (CUresult r = check_releasable("cuMemFree", ptr)) return r;
    flush_all();
    if (g_allocations.count(ptr)) release(ptr);
    return CUDA_SUCCESS;
}

// The memory goes back when the stream reaches the free: work queued before it on the stream
// may still use it; work elsewhere that nothing orders before the free finds it gone.
FAKE_API CUresult cuMemFreeAsync(CUdeviceptr ptr, CUstream s) {
    Lock lock(g_mutex);
    if (CUresult r = check_stream("cuMemFreeAsync", s)) return r;
    if (CUresult r = check_releasable("cuMemFreeAsync", ptr)) return r;
    g_freeing.insert(ptr);
    enqueue(s, [ptr] { release(ptr); });
    return CUDA_SUCCESS;
}

FAKE_API CUresult cuMemGetInfo_v2(std::size_t* free, std::size_t* total) {
    Lock lock(g_mutex);
    if (CUresult r = current_context("cuMemGetInfo")) return r;
    if (!free || !total) return refuse(CUDA_ERROR_INVALID_VALUE, "cuMemGetInfo", "null output");
    *total = device().total_memory;
    *free = *total - t_current->allocated;
    return CUDA_SUCCESS;
}

namespace {

// The copies and sets check their ranges when called (the driver's argument checks) and again
// when they run: by then a free queued elsewhere may have taken the memory.

void run_memset(CUdeviceptr dst, unsigned char value, std::size_t n) {
    if (!inside_allocation(dst, n)) return fault(CUDA_ERROR_ILLEGAL_ADDRESS, "memset", "destination was freed");
    std::memset((void*)dst, value, n);
}

void run_copy(CUdeviceptr dst, const void* src, std::size_t n) {
    if (!inside_allocation(dst, n)) return fault(CUDA_ERROR_ILLEGAL_ADDRESS, "copy", "destination was freed");
    std::memmove((void*)dst, src, n);
}

void run_dtod(CUdeviceptr dst, CUdeviceptr src, std::size_t n) {
    if (!inside_allocation(src, n)) return fault(CUDA_ERROR_ILLEGAL_ADDRESS, "copy", "source was freed");
    run_copy(dst, (const void*)src, n);
}

CUresult memset_d8(const char* api, CUdeviceptr dst, unsigned char value, std::size_t n, CUstream s) {
    if (n == 0) return CUDA_SUCCESS;
    if (CUresult r = check_range(api, "destination", dst, n)) return r;
    enqueue(s, [=] { run_memset(dst, value, n); });
    return CUDA_SUCCESS;
}

// The host source is read when the call is made (pageable memory: the caller may reuse it as
// soon as the call returns).
CUresult copy_htod(const char* api, CUdeviceptr dst, const void* src, std::size_t n, CUstream s) {
    if (n == 0) return CUDA_SUCCESS;
    ++g_copies_to_device;
    if (!src) return refuse(CUDA_ERROR_INVALID_VALUE, api, "null host source");
    if (CUresult r = check_range(api, "destination", dst, n)) return r;
    auto staged = std::make_shared<std::vector<unsigned char>>((const unsigned char*)src,
                                                              (const unsigned char*)src + n);
    enqueue(s, [=] { run_copy(dst, staged->data(), n); });
    return CUDA_SUCCESS;
}

// Into pageable host memory: the call returns with the data, after the work queued before it.
CUresult copy_dtoh(const char* api, void* dst, CUdeviceptr src, std::size_t n, CUstream s) {
    if (n == 0) return CUDA_SUCCESS;
    ++g_copies_to_host;
    if (!dst) return refuse(CUDA_ERROR_INVALID_VALUE, api, "null host destination");
    if (CUresult r = check_range(api, "source", src, n)) return r;
    const std::shared_ptr<Queue> q = queue_of(s);
    flush(*q);
    if (q->ctx->sticky != CUDA_SUCCESS) return q->ctx->sticky;
    if (!inside_allocation(src, n)) return refuse(CUDA_ERROR_ILLEGAL_ADDRESS, api, "the source was freed");
    std::memcpy(dst, (const void*)src, n);
    return CUDA_SUCCESS;
}

CUresult copy_dtod(const char* api, CUdeviceptr dst, CUdeviceptr src, std::size_t n, CUstream s) {
    if (n == 0) return CUDA_SUCCESS;
    if (CUresult r = check_range(api, "destination", dst, n)) return r;
    if (CUresult r = check_range(api, "source", src, n)) return r;
    enqueue(s, [=] { run_dtod(dst, src, n); });
    return CUDA_SUCCESS;
}

// A synchronous call: everything queued first, then the operation on the legacy stream, run now.
template <class F>
CUresult synchronous(const char* api, F call) {
    if (CUresult r = current_context(api)) return r;
    flush_all();
    if (CUresult r = call()) return r;
    flush_all();
    return t_current->sticky;
}

}  // namespace

FAKE_API CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char value, std::size_t n) {
    Lock lock(g_mutex);
    return synchronous("cuMemsetD8", [&] { return memset_d8("cuMemsetD8", dst, value, n, nullptr); });
}

FAKE_API CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char value, std::size_t n, CUstream s) {
    Lock lock(g_mutex);
    if (CUresult r = check_stream("cuMemsetD8Async", s)) return r;
    return memset_d8("cuMemsetD8Async", dst, value, n, s);
}

FAKE_API CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, std::size_t n) {
    Lock lock(g_mutex);
    return synchronous("cuMemcpyHtoD", [&] { return copy_htod("cuMemcpyHtoD", dst, src, n, nullptr); });
}

FAKE_API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, std::size_t n, CUstream s) {
    Lock lock(g_mutex);
    if (CUresult r = check_stream("cuMemcpyHtoDAsync", s)) return r;
    return copy_htod("cuMemcpyHtoDAsync", dst, src, n, s);
}

FAKE_API CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, std::size_t n) {
    Lock lock(g_mutex);
    return synchronous("cuMemcpyDtoH", [&] { return copy_dtoh("cuMemcpyDtoH", dst, src, n, nullptr); });
}

FAKE_API CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, std::size_t n, CUstream s) {
    Lock lock(g_mutex);
    if (CUresult r = check_stream("cuMemcpyDtoHAsync", s)) return r;
    return copy_dtoh("cuMemcpyDtoHAsync", dst, src, n, s);
}

FAKE_API CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, std::size_t n) {
    Lock lock(g_mutex);
    return synchronous("cuMemcpyDtoD", [&] { return copy_dtod("cuMemcpyDtoD", dst, src, n, nullptr); });
}

FAKE_API CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, std::size_t n, CUstream s) {
    Lock lock(g_mutex);
    if (CUresult r = check_stream("cuMemcpyDtoDAsync", s)) return r;
    return copy_dtod("cuMemcpyDtoDAsync", dst, src, n, s);
}

// ---------------------------------------------------------------- streams and events

FAKE_API CUresult cuStreamCreate(CUstream* s, unsigned flags) {
    Lock lock(g_mutex);
    if (CUresult r = current_context("cuStreamCreate")) return r;
    if (!s) return refuse(CUDA_ERROR_INVALID_VALUE, "cuStreamCreate", "null output");
    auto queue = std::make_shared<Queue>();
    queue->blocking = (flags & CU_STREAM_NON_BLOCKING) == 0;
    queue->ctx = t_current;
    *s = new CUstream_st{flags, std::move(queue)};
    g_streams.insert(*s);
    return CUDA_SUCCESS;
}

FAKE_API CUresult cuStreamCreateWithPriority(CUstream* s, unsigned flags, int) { return cuStreamCreate(s, flags); }

// The stream's queued work still runs (CUDA finishes it after the call returns; here first).
FAKE_API CUresult cuStreamDestroy_v2(CUstream s) {
    Lock lock(g_mutex);
    if (CUresult r = current_context("cuStreamDestroy")) return r;
    if (!g_streams.count(s)) return refuse(CUDA_ERROR_INVALID_HANDLE, "cuStreamDestroy", "unknown stream %p", (void*)s);
    flush(*s->queue);
    g_streams.erase(s);
    delete s;
    return CUDA_SUCCESS;
}

FAKE_API CUresult cuStreamSynchronize(CUstream s) {
    Lock lock(g_mutex);
    if (CUresult r = check_stream("cuStreamSynchronize", s)) return r;
    const std::shared_ptr<Queue> q = queue_of(s);
    flush(*q);
    return q->ctx->sticky;
}

// Runs the stream's work and says it is done (a query that answered "not ready" forever would
// stall a caller that polls).
FAKE_API CUresult cuStreamQuery(CUstream s) {
    Lock lock(g_mutex);
    if (CUresult r = check_stream("cuStreamQuery", s)) return r;
    const std::shared_ptr<Queue> q = queue_of(s);
    flush(*q);
    return q->ctx->sticky;
}

// The stream's later work waits for what the event's last record covers (nothing, when it was
// never recorded).
FAKE_API CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned) {
    Lock lock(g_mutex);
    if (CUresult r = check_stream("cuStreamWaitEvent", s)) return r;
    if (!g_events.count(e)) return refuse(CUDA_ERROR_INVALID_HANDLE, "cuStreamWaitEvent", "unknown event");
    if (e->queue) enqueue(s, [q = e->queue, upto = e->upto] { flush(*q, upto); });
    return CUDA_SUCCESS;
}

FAKE_API CUresult cuEventCreate(CUevent* e, unsigned flags) {
    Lock lock(g_mutex);
    if (CUresult r = current_context("cuEventCreate")) return r;
    if (!e) return refuse(CUDA_ERROR_INVALID_VALUE, "cuEventCreate", "null output");
    *e = new CUevent_st{flags, t_current, nullptr, 0, false, {}};
    g_events.insert(*e);
    return CUDA_SUCCESS;
}

// Whatever the event's last record covers still runs (its time is written into the event).
FAKE_API CUresult cuEventDestroy_v2(CUevent e) {
    Lock lock(g_mutex);
    if (CUresult r = current_context("cuEventDestroy")) return r;
    if (!g_events.count(e)) return refuse(CUDA_ERROR_INVALID_HANDLE, "cuEventDestroy", "unknown event");
    if (e->queue) flush(*e->queue, e->upto);
    g_events.erase(e);
    delete e;
    return CUDA_SUCCESS;
}

FAKE_API CUresult cuEventRecord(CUevent e, CUstream s) {
    Lock lock(g_mutex);
    if (CUresult r = check_stream("cuEventRecord", s)) return r;
    if (!g_events.count(e)) return refuse(CUDA_ERROR_INVALID_HANDLE, "cuEventRecord", "unknown event");
    // A re-record supersedes the last one; that one's timestamp must not land after it.
    if (e->queue) flush(*e->queue, e->upto);
    e->recorded = false;
    enqueue(s, [e] {
        e->recorded = true;
        e->at = std::chrono::steady_clock::now();
    });
    e->queue = queue_of(s);
    e->upto = e->queue->queued;
    return CUDA_SUCCESS;
}

FAKE_API CUresult cuEventSynchronize(CUevent e) {
    Lock lock(g_mutex);
    if (CUresult r = initialized("cuEventSynchronize")) return r;
    if (!g_events.count(e)) return refuse(CUDA_ERROR_INVALID_HANDLE, "cuEventSynchronize", "unknown event");
    if (e->queue) flush(*e->queue, e->upto);
    return (e->queue ? e->queue->ctx : e->ctx)->sticky;
}

// As cuStreamQuery: runs the work and says it is done.
FAKE_API CUresult cuEventQuery(CUevent e) {
    Lock lock(g_mutex);
    if (CUresult r = initialized("cuEventQuery")) return r;
    if (!g_events.count(e)) return refuse(CUDA_ERROR_INVALID_HANDLE, "cuEventQuery", "unknown event");
    if (e->queue) flush(*e->queue, e->upto);
    return (e->queue ? e->queue->ctx : e->ctx)->sticky;
}

// Host time between the two records (what ran in between ran on the CPU).
FAKE_API CUresult cuEventElapsedTime(float* ms, CUevent start, CUevent end) {
    Lock lock(g_mutex);
    if (CUresult r = initialized("cuEventElapsedTime")) return r;
    if (!ms) return refuse(CUDA_ERROR_INVALID_VALUE, "cuEventElapsedTime", "null output");
    if (!g_events.count(start) || !g_events.count(end)) {
        return refuse(CUDA_ERROR_INVALID_HANDLE, "cuEventElapsedTime", "unknown event");
    }
    if ((start->flags | end->flags) & CU_EVENT_DISABLE_TIMING || !start->queue || !end->queue) {
        return refuse(CUDA_ERROR_INVALID_HANDLE, "cuEventElapsedTime", "an event without timing or never recorded");
    }
    if (!start->recorded || !end->recorded) return CUDA_ERROR_NOT_READY;
    *ms = std::chrono::duration<float, std::milli>(end->at - start->at).count();
    return CUDA_SUCCESS;
}

// ---------------------------------------------------------------- modules and launches

FAKE_API CUresult cuModuleLoadData(CUmodule* module, const void* data) {
    Lock lock(g_mutex);
    if (CUresult r = current_context("cuModuleLoadData")) return r;
    if (!module) return refuse(CUDA_ERROR_INVALID_VALUE, "cuModuleLoadData", "null output");
    auto m = std::make_unique<CUmod_st>();
    std::string why;
    if (CUresult r = parse_image(data, device().cc_major, device().cc_minor, m->image, why)) {
        return refuse(r, "cuModuleLoadData", "%s", why.c_str());
    }
    m->ctx = t_current;
    *module = m.release();
    g_modules.insert(*module);
    return CUDA_SUCCESS;
}

FAKE_API CUresult cuModuleUnload(CUmodule module) {
    Lock lock(g_mutex);
    if (CUresult r = current_context("cuModuleUnload")) return r;
    if (!g_modules.count(module)) return refuse(CUDA_ERROR_INVALID_HANDLE, "cuModuleUnload", "unknown module");
    flush_all();  // queued launches of its kernels run first
    g_modules.erase(module);
    for (const auto& [name, f] : module->functions) g_functions.erase(f.get());
    delete module;
    return CUDA_SUCCESS;
}

FAKE_API CUresult cuModuleGetFunction(CUfunction* function, CUmodule module, const char* name) {
    Lock lock(g_mutex);
    const char* api = "cuModuleGetFunction";
    if (CUresult r = current_context(api)) return r;
    if (!function || !name) return refuse(CUDA_ERROR_INVALID_VALUE, api, "null argument");
    if (!g_modules.count(module)) return refuse(CUDA_ERROR_INVALID_HANDLE, api, "unknown module");
    if (const auto f = module->functions.find(name); f != module->functions.end()) {
        *function = f->second.get();
        return CUDA_SUCCESS;
    }
    const auto in_image = module->image.kernels.find(name);
    if (in_image == module->image.kernels.end()) {
        std::string have;
        for (const auto& [k, _] : module->image.kernels) have += (have.empty() ? "" : ", ") + k;
        return refuse(CUDA_ERROR_NOT_FOUND, api, "no kernel %s in this %s module (it has %s)", name,
                      module->image.kind, have.c_str());
    }
    const Kernel* kernel = find_kernel(name);
    if (!kernel) {
        return refuse(CUDA_ERROR_NOT_FOUND, api,
                      "kernel %s is in the module but not compiled into the fake driver: the embedded kernels are "
                      "newer than this build of the fake (cargo xtask gpu-emu rebuilds it)",
                      name);
    }
    // The fake runs kernels-cu/ as it is now; the module is what the backend embedded. Different
    // parameter lists mean stale embedded kernels, whose launches the fake would misread.
    std::vector<std::size_t> compiled;
    for (const Param& p : kernel->params) compiled.push_back(p.size);
    const ImageKernel& meta = in_image->second;
    if (meta.params_known && meta.param_sizes != compiled) {
        return refuse(CUDA_ERROR_INVALID_IMAGE, api,
                      "kernel %s takes parameters of %s bytes in the %s module but %s in kernels-cu/: the embedded "
                      "kernels are stale (run cargo xtask kernels, then rebuild)",
                      name, sizes(meta.param_sizes).c_str(), module->image.kind, sizes(compiled).c_str());
    }
    const std::size_t dynamic = kMaxSharedPerBlock - std::min<std::size_t>(meta.static_shared, kMaxSharedPerBlock);
    auto f = std::make_unique<CUfunc_st>(CUfunc_st{kernel, meta, max_threads_of(meta), dynamic, module->ctx});
    *function = f.get();
    g_functions.insert(f.get());
    module->functions[name] = std::move(f);
    return CUDA_SUCCESS;
}

FAKE_API CUresult cuFuncGetAttribute(int* value, int attr, CUfunction f) {
    Lock lock(g_mutex);
    const char* api = "cuFuncGetAttribute";
    if (CUresult r = initialized(api)) return r;
    if (!value) return refuse(CUDA_ERROR_INVALID_VALUE, api, "null output");
    if (!g_functions.count(f)) return refuse(CUDA_ERROR_INVALID_HANDLE, api, "unknown function");
    switch (attr) {
        case CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *value = (int)f->max_threads; return CUDA_SUCCESS;
        case CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES: *value = (int)f->image.static_shared; return CUDA_SUCCESS;
        case CU_FUNC_ATTRIBUTE_NUM_REGS:
            if (!f->image.registers) break;
            *value = (int)f->image.registers;
            return CUDA_SUCCESS;
        case CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: *value = (int)f->max_dynamic_shared; return CUDA_SUCCESS;
        default: break;
    }
    return refuse(CUDA_ERROR_NOT_SUPPORTED, api, "attribute %d of %s is not emulated", attr, f->kernel->name);
}

FAKE_API CUresult cuFuncSetAttribute(CUfunction f, int attr, int value) {
    Lock lock(g_mutex);
    const char* api = "cuFuncSetAttribute";
    if (CUresult r = initialized(api)) return r;
    if (!g_functions.count(f)) return refuse(CUDA_ERROR_INVALID_HANDLE, api, "unknown function");
    if (attr != CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES) {
        return refuse(CUDA_ERROR_NOT_SUPPORTED, api, "setting attribute %d of %s is not emulated", attr,
                      f->kernel->name);
    }
    if (value < 0 || f->image.static_shared + (std::size_t)value > (std::size_t)kMaxSharedPerBlockOptIn) {
        return refuse(CUDA_ERROR_INVALID_VALUE, api,
                      "%s: %d bytes of dynamic shared memory with %zu static: more than a block may have (%d)",
                      f->kernel->name, value, f->image.static_shared, kMaxSharedPerBlockOptIn);
    }
    f->max_dynamic_shared = (std::size_t)value;
    return CUDA_SUCCESS;
}

FAKE_API CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                 unsigned bz, unsigned shared_bytes, CUstream s, void** params, void** extra) {
    Lock lock(g_mutex);
    const char* api = "cuLaunchKernel";
    if (CUresult r = check_stream(api, s)) return r;
    if (!g_functions.count(f)) return refuse(CUDA_ERROR_INVALID_HANDLE, api, "unknown function");
    const Kernel& k = *f->kernel;
    if (extra) return refuse(CUDA_ERROR_NOT_SUPPORTED, api, "%s: `extra` parameter buffers are not emulated", k.name);
    // A launch runs in the current context: its module must have been loaded there, and a
    // created stream must be one of its streams.
    const int dev = t_current->device;
    if (f->ctx != t_current) {
        return refuse(CUDA_ERROR_INVALID_HANDLE, api, "%s: its module was loaded on cuda:%d, the launch is on cuda:%d",
                      k.name, f->ctx->device, dev);
    }
    if (!is_default_stream(s) && s->queue->ctx != t_current) {
        return refuse(CUDA_ERROR_INVALID_HANDLE, api, "%s: stream %p is cuda:%d's, the launch is on cuda:%d", k.name,
                      (void*)s, s->queue->ctx->device, dev);
    }
    const std::uint64_t threads = (std::uint64_t)bx * by * bz;
    if (threads == 0 || bx > 1024 || by > 1024 || bz > 64 || threads > kMaxThreads) {
        return refuse(CUDA_ERROR_INVALID_VALUE, api, "%s: invalid block (%u, %u, %u)", k.name, bx, by, bz);
    }
    if (threads > f->max_threads) {
        return refuse(CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, api,
                      "%s: %llu threads per block, at most %u (launch bounds %u, %u registers per thread)", k.name,
                      (unsigned long long)threads, f->max_threads, f->image.max_threads, f->image.registers);
    }
    if (gx == 0 || gy == 0 || gz == 0 || gx > 0x7fffffffu || gy > 65535 || gz > 65535) {
        return refuse(CUDA_ERROR_INVALID_VALUE, api, "%s: invalid grid (%u, %u, %u)", k.name, gx, gy, gz);
    }
    if ((std::uint64_t)gx * gy * gz > kMaxEmulatedBlocks) {
        return refuse(CUDA_ERROR_NOT_SUPPORTED, api, "%s: grid (%u, %u, %u) has more blocks than the emulator runs",
                      k.name, gx, gy, gz);
    }
    if (shared_bytes > f->max_dynamic_shared) {
        return refuse(CUDA_ERROR_INVALID_VALUE, api,
                      "%s: %u bytes of dynamic shared memory, at most %zu (%zu static; above 48 KiB in all, "
                      "cuFuncSetAttribute must opt in)",
                      k.name, shared_bytes, f->max_dynamic_shared, f->image.static_shared);
    }
    if (!params && !k.params.empty()) return refuse(CUDA_ERROR_INVALID_VALUE, api, "%s: no kernelParams", k.name);
    // A pointer argument must be null (the kernels' optional inputs) or point into the
    // launching device's memory; anything else (a swapped argument, a host pointer, freed
    // memory, another device's memory without peer access) would fault on the GPU.
    for (std::size_t i = 0; i < k.params.size(); ++i) {
        if (!k.params[i].pointer) continue;
        const auto ptr = load_param<CUdeviceptr>(params[i]);
        if (ptr == 0) continue;
        const Allocation* a = find_allocation(ptr, 1);
        if (!a) {
            return refuse(CUDA_ERROR_ILLEGAL_ADDRESS, api, "%s: argument %zu (%#llx) is not a device pointer", k.name,
                          i, ptr);
        }
        if (a->device != dev) {
            return refuse(CUDA_ERROR_ILLEGAL_ADDRESS, api,
                          "%s: argument %zu (%#llx) is memory of cuda:%d, the launch is on cuda:%d", k.name, i, ptr,
                          a->device, dev);
        }
    }
    // The launch keeps copies of the argument values (the caller's may be gone when it runs).
    std::vector<std::vector<unsigned char>> values;
    for (std::size_t i = 0; i < k.params.size(); ++i) {
        const auto* p = (const unsigned char*)params[i];
        values.emplace_back(p, p + k.params[i].size);
    }
    enqueue(s, [&k, grid = dim3(gx, gy, gz), block = dim3(bx, by, bz), shared_bytes, values = std::move(values), dev] {
        std::vector<void*> args;
        for (std::size_t i = 0; i < values.size(); ++i) {
            const auto ptr = k.params[i].pointer ? load_param<CUdeviceptr>(values[i].data()) : 0;
            const Allocation* a = ptr != 0 ? find_allocation(ptr, 1) : nullptr;
            if (ptr != 0 && (!a || a->device != dev)) {
                return fault(CUDA_ERROR_ILLEGAL_ADDRESS, "cuLaunchKernel", "%s: argument %zu (%#llx) was freed", k.name,
                             i, ptr);
            }
            args.push_back((void*)values[i].data());
        }
        k.run(k.name, grid, block, shared_bytes, args.data());
    });
    return CUDA_SUCCESS;
}

// ---------------------------------------------------------------- linked, never called

// Entry points cudarc's safe layer names and the backend never calls. They are here so that a
// build linking this library at build time resolves every symbol (cudarc's `dynamic-linking`,
// which a build holding candle's CUDA backend turns on: vae_tensor::cuda's module doc); loaded
// at run time, cudarc looks a function up only when it is called.

FAKE_API CUresult cuCtxDestroy_v2(CUcontext) {
    Lock lock(g_mutex);
    return refuse(CUDA_ERROR_NOT_SUPPORTED, "cuCtxDestroy", "not emulated: only primary contexts are");
}

FAKE_API CUresult cuModuleLoad(CUmodule*, const char*) {
    Lock lock(g_mutex);
    return refuse(CUDA_ERROR_NOT_SUPPORTED, "cuModuleLoad", "not emulated: images load from memory");
}

FAKE_API CUresult cuMemcpyPeerAsync(CUdeviceptr, CUcontext, CUdeviceptr, CUcontext, std::size_t, CUstream) {
    Lock lock(g_mutex);
    return refuse(CUDA_ERROR_NOT_SUPPORTED, "cuMemcpyPeerAsync", "not emulated: addresses are unified");
}

// ---------------------------------------------------------------- errors

FAKE_API CUresult cuGetErrorName(CUresult r, const char** name) {
    if (!name) return CUDA_ERROR_INVALID_VALUE;
    *name = error_name(r);
    return *name ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

FAKE_API CUresult cuGetErrorString(CUresult r, const char** text) {
    if (!text) return CUDA_ERROR_INVALID_VALUE;
    *text = error_string(r);
    return *text ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

// ---------------------------------------------------------------- for the fake NCCL (fake_cuda.h)

namespace {

CUresult range_of(CUdeviceptr ptr, std::size_t bytes, int device, int* owner) {
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    const Allocation* a = find_allocation(ptr, std::max<std::size_t>(bytes, 1));
    if (!a) return CUDA_ERROR_INVALID_VALUE;
    if (a->device != device) {
        if (owner) *owner = a->device;
        return CUDA_ERROR_INVALID_DEVICE;
    }
    return CUDA_SUCCESS;
}

}  // namespace

FAKE_API CUresult fake_cuda_check_range(CUdeviceptr ptr, std::size_t bytes, int device, int* owner) {
    Lock lock(g_mutex);
    return range_of(ptr, bytes, device, owner);
}

FAKE_API CUresult fake_cuda_synchronize(CUstream s, int device, int* owner) {
    Lock lock(g_mutex);
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (device < 0 || device >= fake_cuda::device().count) return CUDA_ERROR_INVALID_DEVICE;
    if (!is_default_stream(s) && !g_streams.count(s)) return CUDA_ERROR_INVALID_HANDLE;
    const std::shared_ptr<Queue> q = is_default_stream(s) ? g_contexts[device].legacy : s->queue;
    if (q->ctx->device != device) {
        if (owner) *owner = q->ctx->device;
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    // An NCCL call is work queued on `s`: what the legacy ordering puts before it runs first.
    run_predecessors(*q);
    flush(*q);
    return q->ctx->sticky;
}

FAKE_API CUresult fake_cuda_read(void* dst, CUdeviceptr src, std::size_t bytes, int device) {
    Lock lock(g_mutex);
    if (bytes == 0) return CUDA_SUCCESS;
    if (CUresult r = range_of(src, bytes, device, nullptr)) return r;
    std::memcpy(dst, (const void*)src, bytes);
    return CUDA_SUCCESS;
}

FAKE_API CUresult fake_cuda_write(CUdeviceptr dst, const void* src, std::size_t bytes, int device) {
    Lock lock(g_mutex);
    if (bytes == 0) return CUDA_SUCCESS;
    if (CUresult r = range_of(dst, bytes, device, nullptr)) return r;
    std::memmove((void*)dst, src, bytes);
    return CUDA_SUCCESS;
}

FAKE_API CUresult fake_cuda_host_copies(unsigned long long* to_device, unsigned long long* to_host) {
    Lock lock(g_mutex);
    if (!to_device || !to_host) return CUDA_ERROR_INVALID_VALUE;
    *to_device = g_copies_to_device;
    *to_host = g_copies_to_host;
    return CUDA_SUCCESS;
}
