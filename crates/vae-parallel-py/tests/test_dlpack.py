"""DLPack in and out of the package, with CPU producers (NumPy always, torch where importable).

Inputs with ``__dlpack__`` / ``__dlpack_device__`` are read through DLPack and give, bit for bit,
what the ``numpy.asarray`` path (a list input) gives; the producer's deleter runs exactly once;
what cannot be read is an ``InputError``. Results are ``DLPackTensor``s underneath, adopted
without a copy, and outlive the model.
"""

import gc
import sys
from pathlib import Path

import numpy as np
import pytest

import vae_parallel as vp
from vae_parallel import _native

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures"
MODEL = FIXTURES / "autoencoder_kl/flux1_like"


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


@pytest.fixture(scope="module")
def vae():
    return vp.load(MODEL)


@pytest.fixture(scope="module")
def z():
    return np.load(FIXTURES / "autoencoder_kl/flux1_like.decode.in.npy")


@pytest.fixture(scope="module")
def want(vae, z):
    # The numpy.asarray path: a list is no DLPack producer.
    return vae.decode(z.tolist())


class Recording:
    """A DLPack producer over a numpy array that records how it is asked."""

    def __init__(self, array, device=(1, 0), legacy_only=False, refuse=False):
        self.array = array
        self.device = device
        self.legacy_only = legacy_only
        self.refuse = refuse
        self.calls = []

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, **kwargs):
        self.calls.append(kwargs)
        if self.refuse:
            raise BufferError("cannot export")
        if self.legacy_only and kwargs:
            raise TypeError("__dlpack__() got an unexpected keyword argument")
        return self.array.__dlpack__(**kwargs)

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.array, dtype=dtype)


def test_numpy_inputs_go_through_dlpack_and_give_the_asarray_paths_bits(vae, z, want):
    producer = Recording(z)
    assert same_bits(vae.decode(producer), want)
    # One versioned request, no stream for host memory.
    assert producer.calls == [{"max_version": (1, 1)}]
    # A producer of the protocol before max_version is asked again without it.
    old = Recording(z, legacy_only=True)
    assert same_bits(vae.decode(old), want)
    assert old.calls == [{"max_version": (1, 1)}, {}]
    # One that cannot export falls back to numpy.asarray.
    refusing = Recording(z, refuse=True)
    assert same_bits(vae.decode(refusing), want)
    assert len(refusing.calls) == 1
    assert same_bits(vae.decode(z), want)


def test_the_producers_deleter_runs_exactly_once(vae, z, want):
    z = z.copy()
    before = sys.getrefcount(z)
    for _ in range(3):
        assert same_bits(vae.decode(z), want)
        # The capsule's hold on the array is gone: released once, not twice (that would free
        # the array under us) and not never.
        assert sys.getrefcount(z) == before
    with pytest.raises(vp.InputError):
        vae.decode(z[:, :3])  # refused by the model after the import: released all the same
    assert sys.getrefcount(z) == before


def test_other_float_types_and_layouts_are_converted(vae, z, want):
    assert same_bits(vae.decode(z.astype(np.float64)), want)
    assert same_bits(vae.decode(np.asfortranarray(z)), want)
    wide = np.zeros(z.shape[:-1] + (2 * z.shape[-1],), dtype=np.float32)
    wide[..., ::2] = z
    assert same_bits(vae.decode(wide[..., ::2]), want)
    # A byte offset: a view that starts inside its buffer.
    padded = np.concatenate([np.zeros((1,) + z.shape[1:], np.float32), z])
    assert same_bits(vae.decode(padded[1:]), want)
    half = z.astype(np.float16)
    assert same_bits(vae.decode(half), vae.decode(half.astype(np.float32).tolist()))
    frozen = z.copy()
    frozen.setflags(write=False)
    assert same_bits(vae.decode(frozen), want)


