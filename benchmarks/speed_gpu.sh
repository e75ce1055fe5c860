#!/bin/bash
# On a lent GPU machine (torch, triton, pyyaml; no network), .whl carried (torchao, tabulate, nvidia-ml-py):
# the speed prediction's check. For llama3_1b (batch 4 x 4096) and llama3_8b's shape cut to 8 layers
# (batch 1 x 8192): the rates at each one's shapes (benchmarks.rates), then the trainer's measured tokens/s
# (benchmarks.train_throughput, --kernels, fp32 master weights) in bf16 and FP8 under two checkpointing
# modes. Predicted against measured: python -m benchmarks.speed_check OUT (on any machine, after).
# About 7 minutes on one H100. Output in $OUT: rates_*.json, <case>_<mode>.json, logs.tgz, speed_gpu.txt.
LOG=speed_gpu.txt; . benchmarks/gpu_setup.sh   # wheels, PYTHONPATH, multicast off, GPU and versions
L8="--set model.n_layers=8"
QUICK=${QUICK-}   # QUICK=--quick: fewer repetitions, no FlexAttention
python3 -m benchmarks.rates --config configs/llama3_1b.yaml --set precision.fp8=tensorwise $QUICK \
    --out "$OUT/rates_llama3_1b.json" > /dev/null || exit 1
echo "rates llama3_1b after $((SECONDS - start)) s"
python3 -m benchmarks.rates --config configs/llama3_8b.yaml $L8 --set data.batch_size=1 \
    --set precision.fp8=tensorwise $QUICK --out "$OUT/rates_llama3_8b_l8.json" > /dev/null || exit 1
echo "rates llama3_8b_l8 after $((SECONDS - start)) s"
for mode in none selective; do
    PROFILE=""; [ "$mode" = none ] && [ -z "$QUICK" ] && PROFILE="--profile-steps 2"   # the step by category
    python3 -m benchmarks.train_throughput --config configs/llama3_1b.yaml --batch 4 --seq 4096 --steps ${STEPS:-12} $PROFILE \
        --variants kernels_fp32,kernels_fp32_fp8 --sets "train.activation_checkpoint=$mode" \
        --out "/tmp/speed_out/llama3_1b_$mode" --run-root /tmp/speed_runs --timeout 150 | tail -8
    cp /tmp/speed_out/llama3_1b_$mode/results.json "$OUT/llama3_1b_$mode.json"   # kept if the call is cut short
    echo "llama3_1b $mode after $((SECONDS - start)) s"
    python3 -m benchmarks.train_throughput --config configs/llama3_8b.yaml --batch 1 --seq 8192 --steps ${STEPS:-12} \
        --variants kernels_fp32,kernels_fp32_fp8 --sets "train.activation_checkpoint=$mode" --sets model.n_layers=8 \
        --out "/tmp/speed_out/llama3_8b_l8_$mode" --run-root /tmp/speed_runs --timeout 150 | tail -8
    cp /tmp/speed_out/llama3_8b_l8_$mode/results.json "$OUT/llama3_8b_l8_$mode.json"
    echo "llama3_8b_l8 $mode after $((SECONDS - start)) s"
done
# at most 8 files come back: one results file per case and mode (above), the logs in one archive
tar -czf "$OUT/logs.tgz" -C /tmp/speed_out . 2>/dev/null
echo "done after $((SECONDS - start)) s"
