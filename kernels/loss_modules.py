"""nn.Module wrappers for the loss kernels, and the causal-LM loss the model patcher uses.

- LlamaCrossEntropy: F.cross_entropy on logits (our kernel; optional in-place gradient).
- FusedLinearCrossEntropy: LM head + cross-entropy without the full logits.
- causal_lm_loss: transformers' ForCausalLMLoss semantics (labels shifted left by one,
  the last position ignored, optional num_items_in_batch) on top of the fused kernel.
"""
from __future__ import annotations

import torch
from torch import nn

from kernels.cross_entropy import cross_entropy
from kernels.fused_linear_cross_entropy import fused_linear_cross_entropy


class LlamaCrossEntropy(nn.Module):
    """Cross-entropy over [..., V] logits. inplace_grad=True overwrites the logits with their gradient."""

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", inplace_grad: bool = False,
                 z_loss: float = 0.0, label_smoothing: float = 0.0):
        super().__init__()
        self.ignore_index, self.reduction, self.inplace_grad = ignore_index, reduction, inplace_grad
        self.z_loss, self.label_smoothing = z_loss, label_smoothing

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return cross_entropy(logits, target, self.ignore_index, self.reduction, self.z_loss, self.label_smoothing,
                             self.inplace_grad)

    def extra_repr(self) -> str:
        return f"ignore_index={self.ignore_index}, reduction={self.reduction}, inplace_grad={self.inplace_grad}"


class FusedLinearCrossEntropy(nn.Module):
    """forward(hidden [..., H], weight [V, H], target [...]) -> loss (fp32)."""

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", chunk_size: int | None = None):
        super().__init__()
        self.ignore_index, self.reduction, self.chunk_size = ignore_index, reduction, chunk_size

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                num_items: torch.Tensor | int | None = None) -> torch.Tensor:
        return fused_linear_cross_entropy(hidden, weight, target, self.ignore_index, self.reduction,
                                          num_items=num_items, chunk_size=self.chunk_size,
                                          loss_dtype=torch.float32)

    def extra_repr(self) -> str:
        return f"ignore_index={self.ignore_index}, reduction={self.reduction}"


def causal_lm_loss(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor,
                   ignore_index: int = -100, num_items_in_batch: torch.Tensor | int | None = None,
                   shift_labels: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' ForCausalLMLoss on hidden states: position i predicts labels[i + 1].

    The labels are shifted (the last position gets ignore_index), never the hidden states, so
    nothing the size of the activations is copied. Mean over non-ignored targets, or the sum
    divided by num_items_in_batch when given (gradient accumulation). Returns fp32.
    """
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return fused_linear_cross_entropy(hidden, lm_head_weight, shift_labels.to(hidden.device), ignore_index,
                                      num_items=num_items_in_batch, loss_dtype=torch.float32)
