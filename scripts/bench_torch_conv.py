"""One 3x3 convolution alone in PyTorch, bf16 and f32, channels-last, best of 3 after a warm-up:
the rate oneDNN reaches on this CPU (context for docs/benchmarks.md, not a side-by-side figure).

    python scripts/bench_torch_conv.py [--threads 1]
"""

import argparse
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    for dtype in (torch.bfloat16, torch.float32):
        for channels, size in ((512, 128), (256, 256)):
            x = torch.randn(1, channels, size, size).to(dtype).to(memory_format=torch.channels_last)
            conv = torch.nn.Conv2d(channels, channels, 3, padding=1).to(dtype).to(memory_format=torch.channels_last)
            with torch.inference_mode():
                conv(x)
                best = float("inf")
                for _ in range(3):
                    started = time.perf_counter()
                    conv(x)
                    best = min(best, time.perf_counter() - started)
            gflop = 2 * 9 * channels * channels * size * size / 1e9
            print(f"{str(dtype):15} {channels}->{channels} at {size}^2: {best * 1e3:7.1f} ms, {gflop / best:6.1f} GFLOP/s")


if __name__ == "__main__":
    main()
