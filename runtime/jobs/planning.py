"""The memory plan (trainer.plan) where the runner needs it.

`inv train.plan` plans for a named or detected GPU (`plan_device`). `inv train.pretrain`
asks the same planner before it launches (`fit`): on GPUs, against the GPU's memory; on a
machine without one, against this machine's memory shared by the ranks, where a run that does
not fit ends with the kernel's OOM killer and no message of its own. A run that certainly
cannot fit (its peak without the plan's allowances is more than a rank has) is refused unless
forced; one that probably will not gets a warning.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from core.vendor import Vendor
from core import names
from trainer.plan import Device, memory, with_changes

GIB = 1024 ** 3
# The plan's peak matched the peaks measured on H100 and H200 runs within 1.1% (BENCHMARKS.md): a
# peak more than twice that above the memory cannot fit, whatever the plan missed.
PLAN_ERROR = 0.022


def split_gpu_size(gpu: str) -> tuple[str, float | None]:
    """'A100-40GB:8' -> ('A100:8', 40.0): the profile to resolve and the memory per GPU to plan for;
    ('H100:4', None) without a size; ('', None) for none. A name envs.profiles.by_name refuses (an unknown
    model, junk after it, a size of 0 or too large) or a count of 0 raises its EnvError (exit 2)."""
    from envs import profiles
    from envs.errors import EnvError

    text = gpu.strip()
    if not text:
        return "", None
    name, count = re.fullmatch(r"(.*?)(?::(\d+))?", text).groups()
    if count is not None and int(count) < 1:
        # envs.synthesize reads a count of 0 as "the model's default": here that would plan for 8 GPUs
        raise EnvError(f"--gpu {text!r}: the GPU count after ':' must be 1 or more")
    model, memory_gib = profiles.parse_typed(name, "--gpu")
    return model.name + (f":{count}" if count else ""), memory_gib


def plan_device(resolved, memory_gib: float | None = None) -> tuple[Device, int]:
    """(Device, GPU count) of an envs.resolve() result; memory_gib overrides the profile's."""
    machine = resolved.machine
    if not machine.has_gpu:
        return Device(source="no GPU detected"), 1
    alloc = next((v for k, v in resolved.environ().items()
                  if k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")), "")
    source = ("--gpu" if memory_gib is not None else _profile_source(machine)) if machine.source == "override" \
        else f"detected by {machine.source}"
    return Device(machine.model or machine.name, machine.memory_gib if memory_gib is None else memory_gib,
                  machine.vendor, "expandable_segments:true" in alloc.replace(" ", "").lower(), source), machine.count


def _profile_source(machine) -> str:
    """Where a named machine's memory comes from: its profile, or a size in the name (names.GPU=A100-40GB)."""
    from envs import profiles

    model = profiles.MODELS.get(machine.profile)
    return f"envs/profiles/{machine.profile}.py" if model and model.memory_gib == machine.memory_gib \
        else f"--gpu / {names.GPU}"


def host_memory_gib() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    except (ValueError, OSError, AttributeError):
        return None


@dataclass
class Fit:
    """What the plan says of a run that will not fit: `certain` when even its peak without the
    allowances (fragmentation, the CUDA/ROCm context, communication buffers: the uncertain part of the
    plan) is more than each rank has, beyond the plan's own error, so it cannot fit; else it
    probably will not."""
    message: str
    certain: bool


def fit(cfg, resolved, procs_per_node: int, nodes: int, on_this_machine: bool) -> Fit | None:
    """None when the plan says the run fits each rank's memory (or there is nothing to check it
    against); else the verdict, one line.

    on_this_machine: the ranks run here (not on Slurm nodes that a login node cannot see), so
    without a GPU they share this machine's memory."""
    world = max(1, procs_per_node) * max(1, nodes)
    device, _count = plan_device(resolved)
    where = f"{device.name} ({device.memory_gib:g} GiB)" if device.memory_gib else ""
    if not device.memory_gib:
        ram = host_memory_gib()
        if not (on_this_machine and ram):
            return None   # the GPUs are elsewhere and not named: nothing to check against
        # Each rank holds its own copy here (the CPU path is one process or DDP over gloo), in fp32
        # unless the config says bf16, and no CUDA context.
        device = Device("CPU", ram / max(1, procs_per_node), Vendor.CPU, None, "this machine's memory")
        where = f"this machine's {ram:.0f} GiB of memory" + (f" shared by {procs_per_node} ranks"
                                                              if procs_per_node > 1 else "")
        if cfg.precision.compute == "auto":
            cfg = with_changes(cfg, **{"precision.compute": "fp32"})
    mem = memory(cfg, world, device)
    if mem.fits(world) is not False:
        return None
    certain = mem.peak_bytes > device.memory_gib * GIB * (1 + PLAN_ERROR)
    need = (mem.peak_bytes if certain else mem.needed_bytes(world)) / GIB
    # train.plan plans for GPUs: here, on a CPU, it can only be pointed at the GPU the run is for.
    advice = ("`inv train.plan` with the same --config and --set shows the breakdown and what would fit"
              if device.vendor is not Vendor.CPU else
              "lower data.batch_size or the model here, or plan it for its GPU: `inv train.plan` with the same "
              "--config and --set and --gpu NAME (e.g. H100)")
    if certain:
        return Fit(f"the memory plan says this run cannot fit: its peak alone, before any allowance, is "
                   f"{_gib(need)} GiB per rank (data.batch_size {mem.batch_size}, activation checkpointing "
                   f"{mem.mode}) on {where}; {advice}", True)
    return Fit(f"the memory plan says this run will not fit: it needs about {_gib(need)} GiB per rank "
               f"(data.batch_size {mem.batch_size}, activation checkpointing {mem.mode}) on {where}; {advice}",
               False)


def fit_warning(cfg, resolved, procs_per_node: int, nodes: int, on_this_machine: bool) -> str | None:
    """fit's line, or None."""
    verdict = fit(cfg, resolved, procs_per_node, nodes, on_this_machine)
    return verdict.message if verdict else None


def _gib(value: float) -> str:
    """45.3, 1,234.5, 1.97e+17: a size in GiB that reads at any magnitude."""
    return f"{value:,.1f}" if value < 1e6 else f"{value:.3g}"



def rates_for(device, runs_dir, net_gbps: float | None = None):
    """trainer.speed.Rates for a trainer.plan.Device (runtime.jobs.figures: measured, shipped or the
    datasheet; this machine's own where no GPU is named), or None where nothing is known."""
    from runtime.jobs import figures

    cpu = not device.memory_gib or (device.vendor is not None and Vendor.parse(device.vendor) is Vendor.CPU)
    return figures.for_device(runs_dir, None if cpu else device.name, net_gbps=net_gbps)


def speed_of(cfg, rates, gpus: int, nodes: int, always: bool = False):
    """trainer.speed's Prediction of the run with `rates` (rates_for), or None: without figures measured on the
    device unless `always` (then its datasheet), and where nothing at all is known."""
    from trainer import speed

    if rates is None or not (rates.measured or always):
        return None
    try:
        return speed.predict(cfg, rates, gpus=gpus, nodes=nodes)
    except speed.SpeedError:
        return None


def nodes_of(gpus: int, nodes: int, device) -> tuple[int, int]:
    """(GPUs a node, nodes): --gpus 512 on one node of a model built as 8-GPU boards is 64 nodes of 8."""
    from envs import profiles

    model = profiles.MODELS.get((device.name or "").lower())
    per_node = model.default_count if model else 8
    if nodes == 1 and gpus > per_node and gpus % per_node == 0 and device.memory_gib:
        return per_node, gpus // per_node
    return gpus, nodes


def positive(value, flag: str) -> float | None:
    """A positive number given as text, or None when not given; UserError otherwise."""
    from core.errors import UserError

    if value in (None, ""):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = 0.0
    if not number > 0:
        raise UserError(f"{flag} {value!r}: expected a positive number")
    return number


def predicted(cfg, resolved, procs_per_node: int, nodes: int, runs_dir) -> dict | None:
    """What a training run records before it starts (metadata.json `prediction`): its predicted speed from
    figures measured on its GPU model (none from a datasheet: a guess is not recorded as a prediction)."""
    import sys

    from core.errors import UserError

    device, _count = plan_device(resolved)
    try:
        p = speed_of(cfg, rates_for(device, runs_dir), max(1, procs_per_node), max(1, nodes))
    except UserError as exc:   # unreadable figures: said, and the run goes on without a prediction
        print(f"warning: {exc}; this run records no speed prediction", file=sys.stderr)
        return None
    if p is None:
        return None
    return {"tokens_per_s_per_gpu": round(p.tokens_per_s_per_gpu, 1), "step_s": round(p.step_s, 5),
            "mfu": round(p.mfu, 4) if p.mfu is not None else None, "rates": p.rates_source,
            "parts_s": {k: round(v, 5) for k, v in p.parts.items()}}


def compared(prediction: dict, summary: dict) -> dict:
    """The prediction with the run's measured tokens/s per GPU beside it, their ratio, and the line the
    console shows."""
    measured = summary.get("tokens_per_s_per_device") or summary.get("tokens_per_s")
    out = dict(prediction)
    if not measured:
        return out
    ratio = prediction["tokens_per_s_per_gpu"] / measured
    out.update(measured_tokens_per_s_per_gpu=round(measured, 1), predicted_over_measured=round(ratio, 3))
    out["line"] = (f"speed: {measured:,.0f} tokens/s per device measured, {prediction['tokens_per_s_per_gpu']:,.0f} "
                   f"predicted ({ratio:.2f}x; figures {prediction['rates']})")
    return out
