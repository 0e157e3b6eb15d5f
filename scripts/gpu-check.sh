#!/usr/bin/env bash
# GPU checks, run on a machine with a GPU and no Rust toolchain, from the repository root, with
# the bundle that scripts/build-gpu-bundle.sh made on the build machine (carried as gpu-bundle/).
#
#   1. what the driver reports, and which kernels this build embeds (vae-parallel devices);
#   2. every CUDA kernel, every CUDA tensor op, then the video VAEs (plain and 2-rank shard)
#      on CUDA, against the CPU backend and the diffusers fixtures (three test binaries); the
#      model tests once more with the warpgroup-MMA convolutions (VAE_CUDA_WGMMA=1, Hopper);
#   3. the NCCL backend's collectives (world size 1; every GPU when there are several), and the
#      CLI decoding over --transport nccl;
#   4. per-op rates against the device peak (bench kernels, f32, tf32 and bf16);
#   5. the Wan2.1 480x832x17 decode benchmark, diffusers vs ours in f32, tf32 and bf16, same GPU
#      (diffusers' default f32 takes TF32 convolutions: compare it with ours in tf32), and bf16
#      with each conv kernel family forced (mma.sync 128 / 256 pixels, wgmma);
#   6. the same decode on two local ranks of the one GPU (a stream each): direct, shard, tile;
#   7. where ncu exists, GPU time per kernel of a small bf16 decode (scripts/gpu-profile.sh, at
#      most 3 minutes, informational: it does not fail the check). PROFILE=0 skips it.
#
# Each step prints its own result; the script exits non-zero if any step failed. It finishes in
# under 8 minutes (148 s on an H200 before steps 6, 7 and the tf32 runs were added; step 7 is
# capped at 3 minutes).
#
# Where the GPU machine has torch but no diffusers, carry the wheels in .whl/ (ignored by git):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux2014_x86_64 -d .whl diffusers==0.38.0 importlib_metadata
set -u -o pipefail
source scripts/unpack-bundle.sh
# The test binaries were built elsewhere: point them at this checkout's fixtures.
export VAE_FIXTURES_DIR="$PWD/fixtures"
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
status=0
step() { echo; echo "=== $*"; }

step "driver and GPU"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$OUT/nvidia-smi.txt" || true

# cudarc looks for libnccl.so, the wheels ship libnccl.so.2 (nvidia-nccl-cu12 under nvidia/nccl/lib,
# the cu13 wheels elsewhere under nvidia/): find it under the nvidia namespace package.
shim=$(mktemp -d)
nvidia_dir=$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])' 2>/dev/null || true)
nccl_lib=""
if [ -n "$nvidia_dir" ]; then
    nccl_lib=$(find "$nvidia_dir" -name 'libnccl.so.2' 2>/dev/null | head -1)
fi
if [ -n "$nccl_lib" ]; then
    ln -sf "$nccl_lib" "$shim/libnccl.so"
    echo "NCCL: $nccl_lib"
else
    echo "NCCL: no libnccl.so.2 under the python nvidia packages"
fi
export LD_LIBRARY_PATH="$shim:${LD_LIBRARY_PATH:-}"

# diffusers is carried as wheels when the machine lacks it (see the header).
if [ -d .whl ] && ! python3 -c "import diffusers" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

# cuDNN (for the cuDNN convolutions' tests and timings): VAE_CUDNN_PATH if set, else the
# nvidia-cudnn-cu12 wheel torch installs, else the loader's path.
if [ -z "${VAE_CUDNN_PATH:-}" ]; then
    VAE_CUDNN_PATH=$(python3 -c 'import nvidia.cudnn, os; print(os.path.join(list(nvidia.cudnn.__path__)[0], "lib"))' \
        2>/dev/null || true)
    export VAE_CUDNN_PATH
fi

step "vae-parallel devices"
"$BUNDLE/vae-parallel" devices 2>&1 | tee "$OUT/devices.txt" || status=1

for suite in cuda_kernels cuda_ops conformance conformance_video cuda_models nccl; do
    step "$suite (CUDA vs the CPU backend)"
    # The conformance suites run their CPU instantiation too: only the cuda:: tests matter here.
    filter=""
    case $suite in conformance*) filter="cuda::" ;; esac
    timeout 90 "$BUNDLE/$suite" $filter --test-threads=1 --nocapture 2>&1 | tee "$OUT/$suite.txt" || status=1
    # On a GPU machine nothing may skip (the one test that needs no GPU says so and passes),
    # except what needs more GPUs than the machine has (NCCL: one GPU per rank).
    if grep "skipped" "$OUT/$suite.txt" | grep -v "needs one GPU per rank" | grep -vq "this machine has a usable GPU"; then
        echo "$suite: a GPU test was skipped on a GPU machine: treated as a failure"
        status=1
    fi
done

# The decoders once more with every bf16 convolution of 96 channels and more on Hopper's
# warpgroup MMA (not yet the default; elsewhere the variable changes nothing).
step "cuda_models with VAE_CUDA_WGMMA=1 (warpgroup-MMA convolutions)"
VAE_CUDA_WGMMA=1 timeout 90 "$BUNDLE/cuda_models" --test-threads=1 --nocapture 2>&1 | tee "$OUT/cuda_models_wgmma.txt" \
    || status=1

# The decoders once more with every convolution on cuDNN (never run on a GPU before): the
# fixtures' tolerances, and the tile-parallel runs bit-identical to one rank. Only where cuDNN
# loads (convolutions_run_on_cudnn_where_the_process_asks_for_it fails otherwise).
if python3 -c 'import ctypes, os; p = os.environ.get("VAE_CUDNN_PATH", ""); ctypes.CDLL(os.path.join(p, "libcudnn.so.9") if os.path.isdir(p) else (p or "libcudnn.so.9"))' 2>/dev/null; then
    step "cuda_models with VAE_CUDA_CONV=cudnn (cuDNN convolutions)"
    VAE_CUDA_CONV=cudnn timeout 120 "$BUNDLE/cuda_models" --test-threads=1 --nocapture 2>&1 \
        | tee "$OUT/cuda_models_cudnn.txt" || status=1
