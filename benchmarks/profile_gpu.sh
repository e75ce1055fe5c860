#!/bin/bash
# On a GPU machine with torch but no Anvil environment (the lent H200): every GPU part of the profiling work in one
# call of about 8-9 minutes (benchmarks/profile_gpu.py says which; --parts runs some of them): profile.train of
# llama3_1b with --kernels and with --compile --kernels, the benchmark's split of the same variants beside them,
# ncu on the largest kernels of a profiled step, TunableOp's tuning time and step time with and without tuned GEMMs,
# and excerpts of the real traces as test data. Everything lands in $OUT (default ./out); $OUT/profile_gpu.json holds the figures.
# The pure-Python packages travel as wheels (carry .whl with the command); on the machine that sends them:
#   pip download --no-deps -d .whl/anvil "invoke>=2.2,<3" tabulate nvidia-ml-py
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
#       -d .whl/plot matplotlib contourpy cycler fonttools kiwisolver pillow pyparsing python-dateutil six
# (.whl/plot is optional: without matplotlib profile.train writes no breakdown.png and says so.)
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/anvil/*.whl || exit 1
ls .whl/plot/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/site .whl/plot/*.whl
export PYTHONPATH=/tmp/site:$PWD INVOKE_ANVIL_RUNS_DIR=/tmp/runs NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/versions.txt"
(command -v ncu && ncu --version) >> "$OUT/versions.txt" 2>&1
python3 -m benchmarks.profile_gpu --out "$OUT" "$@"
