"""Training configuration: typed dataclasses loaded from YAML and validated.

One TrainConfig per run, in sections (torchtitan style). `load(path, overrides)`
reads the YAML, applies dotted overrides ("optim.lr=3e-4"), checks every key,
type and value, and raises ConfigError naming the file, the key and what was
expected, before anything starts.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

import yaml
from core import safe_yaml
from core.errors import UserError
from core.files import text_of

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"
SYNTHETIC = "synthetic"  # data.path value: random tokens, for throughput measurements
DEFAULT_DATA = "data/stdlib"   # data.path when a config names neither a path nor a blend
BLEND_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")  # a blend source's name: a metric key part


class ConfigError(UserError):
    """A user error in a training config (message names file, key, expectation)."""


@dataclass
class RopeScaling:
    """RoPE frequency scaling: Llama 3.1's (HF rope_type "llama3") or YaRN (DeepSeek-V2/V3's "yarn")."""
    type: Literal["llama3", "yarn"] = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0       # llama3: wavelengths above original / low_freq_factor are divided by factor
    high_freq_factor: float = 4.0      # llama3: those below original / high_freq_factor are kept
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0            # yarn: rotations per context above which a dimension is kept
    beta_slow: float = 1.0             # yarn: ... below which it is interpolated
    mscale: float = 1.0                # yarn: attention temperature (DeepSeek's mscale)
    mscale_all_dim: float = 0.0        # yarn: DeepSeek's softmax scale correction (0 = none)

    def fields(self) -> dict:
        """The keys its type uses, with their values (what a Hugging Face config.json holds besides the type)."""
        names = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings") \
            if self.type == "llama3" else \
            ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
        return {name: getattr(self, name) for name in names}


@dataclass
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): keys and values from a low-rank latent, RoPE on
    a separate part of each query and key head (decoupled RoPE)."""
    q_lora_rank: int = 0               # 0: queries straight from the hidden state (V2-Lite); else their latent's size
    kv_lora_rank: int = 512            # the key/value latent (what inference caches)
    qk_nope_head_dim: int = 128        # per head: the query/key part without RoPE
    qk_rope_head_dim: int = 64         # ... and the part with it (one RoPE key shared by the heads)
    v_head_dim: int = 128


@dataclass
class MoEConfig:
    """Mixture of experts (DeepSeekMoE, Qwen3-MoE): routed experts, optional shared experts."""
    n_routed_experts: int = 64
    n_shared_experts: int = 0          # experts every token goes through (DeepSeek: 2 or 1; Qwen3: 0)
    top_k: int = 6                     # routed experts per token
    ffn_dim: int = 1408                # each expert's intermediate size (a shared expert's too)
    first_k_dense: int = 0             # the first layers keep a dense MLP of model.ffn_dim
    score_func: Literal["softmax", "sigmoid"] = "softmax"   # V2 and Qwen3: softmax; V3: sigmoid
    norm_topk_prob: bool = False       # the chosen experts' weights rescaled to sum to 1
    route_scale: float = 1.0           # routed_scaling_factor: the routed output's multiplier
    n_group: int = 1                   # group-limited routing: experts in n_group groups,
    topk_group: int = 1                # ... a token's experts from its best topk_group groups
    aux_loss_alpha: float = 0.0        # sequence-level balance loss weight (DeepSeek-V2); 0 = none
    bias_update_speed: float = 0.0     # auxiliary-loss-free balancing (DeepSeek-V3, 0.001): a per-expert bias
    #                                    moved against each step's load; 0 = off
    capacity_factor: Optional[float] = None   # null: dropless; else an expert takes at most
    #                                    capacity_factor x (tokens x top_k / experts) tokens, the rest are dropped


FAMILIES = ("llama", "deepseek_v2", "deepseek_v3", "qwen3_moe")


