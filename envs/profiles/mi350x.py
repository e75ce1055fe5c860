"""AMD Instinct MI350X (CDNA4, gfx950, air-cooled).

Primus shipped no MI350X file and gfx950 runs hit NaNs (AMD-AGI/Primus#1178):
the reason Anvil fails preflight on a GPU without a profile."""
from envs.profiles import rocm
from envs.profiles.mi355x import GFX950
from envs.spec import GpuModel, model_profile

MODEL = GpuModel(
    key="mi350x", name="MI350X", vendor="amd", arch="gfx950", memory_gib=288,
    peak_tflops=2300,
    peak_ref="AMD Instinct MI350X datasheet (amd.com): 2.3 PFLOP/s dense bf16",
    patterns=(r"MI350X",), device_ids=(0x75A0,), default_count=8,
)

PROFILE = model_profile(MODEL, *rocm.CDNA3_PLUS, *GFX950)
