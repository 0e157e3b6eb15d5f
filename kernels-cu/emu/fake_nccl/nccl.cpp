// A fake libnccl.so: the slice of NCCL's C API that cudarc calls, for the fake driver's devices
// (../fake_driver/), so that NCCL code runs with several ranks where there are no GPUs. The
// ranks of a communicator are threads of one process (ncclCommInitAll) or processes
// (ncclCommInitRank with a unique id handed between them), connected by Unix-domain sockets
// (mesh.h); device memory is host memory, read and written through the fake driver.
//
// Semantics, as NCCL where it matters:
// - Stream order: before a call touches its buffers, the work queued on its stream runs (the
//   fake driver's streams are lazy); the results are in the receive buffers when the call, or
//   the group's outermost ncclGroupEnd, returns (stricter than NCCL, which only queues them).
// - Groups nest (a thread-local depth, as NCCL's); calls inside one are checked when made and
//   run at the outermost ncclGroupEnd: every send is posted before any receive waits, so sends
//   and receives in any order cannot deadlock, and collectives inside a group work too (also
//   one thread driving every rank's communicator, as with ncclCommInitAll).
// - Collectives exchange every rank's call, so every rank knows whether all made the same one.
// - Reductions go in rank order, so every rank gets the same bits.
//
// Refused with NCCL's codes and a line on stderr saying why: null or unknown communicators, ranks
// and roots out of range, two ranks of a communicator on one device ("Duplicate GPU detected",
// ncclInvalidUsage), buffers that are not device memory of the communicator's device with
// enough bytes and streams of another device (ncclInvalidArgument), and, where NCCL would corrupt
// memory or hang instead, a send whose count or type differs from the peer's receive and
// collectives that differ between ranks (ncclInvalidUsage on every rank involved). A peer that
// left is ncclRemoteError; no wait lasts beyond FAKE_NCCL_TIMEOUT_S (60 s: ncclSystemError);
// ncclCommAbort from another thread ends the rank's wait. A call that fails leaves its
// communicator failed: later calls return the same error, and the other ranks are told, so none
// waits for a message that will not come (NCCL would leave them waiting).
#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <set>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "fake_cuda.h"
#include "mesh.h"
#include "nccl_api.h"

#define FAKE_API extern "C" __attribute__((visibility("default")))

using fake_nccl::Error;
using fake_nccl::fail;

struct ncclComm {
    std::unique_ptr<fake_nccl::Mesh> mesh;
    int rank = 0;
    int nranks = 0;
    int device = 0;
    std::mutex mutex;  // what follows
    std::condition_variable idle;
    int busy = 0;                // threads inside a call on it (abort waits for them to leave)
    std::uint64_t collectives = 0;  // collectives called so far (each one's number)
    Error failed;                // the first failure
};

namespace {

// ---------------------------------------------------------------- errors

const char* result_name(ncclResult_t r) {
    switch (r) {
        case ncclSuccess: return "ncclSuccess";
        case ncclUnhandledCudaError: return "ncclUnhandledCudaError";
        case ncclSystemError: return "ncclSystemError";
        case ncclInternalError: return "ncclInternalError";
        case ncclInvalidArgument: return "ncclInvalidArgument";
        case ncclInvalidUsage: return "ncclInvalidUsage";
        case ncclRemoteError: return "ncclRemoteError";
        case ncclInProgress: return "ncclInProgress";
        default: return "an unknown ncclResult_t";
    }
}

thread_local std::string t_last_error;

// Reports a failed call on stderr (NCCL only returns the code; the reason makes a failure under
// the fake quick to diagnose) and returns its code.
ncclResult_t report(const char* api, const Error& e) {
    t_last_error = std::string(api) + ": " + e.why;
    std::fprintf(stderr, "fake libnccl: %s failed (%s): %s\n", api, result_name(e.code), e.why.c_str());
    return e.code;
}

// ---------------------------------------------------------------- communicators

// The live communicators of this process: a call on any other pointer is refused.
std::mutex g_comms_mutex;
std::set<ncclComm*> g_comms;

// A call's hold on a communicator: while any is held, the communicator is not freed.
class Entered {
public:
    Entered() = default;
    Entered(const Entered&) = delete;
    Entered& operator=(const Entered&) = delete;
    Entered(Entered&& o) noexcept : comm_(std::exchange(o.comm_, nullptr)) {}
    ~Entered() {
        if (!comm_) return;
        std::lock_guard<std::mutex> lock(comm_->mutex);
        if (--comm_->busy == 0) comm_->idle.notify_all();
    }

    void release() { Entered().swap(*this); }
    void swap(Entered& o) noexcept { std::swap(comm_, o.comm_); }

    // Holds `comm`, which must be live.
    Error hold(ncclComm* comm) {
        std::lock_guard<std::mutex> lock(g_comms_mutex);
        if (!comm) return fail(ncclInvalidArgument, "a null communicator");
        if (!g_comms.count(comm)) {
            return fail(ncclInvalidArgument, "communicator %p is not one of this process (destroyed or aborted?)",
                        (void*)comm);
        }
        std::lock_guard<std::mutex> busy(comm->mutex);
        ++comm->busy;
        comm_ = comm;
        return {};
    }

