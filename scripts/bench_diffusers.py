#!/usr/bin/env python3
"""Time diffusers' AutoencoderKL decode on the CPU at the real SD VAE geometry.

The model has Stable Diffusion's VAE geometry (block_out_channels 128, 256, 512, 512,
layers_per_block 2, latent_channels 4, norm_num_groups 32, mid-block attention) with seeded
random weights (PyTorch's default init; the speed does not depend on the values). It is written
with ``save_pretrained`` (safetensors) into OUT_DIR, default ``target/bench-models/sd_geometry``
(under ``target/``, so ignored by git), and reused when its ``bench_seed.txt`` matches. Next to
it go the latents ``z_256.npy`` (``[1, 4, 32, 32]``, decodes to 256x256) and ``z_512.npy``
(``[1, 4, 64, 64]``, decodes to 512x512): seeded ``randn``, float32, C order, so that
``vae-parallel bench decode`` reads exactly the same inputs.

Each (size, threads) configuration runs in a fresh subprocess (``--worker``), which:

1. ``torch.set_num_threads(threads)`` (and one inter-op thread) before any torch work;
2. loads the model (``AutoencoderKL.from_pretrained``, float32, ``eval()``) and the latent;
3. resets the kernel's resident-set high-water mark (writes ``5`` to ``/proc/self/clear_refs``)
   so that transient load-time memory does not count, and records the baseline: the resident
   set after the load (``VmRSS``). If the reset is refused, the baseline is
   ``getrusage(RUSAGE_SELF).ru_maxrss`` after the load instead (``hwm_reset: false``);
4. runs ``vae.decode(z)`` under ``torch.inference_mode()`` (no tiling, no slicing) once as a
   warm-up and then ``--iters`` timed times (wall clock, ``time.perf_counter``);
5. reads ``getrusage(RUSAGE_SELF).ru_maxrss`` (KiB on Linux: the process' peak resident set,
   whole process, everything included) and reports ``peak_rss_mib`` = that peak and
   ``decode_rss_mib`` = peak minus the baseline: the extra resident memory the decodes needed
   on top of the loaded model.

Output: one JSON object per line on stdout, one per configuration (plus a ``model`` line first).

With ``--family wan21`` the model is instead an ``AutoencoderKLWan`` with Wan2.1's real geometry
(base_dim 96, z_dim 16, dim_mult 1,2,4,4, num_res_blocks 2, seeded random weights) in
``target/bench-models/wan21_geometry``, and the latents are ``[1, 16, 3, size/8, size/8]``
(3 latent frames, 9 output frames).

Usage:
    python scripts/bench_diffusers.py [--family sd|wan21] [--out DIR] [--iters N] [--sizes 256,512] [--threads 1,2]
    python scripts/bench_diffusers.py --prepare-only [--out DIR]   # model and latents only
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "target" / "bench-models" / "sd_geometry"
WAN_OUT = REPO_ROOT / "target" / "bench-models" / "wan21_geometry"
FAMILY = "sd"  # set from --family before anything runs

MODEL_SEED = 4242
LATENT_SEED = 4243
SCALE = 8  # 3 upsamplings: latent pixel = 8 output pixels


def model_config() -> dict:
    if FAMILY == "wan21":
        return dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True])
    return dict(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(128, 256, 512, 512),
        layers_per_block=2,
        act_fn="silu",
        latent_channels=4,
        norm_num_groups=32,
        sample_size=512,
        scaling_factor=0.18215,
        use_quant_conv=True,
        use_post_quant_conv=True,
        mid_block_add_attention=True,
    )


def seed_tag() -> str:
    return json.dumps({"seed": MODEL_SEED, "config": model_config()}, sort_keys=True)


def prepare(out: Path, sizes: list[int]) -> dict:
    """Creates (or reuses) the model and the latents; returns the file names."""
    import numpy as np
    import torch
    from diffusers import AutoencoderKL, AutoencoderKLWan

    cls = AutoencoderKLWan if FAMILY == "wan21" else AutoencoderKL
    out.mkdir(parents=True, exist_ok=True)
    tag_file = out / "bench_seed.txt"
    reused = tag_file.exists() and tag_file.read_text() == seed_tag() and (out / "config.json").exists()
    if not reused:
        torch.manual_seed(MODEL_SEED)
        vae = cls(**model_config()).eval()
        vae.save_pretrained(out, safe_serialization=True)
        tag_file.write_text(seed_tag())
        params = sum(p.numel() for p in vae.parameters())
    else:
        params = None
    latents = {}
    for size in sizes:
        path = out / f"z_{size}.npy"
        g = torch.Generator().manual_seed(LATENT_SEED + size)
        shape = (1, 16, 3, size // SCALE, size // SCALE) if FAMILY == "wan21" else (1, 4, size // SCALE, size // SCALE)
        z = torch.randn(shape, generator=g, dtype=torch.float32)
        a = np.ascontiguousarray(z.numpy().astype("<f4"))
        if not path.exists() or not np.array_equal(np.load(path), a):
            with open(path, "wb") as f:
                np.save(f, a, allow_pickle=False)
        latents[size] = str(path)
    return {"kind": "model", "dir": str(out), "reused": reused, "parameters": params, "latents": latents}


def status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def worker(model_dir: Path, latent: Path, threads: int, iters: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)
    import numpy as np
    from diffusers import AutoencoderKL, AutoencoderKLWan

    cls = AutoencoderKLWan if FAMILY == "wan21" else AutoencoderKL
    vae = cls.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    z = torch.from_numpy(np.load(latent))
    assert not vae.use_tiling and not vae.use_slicing

    hwm_reset = reset_hwm()
    if hwm_reset:
        baseline_kib = status_kib("VmRSS")
    else:
        baseline_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    times = []
    with torch.inference_mode():
        shape = list(vae.decode(z).sample.shape)  # warm-up
        for _ in range(iters):
            t = time.perf_counter()
            vae.decode(z).sample
            times.append(time.perf_counter() - t)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "kind": "decode",
        "impl": "diffusers",
        "size": shape[-1],
        "latent_shape": list(z.shape),
        "output_shape": shape,
        "threads": threads,
        "torch_threads": torch.get_num_threads(),
        "iters": iters,
        "best_ms": min(times) * 1e3,
        "median_ms": statistics.median(times) * 1e3,
        "times_ms": [t * 1e3 for t in times],
        "hwm_reset": hwm_reset,
        "baseline_rss_mib": baseline_kib / 1024,
        "peak_rss_mib": peak_kib / 1024,
        "decode_rss_mib": (peak_kib - baseline_kib) / 1024,
        "torch": torch.__version__,
        "diffusers": __import__("diffusers").__version__,
    }


def main() -> None:
    global FAMILY
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=["sd", "wan21"], default="sd", help="model geometry")
    p.add_argument("--out", type=Path, default=None, help="model + latent directory")
    p.add_argument("--iters", type=int, default=3, help="timed decodes per configuration")
    p.add_argument("--sizes", default="256,512", help="output sizes in pixels, comma-separated")
    p.add_argument("--threads", default="1,2", help="torch thread counts, comma-separated")
    p.add_argument("--prepare-only", action="store_true", help="write the model and latents, time nothing")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--latent", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    FAMILY = args.family
    if args.out is None:
        args.out = WAN_OUT if FAMILY == "wan21" else DEFAULT_OUT

    if args.worker:
        print(json.dumps(worker(args.out, args.latent, int(args.threads), args.iters)), flush=True)
        return

    sizes = [int(s) for s in args.sizes.split(",") if s]
    threads = [int(t) for t in args.threads.split(",") if t]
    info = prepare(args.out.resolve(), sizes)
    print(json.dumps(info), flush=True)
    if args.prepare_only:
        return
    for size in sizes:
        for t in threads:
            cmd = [
                sys.executable, __file__, "--worker", "--family", FAMILY, "--out", info["dir"],
                "--latent", info["latents"][size],
                "--threads", str(t), "--iters", str(args.iters),
            ]
            r = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
            if r.returncode != 0:
                sys.exit(f"worker {size}px / {t} thread(s) failed with exit code {r.returncode}")
            print(r.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
