"""Each model family's Hugging Face mapping, and the machinery that applies it both ways.

A family declares one `HFFamily` table beside its layer recipe (trainer/models/<family>.py,
`HF_MAPPINGS`): the transformers class and model_type, which ModelConfig field is which config.json
key, the values config.json must hold (or the architecture implies), and the rules that turn a
tensor of ours into the Hub's and back. The table sits with the recipe because the recipe's module
and parameter names are transformers' names: a family that renames a module, or a new family,
changes one file. What the tables share lives here:

    table.read_config(raw, source) -> dict    ModelConfig fields, dotted for a section's ("moe.top_k")
    table.write_config(m) -> dict             config.json (transformers' keys) for this shape
    sources(table, m, shapes) -> {name: Source}   how each tensor of ours is read from the Hub's tensors
    hub_tensors(table, m, state) -> dict           our state dict as the Hub's tensors (export)
(trainer/hf/config.py's mapping_for(family) finds a family's table: it imports the families, which
import this module)

Weights: most tensors go over unchanged, under the same name. Two rules move them:
- the routed experts: ours are stacked and input-major (GroupedExperts: gate_up_proj [E, dim, 2 x
  ffn], down_proj [E, ffn, dim]); the Hub keeps one nn.Linear per expert ([out, in]):
  mlp.experts.E.{gate,up,down}_proj.weight. transformers 5 fuses them in memory too, but reads and
  writes the Hub's per-expert keys, so those are the format both ways.
- DeepSeek's RoPE: its checkpoints rotate interleaved pairs (x0, x1), (x2, x3), ... of each
  query head's and of the shared key's RoPE part; LatentAttention rotates halves. Permuting those
  rows of the projection that makes them (evens first, then odds: transformers' Llama conversion,
  the other way) makes rotate-half compute the same attention; export permutes them back.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from trainer.config import ModelConfig

from .errors import InexpressibleModel, InitError

REQUIRED = object()   # Key.default: config.json must have the key
OMITTED = object()    # Key.default: without it, the training config's value (or its default) stays

# Read from config.json only where the training config leaves them out: a limit on data.seq_len (RoPE
# does not depend on it), an init scale unused once the weights are loaded, the balance loss's weight.
# (model.mtp_depth is the run's choice, not read from config.json: transformers writes DeepSeek-V3's
# num_nextn_predict_layers 1 and saves no such layer; a checkpoint's layers the run does not build are
# skipped, not_built)
UNCHECKED = ("max_seq_len", "init_std", "moe.aux_loss_alpha")
SECTIONS = ("mla", "moe")   # ModelConfig fields that are sections: their keys are compared one by one


@dataclass(frozen=True)
class Key:
    """One ModelConfig field and the config.json key that holds it."""
    ours: str                    # dotted for a section's: "dim", "moe.top_k", "mla.q_lora_rank"
    hf: str                      # the key transformers writes
    kind: type = int             # int: a positive integer (>= 0 with zero_ok); float: a positive number; bool
    default: Any = REQUIRED      # what transformers takes when config.json lacks the key (or OMITTED)
    also: tuple[str, ...] = ()   # other spellings read where `hf` is missing (num_experts)
    null: Any = REQUIRED         # the value JSON null stands for (q_lora_rank: no query latent, 0); written as null
    zero_ok: bool = False


@dataclass(frozen=True)
class HFFamily:
    """A model family's Hugging Face mapping (see the module's docstring)."""
    family: str                                   # model.family
    name: str                                     # as people write it: "DeepSeek-V3"
    architecture: str                             # transformers' class
    model_type: str
    keys: tuple[Key, ...]                         # besides COMMON_KEYS
    fixed: dict[str, Any] = field(default_factory=dict)     # config.json keys with the one value Anvil computes
    implied: dict[str, Any] = field(default_factory=dict)   # ModelConfig fields the architecture has one value of
    rope_types: tuple[str, ...] = ()              # RoPE scalings it has besides none
    read: Callable[[dict, dict, str], None] | None = None   # (raw, fields, source): what no key-for-key row says
    write: Callable[[ModelConfig, dict], None] | None = None   # (m, config): ... and back
    derived: dict[str, str] = field(default_factory=dict)   # field `read` derives -> the config.json keys it reads
    weight_rules: tuple[Callable, ...] = ()       # (name, shape, m) -> Source | None; else the same tensor
    not_loaded: Callable[[ModelConfig, str], bool] | None = None   # Hub tensors Anvil does not build

    # ------------------------------------------------------------------- config.json -> ModelConfig

    def read_config(self, raw: dict, source: str) -> dict[str, Any]:
        check_not_quantized(raw, source)
        for key, value in self.fixed.items():
            if raw.get(key, value) != value:
                raise InitError(f"{source}: {key} {raw[key]!r}: Anvil's {self.name} has {key} {value!r} only")
        fields: dict[str, Any] = {"family": self.family}
        for key in (*COMMON_KEYS, *self.keys):
            value = _read_key(key, raw, fields, source)
            if value is not OMITTED:
                fields[key.ours] = value
        if fields["n_heads"] % fields["n_kv_heads"]:
            raise InitError(f"{source}: num_key_value_heads {fields['n_kv_heads']} does not divide "
                            f"num_attention_heads {fields['n_heads']}")
        fields["rope_theta"], fields["rope_scaling"] = _read_rope(raw, fields, self, source)
        fields.update(self.implied)
        if self.read is not None:
            self.read(raw, fields, source)
        return fields

    def skipped(self, m: ModelConfig) -> Callable[[str], bool]:
        """Which of the Hub's tensors a checkpoint of this shape may hold that are not loaded."""
        own = functools.partial(self.not_loaded, m) if self.not_loaded is not None else (lambda name: False)
        return lambda name: not_built(m, name) or own(name)

    def hf_key(self, ours: str) -> str:
        """The config.json key(s) a field comes from, for messages."""
        named = {key.ours: key.hf for key in (*COMMON_KEYS, *self.keys)}
        named.update(self.derived, family="architectures", rope_theta="rope_theta",
                     rope_scaling="rope_scaling")
        return named.get(ours) or f"{self.architecture}'s (always)"

    # ------------------------------------------------------------------- ModelConfig -> config.json

    def write_config(self, m: ModelConfig, torch_dtype: str = "bfloat16") -> dict:
        wrong = [f"model.{key} {_get(m, key)!r} (it has {value!r})" for key, value in self.implied.items()
                 if _get(m, key) != value]
        if wrong:
            raise InexpressibleModel(f"model.family {self.family}: transformers' {self.architecture} cannot "
                                     f"express {'; '.join(wrong)}")
        rs = m.rope_scaling
        if rs is not None and rs.type not in self.rope_types:
            raise InexpressibleModel(f"model.rope_scaling.type {rs.type}: transformers' {self.architecture} "
                                     f"has {' or '.join(self.rope_types) or 'no'} RoPE scaling here")
        out: dict[str, Any] = {"architectures": [self.architecture], "model_type": self.model_type}
        for key in (*COMMON_KEYS, *self.keys):
            value = _get(m, key.ours)
            out[key.hf] = None if key.null is not REQUIRED and value == key.null else value
        if m.mtp_depth or self.family == "deepseek_v3":   # DeepSeek-V3's key (transformers' default: 1)
            out["num_nextn_predict_layers"] = m.mtp_depth
        out.update(self.fixed)
        out["rope_theta"] = m.rope_theta
        out["rope_scaling"] = None if rs is None else {"rope_type": rs.type, **rs.fields()}
        if self.write is not None:
            self.write(m, out)
        out.update(bos_token_id=None, eos_token_id=None, torch_dtype=torch_dtype)
        return out


