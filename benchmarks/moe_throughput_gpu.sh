#!/bin/bash
# On a lent GPU machine with torch but no Anvil environment (the H100/H200 image: python3 with torch,
# triton, transformers, pyyaml, psutil; no network): benchmarks.moe_throughput, Anvil against
# torchtitan 0.2.2 on the 4-layer DeepSeek-V2-Lite and Qwen3-30B-A3B shapes, in one call of about
# 8 minutes (pip ~10 s, the variants within --budget, 420 s unless BUDGET says otherwise).
# Wheels (carry .whl, 4 MiB), made from the checkout's root on a machine that reaches PyPI:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       --platform any -d .whl torchtitan==0.2.2 torchao==0.17.0 tyro==1.0.17 torchdata==0.11.0 \
#       docstring-parser==0.18.0 typeguard==4.6.1 typing_extensions==4.16.0 tabulate==0.10.0 nvidia-ml-py==13.615.71
# (torchtitan, its config parser tyro and what tyro needs, torchdata's StatefulDataLoader; Anvil's table
# and GPU utilisation. HF datasets and TensorBoard stay behind, pyarrow alone being over 40 MiB:
# torchtitan imports them at module level and never uses them here, and the benchmark stubs them.)
# ARGS go to the benchmark (e.g. ARGS=--quick: the headline pair of each case, 6 steps). Output in
# $OUT (default ./out): moe_throughput.txt (this log and the table), moe/results.json, moe/<case>/bench.log.
LOG=moe_throughput.txt; . benchmarks/gpu_setup.sh   # wheels, PYTHONPATH, multicast off, GPU and versions
# The run dirs stay in /tmp: only 8 files come back from $OUT. results.json is rewritten after each
# variant, so what ran is there even if the call is cut short.
python3 -m benchmarks.moe_throughput --budget "${BUDGET:-420}" --out "$OUT/moe" --run-root /tmp/moe_runs $ARGS
rc=$?
echo "rc=$rc after $((SECONDS - start)) s"
exit $rc
