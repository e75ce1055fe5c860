"""Benchmarks as runs: the GEMM in a child process with the run's environment, collectives through a launch.

    check_gemm(M, N, K, dtype); result = gemm(run, M, N, K, dtype, iters)
    check_collective(op, sizes); report = collective(settings, run, env, op, sizes, iters, nproc)

Both results carry "measurements" rows, the shape the fan-out merges per node
(`inv -H ...`, `--runtime slurm`).
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

from trainer.errors import AnvilError, UserError

DTYPES = ("bf16", "fp16", "fp32")


def check_gemm(m: int, n: int, k: int, dtype: str) -> None:
    if min(m, n or m, k or m) <= 0:
        raise UserError("M, N and K must be positive")
    if dtype not in DTYPES:
        raise UserError(f"unknown --dtype {dtype!r} ({', '.join(DTYPES)})")


def gemm_argv(m: int, n: int, k: int, dtype: str, iters: int) -> list[str]:
    return [sys.executable, "-m", "benchmarks.gemm", "-M", str(m), "--dtype", dtype, "--iters", str(iters),
            "--json"] + (["-N", str(n)] if n else []) + (["-K", str(k)] if k else [])


def gemm(run, m: int, n: int, k: int, dtype: str, iters: int) -> dict:
    """benchmarks.gemm in a child process that gets the run's environment (TunableOp, hipBLASLt, ...)."""
    argv = gemm_argv(m, n, k, dtype, iters)
    proc = subprocess.run(argv, env=run.env, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        raise AnvilError(f"the benchmark failed: {last}", 1)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["measurements"] = [{"name": f"gemm {result['m']}x{result['n']}x{result['k']} {result['dtype']}",
                               "value": result["tflops"], "unit": "TFLOP/s"}]
    run.write_json("gemm.json", result)
    return result


def check_collective(op: str, sizes: str) -> None:
    from benchmarks.collectives import OPS, parse_size

    if op not in OPS:
        raise UserError(f"unknown --op {op!r} ({', '.join(OPS)})")
    try:
        [parse_size(s) for s in sizes.split(",") if s.strip()]
    except ValueError as exc:
        raise UserError(str(exc)) from None


def collective_spec(settings, env, op: str, sizes: str, iters: int, nproc: int, out):
    from runtime.launch import LaunchSpec

    procs = nproc or (None if env.machine.count else 2)  # a collective needs two ranks
    return LaunchSpec(module="benchmarks.collectives", runtime=settings.runtime, nproc=procs,
                      gpus=env.machine.count, vendor=env.machine.vendor,
                      args=["--op", op, "--sizes", sizes, "--iters", str(iters), "--out", str(out)])


def dry_run(env, argv: list[str] | None = None, spec=None) -> None:
    """--dry-run: the resolved environment and the exact command; nothing starts, no run directory."""
    from runtime.launch import launch

    for name, value in sorted(env.environ().items()):
        print(f"export {name}={shlex.quote(value)}")
    if spec is not None:
        launch(spec, {**os.environ, **env.environ()}, run_dir=None, dry_run=True)
    else:
        print(shlex.join(argv or []))


def collective(settings, run, env, op: str, sizes: str, iters: int, nproc: int) -> dict:
    """benchmarks.collectives through the configured runtime on this node; its report with measurements."""
    from runtime.launch import launch

    out = run.path / "collectives.json"
    spec = collective_spec(settings, env, op, sizes, iters, nproc, out)
    code = launch(spec, env=run.env, run_dir=run.path, masker=run.masker)
    if code != 0 or not out.is_file():
        raise AnvilError(f"the benchmark exited with status {code}; see {run.path}/logs", code or 1)
    report = json.loads(out.read_text())
    report["measurements"] = [{"name": f"{r['op']} {r['bytes']} B x {r['ranks']} busbw", "value": r["busbw_GBps"],
                               "unit": "GB/s"} for r in report.get("results", [])]
    return report
