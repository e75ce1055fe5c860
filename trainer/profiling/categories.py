"""Which part of a training step a GPU kernel belongs to: rules on names, CUDA's and ROCm's alike.

    category("nvjet_sm90_qqtst_128x128_128x6_2x1_v_bz_ovscale_TNT")          -> "gemm_fp8"
    category("void at::native::vectorized_elementwise_kernel<4, ...>", ["Optimizer.step#AdamW.step"])
                                                                               -> "optimizer"

A kernel's name says what it is when a library or a compiler named it for its
job (cuBLAS' nvjet, hipBLASLt's Cijk_, cuDNN's sdpa, Inductor's fused op list,
Anvil's own Triton kernels); a generic one (an elementwise kernel, a copy, a
reduction) says nothing, and the host ops that launched it do: the optimizer
step, a loss, a norm. So three kinds of rule, tried in this order, the first
match winning:

1. ``name``: the kernel's name says it (every name but Inductor's fused ones),
2. ``fused``: Inductor's generated kernels (triton_poi_/triton_red_/triton_per_fused_<ops>_<n>) are named
   after the ops they fused; the op list says it,
3. ``host``: a host op around the launch says it (any level of the stack, innermost first),

and after them the generic names that are memory traffic (copies, fills).
Anything else is ``other``. The rules are patterns over families of names,
never lists of one-off names: a new tile size or a new ROCm release names its
kernels the same way.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Sequence

#: (key, label) in the order tables show them.
CATEGORIES = (
    ("gemm", "GEMM"),
    ("gemm_fp8", "GEMM (FP8)"),
    ("attention", "attention"),
    ("norm", "normalisation"),
    ("rope", "RoPE"),
    ("activation", "activation"),
    ("loss", "loss"),
    ("fp8_cast", "FP8 casts"),
    ("optimizer", "optimizer"),
    ("communication", "communication"),
    ("memory", "memory copies"),
    ("other", "other kernels"),
)
LABELS = dict(CATEGORIES)
KEYS = tuple(key for key, _ in CATEGORIES)
#: The matrix multiplies: what a step is for; everything else is a candidate for less time.
GEMM_KEYS = ("gemm", "gemm_fp8")


@dataclass(frozen=True)
class Rule:
    category: str
    on: str          # "name" | "fused" | "host" | "generic"
    pattern: str     # a regular expression, searched case-insensitively
    why: str         # which kernels or ops, briefly

    def __post_init__(self):
        if self.category not in LABELS:
            raise ValueError(f"rule for unknown category {self.category!r}")
        object.__setattr__(self, "regex", re.compile(self.pattern, re.IGNORECASE))

    def matches(self, text: str) -> bool:
        return bool(self.regex.search(text))


# Markers of an FP8 operand in a GEMM's name: cuBLAS (e4m3/e5m2 in xmma and cutlass names; nvjet's
# operand letters, q for e4m3 and r for e5m2: "qq" forward, "qr" the backward's e5m2 gradients), hipBLASLt/Tensile (the type section after the layouts: F8, B8,
# F8B8, F8N...), fbgemm/CUTLASS rowwise (f8f8bf16), and the op's own name.
_FP8 = r"(e4m3|e5m2|fp8|float8|nvjet_sm\d+_[qr][qr]|Cijk_[A-Za-z]+_[A-Za-z]+_(F8|B8)|f8f8|_scaled_mm|scaled_gemm)"
# A GEMM's name: cuBLAS (nvjet, xmma, cutlass and ampere/sm* gemm kernels, gemv, split-K reduce and
# epilogue helpers), hipBLASLt/rocBLAS (Tensile's Cijk_), Composable Kernel, Triton/Inductor matmul
# templates, and generic gemm/matmul names.
_GEMM = (r"^(?!.*fbgemm_gpu::)"      # fbgemm's embedding helpers are no GEMMs
         r".*(gemm|gemv|nvjet|xmma|cutlass\w*tensorop|cublas|splitKreduce|epilogue::impl|Cijk_|"
         r"ck(_tile)?::\w*gemm|hipblaslt|tensile|matmul|^triton_tem_|_mm_kernel|wgmma)")

RULES: tuple[Rule, ...] = (
    # ---- names that say it
    Rule("communication", "name", r"nccl|rccl|msccl|cross_device_reduce|all_?reduce|all_?gather|reduce_?scatter"
                                  r"|all_?to_?all|sendrecv",
         "NCCL/RCCL kernels (ncclDevKernel_*, ncclKernel_*), custom all-reduce"),
    Rule("attention", "name", r"flash|fmha|sdpa|attn|attention|mha_(fwd|bwd)",
         "cuDNN SDPA, flash-attention, CUTLASS fmha, CK/aiter fmha, aotriton attn_fwd/bwd, flex attention"),
    Rule("fp8_cast", "name", r"^(?!.*(gemm|nvjet|Cijk_|xmma)).*(to_?fp8|to_?float8|float8_?(cast|quant)|quantize_?fp8"
                             r"|cast_?transpose|amax)",
         "stand-alone FP8 quantisation kernels (torchao, Transformer Engine cast/transpose, amax)"),
    Rule("gemm_fp8", "name", rf"^(?=.*{_GEMM})(?=.*{_FP8})",
         "GEMMs with FP8 operands (cuBLAS e4m3/nvjet qq, hipBLASLt F8/B8, CUTLASS f8f8, _scaled_mm)"),
    Rule("gemm", "name", _GEMM, "every other GEMM"),
    Rule("loss", "name", r"cross_?entropy|^ce_(row|split)|log_?softmax|logsumexp|nll_?loss|mse_?(loss|kernel)|flce",
         "cross-entropy kernels (Anvil's ce_row/ce_split, Liger, aten's log_softmax/nll_loss)"),
    Rule("norm", "name", r"rms_?norm|layer_?norm|RowwiseMoments|GammaBetaBackward|group_?norm|batch_?norm",
         "RMSNorm/LayerNorm kernels (Anvil's _rms_norm_*, aten's, apex/TE/aiter rmsnorm)"),
    Rule("rope", "name", r"rope|rotary", "rotary embedding kernels (Anvil's _rope_kernel, TE/aiter rotary)"),
    Rule("activation", "name", r"silu|swiglu|geglu|gelu|act_and_mul|sigmoid", "SwiGLU/SiLU/GELU kernels"),
    Rule("optimizer", "name", r"multi_tensor_apply|adam|lpnorm_cleanup|_foreach_|sgd_|lamb_",
         "optimizer kernels (torch's fused and foreach AdamW, Anvil's _adamw_kernel, clipping's norms)"),
    # ---- Inductor's fused kernels, by the ops in their names
    Rule("fp8_cast", "fused", r"_scaled_mm|abs_max|amax|float8|fp8|e4m3|e5m2",
         "casts and scales feeding an FP8 GEMM (triton_*_fused__scaled_mm__to_copy_clamp_...)"),
    Rule("loss", "fused", r"log_softmax|nll_loss|logsumexp|cross_entropy", "a compiled loss"),
    Rule("norm", "fused", r"rsqrt|rms_norm|layer_norm", "a compiled RMSNorm (mean, pow, rsqrt)"),
    Rule("activation", "fused", r"silu|sigmoid|gelu", "a compiled SwiGLU"),
    Rule("rope", "fused", r"rope|rotary|view_as_complex|view_as_real", "a compiled rotary embedding"),
    Rule("optimizer", "fused", r"_foreach|addcdiv|lerp", "a compiled optimizer step"),
    Rule("memory", "fused", r"^((_to_copy|_unsafe_view|clone|copy|cat|view|t|transpose|permute|slice|select|expand"
                            r"|unsqueeze|squeeze|split|stack|zeros|fill|full|empty|new_zeros|constant_pad_nd)_?)+$",
         "a compiled kernel that only casts, copies or lays out"),
    # ---- host ops around the launch (forward on the main thread, backward on autograd's)
    Rule("communication", "host", r"^c10d::|^nccl:|record_param_comms", "a collective"),
    Rule("optimizer", "host", r"^Optimizer\.|clip_grad|_foreach_|anvil::adamw", "the optimizer step and clipping"),
    Rule("loss", "host", r"cross_?entropy|nll_?loss|log_?softmax|mse_?loss", "the loss and its backward"),
    Rule("fp8_cast", "host", r"float8|fp8|_scaled_mm", "torchao's float8 casts"),
    Rule("norm", "host", r"rms_?norm|layer_?norm|rsqrt",
         "a norm op, or rsqrt (in a Llama block only RMSNorm uses it)"),
    Rule("rope", "host", r"rope|rotary", "the rotary embedding"),
    Rule("activation", "host", r"silu|swiglu|gelu", "the MLP's activation"),
    Rule("attention", "host", r"scaled_?dot_?product|attention", "SDPA's other kernels"),
    # ---- generic names that are memory traffic
    Rule("memory", "generic", r"memcpy|memset|copyBuffer|fillBuffer|direct_copy_kernel|CatArrayBatchedCopy"
                              r"|copy_kernel|FillFunctor",
         "copies, casts, concatenation and fills (cudaMemcpy, aten copy kernels, ROCclr copyBuffer)"),
)

_INDUCTOR = re.compile(r"^triton_(poi|red|per)_fused_?(.*?)(_\d+)?$")
ORDER = ("name", "fused", "host", "generic")


def inductor_ops(name: str) -> str | None:
    """The op list of an Inductor pointwise/reduction kernel ('triton_poi_fused_add_mul_silu_3' ->
    'add_mul_silu'), or None for any other name."""
    match = _INDUCTOR.match(name.strip())
    return match.group(2) if match else None


def category(name: str, host_ops: Sequence[str] = (), kind: str = "kernel") -> str:
    """The category key of one GPU event. `host_ops`: the host ops around its launch, innermost first;
    `kind`: the trace's event category (a gpu_memcpy or gpu_memset is memory whatever its name)."""
    return rule_for(name, host_ops, kind)[0]


def rule_for(name: str, host_ops: Sequence[str] = (), kind: str = "kernel") -> tuple[str, Rule | None]:
    """(category, the rule that decided it or None)."""
    if kind in ("gpu_memcpy", "gpu_memset"):
        return "memory", None
    ops = inductor_ops(name)
    for on in ORDER:
        for rule in RULES:
            if rule.on != on:
                continue
            if on == "name" and ops is None and rule.matches(name):
                return rule.category, rule
            if on == "fused" and ops is not None and rule.matches(ops):
                return rule.category, rule
            if on == "host" and any(rule.matches(op) for op in host_ops):
                return rule.category, rule
            if on == "generic" and rule.matches(name):
                return rule.category, rule
    return "other", None


def describe(rules: Iterable[Rule] = RULES) -> list[dict]:
    """The rules as rows (for a reader of summary.json, and the docs)."""
    return [{"category": r.category, "on": r.on, "pattern": r.pattern, "why": r.why} for r in rules]
