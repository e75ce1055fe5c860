"""A training job through the runner: config, environment, run directory, launch.

train.pretrain and profile.train both start the trainer this way; profile.train
only adds the variables that open trainer.profiling's window (and, with --tool, a
vendor profiler around the chosen ranks: runtime.launch.tools), and summarises
the profile inside the run (`after`). --tune-gemm adds the environment's tuning
layer (TunableOp, its results file kept per key) and records that file with the
run (runtime.jobs.tuning).

    result = run_training(c, "train.pretrain", TrainingJob(config="configs/tiny.yaml"), run_options)
    result["run_dir"], result["summary"]

1. Load and validate the config (--set overrides, then the task's flags:
   TrainingJob.overrides); check its data, the runtime and the launch - all
   before a run directory exists.
2. Resolve the environment: profiles, the config's env: block, --env.
3. runtime.runs.run.execute: run directory, snapshot (the config as used, once:
   RUN/configs/train.yaml, which the ranks read and a replay reads back), hooks;
   the body launches `python -m trainer` through the runtime's transport
   (runtime.cluster: direct, one agent here; ssh, one per host; slurm, one per
   node of the allocation, or an sbatch job that is followed; any of them in a
   container).
4. The agents' reports give the hosts, the world size, and on failure the
   first failing rank with its own error line.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from core import names, runfiles
from runtime.cluster.runtime import Runtime
from runtime.launch.spec import EXIT_INTERRUPTED, EXIT_REQUEUE, RUN_DIR
from core.errors import AnvilError, UserError
from core.signals import exit_status

#: Where a run keeps the config as used (written once by its snapshot; the ranks and a replay read it).
CONFIG_FILE = names.TRAIN_CONFIG


class JobStopped(AnvilError):
    """The job ended early but cleanly (preempted or interrupted); `status` says which."""

    def __init__(self, message: str, exit_code: int, status: str):
        super().__init__(message, exit_code)
        self.status = status


@dataclass
class Placement:
    """Where and as what a training launch runs: what train.pretrain and train.launch take alike."""
    nproc: int = 0                      # 0 = one per visible GPU, one on CPU
    resume: str | None = None           # None (not given), "auto", or a run / checkpoint path
    gpu: str = ""
    site: str = ""
    runtime: Runtime | None = None      # None = the anvil.runtime setting
    hosts: str | None = None            # ssh: the hosts to train across (-H, --hosts; "@" = anvil.hosts); None: none
    master: str = ""                    # ssh: the host of node rank 0 ("" = the first)
    nodes: int = 0                      # slurm: 0 = the allocation's, or 1
    partition: str = ""
    account: str = ""
    time: str = ""
    wait: bool = True                   # sbatch: follow the job
    exclude: list[str] = field(default_factory=list)
    exclude_from: str = ""              # a preflight run whose failing nodes are left out
    dry_run: bool = False


@dataclass
class TrainingJob(Placement):
    config: str | None = None           # None = configs/tiny.yaml
    sets: list[str] = field(default_factory=list)
    compile: bool = False
    kernels: bool = False
    init_from: str | None = None        # a Hugging Face directory to start from (checkpoint.init_from)
    force: bool = False                 # launch what the memory plan says cannot fit
    ranks_used: frozenset[int] = frozenset()   # global ranks the task needs (profile.train --ranks)
    tool: str = ""                      # profile.train --tool: the vendor profiler the chosen ranks run under
    tune_gemm: bool = False             # TunableOp on, its results kept per GPU model, torch and CUDA/ROCm build

    def overrides(self) -> list[str]:
        """The config overrides: the --set ones, then what the task's flags mean (trainer.flags)."""
        from trainer import flags

        return flags.overrides(self.sets, compile=self.compile, kernels=self.kernels, init_from=self.init_from)


