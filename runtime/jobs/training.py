"""A training job through the runner: config, environment, run directory, launch.

train.pretrain and profile.train both start the trainer this way; profile.train
only adds the variables that open trainer.profiling's window.

    result = run_training(c, "train.pretrain", TrainingJob(config="configs/tiny.yaml"), run_options)
    result["run_dir"], result["summary"]

1. Load and validate the config (dotted --set overrides); check its data and
   the launch options - all before a run directory exists.
2. Resolve the environment: profiles, the config's env: block, --env.
3. runtime.runs.run.execute: run directory, snapshot, hooks; the body writes
   the config as used and launches `python -m trainer` through the runtime
   (direct: the agent with one rank per visible GPU, one on CPU; slurm: one
   agent per node of the allocation, or an sbatch job that is followed).
4. The agents' reports give the hosts, the world size, and on failure the
   first failing rank with its own error line.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from runtime.launch.spec import EXIT_INTERRUPTED, EXIT_REQUEUE
from trainer.errors import AnvilError, UserError


class JobStopped(AnvilError):
    """The job ended early but cleanly (preempted or interrupted); `status` says which."""

    def __init__(self, message: str, exit_code: int, status: str):
        super().__init__(message, exit_code)
        self.status = status


@dataclass
class TrainingJob:
    config: str | None = None           # None = configs/tiny.yaml
    sets: list[str] = field(default_factory=list)
    nproc: int = 0                      # 0 = one per visible GPU, one on CPU
    resume: str | None = None           # None (not given), "auto", or a run / checkpoint path
    compile: bool = False
    kernels: bool = False
    gpu: str = ""
    site: str = ""
    runtime: str = ""                   # "" = the anvil.runtime setting
    nodes: int = 0                      # slurm: 0 = the allocation's, or 1
    partition: str = ""
    account: str = ""
    time: str = ""
    wait: bool = True                   # sbatch: follow the job
    exclude: list[str] = field(default_factory=list)
    exclude_from: str = ""              # a preflight run whose failing nodes are left out
    dry_run: bool = False
    ranks_used: frozenset[int] = frozenset()   # global ranks the task needs (profile.train --ranks)


def previous_checkpoint(runs_dir: Path, name: str) -> str | None:
    """--resume auto: the newest complete checkpoint among earlier runs with this name.

    A host of an `inv -H` fan-out keeps its runs in FANOUT/hosts/<host>/, a new fan-out run each
    time: its earlier runs are in the other fan-outs' hosts/<host>/ folders beside it."""
    from trainer.checkpoint import find_latest

    runs_dir = Path(runs_dir)
    pattern = f"*_train.pretrain_{name}"
    candidates = list(runs_dir.glob(pattern))
    if runs_dir.parent.name == "hosts":
        candidates += runs_dir.parent.parent.parent.glob(f"*/hosts/{runs_dir.name}/{pattern}")
    for run_dir in sorted(set(candidates), key=lambda p: p.name, reverse=True):   # names start with the time
        found = find_latest(run_dir)
        if found is not None:
            return str(found)
    return None


def finished_at(checkpoint: str, steps: int) -> int | None:
    """The checkpoint's step if it already reached `steps` (the run is complete), else None."""
    from trainer.checkpoint import read_meta

    if checkpoint in ("", "auto"):
        return None
    try:
        step = int(read_meta(Path(checkpoint)).get("step", -1))
    except (AnvilError, ValueError, TypeError):
        return None
    return step if step >= steps else None


def _needs_a_gpu_here(cfg, machine) -> None:
    """--kernels and precision.fp8 on a machine without a GPU: one line before a run, not a failed rank."""
    if not machine.has_gpu and cfg.train.kernels and os.environ.get("TRITON_INTERPRET") != "1":
        raise UserError("--kernels needs a GPU (CUDA or ROCm): the fused Triton kernels do not run on a CPU "
                        "(TRITON_INTERPRET=1 runs them in Triton's interpreter, slowly, as the tests do); "
                        "drop --kernels here")
    if not machine.has_gpu and cfg.precision.fp8 != "off":
        from trainer.fp8 import NEEDS_GPU
        raise UserError(f"{NEEDS_GPU}; this machine has none. Set precision.fp8=off")


