"""Resolve the environment in layers, keeping where every value came from.

base -> vendor (rocm | cuda | cpu) -> model (mi300x, h100, ...) -> site (lumi)
-> tuning (TunableOp, with --tune-gemm) -> config (the training config's env: block) -> cli (--env KEY=VALUE).
A later layer overrides an earlier one; each Var keeps every layer that
touched it, so `inv env.explain VAR` can show the whole story.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, NamedTuple, Optional, Union

from core.vendor import Vendor
from core import names
from core.host import host_name
from envs import profiles
from envs.detect import detect
from envs.errors import EnvError
from envs.machine import Machine
from envs.profiles import sites, tunableop
from envs.spec import Computed, Profile

#: The layers a task's own input sets (the config's env: block, --env), after this checkout's profiles.
INPUT_LAYERS = ("config", "cli")
LAYERS = ("base", "vendor", "model", "site", "tuning") + INPUT_LAYERS


class Change(NamedTuple):
    """One layer's say on a variable (value None: that layer unset it)."""

    layer: str
    value: Optional[str]
    reason: str
    ref: str


@dataclass
class Var:
    name: str
    value: Optional[str]
    source: str  # the layer that set the final value: "base", "vendor:rocm", "model:mi300x", "site:lumi", ...
    reason: str
    ref: str
    history: list = field(default_factory=list)  # list[Change], first layer first
    computed: bool = False  # the final value was computed from this machine (recompute per node)

    def to_dict(self) -> dict:
        return {"name": self.name, "value": self.value, "source": self.source, "reason": self.reason,
                "ref": self.ref, "history": [c._asdict() for c in self.history]}


@dataclass
class ResolvedEnv:
    machine: Machine
    site: Optional[str]
    layers: list  # labels of the layers applied, in order
    vars: dict = field(default_factory=dict)  # name -> Var
    warnings: list = field(default_factory=list)

    def environ(self) -> dict[str, str]:
        """The variables to export (unset ones left out)."""
        return {name: var.value for name, var in sorted(self.vars.items()) if var.value is not None}

    def node_local(self) -> list[str]:
        """Names whose value was computed from this machine: each node recomputes them."""
        return sorted(name for name, var in self.vars.items() if var.computed)

    def to_json(self) -> dict:
        return {"machine": self.machine.to_dict(), "site": self.site, "layers": self.layers,
                "vars": {name: var.to_dict() for name, var in sorted(self.vars.items())},
                "warnings": self.warnings}

    @classmethod
    def from_json(cls, data: dict) -> "ResolvedEnv":
        """The inverse of to_json: another host's `inv env.show --json`."""
        machine = Machine.from_dict(data["machine"])
        resolved = cls(machine, data.get("site"), data.get("layers", []), warnings=data.get("warnings", []))
        for name, var in data.get("vars", {}).items():
            history = [Change(**h) for h in var.get("history", [])]
            resolved.vars[name] = Var(name, var["value"], var["source"], var["reason"], var["ref"], history)
        return resolved


@dataclass
class Context:
    """What computed values may look at: the machine, the process environment, the file system root."""

    machine: Machine
    environ: Mapping[str, str]
    hostname: str
    root: Path = Path("/")
    resolved: dict = field(default_factory=dict)  # values resolved so far

    def get(self, name: str) -> Optional[str]:
        """A variable as resolved so far, else from the process environment."""
        var = self.resolved.get(name)
        if var is not None:
            return var.value
        return self.environ.get(name)


def parse_overrides(overrides: Union[Iterable[str], Mapping[str, str]]) -> dict[str, str]:
    """["KEY=VALUE", ...] (or a dict) -> dict; malformed entries raise EnvError."""
    if isinstance(overrides, Mapping):
        return {str(k): str(v) for k, v in overrides.items()}
    parsed = {}
    for item in overrides or ():
        key, sep, value = item.partition("=")
        if not sep or not key or not key.replace("_", "a").isalnum() or key[0].isdigit():
            raise EnvError(f"--env expects KEY=VALUE with a variable name as KEY, got {item!r}")
        parsed[key] = value
    return parsed