else
    echo "cuda_models with cuDNN: not run, no libcudnn.so.9 here (set VAE_CUDNN_PATH)"
fi

# The CLI over NCCL: a one-rank NCCL group (bootstrap over sockets, then NCCL collectives) on
# cuda:0 decodes a fixture latent to what the CPU decodes.
step "CLI decode over --transport nccl vs the CPU"
fx="$VAE_FIXTURES_DIR/wan"
timeout 60 "$BUNDLE/vae-parallel" decode --model "$fx/wan21_like" --latent "$fx/wan21_like.decode_t3.in.npy" \
    --out "$OUT/nccl.npy" --transport nccl --device cuda --vae-patch-parallel-size 1 2>&1 | tee "$OUT/nccl_cli.txt" || status=1
timeout 60 "$BUNDLE/vae-parallel" decode --model "$fx/wan21_like" --latent "$fx/wan21_like.decode_t3.in.npy" \
    --out "$OUT/cpu.npy" 2>&1 | tail -1 || status=1
python3 -c "import numpy as n, sys; d=abs(n.load(sys.argv[1])-n.load(sys.argv[2])).max(); print('max |nccl-cpu| =', d); sys.exit(int(d > 1e-3))" \
    "$OUT/nccl.npy" "$OUT/cpu.npy" || status=1

# Each op alone at the decoders' real shapes: achieved FLOP/s or GB/s next to the device peak.
for dtype in f32 tf32 bf16; do
    step "bench kernels ($dtype)"
    timeout 60 "$BUNDLE/vae-parallel" bench kernels --device cuda --dtype $dtype --iters 3 2>&1 \
        | tee "$OUT/kernels_$dtype.txt" || status=1
done

# The benchmark: Wan2.1 real geometry, latent [1, 16, 5, 60, 104] (17 frames of 480x832),
# diffusers in f32 (PyTorch's default TF32 convs, and strict IEEE f32) and bf16, then ours in
# f32 (f32 accuracy), tf32 (one TF32 product per conv product, as PyTorch's default) and bf16,
# on the same GPU. Needs torch and
# diffusers on this machine; skipped (not failed) without them.
step "benchmark: Wan2.1 480x832x17 decode, diffusers vs vae-parallel"
if python3 -c "import torch, diffusers" 2>/dev/null; then
    timeout 180 python3 scripts/bench_gpu_diffusers.py --out "$OUT/wan21" --shape 1,16,5,60,104 \
        --dtypes float32,float32_strict,bfloat16 --iters 2 2>&1 | tee "$OUT/bench_diffusers.jsonl" || status=1
    for dtype in f32 tf32 bf16; do
        timeout 90 "$BUNDLE/vae-parallel" bench decode --device cuda --dtype $dtype --model "$OUT/wan21" \
            --latent "$OUT/wan21/z.npy" --iters 2 --json 2>&1 | tee "$OUT/bench_ours_$dtype.json" || status=1
    done
    # The bf16 decode again with each conv kernel family forced: mma.sync tiles of 128 or 256
    # pixels (same bits, another speed: what the backend's choice per launch gains over either
    # alone), and Hopper's warpgroup MMA (not yet the default).
    for tiles in 128 256 wgmma; do
        timeout 90 "$BUNDLE/vae-parallel" bench decode --device cuda --dtype bf16 --conv-tiles $tiles \
            --model "$OUT/wan21" --latent "$OUT/wan21/z.npy" --iters 2 --json 2>&1 \
            | tee -a "$OUT/bench_ours_bf16.json" || status=1
    done
    # cuDNN's convolutions forced, and the per-layer choice between them and ours, in bf16 and
    # TF32 (never run on a GPU before: the JSON's cudnn_convolutions says whether cuDNN ran,
    # conv_choices what `fastest` chose); without cuDNN ours run, with a warning.
    for dtype in bf16 tf32; do
        for tiles in cudnn fastest; do
            timeout 120 "$BUNDLE/vae-parallel" bench decode --device cuda --dtype $dtype --conv-tiles $tiles \
                --model "$OUT/wan21" --latent "$OUT/wan21/z.npy" --iters 2 --json 2>&1 \
                | tee -a "$OUT/bench_ours_cudnn.json" || status=1
        done
    done
    # Two ranks of one process on the one GPU, each queueing on a stream of its own: the direct
    # decode, the 2-rank shard (halos device to device) and 2-rank tiles, each after a warm-up.
    step "two local ranks on one GPU (bf16): direct, shard, tile"
    timeout 120 "$BUNDLE/vae-parallel" bench shard --device cuda --dtype bf16 --model "$OUT/wan21" \
        --latent "$OUT/wan21/z.npy" --ranks 2 2>&1 | tee "$OUT/bench_two_ranks.txt" || status=1
else
    echo "benchmark skipped: no torch/diffusers in this machine's python3"
fi

if [ "${PROFILE:-1}" != 0 ] && command -v ncu >/dev/null 2>&1; then
    step "GPU time per kernel (ncu, bf16, small latent; informational)"
    OUT="$OUT/profile" timeout 180 bash scripts/gpu-profile.sh bf16 2>&1 | tee "$OUT/profile.txt" \
        || echo "profile did not finish (not counted as a failure)"
fi

step "result"
if [ $status -eq 0 ]; then echo "GPU checks passed"; else echo "GPU checks FAILED"; fi
exit $status
