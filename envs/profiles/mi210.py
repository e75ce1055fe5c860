"""AMD Instinct MI210 (CDNA2, one GCD per card, PCIe)."""
from envs.spec import GpuModel, model_profile

MODEL = GpuModel(
    key="mi210", name="MI210", vendor="amd", arch="gfx90a", memory_gib=64,
    peak_tflops=181,
    peak_ref="AMD Instinct MI210 datasheet (amd.com): 181 TFLOP/s peak bf16",
    patterns=(r"MI210",), device_ids=(0x740F,), default_count=4,
)

PROFILE = model_profile(MODEL)