def resolve(machine: Optional[Machine] = None, gpu: Optional[str] = None, site: Optional[str] = None,
            config_env: Optional[Mapping] = None, overrides=(), context: Optional[dict] = None,
            config_ref: str = "the training config's env: block", tune_gemm: bool = False) -> ResolvedEnv:
    """Resolve the environment for `machine` (default: detect(gpu)).

    site: a site name, "none" for no site, or None to auto-detect.
    context: optional {"environ": mapping, "hostname": str, "root": path} for computed values.
    tune_gemm: add the tuning layer (envs/profiles/tunableop.py: TunableOp on, its results file kept per key).
    """
    context = context or {}
    environ = context.get("environ", os.environ)
    root = Path(context.get("root", "/"))
    machine = machine or detect(gpu, environ=environ)
    cli_values = parse_overrides(overrides)  # validate before doing any work
    site_key = _pick_site(site, environ, root)

    stack: list[Profile] = [profiles.BASE, profiles.VENDOR_PROFILES[machine.vendor]]
    if machine.profile:
        stack.append(profiles.MODEL_PROFILES[machine.profile])
    if site_key:
        stack.append(sites.get(site_key).PROFILE)
    if tune_gemm:
        stack.append(tunableop.PROFILE)

    result = ResolvedEnv(machine, site_key, [p.label for p in stack])
    ctx = Context(machine, environ, context.get("hostname") or host_name(), root, result.vars)
    for profile in stack:
        for entry in profile.entries:
            if isinstance(entry, Computed):
                value, detail = _compute(entry, ctx, result)
                if value is None:
                    continue
                reason = f"{entry.reason} ({detail})" if detail else entry.reason
            else:
                value, reason = entry.value, entry.reason
            _apply(result.vars, entry.name, value, profile.label, reason, entry.ref,
                   computed=isinstance(entry, Computed) and entry.per_node)
    if config_env:
        result.layers.append("config")
        for name, value in config_env.items():
            _apply(result.vars, str(name), None if value is None else str(value), "config",
                   "set in the training config", config_ref)
    if cli_values:
        result.layers.append("cli")
        for name, value in cli_values.items():
            _apply(result.vars, name, value, "cli", "--env on the command line", "command line")

    if machine.unknown_gpu:
        result.warnings.append(unknown_gpu_message(machine))
    if tune_gemm and not machine.has_gpu:
        result.warnings.append("--tune-gemm: no GPU here, so TunableOp has no GEMM to tune")
    for name, var in sorted(result.vars.items()):
        shell = environ.get(name)
        if shell is not None and var.value is not None and shell != var.value and var.source != "cli":
            result.warnings.append(f"{name}={shell} in your environment is replaced by {var.value} ({var.source}); "
                                   f"pass --env {name}={shell} to keep yours")
    return result


def unknown_gpu_message(machine: Machine) -> str:
    return (f"GPU {machine.name!r} ({machine.arch or 'unknown arch'}) has no Anvil profile: only the base and "
            f"{profiles.VENDOR_PROFILES[machine.vendor].key} layers apply, no tuned settings and no peak FLOP/s. "
            f"Known models: {', '.join(profiles.known_names())}. Add envs/profiles/<model>.py, or accept it with "
            f"--allow-unknown-gpu / {names.ALLOW_UNKNOWN_GPU}=1 (preflight fails otherwise).")


def _pick_site(site: Optional[str], environ, root: Path) -> Optional[str]:
    if site is None:
        return sites.detect(environ, root)
    if site.lower() in ("none", ""):
        return None
    sites.get(site)  # raises EnvError for an unknown name
    return site.lower()


def _compute(entry: Computed, ctx: Context, result: ResolvedEnv):
    try:
        out = entry.compute(ctx)
    except Exception as exc:  # a probe that breaks must not take the whole resolution down
        result.warnings.append(f"{entry.name}: could not compute ({exc.__class__.__name__}: {exc})")
        return None, None
    if isinstance(out, tuple):
        return out
    return out, None


def _apply(table: dict, name: str, value: Optional[str], layer: str, reason: str, ref: str,
           computed: bool = False) -> None:
    change = Change(layer, value, reason, ref)
    var = table.get(name)
    if var is None:
        table[name] = Var(name, value, layer, reason, ref, [change], computed)
    else:
        var.value, var.source, var.reason, var.ref = value, layer, reason, ref
        var.computed = computed
        var.history.append(change)


def compute_here(names: Iterable[str], environ: Optional[Mapping[str, str]] = None,
                 hostname: Optional[str] = None) -> dict[str, str]:
    """Recompute machine-derived variables on this node (the launcher's per-node step).

    A variable computed from the machine where `inv` ran (the socket interface,
    the host name, the RDMA ports) is wrong on a compute node whose interface is
    named differently; the launcher drops such values and every node calls this.
    Only computed entries are looked at, so nothing here probes the GPUs.
    """
    environ = os.environ if environ is None else environ
    stack = [profiles.BASE, *profiles.VENDOR_PROFILES.values(), *profiles.MODEL_PROFILES.values(),
             *(site.PROFILE for site in sites.SITES.values())]
    # The last layer that computes a name wins, as in resolve(). Only per-node values: one that is
    # the same for the whole job (a GPU model's peak) keeps what the launch host resolved, since
    # searching every model's profile here would pick an arbitrary model's.
    computers = {e.name: e for profile in stack for e in profile.entries
                 if isinstance(e, Computed) and e.per_node}
    machine = Machine(vendor=Vendor.CPU, model=None, name="not probed", arch=None, count=0, memory_gib=None)
    ctx = Context(machine, environ, hostname or host_name())
    out: dict[str, str] = {}
    for name in names:
        entry = computers.get(name)
        if entry is None:
            continue
        try:
            value = entry.compute(ctx)
        except Exception:  # a probe that breaks leaves the variable unset, as in resolve()
            continue
        value = value[0] if isinstance(value, tuple) else value
        if value is not None:
            out[name] = str(value)
    return out
