"""Reading recorded runs back: listing, one run's record, and differences.

The files are the ones runtime.runs.run writes (see runtime/runs/rundir.py).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core import names
from core.runfiles import experts_text, wall_time_text
from runtime.runs import rundir
from core.files import seal_problem, unsealed


@dataclass
class Recorded:
    path: Path
    metadata: dict
    env: dict          # name -> {value, source, ...}
    machine: dict
    versions: dict
    configs: dict      # file name -> parsed content (or text)
    git: dict
    summary: dict = field(default_factory=dict)  # a training run's summary.json ({}: none)
    summary_problem: str = ""                     # why summary.json / result.json could not be read
    benchmark: dict = field(default_factory=dict)  # a benchmark's results: gemm, collectives, kernels, measurements
    seals: dict = field(default_factory=dict)      # who sealed the records a replay restores: {file: trust.sealed_by}

    @property
    def gpu(self) -> dict:
        gpu = self.machine.get("gpu")
        if not isinstance(gpu, dict):
            return {}
        if "platform_version" not in gpu:   # a run recorded before the one vendor vocabulary
            gpu = {**gpu, "platform_version": gpu.get("runtime_version")}
        return gpu


def _parse_config(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        return f"(unreadable: {exc.strerror or exc})"
    if path.suffix == ".json":
        try:
            return json.loads(text)
        except ValueError:
            return text
    if path.suffix in (".yaml", ".yml"):
        import yaml

        from core import safe_yaml
        try:
            return safe_yaml.load(text)
        except safe_yaml.YAMLTooLarge as exc:   # an edited copy: shown as what it is, never expanded
            return f"(not read: {exc.problem})"
        except yaml.YAMLError:
            return text
    return text


def _object(path: Path, seals: dict | None = None) -> dict:
    """A run file that holds a JSON object ({} when absent); RunDirError when it is damaged (its seal,
    when it has one, does not match: rundir.read_record). Who sealed it goes into `seals`."""
    try:
        data, sealed = rundir.read_sealed(path, {})
    except rundir.RunDirError as exc:  # not valid JSON, not UTF-8, edited since it was sealed
        text = str(exc)
        raise rundir.RunDirError(text if text.endswith("damaged") else f"{text}; the run directory is damaged") \
            from None
    except OSError as exc:
        raise rundir.RunDirError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise rundir.RunDirError(f"{path}: expected a JSON object, got a {type(data).__name__}; "
                                 f"the run directory is damaged")
    if seals is not None:
        seals[path.name] = sealed
    return data


def load(path: str | Path, runs_dir: Path | None = None) -> Recorded:
    """One recorded run, by path or by name under runs_dir. RunDirError (exit 2) says what
    is wrong: not a run, or a record file that is damaged."""
    where = f" (a path, or a name under {runs_dir})" if runs_dir is not None else ""
    if not str(path).strip():
        raise rundir.RunDirError(f"the run is empty; expected a run directory{where}")
    named = runs_dir is not None and (Path(runs_dir) / str(path)).is_dir()
    if Path(path).exists() and not Path(path).is_dir() and not named:
        raise rundir.RunDirError(f"{path}: not a directory; expected a run directory{where}")
    try:
        run_dir = rundir.resolve(path, runs_dir)
    except rundir.RunDirError as exc:
        raise rundir.RunDirError(f"{exc}; expected a run directory{where}") from None
    configs = {}
    config_dir = run_dir / names.CONFIGS_DIR
    if config_dir.is_dir():
        for item in sorted(config_dir.iterdir()):
            if item.is_file():
                configs[item.name] = _parse_config(item)
    seals: dict = {}   # the records a replay restores (its command line, its environment)
    metadata = _object(run_dir / rundir.METADATA, seals)
    if not metadata:
        raise rundir.RunDirError(f"{run_dir}: {rundir.METADATA} is empty; the run directory is damaged")
    env = _object(run_dir / names.ENV_RECORD, seals)
    variables = env.get("vars") or {}
    if not isinstance(variables, dict):
        raise rundir.RunDirError(f"{run_dir / 'env.json'}: 'vars' is not a JSON object; the run "
                                 f"directory is damaged")
    summary, problem = training_summary(run_dir)
    benchmark, bench_problem = benchmark_results(run_dir) if not summary else ({}, "")
    return Recorded(run_dir, metadata, variables, _object(run_dir / names.MACHINE),
                    _object(run_dir / names.VERSIONS), configs, _object(run_dir / names.GIT),
                    summary, problem or bench_problem, benchmark, seals)


# ---------------------------------------------------------------- a training run's results

# (summary key, label) in the order show and diff give them; the summary is the one the
# trainer writes (trainer.metrics.Metrics.summary, summary_table formats it the same way)
RESULTS = (("status", "status"), ("steps", "steps"), ("final_loss", "final train loss"),
           ("val_loss", "final val loss"), ("tokens_per_s", "tokens/s"), ("mfu", "MFU"),
           ("wall_s", "wall time"), ("init_from", "started from"), ("experts", "experts' load"),
           # train.launch: the runner's summary of another trainer's metric lines (runtime.runs.metrics.summary)
           ("backend", "backend"), ("resumed_from", "resumed from"), ("unreadable_lines", "unreadable metric lines"))


def training_summary(run_dir: Path) -> tuple[dict, str]:
    """(the trainer's summary, "") from summary.json, else from result.json's "summary" (what
    train.pretrain returned); ({}, "") for a run without one (bench, preflight, a training run
    that stopped before its summary); ({}, why) when the file is damaged. A damaged summary
    never hides the rest of the run."""
    problem = ""
    for name in (names.SUMMARY, names.RESULT):
        path = run_dir / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_bytes().decode("utf-8"))
        except OSError as exc:
            problem = problem or f"{name}: cannot read it ({exc.strerror or exc})"
            continue
        except UnicodeDecodeError as exc:
            problem = problem or f"{name}: not UTF-8 text (byte {exc.start})"
            continue
        except ValueError as exc:
            problem = problem or f"{name}: not valid JSON ({exc})"
            continue
        if name == names.RESULT:
            data = data.get("summary") if isinstance(data, dict) else None
        if isinstance(data, dict) and ("steps" in data or "final_loss" in data):
            return data, ""
        if name == names.SUMMARY:
            problem = problem or f"{name}: not a training summary (no steps, no final_loss)"
    return {}, problem


# ---------------------------------------------------------------- a benchmark's results

# (key in Recorded.benchmark, file a benchmark writes into its run): bench.gemm, bench.allreduce,
# bench.kernels; any run's result.json "measurements" rows (the shape a fan-out merges) besides
BENCHMARK_FILES = (("gemm", names.GEMM), ("collectives", names.COLLECTIVES), ("kernels", names.KERNELS))


def _json_file(path: Path) -> tuple[Any, str]:
    """(the parsed file, "") or (None, why it could not be read); (None, "") when it is absent."""
    if not path.is_file():
        return None, ""
    try:
        return json.loads(path.read_bytes().decode("utf-8")), ""
    except OSError as exc:
        return None, f"{path.name}: cannot read it ({exc.strerror or exc})"
    except UnicodeDecodeError as exc:
        return None, f"{path.name}: not UTF-8 text (byte {exc.start})"
    except ValueError as exc:
        return None, f"{path.name}: not valid JSON ({exc})"


def benchmark_results(run_dir: Path) -> tuple[dict, str]:
    """({"gemm": ..., "collectives": ..., "kernels": ..., "measurements": [...]}, "") with what the run
    holds of those; ({}, "") for a run without any; a damaged file is left out and named."""
    found, problems = {}, []
    for key, name in BENCHMARK_FILES:
        data, problem = _json_file(run_dir / name)
        if isinstance(data, dict):
            found[key] = data
        elif problem:
            problems.append(problem)
    result, problem = _json_file(run_dir / names.RESULT)
    if problem:
        problems.append(problem)
    if isinstance(result, dict):
        if "gemm" not in found and isinstance(result.get("tflops"), (int, float)):   # bench.gemm before gemm.json
            found["gemm"] = result
        if isinstance(result.get("measurements"), list) and not found:
            found["measurements"] = [m for m in result["measurements"] if isinstance(m, dict)]
    return found, "; ".join(problems)


def _ms(value: Any) -> str:
    number = _number(value)
    return "n/a" if number is None else f"{number:.3f} ms"


def benchmark_rows(benchmark: dict) -> list[tuple[str, str]]:
    """(label, text) of each result a benchmark recorded, as snapshot.show prints them and diff compares."""
    rows: list[tuple[str, str]] = []
    gemm = benchmark.get("gemm")
    if isinstance(gemm, dict):
        rows.append(("GEMM", f"{gemm.get('m')}x{gemm.get('n')}x{gemm.get('k')} {gemm.get('dtype')} on "
                             f"{gemm.get('device')}"))
        rows.append(("median time", _ms(gemm.get("median_ms"))))
        tflops = _number(gemm.get("tflops"))
        rows.append(("TFLOP/s", "n/a" if tflops is None else f"{tflops:.2f}"))
        percent = _number(gemm.get("percent_of_peak"))
        rows.append(("of peak", f"{percent:.1f}%" if percent is not None else
                     "n/a (ran on the CPU)" if gemm.get("device") == "cpu" else "n/a (no GPU profile)"))
    collectives = benchmark.get("collectives")
    if isinstance(collectives, dict):
        for r in collectives.get("results") or []:
            if not isinstance(r, dict):
                continue
            size = _number(r.get("bytes"))
            label = f"{r.get('op')} {_bytes(size)} x {r.get('ranks')} ranks"
            bus, alg = _number(r.get("busbw_GBps")), _number(r.get("algbw_GBps"))
            rows.append((label, f"busbw {bus:.2f} GB/s, algbw {alg:.2f} GB/s" if bus is not None and alg is not None
                         else "n/a"))
    kernels = benchmark.get("kernels")
    if isinstance(kernels, dict):
        for r in kernels.get("rows") or []:
            if isinstance(r, dict):
                rows.append((f"{r.get('op')} {r.get('shape')} {r.get('provider')}", _ms(r.get("ms"))))
    for m in benchmark.get("measurements") or []:
        value = _number(m.get("value"))
        rows.append((str(m.get("name")), "n/a" if value is None else f"{value:.4g} {m.get('unit') or ''}".rstrip()))
    return rows


def _bytes(size: float | None) -> str:
    if size is None:
        return "?"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:g} {unit}"
    return f"{size:g} B"


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _result_text(key: str, value: Any, summary: dict) -> str:
    if key == "wall_s":
        return wall_time_text(summary)
    if key == "init_from" and isinstance(value, dict):   # train.pretrain --init-from: the directory
        return str(value.get("path"))
    if key == "experts" and isinstance(value, dict):      # a mixture-of-experts run: the least and most loaded
        try:
            return experts_text(value)
        except (KeyError, TypeError, ValueError):
            return "n/a (damaged)"
    number = _number(value)
    if value is None:
        return "n/a"
    if number is None or key in ("status", "steps"):
        return str(value)
    if key in ("final_loss", "val_loss"):
        return f"{number:.4f}"
    if key == "tokens_per_s":
        return f"{number:,.0f}"
    if key == "mfu":
        return f"{number:.1%}"
    return str(value)


def result_rows(rec: Recorded) -> list[tuple[str, str]]:
    """(label, text) for each result the run's training summary holds (None shown as n/a), or each
    result its benchmark recorded; [] when it has neither."""
    if rec.benchmark:
        return benchmark_rows(rec.benchmark)
    return summary_rows(rec.summary)


def summary_rows(summary: dict) -> list[tuple[str, str]]:
    """(label, text) for each result a training summary holds, as snapshot.show prints them."""
    return [(label, _result_text(key, summary.get(key), summary)) for key, label in RESULTS if key in summary]


def _read_metadata(path: Path) -> tuple[dict | None, str]:
    """(metadata, "") of a run directory, or (None, why it cannot be read)."""
    try:
        data = json.loads((path / rundir.METADATA).read_bytes().decode("utf-8"))
    except FileNotFoundError:
        return None, "missing"
    except OSError as exc:
        return None, exc.strerror or str(exc)
    except UnicodeDecodeError as exc:
        return None, f"not UTF-8 text at byte {exc.start}"
    except json.JSONDecodeError as exc:
        return None, f"not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
    if not isinstance(data, dict):
        return None, f"not a JSON object (a {type(data).__name__})"
    problem = seal_problem(data)
    if problem:
        return None, problem
    return unsealed(data), ""


def _text(value: Any) -> str:
    return "" if value is None else str(value)


def check_limit(limit: int | None) -> None:
    if limit is not None and limit < 1:
        raise rundir.RunDirError(f"--limit: expected a number of runs >= 1 (0 or left out: all), got {limit}")


def list_rows(runs_dir: Path, limit: int | None = None) -> list[dict]:
    """One row per run under runs_dir, oldest first (the newest `limit` only, when given). A
    folder whose metadata.json cannot be read is listed too, its status saying why; one
    without metadata.json is not a run."""
    check_limit(limit)
    rows = []
    runs_dir = Path(runs_dir)
    folders = sorted(p for p in runs_dir.iterdir() if p.is_dir() and not p.name.startswith(".")) \
        if runs_dir.is_dir() else []
    for path in folders:
        md, problem = _read_metadata(path)
        if problem == "missing":
            continue
        if md is None:
            rows.append({"start": "", "task": "", "name": "", "status": "(unreadable)",
                         "hosts": "", "seconds": None, "replay_of": "", "dir": path.name,
                         "problem": f"metadata.json unreadable: {problem}"})
            continue
        replay_of = md.get("replay_of")
        rows.append({"start": md.get("start"), "task": md.get("task"), "name": md.get("name") or "",
                     "status": md.get("status"), "hosts": hosts_text(md),
                     "seconds": md.get("duration_s"),
                     "replay_of": Path(str(replay_of)).name if replay_of else "", "dir": path.name})
    return rows[-limit:] if limit else rows


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists stay values."""
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for key, value in obj.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: obj}