def previous_checkpoint(runs_dir: Path, name: str, task: str = "train.pretrain", find=None) -> str | None:
    """--resume auto: the newest complete checkpoint among earlier runs of `task` with this name
    (`find(run_dir)`: a run's newest checkpoint, or None; the trainer's by default).

    A host of an `inv -H` fan-out keeps its runs in FANOUT/hosts/<host>/, a new fan-out run each
    time: its earlier runs are in the other fan-outs' hosts/<host>/ folders beside it."""
    if find is None:
        from trainer.checkpoint import find_latest as find
    runs_dir = Path(runs_dir)
    pattern = f"*_{task}_{name}"
    candidates = list(runs_dir.glob(pattern))
    if runs_dir.parent.name == "hosts":
        candidates += runs_dir.parent.parent.parent.glob(f"*/hosts/{runs_dir.name}/{pattern}")
    for run_dir in sorted(set(candidates), key=lambda p: p.name, reverse=True):   # names start with the time
        found = find(run_dir)
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
        from trainer.fp8_rules import NEEDS_GPU
        raise UserError(f"{NEEDS_GPU}; this machine has none. Set precision.fp8=off")
    if (not machine.has_gpu or cfg.train.device == "cpu") and cfg.train.attention == "flex":
        raise UserError("train.attention flex needs a GPU: torch's FlexAttention has no backward on the CPU; "
                        "set train.attention=sdpa (or auto: SDPA with a mask on the CPU)")


def where(job: TrainingJob, settings, mounts: list[str] = ()):
    """(runtime, transport) of this job: its runtime (ssh when hosts are named) opened with the task's
    options over the settings'; `mounts` (the dataset) go into a container beside container_mounts."""
    from runtime.cluster.ssh import parse_hosts

    runtime = job.runtime or settings.runtime
    hosts: list[str] = []
    if job.hosts is not None and not job.hosts.strip():   # --hosts '': a mistake, not "train here"
        raise UserError("--hosts is empty: name the hosts (--hosts node1,node2, or @ for anvil.hosts); leave it "
                        "out to train here")
    if job.hosts:
        if job.runtime is not None and job.runtime.transport != "ssh":
            raise UserError(f"--runtime {job.runtime} with -H {job.hosts}: -H names the hosts to train on over SSH; "
                            "give one or the other")
        hosts = parse_hosts(job.hosts, settings.hosts)
        runtime = runtime.over("ssh")     # a shared anvil.runtime's container is kept
    if job.nproc < 0:
        raise UserError(f"--nproc {job.nproc}: expected 1 or more (0 = one per visible GPU)")
    if job.nodes < 0:
        raise UserError(f"--nodes {job.nodes}: expected 1 or more")
    if (job.nodes or job.partition or job.account or job.time or not job.wait) and not runtime.scheduler:
        raise UserError("--nodes, --partition, --account, --time and --no-wait need --runtime slurm "
                        f"(runtime is {runtime})")
    if job.master and runtime.transport != "ssh":
        raise UserError(f"--master names the SSH host of node rank 0: it needs -H (runtime is {runtime})")
    slurm = replace(settings.slurm_options(), partition=job.partition or settings.slurm_partition,
                    account=job.account or settings.slurm_account, time=job.time or settings.slurm_time,
                    wait=job.wait)
    container = settings.container_options()
    container.mounts += list(mounts)
    options = settings.cluster_options(nodes=job.nodes, master=job.master, exclude=list(job.exclude), slurm=slurm,
                                       container=container, **({"hosts": hosts} if hosts else {}))
    return runtime, runtime.open(options)


def _check_tool(tool: str, machine, here: bool) -> None:
    """--tool: a profiler for this machine's GPUs, installed here when the ranks run here (one line if not)."""
    from runtime.launch import tools

    spec = tools.TOOLS[tool]
    if machine.has_gpu and spec.vendor is not machine.vendor:
        raise UserError(f"--tool {tool} profiles {spec.vendor.platform.upper()} GPUs; this machine's are "
                        f"{machine.platform.upper()} "
                        f"({', '.join(n for n, t in tools.TOOLS.items() if t.vendor is machine.vendor)} instead)")
    absent = tools.missing(tool) if here else None
    if absent:
        raise UserError(absent)


