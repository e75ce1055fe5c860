"""Speed before launch: step time, tokens/s, MFU and the time to a token target, from per-operation costs.

    rates = Rates.from_dict(json.load(...))     # measured (benchmarks/rates.py) or datasheet(...)
    p = predict(cfg, rates, gpus=8, nodes=2)    # p.tokens_per_s_per_gpu, p.step_s, p.mfu, p.parts
    p.time_to(1e12)                             # seconds to train a trillion tokens

Like trainer/plan.py this is arithmetic over the config, nothing runs. A micro-batch of N = batch x seq
tokens costs, on each rank:

    GEMMs        every linear of every layer (read off the model's parameter shapes, so each family's
                 MLA, router and shared experts come along) and the LM head: forward (N x in -> out),
                 input gradient and weight gradient, each at the measured rate of that shape (the nearest
                 measured shape otherwise; FP8 linears at the rate measured for torchao's float8 linear,
                 its casts included); routed experts as grouped products of N x top_k rows
    attention    2 x heads x (qk + v head dims) x the keys a query sees (causal: (T + 1) / 2) a token
                 forward, 2.5 times that backward (flash attention's five products against two), at the
                 rate measured for the kernel the config picks
    memory-bound RMSNorm, RoPE, SwiGLU, the residual stream, the loss: the bytes each must move (counted
                 below, as a fused kernel moves them) at the bandwidth measured for the implementation the
                 config runs (eager ops make more passes and so reach less of it)
    recompute    selective: the layers' memory-bound forward again; selective_lean: and the k, o and
                 up products; full: each layer's whole forward
    host         kernels issued a micro-batch x the measured launch time (hidden behind the GPU's work,
                 unless the GPU finishes first; on a CPU the host is the device and they add)

and a step adds the optimizer (AdamW's bytes at its measured bandwidth) and the communication the
overlap does not hide: DDP's gradient all-reduce runs under the backward (its last bucket after it);
FSDP2's all-gathers and reduce-scatters run under the compute (the first gather and the last reduce
exposed); expert parallelism's all-to-alls stop the compute. Bus bandwidths are measured ones where
recorded, else the link's datasheet figure inside a node; across nodes the rings run one on each NIC (a
NIC a GPU), so their bus bandwidth is the node's NICs together, and an all-to-all gets its GPU's own NIC.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from core.errors import UserError
from trainer.config import TrainConfig

# Datasheet fallbacks: the share of a peak a well-tuned stack reaches, stated with every prediction
# that uses one. GEMM: H100's bf16 8192^3 product measures 70-76% of its dense peak (BENCHMARKS.md);
# FP8 linears lose part to their casts; flash attention forward + backward reaches about half.
GEMM_EFFICIENCY = 0.70          # where a model has no node-screen floor
GEMM_FLOOR_SHARE = 0.50          # ... and the least share of the peak a floor is taken for
ATTENTION_OF_GEMM = 0.65         # flash attention forward + backward against the GEMM rate
FP8_OF_GEMM = 0.65               # FP8 linears (their casts in) against their peak x the GEMM's share
HBM_EFFICIENCY = 0.80            # a fused elementwise kernel against the datasheet bandwidth
EAGER_PASSES = {"norm": 4.0, "rope": 3.0, "swiglu": 2.5, "loss": 2.0, "residual": 1.0, "adamw": 1.0}
BUS_EFFICIENCY = 0.80            # NCCL/RCCL bus bandwidth against the link's datasheet figure
NET_GBPS = 50.0                  # across nodes, per GPU each way: one 400 Gb/s NIC a GPU (InfiniBand NDR,
#                                  400G RoCE), the usual 8-rail GPU node; --net-gbps says otherwise
LAUNCH_US = 6.0                  # host time to issue one kernel from eager PyTorch (without a measurement)
DDP_BUCKET_BYTES = 25 * 2 ** 20  # torch DDP's default bucket: what is left to reduce after the backward
FLASH_BACKWARD = 2.5             # flash attention backward / forward work
KERNELS_PER_LAYER = {"eager": 40, "kernels": 24, "compile": 10}   # forward; backward issues twice as many
MOE_KERNELS_PER_LAYER = 40       # a MoE layer's routing, load count and permutation, forward



class SpeedError(UserError):
    """Bad input to the prediction (a token count), or no figure for what it needs: exit 2."""


@dataclass
class Rates:
    """What one device does per second: measured at given shapes (benchmarks/rates.py) or from its
    datasheet. gemm: dtype -> [[m, n, k, TFLOP/s]]; fp8: [[tokens, in, out, TFLOP/s]] of a float8 linear's
    forward + backward; attention: kernel -> TFLOP/s (forward + backward on the FLOPs the mask keeps);
    op_gbps: "<op>/<eager|kernels>" -> GB/s of the bytes counted here; bus_gbps: collective -> bus
    bandwidth inside a node (nccl-tests' definition), for bus_gpus GPUs."""
    gpu: str = ""
    source: str = ""
    measured: bool = False
    peak_tflops: float | None = None
    gemm: dict = field(default_factory=dict)
    gemm_tflops: dict = field(default_factory=dict)     # dtype -> the rate where no shape was measured
    fp8: list = field(default_factory=list)
    fp8_tflops: float | None = None
    attention: dict = field(default_factory=dict)
    attention_tflops: float | None = None
    hbm_gbps: float | None = None
    fused_gbps: float | None = None                     # a fused op's bandwidth where none was measured
    op_gbps: dict = field(default_factory=dict)
    launch_us: float = LAUNCH_US
    bus_gbps: dict = field(default_factory=dict)
    bus_gpus: int = 0
    link_gbps: float | None = None
    net_gbps: float = NET_GBPS
    host_is_device: bool = False                        # a CPU: the host's time and the compute add
    device: str = ""
    date: str = ""
    versions: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: dict) -> "Rates":
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})

    def to_dict(self) -> dict:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}

    def merged(self, newer: "Rates") -> "Rates":
        """These figures with a newer measurement's added: its shapes replace the same shapes, its kernels and
        ops the same ones, and what it measured of the rest (a field left at its default was not measured)."""
        import dataclasses

        out = Rates.from_dict(self.to_dict())
        for f in dataclasses.fields(self):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            value = getattr(newer, f.name)
            if f.name in ("gemm", "fp8", "attention", "op_gbps", "bus_gbps") or value == default:
                continue
            setattr(out, f.name, value)
        out.gemm = {dt: _by_shape(self.gemm.get(dt, []), newer.gemm.get(dt, []))
                    for dt in {**self.gemm, **newer.gemm}}
        out.fp8 = _by_shape(self.fp8, newer.fp8)
        out.attention = {**self.attention, **newer.attention}
        out.op_gbps = {**self.op_gbps, **newer.op_gbps}
        if newer.bus_gbps:   # a measurement of another GPU count replaces the old one
            out.bus_gbps = {**(self.bus_gbps if newer.bus_gpus == self.bus_gpus else {}), **newer.bus_gbps}
        return out

    # ---- lookups
    def gemm_rate(self, m: int, n: int, k: int, dtype: str) -> float:
        rows = self.gemm.get(dtype) or []
        near = _nearest(rows, (m, n, k))
        if near is not None:
            return near
        if dtype in self.gemm_tflops:
            return float(self.gemm_tflops[dtype])
        if rows:   # a device measured at other shapes only: its best rate is the nearer guess
            return float(max(r[3] for r in rows))
        other = [r for rows in self.gemm.values() for r in rows]
        if other:  # measured in another dtype only (a CPU runs what it is given in fp32)
            return float(max(r[3] for r in other))
        raise SpeedError(f"no GEMM rate for {dtype} on {self.gpu}")

    def fp8_rate(self, tokens: int, n_in: int, n_out: int) -> float | None:
        near = _nearest(self.fp8, (tokens, n_in, n_out))
        if near is None and self.fp8 and not self.fp8_tflops:   # measured at other shapes only
            near = _nearest(self.fp8, (tokens, n_in, n_out), within=math.inf)
        return near if near is not None else self.fp8_tflops

    def attention_rate(self, kernel: str) -> float:
        if kernel in self.attention:
            return float(self.attention[kernel])
        if self.attention_tflops:
            return float(self.attention_tflops)
        if self.attention:
            return float(min(self.attention.values()))
        raise SpeedError(f"no attention rate on {self.gpu}")

    def op_rate(self, op: str, impl: str) -> float:
        key = f"{op}/{impl}"
        if key in self.op_gbps:
            return float(self.op_gbps[key])
        if impl == "compile" and f"{op}/kernels" in self.op_gbps:   # Inductor fuses as our kernels do
            return float(self.op_gbps[f"{op}/kernels"])
        fused = self.fused_gbps or (self.hbm_gbps or 0) * HBM_EFFICIENCY
        if not fused:
            raise SpeedError(f"no bandwidth for {op} on {self.gpu}")
        return fused / (EAGER_PASSES.get(op, 1.0) if impl == "eager" else 1.0)

    def bus(self, op: str, gpus: int, nodes: int) -> tuple[float, str]:
        """(GB/s, where it comes from) of `op` over gpus x nodes ranks: across nodes the slower of the
        network and the node's own links (a ring passes through both)."""
        inside = self._inside(op, gpus)
        if nodes > 1:
            # Rings (all-reduce, all-gather, reduce-scatter) run one a NIC, each crossing between nodes once:
            # their bus bandwidth is the node's NICs together. An all-to-all sends each GPU's share to the
            # other nodes through its own NIC.
            rails = 1 if op == "all_to_all" else gpus
            net = self.net_gbps * rails * BUS_EFFICIENCY
            if net <= inside[0]:
                return net, (f"the network: {rails} x {self.net_gbps:g} GB/s each way (a NIC a GPU"
                             + (", a ring on each" if rails > 1 else "") + f") x {BUS_EFFICIENCY:.0%}")
        return inside

    def _inside(self, op: str, gpus: int) -> tuple[float, str]:
        if op in self.bus_gbps and self.bus_gpus == gpus:
            return float(self.bus_gbps[op]), f"measured on {gpus} GPUs"
        if self.link_gbps:
            return self.link_gbps * BUS_EFFICIENCY, f"the GPU link: {self.link_gbps:g} GB/s each way x " \
                                                    f"{BUS_EFFICIENCY:.0%}"
        if op in self.bus_gbps:
            return float(self.bus_gbps[op]), f"measured on {self.bus_gpus} GPUs"
        return 25.0, "PCIe Gen4 x16 (no GPU link known)"


