"""AMD Instinct MI250X (CDNA2): two GCDs per module; torch and ROCm see each GCD as one GPU.

MI250 and MI250X share PCI id 0x740c and rocm-smi calls both "MI250 (MCM)";
they differ in compute units per GCD (110 vs 104), which is checked where a
probe reports it. LUMI-G and Frontier nodes have 4 modules = 8 GCDs."""
from core.vendor import Vendor
from envs.profiles import refs
from envs.spec import Floors, GpuModel, model_profile

MODEL = GpuModel(
    key="mi250x", name="MI250X", vendor=Vendor.AMD, arch="gfx90a", memory_gib=64,
    peak_tflops=191.5,
    peak_ref=("AMD Instinct MI250X datasheet (amd.com): 383 TFLOP/s bf16 per module = 2 GCDs, so 191.5 per device; "
              + refs.TORCHTITAN_PEAK),
    patterns=(r"MI250X?\b",), device_ids=(0x740C, 0x7408), default_count=8,
    compute_units=110,
    floors=Floors(gemm_tflops=100, hbm_gbps=1000, h2d_gbps=20, allreduce_gbps=None,
                    ref="estimates per GCD: about 52% of the 191.5 TFLOP/s peak and 63% of the 1.6 TB/s HBM2e "
                        "figure; H2D over Infinity Fabric (36 GB/s per link on LUMI/Frontier nodes); no local "
                        "all-reduce floor"),
    gpu_link="XGMI",
    gpu_link_ref=("AMD MI200 system optimization guide (rocm.docs.amd.com): the GCDs of an MI250X node reach "
                  "each other over Infinity Fabric (rocm-smi --showtopo: XGMI)"),
    hbm_gbps=1638, fp8_tflops=None, link_gbps=100,
    speed_ref="AMD Instinct MI250X datasheet: 3.2 TB/s HBM2e per module = 1.6 per GCD, no FP8; Infinity Fabric 50 GB/s a link each way, about two per GCD pair",
)

PROFILE = model_profile(MODEL)
