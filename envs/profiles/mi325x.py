"""AMD Instinct MI325X (CDNA3 like MI300X, 256 GB HBM3E)."""
from envs.profiles import rocm
from envs.spec import GpuModel, model_profile

MODEL = GpuModel(
    key="mi325x", name="MI325X", vendor="amd", arch="gfx942", memory_gib=256,
    peak_tflops=1307.4,
    peak_ref="AMD Instinct MI325X datasheet (amd.com): 1307.4 TFLOP/s dense bf16, same compute as MI300X",
    patterns=(r"MI325X",), device_ids=(0x74A5,), default_count=8,
)

PROFILE = model_profile(MODEL, *rocm.CDNA3_PLUS)
