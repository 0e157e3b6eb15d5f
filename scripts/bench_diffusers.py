#!/usr/bin/env python3
"""Time diffusers' VAE decode and encode on the CPU at real VAE geometries.

Families (``--family``), each with seeded random weights (PyTorch's default init; the speed
does not depend on the values), written with ``save_pretrained`` (safetensors) into OUT_DIR,
default ``target/bench-models/<family>_geometry`` (under ``target/``, so ignored by git), and
reused while its ``bench_seed.txt`` (seed and config) matches:

- ``sd``: ``AutoencoderKL`` with Stable Diffusion's VAE geometry (block_out_channels 128, 256,
  512, 512, layers_per_block 2, latent_channels 4, norm_num_groups 32, mid-block attention,
  quant_conv and post_quant_conv). Latents ``[1, 4, size/8, size/8]``.
- ``flux1``: ``AutoencoderKL`` in the FLUX.1 / Z-Image geometry (same blocks, latent_channels
  16, no quant_conv / post_quant_conv, scaling_factor 0.3611, shift_factor 0.1159). Latents
  ``[1, 16, size/8, size/8]``.
- ``flux2``: ``AutoencoderKLFlux2`` in its default (FLUX.2) geometry (same blocks,
  latent_channels 32, quant convs, BatchNorm statistics of the patchified latents). Latents
  ``[1, 32, size/8, size/8]``.
- ``wan21``: ``AutoencoderKLWan`` with Wan2.1's geometry (base_dim 96, z_dim 16, dim_mult 1, 2,
  4, 4, num_res_blocks 2). Latents ``[1, 16, 3, size/8, size/8]`` (9 output frames).
- ``wan22``: ``AutoencoderKLWan`` with Wan2.2's geometry (base_dim 160, decoder_base_dim 256,
  z_dim 48, dim_mult 1, 2, 4, 4, num_res_blocks 2, residual blocks, 2 × 2 patches: 16x spatial).
  Latents ``[1, 48, 3, size/16, size/16]`` (9 output frames).
- ``hv15``: ``AutoencoderKLHunyuanVideo15`` in its default (HunyuanVideo-1.5) geometry
  (block_out_channels 128, 256, 512, 1024, 1024, 32 latent channels, 16x spatial, 4x temporal).
  Latents ``[1, 32, 3, size/16, size/16]`` (9 output frames).
- ``ltx2``: ``AutoencoderKLLTX2Video`` in LTX-2's geometry (the class's defaults: block_out_channels
  256, 512, 1024, 2048, decoder 256, 512, 1024, 128 latent channels, patch 4, reflect-padded
  decoder; with the published config's ``decoder_causal=False`` and ratios 32 / 8). Latents
  ``[1, 128, 3, size/32, size/32]`` (17 output frames).

Next to the model go the inputs, seeded, float32, C order, so that ``vae-parallel bench decode``
/ ``bench encode`` read exactly the same files: ``z_<size>.npy`` (latents, ``randn``) for
``--task decode`` and ``x_<size>.npy`` (images ``[1, 3, size, size]``, videos ``[1, 3, 9, size,
size]``, uniform in [-1, 1]) for ``--task encode``.

Each (size, dtype, threads, layout) configuration runs in a fresh subprocess (``--worker``),
which:

1. ``torch.set_num_threads(threads)`` (and one inter-op thread) before any torch work;
2. loads the model (``from_pretrained``, float32, ``eval()``, ``disable_mmap=True``: the
   weights are read into memory at load, as ours are; with diffusers' default mmap they alias
   the file and only become resident during the first decode, which would move them from the
   baseline into the decode's memory) and the input; with ``--dtypes bf16`` both are then cast
   with ``.to(torch.bfloat16)``; with the ``channels_last`` layout the model is converted with
   ``vae.to(memory_format=torch.channels_last)`` and the input with
   ``.contiguous(memory_format=torch.channels_last)`` (Wan: 5-D tensors in
   ``torch.channels_last_3d``, the 4-D weights of its 2-D convolutions in ``channels_last``;
   ``Module.to`` cannot do both at once);
3. collects garbage and returns freed heap to the kernel (``malloc_trim(0)``: the copies that
   the casts and layout conversions discarded would otherwise stay resident), then resets the
   kernel's resident-set high-water mark (writes ``5`` to ``/proc/self/clear_refs``) so that
   transient load-time memory does not count, and records the baseline: the resident set after
   the load (``VmRSS``). If the reset is refused, the baseline is
   ``getrusage(RUSAGE_SELF).ru_maxrss`` after the load instead (``hwm_reset: false``);
4. runs ``vae.decode(z).sample`` or ``vae.encode(x)`` under ``torch.inference_mode()`` (no
   tiling, no slicing) once as a warm-up and then ``--iters`` timed times (wall clock,
   ``time.perf_counter``);
5. reads ``getrusage(RUSAGE_SELF).ru_maxrss`` (KiB on Linux: the process' peak resident set,
   whole process, everything included) and reports ``peak_rss_mib`` = that peak and
   ``decode_rss_mib`` = peak minus the baseline: the extra resident memory the decodes (or
   encodes: the field has the same name) needed on top of the loaded model.

Output: one JSON object per line on stdout, one per configuration (plus a ``model`` line first).
A configuration that fails prints a line with an ``"error"`` field (the exception's first line,
or the exit status) instead of numbers, and the others still run.

Usage:
    python scripts/bench_diffusers.py [--family sd|flux1|flux2|wan21|wan22|hv15|ltx2] [--task decode|encode] [--out DIR]
        [--iters N] [--sizes 256,512] [--threads 1,2] [--dtypes f32,bf16] [--layouts nchw,channels_last]
    python scripts/bench_diffusers.py --prepare-only [--family F] [--task T] [--sizes S]   # model and inputs only
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
FAMILIES = ("sd", "flux1", "flux2", "wan21", "wan22", "hv15", "ltx2")
VIDEO = ("wan21", "wan22", "hv15", "ltx2")
LAYOUTS = ("nchw", "channels_last")
DTYPES = ("f32", "bf16")
FAMILY = "sd"  # set from --family before anything runs

MODEL_SEED = 4242
LATENT_SEED = 4243
IMAGE_SEED = 4244
SCALE = 8  # 3 upsamplings: latent pixel = 8 output pixels
WAN_LATENT_FRAMES = 3  # 1 + 4·2 = 9 video frames


def default_out(family: str) -> Path:
    return REPO_ROOT / "target" / "bench-models" / f"{family}_geometry"


def model_config() -> dict:
    if FAMILY == "flux2":
        # AutoencoderKLFlux2's defaults are FLUX.2's geometry (32 latent channels, quant convs).
        return dict(block_out_channels=(128, 256, 512, 512), latent_channels=32, sample_size=1024)
    if FAMILY == "wan21":
        return dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True])
    if FAMILY == "wan22":
        return dict(
            base_dim=160,
            decoder_base_dim=256,
            z_dim=48,
            dim_mult=[1, 2, 4, 4],
            num_res_blocks=2,
            temperal_downsample=[False, True, True],
            is_residual=True,
            in_channels=12,
            out_channels=12,
            patch_size=2,
            scale_factor_spatial=16,
            scale_factor_temporal=4,
        )
    if FAMILY == "ltx2":
        # AutoencoderKLLTX2Video's defaults are LTX-2's geometry; its published config makes the decoder
        # non-causal and names the ratios (the class's formula would give 64 / 16).
        return dict(decoder_causal=False, spatial_compression_ratio=32, temporal_compression_ratio=8)
    if FAMILY == "hv15":
        # AutoencoderKLHunyuanVideo15's defaults are HunyuanVideo-1.5's geometry (16x spatial, 4x temporal).
        return dict(latent_channels=32, block_out_channels=(128, 256, 512, 1024, 1024), layers_per_block=2)
    common = dict(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(128, 256, 512, 512),
        layers_per_block=2,
        act_fn="silu",
        norm_num_groups=32,
        mid_block_add_attention=True,
    )
    if FAMILY == "flux1":
        return dict(
            common,
            latent_channels=16,
            sample_size=1024,
            scaling_factor=0.3611,
            shift_factor=0.1159,
            use_quant_conv=False,
            use_post_quant_conv=False,
        )
    # SD: the key order of the original script, so that an existing model's tag still matches.
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


def model_class():
    from diffusers import (
        AutoencoderKL,
        AutoencoderKLFlux2,
        AutoencoderKLHunyuanVideo15,
        AutoencoderKLLTX2Video,
        AutoencoderKLWan,
    )

    classes = {
        "wan21": AutoencoderKLWan,
        "wan22": AutoencoderKLWan,
        "flux2": AutoencoderKLFlux2,
        "hv15": AutoencoderKLHunyuanVideo15,
        "ltx2": AutoencoderKLLTX2Video,
    }
    return classes.get(FAMILY, AutoencoderKL)


def seed_tag() -> str:
    return json.dumps({"seed": MODEL_SEED, "config": model_config()}, sort_keys=True)


def input_shape(task: str, size: int) -> tuple[int, ...]:
    if task == "encode":
        if FAMILY in VIDEO:
            return (1, 3, 1 + 4 * (WAN_LATENT_FRAMES - 1), size, size)
        return (1, 3, size, size)
    if FAMILY == "hv15":
        return (1, 32, WAN_LATENT_FRAMES, size // 16, size // 16)
    if FAMILY == "wan22":
        return (1, 48, WAN_LATENT_FRAMES, size // 16, size // 16)
    if FAMILY == "ltx2":
        return (1, 128, WAN_LATENT_FRAMES, size // 32, size // 32)
    latent = size // SCALE
    if FAMILY == "wan21":
        return (1, 16, WAN_LATENT_FRAMES, latent, latent)
    return (1, {"flux1": 16, "flux2": 32}.get(FAMILY, 4), latent, latent)


def input_path(out: Path, task: str, size: int) -> Path:
    return out / (f"x_{size}.npy" if task == "encode" else f"z_{size}.npy")


def prepare(out: Path, task: str, sizes: list[int]) -> dict:
    """Creates (or reuses) the model and the inputs; returns the file names."""
    import numpy as np
    import torch

    out.mkdir(parents=True, exist_ok=True)
    tag_file = out / "bench_seed.txt"
    reused = tag_file.exists() and tag_file.read_text() == seed_tag() and (out / "config.json").exists()
    if not reused:
        torch.manual_seed(MODEL_SEED)
        vae = model_class()(**model_config()).eval()
        vae.save_pretrained(out, safe_serialization=True)
        tag_file.write_text(seed_tag())
        params = sum(p.numel() for p in vae.parameters())
    else:
        params = None
    inputs = {}
    for size in sizes:
        path = input_path(out, task, size)
        shape = input_shape(task, size)
        if task == "encode":
            g = torch.Generator().manual_seed(IMAGE_SEED + size)
            t = torch.rand(shape, generator=g, dtype=torch.float32) * 2 - 1
        else:
            g = torch.Generator().manual_seed(LATENT_SEED + size)
            t = torch.randn(shape, generator=g, dtype=torch.float32)
        a = np.ascontiguousarray(t.numpy().astype("<f4"))
        if not path.exists() or not np.array_equal(np.load(path), a):
            with open(path, "wb") as f:
                np.save(f, a, allow_pickle=False)
        inputs[size] = str(path)
    return {
        "kind": "model",
        "family": FAMILY,
        "task": task,
        "dir": str(out),
        "reused": reused,
        "parameters": params,
        "inputs": inputs,
        # The decode inputs under their old name.
        **({"latents": inputs} if task == "decode" else {}),
    }


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


def release_freed_memory() -> None:
    """Returns the heap freed by the conversions (the f32 / NCHW copies) to the kernel, so that
    the baseline resident set is the model as loaded and converted, not its discarded copies."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def to_channels_last(vae, x):
    """The model and input in channels-last order (``channels_last_3d`` for 5-D tensors)."""
    import torch

    if FAMILY in VIDEO:
        # Module.to(memory_format=channels_last_3d) refuses the 4-D weights of the 2-D convs.
        with torch.no_grad():
            for p in vae.parameters():
                if p.dim() == 5:
                    p.data = p.data.contiguous(memory_format=torch.channels_last_3d)
                elif p.dim() == 4:
                    p.data = p.data.contiguous(memory_format=torch.channels_last)
        return vae, x.contiguous(memory_format=torch.channels_last_3d)
    return vae.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)


