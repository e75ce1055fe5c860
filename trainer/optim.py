"""AdamW (torch's fused one on a GPU, or one Triton kernel a parameter with train.kernels), warmup +
decay schedule, gradient clipping."""
from __future__ import annotations

import math

import torch
from torch import nn

from trainer.config import OptimConfig, ScheduleConfig


class TritonAdamW(torch.optim.AdamW):
    """torch's AdamW, its update one Triton kernel per parameter (kernels.adamw): the same state
    (step, exp_avg, exp_avg_sq), hyperparameters and checkpoints; the clip factor comes in as
    `grad_scale` (clip_grad_norm sets it), for FSDP2's DTensors too, whose local shards it updates."""

    takes_grad_scale = True

    def __init__(self, params, **kwargs):
        super().__init__(params, foreach=False, **kwargs)
        self.grad_scale: torch.Tensor | None = None

    @torch.no_grad()
    def step(self, closure=None):
        from kernels.adamw import adamw_update
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:   # as torch's AdamW: the step on the CPU, the moments like p
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                adamw_update(_local(p), _local(p.grad), _local(state["exp_avg"]), _local(state["exp_avg_sq"]),
                             step=int(state["step"]), lr=group["lr"], beta1=beta1, beta2=beta2,
                             eps=group["eps"], weight_decay=group["weight_decay"], grad_scale=self.grad_scale)
        return loss


def _local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding t's (local) elements: a DTensor's shard, and inside a wrapper
    subclass (FP8's float8 all-gather weight) the inner tensor of the same shape; writes to it
    update t."""
    from torch.distributed.tensor import DTensor
    if isinstance(t, DTensor):
        t = t.to_local()
    while type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        inner = getattr(t, "_tensor", None)
        if isinstance(inner, torch.Tensor) and inner.shape == t.shape:
            # torchao's wrappers: their __tensor_flatten__ asks `if self._precomputed_scale:`, a host sync
            # on a GPU scalar. Called here for each of 8B's 224 FP8 weights, it stalled the host 124 ms in
            # the optimizer step, and the GPU idled 27 ms a step waiting for the launches after it.
            t = inner
            continue
        names, _ = t.__tensor_flatten__()
        inner = next((getattr(t, n) for n in names if getattr(t, n).shape == t.shape), None)
        if inner is None:
            raise TypeError(f"TritonAdamW: cannot reach the elements of a {type(t).__name__}")
        t = inner
    return t


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device,
                    kernels: bool = False) -> torch.optim.AdamW:
    # No weight decay on norms (1-D weights), as in Llama/nanoGPT; embeddings and matrices decay.
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    hyper = dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    if cfg.fused and device.type == "cuda":
        if kernels:   # train.kernels: Anvil's Triton kernel
            return TritonAdamW(groups, **hyper)
        return torch.optim.AdamW(groups, **hyper, fused=True)
    return torch.optim.AdamW(groups, **hyper)


def lr_factor(step: int, total_steps: int, cfg: ScheduleConfig) -> float:
    """Multiplier of the base lr after `step` optimizer steps (LambdaLR calls it with 0, 1, ...)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.decay == "constant":
        return 1.0
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.decay == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        shape = 1.0 - progress
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_scheduler(optimizer, cfg: ScheduleConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, cfg))


def _takes_grad_scale(optimizer, dtensor: bool) -> bool:
    """Whether the optimizer divides the gradients by its `grad_scale` inside its own kernel:
    TritonAdamW for any gradients, torch's fused AdamW for plain tensors (not DTensors)."""
    if optimizer is None:
        return False
    return getattr(optimizer, "takes_grad_scale", False) or (bool(optimizer.defaults.get("fused")) and not dtensor)


def clip_grad_norm(parameters, max_norm: float, optimizer=None) -> torch.Tensor:
    """Global grad norm (clipped when max_norm > 0); a device tensor, no host sync.

    Works for plain tensors and FSDP2's DTensors (the norm is reduced over the mesh).
    With a fused AdamW/Adam passed as `optimizer` (plain tensors), clipping costs no pass over
    the gradients: the optimizer's kernel divides them by the clip factor (its `grad_scale`
    input, as GradScaler uses it). Eager torch multiplies each gradient by a 0-dim fp32
    tensor in a slow non-vectorized kernel: 5.6 ms a step for Llama 3.2 1B on an H200.
    The gradients themselves stay unclipped until optimizer.step() runs."""
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    if optimizer is not None:
        optimizer.grad_scale = None  # set afresh every step; None = no scaling
    from torch.distributed.tensor import DTensor
    dtensor = bool(grads) and isinstance(grads[0], DTensor)
    if grads and not dtensor and any(g.dtype != torch.float32 for g in grads):
        # bf16 weights: accumulate the norm in fp32 (a bf16 norm keeps ~3 significant digits)
        norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
    else:
        # DTensors of one mesh at a time (expert parallelism shards the experts on a mesh of its own)
        parts = [torch.nn.utils.get_total_norm([p.grad for p in group], norm_type=2.0, foreach=None)
                 for group in _by_mesh(params) or [[]]]
        parts = [p.full_tensor() if isinstance(p, DTensor) else p for p in parts]
        total = parts[0] if len(parts) == 1 else torch.linalg.vector_norm(torch.stack(parts), 2.0)
    if max_norm > 0:
        if _takes_grad_scale(optimizer, dtensor):
            # grad / clamp((norm + 1e-6) / max_norm, min=1) == grad * clip_grads_with_norm_'s factor
            optimizer.grad_scale = torch.clamp((total + 1e-6) / max_norm, min=1.0)
        else:
            for group in _by_mesh(params):
                torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=None)
    return total


def _by_mesh(params: list) -> list[list]:
    """The parameters grouped by their gradients' device mesh (plain tensors: one group of their own)."""
    from torch.distributed.tensor import DTensor
    groups: dict = {}
    for p in params:
        groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    return list(groups.values())
