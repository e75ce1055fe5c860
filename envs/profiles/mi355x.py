"""AMD Instinct MI355X (CDNA4, gfx950, liquid-cooled, higher clocks than MI350X)."""
from core.vendor import Vendor
from envs.profiles import refs, rocm
from envs.spec import Floors, GpuModel, model_profile, setting

# gfx950 (MI350X and MI355X): Primus's only MI355X setting.
GFX950 = (
    setting("RCCL_WARP_SPEED_AUTO", "0", "RCCL's warp-speed auto-tuning misbehaves on gfx950", refs.PRIMUS_MI355X),
)

MODEL = GpuModel(
    key="mi355x", name="MI355X", vendor=Vendor.AMD, arch="gfx950", memory_gib=288,
    peak_tflops=2500,
    peak_ref="AMD Instinct MI355X datasheet (amd.com): 2.5 PFLOP/s dense bf16; torchtitan uses 2500",
    patterns=(r"MI355X",), device_ids=(0x75A3,), default_count=8,
    floors=Floors(gemm_tflops=600, hbm_gbps=2000, h2d_gbps=44, allreduce_gbps=314, allreduce_gpus=8,
                    ref="Primus node_smoke tier-2 minimums for the MI3xx series; no MI355X-specific published "
                        "thresholds found, so these are MI300X-level and loose for this GPU"),
    gpu_link="XGMI",
    gpu_link_ref="AMD Instinct MI350 series platform: 8 GPUs fully connected by Infinity Fabric links",
    hbm_gbps=8000, fp8_tflops=5000, link_gbps=538,
    speed_ref="AMD Instinct MI355X datasheet: 8 TB/s HBM3E, FP8 5.0 PFLOP/s dense; 7 Infinity Fabric links of 76.8 GB/s each way",
)

PROFILE = model_profile(MODEL, *rocm.CDNA3_PLUS, *GFX950)
