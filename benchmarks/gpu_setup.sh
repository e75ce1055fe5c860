# Sourced by the GPU scripts of this folder on a lent GPU machine (python3 with torch and triton, no
# network, no Anvil environment):  LOG=name.txt; . benchmarks/gpu_setup.sh
# Installs the carried wheels (.whl/*.whl) into /tmp/site, puts them and the checkout on PYTHONPATH, keeps
# NVLink multicast off (it can take a shared host's GPUs out of service), sends this shell's output to
# $OUT/$LOG as well, and prints the GPU and the versions. Sets OUT (default ./out) and start (SECONDS).
OUT=${OUT:-out}; mkdir -p "$OUT"
exec > >(tee "$OUT/${LOG:-gpu.txt}") 2>&1
start=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit --format=csv,noheader
python3 -c "
import importlib.util, sys, torch, triton
ao = importlib.util.find_spec('torchao') and __import__('torchao').__version__
print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'torchao', ao or '-')"