@dataclass
class ModelConfig:
    name: str = "tiny"
    family: Literal["llama", "deepseek_v2", "deepseek_v3", "qwen3_moe"] = "llama"   # trainer/models/<family>
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    ffn_dim: int = 768
    vocab_size: int = 512
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    init_std: float = 0.02
    head_dim_size: Optional[int] = None   # null: dim / n_heads (Qwen3 sets 128 for every size)
    mla: Optional[MLAConfig] = None       # the DeepSeek families' attention (null: their defaults)
    moe: Optional[MoEConfig] = None       # experts (the DeepSeek and Qwen3-MoE families)
    mtp_depth: int = 0                    # multi-token prediction (DeepSeek-V3): decoder layers after the last,
    #                                       the k-th predicting the token k+1 ahead (trainer/models/multi_token.py)
    mtp_loss_weight: float = 0.3          # their mean loss's weight in the objective (V3: 0.3, later 0.1)

    def __post_init__(self):
        if self.family.startswith("deepseek") and self.mla is None:
            self.mla = MLAConfig()

    @property
    def head_dim(self) -> int:
        """A query/key head's size that RoPE rotates: under MLA its RoPE part (qk_rope_head_dim)."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return self.head_dim_size or self.dim // self.n_heads

    @property
    def decoder_layers(self) -> int:
        """Decoder layers a training step runs: the model's and one per multi-token prediction depth."""
        return self.n_layers + self.mtp_depth

    def moe_layer(self, layer_id: int) -> bool:
        """Whether layer `layer_id` is a mixture-of-experts layer (else a dense MLP)."""
        return self.moe is not None and layer_id >= self.moe.first_k_dense


@dataclass
class BlendSource:
    """One dataset of a weighted blend (data.blend)."""
    path: str = ""                 # prepared dataset dir (inv data.prepare)
    weight: Optional[float] = None  # > 0; the blend's weights are normalised to shares
    name: Optional[str] = None     # in metrics (val_loss/<name>, tokens/<name>); default: the folder's name

    def __post_init__(self):
        if self.name is None and isinstance(self.path, str) and self.path.strip():
            self.name = Path(self.path).name


@dataclass
class DataConfig:
    path: Optional[str] = None     # prepared dataset dir (inv data.prepare), or "synthetic"; left out:
    #                                data/stdlib; null only beside data.blend (load refuses it alone)
    blend: list[BlendSource] = field(default_factory=list)  # weighted datasets instead of data.path
    seq_len: int = 256
    batch_size: int = 8            # micro batch per rank
    grad_accum: int = 1            # micro batches per optimizer step
    document_mask: bool = False    # attention stays inside each document of a packed row (documents cut
    #                                by the dataset's BOS/EOS ids); false: causal over the whole row
    position_reset: bool = False   # with document_mask: RoPE positions restart at 0 in each document

    def __post_init__(self):
        if self.path is None and not self.blend:
            self.path = DEFAULT_DATA

    def datasets(self) -> list[str]:
        """Every dataset directory the run reads: the blend's, or data.path's ([] for synthetic)."""
        if self.blend:
            return [source.path for source in self.blend]
        return [] if self.path == SYNTHETIC else [self.path]


@dataclass
class OptimConfig:
    lr: float = 3e-4
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    grad_clip: float = 1.0         # max global grad norm; 0 disables clipping
    fused: bool = True             # fused AdamW where the device supports it


@dataclass
class ScheduleConfig:
    warmup_steps: int = 100
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = 0.1      # final lr = lr * min_lr_ratio


@dataclass
class TrainSection:
    steps: int = 1000
    seed: int = 1234
    device: Literal["auto", "cpu", "cuda"] = "auto"
    log_interval: int = 10
    val_interval: int = 100        # 0 = only at the end
    val_batches: int = 8
    activation_checkpoint: Literal["none", "selective", "selective_lean", "full"] = "none"
    compile: bool = False
    skip_guards: bool = True       # compile: once a step compiled nothing, skip dynamo's guard checks (guards.py; not MoE)
    float8_activations: bool = False       # compile: saved activations kept in float8 (saved_activations.py)
    float8_activations_min_mib: float = 100.0   # ... those of at least this size (not SwiGLU's stash)
    kernels: bool = False
    attention: Literal["auto", "flex", "sdpa"] = "auto"   # with data.document_mask: the attention
    #                                kernel; auto: FlexAttention on a GPU, SDPA with a mask on the CPU