    // Holds `comm`, which must be live and not failed.
    Error enter(ncclComm* comm) {
        if (Error e = hold(comm)) return e;
        std::lock_guard<std::mutex> lock(comm->mutex);
        if (comm->failed) {
            return Error{comm->failed.code,
                         "rank " + std::to_string(comm->rank) + "'s communicator failed earlier: " + comm->failed.why};
        }
        return {};
    }

private:
    ncclComm* comm_ = nullptr;
};

// Marks `comm` failed with `e` (once) and tells the other ranks.
void poison(ncclComm* comm, const Error& e) {
    {
        std::lock_guard<std::mutex> lock(comm->mutex);
        if (comm->failed) return;
        comm->failed = e;
    }
    comm->mesh->tell_failed(e.why);
}

// Frees `comm` once no call holds it; its waits end first.
ncclResult_t teardown(ncclComm* comm, const char* api) {
    if (!comm) return ncclSuccess;  // as NCCL
    {
        std::lock_guard<std::mutex> lock(g_comms_mutex);
        if (!g_comms.erase(comm)) {
            return report(api, fail(ncclInvalidArgument, "communicator %p is not one of this process (freed twice?)",
                                    (void*)comm));
        }
    }
    comm->mesh->abort();
    {
        std::unique_lock<std::mutex> lock(comm->mutex);
        comm->idle.wait(lock, [comm] { return comm->busy == 0; });
    }
    delete comm;
    return ncclSuccess;
}

Error cuda_devices(int& count) {
    count = 0;
    if (CUresult r = cuInit(0)) return fail(ncclUnhandledCudaError, "cuInit failed (CUDA error %d)", (int)r);
    if (CUresult r = cuDeviceGetCount(&count)) return fail(ncclUnhandledCudaError, "cuDeviceGetCount failed (%d)", (int)r);
    return {};
}

// Joins the communicator `id` names as `rank` of `nranks` on `device`.
Error init_rank(const ncclUniqueId& id, int nranks, int rank, int device, ncclComm_t* out) {
    fake_nccl::Rendezvous at;
    if (!fake_nccl::read_unique_id(id, at)) {
        return fail(ncclInvalidArgument, "the unique id is not one of this fake's ncclGetUniqueId");
    }
    auto comm = std::make_unique<ncclComm>();
    comm->rank = rank;
    comm->nranks = nranks;
    comm->device = device;
    if (Error e = fake_nccl::Mesh::join(at, nranks, rank, device, comm->mesh)) return e;
    std::lock_guard<std::mutex> lock(g_comms_mutex);
    g_comms.insert(comm.get());
    *out = comm.release();
    return {};
}

// ---------------------------------------------------------------- data types and reductions

std::size_t type_size(int t) {
    switch (t) {
        case ncclInt8:
        case ncclUint8:
        case ncclFloat8e4m3:
        case ncclFloat8e5m2: return 1;
        case ncclFloat16:
        case ncclBfloat16: return 2;
        case ncclInt32:
        case ncclUint32:
        case ncclFloat32: return 4;
        case ncclInt64:
        case ncclUint64:
        case ncclFloat64: return 8;
        default: return 0;
    }
}

const char* type_name(int t) {
    static const char* const names[] = {"int8",    "uint8",   "int32",    "uint32",        "int64",        "uint64",
                                        "float16", "float32", "float64", "bfloat16", "float8e4m3", "float8e5m2"};
    return t >= 0 && t < ncclNumTypes ? names[t] : "an unknown type";
}

const char* op_name(int op) {
    static const char* const names[] = {"sum", "prod", "max", "min", "avg"};
    return op >= 0 && op < ncclNumOps ? names[op] : "an unknown op";
}

// IEEE half and bfloat16 through float, rounding to nearest even, as the GPU converts them.
float half_to_float(std::uint16_t h) {
    const std::uint32_t sign = (std::uint32_t)(h & 0x8000) << 16;
    std::uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000 | (mant << 13);
    } else if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else {  // subnormal: normalise
            int e = -1;
            do {
                mant <<= 1;
                ++e;
            } while (!(mant & 0x400));
            bits = sign | ((std::uint32_t)(127 - 15 - e) << 23) | ((mant & 0x3ff) << 13);
        }
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

std::uint16_t float_to_half(float f) {
    std::uint32_t bits;
    std::memcpy(&bits, &f, 4);
    const std::uint16_t sign = (bits >> 16) & 0x8000;
    const std::uint32_t abs = bits & 0x7fffffff;
    if (abs > 0x7f800000) return sign | 0x7e00;  // NaN
    if (abs >= 0x477ff000) return sign | 0x7c00;  // rounds to infinity
    if (abs < 0x38800000) {                         // a subnormal half (or zero)
        const float scaled = std::fabs(f) * 16777216.0f;  // in units of 2^-24, exact
        return sign | (std::uint16_t)std::nearbyint(scaled);
    }
    const std::uint32_t rounded = abs + 0xfff + ((abs >> 13) & 1);
    return sign | (std::uint16_t)((rounded - 0x38000000) >> 13);
}

float bf16_to_float(std::uint16_t h) {
    const std::uint32_t bits = (std::uint32_t)h << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

std::uint16_t float_to_bf16(float f) {
    std::uint32_t bits;
    std::memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffff) > 0x7f800000) return (std::uint16_t)((bits >> 16) | 0x40);  // NaN stays NaN
    return (std::uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

template <class T>
T combine(T a, T b, int op) {
    if constexpr (std::is_floating_point_v<T>) {
        switch (op) {
            case ncclProd: return a * b;
            case ncclMax: return std::fmax(a, b);  // as the GPU's fmax: a NaN loses to a number
            case ncclMin: return std::fmin(a, b);
            default: return a + b;  // sum, and avg before its division
        }
    } else {
        // Wrapping, as on the GPU (signed overflow is defined on unsigned values).
        using U = std::make_unsigned_t<T>;
        switch (op) {
            case ncclProd: return (T)(U)((U)a * (U)b);
            case ncclMax: return std::max(a, b);
            case ncclMin: return std::min(a, b);
            default: return (T)(U)((U)a + (U)b);
        }
    }
}

// acc[i] = acc[i] op in[i] for `n` elements of type T, accumulated in T.
template <class T>
void combine_all(unsigned char* acc, const unsigned char* in, std::size_t n, int op) {
    for (std::size_t i = 0; i < n; ++i) {
        T a, b;
        std::memcpy(&a, acc + i * sizeof(T), sizeof(T));
        std::memcpy(&b, in + i * sizeof(T), sizeof(T));
        a = combine(a, b, op);
        std::memcpy(acc + i * sizeof(T), &a, sizeof(T));
    }
}

template <class T>
void divide_all(unsigned char* acc, std::size_t n, int by) {
    for (std::size_t i = 0; i < n; ++i) {
        T a;
        std::memcpy(&a, acc + i * sizeof(T), sizeof(T));
        a = (T)(a / (T)by);
        std::memcpy(acc + i * sizeof(T), &a, sizeof(T));
    }
}

// The 16-bit float types, each step rounded back to 16 bits as the GPU's half arithmetic does.
template <float (*Widen)(std::uint16_t), std::uint16_t (*Narrow)(float)>
void combine_16(unsigned char* acc, const unsigned char* in, std::size_t n, int op, int divide_by) {
    for (std::size_t i = 0; i < n; ++i) {
        std::uint16_t a, b;
        std::memcpy(&a, acc + i * 2, 2);
        float r = Widen(a);
        if (in) {
            std::memcpy(&b, in + i * 2, 2);
            r = combine(r, Widen(b), op);
        } else {
            r /= (float)divide_by;
        }
        a = Narrow(r);
        std::memcpy(acc + i * 2, &a, 2);
    }
}

// The reduction of `inputs` (one per rank, `n` elements each) in rank order.
std::vector<unsigned char> reduce(const std::vector<const unsigned char*>& inputs, std::size_t n, int dtype, int op) {
    const std::size_t size = type_size(dtype);
    std::vector<unsigned char> acc(inputs[0], inputs[0] + n * size);
    const int ranks = (int)inputs.size();
    for (std::size_t r = 1; r <= inputs.size(); ++r) {
        const bool last = r == inputs.size();
        // After the last input: avg's division by the number of ranks.
        if (last && op != ncclAvg) break;
        const unsigned char* in = last ? nullptr : inputs[r];
        switch (dtype) {
#define FAKE_NCCL_REDUCE(tag, T)                                \
    case tag:                                                   \
        if (in) {                                               \
            combine_all<T>(acc.data(), in, n, op);              \
        } else {                                                \
            divide_all<T>(acc.data(), n, ranks);                \
        }                                                       \
        break;
            FAKE_NCCL_REDUCE(ncclInt8, std::int8_t)
            FAKE_NCCL_REDUCE(ncclUint8, std::uint8_t)
            FAKE_NCCL_REDUCE(ncclInt32, std::int32_t)
            FAKE_NCCL_REDUCE(ncclUint32, std::uint32_t)
            FAKE_NCCL_REDUCE(ncclInt64, std::int64_t)
            FAKE_NCCL_REDUCE(ncclUint64, std::uint64_t)
            FAKE_NCCL_REDUCE(ncclFloat32, float)
            FAKE_NCCL_REDUCE(ncclFloat64, double)
#undef FAKE_NCCL_REDUCE
            case ncclFloat16: combine_16<half_to_float, float_to_half>(acc.data(), in, n, op, ranks); break;
            case ncclBfloat16: combine_16<bf16_to_float, float_to_bf16>(acc.data(), in, n, op, ranks); break;
            default: break;  // refused when called
        }
    }
    return acc;
}

// ---------------------------------------------------------------- calls

enum class Kind { Send, Recv, Broadcast, Reduce, AllGather, AllReduce, ReduceScatter };

const char* kind_name(Kind k) {
    switch (k) {
        case Kind::Send: return "ncclSend";
        case Kind::Recv: return "ncclRecv";
        case Kind::Broadcast: return "ncclBroadcast";
        case Kind::Reduce: return "ncclReduce";
        case Kind::AllGather: return "ncclAllGather";
        case Kind::AllReduce: return "ncclAllReduce";
        case Kind::ReduceScatter: return "ncclReduceScatter";
    }
    return "?";
}

bool is_collective(Kind k) { return k != Kind::Send && k != Kind::Recv; }
bool reduces(Kind k) { return k == Kind::Reduce || k == Kind::AllReduce || k == Kind::ReduceScatter; }
bool rooted(Kind k) { return k == Kind::Broadcast || k == Kind::Reduce; }

// One call, as made (checked), then as it runs.
struct Call {
    Call(Kind kind, ncclComm* comm, const void* send, void* recv, std::size_t count, int dtype, int op, int peer,
         CUstream stream)
        : kind(kind), comm(comm), send(send), recv(recv), count(count), dtype(dtype), op(op), peer(peer),
          stream(stream) {}

    Kind kind;
    ncclComm* comm;
    const void* send;
    void* recv;
    std::size_t count;  // NCCL's count argument (per rank for all_gather and reduce_scatter)
    int dtype;
    int op;
    int peer;  // the peer (send, recv) or the root (broadcast, reduce)
    CUstream stream;
    std::uint64_t seq = 0;  // collectives: its number on the communicator
    int caller = -1;        // the calling rank (the communicator may be gone when a group fails)
    std::vector<unsigned char> staged;  // what this rank sends, read from the device
    Error error;
    Entered held;

    std::size_t elem() const { return type_size(dtype); }
    int rank() const { return comm->rank; }
    int nranks() const { return comm->nranks; }
    // Bytes this rank's send buffer must have (0 when it has none) and its receive buffer.
    std::size_t send_bytes() const {
        switch (kind) {
            case Kind::Recv: return 0;
            case Kind::Broadcast: return rank() == peer ? count * elem() : 0;
            case Kind::ReduceScatter: return count * elem() * nranks();
            default: return count * elem();
        }
    }
    std::size_t recv_bytes() const {
        switch (kind) {
            case Kind::Send: return 0;
            case Kind::Reduce: return rank() == peer ? count * elem() : 0;
            case Kind::AllGather: return count * elem() * nranks();
            default: return count * elem();
        }
    }
    std::string describe() const {
        char text[160];
        if (is_collective(kind)) {
            std::snprintf(text, sizeof text, "%s #%llu (%zu x %s", kind_name(kind), (unsigned long long)seq, count,
                          type_name(dtype));
        } else {
            std::snprintf(text, sizeof text, "%s %s rank %d (%zu x %s", kind_name(kind),
                          kind == Kind::Send ? "to" : "from", peer, count, type_name(dtype));
        }
        std::string s = text;
        if (reduces(kind)) s += std::string(", ") + op_name(op);
        if (rooted(kind)) s += ", root " + std::to_string(peer);
        return s + ")";
    }
};

std::string describe_header(const fake_nccl::Header& h) {
    Call c((Kind)h.op, nullptr, nullptr, nullptr, h.count, h.dtype, h.redop, h.root, nullptr);
    c.seq = h.seq;
    return c.describe();
}

// Checks a buffer of `bytes` at `ptr`: device memory of the communicator's device.
Error check_buffer(const char* what, const void* ptr, std::size_t bytes, const ncclComm* comm) {
    if (bytes == 0) return {};
    int owner = -1;
    switch (fake_cuda_check_range((CUdeviceptr)ptr, bytes, comm->device, &owner)) {
        case CUDA_SUCCESS: return {};
        case CUDA_ERROR_INVALID_DEVICE:
            return fail(ncclInvalidArgument, "%s %p is memory of cuda:%d, and rank %d's communicator is on cuda:%d", what,
                        ptr, owner, comm->rank, comm->device);
        case CUDA_ERROR_NOT_INITIALIZED: return fail(ncclInvalidArgument, "%s %p: CUDA is not initialised", what, ptr);
        default:
            return fail(ncclInvalidArgument, "%s [%p, +%zu bytes) is not inside one allocation of device memory", what,
                        ptr, bytes);
    }
}

// The checks NCCL makes when a call is made (before it is queued or grouped).
Error check_arguments(const Call& c) {
    if (type_size(c.dtype) == 0) return fail(ncclInvalidArgument, "datatype %d is not an ncclDataType_t", c.dtype);
    if (reduces(c.kind)) {
        if (c.op < 0 || c.op >= ncclNumOps) {
            return fail(ncclInvalidArgument, "reduction %d is not one of sum, prod, max, min, avg (custom "
                        "reductions are not emulated)", c.op);
        }
        if (c.dtype == ncclFloat8e4m3 || c.dtype == ncclFloat8e5m2) {
            return fail(ncclInvalidArgument, "reductions of %s are not emulated", type_name(c.dtype));
        }
    }
    if ((!is_collective(c.kind) || rooted(c.kind)) && (c.peer < 0 || c.peer >= c.nranks())) {
        return fail(ncclInvalidArgument, "%s %d is out of range for a communicator of %d ranks",
                    rooted(c.kind) ? "root" : "peer", c.peer, c.nranks());
    }
    if (Error e = check_buffer("sendbuff", c.send, c.send_bytes(), c.comm)) return e;
    return check_buffer("recvbuff", c.recv, c.recv_bytes(), c.comm);
}

// Holds `c`'s communicator and checks the arguments. A refused call leaves the other ranks
// waiting for this one: its communicator fails, and they are told.
Error check_call(Call& c) {
    if (Error e = c.held.enter(c.comm)) return e;
    c.caller = c.comm->rank;
    if (Error e = check_arguments(c)) {
        e.why = "rank " + std::to_string(c.rank()) + ": " + e.why;
        poison(c.comm, e);
        return e;
    }
    return {};
}

// ---------------------------------------------------------------- running calls

// What `c` posts to `p`: a header, and the payload `p` needs from this rank.
Error post(Call& c, int p) {
    fake_nccl::Header h{};
    h.lane = is_collective(c.kind) ? fake_nccl::kCollective : fake_nccl::kP2p;
    h.op = (std::int32_t)c.kind;
    h.dtype = c.dtype;
    h.redop = c.op;
    h.root = c.peer;
    h.count = c.count;
    h.seq = c.seq;
    const unsigned char* data = c.staged.data();
    std::size_t bytes = 0;
    const std::size_t n = c.count * c.elem();
    switch (c.kind) {
        case Kind::Send:
        case Kind::AllGather:
        case Kind::AllReduce: bytes = n; break;
        case Kind::Broadcast: bytes = c.rank() == c.peer ? n : 0; break;
        case Kind::Reduce: bytes = p == c.peer ? n : 0; break;
        case Kind::ReduceScatter:
            data += p * n;
            bytes = n;
            break;
        case Kind::Recv: return {};
    }
    h.bytes = bytes;
    return c.comm->mesh->post(p, h, data, kind_name(c.kind));
}

Error write_result(Call& c, const unsigned char* data) {
    const std::size_t bytes = c.recv_bytes();
    if (bytes == 0) return {};
    if (CUresult r = fake_cuda_write((CUdeviceptr)c.recv, data, bytes, c.comm->device)) {
        return fail(ncclInvalidArgument, "recvbuff [%p, +%zu bytes) is no longer device memory of cuda:%d (CUDA error %d)",
                    c.recv, bytes, c.comm->device, (int)r);
    }
    return {};
}

// A receive: the matching send's data into the buffer, and the sender told whether it matched.
Error complete_recv(Call& c) {
    fake_nccl::Message m;
    if (Error e = c.comm->mesh->take(c.peer, fake_nccl::kP2p, m, "ncclRecv")) return e;
    const bool matches = m.h.count == c.count && m.h.dtype == c.dtype;
    fake_nccl::Header ack{};
    ack.lane = fake_nccl::kAck;
    ack.op = matches ? 0 : 1;
    ack.count = c.count;
    ack.dtype = c.dtype;
    if (Error e = c.comm->mesh->post(c.peer, ack, nullptr, "answering an ncclSend")) return e;
    if (!matches) {
        return fail(ncclInvalidUsage, "rank %d's ncclRecv of %zu x %s from rank %d met an ncclSend of %llu x %s", c.rank(),
                    c.count, type_name(c.dtype), c.peer, (unsigned long long)m.h.count, type_name(m.h.dtype));
    }
    if (m.payload.size() != c.count * c.elem()) return fail(ncclInternalError, "a send of the wrong size arrived");
    return write_result(c, m.payload.data());
}

// A send: whether the receive matched.
Error complete_send(Call& c) {
    fake_nccl::Message m;
    if (Error e = c.comm->mesh->take(c.peer, fake_nccl::kAck, m, "ncclSend")) return e;
    if (m.h.op != 0) {
        return fail(ncclInvalidUsage, "rank %d's ncclSend of %zu x %s to rank %d met an ncclRecv of %llu x %s", c.rank(),
                    c.count, type_name(c.dtype), c.peer, (unsigned long long)m.h.count, type_name(m.h.dtype));
    }
    return {};
}

// A collective: every other rank's call and contribution, then this rank's result.
Error complete_collective(Call& c) {
    const int n = c.nranks(), me = c.rank();
    std::vector<fake_nccl::Message> from(n);
    for (int p = 0; p < n; ++p) {
        if (p == me) continue;
        if (Error e = c.comm->mesh->take(p, fake_nccl::kCollective, from[p], kind_name(c.kind))) return e;
    }
    // Every rank has every call now, so every rank finds a mismatch if there is one.
    for (int p = 0; p < n; ++p) {
        if (p == me) continue;
        const fake_nccl::Header& h = from[p].h;
        const bool same = h.op == (std::int32_t)c.kind && h.seq == c.seq && h.count == c.count && h.dtype == c.dtype &&
                          (!reduces(c.kind) || h.redop == c.op) && (!rooted(c.kind) || h.root == c.peer);
        if (!same) {
            return fail(ncclInvalidUsage, "collectives differ: rank %d called %s, rank %d called %s", me,
                        c.describe().c_str(), p, describe_header(h).c_str());
        }
    }
    const std::size_t bytes = c.count * c.elem();
    const auto part = [&](int r) -> const unsigned char* {
        if (r == me) return c.kind == Kind::ReduceScatter ? c.staged.data() + me * bytes : c.staged.data();
        return from[r].payload.data();
    };
    for (int p = 0; p < n; ++p) {
        const bool carries = c.kind == Kind::Broadcast ? p == c.peer : c.kind == Kind::Reduce ? me == c.peer : true;
        if (p != me && carries && from[p].payload.size() != bytes) {
            return fail(ncclInternalError, "rank %d's contribution has %zu bytes, not %zu", p, from[p].payload.size(),
                        bytes);
        }
    }
    std::vector<const unsigned char*> parts(n);
    for (int r = 0; r < n; ++r) parts[r] = part(r);
    switch (c.kind) {
        case Kind::Broadcast: return write_result(c, parts[c.peer]);
        case Kind::AllGather: {
            std::vector<unsigned char> all(bytes * n);
            for (int r = 0; r < n; ++r) std::memcpy(all.data() + r * bytes, parts[r], bytes);
            return write_result(c, all.data());
        }
        case Kind::Reduce:
            if (me != c.peer) return {};
            [[fallthrough]];
        case Kind::AllReduce:
        case Kind::ReduceScatter: return write_result(c, reduce(parts, c.count, c.dtype, c.op).data());
        default: return {};
    }
}

// Runs `calls` (one, or a group's): reads what they send once their streams' work has run,
// posts every send, then completes every receive and collective, then learns whether the sends
// matched. Returns the first failure.
Error run(std::vector<Call>& calls) {
    const auto failed = [](Call& c, Error e) {
        poison(c.comm, e);
        c.error = std::move(e);
    };
    const auto still_ok = [](Call& c) {
        if (c.error) return false;
        std::lock_guard<std::mutex> lock(c.comm->mutex);
        if (!c.comm->failed) return true;
        c.error = Error{c.comm->failed.code, "an earlier call of the group failed: " + c.comm->failed.why};
        return false;
    };
    for (Call& c : calls) {
        if (!still_ok(c)) continue;
        int owner = -1;
        switch (CUresult r = fake_cuda_synchronize(c.stream, c.comm->device, &owner)) {
            case CUDA_SUCCESS: break;
            case CUDA_ERROR_INVALID_HANDLE:
                failed(c, fail(ncclInvalidArgument, "stream %p is not a stream of the CUDA driver", (void*)c.stream));
                continue;
            case CUDA_ERROR_INVALID_CONTEXT:
                failed(c, fail(ncclInvalidArgument, "stream %p is cuda:%d's, and rank %d's communicator is on cuda:%d",
                               (void*)c.stream, owner, c.rank(), c.comm->device));
                continue;
            default:
                failed(c, fail(ncclUnhandledCudaError, "work queued on the stream before the call failed (CUDA error %d)",
                               (int)r));
                continue;
        }
        c.staged.resize(c.send_bytes());
        if (CUresult r = fake_cuda_read(c.staged.data(), (CUdeviceptr)c.send, c.staged.size(), c.comm->device)) {
            failed(c, fail(ncclInvalidArgument, "sendbuff [%p, +%zu bytes) is no longer device memory of cuda:%d "
                           "(CUDA error %d)", c.send, c.staged.size(), c.comm->device, (int)r));
        }
    }
    for (Call& c : calls) {
        if (!still_ok(c)) continue;
        if (c.kind == Kind::Send) {
            if (Error e = post(c, c.peer)) failed(c, std::move(e));
        } else if (is_collective(c.kind)) {
            for (int p = 0; p < c.nranks() && !c.error; ++p) {
                if (p == c.rank()) continue;
                if (Error e = post(c, p)) failed(c, std::move(e));
            }
        }
    }
    for (Call& c : calls) {
        if (!still_ok(c) || c.kind == Kind::Send) continue;
        if (Error e = c.kind == Kind::Recv ? complete_recv(c) : complete_collective(c)) failed(c, std::move(e));
    }
    for (Call& c : calls) {
        if (!still_ok(c) || c.kind != Kind::Send) continue;
        if (Error e = complete_send(c)) failed(c, std::move(e));
    }
    for (Call& c : calls) {
        if (c.error) return Error{c.error.code, c.describe() + " on rank " + std::to_string(c.caller) + ": " + c.error.why};
    }
    return {};
}

// ---------------------------------------------------------------- groups

// A rank joining a communicator inside a group: joined at the outermost ncclGroupEnd, every
// such rank at once (one thread may init every rank of a communicator that way).
struct Init {
    ncclComm_t* out;
    ncclUniqueId id;
    int nranks, rank, device;
};

thread_local int t_depth = 0;
thread_local std::vector<Call> t_calls;
thread_local std::vector<Init> t_inits;
thread_local Error t_group_error;  // a call of the group that was refused when made

// Runs `inits` at once, each on a thread of its own (they wait for each other).
Error run_inits(std::vector<Init>& inits) {
    std::vector<Error> errors(inits.size());
    std::vector<std::thread> threads;
    for (std::size_t i = 0; i < inits.size(); ++i) {
        threads.emplace_back([&, i] {
            const Init& in = inits[i];
            errors[i] = init_rank(in.id, in.nranks, in.rank, in.device, in.out);
        });
    }
    for (std::thread& t : threads) t.join();
    for (std::size_t i = 0; i < inits.size(); ++i) {
        if (errors[i]) {
            // None is left half made: the ones that succeeded go too.
            for (Init& in : inits) {
                if (*in.out) teardown(*in.out, "ncclCommInitAll");
                *in.out = nullptr;
            }
            return errors[i];
        }
    }
    return {};
}

// A call made: checked, then run now, or at the outermost ncclGroupEnd inside a group.
ncclResult_t call(const char* api, Call c) {
    if (Error e = check_call(c)) {
        if (t_depth > 0 && !t_group_error) t_group_error = e;
        return report(api, e);
    }
    if (is_collective(c.kind)) {
        std::lock_guard<std::mutex> lock(c.comm->mutex);
        c.seq = c.comm->collectives++;
    }
    if (t_depth > 0) {
        // The communicator is held again when the group runs.
        c.held.release();
        t_calls.push_back(std::move(c));
        return ncclSuccess;
    }
    std::vector<Call> one;
    one.push_back(std::move(c));
    if (Error e = run(one)) return report(api, e);
    return ncclSuccess;
}

Call make(Kind kind, ncclComm_t comm, const void* send, void* recv, std::size_t count, ncclDataType_t dtype, int op,
          int peer, cudaStream_t stream) {
    return Call(kind, comm, send, recv, count, (int)dtype, op, peer, stream);
}

}  // namespace

// ---------------------------------------------------------------- the API

FAKE_API ncclResult_t ncclGetVersion(int* version) {
    if (!version) return report("ncclGetVersion", fail(ncclInvalidArgument, "null output"));
    *version = FAKE_NCCL_VERSION;
    return ncclSuccess;
}

FAKE_API const char* ncclGetErrorString(ncclResult_t r) {
    switch (r) {
        case ncclSuccess: return "no error";
        case ncclUnhandledCudaError: return "unhandled cuda error (the fake's stderr says which)";
        case ncclSystemError: return "unhandled system error (a timeout or a socket failed; the fake's stderr says which)";
        case ncclInternalError: return "internal error - please report this issue to the fake's owners";
        case ncclInvalidArgument: return "invalid argument (the fake's stderr says which)";
        case ncclInvalidUsage: return "invalid usage (the fake's stderr says how)";
        case ncclRemoteError: return "remote process exited or there was a network error";
        case ncclInProgress: return "NCCL operation in progress";
        default: return "unknown result code";
    }
}

FAKE_API const char* ncclGetLastError(ncclComm_t) { return t_last_error.c_str(); }

FAKE_API ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
    if (!id) return report("ncclGetUniqueId", fail(ncclInvalidArgument, "null output"));
    fake_nccl::make_unique_id(*id);
    return ncclSuccess;
}

