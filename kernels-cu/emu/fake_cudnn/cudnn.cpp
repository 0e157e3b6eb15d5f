// A fake libcudnn.so: the slice of cuDNN's C API that the CUDA backend's convolutions call
// (crates/vae-tensor/src/cuda/backend/cudnn.rs), for the fake driver's devices (../fake_driver/),
// so that the cuDNN path runs, and is checked, where there is no GPU. Each convolution is
// computed on the host from the descriptors it was given: every output element one sum over its
// taps in a fixed order (input channel, then time, row, column), in double, rounded once to the
// output's type. That order depends on the element's own taps alone, as the algorithms the backend
// admits do, so results are bit-identical however a tensor is tiled or sharded.
//
// What it checks, failing with a cuDNN error status and a line on stderr (and the text
// cudnnGetLastErrorString returns) on any mismatch:
// - handles and descriptors: created here, not destroyed, set before use;
// - tensors: f32 or bf16, 4 or 5 dimensions, strides exactly the packed NCHW / NCDHW strides of
//   the extents (the layout the backend promises: our tensors as they are); filters in the NCHW
//   format of the same type; the convolution cross-correlation, f32 compute, no dilation,
//   non-negative padding, positive strides; f32 data with CUDNN_FMA_MATH (f32 products) or
//   CUDNN_TENSOR_OP_MATH (TF32 products: operands rounded to TF32 here), never DEFAULT_MATH (which
//   lets cuDNN use TF32 unasked); bf16 with CUDNN_TENSOR_OP_MATH;
// - a forward convolution: x, w and y consistent (channels, types, y's extents those of
//   cudnnGetConvolutionNdForwardOutputDim), an algorithm this fake offered for the problem, a
//   workspace of at least the size cudnnGetConvolutionForwardWorkspaceSize reported (which it
//   scribbles over), alpha 1 and beta 0;
// - cudnnAddTensor: a [1, C, 1, ...] bias of the output's type, alpha and beta 1;
// - every buffer: device memory of the handle's device, large enough, aligned to its element.
// The work queued on the handle's stream runs before a call reads its buffers (the fake driver's
// streams are lazy), and the results are in device memory when the call returns.
//
// The algorithms offered (cudnnGetConvolutionForwardAlgorithm_v7), in this order: FFT
// (deterministic), IMPLICIT_PRECOMP_GEMM (deterministic, a workspace), IMPLICIT_GEMM
// (deterministic, none), GEMM (reported non-deterministic): the backend must refuse the first
// and the last. All compute the same thing here.
#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "cudnn_api.h"
#include "fake_cuda.h"

#define FAKE_API extern "C" __attribute__((visibility("default")))

struct cudnnContext {
    int device = 0;
    CUstream stream = nullptr;
};

struct cudnnTensorStruct {
    bool set = false;
    int dtype = 0;
    int nb = 0;
    int dims[8] = {};
};

struct cudnnFilterStruct {
    bool set = false;
    int dtype = 0;
    int nb = 0;
    int dims[8] = {};
};

struct cudnnConvolutionStruct {
    bool set = false;
    int spatial = 0;
    int pads[6] = {};
    int strides[6] = {};
    int math = CUDNN_DEFAULT_MATH;
};