@dataclass
class ParallelConfig:
    strategy: Literal["ddp", "fsdp"] = "ddp"
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    reshard_after_forward: bool = True
    meta_init: bool = False        # build on the meta device, shard, then init (models > 1 GPU)
    timeout_minutes: int = 30
    ep: int = 1                    # expert parallelism: each rank holds n_routed_experts / ep experts, and
    #                                tokens travel to their experts' ranks (all-to-all); needs strategy fsdp
    tp: int = 1                    # tensor parallelism with sequence parallelism: each of tp ranks holds
    #                                1/tp of every attention and MLP projection and 1/tp of the row's tokens
    #                                between them (trainer/models/tensor_parallel.py); needs strategy fsdp
    async_tp: bool = False         # with tp, compile and GPUs: Inductor overlaps the tp collectives with the
    #                                matmuls next to them (symmetric memory; torchtitan's async TP)
    cp: int = 1                    # context parallelism: each of cp ranks holds 1/cp of every row's tokens
    #                                and attends over all of them (keys and values gathered,
    #                                trainer/models/context_parallel.py). Ranks: data x cp x tp, tp innermost

    @property
    def model_ranks(self) -> int:
        """The ranks that split each row between them (cp x tp); the others are data ranks."""
        return self.cp * self.tp


@dataclass
class PrecisionConfig:
    compute: Literal["auto", "bf16", "fp32"] = "auto"   # auto: bf16 on GPU, fp32 on CPU
    params: Literal["fp32", "bf16"] = "fp32"            # bf16 = pure bf16 weights + optimizer
    fp8: Literal["off", "tensorwise", "rowwise"] = "off"  # FP8 linear layers (torchao float8), GPU only
    fp8_fused: bool = True   # with --kernels and tensorwise: RMSNorm and SwiGLU write the FP8 linears'
    #                          float8 inputs themselves; false: torchao casts their outputs (the reference)
    fp8_lm_head: bool = False   # with fp8 and --kernels: the fused loss runs the LM head's logits and hidden-
    #                          gradient GEMMs in float8, per-row scales (its weight gradient stays bf16)


@dataclass
class CheckpointConfig:
    interval: int = 0              # steps between checkpoints; 0 = only at the end / on signal
    keep_last: int = 3
    dir: str = "checkpoints"       # relative to the run dir
    save_final: bool = True
    init_from: Optional[str] = None   # a Hugging Face directory to start from (trainer/hf); --resume wins
    async_save: Optional[bool] = None   # write in the background, training paused only to copy the state to
    #                                 host memory; null: on where that copy fits in the host's memory
    write_threads: int = 4         # files each rank writes at once (DCP's thread_count): with one, two
    #                                 ranks wrote a local disk at 0.61x its dd speed, with four at 1.09x


@dataclass
class LoggingConfig:
    tensorboard: bool | None = None   # null: on when TensorBoard is installed; true: say so when it is not
    progress: bool = True          # progress bar on a terminal (rank 0)
    gpu_stats: bool = True         # utilisation via nvidia-ml-py / pyrsmi


#: health.on_nonfinite: what a NaN/Inf loss or gradient norm does (trainer.health.NumericGuard).
NONFINITE_ACTIONS = ("stop", "rerun")


@dataclass
class HealthConfig:
    """Straggler detection, the hang watchdog and numeric faults (trainer.health); restarts inside the job
    (runtime.jobs.restarts)."""
    straggler_interval: int = 50   # steps between straggler checks (one small all_gather); 0 = off
    straggler_margin: float = 0.2  # name a rank this much slower than the median (0.2 = 20%)
    hang_timeout_s: Optional[float] = None  # no step for this long = hung: stacks dumped, rank ended
    #                                 (exit 4); null: min(300, half of parallel.timeout_minutes); 0 = off
    max_restarts: int = 2          # the launcher restarts every rank from the newest checkpoint after a
    #                                 rank dies, hangs or hits a faulty GPU, this many times per run; 0 = off
    spares: int = 0                # nodes held back (the last ones named); a node that failed twice is
    #                                 swapped for one
    on_nonfinite: str = "stop"     # a NaN/Inf loss or gradient norm (or a spike): stop (checked at the log
    #                                 interval), or rerun the step once (checked every step): the batch's
    #                                 fault -> the step is skipped; the hardware's -> exit 5, restart
    spike_factor: float = 0.0      # rerun: a loss over this many times the recent median is a fault too; 0 = off


@dataclass
class TrainConfig:
    name: str = "run"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainSection = field(default_factory=TrainSection)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    env: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------- loading

