"""The ROCm vendor layer (AMD Instinct), plus entries shared by CDNA3+ models."""
from envs.profiles import refs
from envs.spec import Profile, setting

PROFILE = Profile("rocm", "vendor", "AMD ROCm", (
    setting("HSA_NO_SCRATCH_RECLAIM", "1",
            "keep scratch memory allocated; reclaiming it crashed MoE training",
            refs.PRIMUS_BASE_ENV),
    setting("TORCH_NCCL_HIGH_PRIORITY", "1",
            "run RCCL collectives on high-priority HIP streams so they overlap compute",
            f"{refs.ROCM_WORKLOAD}; {refs.ROCM_SYSTEM_VALIDATION}"),
    setting("GPU_MAX_HW_QUEUES", "2",
            "with high-priority NCCL streams FSDP needs at most 4 HIP streams; fewer HW queues cut contention",
            f"{refs.ROCM_WORKLOAD}; {refs.PRIMUS_BASE_ENV}"),
    setting("RCCL_MSCCL_ENABLE", "0",
            "MSCCL algorithms caused data corruption/mismatch; removed from RCCL 7.13 anyway",
            f"{refs.ROCM_SYSTEM_VALIDATION}; {refs.PRIMUS_BASE_ENV}"),
))

# CDNA3 and later (gfx942, gfx950): the MI300X system-optimization guide's runtime knobs.
CDNA3_PLUS = (
    setting("HIP_FORCE_DEV_KERNARG", "1",
            "kernel arguments in device memory save 2-3 us per launch (default from ROCm 6.2; explicit for older)",
            refs.ROCM_MI300X_SYSTEM),
    setting("TORCH_BLAS_PREFER_HIPBLASLT", "1",
            "route torch GEMMs to hipBLASLt, the faster library on MI300-class GPUs",
            refs.ROCM_WORKLOAD),
    setting("HSA_OVERRIDE_CPU_AFFINITY_DEBUG", "0",
            "ROCm helper threads inherit the rank's CPU binding instead of spreading over all cores",
            refs.ROCM_MI300X_SYSTEM),
)
