#!/bin/bash
# On a GPU machine with torch but no Anvil environment (the lent device): the launch path end to end on
# the tiny default config. --kernels and FP8 past the pre-launch GPU checks, SIGHUP to a run's process
# group (interrupted, 130, a checkpoint), kill -9 of inv alone (its ranks stop after a checkpoint; the
# next snapshot.list records the run lost), a sized --gpu in train.plan, one GEMM. Output in $OUT/smoke.txt
# (default ./out). Wheels as for screen_h200.sh, plus torchao for FP8 in .whl/titan.
OUT=${OUT:-out}; mkdir -p "$OUT"
exec > >(tee "$OUT/smoke.txt") 2>&1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/anvil/*.whl .whl/titan/torchao*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 INVOKE_ANVIL_RUNS_DIR=/tmp/runs
INV="python3 -m runtime.program.main"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
echo "== env.detect"; $INV env.detect | head -8
echo "== data.prepare"; $INV data.prepare 2>&1 | tail -2
echo "== kernels"; $INV train.pretrain --kernels --set train.steps=40 --name kern 2>&1 | tail -6; echo "rc=${PIPESTATUS[0]}"
echo "== fp8, checkpoints every 10 steps (written in the background), then resumed"
$INV train.pretrain --set precision.fp8=tensorwise --set train.steps=40 --set checkpoint.interval=10 --name fp8 2>&1 | tail -6
echo "rc=${PIPESTATUS[0]}"; r=$(ls -d /tmp/runs/*_train.pretrain_fp8 | tail -1); ls "$r/checkpoints"
grep -h "checkpoint" "$r/logs/rank0.log" | tail -4
$INV train.pretrain --set precision.fp8=tensorwise --set train.steps=50 --set checkpoint.interval=10 --name fp8 --resume auto 2>&1 | tail -3
echo "rc=${PIPESTATUS[0]}"
echo "== plan"; $INV train.plan --config configs/llama3_8b.yaml --gpu H100-40 2>&1 | tail -3
echo "== gemm"; $INV bench.gemm -M 8192 2>&1 | tail -3
run_of() { ls -d /tmp/runs/*_$1 2>/dev/null | tail -1; }
wait_step() {   # until the run has logged two steps
    for _ in $(seq 1 600); do
        r=$(run_of "$1"); [ -n "$r" ] && [ -f "$r/metrics.jsonl" ] && [ "$(wc -l < "$r/metrics.jsonl")" -ge 2 ] && return 0
        sleep 0.2
    done; return 1
}
echo "== SIGHUP"
setsid $INV train.pretrain --set train.steps=100000 --set train.log_interval=1 --name hup > /tmp/hup.log 2>&1 &
pid=$!; wait_step train.pretrain_hup; sleep 1; kill -HUP -- -$pid; wait $pid; echo "inv exit $?"
r=$(run_of train.pretrain_hup)
python3 -c "import json; m = json.load(open('$r/metadata.json')); print(m['status'], m['exit_code'])"; ls "$r/checkpoints"
echo "== kill -9"
setsid $INV train.pretrain --set train.steps=100000 --set train.log_interval=1 --name k9 > /tmp/k9.log 2>&1 &
pid=$!; wait_step train.pretrain_k9; sleep 1; kill -9 $pid; sleep 20
echo "processes of the group left: $(pgrep -g $pid | wc -l)"
echo "processes on the GPU: $(nvidia-smi --query-compute-apps=pid --format=csv,noheader | wc -l)"
r=$(run_of train.pretrain_k9); ls "$r/checkpoints"; $INV snapshot.list 2>&1 | tail -4
