#!/usr/bin/env python3
"""Train the tiny real AutoencoderKL that `vae-parallel demo` encodes and decodes.

Writes ``fixtures/demo_vae/`` (or OUT_DIR): a diffusers ``save_pretrained`` directory
(``config.json`` + ``diffusion_pytorch_model.safetensors``) and ``chelsea_256.png``, the demo
photo. The model is trained only on public-domain / CC0 photos shipped inside scikit-image's own
package (no download): astronaut, coffee, rocket and camera. The demo photo, Chelsea the cat
(CC0), is held out: the model never sees it during training.

Everything is deterministic: fixed seeds, float32, CPU, ``torch.set_num_threads(2)``,
``torch.use_deterministic_algorithms(True)``. Two runs on one machine give the same bytes; another
CPU may differ in the last bits. Takes about 1,000 CPU seconds (3,000 steps; roughly 8-10 minutes
on 2 idle cores). Run with the packages pinned in ``scripts/requirements-demo-vae.txt``.

Usage:
    python scripts/train_demo_vae.py [--out OUT_DIR]        # train, save, evaluate
    python scripts/train_demo_vae.py --check [--out OUT_DIR] [--preview-dir /tmp/demo_vae_check]
        # no training: load OUT_DIR, encode the demo photo (latent mean), decode it untiled and
        # with enable_tiling(), print PSNRs, write previews (PNG) and the latent / decodes (.npy)
    python scripts/train_demo_vae.py --check --compare CLI_OUT.npy [...]
        # also: max |diff| of each given decode (e.g. from `vae-parallel decode --out x.npy`)
        # against diffusers' untiled and tiled decodes
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import sys
import time
from pathlib import Path

# Threads that sleep instead of spinning while they wait: the same results, and on a machine
# shared with other jobs a training step takes a tenth of the time that spinning threads take.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch
import torch.nn.functional as F

import diffusers
import skimage
import skimage.data
import skimage.transform
from diffusers import AutoencoderKL
from PIL import Image

PINNED = {
    "torch": "2.15.0",
    "diffusers": "0.38.0",
    "numpy": "2.4.6",
    "skimage": "0.26.0",
}

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "fixtures" / "demo_vae"
DEMO_PHOTO = "chelsea_256.png"

SEED = 20260101
THREADS = 2

# Training photos: (skimage.data function, scales). Each image is used at every listed scale
# (anti-aliased resize), so the model sees content at the size of the 256-pixel demo photo too.
# Licences as scikit-image's docstrings state them (see fixtures/demo_vae/README.md).
TRAIN_IMAGES = (
    ("astronaut", (1.0, 0.5)),  # NASA, public domain
    ("coffee", (1.0, 0.5)),  # CC0 (Rachel Michetti)
    ("rocket", (1.0, 0.5)),  # SpaceX, public domain
    ("camera", (1.0, 0.5)),  # CC0 (Lav Varshney); gray, used as R = G = B
)

# The model: 3 levels (4x), 4 latent channels, mid-block attention, 128-pixel tiles (32 latent).
MODEL_CONFIG = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 3,
    up_block_types=("UpDecoderBlock2D",) * 3,
    block_out_channels=(16, 32, 64),
    layers_per_block=1,
    act_fn="silu",
    latent_channels=4,
    norm_num_groups=8,
    sample_size=128,
    mid_block_add_attention=True,
)

# Training schedule.
STEPS = 3000
BATCH = 8
CROP = 64
LR = 2e-3
WARMUP = 100
MSE_WEIGHT = 0.5
KL_WEIGHT = 1e-5  # on the mean KL per latent element


def set_steps(steps: int) -> None:
    global STEPS
    STEPS = steps


def check_versions() -> None:
    found = {
        "torch": torch.__version__.split("+")[0],
        "diffusers": diffusers.__version__,
        "numpy": np.__version__,
        "skimage": skimage.__version__,
    }
    bad = {k: (found[k], v) for k, v in PINNED.items() if found[k] != v}
    if bad:
        msg = ", ".join(f"{k} {have} (pinned {want})" for k, (have, want) in bad.items())
        print(f"warning: not the pinned versions: {msg}; the weights may differ", file=sys.stderr)


def setup_torch() -> None:
    torch.set_num_threads(THREADS)
    torch.use_deterministic_algorithms(True)
    # Filling every new tensor with NaN (the deterministic mode's default) costs a quarter of the
    # CPU time and changes no result: every op used here writes all of its output.
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.manual_seed(SEED)


def to_tensor(img: np.ndarray) -> torch.Tensor:
    """HWC float in [0, 1] or uint8 -> CHW float32 in [-1, 1]."""
    if img.dtype == np.uint8:
        img = img.astype(np.float32) / 255.0
    return torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1), dtype=np.float32)) * 2.0 - 1.0


def load_training_images() -> list[torch.Tensor]:
    images = []
    for name, scales in TRAIN_IMAGES:
        img = getattr(skimage.data, name)()
        if img.ndim == 2:
            img = np.repeat(img[:, :, None], 3, axis=2)
        for s in scales:
            if s == 1.0:
                t = to_tensor(img)
            else:
                h, w = round(img.shape[0] * s), round(img.shape[1] * s)
                r = skimage.transform.resize(img, (h, w), order=1, anti_aliasing=True, preserve_range=False)
                t = to_tensor(r)
            images.append(t)
    return images


def demo_photo_uint8() -> np.ndarray:
    """Chelsea the cat (held out from training): the 300x300 square around her face, 256x256."""
    img = skimage.data.chelsea()  # (300, 451, 3)
    square = img[:, 100:400]
    small = skimage.transform.resize(square, (256, 256), order=1, anti_aliasing=True, preserve_range=False)
    return np.clip(np.rint(small * 255.0), 0, 255).astype(np.uint8)


def read_png(path: Path) -> torch.Tensor:
    """[1, 3, H, W] in [-1, 1], as diffusers' image processor and `vae-parallel encode` read it."""
    arr = np.asarray(Image.open(path).convert("RGB"))
    return to_tensor(arr)[None]


