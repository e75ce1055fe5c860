"""Benchmarks as runs: the GEMM in a child process with the run's environment, collectives through a launch.

    runtime = check_runtime(given, settings)      # both tasks, before the run (a node runs direct)
    m, n, k = parse_dims(M, N, K); check_gemm(m, n, k, dtype, iters); m, note = gemm_rows(m, env)
    check_gemm_fits(m, n, k, dtype, env, force)    # operands larger than the memory: refused
    result = gemm(run, m, n, k, dtype, iters)      # peak_cell(result): the table's "of peak"
    check_collective(op, sizes, iters, nproc)
    report = collective(settings, run, env, op, sizes, iters, nproc, runtime, quiet)

Both results carry "measurements" rows, the shape the fan-out merges per node
(`inv -H ...`, `--runtime slurm`).
"""
from __future__ import annotations

import io
import json
import os
import shlex
import sys

from core import names
from core.errors import AnvilError, UserError

DTYPES = ("bf16", "fp16", "fp32")


def check_runtime(given: str, settings):
    """The Runtime the task runs under (runtime.runs.options.per_node_runtime); UserError for one with a
    container. The program fans a runtime that spans nodes out before the task runs (and prints the
    notice), so on a node this is direct."""
    from runtime.runs.options import per_node_runtime
    return per_node_runtime(given, settings.runtime)[0]


def check_iters(iters: int) -> None:
    if iters < 1:   # the result is a median of the timed runs: none gives no result, only a late crash
        raise UserError(f"--iters {iters}: expected 1 or more")


def parse_dims(*typed: str | None) -> tuple[int | None, ...]:
    """-M, -N, -K as typed: Invoke hands them over as strings, so None (not given) stays apart from 0."""
    dims = []
    for value, flag in zip(typed, ("-M", "-N", "-K")):
        try:
            dims.append(None if value is None else int(value))
        except ValueError:
            raise UserError(f"{flag}: expected an integer, got {value!r}") from None
    return tuple(dims)


def gemm_rows(m: int | None, env) -> tuple[int, str]:
    """(M, a note for stderr or ""): -M as given, else 8192 where the environment has a GPU, 1024 where not."""
    from benchmarks.gemm import CPU_ROWS, GPU_ROWS

    if m is not None:
        return m, ""
    machine = where_it_runs(env)   # --gpu H100 names a profile; the product runs on this machine
    if machine.has_gpu:
        return GPU_ROWS, ""
    return CPU_ROWS, f"no GPU visible: -M defaults to {CPU_ROWS} on a CPU ({GPU_ROWS} on a GPU); give -M to choose"


def check_gemm(m: int | None, n: int | None, k: int | None, dtype: str, iters: int) -> None:
    """None: not given (M: gemm_rows picks it; N, K: as M); a given 0 is as wrong as a negative."""
    for flag, value in (("-M", m), ("-N", n), ("-K", k)):
        if value is not None and value <= 0:
            default = "" if flag == "-M" else f" (leave {flag} out for the default, M)"
            raise UserError(f"{flag} {value}: M, N and K must be positive integers{default}")
    if dtype not in DTYPES:
        raise UserError(f"unknown --dtype {dtype!r} ({', '.join(DTYPES)})")
    check_iters(iters)


def gemm_argv(m: int, n: int | None, k: int | None, dtype: str, iters: int) -> list[str]:
    return [sys.executable, "-m", "benchmarks.gemm", "-M", str(m), "--dtype", dtype, "--iters", str(iters),
            "--json"] + (["-N", str(n)] if n is not None else []) + (["-K", str(k)] if k is not None else [])


def peak_cell(result: dict) -> str:
    """The table's "of peak": a CPU run has no peak to compare with, even with --gpu naming a GPU's profile."""
    if result["device"] == "cpu":
        return "n/a (ran on the CPU)"
    return f"{result['percent_of_peak']:.1f}%" if result["percent_of_peak"] else "n/a (no GPU profile)"


def where_it_runs(env):
    """The machine the product runs on: this one, even where --gpu names another's profile."""
    machine = env.machine
    if machine.source == "override":
        from envs.detect import detect
        machine = detect(environ={})
    return machine


