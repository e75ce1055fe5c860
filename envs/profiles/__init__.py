"""The profile registry: vendor layers, one module per GPU model, sites.

To add a GPU: write envs/profiles/<model>.py with MODEL (a GpuModel) and
PROFILE (model_profile(MODEL, ...)), then list the module in MODEL_MODULES.
"""
from __future__ import annotations

import difflib
import re
from dataclasses import replace
from typing import Optional

from core.vendor import Vendor
from core import names
from envs.errors import EnvError
from envs.profiles import (a100, b200, base, cpu, cuda, h100, h200, mi210, mi250x, mi300x, mi325x,
                           mi350x, mi355x, rocm)
from envs.spec import GpuModel, Profile

MODEL_MODULES = (mi210, mi250x, mi300x, mi325x, mi350x, mi355x, a100, h100, h200, b200)
MODELS: dict[str, GpuModel] = {m.MODEL.key: m.MODEL for m in MODEL_MODULES}
MODEL_PROFILES: dict[str, Profile] = {m.MODEL.key: m.PROFILE for m in MODEL_MODULES}
VENDOR_PROFILES: dict[Vendor, Profile] = {Vendor.AMD: rocm.PROFILE, Vendor.NVIDIA: cuda.PROFILE, Vendor.CPU: cpu.PROFILE}
BASE: Profile = base.PROFILE


def known_names() -> list[str]:
    return [m.name for m in MODELS.values()]


# A typed name: an optional vendor prefix (as the probes report it: "AMD Instinct MI300X"), the model,
# and optionally "-<size>" with the memory per device (A100-40, A100-40GB, A100_40G, "A100 40GiB").
_TYPED = re.compile(r"(?:(?:nvidia|amd)\s+)?(?:instinct\s+)?(?P<model>[a-z0-9]+)(?P<rest>.*)", re.IGNORECASE)
_SIZE = re.compile(r"[-_ ](?P<gib>-?\d+(?:\.\d+)?)\s*(?:gib|gb|g)?", re.IGNORECASE)
# Sizes below the profile's are real (an H100 MIG 3g.40gb slice, an MI300X CPX partition of 24 GB); above
# it only a little: the largest variant over its profile is the H100 NVL (94 GB) or GH200 (96 GB), 1.2x.
MAX_SIZE_OVER_PROFILE = 1.25


def by_name(name: str, source: str = "--gpu") -> GpuModel:
    """The model a user typed (--gpu / names.GPU): "MI300X", "mi300x", "AMD Instinct MI300X", "H100",
    "A100-40GB" (then with that memory_gib). Exact model names only, any case; EnvError (exit 2) else.
    source: where the name came from (--gpu, names.GPU), for the message."""
    model, memory_gib = parse_typed(name, source)
    return replace(model, memory_gib=memory_gib) if memory_gib is not None else model


def parse_typed(name: str, source: str = "--gpu") -> tuple[GpuModel, Optional[float]]:
    """(model, memory in GiB or None) of a typed name as by_name reads it; EnvError (exit 2) if it is not one."""
    text = name.strip()
    label = f"{names.GPU}={text!r}" if source == names.GPU else f"{source} {text!r}"
    # Separators inside the name are the user's choice ("MI-300X"); only what follows a whole model is a size.
    key = re.sub(r"[^a-z0-9]", "", text.lower())
    if key in MODELS:
        return MODELS[key], None
    typed = _TYPED.fullmatch(text)
    model = MODELS.get(typed.group("model").lower()) if typed else None
    if model is None:
        close = difflib.get_close_matches(typed.group("model").upper() if typed else text.upper(), known_names(),
                                          n=2, cutoff=0.6)
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        where, unset = (f" in the {names.GPU} variable", f"; unset {names.GPU} to detect this machine's GPUs") \
            if source == names.GPU else ("", "")
        raise EnvError(f"unknown GPU model {text!r}{where}; {hint}known models: {', '.join(known_names())}{unset}")
    rest = typed.group("rest")
    if not rest:
        return model, None
    sized = _SIZE.fullmatch(rest)
    if not sized:
        raise EnvError(f"{label}: expected {model.name} or {model.name}-<GiB per GPU> (e.g. {model.name}-"
                       f"{model.memory_gib:g} or {model.name}-{model.memory_gib:g}GB), either with :COUNT or not; "
                       f"got {rest!r} after the model name")
    gib = float(sized.group("gib"))
    most = model.memory_gib * MAX_SIZE_OVER_PROFILE
    if not 0 < gib <= most:
        raise EnvError(f"{label}: {gib:g} GiB per GPU is refused: expected more than 0 and at most {most:g} GiB "
                       f"(the {model.name} profile has {model.memory_gib:g})")
    return model, gib



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