def _cell(value: Any) -> str:
    if value is None:
        return "(unset)"
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    return str(value)


def _compare(kind: str, a: dict, b: dict) -> list[dict]:
    rows = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key), b.get(key)
        if _cell(va) != _cell(vb):
            rows.append({"kind": kind, "key": key, "a": _cell(va), "b": _cell(vb)})
    return rows


def machine_summary(rec: Recorded) -> dict:
    gpu = rec.gpu
    return {"gpu.vendor": gpu.get("vendor"), "gpu.model": gpu.get("model"), "gpu.arch": gpu.get("arch"),
            "gpu.count": gpu.get("count"), "gpu.driver": gpu.get("driver"),
            "gpu.platform_version": gpu.get("platform_version"), "host": rec.machine.get("host"),
            "cpu_count": rec.machine.get("cpu_count")}


def diff(a: Recorded, b: Recorded) -> list[dict]:
    """Rows {kind, key, a, b} for every difference: env, config, versions, machine, run, and
    the results as shown: a training run's (status, steps, losses, tokens/s, MFU, wall time), a
    benchmark's (TFLOP/s, bandwidth, kernel times)."""
    env_a = {k: v.get("value") for k, v in a.env.items() if isinstance(v, dict)}
    env_b = {k: v.get("value") for k, v in b.env.items() if isinstance(v, dict)}
    rows = _compare("env", env_a, env_b)
    for name in sorted(set(a.configs) | set(b.configs)):
        ca, cb = a.configs.get(name), b.configs.get(name)
        rows += [dict(r, key=f"{name}:{r['key']}") for r in _compare("config", flatten(ca), flatten(cb))]
    versions_a = {k: v for k, v in flatten(a.versions).items() if k != "executable"}
    versions_b = {k: v for k, v in flatten(b.versions).items() if k != "executable"}
    rows += _compare("version", versions_a, versions_b)
    rows += _compare("machine", machine_summary(a), machine_summary(b))
    rows += _compare("run", _run_facts(a), _run_facts(b))
    return _result_differences(a, b) + rows


