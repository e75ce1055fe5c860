"""NVIDIA B200 (Blackwell, sm_100, 180 GB HBM3e usable)."""
from envs.profiles import refs
from envs.spec import GpuModel, model_profile, setting

MODEL = GpuModel(
    key="b200", name="B200", vendor="nvidia", arch="sm_100", memory_gib=180,
    peak_tflops=2250,
    peak_ref=("NVIDIA Blackwell datasheet (nvidia.com): 4.5 PFLOP/s bf16 with sparsity per B200 = 2250 dense; "
              + refs.TORCHTITAN_PEAK),
    patterns=(r"\bB200",), device_ids=(), default_count=8,
)

PROFILE = model_profile(
    MODEL,
    setting("PYTORCH_CUDA_ALLOC_CONF", None,
            "NeMo's perf scripts leave expandable segments off on B200",
            refs.NEMO_PERF),
)
