"""`kernels.patch(model)`: swap the fused kernels into a built Llama, in place.

Two model families are recognised:

- our trainer's `trainer.models.Transformer` (by the hook points its module
  docstring names): every RMSNorm instance gets a kernel forward,
  every `Attention.rotary_fn` becomes `apply_rope`, every `MLP.act_fn` becomes
  `swiglu`, and `Transformer.loss_fn` becomes the fused linear cross-entropy
  (sum reduction, as the trainer expects);
- transformers' LlamaForCausalLM / LlamaModel (like Liger's
  apply_liger_kernel_to_llama): every LlamaRMSNorm and LlamaMLP instance gets
  a kernel forward, `modeling_llama.apply_rotary_pos_emb` is rebound (a
  module global: it then applies to every Llama in the process), and
  LlamaForCausalLM.forward skips the logits when training with labels and
  computes the loss with the fused linear cross-entropy.

Parameters are never renamed or replaced, so state_dicts, optimizers and
checkpoints are unaffected. Call it after building and initialising the
model, before activation checkpointing, torch.compile and DDP/FSDP wrapping.
"""

from __future__ import annotations

import functools
import types

import torch
from torch import nn

from kernels.rms_norm import rms_norm
from kernels.rope import apply_rope
from kernels.swiglu import swiglu


# --- trainer.models.Transformer ------------------------------------------------------------------

def _trainer_rms_norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    # trainer.models.RMSNorm returns x's dtype: its weight_as casts the weight to it first.
    return rms_norm(x, self.weight_as(x.dtype), self.eps)


def _trainer_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                  float8: torch.dtype | None = None) -> torch.Tensor:
    from kernels.fused_linear_cross_entropy import fused_linear_cross_entropy

    # The sum of thousands of token losses must stay fp32: returned in bf16 it is
    # quantized to steps of 1/16 at loss ~12, and the logged curve goes flat.
    return fused_linear_cross_entropy(hidden, weight, labels, reduction="sum", loss_dtype=torch.float32,
                                      float8=float8)


def _is_trainer_llama(model: nn.Module) -> bool:
    """Our trainer's model, of any family (trainer/models): its layers have the hook points."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    return (hasattr(model, "loss_fn") and layers is not None and len(layers) > 0
            and hasattr(layers[0].self_attn, "rotary_fn"))


def _trainer_route(logits: torch.Tensor, moe, bias: torch.Tensor | None):
    """trainer.models.moe's Router.route_fn through kernels/router.py's route (model.moe -> its RouterSpec):
    the Triton kernels where they were measured to win, the reference elsewhere."""
    from kernels import router

    spec = router.RouterSpec(moe.top_k, moe.score_func, moe.n_group, moe.topk_group, moe.norm_topk_prob,
                             moe.route_scale)
    return tuple(router.route(logits, spec, bias))


def _trainer_permute(x: torch.Tensor, indices: torch.Tensor, experts: int, capacity: int | None = None):
    from kernels.moe_permute import permute

    return permute(x, indices, experts)


def _patch_experts(module: nn.Module) -> list[str]:
    """A mixture-of-experts layer's ops (trainer.models.moe): the grouped GEMM, the permutation (dropless
    layers only: a capacity stays on the reference path) and the router."""
    from kernels.grouped_gemm import grouped_mm
    from kernels.moe_permute import unpermute

    done = []
    if hasattr(module, "grouped_mm"):
        module.grouped_mm = grouped_mm
        done.append("grouped_gemm")
    if hasattr(module, "permute") and getattr(module.moe, "capacity_factor", None) is None:
        module.permute, module.unpermute = _trainer_permute, unpermute
        done.append("moe_permute")
    if hasattr(module, "route_fn"):
        module.route_fn = _trainer_route
        done.append("router")
    return done


def _patch_trainer(model: nn.Module, rms: bool, rope: bool, mlp: bool, loss: bool) -> list[str]:
    done = []
    for module in model.modules():
        if rms and type(module).__name__ == "RMSNorm" and hasattr(module, "eps"):
            module.forward = types.MethodType(_trainer_rms_norm_forward, module)
            done.append("rms_norm")
        if rope and hasattr(module, "rotary_fn"):
            module.rotary_fn = apply_rope
            done.append("rope")
        if mlp and hasattr(module, "act_fn") and hasattr(module, "gate_proj"):
            module.act_fn = swiglu
            done.append("swiglu")
        if mlp and any(hasattr(module, hook) for hook in ("grouped_mm", "route_fn")) or \
                (mlp and hasattr(module, "permute") and hasattr(module, "dispatch")):
            done += _patch_experts(module)
    if loss:
        model.loss_fn = _trainer_loss
        done.append("fused_linear_cross_entropy")
    return done


def _trainer_rms_norm_float8_forward(self, x: torch.Tensor) -> torch.Tensor:
    from kernels.rms_norm import rms_norm_float8

    return rms_norm_float8(x, self.weight_as(x.dtype), self.eps, self._anvil_float8_target)


def _swiglu_float8_for(target, grad_target, stash):
    from kernels.swiglu import swiglu_float8

    return lambda gate, up: swiglu_float8(gate, up, target, grad_target, stash)


def _shared_target(*linears):
    """The Float8Target all `linears` take (tensorwise torchao Float8Linear), else None."""
    from kernels.float8 import target_of

    targets = {target_of(lin) for lin in linears}
    return targets.pop() if len(targets) == 1 else None


def patch_float8_inputs(model: nn.Module, stash: bool = False) -> list[str]:
    """After torchao's float8 conversion of a patched trainer Llama: each decoder layer's two RMSNorms
    and its SwiGLU write their Float8Linear consumers' input as float8 themselves, and SwiGLU's
    backward the output gradients of gate and up (kernels/float8.py). `stash`: SwiGLU also keeps gate
    and up for its backward in float8 (kernels.swiglu's stash; the MLP's `stashes` says so).

    A site is left as it is unless every linear it feeds is a tensorwise Float8Linear of one config
    (rowwise scales, an unconverted layer). Returns what was patched, one entry per site.
    """
    if not _is_trainer_llama(model):
        raise TypeError(f"kernels.patch_float8_inputs: {type(model).__name__} is not trainer.models.Transformer")
    done = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for norm, consumers in ((layer.input_layernorm, (attn.q_proj, attn.k_proj, attn.v_proj)),
                                (layer.post_attention_layernorm, (mlp.gate_proj, mlp.up_proj))):
            target = _shared_target(*consumers)
            if target is not None and hasattr(norm, "eps"):
                norm._anvil_float8_target = target
                norm.forward = types.MethodType(_trainer_rms_norm_float8_forward, norm)
                done.append("rms_norm_float8")
        target = _shared_target(mlp.down_proj)
        if target is not None:
            grad_target = _shared_target(mlp.gate_proj, mlp.up_proj)
            if grad_target is not None and grad_target.grad_dtype is None:
                grad_target = None
            mlp.act_fn = _swiglu_float8_for(target, grad_target, stash)
            mlp.stashes = stash
            done.append("swiglu_float8")
            if stash:
                done.append("swiglu_float8_stash")
            if grad_target is not None:
                done.append("swiglu_float8_grads")
    return done


def patch_float8_lm_head(model: nn.Module, dtype: torch.dtype) -> list[str]:
    """After kernels.patch of a trainer Llama: its fused loss runs the LM head's logits and hidden-gradient
    GEMMs with `dtype` (e4m3) operands, per-row scales. Returns ["lm_head_float8"]."""
    if not _is_trainer_llama(model) or getattr(model.loss_fn, "__wrapped__", model.loss_fn) is not _trainer_loss:
        raise TypeError("kernels.patch_float8_lm_head: needs a trainer.models.Transformer patched by kernels.patch")
    model.loss_fn = functools.update_wrapper(functools.partial(_trainer_loss, float8=dtype), _trainer_loss)
    return ["lm_head_float8"]


# --- transformers' LlamaForCausalLM -------------------------------------------------------------

def _hf_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _hf_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def hf_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' apply_rotary_pos_emb signature: q, k [B, H, S, D] (unsqueeze_dim=1) or [B, S, H, D] (2)."""
    if unsqueeze_dim == 2:
        return apply_rope(q, k, cos, sin)
    if unsqueeze_dim != 1:
        raise ValueError(f"hf_apply_rotary_pos_emb: unsqueeze_dim must be 1 or 2, got {unsqueeze_dim}")
    q_rot, k_rot = apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return q_rot.transpose(1, 2), k_rot.transpose(1, 2)


