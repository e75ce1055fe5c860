#!/bin/bash
# On a GPU machine with torch but no Anvil environment (the lent H100/H200): the float8 inputs written by
# RMSNorm and SwiGLU (kernels/float8.py). PARTS (default "kernels train tests") picks, in this order:
#   kernels  benchmarks.float8_inputs: bit equality with torchao's cast on the hardware, and the ops' times;
#   train    llama3_1b throughput: torchtitan FP8, Anvil FP8 with torchao's casts (_fp8ref) and with the
#            fused inputs (_fp8), one process each, same call (VARIANTS overrides);
#   tests    the float8 kernel tests compiled for the GPU;
#   quality  300 steps on real tokens (the standard library, BPE 8192): bf16, FP8 fused, FP8 torchao casts.
# Output in $OUT (default ./out). Wheels (carry .whl): .whl/anvil (invoke, tabulate) and .whl/titan, with
#   pip download --no-deps -d .whl/titan torchao==0.17.0 torchtitan==0.2.2 tyro torchdata docstring-parser typeguard shtab
OUT=${OUT:-out}; mkdir -p "$OUT"; PARTS=${PARTS:-kernels train tests}
exec > >(tee "$OUT/fp8_fused.txt") 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/anvil/*.whl .whl/titan/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 INVOKE_ANVIL_RUNS_DIR=/tmp/runs
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
python3 -c "import torch, triton, torchao, torchtitan; print('torch', torch.__version__, 'triton', triton.__version__, 'torchao', torchao.__version__, 'torchtitan', torchtitan.__version__)"
if [[ " $PARTS " == *" kernels "* ]]; then
    echo "== benchmarks.float8_inputs"
    python3 -m benchmarks.float8_inputs --out "$OUT/float8_inputs.json"; echo "rc=$?"
fi
if [[ " $PARTS " == *" train "* ]]; then
    echo "== train_throughput llama3_1b"
    python3 -m benchmarks.train_throughput --config configs/llama3_1b.yaml --batch 4 --seq 4096 --steps 12 \
        --profile-steps 2 --out "$OUT/tt" --variants ${VARIANTS:-titan_compile_fp8,compile_kernels_fp8ref,compile_kernels_fp8}
    echo "rc=$?"
fi
if [[ " $PARTS " == *" tests "* ]]; then
    echo "== kernel tests on the GPU"
    timeout ${TEST_TIMEOUT:-120} python3 -m pytest -q -p no:cacheprovider tests/kernels/test_kernels_float8.py 2>&1 | tail -5
fi
if [[ " $PARTS " == *" quality "* ]]; then
    echo "== quality: 300 steps on real tokens"
    python3 -m runtime.program.main data.prepare --tokenizer bpe --vocab-size 8192 --out /tmp/stdlib_bpe8k 2>&1 | tail -2
    python3 -m benchmarks.train_throughput --quality --config configs/llama3_1b.yaml --data /tmp/stdlib_bpe8k \
        --batch 8 --seq 1024 --steps 300 --out "$OUT/quality" \
        --variants compile_kernels_fp32,compile_kernels_fp32_fp8,compile_kernels_fp32_fp8ref
    echo "rc=$?"
fi
