#!/bin/bash
# On a lent GPU machine (torch, triton, pyyaml; no network), .whl carried (torchao, tabulate, nvidia-ml-py):
# document masking against plain causal attention on llama3_1b at 8192 tokens a row (one GPU): the trainer
# --kernels eager and compiled, causal over the row / inside documents through FlexAttention (_docs) /
# through SDPA with a mask (_docsdpa); tokens/s and peak memory of each (benchmarks.train_throughput).
# Synthetic rows hold documents of 2048 tokens on average (seq / 4). About 5 minutes on one H100.
LOG=long_context_gpu.txt; . benchmarks/gpu_setup.sh   # wheels, PYTHONPATH, multicast off, GPU and versions
python3 -m benchmarks.train_throughput --config configs/llama3_1b.yaml --batch 1 --seq 8192 --steps ${STEPS:-12} \
    --variants ${VARIANTS:-kernels,kernels_docs,kernels_docsdpa,compile_kernels,compile_kernels_docs} \
    --out /tmp/long_out --run-root /tmp/long_runs --timeout 150 | tail -12
cp /tmp/long_out/results.json "$OUT/long_context.json"
echo "done after $((SECONDS - start)) s"
