"""FP8 linear layers for training (`precision.fp8`), through torchao's float8.

    precision.fp8: off | tensorwise | rowwise

The model's nn.Linear layers become torchao Float8Linear: each matmul casts
its two operands to float8 with a dynamic scale (one per tensor, or one per
row for `rowwise`) and runs on the FP8 tensor cores; weights, gradients and
the optimizer stay in their own precision. Left in bf16 by the filter rule
(`convert_filter`): the LM head (`lm_head`, whose logits feed the loss, and
which the fused loss kernel reads directly), and any Linear whose
in/out features are not multiples of 16 (the FP8 GEMMs need 16-aligned
dimensions). `precision.fp8_lm_head` (with --kernels) runs the head's logits
and hidden-gradient GEMMs in float8 inside the fused loss instead, per-row
scales (needs sm_90+ / MI300+).

Order (torchtitan's): build -> kernels.patch -> **convert** -> activation
checkpointing -> torch.compile -> FSDP2. With FSDP2 and `tensorwise`, the
weights are all-gathered in float8 (half the bytes of bf16) and their scales
are computed for all layers at once after each optimizer step
(`after_optimizer_step`). `rowwise` all-gathers in bf16 (torchao supports
float8 all-gather for tensorwise scales only).

Hardware: NVIDIA sm_89+ (Ada, Hopper, Blackwell) and AMD MI300-class
(gfx940/941/942: float8 e4m3fnuz/e5m2fnuz, as torchao chooses on them) and
MI350-class (gfx950: the OCP e4m3fn/e5m2 types). The AMD paths are written
from torchao's code; they have not run on an AMD GPU.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import nn


from trainer.fp8_rules import (ALIGN, NEEDS_GPU, RECIPES, ROCM_FNUZ_ARCHS, ROCM_OCP_ARCHS, SKIP_FQNS,  # noqa: F401
                               STASH_MODES, Fp8Error, enabled, stash_fits, stashes)


def check_supported(cfg, device: torch.device) -> None:
    """Raise Fp8Error unless precision.fp8 can run on `device` (no-op when fp8 is off)."""
    recipe = cfg.precision.fp8
    if cfg.precision.fp8_lm_head:
        _check_lm_head(cfg)
    if recipe == "off":
        return
    if recipe not in RECIPES:
        raise Fp8Error(f"precision.fp8={recipe!r}: expected off, {', '.join(RECIPES)}")
    if device.type != "cuda":
        raise Fp8Error(f"{NEEDS_GPU}; this run is on {device.type} "
                       f"(train.device={cfg.train.device}). Set precision.fp8=off")
    if cfg.precision.compute == "fp32":
        raise Fp8Error("precision.fp8 needs bf16 compute (the non-FP8 ops and FP8 GEMM outputs are "
                       "bf16); set precision.compute=bf16 (or auto)")
    why = gpu_unsupported_reason(device)
    if why:
        raise Fp8Error(f"{NEEDS_GPU}; {why}. Set precision.fp8=off")
    why = lm_head_unsupported_reason(device) if cfg.precision.fp8_lm_head else None
    if why:
        raise Fp8Error(f"precision.fp8_lm_head: {why}. Set precision.fp8_lm_head=false")
    try:
        import torchao.float8  # noqa: F401
    except ImportError as exc:
        raise Fp8Error(f"precision.fp8={recipe} uses torchao's float8 training, which is not "
                       f"importable here ({exc}); `pip install 'anvil[fp8]'` (torchao>=0.17 for "
                       "torch 2.11) or set precision.fp8=off") from None


def _check_lm_head(cfg) -> None:
    """precision.fp8_lm_head: the fused loss's float8 GEMMs, beside FP8 linears, on 16-aligned shapes."""
    if cfg.precision.fp8 == "off":
        raise Fp8Error("precision.fp8_lm_head needs precision.fp8 (tensorwise or rowwise) as well")
    if not cfg.train.kernels:
        raise Fp8Error("precision.fp8_lm_head runs in the fused loss: it needs --kernels (train.kernels=true)")
    m = cfg.model
    if m.vocab_size % ALIGN or m.dim % ALIGN:
        raise Fp8Error(f"precision.fp8_lm_head: the head's FP8 GEMMs need vocab_size and dim divisible by "
                       f"{ALIGN}, got {m.vocab_size} and {m.dim}")


