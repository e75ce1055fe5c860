#!/bin/bash
# On a GPU machine with torch but no Anvil environment (the lent device): the node screen
# (preflight.screen, preflight.perf against the GPU profile's floors, preflight.all) and the memory
# plan checked against a real run; results under $OUT (default ./out). The few pure-Python packages
# it needs travel as wheels:  pip download --no-deps -d .whl/anvil "invoke>=2.2,<3" tabulate nvidia-ml-py
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/anvil/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD INVOKE_ANVIL_RUNS_DIR=/tmp/runs
python3 -c "import torch, yaml, psutil; print('torch', torch.__version__, torch.cuda.get_device_name())" 2>&1 | tee $OUT/versions.txt
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> $OUT/versions.txt
inv() { python3 -m runtime.program.main "$@"; }
s=$(date +%s%N); inv preflight.screen > $OUT/screen.txt 2>&1; echo "screen exit $? $(( ($(date +%s%N) - s) / 1000000 )) ms" >> $OUT/times.txt
s=$(date +%s%N); inv preflight.perf --save-baseline $OUT/h200-baseline.json > $OUT/perf.txt 2>&1; echo "perf exit $? $(( ($(date +%s%N) - s) / 1000000 )) ms" >> $OUT/times.txt
s=$(date +%s%N); inv preflight.all > $OUT/all.txt 2>&1; echo "all exit $? $(( ($(date +%s%N) - s) / 1000000 )) ms" >> $OUT/times.txt
timeout 200 python3 -m benchmarks.plan_check --config configs/llama3_1b.yaml --batch 4 --seq 4096 --ac none --kernels --set precision.params=bf16 > $OUT/plan_check.json 2> $OUT/plan_check.err
echo "plan_check exit $?" >> $OUT/times.txt
cat $OUT/times.txt
