#!/bin/bash
# On a machine with two GPUs of one host and torch, but no Anvil environment (the lent H200 pairs): the
# two-GPU figures of BENCHMARKS.md, each against its anchor in the same call. PARTS picks, in this order:
#   allreduce  nccl-tests' all_reduce_perf (-g 2, bf16, 1 MiB to 1 GiB; eager and -G) against
#              `inv bench.allreduce` over the same sizes (with --eager: one Python call per collective;
#              then its default on GPUs, CUDA-graph replays of each loop), nccl-tests run again last to
#              see the machine's drift;
#   train8b    llama3_8b FSDP2, batch 1 x 8192 per GPU, fp32 master weights: benchmarks.train_throughput
#              over VARIANTS (default: torchtitan and Anvil, FP8 tensorwise);
#   ckpt8b     llama3_8b checkpoints as a user's run makes them: `inv train.pretrain --compile --kernels`,
#              bf16 on fp32 weights, one asynchronous save of the 96 GB state at step CKPT_AT (default 80)
#              of 2 x CKPT_AT (the disk holds one), every step logged, once per checkpoint.write_threads
#              in CKPT_THREADS (default 4, as the setting); then benchmarks.checkpoint_run: the pause, the background
#              write, what the steps beside it lost, and after the last run a dd of the same bytes.
# Output in $OUT (default ./out): two_gpu.txt, nccl_tests_*.txt (nccl_tests_graph_*: -G), allreduce_*.json,
# train8b.json, ckpt8b_w*.json.
# Carried: .whl/anvil (invoke, tabulate, nvidia-ml-py), .whl/titan (as in fp8_fused_gpu.sh) and
# .nccl-tests (NVIDIA/nccl-tests' source; build/all_reduce_perf if built beforehand, else built here with
# the machine's nvcc against the NCCL that torch ships).
OUT=${OUT:-out}; mkdir -p "$OUT"; PARTS=${PARTS:-allreduce train8b}; CKPT_AT=${CKPT_AT:-80}
exec > >(tee -a "$OUT/two_gpu.txt") 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/anvil/*.whl .whl/titan/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 INVOKE_ANVIL_RUNS_DIR=/tmp/runs
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1   # the lender's rule
INV="python3 -m runtime.program.main"
date -u; nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader; nvidia-smi topo -m | head -4
python3 -c "import torch, triton, torchao, torchtitan; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', '.'.join(map(str, torch.cuda.nccl.version())), 'triton', triton.__version__, 'torchao', torchao.__version__, 'torchtitan', torchtitan.__version__)"

nccl_tests() {   # the anchor: nccl-tests against the NCCL library torch loads
    local nccl cudart
    nccl=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))")
    cudart=$(dirname "$(python3 -c "import ctypes.util, glob, torch, os; print((glob.glob(os.path.join(os.path.dirname(torch.__file__), '..', 'nvidia', '*', 'lib', 'libcudart.so.1*')) or [''])[0])")")
    export LD_LIBRARY_PATH=$nccl:$cudart:/usr/local/cuda/lib64:$LD_LIBRARY_PATH
    if ! .nccl-tests/build/all_reduce_perf -b 1M -e 1M -g 2 -n 1 -w 1 >/dev/null 2>&1; then
        echo "(building all_reduce_perf here)"; ln -sf libnccl.so.2 "$nccl/libnccl.so"
        make -s -j16 -C .nccl-tests/src "$PWD/.nccl-tests/build/all_reduce_perf" BUILDDIR="$PWD/.nccl-tests/build" \
            NCCL_HOME="$(dirname "$nccl")" NVCC_GENCODE="-gencode=arch=compute_90,code=sm_90" >/dev/null || return 1
    fi
    # bf16, the element type bench.allreduce reduces on GPUs; then nccl-tests' own CUDA-graph mode (-G), the
    # mechanism of bench.allreduce's default (graph-captured NCCL ran 9-13% slower at 2-4 MiB)
    local perf=".nccl-tests/build/all_reduce_perf -b 1M -e 1G -f 2 -g 2 -n 20 -w 5 -d bfloat16"
    $perf | tee "$OUT/nccl_tests_$1.txt"
    $perf -G 1 | tee "$OUT/nccl_tests_graph_$1.txt"
}
SIZES=1M,2M,4M,8M,16M,32M,64M,128M,256M,512M,1G
if [[ " $PARTS " == *" allreduce "* ]]; then
    echo "== nccl-tests, first"; nccl_tests first
    echo "== inv bench.allreduce --eager (eager launches)"
    timeout 120 $INV bench.allreduce --sizes $SIZES --eager --json > "$OUT/allreduce_eager.json"; echo "rc=$?"
    echo "== inv bench.allreduce (the same loops captured as CUDA graphs)"
    timeout 120 $INV bench.allreduce --sizes $SIZES --json > "$OUT/allreduce_graph.json"; echo "rc=$?"
    echo "== nccl-tests, last"; nccl_tests last
fi
if [[ " $PARTS " == *" train8b "* ]]; then
    echo "== train_throughput llama3_8b, two GPUs"
    timeout ${TRAIN_TIMEOUT:-560} python3 -m benchmarks.train_throughput --config configs/llama3_8b.yaml --nproc 2 \
        --batch 1 --seq 8192 --steps 12 --profile-steps ${PROFILE_STEPS:-0} --timeout 300 --out /tmp/tt8b \
        --variants ${VARIANTS:-titan_compile_fp32_fp8,compile_kernels_fp32_fp8}
    echo "rc=$?"; cp /tmp/tt8b/results.json "$OUT/train8b.json" 2>/dev/null
fi
if [[ " $PARTS " == *" ckpt8b "* ]]; then
    echo "== llama3_8b checkpoints through inv train.pretrain, two GPUs"; df -h /tmp | tail -1
    threads=(${CKPT_THREADS:-4}); last=${threads[-1]}
    for n in "${threads[@]}"; do
        echo "-- checkpoint.write_threads=$n"
        timeout ${CKPT_TIMEOUT:-300} $INV train.pretrain --config configs/llama3_8b.yaml --compile --kernels \
            --name "ckpt8b_w$n" --set data.path=synthetic --set train.steps=$((2 * CKPT_AT)) \
            --set checkpoint.interval=$CKPT_AT --set checkpoint.save_final=false --set checkpoint.write_threads=$n \
            --set train.log_interval=1 --set train.val_interval=0 --set train.val_batches=0 \
            --set schedule.warmup_steps=20 | tail -4
        echo "rc=${PIPESTATUS[0]}"; run=$(ls -d "$INVOKE_ANVIL_RUNS_DIR"/*_train.pretrain_ckpt8b_w$n | tail -1)
        grep -h "checkpoint" "$run"/logs/*.log 2>/dev/null | tail -4
        python3 -m benchmarks.checkpoint_run "$run" --every 100 --warmup 30 --remove $([ "$n" = "$last" ] && echo --dd) \
            --out "$OUT/ckpt8b_w$n.json"
        cp "$run/metrics.jsonl" "$OUT/ckpt8b_w${n}_metrics.jsonl"
    done
fi
date -u