def _stopped_before_the_first_step(run_dir: Path, code: int, report) -> str | None:
    """What ended a launch before the trainer's loop (so before any checkpoint or summary.json), as
    "SIGTERM", or None: the ranks stopped on a signal (3 or 130: the agent's status for ranks the
    signal ended before their handler was in place) and wrote no summary, or an agent the signal
    ended while it started (128+N, no agent report)."""
    import signal

    from core.signals import STOP_SIGNALS, signal_name

    if (run_dir / names.SUMMARY).is_file():
        return None
    if code in (EXIT_REQUEUE, EXIT_INTERRUPTED):
        signals = [n.signal for n in report.nodes if n.signal]
        return signal_name(getattr(signal, signals[0])) if signals and hasattr(signal, signals[0]) else "a stop signal"
    if code - 128 in STOP_SIGNALS and not report.nodes:
        return signal_name(code - 128)
    return None


def exclusions(job: Placement) -> tuple[dict[str, list[str]], list[str]]:
    """--exclude-from RUN: ({node: reasons} of its failing nodes, added to job.exclude), and the flags given
    that leave nodes out (for the note when the runtime has none to leave out)."""
    from runtime.runs import nodes as nodes_mod

    excluded: dict[str, list[str]] = {}
    leaving_out = [flag for flag, given in (("--exclude-from", job.exclude_from), ("--exclude", job.exclude)) if given]
    if job.exclude_from:
        excluded = nodes_mod.failing(job.exclude_from)
        job.exclude = sorted(set(job.exclude) | set(excluded))
    return excluded, leaving_out


def kept_local(leaving_out: list[str], runtime: Runtime) -> bool:
    """Whether --exclude/--exclude-from apply: a note, and False, where the runtime runs on this machine only."""
    if leaving_out and not runtime.spans_nodes:   # no node of this machine to leave out
        print(f"note: {' and '.join(leaving_out)} ignored: runtime {runtime} runs on this machine only (it leaves "
              "nodes out of an ssh or slurm launch)", file=sys.stderr)
        return False
    return True


def _restarts(cfg, runtime: Runtime, transport, environ):
    """The in-job restarts of a training launch (runtime.jobs.restarts), or None where none can be: a
    batch job (Slurm requeues it) or health.max_restarts 0."""
    from runtime.jobs.restarts import Restarts, launch_nodes

    nodes = launch_nodes(transport, environ) if cfg.health.max_restarts else None
    return Restarts.of(cfg, nodes) if nodes is not None else None


def _held_back(spares: int, runtime: Runtime, layout, restarts):
    """The layout without health.spares nodes (the last ones), which wait for a node that fails."""
    from runtime.launch.spec import Layout

    if restarts is None:
        raise UserError(f"health.spares={spares}: spares take the place of a node that failed when inv restarts "
                        "the ranks: set health.max_restarts above 0, and launch where inv runs the launch (-H "
                        "hosts, or an srun step inside an allocation; a batch job's nodes are Slurm's)")
    if not runtime.spans_nodes:
        raise UserError(f"health.spares={spares}: spare nodes need a launch over several (-H hosts, or Slurm's "
                        f"nodes); runtime {runtime} runs on this machine only")
    if layout.nodes <= spares:
        raise UserError(f"health.spares={spares}: the launch has {layout.nodes} node(s); at least one more than "
                        "the spares must train")
    return Layout(layout.nproc, layout.nodes - spares)