def _run_facts(r: Recorded) -> dict:
    """What a run was, beside its config: the command, and where and on how many processes it ran
    (a 1-process and a 2-process run of one config differ in throughput for that reason)."""
    md = r.metadata
    return {"task": md.get("task"), "argv": argv_text(md), "status": md.get("status"),
            "world_size": md.get("world_size"), "nodes": md.get("nodes"), "hosts": hosts_text(md),
            "runtime": md.get("runtime"), "git": r.git.get("commit"), "dirty": r.git.get("dirty")}


def _result_differences(a: Recorded, b: Recorded) -> list[dict]:
    """The results as show prints them, where they differ (first: what the reader came for). A run
    without results of that kind (a benchmark beside a training run) reads "(no results)"."""
    if not (a.summary or b.summary or a.benchmark or b.benchmark):
        return []
    results_a, results_b = dict(result_rows(a)), dict(result_rows(b))
    training = [(key, label) for key, label in RESULTS] if a.summary or b.summary else []
    bench = list(dict.fromkeys([label for label, _ in benchmark_rows(a.benchmark)]
                               + [label for label, _ in benchmark_rows(b.benchmark)]))

    def value(rec: Recorded, results: dict, key: str | None, label: str) -> str:
        if label in results:
            return results[label]
        if key == "status":   # a run without results still has a status: the run's own (failed, lost, ...)
            return _text(rec.metadata.get("status"))
        return "n/a" if (rec.summary if key is not None else rec.benchmark) else "(no results)"

    rows = []
    for key, label in training + [(None, label) for label in bench]:
        value_a, value_b = value(a, results_a, key, label), value(b, results_b, key, label)
        if value_a != value_b:
            rows.append({"kind": "result", "key": label, "a": value_a, "b": value_b})
    return rows


def argv_text(metadata: dict, skip_program: bool = True) -> str:
    """The recorded command line as text (whatever type a damaged metadata.json holds)."""
    argv = metadata.get("argv")
    if not isinstance(argv, list):
        return _text(argv)
    return " ".join(map(str, argv[1:] if skip_program else argv))


def hosts_text(metadata: dict) -> str:
    hosts = metadata.get("hosts")
    return ",".join(map(str, hosts)) if isinstance(hosts, list) else _text(hosts)