def check_gemm_fits(m: int, n: int | None, k: int | None, dtype: str, env, force: bool = False) -> None:
    """UserError (unless forced) for a product whose operands, A (M x K), B (K x N) and the product
    (M x N), need more than the memory they live in: one GPU's, or this machine's on a CPU."""
    from runtime.jobs.planning import GIB, host_memory_gib

    n, k = n or m, k or m
    need = (m * k + k * n + m * n) * {"bf16": 2, "fp16": 2, "fp32": 4}[dtype]
    machine = where_it_runs(env)
    if machine.has_gpu and machine.memory_gib:
        memory, where = machine.memory_gib, f"one {machine.model or machine.name} ({machine.memory_gib:g} GiB)"
    else:
        memory = host_memory_gib()
        where = f"this machine's memory ({memory:.0f} GiB)" if memory else ""
    if force or not memory or need <= memory * GIB:
        return
    size = need / GIB
    size_text = f"{size:,.1f}" if size < 1e6 else f"{size:.3g}"
    raise UserError(f"-M {m} -N {n} -K {k} {dtype}: A, B and the product take {size_text} GiB, more than "
                    f"{where}; choose a smaller M, N or K (--force runs it anyway)")


def gemm(run, m: int, n: int | None, k: int | None, dtype: str, iters: int) -> dict:
    """benchmarks.gemm in a child process that gets the run's environment (TunableOp, hipBLASLt, ...).
    Its stderr (a long CPU run's progress) is shown as it comes and kept in RUN/logs/gemm.log."""
    from runtime.jobs import tuning

    with tuning.kept(run):   # --tune-gemm: which TunableOp results file, recorded with the run
        result = _child_json(run, gemm_argv(m, n, k, dtype, iters), "gemm.log", "the benchmark")
    result["measurements"] = [{"name": f"gemm {result['m']}x{result['n']}x{result['k']} {result['dtype']}",
                               "value": result["tflops"], "unit": "TFLOP/s"}]
    run.write_json(names.GEMM, result)
    return result


def _child_json(run, argv: list[str], log: str, what: str) -> dict:
    """A benchmark program in a child process with the run's environment: its stderr (a long CPU run's
    progress) shown as it comes and kept in RUN/logs/<log>, its last stdout line read as JSON. Stopped by a
    signal inv passed on: Interrupt; failed: AnvilError with its last line."""
    from runtime.launch.process import open_log, run_streaming
    from core.signals import STOP_SIGNALS, Interrupt

    result_text, said = io.StringIO(), _LastLine(sys.stderr)
    code = run_streaming(argv, run.env, open_log(run.path, log, argv, run.masker), stdout=result_text,
                         stderr=said, masker=run.masker)
    if code - 128 in STOP_SIGNALS:
        raise Interrupt(code - 128)
    if code != 0:
        raise AnvilError(f"{what} failed: {said.last or f'exit status {code}'}", 1)
    return json.loads(result_text.getvalue().strip().splitlines()[-1])


class _LastLine:
    """A stream that passes text on and keeps its last non-empty line (for a failure's message)."""

    def __init__(self, out):
        self.out, self.last = out, ""

    def write(self, text: str) -> None:
        self.out.write(text)
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if lines:
            self.last = lines[-1]

    def flush(self) -> None:
        self.out.flush()


def _stopped_by(code: int, run_dir) -> int | None:
    """The stop signal that ended a launch, or None: the agents' status for ranks a stop signal
    ended (3 or 130, the signal in their reports), or 128+N for an agent the signal ended itself."""
    import signal

    from runtime.launch.spec import EXIT_INTERRUPTED, EXIT_REQUEUE
    from runtime.runs import outcome
    from core.signals import STOP_SIGNALS

    if code in (EXIT_REQUEUE, EXIT_INTERRUPTED):
        signals = [n.signal for n in outcome.read(run_dir).nodes if n.signal and hasattr(signal, n.signal)]
        return int(getattr(signal, signals[0])) if signals else (signal.SIGINT if code == EXIT_INTERRUPTED
                                                             else signal.SIGTERM)
    return code - 128 if code - 128 in STOP_SIGNALS else None


def check_collective(op: str, sizes: str, iters: int, nproc: int, dtype: str = "") -> None:
    from benchmarks.collectives import DTYPES, OPS, parse_sizes

    if op not in OPS:
        raise UserError(f"unknown --op {op!r} ({', '.join(OPS)})")
    if dtype and dtype not in DTYPES:
        raise UserError(f"unknown --dtype {dtype!r} ({', '.join(sorted(DTYPES))})")
    try:
        parse_sizes(sizes)
    except ValueError as exc:
        raise UserError(f"--sizes: {exc}") from None
    check_iters(iters)
    if nproc < 0:
        raise UserError(f"--nproc {nproc}: expected 1 or more (0: the default)")


