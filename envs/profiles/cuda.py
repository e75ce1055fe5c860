"""The CUDA vendor layer (NVIDIA)."""
from envs.profiles import refs
from envs.spec import Profile, setting

PROFILE = Profile("cuda", "vendor", "NVIDIA CUDA", (
    setting("TORCH_NCCL_AVOID_RECORD_STREAMS", "1",
            "free NCCL communication buffers at once instead of caching them per stream",
            refs.NEMO_PERF),
    setting("NCCL_NVLS_ENABLE", "0",
            "NVLink SHARP buffers cost GPU memory; trades the NVLS all-reduce peak for it (set 1 to benchmark)",
            refs.NEMO_PERF),
    setting("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True",
            "expandable segments cut caching-allocator fragmentation in long runs",
            refs.NEMO_PERF),
))
