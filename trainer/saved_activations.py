"""Saved activations kept in float8 between forward and backward (`train.float8_activations`).

Much of a training step's memory is the activations that forward keeps for
backward: in a Llama layer, the outputs of the gate and up projections are
the largest (tokens x ffn_dim each). Under torch.compile, PyTorch's
partitioner can store each saved floating-point activation of at least a set
size as float8 with one scale per row (the row's amax maps onto the format's
largest value) and turn it back into its own dtype where backward first reads it
(torch._functorch.partitioners, `activation_quantization_aten_pass` among
Inductor's `post_grad_fusion_options`). Half the bytes of bf16 (a quarter of fp32);
the price is a pass that writes the float8 copy in forward, one that reads it
in backward, and e4m3's 3 mantissa bits in the values backward sees. Rows
are scaled on their own, so one outlier costs only its row's precision.

It works with every activation-checkpoint mode: what a mode keeps is what
gets stored, and recomputed tensors never are. Weights are not activations:
a saved value that is a graph input seen through views or casts (a weight's
transpose, its autocast copy) stays as it is (_is_weight). It needs `train.compile`.
With FP8 and the fused inputs (kernels.swiglu's stash), SwiGLU does the
MLP's share itself, cheaper: it writes gate and up as float8 in the pass that
reads them anyway, computes its output from those values (so that backward
rebuilds the output rather than keeping it: under `selective`, and under `none`
through the MLP's own region) and its backward reads them back; only what else
is kept goes through the partitioner.
The float8 format is the forward one of trainer.fp8.float8_dtypes (e4m3fn;
e4m3fnuz on MI300-class GPUs, not run on AMD).
"""
from __future__ import annotations

import torch

PASS = "activation_quantization_aten_pass"   # the partitioner's key in post_grad_fusion_options
COUNTER = "activation_quantization_fwd_aten_pass"   # counted once per forward graph it changed


def _is_weight(node) -> bool:
    """A saved value that is a graph input seen through views or casts: a weight (its transpose, its
    autocast copy) or the block's input. The partitioner's own check skips only inputs kept as they
    are; quantizing a weight's transposed view would round the weights the backward multiplies by."""
    import torch.fx

    seen = node
    while isinstance(seen, torch.fx.Node) and seen.op == "call_function" and seen.args:
        if not (getattr(seen.target, "is_view", False) or seen.target in _CASTS):
            return False
        seen = seen.args[0]
    return isinstance(seen, torch.fx.Node) and seen.op == "placeholder"


_CASTS = {torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default}


def _guard_weights() -> None:
    """Wrap the partitioner's size check once so that it passes over weights (_is_weight)."""
    from torch._functorch import partitioners

    check = getattr(partitioners, "should_quantize", None)
    if check is None or getattr(check, "anvil_guard", False):
        return

    def should_quantize(node) -> bool:
        return not _is_weight(node) and check(node)

    should_quantize.anvil_guard = True
    partitioners.should_quantize = should_quantize


def check_device(device: torch.device) -> None:
    """Raise Fp8Error where the float8 casts cannot run: a GPU without FP8 support (Triton's e4m3 needs
    sm_89+ or gfx942/gfx950). The CPU casts in software (the tests)."""
    if device.type != "cuda":
        return
    from trainer.fp8 import Fp8Error, gpu_unsupported_reason

    reason = gpu_unsupported_reason(device)
    if reason:
        raise Fp8Error(f"train.float8_activations stores activations in float8, which this GPU cannot "
                       f"cast: {reason}. Set train.float8_activations=false")


def configure(enabled: bool, min_mib: float, device: torch.device | None = None) -> None:
    """Turn the partitioner's float8 storage on (activations of min_mib MiB or more) or off, for the
    graphs compiled from now on in this process."""
    from torch._inductor import config

    options = config.post_grad_fusion_options
    if not enabled:
        options.pop(PASS, None)
        return
    from trainer.fp8 import float8_dtypes

    _guard_weights()
    options[PASS] = {
        "quant_type": str(float8_dtypes(device)[0]),   # "torch.float8_e4m3fn"
        "size_in_mb": float(min_mib),
        "use_scaling": True,                            # one fp32 scale per row
        "allowed_dtypes": "torch.bfloat16;torch.float16;torch.float32",
    }


def graphs_stored() -> int:
    """How many compiled forward graphs of this process store activations in float8."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"][COUNTER])


def describe(min_mib: float, stashed_layers: int = 0) -> str:
    """The log line after the first step: what the setting did. `stashed_layers`: decoder layers whose
    SwiGLU keeps gate and up in float8 itself (kernels.swiglu's stash, FP8 with the fused inputs)."""
    n = graphs_stored()
    mlp = f"{stashed_layers} SwiGLU(s) keep gate and up in float8 themselves; " if stashed_layers else ""
    other = "other " if stashed_layers else ""
    if n:
        return (f"float8 activations: {mlp}{n} compiled graph(s) keep their {other}saved activations of "
                f"{min_mib:g} MiB or more in float8 (row scales) until backward")
    return (f"float8 activations: {mlp}no {other}saved activation reached {min_mib:g} MiB, those stay as "
            "computed (train.float8_activations_min_mib sets the size)")
