#!/usr/bin/env bash
# The cost model on a GPU, run on a GPU machine from the repository root with the bundle that
# scripts/build-gpu-bundle.sh made (carried as gpu-bundle/) and, where the machine's python3
# lacks diffusers, its wheels in .whl/ (see gpu-check.sh's header):
#
#   1. `vae-parallel calibrate --device cuda --dtype bf16`: the GPU's profile ($OUT/cuda-bf16.toml);
#   2. the Wan2.1 and FLUX.1 decoder geometries (seeded weights, diffusers' classes);
#   3. `plan --measure` on the GPU with that profile: every strategy predicted and run on 1, 2
#      and 4 ranks sharing the GPU (Wan2.1 480x832x17 and 720x1280x81, FLUX.1 1024^2 and
#      2048^2), predicted against measured latency and device peak ($OUT/plan.txt).
#
# Prints each step's output; exits non-zero if a step failed. About 3 minutes on an H200 (estimated
# before its first run: a 720x1280x81 bf16 decode at the 480x832x17 rate is about 5 s); each step
# has its own timeout.
set -u -o pipefail
source scripts/unpack-bundle.sh
OUT=${OUT:-/tmp/gpu-cost}
mkdir -p "$OUT"
status=0
step() { echo; echo "=== $*"; }
vp="$BUNDLE/vae-parallel"

if [ -d .whl ] && ! python3 -c "import diffusers" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

step "calibrate --device cuda --dtype bf16"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$OUT/nvidia-smi.txt"
timeout 180 "$vp" calibrate --device cuda --dtype bf16 --out "$OUT/cuda-bf16.toml" 2>&1 | tee "$OUT/calibrate.txt" \
    || status=1

step "models (seeded weights)"
models=/tmp/gpu-cost-models
timeout 120 python3 scripts/bench_gpu_diffusers.py --out $models/wan21 --shape 1,16,5,60,104 --prepare-only || status=1
timeout 120 python3 scripts/bench_diffusers.py --family flux1 --out $models/flux1 --sizes 1024 --prepare-only \
    > /dev/null || status=1

# plan --measure: each strategy's prediction and its run on local ranks sharing the GPU.
plan() {
    local model=$1 shape=$2 ranks=$3 runs=$4
    shift 4
    echo "--- $model $shape, $ranks rank(s) $*" | tee -a "$OUT/plan.txt"
    timeout 150 "$vp" plan --model "$models/$model" --shape "$shape" --vae-patch-parallel-size "$ranks" \
        --device cuda --dtype bf16 --profile "$OUT/cuda-bf16.toml" --measure --runs "$runs" "$@" 2>&1 \
        | tee -a "$OUT/plan.txt" || status=1
}
step "plan --measure on the GPU (bf16)"
if [ -f "$OUT/cuda-bf16.toml" ]; then
    for ranks in 1 2 4; do plan wan21 1,16,5,60,104 $ranks 3; done
    for ranks in 1 2; do plan wan21 1,16,21,90,160 $ranks 2; done
    for ranks in 1 2; do plan flux1 1,16,128,128 $ranks 3 --tile-sample-min-size 512; done
    plan flux1 1,16,256,256 2 2 --tile-sample-min-size 512
else
    echo "no profile: calibrate failed"
    status=1
fi

step "result"
if [ $status -eq 0 ]; then echo "GPU cost checks passed"; else echo "GPU cost checks FAILED"; fi
exit $status
