"""Type stubs of ``vae_parallel._native``, the Rust extension (crates/vae-parallel-py/src).

Inputs are numpy arrays (any float type and layout, or anything ``numpy.asarray`` takes) or
torch tensors; results are float32 arrays of the same kind (``None`` on a socket rank other
than 0). A numpy input gives a numpy result; anything else is typed ``Any``, since torch is
optional. tests/test_stubs.py checks these signatures against the extension.
"""

import os
from pathlib import Path
from typing import Any, Literal, TypedDict, overload

import numpy as np
import numpy.typing as npt

__version__: str

_F32 = npt.NDArray[np.float32]
_PathLike = str | os.PathLike[str]

class VaeParallelError(Exception):
    """Every error this package raises."""

class InputError(VaeParallelError):
    """The input array does not fit the model."""

class ModelError(VaeParallelError):
    """The model directory cannot be loaded."""

class ConfigError(VaeParallelError):
    """An option is invalid or unsupported here."""

class ExecutionError(VaeParallelError):
    """A request failed while running."""

class GroupError(VaeParallelError):
    """The group of ranks could not be started."""

class Vae:
    """A loaded VAE and the group its requests run on: returned by :func:`load`."""

    @overload
    def decode(
        self,
        z: npt.NDArray[Any],
        *,
        mode: str | None = None,
        use_tiling: bool = False,
        latents_normalized: bool = False,
    ) -> _F32 | None: ...
    @overload
    def decode(
        self,
        z: Any,
        *,
        mode: str | None = None,
        use_tiling: bool = False,
        latents_normalized: bool = False,
    ) -> Any: ...
    @overload
    def encode(
        self,
        x: npt.NDArray[Any],
        *,
        output: Literal["mean", "moments"] = "mean",
        mode: str | None = None,
        use_tiling: bool = False,
        latents_normalized: bool = False,
    ) -> _F32 | None: ...
    @overload
    def encode(
        self,
        x: Any,
        *,
        output: Literal["mean", "moments"] = "mean",
        mode: str | None = None,
        use_tiling: bool = False,
        latents_normalized: bool = False,
    ) -> Any: ...
    def decode_to(
        self,
        path: _PathLike,
        z: Any,
        *,
        fps: int = 16,
        mode: str | None = None,
        use_tiling: bool = False,
        latents_normalized: bool = False,
    ) -> list[Path]: ...
    def inspect(self) -> dict[str, Any]: ...
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    def last_report(self) -> dict[str, Any] | None: ...

class DLPackTensor:
    """A result lent through DLPack without a copy: float32 on the host (``numpy.from_dlpack``,
    ``torch.from_dlpack``), or on the model's CUDA device when the input was there (float32, or
    bfloat16 for a bf16 model; ``torch.from_dlpack``, ``cupy.from_dlpack``); it owns the memory
    until the last consumer lets go."""

    def __dlpack__(
        self,
        *,
        stream: int | None = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any: ...
    def __dlpack_device__(self) -> tuple[int, int]: ...
    @property
    def is_cuda(self) -> bool: ...
    @property
    def shape(self) -> list[int]: ...

def load(
    model: _PathLike,
    *,
    device: str = "cpu",
    dtype: Literal["f32", "bf16"] = "f32",
    ranks: int | None = None,
    transport: Literal["local", "socket"] = "local",
    mode: str = "auto",
    shard_grid: tuple[int, int] | None = None,
    tile_sample_min_size: int | None = None,
    tile_overlap_factor: float | None = None,
    tile_sample_min_height: int | None = None,
    tile_sample_min_width: int | None = None,
    tile_sample_stride_height: int | None = None,
    tile_sample_stride_width: int | None = None,
    tile_latent_min_height: int | None = None,
    tile_latent_min_width: int | None = None,
    tile_sample_min_num_frames: int | None = None,
    tile_sample_stride_num_frames: int | None = None,
    decode_timestep: float | None = None,
    max_memory_per_rank: int | str | None = None,
    profile: _PathLike | None = None,
) -> Vae: ...
def save(path: _PathLike, pixels: Any, *, fps: int = 16) -> list[Path]: ...
def read_image(path: _PathLike) -> _F32: ...

class _Device(TypedDict):
    """One CUDA device, as the driver reports it."""

    ordinal: int
    name: str
    compute_capability: tuple[int, int]
    total_memory: int
    multiprocessors: int

class _Devices(TypedDict):
    """What :func:`devices` returns."""

    cuda: bool
    reason: str | None
    kernels: bool
    nccl: bool
    devices: list[_Device]

def devices() -> _Devices: ...