def launch_spec(job: TrainingJob, settings, env, args: list[str], job_name: str = "anvil",
                mounts: list[str] = ()):
    """The LaunchSpec of this job, its Slurm options from the task's options over the settings;
    `mounts` (the dataset) go into a container beside the settings' container_mounts."""
    from runtime.launch import ContainerOptions, LaunchSpec, SlurmOptions
    from runtime.settings import RUNTIMES

    runtime = job.runtime or settings.runtime
    if runtime not in RUNTIMES:
        raise UserError(f"--runtime {runtime!r}: expected {' | '.join(RUNTIMES)}")
    if job.nproc < 0:
        raise UserError(f"--nproc {job.nproc}: expected 1 or more (0 = one per visible GPU)")
    if job.nodes < 0:
        raise UserError(f"--nodes {job.nodes}: expected 1 or more")
    if (job.nodes or job.partition or job.account or job.time or not job.wait) and not runtime.startswith("slurm"):
        raise UserError("--nodes, --partition, --account, --time and --no-wait need --runtime slurm "
                        f"(runtime is {runtime})")
    slurm = SlurmOptions(mode=settings.slurm_mode, nodes=job.nodes or None,
                         partition=job.partition or settings.slurm_partition,
                         account=job.account or settings.slurm_account, time=job.time or settings.slurm_time,
                         job_name=job_name[:60],
                         exclude=list(job.exclude), extra=list(settings.slurm_extra), wait=job.wait)
    container = ContainerOptions(engine=settings.container_engine or "docker", image=settings.container_image,
                                 mounts=list(settings.container_mounts) + list(mounts),
                                 extra=list(settings.container_extra))
    return LaunchSpec(module="trainer", args=args, runtime=runtime, nproc=job.nproc or None,
                      gpus=env.machine.count, vendor=env.machine.vendor, node_local=env.node_local(),
                      python=settings.container_python if "container" in runtime else "",
                      slurm=slurm, container=container)


