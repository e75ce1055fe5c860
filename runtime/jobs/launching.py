"""Another trainer through the runner (inv train.launch --backend NAME): the same machinery as train.pretrain,
with the backend's program where Anvil's trainer would be.

    result = run_launch(c, LaunchJob(backend="command", program=["python", "train.py"], nproc=2), run_options)
    result["run_dir"], result["summary"]

1. The backend checks what it was given (runtime.backends: the program, --config, the Megatron-LM checkout)
   and --metrics-regex is compiled; --resume is found among the backend's checkpoints; the runtime, the
   launch and the hosts are checked: all before a run directory exists (one line, exit 2).
2. The environment is resolved as for the trainer (profiles, --gpu, --site, --env).
3. runtime.runs.run.execute: run directory, snapshot (a config the backend reads is kept in RUN/configs/),
   hooks (hooks/train/launch/: the preflight gate); the body launches the program through the runtime's
   transport with Anvil's node agent in --backend mode (runtime.launch.agent, runtime.launch.output: rank
   logs, metrics.jsonl, resume, the backend's stop signal, --hang-timeout), exactly as train.pretrain
   launches the trainer (training.launch_job).
4. summary.json is the runner's, from metrics.jsonl (runtime.runs.metrics.summary): also after a stop or
   a failure, for what ran.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from core import names, runfiles
from core.errors import UserError
from core.signals import EXIT_INTERRUPTED, EXIT_REQUEUE, exit_status
from runtime.jobs.training import JobStopped, Placement, exclusions, kept_local, launch_job, previous_checkpoint, where

#: How long without a progress line before the ranks are taken for hung, by default (--hang-timeout).
HANG_TIMEOUT_S = 1800.0


@dataclass
class LaunchJob(Placement):
    backend: str = "command"
    program: list[str] = field(default_factory=list)   # what followed `--`
    config: str = ""                    # torchtitan: its TOML config (or MODULE:NAME)
    megatron: str = ""                  # megatron: the checkout ("" = anvil.megatron_path)
    metrics_regex: str = ""             # metric lines of another format
    hang_timeout: float = HANG_TIMEOUT_S   # seconds without a progress line once there was one; 0 = off
    max_restarts: int = 0               # a failed attempt starts again from the newest checkpoint, this often


def _resume(job: LaunchJob, backend, argv: list[str], runs_dir: Path, name: str):
    """The checkpoint --resume names (a Checkpoint), or None; UserError when there is none where it says."""
    given = (job.resume or "").strip()
    if job.resume is not None and not given:
        raise UserError("--resume is empty; expected auto or a run directory or checkpoint path")
    if not given:
        return None
    if given == "auto":
        def newest(run: Path) -> Path | None:
            found = backend.find(argv, run)
            return found.path if found is not None else None
        path = previous_checkpoint(runs_dir, name, "train.launch", find=newest)
        return (backend.at(Path(path)) or backend.find(argv, Path(path))) if path else None
    path = Path(given).expanduser()
    if not path.exists():
        raise UserError(f"--resume {given}: no such run directory or checkpoint")
    found = backend.find(argv, path)
    if found is None:
        raise UserError(f"--resume {given}: no {backend.name} checkpoint there (looked in "
                        f"{backend.checkpoint_dir(argv, path)})")
    return found


def run_launch(c, job: LaunchJob, run_options) -> dict:
    """Launch the backend's program as `job` says; {"run_dir": Path, "summary": dict | None}."""
    import envs
    from runtime import backends
    from runtime import settings as settings_mod
    from runtime.backends.base import compile_metrics_regex
    from runtime.jobs.environment import print_warnings
    from runtime.launch import LaunchSpec
    from runtime.runs import metrics
    from runtime.runs.replay import resume_command
    from runtime.runs.run import execute

    backend = backends.get(job.backend)
    settings = settings_mod.load(c)
    if job.metrics_regex:
        compile_metrics_regex(job.metrics_regex)
    if job.hang_timeout < 0:
        raise UserError(f"--hang-timeout {job.hang_timeout:g}: expected seconds >= 0 (0: off)")
    plan = backend.plan(list(job.program), backends.Options(config=job.config,
                                                            megatron=job.megatron or settings.megatron_path))
    env = envs.resolve(gpu=job.gpu or None, site=job.site or None, overrides=list(run_options.env))
    print_warnings(env.warnings)
    for note in plan.notes:
        print(f"note: {note}", file=sys.stderr)
    excluded, leaving_out = exclusions(job)
    name = run_options.name or backend.name
    resume = _resume(job, backend, plan.argv, settings.runs_dir, name)
    runtime, transport = where(job, settings, plan.mounts)
    if not kept_local(leaving_out, runtime):
        excluded = {}
    agent_args = ["--backend", backend.name, "--hang-timeout", f"{job.hang_timeout:g}", "--chdir", os.getcwd()]
    agent_args += ["--metrics-regex", job.metrics_regex] if job.metrics_regex else []
    spec = LaunchSpec(program=plan.argv, agent_args=agent_args, nproc=job.nproc or None, gpus=env.machine.count,
                      vendor=env.machine.vendor, node_local=env.node_local(),
                      profile=list(env.environ()))
    environ = {**os.environ, **env.environ()}
    layout = transport.layout(spec, environ)
    if job.dry_run:
        print(f"{backend.name}: {' '.join(plan.argv)}" + (f" (resuming from {resume.path})" if resume else ""))
        transport.launch(spec, environ, run_dir=Path("RUN_DIR"), dry_run=True)
        return {"run_dir": None, "summary": None, "dry_run": True}
    transport.check(os.environ)   # Slurm's commands are there and its controller answers; hosts answer
    restarts = _restarts(job, backend, plan.argv, transport, environ)

    def body(run):
        launch_env = dict(run.env)
        launch_env.pop(names.RESUME, None)
        launch_env.pop(names.RESUME_FROM, None)
        if resume is not None:   # the agents go on from the run's own checkpoints first (a requeued job)
            launch_env[names.RESUME_FROM] = str(resume.path)

        def stopped(code, report):
            found = backend.latest(backend.checkpoint_dir(plan.argv, run.path))
            signals = [n.signal for n in report.nodes if n.signal]
            what = "interrupted (Ctrl-C)" if code == EXIT_INTERRUPTED else \
                f"stopped ({signals[0] if signals else 'a stop signal'})"
            exit_code = code if code in (EXIT_REQUEUE, EXIT_INTERRUPTED) else exit_status(code - 128, training=True)
            status = "interrupted" if exit_code == EXIT_INTERRUPTED else "preempted"
            if found is not None:
                raise JobStopped(f"{what}; its newest checkpoint is {found.path} (step {found.step}); continue "
                                 f"where it ran with `{resume_command(run.metadata, run.path)}`", exit_code, status)
            raise JobStopped(f"{what} before {backend.name} saved a checkpoint in "
                             f"{backend.checkpoint_dir(plan.argv, run.path)}; the same command starts it again",
                             exit_code, status)

        try:
            submitted = launch_job(run, transport, spec, job, excluded, layout, stopped, env=launch_env,
                                   restarts=restarts)
            if submitted is not None:
                return submitted
        finally:
            summary = _summarize(run, metrics)
        return {"run_dir": run.path, "summary": summary}

    spec_of_run = run_options.spec(
        "train.launch", name=name, configs={n: p for n, p in plan.configs.items()},
        config_sources={n: job.config for n in plan.configs}, config_options={n: plan.config_option
                                                                            for n in plan.configs},
        env=env, world_size=layout.world_size,
        extra={"resume": str(resume.path) if resume else None, "runtime": str(runtime), "backend": backend.name,
               "program": list(job.program)})
    return execute(c, spec_of_run, body)


def _restarts(job: LaunchJob, backend, argv: list[str], transport, environ):
    """--max-restarts: the program's attempts after a failure, each from its newest checkpoint (the agents
    pick it, as for a requeued job), or None."""
    from runtime.jobs.restarts import Restarts, launch_nodes

    if job.max_restarts < 0:
        raise UserError(f"--max-restarts {job.max_restarts}: expected 0 or more")
    nodes = launch_nodes(transport, environ) if job.max_restarts else None
    if nodes is None:
        return None

    def newest(run_dir: Path) -> str | None:
        found = backend.latest(backend.checkpoint_dir(argv, run_dir))
        return str(found.path) if found is not None else None
    return Restarts(limit=job.max_restarts, nodes=nodes, find=newest)


def _summarize(run, metrics) -> dict | None:
    """summary.json from what the run logged (nothing when it logged no step); the run's end says the rest."""
    if run.end_status == "submitted":
        return None
    try:
        summary = metrics.summary(run.path, wall_s=round(time.time() - run.metadata["start_ts"], 1))
    except (OSError, ValueError) as exc:
        run.log.warning(f"no summary: {exc}")
        return None
    if summary is not None:
        runfiles.write_summary(run.path, run.masker.mapping(summary))
    return summary
