"""FP8 training's rules that need no torch: the recipes, what stays in bf16, the alignment FP8 GEMMs need,
which AMD architectures take which float8 types, and when SwiGLU's float8 stash applies. trainer.fp8
(which converts the model, with torch and torchao) and the memory plan (trainer.plan, which the runner
asks on a login node without importing torch) both read them here."""
from __future__ import annotations

from core.errors import UserError

RECIPES = ("tensorwise", "rowwise")
SKIP_FQNS = ("lm_head",)          # the output head stays in bf16
ALIGN = 16                        # FP8 GEMM operands need dims divisible by 16
ROCM_FNUZ_ARCHS = ("gfx940", "gfx941", "gfx942")   # MI300A/X, MI325X: fnuz float8
ROCM_OCP_ARCHS = ("gfx950",)                       # MI350X/MI355X: OCP float8
NEEDS_GPU = "precision.fp8 needs a GPU with FP8 support (sm_89+ / MI300+)"



class Fp8Error(UserError):
    """precision.fp8 asked for where it cannot run (CPU, an older GPU, torchao missing): exit 2."""


# --------------------------------------------------------------------------- rules

def enabled(cfg) -> bool:
    return cfg.precision.fp8 != "off"


STASH_MODES = ("none", "selective")   # where SwiGLU's float8 stash keeps less than the mode would


def stash_fits(cfg) -> bool:
    """Whether SwiGLU can keep gate and up in float8 itself (kernels.swiglu's stash): train.float8_activations
    with the fused FP8 inputs (tensorwise, --kernels, precision.fp8_fused), whatever the checkpointing."""
    return bool(cfg.train.float8_activations and cfg.train.kernels and cfg.precision.fp8_fused
                and cfg.precision.fp8 == "tensorwise")


def stashes(cfg) -> bool:
    """Whether it does: stash_fits and a checkpointing mode where the stash keeps less. `selective_lean`
    keeps gate alone (2 bytes an element, 1 as the partitioner's float8 copy once it reaches the size):
    the stash's gate and up (2) would keep as much or more; `full` keeps no MLP tensor at all."""
    return stash_fits(cfg) and cfg.train.activation_checkpoint in STASH_MODES
