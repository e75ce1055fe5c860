"""Fused Triton kernels for Llama training.

    from kernels import rms_norm, apply_rope, swiglu, cross_entropy, fused_linear_cross_entropy, patch
"""

from kernels.cross_entropy import cross_entropy
from kernels.fused_linear_cross_entropy import fused_linear_cross_entropy
from kernels.modules import RMSNorm, SwiGLU, SwiGLUMLP
from kernels.patch import patch
from kernels.rms_norm import rms_norm
from kernels.rope import apply_rope
from kernels.swiglu import swiglu

__all__ = [
    "RMSNorm", "SwiGLU", "SwiGLUMLP", "apply_rope", "cross_entropy", "fused_linear_cross_entropy",
    "patch", "rms_norm", "swiglu",
]
