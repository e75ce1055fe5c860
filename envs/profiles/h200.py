"""NVIDIA H200 (Hopper, sm_90, 141 GB HBM3e): H100 compute, more and faster memory."""
from core.vendor import Vendor
from envs.profiles import refs
from envs.spec import Floors, GpuModel, model_profile

MODEL = GpuModel(
    key="h200", name="H200", vendor=Vendor.NVIDIA, arch="sm_90", memory_gib=141,
    peak_tflops=989,
    peak_ref=("NVIDIA H200 datasheet (nvidia.com): 1979 TFLOP/s bf16 with sparsity = 989 dense (SXM), NVL 835; "
              + refs.TORCHTITAN_PEAK),
    patterns=(r"\bH200",), device_ids=(), default_count=8,
    peak_variants=(("NVL", 835),),
    floors=Floors(gemm_tflops=650, hbm_gbps=3400, h2d_gbps=40, allreduce_gbps=360, allreduce_gpus=8,
                  ref="about 83% of Anvil's own H200 measurements (bf16 8192^3 769-798 TFLOP/s, device copy 4.3 TB/s; "
                      "BENCHMARKS.md); PCIe Gen5 x16 for H2D; all-reduce as H100 (same NVLink 4 fabric; Azure node "
                      "health checks' H100 NCCL threshold 460 GB/s)"),
    gpu_link="NVLink",
    gpu_link_ref=("NVIDIA H200 datasheet: HGX H200 joins 8 SXM GPUs through NVSwitch (NVLink 4, 900 GB/s per "
                  "GPU); H200 NVL pairs or quads GPUs through bridges"),
    link_exempt=("NVL",),
    hbm_gbps=4800, fp8_tflops=1979, link_gbps=450,
    speed_ref="NVIDIA H200 datasheet: 4.8 TB/s HBM3e, FP8 3,958 TFLOP/s with sparsity = 1,979 dense; NVLink 4 900 GB/s (450 each way)",
)

PROFILE = model_profile(MODEL)
