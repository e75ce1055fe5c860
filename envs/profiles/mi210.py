"""AMD Instinct MI210 (CDNA2, one GCD per card, PCIe)."""
from core.vendor import Vendor
from envs.spec import Floors, GpuModel, model_profile

MODEL = GpuModel(
    key="mi210", name="MI210", vendor=Vendor.AMD, arch="gfx90a", memory_gib=64,
    peak_tflops=181,
    peak_ref="AMD Instinct MI210 datasheet (amd.com): 181 TFLOP/s peak bf16",
    patterns=(r"MI210",), device_ids=(0x740F,), default_count=4,
    floors=Floors(gemm_tflops=100, hbm_gbps=1000, h2d_gbps=20, allreduce_gbps=None,
                   ref="estimates: about 55% of the 181 TFLOP/s peak and 63% of the 1.6 TB/s HBM2e figure; "
                       "PCIe Gen4 x16 for H2D; no local all-reduce floor"),
    hbm_gbps=1638, fp8_tflops=None, link_gbps=None,
    speed_ref="AMD Instinct MI210 datasheet: 1.6 TB/s HBM2e, no FP8; a PCIe card (bridges optional)",
)

PROFILE = model_profile(MODEL)