def worker(model_dir: Path, task: str, path: Path, threads: int, iters: int, dtype: str, layout: str) -> dict:
    import torch

    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)
    import numpy as np

    # low_cpu_mem_usage=False: what diffusers does without `accelerate`, said explicitly (no
    # warning). disable_mmap=True: the weights are read into memory now; with the default mmap
    # they would alias the file and only become resident when the first decode touches them,
    # so the baseline would leave them out and the decode's memory would count them.
    vae = model_class().from_pretrained(
        model_dir, torch_dtype=torch.float32, low_cpu_mem_usage=False, disable_mmap=True
    ).eval()
    x = torch.from_numpy(np.load(path))
    input_dims = list(x.shape)
    if dtype == "bf16":
        vae, x = vae.to(torch.bfloat16), x.to(torch.bfloat16)
    if layout == "channels_last":
        vae, x = to_channels_last(vae, x)
    assert not vae.use_tiling and not vae.use_slicing
    release_freed_memory()

    hwm_reset = reset_hwm()
    if hwm_reset:
        baseline_kib = status_kib("VmRSS")
    else:
        baseline_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    if task == "encode":
        def run():
            return vae.encode(x).latent_dist.mean
    else:
        def run():
            return vae.decode(x).sample

    times = []
    with torch.inference_mode():
        shape = list(run().shape)  # warm-up
        for _ in range(iters):
            t = time.perf_counter()
            run()
            times.append(time.perf_counter() - t)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "kind": task,
        "impl": "diffusers",
        "family": FAMILY,
        "dtype": dtype,
        "layout": layout,
        "size": input_dims[-1] if task == "encode" else shape[-1],
        "input_shape": input_dims,
        **({"latent_shape": input_dims} if task == "decode" else {}),
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
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def csv(text: str, allowed: tuple[str, ...] | None = None) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    for item in items:
        if allowed is not None and item not in allowed:
            sys.exit(f"{item!r} is not one of {', '.join(allowed)}")
    return items