def _distance(a, b) -> float:
    return max(abs(math.log(max(x, 1) / max(y, 1))) for x, y in zip(a, b)) / math.log(2)


def _nearest(rows: list, shape: tuple, within: float = 2.0) -> float | None:
    """The rate (last column) of the measured shape nearest `shape`, if it is within a factor of about 2**within
    in every dimension; None otherwise."""
    if not rows:
        return None
    best = min(rows, key=lambda r: _distance(r[:3], shape))
    return float(best[3]) if _distance(best[:3], shape) < within else None


def _by_shape(old: list, new: list) -> list:
    """Rows [shape..., rate] of both, a shape in `new` replacing the same one in `old`."""
    rows = {tuple(r[:3]): r for r in old}
    rows.update({tuple(r[:3]): r for r in new})
    return sorted(rows.values())


def datasheet(model, net_gbps: float = NET_GBPS) -> Rates:
    """Rates from an envs.spec.GpuModel's datasheet, at its node-screen floors where it has them (what a
    healthy GPU of the model measures at least: bf16 GEMM, at least half the peak; HBM copy), else at the
    stated efficiencies;
    attention and FP8 linears at the share of their peak the GEMM reaches, times theirs."""
    if not model.hbm_gbps:
        raise SpeedError(f"{model.name}: no datasheet bandwidth in envs/profiles/{model.key}.py")
    floors = model.floors
    # a floor below half the peak is a borrowed one (gfx950 has the MI300X's): half the peak then
    gemm = max(floors.gemm_tflops, model.peak_tflops * GEMM_FLOOR_SHARE) if floors else \
        model.peak_tflops * GEMM_EFFICIENCY
    fused = floors.hbm_gbps if floors else model.hbm_gbps * HBM_EFFICIENCY
    share = gemm / model.peak_tflops
    fp8 = model.fp8_tflops * share * FP8_OF_GEMM if model.fp8_tflops else None
    where = f"node-screen floors (envs/profiles/{model.key}.py)" if floors else \
        f"stated efficiencies of the datasheet (envs/profiles/{model.key}.py)"
    return Rates(
        gpu=model.name, measured=False, peak_tflops=model.peak_tflops, net_gbps=net_gbps,
        source=f"{model.name} {where}: GEMM {gemm:g} TFLOP/s ({share:.0%} of {model.peak_tflops:g}), attention "
               f"{ATTENTION_OF_GEMM:.2f}x that, " + (f"FP8 linears {fp8:,.0f}, " if fp8 else "")
               + f"memory-bound ops {fused:,.0f} GB/s",
        gemm_tflops={"bf16": gemm, "fp32": gemm / 8}, fp8_tflops=fp8, attention_tflops=gemm * ATTENTION_OF_GEMM,
        hbm_gbps=model.hbm_gbps, fused_gbps=fused, link_gbps=model.link_gbps,
        notes=[f"{model.name}: no measured figures; its datasheet at the rates above (`inv bench.rates` on one of "
               "its nodes records measured ones)"])


