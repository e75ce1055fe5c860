"""What to try next: every category except the GEMMs over a share of the step, with one concrete action.

    candidates(bd, RunSettings.from_config(cfg, world_size=8))
    -> [{"category": "norm", "label": "normalisation", "ms": 9.1, "share": 0.036,
         "action": "--kernels: Anvil's fused Triton RMSNorm, one kernel forward and one backward"}, ...]

The action depends on how the run was made (--kernels, --compile, FP8, DDP or
FSDP, fp32 or bf16 weights): advice to turn on what is already on is no advice.
GPU idle time is split by what the host was doing in the gaps (idle_gaps in the
breakdown): reading data, waiting on a sync, stepping the optimizer, or only
launching kernels (launch-bound).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from trainer.profiling.categories import GEMM_KEYS

THRESHOLD = 0.02   # a category over 2% of the step is worth a look (the MI300X workflow's cut-off)

_DATA = re.compile(r"anvil::next_batch|DataLoader", re.IGNORECASE)
_SYNC = re.compile(r"synchronize|aten::item|_local_scalar_dense|Memcpy(DtoH|WithStream)|hipMemcpy$|cudaMemcpy$",
                   re.IGNORECASE)
_OPTIMIZER = re.compile(r"^Optimizer\.|clip_grad|_foreach_", re.IGNORECASE)


@dataclass(frozen=True)
class RunSettings:
    """What the advice needs to know about the run."""
    compile: bool = False
    kernels: bool = False
    fp8: str = "off"
    strategy: str = "ddp"
    world_size: int = 1
    params: str = "fp32"
    reshard_after_forward: bool = True
    config: str = ""          # the config path, for commands to copy
    synthetic: bool = False   # data.path: synthetic (random tokens drawn on the host)

    @classmethod
    def from_config(cls, cfg: dict, world_size: int = 1, config: str = "") -> "RunSettings":
        """From a run's config as used (RUN/configs/train.yaml, a dict)."""
        train, precision, parallel = cfg.get("train", {}), cfg.get("precision", {}), cfg.get("parallel", {})
        fp8 = precision.get("fp8", "off")
        return cls(compile=bool(train.get("compile")), kernels=bool(train.get("kernels")),
                   fp8="off" if fp8 in (False, None) else str(fp8), strategy=str(parallel.get("strategy", "ddp")),
                   world_size=int(world_size or 1), params=str(precision.get("params", "fp32")),
                   reshard_after_forward=bool(parallel.get("reshard_after_forward", True)), config=config,
                   synthetic=(cfg.get("data") or {}).get("path") == "synthetic")


def candidates(bd: dict, run: RunSettings, threshold: float = THRESHOLD) -> list[dict]:
    """The rows of `bd` other than the GEMMs over `threshold` of the step, largest first, each with an action."""
    if "error" in bd:
        return []
    out = []
    for row in bd["rows"]:
        if row["category"] in GEMM_KEYS or row["share"] <= threshold:
            continue
        out.append({"category": row["category"], "label": row["label"], "ms": row["ms"], "share": row["share"],
                    "action": action(row["category"], bd, run)})
    return sorted(out, key=lambda c: -c["ms"])


def _fused_or_bench(run: RunSettings, what: str, op: str) -> str:
    if not run.kernels:
        return f"--kernels: {what}"
    return (f"already Anvil's fused kernel (--kernels): `inv bench.kernels --op {op}` compares it with torch.compile "
            f"and Liger at your shapes")


