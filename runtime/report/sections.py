"""What a report shows of each kind of run: a section of charts, tables and pictures.

    section(rec) -> dict      {"title", "subtitle", "status", "notes": [...], "blocks": [...]}
    compare(recs) -> dict    the curves of several runs overlaid, and snapshot.diff as a table

A block is {"type": "chart", "title", "figure"} (a Plotly spec), {"type": "table", "title",
"headers", "rows"}, {"type": "svg", "title", "svg"} or {"type": "text", "title", "text"}. The run
is read through runtime.runs.history (the record) and runtime.runs.metrics (every segment's
metrics); what is missing or damaged becomes a note, never an error.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from core import names
from core.runfiles import source_text
from runtime.report import charts, experts
from runtime.runs import history, metrics, rundir

TRAINING_TASKS = names.TRAINING_TASKS
MAX_RANK_LINES = 32        # more ranks: their min, median and max instead of one line each


def _json(path: Path, notes: list[str], what: str = "") -> Any:
    """A JSON file of the run (None when absent); a damaged one is a note."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as exc:
        notes.append(f"{what or path.name}: cannot be read ({str(exc).splitlines()[0][:120]})")
        return None


def _table(title: str, headers: list, rows: list, open_: bool = True) -> dict | None:
    return {"type": "table", "title": title, "headers": headers, "rows": rows, "open": open_} if rows else None


def _chart(title: str, figure: dict | None) -> dict | None:
    return {"type": "chart", "title": title, "figure": figure} if figure else None


def _fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    return str(value)


# ---------------------------------------------------------------- every run

def _facts(rec: history.Recorded) -> dict:
    md = rec.metadata
    rows = [["task", md.get("task")], ["name", md.get("name") or ""], ["status", md.get("status")],
            ["error", md.get("error") or ""], ["start", md.get("start")], ["end", md.get("end") or ""],
            ["seconds", md.get("duration_s")], ["hosts", history.hosts_text(md)],
            ["world size", md.get("world_size")], ["command", history.argv_text(md, skip_program=False)],
            ["resumed from", md.get("resume") or ""], ["replay of", md.get("replay_of") or ""],
            ["git", f"{rec.git.get('commit') or ''}{' (dirty)' if rec.git.get('dirty') else ''}"]]
    rows += _faults(md)
    machine = history.machine_summary(rec)
    for key in ("python", "torch", "triton"):
        machine[key] = rec.versions.get(key)
    rows += [[k, v] for k, v in machine.items() if v not in (None, "")]
    return _table("run", ["", ""], [[k, _fmt(v)] for k, v in rows if v not in (None, "")])


def _faults(md: dict) -> list[list]:
    """The rows for what went wrong on the way: in-job restarts, nodes left out, Slurm's node failures, the
    GPUs the watch saw in trouble (with the step time they cost)."""
    from runtime.runs.gpuhealth import describe

    rows = [[f"restart {r.get('attempt')}", f"from step {r.get('step')}: {r.get('why')}"
             + (f" ({r['left_out']} left out)" if r.get("left_out") else "")]
            for r in md.get("restarts") or [] if isinstance(r, dict)]
    if md.get("node_failures"):
        rows.append(["node failures", ", ".join(map(str, md["node_failures"]))])
    rows += [["GPU trouble", describe(e)] for e in md.get("gpu_events") or [] if isinstance(e, dict)]
    return rows


def _environment(rec: history.Recorded) -> dict | None:
    rows = [[name, _fmt(v.get("value")) if isinstance(v, dict) else _fmt(v),
             v.get("source", "") if isinstance(v, dict) else ""] for name, v in sorted(rec.env.items())]
    return _table(f"environment ({len(rows)} variables, with the layer that set each; secrets masked as in "
                  f"the run directory)", ["variable", "value", "source"], rows, open_=False)


