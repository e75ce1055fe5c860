#!/usr/bin/env bash
# The mixture-of-experts fixes checked in one short call on a lent NVIDIA GPU (about 2.5 minutes on an
# H100; its limits add up to under 4): the three MoE kernel test files, compiled for the GPU, as four
# pytest processes side by side (each compiles its own kernels; the tile sweep, marker tile_sweep, left
# out), then the benchmark
# rows that changed: each grouped-GEMM weight gradient (torch._grouped_mm, anvil = what grouped_mm runs
# now, c0..c5 = our tiles alone), moe_permute kernel by kernel, and moe_permute against eager.
# Wheels travel in .whl (pytest, tabulate, ...), as for benchmarks/moe_gpu.sh; results go to $OUT.
#   bash benchmarks/moe_check_gpu.sh
set -u -o pipefail
OUT=${OUT:-/tmp/moe_check}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
start=$SECONDS
tests() {   # name, then pytest's arguments
    local name=$1; shift
    timeout 95 python3 -m pytest -o addopts="" -p no:cacheprovider -q -rfEs --durations=5 -m "not tile_sweep" \
        "$@" >"$OUT/tests_$name.txt" 2>&1
    echo "=== tests $name: exit $?, $((SECONDS - start)) s"
}
GEMM=tests/kernels/test_kernels_grouped_gemm.py
tests gemm_a "$GEMM" -k "matches_reference or float32_follows or agrees" &
tests gemm_b "$GEMM" -k "not (matches_reference or float32_follows or agrees)" &
tests permute tests/kernels/test_kernels_moe_permute.py &
tests router tests/kernels/test_kernels_router.py &
wait
for f in "$OUT"/tests_*.txt; do echo "--- $f"; grep -E "^(FAILED|ERROR)|passed|failed|[0-9.]+s (call|setup)" "$f"; done
step() { local limit=$1; shift; echo "=== $*"; timeout "$limit" "$@" 2>&1 | tee -a "$OUT/bench.txt" | grep -vE "^\|[- |]+\|$"; }
step 75 python3 -m benchmarks.cases_moe --sweep --product weight_grad
step 25 python3 -m benchmarks.cases_moe --permute-profile
step 35 python3 -m benchmarks.kernels --op moe_permute --quick --providers anvil,eager
echo "=== all done in $((SECONDS - start)) s"
