"""NVIDIA B200 (Blackwell, sm_100, 180 GB HBM3e usable)."""
from core.vendor import Vendor
from envs.profiles import refs
from envs.spec import Floors, GpuModel, model_profile, setting

MODEL = GpuModel(
    key="b200", name="B200", vendor=Vendor.NVIDIA, arch="sm_100", memory_gib=180,
    peak_tflops=2250,
    peak_ref=("NVIDIA Blackwell datasheet (nvidia.com): 4.5 PFLOP/s bf16 with sparsity per B200 = 2250 dense; "
              + refs.TORCHTITAN_PEAK),
    patterns=(r"\bB200",), device_ids=(), default_count=8,
    floors=Floors(gemm_tflops=1200, hbm_gbps=5000, h2d_gbps=40, allreduce_gbps=550, allreduce_gpus=8,
                  ref="estimates: about 53% of the 2250 TFLOP/s dense peak and 63% of the 8 TB/s HBM3e datasheet "
                      "figure; PCIe Gen5 x16 for H2D; all-reduce an estimate for NVLink 5 (1.8 TB/s per GPU); "
                      "not measured by Anvil"),
    gpu_link="NVLink",
    gpu_link_ref="NVIDIA HGX B200: 8 GPUs through NVSwitch (NVLink 5, 1.8 TB/s per GPU)",
    hbm_gbps=8000, fp8_tflops=4500, link_gbps=900,
    speed_ref="NVIDIA Blackwell datasheet: 8 TB/s HBM3e, FP8 9 PFLOP/s with sparsity = 4,500 dense; NVLink 5 1.8 TB/s per GPU (900 each way)",
)

PROFILE = model_profile(
    MODEL,
    setting("PYTORCH_CUDA_ALLOC_CONF", None,
            "NeMo's perf scripts leave expandable segments off on B200",
            refs.NEMO_PERF),
)
