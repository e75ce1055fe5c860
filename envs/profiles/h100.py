"""NVIDIA H100 (Hopper, sm_90). The SXM part is the default; PCIe and NVL run lower clocks."""
from envs.profiles import refs
from envs.spec import GpuModel, model_profile

MODEL = GpuModel(
    key="h100", name="H100", vendor="nvidia", arch="sm_90", memory_gib=80,
    peak_tflops=989,
    peak_ref=("NVIDIA H100 datasheet (nvidia.com): 1979 TFLOP/s bf16 with sparsity = 989 dense (SXM), PCIe 756, NVL 835; "
              + refs.TORCHTITAN_PEAK),
    patterns=(r"\bH100",), device_ids=(), default_count=8,
    peak_variants=(("PCIe", 756), ("NVL", 835)),
)

PROFILE = model_profile(MODEL)
