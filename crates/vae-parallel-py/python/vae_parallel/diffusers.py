"""A diffusers-compatible VAE computed by vae_parallel.

``DistributedVae.from_pretrained(path, subfolder="vae", ranks=4)`` stands where a diffusers
pipeline expects ``pipe.vae``: ``decode(z, return_dict=...)`` gives a ``DecoderOutput`` (or a
tuple) whose ``.sample`` is diffusers' own within the fixtures' tolerance, ``encode(x)`` an
``AutoencoderKLOutput`` whose ``.latent_dist`` is diffusers' ``DiagonalGaussianDistribution``
(``.mean``, ``.sample(generator)``, ``.mode()``), and ``.config``, ``.dtype``, ``.device``,
``.parameters()``, ``enable_tiling()`` / ``disable_tiling()`` behave as a pipeline uses them.

The pixels follow the tiling state the caller set, as diffusers' do, whatever the number of
ranks: without ``enable_tiling()`` the untiled decode and encode (split exactly over the ranks
by a spatial shard where the family has one; otherwise computed on one rank, with a warning
naming why), after it diffusers' tiled decode and encode, the tiles spread over the ranks.

The model computes where ``device`` and ``dtype`` said when it was loaded; tensors come back
on the device and in the dtype they were given. ``.to(...)`` changes nothing. Importing this
module imports torch and diffusers; ``import vae_parallel`` alone does not.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from diffusers.configuration_utils import FrozenDict
from diffusers.models.autoencoders.vae import DecoderOutput, DiagonalGaussianDistribution
from diffusers.models.modeling_outputs import AutoencoderKLOutput

from . import load

# diffusers' tiling keywords, as vae_parallel.load takes them.
TILING_KEYWORDS = (
    "tile_sample_min_size",
    "tile_overlap_factor",
    "tile_sample_min_height",
    "tile_sample_min_width",
    "tile_sample_stride_height",
    "tile_sample_stride_width",
    "tile_latent_min_height",
    "tile_latent_min_width",
    "tile_sample_min_num_frames",
    "tile_sample_stride_num_frames",
)
# The frame keywords (LTX): diffusers tiles frames only while `use_framewise_decoding` is set.
FRAME_KEYWORDS = ("tile_sample_min_num_frames", "tile_sample_stride_num_frames")
# The classes whose latent statistics are weights (`latents_mean` / `latents_std` buffers).
LTX_CLASSES = ("AutoencoderKLLTXVideo", "AutoencoderKLLTX2Video")
# The classes with Wan's causal 3-D layout (`temperal_downsample` and `z_dim` attributes).
WAN_CLASSES = ("AutoencoderKLWan", "AutoencoderKLQwenImage")


class DistributedVae:
    """A diffusers VAE directory served by vae_parallel over ``ranks`` local ranks.

    Its results are diffusers' own for the tiling state set on it, as a stock VAE's would be:
    untiled until ``enable_tiling()`` (any number of ranks), diffusers' tiled decode and encode
    after it. ``mode`` is the CLI's ``--vae-parallel-mode`` and only says how the ranks share
    the work: ``"auto"`` (the default) picks the fastest strategy that gives those pixels (an
    exact spatial shard of an untiled request where the family has one, the tiles spread over
    the ranks of a tiled one). A named mode forces its strategy: ``"tile"`` computes an untiled
    request on one rank (logged as a warning; ``last_report()["reason"]`` says why), and a shard
    mode (``"spatial_shard_height"``, ...) gives the untiled pixels even after
    ``enable_tiling()`` (a shard has no tiles). ``tiling`` keywords are diffusers' tile sizes
    (as ``enable_tiling(**tiling)`` takes them); they do not turn tiling on.
    """

    def __init__(self, directory, *, ranks=1, mode="auto", device="cpu", dtype="f32", **tiling):
        self._directory = Path(directory)
        self._options = {"ranks": ranks, "mode": mode, "device": device, "dtype": dtype}
        self._tiling = {}
        self._frames = {"tile_sample_min_num_frames": 16, "tile_sample_stride_num_frames": 8}
        self._framewise = False
        self.config = FrozenDict(json.loads((self._directory / "config.json").read_text()))
        self.use_tiling = False
        self.use_slicing = False
        self.use_framewise_encoding = False
        self.dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        self.device = torch.device(device if device != "cuda" else "cuda:0")
        self._vae = self._load(tiling)
        if self.config.get("_class_name") in LTX_CLASSES:
            self._ltx_attributes()
        else:
            self._video_attributes()

    def _ltx_attributes(self):
        """What the LTX pipelines read off their VAE: the latent statistics (weights of the
        checkpoint) and the compression ratios (the config's, else the class's formula)."""
        from safetensors import safe_open

        index = self._directory / "diffusion_pytorch_model.safetensors.index.json"
        files = json.loads(index.read_text())["weight_map"] if index.exists() else {}
        for name in ("latents_mean", "latents_std"):
            path = self._directory / files.get(name, "diffusion_pytorch_model.safetensors")
            with safe_open(path, framework="pt") as f:
                setattr(self, name, f.get_tensor(name).to(torch.float32))
        ltx2 = self.config["_class_name"] == "AutoencoderKLLTX2Video"
        scaling = self.config.get("spatio_temporal_scaling", (True,) * 4 if ltx2 else (True, True, True, False))
        if isinstance(scaling, bool):
            scaling = (scaling,) * (len(self.config.get("layers_per_block", (4, 6, 6, 2, 2))) - 1)
        doublings = 2 ** sum(bool(b) for b in scaling)
        ratio = self.config.get("spatial_compression_ratio")
        self.spatial_compression_ratio = ratio or self.config.get("patch_size", 4) * doublings
        ratio = self.config.get("temporal_compression_ratio")
        self.temporal_compression_ratio = ratio or self.config.get("patch_size_t", 1) * doublings

    def _video_attributes(self):
        """What the other video pipelines read off their VAE besides its config: Wan's and
        Qwen-Image's ``z_dim``, ``temperal_downsample`` / ``temperal_upsample`` (the Qwen-Image
        pipelines derive their scale factor from it) and the compression ratios (HunyuanVideo-1.5,
        Wan), as the diffusers classes set them."""
        name = self.config.get("_class_name")
        if name in WAN_CLASSES:
            self.z_dim = self.config.get("z_dim", 16)
            self.temperal_downsample = list(self.config.get("temperal_downsample", (False, True, True)))
            self.temperal_upsample = self.temperal_downsample[::-1]
            if name == "AutoencoderKLWan":
                self.spatial_compression_ratio = self.config.get("scale_factor_spatial") or 8
            else:
                self.spatial_compression_ratio = 2 ** len(self.temperal_downsample)
        elif name == "AutoencoderKLHunyuanVideo15":
            self.spatial_compression_ratio = self.config.get("spatial_compression_ratio", 16)
            self.temporal_compression_ratio = self.config.get("temporal_compression_ratio", 4)

    @property
    def use_framewise_decoding(self):
        """diffusers' switch for tiling the frames (LTX; it gates the encoder's frame tiles too)."""
        return self._framewise

    @use_framewise_decoding.setter
    def use_framewise_decoding(self, on):
        if bool(on) != self._framewise:
            self._framewise = bool(on)
            self._vae = self._load({})

    @classmethod
    def from_pretrained(cls, path, subfolder=None, **kwargs):
        """Loads ``path`` (or ``path/subfolder``, as a pipeline's ``vae`` folder)."""
        directory = Path(path) / subfolder if subfolder else Path(path)
        return cls(directory, **kwargs)

    def _load(self, tiling, **options):
        unknown = sorted(set(tiling) - set(TILING_KEYWORDS))
        if unknown:
            raise TypeError(f"unknown tiling keyword(s) {unknown}; known: {list(TILING_KEYWORDS)}")
        frames = {k: v for k, v in tiling.items() if k in FRAME_KEYWORDS}
        spatial = {**self._tiling, **{k: v for k, v in tiling.items() if k not in FRAME_KEYWORDS}}
        frames = {**self._frames, **frames}
        options = {**self._options, **options}
        # The engine tiles frames whenever a frame keyword is given: only while framewise here.
        vae = load(self._directory, **options, **spatial, **(frames if self._framewise else {}))
        self._tiling, self._frames, self._options = spatial, frames, options
        return vae

    def enable_tiling(self, **tiling):
        """Tiled decode and encode from now on, with diffusers' tiling keywords if given."""
        if tiling:
            self._vae = self._load(tiling)
        self.use_tiling = True

    def disable_tiling(self):
        """Untiled decode and encode from now on, whatever the number of ranks (split exactly over
        them where the family has a spatial shard; otherwise on one rank, with a warning)."""
        self.use_tiling = False

    def enable_slicing(self):
        """Accepted for compatibility: a batch is one request here either way."""
        self.use_slicing = True

    def disable_slicing(self):
        """Accepted for compatibility."""
        self.use_slicing = False

    def decode(self, z, *args, return_dict=True, generator=None, timestep=None):
        """Pixels in [-1, 1] for the latent ``z``, as ``AutoencoderKL.decode``; the LTX pipelines'
        ``vae.decode(z, timestep, return_dict=False)`` too (a timestep-conditioned decoder decodes
        at that timestep: one value for the whole batch)."""
        second = args[0] if args else False
        if second is None or (isinstance(second, (torch.Tensor, float, int)) and not isinstance(second, bool)):
            timestep, args = second, args[1:]
        if args:
            return_dict = args[0]
        if timestep is not None:
            self._set_decode_timestep(timestep)
        sample = self._vae.decode(z, use_tiling=self.use_tiling).to(z.dtype)
        return DecoderOutput(sample=sample) if return_dict else (sample,)

    def _set_decode_timestep(self, timestep):
        values = sorted(set(torch.as_tensor(timestep).flatten().tolist()))
        if len(values) != 1:
            raise ValueError(f"one decode timestep per call, not {values}")
        if self._options.get("decode_timestep") != values[0]:
            self._vae = self._load({}, decode_timestep=float(values[0]))

    def encode(self, x, return_dict=True):
        """The latent distribution of the pixels ``x``, as ``AutoencoderKL.encode``."""
        moments = self._vae.encode(x, output="moments", use_tiling=self.use_tiling).to(x.dtype)
        posterior = DiagonalGaussianDistribution(moments)
        return AutoencoderKLOutput(latent_dist=posterior) if return_dict else (posterior,)

    def forward(self, sample, sample_posterior=False, return_dict=True, generator=None):
        """Encode then decode, as ``AutoencoderKL.forward``."""
        posterior = self.encode(sample).latent_dist
        z = posterior.sample(generator=generator) if sample_posterior else posterior.mode()
        return self.decode(z, return_dict=return_dict)

    __call__ = forward

    def parameters(self):
        """One empty tensor of the model's dtype and device (pipelines read them off it)."""
        yield torch.empty(0, dtype=self.dtype, device=self.device)

    def to(self, *args, **kwargs):
        """Returns self: the model stays where it was loaded."""
        return self

    def eval(self):
        """Returns self (the model only infers)."""
        return self

    def requires_grad_(self, requires_grad=True):
        """Returns self (no gradients here)."""
        return self

    def inspect(self):
        """What ``vae-parallel inspect`` prints, as a dict."""
        return self._vae.inspect()

    def last_report(self):
        """The report of the last request, as text."""
        return self._vae.last_report()

    def __repr__(self):
        return f"DistributedVae({str(self._directory)!r}, {self._options})"
