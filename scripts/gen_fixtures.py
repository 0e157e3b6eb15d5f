#!/usr/bin/env python3
"""Generate the diffusers ground-truth fixtures for the Rust VAE reimplementation.

Writes tiny randomly initialised diffusers VAEs (``save_pretrained``, safetensors) and input /
output ``.npy`` pairs (little-endian float32, C order) plus ``manifest.json`` under
``fixtures/autoencoder_kl/`` (or the directory given as the first argument), and the video VAE
families next to it: ``fixtures/wan/`` (AutoencoderKLWan, Wan2.1- and Wan2.2-like) and
``fixtures/qwen_image/`` (AutoencoderKLQwenImage), i.e. the siblings ``wan`` and ``qwen_image`` of
the first argument. Also ``fixtures/hunyuan_video15/`` (AutoencoderKLHunyuanVideo15) and ``fixtures/ltx/``
(AutoencoderKLLTXVideo and AutoencoderKLLTX2Video), the siblings ``hunyuan_video15`` and ``ltx``.

Everything is deterministic: fixed seeds, float32, CPU, one thread. Run with the packages pinned
in ``scripts/requirements-fixtures.txt`` (``cargo xtask fixtures`` checks them first).

Usage: python scripts/gen_fixtures.py [OUTPUT_DIR]
       (also writes OUTPUT_DIR/../wan, OUTPUT_DIR/../qwen_image, OUTPUT_DIR/../hunyuan_video15,
       OUTPUT_DIR/../ltx)
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

import diffusers
from diffusers import (
    AutoencoderKL,
    AutoencoderKLFlux2,
    AutoencoderKLHunyuanVideo15,
    AutoencoderKLLTX2Video,
    AutoencoderKLLTXVideo,
    AutoencoderKLQwenImage,
    AutoencoderKLWan,
)

PINNED = {"torch": "2.15.0", "diffusers": "0.38.0"}

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "fixtures" / "autoencoder_kl"


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


def perturb(model: nn.Module, seed: int) -> None:
    """Make every normalisation non-trivial and attention non-uniform.

    Conv / linear weights keep PyTorch's default init. GroupNorm affine parameters become
    weight = 1 + 0.1 * randn, bias = 0.1 * randn. The attention query/key projections are scaled by
    2 so that softmax is far from uniform (with default init the logits are tiny).
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, nn.GroupNorm):
                m.weight.copy_(1.0 + 0.1 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
        for name, m in model.named_modules():
            if name.endswith(".to_q") or name.endswith(".to_k"):
                m.weight.mul_(2.0)


def build_sd_like(mid_block_add_attention: bool = True) -> AutoencoderKL:
    # The no-attention variant uses narrower blocks to keep the committed size down.
    torch.manual_seed(1000 if mid_block_add_attention else 1001)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 16, 16, 16) if mid_block_add_attention else (8, 8, 8, 8),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=64,
        scaling_factor=0.18215,
        shift_factor=None,
        use_quant_conv=True,
        use_post_quant_conv=True,
        mid_block_add_attention=mid_block_add_attention,
    )
    perturb(vae, 2000 if mid_block_add_attention else 2001)
    return vae


def build_flux1_like() -> AutoencoderKL:
    torch.manual_seed(1100)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(8, 16, 16),
        layers_per_block=1,
        latent_channels=16,
        norm_num_groups=4,
        sample_size=48,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
        mid_block_add_attention=True,
    )
    perturb(vae, 2100)
    return vae


def build_flux2_like() -> AutoencoderKLFlux2:
    torch.manual_seed(1200)
    vae = AutoencoderKLFlux2(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 16, 16, 16),
        decoder_block_out_channels=(8, 16, 16, 24),
        layers_per_block=1,
        latent_channels=32,
        norm_num_groups=4,
        sample_size=64,
        use_quant_conv=True,
        use_post_quant_conv=True,
        mid_block_add_attention=True,
        batch_norm_eps=1e-4,
        patch_size=(2, 2),
    )
    perturb(vae, 2200)
    g = torch.Generator().manual_seed(2201)
    with torch.no_grad():
        n = vae.bn.running_mean.shape[0]
        vae.bn.running_mean.copy_(0.1 * torch.randn(n, generator=g))
        vae.bn.running_var.copy_(0.5 + torch.rand(n, generator=g))
    return vae


MODELS = {
    "sd_like": lambda: build_sd_like(True),
    "sd_like_noattn": lambda: build_sd_like(False),
    "flux1_like": build_flux1_like,
    "flux2_like": build_flux2_like,
}


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def levels(vae) -> int:
    return len(vae.config.block_out_channels)


def set_tiling(vae, tile_sample_min_size: int | None, tile_overlap_factor: float | None):
    """Enable tiling, optionally overriding the tile attributes the way a diffusers user can."""
    vae.enable_tiling()
    if tile_sample_min_size is not None:
        vae.tile_sample_min_size = tile_sample_min_size
        vae.tile_latent_min_size = int(tile_sample_min_size / (2 ** (levels(vae) - 1)))
    if tile_overlap_factor is not None:
        vae.tile_overlap_factor = tile_overlap_factor
    return vae


def reset_tiling(vae) -> None:
    """Back to the constructor's state: tiling off, default tile attributes."""
    vae.disable_tiling()
    vae.tile_sample_min_size = vae.config.sample_size
    vae.tile_latent_min_size = int(vae.config.sample_size / (2 ** (levels(vae) - 1)))
    vae.tile_overlap_factor = 0.25


