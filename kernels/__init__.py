"""Fused Triton kernels for Llama training.

    from kernels import rms_norm, apply_rope, swiglu, cross_entropy, fused_linear_cross_entropy, patch

Hugging Face ships a package with the same import name (`pip install kernels`, hub kernels for
transformers). Anvil's programs put the checkout first on sys.path (core.checkout), so they get
this one; where both are installed, this one also carries Hugging Face's (kernels/namesake.py),
so transformers works beside it in one process. `__anvil__` tells the two apart.
"""

__anvil__ = True

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

from kernels import namesake  # noqa: E402  (after our names: it checks that none is overwritten)

#: Why Hugging Face's package could not be carried (None: it was, or it is not installed).
NAMESAKE_PROBLEM = namesake.carry(globals())
