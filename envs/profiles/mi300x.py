"""AMD Instinct MI300X (CDNA3, 192 GB HBM3)."""
from core.vendor import Vendor
from envs.profiles import rocm
from envs.spec import Floors, GpuModel, model_profile

MODEL = GpuModel(
    key="mi300x", name="MI300X", vendor=Vendor.AMD, arch="gfx942", memory_gib=192,
    peak_tflops=1307.4,
    peak_ref="AMD Instinct MI300X datasheet (amd.com): 1307.4 TFLOP/s dense bf16 (2614.9 with sparsity)",
    patterns=(r"MI300X",), device_ids=(0x74A1,), default_count=8,
    floors=Floors(gemm_tflops=600, hbm_gbps=2000, h2d_gbps=44, allreduce_gbps=314, allreduce_gpus=8,
                    ref="GEMM and HBM: Primus node_smoke tier-2 minimums (github.com/AMD-AGI/Primus); H2D and "
                        "all-reduce: Azure node health checks' MI300X thresholds (D2H/H2D 44/48 GB/s, RCCL 314 GB/s)"),
    gpu_link="XGMI",
    gpu_link_ref=("AMD Instinct MI300X platform (OAM, UBB): 8 GPUs fully connected by Infinity Fabric links, "
                  "128 GB/s each way per pair"),
    hbm_gbps=5300, fp8_tflops=2614.9, link_gbps=448,
    speed_ref="AMD Instinct MI300X datasheet: 5.3 TB/s HBM3, FP8 2,614.9 TFLOP/s dense; 7 Infinity Fabric links of 64 GB/s each way",
)

PROFILE = model_profile(MODEL, *rocm.CDNA3_PLUS)