def to_uint8(x: torch.Tensor) -> np.ndarray:
    """[1, 3, H, W] in [-1, 1] -> HWC uint8, as diffusers' postprocess (x/2+0.5, clamp, round)."""
    y = (x[0] / 2 + 0.5).clamp(0, 1).permute(1, 2, 0).numpy()
    return np.rint(y * 255.0).astype(np.uint8)


def psnr_uint8(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10.0 * math.log10(255.0**2 / mse)


def sample_batch(images: list[torch.Tensor], g: torch.Generator) -> torch.Tensor:
    areas = torch.tensor([float(t.shape[1] * t.shape[2]) for t in images])
    probs = areas.sqrt() / areas.sqrt().sum()
    idx = torch.multinomial(probs, BATCH, replacement=True, generator=g)
    crops = []
    for i in idx.tolist():
        t = images[i]
        _, h, w = t.shape
        y = int(torch.randint(0, h - CROP + 1, (1,), generator=g))
        x = int(torch.randint(0, w - CROP + 1, (1,), generator=g))
        c = t[:, y : y + CROP, x : x + CROP]
        if bool(torch.rand((), generator=g) < 0.5):
            c = c.flip(2)
        crops.append(c)
    return torch.stack(crops)


def lr_at(step: int) -> float:
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    p = (step - WARMUP) / max(1, STEPS - WARMUP)
    return LR * (0.02 + 0.98 * 0.5 * (1 + math.cos(math.pi * p)))


def train(out: Path) -> None:
    setup_torch()
    images = load_training_images()
    print(f"training images: {len(images)} ({sum(t.shape[1] * t.shape[2] for t in images)} pixels)")
    torch.manual_seed(SEED)
    vae = AutoencoderKL(**MODEL_CONFIG)
    # channels_last: oneDNN's convolutions are ~2x faster on the CPU this way.
    vae = vae.to(memory_format=torch.channels_last)
    n_params = sum(p.numel() for p in vae.parameters())
    print(f"parameters: {n_params} ({n_params * 4 / 1e6:.2f} MB in float32)")
    opt = torch.optim.AdamW(vae.parameters(), lr=LR, betas=(0.9, 0.99), weight_decay=0.0)
    g = torch.Generator().manual_seed(SEED + 1)
    gz = torch.Generator().manual_seed(SEED + 2)
    vae.train()
    t0 = time.time()
    c0 = time.process_time()
    run_l1 = None
    for step in range(STEPS):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        x = sample_batch(images, g).contiguous(memory_format=torch.channels_last)
        post = vae.encode(x).latent_dist
        z = post.sample(generator=gz)
        y = vae.decode(z).sample
        l1 = (y - x).abs().mean()
        mse = ((y - x) ** 2).mean()
        kl = post.kl().mean() / post.mean[0].numel()
        loss = l1 + MSE_WEIGHT * mse + KL_WEIGHT * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        run_l1 = l1.item() if run_l1 is None else 0.98 * run_l1 + 0.02 * l1.item()
        if step % 100 == 0 or step == STEPS - 1:
            print(
                f"step {step:5d}  lr {lr_at(step):.2e}  l1 {l1.item():.4f} (avg {run_l1:.4f})  "
                f"mse {mse.item():.5f}  kl {kl.item():.3f}  {time.time() - t0:.0f} s "
                f"({time.process_time() - c0:.0f} CPU s)",
                flush=True,
            )
    train_s = time.time() - t0
    train_cpu_s = time.process_time() - c0
    vae = vae.to(memory_format=torch.contiguous_format)
    vae.eval()

    # scaling_factor as Stable Diffusion's: 1 / std of the latent means over the training photos.
    with torch.no_grad():
        means = [vae.encode(t[None]).latent_dist.mean for t in images[::2]]
        std = torch.cat([m.flatten() for m in means]).std().item()
    vae.register_to_config(scaling_factor=round(1.0 / std, 5))

    out.mkdir(parents=True, exist_ok=True)
    # float16 on disk (1.4 MB rather than 2.7 MB; every weight is within +-1.6); loaded as f32.
    vae.half().save_pretrained(out, safe_serialization=True)
    vae.float()
    Image.fromarray(demo_photo_uint8()).save(out / DEMO_PHOTO, optimize=True)
    digest = hashlib.sha256((out / "diffusion_pytorch_model.safetensors").read_bytes()).hexdigest()
    print(f"trained {STEPS} steps in {train_s:.0f} s wall, {train_cpu_s:.0f} CPU s; final l1 (running avg) {run_l1:.4f}")
    print(f"scaling_factor {1.0 / std:.5f}")
    print(f"wrote {out} (weights sha256 {digest})")

    # Training-set reconstruction, full astronaut image.
    with torch.no_grad():
        x = images[0][None]
        y = vae.decode(vae.encode(x).latent_dist.mean).sample
    print(f"PSNR astronaut (training image, 512x512, untiled): {psnr_uint8(to_uint8(x), to_uint8(y)):.2f} dB")
    check(out, None, [])


def check(out: Path, preview_dir: Path | None, compare: list[Path]) -> None:
    setup_torch()
    preview_dir = preview_dir or Path("/tmp/demo_vae_check")
    preview_dir.mkdir(parents=True, exist_ok=True)
    vae = AutoencoderKL.from_pretrained(out).eval()
    photo = np.asarray(Image.open(out / DEMO_PHOTO).convert("RGB"))
    x = read_png(out / DEMO_PHOTO)
    with torch.no_grad():
        z = vae.encode(x).latent_dist.mean
        plain = vae.decode(z).sample
        vae.enable_tiling()
        tiled = vae.decode(z).sample
        z_tiled = vae.encode(x).latent_dist.mean
        tiled_both = vae.decode(z_tiled).sample
        vae.disable_tiling()
    print(
        f"tiles: tile_sample_min_size {vae.tile_sample_min_size}, tile_latent_min_size "
        f"{vae.tile_latent_min_size}, overlap {vae.tile_overlap_factor}; latent {tuple(z.shape)}"
    )
    np.save(preview_dir / "latent_mean.npy", z.numpy().astype("<f4"))
    np.save(preview_dir / "decode_untiled.npy", plain.numpy().astype("<f4"))
    np.save(preview_dir / "decode_tiled.npy", tiled.numpy().astype("<f4"))
    results = {
        "untiled": plain,
        "tiled decode": tiled,
        "tiled encode + tiled decode": tiled_both,
    }
    for name, y in results.items():
        print(f"PSNR {name} vs photo: {psnr_uint8(photo, to_uint8(y)):.2f} dB")
    print(f"max |tiled - untiled| decode: {(tiled - plain).abs().max().item():.4f}")
    Image.fromarray(to_uint8(plain)).save(preview_dir / "decode_untiled.png")
    Image.fromarray(to_uint8(tiled)).save(preview_dir / "decode_tiled.png")
    Image.fromarray(to_uint8(tiled_both)).save(preview_dir / "encode_decode_tiled.png")
    err = np.abs(to_uint8(tiled).astype(np.int16) - to_uint8(plain).astype(np.int16))
    Image.fromarray(np.clip(err * 8, 0, 255).astype(np.uint8)).save(preview_dir / "tiled_vs_untiled_x8.png")
    side = np.concatenate([photo, to_uint8(plain), to_uint8(tiled)], axis=1)
    Image.fromarray(side).save(preview_dir / "photo_untiled_tiled.png")
    print(f"previews in {preview_dir}")
    for path in compare:
        other = torch.from_numpy(np.load(path)).float()
        d_plain = (other - plain).abs().max().item() if other.shape == plain.shape else float("nan")
        d_tiled = (other - tiled).abs().max().item() if other.shape == tiled.shape else float("nan")
        print(f"{path}: max |diff| vs diffusers untiled {d_plain:.3e}, vs tiled {d_tiled:.3e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--check", action="store_true", help="evaluate OUT instead of training")
    ap.add_argument("--preview-dir", type=Path, default=None)
    ap.add_argument("--compare", type=Path, nargs="*", default=[])
    ap.add_argument("--steps", type=int, default=STEPS, help="smoke tests only; the fixture uses the default")
    args = ap.parse_args()
    set_steps(args.steps)
    check_versions()
    if args.check:
        check(args.out, args.preview_dir, args.compare)
    else:
        train(args.out)


if __name__ == "__main__":
    main()