def load(path: str | Path | None = None, overrides: typing.Iterable[str] = ()) -> TrainConfig:
    """Read, override and validate a config. Raises ConfigError."""
    path = Path(path) if path is not None else DEFAULT_CONFIG
    src = str(path)
    text = _read_text(path, src)
    try:
        raw = safe_yaml.load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{src}: invalid YAML{where}: {problem}") from None
    if raw is None:  # 0 bytes, blank, or only comments: nothing to train with; not the defaults
        raise ConfigError(f"{src}: config is empty; expected a mapping of sections "
                          f"(model:, data:, optim:, train:, ...)")
    if not isinstance(raw, dict):
        raise ConfigError(f"{src}: expected a mapping of sections at the top level, "
                          f"got {type(raw).__name__}")
    overrides = list(overrides)
    for item in overrides:
        _apply_override(raw, item, src)
    try:
        _refuse_null_data_path(raw, src)
        cfg = _build(TrainConfig, raw, "", src)
        _check_values(cfg, src)
    except ConfigError as exc:
        raise _blame_override(exc, src, overrides) from None
    return cfg


def _refuse_null_data_path(raw: dict, src: str) -> None:
    """data.path set to null with no data.blend: refused. Null is how a blend drops data.path
    (--set data.path=null --set data.blend=...); alone it used to fall back to data/stdlib and train
    on the standard library without a word. A config that leaves data.path out still gets that default."""
    data = raw.get("data")
    if isinstance(data, dict) and "path" in data and data["path"] is None and not data.get("blend"):
        raise ConfigError(f"{src}: data.path: expected a prepared dataset directory or 'synthetic', got null "
                          f"(null only makes way for data.blend, which names no datasets here)")


def _blame_override(exc: ConfigError, src: str, overrides: list[str]) -> ConfigError:
    """A bad key or value that came from --set says so: "tiny.yaml with --set optim.lrr=3e-4:
    unknown key ..." rather than blaming the file for a typo on the command line."""
    text = str(exc)
    said = re.match(rf"{re.escape(src)}: (?:unknown key '([^']+)'|([\w.]+)(?:\[\d+\][\w.]*)?: )", text)
    key = said and (said[1] or said[2])
    item = next((o for o in reversed(overrides) if key and o.partition("=")[0].strip() in
                 (key, *(key.rsplit(".", n)[0] for n in range(1, key.count(".") + 1)))), None)
    if item is None and said:   # a check across keys ("model.dim: expected a multiple of model.n_heads")
        item = next((o for o in reversed(overrides) if o.partition("=")[0].strip() and
                     re.search(rf"(?<![\w.]){re.escape(o.partition('=')[0].strip())}(?![\w.])", text)), None)
    return ConfigError(f"{src} with --set {item}{text[len(src):]}") if item else exc


def _read_text(path: Path, src: str) -> str:
    """The config file's text; a missing file, a directory or binary content is a ConfigError."""
    expected = f"expected a YAML config such as {DEFAULT_CONFIG.relative_to(DEFAULT_CONFIG.parent.parent)}"
    if path.is_dir():
        raise ConfigError(f"{src}: is a directory; expected a YAML config file")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{src}: no such config file") from None
    except OSError as e:
        raise ConfigError(f"{src}: cannot read it ({e.strerror or e}); {expected}") from None
    text, where = text_of(data)
    if text is None:
        raise ConfigError(f"{src}: not a text YAML file ({where}); {expected}")
    return text.removeprefix("\ufeff")


def from_dict(raw: dict, source: str = "<dict>") -> TrainConfig:
    cfg = _build(TrainConfig, raw, "", source)
    _check_values(cfg, source)
    return cfg


def _apply_override(raw: dict, item: str, src: str) -> None:
    key, sep, value = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"{src}: override {item!r}: expected KEY=VALUE, e.g. optim.lr=3e-4")
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"{src}: override {key}: {part!r} is not a section")
        node = child
    try:
        node[parts[-1]] = safe_yaml.load(value) if value.strip() else ""
    except yaml.YAMLError:
        node[parts[-1]] = value


def _describe(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_describe(a) for a in args) + " or null"
    if origin is list:
        inner = typing.get_args(tp)[0]
        plural = {int: "integers", float: "numbers", str: "strings", bool: "true/false values"}.get(inner)
        return f"a list of {plural}" if plural else f"a list, each {_describe(inner)}"
    if origin is dict:
        return "a mapping of NAME: string"
    if dataclasses.is_dataclass(tp):
        return "a mapping with keys " + ", ".join(f.name for f in dataclasses.fields(tp))
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}[tp]