namespace {

std::mutex g_mutex;  // the live objects
std::set<const void*> g_live;
thread_local std::string t_last_error;

// Records and prints why a call failed; returns `status`.
cudnnStatus_t fail(cudnnStatus_t status, const char* call, const char* format, ...) {
    char text[1024];
    va_list args;
    va_start(args, format);
    std::vsnprintf(text, sizeof text, format, args);
    va_end(args);
    t_last_error = std::string(call) + ": " + text;
    std::fprintf(stderr, "fake cuDNN: %s\n", t_last_error.c_str());
    return status;
}

bool live(const void* p) {
    std::lock_guard<std::mutex> lock(g_mutex);
    return p && g_live.count(p);
}

template <class T>
cudnnStatus_t create(T** out, const char* call) {
    if (!out) return fail(CUDNN_STATUS_BAD_PARAM_NULL_POINTER, call, "null output");
    *out = new T();
    std::lock_guard<std::mutex> lock(g_mutex);
    g_live.insert(*out);
    return CUDNN_STATUS_SUCCESS;
}

template <class T>
cudnnStatus_t destroy(T* p, const char* call) {
    {
        std::lock_guard<std::mutex> lock(g_mutex);
        if (!p || !g_live.erase(p)) return fail(CUDNN_STATUS_BAD_PARAM, call, "%p is not a live object", (void*)p);
    }
    delete p;
    return CUDNN_STATUS_SUCCESS;
}

std::size_t elem_size(int dtype) { return dtype == CUDNN_DATA_FLOAT ? 4 : 2; }
const char* type_name(int dtype) { return dtype == CUDNN_DATA_FLOAT ? "f32" : "bf16"; }

std::size_t count(const int* dims, int nb) {
    std::size_t n = 1;
    for (int i = 0; i < nb; ++i) n *= (std::size_t)dims[i];
    return n;
}

float bf16_to_f32(std::uint16_t b) {
    std::uint32_t u = (std::uint32_t)b << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// Round to nearest even, NaN kept a NaN.
std::uint16_t f32_to_bf16(float f) {
    std::uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (std::uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (std::uint16_t)(u >> 16);
}

// TF32 (10 mantissa bits), rounded to nearest, ties away from zero, as cvt.rna.tf32.f32.
float tf32(float f) {
    std::uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) == 0x7f800000u) return f;
    u = (u + 0x1000u) & 0xffffe000u;
    std::memcpy(&f, &u, 4);
    return f;
}

// A buffer the call reads or writes: device memory of `device`, `bytes` long, aligned.
cudnnStatus_t check_buffer(const char* call, const char* what, const void* ptr, std::size_t bytes, std::size_t align,
                           int device) {
    if (!ptr) return fail(CUDNN_STATUS_BAD_PARAM_NULL_POINTER, call, "%s is null", what);
    if ((std::uintptr_t)ptr % align) {
        return fail(CUDNN_STATUS_BAD_PARAM_MISALIGNED_POINTER, call, "%s %p is not aligned to %zu bytes", what, ptr,
                    align);
    }
    int owner = -1;
    switch (fake_cuda_check_range((CUdeviceptr)ptr, bytes, device, &owner)) {
        case CUDA_SUCCESS: return CUDNN_STATUS_SUCCESS;
        case CUDA_ERROR_INVALID_DEVICE:
            return fail(CUDNN_STATUS_BAD_PARAM, call, "%s %p is memory of cuda:%d, and the handle is on cuda:%d", what,
                        ptr, owner, device);
        default:
            return fail(CUDNN_STATUS_BAD_PARAM_OUT_OF_BOUND, call,
                        "%s [%p, +%zu bytes) is not inside one allocation of cuda:%d's memory", what, ptr, bytes,
                        device);
    }
}

cudnnStatus_t check_handle(cudnnHandle_t h, const char* call) {
    if (!live(h)) return fail(CUDNN_STATUS_BAD_PARAM, call, "handle %p is not a live handle", (void*)h);
    return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t check_tensor(cudnnTensorDescriptor_t t, const char* call, const char* what) {
    if (!live(t)) return fail(CUDNN_STATUS_BAD_PARAM, call, "%s %p is not a live tensor descriptor", what, (void*)t);
    if (!t->set) return fail(CUDNN_STATUS_BAD_PARAM, call, "%s was never set", what);
    return CUDNN_STATUS_SUCCESS;
}

// The output extents of convolving `x` with `w` under `c`, after checking they fit together.
cudnnStatus_t output_dims(const cudnnConvolutionStruct* c, const cudnnTensorStruct* x, const cudnnFilterStruct* w,
                          int* out, const char* call) {
    if (!live(c) || !c->set) return fail(CUDNN_STATUS_BAD_PARAM, call, "the convolution descriptor is not set");
    if (!live(w) || !w->set) return fail(CUDNN_STATUS_BAD_PARAM, call, "the filter descriptor is not set");
    if (x->nb != w->nb || c->spatial != x->nb - 2) {
        return fail(CUDNN_STATUS_BAD_PARAM, call, "%d-D input, %d-D filters and %d spatial dimensions do not fit",
                    x->nb, w->nb, c->spatial);
    }
    if (x->dtype != w->dtype) {
        return fail(CUDNN_STATUS_BAD_PARAM, call, "input %s and filters %s", type_name(x->dtype), type_name(w->dtype));
    }
    if (x->dims[1] != w->dims[1]) {
        return fail(CUDNN_STATUS_BAD_PARAM, call, "input of %d channels, filters of %d", x->dims[1], w->dims[1]);
    }
    if (x->dtype == CUDNN_DATA_FLOAT && c->math != CUDNN_FMA_MATH && c->math != CUDNN_TENSOR_OP_MATH) {
        return fail(CUDNN_STATUS_BAD_PARAM, call,
                    "f32 data with math type %d: FMA_MATH (f32) or TENSOR_OP_MATH (TF32) expected, DEFAULT_MATH "
                    "lets cuDNN take TF32 unasked",
                    c->math);
    }
    if (x->dtype == CUDNN_DATA_BFLOAT16 && c->math != CUDNN_TENSOR_OP_MATH) {
        return fail(CUDNN_STATUS_BAD_PARAM, call, "bf16 data with math type %d, not TENSOR_OP_MATH", c->math);
    }
    out[0] = x->dims[0];
    out[1] = w->dims[0];
    for (int d = 0; d < c->spatial; ++d) {
        const int padded = x->dims[2 + d] + 2 * c->pads[d] - w->dims[2 + d];
        if (padded < 0) {
            return fail(CUDNN_STATUS_BAD_PARAM, call, "dimension %d: %d + 2 x %d padding is less than the kernel's %d",
                        d, x->dims[2 + d], c->pads[d], w->dims[2 + d]);
        }
        out[2 + d] = padded / c->strides[d] + 1;
    }
    return CUDNN_STATUS_SUCCESS;
}

// The workspace this fake asks for `algo` (cudnnStatus NOT_SUPPORTED for algorithms it does not
// offer).
bool workspace_of(int algo, const cudnnFilterStruct* w, std::size_t* bytes) {
    const std::size_t taps = count(w->dims + 1, w->nb - 1);
    switch (algo) {
        case CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM: *bytes = 0; return true;
        case CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM: *bytes = 4096 + 8 * taps; return true;
        case CUDNN_CONVOLUTION_FWD_ALGO_GEMM: *bytes = 1 << 20; return true;
        case CUDNN_CONVOLUTION_FWD_ALGO_FFT: *bytes = 1 << 22; return true;
        default: return false;
    }
}

// The checks of a forward convolution's descriptors; `y_dims` must be the output's.
cudnnStatus_t check_problem(cudnnHandle_t h, cudnnTensorDescriptor_t x, cudnnFilterDescriptor_t w,
                            cudnnConvolutionDescriptor_t c, cudnnTensorDescriptor_t y, const char* call) {
    if (cudnnStatus_t s = check_handle(h, call)) return s;
    if (cudnnStatus_t s = check_tensor(x, call, "xDesc")) return s;
    if (cudnnStatus_t s = check_tensor(y, call, "yDesc")) return s;
    int out[8];
    if (cudnnStatus_t s = output_dims(c, x, w, out, call)) return s;
    if (y->nb != x->nb || std::memcmp(out, y->dims, sizeof(int) * x->nb) != 0) {
        return fail(CUDNN_STATUS_BAD_PARAM, call, "yDesc's extents are not the convolution's output extents");
    }
    if (y->dtype != x->dtype) {
        return fail(CUDNN_STATUS_BAD_PARAM, call, "output %s for %s input", type_name(y->dtype), type_name(x->dtype));
    }
    return CUDNN_STATUS_SUCCESS;
}

// Element `i` of a buffer of `dtype` as f32.
float load(const std::vector<unsigned char>& b, int dtype, std::size_t i) {
    if (dtype == CUDNN_DATA_FLOAT) {
        float f;
        std::memcpy(&f, b.data() + 4 * i, 4);
        return f;
    }
    std::uint16_t u;
    std::memcpy(&u, b.data() + 2 * i, 2);
    return bf16_to_f32(u);
}

void store(std::vector<unsigned char>& b, int dtype, std::size_t i, float v) {
    if (dtype == CUDNN_DATA_FLOAT) {
        std::memcpy(b.data() + 4 * i, &v, 4);
    } else {
        const std::uint16_t u = f32_to_bf16(v);
        std::memcpy(b.data() + 2 * i, &u, 2);
    }
}

// Runs what the handle's stream holds, then reads `bytes` of device memory.
cudnnStatus_t read_buffer(cudnnHandle_t h, const void* ptr, std::size_t bytes, std::vector<unsigned char>& out,
                          const char* call, const char* what) {
    out.resize(bytes);
    if (fake_cuda_read(out.data(), (CUdeviceptr)ptr, bytes, h->device) != CUDA_SUCCESS) {
        return fail(CUDNN_STATUS_EXECUTION_FAILED, call, "reading %s failed", what);
    }
    return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t synchronize(cudnnHandle_t h, const char* call) {
    int owner = -1;
    switch (CUresult r = fake_cuda_synchronize(h->stream, h->device, &owner)) {
        case CUDA_SUCCESS: return CUDNN_STATUS_SUCCESS;
        case CUDA_ERROR_INVALID_CONTEXT:
            return fail(CUDNN_STATUS_BAD_PARAM, call, "the handle's stream is cuda:%d's, the handle cuda:%d's", owner,
                        h->device);
        default: return fail(CUDNN_STATUS_EXECUTION_FAILED, call, "the work queued before it failed (CUresult %d)", r);
    }
}

}  // namespace

FAKE_API std::size_t cudnnGetVersion() { return 90201; }

FAKE_API void cudnnGetLastErrorString(char* message, std::size_t max_size) {
    if (!message || max_size == 0) return;
    std::snprintf(message, max_size, "%s", t_last_error.c_str());
    t_last_error.clear();
}

FAKE_API cudnnStatus_t cudnnCreate(cudnnHandle_t* handle) {
    CUdevice device = 0;
    if (cuCtxGetDevice(&device) != CUDA_SUCCESS) {
        return fail(CUDNN_STATUS_NOT_INITIALIZED, "cudnnCreate", "no current CUDA context");
    }
    if (cudnnStatus_t s = create(handle, "cudnnCreate")) return s;
    (*handle)->device = device;
    return CUDNN_STATUS_SUCCESS;
}

FAKE_API cudnnStatus_t cudnnDestroy(cudnnHandle_t handle) { return destroy(handle, "cudnnDestroy"); }

FAKE_API cudnnStatus_t cudnnSetStream(cudnnHandle_t handle, cudaStream_t stream) {
    if (cudnnStatus_t s = check_handle(handle, "cudnnSetStream")) return s;
    handle->stream = stream;
    return CUDNN_STATUS_SUCCESS;
}

FAKE_API cudnnStatus_t cudnnCreateTensorDescriptor(cudnnTensorDescriptor_t* d) {
    return create(d, "cudnnCreateTensorDescriptor");
}
FAKE_API cudnnStatus_t cudnnDestroyTensorDescriptor(cudnnTensorDescriptor_t d) {
    return destroy(d, "cudnnDestroyTensorDescriptor");
}
FAKE_API cudnnStatus_t cudnnCreateFilterDescriptor(cudnnFilterDescriptor_t* d) {
    return create(d, "cudnnCreateFilterDescriptor");
}
FAKE_API cudnnStatus_t cudnnDestroyFilterDescriptor(cudnnFilterDescriptor_t d) {
    return destroy(d, "cudnnDestroyFilterDescriptor");
}
FAKE_API cudnnStatus_t cudnnCreateConvolutionDescriptor(cudnnConvolutionDescriptor_t* d) {
    return create(d, "cudnnCreateConvolutionDescriptor");
}
FAKE_API cudnnStatus_t cudnnDestroyConvolutionDescriptor(cudnnConvolutionDescriptor_t d) {
    return destroy(d, "cudnnDestroyConvolutionDescriptor");
}

FAKE_API cudnnStatus_t cudnnSetTensorNdDescriptor(cudnnTensorDescriptor_t d, cudnnDataType_t dtype, int nb,
                                                  const int* dims, const int* strides) {
    const char* call = "cudnnSetTensorNdDescriptor";
    if (!live(d)) return fail(CUDNN_STATUS_BAD_PARAM, call, "%p is not a live tensor descriptor", (void*)d);
    if (dtype != CUDNN_DATA_FLOAT && dtype != CUDNN_DATA_BFLOAT16) {
        return fail(CUDNN_STATUS_NOT_SUPPORTED, call, "data type %d is neither f32 nor bf16", dtype);
    }
    if (nb < 4 || nb > 5 || !dims || !strides) return fail(CUDNN_STATUS_BAD_PARAM, call, "%d dimensions, not 4 or 5", nb);
    long long packed = 1;
    for (int i = nb - 1; i >= 0; --i) {
        if (dims[i] <= 0) return fail(CUDNN_STATUS_BAD_PARAM, call, "extent %d of dimension %d", dims[i], i);
        if (strides[i] != packed) {
            return fail(CUDNN_STATUS_BAD_PARAM, call,
                        "stride %d of dimension %d is not the packed NC(D)HW stride %lld: the backend hands its "
                        "tensors as they are laid out",
                        strides[i], i, packed);
        }
        packed *= dims[i];
    }
    d->set = true;
    d->dtype = dtype;
    d->nb = nb;
    std::memcpy(d->dims, dims, sizeof(int) * nb);
    return CUDNN_STATUS_SUCCESS;
}

FAKE_API cudnnStatus_t cudnnSetFilterNdDescriptor(cudnnFilterDescriptor_t d, cudnnDataType_t dtype,
                                                  cudnnTensorFormat_t format, int nb, const int* dims) {
    const char* call = "cudnnSetFilterNdDescriptor";
    if (!live(d)) return fail(CUDNN_STATUS_BAD_PARAM, call, "%p is not a live filter descriptor", (void*)d);
    if (dtype != CUDNN_DATA_FLOAT && dtype != CUDNN_DATA_BFLOAT16) {
        return fail(CUDNN_STATUS_NOT_SUPPORTED, call, "data type %d is neither f32 nor bf16", dtype);
    }
    if (format != CUDNN_TENSOR_NCHW) {
        return fail(CUDNN_STATUS_BAD_PARAM, call, "format %d: the weights are [Cout, Cin, (kt,) kh, kw], NCHW", format);
    }
    if (nb < 4 || nb > 5 || !dims) return fail(CUDNN_STATUS_BAD_PARAM, call, "%d dimensions, not 4 or 5", nb);
    for (int i = 0; i < nb; ++i) {
        if (dims[i] <= 0) return fail(CUDNN_STATUS_BAD_PARAM, call, "extent %d of dimension %d", dims[i], i);
    }
    d->set = true;
    d->dtype = dtype;
    d->nb = nb;
    std::memcpy(d->dims, dims, sizeof(int) * nb);
    return CUDNN_STATUS_SUCCESS;
}

FAKE_API cudnnStatus_t cudnnSetConvolutionNdDescriptor(cudnnConvolutionDescriptor_t d, int n, const int* pads,
                                                       const int* strides, const int* dilations,
                                                       cudnnConvolutionMode_t mode, cudnnDataType_t compute) {
    const char* call = "cudnnSetConvolutionNdDescriptor";
    if (!live(d)) return fail(CUDNN_STATUS_BAD_PARAM, call, "%p is not a live convolution descriptor", (void*)d);
    if (n < 2 || n > 3 || !pads || !strides || !dilations) {
        return fail(CUDNN_STATUS_BAD_PARAM, call, "%d spatial dimensions, not 2 or 3", n);
    }
    if (mode != CUDNN_CROSS_CORRELATION) {
        return fail(CUDNN_STATUS_BAD_PARAM, call, "mode %d: PyTorch's convolutions are cross-correlations", mode);
    }
    if (compute != CUDNN_DATA_FLOAT) {
        return fail(CUDNN_STATUS_BAD_PARAM, call, "compute type %d: the backend accumulates in f32", compute);
    }
    for (int i = 0; i < n; ++i) {
        if (pads[i] < 0 || strides[i] < 1 || dilations[i] != 1) {
            return fail(CUDNN_STATUS_BAD_PARAM, call, "dimension %d: padding %d, stride %d, dilation %d", i, pads[i],
                        strides[i], dilations[i]);
        }
        d->pads[i] = pads[i];
        d->strides[i] = strides[i];
    }
    d->spatial = n;
    d->set = true;
    return CUDNN_STATUS_SUCCESS;
}

FAKE_API cudnnStatus_t cudnnSetConvolutionMathType(cudnnConvolutionDescriptor_t d, cudnnMathType_t math) {
    const char* call = "cudnnSetConvolutionMathType";
    if (!live(d)) return fail(CUDNN_STATUS_BAD_PARAM, call, "%p is not a live convolution descriptor", (void*)d);
    if (math < CUDNN_DEFAULT_MATH || math > CUDNN_FMA_MATH) return fail(CUDNN_STATUS_BAD_PARAM, call, "math %d", math);
    d->math = math;
    return CUDNN_STATUS_SUCCESS;
}

FAKE_API cudnnStatus_t cudnnGetConvolutionNdForwardOutputDim(cudnnConvolutionDescriptor_t c,
                                                             cudnnTensorDescriptor_t x, cudnnFilterDescriptor_t w,
                                                             int nb, int* out) {
    const char* call = "cudnnGetConvolutionNdForwardOutputDim";
    if (cudnnStatus_t s = check_tensor(x, call, "inputTensorDesc")) return s;
    if (!out || nb != x->nb) return fail(CUDNN_STATUS_BAD_PARAM, call, "%d output extents for a %d-D input", nb, x->nb);
    return output_dims(c, x, w, out, call);
}

FAKE_API cudnnStatus_t cudnnGetConvolutionForwardAlgorithm_v7(cudnnHandle_t h, cudnnTensorDescriptor_t x,
                                                              cudnnFilterDescriptor_t w,
                                                              cudnnConvolutionDescriptor_t c,
                                                              cudnnTensorDescriptor_t y, int requested,
                                                              int* returned, cudnnConvolutionFwdAlgoPerf_t* perf) {
    const char* call = "cudnnGetConvolutionForwardAlgorithm_v7";
    if (cudnnStatus_t s = check_problem(h, x, w, c, y, call)) return s;
    if (!returned || !perf || requested < 1) {
        return fail(CUDNN_STATUS_BAD_PARAM, call, "room for %d results, outputs %p %p", requested, (void*)returned,
                    (void*)perf);
    }
    const struct {
        cudnnConvolutionFwdAlgo_t algo;
        cudnnDeterminism_t determinism;
    } offered[] = {
        {CUDNN_CONVOLUTION_FWD_ALGO_FFT, CUDNN_DETERMINISTIC},
        {CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM, CUDNN_DETERMINISTIC},
        {CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM, CUDNN_DETERMINISTIC},
        {CUDNN_CONVOLUTION_FWD_ALGO_GEMM, CUDNN_NON_DETERMINISTIC},
    };
    const int n = requested < 4 ? requested : 4;
    for (int i = 0; i < n; ++i) {
        perf[i] = {};
        perf[i].algo = offered[i].algo;
        perf[i].status = CUDNN_STATUS_SUCCESS;
        perf[i].time = -1.0f;
        workspace_of(offered[i].algo, w, &perf[i].memory);
        perf[i].determinism = offered[i].determinism;
        perf[i].mathType = (cudnnMathType_t)c->math;
    }
    *returned = n;
    return CUDNN_STATUS_SUCCESS;
}

FAKE_API cudnnStatus_t cudnnGetConvolutionForwardWorkspaceSize(cudnnHandle_t h, cudnnTensorDescriptor_t x,
                                                               cudnnFilterDescriptor_t w,
                                                               cudnnConvolutionDescriptor_t c,
                                                               cudnnTensorDescriptor_t y,
                                                               cudnnConvolutionFwdAlgo_t algo, std::size_t* bytes) {
    const char* call = "cudnnGetConvolutionForwardWorkspaceSize";
    if (cudnnStatus_t s = check_problem(h, x, w, c, y, call)) return s;
    if (!bytes) return fail(CUDNN_STATUS_BAD_PARAM_NULL_POINTER, call, "null output");
    if (!workspace_of(algo, w, bytes)) return fail(CUDNN_STATUS_NOT_SUPPORTED, call, "algorithm %d is not offered", algo);
    return CUDNN_STATUS_SUCCESS;
}

FAKE_API cudnnStatus_t cudnnConvolutionForward(cudnnHandle_t h, const void* alpha, cudnnTensorDescriptor_t xd,
                                               const void* x, cudnnFilterDescriptor_t wd, const void* w,
                                               cudnnConvolutionDescriptor_t cd, cudnnConvolutionFwdAlgo_t algo,
                                               void* workspace, std::size_t workspace_bytes, const void* beta,
                                               cudnnTensorDescriptor_t yd, void* y) {
    const char* call = "cudnnConvolutionForward";
    if (cudnnStatus_t s = check_problem(h, xd, wd, cd, yd, call)) return s;
    if (!alpha || !beta) return fail(CUDNN_STATUS_BAD_PARAM_NULL_POINTER, call, "null alpha or beta");
    const float a = *(const float*)alpha, b = *(const float*)beta;
    if (a != 1.0f || b != 0.0f) {
        return fail(CUDNN_STATUS_NOT_SUPPORTED, call, "alpha %g and beta %g: the backend asks for 1 and 0", a, b);
    }
    std::size_t needed = 0;
    if (!workspace_of(algo, wd, &needed)) {
        return fail(CUDNN_STATUS_BAD_PARAM, call, "algorithm %d was not offered for this problem", algo);
    }
    if (workspace_bytes < needed) {
        return fail(CUDNN_STATUS_BAD_PARAM, call, "a workspace of %zu bytes where algorithm %d needs %zu",
                    workspace_bytes, algo, needed);
    }
    const int dtype = xd->dtype, nb = xd->nb;
    const std::size_t es = elem_size(dtype);
    const std::size_t nx = count(xd->dims, nb), nw = count(wd->dims, nb), ny = count(yd->dims, nb);
    if (cudnnStatus_t s = check_buffer(call, "x", x, nx * es, es, h->device)) return s;
    if (cudnnStatus_t s = check_buffer(call, "w", w, nw * es, es, h->device)) return s;
    if (cudnnStatus_t s = check_buffer(call, "y", y, ny * es, es, h->device)) return s;
    if (workspace_bytes > 0) {
        if (cudnnStatus_t s = check_buffer(call, "workSpace", workspace, workspace_bytes, 16, h->device)) return s;
    }
    if (cudnnStatus_t s = synchronize(h, call)) return s;
    std::vector<unsigned char> xb, wb, yb(ny * es);
    if (cudnnStatus_t s = read_buffer(h, x, nx * es, xb, call, "x")) return s;
    if (cudnnStatus_t s = read_buffer(h, w, nw * es, wb, call, "w")) return s;

    // 4-D as 5-D with one frame.
    const int sp = cd->spatial;
    auto dim5 = [&](const int* d, int i) { return sp == 2 ? (i == 2 ? 1 : d[i < 2 ? i : i - 1]) : d[i]; };
    const int N = dim5(xd->dims, 0), C = dim5(xd->dims, 1), T = dim5(xd->dims, 2), H = dim5(xd->dims, 3),
              W = dim5(xd->dims, 4);
    const int K = dim5(wd->dims, 0), KT = dim5(wd->dims, 2), KH = dim5(wd->dims, 3), KW = dim5(wd->dims, 4);
    const int TO = dim5(yd->dims, 2), HO = dim5(yd->dims, 3), WO = dim5(yd->dims, 4);
    const int PT = sp == 3 ? cd->pads[0] : 0, PH = cd->pads[sp - 2], PW = cd->pads[sp - 1];
    const int ST = sp == 3 ? cd->strides[0] : 1, SH = cd->strides[sp - 2], SW = cd->strides[sp - 1];
    const bool round_tf32 = dtype == CUDNN_DATA_FLOAT && cd->math == CUDNN_TENSOR_OP_MATH;
    std::vector<float> xf(nx), wf(nw);
    for (std::size_t i = 0; i < nx; ++i) xf[i] = round_tf32 ? tf32(load(xb, dtype, i)) : load(xb, dtype, i);
    for (std::size_t i = 0; i < nw; ++i) wf[i] = round_tf32 ? tf32(load(wb, dtype, i)) : load(wb, dtype, i);
    std::vector<double> acc((std::size_t)TO * HO * WO);
    for (int n = 0; n < N; ++n) {
        for (int k = 0; k < K; ++k) {
            std::fill(acc.begin(), acc.end(), 0.0);
            for (int c = 0; c < C; ++c) {
                for (int dt = 0; dt < KT; ++dt) {
                    for (int dh = 0; dh < KH; ++dh) {
                        for (int dw = 0; dw < KW; ++dw) {
                            const double wv = wf[(((std::size_t)k * C + c) * KT + dt) * KH * KW + dh * KW + dw];
                            for (int to = 0; to < TO; ++to) {
                                const int t = to * ST - PT + dt;
                                if (t < 0 || t >= T) continue;
                                for (int ho = 0; ho < HO; ++ho) {
                                    const int hh = ho * SH - PH + dh;
                                    if (hh < 0 || hh >= H) continue;
                                    const float* row = &xf[((((std::size_t)n * C + c) * T + t) * H + hh) * W];
                                    double* out = &acc[((std::size_t)to * HO + ho) * WO];
                                    for (int wo = 0; wo < WO; ++wo) {
                                        const int ww = wo * SW - PW + dw;
                                        if (ww >= 0 && ww < W) out[wo] += wv * (double)row[ww];
                                    }
                                }
                            }
                        }
                    }
                }
            }
            const std::size_t base = ((std::size_t)n * K + k) * acc.size();
            for (std::size_t i = 0; i < acc.size(); ++i) store(yb, dtype, base + i, (float)acc[i]);
        }
    }
    if (workspace_bytes > 0) {
        std::vector<unsigned char> scribble(workspace_bytes, 0xab);
        if (fake_cuda_write((CUdeviceptr)workspace, scribble.data(), workspace_bytes, h->device) != CUDA_SUCCESS) {
            return fail(CUDNN_STATUS_EXECUTION_FAILED, call, "writing the workspace failed");
        }
    }
    if (fake_cuda_write((CUdeviceptr)y, yb.data(), yb.size(), h->device) != CUDA_SUCCESS) {
        return fail(CUDNN_STATUS_EXECUTION_FAILED, call, "writing y failed");
    }
    return CUDNN_STATUS_SUCCESS;
}

FAKE_API cudnnStatus_t cudnnAddTensor(cudnnHandle_t h, const void* alpha, cudnnTensorDescriptor_t ad, const void* A,
                                      const void* beta, cudnnTensorDescriptor_t cd, void* C) {
    const char* call = "cudnnAddTensor";
    if (cudnnStatus_t s = check_handle(h, call)) return s;
    if (cudnnStatus_t s = check_tensor(ad, call, "aDesc")) return s;
    if (cudnnStatus_t s = check_tensor(cd, call, "cDesc")) return s;
    if (!alpha || !beta) return fail(CUDNN_STATUS_BAD_PARAM_NULL_POINTER, call, "null alpha or beta");
    const float a = *(const float*)alpha, b = *(const float*)beta;
    if (a != 1.0f || b != 1.0f) return fail(CUDNN_STATUS_NOT_SUPPORTED, call, "alpha %g, beta %g: 1 and 1 expected", a, b);
    if (ad->dtype != cd->dtype) {
        return fail(CUDNN_STATUS_BAD_PARAM, call, "bias %s, output %s", type_name(ad->dtype), type_name(cd->dtype));
    }
    if (ad->nb != cd->nb || ad->dims[1] != cd->dims[1] || count(ad->dims, ad->nb) != (std::size_t)ad->dims[1]) {
        return fail(CUDNN_STATUS_BAD_PARAM, call, "the bias is not [1, %d, 1, ...] of the output's rank",
                    cd->dims[1]);
    }
    const int dtype = cd->dtype;
    const std::size_t es = elem_size(dtype), channels = cd->dims[1], n = count(cd->dims, cd->nb);
    const std::size_t plane = count(cd->dims + 2, cd->nb - 2);
    if (cudnnStatus_t s = check_buffer(call, "A", A, channels * es, es, h->device)) return s;
    if (cudnnStatus_t s = check_buffer(call, "C", C, n * es, es, h->device)) return s;
    if (cudnnStatus_t s = synchronize(h, call)) return s;
    std::vector<unsigned char> ab, cb;
    if (cudnnStatus_t s = read_buffer(h, A, channels * es, ab, call, "A")) return s;
    if (cudnnStatus_t s = read_buffer(h, C, n * es, cb, call, "C")) return s;
    for (std::size_t i = 0; i < n; ++i) store(cb, dtype, i, load(cb, dtype, i) + load(ab, dtype, (i / plane) % channels));
    if (fake_cuda_write((CUdeviceptr)C, cb.data(), cb.size(), h->device) != CUDA_SUCCESS) {
        return fail(CUDNN_STATUS_EXECUTION_FAILED, call, "writing C failed");
    }
    return CUDNN_STATUS_SUCCESS;
}