# --------------------------------------------------------------------------- the step


@dataclass
class Prediction:
    gpus: int
    nodes: int
    tokens_per_step: int
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float | None
    tflops: float
    parts: dict            # name -> seconds a step
    comm: dict             # collective -> (seconds a step, GB/s, where the bandwidth comes from)
    rates_source: str
    measured: bool
    assumptions: list

    @property
    def world(self) -> int:
        return self.gpus * self.nodes

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_s_per_gpu * self.world

    def time_to(self, tokens: float) -> float:
        return tokens / self.tokens_per_s

    def to_dict(self) -> dict:
        return {"gpus": self.gpus, "nodes": self.nodes, "tokens_per_step": self.tokens_per_step,
                "step_s": self.step_s, "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
                "tokens_per_s": self.tokens_per_s, "mfu": self.mfu, "tflops_per_gpu": self.tflops,
                "parts_s": self.parts,
                "communication": {k: {"s": v[0], "bus_gbps": v[1], "source": v[2]} for k, v in self.comm.items()},
                "rates": self.rates_source, "measured_rates": self.measured, "assumptions": self.assumptions}


def compute_dtype(cfg: TrainConfig, rates: Rates) -> str:
    if cfg.precision.compute == "fp32" or (cfg.precision.compute == "auto" and rates.host_is_device):
        return "fp32"
    return "bf16"


