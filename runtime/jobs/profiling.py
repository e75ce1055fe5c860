"""What profile.train and profile.compare do with a profiled run: its summary, its chart, two runs side by side,
and the kernels a vendor tool is pointed at.

    summary = summarise(run)                 # inside the run: RUN/profile/summary.json and breakdown.png
    a, b = compare(run_a, run_b)             # their summaries (made from the ranks' files where missing)
    regex = kernel_regex("runs/..._profile.train_x", top=5)   # or a regular expression, checked
    rows = ncu_summary(RUN/profile/rank0.ncu-rep)              # per kernel: time, SM and memory throughput

summary.json holds, per profiled rank, the breakdown (trainer.profiling.breakdown: ms per step and share
by category, exposed communication, GPU idle and what the host did meanwhile), the candidates with their
actions (trainer.profiling.advice), the window's steps and wall time, and the run settings the advice used.
"""
from __future__ import annotations

import csv
import io
import json
import re
import subprocess
from pathlib import Path

from core import names
from core.errors import AnvilError, UserError

SUMMARY = names.PROFILE_SUMMARY
CHART = "breakdown.png"


class ProfileError(UserError):
    pass


def _rank_files(profile_dir: Path) -> dict[str, dict]:
    out = {}
    for path in sorted(profile_dir.glob("rank*.breakdown.json"), key=lambda p: int(re.sub(r"\D", "", p.name) or 0)):
        try:
            out[path.name.split(".")[0].removeprefix("rank")] = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ProfileError(f"{path}: unreadable ({exc})") from None
    return out


def _settings(run_dir: Path):
    from core import safe_yaml
    from trainer.profiling.advice import RunSettings

    config_path = run_dir / names.CONFIGS_DIR / names.TRAIN_CONFIG
    try:
        cfg = safe_yaml.load(config_path.read_text()) if config_path.is_file() else {}
    except Exception:  # noqa: BLE001 - advice without the config's details is still advice
        cfg = {}
    meta = {}
    try:
        meta = json.loads((run_dir / names.METADATA).read_text())
    except (OSError, json.JSONDecodeError):
        pass
    source = (meta.get("config_sources") or {}).get(names.TRAIN_CONFIG, "")
    return RunSettings.from_config(cfg if isinstance(cfg, dict) else {}, world_size=meta.get("world_size") or 1,
                                   config=source)


def build(run_dir: Path) -> dict:
    """The summary of a profiled run from its ranks' breakdown files (none: {"ranks": {}})."""
    from dataclasses import asdict

    from trainer.profiling.advice import candidates

    run_dir = Path(run_dir)
    settings = _settings(run_dir)
    ranks = {}
    for rank, window in _rank_files(run_dir / names.PROFILE_DIR).items():
        bd = window.get("breakdown", {})
        ranks[rank] = {"steps": window.get("steps"), "wall_ms": window.get("wall_ms"), "breakdown": bd,
                       "candidates": candidates(bd, settings)}
    return {"run": str(run_dir), "settings": asdict(settings), "ranks": ranks}


def summarise(run) -> dict:
    """summary.json and breakdown.png of a run that has just profiled (run: runtime.runs.run.Run)."""
    from trainer.profiling.report import chart

    summary = build(run.path)
    run.write_json(f"profile/{SUMMARY}", summary)
    breakdowns = {rank: entry["breakdown"] for rank, entry in summary["ranks"].items()}
    png = None
    if any("rows" in bd for bd in breakdowns.values()):
        try:
            png = chart(breakdowns, run.path / names.PROFILE_DIR / CHART, title=f"{run.path.name}: step time by category")
        except Exception as exc:  # noqa: BLE001 - the table and summary.json hold the same figures
            summary["chart_error"] = f"{type(exc).__name__}: {exc}"
    summary["chart"] = str(png) if png else None
    return summary


def load_summary(run: str | Path, runs_dir: Path | None = None) -> dict:
    """A profiled run's summary: its summary.json, or one made from its ranks' files."""
    from runtime.runs import rundir

    try:
        path = rundir.resolve(run, runs_dir)
    except rundir.RunDirError as exc:
        raise ProfileError(str(exc)) from None
    file = path / names.PROFILE_DIR / SUMMARY
    if file.is_file():
        try:
            return json.loads(file.read_text())
        except json.JSONDecodeError as exc:
            raise ProfileError(f"{file}: not valid JSON ({exc})") from None
    summary = build(path)
    if not summary["ranks"]:
        raise ProfileError(f"{run}: no profile in it (no profile/rank*.breakdown.json); make one with "
                           f"`inv profile.train`")
    return summary


