"""Public sources the profiles cite, named once: each entry is a document users can open."""

PRIMUS_BASE_ENV = "Primus runner/helpers/envs/base_env.sh (github.com/AMD-AGI/Primus)"
PRIMUS_AUTO_NET = "Primus runner/helpers/hooks/10_auto_nccl_net.sh (github.com/AMD-AGI/Primus)"
PRIMUS_MI355X = "Primus runner/helpers/envs/MI355X.sh (github.com/AMD-AGI/Primus)"
ROCM_WORKLOAD = ("ROCm docs, MI300X workload optimization (rocm.docs.amd.com, "
                 "how-to/rocm-for-ai/inference-optimization/workload.rst)")
ROCM_SYSTEM_VALIDATION = ("ROCm docs, training prerequisite system validation (rocm.docs.amd.com, "
                          "how-to/rocm-for-ai/training/prerequisite-system-validation.rst)")
ROCM_MI300X_SYSTEM = "ROCm docs, MI300X system optimization (rocm.docs.amd.com, how-to/system-optimization/mi300x.rst)"
NEMO_PERF = "NVIDIA NeMo scripts/performance/executors.py PERF_ENV_VARS (github.com/NVIDIA/NeMo)"
NCCL_ENV_DOCS = "NCCL docs, Environment Variables (docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html)"
TORCH_DIST_DOCS = "PyTorch docs, torch.distributed 'Common environment variables' (pytorch.org/docs/stable/distributed.html)"
LUMI_USER_GUIDE = "LUMI user guide, PyTorch page (docs.lumi-supercomputer.eu/software/packages/pytorch/)"
LUMI_AI_GUIDE = ("LUMI AI guide 5-multi-gpu-and-node/README.md 'RCCL environment variables' "
                 "(github.com/Lumi-supercomputer/LUMI-AI-Guide)")
LUMI_SLIDES = "LUMI AI workshop slides 'Extreme scale AI training on LUMI' (S. Antao, May 2024)"
TORCHTITAN_PEAK = "torchtitan torchtitan/tools/utils.py get_peak_flops (github.com/pytorch/torchtitan)"
TORCH_TUNABLEOP = ("PyTorch docs, torch.cuda.tunable 'TunableOp' (pytorch.org/docs/stable/cuda.tunable.html; "
                   "torch/cuda/tunable.py)")
