"""Tensor parallelism with sequence parallelism for the Llama family (parallel.tp), as DTensor plans.

Between the blocks, each of the tp ranks holds 1/tp of the row's tokens ([B, T/tp, D], sequence
parallel): the norms, the residual adds, the embedding lookup and the loss run on those tokens alone.
Into attention and the MLP the tokens are gathered (all-gather over tp), each rank computes 1/tp of the
heads and of the MLP's hidden units (q, k, v, gate, up split by output: ColwiseParallel), and the
output projections (o, down: RowwiseParallel) reduce-scatter the sum back to each rank's tokens:
Megatron-LM's layout, two all-gathers and two reduce-scatters of B x T x D a layer, each way.

The embedding, the norms and the LM head stay whole on every tp rank (Replicate): each computes with
its local copy on its own tokens (blocks.local_weight), and DTensor sums their gradients over tp. Not
the usual vocabulary-split head (torchtitan's loss_parallel): the fused linear cross-entropy kernel
needs whole rows of the vocabulary for its online softmax, and a head that computes only this rank's
tokens splits its GEMMs over tp just the same; what it costs is V x D weights kept on every tp rank
(sharded again by FSDP2 over the data ranks) and one all-reduce of their gradient a step.

    tensor_parallel.apply(model, tp_mesh)     # before FSDP2 (trainer/distributed.py)
    tensor_parallel.enable_async(tp_mesh)     # parallel.async_tp: GPUs, compiled layers

Every module computes on local tensors (the plan's outputs are local), so --kernels' Triton kernels run
unchanged. FP8 (torchao's float8 linears) is refused with tp > 1 (trainer/config.py).
"""
from __future__ import annotations

from torch import nn


def apply(model: nn.Module, tp_mesh) -> None:
    """Splits `model` (trainer.models.Transformer, family llama) over `tp_mesh` in place."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   parallelize_module)

    for layer in model.model.layers:
        parallelize_module(layer, tp_mesh, {
            # x is gathered over tp once for q, k and v; cos, sin and the mask pass as they are
            "self_attn": PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                            desired_input_layouts=(Replicate(), None, None, None)),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        })
    # Everything else whole on every tp rank: a DTensor too, so that FSDP2 shards every parameter on one
    # mesh and checkpoints keep global shapes. (No broadcast: every rank built the same weights.)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                whole = DTensor.from_local(param.data, tp_mesh, [Replicate()], run_check=False)
                module.register_parameter(name, nn.Parameter(whole, requires_grad=param.requires_grad))
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight


def enable_async(tp_mesh) -> None:
    """Async TP (parallel.async_tp): Inductor's micro-pipelining splits each all-gather + matmul and
    matmul + reduce-scatter of the compiled layers into chunks that overlap, over symmetric memory
    registered for the tp group (CUDA only; as torchtitan enables it). Written from torch's and
    torchtitan's source; not yet run on GPUs here."""
    import torch._inductor.config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)
