#!/usr/bin/env bash
# Builds, on the build machine, what scripts/gpu-check.sh runs on a GPU machine: the kernels
# (cargo xtask kernels), then the release CLI and the GPU test binaries with them embedded,
# packed into gpu-bundle/bundle.tar.xz (ignored by git; carry gpu-bundle/ to the GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo xtask kernels
cargo build --release -p vae-parallel
rm -rf gpu-bundle && mkdir -p gpu-bundle
cp target/release/vae-parallel gpu-bundle/

# Test binaries by target name: kernel by kernel, op by op and the conformance suites against
# the CPU backend, the video VAEs on CUDA, and the NCCL backend.
tests=(cuda_kernels cuda_ops conformance conformance_video cuda_models nccl)
cargo test --release -p vae-tensor -p vae-integration-tests -p vae-transport \
    --test cuda_kernels --test cuda_ops --test conformance --test conformance_video --test cuda_models --test nccl \
    --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import json, shutil, sys
wanted = set(sys.argv[1:])
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in wanted:
        shutil.copy(m["executable"], "gpu-bundle/" + m["target"]["name"])' "${tests[@]}"
for t in "${tests[@]}"; do test -x "gpu-bundle/$t"; done
# Debug info off, and the binaries packed: the device machine takes at most 64 MiB with the
# working tree, and each binary embeds about 8 MB of kernels (mostly PTX text, which xz shrinks
# about tenfold). gpu-check.sh unpacks bundle.tar.xz when it finds it.
strip --strip-debug gpu-bundle/*
(cd gpu-bundle && tar -cJf bundle.tar.xz --remove-files vae-parallel "${tests[@]}")
du -sh gpu-bundle