// On the calling thread's current device, as NCCL (the fake insists there is a current context).
FAKE_API ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
    const char* api = "ncclCommInitRank";
    if (!comm) return report(api, fail(ncclInvalidArgument, "null output"));
    *comm = nullptr;
    if (nranks < 1) return report(api, fail(ncclInvalidArgument, "nranks %d", nranks));
    if (rank < 0 || rank >= nranks) {
        return report(api, fail(ncclInvalidArgument, "rank %d is out of range for %d ranks", rank, nranks));
    }
    int count = 0;
    if (Error e = cuda_devices(count)) return report(api, e);
    CUdevice device = -1;
    if (cuCtxGetDevice(&device) != CUDA_SUCCESS) {
        return report(api, fail(ncclInvalidUsage, "rank %d: no current CUDA context on this thread (NCCL joins on the "
                                "current device)", rank));
    }
    if (t_depth > 0) {
        t_inits.push_back(Init{comm, id, nranks, rank, device});
        return ncclSuccess;
    }
    if (Error e = init_rank(id, nranks, rank, device, comm)) return report(api, e);
    return ncclSuccess;
}

FAKE_API ncclResult_t ncclCommInitAll(ncclComm_t* comms, int ndev, const int* devlist) {
    const char* api = "ncclCommInitAll";
    if (!comms) return report(api, fail(ncclInvalidArgument, "null output"));
    if (ndev < 1) return report(api, fail(ncclInvalidArgument, "ndev %d", ndev));
    int count = 0;
    if (Error e = cuda_devices(count)) return report(api, e);
    std::vector<Init> inits;
    ncclUniqueId id;
    fake_nccl::make_unique_id(id);
    for (int i = 0; i < ndev; ++i) {
        comms[i] = nullptr;
        const int device = devlist ? devlist[i] : i;
        if (device < 0 || device >= count) {
            return report(api, fail(ncclInvalidArgument, "rank %d on cuda:%d, which does not exist (%d devices)", i,
                                    device, count));
        }
        for (int j = 0; j < i; ++j) {
            if (inits[j].device == device) {
                return report(api, fail(ncclInvalidUsage, "Duplicate GPU detected: rank %d and rank %d both on cuda:%d "
                                        "(one rank per device)", j, i, device));
            }
        }
        inits.push_back(Init{&comms[i], id, ndev, i, device});
    }
    if (Error e = run_inits(inits)) return report(api, e);
    return ncclSuccess;
}

