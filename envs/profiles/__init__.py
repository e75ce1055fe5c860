"""The profile registry: vendor layers, one module per GPU model, sites.

To add a GPU: write envs/profiles/<model>.py with MODEL (a GpuModel) and
PROFILE (model_profile(MODEL, ...)), then list the module in MODEL_MODULES.
"""
from __future__ import annotations

import re
from typing import Optional

from envs.errors import EnvError
from envs.profiles import (a100, b200, base, cpu, cuda, h100, h200, mi210, mi250x, mi300x, mi325x,
                           mi350x, mi355x, rocm)
from envs.spec import GpuModel, Profile

MODEL_MODULES = (mi210, mi250x, mi300x, mi325x, mi350x, mi355x, a100, h100, h200, b200)
MODELS: dict[str, GpuModel] = {m.MODEL.key: m.MODEL for m in MODEL_MODULES}
MODEL_PROFILES: dict[str, Profile] = {m.MODEL.key: m.PROFILE for m in MODEL_MODULES}
VENDOR_PROFILES: dict[str, Profile] = {"amd": rocm.PROFILE, "nvidia": cuda.PROFILE, "cpu": cpu.PROFILE}
BASE: Profile = base.PROFILE


def known_names() -> list[str]:
    return [m.name for m in MODELS.values()]


def by_name(name: str) -> GpuModel:
    """The model a user typed (--gpu / ANVIL_GPU): "MI300X", "mi300x", "AMD Instinct MI300X", "H100"."""
    key = re.sub(r"[^a-z0-9]", "", name.lower())
    if key in MODELS:
        return MODELS[key]
    found = match_reported(name)
    if found:
        return found
    raise EnvError(f"unknown GPU model {name!r}; known models: {', '.join(known_names())}")


def match_reported(name: str, device_id: Optional[int] = None,
                   compute_units: Optional[int] = None) -> Optional[GpuModel]:
    """The model a probe's product name (or, failing that, PCI device id) names; None if unknown.

    Where a model declares `compute_units` (MI250X: 110 per GCD, MI250: 104),
    a reported count that differs means another model sharing the id/name.
    """
    for model in MODELS.values():
        named = bool(name) and any(re.search(p, name, re.IGNORECASE) for p in model.patterns)
        by_id = device_id is not None and device_id in model.device_ids
        if not (named or by_id):
            continue
        if model.compute_units and compute_units and compute_units != model.compute_units:
            continue
        return model
    return None
