#!/usr/bin/env bash
# Where a CUDA decode's time goes, kernel by kernel, on a GPU machine with ncu (Nsight Compute):
# the total GPU time, launch count and slowest launch (with its grid) of every kernel of one
# `vae-parallel decode`, next to the decode's wall time from `bench decode`. Run from the
# repository root with the bundle of scripts/build-gpu-bundle.sh in gpu-bundle/; needs torch and
# diffusers (carried as wheels in .whl/ where missing) to write the Wan2.1-geometry model.
#
#   scripts/gpu-profile.sh [bf16|f32] [latent B,C,T,H,W]      (default: bf16 1,16,2,30,52)
#
# ncu times each kernel alone (one metric, one pass), so a small latent keeps it to seconds.
# This found copy_box's single-block launches (2.1 s of a 2.2 s decode) on 2026-11-30.
set -u
source scripts/unpack-bundle.sh
OUT=${OUT:-/tmp/gpu-profile}
DTYPE=${1:-bf16}
SHAPE=${2:-1,16,2,30,52}
mkdir -p "$OUT"
if [ -d .whl ] && ! python3 -c "import diffusers" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
model="$OUT/wan21"
timeout 120 python3 scripts/bench_gpu_diffusers.py --out "$model" --shape "$SHAPE" --prepare-only | tail -1 || exit 1
echo "== wall time"
timeout 120 "$BUNDLE/vae-parallel" bench decode --device cuda --dtype "$DTYPE" --model "$model" \
    --latent "$model/z.npy" --iters 1 --json || exit 1
echo "== GPU time per kernel"
timeout 300 ncu --clock-control none --metrics gpu__time_duration.sum --csv "$BUNDLE/vae-parallel" decode \
    --model "$model" --latent "$model/z.npy" --out "$OUT/decoded.npy" --device cuda --dtype "$DTYPE" \
    > "$OUT/ncu.csv" 2> "$OUT/ncu.err" || { tail -5 "$OUT/ncu.err"; exit 1; }
python3 - "$OUT/ncu.csv" <<'PY'
import collections, csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head, rows = rows[0], rows[1:]
name, grid, block = head.index("Kernel Name"), head.index("Grid Size"), head.index("Block Size")
value, unit = head.index("Metric Value"), head.index("Metric Unit")
scale = {"n": 1e-3, "u": 1.0, "m": 1e3, "s": 1e6}  # to microseconds
total, count, worst = collections.defaultdict(float), collections.Counter(), {}
for r in rows:
    us = float(r[value].replace(",", "")) * scale.get(r[unit].strip().lower()[:1], 1.0)
    k = r[name].split("(")[0]
    total[k] += us
    count[k] += 1
    if us > worst.get(k, (0.0,))[0]:
        worst[k] = (us, r[grid], r[block])
print(f"{sum(total.values()) / 1e3:.1f} ms of GPU time in {sum(count.values())} launches")
for k, us in sorted(total.items(), key=lambda kv: -kv[1]):
    w = worst[k]
    print(f"{k:40s} {count[k]:6d} launches {us / 1e3:10.2f} ms   slowest {w[0]:9.0f} us grid {w[1]} block {w[2]}")
PY