def _hf_causal_lm_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                          inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
    """LlamaForCausalLM.forward, but training with labels never builds the logits (fused linear CE)."""
    if labels is None or not self.training:
        return type(self).forward(self, input_ids=input_ids, attention_mask=attention_mask,
                                  position_ids=position_ids, past_key_values=past_key_values,
                                  inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache,
                                  logits_to_keep=logits_to_keep, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from kernels.loss_modules import causal_lm_loss

    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                         **kwargs)
    loss = causal_lm_loss(outputs.last_hidden_state, self.lm_head.weight, labels,
                          num_items_in_batch=kwargs.get("num_items_in_batch"))
    return CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=outputs.past_key_values,
                                  hidden_states=outputs.hidden_states, attentions=outputs.attentions)


def _is_hf_llama(model: nn.Module) -> bool:
    return getattr(getattr(model, "config", None), "model_type", None) == "llama"


def _patch_hf(model: nn.Module, rms: bool, rope: bool, mlp: bool, loss: bool) -> list[str]:
    from transformers.models.llama import modeling_llama

    done = []
    if rope:
        modeling_llama.apply_rotary_pos_emb = hf_apply_rotary_pos_emb
        done.append("rope")
    silu = model.config.hidden_act in ("silu", "swish")
    for module in model.modules():
        if rms and isinstance(module, modeling_llama.LlamaRMSNorm):
            module.forward = types.MethodType(_hf_rms_norm_forward, module)
            done.append("rms_norm")
        if mlp and silu and isinstance(module, modeling_llama.LlamaMLP):
            module.forward = types.MethodType(_hf_mlp_forward, module)
            done.append("swiglu")
    if loss and isinstance(model, modeling_llama.LlamaForCausalLM):
        model.forward = types.MethodType(_hf_causal_lm_forward, model)
        done.append("fused_linear_cross_entropy")
    return done


def patch(model: nn.Module, *, rms_norm: bool = True, rope: bool = True, swiglu: bool = True,
          fused_linear_cross_entropy: bool = True) -> nn.Module:
    """Swap the fused kernels into `model` in place and return it.

    `model._anvil_kernels` lists what was patched (one entry per patched site).
    Raises TypeError for a model that is neither our trainer's Llama nor a
    transformers Llama.
    """
    flags = (rms_norm, rope, swiglu, fused_linear_cross_entropy)
    if _is_trainer_llama(model):
        done = _patch_trainer(model, *flags)
    elif _is_hf_llama(model):
        done = _patch_hf(model, *flags)
    else:
        raise TypeError(f"kernels.patch: {type(model).__name__} is neither trainer.models.Transformer "
                        "nor a transformers Llama model")
    model._anvil_kernels = done
    return model
