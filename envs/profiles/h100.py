"""NVIDIA H100 (Hopper, sm_90). The SXM part is the default; PCIe and NVL run lower clocks."""
from core.vendor import Vendor
from envs.profiles import refs
from envs.spec import Floors, GpuModel, model_profile

MODEL = GpuModel(
    key="h100", name="H100", vendor=Vendor.NVIDIA, arch="sm_90", memory_gib=80,
    peak_tflops=989,
    peak_ref=("NVIDIA H100 datasheet (nvidia.com): 1979 TFLOP/s bf16 with sparsity = 989 dense (SXM), PCIe 756, NVL 835; "
              + refs.TORCHTITAN_PEAK),
    patterns=(r"\bH100",), device_ids=(), default_count=8,
    peak_variants=(("PCIe", 756), ("NVL", 835)),
    floors=Floors(gemm_tflops=600, hbm_gbps=2400, h2d_gbps=40, allreduce_gbps=360, allreduce_gpus=8,
                  ref="about 60% of the 989 TFLOP/s dense peak and 72% of the 3.35 TB/s HBM3 datasheet figure; "
                      "PCIe Gen5 x16 (64 GB/s) for H2D; all-reduce 78% of Azure node health checks' H100 NCCL "
                      "threshold (460 GB/s, github.com/Azure/azurehpc-health-checks)"),
    gpu_link="NVLink",
    gpu_link_ref=("NVIDIA H100 datasheet: HGX H100 joins 8 SXM GPUs through NVSwitch (NVLink 4, 900 GB/s per "
                  "GPU); H100 PCIe and NVL pair GPUs through bridges"),
    link_exempt=("PCIe", "NVL"),
    hbm_gbps=3350, fp8_tflops=1979, link_gbps=450,
    speed_ref="NVIDIA H100 datasheet: 3.35 TB/s HBM3 (SXM), FP8 3,958 TFLOP/s with sparsity = 1,979 dense; NVLink 4 900 GB/s per GPU (450 each way)",
)

PROFILE = model_profile(MODEL)