def run_training(c, task_name: str, job: TrainingJob, run_options, extra_env: list[str] = ()) -> dict:
    """Train as `job` says; returns {"run_dir": Path, "summary": dict | None}."""
    import envs
    from runtime import settings as settings_mod
    from runtime.jobs import planning
    from runtime.jobs.environment import print_warnings
    from runtime.launch import build, launch
    from runtime.cluster.slurm.control import submitted_job_id
    from runtime.runs import nodes as nodes_mod
    from runtime.runs import outcome
    from runtime.runs.run import execute
    from trainer.config import DEFAULT_CONFIG, SYNTHETIC, dump, load
    from trainer.train import check_data

    if job.config is not None and not str(job.config).strip():
        raise UserError("--config is empty; expected a YAML config such as configs/tiny.yaml")
    if job.resume is not None and not job.resume.strip():
        raise UserError("--resume is empty; expected auto or a run directory or checkpoint path")
    sets = list(job.sets) + ["train.compile=true"] * job.compile + ["train.kernels=true"] * job.kernels
    cfg = load(job.config or None, sets)
    check_data(cfg)
    config_path = job.config or str(DEFAULT_CONFIG)
    env = envs.resolve(gpu=job.gpu or None, site=job.site or None, config_env=cfg.env,
                       overrides=list(run_options.env) + list(extra_env), config_ref=f"{config_path} (env:)")
    warnings = list(env.warnings)
    if cfg.schedule.warmup_steps >= cfg.train.steps and task_name == "train.pretrain":   # (a profile is short)
        warnings.append(f"schedule.warmup_steps={cfg.schedule.warmup_steps} >= train.steps={cfg.train.steps}: "
                        "the learning rate never leaves warmup")
    print_warnings(warnings)   # stderr: stdout stays the result (--json)
    settings = settings_mod.load(c)
    excluded: dict[str, list[str]] = {}
    if job.exclude_from:
        excluded = nodes_mod.failing(job.exclude_from)
        job.exclude = sorted(set(job.exclude) | set(excluded))
    name = run_options.name or cfg.name
    resume = job.resume or ""
    if resume not in ("", "auto"):
        from trainer.checkpoint import resolve as resolve_checkpoint
        found = resolve_checkpoint(resume, Path("."), what="--resume")   # CheckpointError now, not in every rank
        done = finished_at(str(found), cfg.train.steps)
        if done is not None:    # the trainer would load it and stop at once: a run that trains nothing
            raise UserError(f"--resume {resume}: its checkpoint ({found.name}) is at step {done}, and "
                            f"train.steps is {cfg.train.steps}: nothing to train; --set train.steps=N with N > "
                            f"{done} trains on from there")
    if resume == "auto":
        resume = previous_checkpoint(settings.runs_dir, name) or "auto"
        done = finished_at(resume, cfg.train.steps)
        if done is not None and not job.dry_run and task_name == "train.pretrain":
            print(f"{name}: already complete at step {done} of train.steps={cfg.train.steps} ({resume}); "
                  f"nothing to do (--set train.steps=N with a larger N trains on from there)", file=sys.stderr)
            return {"run_dir": None, "summary": None, "complete": resume}
    # Check the launch before a run directory exists (bad --nproc, --nodes, runtime, image).
    # a container sees the checkout and the run directory; the dataset may live elsewhere
    data_mounts = [] if cfg.data.path == SYNTHETIC else [str(Path(cfg.data.path).resolve())]
    probe = launch_spec(job, settings, env, ["--config", "CONFIG", "--run-dir", "RUN"], mounts=data_mounts)
    if not probe.runtime.startswith("slurm"):   # (a Slurm login node has no GPU; its nodes do)
        _needs_a_gpu_here(cfg, env.machine)
    built = build(probe, {**os.environ, **env.environ()}, Path("RUN"))
    world = built.nproc * built.nodes
    if job.ranks_used and max(job.ranks_used) >= world:
        raise UserError(f"--ranks {','.join(map(str, sorted(job.ranks_used)))}: this job has {world} rank(s), "
                        f"0..{world - 1}")
    if probe.runtime.startswith("slurm") and not job.dry_run:
        from runtime.cluster.slurm.control import require, require_controller
        require(built.argv[0])            # srun or sbatch: Slurm is there, before a run directory is,
        require_controller(os.environ)    # and its controller answers
    if built.script is not None and not resume:
        resume = "auto"   # a batch job that Slurm requeues resumes from its own run directory
    too_big = planning.fit_warning(cfg, env, built.nproc, built.nodes,
                                   on_this_machine=not probe.runtime.startswith("slurm"))
    if too_big:
        print_warnings([too_big])
    if job.dry_run:
        print(dump(cfg))
        args = ["--config", "RUN_DIR/config.yaml", "--run-dir", "RUN_DIR"] + (["--resume", resume] if resume else [])
        spec = launch_spec(job, settings, env, args, mounts=data_mounts)
        launch(spec, {**os.environ, **env.environ()}, run_dir=Path("RUN_DIR"), dry_run=True)
        return {"run_dir": None, "summary": None, "dry_run": True}

    def body(run):
        run.write_text("config.yaml", dump(cfg))
        args = ["--config", str(run.path / "config.yaml"), "--run-dir", str(run.path)]
        if resume:
            args += ["--resume", resume]
        spec = launch_spec(job, settings, env, args, job_name=f"anvil-{run.path.name}", mounts=data_mounts)
        if excluded:
            run.update_metadata(excluded_nodes=excluded)
            print(f"excluding {len(excluded)} node(s) that failed preflight in {job.exclude_from}: "
                  + ", ".join(f"{h} ({'; '.join(r)[:80]})" for h, r in sorted(excluded.items())), file=sys.stderr)
        code = launch(spec, env=run.env, run_dir=run.path, masker=run.masker, stdout=sys.stderr)   # stdout: the result
        job_id = submitted_job_id(run.path)
        if job_id:
            run.update_metadata(slurm_job_id=job_id)
        if job_id and not job.wait:
            # The job runs later, without us: its batch script records the end (runtime.runs.jobend).
            run.end_status = "submitted"
            print(f"the run's status is in {run.path}/metadata.json (`inv snapshot.show {run.path}`); "
                  f"`squeue -j {job_id}` shows the job", file=sys.stderr)
            return {"run_dir": run.path, "summary": None, "slurm_job_id": job_id}
        report = outcome.read(run.path)
        if code == 0:
            code = report.stop_status()   # under srun a clean stop exits 0 (agent.main)
        if report.nodes:
            run.update_metadata(hosts=report.hosts, world_size=report.world_size, nodes=len(report.nodes))
        if code == EXIT_REQUEUE:
            raise JobStopped(f"stopped on a signal after checkpointing; continue with "
                             f"`inv train.pretrain --resume {run.path}` (same config)", EXIT_REQUEUE, "preempted")
        if code == EXIT_INTERRUPTED:
            raise JobStopped(f"interrupted (Ctrl-C) after checkpointing; continue with "
                             f"`inv train.pretrain --resume {run.path}` (same config)", EXIT_INTERRUPTED,
                             "interrupted")
        if code != 0:
            cause = outcome.failure_summary(run.path, expected_nodes=built.nodes)
            raise AnvilError(cause or f"the trainer exited with status {code}; see {run.path}/logs/", code)
        summary_path = run.path / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
        return {"run_dir": run.path, "summary": summary}

    spec = run_options.spec(task_name, name=name, configs={"train.yaml": cfg.to_dict()},
                            config_sources={"train.yaml": config_path},
                            # a replay passes the recorded copy, even when the run used the default
                            config_options={"train.yaml": "--config"},
                            env=env, world_size=built.nproc * built.nodes,
                            extra={"resume": resume or None, "runtime": probe.runtime})
    return execute(c, spec, body)