def _configs(rec: history.Recorded) -> list[dict]:
    blocks = []
    for name, content in sorted(rec.configs.items()):
        if isinstance(content, (dict, list)):
            rows = [[key, _fmt(value)] for key, value in history.flatten(content).items()]
            blocks.append(_table(f"config {name}", ["key", "value"], rows, open_=False))
        elif content:
            blocks.append({"type": "text", "title": f"config {name}", "text": str(content)[:100_000]})
    return blocks


def _hooks(path: Path) -> dict | None:
    """hooks/pre.log and post.log: each hook file that ran, its outcome and output."""
    rows = []
    for phase in ("pre", "post"):
        log = path / names.HOOKS_DIR / f"{phase}.log"
        try:
            text = log.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        current = None
        for line in text.splitlines():
            if line.startswith("== ") and line.endswith(")") and " (" in line:
                hook, _, outcome = line[3:].rpartition(" (")
                current = [phase, Path(hook).name, outcome[:-1], ""]
                rows.append(current)
            elif current is not None and line.strip():
                current[3] = (current[3] + "\n" + line).strip()[:2000]
    return _table("hooks that ran", ["phase", "hook", "outcome", "output"], rows)


def section(rec: history.Recorded) -> dict:
    """The section of one run, by what it recorded."""
    md = rec.metadata
    task = str(md.get("task") or "")
    notes: list[str] = []
    blocks: list = []
    if task in TRAINING_TASKS or (rec.path / names.METRICS).is_file():
        blocks += _training(rec, notes)
    if (rec.path / names.PREFLIGHT).is_file():
        blocks += _preflight(rec.path, notes)
    fanout = bool(md.get("fanout")) or (rec.path / names.HOSTS_DIR).is_dir()     # a run of one task on many hosts
    if task == "preflight.comm":
        blocks += _comm(rec.path, notes)
    elif fanout and (rec.path / names.FANOUT_REPORT).is_file():
        blocks += _fanout(rec.path, notes)
    elif task.startswith("bench."):
        blocks += _bench(rec, notes)
    topo = _json(rec.path / names.TOPOLOGY, notes)
    if isinstance(topo, dict):
        blocks.append(_topology_block(topo, "node topology"))
    if md.get("status") == "running":
        notes.append("the run is still running (metadata.json says running): this is what it had written so far")
    blocks += [_facts(rec), _hooks(rec.path), *_configs(rec), _environment(rec)]
    status = str(md.get("status") or "")
    return {"title": rec.path.name, "subtitle": f"{task} · {status}", "status": status,
            "notes": notes, "blocks": [b for b in blocks if b]}


def _topology_block(data: dict, title: str) -> dict:
    from envs.topology import Topology
    from runtime.report import svg

    topo = Topology.from_dict(data)
    return {"type": "svg", "title": title, "svg": svg.draw(topo)}


# ---------------------------------------------------------------- training