FAKE_API ncclResult_t ncclCommFinalize(ncclComm_t comm) {
    Entered held;
    if (Error e = held.hold(comm)) return report("ncclCommFinalize", e);
    return ncclSuccess;  // every call is complete when it returns: nothing is outstanding
}

FAKE_API ncclResult_t ncclCommDestroy(ncclComm_t comm) { return teardown(comm, "ncclCommDestroy"); }

FAKE_API ncclResult_t ncclCommAbort(ncclComm_t comm) { return teardown(comm, "ncclCommAbort"); }

FAKE_API ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* error) {
    Entered held;
    if (!error) return report("ncclCommGetAsyncError", fail(ncclInvalidArgument, "null output"));
    if (Error e = held.hold(comm)) return report("ncclCommGetAsyncError", e);
    std::lock_guard<std::mutex> lock(comm->mutex);
    *error = comm->failed.code;
    return ncclSuccess;
}

namespace {

// The queries: a live communicator (failed or not) and an output.
template <class F>
ncclResult_t query(const char* api, ncclComm_t comm, int* out, F value) {
    if (!out) return report(api, fail(ncclInvalidArgument, "null output"));
    Entered held;
    if (Error e = held.hold(comm)) return report(api, e);
    *out = value(*comm);
    return ncclSuccess;
}

}  // namespace

