"""Plan before launch: parameters, FLOPs per token and the GPU memory a training run needs.

    plan = make_plan(cfg, gpus=8, nodes=1, device=Device("H100", 80, Vendor.NVIDIA))
    print(render(plan))            # tables and the verdict line; plan.to_dict() for --json

Everything is arithmetic over the config; nothing is allocated. The model is the one in
trainer/models/ as trainer/train.py and trainer/distributed.py run it, so the figures follow
their choices: what autograd saves in each block, the trainer's selective checkpointing policy,
FSDP2 as `distributed.wrap` applies it, AdamW from trainer/optim.py. The parameter count is
checked exactly against the real model, and the FLOPs per token are trainer.models'
flops_per_token (the MFU count), called, not rewritten (tests/trainer/test_plan.py).

Symbols: D dim, F ffn_dim, H heads, Dkv = n_kv_heads * head_dim, L layers, V vocab,
T seq_len, N = batch_size * T tokens per micro-batch, W the data-parallel world (gpus * nodes);
bytes: p per parameter (4 fp32, 2 bf16: precision.params), c per activation in the compute
dtype (2 bf16, 4 fp32), r of the residual stream (c under FSDP2 and with bf16 weights, where
the whole block runs in c; 4 with fp32 weights under autocast, whose residual stays fp32).

Saved for backward, per decoder layer and token (bytes):

    no checkpointing, eager modules (trainer/models/):
      RMSNorm, twice          4D + rD + 4    fp32 copy of x (kept by pow), x * rsqrt in r, rsqrt
      inputs of the linears   cD * k         the normed x; k = 1 + 1 when r == c (q/k/v share one
                                             tensor, gate/up another), k = 3 + 2 under autocast,
                                             which casts the input once per linear
      attention (SDPA)        2cD + 2cDkv    rotated q and k, v, the output (o_proj's input)
                              + 4H           logsumexp (fp32) of the flash / cuDNN kernels
      SwiGLU                  4cF            gate, up, silu(gate), silu(gate) * up
      RoPE                    0              only the [T, head_dim] cos/sin tables
    train.kernels (fused RMSNorm, RoPE, SwiGLU): RMSNorm rD + 4 (x, rstd); SwiGLU 3cF (gate, up,
      output); the rest as above
    selective (trainer.models.blocks: keep matmul and attention outputs, recompute the rest; down_proj's
      output is not kept, no backward needs it):
      rD + c(3D + 2Dkv) + 2cF + 4H           layer input; q, k, v and o_proj outputs, SDPA output
                                             and logsumexp; gate, up
    selective_lean (k, o_proj and up recomputed as well):
      rD + c(2D + Dkv) + cF + 4H             layer input; q, v; SDPA output and logsumexp; gate
    full: rD                                 the layer input only
    fp32 compute on a GPU runs SDPA's math kernel (flash needs 16-bit): 4cD + cHT per token
      instead (scaled q, k and v repeated to H heads, output, the T x T probabilities)

    precision.fp8 (Float8Linear for the layers' linears; trainer/fp8.py), no checkpointing: eager
      keeps the same 16-bit inputs (torchao saves the input before its cast); under torch.compile
      the partitioner keeps the float8 cast instead (one byte) of each input the linears share and
      nothing else needs: attention's and the MLP's normed inputs (D each, however many casts
      autocast made) and SwiGLU's output (F). Checkpointed modes keep what they kept.

    train.float8_activations (under torch.compile): with FP8 tensorwise and the fused inputs, under
      none or selective (trainer.fp8.stashes), SwiGLU keeps gate and up as float8 (F each) in place
      of what the mode kept of the MLP, and that is all (2F): neither projection is recomputed, and
      SwiGLU's float8 output, which down's backward reads, is rebuilt from the stash (under none
      through the MLP's own checkpoint region, trainer.models.MLP). Otherwise gate and up, where
      kept, are stored in float8 with a 4-byte scale per row once a whole tensor (N c F bytes)
      reaches train.float8_activations_min_mib: F + 4 each. Other saved tensors of that size (q, o)
      go the same way and are counted whole, an upper bound; the layer input, a graph input, is
      never stored in float8.

The no-checkpointing formula is exact against autograd's saved tensors on CPU (test_plan.py
counts them with saved_tensors_hooks, bf16 weights and fp32 weights under autocast).
Checkpointing adds, during each layer's backward, the recomputed rest of that one layer; with the
stash, SwiGLU's float8 output (F) is rebuilt there under none too.

With data.document_mask the layers keep what they keep causally (FlexAttention saves q, k, v, its
output and the log-sum-exp, as flash does); the mask built once a batch comes on top for the whole
step: FlexAttention's block tables (16 bytes per 128 x 128 block a row) or SDPA's additive T x T mask a row
in the compute dtype (c bytes each),
and with data.position_reset the per-row RoPE tables (2 x 4 x head_dim bytes a token).

Around the layers: the final norm and the LM head's input (4D + rD + 4 + cD per token; fused:
rD + 4); the loss. Eager `linear_cross_entropy` makes c*V logits, a fp32 copy and fp32
log-probs (kept): (c + 8) * V * N bytes in forward; its backward holds the log-probs, the NLL
gradient and the log-softmax gradient, 12 * V * N: the largest single item of a Llama 3 run
at long sequences. With train.kernels the fused linear cross-entropy never makes the logits:
a chunk of C x V (kernels.fused_linear_cross_entropy.default_chunk) plus the gradients of the
hidden states (cDN) and of the head (cVD), computed in forward; precision.fp8_lm_head adds their
float8 operands, a byte each: DN + 2VD + CV.

State: weights p, gradients p and AdamW's exp_avg + exp_avg_sq 2p per parameter (torch's
AdamW keeps its moments in the parameter's dtype: fp32 with fp32 weights, bf16 with
precision.params=bf16). Under FSDP2 (parallel.strategy fsdp and W > 1) each is the rank's dim-0
shard, ceil(rows / W) * cols per tensor, and the all-gathered copies in c come on top: the root
group through forward and backward (the final norm; with tied embeddings also the shared
embedding / LM head, and its gradient until the end of backward), an untied LM head from the
loss's forward to the end of its backward (then its fp32 reduce-scatter input on top of the
loss's gradients), the last layer (kept gathered by distributed.wrap), in backward a window of
layers: the one computing, the one prefetched, its unsharded gradients and the fp32
reduce-scatter input (reduce_dtype fp32), max(3c + 4, 2c + 8) bytes per layer parameter; and
at the end of backward the embedding's unsharded gradient with its fp32 reduce-scatter input.
With FP8 tensorwise, FSDP2 gathers the converted weights in float8 (one byte each).
Without FSDP, fp32 weights under bf16 autocast add bf16 copies of every matmul weight but the
FP8 ones (autocast's cache; autograd keeps them for backward when nothing is checkpointed), DDP a second
copy of the gradients (its buckets). With data.grad_accum > 1 the gradients live through the
next micro-batches; under FSDP2's no-sync
they are unsharded and fp32 (4 bytes per parameter of the whole model on every rank).

Peak allocated = the largest of these moments: forward end (in the loss), the loss backward
(all activations still held), the first layer's backward (head gradient, recompute, gradient
transients; eager FP8 adds its casts' two fp32 copies of the widest gradient), the end of
backward / optimizer step (weights + gradients + optimizer, plus the
root's reduce-scatter under FSDP2) and, for FSDP2 without parallel.meta_init, the full model
built on each GPU before sharding. Checked on an H200 (BENCHMARKS.md, Llama-3.2-1B, batch
4 x 4096, one GPU): eager bf16 57.3 GiB measured / 57.2 planned, --kernels 26.7 / 26.8,
--kernels with fp32 weights 40.9 / 41.0; with FP8 on an H100 and two H200s within 1.1%
(test_plan.py keeps these).

Needed = peak * (1 + fragmentation) + context + communicator. Assumptions, not measurements:
fragmentation 5% with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set by the CUDA
profile), 10% without; CUDA context 0.75 GiB, ROCm (HIP runtime and code objects) 1.0 GiB;
NCCL / RCCL buffers 1.0 GiB when W > 1. torch.compile lowers activation and loss memory
(Inductor fuses the upcast and recomputes); the plan counts eager, an upper bound there.

Tensor and context parallelism (parallel.tp, parallel.cp; trainer/models/tensor_parallel.py and
context_parallel.py): the layers' q, k, v, gate and up are split by rows over tp, o and down by columns;
the embedding, norms and LM head stay whole; FSDP2 shards what a rank holds over the W / tp data x cp
ranks. A rank computes N = batch_size * T / (cp * tp) tokens, so every per-token term above counts
those (attention's and the MLP's inner tensors hold T / cp tokens of H / tp heads and F / tp units: the
same bytes). On top: without checkpointing, the gathered inputs of attention and the MLP (2cD per
token of the T / cp, less the rank's own); under cp, the keys and values gathered from the other ranks
(2c Dkv / tp per token of the other cp ranks'), kept by every mode but full, which holds one layer's
in its backward. parallel_traffic() counts the bytes each rank sends a step.

Why one module of this size: each memory term mirrors one choice of the trainer (what autograd
saves per block, the checkpointing policy, FSDP2's shards and windows, the loss), and keeping them
side by side is what lets a reader check the plan against trainer/models/ and trainer/train.py.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

from core.vendor import Vendor
from trainer.config import ModelConfig, TrainConfig
from core.errors import UserError

GIB = 1024 ** 3
AC_MODES = ("none", "selective", "selective_lean", "full")   # most memory first
MAX_BATCH_SEARCH = 1 << 20
CONTEXT_GIB = {Vendor.NVIDIA: 0.75, Vendor.AMD: 1.0, Vendor.CPU: 0.0}   # cpu: host memory, no device context
COMM_GIB = 1.0
FRAGMENTATION = {True: 0.05, False: 0.10}


class PlanError(UserError):
    """Bad input to the planner (a GPU count, a node count): exit 2."""


@dataclass(frozen=True)
class Device:
    """The GPU planned for: its name and memory per device (None: not known)."""

    name: str | None = None
    memory_gib: float | None = None
    vendor: Vendor | None = None           # None: not known (planned as NVIDIA)
    expandable_segments: bool | None = None  # None: as the vendor's profile does (CUDA: on)
    source: str = ""                       # where memory_gib came from, for the report

    @property
    def context_gib(self) -> float:
        return CONTEXT_GIB[Vendor.parse(self.vendor or Vendor.NVIDIA)]

    @property
    def fragmentation(self) -> float:
        expandable = self.expandable_segments
        if expandable is None:
            expandable = Vendor.parse(self.vendor or Vendor.NVIDIA) is Vendor.NVIDIA
        return FRAGMENTATION[bool(expandable)]


# --------------------------------------------------------------------------- parameters

def param_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of trainer.models.Transformer, by its name in named_parameters(). Llama's are
    written out below; the other families' (and a model with multi-token prediction layers) are read off
    the model built on the meta device."""
    if m.family != "llama" or m.mtp_depth:
        if repr(m) not in _META_SHAPES:
            _META_SHAPES[repr(m)] = _meta_shapes(m)
        return dict(_META_SHAPES[repr(m)])
    q, kv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    shapes = {"model.embed_tokens.weight": (m.vocab_size, m.dim)}
    for i in range(m.n_layers):
        pre = f"model.layers.{i}."
        shapes.update({
            pre + "input_layernorm.weight": (m.dim,),
            pre + "self_attn.q_proj.weight": (q, m.dim),
            pre + "self_attn.k_proj.weight": (kv, m.dim),
            pre + "self_attn.v_proj.weight": (kv, m.dim),
            pre + "self_attn.o_proj.weight": (m.dim, q),
            pre + "post_attention_layernorm.weight": (m.dim,),
            pre + "mlp.gate_proj.weight": (m.ffn_dim, m.dim),
            pre + "mlp.up_proj.weight": (m.ffn_dim, m.dim),
            pre + "mlp.down_proj.weight": (m.dim, m.ffn_dim),
        })
    shapes["model.norm.weight"] = (m.dim,)
    if not m.tie_embeddings:   # a tied head is the embedding's tensor, listed once
        shapes["lm_head.weight"] = (m.vocab_size, m.dim)
    return shapes


