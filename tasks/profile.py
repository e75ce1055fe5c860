"""inv profile.*: where the step time of a training run goes, what to do about it, and two runs compared.

    inv profile.train [--config X] [--steps 3:6] [--ranks 0] [--set k=v]... [--kernels] [--compile]
                      [--tool nsys|ncu|rocprofv3|rocprofv3-counters [--tool-kernels RUN|REGEX] [--tool-args "..."]]
                      [--tune-gemm] [--dry-run]
    inv profile.compare RUN_A RUN_B [--rank R] [--json]

train runs the trainer as train.pretrain does (same run directory, snapshot,
hooks and launcher), shortened to the profiled window, with trainer.profiling
recording only the ranks asked for: one rank's trace of a 1024-rank job is
what you can read (LUMI's advice). Per profiled rank it writes
RUN/profile/rank{R}.trace.json (Perfetto / chrome://tracing) and prints the
operators that took the most time, then the step time by category (GEMM,
attention, normalisation, ..., communication exposed and total, GPU idle) and
the categories worth a look with an action for each; the same goes into
RUN/profile/summary.json and breakdown.png. With --tool the chosen ranks run
under that vendor profiler instead, recording the same window only.

compare puts two profiled runs' tables side by side with the difference per
category: what a change (--kernels, --compile, FP8, another node) did to the step.
"""
import json as jsonlib

from invoke import Collection, task

from core import names
from runtime.runs.run import run_task
from core.errors import AnvilError

HELP = {
    "config": "Training config YAML (default: configs/tiny.yaml)",
    "set": "Config override KEY=VALUE (repeatable), as for train.pretrain",
    "steps": "Steps to record, START:END (end exclusive); the first steps hold compile and warm-up",
    "ranks": "Global ranks to profile: 0,8 or all",
    "top": "Operators to print per rank (with --tool-kernels RUN: that run's largest kernels to measure)",
    "nproc": "Processes per node (default: one per visible GPU, one on CPU)",
    "compile": "torch.compile the decoder blocks and the loss",
    "kernels": "Use the fused Triton kernels (kernels.patch)",
    "gpu": "Resolve the environment for another GPU model (default: detect)",
    "site": "Site overlay: lumi, or none (default: auto-detect)",
    "tool": "Run the chosen ranks under a vendor profiler for the window only: nsys, ncu (NVIDIA); rocprofv3 "
            "(kernel, HIP and copy traces), rocprofv3-counters (hardware counters) (AMD)",
    "tool-kernels": "ncu, rocprofv3-counters: the kernels to measure, a regular expression on their names or a "
                    "run profiled before (its largest kernels)",
    "tool-args": "More options for the tool, as one quoted string",
    "tune-gemm": "TunableOp GEMM tuning, its results kept per GPU model, torch and CUDA/ROCm build",
    "dry-run": "Print the resolved config and the launch command; start nothing",
}