def implementation(cfg: TrainConfig) -> str:
    """How the memory-bound ops run: eager PyTorch, our fused kernels, or Inductor's."""
    if cfg.train.compile:
        return "compile"
    return "kernels" if cfg.train.kernels else "eager"


def attention_kind(cfg: TrainConfig, rates: Rates) -> str:
    """sdpa_causal, flex_docs (FlexAttention with a document mask) or sdpa_docs (SDPA's additive mask)."""
    from core.vendor import Vendor
    from trainer.plan import Device, attention_kernel

    if not cfg.data.document_mask:
        return "sdpa_causal"
    return attention_kernel(cfg, Device(vendor=Vendor.CPU if rates.host_is_device else None)) + "_docs"


def linears(cfg: TrainConfig) -> list[tuple[str, int, int, int]]:
    """(name, rows per token, in, out) of every product a token's micro-batch runs: each layer's 2-D
    weights on every token, the routed experts' stacked weights on top_k rows a token, the LM head."""
    from trainer.plan import is_expert, param_shapes

    m = cfg.model
    out = []
    for name, shape in param_shapes(m).items():
        if not name.startswith("model.layers.") or len(shape) < 2:
            continue
        if is_expert(name):     # [E, in, out]: each token's rows go to top_k of them
            out.append((name, m.moe.top_k, shape[1], shape[2]))
        else:
            out.append((name, 1, shape[1], shape[0]))
    out += [("lm_head.weight", 1, m.dim, m.vocab_size)] * (1 + m.mtp_depth)   # (each prediction depth again)
    return out