def patchify(latents: torch.Tensor) -> torch.Tensor:
    """Flux2Pipeline._patchify_latents."""
    b, c, h, w = latents.shape
    latents = latents.view(b, c, h // 2, 2, w // 2, 2)
    latents = latents.permute(0, 1, 3, 5, 2, 4)
    return latents.reshape(b, c * 4, h // 2, w // 2)


def unpatchify(latents: torch.Tensor) -> torch.Tensor:
    """Flux2Pipeline._unpatchify_latents."""
    b, c, h, w = latents.shape
    latents = latents.reshape(b, c // (2 * 2), 2, 2, h, w)
    latents = latents.permute(0, 1, 4, 2, 5, 3)
    return latents.reshape(b, c // (2 * 2), h * 2, w * 2)


def bn_stats(vae):
    mean = vae.bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
    return mean, std


def latent_input(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)


def image_input(shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=g, dtype=torch.float32) * 2.0 - 1.0


def save_npy(path: Path, t: torch.Tensor) -> None:
    a = np.ascontiguousarray(t.detach().cpu().numpy().astype("<f4"))
    with open(path, "wb") as f:
        np.save(f, a, allow_pickle=False)


# --------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------


class Writer:
    def __init__(self, out: Path):
        self.out = out
        self.cases: list[dict] = []
        self.inputs: dict[str, tuple] = {}

    def input(self, name: str, t: torch.Tensor) -> str:
        file = f"{name}.npy"
        if file not in self.inputs:
            save_npy(self.out / file, t)
            self.inputs[file] = tuple(t.shape)
        return file

    def case(self, *, name, model, op, x_file, x, y, output_kind, notes, tiling=None):
        out_file = f"{name}.out.npy"
        save_npy(self.out / out_file, y)
        tiling = tiling or {}
        self.cases.append(
            {
                "name": name,
                "model": model,
                "op": op,
                "tiling": bool(tiling),
                "tile_sample_min_size": tiling.get("tile_sample_min_size"),
                "tile_latent_min_size": tiling.get("tile_latent_min_size"),
                "tile_overlap_factor": tiling.get("tile_overlap_factor"),
                "input": x_file,
                "input_shape": list(x.shape),
                "output": out_file,
                "output_shape": list(y.shape),
                "output_kind": output_kind,
                "notes": notes,
            }
        )


def tiling_record(vae) -> dict:
    return {
        "tile_sample_min_size": int(vae.tile_sample_min_size),
        "tile_latent_min_size": int(vae.tile_latent_min_size),
        "tile_overlap_factor": float(vae.tile_overlap_factor),
    }


def tiling_note(vae, size: int | None = None, factor: float | None = None) -> str:
    s = (
        f"vae.enable_tiling(); tile_sample_min_size={vae.tile_sample_min_size}, "
        f"tile_latent_min_size={vae.tile_latent_min_size}, tile_overlap_factor={vae.tile_overlap_factor}"
    )
    set_by_hand = []
    if size is not None:
        set_by_hand.append(f"vae.tile_sample_min_size = {size}")
        set_by_hand.append(
            f"vae.tile_latent_min_size = int({size} / 2**({levels(vae)} - 1)) = {vae.tile_latent_min_size}"
        )
    if factor is not None:
        set_by_hand.append(f"vae.tile_overlap_factor = {factor}")
    if set_by_hand:
        s += " (set by hand after enable_tiling(): " + "; ".join(set_by_hand) + "; the rest are model defaults)"
    else:
        s += " (all model defaults, derived from config.sample_size)"
    return s


def decode_cases(w: Writer, model: str, vae, *, plain, tiled, tiled_custom, extra=()):
    """plain: latent shape; tiled: (latent shape); tiled_custom: (latent shape, S, F)."""
    z = latent_input(plain, seed=hash_seed(model, "decode"))
    f = w.input(f"{model}.decode.in", z)
    reset_tiling(vae)
    y = vae.decode(z).sample
    w.case(name=f"{model}.decode", model=model, op="decode", x_file=f, x=z, y=y, output_kind="sample",
           notes="vae.decode(z).sample, tiling disabled")

    if tiled is not None:
        z = latent_input(tiled, seed=hash_seed(model, "decode_tiled"))
        f = w.input(f"{model}.decode_tiled.in", z)
        set_tiling(vae, None, None)
        y = vae.decode(z).sample
        w.case(name=f"{model}.decode_tiled", model=model, op="decode", x_file=f, x=z, y=y,
               output_kind="sample", tiling=tiling_record(vae),
               notes=f"vae.decode(z).sample with {tiling_note(vae)}")
        reset_tiling(vae)

    if tiled_custom is not None:
        shape, size, factor = tiled_custom
        z = latent_input(shape, seed=hash_seed(model, "decode_tiled_custom"))
        f = w.input(f"{model}.decode_tiled_custom.in", z)
        set_tiling(vae, size, factor)
        y = vae.decode(z).sample
        w.case(name=f"{model}.decode_tiled_custom", model=model, op="decode", x_file=f, x=z, y=y,
               output_kind="sample", tiling=tiling_record(vae),
               notes=f"vae.decode(z).sample with {tiling_note(vae, size, factor)}")
        reset_tiling(vae)

    for tag, shape, note in extra:
        z = latent_input(shape, seed=hash_seed(model, tag))
        f = w.input(f"{model}.{tag}.in", z)
        set_tiling(vae, None, None)
        y = vae.decode(z).sample
        w.case(name=f"{model}.{tag}", model=model, op="decode", x_file=f, x=z, y=y, output_kind="sample",
               tiling=tiling_record(vae), notes=f"vae.decode(z).sample with {tiling_note(vae)}. {note}")
        reset_tiling(vae)


def encode_cases(w: Writer, model: str, vae, *, plain, tiled, tiled_custom, mean=True):
    x = image_input(plain, seed=hash_seed(model, "encode"))
    f = w.input(f"{model}.encode.in", x)
    reset_tiling(vae)
    h = vae._encode(x)
    w.case(name=f"{model}.encode_moments", model=model, op="encode", x_file=f, x=x, y=h, output_kind="moments",
           notes="vae._encode(x): encoder (+ quant_conv when present) output, channels = [mean; logvar] "
                 "before DiagonalGaussianDistribution (logvar NOT clamped); tiling disabled")
    if mean:
        m = vae.encode(x).latent_dist.mean
        w.case(name=f"{model}.encode_mean", model=model, op="encode", x_file=f, x=x, y=m, output_kind="mean",
               notes="vae.encode(x).latent_dist.mean (first half of the moment channels); tiling disabled")

    if tiled is not None:
        x = image_input(tiled, seed=hash_seed(model, "encode_tiled"))
        f = w.input(f"{model}.encode_tiled.in", x)
        set_tiling(vae, None, None)
        h = vae._encode(x)
        w.case(name=f"{model}.encode_tiled_moments", model=model, op="encode", x_file=f, x=x, y=h,
               output_kind="moments", tiling=tiling_record(vae),
               notes=f"vae._encode(x) (routes to _tiled_encode) with {tiling_note(vae)}")
        reset_tiling(vae)

    if tiled_custom is not None:
        shape, size, factor = tiled_custom
        x = image_input(shape, seed=hash_seed(model, "encode_tiled_custom"))
        f = w.input(f"{model}.encode_tiled_custom.in", x)
        set_tiling(vae, size, factor)
        h = vae._encode(x)
        w.case(name=f"{model}.encode_tiled_custom_moments", model=model, op="encode", x_file=f, x=x, y=h,
               output_kind="moments", tiling=tiling_record(vae),
               notes=f"vae._encode(x) (routes to _tiled_encode) with {tiling_note(vae, size, factor)}")
        reset_tiling(vae)


def kl_normalized_cases(w: Writer, model: str, vae, *, latent_shape, image_file):
    sf = vae.config.scaling_factor
    shift = vae.config.shift_factor
    reset_tiling(vae)
    zn = latent_input(latent_shape, seed=hash_seed(model, "decode_normalized"))
    f = w.input(f"{model}.decode_normalized.in", zn)
    z = zn / sf
    if shift is not None:
        z = z + shift
    y = vae.decode(z).sample
    formula = f"vae.decode(z_n / {sf}" + (f" + {shift}" if shift is not None else "") + ").sample"
    w.case(name=f"{model}.decode_normalized", model=model, op="decode_normalized", x_file=f, x=zn, y=y,
           output_kind="sample",
           notes=f"{formula} (pipeline denormalisation: / scaling_factor"
                 + (", + shift_factor" if shift is not None else ", no shift_factor") + "); tiling disabled")

    x = torch.from_numpy(np.load(w.out / image_file))
    m = vae.encode(x).latent_dist.mean
    y = m
    if shift is not None:
        y = y - shift
    y = y * sf
    formula = "(mean" + (f" - {shift}" if shift is not None else "") + f") * {sf}"
    w.case(name=f"{model}.encode_normalized", model=model, op="encode_normalized", x_file=image_file, x=x, y=y,
           output_kind="latents",
           notes=f"{formula} with mean = vae.encode(x).latent_dist.mean (pipeline normalisation); tiling disabled")


def flux2_normalized_cases(w: Writer, model: str, vae, *, packed_shape, image_shape):
    reset_tiling(vae)
    bn_mean, bn_std = bn_stats(vae)
    zn = latent_input(packed_shape, seed=hash_seed(model, "decode_normalized"))
    f = w.input(f"{model}.decode_normalized.in", zn)
    z = unpatchify(zn * bn_std + bn_mean)
    y = vae.decode(z).sample
    w.case(name=f"{model}.decode_normalized", model=model, op="decode_normalized", x_file=f, x=zn, y=y,
           output_kind="sample",
           notes="Flux2Pipeline decode: z = z_n * sqrt(bn.running_var + batch_norm_eps) + bn.running_mean "
                 "(per channel of the 4*latent_channels patchified layout), then _unpatchify_latents "
                 "([B, 4C, h, w] -> [B, C, 2h, 2w]; channel index = c*4 + dy*2 + dx), then vae.decode(z).sample; "
                 "tiling disabled")

    x = image_input(image_shape, seed=hash_seed(model, "encode_normalized"))
    f = w.input(f"{model}.encode_normalized.in", x)
    m = vae.encode(x).latent_dist.mean
    y = (patchify(m) - bn_mean) / bn_std
    w.case(name=f"{model}.encode_normalized", model=model, op="encode_normalized", x_file=f, x=x, y=y,
           output_kind="latents",
           notes="Flux2Pipeline._encode_vae_image: mean = vae.encode(x).latent_dist.mean (sample_mode argmax), "
                 "_patchify_latents ([B, C, H, W] -> [B, 4C, H/2, W/2]; channel index = c*4 + dy*2 + dx), "
                 "then (p - bn.running_mean) / sqrt(bn.running_var + batch_norm_eps); tiling disabled")


def hash_seed(model: str, tag: str) -> int:
    """A stable (not Python-hash-randomised) seed per (model, case)."""
    s = 0
    for ch in f"{model}/{tag}":
        s = (s * 131 + ord(ch)) % 2_147_483_647
    return s


# --------------------------------------------------------------------------------------------
# Video VAEs: AutoencoderKLWan (Wan2.1 / Wan2.2) and AutoencoderKLQwenImage
# --------------------------------------------------------------------------------------------


def perturb_video(model: nn.Module, seed: int) -> None:
    """The video-VAE counterpart of ``perturb``.

    Every RMS norm (``WanRMS_norm`` / ``QwenImageRMS_norm``: a ``gamma`` parameter, ``bias`` a
    parameter only when built with bias=True) gets gamma = 1 + 0.1 * randn, bias = 0.1 * randn.
    Attention ``to_qkv`` (a 1x1 Conv2d, output rows [q; k; v]) has its q and k rows doubled so that
    softmax is not nearly uniform. Everything else keeps PyTorch's default init.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, m in model.named_modules():
            if type(m).__name__.endswith("RMS_norm"):
                m.gamma.copy_(1.0 + 0.1 * torch.randn(m.gamma.shape, generator=g))
                if isinstance(m.bias, nn.Parameter):
                    m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
        for name, m in model.named_modules():
            if name.endswith(".to_qkv"):
                c = m.weight.shape[0] // 3
                m.weight[: 2 * c].mul_(2.0)
                m.bias[: 2 * c].mul_(2.0)


def latent_stats(z_dim: int, seed: int) -> tuple[list[float], list[float]]:
    """Random per-channel latents_mean (0.5 * randn) and latents_std (0.5 + rand, > 0), rounded to 4 decimals
    like the published configs."""
    g = torch.Generator().manual_seed(seed)
    mean = [round(float(v), 4) for v in 0.5 * torch.randn(z_dim, generator=g)]
    std = [round(float(v), 4) for v in 0.5 + torch.rand(z_dim, generator=g)]
    return mean, std


def build_wan21_like() -> AutoencoderKLWan:
    torch.manual_seed(3000)
    mean, std = latent_stats(16, 3001)
    vae = AutoencoderKLWan(
        base_dim=4,
        z_dim=16,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True, True],
        latents_mean=mean,
        latents_std=std,
    )
    perturb_video(vae, 4000)
    return vae


def build_wan22_like() -> AutoencoderKLWan:
    # Wan2.2 TI2V-5B: base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4],
    # num_res_blocks=2, is_residual=True, in/out_channels=12, patch_size=2, scale_factor_spatial=16.
    torch.manual_seed(3100)
    mean, std = latent_stats(48, 3101)
    vae = AutoencoderKLWan(
        base_dim=4,
        decoder_base_dim=6,
        z_dim=48,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True, True],
        is_residual=True,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_temporal=4,
        scale_factor_spatial=16,
        latents_mean=mean,
        latents_std=std,
    )
    perturb_video(vae, 4100)
    return vae


def build_qwen_image_like() -> AutoencoderKLQwenImage:
    torch.manual_seed(3200)
    mean, std = latent_stats(16, 3201)
    vae = AutoencoderKLQwenImage(
        base_dim=4,
        z_dim=16,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True, True],
        latents_mean=mean,
        latents_std=std,
    )
    perturb_video(vae, 4200)
    return vae


VIDEO_DEFAULT_TILES = (256, 256, 192, 192)  # min h, min w, stride h, stride w (constructor values)


def set_video_tiling(vae, tiles) -> dict:
    """vae.enable_tiling(tile_sample_min_height=, tile_sample_min_width=, tile_sample_stride_height=,
    tile_sample_stride_width=) with the given values (all four passed explicitly)."""
    mh, mw, sh, sw = tiles
    vae.enable_tiling(tile_sample_min_height=mh, tile_sample_min_width=mw,
                      tile_sample_stride_height=sh, tile_sample_stride_width=sw)
    return {
        "tile_sample_min_height": int(vae.tile_sample_min_height),
        "tile_sample_min_width": int(vae.tile_sample_min_width),
        "tile_sample_stride_height": int(vae.tile_sample_stride_height),
        "tile_sample_stride_width": int(vae.tile_sample_stride_width),
    }


def reset_video_tiling(vae) -> None:
    vae.disable_tiling()
    (vae.tile_sample_min_height, vae.tile_sample_min_width,
     vae.tile_sample_stride_height, vae.tile_sample_stride_width) = VIDEO_DEFAULT_TILES


def video_tiling_note(t: dict) -> str:
    return ("vae.enable_tiling(tile_sample_min_height={tile_sample_min_height}, "
            "tile_sample_min_width={tile_sample_min_width}, tile_sample_stride_height={tile_sample_stride_height}, "
            "tile_sample_stride_width={tile_sample_stride_width})").format(**t)


class VideoWriter(Writer):
    """Writer with the video tile fields. The AutoencoderKL tile fields stay in each case (always null)."""

    def case(self, *, name, model, op, x_file, x, y, output_kind, notes, tiling=None, extra=None):
        super().case(name=name, model=model, op=op, x_file=x_file, x=x, y=y, output_kind=output_kind, notes=notes)
        c = self.cases[-1]
        c["tiling"] = bool(tiling)
        for k in ("tile_sample_min_height", "tile_sample_min_width",
                  "tile_sample_stride_height", "tile_sample_stride_width"):
            c[k] = (tiling or {}).get(k)
        for k, v in (extra or {}).items():
            c[k] = v
        # keep the common keys first, the video keys after, in a fixed order
        order = ["name", "model", "op", "tiling", "tile_sample_min_size", "tile_latent_min_size",
                 "tile_overlap_factor", "tile_sample_min_height", "tile_sample_min_width",
                 "tile_sample_stride_height", "tile_sample_stride_width", "input", "input_shape", "output",
                 "output_shape", "output_kind"]
        self.cases[-1] = {k: c[k] for k in order} | {k: v for k, v in c.items() if k not in order}


def video_decode(w: VideoWriter, model: str, vae, tag: str, shape, tiles=None, extra_note: str = ""):
    z = latent_input(shape, seed=hash_seed(model, tag))
    f = w.input(f"{model}.{tag}.in", z)
    reset_video_tiling(vae)
    t = set_video_tiling(vae, tiles) if tiles is not None else None
    y = vae.decode(z).sample
    note = "vae.decode(z).sample, " + (f"tiling: {video_tiling_note(t)}" if t else "tiling disabled")
    w.case(name=f"{model}.{tag}", model=model, op="decode", x_file=f, x=z, y=y, output_kind="sample",
           tiling=t, notes=note + extra_note)
    reset_video_tiling(vae)


def video_encode(w: VideoWriter, model: str, vae, tag: str, shape, tiles=None, mean=True, extra_note: str = "",
                 input_tag: str | None = None):
    """input_tag: reuse the input of another case (same seed and file)."""
    x = image_input(shape, seed=hash_seed(model, input_tag or tag))
    f = w.input(f"{model}.{input_tag or tag}.in", x)
    reset_video_tiling(vae)
    t = set_video_tiling(vae, tiles) if tiles is not None else None
    tn = f"tiling: {video_tiling_note(t)}" if t else "tiling disabled"
    h = vae._encode(x)
    w.case(name=f"{model}.{tag}_moments", model=model, op="encode", x_file=f, x=x, y=h, output_kind="moments",
           tiling=t,
           notes="vae._encode(x): encoder + quant_conv output, channels = [mean; logvar] (2*z_dim) before "
                 "DiagonalGaussianDistribution (logvar NOT clamped); " + tn + extra_note)
    if mean:
        m = vae.encode(x).latent_dist.mean
        w.case(name=f"{model}.{tag}_mean", model=model, op="encode", x_file=f, x=x, y=m, output_kind="mean",
               tiling=t, notes="vae.encode(x).latent_dist.mean (first z_dim moment channels); " + tn + extra_note)
    reset_video_tiling(vae)


def video_decode_normalized(w: VideoWriter, model: str, vae, shape, pipeline: str):
    reset_video_tiling(vae)
    zn = latent_input(shape, seed=hash_seed(model, "decode_normalized"))
    f = w.input(f"{model}.decode_normalized.in", zn)
    zd = vae.config.z_dim
    latents_mean = torch.tensor(vae.config.latents_mean).view(1, zd, 1, 1, 1).to(zn.device, zn.dtype)
    latents_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, zd, 1, 1, 1).to(zn.device, zn.dtype)
    z = zn / latents_std + latents_mean
    y = vae.decode(z, return_dict=False)[0]
    w.case(name=f"{model}.decode_normalized", model=model, op="decode_normalized", x_file=f, x=zn, y=y,
           output_kind="sample",
           notes=f"{pipeline} decode, reproduced exactly: latents_mean = tensor(config.latents_mean).view(1, z_dim, "
                 "1, 1, 1); latents_std = 1.0 / tensor(config.latents_std).view(1, z_dim, 1, 1, 1) (float32); "
                 "z = z_n / latents_std + latents_mean (i.e. z_n divided by the reciprocal of std, which "
                 "differs from z_n * std in the last bit); vae.decode(z, return_dict=False)[0]; tiling disabled. "
                 "No video postprocessing.")
    reset_video_tiling(vae)


def save_models(out: Path, builders: dict) -> dict:
    vaes = {}
    for name, build in builders.items():
        vae = build()
        vae.save_pretrained(out / name, safe_serialization=True)
        vaes[name] = type(vae).from_pretrained(out / name).to(torch.float32).eval()
    return vaes


def finish(out: Path, w: Writer) -> None:
    (out / "manifest.json").write_text(json.dumps(w.cases, indent=2) + "\n")
    for c in w.cases:
        print(f"{c['name']:45s} {c['op']:18s} {str(c['input_shape']):22s} -> {c['output_shape']}")


WAN_PATCH_NOTE = (
    " Wan2.2 (patch_size=2): _encode patchifies x BEFORE routing, but the routing test uses the un-patchified "
    "height/width against tile_sample_min_*; tiled_encode then slices the PATCHIFIED tensor with the tile_sample_* "
    "values unchanged (so an encode tile covers patch_size * tile_sample_min_* input pixels) and uses "
    "spatial_compression_ratio // patch_size (= 8) for the latent tile/stride/blend sizes. tiled_decode instead "
    "divides the sample stride and blend by patch_size (blend = tile_sample_min // p - tile_sample_stride // p, "
    "in patchified pixels), blends and crops in the patchified domain, then unpatchifies and clamps.")


def gen_wan(out: Path) -> None:
    prepare_dir(out)
    vaes = save_models(out, {"wan21_like": build_wan21_like, "wan22_like": build_wan22_like})
    w = VideoWriter(out)
    with torch.no_grad():
        # wan21_like: 8x spatial, 4x temporal (latent T -> 1 + 4 (T - 1) frames), output clamped to [-1, 1].
        vae, m = vaes["wan21_like"], "wan21_like"
        video_decode(w, m, vae, "decode_t1", (1, 16, 1, 3, 5))
        video_decode(w, m, vae, "decode_t3", (1, 16, 3, 2, 3))
        # tiles: latent min 2 x 3, latent stride 1 x 2 -> rows 0,1,2 x cols 0,2,4 = 3 x 3 tiles; blend 8 x 8 px
        video_decode(w, m, vae, "decode_tiled", (1, 16, 2, 3, 5), tiles=(16, 24, 8, 16))
        video_encode(w, m, vae, "encode_f1", (1, 3, 1, 20, 28))
        video_encode(w, m, vae, "encode_f5", (1, 3, 5, 20, 28))
        # tiles over 28 x 44 px: rows 0,16 (tails 28, 12 px) x cols 0,16,32; latent tile 3 x 4, stride 2 x 2,
        # blend 1 x 2 latent rows/cols. Every tile must be >= 8 px wide/high or the stride-2 convs get empty.
        video_encode(w, m, vae, "encode_tiled_f5", (1, 3, 5, 28, 44), tiles=(24, 32, 16, 16))
        video_decode_normalized(w, m, vae, (1, 16, 2, 2, 3), "WanPipeline")

        # wan22_like: patch_size 2, 16x spatial overall (8x in the network), in/out 12 = 3 * 2 * 2 channels.
        vae, m = vaes["wan22_like"], "wan22_like"
        video_decode(w, m, vae, "decode_t1", (1, 48, 1, 2, 3))
        video_decode(w, m, vae, "decode_t2", (1, 48, 2, 1, 3))
        # tiles: latent min 2 x 3, stride 1 x 2 -> 3 x 3 tiles on a 3 x 5 latent; blend (patchified px)
        # 32//2 - 16//2 = 8 and 48//2 - 32//2 = 8.
        video_decode(w, m, vae, "decode_tiled", (1, 48, 1, 3, 5), tiles=(32, 48, 16, 32), extra_note=WAN_PATCH_NOTE)
        # is_residual encoders: AvgDown3D needs even sizes at every level, so the (patchified) input must be a
        # multiple of 8, i.e. H, W multiples of 16 px (a non-multiple fails in diffusers too).
        video_encode(w, m, vae, "encode_f1", (1, 3, 1, 32, 48))
        video_encode(w, m, vae, "encode_f5", (1, 3, 5, 32, 48))
        # Same input: 32 x 48 px = 16 x 24 patchified; tiles (in PATCHIFIED px, see note) 16 x 16, stride 8 x 8:
        # rows 0,8 x cols 0,8,16 = 2 x 3 tiles (tails 8 px patchified); latent tile 2, stride 1, blend 1.
        video_encode(w, m, vae, "encode_tiled_f5", (1, 3, 5, 32, 48), tiles=(16, 16, 8, 8),
                     extra_note=WAN_PATCH_NOTE, input_tag="encode_f5")
        video_decode_normalized(w, m, vae, (1, 48, 1, 2, 3), "WanPipeline")
    finish(out, w)


def gen_qwen_image(out: Path) -> None:
    prepare_dir(out)
    vaes = save_models(out, {"qwen_image_like": build_qwen_image_like})
    w = VideoWriter(out)
    qnote = (" Note: QwenImage tiled_decode does NOT clamp (plain _decode clamps to [-1, 1]); the decoder has no "
             "first_chunk argument.")
    with torch.no_grad():
        vae, m = vaes["qwen_image_like"], "qwen_image_like"
        video_decode(w, m, vae, "decode_t1", (1, 16, 1, 3, 5))
        video_decode(w, m, vae, "decode_t3", (1, 16, 3, 2, 3))
        video_decode(w, m, vae, "decode_tiled", (1, 16, 2, 3, 5), tiles=(16, 24, 8, 16), extra_note=qnote)
        video_encode(w, m, vae, "encode_f1", (1, 3, 1, 20, 28))
        video_encode(w, m, vae, "encode_f5", (1, 3, 5, 20, 28))
        video_encode(w, m, vae, "encode_tiled_f5", (1, 3, 5, 28, 44), tiles=(24, 32, 16, 16))
        video_decode_normalized(w, m, vae, (1, 16, 1, 2, 3), "QwenImagePipeline")
    finish(out, w)


# --------------------------------------------------------------------------------------------
# AutoencoderKLHunyuanVideo15 (HunyuanVideo-1.5)
# --------------------------------------------------------------------------------------------


def build_hunyuan_video15_like() -> AutoencoderKLHunyuanVideo15:
    # HunyuanVideo-1.5: block_out_channels (128, 256, 512, 1024, 1024), latent_channels 32, layers_per_block 2,
    # spatial 16x, temporal 4x, scaling_factor 1.03682. Here 4 levels (8x spatial: three DCAE down/upsamples, the
    # middle two also temporal), 4 latent channels, one layer per block.
    torch.manual_seed(3300)
    vae = AutoencoderKLHunyuanVideo15(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        spatial_compression_ratio=8,
        temporal_compression_ratio=4,
        scaling_factor=0.8125,
    )
    perturb_video(vae, 4300)
    g = torch.Generator().manual_seed(4301)
    with torch.no_grad():
        for name, m in vae.named_modules():
            if name.endswith(".to_q") or name.endswith(".to_k"):
                m.weight.mul_(2.0)
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return vae


HV15_DEFAULT_TILES = (256, 256, 32, 32, 0.25)  # sample h, sample w, latent h, latent w (256 // 8), overlap factor


def set_hv15_tiling(vae, tiles) -> dict:
    """vae.enable_tiling(tile_sample_min_height=, tile_sample_min_width=, tile_latent_min_height=,
    tile_latent_min_width=, tile_overlap_factor=) with all five passed explicitly."""
    sh, sw, lh, lw, f = tiles
    vae.enable_tiling(tile_sample_min_height=sh, tile_sample_min_width=sw, tile_latent_min_height=lh,
                      tile_latent_min_width=lw, tile_overlap_factor=f)
    return {
        "tile_sample_min_height": int(vae.tile_sample_min_height),
        "tile_sample_min_width": int(vae.tile_sample_min_width),
        "tile_latent_min_height": int(vae.tile_latent_min_height),
        "tile_latent_min_width": int(vae.tile_latent_min_width),
        "tile_overlap_factor": float(vae.tile_overlap_factor),
    }


def reset_hv15_tiling(vae) -> None:
    vae.disable_tiling()
    (vae.tile_sample_min_height, vae.tile_sample_min_width, vae.tile_latent_min_height,
     vae.tile_latent_min_width, vae.tile_overlap_factor) = HV15_DEFAULT_TILES


def hv15_tiling_note(t: dict | None) -> str:
    if t is None:
        return "tiling disabled"
    return ("tiling: vae.enable_tiling(tile_sample_min_height={tile_sample_min_height}, "
            "tile_sample_min_width={tile_sample_min_width}, tile_latent_min_height={tile_latent_min_height}, "
            "tile_latent_min_width={tile_latent_min_width}, tile_overlap_factor={tile_overlap_factor})").format(**t)


# The mid-block attention's causal mask is [B, S, S], which scaled_dot_product_attention broadcasts against
# [B, heads=1, S, S] as [1, B, S, S]: an unsliced batch of 2 or more raises in diffusers. Batches are made with
# vae.enable_slicing() (each item alone), which is what vae-parallel computes for a batch.
SLICING_NOTE = (" Batch > 1: with vae.enable_slicing() (each item alone); without it diffusers raises, the causal "
                "mask [B, S, S] broadcasting against [B, 1, S, S].")


def hv15_decode(w: VideoWriter, model: str, vae, tag: str, shape, tiles=None, extra_note: str = ""):
    z = latent_input(shape, seed=hash_seed(model, tag))
    f = w.input(f"{model}.{tag}.in", z)
    reset_hv15_tiling(vae)
    t = set_hv15_tiling(vae, tiles) if tiles is not None else None
    if shape[0] > 1:
        vae.enable_slicing()
        extra_note += SLICING_NOTE
    y = vae.decode(z).sample
    vae.disable_slicing()
    w.case(name=f"{model}.{tag}", model=model, op="decode", x_file=f, x=z, y=y, output_kind="sample", tiling=t,
           extra=t, notes="vae.decode(z).sample (no clamp), " + hv15_tiling_note(t) + extra_note)
    reset_hv15_tiling(vae)


def hv15_encode(w: VideoWriter, model: str, vae, tag: str, shape, tiles=None, input_tag: str | None = None):
    x = image_input(shape, seed=hash_seed(model, input_tag or tag))
    f = w.input(f"{model}.{input_tag or tag}.in", x)
    reset_hv15_tiling(vae)
    t = set_hv15_tiling(vae, tiles) if tiles is not None else None
    tn = hv15_tiling_note(t)
    if shape[0] > 1:
        vae.enable_slicing()
        tn += SLICING_NOTE
        h = torch.cat([vae._encode(item) for item in x.split(1)])
    else:
        h = vae._encode(x)
    w.case(name=f"{model}.{tag}_moments", model=model, op="encode", x_file=f, x=x, y=h, output_kind="moments",
           tiling=t, extra=t,
           notes="vae._encode(x) (per item when sliced): the encoder's output (no quant_conv in this class), channels = [mean; logvar] "
                 "(2*latent_channels) before DiagonalGaussianDistribution (logvar NOT clamped); " + tn)
    m = vae.encode(x).latent_dist.mean
    w.case(name=f"{model}.{tag}_mean", model=model, op="encode", x_file=f, x=x, y=m, output_kind="mean",
           tiling=t, extra=t, notes="vae.encode(x).latent_dist.mean (first latent_channels moments); " + tn)
    vae.disable_slicing()
    reset_hv15_tiling(vae)


def gen_hunyuan_video15(out: Path) -> None:
    prepare_dir(out)
    vaes = save_models(out, {"hunyuan_video15_like": build_hunyuan_video15_like})
    w = VideoWriter(out)
    with torch.no_grad():
        # 8x spatial, 4x temporal (latent T -> 1 + 4 (T - 1) frames), no clamp anywhere.
        vae, m = vaes["hunyuan_video15_like"], "hunyuan_video15_like"
        hv15_decode(w, m, vae, "decode_t1", (1, 4, 1, 3, 5))
        hv15_decode(w, m, vae, "decode_t3", (1, 4, 3, 2, 3))
        hv15_decode(w, m, vae, "decode_batch2", (2, 4, 2, 3, 2))
        # Consistent tiles (one frame: tiles are independent of time): latent 4 x 4 every int(4 * 0.75) = 3,
        # blend int(32 * 0.25) = 8 px, keep 24 px: rows 0, 3 x cols 0, 3, 6 on a 6 x 8 latent (tails 3 and 2
        # latent rows); output 48 x 64 px.
        hv15_decode(w, m, vae, "decode_tiled", (1, 4, 1, 6, 8), tiles=(32, 32, 4, 4, 0.25))
        # The class's quirks: the latent tile is its own keyword and the result is never cropped, so a pixel
        # tile that is not latent tile * 8 gives an output of another size: latent 3 x 4 every 2 x 3, blend
        # 6 x 8 px, keep 18 x 24 px; rows 0, 2, 4 (24, 24, 8 px) -> 18 + 18 + 8 = 44 rows for a 5-row latent.
        hv15_decode(w, m, vae, "decode_tiled_uncropped", (1, 4, 1, 5, 7), tiles=(24, 32, 3, 4, 0.25),
                    extra_note=" (the output is 44 x 56 px, not 40 x 56: tiles are cropped to their kept part, the "
                               "result never to the latent size times 8)")
        hv15_encode(w, m, vae, "encode_f1", (1, 3, 1, 16, 24))
        hv15_encode(w, m, vae, "encode_f5", (1, 3, 5, 16, 24))
        hv15_encode(w, m, vae, "encode_batch2_f5", (2, 3, 5, 8, 16))
        # Pixel tiles 32 x 32 every int(32 * 0.75) = 24 px, latent blend int(4 * 0.25) = 1, keep 3: rows 0, 24
        # (32, 24 px) x cols 0, 24, 48 (32, 32, 8 px) on 48 x 56 px; moments 6 x 7.
        hv15_encode(w, m, vae, "encode_tiled_f1", (1, 3, 1, 48, 56), tiles=(32, 32, 4, 4, 0.25))
        # HunyuanVideo15Pipeline: vae.decode(latents / scaling_factor); image-to-video conditions on
        # encode(x).latent_dist.mode() * scaling_factor.
        reset_hv15_tiling(vae)
        sf = vae.config.scaling_factor
        zn = latent_input((1, 4, 2, 2, 3), seed=hash_seed(m, "decode_normalized"))
        f = w.input(f"{m}.decode_normalized.in", zn)
        y = vae.decode(zn / sf, return_dict=False)[0]
        w.case(name=f"{m}.decode_normalized", model=m, op="decode_normalized", x_file=f, x=zn, y=y,
               output_kind="sample",
               notes=f"HunyuanVideo15Pipeline decode: vae.decode(z_n / {sf}, return_dict=False)[0]; tiling disabled")
        x = torch.from_numpy(np.load(w.out / f"{m}.encode_f1.in.npy"))
        y = vae.encode(x).latent_dist.mode() * sf
        w.case(name=f"{m}.encode_normalized", model=m, op="encode_normalized", x_file=f"{m}.encode_f1.in.npy", x=x,
               y=y, output_kind="latents",
               notes=f"HunyuanVideo15ImageToVideoPipeline: vae.encode(x).latent_dist.mode() * {sf}; tiling disabled")
    finish(out, w)


# --------------------------------------------------------------------------------------------
# AutoencoderKLLTXVideo (LTX-Video 0.9.5-like) and AutoencoderKLLTX2Video (LTX-2)
# --------------------------------------------------------------------------------------------


def set_ltx_latent_stats(vae, seed: int) -> None:
    """latents_mean / latents_std are persistent buffers (saved in the safetensors, not the config)."""
    mean, std = latent_stats(vae.config.latent_channels, seed)
    with torch.no_grad():
        vae.latents_mean.copy_(torch.tensor(mean, dtype=torch.float32))
        vae.latents_std.copy_(torch.tensor(std, dtype=torch.float32))


def build_ltx_video_like() -> AutoencoderKLLTXVideo:
    # LTX-Video 0.9.5: block_out_channels (128, 256, 512, 1024, 2048), LTXVideo095DownBlock3D x 4, decoder
    # (256, 512, 1024), timestep conditioning, 128 latent channels, patch 4, 32x spatial / 8x temporal. Here three
    # levels (spatial, temporal, spatiotemporal down; two spatiotemporal residual ups), patch 2, 8x spatial, 4x
    # temporal, to keep the fixtures small. The ratios are passed explicitly: the class's default
    # patch_size * 2 ** sum(spatio_temporal_scaling) = 16 / 8 would be wrong for this layout.
    torch.manual_seed(3400)
    vae = AutoencoderKLLTXVideo(
        in_channels=3,
        out_channels=3,
        latent_channels=8,
        block_out_channels=(4, 8, 8, 16),
        down_block_types=("LTXVideo095DownBlock3D",) * 3,
        decoder_block_out_channels=(8, 16),
        layers_per_block=(1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1),
        spatio_temporal_scaling=(True, True, True),
        decoder_spatio_temporal_scaling=(True, True),
        decoder_inject_noise=(False, False, False),
        downsample_type=("spatial", "temporal", "spatiotemporal"),
        upsample_residual=(True, True),
        upsample_factor=(2, 2),
        timestep_conditioning=True,
        patch_size=2,
        patch_size_t=1,
        scaling_factor=0.95,
        encoder_causal=True,
        decoder_causal=False,
        spatial_compression_ratio=8,
        temporal_compression_ratio=4,
    )
    set_ltx_latent_stats(vae, 3401)
    return vae


def build_ltx2_like() -> AutoencoderKLLTX2Video:
    # LTX-2: block_out_channels (256, 512, 1024, 2048), decoder (256, 512, 1024), 128 latent channels, encoder
    # zero padding, decoder reflect padding, no timestep conditioning. Here three levels, patch 2, 8x spatial, 4x
    # temporal.
    torch.manual_seed(3500)
    vae = AutoencoderKLLTX2Video(
        in_channels=3,
        out_channels=3,
        latent_channels=8,
        block_out_channels=(8, 8, 16),
        down_block_types=("LTX2VideoDownBlock3D",) * 3,
        layers_per_block=(1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, True),
        downsample_type=("spatial", "temporal", "spatiotemporal"),
        decoder_block_out_channels=(8, 16),
        decoder_layers_per_block=(1, 1, 1),
        decoder_spatio_temporal_scaling=(True, True),
        decoder_inject_noise=(False, False, False),
        upsample_type=("spatiotemporal", "spatiotemporal"),
        upsample_residual=(True, True),
        upsample_factor=(2, 2),
        timestep_conditioning=False,
        patch_size=2,
        patch_size_t=1,
        scaling_factor=1.0,
        encoder_causal=True,
        decoder_causal=False,
        encoder_spatial_padding_mode="zeros",
        decoder_spatial_padding_mode="reflect",
        spatial_compression_ratio=8,
        temporal_compression_ratio=4,
    )
    set_ltx_latent_stats(vae, 3501)
    return vae


def build_ltx2_variant() -> AutoencoderKLLTX2Video:
    # The LTX-2 class off its published path: its own default decoder_causal=True, a reflect-padded encoder and a
    # zero-padded decoder, timestep conditioning, upsample_type ("spatial", "temporal") (the class does NOT reverse
    # it, unlike the other decoder tuples), a residual only on the first upsample and factors (1, 2) (reversed: 2
    # then 1), layers_per_block longer than the blocks (the mid block takes the last entry), and no ratios in the
    # config: the class's formula patch_size * 2 ** sum(spatio_temporal_scaling) = 8 / 4 is not what the blocks
    # make (4 / 2), and the tiled paths divide by the formula's.
    torch.manual_seed(3600)
    vae = AutoencoderKLLTX2Video(
        in_channels=3,
        out_channels=3,
        latent_channels=8,
        block_out_channels=(8, 16),
        down_block_types=("LTX2VideoDownBlock3D",) * 2,
        layers_per_block=(1, 1, 1, 2),
        spatio_temporal_scaling=(True, True),
        downsample_type=("spatial", "temporal"),
        decoder_block_out_channels=(8, 16),
        decoder_layers_per_block=(1, 1, 1),
        decoder_spatio_temporal_scaling=(True, True),
        decoder_inject_noise=(False, False, False),
        upsample_type=("spatial", "temporal"),
        upsample_residual=(False, True),
        upsample_factor=(1, 2),
        timestep_conditioning=True,
        patch_size=2,
        patch_size_t=1,
        scaling_factor=1.0,
        encoder_spatial_padding_mode="reflect",
        decoder_spatial_padding_mode="zeros",
    )
    set_ltx_latent_stats(vae, 3601)
    return vae


# The constructor's tile attributes (both classes).
LTX_DEFAULT_TILES = {
    "tile_sample_min_height": 512,
    "tile_sample_min_width": 512,
    "tile_sample_min_num_frames": 16,
    "tile_sample_stride_height": 448,
    "tile_sample_stride_width": 448,
    "tile_sample_stride_num_frames": 8,
}
LTX_SPATIAL = {"tile_sample_min_height": 16, "tile_sample_min_width": 16,
               "tile_sample_stride_height": 8, "tile_sample_stride_width": 8}
LTX_TEMPORAL = {"tile_sample_min_num_frames": 8, "tile_sample_stride_num_frames": 4}
# ltx2_like decodes: reflect padding needs tiles of >= 2 latent pixels, so a latent stride of 2.
LTX2_SPATIAL = {"tile_sample_min_height": 24, "tile_sample_min_width": 24,
                "tile_sample_stride_height": 16, "tile_sample_stride_width": 16}
LTX2_REFLECT_NOTE = (" LTX2 decoder convs pad H and W by reflection (decoder_spatial_padding_mode='reflect'), which "
                     "needs every decoded (tile of the) latent to be >= 2 pixels high and wide.")


def reset_ltx_tiling(vae) -> None:
    vae.disable_tiling()
    vae.disable_slicing()
    vae.use_framewise_encoding = False
    vae.use_framewise_decoding = False
    for k, v in LTX_DEFAULT_TILES.items():
        setattr(vae, k, v)


def set_ltx_tiling(vae, tiles: dict | None, framewise: bool) -> dict:
    """vae.enable_tiling(**tiles) (when tiles is given), then vae.use_framewise_decoding = framewise. Returns the
    manifest fields: tiling (use_tiling), framewise (use_framewise_decoding) and the six tile attributes in force
    (null when neither is on)."""
    reset_ltx_tiling(vae)
    if tiles is not None:
        vae.enable_tiling(**tiles)
    vae.use_framewise_decoding = framewise
    on = bool(vae.use_tiling or vae.use_framewise_decoding)
    rec = {"tiling": bool(vae.use_tiling), "framewise": bool(vae.use_framewise_decoding)}
    for k in LTX_DEFAULT_TILES:
        rec[k] = int(getattr(vae, k)) if on else None
    return rec


def ltx_tiling_note(tiles: dict | None, framewise: bool, encode: bool = False) -> str:
    """The diffusers calls, then how the tiles run (spatial when the spatial sizes were set, temporal when
    framewise)."""
    if tiles is None and not framewise:
        return "tiling disabled"
    parts = []
    if tiles is not None:
        parts.append("vae.enable_tiling(" + ", ".join(f"{k}={v}" for k, v in tiles.items()) + ")")
    if framewise:
        parts.append("vae.use_framewise_decoding = True")
    note = "tiling: " + "; ".join(parts) + "."
    if framewise:
        note += LTX_ENCODE_TEMPORAL_NOTE if encode else LTX_DECODE_TEMPORAL_NOTE
    if tiles is not None and "tile_sample_min_height" in tiles:
        note += LTX_ENCODE_SPATIAL_NOTE if encode else LTX_DECODE_SPATIAL_NOTE
    return note


LTX_DECODE_TEMPORAL_NOTE = (
    " Temporal tiles: latent chunks of tile_sample_min_num_frames // 4 + 1 frames every tile_sample_stride_num_frames"
    " // 4; every chunk after the first drops its LAST decoded frame; blend tile_sample_min_num_frames - "
    "tile_sample_stride_num_frames frames; keep stride + 1 frames of the first chunk, stride of the others.")
LTX_DECODE_SPATIAL_NOTE = (
    " Spatial tiles: latent tile_sample_min_* // 8 every tile_sample_stride_* // 8 (last tiles shorter), pixel "
    "blend min - stride, keep stride px, crop to latent * 8.")
LTX_ENCODE_TEMPORAL_NOTE = (
    " Temporal tiles: pixel chunks of tile_sample_min_num_frames + 1 frames every tile_sample_stride_num_frames; "
    "every chunk after the first drops its FIRST latent frame; latent blend (min - stride) // 4 frames; keep "
    "stride // 4 + 1 latent frames of the first chunk, stride // 4 of the others. Routed by "
    "use_framewise_DECODING (the class's _encode never reads use_framewise_encoding).")
LTX_ENCODE_SPATIAL_NOTE = (
    " Spatial tiles: pixel tile_sample_min_* every tile_sample_stride_* (last tiles shorter), latent blend "
    "(min - stride) // 8, keep stride // 8, crop to pixels // 8.")


LTX_DECODE_TIMESTEP = 0.05


def ltx_temb(vae, batch: int):
    """The decode timestep: torch.tensor([t] * B) when the decoder is timestep-conditioned, else None."""
    return torch.tensor([LTX_DECODE_TIMESTEP] * batch) if vae.config.timestep_conditioning else None


def ltx_check(name: str, y: torch.Tensor) -> None:
    if not bool(torch.isfinite(y).all()) or float(y.std()) <= 1e-3:
        sys.exit(f"gen_fixtures.py: {name}: degenerate output (std {float(y.std())})")


def ltx_case(w: VideoWriter, *, name, model, op, x_file, x, y, output_kind, notes, rec, timestep):
    ltx_check(name, y)
    w.case(name=name, model=model, op=op, x_file=x_file, x=x, y=y, output_kind=output_kind, notes=notes,
           tiling=rec if rec["tiling"] else None, extra=rec | {"decode_timestep": timestep})


def ltx_decode(w: VideoWriter, model: str, vae, tag: str, shape, tiles=None, framewise=False, extra_note: str = ""):
    z = latent_input(shape, seed=hash_seed(model, tag))
    f = w.input(f"{model}.{tag}.in", z)
    rec = set_ltx_tiling(vae, tiles, framewise)
    temb = ltx_temb(vae, shape[0])
    y = vae.decode(z, temb).sample
    call = (f"vae.decode(z, temb=torch.tensor([{LTX_DECODE_TIMESTEP}] * {shape[0]})).sample" if temb is not None
            else "vae.decode(z).sample")
    ltx_case(w, name=f"{model}.{tag}", model=model, op="decode", x_file=f, x=z, y=y, output_kind="sample",
             rec=rec, timestep=LTX_DECODE_TIMESTEP if temb is not None else None,
             notes=call + " (no clamp), " + ltx_tiling_note(tiles, framewise) + extra_note)
    reset_ltx_tiling(vae)


def ltx_encode(w: VideoWriter, model: str, vae, tag: str, shape, tiles=None, framewise=False, mean=True,
               extra_note: str = ""):
    x = image_input(shape, seed=hash_seed(model, tag))
    f = w.input(f"{model}.{tag}.in", x)
    rec = set_ltx_tiling(vae, tiles, framewise)
    tn = ltx_tiling_note(tiles, framewise, encode=True) + extra_note
    h = vae._encode(x)
    ltx_case(w, name=f"{model}.{tag}_moments", model=model, op="encode", x_file=f, x=x, y=h, output_kind="moments",
             rec=rec, timestep=None,
             notes="vae._encode(x): the encoder's output (no quant_conv in this class): latent_channels means, "
                   "then the encoder's single logvar channel repeated latent_channels times (2*latent_channels), "
                   "before DiagonalGaussianDistribution (logvar NOT clamped); " + tn)
    if mean:
        m = vae.encode(x).latent_dist.mean
        ltx_case(w, name=f"{model}.{tag}_mean", model=model, op="encode", x_file=f, x=x, y=m, output_kind="mean",
                 rec=rec, timestep=None,
                 notes="vae.encode(x).latent_dist.mean (first latent_channels moments); " + tn)
    reset_ltx_tiling(vae)


def ltx_normalized(w: VideoWriter, model: str, vae, latent_shape, pipeline: str, i2v_pipeline: str) -> None:
    """decode_normalized / encode_normalized with the pipelines' _denormalize_latents / _normalize_latents."""
    reset_ltx_tiling(vae)
    sf = vae.config.scaling_factor
    zn = latent_input(latent_shape, seed=hash_seed(model, "decode_normalized"))
    f = w.input(f"{model}.decode_normalized.in", zn)
    latents_mean = vae.latents_mean.view(1, -1, 1, 1, 1).to(zn.device, zn.dtype)
    latents_std = vae.latents_std.view(1, -1, 1, 1, 1).to(zn.device, zn.dtype)
    z = zn * latents_std / sf + latents_mean
    temb = ltx_temb(vae, latent_shape[0])
    y = vae.decode(z, temb, return_dict=False)[0]
    if temb is not None:
        tcall = (f"timestep = torch.tensor([{LTX_DECODE_TIMESTEP}] * {latent_shape[0]}) (decode_timestep); the "
                 "pipeline's decode noise is left out (decode_noise_scale = 0.0: latents = (1 - 0) * latents + 0 * "
                 "noise); vae.decode(z, timestep, return_dict=False)[0]")
    else:
        tcall = "timestep = None (timestep_conditioning is False); vae.decode(z, None, return_dict=False)[0]"
    ltx_case(w, name=f"{model}.decode_normalized", model=model, op="decode_normalized", x_file=f, x=zn, y=y,
             output_kind="sample", rec=set_ltx_tiling(vae, None, False),
             timestep=LTX_DECODE_TIMESTEP if temb is not None else None,
             notes=f"{pipeline}._denormalize_latents(z_n, vae.latents_mean, vae.latents_std, "
                   f"vae.config.scaling_factor={sf}): z = z_n * latents_std.view(1, -1, 1, 1, 1) / scaling_factor "
                   f"+ latents_mean.view(1, -1, 1, 1, 1) (float32, the buffers); {tcall}; tiling disabled. No video "
                   "postprocessing.")
    x = torch.from_numpy(np.load(w.out / f"{model}.encode_f5.in.npy"))
    mean = vae.encode(x).latent_dist.mean
    latents_mean = vae.latents_mean.view(1, -1, 1, 1, 1).to(mean.device, mean.dtype)
    latents_std = vae.latents_std.view(1, -1, 1, 1, 1).to(mean.device, mean.dtype)
    y = (mean - latents_mean) * sf / latents_std
    ltx_case(w, name=f"{model}.encode_normalized", model=model, op="encode_normalized",
             x_file=f"{model}.encode_f5.in.npy", x=x, y=y, output_kind="latents", rec=set_ltx_tiling(vae, None, False),
             timestep=None,
             notes=f"{pipeline}._normalize_latents(vae.encode(x).latent_dist.mean, vae.latents_mean, vae.latents_std, "
                   f"vae.config.scaling_factor={sf}): (mean - latents_mean.view(1, -1, 1, 1, 1)) * scaling_factor / "
                   "latents_std.view(1, -1, 1, 1, 1), the exact inverse of decode_normalized's denormalisation "
                   f"(what {pipeline}.prepare_latents applies to given 5-D latents); tiling disabled. {i2v_pipeline}")
    reset_ltx_tiling(vae)


LTX_I2V_NOTE = ("NB LTXImageToVideoPipeline / LTXConditionPipeline encode images with retrieve_latents(..., "
                "generator) = latent_dist.sample(generator) and call _normalize_latents WITHOUT scaling_factor "
                "(default 1.0); the mean stands in for the sample here.")
LTX2_I2V_NOTE = ("NB LTX2ImageToVideoPipeline encodes with retrieve_latents(..., 'argmax') = latent_dist.mode() "
                 "(= mean) and calls _normalize_latents WITHOUT scaling_factor (default 1.0; the same here, "
                 "scaling_factor is 1.0).")


def gen_ltx(out: Path) -> None:
    prepare_dir(out)
    vaes = save_models(out, {"ltx_video_like": build_ltx_video_like, "ltx2_like": build_ltx2_like,
                             "ltx2_variant": build_ltx2_variant})
    w = VideoWriter(out)
    both = LTX_SPATIAL | LTX_TEMPORAL
    with torch.no_grad():
        variant = vaes.pop("ltx2_variant")
        for m, vae in vaes.items():
            # 8x spatial, 4x temporal (latent T -> 4 (T - 1) + 1 frames), no clamp. ltx_video_like decodes with
            # temb = 0.05 (x timestep_scale_multiplier 1000 inside the decoder); ltx2_like has no temb.
            ltx_decode(w, m, vae, "decode_t1", (1, 8, 1, 2, 3))
            ltx_decode(w, m, vae, "decode_t3", (1, 8, 3, 2, 2))
            ltx_decode(w, m, vae, "decode_batch2", (2, 8, 2, 2, 2))
            if m == "ltx_video_like":
                # latent tiles 2 x 2 every 1 x 1 (pixel blend 8): rows 0, 1, 2 x cols 0, 1, 2, 3 on a 3 x 4
                # latent; the last row / column of tiles is 1 latent pixel wide.
                ltx_decode(w, m, vae, "decode_tiled", (1, 8, 2, 3, 4), tiles=LTX_SPATIAL)
            else:
                # Reflect padding (decoder) needs every tile >= 2 latent pixels, and with a latent stride of 1 the
                # last tile is always 1 wide (diffusers raises "Padding size should be less than the corresponding
                # input dimension"). So latent tiles 3 x 3 every 2 x 2 (pixel blend 8) on an even 4 x 4 latent:
                # rows 0, 2 (3, 2 latent rows) x cols 0, 2.
                ltx_decode(w, m, vae, "decode_tiled", (1, 8, 2, 4, 4), tiles=LTX2_SPATIAL,
                           extra_note=LTX2_REFLECT_NOTE)
            # latent chunks of 3 frames every 1 (0-2, 1-3, 2-3, 3): 9, 9, 5, 1 frames, the last three dropping
            # their last frame (the 1-frame chunk keeps nothing); blend 4 frames; 5 + 4 + 4 + 0 = 13 frames.
            ltx_decode(w, m, vae, "decode_temporal", (1, 8, 4, 2, 2), tiles=LTX_TEMPORAL, framewise=True)
            if m == "ltx_video_like":
                # chunks 0-2, 1-2, 2 latent frames, each spatially tiled: 2 x 2 every 1 x 1 on 2 x 3.
                ltx_decode(w, m, vae, "decode_spatiotemporal", (1, 8, 3, 2, 3), tiles=both, framewise=True)
            else:
                # chunks 0-2, 1-2, 2 latent frames, each spatially tiled: 3 x 3 every 2 x 2 on 2 x 4 (one row,
                # cols 0, 2: 3 and 2 latent pixels wide).
                ltx_decode(w, m, vae, "decode_spatiotemporal", (1, 8, 3, 2, 4), tiles=LTX2_SPATIAL | LTX_TEMPORAL,
                           framewise=True, extra_note=LTX2_REFLECT_NOTE)
            ltx_encode(w, m, vae, "encode_f5", (1, 3, 5, 16, 24))
            ltx_encode(w, m, vae, "encode_batch2_f5", (2, 3, 5, 8, 16))
            # pixel tiles 16 every 8: rows 0, 8, 16 (16, 16, 8 px) x cols 0, 8, 16, 24; latent blend 1.
            ltx_encode(w, m, vae, "encode_tiled_f1", (1, 3, 1, 24, 32), tiles=LTX_SPATIAL)
            # 13 frames > 8: pixel chunks 0-8, 4-12, 8-12, 12 (9, 9, 5, 1 frames -> 3, 3, 2, 1 latent frames;
            # the 1-frame chunk keeps nothing): 2 + 1 + 1 + 0 = 4 latent frames.
            ltx_encode(w, m, vae, "encode_temporal", (1, 3, 13, 8, 16), tiles=LTX_TEMPORAL, framewise=True)
            ltx_encode(w, m, vae, "encode_spatiotemporal", (1, 3, 9, 16, 24), tiles=both, framewise=True, mean=False)
            if m == "ltx_video_like":
                ltx_normalized(w, m, vae, (1, 8, 2, 2, 3), "LTXPipeline", LTX_I2V_NOTE)
            else:
                ltx_normalized(w, m, vae, (1, 8, 2, 2, 3), "LTX2Pipeline", LTX2_I2V_NOTE)
        # The variant: 4x spatial, 2x temporal as built (latent T -> 2 (T - 1) + 1 frames, causal), tiles sized
        # by the class's 8 / 4.
        m, vae = "ltx2_variant", variant
        ltx_decode(w, m, vae, "decode_t3", (1, 8, 3, 3, 4))
        # latent tiles 16 // 8 = 2 every 8 // 8 = 1 on 3 x 5; each decodes to 8 px, blended over 8, kept 8.
        ltx_decode(w, m, vae, "decode_tiled", (1, 8, 2, 3, 5), tiles=LTX_SPATIAL)
        # latent chunks of 8 // 4 + 1 = 3 frames every 4 // 4 = 1 on 5 latent frames.
        ltx_decode(w, m, vae, "decode_temporal", (1, 8, 5, 2, 2), tiles=LTX_TEMPORAL, framewise=True)
        ltx_encode(w, m, vae, "encode_f3", (1, 3, 3, 8, 12))
        ltx_encode(w, m, vae, "encode_tiled_f1", (1, 3, 1, 24, 32), tiles=LTX_SPATIAL, mean=False)
        # 13 frames > 8: chunks 0-8, 4-12, 8-12, 12 (9, 9, 5, 1 frames).
        ltx_encode(w, m, vae, "encode_temporal", (1, 3, 13, 8, 8), tiles=LTX_TEMPORAL, framewise=True, mean=False)
    finish(out, w)


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def check_versions() -> None:
    have = {"torch": torch.__version__.split("+")[0], "diffusers": diffusers.__version__}
    bad = [f"{k}=={have[k]} (want {v})" for k, v in PINNED.items() if have[k] != v]
    if bad:
        sys.exit("gen_fixtures.py: wrong package versions: " + ", ".join(bad)
                 + "; install scripts/requirements-fixtures.txt")


def prepare_dir(out: Path) -> None:
    if out.exists() and any(out.iterdir()):
        if not (out / "manifest.json").exists():
            sys.exit(f"gen_fixtures.py: {out} is not empty and holds no manifest.json; refusing to replace it")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)


def main() -> None:
    check_versions()
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.set_default_dtype(torch.float32)

    prepare_dir(out)

    # Save, then reload from disk, so the fixtures are computed from exactly the committed weights.
    vaes = {}
    for name, build in MODELS.items():
        vae = build()
        vae.save_pretrained(out / name, safe_serialization=True)
        cls = type(vae)
        vaes[name] = cls.from_pretrained(out / name).to(torch.float32).eval()

    w = Writer(out)
    with torch.no_grad():
        # sd_like: 4 levels (8x), tile 64 px / 8 latent, stride 48 px / 6 latent.
        vae = vaes["sd_like"]
        decode_cases(w, "sd_like", vae, plain=(1, 4, 6, 9), tiled=(1, 4, 9, 14),
                     tiled_custom=((1, 4, 5, 8), 48, 0.5))
        encode_cases(w, "sd_like", vae, plain=(1, 3, 40, 56), tiled=(1, 3, 56, 104),
                     tiled_custom=((1, 3, 40, 64), 48, 0.5))
        kl_normalized_cases(w, "sd_like", vae, latent_shape=(1, 4, 6, 9), image_file="sd_like.encode.in.npy")

        # sd_like_noattn: mid_block_add_attention=False.
        vae = vaes["sd_like_noattn"]
        decode_cases(w, "sd_like_noattn", vae, plain=(1, 4, 6, 9), tiled=None, tiled_custom=None)
        encode_cases(w, "sd_like_noattn", vae, plain=(1, 3, 40, 56), tiled=None, tiled_custom=None)

        # flux1_like: 3 levels (4x), tile 48 px / 12 latent, stride 36 px / 9 latent; batch 2 here.
        vae = vaes["flux1_like"]
        decode_cases(
            w, "flux1_like", vae, plain=(1, 16, 6, 9), tiled=(2, 16, 11, 20),
            tiled_custom=((1, 16, 8, 14), 32, None),
            extra=[
                ("decode_tiled_one_row", (1, 16, 12, 14),
                 "Routing: height == tile_latent_min_size (not >) but width > it, so the tiled path runs "
                 "with a single row of tiles."),
                ("decode_tiling_enabled_small", (1, 16, 12, 12),
                 "Routing: tiling enabled but neither side > tile_latent_min_size, so the plain path runs."),
            ],
        )
        encode_cases(w, "flux1_like", vae, plain=(2, 3, 40, 56), tiled=(1, 3, 52, 84),
                     tiled_custom=((1, 3, 40, 64), 32, None))
        kl_normalized_cases(w, "flux1_like", vae, latent_shape=(1, 16, 6, 9), image_file="flux1_like.encode.in.npy")

        # flux2_like: 4 levels (8x), decoder channels differ from encoder ones, BatchNorm stats set.
        vae = vaes["flux2_like"]
        decode_cases(w, "flux2_like", vae, plain=(1, 32, 6, 9), tiled=(1, 32, 9, 14),
                     tiled_custom=((1, 32, 6, 10), None, 0.5))
        encode_cases(w, "flux2_like", vae, plain=(1, 3, 40, 56), tiled=(1, 3, 64, 112),
                     tiled_custom=((1, 3, 48, 80), None, 0.5))
        flux2_normalized_cases(w, "flux2_like", vae, packed_shape=(1, 128, 3, 5), image_shape=(1, 3, 48, 80))

    (out / "manifest.json").write_text(json.dumps(w.cases, indent=2) + "\n")
    for c in w.cases:
        print(f"{c['name']:45s} {c['op']:18s} {str(c['input_shape']):18s} -> {c['output_shape']}")

    # Video VAE families, next to the AutoencoderKL directory.
    gen_wan(out.parent / "wan")
    gen_qwen_image(out.parent / "qwen_image")
    gen_hunyuan_video15(out.parent / "hunyuan_video15")
    gen_ltx(out.parent / "ltx")


if __name__ == "__main__":
    main()