def compare(run_a: str | Path, run_b: str | Path, rank: str = "", runs_dir: Path | None = None):
    """(name, breakdown) of each run for one rank (default: the lowest both profiled)."""
    out = []
    summaries = [load_summary(run, runs_dir) for run in (run_a, run_b)]
    common = sorted(set(summaries[0]["ranks"]) & set(summaries[1]["ranks"]), key=int)
    if rank:
        if rank not in common:
            raise ProfileError(f"--rank {rank}: profiled in both runs are ranks {', '.join(common) or 'none'}")
    elif not common:
        raise ProfileError(f"the two runs profiled no rank in common ({sorted(summaries[0]['ranks'])} and "
                           f"{sorted(summaries[1]['ranks'])}): give --rank of each with the same number")
    chosen = rank or common[0]
    for run, summary in zip((run_a, run_b), summaries):
        bd = summary["ranks"][chosen]["breakdown"]
        if "error" in bd:
            raise ProfileError(f"{run}: rank {chosen} has no breakdown ({bd['error']})")
        out.append((Path(summary["run"]).name, bd))
    return chosen, out


# ---------------------------------------------------------------- vendor tools

def kernel_regex(source: str, top: int, runs_dir: Path | None = None) -> str:
    """--tool-kernels: a run directory profiled before (its `top` largest kernels, as ncu and rocprofv3 name
    functions), or a regular expression, checked."""
    if not source:
        return ""
    candidate = Path(source)
    if candidate.is_dir() or (runs_dir is not None and (Path(runs_dir) / source).is_dir()):
        summary = load_summary(source, runs_dir)
        found: list[str] = []
        for entry in summary["ranks"].values():
            for _, name, _ in entry["breakdown"].get("top_kernels", []):
                if re.match(r"Mem(cpy|set)\b", name):     # a copy engine's work, no kernel to measure
                    continue
                base = function_name(name)
                if base and base not in found:
                    found.append(base)
        if not found:
            raise ProfileError(f"--tool-kernels {source}: its profile lists no GPU kernels (a CPU run?)")
        return "|".join(re.escape(n) for n in found[:top])
    try:
        re.compile(source)
    except re.error as exc:
        raise ProfileError(f"--tool-kernels {source!r}: neither a run directory nor a regular expression "
                           f"({exc})") from None
    return source


def function_name(name: str) -> str:
    """A kernel's function name as the profilers match it (ncu --kernel-name-base function): no return type,
    namespaces, template arguments or parameters. 'void at::native::f<4, g(int)>(int)' -> 'f'."""
    depth, out = 0, []
    for ch in name:
        if ch == "<":
            depth += 1
        elif ch == ">" and depth:
            depth -= 1
        elif depth == 0:
            out.append(ch)
    text = "".join(out).split("(")[0].strip()
    text = text.split()[-1] if text.split() else ""
    return text.split("::")[-1]


NCU_METRICS = ("gpu__time_duration.sum", "sm__throughput.avg.pct_of_peak_sustained_elapsed",
               "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed", "launch__grid_size")


def ncu_summary(report: Path, timeout: int = 120) -> list[dict]:
    """Per measured kernel of an ncu report: duration, SM and memory throughput (% of peak), grid size."""
    proc = subprocess.run(["ncu", "--import", str(report), "--csv", "--page", "raw", "--metrics",
                           ",".join(NCU_METRICS)], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AnvilError(f"ncu --import {report}: {(proc.stderr.strip().splitlines() or ['failed'])[-1]}")
    return parse_ncu_csv(proc.stdout)


def parse_ncu_csv(text: str) -> list[dict]:
    """ncu's --page raw --csv: a header row, a units row, one row per kernel launch."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    rows = list(csv.DictReader(io.StringIO("\n".join(lines))))
    out = []
    for row in rows:
        if not row.get("Kernel Name") or row.get("ID", "").strip() == "":
            continue
        try:
            int(row["ID"])
        except ValueError:      # the units row
            continue
        out.append({"kernel": row["Kernel Name"], "id": int(row["ID"]),
                    **{metric: _number(row.get(metric)) for metric in NCU_METRICS}})
    return out


def _number(text):
    try:
        return float(str(text).replace(",", ""))
    except (TypeError, ValueError):
        return None
