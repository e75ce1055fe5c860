"""Fused Triton kernels for Llama training.

    from kernels import rms_norm, apply_rope, swiglu, cross_entropy, fused_linear_cross_entropy, patch

Hugging Face ships a package with the same import name (`pip install kernels`, hub kernels for
transformers). Installed in the same environment it shadows this one wherever the checkout is not
first on sys.path; the trainer checks ANVIL_KERNELS and says so instead of failing obscurely.
"""

ANVIL_KERNELS = True   # tells this package apart from Hugging Face's `kernels`

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