COMMON_KEYS = (
    Key("dim", "hidden_size"), Key("n_layers", "num_hidden_layers"), Key("n_heads", "num_attention_heads"),
    Key("n_kv_heads", "num_key_value_heads", default=lambda fields: fields["n_heads"]),
    Key("ffn_dim", "intermediate_size"), Key("vocab_size", "vocab_size"),
    Key("norm_eps", "rms_norm_eps", float, 1e-6), Key("tie_embeddings", "tie_word_embeddings", bool, False),
    Key("max_seq_len", "max_position_embeddings", int, 2048), Key("init_std", "initializer_range", float, 0.02),
)
# config.json keys every family computes one way; they are written so and refused otherwise
COMMON_FIXED = {"hidden_act": "silu", "attention_bias": False}


def _read_key(key: Key, raw: dict, fields: dict, source: str) -> Any:
    name = next((k for k in (key.hf, *key.also) if k in raw), None)
    if name is None:
        if key.default is REQUIRED:
            raise InitError(f"{source}: no {key.hf}; expected it in a config.json of this architecture")
        return key.default(fields) if callable(key.default) else key.default
    value = raw[name]
    if value is None and key.null is not REQUIRED:
        return key.null
    if key.kind is bool:
        if not isinstance(value, bool):
            raise InitError(f"{source}: {name}: expected true or false, got {value!r}")
        return value
    if key.kind is int:
        low = 0 if key.zero_ok else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            expected = "an integer >= 0" if key.zero_ok else "a positive integer"
            raise InitError(f"{source}: {name}: expected {expected}{' or null' * (key.null is not REQUIRED)}, "
                            f"got {value!r}")
        return value
    return number(value, f"{source}: {name}", key.zero_ok)