def _series(records: dict, key: str) -> tuple[list, list]:
    steps = [s for s, r in records.items() if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
    return steps, [records[s][key] for s in steps]


def training_figures(curves: metrics.Curves, label: str = "") -> list[dict]:
    train, val, marks = curves.train, curves.val, curves.resumes
    prefix = f"{label} " if label else ""
    val_keys = sorted({k for r in val.values() for k in r if k.startswith("val_loss/")})
    loss = charts.figure([charts.line(*_series(train, "loss"), f"{prefix}train", color=charts.PALETTE[0]),
                          charts.line(*_series(val, "val_loss"), f"{prefix}validation", mode="lines+markers",
                                      color=charts.PALETTE[1])]
                         + [charts.line(*_series(val, k), k.split("/", 1)[1], mode="lines+markers", dash="dot")
                            for k in val_keys]
                         + ([charts.line(*_series(train, "mtp_loss"), f"{prefix}multi-token prediction",
                                         dash="dash", color=charts.PALETTE[3])]
                            if _series(train, "mtp_loss")[0] else []),
                         "Loss (train and validation)", "loss (nats/token)", marks=marks)
    throughput = charts.figure([charts.line(*_series(train, "tokens_per_s"), "tokens/s (all ranks)",
                                            color=charts.PALETTE[2]),
                                charts.line(*_series(train, "mfu"), "MFU (%)", axis="y2", scale=100,
                                            color=charts.PALETTE[4], dash="dash")],
                               "Throughput", "tokens/s", y2title="MFU (%)", marks=marks, ymin0=True)
    memory = charts.figure([charts.line(*_series(train, "gpu_mem_gib"), "GPU peak allocated"),
                            charts.line(*_series(train, "gpu_mem_reserved_gib"), "GPU reserved"),
                            charts.line(*_series(train, "rss_gib"), "process RSS (rank 0)")],
                           "Memory", "GiB", marks=marks, ymin0=True)
    lr = charts.figure([charts.line(*_series(train, "lr"), "learning rate", color=charts.PALETTE[0]),
                        charts.line(*_series(train, "grad_norm"), "grad norm", axis="y2", color=charts.PALETTE[1])],
                       "Learning rate and gradient norm", "learning rate", y2title="grad norm", marks=marks)
    return [b for b in (_chart("loss", loss), _chart("throughput", throughput), _chart("memory", memory),
                        _chart("lr", lr)) if b]


def _rank_spread(curves: metrics.Curves) -> list[dict]:
    spreads = [e for e in curves.events if e.get("kind") == "rank_times" and isinstance(e.get("step_time"), list)]
    stragglers = [e for e in curves.events if e.get("kind") == "straggler"]
    traces = []
    if spreads:
        steps = [int(e["step"]) for e in spreads]
        ranks = max(len(e["step_time"]) for e in spreads)
        if ranks <= MAX_RANK_LINES:
            for r in range(ranks):
                values = [e["step_time"][r] if r < len(e["step_time"]) else None for e in spreads]
                traces.append(charts.line(steps, values, f"rank {r}", scale=1000, mode="lines+markers"))
        else:
            for name, pick in (("slowest rank", max), ("median", None), ("fastest rank", min)):
                values = [e.get("median") if pick is None else pick(v for v in e["step_time"] if v is not None)
                          for e in spreads]
                traces.append(charts.line(steps, values, name, scale=1000))
    if stragglers:
        hover = [f"rank {e.get('rank')} on {e.get('host')}: +{(e.get('slower') or 0):.0%} over the median"
                 for e in stragglers]
        traces.append(charts.line([e["step"] for e in stragglers], [e.get("step_time") for e in stragglers],
                                  "straggler", mode="markers", scale=1000, color="#c53030", hover=hover))
    fig = charts.figure(traces, "Per-rank step time (own work: data + forward)", "ms per step",
                        marks=curves.resumes, ymin0=True)
    blocks = [_chart("rank spread", fig)]
    rows = [[e.get("step"), e.get("rank"), e.get("host"), f"{(e.get('step_time') or 0) * 1e3:.1f}",
             f"{(e.get('median') or 0) * 1e3:.1f}", f"+{(e.get('slower') or 0):.0%}",
             "-".join(map(str, e.get("steps") or []))] for e in stragglers]
    blocks.append(_table("straggler events", ["step", "rank", "host", "ms/step", "median ms", "slower", "steps"],
                         rows))
    return blocks


def _hangs(path: Path, notes: list[str]) -> dict | None:
    rows = []
    for file in sorted((path / names.LOGS_DIR).glob(names.HANG_REPORTS)):
        data = _json(file, notes, f"logs/{file.name}")
        if isinstance(data, dict):
            rows.append([data.get("rank"), data.get("host"), data.get("step"), data.get("phase"),
                         data.get("stalled_s"), data.get("where"), data.get("log")])
    return _table("hang reports", ["rank", "host", "step", "phase", "stalled s", "where", "stacks"], rows)


def _profile(path: Path, notes: list[str]) -> list[dict]:
    """RUN/profile/summary.json: per rank, category -> ms per step (and its share)."""
    data = _json(path / names.PROFILE_DIR / names.PROFILE_SUMMARY, notes, f"{names.PROFILE_DIR}/{names.PROFILE_SUMMARY}")
    if not isinstance(data, dict):
        return []
    ranks = data.get("ranks", data.get("per_rank", data))
    if not isinstance(ranks, dict):
        notes.append("profile/summary.json: no per-rank breakdown in it")
        return []
    table: dict[str, dict[str, tuple]] = {}
    for rank, categories in ranks.items():
        if not isinstance(categories, dict):
            continue
        for category, value in categories.items():
            ms = share = None
            if isinstance(value, (int, float)):
                ms = value
            elif isinstance(value, dict):
                ms = next((v for k, v in value.items() if "ms" in k and isinstance(v, (int, float))), None)
                share = next((v for k, v in value.items() if "share" in k and isinstance(v, (int, float))), None)
            table.setdefault(str(category), {})[str(rank)] = (ms, share)
    if not table:
        notes.append("profile/summary.json: no category figures in it")
        return []
    rank_names = sorted({r for cats in table.values() for r in cats}, key=lambda r: (len(r), r))
    series = {cat: [table[cat].get(r, (None, None))[0] for r in rank_names] for cat in table}
    fig = charts.bars([f"rank {r}" for r in rank_names], series, "Profile: time per step by category",
                      "ms per step", stacked=True)
    rows = [[cat] + [_share(table[cat].get(r)) for r in rank_names] for cat in table]
    return [_chart("profile", fig), _table("profile breakdown (ms per step, share)",
                                           ["category"] + [f"rank {r}" for r in rank_names], rows)]


def _share(value) -> str:
    if not value or value[0] is None:
        return ""
    ms, share = value
    return f"{ms:.2f}" + (f" ({share:.0%})" if isinstance(share, (int, float)) else "")


def _blend_rows(rec: history.Recorded, curves: metrics.Curves) -> list[list[str]]:
    """One row per source of a blend: its share of the tokens (and weight), epochs and last val loss, from
    the summary, else from the run's metrics (runtime.runs.metrics.sources); [] for one dataset."""
    figures = rec.summary.get("sources") if isinstance(rec.summary.get("sources"), dict) else None
    if not figures:
        config = next(iter(rec.configs.values()), None)      # a training run's one: the config as used
        data = config.get("data") if isinstance(config, dict) else None
        figures = metrics.sources(curves, data.get("blend") if isinstance(data, dict) else None)
    return [[f"  {name}", source_text(f) if isinstance(f, dict) else _fmt(f)] for name, f in figures.items()]


def _config_text(md: dict, name: Any) -> str:
    """The config a training run was started with: the file given (or the default, or a replay's copy), from
    metadata.json's config_sources, and the `name:` inside it where that is not the file's own name (the
    summary's "config" is that name alone, and a config without one is named "run")."""
    sources = md.get("config_sources") if isinstance(md.get("config_sources"), dict) else {}
    source = next((str(v) for _, v in sorted(sources.items()) if v), "")
    if not source:
        return _fmt(name)
    return source if name in (None, "", Path(source).stem) else f"{source} (name: {name})"


def _training(rec: history.Recorded, notes: list[str]) -> list:
    curves = metrics.read(rec.path)
    notes += curves.notes
    blocks: list = []
    if len(curves.segments) > 1:
        blocks.append(_table(f"segments: resumed {len(curves.segments) - 1} time(s); the curves join them",
                             ["", "run directory"], [[i + 1, str(p)] for i, p in enumerate(curves.segments)]))
    results = history.result_rows(rec)
    blend = _blend_rows(rec, curves)
    if results:
        summary = rec.summary
        extra = [("params", summary.get("params")), ("world size", summary.get("world_size")),
                 ("device", summary.get("device")), ("data", summary.get("data"))]
        after = [("config", _config_text(rec.metadata, summary.get("config")))]
        blocks.append(_table("summary", ["", ""], [list(r) for r in results]
                             + [[k, _fmt(v)] for k, v in extra if v not in (None, "")] + blend
                             + [[k, _fmt(v)] for k, v in after if v not in (None, "")]))
    elif rec.summary_problem:
        notes.append(f"no summary: {rec.summary_problem}")
    elif rec.metadata.get("status") != "running":
        notes.append("no summary.json: the trainer stopped before writing it")
    if blend and not results:   # no summary (yet): the blend as its metrics have it so far
        blocks.append(_table("blend: each source so far", ["", ""], blend))
    if not curves.train:
        notes.append("no training step logged yet: no curves to draw")
    blocks += training_figures(curves)
    blocks += experts.blocks(curves)
    blocks += _rank_spread(curves)
    blocks.append(_hangs(rec.path, notes))
    blocks += _profile(rec.path, notes)
    return blocks


# ---------------------------------------------------------------- preflight, fan-out, comm

STATUS_ORDER = {"FAIL": 0, "WARN": 1, "PASS": 2}


def _preflight(path: Path, notes: list[str]) -> list:
    data = _json(path / names.PREFLIGHT, notes)
    if not isinstance(data, dict):
        return []
    rows = [[c.get("name"), c.get("status"), _fmt(c.get("value")), c.get("reason", ""), c.get("fix", "")]
            for c in data.get("checks") or [] if isinstance(c, dict)]
    return [_table(f"checks on {data.get('host', '?')}: {data.get('status', '?')}",
                   ["check", "status", "value", "reason", "fix"], rows)]


def _node_lists(path: Path, notes: list[str]) -> dict | None:
    try:   # sealed (runtime.runs.nodes): the seal is not a host, and an edited list is a note
        failing = rundir.read_record(path / names.NODES_DIR / names.FAILURES)
    except (rundir.RunDirError, OSError) as exc:
        notes.append(f"nodes/fail.json: cannot be read ({str(exc).splitlines()[0][:160]})")
        failing = None
    passing = []
    try:
        passing = [h for h in (path / names.NODES_DIR / names.PASSING_HOSTS).read_text().split() if h]
    except OSError:
        pass
    rows = [[h, "pass", ""] for h in passing]
    if isinstance(failing, dict):
        rows += [[h, "FAIL", "; ".join(map(str, reasons)) if isinstance(reasons, list) else _fmt(reasons)]
                 for h, reasons in failing.items()]
    return _table(f"node lists: {len(passing)} passing, {len(failing or {})} failing (--exclude-from reads them)",
                  ["host", "list", "reasons"], rows)


def _fanout(path: Path, notes: list[str]) -> list:
    report = _json(path / names.FANOUT_REPORT, notes)
    if not isinstance(report, dict):
        return []
    checks = [c for c in report.get("checks") or [] if isinstance(c, dict)]
    hosts = list(report.get("hosts") or {})
    rows = []
    for check in checks:
        cells = []
        for host in hosts:
            row = (check.get("hosts") or {}).get(host)
            cells.append(f"{row.get('status')}: {_fmt(row.get('value'))}" if isinstance(row, dict) else "")
        rows.append([check.get("name") + (" ≠" if check.get("differs") else "")] + cells)
    blocks: list = [_table(f"checks per host ({len(hosts)} hosts; ≠: the hosts differ)", ["check"] + hosts, rows)]
    blocks.append(_node_lists(path, notes))
    for host in hosts:
        for topo in sorted((path / names.HOSTS_DIR / host).glob("*/topology.json")):
            data = _json(topo, notes, f"hosts/{host}/{topo.parent.name}/topology.json")
            if isinstance(data, dict):
                blocks.append(_topology_block(data, f"topology of {host}"))
    return blocks


def _comm(path: Path, notes: list[str]) -> list:
    report = _json(path / names.FANOUT_REPORT, notes)
    if not isinstance(report, dict):
        return []
    hosts = [str(h) for h in report.get("hosts") or []]
    index = {h: i for i, h in enumerate(hosts)}
    matrix = [[None] * len(hosts) for _ in hosts]
    hover = [[f"{a} <-> {b}: not measured" for b in hosts] for a in hosts]
    for pair in report.get("pairs") or []:
        ends = [str(h) for h in pair.get("hosts") or []] if isinstance(pair, dict) else []
        if len(ends) != 2 or not all(h in index for h in ends):
            continue
        i, j = index[ends[0]], index[ends[1]]
        value = pair.get("busbw")
        text = (f"{ends[0]} <-> {ends[1]}: " + (f"{value:.3g} GB/s" if isinstance(value, (int, float))
                                                 else f"failed ({pair.get('error')})")
                + (" (slow)" if pair.get("slow") else "") + f", round {pair.get('round')}")
        for a, b in ((i, j), (j, i)):
            if matrix[a][b] is None or (isinstance(value, (int, float)) and value > matrix[a][b]):
                matrix[a][b] = value if isinstance(value, (int, float)) else 0.0
                hover[a][b] = text
    allreduce = report.get("allreduce") or {}
    fig = charts.heatmap(hosts, matrix, f"All-reduce bus bandwidth per pair (GB/s; slow below "
                         f"{(report.get('ratio') or 0):.0%} of the median "
                         f"{(report.get('reference_busbw_GBps') or 0):.3g})", "GB/s", hover)
    rows = [[c.get("host", ""), c.get("name"), c.get("status"), _fmt(c.get("value")), c.get("reason", ""),
             c.get("fix", "")] for c in report.get("checks") or [] if isinstance(c, dict)]
    return [_table("all nodes", ["", ""], [["status", report.get("status")],
                                           ["all-reduce", _fmt(allreduce.get("value"))],
                                           ["", allreduce.get("reason", "")],
                                           ["passing", ", ".join(map(str, report.get("passing") or []))],
                                           ["failing", ", ".join(map(str, report.get("failing") or {}))]]),
            _chart("slow-link matrix", fig),
            _table("per node and link", ["host", "check", "status", "value", "reason", "fix"], rows),
            _node_lists(path, notes)]


# ---------------------------------------------------------------- benchmarks

def _bench(rec: history.Recorded, notes: list[str]) -> list:
    path = rec.path
    result = _json(path / names.RESULT, notes)
    blocks: list = []
    gemm = _json(path / names.GEMM, notes) or (result if isinstance(result, dict) and "tflops" in result else None)
    if isinstance(gemm, dict) and isinstance(gemm.get("tflops"), (int, float)):
        anchors = {}
        if isinstance(gemm.get("peak_tflops"), (int, float)):
            anchors[f"peak {gemm['peak_tflops']:.0f}"] = gemm["peak_tflops"]
        floor = _floor(rec, "gemm_tflops")
        if floor:
            anchors[f"preflight floor {floor:.0f}"] = floor
        label = f"{gemm.get('m')}x{gemm.get('n')}x{gemm.get('k')} {gemm.get('dtype')} on {gemm.get('device')}"
        blocks.append(_chart("gemm", charts.bars([label], {"TFLOP/s": [gemm["tflops"]]},
                                                 "GEMM throughput against the GPU's peak and floor", "TFLOP/s",
                                                 lines=anchors)))
        if not anchors:
            notes.append("no anchor to hold the GEMM against: this device has no peak in its profile")
    coll = _json(path / names.COLLECTIVES, notes)
    if isinstance(coll, dict) and coll.get("results"):
        rows = [r for r in coll["results"] if isinstance(r, dict)]
        floor = _floor(rec, "allreduce_gbps")
        fig = charts.bars([f"{r.get('bytes', 0) / 2 ** 20:.0f} MiB" for r in rows],
                          {"busbw GB/s": [r.get("busbw_GBps") for r in rows],
                           "algbw GB/s": [r.get("algbw_GBps") for r in rows]},
                          f"{rows[0].get('op', '')} bandwidth by message size, {rows[0].get('ranks')} ranks", "GB/s",
                          lines={f"preflight floor {floor:.0f}": floor} if floor else None)
        blocks.append(_chart("collectives", fig))
    kernels = _json(path / names.KERNELS, notes)
    if isinstance(kernels, dict) and kernels.get("rows"):
        rows = [r for r in kernels["rows"] if isinstance(r, dict)]
        cases = list(dict.fromkeys(f"{r.get('op')} {r.get('shape')}" for r in rows))
        providers = list(dict.fromkeys(str(r.get("provider")) for r in rows))
        times = {(f"{r.get('op')} {r.get('shape')}", str(r.get("provider"))): r.get("ms") for r in rows}
        blocks.append(_chart("kernels", charts.bars(cases, {p: [times.get((c, p)) for c in cases] for p in providers},
                                                    "Kernels: ms per forward+backward, ours against each anchor",
                                                    "ms", horizontal=True)))
    measurements = (result or {}).get("measurements") if isinstance(result, dict) else None
    if isinstance(measurements, list):
        blocks.append(_table("measurements", ["name", "value", "unit"],
                             [[m.get("name"), _fmt(m.get("value")), m.get("unit")] for m in measurements
                              if isinstance(m, dict)]))
    return blocks


def _floor(rec: history.Recorded, name: str) -> float | None:
    from envs import profiles

    model = next((m for m in profiles.MODELS.values() if m.name == rec.gpu.get("model")), None)
    value = getattr(model.floors, name, None) if model is not None and model.floors is not None else None
    return float(value) if isinstance(value, (int, float)) else None


# ---------------------------------------------------------------- several runs

def compare(recs: list[history.Recorded]) -> dict:
    """The curves of several runs overlaid; snapshot.diff of each against the first."""
    notes: list[str] = []
    loss, val, tput = [], [], []
    for i, rec in enumerate(recs):
        curves = metrics.read(rec.path) if (rec.path / names.METRICS).is_file() or \
            str(rec.metadata.get("task")) in TRAINING_TASKS else metrics.Curves()
        color = charts.PALETTE[i % len(charts.PALETTE)]
        loss.append(charts.line(*_series(curves.train, "loss"), rec.path.name, color=color))
        val.append(charts.line(*_series(curves.val, "val_loss"), f"{rec.path.name} (val)", color=color,
                               mode="lines+markers", dash="dot"))
        tput.append(charts.line(*_series(curves.train, "tokens_per_s"), rec.path.name, color=color))
        if not curves.train:
            notes.append(f"{rec.path.name}: no training curve")
    blocks = [_chart("compare loss", charts.figure(loss + val, "Loss, overlaid", "loss (nats/token)")),
              _chart("compare throughput", charts.figure(tput, "Throughput, overlaid", "tokens/s", ymin0=True))]
    first = recs[0]
    for other in recs[1:]:
        rows = [[r["kind"], r["key"], r["a"], r["b"]] for r in history.diff(first, other)]
        blocks.append(_table(f"snapshot.diff: A = {first.path.name}, B = {other.path.name}",
                             ["kind", "item", "A", "B"], rows or [["", "no differences", "", ""]]))
    return {"title": f"{len(recs)} runs compared", "subtitle": ", ".join(r.path.name for r in recs),
            "status": "", "notes": notes, "blocks": [b for b in blocks if b]}


def load(path: str | Path, runs_dir: Path | None = None) -> tuple[history.Recorded, list[str]]:
    """The run's record (history.load), or, when a record file is damaged, what can be read of it
    with a note: a report shows what is there."""
    try:
        return history.load(path, runs_dir), []
    except rundir.RunDirError as exc:
        run_dir = rundir.resolve(path, runs_dir) if Path(path).is_dir() or (
            runs_dir is not None and (Path(runs_dir) / str(path)).is_dir()) else None
        if run_dir is None or not any(run_dir.iterdir()):
            raise
        note = str(exc)
    parts: dict[str, dict] = {}
    for name in (names.METADATA, names.ENV_RECORD, names.MACHINE, names.VERSIONS, names.GIT):
        try:
            value = rundir.read_json(run_dir / name, {})
        except (rundir.RunDirError, OSError):
            value = {}
        parts[name] = value if isinstance(value, dict) else {}
    env = parts[names.ENV_RECORD].get("vars")
    summary, problem = history.training_summary(run_dir)
    rec = history.Recorded(run_dir, parts[names.METADATA], env if isinstance(env, dict) else {},
                           parts[names.MACHINE], parts[names.VERSIONS], {}, parts[names.GIT], summary, problem)
    return rec, [note]
