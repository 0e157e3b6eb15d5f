#!/usr/bin/env bash
# Builds, on the build machine, what scripts/gpu-check.sh runs on a GPU machine: the kernels
# (cargo xtask kernels), then the release CLI and the two CUDA test binaries with them embedded,
# copied into gpu-bundle/ (ignored by git; carry it to the GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo xtask kernels
cargo build --release -p vae-parallel
rm -rf gpu-bundle && mkdir -p gpu-bundle
cp target/release/vae-parallel gpu-bundle/
# The GPU tests of vae-tensor: kernel by kernel, and op by op against the CPU backend.
cargo test --release -p vae-tensor --test cuda_kernels --test cuda_ops --test conformance --test conformance_video --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import json, shutil, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in ("cuda_kernels", "cuda_ops", "conformance", "conformance_video"):
        shutil.copy(m["executable"], "gpu-bundle/" + m["target"]["name"])'
cargo test --release -p vae-integration-tests --test cuda_models --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import json, shutil, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "cuda_models":
        shutil.copy(m["executable"], "gpu-bundle/cuda_models")'
cargo test --release -p vae-transport --test nccl --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import json, shutil, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "nccl":
        shutil.copy(m["executable"], "gpu-bundle/nccl")'
for t in cuda_kernels cuda_ops conformance conformance_video cuda_models nccl; do test -x gpu-bundle/$t; done
# Debug info off: the device machine takes at most 64 MiB with the working tree.
strip --strip-debug gpu-bundle/*
du -sh gpu-bundle