def main() -> None:
    global FAMILY
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=FAMILIES, default="sd", help="model geometry")
    p.add_argument("--task", choices=["decode", "encode"], default="decode", help="what to time")
    p.add_argument("--out", type=Path, default=None, help="model + input directory")
    p.add_argument("--iters", type=int, default=3, help="timed runs per configuration")
    p.add_argument("--sizes", default="256,512", help="image sizes in pixels, comma-separated")
    p.add_argument("--threads", default="1,2", help="torch thread counts, comma-separated")
    p.add_argument("--dtypes", default="f32", help="f32 and/or bf16, comma-separated")
    p.add_argument("--layouts", default="nchw,channels_last", help="nchw and/or channels_last, comma-separated")
    p.add_argument("--prepare-only", action="store_true", help="write the model and inputs, time nothing")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--input", "--latent", dest="input", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    FAMILY = args.family
    if args.out is None:
        args.out = default_out(FAMILY)

    if args.worker:
        try:
            result = worker(args.out, args.task, args.input, int(args.threads), args.iters, args.dtypes, args.layouts)
        except Exception as e:  # reported as a line: the other configurations still run
            first = (str(e).strip().splitlines() or [""])[0]
            print(json.dumps({"kind": args.task, "impl": "diffusers", "error": f"{type(e).__name__}: {first}"}), flush=True)
            raise
        print(json.dumps(result), flush=True)
        return

    sizes = [int(s) for s in csv(args.sizes)]
    threads = [int(t) for t in csv(args.threads)]
    dtypes = csv(args.dtypes, DTYPES)
    layouts = csv(args.layouts, LAYOUTS)
    info = prepare(args.out.resolve(), args.task, sizes)
    print(json.dumps(info), flush=True)
    if args.prepare_only:
        return
    for size in sizes:
        for dtype in dtypes:
            for t in threads:
                for layout in layouts:
                    cmd = [
                        sys.executable, __file__, "--worker", "--family", FAMILY, "--task", args.task,
                        "--out", info["dir"], "--input", info["inputs"][size],
                        "--threads", str(t), "--iters", str(args.iters), "--dtypes", dtype, "--layouts", layout,
                    ]
                    r = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
                    lines = [l for l in r.stdout.strip().splitlines() if l.startswith("{")]
                    if r.returncode == 0 and lines:
                        print(lines[-1], flush=True)
                        continue
                    error = json.loads(lines[-1]).get("error") if lines else None
                    print(json.dumps({
                        "kind": args.task,
                        "impl": "diffusers",
                        "family": FAMILY,
                        "dtype": dtype,
                        "layout": layout,
                        "size": size,
                        "threads": t,
                        "iters": args.iters,
                        "error": error or f"worker exited with status {r.returncode}",
                    }), flush=True)


if __name__ == "__main__":
    main()