FAKE_API ncclResult_t ncclCommCount(ncclComm_t comm, int* count) {
    return query("ncclCommCount", comm, count, [](const ncclComm& c) { return c.nranks; });
}

FAKE_API ncclResult_t ncclCommCuDevice(ncclComm_t comm, int* device) {
    return query("ncclCommCuDevice", comm, device, [](const ncclComm& c) { return c.device; });
}

FAKE_API ncclResult_t ncclCommUserRank(ncclComm_t comm, int* rank) {
    return query("ncclCommUserRank", comm, rank, [](const ncclComm& c) { return c.rank; });
}

FAKE_API ncclResult_t ncclGroupStart() {
    ++t_depth;
    return ncclSuccess;
}

FAKE_API ncclResult_t ncclGroupEnd() {
    const char* api = "ncclGroupEnd";
    if (t_depth == 0) return report(api, fail(ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart"));
    if (--t_depth > 0) return ncclSuccess;
    std::vector<Init> inits = std::move(t_inits);
    std::vector<Call> calls = std::move(t_calls);
    Error refused = std::move(t_group_error);
    t_inits.clear();
    t_calls.clear();
    t_group_error = {};
    if (Error e = run_inits(inits)) return report(api, e);
    if (refused) {
        // NCCL runs none of a group with a refused call; the peers must not wait for them.
        for (Call& c : calls) {
            Entered held;
            if (!held.hold(c.comm)) poison(c.comm, Error{refused.code, "a call of its group was refused: " + refused.why});
        }
        return report(api, Error{refused.code, "a call of the group was refused: " + refused.why});
    }
    for (Call& c : calls) {
        if (Error e = c.held.enter(c.comm)) c.error = std::move(e);
    }
    if (Error e = run(calls)) return report(api, e);
    return ncclSuccess;
}

FAKE_API ncclResult_t ncclSend(const void* sendbuff, std::size_t count, ncclDataType_t datatype, int peer,
                               ncclComm_t comm, cudaStream_t stream) {
    return call("ncclSend", make(Kind::Send, comm, sendbuff, nullptr, count, datatype, 0, peer, stream));
}

FAKE_API ncclResult_t ncclRecv(void* recvbuff, std::size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                               cudaStream_t stream) {
    return call("ncclRecv", make(Kind::Recv, comm, nullptr, recvbuff, count, datatype, 0, peer, stream));
}

FAKE_API ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, std::size_t count, ncclDataType_t datatype,
                                    int root, ncclComm_t comm, cudaStream_t stream) {
    return call("ncclBroadcast", make(Kind::Broadcast, comm, sendbuff, recvbuff, count, datatype, 0, root, stream));
}

FAKE_API ncclResult_t ncclBcast(void* buff, std::size_t count, ncclDataType_t datatype, int root, ncclComm_t comm,
                                cudaStream_t stream) {
    return call("ncclBcast", make(Kind::Broadcast, comm, buff, buff, count, datatype, 0, root, stream));
}

FAKE_API ncclResult_t ncclReduce(const void* sendbuff, void* recvbuff, std::size_t count, ncclDataType_t datatype,
                                 ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) {
    return call("ncclReduce", make(Kind::Reduce, comm, sendbuff, recvbuff, count, datatype, op, root, stream));
}

FAKE_API ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, std::size_t sendcount,
                                    ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream) {
    return call("ncclAllGather", make(Kind::AllGather, comm, sendbuff, recvbuff, sendcount, datatype, 0, 0, stream));
}

FAKE_API ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, std::size_t count, ncclDataType_t datatype,
                                    ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
    return call("ncclAllReduce", make(Kind::AllReduce, comm, sendbuff, recvbuff, count, datatype, op, 0, stream));
}

FAKE_API ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, std::size_t recvcount,
                                        ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
    return call("ncclReduceScatter",
                make(Kind::ReduceScatter, comm, sendbuff, recvbuff, recvcount, datatype, op, 0, stream));
}