def _convert(tp, value, key: str, src: str):
    def bad():
        return ConfigError(f"{src}: {key}: expected {_describe(tp)}, got {value!r}")

    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return _convert(inner, value, key, src)
    if origin is Literal:
        choices = typing.get_args(tp)
        if isinstance(value, bool):   # YAML 1.1 reads a bare off/on/no/yes as a boolean
            value = {False: "off", True: "on"}[value] if ({"off", "on"} & set(choices)) else value
        if value not in choices:
            raise bad()
        return value
    if origin is list:
        if not isinstance(value, list):
            raise bad()
        (inner,) = typing.get_args(tp)
        return [_convert(inner, v, f"{key}[{i}]", src) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise bad()
        out = {}
        for k, v in value.items():
            # env values are strings; numbers are accepted and written as strings.
            if isinstance(v, bool) or not isinstance(v, (str, int, float)):
                raise ConfigError(f"{src}: {key}.{k}: expected a string (quote it), got {v!r}")
            out[str(k)] = str(v)
        return out
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise bad()
        return _build(tp, value, key + ".", src)
    if tp is bool:
        if not isinstance(value, bool):
            raise bad()
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad()
        return value
    if tp is float:
        if isinstance(value, bool):
            raise bad()
        if isinstance(value, (int, float)):
            number = float(value)
        elif isinstance(value, str):  # PyYAML reads "3e-4" as a string
            try:
                number = float(value)
            except ValueError:
                raise bad() from None
        else:
            raise bad()
        if not math.isfinite(number):  # .inf, .nan, "inf", 1e999: every float field, list items too
            raise ConfigError(f"{src}: {key}: expected a finite number, got {value!r}")
        return number
    if tp is str:
        if not isinstance(value, str):
            raise bad()
        return value
    raise TypeError(f"unsupported config type {tp!r}")


def _build(cls, raw: dict, prefix: str, src: str):
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in raw.items():
        key = f"{prefix}{k}"
        if k not in fields:
            raise ConfigError(f"{src}: unknown key {key!r}; expected one of: "
                              + ", ".join(prefix + name for name in fields))
        kwargs[k] = _convert(hints[k], v, key, src)
    return cls(**kwargs)


def validate(cfg: TrainConfig, src: str = "the config") -> None:
    """ConfigError where a config changed in code (trainer/speed.py's search) breaks a rule load() checks."""
    _check_values(cfg, src)


def _check_values(cfg: TrainConfig, src: str) -> None:
    def need(ok: bool, key: str, expected: str):
        if not ok:
            value = cfg
            for part in key.split("."):
                value = getattr(value, part)
            raise ConfigError(f"{src}: {key}: expected {expected}, got {value!r}")

    m = cfg.model
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len"):
        need(getattr(m, key) > 0, f"model.{key}", "a positive integer")
    need(m.head_dim_size is not None or m.mla is not None or m.dim % m.n_heads == 0, "model.dim",
         f"a multiple of model.n_heads ({m.n_heads})")
    need(m.mla is not None or m.head_dim % 2 == 0, "model.n_heads",
         "a head count giving an even head_dim (dim / n_heads, or model.head_dim_size)")
    need(m.n_heads % m.n_kv_heads == 0, "model.n_kv_heads", f"a divisor of model.n_heads ({m.n_heads})")
    need(m.norm_eps > 0, "model.norm_eps", "a positive number")
    need(m.rope_theta > 0, "model.rope_theta", "a positive number")
    need(m.init_std > 0, "model.init_std", "a positive number")
    if m.rope_scaling is not None:
        rs = m.rope_scaling
        need(rs.factor >= 1, "model.rope_scaling.factor", "a number >= 1")
        if rs.type == "llama3":
            need(rs.high_freq_factor > rs.low_freq_factor > 0, "model.rope_scaling.high_freq_factor",
                 "a number above model.rope_scaling.low_freq_factor (> 0)")
        else:
            need(rs.beta_fast > rs.beta_slow > 0, "model.rope_scaling.beta_fast",
                 "a number above model.rope_scaling.beta_slow (> 0)")
        need(rs.original_max_position_embeddings > 0,
             "model.rope_scaling.original_max_position_embeddings", "a positive integer")
    _check_family(m, cfg.parallel, need)
    _check_model_parallel(cfg, need)
    need(0 <= m.mtp_depth < cfg.data.seq_len, "model.mtp_depth",
         f"an integer from 0 (off) to below data.seq_len ({cfg.data.seq_len})")
    need(m.mtp_loss_weight > 0, "model.mtp_loss_weight", "a positive number, e.g. 0.3")
    d = cfg.data
    if d.blend:
        _check_blend(d, src)
    else:
        need(bool(d.path.strip()), "data.path", "a prepared dataset directory or 'synthetic'")
    need(d.seq_len > 0, "data.seq_len", "a positive integer")
    need(d.seq_len <= m.max_seq_len, "data.seq_len", f"at most model.max_seq_len ({m.max_seq_len})")
    need(d.batch_size > 0, "data.batch_size", "a positive integer")
    need(d.grad_accum > 0, "data.grad_accum", "a positive integer")
    need(d.document_mask or not d.position_reset, "data.position_reset",
         "false unless data.document_mask is true (positions restart where attention stops at a document's end)")
    o = cfg.optim
    need(0 < o.lr <= 1, "optim.lr", "a learning rate in (0, 1], e.g. 3e-4")
    need(o.weight_decay >= 0, "optim.weight_decay", "a number >= 0")
    need(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), "optim.betas",
         "two numbers in [0, 1), e.g. [0.9, 0.95]")
    need(o.eps > 0, "optim.eps", "a positive number")
    need(o.grad_clip >= 0, "optim.grad_clip", "a number >= 0 (0 disables clipping)")
    s = cfg.schedule
    need(s.warmup_steps >= 0, "schedule.warmup_steps", "an integer >= 0")
    need(0 <= s.min_lr_ratio <= 1, "schedule.min_lr_ratio", "a number in [0, 1]")
    t = cfg.train
    need(t.steps > 0, "train.steps", "a positive integer")
    need(t.log_interval > 0, "train.log_interval", "a positive integer")
    need(t.val_interval >= 0, "train.val_interval", "an integer >= 0 (0 = only at the end)")
    need(t.val_batches >= 0, "train.val_batches", "an integer >= 0 (0 disables validation)")
    need(not t.float8_activations or t.compile, "train.float8_activations",
         "false unless train.compile is true (the float8 storage is a torch.compile pass; or pass --compile)")
    need(t.float8_activations_min_mib > 0, "train.float8_activations_min_mib", "a positive number of MiB")
    need(cfg.parallel.timeout_minutes > 0, "parallel.timeout_minutes", "a positive integer")
    c = cfg.checkpoint
    need(c.interval >= 0, "checkpoint.interval", "an integer >= 0 (0 = only at the end)")
    need(c.keep_last > 0, "checkpoint.keep_last", "a positive integer")
    need(c.write_threads > 0, "checkpoint.write_threads", "a positive integer")
    need(bool(c.dir.strip()), "checkpoint.dir", "a directory name")
    h = cfg.health
    need(h.straggler_interval >= 0, "health.straggler_interval", "an integer >= 0 (0 = off)")
    need(h.straggler_margin > 0, "health.straggler_margin", "a positive number, e.g. 0.2 (20% above the median)")
    collective_s = cfg.parallel.timeout_minutes * 60
    need(h.hang_timeout_s is None or 0 <= h.hang_timeout_s < collective_s, "health.hang_timeout_s",
         f"null (auto), 0 (off) or seconds below the collective timeout parallel.timeout_minutes "
         f"({collective_s} s), which would end the ranks first")
    need(h.max_restarts >= 0, "health.max_restarts", "an integer >= 0 (0 = a fault ends the run)")
    need(h.spares >= 0, "health.spares", "an integer >= 0 (nodes held back for a node that fails twice)")
    need(h.on_nonfinite in NONFINITE_ACTIONS, "health.on_nonfinite", " or ".join(NONFINITE_ACTIONS))
    need(h.spike_factor == 0 or h.spike_factor > 1, "health.spike_factor",
         "0 (off) or a factor above 1, e.g. 3 (a loss 3x its recent median)")
    need(h.spike_factor == 0 or h.on_nonfinite == "rerun", "health.spike_factor",
         "0 unless health.on_nonfinite is rerun (a spike is rerun like a NaN)")
    for name in cfg.env:
        if not name or not (name[0].isalpha() or name[0] == "_") or not all(
                ch.isalnum() or ch == "_" for ch in name):
            raise ConfigError(f"{src}: env.{name}: expected an environment variable name "
                              "(letters, digits, _)")


