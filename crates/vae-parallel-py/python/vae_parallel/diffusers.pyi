"""Type stubs of ``vae_parallel.diffusers`` (the diffusers drop-in; needs torch and diffusers).

tests/test_stubs.py checks that every public name and signature here is the module's.
"""

import os
from collections.abc import Iterator
from typing import Any

import torch
from diffusers.configuration_utils import FrozenDict
from diffusers.models.autoencoders.vae import DecoderOutput, DiagonalGaussianDistribution
from diffusers.models.modeling_outputs import AutoencoderKLOutput
from typing_extensions import Self

TILING_KEYWORDS: tuple[str, ...]
FRAME_KEYWORDS: tuple[str, ...]
LTX_CLASSES: tuple[str, ...]
WAN_CLASSES: tuple[str, ...]

class DistributedVae:
    """A diffusers VAE directory served by vae_parallel over ``ranks`` local ranks."""

    config: FrozenDict
    use_tiling: bool
    use_slicing: bool
    use_framewise_encoding: bool
    dtype: torch.dtype
    device: torch.device
    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        ranks: int = 1,
        mode: str = "auto",
        device: str = "cpu",
        dtype: str = "f32",
        **tiling: Any,
    ) -> None: ...
    @property
    def use_framewise_decoding(self) -> bool: ...
    @use_framewise_decoding.setter
    def use_framewise_decoding(self, on: bool) -> None: ...
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str], subfolder: str | None = None, **kwargs: Any) -> Self: ...
    def enable_tiling(self, **tiling: Any) -> None: ...
    def disable_tiling(self) -> None: ...
    def enable_slicing(self) -> None: ...
    def disable_slicing(self) -> None: ...
    def decode(
        self,
        z: torch.Tensor,
        *args: Any,
        return_dict: bool = True,
        generator: torch.Generator | None = None,
        timestep: torch.Tensor | float | None = None,
    ) -> DecoderOutput | tuple[torch.Tensor]: ...
    def encode(
        self, x: torch.Tensor, return_dict: bool = True
    ) -> AutoencoderKLOutput | tuple[DiagonalGaussianDistribution]: ...
    def forward(
        self,
        sample: torch.Tensor,
        sample_posterior: bool = False,
        return_dict: bool = True,
        generator: torch.Generator | None = None,
    ) -> DecoderOutput | tuple[torch.Tensor]: ...
    def __call__(
        self,
        sample: torch.Tensor,
        sample_posterior: bool = False,
        return_dict: bool = True,
        generator: torch.Generator | None = None,
    ) -> DecoderOutput | tuple[torch.Tensor]: ...
    def parameters(self) -> Iterator[torch.Tensor]: ...
    def to(self, *args: Any, **kwargs: Any) -> Self: ...
    def eval(self) -> Self: ...
    def requires_grad_(self, requires_grad: bool = True) -> Self: ...
    def inspect(self) -> dict[str, Any]: ...
    def last_report(self) -> dict[str, Any] | None: ...
