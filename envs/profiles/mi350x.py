"""AMD Instinct MI350X (CDNA4, gfx950, air-cooled).

Primus shipped no MI350X file and gfx950 runs hit NaNs (AMD-AGI/Primus#1178):
the reason Anvil fails preflight on a GPU without a profile."""
from core.vendor import Vendor
from envs.profiles import rocm
from envs.profiles.mi355x import GFX950
from envs.spec import Floors, GpuModel, model_profile

MODEL = GpuModel(
    key="mi350x", name="MI350X", vendor=Vendor.AMD, arch="gfx950", memory_gib=288,
    peak_tflops=2300,
    peak_ref="AMD Instinct MI350X datasheet (amd.com): 2.3 PFLOP/s dense bf16",
    patterns=(r"MI350X",), device_ids=(0x75A0,), default_count=8,
    floors=Floors(gemm_tflops=600, hbm_gbps=2000, h2d_gbps=44, allreduce_gbps=314, allreduce_gpus=8,
                    ref="Primus node_smoke tier-2 minimums for the MI3xx series; no MI350X-specific published "
                        "thresholds found, so these are MI300X-level and loose for this GPU"),
    gpu_link="XGMI",
    gpu_link_ref="AMD Instinct MI350 series platform: 8 GPUs fully connected by Infinity Fabric links",
    hbm_gbps=8000, fp8_tflops=4600, link_gbps=538,
    speed_ref="AMD Instinct MI350X datasheet: 8 TB/s HBM3E, FP8 4.6 PFLOP/s dense; 7 Infinity Fabric links of 76.8 GB/s each way",
)

PROFILE = model_profile(MODEL, *rocm.CDNA3_PLUS, *GFX950)
