"""NVIDIA A100 (Ampere, sm_80; 40 GB and 80 GB SXM/PCIe)."""
from core.vendor import Vendor
from envs.spec import Floors, GpuModel, model_profile

MODEL = GpuModel(
    key="a100", name="A100", vendor=Vendor.NVIDIA, arch="sm_80", memory_gib=80,
    peak_tflops=312,
    peak_ref="NVIDIA A100 datasheet (nvidia.com): 312 TFLOP/s dense bf16 (624 with sparsity), SXM and PCIe alike",
    patterns=(r"\bA100",), device_ids=(), default_count=8,
    floors=Floors(gemm_tflops=220, hbm_gbps=1300, h2d_gbps=20, allreduce_gbps=180, allreduce_gpus=8,
                  ref="about 70% of the 312 TFLOP/s dense peak, 64% of the 2.04 TB/s HBM2e datasheet figure (80 GB); "
                      "PCIe Gen4 x16 (32 GB/s) for H2D; all-reduce an estimate for NVLink 3 (600 GB/s per GPU)"),
    gpu_link="NVLink",
    gpu_link_ref=("NVIDIA A100 datasheet: HGX A100 boards join 8 GPUs through NVSwitch (NVLink 3, 600 GB/s per "
                  "GPU); the PCIe card pairs at most two with a bridge"),
    link_exempt=("PCIe",),
    hbm_gbps=2039, fp8_tflops=None, link_gbps=300,
    speed_ref="NVIDIA A100 datasheet: 2,039 GB/s HBM2e (80 GB SXM), no FP8; NVLink 3 600 GB/s per GPU (300 each way)",
)

PROFILE = model_profile(MODEL)
