"""Decode and encode diffusion latents over ranks, bit-identical to one device.

``vae = vae_parallel.load(dir, ranks=4)`` loads a diffusers VAE directory; ``vae.decode(z)`` and
``vae.encode(x)`` take numpy arrays, torch tensors or any host DLPack producer (read in place
when row-major float32) and return numpy arrays (torch tensors for torch input), adopted through
DLPack without a copy. The diffusers
drop-in is :mod:`vae_parallel.diffusers` (imports torch and diffusers only when used).
``vae_parallel.Client(url)`` calls a ``vae-parallel serve`` service.
``vae_parallel.devices()`` says whether this installation runs on a GPU here, and why not.
"""

from ._native import (
    ConfigError,
    ExecutionError,
    GroupError,
    InputError,
    ModelError,
    Vae,
    VaeParallelError,
    __version__,
    devices,
    load,
    read_image,
    save,
)
from .client import Client, ServiceError

__all__ = [
    "Client",
    "ConfigError",
    "ExecutionError",
    "GroupError",
    "InputError",
    "ModelError",
    "ServiceError",
    "Vae",
    "VaeParallelError",
    "__version__",
    "devices",
    "load",
    "read_image",
    "save",
]