def action(key: str, bd: dict, run: RunSettings) -> str:
    config = f" --config {run.config}" if run.config else ""
    if key == "attention":
        top = (bd.get("top_by_category", {}).get("attention") or [["?"]])[0][0]
        return (f"its own kernels ({top[:48]}): at its floor for this sequence length unless the SDPA backend "
                f"changes; `python -m benchmarks.train_throughput --worker attention{config}` times each backend")
    if key == "norm":
        return _fused_or_bench(run, "Anvil's fused Triton RMSNorm, one kernel forward and one backward", "rms_norm")
    if key == "rope":
        return _fused_or_bench(run, "the fused rotary kernel, q and k in one launch", "rope")
    if key == "activation":
        return _fused_or_bench(run, "the fused SwiGLU kernel (gate and up read once)", "swiglu")
    if key == "loss":
        return _fused_or_bench(run, "the fused linear cross-entropy, which never holds the logits", "flce")
    if key == "fp8_cast":
        if run.fp8 == "rowwise":
            return ("precision.fp8=tensorwise: rowwise scales cost a reduction per row of every operand "
                    "(BENCHMARKS.md: FP8)")
        if not run.compile:
            return "the fused FP8 path, --compile: Inductor folds the casts and scales into the neighbouring kernels"
        return ("the casts Inductor cannot fold sit after opaque kernels (Anvil's Triton RMSNorm and SwiGLU with "
                "--kernels): compare a run without --kernels with `inv profile.compare`")
    if key == "optimizer":
        if not run.kernels:
            return "--kernels: TritonAdamW steps each parameter in one kernel, clipping inside"
        if run.strategy != "fsdp" and run.world_size > 1:
            return ("parallel.strategy=fsdp: each rank then steps 1/world of the parameters instead of all of them")
        return ("memory traffic of the optimizer state; precision.params=bf16 halves it (bf16 weights, no fp32 "
                "master copy: a precision trade)" if run.params == "fp32" else
                "memory traffic of the optimizer state: it is already TritonAdamW on bf16 weights")
    if key == "communication":
        if run.strategy == "fsdp":
            step = ("parallel.reshard_after_forward=false keeps each layer's gathered weights from forward to "
                    "backward (one all-gather less per layer, more memory: `inv train.plan` shows it)"
                    if run.reshard_after_forward else
                    "the reduce-scatters are exposed: a larger data.batch_size gives the backward more to hide them "
                    "behind (`inv train.plan` says what fits)")
            return step + "; across nodes, `inv preflight.comm` checks the links"
        return ("DDP's last gradient bucket is exposed: a larger data.batch_size gives the backward more to hide "
                "it behind (`inv train.plan` says what fits); across nodes, `inv preflight.comm` checks the links")
    if key == "memory":
        if run.params == "fp32" and run.strategy != "fsdp":
            return ("autocast casts every fp32 weight to bf16 each step: --compile fuses the casts into their "
                    "consumers, parallel.strategy=fsdp casts once per all-gather; summary.json lists the copies "
                    "(top_by_category.memory)")
        return "summary.json lists the copies (top_by_category.memory); --compile fuses casts into their consumers"
    if key == "other":
        if not run.compile:
            return "--compile fuses chains of elementwise kernels into one"
        return ("the largest are in summary.json (top_by_category.other); a kernel a rule should have named "
                "belongs in trainer/profiling/categories.py")
    if key == "idle":
        return _idle_action(bd, run)
    return ""


def idle_causes(bd: dict) -> dict[str, float]:
    """ms per step of GPU idle time by what the host was doing: data, sync, optimizer, launching."""
    out = {"data": 0.0, "sync": 0.0, "optimizer": 0.0, "launching": 0.0}
    for outer, inner, ms, _ in bd.get("idle_gaps", {}).get("by_host_op", []):
        names = f"{outer} {inner}"
        if _DATA.search(names):
            out["data"] += ms
        elif _SYNC.search(inner) or _SYNC.search(outer):
            out["sync"] += ms
        elif _OPTIMIZER.search(outer) or _OPTIMIZER.search(inner):
            out["optimizer"] += ms
        else:
            out["launching"] += ms
    return out


def _idle_action(bd: dict, run: RunSettings) -> str:
    causes = idle_causes(bd)
    cause = max(causes, key=causes.get) if any(causes.values()) else "launching"
    if cause == "data" and run.synthetic:
        return ("the GPU waits for the next batch: data.path=synthetic draws its random tokens on the host each "
                "step; a prepared dataset is read from memory-mapped shards instead (time it with one)")
    if cause == "data":
        return ("the GPU waits for the next batch: Anvil's loader reads memory-mapped shards in the training "
                "process (no worker processes), so put the dataset on a local or faster file system")
    if cause == "sync":
        return ("host syncs: something reads a GPU value on the host (.item(), .cpu(), printing a tensor) and "
                "waits for the whole queue; the loop reads its loss a step late and never does, so look for the "
                "caller in the trace's host events (a hook, a callback, custom code)")
    if cause == "optimizer":
        return ("the optimizer step launches many small kernels: --kernels (TritonAdamW, one kernel per parameter)"
                if not run.kernels else "the optimizer step's launches: a larger data.batch_size spreads them "
                                        "over more work (`inv train.plan` says what fits)")
    bigger = "a larger data.batch_size if the plan allows (`inv train.plan --set data.batch_size=N` says whether it fits)"
    if not run.compile:
        return f"launch-bound: --compile (fewer, larger kernels), or {bigger}"
    return f"launch-bound: {bigger}"
