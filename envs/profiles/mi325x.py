"""AMD Instinct MI325X (CDNA3 like MI300X, 256 GB HBM3E)."""
from core.vendor import Vendor
from envs.profiles import rocm
from envs.spec import Floors, GpuModel, model_profile

MODEL = GpuModel(
    key="mi325x", name="MI325X", vendor=Vendor.AMD, arch="gfx942", memory_gib=256,
    peak_tflops=1307.4,
    peak_ref="AMD Instinct MI325X datasheet (amd.com): 1307.4 TFLOP/s dense bf16, same compute as MI300X",
    patterns=(r"MI325X",), device_ids=(0x74A5,), default_count=8,
    floors=Floors(gemm_tflops=600, hbm_gbps=2000, h2d_gbps=44, allreduce_gbps=314, allreduce_gpus=8,
                    ref="as MI300X (same compute dies and Infinity Fabric): Primus node_smoke tier-2 minimums, "
                        "Azure node health checks' MI300X thresholds"),
    gpu_link="XGMI",
    gpu_link_ref="AMD Instinct MI325X platform: the MI300X board (8 OAMs fully connected by Infinity Fabric)",
    hbm_gbps=6000, fp8_tflops=2614.9, link_gbps=448,
    speed_ref="AMD Instinct MI325X datasheet: 6 TB/s HBM3E, FP8 2,614.9 TFLOP/s dense; 7 Infinity Fabric links of 64 GB/s each way",
)

PROFILE = model_profile(MODEL, *rocm.CDNA3_PLUS)
