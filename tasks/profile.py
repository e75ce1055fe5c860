"""inv profile.*: torch.profiler traces of chosen steps on chosen ranks of a training run.

    inv profile.train [--config X] [--steps 3:6] [--ranks 0] [--set k=v]... [--kernels] [--compile] [--dry-run]

Runs the trainer as train.pretrain does (same run directory, snapshot, hooks
and launcher), shortened to the profiled window, with trainer.profiling
recording only the ranks asked for: one rank's trace of a 1024-rank job is
what you can read (LUMI's advice). Writes RUN/profile/rank{R}.trace.json
(Perfetto / chrome://tracing) and prints the operators that took the most time.
"""
import json as jsonlib

from invoke import Collection

from runtime.runs.run import run_task
from trainer.errors import AnvilError

HELP = {
    "config": "Training config YAML (default: configs/tiny.yaml)",
    "set": "Config override KEY=VALUE (repeatable), as for train.pretrain",
    "steps": "Steps to record, START:END (end exclusive); the first steps hold compile and warm-up",
    "ranks": "Global ranks to profile: 0,8 or all",
    "top": "Operators to print per rank",
    "nproc": "Processes per node (default: one per visible GPU, one on CPU)",
    "compile": "torch.compile the decoder blocks and the loss",
    "kernels": "Use the fused Triton kernels (kernels.patch)",
    "gpu": "Resolve the environment for another GPU model (default: detect)",
    "site": "Site overlay: lumi, or none (default: auto-detect)",
    "dry-run": "Print the resolved config and the launch command; start nothing",
}


@run_task(help=HELP, iterable=["set_"])
def train(c, config=None, set_=None, steps="3:6", ranks="0", top=15, nproc=0, compile=False, kernels=False,
          gpu="", site="", dry_run=False, run_options=None):
    """Profile a few training steps on chosen ranks: chrome trace + the operators that took longest."""
    from tabulate import tabulate

    from runtime.jobs.training import TrainingJob, run_training
    from trainer.profiling import ProfileSettingsError, parse_ranks, parse_steps

    # the option names the user typed, not the variables they travel in (ANVIL_PROFILE_*)
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
    # Stop right after the window: the point is the trace, not the model.
    sets = list(set_ or []) + [f"train.steps={end - 1}", "checkpoint.interval=0", "checkpoint.save_final=false"]
    job = TrainingJob(config=config, sets=sets, nproc=nproc, compile=compile, kernels=kernels, gpu=gpu, site=site,
                      dry_run=dry_run, ranks_used=frozenset(chosen or ()))
    window = [f"ANVIL_PROFILE_STEPS={steps}", f"ANVIL_PROFILE_RANKS={ranks}"]
    result = run_training(c, "profile.train", job, run_options, extra_env=window)
    if result.get("dry_run"):   # train.pretrain's dry run printed the config and the command
        print(f"profiling steps {steps} (end exclusive) on ranks {ranks}: the ranks get " + " ".join(window))
        return
    profile_dir = result["run_dir"] / "profile"
    reports = sorted(profile_dir.glob("rank*.ops.json"))
    if not reports:
        raise AnvilError(f"no trace was written (is rank {ranks} in this job?); see "
                         f"{result['run_dir']}/logs", exit_code=1)
    for path in reports:
        report = jsonlib.loads(path.read_text())
        print(f"\nrank {report['rank']}, steps {report['steps'][0]}..{report['steps'][1] - 1}: "
              f"{path.with_name(path.name.replace('.ops.json', '.trace.json'))}")
        ops = report["ops"][:top]
        on_device = any(op["self_device_ms"] for op in ops)     # a CPU run has no device column to show
        print(tabulate([[op["name"][:60], op["calls"]] + ([f"{op['self_device_ms']:.2f}"] if on_device else [])
                        + [f"{op['self_cpu_ms']:.2f}"] for op in ops],
                       headers=["operator", "calls"] + (["self device ms"] if on_device else []) + ["self CPU ms"],
                       floatfmt=".2f"))


ns = Collection("profile")
ns.add_task(train)
