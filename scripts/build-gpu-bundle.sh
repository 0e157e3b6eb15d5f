#!/usr/bin/env bash
# Builds, on the build machine, what scripts/gpu-check.sh runs on a GPU machine: the kernels
# (cargo xtask kernels), then the release CLI and the CUDA kernel test binary with them embedded,
# copied into gpu-bundle/ (ignored by git; carry it to the GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo xtask kernels
cargo build --release -p vae-parallel
test_bin=$(cargo test --release -p vae-tensor --test cuda_kernels --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "cuda_kernels":
        print(m["executable"])')
rm -rf gpu-bundle && mkdir -p gpu-bundle
cp target/release/vae-parallel gpu-bundle/
cp "$test_bin" gpu-bundle/cuda_kernels
du -sh gpu-bundle