def _check_family(m: ModelConfig, p: ParallelConfig, need) -> None:
    """What model.family asks of the model's other keys: experts and latent attention where it has them,
    ranks, routing and expert parallelism that fit."""
    moe_family, mla_family = m.family != "llama", m.family.startswith("deepseek")
    need(moe_family or m.moe is None, "model.moe", f"null for model.family {m.family!r} (experts: "
         "model.family deepseek_v2, deepseek_v3 or qwen3_moe)")
    need(not moe_family or m.moe is not None, "model.moe", f"a mapping of the experts for model.family "
         f"{m.family!r} (n_routed_experts, top_k, ffn_dim, ...)")
    need(mla_family or m.mla is None, "model.mla", f"null for model.family {m.family!r} (latent attention: "
         "the deepseek families)")
    need(m.head_dim_size is None or m.head_dim_size > 0, "model.head_dim_size", "null or a positive integer")
    if m.mla is not None:
        a = m.mla
        for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            need(getattr(a, key) > 0, f"model.mla.{key}", "a positive integer")
        need(a.qk_rope_head_dim % 2 == 0, "model.mla.qk_rope_head_dim", "an even number (RoPE rotates pairs)")
        need(a.q_lora_rank >= 0, "model.mla.q_lora_rank", "0 (no query latent) or a positive integer")
        full_q, full_kv = m.n_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim), \
            m.n_heads * (a.qk_nope_head_dim + a.v_head_dim)
        need(a.q_lora_rank < full_q, "model.mla.q_lora_rank",
             f"a rank below the query heads' size (model.n_heads x (qk_nope_head_dim + qk_rope_head_dim) = {full_q})")
        need(a.kv_lora_rank < full_kv, "model.mla.kv_lora_rank",
             f"a rank below the key/value heads' size (model.n_heads x (qk_nope_head_dim + v_head_dim) = {full_kv})")
    if m.moe is not None:
        e = m.moe
        need(e.n_routed_experts > 0, "model.moe.n_routed_experts", "a positive integer")
        need(0 < e.top_k <= e.n_routed_experts, "model.moe.top_k",
             f"a number of experts from 1 to model.moe.n_routed_experts ({e.n_routed_experts})")
        need(e.ffn_dim > 0, "model.moe.ffn_dim", "a positive integer")
        need(e.n_shared_experts >= 0, "model.moe.n_shared_experts", "an integer >= 0")
        need(0 <= e.first_k_dense <= m.n_layers, "model.moe.first_k_dense",
             f"an integer from 0 to model.n_layers ({m.n_layers})")
        need(e.n_group > 0 and e.n_routed_experts % e.n_group == 0, "model.moe.n_group",
             f"a divisor of model.moe.n_routed_experts ({e.n_routed_experts})")
        need(0 < e.topk_group <= e.n_group, "model.moe.topk_group", f"from 1 to model.moe.n_group ({e.n_group})")
        need(e.top_k <= e.topk_group * (e.n_routed_experts // e.n_group), "model.moe.top_k",
             f"at most the experts of model.moe.topk_group groups "
             f"({e.topk_group * (e.n_routed_experts // e.n_group)})")
        need(e.route_scale > 0, "model.moe.route_scale", "a positive number")
        need(e.aux_loss_alpha >= 0, "model.moe.aux_loss_alpha", "a number >= 0 (0 = no balance loss)")
        need(e.bias_update_speed >= 0, "model.moe.bias_update_speed", "a number >= 0 (0 = off)")
        need(e.capacity_factor is None or e.capacity_factor > 0, "model.moe.capacity_factor",
             "null (dropless) or a positive number (1.0 = the even share)")
    need(p.ep > 0, "parallel.ep", "a positive integer")
    if p.ep > 1:
        need(m.moe is not None, "parallel.ep", f"1 for model.family {m.family!r} (it has no experts)")
        need(m.moe.n_routed_experts % p.ep == 0, "parallel.ep",
             f"a divisor of model.moe.n_routed_experts ({m.moe.n_routed_experts})")
        need(p.strategy == "fsdp", "parallel.ep", "1 unless parallel.strategy is fsdp (experts shard with FSDP2)")


def _check_model_parallel(cfg: TrainConfig, need) -> None:
    """parallel.tp and parallel.cp: what each splits must divide evenly, and what does not compose yet."""
    m, p, T = cfg.model, cfg.parallel, cfg.data.seq_len
    need(p.tp > 0, "parallel.tp", "a positive integer")
    need(p.cp > 0, "parallel.cp", "a positive integer")
    if p.tp > 1:
        need(m.family == "llama", "parallel.tp", f"1 for model.family {m.family!r} (tensor parallelism splits "
             "the Llama family's attention and MLP; experts split with parallel.ep)")
        need(p.strategy == "fsdp", "parallel.tp", "1 unless parallel.strategy is fsdp (the tensor-parallel "
             "weights shard with FSDP2 over the data ranks)")
        for key, size in (("model.n_heads", m.n_heads), ("model.n_kv_heads", m.n_kv_heads),
                          ("model.ffn_dim", m.ffn_dim)):
            need(size % p.tp == 0, "parallel.tp", f"a divisor of {key} ({size})")
        need(cfg.precision.fp8 == "off", "parallel.tp", "1 with precision.fp8 (torchao's float8 linears are not "
             "wired to the tensor-parallel plan yet)")
    need(not p.async_tp or (p.tp > 1 and cfg.train.compile), "parallel.async_tp",
         "false unless parallel.tp is above 1 and train.compile is on (Inductor rewrites the compiled layers)")
    if p.tp > 1 or p.cp > 1:
        need(p.ep == 1, "parallel.ep", "1 with parallel.tp or parallel.cp above 1 (not combined yet)")
        need(m.mtp_depth == 0 or p.tp == 1, "model.mtp_depth", "0 with parallel.tp above 1 (multi-token "
             "prediction's layers are not on the tensor-parallel plan yet)")
        # each cp rank holds two of 2 x cp chunks of a row (the causal work balanced), split again over tp
        share = 2 * p.cp * p.tp if p.cp > 1 else p.tp
        need(T % share == 0, "data.seq_len", f"a multiple of {share} ("
             + ("2 x parallel.cp x parallel.tp: each rank holds two chunks of every row)" if p.cp > 1
                else "parallel.tp: each rank holds 1/tp of every row)"))


def check_world(cfg: TrainConfig, world_size: int, src: str = "the config") -> None:
    """ConfigError when the parallel layout does not fit `world_size` processes (known at launch)."""
    if world_size % cfg.parallel.model_ranks:
        raise ConfigError(f"{src}: parallel.tp x parallel.cp: expected a divisor of the {world_size} process(es) "
                          f"(the rest are data-parallel ranks), got {cfg.parallel.tp} x {cfg.parallel.cp}")
    ep = cfg.parallel.ep
    if ep > 1 and world_size % ep:
        raise ConfigError(f"{src}: parallel.ep: expected a divisor of the {world_size} process(es) (and of "
                          f"model.moe.n_routed_experts, {cfg.model.moe.n_routed_experts}), got {ep}")


def _check_blend(d: DataConfig, src: str) -> None:
    """data.blend: no data.path beside it; each source a dataset directory with a positive weight and a
    name unlike the others' (names key the per-source metrics); no dataset twice."""
    if d.path is not None:
        raise ConfigError(f"{src}: data.blend: expected data.path or data.blend, not both (data.path is "
                          f"{d.path!r}; --set data.path=null drops it)")
    names, paths = {}, {}
    for i, source in enumerate(d.blend):
        key = f"data.blend[{i}]"
        if not source.path.strip():
            raise ConfigError(f"{src}: {key}.path: expected a prepared dataset directory, got {source.path!r}")
        if source.path == SYNTHETIC:
            raise ConfigError(f"{src}: {key}.path: expected a prepared dataset directory; synthetic tokens "
                              f"cannot be blended (data.path=synthetic alone measures throughput)")
        if source.weight is None or source.weight <= 0:
            raise ConfigError(f"{src}: {key}.weight: expected a positive number (the weights are normalised "
                              f"to shares), got {source.weight!r}")
        if not BLEND_NAME.match(source.name or ""):
            raise ConfigError(f"{src}: {key}.name: expected a name of letters, digits, '_', '.' and '-' "
                              f"(default: the folder's name), got {source.name!r}; set {key}.name")
        if source.name in names:
            raise ConfigError(f"{src}: {key}.name: expected a name unlike {names[source.name]}'s, got "
                              f"{source.name!r}; set {key}.name")
        same = os.path.normpath(source.path)
        if same in paths:
            raise ConfigError(f"{src}: {key}.path: {source.path!r} is already {paths[same]}; a dataset "
                              f"appears once in a blend (raise its weight instead)")
        names[source.name], paths[same] = key, key


def dump(cfg: TrainConfig) -> str:
    """YAML text of the config as used (load() reads it back to an equal config)."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
