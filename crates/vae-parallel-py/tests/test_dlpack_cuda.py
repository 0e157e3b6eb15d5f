"""DLPack on the GPU: a fake CUDA producer (memory allocated in the fake driver with ctypes, a
``DLManagedTensorVersioned`` built with ctypes in a PyCapsule) read in place by ``decode``, the
result a ``kDLCUDA`` ``DLPackTensor`` whose bytes, read back by the driver, are the host path's.

Runs only under the fake driver (``FAKE_CUDA_DEVICE_COUNT`` set and ``libcuda.so`` the fake one on
``LD_LIBRARY_PATH``, with an extension built after ``cargo xtask kernels``); elsewhere it skips
with the reason, or fails where ``VAE_PARALLEL_FAKE_CUDA_REQUIRED`` is set (CI runs it so, with the
installed wheel and gpu-emu's fast driver: .ci/run).
"""

import ctypes
import os
from pathlib import Path

import numpy as np
import pytest

import vae_parallel as vp

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures"
MODEL = FIXTURES / "autoencoder_kl/sd_like"
KDLCUDA = 2


def unavailable(reason):
    """Skips the test, or fails it where the fake driver was promised (CI)."""
    if os.environ.get("VAE_PARALLEL_FAKE_CUDA_REQUIRED"):
        pytest.fail(reason)
    pytest.skip(reason)


def fake_driver():
    if "FAKE_CUDA_DEVICE_COUNT" not in os.environ:
        unavailable("needs the fake CUDA driver (cargo xtask gpu-emu's libcuda.so, FAKE_CUDA_DEVICE_COUNT)")
    try:
        cuda = ctypes.CDLL("libcuda.so")
    except OSError as e:
        unavailable(f"no libcuda.so on the loader's path: {e}")
    if not hasattr(cuda, "fake_cuda_host_copies"):
        unavailable("libcuda.so is not the fake driver")
    return cuda


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensorVersioned(ctypes.Structure):
    pass


DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensorVersioned))
DLManagedTensorVersioned._fields_ = [
    ("major", ctypes.c_uint32),
    ("minor", ctypes.c_uint32),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", DELETER),
    ("flags", ctypes.c_uint64),
    ("dl_tensor", DLTensor),
]

ctypes.pythonapi.PyCapsule_New.restype = ctypes.py_object
ctypes.pythonapi.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
ctypes.pythonapi.PyCapsule_GetPointer.restype = ctypes.c_void_p
ctypes.pythonapi.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def host_copies(cuda):
    to_device, to_host = ctypes.c_ulonglong(), ctypes.c_ulonglong()
    assert cuda.fake_cuda_host_copies(ctypes.byref(to_device), ctypes.byref(to_host)) == 0
    return to_device.value, to_host.value


class FakeCudaProducer:
    """A float32 array copied into fake device memory, lent through ``__dlpack__``; records how it
    is asked and how many times its deleter runs."""

    def __init__(self, cuda, array):
        self.cuda = cuda
        self.array = np.ascontiguousarray(array, dtype=np.float32)
        self.calls = []
        self.deleted = 0
        ctx = ctypes.c_void_p()
        assert cuda.cuInit(0) == 0
        assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
        assert cuda.cuCtxSetCurrent(ctx) == 0
        self.ptr = ctypes.c_ulonglong()
        assert cuda.cuMemAlloc_v2(ctypes.byref(self.ptr), ctypes.c_size_t(self.array.nbytes)) == 0
        host = self.array.ctypes.data_as(ctypes.c_void_p)
        assert cuda.cuMemcpyHtoD_v2(self.ptr, host, ctypes.c_size_t(self.array.nbytes)) == 0
        self.shape = (ctypes.c_int64 * self.array.ndim)(*self.array.shape)
        self.deleter = DELETER(self._delete)

    def _delete(self, _managed):
        self.deleted += 1

    def __dlpack_device__(self):
        return (KDLCUDA, 0)

    def __dlpack__(self, stream=None, max_version=None, **kwargs):
        self.calls.append({"stream": stream, "max_version": max_version, **kwargs})
        self.managed = DLManagedTensorVersioned(
            major=1,
            minor=0,
            manager_ctx=None,
            deleter=self.deleter,
            flags=0,
            dl_tensor=DLTensor(
                data=self.ptr.value,
                device=DLDevice(KDLCUDA, 0),
                ndim=self.array.ndim,
                dtype=DLDataType(2, 32, 1),
                shape=self.shape,
                strides=None,
                byte_offset=0,
            ),
        )
        return ctypes.pythonapi.PyCapsule_New(ctypes.addressof(self.managed), b"dltensor_versioned", None)


def test_a_cuda_producer_is_decoded_in_place_and_the_result_lent_on_the_device():
    cuda = fake_driver()
    if not vp.devices()["cuda"]:
        unavailable(f"the extension cannot use CUDA here: {vp.devices()['reason']}")
    vae = vp.load(MODEL, device="cuda:0")
    z = np.load(FIXTURES / "autoencoder_kl/sd_like.decode.in.npy")
    want = np.asarray(vae.decode(z))
    producer = FakeCudaProducer(cuda, z)
    before = host_copies(cuda)
    out = vae.decode(producer)
    assert host_copies(cuda) == before, "the request made no copy through the host"
    assert len(producer.calls) == 1 and producer.calls[0]["max_version"] == (1, 0)
    assert isinstance(producer.calls[0]["stream"], int) and producer.calls[0]["stream"] > 0
    assert out.__dlpack_device__() == (KDLCUDA, 0)
    capsule = out.__dlpack__(stream=None, max_version=(1, 0))
    managed = DLManagedTensorVersioned.from_address(
        ctypes.pythonapi.PyCapsule_GetPointer(capsule, b"dltensor_versioned")
    )
    t = managed.dl_tensor
    assert (t.device.device_type, t.device.device_id) == (KDLCUDA, 0)
    assert (t.dtype.code, t.dtype.bits) == (2, 32)
    got = np.empty(want.shape, dtype=np.float32)
    assert cuda.cuMemcpyDtoH_v2(got.ctypes.data_as(ctypes.c_void_p), ctypes.c_ulonglong(t.data), got.nbytes) == 0
    assert got.tobytes() == want.astype(np.float32).tobytes(), "the device result is the host path's, bit for bit"
    del capsule, out
    assert producer.deleted == 1, "the producer's deleter ran once"
