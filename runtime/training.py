"""A training job through the runner: config, environment, run directory, torchrun.

train.pretrain and profile.train both start the trainer this way; profile.train
only adds the variables that open trainer.profiling's window.

    result = run_training(c, "train.pretrain", TrainingJob(config="configs/tiny.yaml"), run_options)
    result["run_dir"], result["summary"]

1. Load and validate the config (dotted --set overrides); check its data.
2. Resolve the environment: profiles, the config's env: block, --env.
3. runtime.run.execute: run directory, snapshot, hooks; the body writes the
   config as used and launches `python -m trainer` through the configured
   runtime (torchrun with one process per visible GPU, one on CPU).
User errors end in invoke's Exit with one message naming the task.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from invoke.exceptions import Exit


@dataclass
class TrainingJob:
    config: str = ""                    # "" = configs/tiny.yaml
    sets: list[str] = field(default_factory=list)
    nproc: int = 0                      # 0 = one per visible GPU, one on CPU
    resume: str = ""                    # "", "auto", or a run / checkpoint path
    compile: bool = False
    kernels: bool = False
    gpu: str = ""
    site: str = ""


def previous_checkpoint(runs_dir: Path, name: str) -> str | None:
    """--resume auto: the newest complete checkpoint among earlier runs with this name."""
    from trainer.checkpoint import find_latest

    for run_dir in sorted(Path(runs_dir).glob(f"*_train.pretrain_{name}"), reverse=True):
        found = find_latest(run_dir)
        if found is not None:
            return str(found)
    return None


def run_training(c, task_name: str, job: TrainingJob, run_options, extra_env: list[str] = ()) -> dict:
    """Train as `job` says; returns {"run_dir": Path, "summary": dict | None}."""
    import envs
    from runtime import settings as settings_mod
    from runtime.launch import ContainerOptions, LaunchError, LaunchSpec, launch
    from runtime.run import execute
    from trainer.config import DEFAULT_CONFIG, ConfigError, dump, load
    from trainer.data import DataError
    from trainer.train import check_data

    sets = list(job.sets) + ["train.compile=true"] * job.compile + ["train.kernels=true"] * job.kernels
    try:
        cfg = load(job.config or None, sets)
        check_data(cfg)
    except (ConfigError, DataError) as exc:
        raise Exit(f"{task_name}: {exc}", 2)
    config_path = job.config or str(DEFAULT_CONFIG)
    try:
        env = envs.resolve(gpu=job.gpu or None, site=job.site or None, config_env=cfg.env,
                           overrides=list(run_options.env) + list(extra_env), config_ref=f"{config_path} (env:)")
    except envs.EnvError as exc:
        raise Exit(f"{task_name}: {exc}", 2)
    for warning in env.warnings:
        print(f"WARNING: {warning}")
    settings = settings_mod.load(c)
    name = run_options.name or cfg.name
    resume = job.resume
    if resume == "auto":
        resume = previous_checkpoint(settings.runs_dir, name) or "auto"

    def body(run):
        run.write_text("config.yaml", dump(cfg))
        args = ["--config", str(run.path / "config.yaml"), "--run-dir", str(run.path)]
        if resume:
            args += ["--resume", resume]
        spec = LaunchSpec(module="trainer", args=args, runtime=settings.runtime,
                          nproc=job.nproc or None, gpus=env.machine.count, vendor=env.machine.vendor,
                          container=ContainerOptions(engine=settings.container_engine or "docker",
                                                     image=settings.container_image))
        try:
            code = launch(spec, env=run.env, run_dir=run.path, masker=run.masker)
        except LaunchError as exc:
            raise Exit(f"{task_name}: {exc}", 2)
        if code == 3:
            raise Exit(f"{task_name}: stopped on a signal after checkpointing; continue with "
                       f"`inv train.pretrain --resume {run.path}` (same config)", 3)
        if code != 0:
            raise Exit(f"{task_name}: the trainer exited with status {code}; see {run.path}/logs/rank0.log", code)
        summary_path = run.path / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
        return {"run_dir": run.path, "summary": summary}

    spec = run_options.spec(task_name, name=name, configs={"train.yaml": cfg.to_dict()},
                            config_sources={"train.yaml": config_path},
                            # a replay passes the recorded copy, even when the run used the default
                            config_options={"train.yaml": "--config"},
                            env=env, extra={"resume": resume or None})
    return execute(c, spec, body)
