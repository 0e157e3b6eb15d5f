"""Wan2.1 decode on a GPU with diffusers, for the side-by-side with `vae-parallel bench decode --device cuda`.

Writes (or reuses) the Wan2.1-geometry AutoencoderKLWan with the seeded random weights of
scripts/bench_diffusers.py and a seeded latent ``[1, 16, T, H, W]`` into ``--out``, then times
``vae.decode`` on ``cuda:0`` in each ``--dtypes`` (one warm-up, ``--iters`` timed runs, CUDA
synchronised) and prints one JSON line per dtype with latency and ``torch.cuda.max_memory_allocated``.

``float32`` runs with PyTorch's defaults, under which cuDNN convolutions use TF32 tensor cores
(``torch.backends.cudnn.allow_tf32`` is True by default): 10-bit mantissas, not IEEE f32.
``float32_strict`` turns TF32 off, which is what vae-parallel's f32 computes; compare like with
like.

    python scripts/bench_gpu_diffusers.py --out /tmp/wan21 --shape 1,16,5,60,104 \
        --dtypes float32,float32_strict,bfloat16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

MODEL_SEED = 4242  # as scripts/bench_diffusers.py: the same weights
LATENT_SEED = 4244
CONFIG = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="model + latent directory")
    p.add_argument("--shape", default="1,16,5,60,104", help="latent B,C,T,H,W")
    p.add_argument("--dtypes", default="float32,float32_strict,bfloat16")
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--prepare-only", action="store_true")
    args = p.parse_args()

    import numpy as np
    import torch
    from diffusers import AutoencoderKLWan

    args.out.mkdir(parents=True, exist_ok=True)
    if not (args.out / "config.json").exists():
        torch.manual_seed(MODEL_SEED)
        AutoencoderKLWan(**CONFIG).eval().save_pretrained(args.out, safe_serialization=True)
    shape = tuple(int(v) for v in args.shape.split(","))
    latent = args.out / "z.npy"
    g = torch.Generator().manual_seed(LATENT_SEED)
    z = torch.randn(shape, generator=g, dtype=torch.float32)
    np.save(latent, np.ascontiguousarray(z.numpy().astype("<f4")), allow_pickle=False)
    print(json.dumps({"kind": "prepared", "dir": str(args.out), "latent": str(latent), "shape": list(shape)}), flush=True)
    if args.prepare_only:
        return

    for name in args.dtypes.split(","):
        strict = name.endswith("_strict")
        dtype = getattr(torch, name.removesuffix("_strict"))
        torch.backends.cudnn.allow_tf32 = not strict
        torch.backends.cuda.matmul.allow_tf32 = False  # PyTorch's default
        vae = AutoencoderKLWan.from_pretrained(args.out, torch_dtype=dtype).to("cuda").eval()
        zc = z.to("cuda", dtype)
        times = []
        with torch.inference_mode():
            out_shape = list(vae.decode(zc).sample.shape)  # warm-up
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            for _ in range(args.iters):
                t = time.perf_counter()
                vae.decode(zc).sample
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
        print(
            json.dumps(
                {
                    "kind": "decode",
                    "impl": "diffusers",
                    "device": torch.cuda.get_device_name(0),
                    "dtype": name,
                    "tf32_convs": dtype == torch.float32 and torch.backends.cudnn.allow_tf32,
                    "output_shape": out_shape,
                    "best_ms": min(times) * 1e3,
                    "median_ms": statistics.median(times) * 1e3,
                    "peak_allocated_mib": torch.cuda.max_memory_allocated() / 2**20,
                    "torch": torch.__version__,
                    "diffusers": __import__("diffusers").__version__,
                }
            ),
            flush=True,
        )
        del vae, zc
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
