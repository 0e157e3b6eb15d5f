// What the fake driver offers the fake NCCL (kernels-cu/emu/fake_nccl/) beyond CUDA's driver
// API: NCCL reads and writes device memory itself, so the fake NCCL asks the fake driver, under
// its lock, whether a buffer is the communicator's device memory, and moves bytes in and out.
#pragma once

#include <cstddef>

#include "driver_api.h"

extern "C" {

// The driver API calls the fake NCCL makes (libnccl.so links against the fake driver), declared
// here so that the compiler checks them against driver.cpp's definitions.
CUresult cuInit(unsigned flags);
CUresult cuDeviceGetCount(int* count);
CUresult cuCtxGetDevice(CUdevice* device);

// CUDA_SUCCESS when `[ptr, ptr + bytes)` lies in one live allocation of device `device`;
// CUDA_ERROR_INVALID_VALUE when it does not lie in one live allocation (of any device);
// CUDA_ERROR_INVALID_DEVICE when it is another device's memory, whose ordinal goes to `*owner`;
// CUDA_ERROR_NOT_INITIALIZED before cuInit.
CUresult fake_cuda_check_range(CUdeviceptr ptr, std::size_t bytes, int device, int* owner);

// Runs what is queued on stream `s` (a default stream: `device`'s legacy stream), and first
// what the legacy stream's ordering puts before new work on it, as cuStreamSynchronize after a
// launch on `s` would, but from any thread, current context or not; returns the
// context's sticky error. CUDA_ERROR_INVALID_HANDLE for an unknown stream,
// CUDA_ERROR_INVALID_CONTEXT for a stream of another device (its ordinal goes to `*owner`).
CUresult fake_cuda_synchronize(CUstream s, int device, int* owner);

// Copies `bytes` from device memory of `device` at `src` to the host, or from the host into
// device memory of `device` at `dst`; fails as fake_cuda_check_range does.
CUresult fake_cuda_read(void* dst, CUdeviceptr src, std::size_t bytes, int device);
CUresult fake_cuda_write(CUdeviceptr dst, const void* src, std::size_t bytes, int device);

// How many copies of a non-empty range from the host to device memory (cuMemcpyHtoD*) and back
// (cuMemcpyDtoH*) the process has asked the driver for since it loaded, all devices and
// threads together: a test reads them before and after a path that must not touch the host.
// CUDA_ERROR_INVALID_VALUE for a null output.
CUresult fake_cuda_host_copies(unsigned long long* to_device, unsigned long long* to_host);
}
