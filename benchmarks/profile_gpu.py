"""The GPU half of profiling, in one call on one H200 (about 8-9 minutes): what only a GPU can measure.

    OUT=out python -m benchmarks.profile_gpu [--budget 540] [--parts profile_kernels,tunableop,...]
                                             [--config configs/llama3_1b.yaml] [--batch 4] [--seq 4096]

Runs `inv` as a user would (python -m runtime.program.main), each part under its own time limit and all of them
under --budget seconds, in the order below; a part that fails or runs out of time is recorded and the rest go
on (when the budget ran out before the last ones, a second call with --parts runs those). Writes into $OUT:
  profile_gpu.json      every figure below, the commands, their exit codes and times
  logs/<part>.txt       each command's output
  profiles/<name>/      summary.json and breakdown.png of each profile.train run
  traces/*.trace.json.gz  the last profiled step of each profile.train run (trainer.profiling.trace.excerpt), with
                        its breakdown beside (*.breakdown.json): test data for tests/trainer/traces/
  ncu/                  the ncu report (when small) and ncu's own per-kernel summary

Parts:
  profile_kernels         inv profile.train llama3_1b --kernels (steps 5-6 of 6), its breakdown and advice
  tunableop               train.pretrain llama3_1b --kernels, 6 steps: without TunableOp, --tune-gemm on an
                          empty cache (tunes), --tune-gemm again (reads the file back); and bench.gemm -M 8192
                          the same three ways
  ncu                     inv profile.train --tool ncu on the 5 largest kernels of profile_kernels, one step
  profile_compile_kernels the same profile with --compile --kernels
  compare                 inv profile.compare of the two profiles
  benchmark               benchmarks.train_throughput --variants kernels,compile_kernels --steps 6
                          --profile-steps 2: the benchmark's split of the same variants, set beside the profiles'
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from core import checkout, names, runfiles

REPO = checkout.ROOT
# As benchmarks.train_throughput runs Anvil's variants (anvil_argv), so that the two splits are of the same run.
SETS = ["data.path=synthetic", "data.grad_accum=1", "train.log_interval=1",
        "train.val_batches=0", "logging.progress=false", "logging.tensorboard=false", "precision.compute=bf16",
        "precision.params=bf16"]
NO_CHECKPOINTS = ["checkpoint.interval=0", "checkpoint.save_final=false"]
PARTS = ("profile_kernels", "tunableop", "ncu", "profile_compile_kernels", "compare", "benchmark")


class Parts:
    def __init__(self, out: Path, budget: float, runs: Path):
        self.out, self.budget, self.runs = out, budget, runs
        self.started = time.time()
        self.report: dict = {"parts": {}, "budget_s": budget}
        (out / names.LOGS_DIR).mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.budget - (time.time() - self.started)

    def run(self, part: str, argv: list[str], limit: float, env: dict | None = None) -> tuple[int, str]:
        """One command, its output in logs/<part>.txt; (exit status, its stdout). 124: out of time or budget."""
        timeout = min(limit, self.left())
        entry = self.report["parts"].setdefault(part, {"commands": []})
        record = {"argv": argv, "limit_s": round(timeout)}
        entry["commands"].append(record)
        if timeout < 5:
            record.update(rc=None, skipped="budget spent")
            return 124, ""
        t0 = time.time()
        try:
            proc = subprocess.run(argv, cwd=REPO, env={**os.environ, **(env or {})}, capture_output=True,
                                  text=True, timeout=timeout)
            code, text, errors = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as exc:
            code, text = 124, _text(exc.stdout)
            errors = _text(exc.stderr) + f"\n== timed out after {timeout:.0f} s"
        record.update(rc=code, wall_s=round(time.time() - t0, 1))
        with open(self.out / names.LOGS_DIR / f"{part}.txt", "a") as log:
            log.write(f"\n$ {' '.join(argv)}\n{text}\n{errors}\n== exit {code} in {record['wall_s']} s\n")
        self.save()
        return code, text + ("" if code == 0 else "\n" + errors[-2000:])

    def save(self) -> None:
        self.report["elapsed_s"] = round(time.time() - self.started, 1)
        (self.out / "profile_gpu.json").write_text(json.dumps(self.report, indent=2, default=str))

    def run_dir(self, task: str, name: str) -> Path | None:
        found = sorted(self.runs.glob(f"*_{task}_{name}"))
        return found[-1] if found else None


def _text(output) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")


def inv(*args: str) -> list[str]:
    return [sys.executable, "-m", "runtime.program.main", *args]


def sets(*items: str) -> list[str]:
    out = []
    for item in items:
        out += ["--set", item]
    return out


def step_times(run_dir: Path | None) -> list[float]:
    if run_dir is None or not (run_dir / names.METRICS).is_file():
        return []
    records = runfiles.metrics_records(run_dir)
    train = sorted((r for r in records if r.get("kind") == "train"), key=lambda r: r["step"])
    return [round(r["step_time_s"], 4) for r in train]


def profile(parts: Parts, part: str, config: str, flags: list[str], limit: float) -> dict:
    code, _ = parts.run(part, inv("profile.train", "--config", config, *flags, "--steps", "5:7", "--top", "10",
                                  "--name", part, *sets(*SETS)), limit)
    run = parts.run_dir("profile.train", part)
    out = {"rc": code, "run": str(run) if run else None}
    if run is None:
        return out
    dest = parts.out / "profiles" / part
    dest.mkdir(parents=True, exist_ok=True)
    for name in (names.PROFILE_SUMMARY, "breakdown.png", "rank0.ops.json", "rank0.breakdown.json"):
        if (run / names.PROFILE_DIR / name).is_file():
            (dest / name).write_bytes((run / names.PROFILE_DIR / name).read_bytes())
    summary = run / names.PROFILE_DIR / names.PROFILE_SUMMARY
    if summary.is_file():
        rank0 = json.loads(summary.read_text())["ranks"].get("0", {})
        bd = rank0.get("breakdown", {})
        out.update(step_ms=bd.get("step_ms"), rows={r["category"]: [r["ms"], r["share"]] for r in bd.get("rows", [])},
                   communication_total_ms=bd.get("communication_total_ms"), overlap_ms=bd.get("overlap_ms"),
                   candidates=[[c["category"], c["ms"], c["action"]] for c in rank0.get("candidates", [])],
                   top_kernels=bd.get("top_kernels"), idle_gaps=bd.get("idle_gaps"))
    try:
        out["excerpt"] = excerpt(run, parts.out / "traces" / f"llama3_1b_h200_{part.removeprefix('profile_')}")
    except Exception as exc:  # noqa: BLE001 - the figures stand without it
        out["excerpt"] = f"failed: {type(exc).__name__}: {exc}"
    return out


def excerpt(run: Path, stem: Path) -> dict:
    """The last profiled step of rank 0's trace (its kernels by launch time, from the last anvil::next_batch),
    with its breakdown: test data."""
    from trainer.profiling import trace
    from trainer.profiling.breakdown import breakdown

    doc = trace.load(run / names.PROFILE_DIR / "rank0.trace.json")
    marks = sorted(float(e["ts"]) for e in doc["traceEvents"] if e.get("name") == "anvil::next_batch")
    if not marks:
        return {"error": "no anvil::next_batch in the trace"}
    cut = trace.excerpt(doc, marks[-1], float("inf"), by_launch=True)
    path = trace.write_gz(cut, stem.with_suffix(".trace.json.gz"))
    bd = breakdown(cut, steps=1)
    stem.with_suffix(".breakdown.json").write_text(json.dumps(bd, indent=1))
    return {"file": str(path), "bytes": path.stat().st_size, "kernels": len(trace.gpu_events(cut)),
            "step_ms": bd.get("step_ms")}


def tunableop(parts: Parts, config: str, limit: float) -> dict:
    import shutil
    cache, gemm_cache = Path("/tmp/anvil-tunableop-cache"), Path("/tmp/anvil-tunableop-cache-gemm")
    for path in (cache, gemm_cache):     # cold means cold, also on a machine an earlier call warmed
        shutil.rmtree(path, ignore_errors=True)
    out: dict = {"cache": str(cache)}
    train_sets = sets(*SETS, "train.steps=6", *NO_CHECKPOINTS)
    for name, flags in (("tune_none", []), ("tune_cold", ["--tune-gemm"]), ("tune_warm", ["--tune-gemm"])):
        code, _ = parts.run("tunableop", inv("train.pretrain", "--config", config, "--kernels", *flags, "--name", name,
                                             *train_sets), limit / 4, env={names.CACHE_DIR: str(cache)})
        run = parts.run_dir("train.pretrain", name)
        times = step_times(run)
        meta = json.loads((run / names.METADATA).read_text()) if run and (run / names.METADATA).is_file() else {}
        out[name] = {"rc": code, "run": str(run) if run else None, "step_times_s": times,
                     "first_step_s": times[0] if times else None,
                     "median_steps_4_6_s": statistics.median(times[3:]) if len(times) > 3 else None,
                     "tunableop": meta.get("tunableop"), "wall_s": meta.get("duration_s")}
    cold, warm, none = out["tune_cold"], out["tune_warm"], out["tune_none"]
    if cold["first_step_s"] and warm["first_step_s"]:
        out["tuning_time_s"] = round(cold["first_step_s"] - warm["first_step_s"], 2)
    if none["median_steps_4_6_s"] and warm["median_steps_4_6_s"]:
        out["step_speedup_tuned_vs_default"] = round(none["median_steps_4_6_s"] / warm["median_steps_4_6_s"], 4)
    for name, flags in (("gemm_none", []), ("gemm_cold", ["--tune-gemm"]), ("gemm_warm", ["--tune-gemm"])):
        t0 = time.time()
        code, text = parts.run("tunableop", inv("bench.gemm", "-M", "8192", "--json", *flags), limit / 6,
                               env={names.CACHE_DIR: str(gemm_cache)})
        result = _last_json(text)
        out[name] = {"rc": code, "wall_s": round(time.time() - t0, 1), "tflops": result.get("tflops"),
                     "median_ms": result.get("median_ms")}
    files = sorted(str(p) for p in cache.rglob("*.csv")) + sorted(str(p) for p in gemm_cache.rglob("*.csv"))
    out["results_files"] = files
    if files:
        out["results_head"] = Path(files[0]).read_text()[:3000]
    return out


def _last_json(text: str) -> dict:
    start = text.find("{")
    while start != -1:
        try:
            return json.loads(text[start:text.rindex("}") + 1])
        except ValueError:
            start = text.find("{", start + 1)
    return {}


def ncu(parts: Parts, config: str, source: str, limit: float) -> dict:
    import shutil
    out: dict = {"ncu": shutil.which("ncu")}
    if out["ncu"]:
        out["version"] = subprocess.run(["ncu", "--version"], capture_output=True, text=True).stdout.strip()[-200:]
    kernels = source or r"nvjet|sdpa|_rms_norm|ce_row|_adamw"
    code, text = parts.run("ncu", inv("profile.train", "--config", config, "--kernels", "--tool", "ncu",
                                      "--tool-kernels", kernels, "--top", "5", "--steps", "5:6", "--name", "ncu",
                                      *sets(*SETS)), limit)
    out.update(rc=code, printed=text[-4000:])
    run = parts.run_dir("profile.train", "ncu")
    reports = sorted((run / names.PROFILE_DIR).glob("*.ncu-rep")) if run else []
    dest = parts.out / "ncu"
    dest.mkdir(parents=True, exist_ok=True)
    for report in reports:
        if report.stat().st_size < 20 * 2 ** 20:
            (dest / report.name).write_bytes(report.read_bytes())
        summary = subprocess.run(["ncu", "--import", str(report), "--print-summary", "per-kernel"],
                                 capture_output=True, text=True)
        (dest / f"{report.stem}.summary.txt").write_text(summary.stdout + summary.stderr)
        out.setdefault("reports", []).append({"file": report.name, "bytes": report.stat().st_size})
    return out


def benchmark(parts: Parts, config: str, limit: float, batch: int, seq: int) -> dict:
    bench_out = parts.out / "bench"
    code, _ = parts.run("benchmark", [sys.executable, "-m", "benchmarks.train_throughput", "--config", config,
                                      "--variants", "kernels,compile_kernels", "--batch", str(batch), "--seq", str(seq),
                                      "--steps", "6", "--profile-steps", "2", "--out", str(bench_out),
                                      "--run-root", "/tmp/bench-runs", "--timeout", str(int(limit / 2))], limit)
    out: dict = {"rc": code}
    results = bench_out / "results.json"
    if results.is_file():
        for r in json.loads(results.read_text())["results"]:
            bd = r.get("breakdown") or {}
            out[r["variant"]] = {"step_time_s": r.get("step_time_s"), "error": r.get("error"),
                                 **{k: bd.get(k) for k in ("matmul_ms", "attention_ms", "other_kernels_ms",
                                                           "communication_ms", "exposed_communication_ms", "idle_ms",
                                                           "profile_step_ms", "categories")}}
    return out


def agreement(profile_part: dict, bench: dict) -> dict:
    """The profile's split against the benchmark's, column by column: relative difference."""
    rows = profile_part.get("rows") or {}
    if not rows or not bench or bench.get("matmul_ms") is None:
        return {}
    mine = {"matmul_ms": rows["gemm"][0] + rows["gemm_fp8"][0], "attention_ms": rows["attention"][0],
            "idle_ms": rows["idle"][0], "profile_step_ms": profile_part.get("step_ms"),
            "other_kernels_ms": sum(v[0] for k, v in rows.items()
                                    if k not in ("gemm", "gemm_fp8", "attention", "communication", "idle"))}
    return {k: {"profile": round(v, 2), "benchmark": bench.get(k),
                "rel_diff": round(v / bench[k] - 1, 4) if bench.get(k) else None} for k, v in mine.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/llama3_1b.yaml")
    p.add_argument("--budget", type=float, default=540.0, help="seconds for all parts together")
    p.add_argument("--parts", default=",".join(PARTS),
                   help="which parts, comma-separated (compare needs both profiles in the same call)")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    args = p.parse_args(argv)
    SETS.extend([f"data.batch_size={args.batch}", f"data.seq_len={args.seq}"])
    out = Path(args.out).resolve()
    runs = Path(os.environ.setdefault("INVOKE_ANVIL_RUNS_DIR", "/tmp/runs"))
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    parts = Parts(out, args.budget, runs)
    import torch
    parts.report["versions"] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                                "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                                "python": sys.version.split()[0]}
    rep = parts.report
    chosen = set(args.parts.split(","))
    unknown = chosen - set(PARTS)
    if unknown:
        p.error(f"--parts: unknown {', '.join(sorted(unknown))} (known: {', '.join(PARTS)})")
    rep["parts_chosen"] = [part for part in PARTS if part in chosen]
    if "profile_kernels" in chosen:
        rep["profile_kernels"] = profile(parts, "profile_kernels", args.config, ["--kernels"], 120)
    if "tunableop" in chosen:
        rep["tunableop"] = tunableop(parts, args.config, 150)
        parts.save()
    if "ncu" in chosen:
        first = rep.get("profile_kernels", {})
        rep["ncu"] = ncu(parts, args.config, first.get("run") if first.get("rows") else "", 100)
        parts.save()
    if "profile_compile_kernels" in chosen:
        rep["profile_compile_kernels"] = profile(parts, "profile_compile_kernels", args.config,
                                                 ["--compile", "--kernels"], 150)
    a, b = rep.get("profile_kernels", {}).get("run"), rep.get("profile_compile_kernels", {}).get("run")
    if "compare" in chosen and a and b:
        code, text = parts.run("compare", inv("profile.compare", a, b), 30)
        rep["compare"] = {"rc": code, "printed": text[-3000:]}
    if "benchmark" in chosen:
        rep["benchmark"] = benchmark(parts, args.config, 240, args.batch, args.seq)
        rep["agreement"] = {variant: agreement(rep.get(f"profile_{variant}", {}), rep["benchmark"].get(variant, {}))
                            for variant in ("kernels", "compile_kernels")}
    parts.save()
    print(json.dumps({k: v for k, v in rep.items() if k in ("versions", "agreement", "elapsed_s")}, indent=1))
    print(f"wrote {out / 'profile_gpu.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