_META_SHAPES: dict[str, dict] = {}   # the model config's repr -> its shapes (the plan asks many times)


def _meta_shapes(m: ModelConfig) -> dict:
    import torch

    from trainer.models import Transformer
    with torch.device("meta"):
        model = Transformer(m)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def _numel(shape) -> int:
    return math.prod(shape)


def _shard_numel(shape, world: int) -> int:
    """Elements of one rank's FSDP2 shard: dim 0 split in `world` padded chunks."""
    return -(-shape[0] // world) * _numel(shape[1:])


#: The layers' linears tensor parallelism splits by rows (ColwiseParallel) and by columns (RowwiseParallel).
TP_ROWS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
           "mlp.gate_proj.weight", "mlp.up_proj.weight")
TP_COLUMNS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def tp_shapes(shapes: dict[str, tuple[int, ...]], tp: int) -> dict[str, tuple[int, ...]]:
    """The shapes a tensor-parallel rank holds: the split linears' 1/tp, everything else whole."""
    if tp == 1:
        return shapes
    out = {}
    for name, shape in shapes.items():
        if name.endswith(TP_ROWS):
            shape = (shape[0] // tp, *shape[1:])
        elif name.endswith(TP_COLUMNS):
            shape = (shape[0], shape[1] // tp)
        out[name] = shape
    return out


def kv_gathered_bytes(cfg: TrainConfig, batch: int) -> int:
    """One layer's keys and values from the other cp ranks (trainer/models/context_parallel.py), in the
    compute dtype: this rank's kv heads (n_kv_heads / tp) for the (cp - 1) / cp of the row it does not hold."""
    m, p = cfg.model, cfg.parallel
    c = compute_bytes(cfg)
    if m.mla is not None:   # latent attention gathers whole heads: nope + rope keys and the values
        width = m.n_heads * (m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim + m.mla.v_head_dim)
    else:
        width = 2 * m.n_kv_heads * m.head_dim
    T = cfg.data.seq_len
    return c * batch * (T - T // p.cp) * width // p.tp


def parallel_traffic(cfg: TrainConfig, batch: int | None = None) -> dict[str, int]:
    """Bytes one rank sends a step for tensor and context parallelism (forward and backward, every
    micro-batch; ring collectives: a rank sends (n - 1) / n of the gathered size): tp's two all-gathers
    and two reduce-scatters of the T / cp tokens' B x D a layer each way, and the replicated weights'
    gradients all-reduced (embedding, norms, head); cp's all-gather of keys and values a layer and its
    reduce-scatter in backward. {} without either."""
    m, p, d = cfg.model, cfg.parallel, cfg.data
    batch = d.batch_size if batch is None else batch
    c = compute_bytes(cfg)
    out = {}
    if p.tp > 1:
        rows = batch * d.seq_len // p.cp
        per_layer = 4 * c * rows * m.dim * (p.tp - 1) // p.tp     # 2 gathers + 2 reduce-scatters
        whole = sum(_numel(s) for n, s in param_shapes(m).items()
                    if not n.endswith(TP_ROWS + TP_COLUMNS))
        out["tp_bytes"] = d.grad_accum * 2 * m.n_layers * per_layer + 2 * 4 * whole * (p.tp - 1) // p.tp
    if p.cp > 1:
        out["cp_bytes"] = d.grad_accum * 2 * m.n_layers * kv_gathered_bytes(cfg, batch)
    return out


def is_expert(name: str) -> bool:
    """A routed experts' stacked weight (trainer.models.moe.GroupedExperts)."""
    return ".mlp.experts." in name


def _rank_numel(name: str, shape, world: int, ep: int) -> int:
    """Elements one rank holds under FSDP2: routed experts split over the ep ranks (dim 0) and again over
    the ranks holding the same experts (dim 1, trainer.distributed); everything else as _shard_numel."""
    if is_expert(name) and ep > 1:
        return shape[0] // ep * -(-shape[1] // (world // ep)) * _numel(shape[2:])
    return _shard_numel(shape, world)


def _gathered_numel(name: str, shape, world: int, ep: int) -> int:
    """Elements FSDP2 all-gathers of a parameter for its layer's compute: this rank's experts only."""
    if is_expert(name) and ep > 1:
        return shape[0] // ep * _numel(shape[1:])
    return world * _shard_numel(shape, world)


def by_layer(shapes: dict[str, tuple[int, ...]], n_layers: int) -> list[dict[str, tuple[int, ...]]]:
    """Each decoder layer's parameters (model.layers.<i>.*), in one pass over the names."""
    layers: list[dict[str, tuple[int, ...]]] = [{} for _ in range(n_layers)]
    for name, shape in shapes.items():
        if name.startswith("model.layers."):
            layers[int(name.split(".", 3)[2])][name] = shape
    return layers


_PARAM_COUNTS: dict[str, "ParamCount"] = {}


@dataclass(frozen=True)
class ParamCount:
    total: int           # Transformer.num_params()
    non_embedding: int   # Transformer.num_params(exclude_embedding=True): flops_per_token's input
    per_layer: int
    layer_matmul: int    # one layer's linear weights (what autocast copies)
    root: int            # embedding + final norm + LM head: FSDP2's root group

    @classmethod
    def of(cls, m: ModelConfig) -> "ParamCount":
        """per_layer and layer_matmul are the largest layer's (a MoE layer's, beside dense ones)."""
        key = repr(m)      # (train.plan's layout search asks for the same model a thousand times)
        if key not in _PARAM_COUNTS:
            _PARAM_COUNTS[key] = cls._count(m)
        return _PARAM_COUNTS[key]

    @classmethod
    def _count(cls, m: ModelConfig) -> "ParamCount":
        shapes = param_shapes(m)
        total = sum(_numel(s) for s in shapes.values())
        layers = [list(layer.values()) for layer in by_layer(shapes, m.decoder_layers)]
        largest = max(layers, key=lambda layer: sum(_numel(s) for s in layer))
        embed = m.vocab_size * m.dim
        return cls(total=total, non_embedding=total if m.tie_embeddings else total - embed,
                   per_layer=sum(_numel(s) for s in largest),
                   layer_matmul=sum(_numel(s) for s in largest if len(s) >= 2),
                   root=total - sum(_numel(s) for layer in layers for s in layer))


# --------------------------------------------------------------------------- activations

@dataclass(frozen=True)
class Dtypes:
    p: int          # bytes per parameter
    c: int          # bytes per activation in the compute dtype
    r: int          # bytes per element of the residual stream
    fsdp: bool
    ddp: bool

    @property
    def casts(self) -> bool:
        """Autocast: fp32 residual and weights, each linear casts its input (and weight) to c."""
        return self.r != self.c


def compute_bytes(cfg: TrainConfig) -> int:
    """Bytes of an activation in the compute dtype on a GPU (auto is bf16 there)."""
    return 4 if cfg.precision.compute == "fp32" else 2


def dtypes(cfg: TrainConfig, world: int) -> Dtypes:
    p = 2 if cfg.precision.params == "bf16" else 4
    c = compute_bytes(cfg)
    fsdp = cfg.parallel.strategy == "fsdp" and world > 1
    ddp = cfg.parallel.strategy == "ddp" and world > 1
    if fsdp:
        return Dtypes(p, c, c, True, False)      # MixedPrecisionPolicy(param_dtype=c) casts all
    if p == 2:
        return Dtypes(2, 2, 2, False, ddp)       # bf16 weights: no autocast, all bf16
    return Dtypes(4, c, 4, False, ddp)          # fp32 weights, autocast to c (or plain fp32)


@dataclass(frozen=True)
class Fp8:
    """What precision.fp8 changes in the plan: which of a layer's linears are Float8Linear
    (trainer.fp8.convert_filter's rule), whether torch.compile runs them, whether FSDP2 gathers
    their weights in float8."""

    recipe: str
    compiled: bool
    attn_in: bool          # q, k, v converted: their shared input can be kept in float8
    mlp_in: bool           # gate, up converted
    down: bool             # down_proj converted: SwiGLU's output can be kept in float8
    converted: int         # elements of one layer's converted weights
    widest_out: int        # the largest output width of a converted linear (its gradient is cast)
    gather: bool           # FSDP2 all-gathers the converted weights in float8 (tensorwise)


def fp8_layout(cfg: TrainConfig, dt: Dtypes) -> Fp8 | None:
    """The Fp8 of cfg, or None with precision.fp8 off."""
    recipe = cfg.precision.fp8
    if recipe == "off":
        return None
    from trainer.fp8_rules import ALIGN   # the alignment rule of trainer.fp8.convert_filter
    pre = "model.layers.0."
    # One layer's linears, {"q_proj": (out, in), ...}: the 2-D weights of param_shapes.
    linears = {n[len(pre):].split(".")[1]: s for n, s in param_shapes(cfg.model).items()
               if n.startswith(pre) and len(s) == 2}
    ok = {name: out % ALIGN == 0 and inp % ALIGN == 0 for name, (out, inp) in linears.items()}
    return Fp8(recipe, bool(cfg.train.compile), ok["q_proj"] and ok["k_proj"] and ok["v_proj"],
               ok["gate_proj"] and ok["up_proj"], ok["down_proj"],
               sum(_numel(s) for name, s in linears.items() if ok[name]),
               max((s[0] for name, s in linears.items() if ok[name]), default=0),
               dt.fsdp and recipe == "tensorwise")


@dataclass(frozen=True)
class Float8Acts:
    """What train.float8_activations changes in the plan (trainer/saved_activations.py)."""

    stash: bool            # SwiGLU can keep gate and up in float8 itself (FP8 tensorwise, fused inputs),
                           # which it does under the modes of trainer.fp8.STASH_MODES
    wide: bool             # else: gate and up (N x F each) reach the size the partitioner stores


def float8_acts(cfg: TrainConfig, dt: Dtypes, fp8: Fp8 | None, n_tokens: int) -> Float8Acts | None:
    """The Float8Acts of cfg at n_tokens a micro-batch, or None with the setting off."""
    t = cfg.train
    if not t.float8_activations:
        return None
    from trainer.fp8_rules import stash_fits
    stash = bool(stash_fits(cfg) and fp8 and fp8.mlp_in and fp8.down)
    return Float8Acts(stash, n_tokens * dt.c * cfg.model.ffn_dim >= t.float8_activations_min_mib * 2 ** 20)


def _stash_on(f8: Float8Acts | None, mode: str) -> bool:
    """Whether SwiGLU keeps gate and up as its own float8 stash under this checkpointing mode."""
    from trainer.fp8_rules import STASH_MODES
    return bool(f8 and f8.stash and mode in STASH_MODES)


def layer_activation_bytes(m: ModelConfig, seq_len: int, mode: str, dt: Dtypes,
                           kernels: bool = False, fp8: Fp8 | None = None, f8: Float8Acts | None = None) -> int:
    """Bytes one decoder layer keeps for backward per token (the module docstring's table)."""
    D, F, H = m.dim, m.ffn_dim, m.n_heads
    Dkv = m.n_kv_heads * m.head_dim
    c, r = dt.c, dt.r
    flash = c == 2
    stash = _stash_on(f8, mode)
    gate_up = (F + 4) if f8 and f8.wide and not stash else c * F      # gate's or up's bytes when kept
    if mode == "full":
        return r * D
    if mode in ("selective", "selective_lean"):
        attn = c * D + 4 * H if flash else 0      # the math kernel's ops are not in _SAVE_OPS
        mlp = 2 * F if stash else (2 if mode == "selective" else 1) * gate_up   # stash: SwiGLU's output rebuilt
        if mode == "selective":
            return r * D + c * (2 * D + 2 * Dkv) + attn + mlp
        return r * D + c * (D + Dkv) + attn + mlp
    if mode != "none":
        raise PlanError(f"activation checkpointing {mode!r}: expected one of {', '.join(AC_MODES)}")
    norms = 2 * (r * D + 4) if kernels else 2 * (4 * D + r * D + 4)
    attn_in = c * D * (3 if dt.casts else 1)     # autocast casts the input once per linear
    mlp_in = c * D * (2 if dt.casts else 1)
    if flash:
        attn = 2 * c * D + 2 * c * Dkv + 4 * H
    else:
        attn = 4 * c * D + c * H * seq_len
    mlp = (3 if kernels else 4) * c * F - 2 * (c * F - gate_up)
    if fp8 and fp8.compiled:
        # Inductor's partitioner keeps a Float8Linear's input as its float8 cast (one byte), once per
        # input the linears share, where nothing else needs the 16-bit tensor: the normed inputs of
        # attention and the MLP, and SwiGLU's output. o_proj's input is SDPA's output, kept anyway.
        attn_in = D if fp8.attn_in else attn_in
        mlp_in = D if fp8.mlp_in else mlp_in
        mlp -= (c - 1) * F if fp8.down else 0
    if stash:
        mlp = 2 * F     # gate and up in float8 (the stash); SwiGLU's output for down rebuilt from it
    return norms + attn_in + mlp_in + attn + mlp


def family_layer_bytes(m: ModelConfig, layer_id: int, mode: str, dt: Dtypes) -> int:
    """Bytes a layer of another family than Llama keeps for backward per token (latent attention, a
    norm on each query and key head, experts): an estimate by layer_activation_bytes' rules (what each
    op saves), not yet held against a measured run. Selective checkpointing keeps every matmul's output
    there (trainer.models.blocks.KEEP_EVERY_MATMUL) and recomputes the rest."""
    D, H, c, r = m.dim, m.n_heads, dt.c, dt.r
    if mode == "full":
        return r * D
    if m.mla is not None:
        a = m.mla
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        latents = (a.q_lora_rank if a.q_lora_rank else 0) + a.kv_lora_rank + a.qk_rope_head_dim
        matmuls = c * (latents + H * qk + H * (a.qk_nope_head_dim + a.v_head_dim) + H * a.v_head_dim)
        elementwise = 4 * (a.q_lora_rank + a.kv_lora_rank) + 2 * c * H * qk     # latent norms' fp32 inputs, q and k
    else:
        q, kv = H * m.head_dim, m.n_kv_heads * m.head_dim
        matmuls = c * (q + 2 * kv + q)
        elementwise = 4 * (q + kv) + c * (q + kv) if m.family == "qwen3_moe" else c * (q + kv)
    attn = c * D + matmuls + 4 * H                                  # its input, SDPA's log-sum-exp
    if m.moe_layer(layer_id):
        e = m.moe
        rows = e.top_k * (c * D + c * 2 * e.ffn_dim + c * D + 4)    # permuted input, gate and up, down, weight
        ffn_matmuls = c * D + rows + 4 * e.n_routed_experts + (c * 3 * e.ffn_dim * e.n_shared_experts)
        ffn_elementwise = e.top_k * c * e.ffn_dim + (c * e.ffn_dim * e.n_shared_experts) + 4 * 2 * e.n_routed_experts
    else:
        ffn_matmuls = c * D + 3 * c * m.ffn_dim
        ffn_elementwise = c * m.ffn_dim
    norms = 2 * (4 * D + r * D + 4)
    if mode in ("selective", "selective_lean"):
        return r * D + attn + ffn_matmuls
    return norms + attn + elementwise + ffn_matmuls + ffn_elementwise


def _layers_bytes(m: ModelConfig, seq_len: int, mode: str, dt: Dtypes, kernels: bool, fp8, f8) -> tuple[int, int]:
    """(bytes per token all layers keep, the largest layer's): Llama's exact rule, the others' estimate."""
    if m.family == "llama":
        one = layer_activation_bytes(m, seq_len, mode, dt, kernels, fp8, f8)
        return m.decoder_layers * one, one
    each = [family_layer_bytes(m, i, mode, dt) for i in range(m.decoder_layers)]
    return sum(each), max(each)


def _flce_chunk(n_tokens: int, m: ModelConfig) -> tuple[int, str]:
    """Tokens per chunk of the fused linear cross-entropy, as kernels computes it."""
    try:
        from kernels.fused_linear_cross_entropy import default_chunk
    except Exception as exc:  # no Triton here: plan with the whole batch as one chunk (upper bound)
        return n_tokens, f"kernels not importable ({type(exc).__name__}): loss chunk taken as all tokens"
    return default_chunk(n_tokens, m.dim, m.vocab_size), ""


# --------------------------------------------------------------------------- memory

@dataclass
class Term:
    key: str
    label: str
    bytes: int
    note: str = ""

    @property
    def gib(self) -> float:
        return self.bytes / GIB


@dataclass
class Moment:
    key: str
    label: str
    terms: list[Term]

    @property
    def bytes(self) -> int:
        return sum(t.bytes for t in self.terms)


@dataclass
class Memory:
    """Per-GPU memory of one configuration at one batch size and checkpointing mode."""

    batch_size: int
    mode: str
    state: list[Term]          # weights, gradients, optimizer (always shown)
    moments: list[Moment]
    activations: int           # all layers, this mode
    device: Device
    notes: list[str] = field(default_factory=list)

    @property
    def peak(self) -> Moment:
        return max(self.moments, key=lambda mo: mo.bytes)

    @property
    def peak_bytes(self) -> int:
        return self.peak.bytes

    @property
    def fragmentation_bytes(self) -> int:
        return int(self.peak_bytes * self.device.fragmentation)

    def overhead_bytes(self, world: int) -> int:
        return int((self.device.context_gib + (COMM_GIB if world > 1 else 0.0)) * GIB)

    def needed_bytes(self, world: int) -> int:
        return self.peak_bytes + self.fragmentation_bytes + self.overhead_bytes(world)

    def fits(self, world: int) -> bool | None:
        if not self.device.memory_gib:
            return None
        return self.needed_bytes(world) <= self.device.memory_gib * GIB


def _gib(x: float) -> str:
    return f"{x / GIB:.2f}"


def _count(x: float) -> str:
    """8.03e9 -> '8.03 G', 57.9e9 -> '57.91 G' (SI prefixes, for parameters and FLOPs)."""
    for prefix, scale in (("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.2f} {prefix}"
    return f"{x:.0f} "


def memory(cfg: TrainConfig, world: int, device: Device, batch_size: int | None = None,
           mode: str | None = None) -> Memory:
    """Per-GPU memory of `cfg` on `world` data-parallel ranks (the module docstring's model)."""
    m = cfg.model
    batch = cfg.data.batch_size if batch_size is None else batch_size
    mode = mode or cfg.train.activation_checkpoint
    kernels = cfg.train.kernels
    dt = dtypes(cfg, world)
    fp8 = fp8_layout(cfg, dt)
    p, c = dt.p, dt.c
    tp, cp = cfg.parallel.tp, cfg.parallel.cp
    shapes = tp_shapes(param_shapes(m), tp)
    world //= tp   # FSDP2 shards over the data x cp ranks; tp splits the shapes themselves
    count = ParamCount.of(m)
    held = sum(_numel(s) for s in shapes.values())   # parameters a rank holds before FSDP2 (count.total / tp-ish)
    ep = cfg.parallel.ep if dt.fsdp else 1
    T = cfg.data.seq_len
    N = batch * T // (cp * tp)   # the tokens a rank computes
    V, D, L = m.vocab_size, m.dim, m.decoder_layers   # (multi-token prediction's layers are layers)
    notes: list[str] = []

    # State: full on every rank, or the rank's FSDP2 shard.
    local = sum(_rank_numel(n, s, world, ep) for n, s in shapes.items()) if dt.fsdp else count.total
    share = f", 1/{world} shard" if dt.fsdp else ""
    pname = "fp32" if p == 4 else "bf16"
    weights = Term("weights", f"weights ({pname}{share})", p * local, f"{count.total:,} parameters")
    grads = Term("gradients", f"gradients ({pname}{share})", p * local,
                 "live from the backward on, as activations are freed")
    optim = Term("optimizer", f"optimizer: AdamW exp_avg + exp_avg_sq ({pname}{share})", 2 * p * local)

    # Activations and the loss.
    f8 = float8_acts(cfg, dt, fp8, N)
    all_layers, per_token_layer = _layers_bytes(m, T, mode, dt, kernels, fp8, f8)
    none_layer = _layers_bytes(m, T, "none", dt, kernels, fp8, f8)[1]
    acts = N * all_layers
    gathered_acts = 0
    if tp > 1 and mode == "none":   # attention's and the MLP's gathered inputs, beyond the rank's own tokens
        gathered_acts += L * 2 * c * D * N * (tp - 1)
    if cp > 1 and mode != "full":   # the other cp ranks' keys and values, kept for attention's backward
        gathered_acts += L * kv_gathered_bytes(cfg, batch)
    acts += gathered_acts
    act_term = Term("activations", f"activations ({L} layers, checkpointing {mode})", acts,
                    f"{all_layers // L:,} B per token per layer x {N:,} tokens" + ("" if m.family == "llama" else
                    f" (the largest layer {per_token_layer:,} B; {m.family}: estimated)")
                    + (f" + {_gib(gathered_acts)} gathered over tp / cp" if gathered_acts else ""))
    if kernels:
        final = Term("final", "final norm", N * (dt.r * D + 4))
        chunk, why = _flce_chunk(N, m)
        if why:
            notes.append(why)
        gx, gw = c * N * D, c * V * D
        head_cast = c * N * D if dt.casts else 0
        # precision.fp8_lm_head: hidden, the weight twice (per row, per column) and a chunk's gradient
        # in float8, one byte each, for the length of the loss
        head_f8 = N * D + 2 * V * D + min(chunk, N) * V if fp8 and cfg.precision.fp8_lm_head else 0
        ahead = m.mtp_depth * (gx + gw)   # each prediction depth's loss keeps its own two gradients
        loss_fwd = Term("loss", "loss: fused linear cross-entropy (forward)",
                        c * min(chunk, N) * V + gx + gw + head_cast + head_f8 + ahead,
                        f"chunk {min(chunk, N):,} x {V:,} + grad of hidden and head"
                        + (" + float8 operands of the head" if head_f8 else "")
                        + (f", x {1 + m.mtp_depth} with multi-token prediction" if ahead else ""))
        loss_bwd = Term("loss", "loss: fused linear cross-entropy (backward)",
                        gx + gw + ahead + (p * V * D if (p != c and not dt.fsdp) else 0),
                        "grad of hidden and head, computed in forward")
    else:
        final = Term("final", "final norm + LM head input", N * (4 * D + dt.r * D + 4 + c * D))
        fwd_per = (8 if c == 4 else c + 8) * V
        ahead = m.mtp_depth * 4 * N * V   # each prediction depth's loss keeps its log-probs for backward
        loss_fwd = Term("loss", "loss: logits (forward)", N * fwd_per + ahead,
                        f"{'' if c == 4 else 'bf16 logits + '}fp32 logits + log-probs, {N:,} x {V:,}"
                        + (f", and the log-probs of {m.mtp_depth} prediction depth(s)" if ahead else ""))
        loss_bwd = Term("loss", "loss: logits (backward)", 12 * N * V,
                        f"log-probs + 2 fp32 gradients, 12 B x {N:,} tokens x {V:,} vocab")
    recompute = (none_layer - per_token_layer) * N
    if _stash_on(f8, mode):
        recompute += N * m.ffn_dim     # SwiGLU's float8 output, rebuilt from the stash under none too
    transient = N * (3 * c * m.ffn_dim + 2 * c * D)
    if cp > 1 and mode == "full":   # the layer's gathered keys and values, rebuilt for its backward
        transient += kv_gathered_bytes(cfg, batch)
    if m.moe is not None:   # a MoE layer's gradients: its top_k rows of gate, up and their SwiGLU, and the input
        transient = max(transient, N * (m.moe.top_k * (3 * c * m.moe.ffn_dim + 2 * c * D) + 2 * c * D))
    # Eager float8 casts (torchao: x.float() * scale, then a clamp) hold two fp32 copies of the
    # tensor they cast; the largest is a gradient of the widest converted output. Inductor fuses them.
    casts = 8 * N * fp8.widest_out if fp8 and not fp8.compiled else 0
    layer_work = Term("layer_bwd", "one layer's backward: recompute + activation gradients",
                      recompute + transient + casts,
                      (f"recompute {_gib(recompute)} + " if recompute else "") + f"grads {_gib(transient)}"
                      + (f" + eager float8 casts {_gib(casts)}" if casts else ""))

    # What comes on top of the state, by strategy.
    shared: list[Term] = []          # at every moment from forward to the end of backward
    fwd_extra: list[Term] = []
    bwd_extra: list[Term] = []
    layer_extra: list[Term] = []
    end_extra: list[Term] = []
    if ep > 1:   # the rows a MoE layer sends to its experts' ranks and receives: both buffers
        a2a = Term("all_to_all", f"expert parallelism: all-to-all buffers (ep {ep})",
                   2 * N * m.moe.top_k * D * c, f"{N:,} tokens x top_k {m.moe.top_k} rows, sent and received")
        fwd_extra.append(a2a)
        layer_extra.append(a2a)
    if dt.fsdp:
        layer_numel = max(sum(_gathered_numel(n, s, world, ep) for n, s in layer.items())
                          for layer in by_layer(shapes, L))
        # Bytes of one gathered layer: float8 for the converted weights under float8 all-gather.
        f8_numel = fp8.converted if fp8 and fp8.gather else 0
        layer_gathered = c * layer_numel - (c - 1) * f8_numel
        def gathered_numel(name: str) -> int:
            return world * _shard_numel(shapes[name], world) if name in shapes else 0
        outer_numel = sum(gathered_numel(n) for n in shapes if not n.startswith("model.layers."))
        # distributed.wrap: an untied head and the embedding are groups of their own; tied, they are
        # one tensor in the root group with the final norm.
        head_numel = 0 if m.tie_embeddings else gathered_numel("lm_head.weight")
        embed_numel = 0 if m.tie_embeddings else gathered_numel("model.embed_tokens.weight")
        root_numel = outer_numel - head_numel - embed_numel
        root = Term("fsdp_root", "FSDP2 root all-gathered (final norm)" if head_numel else
                    "FSDP2 root all-gathered (embedding, norm, LM head)", c * root_numel)
        f8_note = "float8 all-gather of the FP8 linears' weights" if f8_numel else ""
        if cfg.parallel.reshard_after_forward:
            gathered = Term("fsdp_layers", "FSDP2 last layer all-gathered", layer_gathered,
                            "distributed.wrap keeps it for backward" + (f"; {f8_note}" if f8_note else ""))
        else:
            gathered = Term("fsdp_layers", "FSDP2 layers all-gathered (reshard_after_forward off)",
                            layer_gathered * L, f8_note)
        grad_rs = (c + 4) * layer_numel            # unsharded gradients + fp32 reduce-scatter input
        window = Term("fsdp_window", "FSDP2 backward window (gathered, prefetched, grads, reduce-scatter)",
                      max(2 * layer_gathered + grad_rs, layer_gathered + grad_rs + 4 * layer_numel)
                      + (layer_gathered * L if not cfg.parallel.reshard_after_forward else 0), f8_note)
        shared.append(root)
        fwd_extra.append(gathered)
        bwd_extra.append(gathered)
        if head_numel:
            # Gathered from the loss's forward through its backward; its gradient is reduced right
            # after the loss backward (fp32 reduce-scatter input on top of the loss's gradient).
            head = Term("fsdp_head", "FSDP2 LM head all-gathered (a group of its own)", c * head_numel)
            fwd_extra.append(head)
            bwd_extra.append(head)
            if kernels:   # (the eager loss's logit gradients are gone by then, and larger)
                bwd_extra.append(Term("fsdp_head_rs", "FSDP2 LM head: fp32 reduce-scatter input", 4 * head_numel))
        else:
            layer_extra.append(Term("head_grad", "LM head gradient, unsharded until the root's reduce-scatter",
                                    c * V * D))
        layer_extra.append(window)
        # The embedding's (or the root's) gradients are reduce-scattered last, after its parameters
        # were resharded; the first layer's fp32 reduce-scatter input may still be in flight.
        last_numel = root_numel + embed_numel
        end_extra.append(Term("fsdp_root_rs", "FSDP2 embedding and root: unsharded gradients + fp32 "
                              "reduce-scatter input", (c + 4) * last_numel + 4 * layer_numel,
                              "and the first layer's reduce-scatter input"))
        if cfg.data.grad_accum > 1:
            shared.append(Term("carry", "gradients between micro-batches (FSDP2 no-sync: unsharded fp32)",
                               4 * held, f"data.grad_accum {cfg.data.grad_accum}"))
            notes.append("FSDP2 accumulates unsharded fp32 gradients of the whole model between "
                         "micro-batches (set_requires_gradient_sync(False)); data.grad_accum 1 with a "
                         "larger batch_size avoids that")
    else:
        if dt.casts:
            # Float8Linear casts its fp32 weight to float8 itself: autocast copies only the others.
            cast_matmul = count.layer_matmul - (fp8.converted if fp8 else 0)
            copies_all = c * (L * cast_matmul + V * D)
            copies_saved = (c * L * cast_matmul if mode == "none" else 0) + (0 if kernels else c * V * D)
            fwd_extra.append(Term("copies", "bf16 weight copies (autocast cache)", copies_all,
                                  "fp32 weights cast for bf16 matmuls"))
            if copies_saved:
                label = ("bf16 weight copies saved for backward" if mode == "none"
                         else "bf16 LM head copy saved for backward")
                bwd_extra.append(Term("copies", label, copies_saved))
            if mode == "none" and cast_matmul:   # the LM head's copy is gone once the loss backward ran
                layer_extra.append(Term("copies", "bf16 layer weight copies saved for backward",
                                        c * L * cast_matmul))
        layer_extra.append(Term("head_grad", "LM head gradient", p * V * D))
        if dt.ddp:
            buckets = Term("ddp", "DDP gradient buckets (a second copy of the gradients)", p * held)
            shared.append(buckets)
            end_extra.append(buckets)
        if cfg.data.grad_accum > 1:
            shared.append(Term("carry", "gradients between micro-batches", p * held,
                               f"data.grad_accum {cfg.data.grad_accum}"))

    mask = attention_mask_term(cfg, batch, device)
    if mask is not None:
        shared.append(mask)
    base = [weights, optim]
    moments = [
        Moment("forward", "forward end (loss forward)",
               base + shared + fwd_extra + [act_term, final, loss_fwd]),
        Moment("loss_backward", "loss backward",
               base + shared + bwd_extra + [act_term, final, loss_bwd]),
        Moment("layer_backward", "first layer's backward",
               base + shared + layer_extra + [act_term, layer_work]),
        Moment("step", "end of backward / optimizer step",
               base + [grads] + end_extra),
    ]
    if dt.fsdp and not cfg.parallel.meta_init:
        moments.append(Moment("init", "model built on each GPU before sharding (meta_init off)",
                              [Term("init", "full model on each GPU", p * held,
                                    "parallel.meta_init=true builds it on the meta device")]))
    if c == 4:
        notes.append("fp32 compute: SDPA runs its math kernel (flash needs bf16/fp16), which keeps "
                     "T x T attention probabilities per head")
    return Memory(batch, mode, [weights, grads, optim], moments, acts, device, notes)


def attention_kernel(cfg: TrainConfig, device: Device) -> str:
    """The kernel train.attention picks on the planned device (trainer.train.attention_kernel's rule)."""
    if cfg.train.attention != "auto":
        return cfg.train.attention
    return "sdpa" if device.vendor is not None and Vendor.parse(device.vendor) is Vendor.CPU else "flex"


def attention_mask_term(cfg: TrainConfig, batch: int, device: Device) -> Term | None:
    """The mask built once a batch for every layer (trainer/models/masking.py), with data.document_mask:
    FlexAttention's block mask (four int32 tables of 128 x 128 blocks a row: kept and partly kept
    blocks, forward and backward) or SDPA's additive T x T mask a row in the compute dtype (fp32 on the
    CPU); and RoPE's tables read at restarting
    positions (cos and sin, fp32, per row). Under cp, the rank's queries against every key, documents or
    not (a split row's places are not in order). None without document masking or cp."""
    d, m = cfg.data, cfg.model
    if not d.document_mask and cfg.parallel.cp == 1:
        return None
    T = d.seq_len
    Tq = T // cfg.parallel.cp   # under cp the rank's queries against every key
    kernel = attention_kernel(cfg, device)
    if kernel == "flex":
        blocks, q_blocks = -(-T // 128), -(-Tq // 128)
        mask, what = 16 * batch * q_blocks * blocks, f"FlexAttention block mask, {q_blocks} x {blocks} blocks a row"
    else:
        cpu = device.vendor is not None and Vendor.parse(device.vendor) is Vendor.CPU
        c = 4 if cfg.precision.compute == "fp32" or cpu else 2
        mask, what = c * batch * Tq * T, f"SDPA additive mask, {Tq:,} x {T:,} a row, {c} bytes each"
    tables = 2 * 4 * batch * Tq * m.head_dim if d.position_reset else 0
    what_for = "attention inside documents" if d.document_mask else "context parallelism's attention"
    return Term("attention_mask", f"{what_for}: mask" + (" + RoPE tables" if tables else ""),
                mask + tables, what + (", positions restart per document" if tables else ""))


# --------------------------------------------------------------------------- the plan

@dataclass
class Plan:
    cfg: TrainConfig
    config_path: str
    gpus: int
    nodes: int
    device: Device
    params: ParamCount
    flops_per_token: int
    memory: Memory                      # at the config's batch and checkpointing mode
    by_mode: dict[str, Memory]          # the config's batch under each mode
    max_batch: dict[str, int | None]    # largest data.batch_size that fits, per mode
    hints: list[str]

    @property
    def world(self) -> int:
        return self.gpus * self.nodes

    @property
    def fits(self) -> bool | None:
        return self.memory.fits(self.world)

    @property
    def strategy(self) -> str:
        dt = dtypes(self.cfg, self.world)
        p = self.cfg.parallel
        layout = f" (data {self.world // p.model_ranks} x cp {p.cp} x tp {p.tp})" if p.model_ranks > 1 else ""
        if dt.fsdp:
            return f"FSDP2 over {self.world // p.tp} ranks" + layout
        if dt.ddp:
            return f"DDP over {self.world} ranks" + layout
        if self.cfg.parallel.strategy == "fsdp":
            return "one process (parallel.strategy fsdp needs 2+ GPUs: nothing is sharded)"
        return "one process"

    @property
    def tokens_per_step(self) -> int:
        d = self.cfg.data
        return d.batch_size * d.seq_len * d.grad_accum * (self.world // self.cfg.parallel.model_ranks)

    def verdict(self) -> str:
        mem, world = self.memory, self.world
        need = mem.needed_bytes(world) / GIB
        where = f"{self.gpus} x {self.device.name}" + (f" x {self.nodes} nodes" if self.nodes > 1 else "")
        batch = f"data.batch_size {mem.batch_size}, checkpointing {mem.mode}"
        if self.fits is None:
            return (f"NO GPU TO CHECK: needs {need:.1f} GiB per GPU ({batch}); name one with "
                    f"--gpu MODEL (e.g. --gpu H100)")
        total = self.device.memory_gib
        if self.fits:
            best = ", ".join(f"{b} ({mo})" for mo, b in self.max_batch.items())
            return (f"FITS on {where}: needs {need:.1f} of {total:g} GiB per GPU ({need / total:.0%}) "
                    f"at {batch}; largest data.batch_size: {best}")
        line = (f"DOES NOT FIT on {where}: needs {need:.1f} of {total:g} GiB per GPU "
                f"({need / total:.0%}) at {batch}")
        return line + (f"; would fit with {' | '.join(self.hints)}" if self.hints else "")

    def to_dict(self) -> dict:
        mem, world = self.memory, self.world

        def terms(ts):
            return [{"key": t.key, "label": t.label, "bytes": t.bytes, "gib": round(t.gib, 3),
                     "note": t.note} for t in ts]

        return {
            "config": self.config_path, "name": self.cfg.name,
            "model": {"name": self.cfg.model.name, "params": self.params.total,
                      "params_non_embedding": self.params.non_embedding,
                      "flops_per_token": self.flops_per_token,
                      "layers": self.cfg.model.n_layers, "dim": self.cfg.model.dim,
                      "vocab_size": self.cfg.model.vocab_size},
            "run": {"gpus": self.gpus, "nodes": self.nodes, "world_size": world,
                    "strategy": self.strategy, "params_dtype": self.cfg.precision.params,
                    "compute_dtype": "fp32" if self.cfg.precision.compute == "fp32" else "bf16",
                    "batch_size": mem.batch_size, "seq_len": self.cfg.data.seq_len,
                    "grad_accum": self.cfg.data.grad_accum, "tokens_per_step": self.tokens_per_step,
                    "tp": self.cfg.parallel.tp, "cp": self.cfg.parallel.cp,
                    "traffic_bytes_per_step": parallel_traffic(self.cfg, mem.batch_size),
                    "activation_checkpoint": mem.mode, "kernels": self.cfg.train.kernels,
                    "compile": self.cfg.train.compile, "document_mask": self.cfg.data.document_mask,
                    "position_reset": self.cfg.data.position_reset,
                    "attention": attention_kernel(self.cfg, self.device) if self.cfg.data.document_mask
                    else "sdpa_causal"},
            "device": {"name": self.device.name, "memory_gib": self.device.memory_gib,
                       "vendor": self.device.vendor, "source": self.device.source},
            "memory": {
                "state": terms(mem.state),
                "peak_moment": mem.peak.key,
                "peak_terms": terms(mem.peak.terms),
                "moments_gib": {mo.key: round(mo.bytes / GIB, 3) for mo in mem.moments},
                "peak_allocated_gib": round(mem.peak_bytes / GIB, 3),
                "fragmentation_gib": round(mem.fragmentation_bytes / GIB, 3),
                "context_and_comm_gib": round(mem.overhead_bytes(world) / GIB, 3),
                "needed_gib": round(mem.needed_bytes(world) / GIB, 3),
                "device_gib": self.device.memory_gib,
            },
            "activation_checkpointing": [
                {"mode": mo, "activations_gib": round(m.activations / GIB, 3),
                 "needed_gib": round(m.needed_bytes(world) / GIB, 3), "fits": m.fits(world),
                 "max_batch_size": self.max_batch.get(mo)}
                for mo, m in self.by_mode.items()],
            "fits": self.fits,
            "hints": self.hints,
            "notes": self.notes,
            "verdict": self.verdict(),
        }

    @property
    def notes(self) -> list[str]:
        notes = list(self.memory.notes)
        fp8 = fp8_layout(self.cfg, dtypes(self.cfg, self.world))
        if self.cfg.train.compile:
            notes.append("torch.compile: planned as eager, an upper bound (Inductor fuses the loss "
                         "upcast and recomputes cheap ops)")
        if self.cfg.train.float8_activations:
            notes.append("train.float8_activations: gate and up counted in float8 (SwiGLU's stash with FP8 "
                         "and the fused inputs, else where they reach "
                         f"{self.cfg.train.float8_activations_min_mib:g} MiB); smaller saved tensors of "
                         "that size counted whole, an upper bound")
        if fp8:
            notes.append(f"precision.fp8 {fp8.recipe}: "
                         + ("weights all-gathered in float8; " if fp8.gather else "")
                         + ("the FP8 linears' inputs kept in float8 for backward (as Inductor does)"
                            if fp8.compiled else "eager: the linears' 16-bit inputs kept and each float8 "
                            "cast holds two fp32 copies; train.compile keeps the inputs in float8"))
        return notes


def _largest_batch(cfg: TrainConfig, world: int, device: Device, mode: str) -> int | None:
    if not device.memory_gib:
        return None

    def fits(b: int) -> bool:
        return bool(memory(cfg, world, device, b, mode).fits(world))

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= MAX_BATCH_SEARCH and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, MAX_BATCH_SEARCH + 1)
    while hi - lo > 1:   # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def with_changes(cfg: TrainConfig, **changes) -> TrainConfig:
    """A copy of cfg with dotted changes: with_changes(cfg, **{"precision.params": "bf16"})."""
    out = copy.deepcopy(cfg)
    for key, value in changes.items():
        section, _, name = key.partition(".")
        setattr(getattr(out, section), name, value)
    return out


def _hints(cfg: TrainConfig, gpus: int, nodes: int, device: Device) -> list[str]:
    """What would make a run that does not fit fit: more GPUs, more checkpointing, bf16 weights."""
    hints = []
    world = gpus * nodes
    fsdp = cfg if cfg.parallel.strategy == "fsdp" else with_changes(cfg, **{"parallel.strategy": "fsdp"})
    switch = "" if fsdp is cfg else " --set parallel.strategy=fsdp"
    if cfg.model.moe is not None and world > 1:   # experts over more ranks gather fewer of them
        ep = math.gcd(world, cfg.model.moe.n_routed_experts)
        if ep > cfg.parallel.ep and memory(with_changes(fsdp, **{"parallel.ep": ep}), world, device).fits(world):
            hints.append(f"{switch} --set parallel.ep={ep}".strip())
    if world > 1 and fsdp is not cfg and memory(fsdp, world, device).fits(world):
        hints.append(switch.strip())
    elif not hints:
        tries = [(g, 1) for g in (2, 4, 8) if g > gpus and nodes == 1] + \
                [(max(gpus, 8) if nodes == 1 and gpus < 8 else gpus, n) for n in range(nodes + 1, 1025)]
        modes = AC_MODES[AC_MODES.index(cfg.train.activation_checkpoint):]
        found = None
        for g, n in tries:
            layout = fsdp if cfg.model.moe is None else \
                with_changes(fsdp, **{"parallel.ep": math.gcd(g * n, cfg.model.moe.n_routed_experts)})
            mode = next((mo for mo in modes if g * n > world and memory(layout, g * n, device, mode=mo).fits(g * n)),
                        None)
            if mode and (found is None or modes.index(mode) < modes.index(found[3])):
                found = (g, n, layout, mode)
            if mode == cfg.train.activation_checkpoint:   # the fewest GPUs at the config's own checkpointing
                break
        if found:
            g, n, layout, mode = found
            ep = "" if layout is fsdp else f" --set parallel.ep={layout.parallel.ep}"
            ac = "" if mode == cfg.train.activation_checkpoint else f" --set train.activation_checkpoint={mode}"
            hints.append(((f"--gpus {g}" if g != gpus else "") + (f" --nodes {n}" if n != nodes else "")
                          + switch + ep + ac).strip())
    split = model_parallel_layout(fsdp, gpus, nodes, device)
    if split is not None:
        hints.append((switch + "".join(f" --set {k}={v}" for k, v in split.items())).strip())
    order = AC_MODES[AC_MODES.index(cfg.train.activation_checkpoint) + 1:]
    for mode in order:
        if memory(cfg, world, device, mode=mode).fits(world):
            hints.append(f"--set train.activation_checkpoint={mode}")
            break
    if cfg.precision.params == "fp32":
        bf16 = with_changes(cfg, **{"precision.params": "bf16"})
        if memory(bf16, world, device).fits(world):
            hints.append("--set precision.params=bf16")
    return hints


def row_splits(cfg: TrainConfig, gpus: int, nodes: int) -> list[tuple[int, int]]:
    """Every (tp, cp) that splits rows, tp within a node (a divisor of its GPUs, at most 8), that
    trainer/config.py accepts for `cfg` (ep 1) on these GPUs."""
    from trainer.config import ConfigError, check_world, validate
    world, out = gpus * nodes, []
    for tp in (t for t in (1, 2, 4, 8) if gpus % t == 0):
        for cp in (c for c in (1, 2, 4, 8, 16, 32, 64) if world % c == 0):
            if tp * cp == 1:
                continue
            layout = with_changes(cfg, **{"parallel.tp": tp, "parallel.cp": cp, "parallel.ep": 1})
            try:
                validate(layout)
                check_world(layout, world)
            except ConfigError:
                continue
            out.append((tp, cp))
    return out


def model_parallel_layout(cfg: TrainConfig, gpus: int, nodes: int, device: Device) -> dict[str, object] | None:
    """The fewest ranks sharing each row (cp x tp) with which `cfg` fits these GPUs, at its checkpointing
    mode or the next that fits, or None: tp within a node (its collectives run every layer) and only
    where the heads and the MLP divide; cp where the row cuts into 2 x cp x tp chunks. Long rows lean on
    cp (its traffic is the keys and values alone), short ones on tp (which also splits the weights).
    {"tp": 2, "cp": 4, "train.activation_checkpoint": "full"}: the keys that change."""
    world, T = gpus * nodes, cfg.data.seq_len
    if cfg.parallel.ep > 1 or not device.memory_gib:
        return None
    options = [(t * c, -c if T >= 32768 else c, t, c) for t, c in row_splits(cfg, gpus, nodes)]
    modes = AC_MODES[AC_MODES.index(cfg.train.activation_checkpoint):]
    for mode in modes:
        for _, _, t, c in sorted(options):
            layout = with_changes(cfg, **{"parallel.tp": t, "parallel.cp": c})
            if memory(layout, world, device, mode=mode).fits(world):
                return {**{f"parallel.{k}": v for k, v in (("tp", t), ("cp", c)) if v > 1},
                        **({} if mode == cfg.train.activation_checkpoint else {"train.activation_checkpoint": mode})}
    return None


def make_plan(cfg: TrainConfig, gpus: int = 1, nodes: int = 1, device: Device = Device(),
              config_path: str = "") -> Plan:
    """The plan of `cfg` on `nodes` nodes of `gpus` GPUs each (raises PlanError on bad counts)."""
    for name, value in (("gpus", gpus), ("nodes", nodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise PlanError(f"--{name} {value!r}: expected a positive integer")
    if device.memory_gib is not None and device.memory_gib <= 0:
        raise PlanError(f"GPU memory {device.memory_gib!r} GiB: expected a positive number")
    from trainer.config import check_world
    from trainer.models import flops_per_token   # torch: only once the input is known to be good
    world = gpus * nodes
    check_world(cfg, world, config_path or "the config")
    count = ParamCount.of(cfg.model)
    fpt = flops_per_token(cfg.model, count.non_embedding, cfg.data.seq_len)
    mem = memory(cfg, world, device)
    by_mode = {mode: memory(cfg, world, device, mode=mode) for mode in AC_MODES}
    max_batch = {mode: _largest_batch(cfg, world, device, mode) for mode in AC_MODES}
    fits = mem.fits(world)
    hints = _hints(cfg, gpus, nodes, device) if fits is False else []
    return Plan(cfg, config_path, gpus, nodes, device, count, fpt, mem, by_mode, max_batch, hints)


# --------------------------------------------------------------------------- report

def experts_line(cfg: TrainConfig, world: int) -> str:
    """"64 routed (top 6) + 2 shared in 26 of 27 layers; ep 8: 8 experts a rank, 2.66 B active a token"."""
    from trainer.models.transformer import inactive_expert_params
    m, e = cfg.model, cfg.model.moe
    ep = cfg.parallel.ep if world > 1 else 1
    layers = sum(m.moe_layer(i) for i in range(m.decoder_layers))
    active = ParamCount.of(m).total - inactive_expert_params(m)
    return (f"{e.n_routed_experts} routed (top {e.top_k})" + (f" + {e.n_shared_experts} shared" if e.n_shared_experts
            else "") + f" in {layers} of {m.decoder_layers} layers; ep {ep}: {e.n_routed_experts // ep} experts a rank, "
            f"{_count(active).replace(' G', ' B')} parameters active a token")


def attention_line(cfg: TrainConfig, device: Device) -> str:
    """"causal over each row" or "inside documents (FlexAttention block mask, positions restart)"."""
    if not cfg.data.document_mask:
        return "causal over each row (SDPA)"
    kernel = {"flex": "FlexAttention block mask", "sdpa": "SDPA additive mask"}[attention_kernel(cfg, device)]
    return f"inside documents ({kernel}" + (", positions restart per document)" if cfg.data.position_reset else ")")


def traffic_line(cfg: TrainConfig, batch: int) -> str:
    """"tp 8: 12.30 GiB sent per GPU a step (...); cp 2: 28.00 GiB (...)"."""
    t = parallel_traffic(cfg, batch)
    parts = []
    if "tp_bytes" in t:
        parts.append(f"tp {cfg.parallel.tp}: {_gib(t['tp_bytes'])} GiB sent per GPU a step (activations gathered and "
                     "reduce-scattered twice a layer each way, the whole weights' gradients all-reduced)")
    if "cp_bytes" in t:
        parts.append(f"cp {cfg.parallel.cp}: {_gib(t['cp_bytes'])} GiB (keys and values gathered a layer, their "
                     "gradients reduce-scattered)")
    return "; ".join(parts)


def render(plan: Plan) -> str:
    """The plan as text: a header, the memory table, the checkpointing table, notes, the verdict."""
    from tabulate import tabulate

    cfg, mem, world = plan.cfg, plan.memory, plan.world
    m = cfg.model
    shared = cfg.parallel.model_ranks
    dev = plan.device
    if dev.name and dev.memory_gib:
        gpu = f"{plan.gpus} x {dev.name} ({dev.memory_gib:g} GiB{', ' + dev.source if dev.source else ''})"
    else:
        gpu = f"no GPU detected (name one with --gpu); {plan.gpus} GPU(s)"
    nodes = f"{plan.nodes} nodes" if plan.nodes > 1 else "1 node"
    compute = "fp32" if cfg.precision.compute == "fp32" else "bf16"
    embedding = "with the tied embedding once" if m.tie_embeddings else "without the embedding"
    header = [
        ("config", f"{plan.config_path or cfg.name} ({cfg.name})"),
        ("GPUs", f"{gpu} per node, {nodes}: {plan.strategy}"),
        ("model", f"{_count(plan.params.total).replace(' G', ' B')} parameters ({plan.params.total:,}; "
                  f"{plan.params.non_embedding:,} {embedding}), {m.n_layers} layers"
                  + (f" + {m.mtp_depth} multi-token prediction" if m.mtp_depth else "")
                  + f", dim {m.dim}, vocab {m.vocab_size}"),
        ("FLOPs", f"{_count(plan.flops_per_token)}FLOP per token (trainer.models.flops_per_token, the MFU "
                  f"count); {_count(plan.flops_per_token * plan.tokens_per_step)}FLOP per optimizer step "
                  f"of {plan.tokens_per_step:,} tokens"),
        *([("experts", experts_line(cfg, world))] if m.moe else []),
        ("batch", f"data.batch_size {mem.batch_size} x seq_len {cfg.data.seq_len} = "
                  f"{mem.batch_size * cfg.data.seq_len:,} tokens per data rank"
                  + (f", {mem.batch_size * cfg.data.seq_len // shared:,} per GPU (each row over cp x tp = {shared})"
                     if shared > 1 else "") + f", grad_accum {cfg.data.grad_accum}"),
        *([("traffic", traffic_line(cfg, mem.batch_size))] if shared > 1 else []),
        ("precision", f"params {cfg.precision.params}, compute {compute}; activation checkpointing "
                      f"{mem.mode}; kernels {'on' if cfg.train.kernels else 'off'}"),
        ("attention", attention_line(cfg, dev)),
    ]
    out = [tabulate(header, tablefmt="plain")]

    peak = mem.peak
    rows, seen = [], set()
    for t in peak.terms:
        rows.append([t.label, _gib(t.bytes), t.note])
        seen.add(t.key)
    for t in mem.state:
        if t.key not in seen:
            rows.append([t.label, _gib(t.bytes), f"not at this peak: {t.note}" if t.note else "not at this peak"])
    rows.append(["= peak allocated", _gib(mem.peak_bytes), f"at the {peak.label}"])
    frag = dev.fragmentation
    rows.append([f"fragmentation reserve ({frag:.0%})", _gib(mem.fragmentation_bytes),
                 "expandable segments" if frag == FRAGMENTATION[True] else "no expandable segments"])
    rows.append([("ROCm" if dev.vendor == Vendor.AMD else "CUDA") + " context"
                 + (" + " + ("RCCL" if dev.vendor == Vendor.AMD else "NCCL") + " buffers" if world > 1 else ""),
                 _gib(mem.overhead_bytes(world)), "assumed"])
    total = f"of {dev.memory_gib:g} GiB" if dev.memory_gib else ""
    rows.append(["= needed per GPU", _gib(mem.needed_bytes(world)), total])
    out.append(tabulate(rows, headers=["memory per GPU", "GiB", ""], tablefmt="simple",
                        disable_numparse=True, colalign=("left", "right", "left")))
    others = [f"{mo.label} {_gib(mo.bytes)}" for mo in mem.moments if mo is not peak]
    out.append("other moments (GiB allocated): " + "; ".join(others))

    ac_rows = []
    for mode, mm in plan.by_mode.items():
        fit = mm.fits(world)
        best = plan.max_batch.get(mode)
        ac_rows.append([mode + (" (config)" if mode == mem.mode else ""), _gib(mm.activations),
                        _gib(mm.needed_bytes(world)), {True: "yes", False: "no", None: "?"}[fit],
                        "?" if best is None else str(best)])
    out.append(tabulate(ac_rows, headers=["activation checkpointing", "activations GiB",
                                          f"needed GiB at batch {mem.batch_size}", "fits",
                                          "largest data.batch_size"],
                        tablefmt="simple", disable_numparse=True,
                        colalign=("left", "right", "right", "left", "right")))
    for note in plan.notes:
        out.append(f"note: {note}")
    out.append(plan.verdict())
    return "\n\n".join(out[:-1]) + "\n\n" + out[-1] if len(out) > 1 else out[0]