def test_what_cannot_be_read_is_an_input_error(vae, z):
    with pytest.raises(vp.InputError, match="int32"):
        vae.decode(z.astype(np.int32))
    with pytest.raises(vp.InputError, match="bool"):
        vae.decode(z > 0)
    with pytest.raises(vp.InputError):
        vae.decode(z[0])  # three dimensions: the model's latent has four
    with pytest.raises(vp.InputError):
        vae.decode(z[:, :3])  # the wrong channel count
    device = Recording(z, device=(2, 0))
    with pytest.raises(vp.InputError, match="cuda:0"):
        vae.decode(device)
    assert device.calls == [], "a device tensor is not asked for its capsule"


def test_results_are_writable_float32_arrays_that_outlive_the_model(z, want):
    vae = vp.load(MODEL)
    out = vae.decode(z)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.flags.writeable
    assert out.flags.c_contiguous
    del vae
    gc.collect()
    assert same_bits(out, want)
    out[...] = 0  # ours to write
    assert not out.any()


def capture(monkeypatch):
    """The DLPackTensor under the next result (numpy.from_dlpack's argument)."""
    seen = []
    real = np.from_dlpack

    def recording(x, *args, **kwargs):
        seen.append(x)
        return real(x, *args, **kwargs)

    monkeypatch.setattr(np, "from_dlpack", recording)
    return seen


def test_results_speak_the_protocol(monkeypatch, vae, z, want):
    seen = capture(monkeypatch)
    out = vae.decode(z)
    monkeypatch.undo()
    (t,) = seen
    assert isinstance(t, _native.DLPackTensor)
    assert t.__dlpack_device__() == (1, 0)
    assert t.shape == list(want.shape)
    assert "DLPackTensor" in repr(t)
    # Adopted without a copy: the array numpy made is over the tensor's memory, and a second
    # adoption shares it.
    again = np.from_dlpack(t)
    assert np.shares_memory(again, out) or again.ctypes.data == out.ctypes.data
    # The legacy capsule, for consumers that ask no version; and a copy when asked for one.

    class Legacy:
        def __dlpack_device__(self):
            return t.__dlpack_device__()

        def __dlpack__(self, **kwargs):
            return t.__dlpack__()

    legacy = np.from_dlpack(Legacy())
    assert same_bits(legacy, want) and legacy.ctypes.data == out.ctypes.data
    copied = np.from_dlpack(t, copy=True)
    assert same_bits(copied, want) and copied.ctypes.data != out.ctypes.data
    # Unused capsules free nothing but themselves.
    for _ in range(3):
        del_capsule = t.__dlpack__(max_version=(1, 0))
        del del_capsule
        del_capsule = t.__dlpack__()
        del del_capsule
    gc.collect()
    assert same_bits(np.from_dlpack(t), want)
    # Host memory takes no stream and lives on the CPU only.
    assert t.__dlpack__(stream=None) is not None and t.__dlpack__(stream=-1) is not None
    with pytest.raises(BufferError):
        t.__dlpack__(stream=1)
    with pytest.raises(BufferError):
        t.__dlpack__(max_version=(1, 0), dl_device=(2, 0))
    # The tensor outlives everything that adopted it, and they it.
    del t, seen, out, again, legacy
    gc.collect()


def test_torch_cpu_tensors_go_through_dlpack_both_ways(vae, z, want):
    torch = pytest.importorskip("torch")
    t = torch.from_numpy(z.copy())
    out = vae.decode(t)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.device.type == "cpu"
    assert same_bits(out.numpy(), want)
    assert same_bits(vae.decode(t.to(torch.bfloat16)).numpy(), vae.decode(t.to(torch.bfloat16).float().numpy()))
    assert same_bits(vae.decode(t.transpose(2, 3).contiguous().transpose(2, 3)).numpy(), want)
    assert same_bits(vae.decode(t.clone().requires_grad_(True)).numpy(), want)
    with pytest.raises(vp.InputError, match="int"):
        vae.decode(t.to(torch.int64))
