"""inv profile.*: torch.profiler traces of chosen steps on chosen ranks of a training run.

    inv profile.train [--config X] [--steps 3:6] [--ranks 0] [--set k=v]... [--kernels] [--compile]

Runs the trainer as train.pretrain does (same run directory, snapshot, hooks
and launcher), shortened to the profiled window, with trainer.profiling
recording only the ranks asked for: one rank's trace of a 1024-rank job is
what you can read (LUMI's advice). Writes RUN/profile/rank{R}.trace.json
(Perfetto / chrome://tracing) and prints the operators that took the most time.
"""
import json as jsonlib

from invoke import Collection
from invoke.exceptions import Exit

from runtime.runs.run import run_task

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
}


@run_task(help=HELP, iterable=["set_"])
def train(c, config="", set_=None, steps="3:6", ranks="0", top=15, nproc=0, compile=False, kernels=False,
          gpu="", site="", run_options=None):
    """Profile a few training steps on chosen ranks: chrome trace + the operators that took longest."""
    from tabulate import tabulate

    from runtime.jobs.training import TrainingJob, run_training
    from trainer.profiling import ProfileSettingsError, parse_ranks, parse_steps

    try:
        _, end = parse_steps(steps)
        parse_ranks(ranks)
    except ProfileSettingsError as exc:
        raise Exit(f"profile.train: {exc}", 2)
    # Stop right after the window: the point is the trace, not the model.
    sets = list(set_ or []) + [f"train.steps={end - 1}", "checkpoint.interval=0", "checkpoint.save_final=false"]
    job = TrainingJob(config=config, sets=sets, nproc=nproc, compile=compile, kernels=kernels, gpu=gpu, site=site)
    result = run_training(c, "profile.train", job, run_options,
                          extra_env=[f"ANVIL_PROFILE_STEPS={steps}", f"ANVIL_PROFILE_RANKS={ranks}"])
    profile_dir = result["run_dir"] / "profile"
    reports = sorted(profile_dir.glob("rank*.ops.json"))
    if not reports:
        raise Exit(f"profile.train: no trace was written (is rank {ranks} in this job?); see "
                   f"{result['run_dir']}/logs", 1)
    for path in reports:
        report = jsonlib.loads(path.read_text())
        print(f"\nrank {report['rank']}, steps {report['steps'][0]}..{report['steps'][1] - 1}: "
              f"{path.with_name(path.name.replace('.ops.json', '.trace.json'))}")
        print(tabulate([[op["name"][:60], op["calls"], f"{op['self_device_ms']:.2f}", f"{op['self_cpu_ms']:.2f}"]
                        for op in report["ops"][:top]],
                       headers=["operator", "calls", "self device ms", "self CPU ms"]))


ns = Collection("profile")
ns.add_task(train)