def collective_spec(env, op: str, sizes: str, iters: int, nproc: int, out, eager: bool = False, dtype: str = ""):
    from runtime.launch import LaunchSpec

    procs = nproc or (None if env.machine.count else 2)  # a collective needs two ranks
    return LaunchSpec(module="benchmarks.collectives", nproc=procs, gpus=env.machine.count, vendor=env.machine.vendor,
                      args=["--op", op, "--sizes", sizes, "--iters", str(iters), *(["--eager"] if eager else []),
                            *(["--dtype", dtype] if dtype else []), "--out", str(out)], profile=list(env.environ()))


def dry_run(env, argv: list[str] | None = None, spec=None, transport=None) -> None:
    """--dry-run: the resolved environment and the exact command; nothing starts, no run directory."""
    for name, value in sorted(env.environ().items()):
        print(f"export {name}={shlex.quote(value)}")
    if spec is not None:
        transport.launch(spec, {**os.environ, **env.environ()}, run_dir=None, dry_run=True)
    else:
        print(shlex.join(argv or []))


def collective(settings, run, env, op: str, sizes: str, iters: int, nproc: int, runtime,
               quiet: bool = False, eager: bool = False, dtype: str = "") -> dict:
    """benchmarks.collectives through the runtime on this node; its report with measurements.

    quiet: the ranks' output (rank 0's table) goes to stderr, leaving stdout to the caller's JSON."""
    out = run.path / names.COLLECTIVES
    spec = collective_spec(env, op, sizes, iters, nproc, out, eager, dtype)
    transport = runtime.open(settings.cluster_options())
    code = transport.launch(spec, run.env, run.path, masker=run.masker, stdout=sys.stderr if quiet else None)
    stopped = _stopped_by(code, run.path)
    if stopped is not None:   # inv passed a stop signal on to the ranks, which ended on it: interrupted
        from core.signals import Interrupt
        raise Interrupt(stopped)
    if code != 0 or not out.is_file():
        raise AnvilError(f"the benchmark exited with status {code}; see {run.path}/logs", code or 1)
    report = json.loads(out.read_text())
    report["measurements"] = [{"name": f"{r['op']} {r['bytes']} B x {r['ranks']} busbw", "value": r["busbw_GBps"],
                               "unit": "GB/s"} for r in report.get("results", [])]
    recorded = record_bus(settings, env, report)
    if recorded:
        report["recorded"] = recorded
    return report


def record_bus(settings, env, report: dict) -> str | None:
    """On GPUs, the bus bandwidth of the largest message size kept in the speed figures for this GPU model
    and GPU count (trainer.speed predicts the data-parallel collectives with it); the file's path."""
    from runtime.jobs import figures

    machine = where_it_runs(env)
    results = [r for r in report.get("results", []) if r.get("busbw_GBps")]
    if not machine.has_gpu or not results:
        return None
    largest = max(results, key=lambda r: r["bytes"])
    path = figures.record(settings.runs_dir, machine.model or machine.name,
                          {"bus_gbps": {largest["op"]: largest["busbw_GBps"]}, "bus_gpus": largest["ranks"]})
    return str(path)


def rates_argv(config: str, sets: list[str], quick: bool) -> list[str]:
    return [sys.executable, "-m", "benchmarks.rates", *(["--config", config] if config else []),
            *[x for item in sets for x in ("--set", item)], *(["--quick"] if quick else [])]


def rates(run, settings, env, config: str, sets: list[str], quick: bool) -> dict:
    """benchmarks.rates in a child process with the run's environment, at the config's shapes; the result
    kept with the run (rates.json) and merged into the figures for this machine's GPU model (or "CPU")
    that `inv train.plan` and `inv train.pretrain` predict with. Returns {"rates", "model", "recorded"}."""
    from runtime.jobs import figures

    measured = _child_json(run, rates_argv(config, sets, quick), "rates.log", "the measurement")
    run.write_json("rates.json", measured)
    machine = where_it_runs(env)
    model = (machine.model or machine.name) if machine.has_gpu and not measured.get("host_is_device") \
        else figures.CPU
    path = figures.record(settings.runs_dir, model, measured)
    return {"rates": measured, "model": model, "recorded": str(path)}
