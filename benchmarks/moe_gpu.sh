#!/usr/bin/env bash
# The mixture-of-experts GPU checks, in one call on a lent NVIDIA GPU (no network there):
# the MoE kernels' tests compiled for the GPU, their tile sweep and benchmark rows against
# torch._grouped_mm / torch.compile, and the seed's model training a few steps with and without
# --kernels. Wheels travel in .whl (pytest, tabulate, xxhash, psutil); results go to $OUT.
#   bash benchmarks/moe_gpu.sh
set -u -o pipefail
OUT=${OUT:-/tmp/moe_gpu}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"
step() { echo "=== $1"; shift; timeout "$@"; echo "=== exit $?"; }
step "kernel tests" 240 python3 -m pytest -o addopts="" -q -rs tests/kernels/test_kernels_grouped_gemm.py \
    tests/kernels/test_kernels_moe_permute.py tests/kernels/test_kernels_router.py 2>&1 | tee "$OUT/tests.txt" | tail -25
step "grouped GEMM tile sweep" 150 python3 -m benchmarks.cases_moe --sweep 2>&1 | tee "$OUT/sweep.txt" | grep -E "BEST|Error|error" | head -40
for op in grouped_gemm moe_permute router; do
    step "bench.kernels --op $op" 150 python3 -m benchmarks.kernels --op $op --quick 2>&1 | tee "$OUT/bench_$op.txt" | tail -16
done
for kernels in "" "--kernels"; do
    step "deepseek_v2_debug on the GPU $kernels" 120 python3 -m trainer --config configs/deepseek_v2_debug.yaml \
        --run-dir /tmp/moe_run$kernels $kernels --set data.path=synthetic --set train.steps=12 \
        --set train.log_interval=4 --set train.val_batches=0 --set checkpoint.interval=0 \
        --set checkpoint.save_final=false --set logging.tensorboard=false 2>&1 | grep -E "step 12|error|Error|experts" | tail -4
done