def number(value: Any, where: str, zero_ok: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0 or (value == 0 and not zero_ok):
        raise InitError(f"{where}: expected a {'non-negative' if zero_ok else 'positive'} number, got {value!r}")
    return float(value)


# RoPE scaling keys config.json holds per type (ModelConfig.rope_scaling's, RopeScaling.fields())
ROPE_KEYS = {"llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
             "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                      "mscale_all_dim")}
# What transformers takes for a YaRN key config.json lacks. mscale: without it, the attention factor
# comes from `factor` alone, which RopeScaling says as mscale 0.
YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.0, "mscale_all_dim": 0.0}


def _read_rope(raw: dict, fields: dict, table: HFFamily, source: str) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling as ModelConfig fields or None). transformers 5 writes rope_parameters
    (rope_theta inside); earlier ones rope_theta + rope_scaling."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        scaling, theta = params, number(params["rope_theta"], f"{source}: rope_parameters.rope_theta")
    else:
        scaling = raw.get("rope_scaling")
        theta = number(raw.get("rope_theta", 10000.0), f"{source}: rope_theta")
    if scaling is None:
        return theta, None
    if not isinstance(scaling, dict):
        raise InitError(f"{source}: rope_scaling: expected an object or null, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind not in table.rope_types:
        raise InitError(f"{source}: RoPE scaling of type {kind!r}: Anvil's {table.name} does "
                        f"{' or '.join(repr(t) for t in table.rope_types) or 'no'} scaling only (or none)")
    for key, computed, what in (("attention_factor", None, "derives it from factor, mscale and mscale_all_dim"),
                                ("truncate", True, "truncates YaRN's correction range (true)"),
                                ("partial_rotary_factor", 1.0, "rotates whole heads (1.0)")):
        if scaling.get(key, computed) != computed:
            raise InitError(f"{source}: rope_scaling.{key} {scaling[key]!r}: Anvil {what}")
    given = dict(scaling)
    if kind == "yarn":
        given = {**YARN_DEFAULTS, **{k: v for k, v in given.items() if v is not None}}
        if given.get("factor") is None and "original_max_position_embeddings" in given:   # as transformers
            given["factor"] = fields["max_seq_len"] / given["original_max_position_embeddings"]
    missing = [key for key in ROPE_KEYS[kind] if key not in given]
    if missing:
        raise InitError(f"{source}: rope_scaling of type {kind} without {', '.join(missing)}")
    out = {} if kind == "llama3" else {"type": kind}   # RopeScaling.type's default is llama3
    for key in ROPE_KEYS[kind]:
        out[key] = number(given[key], f"{source}: rope_scaling.{key}", zero_ok=key in YARN_DEFAULTS)
    out["original_max_position_embeddings"] = int(out["original_max_position_embeddings"])
    return theta, out


def _get(m: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        m = getattr(m, part, None)
    return m


def ours_value(m: ModelConfig, dotted: str) -> Any:
    """A ModelConfig field as from_hf gives it (rope_scaling as its config.json keys)."""
    value = _get(m, dotted)
    if dotted == "rope_scaling" and value is not None:
        return {"type": value.type, **value.fields()} if value.type != "llama3" else value.fields()
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


def check_not_quantized(raw: dict, source: str) -> None:
    quantized = raw.get("quantization_config")
    if quantized:
        method = quantized.get("quant_method") if isinstance(quantized, dict) else quantized
        raise InitError(f"{source}: quantization_config {method!r}: Anvil starts from unquantized weights "
                        f"(bf16, fp16 or fp32); dequantize the checkpoint first (DeepSeek's fp8_cast_bf16.py "
                        f"for its fp8 releases)")


# --------------------------------------------------------------------------- weights

class Source:
    """How one tensor of ours is made of the Hub's tensors, and back."""

    def hub_shapes(self) -> dict[str, tuple[int, ...]]:
        raise NotImplementedError

    def read(self, hub: "HubReader", box: tuple[slice, ...]) -> torch.Tensor:
        """Our tensor's `box` (a slice per dim: an FSDP2 shard's rows, or all of it)."""
        raise NotImplementedError

    def write(self, ours: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError


@dataclass
class Same(Source):
    """The same tensor under the same name."""
    name: str
    shape: tuple[int, ...]

    def hub_shapes(self):
        return {self.name: self.shape}

    def read(self, hub, box):
        return hub.slice(self.name)[box]

    def write(self, ours):
        return {self.name: ours}


@dataclass
class RopeRows(Source):
    """A projection whose outputs include RoPE blocks (`starts`, each `rope_dim` rows): the Hub's rows
    interleave each block's pairs, ours put the pairs' first elements first (rotate-half)."""
    name: str
    shape: tuple[int, ...]
    starts: tuple[int, ...]
    rope_dim: int

    @property
    def order(self) -> torch.Tensor:
        """Our row r is the Hub's row order[r]."""
        import torch
        order = torch.arange(self.shape[0])
        half_split = torch.cat((torch.arange(0, self.rope_dim, 2), torch.arange(1, self.rope_dim, 2)))
        for start in self.starts:
            order[start:start + self.rope_dim] = start + half_split
        return order

    def hub_shapes(self):
        return {self.name: self.shape}

    def read(self, hub, box):
        rows = self.order[box[0]]
        low, high = int(rows.min()), int(rows.max()) + 1   # a block never leaves its rows: read their span
        return hub.slice(self.name)[(slice(low, high), *box[1:])][rows - low]

    def write(self, ours):
        import torch
        hub = torch.empty_like(ours)
        hub[self.order] = ours
        return {self.name: hub}


@dataclass
class ExpertsGateUp(Source):
    """GroupedExperts.gate_up_proj [E, dim, 2 x ffn] <- experts.E.gate_proj / up_proj [ffn, dim] each."""
    prefix: str                   # model.layers.N.mlp.experts
    shape: tuple[int, ...]

    def names(self, e: int) -> tuple[str, str]:
        return f"{self.prefix}.{e}.gate_proj.weight", f"{self.prefix}.{e}.up_proj.weight"

    def hub_shapes(self):
        experts, dim, ffn = self.shape[0], self.shape[1], self.shape[2] // 2
        return {name: (ffn, dim) for e in range(experts) for name in self.names(e)}

    def read(self, hub, box):
        import torch
        ffn = self.shape[2] // 2
        cols = range(*box[2].indices(self.shape[2]))
        parts = []
        for e in range(*box[0].indices(self.shape[0])):
            gate, up = self.names(e)
            pieces = [hub.slice(name)[lo - base:hi - base, box[1]].T
                      for name, base in ((gate, 0), (up, ffn))
                      for lo, hi in [(max(cols.start, base), min(cols.stop, base + ffn))] if lo < hi]
            parts.append(torch.cat(pieces, dim=-1))
        return torch.stack(parts)

    def write(self, ours):
        ffn = self.shape[2] // 2
        out = {}
        for e in range(self.shape[0]):
            gate, up = self.names(e)
            out[gate], out[up] = ours[e, :, :ffn].T, ours[e, :, ffn:].T
        return out


@dataclass
class ExpertsDown(Source):
    """GroupedExperts.down_proj [E, ffn, dim] <- experts.E.down_proj [dim, ffn] each."""
    prefix: str
    shape: tuple[int, ...]

    def hub_shapes(self):
        return {f"{self.prefix}.{e}.down_proj.weight": (self.shape[2], self.shape[1]) for e in range(self.shape[0])}

    def read(self, hub, box):
        import torch
        return torch.stack([hub.slice(f"{self.prefix}.{e}.down_proj.weight")[box[2], box[1]].T
                            for e in range(*box[0].indices(self.shape[0]))])

    def write(self, ours):
        return {f"{self.prefix}.{e}.down_proj.weight": ours[e].T for e in range(self.shape[0])}


STACKED_EXPERTS = re.compile(r"(.+\.mlp\.experts)\.(gate_up_proj|down_proj)")


def stacked_experts(name: str, shape: tuple[int, ...], m: ModelConfig) -> Source | None:
    """The routed experts (trainer/models/moe.py GroupedExperts) <-> one Hub linear per expert."""
    match = STACKED_EXPERTS.fullmatch(name)
    if match is None:
        return None
    return (ExpertsGateUp if match[2] == "gate_up_proj" else ExpertsDown)(match[1], shape)


TIED_HEAD = "lm_head.weight"
TIED_EMBEDDING = "model.embed_tokens.weight"
# A multi-token prediction layer's tensors on the Hub that are the model's own here: part -> ours.
PREDICTION_COPIES = {"embed_tokens.weight": TIED_EMBEDDING, "shared_head.head.weight": TIED_HEAD}
# Exported in fp32 whatever the dtype: DeepSeek-V3's balancing bias moves by bias_update_speed (1e-3)
# a step, which bf16's 8-bit mantissa rounds away next to scores near 1
KEPT_FP32 = (".mlp.gate.e_score_correction_bias",)


def sources(table: HFFamily, m: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> dict[str, Source]:
    """Our tensor name -> its Source, for the tensors of `shapes` (a tied head is the embedding's)."""
    rules = table.weight_rules
    out = {}
    for name, shape in shapes.items():
        if m.tie_embeddings and name == TIED_HEAD:
            continue
        shape = tuple(shape)
        out[name] = next((s for rule in rules if (s := rule(name, shape, m)) is not None), None) or Same(name, shape)
    return out


def hub_shapes(found: dict[str, Source]) -> dict[str, tuple[int, ...]]:
    return {name: shape for source in found.values() for name, shape in source.hub_shapes().items()}


def hub_tensors(table: HFFamily, m: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our full state dict (a checkpoint's) as the Hub's tensors, contiguous; each multi-token prediction
    layer with its copies of the embedding and the head, as DeepSeek-V3's checkpoint has them."""
    found = sources(table, m, {name: tuple(t.shape) for name, t in state.items()})
    out = {hub: t.contiguous() for name, source in found.items() for hub, t in source.write(state[name]).items()}
    for layer in range(m.n_layers, m.decoder_layers):
        for part, ours in PREDICTION_COPIES.items():
            ours = TIED_EMBEDDING if m.tie_embeddings and ours == TIED_HEAD else ours
            out[f"model.layers.{layer}.{part}"] = state[ours].clone()   # (safetensors keeps no shared tensors)
    return out


def not_built(m: ModelConfig, name: str) -> bool:
    """A tensor of a multi-token prediction layer the model does not build: a depth past model.mtp_depth
    (DeepSeek-V3's model.layers.61 where the run trains without it), or a depth's copy of the embedding or
    the head (the model's own serve every depth)."""
    match = re.match(r"model\.layers\.(\d+)\.(.*)", name)
    if match is None or int(match[1]) < m.n_layers:
        return False
    return int(match[1]) >= m.decoder_layers or match[2] in PREDICTION_COPIES


class HubReader:
    """The Hub's tensors by name across a checkpoint's files, each file opened once (memory-mapped):
    one of our tensors may take its experts from several files."""

    def __init__(self, files: dict[str, Any]):
        self.files = files     # tensor name -> its file
        self.handles: dict[Any, Any] = {}

    def slice(self, name: str):
        from safetensors import safe_open

        file = self.files[name]
        if file not in self.handles:
            self.handles[file] = safe_open(str(file), framework="pt", device="cpu")
        return self.handles[file].get_slice(name)