def launch_job(run, transport, spec, job: Placement, excluded: dict[str, list[str]], layout, stopped,
               around=None, env: dict[str, str] | None = None, restarts=None) -> dict | None:
    """A training run's launch and how it ended, for train.pretrain's body and train.launch's: the
    excluded nodes recorded, the ranks launched through the transport (`around(run)`: a context the
    launch runs in; `env`: the ranks' environment, default run.env), a batch job followed (or
    submitted: its {"run_dir", "summary": None, "slurm_job_id"} returned), the hosts and world size
    recorded. None once every rank finished; `stopped(code, report)` raises the JobStopped of a stop
    (3, 130, or a stop signal before any agent reported); a rank that failed is an AnvilError naming it,
    unless `restarts` (runtime.jobs.restarts.Restarts) starts the ranks again from a checkpoint."""
    from core.signals import STOP_SIGNALS, killed_outright
    from runtime.cluster.slurm.batch import submitted_job_id
    from runtime.runs import gpuhealth, outcome
    from runtime.runs.replay import resume_command

    if excluded:
        run.update_metadata(excluded_nodes=excluded)
        print(f"excluding {len(excluded)} node(s) that failed preflight in {job.exclude_from}: "
              + ", ".join(f"{h} ({'; '.join(r)[:80]})" for h, r in sorted(excluded.items())), file=sys.stderr)
    while True:
        attempt_started = time.time()
        launched = _launched(transport, spec, run.env if env is None else env, layout, restarts)
        code = _launch_once(run, transport, spec, around, env, restarts)
        job_id = submitted_job_id(run.path)
        if restarts is None or job_id or code == 0:
            break
        report = outcome.read(run.path)
        if code in (EXIT_REQUEUE, EXIT_INTERRUPTED) or code - 128 in STOP_SIGNALS \
                or report.stop_status() in (EXIT_REQUEUE, EXIT_INTERRUPTED):
            break
        record = restarts.after_failure(run.path, code, report, _resume_of(spec), attempt_started,
                                        outcome.failure_summary(run.path, layout.nodes, *launched))
        if record is None:
            break
        run.update_metadata(restarts=restarts.done, **({"left_out": restarts.left_out} if restarts.left_out
                                                        else {}))
        run.log.warning(restarts.line(record))
        spec = restarts.restart_spec(spec)
    if job_id:
        run.update_metadata(slurm_job_id=job_id)
    failed_nodes = outcome.node_failures(run.path)
    if failed_nodes:
        run.update_metadata(node_failures=failed_nodes)
        print(f"slurm: node(s) {', '.join(failed_nodes)} failed during the job (srun: Node failure); "
              + ("Slurm requeued it" if job_id else "its ranks were ended"), file=sys.stderr)
    if job_id and not job.wait:
        # The job runs later, without us: its batch script records the end (runtime.runs.jobend).
        run.end_status = "submitted"
        print(f"the run's status is in {run.path}/metadata.json (`inv snapshot.show {run.path}`); "
              f"`squeue -j {job_id}` shows the job", file=sys.stderr)
        return {"run_dir": run.path, "summary": None, "slurm_job_id": job_id}
    report = outcome.read(run.path)
    if code == 0:
        code = report.stop_status()   # a clean stop under srun exits 0 (runtime.cluster.slurm.step)
    if report.nodes:
        run.update_metadata(hosts=report.hosts, world_size=report.world_size, nodes=len(report.nodes))
    gpuhealth.record(run, restarts.left_out if restarts is not None else [])   # the GPUs in trouble, the hosts
    if code in (EXIT_REQUEUE, EXIT_INTERRUPTED) or (code - 128 in STOP_SIGNALS and not report.nodes):
        stopped(code, report)
    if code != 0:
        cause = outcome.failure_summary(run.path, layout.nodes, *launched)
        first = report.first_failure()
        if first is not None and killed_outright(first.get("exit_code")):
            code = 137   # 128 + SIGKILL: the rank the line names, though a peer's node ended first
        after = f" after {len(restarts.done)} restart(s)" if restarts is not None and restarts.done else ""
        why_not = f"; not restarted: {restarts.why_not}" if restarts is not None and restarts.why_not else ""
        raise AnvilError((cause or f"the ranks exited with status {code}; see {run.path}/logs/") + after + why_not,
                         code)
    return None


def _launch_once(run, transport, spec, around, env, restarts) -> int:
    """One attempt of a launch: its exit status."""
    from contextlib import nullcontext

    from runtime.cluster.slurm.batch import FollowStopped
    from runtime.runs.replay import resume_command

    nodes = restarts.active() if restarts is not None else None
    try:
        with around(run) if around is not None else nullcontext():
            return transport.launch(spec, run.env if env is None else env, run.path, masker=run.masker,
                                    stdout=sys.stderr, **({"nodes": nodes} if nodes else {}))   # stdout: the result
    except FollowStopped as exc:   # a batch job cancelled while followed: how to continue it, where it ran
        if exc.status != "cancelled":
            raise
        raise FollowStopped(f"{exc}; continue where it ran with `{resume_command(run.metadata, run.path)}`",
                            exc.status, exc.exit_code) from None