def lm_head_unsupported_reason(device: torch.device) -> str | None:
    """None when the GPU runs rowwise-scaled FP8 GEMMs (torch._scaled_mm with per-row scales)."""
    props = torch.cuda.get_device_properties(device)
    if torch.version.hip or (props.major, props.minor) >= (9, 0):
        return None
    return f"{props.name} is sm_{props.major}{props.minor}; per-row FP8 GEMM scales need sm_90+"


def gpu_unsupported_reason(device: torch.device) -> str | None:
    """None when the GPU has FP8 tensor cores, else what it is."""
    props = torch.cuda.get_device_properties(device)
    if torch.version.hip:
        arch = getattr(props, "gcnArchName", "") or ""
        if any(a in arch for a in ROCM_FNUZ_ARCHS + ROCM_OCP_ARCHS):
            return None
        return f"{props.name} is {arch or 'an unknown gfx arch'} (FP8 training needs gfx942 / gfx950)"
    if (props.major, props.minor) >= (8, 9):
        return None
    return f"{props.name} is sm_{props.major}{props.minor}"


def float8_dtypes(device: torch.device | None = None) -> tuple[torch.dtype, torch.dtype]:
    """(forward e4m3, gradient e5m2) dtypes for this GPU, as torchao picks them.

    torchao.float8.config chooses e4m3fnuz/e5m2fnuz when it is imported on an
    MI300-class GPU (gfx940/941/942) and the OCP e4m3fn/e5m2 everywhere else
    (NVIDIA, MI350). Anvil names them explicitly, so the log says which ran.
    Not run on AMD.
    """
    if torch.version.hip and torch.cuda.is_available():
        arch = getattr(torch.cuda.get_device_properties(device or 0), "gcnArchName", "") or ""
        if any(a in arch for a in ROCM_FNUZ_ARCHS):
            return torch.float8_e4m3fnuz, torch.float8_e5m2fnuz
    return torch.float8_e4m3fn, torch.float8_e5m2


def convert_filter(module: nn.Module, fqn: str) -> bool:
    """True for the Linear layers that become Float8Linear (torchao's module_filter_fn)."""
    if not isinstance(module, nn.Linear):
        return False
    if any(fqn == s or fqn.endswith("." + s) for s in SKIP_FQNS):
        return False
    return module.in_features % ALIGN == 0 and module.out_features % ALIGN == 0


# --------------------------------------------------------------------------- torchao

def float8_config(recipe: str, fsdp: bool, device: torch.device | None = None, emulate: bool = False):
    """torchao Float8LinearConfig for `recipe`; float8 all-gather when tensorwise under FSDP2."""
    from torchao.float8 import CastConfig, Float8LinearConfig
    e4m3, e5m2 = float8_dtypes(device) if not emulate else (torch.float8_e4m3fn, torch.float8_e5m2)
    if recipe == "tensorwise":
        return Float8LinearConfig(
            cast_config_input=CastConfig(target_dtype=e4m3),
            cast_config_weight=CastConfig(target_dtype=e4m3),
            cast_config_grad_output=CastConfig(target_dtype=e5m2),
            enable_fsdp_float8_all_gather=fsdp, emulate=emulate)
    if recipe == "rowwise":
        base = Float8LinearConfig.from_recipe_name("rowwise")   # e4m3 everywhere, power-of-2 scales
        kw = {f: dataclasses.replace(getattr(base, f), target_dtype=e4m3)
              for f in ("cast_config_input", "cast_config_weight", "cast_config_grad_output")}
        # the *_for_grad_* copies were filled from the originals in __post_init__: refill them
        kw.update(cast_config_input_for_grad_weight=None, cast_config_weight_for_grad_input=None,
                  cast_config_grad_output_for_grad_weight=None)
        return dataclasses.replace(base, emulate=emulate, **kw)
    raise Fp8Error(f"precision.fp8={recipe!r}: expected off, {', '.join(RECIPES)}")


