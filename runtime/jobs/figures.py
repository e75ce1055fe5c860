"""The figures a speed prediction (trainer.speed) multiplies by, found for a GPU model.

    rates = figures.for_device(settings.runs_dir, device)    # recorded here, shipped, or the datasheet
    path = figures.record(settings.runs_dir, "H100", measured) # `inv bench.rates`: kept for later plans

In this order: what `inv bench.rates` measured on this cluster (RUNS/.figures/<model>.json, each
measurement merged into the file: more shapes, the newer rate of a shape); what Anvil ships, measured
by us on that model (benchmarks/figures/<model>.json, with device, versions and date); else the model's
datasheet peaks at trainer.speed's stated efficiencies. A machine without a GPU has only what it measured
of itself (model "CPU"). A file that cannot be read is named in one line, never silently skipped.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from core.errors import UserError

RECORDED = ".figures"       # under the runs directory (hidden: not a run)
SHIPPED = Path(__file__).resolve().parents[2] / "benchmarks" / "figures"
CPU = "CPU"


def key_of(model_name: str) -> str:
    return model_name.lower().replace(" ", "_")


def recorded_path(runs_dir: Path, model_name: str) -> Path:
    return Path(runs_dir) / RECORDED / f"{key_of(model_name)}.json"


def _read(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        return data
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: unreadable speed figures ({exc}); remove it or measure again with "
                        "`inv bench.rates`") from None


def for_device(runs_dir: Path, name: str | None, vendor=None, net_gbps: float | None = None):
    """trainer.speed.Rates for a GPU model name (None or "CPU": this machine without a GPU), or None where
    nothing is known (a CPU never measured)."""
    from trainer import speed

    name = name or CPU
    model = None
    if name != CPU:
        from envs import profiles
        model = profiles.MODELS.get(key_of(name))
    peak = model.peak_tflops if model else None
    for path, how in ((recorded_path(runs_dir, name), "measured here"), (SHIPPED / f"{key_of(name)}.json",
                                                                            "measured by Anvil")):
        data = _read(path)
        if data is None:
            continue
        rates = speed.Rates.from_dict({**data, "gpu": name, "measured": True, "peak_tflops": peak})
        rates.source = f"{how}: {data.get('device') or name}, {data.get('date', '?')} ({_shown(path)})"
        if model is not None:      # what was not measured (the links, FP8 peak) from the datasheet
            sheet = speed.datasheet(model)
            rates.link_gbps = rates.link_gbps or sheet.link_gbps
            rates.fp8_tflops = rates.fp8_tflops or sheet.fp8_tflops
            rates.attention_tflops = rates.attention_tflops or sheet.attention_tflops
            rates.hbm_gbps = rates.hbm_gbps or sheet.hbm_gbps
        if net_gbps:
            rates.net_gbps = net_gbps
        return rates
    if model is None or not model.hbm_gbps:
        return None
    return speed.datasheet(model, net_gbps=net_gbps or speed.NET_GBPS)


def _shown(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path.relative_to(SHIPPED.parents[1])) if SHIPPED.parents[1] in path.parents else path.name


def record(runs_dir: Path, model_name: str, measured: dict) -> Path:
    """Merge a measurement into this cluster's figures for the model; the file replaced whole (atomic)."""
    from trainer import speed

    path = recorded_path(runs_dir, model_name)
    old = _read(path)
    new = speed.Rates.from_dict({**measured, "gpu": model_name, "measured": True, "source": "", "peak_tflops": None})
    if old is not None:
        new = speed.Rates.from_dict({**old, "gpu": model_name, "measured": True, "source": "",
                                     "peak_tflops": None}).merged(new)
    data = {k: v for k, v in new.to_dict().items() if k not in ("gpu", "source", "measured", "peak_tflops")}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)
    return path
