// The slice of NCCL's C API types (`nccl.h`, 2.27 ABI) that the fake NCCL implements, with
// NVIDIA's values, so the fake builds without NCCL installed. Only what is used is declared.
#pragma once

#include "driver_api.h"

typedef struct ncclComm* ncclComm_t;
// The runtime's stream handle is the driver's.
typedef CUstream cudaStream_t;

#define NCCL_UNIQUE_ID_BYTES 128
typedef struct {
    char internal[NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;

typedef enum {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
    ncclInProgress = 7,
} ncclResult_t;

typedef enum {
    ncclInt8 = 0,
    ncclUint8 = 1,
    ncclInt32 = 2,
    ncclUint32 = 3,
    ncclInt64 = 4,
    ncclUint64 = 5,
    ncclFloat16 = 6,
    ncclFloat32 = 7,
    ncclFloat64 = 8,
    ncclBfloat16 = 9,
    ncclFloat8e4m3 = 10,
    ncclFloat8e5m2 = 11,
    ncclNumTypes = 12,
} ncclDataType_t;

typedef enum {
    ncclSum = 0,
    ncclProd = 1,
    ncclMax = 2,
    ncclMin = 3,
    ncclAvg = 4,
    ncclNumOps = 5,
} ncclRedOp_t;

// NCCL_VERSION_CODE of the release whose API this is: 2.27.3.
#define FAKE_NCCL_VERSION 22703
