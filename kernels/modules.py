"""Thin nn.Module wrappers around the kernels (drop-in for transformers' Llama modules)."""

from __future__ import annotations

import torch
from torch import nn

from kernels.rms_norm import rms_norm
from kernels.swiglu import swiglu


class RMSNorm(nn.Module):
    """Drop-in for LlamaRMSNorm: same parameter name (`weight`), same `variance_epsilon`, same output dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class SwiGLU(nn.Module):
    """The activation alone: forward(gate, up) = silu(gate) * up."""

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return swiglu(gate, up)


class SwiGLUMLP(nn.Module):
    """Drop-in for LlamaMLP: down_proj(silu(gate_proj(x)) * up_proj(x)), same parameter names."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, device=None, dtype=None):
        super().__init__()
        kw = dict(bias=bias, device=device, dtype=dtype)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))
