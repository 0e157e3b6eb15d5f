#!/usr/bin/env bash
# The CUDA crates built the way an engine holding candle's CUDA backend builds them: candle's
# `cuda` feature turns on cudarc's `dynamic-linking`, which takes the place of the workspace's
# `fallback-dynamic-loading`, so libcuda, libnvrtc, libcudnn and libnccl are linked at build time
# instead of loaded at run time (vae_tensor::cuda's module doc). No GPU needed.
#
#   1. vae-tensor's lib tests and its `cuda_ops` suite built with `--features
#      cudarc/dynamic-linking`, linked against `cargo xtask gpu-emu`'s fake driver and fake cuDNN
#      (NVRTC from `cargo xtask kernels`' toolchain), checked to need the fake libcuda.so, and run
#      on the fake device;
#   2. with --candle: `cargo check` of a crate holding candle-core 0.11.1 with `cuda` and
#      vae-parallel (its CUDA and NCCL crates), nvcc from NVIDIA's `nvidia-cuda-nvcc` 13.x wheel
#      (the 12.x wheel has no nvcc). candle-kernels compiles its GGUF and MoE kernels: about 10
#      minutes on two cores.
#
# Run from anywhere after `cargo xtask gpu-emu` (its fake libraries) and `cargo xtask kernels`
# (its NVRTC). CI runs it without --candle (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
candle=0
for arg in "$@"; do
    case "$arg" in
        --candle) candle=1 ;;
        *) echo "usage: $0 [--candle]" >&2; exit 2 ;;
    esac
done

fakes=$root/target/gpu-emu/fast/lib
nvrtc=$(ls -d "$root"/target/cuda-toolchain/lib/python3*/site-packages/nvidia/cuda_nvrtc/lib 2>/dev/null | head -1 || true)
if [ ! -e "$fakes/libcuda.so" ] || [ ! -e "$fakes/libcudnn.so" ]; then
    echo "no fake driver in $fakes: run cargo xtask gpu-emu first" >&2
    exit 2
fi
if [ -z "$nvrtc" ]; then
    echo "no NVRTC under target/cuda-toolchain: run cargo xtask kernels first" >&2
    exit 2
fi

# cudarc's build script looks for the libraries under $CUDA_HOME/lib.
work=$root/target/cuda-linked
mkdir -p "$work/lib"
for l in cuda cudnn nccl; do ln -sf "$fakes/lib$l.so" "$work/lib/lib$l.so"; done
ln -sf "$nvrtc/libnvrtc.so.12" "$work/lib/libnvrtc.so"
ln -sf "$nvrtc/libnvrtc.so.12" "$work/lib/libnvrtc.so.12"
export CUDA_HOME=$work

echo "== vae-tensor's lib tests and cuda_ops, linked"
bins=$(cargo test -q -p vae-tensor --features cudarc/dynamic-linking --lib --test cuda_ops --no-run \
    --message-format=json | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["executable"])')
status=0
for bin in $bins; do
    if ! readelf -d "$bin" | grep -q 'NEEDED.*\[libcuda\.so\]'; then
        echo "$bin does not link libcuda.so: the build did not link the CUDA libraries" >&2
        status=1
        continue
    fi
    FAKE_CUDA_COMPUTE_CAPABILITY=9.0 FAKE_CUDA_DEVICE_COUNT=1 LD_LIBRARY_PATH="$work/lib" "$bin" -q || status=1
done

if [ "$candle" -eq 1 ]; then
    echo "== candle-core 0.11.1 with cuda beside vae-parallel (cargo check)"
    cu=$(ls -d "$work"/nvcc/lib/python3*/site-packages/nvidia/cu13 2>/dev/null | head -1 || true)
    if [ -z "$cu" ] || [ ! -x "$cu/bin/nvcc" ]; then
        python3 -m venv "$work/nvcc"
        "$work/nvcc/bin/pip" install --quiet --disable-pip-version-check nvidia-cuda-nvcc==13.5.37 \
            nvidia-cuda-runtime==13.5.37 nvidia-cuda-crt==13.5.37 nvidia-cuda-cccl==13.3.5.0.6
        cu=$(ls -d "$work"/nvcc/lib/python3*/site-packages/nvidia/cu13 | head -1)
    fi
    mkdir -p "$work/candle/src"
    cat > "$work/candle/Cargo.toml" <<EOF
[package]
name = "candle-cuda-beside-vae-parallel"
version = "0.0.0"
edition = "2024"
publish = false

[dependencies]
candle-core = { version = "=0.11.1", default-features = false, features = ["cuda"] }
vae-parallel = { path = "$root/crates/vae-parallel", default-features = false, features = ["candle"] }

[workspace]
EOF
    echo 'fn main() {}' > "$work/candle/src/main.rs"
    cp -n "$root/Cargo.lock" "$work/candle/Cargo.lock" 2>/dev/null || true
    (cd "$work/candle" && CUDA_COMPUTE_CAP=90 NVCC="$cu/bin/nvcc" CUDA_HOME="$cu" CUDA_PATH="$cu" PATH="$cu/bin:$PATH" \
        cargo check -q) || status=1
fi

if [ "$status" -ne 0 ]; then
    echo "cuda-linked-check: FAILED" >&2
else
    echo "cuda-linked-check: passed"
fi
exit "$status"
