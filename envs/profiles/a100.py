"""NVIDIA A100 (Ampere, sm_80; 40 GB and 80 GB SXM/PCIe)."""
from envs.spec import GpuModel, model_profile

MODEL = GpuModel(
    key="a100", name="A100", vendor="nvidia", arch="sm_80", memory_gib=80,
    peak_tflops=312,
    peak_ref="NVIDIA A100 datasheet (nvidia.com): 312 TFLOP/s dense bf16 (624 with sparsity), SXM and PCIe alike",
    patterns=(r"\bA100",), device_ids=(), default_count=8,
)

PROFILE = model_profile(MODEL)