@run_task(help=HELP, iterable=["set_"])
def train(c, config=None, set_=None, steps="3:6", ranks="0", top=15, nproc=0, compile=False, kernels=False,
          gpu="", site="", tool="", tool_kernels="", tool_args="", tune_gemm=False, dry_run=False, run_options=None):
    """Profile a few training steps on chosen ranks: step time by category with advice, the trace, the top ops."""
    import shlex

    from tabulate import tabulate

    from runtime import settings as settings_mod
    from runtime.jobs import profiling
    from runtime.jobs.training import TrainingJob, run_training
    from runtime.launch import tools
    from trainer.profiling import ProfileSettingsError, parse_ranks, parse_steps
    from trainer.profiling.report import advice_lines, table

    # the option names the user typed, not the variables they travel in (names.PROFILE_STEPS, names.PROFILE_RANKS, ...)
    try:
        _, end = parse_steps(steps)
    except ProfileSettingsError:
        raise ProfileSettingsError(f"--steps {steps!r}: expected START:END with 1 <= START < END "
                                   f"(end exclusive), e.g. 3:6") from None
    try:
        chosen = parse_ranks(ranks)
    except ProfileSettingsError:
        chosen = set()
    if chosen is not None and (not chosen or min(chosen) < 0):
        raise ProfileSettingsError(f"--ranks {ranks!r}: expected global ranks >= 0 such as 0 or 0,8, "
                                   f"or all")
    if top < 1:
        raise ProfileSettingsError(f"--top: expected a positive number of operators, got {top}")
    if nproc < 0:
        raise ProfileSettingsError(f"--nproc: expected a positive number of processes per node "
                                   f"(0 or left out: one per visible GPU), got {nproc}")
    if tool and tool not in tools.TOOLS:
        raise ProfileSettingsError(f"--tool {tool!r}: expected one of {', '.join(tools.TOOLS)}")
    if (tool_kernels or tool_args) and not tool:
        raise ProfileSettingsError("--tool-kernels and --tool-args go with --tool")
    if tool_args:
        try:
            shlex.split(tool_args)
        except ValueError as exc:
            raise ProfileSettingsError(f"--tool-args {tool_args!r}: {exc}") from None
    regex = profiling.kernel_regex(tool_kernels, top, settings_mod.load(c).runs_dir) if tool_kernels else ""
    # Stop right after the window: the point is the profile, not the model.
    sets = list(set_ or []) + [f"train.steps={end - 1}", "checkpoint.interval=0", "checkpoint.save_final=false"]
    job = TrainingJob(config=config, sets=sets, nproc=nproc, compile=compile, kernels=kernels, gpu=gpu, site=site,
                      dry_run=dry_run, ranks_used=frozenset(chosen or ()), tool=tool, tune_gemm=tune_gemm)
    window = [f"{names.PROFILE_STEPS}={steps}", f"{names.PROFILE_RANKS}={ranks}"]
    if tool:
        window += [f"{tools.TOOL_VAR}={tool}"] + ([f"{tools.KERNELS_VAR}={regex}"] if regex else []) \
            + ([f"{tools.ARGS_VAR}={tool_args}"] if tool_args else [])
    result = run_training(c, "profile.train", job, run_options, extra_env=window,
                          after=None if tool else profiling.summarise)
    if result.get("dry_run"):   # train.pretrain's dry run printed the config and the command
        print(f"profiling steps {steps} (end exclusive) on ranks {ranks}: the ranks get "
              + " ".join(shlex.quote(w) for w in window))
        if tool:
            first = min(chosen) if chosen else 0
            print(f"rank {first} runs under: "
                  + shlex.join(tools.tool_command(tool, first, "RUN_DIR/profile", regex, tool_args)))
        return
    run_dir = result["run_dir"]
    if tool:
        _print_tool_output(run_dir, tool)
        return
    profile_dir = run_dir / names.PROFILE_DIR
    reports = sorted(profile_dir.glob("rank*.ops.json"))
    if not reports:
        raise AnvilError(f"no trace was written (is rank {ranks} in this job?); see {run_dir}/logs", exit_code=1)
    summary = result["after"]
    for path in reports:
        report = jsonlib.loads(path.read_text())
        rank = str(report["rank"])
        print(f"\nrank {rank}, steps {report['steps'][0]}..{report['steps'][1] - 1}: "
              f"{path.with_name(path.name.replace('.ops.json', '.trace.json'))}")
        ops = report["ops"][:top]
        on_device = any(op["self_device_ms"] for op in ops)     # a CPU run has no device column to show
        print(tabulate([[op["name"][:60], op["calls"]] + ([f"{op['self_device_ms']:.2f}"] if on_device else [])
                        + [f"{op['self_cpu_ms']:.2f}"] for op in ops],
                       headers=["operator", "calls"] + (["self device ms"] if on_device else []) + ["self CPU ms"],
                       floatfmt=".2f"))
        entry = summary["ranks"].get(rank, {})
        bd = entry.get("breakdown", {})
        if "rows" not in bd:
            print(f"\nno step-time breakdown: {bd.get('error', 'none written')}")
            continue
        print(f"\nstep time by category, rank {rank} ({bd['step_ms']:.2f} ms/step over {bd['steps']} steps):")
        print(table(bd))
        print("\nworth a look (categories other than the GEMMs over 2% of the step):")
        print(advice_lines(entry.get("candidates", [])))
    drawn = any("rows" in entry.get("breakdown", {}) for entry in summary["ranks"].values())
    print(f"\n{profile_dir / profiling.SUMMARY}" + (f", {summary['chart']}" if summary.get("chart") else
                                                   f" (no chart: {summary.get('chart_error') or 'matplotlib is not installed'})"
                                                   if drawn else ""))


def _print_tool_output(run_dir, tool):
    from runtime.jobs import profiling
    from runtime.launch import tools

    profile_dir = run_dir / names.PROFILE_DIR
    found = sorted(p for p in profile_dir.iterdir() if not p.name.endswith(".window.json")) \
        if profile_dir.is_dir() else []
    if not found:
        raise AnvilError(f"--tool {tool}: it wrote nothing into {profile_dir}; see {run_dir}/logs", exit_code=1)
    print(f"{tool} wrote ({tools.TOOLS[tool].output.format(rank='R')} per profiled rank):")
    for path in found:
        print(f"  {path}")
    if tool != "ncu":
        return
    from tabulate import tabulate
    for report in (p for p in found if p.suffix == ".ncu-rep"):
        try:
            rows = profiling.ncu_summary(report)
        except (AnvilError, OSError) as exc:
            print(f"{report.name}: {exc}")
            continue
        print(f"\n{report.name}: {len(rows)} kernel launch(es) measured")
        print(tabulate([[r["kernel"][:60], r["launch__grid_size"], r["gpu__time_duration.sum"],
                         r["sm__throughput.avg.pct_of_peak_sustained_elapsed"],
                         r["gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed"]] for r in rows],
                       headers=["kernel", "grid", "duration", "SM % of peak", "memory % of peak"], floatfmt=".1f"))


@task(help={"run_a": "A profiled run directory (inv profile.train), the baseline",
            "run_b": "Another, the change",
            "rank": "The rank to compare (default: the lowest both profiled)",
            "json": "Print both breakdowns and the difference as JSON"})
def compare(c, run_a, run_b, rank="", json=False):
    """Two profiled runs' step time by category side by side, with the difference per category."""
    from runtime import settings as settings_mod
    from runtime.jobs import profiling
    from trainer.profiling.report import compare_table

    chosen, ((name_a, a), (name_b, b)) = profiling.compare(run_a, run_b, str(rank), settings_mod.load(c).runs_dir)
    if json:
        diff = {row["category"]: round(row_b["ms"] - row["ms"], 3) for row in a["rows"] for row_b in b["rows"]
                if row_b["category"] == row["category"]}
        print(jsonlib.dumps({"rank": chosen, "a": {"run": name_a, **a}, "b": {"run": name_b, **b},
                             "diff_ms": diff, "step_diff_ms": round(b["step_ms"] - a["step_ms"], 3)}, indent=2))
        return
    print(f"rank {chosen}: A = {name_a}, B = {name_b}")
    print(compare_table(a, b, "A", "B"))


ns = Collection("profile")
ns.add_task(train)
ns.add_task(compare)