def gemm_shapes(cfg: TrainConfig, batch: int | None = None) -> list[tuple[int, int, int]]:
    """The distinct (m, n, k) products of a micro-batch, forward and both gradients (benchmarks/rates.py
    measures these)."""
    n_tok = (batch or cfg.data.batch_size) * cfg.data.seq_len
    shapes = set()
    for name, rows, n_in, n_out in linears(cfg):
        tokens = n_tok * rows
        if rows > 1:    # one expert's share of the rows
            tokens = max(1, tokens // cfg.model.moe.n_routed_experts)
        shapes |= {(tokens, n_out, n_in), (tokens, n_in, n_out), (n_out, n_in, tokens)}
    return sorted(shapes)


def fp8_shapes(cfg: TrainConfig, batch: int | None = None) -> list[tuple[int, int, int]]:
    n_tok = (batch or cfg.data.batch_size) * cfg.data.seq_len
    return sorted({(n_tok, n_in, n_out) for name, rows, n_in, n_out in linears(cfg)
                   if rows == 1 and name != "lm_head.weight"})


def attention_flops(cfg: TrainConfig, tokens: int) -> float:
    """Forward FLOPs of one layer's attention over `tokens` tokens (causal: (T + 1) / 2 keys a query)."""
    m = cfg.model
    if m.mla is not None:
        qk, v = m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim, m.mla.v_head_dim
    else:
        qk = v = m.head_dim
    return 2.0 * tokens * m.n_heads * (qk + v) * (cfg.data.seq_len + 1) / 2


def op_bytes(cfg: TrainConfig, c: int) -> dict[str, tuple[float, float]]:
    """Bytes a token moves through each memory-bound op of one layer, (forward, backward), as a fused
    kernel moves them: c bytes an activation element."""
    m = cfg.model
    d = m.dim
    q_heads, kv_heads = m.n_heads, (m.n_kv_heads if m.mla is None else m.n_heads)
    rope = (q_heads + kv_heads) * m.head_dim * c
    ffn = m.ffn_dim if m.moe is None else m.moe.ffn_dim * (m.moe.top_k + m.moe.n_shared_experts)
    return {
        "norm": (2 * (2 * d * c), 2 * (3 * d * c)),        # two a layer: x in, y out; x, dy in, dx out
        "rope": (2 * rope, 2 * rope),                      # q and k in and out, both ways
        "swiglu": (3 * ffn * c, 5 * ffn * c),              # gate, up in, out; gate, up, d_out in, two out
        "residual": (2 * 3 * d * c, 2 * 3 * d * c),        # two adds a layer, and their gradients
    }


def loss_bytes(cfg: TrainConfig, c: int, impl: str) -> float:
    """Bytes a token moves in cross-entropy beyond the LM head's products: eager writes c-byte logits,
    an fp32 copy and fp32 log-probs, and its backward reads and writes fp32 gradients; the fused loss
    reads each chunk of logits it wrote and writes their gradient."""
    v = cfg.model.vocab_size
    return (2 * c + 20) * v if impl == "eager" else 4 * c * v


def optimizer_bytes(cfg: TrainConfig, params_on_rank: int) -> float:
    """AdamW over this rank's parameters: weight, gradient and both moments read, three written, and the
    gradient read once more for the clipping norm."""
    p = 2 if cfg.precision.params == "bf16" else 4
    return params_on_rank * (8 * p + (p if cfg.optim.grad_clip else 0))


def predict(cfg: TrainConfig, rates: Rates, gpus: int = 1, nodes: int = 1, batch: int | None = None,
            mode: str | None = None) -> Prediction:
    """The step of `cfg` on nodes x gpus ranks at data.batch_size `batch` and checkpointing `mode`."""
    from trainer.plan import (TP_COLUMNS, TP_ROWS, ParamCount, dtypes, is_expert, param_shapes, parallel_traffic,
                              tp_shapes, with_changes)
    from trainer.models.transformer import flops_per_token

    if batch is not None or mode is not None:
        cfg = with_changes(cfg, **{k: v for k, v in (("data.batch_size", batch),
                                                      ("train.activation_checkpoint", mode)) if v is not None})
    m, d = cfg.model, cfg.data
    world = gpus * nodes
    dt = dtypes(cfg, world)
    dtype = compute_dtype(cfg, rates)
    c = 4 if dtype == "fp32" else 2
    impl = implementation(cfg)
    mode = cfg.train.activation_checkpoint
    tp, cp = cfg.parallel.tp, cfg.parallel.cp
    share = cfg.parallel.model_ranks             # ranks that split each row (trainer/models/tensor_parallel.py)
    n_tok = d.batch_size * d.seq_len             # a data rank's micro-batch
    n_own = n_tok // share                       # the tokens a GPU computes outside attention and the MLP
    fp8 = cfg.precision.fp8 != "off" and not rates.host_is_device
    ep = cfg.parallel.ep if world > 1 else 1
    moe_layers = sum(m.moe_layer(i) for i in range(m.decoder_layers))
    count = ParamCount.of(m)
    assumptions = list(rates.notes)

    # ---- GEMMs of a micro-batch, forward and backward, and what recompute adds
    fwd = bwd = recomputed = 0.0
    lean = {"self_attn.k_proj.weight", "self_attn.o_proj.weight", "mlp.up_proj.weight"}
    for name, rows, n_in, n_out in linears(cfg):
        tokens = n_tok * rows
        if share > 1:   # tp splits the layers' linears by rows or columns over the T / cp tokens; the rest
            if name.endswith(TP_ROWS):      # (the head) computes the GPU's own tokens
                tokens, n_out = tokens // cp, n_out // tp
            elif name.endswith(TP_COLUMNS):
                tokens, n_in = tokens // cp, n_in // tp
            else:
                tokens //= share
        fp8_rate = rates.fp8_rate(tokens, n_in, n_out) if fp8 and rows == 1 and name != "lm_head.weight" else None
        if fp8_rate:
            whole = 6.0 * tokens * n_in * n_out / (fp8_rate * 1e12)
            f, b = whole / 3, whole * 2 / 3
        else:
            per = max(1, tokens // m.moe.n_routed_experts) if rows > 1 else tokens
            flop = 2.0 * tokens * n_in * n_out
            f = flop / (rates.gemm_rate(per, n_out, n_in, dtype) * 1e12)
            b = flop / (rates.gemm_rate(per, n_in, n_out, dtype) * 1e12) + \
                flop / (rates.gemm_rate(n_out, n_in, per, dtype) * 1e12)
        fwd, bwd = fwd + f, bwd + b
        if name == "lm_head.weight":
            continue
        if mode == "full" or (mode == "selective_lean" and name.split(".", 3)[-1] in lean):
            recomputed += f

    # ---- attention
    kind = attention_kind(cfg, rates)
    # (under cp and tp: T / cp queries of H / tp heads against the whole row, the causal work balanced)
    attention = m.decoder_layers * attention_flops(cfg, n_tok) / share * (1 + FLASH_BACKWARD) / (rates.attention_rate(kind) * 1e12)
    att_f = attention / (1 + FLASH_BACKWARD)
    if mode == "full":
        recomputed += att_f
    if cfg.data.document_mask:
        assumptions.append("attention inside documents counted as causal over the whole row: an upper bound "
                           "(shorter documents leave fewer keys a query)")

    # ---- memory-bound ops
    memory_f = memory_b = 0.0
    for op, (fb, bb) in op_bytes(cfg, c).items():
        rate = rates.op_rate(op, impl) * 1e9
        memory_f += m.decoder_layers * n_own * fb / rate
        memory_b += m.decoder_layers * n_own * bb / rate
    loss_impl = "kernels" if cfg.train.kernels else impl   # the fused loss, compiled or not
    loss = (1 + m.mtp_depth) * n_own * loss_bytes(cfg, c, loss_impl) / (rates.op_rate("loss", loss_impl) * 1e9)
    if m.moe is not None:
        # tokens gathered into their experts' order and the outputs scattered back weighted, both ways:
        # index copies, taken at half the rate of the residual's plain elementwise passes
        permute = moe_layers * n_own * (2 * m.moe.top_k + 2) * m.dim * c / (rates.op_rate("residual", impl) / 2 * 1e9)
        memory_f, memory_b = memory_f + permute, memory_b + permute
    if mode != "none":
        recomputed += memory_f
    memory = memory_f + memory_b + loss
    if dt.casts and not dt.fsdp and rates.hbm_gbps:
        # fp32 weights under autocast: each forward casts them to 16 bits (4 read, 2 written a parameter) and
        # each backward adds the 16-bit gradients into the fp32 ones (2 + 4 read, 4 written)
        memory += count.total * 16 / (rates.hbm_gbps * HBM_EFFICIENCY * 1e9)

    # ---- the host's kernel launches
    launches = m.decoder_layers * KERNELS_PER_LAYER[impl] * 3
    if m.moe is not None:   # routing and permutation; without a grouped GEMM (a CPU) a product per expert
        per_expert = 0 if not rates.host_is_device else 4 * m.moe.n_routed_experts // ep
        launches += moe_layers * (MOE_KERNELS_PER_LAYER + per_expert) * 3
    host = launches * rates.launch_us * 1e-6
    device_s = fwd + bwd + attention + memory + recomputed
    micro = device_s + host if rates.host_is_device else max(device_s, host)

    # ---- the optimizer step over this rank's parameters
    shapes = tp_shapes(param_shapes(m), tp)
    shard_world = world // tp                    # FSDP2 shards over data x cp
    if dt.fsdp:
        from trainer.plan import _rank_numel
        on_rank = sum(_rank_numel(n, s, shard_world, ep) for n, s in shapes.items())
    else:
        on_rank = count.total
    optimizer = optimizer_bytes(cfg, on_rank) / (rates.op_rate("adamw", "kernels" if cfg.train.kernels else "eager")
                                                 * 1e9)

    # ---- communication
    comm: dict = {}
    exposed = 0.0
    accum = d.grad_accum
    compute = micro * accum
    dense = sum(math.prod(s) for n, s in shapes.items() if not is_expert(n))
    experts = sum(math.prod(s) for n, s in shapes.items()) - dense
    if world > 1:
        if dt.fsdp and shard_world > 1:
            gathered = dense + (experts // ep if ep > 1 else experts)
            ag_bw, ag_src = rates.bus("all_gather", gpus, nodes)
            rs_bw, rs_src = rates.bus("reduce_scatter", gpus, nodes)
            gathers = (2 if cfg.parallel.reshard_after_forward else 1) * accum
            ag = gathers * gathered * c * (shard_world - 1) / shard_world / (ag_bw * 1e9)
            rs = gathered * 4 * (shard_world - 1) / shard_world / (rs_bw * 1e9)   # fp32 gradients (reduce_dtype)
            comm["all_gather"] = (ag, ag_bw, ag_src)
            comm["reduce_scatter"] = (rs, rs_bw, rs_src)
            per_layer = (ag / gathers + rs) / max(1, m.decoder_layers)
            exposed += max(0.0, ag + rs - compute) + per_layer
        elif not dt.fsdp:
            ar_bw, ar_src = rates.bus("all_reduce", gpus, nodes)
            grad_bytes = count.total * (2 if cfg.precision.params == "bf16" else 4)
            ar = grad_bytes * 2 * (world - 1) / world / (ar_bw * 1e9)
            comm["all_reduce"] = (ar, ar_bw, ar_src)
            last = min(grad_bytes, DDP_BUCKET_BYTES) * 2 * (world - 1) / world / (ar_bw * 1e9)
            exposed += max(0.0, ar - bwd) + last   # under the last micro-batch's backward
        if ep > 1:
            a2a_bw, a2a_src = rates.bus("all_to_all", gpus, nodes)
            a2a_bytes = 4 * moe_layers * n_tok * m.moe.top_k * m.dim * c * (ep - 1) / ep * accum
            a2a = a2a_bytes / (a2a_bw * 1e9)
            comm["all_to_all"] = (a2a, a2a_bw, a2a_src)
            exposed += a2a
            assumptions.append("expert parallelism: tokens spread evenly over the experts; the all-to-alls "
                               "are not overlapped")
        # tp and cp: every layer waits for its gathers (no async TP); tp within a node, cp there too while
        # cp x tp fits one node's GPUs
        traffic = parallel_traffic(cfg)
        for key, ranks, inside in (("tp", tp, tp <= gpus), ("cp", cp, share <= gpus)):
            sent = traffic.get(f"{key}_bytes")
            if sent:
                bw, src = rates.bus("all_gather", ranks, 1) if inside else rates.bus("all_gather", gpus, nodes)
                comm[key] = (sent / (bw * 1e9), bw, src)
                exposed += sent / (bw * 1e9)
        if share > 1:
            assumptions.append("tensor / context parallelism: the work split evenly over cp x tp, their "
                               "collectives not overlapped with compute")
    step = compute + optimizer + exposed
    tokens = n_own * accum
    fpt = flops_per_token(m, count.non_embedding, d.seq_len)
    tps = tokens / step
    peak = rates.peak_tflops
    parts = {"gemm": (fwd + bwd) * accum, "attention": attention * accum, "memory-bound": memory * accum,
             "recompute": recomputed * accum, "host launches": (host * accum if rates.host_is_device
                                                                else max(0.0, host - device_s) * accum),
             "optimizer": optimizer, "communication (exposed)": exposed}
    return Prediction(gpus, nodes, tokens * world, step, tps, fpt * tps / (peak * 1e12) if peak else None,
                      fpt * tps / 1e12, parts, comm, rates.source, rates.measured, assumptions)


# --------------------------------------------------------------------------- layouts

def search(cfg: TrainConfig, rates: Rates, device, gpus: int, nodes: int, limit: int = 8) -> list[dict]:
    """Layouts that fit, fastest first: data.batch_size (the global batch kept with grad_accum where it
    divides), activation checkpointing, for a mixture of experts parallel.ep, and under FSDP2 for the Llama
    family the ranks that split each row (parallel.tp within a node, parallel.cp)."""
    from trainer.plan import AC_MODES, GIB, memory, row_splits, with_changes

    world = gpus * nodes
    global_rows = cfg.data.batch_size * cfg.data.grad_accum * world // cfg.parallel.model_ranks
    eps = [cfg.parallel.ep]
    if cfg.model.moe is not None and world > 1 and cfg.parallel.strategy == "fsdp":
        eps = [e for e in range(1, world + 1) if world % e == 0 and cfg.model.moe.n_routed_experts % e == 0]
    rows = []
    splits = row_splits(cfg, gpus, nodes) if cfg.parallel.strategy == "fsdp" and cfg.model.family == "llama" else []
    for ep, tp, cp in [(ep, 1, 1) for ep in eps] + [(1, tp, cp) for tp, cp in splits
                                                    if (tp, cp) != (cfg.parallel.tp, cfg.parallel.cp)]:
        dp = world // (tp * cp)
        if global_rows % dp:
            continue
        for mode in AC_MODES:
            for batch in (1, 2, 4, 8, 16, 32, 64):
                if (global_rows // dp) % batch:
                    continue
                layout = with_changes(cfg, **{"data.batch_size": batch, "data.grad_accum": global_rows // dp // batch,
                                              "train.activation_checkpoint": mode, "parallel.ep": ep,
                                              "parallel.tp": tp, "parallel.cp": cp})
                mem = memory(layout, world, device)
                if mem.fits(world) is False:
                    continue
                p = predict(layout, rates, gpus, nodes)
                rows.append({"batch_size": batch, "grad_accum": global_rows // dp // batch,
                             "activation_checkpoint": mode, "ep": ep, "tp": tp, "cp": cp,
                             "tokens_per_s_per_gpu": p.tokens_per_s_per_gpu, "mfu": p.mfu,
                             "step_s": p.step_s, "needed_gib": mem.needed_bytes(world) / GIB,
                             "sets": _sets(cfg, layout)})
    rows.sort(key=lambda r: -r["tokens_per_s_per_gpu"])
    return rows[:limit]


def _sets(cfg: TrainConfig, layout: TrainConfig) -> str:
    pairs = []
    for key in ("data.batch_size", "data.grad_accum", "train.activation_checkpoint", "parallel.ep", "parallel.tp",
                "parallel.cp"):
        section, name = key.split(".")
        if getattr(getattr(cfg, section), name) != getattr(getattr(layout, section), name):
            pairs.append(f"--set {key}={getattr(getattr(layout, section), name)}")
    return " ".join(pairs) or "(the config as it is)"


# --------------------------------------------------------------------------- text

def parse_tokens(text: str) -> float:
    """'1T', '300B', '2.5e9', '500M' -> tokens."""
    units = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
    s = str(text).strip().upper()
    try:
        value = float(s[:-1]) * units[s[-1]] if s and s[-1] in units else float(s)
    except (ValueError, KeyError):
        raise SpeedError(f"--tokens {text!r}: expected a count such as 300B, 1T or 2.5e9") from None
    if not value > 0:
        raise SpeedError(f"--tokens {text!r}: expected a positive count")
    return value


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 3 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def render(p: Prediction, tokens: float | None = None, searched: list[dict] | None = None) -> str:
    from tabulate import tabulate

    where = f"{p.gpus} GPU(s)" + (f" x {p.nodes} nodes" if p.nodes > 1 else "")
    lines = [f"speed      {p.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, {p.tokens_per_s:,.0f} on {where}; step "
             f"{p.step_s * 1e3:,.1f} ms for {p.tokens_per_step:,} tokens; "
             + (f"MFU {p.mfu:.1%} ({p.tflops:,.0f} TFLOP/s a GPU)" if p.mfu is not None else
                f"{p.tflops:,.2f} TFLOP/s") + " (predicted)",
             f"figures    {p.rates_source}"]
    if tokens:
        lines.append(f"target     {tokens:,.3g} tokens in {duration(p.time_to(tokens))} on {where}")
    rows = [[k, f"{v * 1e3:,.1f}", f"{v / p.step_s:.0%}" if p.step_s else ""] for k, v in p.parts.items() if v > 0]
    out = ["\n".join(lines), tabulate(rows, headers=["step (predicted)", "ms", "share"], tablefmt="simple",
                                       disable_numparse=True, colalign=("left", "right", "right"))]
    if p.comm:
        out.append(tabulate([[k, f"{s * 1e3:,.1f}", f"{bw:,.0f}", src] for k, (s, bw, src) in p.comm.items()],
                            headers=["collective a step", "ms", "bus GB/s", "bandwidth from"], tablefmt="simple",
                            disable_numparse=True, colalign=("left", "right", "right", "left")))
    if searched is not None:
        out.append(tabulate([[f"{r['tokens_per_s_per_gpu']:,.0f}", f"{r['mfu']:.1%}" if r["mfu"] else "",
                              r["batch_size"], r["grad_accum"], r["activation_checkpoint"], r["ep"], r["tp"], r["cp"],
                              f"{r['needed_gib']:.1f}", r["sets"]] for r in searched],
                            headers=["tokens/s/GPU", "MFU", "batch", "accum", "checkpointing", "ep", "tp", "cp", "GiB",
                                     "as"],
                            tablefmt="simple", disable_numparse=True) if searched else
                   "search: no layout fits")
    for a in p.assumptions:
        out.append(f"assumes: {a}")
    return "\n\n".join(out)