@dataclasses.dataclass
class Fp8State:
    recipe: str
    converted: list[str]
    kept: list[str]
    fsdp_float8_all_gather: bool
    dtypes: tuple[str, str]
    fused_inputs: list[str] = dataclasses.field(default_factory=list)   # kernels.patch_float8_inputs sites

    def describe(self) -> str:
        kept = ", ".join(self.kept) if self.kept else "none"
        grads = " (and its gradients)" if "swiglu_float8_grads" in self.fused_inputs else ""
        grads += "; SwiGLU keeps gate and up in float8" if "swiglu_float8_stash" in self.fused_inputs else ""
        fused = (f"; float8 inputs written by the kernels: {self.fused_inputs.count('rms_norm_float8')} RMSNorm, "
                 f"{self.fused_inputs.count('swiglu_float8')} SwiGLU{grads}" if self.fused_inputs else "")
        head = ("; the LM head's logits and hidden-gradient GEMMs in float8 (per-row scales, fused loss)"
                if "lm_head_float8" in self.fused_inputs else "")
        return (f"fp8 {self.recipe} ({self.dtypes[0]}/{self.dtypes[1]}): {len(self.converted)} Linear "
                f"layers converted, left unconverted: {kept}; FSDP float8 all-gather "
                f"{'on' if self.fsdp_float8_all_gather else 'off'}{fused}{head}")


def convert(model: nn.Module, recipe: str, fsdp: bool = False, device: torch.device | None = None,
            compile: bool = False, emulate: bool = False, fuse_inputs: bool = False, stash: bool = False,
            lm_head: bool = False, module_filter: Callable[[nn.Module, str], bool] = convert_filter) -> Fp8State:
    """Swap the model's eligible nn.Linear for torchao Float8Linear, in place.

    `fuse_inputs` (a model patched with our kernels, tensorwise): RMSNorm and
    SwiGLU then write their Float8Linear's input as float8 with its scale
    (kernels.patch_float8_inputs), instead of torchao casting their output in
    passes of its own; with `stash` (train.float8_activations), SwiGLU also keeps
    gate and up for its backward in float8. `lm_head` (precision.fp8_lm_head, a patched model): the fused
    loss runs the head's GEMMs in float8 (kernels.patch_float8_lm_head). `emulate` (tests on CPU only;
    the trainer never sets it) runs the float8 casts with high-precision matmuls, torchao's emulation mode."""
    from torchao.float8 import convert_to_float8_training

    linears = {fqn: m for fqn, m in model.named_modules() if isinstance(m, nn.Linear)}
    chosen = [fqn for fqn, m in linears.items() if module_filter(m, fqn)]
    kept = [fqn for fqn in linears if fqn not in set(chosen)]
    config = float8_config(recipe, fsdp, device, emulate)
    if recipe == "rowwise" and compile:
        # torchtitan sets this for rowwise + compile (pytorch/pytorch#150859: inductor's casts
        # otherwise round differently from eager and the power-of-2 scales drift)
        import torch._inductor.config
        torch._inductor.config.emulate_precision_casts = True
    convert_to_float8_training(model, config=config, module_filter_fn=module_filter)
    fused = []
    if fuse_inputs and recipe == "tensorwise":   # rowwise: torchao casts again along the other axis anyway
        from kernels.patch import patch_float8_inputs
        fused = patch_float8_inputs(model, stash=stash)
    e4m3 = config.cast_config_input.target_dtype
    if lm_head:
        from kernels.patch import patch_float8_lm_head
        fused += patch_float8_lm_head(model, e4m3)
    e5m2 = config.cast_config_grad_output.target_dtype
    return Fp8State(recipe, chosen, _compress(kept), bool(config.enable_fsdp_float8_all_gather),
                    (str(e4m3).removeprefix("torch.float8_"), str(e5m2).removeprefix("torch.float8_")), fused)


def after_optimizer_step(model: nn.Module, state: Fp8State | None) -> None:
    """With float8 all-gather: the next step's weight scales, for all layers in one all-reduce."""
    if state is not None and state.fsdp_float8_all_gather:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
        precompute_float8_dynamic_scale_for_fsdp(model)


def _compress(fqns: list[str]) -> list[str]:
    """'model.layers.3.mlp.x' lists shortened to one 'model.layers.*.mlp.x' entry each."""
    import re
    out: list[str] = []
    for fqn in fqns:
        short = re.sub(r"\.\d+\.", ".*.", fqn)
        if short not in out:
            out.append(short)
    return out
