"""NVIDIA H200 (Hopper, sm_90, 141 GB HBM3e): H100 compute, more and faster memory."""
from envs.profiles import refs
from envs.spec import GpuModel, model_profile

MODEL = GpuModel(
    key="h200", name="H200", vendor="nvidia", arch="sm_90", memory_gib=141,
    peak_tflops=989,
    peak_ref=("NVIDIA H200 datasheet (nvidia.com): 1979 TFLOP/s bf16 with sparsity = 989 dense (SXM), NVL 835; "
              + refs.TORCHTITAN_PEAK),
    patterns=(r"\bH200",), device_ids=(), default_count=8,
    peak_variants=(("NVL", 835),),
)

PROFILE = model_profile(MODEL)
