"""GPU detection: which vendor, model, architecture and how many, without importing torch."""
from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Optional

from core.vendor import Vendor
from core import names
from envs import profiles
from envs.errors import EnvError
from envs.machine import GpuStatus, Machine, Gpu
from envs.probes import amd, nvidia

ROOT = Path("/")


def detect(gpu_override: Optional[str] = None, environ=os.environ) -> Machine:
    """This machine, or with `gpu_override` / names.GPU ("MI300X", "H100:4") another machine's profile."""
    if gpu_override:
        return synthesize(gpu_override, "--gpu")
    if environ.get(names.GPU):
        return synthesize(environ[names.GPU], names.GPU)
    return _detect_live(ROOT)


def synthesize(name: str, source: str = "--gpu") -> Machine:
    """A Machine for a model by name ("MI300X" or "MI300X:4" for 4 GPUs); raises EnvError if unknown.
    source: where the name was given (--gpu, names.GPU), for the message."""
    count = None
    match = re.fullmatch(r"(.+):(\d+)", name.strip())
    if match:
        name, count = match.group(1), int(match.group(2))
        if count < 1:
            raise EnvError(f"{source} {name}:{count}: the GPU count after ':' must be 1 or more")
    model = profiles.by_name(name, source)
    count = count or model.default_count
    return Machine(
        vendor=model.vendor, model=model.name, name=model.name, arch=model.arch, count=count,
        memory_gib=model.memory_gib, source="override", profile=model.key,
        gpus=[Gpu(i, model.name, model.memory_gib, model.arch) for i in range(count)],
        notes=[f"not detected: the {model.name} profile was asked for (--gpu / {names.GPU})"],
    )


@functools.lru_cache(maxsize=4)
def _detect_live(root: Path) -> Machine:
    found = amd.probe(root)
    if found:
        return machine_from(Vendor.AMD, *found)
    found = nvidia.probe() if root == ROOT else None
    if found:
        return machine_from(Vendor.NVIDIA, *found)
    return Machine(vendor=Vendor.CPU, model=None, name="no GPU", arch=None, count=0, memory_gib=None, source="none")


def machine_from(vendor: Vendor, gpus: list, driver: Optional[str], platform_version: Optional[str],
                 source: str) -> Machine:
    """Summarise probe results: the first device names the model; a mixed node is noted."""
    first = gpus[0]
    model = profiles.match_reported(first.name, first.device_id, first.compute_units)
    notes = []
    if len({g.name for g in gpus}) > 1:
        notes.append("mixed GPU models on this node: " + ", ".join(sorted({g.name for g in gpus})))
    if model and model.compute_units and first.compute_units is None:
        notes.append(f"{model.name} assumed: the probe does not report compute units, which tell it from "
                     f"look-alikes (MI250 has 104 per GCD, MI250X 110)")
    if model is None and first.device_id and not first.name.startswith("AMD GPU"):
        notes.append(f"device id 0x{first.device_id:04x}")
    return Machine(
        vendor=vendor, model=model.name if model else None, name=first.name,
        arch=first.arch or (model.arch if model else None), count=len(gpus),
        memory_gib=first.memory_gib or (model.memory_gib if model else None),
        driver=driver, platform_version=platform_version,
        source=source, profile=model.key if model else None, gpus=gpus, notes=notes,
    )


def gpu_status(machine: Machine) -> Optional[GpuStatus]:
    """Live state of this machine's GPUs; None on CPU, for a synthesized machine, or if no probe answers."""
    if not machine.has_gpu or machine.source == "override":
        return None
    return amd.status() if machine.vendor is Vendor.AMD else nvidia.status()