def _launched(transport, spec, env, layout, restarts) -> tuple[list[str], int]:
    """(the nodes an attempt runs on, in node-rank order, and its ranks per node), to name a node that
    leaves no report; ([], 0) where Slurm chooses them (a part of an allocation, a batch job)."""
    from runtime.jobs.restarts import launch_nodes

    active = restarts.active() if restarts is not None else None
    if active:
        return list(active), layout.nproc
    nodes = launch_nodes(transport, env) or []
    return (list(nodes), layout.nproc) if len(nodes) == layout.nodes else ([], 0)


def _resume_of(spec) -> str | None:
    """The checkpoint path the trainer's --resume names, if it names one (not auto)."""
    from runtime.backends.base import option_value

    value = option_value(list(spec.args), "--resume")
    return value if value not in (None, "", "auto") else None


def run_training(c, task_name: str, job: TrainingJob, run_options, extra_env: list[str] = (), after=None) -> dict:
    """Train as `job` says; returns {"run_dir": Path, "summary": dict | None}, and with `after` (called with
    the run once the launch succeeded) what it returned, under "after"."""
    import envs
    from runtime import settings as settings_mod
    from runtime.jobs import planning, tuning
    from runtime.jobs.environment import print_warnings
    from runtime.launch import LaunchSpec
    from runtime.runs.replay import resume_command
    from runtime.runs.run import execute
    from trainer import hf
    from trainer.config import DEFAULT_CONFIG, check_world, dump
    from trainer.data.check import check_data

    if job.config is not None and not str(job.config).strip():
        raise UserError("--config is empty; expected a YAML config such as configs/tiny.yaml")
    if job.resume is not None and not job.resume.strip():
        raise UserError("--resume is empty; expected auto or a run directory or checkpoint path")
    cfg = hf.load_config(job.config or None, job.overrides())   # with init_from, the model shape is its config.json's
    check_data(cfg)
    started_from = hf.check_before_launch(cfg)       # its tensors' names and shapes, from the headers
    config_path = job.config or str(DEFAULT_CONFIG)
    env = envs.resolve(gpu=job.gpu or None, site=job.site or None, config_env=cfg.env,
                       overrides=list(run_options.env) + list(extra_env), config_ref=f"{config_path} (env:)",
                       tune_gemm=job.tune_gemm)
    warnings = list(env.warnings) + [w for w in [hf.tokenizer_warning(cfg)] if w]
    if cfg.schedule.warmup_steps >= cfg.train.steps and task_name == "train.pretrain":   # (a profile is short)
        warnings.append(f"schedule.warmup_steps={cfg.schedule.warmup_steps} >= train.steps={cfg.train.steps}: "
                        "the learning rate never leaves warmup")
    print_warnings(warnings)   # stderr: stdout stays the result (--json)
    settings = settings_mod.load(c)
    excluded, leaving_out = exclusions(job)
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

    # Where it runs, and the launch, checked before a run directory exists (a bad runtime, --nproc,
    # --nodes, host or image). A container sees the checkout and the run directory; the datasets and
    # an init_from directory may live elsewhere.
    data_mounts = [str(Path(path).resolve()) for path in cfg.data.datasets()]
    data_mounts += [cfg.checkpoint.init_from] if cfg.checkpoint.init_from else []
    runtime, transport = where(job, settings, data_mounts)
    if not kept_local(leaving_out, runtime):
        excluded = {}
    environ = {**os.environ, **env.environ()}
    if transport.requeues(environ) and not resume:
        resume = "auto"   # a batch job that Slurm requeues resumes from its own run directory
    # The trainer gets the folder of what auto found: its newest intact checkpoint, so that a damaged one
    # (seen only once the ranks read its bytes) gives way to the one before it; a named step_N does not.
    trainer_resume = str(Path(resume).parent) if job.resume == "auto" and resume != "auto" else resume
    spec = LaunchSpec(module="trainer", args=["--config", f"{RUN_DIR}/configs/{CONFIG_FILE}", "--run-dir", RUN_DIR,
                                              *(["--resume", trainer_resume] if resume else [])],
                      nproc=job.nproc or None, gpus=env.machine.count, vendor=env.machine.vendor,
                      node_local=env.node_local(), profile=list(env.environ()))
    if not runtime.spans_nodes:   # (a login node has no GPU; its nodes do)
        _needs_a_gpu_here(cfg, env.machine)
    if job.tool:
        _check_tool(job.tool, env.machine, here=not runtime.spans_nodes and not job.dry_run)
    layout = transport.layout(spec, environ)
    restarts = _restarts(cfg, runtime, transport, environ)
    if cfg.health.spares:
        layout = _held_back(cfg.health.spares, runtime, layout, restarts)
    check_world(cfg, layout.world_size, config_path)
    if job.ranks_used and max(job.ranks_used) >= layout.world_size:
        raise UserError(f"--ranks {','.join(map(str, sorted(job.ranks_used)))}: this job has {layout.world_size} "
                        f"rank(s), 0..{layout.world_size - 1}")
    if not job.dry_run:
        transport.check(os.environ)   # Slurm's commands are there and its controller answers; hosts answer
    too_big = planning.fit(cfg, env, layout.nproc, layout.nodes, on_this_machine=not runtime.spans_nodes)
    if too_big and too_big.certain and not (job.force or job.dry_run):
        forced = "--force launches it anyway" if task_name == "train.pretrain" else \
            "`inv train.pretrain --force` launches it anyway"
        raise UserError(f"{too_big.message}; {forced}")
    # a training run's own speed (a profile's steps run under the profiler: not what was predicted)
    predicted = planning.predicted(cfg, env, layout.nproc, layout.nodes, settings.runs_dir) \
        if task_name == "train.pretrain" else None
    if too_big:
        print_warnings([too_big.message + ("; a launch is refused without --force"
                                           if too_big.certain and job.dry_run else "")])
    if job.dry_run:
        print(dump(cfg))
        active = restarts.active() if restarts is not None else None
        transport.launch(spec, environ, run_dir=Path("RUN_DIR"), dry_run=True, **({"nodes": active} if active else {}))
        return {"run_dir": None, "summary": None, "dry_run": True}

    def body(run):
        if predicted:
            run.update_metadata(prediction=predicted)
        if started_from:
            run.update_metadata(init_from=started_from)
            run.log.info(f"started from {started_from['path']}: its weights; the optimizer and the step count start "
                         "fresh" if resume in ("", "auto") else f"resumes from {resume}: its checkpoint's weights, not "
                         f"those of {started_from['path']} (checkpoint.init_from)")
        def stopped(code, report):
            early = _stopped_before_the_first_step(run.path, code, report)
            if early is not None:   # exit 3 (requeue me) or 130, as the trainer's after a checkpoint
                raise JobStopped(f"interrupted ({early}) before the first step: nothing to checkpoint; the same "
                                 "command starts it again", code if code in (EXIT_REQUEUE, EXIT_INTERRUPTED)
                                 else exit_status(code - 128, training=True), "interrupted")
            if code == EXIT_REQUEUE:
                raise JobStopped(f"stopped on a signal after checkpointing; continue where it ran with "
                                 f"`{resume_command(run.metadata, run.path)}`", EXIT_REQUEUE, "preempted")
            if code == EXIT_INTERRUPTED:
                raise JobStopped(f"interrupted (Ctrl-C) after checkpointing; continue where it ran with "
                                 f"`{resume_command(run.metadata, run.path)}`", EXIT_INTERRUPTED, "interrupted")

        # --tune-gemm: which TunableOp results file, before and after, kept with the run
        submitted = launch_job(run, transport, spec, job, excluded, layout, stopped, around=tuning.kept,
                               restarts=restarts)
        if submitted is not None:
            return submitted
        summary = runfiles.read_summary(run.path) if (run.path / names.SUMMARY).is_file() else None
        if predicted and summary:
            compared = planning.compared(predicted, summary)
            line = compared.pop("line", None)
            run.update_metadata(prediction=compared)
            if line:
                print(line, file=sys.stderr)
        return {"run_dir": run.path, "summary": summary, **({"after": after(run)} if after else {})}

    spec_of_run = run_options.spec(task_name, name=name, configs={CONFIG_FILE: cfg.to_dict()},
                                   config_sources={CONFIG_FILE: config_path},
                                   # a replay passes the recorded copy, even when the run used the default
                                   config_options={CONFIG_FILE: "--config"},
                                   env=env, world_size=layout.world_size,
                                   extra={"resume": resume or None, "runtime": str(runtime)})
    return execute(c, spec_of_run, body)
