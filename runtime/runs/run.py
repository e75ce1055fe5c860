"""One run, end to end: run directory, snapshot, hooks, body, outcome.

    from runtime.runs.run import RunSpec, execute, run_task

    @run_task(help={"config": "training config"})
    def pretrain(c, config=DEFAULT, run_options=None):
        cfg = trainer.config.load(config)
        env = envs.resolve(config_env=cfg.env, overrides=run_options.env)
        spec = run_options.spec("train.pretrain", configs={"train.yaml": cfg.to_dict()},
                                config_sources={"train.yaml": config}, env=env)
        result = execute(c, spec, body=lambda run: launch(..., env=run.env, run_dir=run.path))

`run_task` (runtime/runs/options.py, re-exported here for the task modules)
gives every run-creating task the same ``--name``, ``--env KEY=VALUE``
(repeatable), ``--no-hooks`` and ``--patch FILE`` options; the task receives
them as ``run_options`` (a RunOptions), whose spec() makes the RunSpec (also there).

`execute` creates runs/<stamp>_<task>[_<name>]/, writes the snapshot (masked),
runs --patch and the pre hooks (which may extend the env), calls body(run),
runs the post hooks (also after a failure, told the outcome), finishes
metadata.json and returns body's result. On failure it reads the logs for
known signatures (runtime.runs.diagnose) and raises RunFailed (an AnvilError) with
one clear message and the process's exit code.

Replays (runtime.runs.replay) start the task again with names.REPLAY_OF=<old run>:
execute then lays the recorded environment over the resolved one (source
"replay") and links the new run to the old one.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shlex
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Mapping

from invoke.exceptions import Exit, UnexpectedExit

from core import names
from core.host import this_host
from runtime import settings as settings_mod
from runtime.runs.options import PER_NODE_HELP, RUN_OPTION_HELP, RunOptions, RunSpec, patch_file, run_task  # noqa: F401,E501 (re-exported)
from core import signals
from core.errors import AnvilError, UserError
from core.secrets import MASK, Masker


def _lazy(name: str):
    """Import `name` on first attribute access (importlib's LazyLoader recipe).

    Task modules import run_task from here at `inv --list` time; the run
    machinery (importlib.metadata, logging, subprocess, ...) loads only when a
    run is really made, keeping `inv --list` inside its 0.5 s budget.
    """
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    loader = importlib.util.LazyLoader(spec.loader)
    spec.loader = loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    loader.exec_module(module)
    return module


diagnose = _lazy("runtime.runs.diagnose")
hooks_mod = _lazy("runtime.runs.hooks")
ranklog = _lazy("trainer.ranklog")
rundir = _lazy("runtime.runs.rundir")
snapshot = _lazy("runtime.runs.snapshot")
trust = _lazy("runtime.runs.trust")

REPLAY_ENV = names.REPLAY_OF
# Recorded variables that name the machine rather than configure the job: a
# replay keeps this machine's own.
MACHINE_IDENTITY = frozenset({names.HOST})


class Run:
    """A live run directory; what `execute` hands to the body."""

    def __init__(self, path: Path, spec: RunSpec, settings: settings_mod.Settings, env: dict[str, str],
                 sources: dict[str, dict], masker: Masker, metadata: dict):
        self.path = path
        self.spec = spec
        self.settings = settings
        self.env = env                 # full environment for child processes
        self.env_sources = sources     # name -> {value, source, reason, ref, history}
        self.masker = masker
        self.metadata = metadata
        self.env_warnings: list[str] = []
        # What a body that returns normally ended as: "submitted" when the work goes on without
        # us (a Slurm batch job nobody follows; runtime.runs.jobend records its real end).
        self.end_status = "ok"
        self.log = ranklog.setup(path, name="anvil.run", file_name=names.RUNNER_LOG)

    @property
    def config(self) -> Any:
        """The first (primary) config of the run, or None."""
        return next(iter(self.spec.configs.values()), None) if self.spec.configs else None

    def write_text(self, rel: str | Path, text: str) -> Path:
        return self._write(self._inside(rel), self.masker.text(text))

    def write_json(self, rel: str | Path, obj: Any) -> Path:
        return self._write(self._inside(rel), rundir.to_json(self.masker.mapping(obj)))

    def write_record(self, rel: str | Path, obj: dict) -> Path:
        """write_json for a record a later command trusts (rundir.RECORDS): masked, then sealed."""
        return self._write(self._inside(rel), rundir.to_json(rundir.seal_record(self.masker.mapping(obj))))

    def _write(self, target: Path, text: str) -> Path:
        """rundir.write_text; on a full disk, once more with the run's reserve given back, so
        that the run's end is recorded whatever filled the disk."""
        try:
            return rundir.write_text(target, text)
        except OSError as exc:
            if not (rundir.disk_full(exc) and rundir.release_space(self.path)):
                raise
        return rundir.write_text(target, text)

    def update_metadata(self, **entries) -> None:
        self.metadata.update(entries)
        self.write_record(rundir.METADATA, self.metadata)

    def _inside(self, rel: str | Path) -> Path:
        target = (self.path / rel).resolve()
        if not target.is_relative_to(self.path.resolve()):
            raise ValueError(f"{rel}: outside the run directory")
        return target


def _env_layers(env: Any) -> tuple[dict[str, str], dict[str, dict], list[str]]:
    """(values, per-variable records, warnings) from a ResolvedEnv or a plain dict."""
    if env is None:
        return {}, {}, []
    if hasattr(env, "vars") and hasattr(env, "environ"):
        values = {k: str(v) for k, v in env.environ().items()}
        records = {}
        for name, var in env.vars.items():
            if hasattr(var, "to_dict"):
                record = dict(var.to_dict())
                record.pop("name", None)
            else:
                record = {"value": getattr(var, "value", values.get(name)), "source": getattr(var, "source", None),
                          "reason": getattr(var, "reason", None), "ref": getattr(var, "ref", None)}
            records[name] = record
        return values, records, list(getattr(env, "warnings", []) or [])
    if isinstance(env, Mapping):
        values = {str(k): str(v) for k, v in env.items()}
        return values, {k: {"value": v, "source": "task"} for k, v in values.items()}, []
    raise TypeError(f"RunSpec.env must be a ResolvedEnv or a dict, not {type(env).__name__}")


def _replay_layer(replay_of: str) -> tuple[Path | None, dict[str, str], bool]:
    """(the replayed run, its recorded variables to lay over this resolution, whether it is trusted)."""
    try:
        original = rundir.resolve(replay_of)
    except rundir.RunDirError as exc:
        raise UserError(f"replay: {exc}") from None
    try:
        recorded, sealed = rundir.read_sealed(original / names.ENV_RECORD, {})
    except rundir.RunDirError as exc:
        raise UserError(f"replay: {exc}") from None
    recorded = recorded if isinstance(recorded, dict) else {}
    values = {name: str(rec.get("value")) for name, rec in (recorded.get("vars") or {}).items()
              if isinstance(rec, dict) and rec.get("value") not in (None, MASK) and name not in MACHINE_IDENTITY}
    # Trusted: --trust-run; or the replaying inv found the run sealed with this user's key, and env.json
    # still is as read here (runtime.runs.trust).
    given = os.environ.get(trust.TRUST_ENV)
    trusted = given == trust.EXPLICIT or (given == trust.BY_KEY and sealed == trust.YOURS)
    # What could run code is laid over only where the run is trusted (the replaying inv left the same
    # variables out of this process's environment).
    for name in trust.untrusted(values, os.environ, trusted):
        values.pop(name)
    return original, values, trusted


def _leave_out_untrusted(values: dict[str, str], sources: dict[str, dict], warnings: list[str]) -> None:
    """An untrusted replay: the variables that can run code which the run's own input set (its config
    copy's env: block, --env) fall back to what this checkout's profiles say, else are left out."""
    from envs.resolve import INPUT_LAYERS
    for name, earlier in trust.untrusted_layers(sources, values, os.environ, INPUT_LAYERS).items():
        warnings.append(f"replay: left out {name}={values[name]} (from {sources[name].get('source')}: "
                        f"{sources[name].get('ref') or sources[name].get('reason')}): {trust.executes(name)}; "
                        "--trust-run sets it")
        if earlier is None or earlier.get("value") is None:
            values.pop(name)
            sources.pop(name)
        else:
            values[name] = str(earlier["value"])
            sources[name] = {**sources[name], "value": values[name], "source": earlier.get("layer"),
                             "reason": earlier.get("reason"), "ref": earlier.get("ref")}


def _write_snapshot(run: Run, argv: list[str], warnings: list[str]) -> None:
    spec = run.spec
    run.write_text(names.COMMAND, shlex.join(run.masker.argv(argv)) + "\n")
    run.env_warnings = list(warnings)
    run.write_record(names.ENV_RECORD, {"vars": run.env_sources, "warnings": run.env_warnings})
    run.write_json(names.ENVIRON, run.masker.env(dict(os.environ)))
    machine = snapshot.machine()
    run.write_record(names.MACHINE, machine)
    git, diff = snapshot.git_info()
    run.write_record(names.GIT, git)
    if diff:
        run.write_text(names.GIT_DIFF, diff)
    run.write_record(names.VERSIONS, snapshot.versions(git, machine.get("gpu")))
    run.write_text(names.PIP_FREEZE, snapshot.pip_freeze())
    # Each config copy's checksum goes into the sealed metadata: a replay passes the copy on only as written.
    run.metadata["config_sha256"] = {}
    for file_name, config in spec.configs.items():
        copy = _write_config(run, file_name, config)
        run.metadata["config_sha256"][copy.name] = hashlib.sha256(copy.read_bytes()).hexdigest()
    run.metadata["anvil_commit"] = git.get("commit")
    run.metadata["dirty"] = git.get("dirty")


def _write_config(run: Run, file_name: str, config: Any) -> Path:
    rel = Path("configs") / rundir.slug(Path(file_name).name)
    if isinstance(config, (str, Path)):
        source = Path(config)
        try:
            text = source.read_text(encoding="utf-8")
        except OSError as exc:
            raise UserError(f"config {source}: {exc.strerror or exc}") from None
        run.spec.config_sources.setdefault(file_name, str(config))
        return run.write_text(rel, text)
    import yaml  # lazily: keeps `inv --list` lean
    masked = run.masker.mapping(config)
    if rel.suffix == ".json":
        return run.write_text(rel, rundir.to_json(masked))
    return run.write_text(rel, yaml.safe_dump(masked, sort_keys=False, default_flow_style=False))


def _hook_context(run: Run, phase: str, outcome: dict | None = None) -> hooks_mod.HookContext:
    return hooks_mod.HookContext(
        task=run.spec.task, phase=phase, config=run.config, env=run.env, run_dir=run.path,
        host=run.metadata.get("host", ""), rank=int(os.environ.get("RANK", 0) or 0),
        local_rank=int(os.environ.get("LOCAL_RANK", 0) or 0), world_size=run.spec.world_size,
        outcome=outcome, log=run.log, configs=dict(run.spec.configs))


def _record_hooks(run: Run, phase: str, records: list) -> None:
    if not records:
        return
    run.masker.add_env({k: v for rec in records for k, v in rec.env_added.items()})
    lines = []
    for rec in records:
        lines.append(f"== {rec.path} ({'ok' if rec.ok else 'FAILED'})")
        lines.append(rec.output.rstrip())
        for key, value in rec.env_added.items():
            run.env_sources[key] = {"value": value, "source": f"hook:{rec.path.name}",
                                    "reason": f"set by {phase} hook {rec.path}"}
    run.write_text(Path("hooks") / f"{phase}.log", "\n".join(lines) + "\n")
    if any(rec.env_added for rec in records):
        run.write_record(names.ENV_RECORD, {"vars": run.env_sources, "warnings": run.env_warnings})


def _run_pre(run: Run) -> None:
    spec = run.spec
    ctx = _hook_context(run, "pre")
    records: list = []
    try:
        if spec.patch:
            patch = patch_file(spec.patch)   # (gone since the run's options were read: a failed run)
            run.write_text(Path("hooks") / f"patch_{patch.name}", patch.read_text(errors="replace"))
            records.append(hooks_mod.run_file(patch.resolve(), ctx, cwd=run.settings.root,
                                              timeout=run.settings.hook_timeout))
        records += hooks_mod.run_phase(run.settings.hooks_dir, ctx, cwd=run.settings.root,
                                       timeout=run.settings.hook_timeout)
    except hooks_mod.HookError as exc:
        phase_records = getattr(exc, "records", None)
        if phase_records is None:   # the patch (or the hook folder itself) failed
            phase_records = [hooks_mod.HookRecord(exc.path, "pre", False, exc.output + exc.detail, {})]
        _record_hooks(run, "pre", records + phase_records)
        raise
    _record_hooks(run, "pre", records)


def _run_post(run: Run, outcome: dict) -> AnvilError | None:
    """Post hooks, all of them; returns the first failure (or None)."""
    ctx = _hook_context(run, "post", outcome)
    try:
        records = hooks_mod.run_phase(run.settings.hooks_dir, ctx, cwd=run.settings.root, keep_going=True,
                                      timeout=run.settings.hook_timeout)
    except hooks_mod.HookError as exc:
        _record_hooks(run, "post", getattr(exc, "records", []))
        return exc
    _record_hooks(run, "post", records)
    return None


def _exit_code(exc: BaseException) -> int:
    if isinstance(exc, AnvilError):
        return exc.exit_code
    if isinstance(exc, Exit):
        return exc.code or 1
    if isinstance(exc, UnexpectedExit):
        return exc.result.exited or 1
    if isinstance(exc, KeyboardInterrupt):   # Ctrl-C, or a stop signal (core.signals.Interrupt)
        return getattr(exc, "exit_code", 130)
    if isinstance(exc, SystemExit):
        return exc.code if isinstance(exc.code, int) and exc.code else 1
    return getattr(exc, "exit_code", None) or 1


def ended_by(exc: BaseException) -> tuple[str, str, int]:
    """(status, error, exit code) of a run that `exc` ended."""
    status = getattr(exc, "status", None) or ("interrupted" if isinstance(exc, KeyboardInterrupt) else "failed")
    return status, _error_text(exc), _exit_code(exc)


def _error_text(exc: BaseException) -> str:
    if isinstance(exc, AnvilError):
        return str(exc) or type(exc).__name__
    if isinstance(exc, Exit):
        return exc.message or f"exit status {exc.code}"
    if isinstance(exc, UnexpectedExit):
        return f"command failed with exit status {exc.result.exited}: {exc.result.command}"
    if isinstance(exc, KeyboardInterrupt):
        # "bench.gemm interrupted (Ctrl-C)", as the trainer words it; "... (SIGTERM)" for a stop signal
        return getattr(exc, "said", "interrupted (Ctrl-C)")
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def create(ctx, spec: RunSpec) -> Run:
    """Make the run directory and write the snapshot (no hooks, no body)."""
    try:
        settings = settings_mod.load(ctx)
    except settings_mod.SettingsError as exc:
        raise UserError(f"invoke.yaml: {exc}") from None
    argv = list(spec.argv if spec.argv is not None else sys.argv)
    host = this_host()
    values, sources, warnings = _env_layers(spec.env)
    replay_of = os.environ.get(REPLAY_ENV)
    original = None
    if replay_of:
        original, recorded, trusted = _replay_layer(replay_of)
        if not trusted:
            _leave_out_untrusted(values, sources, warnings)
        for name, value in recorded.items():
            values[name] = value
            sources[name] = {**sources.get(name, {}), "value": value, "source": f"replay:{original.name}",
                             "reason": "recorded in the replayed run"}
    masker = Masker.from_environ(values)
    try:
        path = rundir.create(settings.runs_dir, spec.task, spec.name)
    except OSError as exc:
        raise UserError(f"cannot create a run directory under {settings.runs_dir}: {exc.strerror or exc}") from None
    started = time.time()
    metadata = {
        "task": spec.task, "name": spec.name, "status": "running",
        "start": datetime.fromtimestamp(started).astimezone().isoformat(timespec="seconds"),
        "start_ts": started, "end": None, "duration_s": None,
        "host": host, "hosts": [host], "world_size": spec.world_size,
        "argv": masker.argv(argv), "cwd": os.getcwd(), "project_root": str(settings.root),
        "configs": sorted(spec.configs), "config_sources": dict(spec.config_sources),
        "config_options": dict(spec.config_options),
        "replay_of": str(original) if original else None, "pid": os.getpid(),
        **spec.extra,
    }
    run = Run(path, spec, settings, {**os.environ, **values}, sources, masker, metadata)
    run.update_metadata()
    rundir.reserve_space(path)
    try:
        if original is not None:
            try:
                (path / "replay_of").symlink_to(original)
            except OSError:
                pass  # file systems without symlinks: metadata.json has replay_of anyway
        _write_snapshot(run, argv, warnings)
        run.metadata["config_sources"] = dict(spec.config_sources)
        run.update_metadata()
    except BaseException as exc:   # Ctrl-C while the snapshot is written: not "running" for ever
        status, error, code = ended_by(exc)
        finish(run, status, error=error, exit_code=code)
        if isinstance(exc, KeyboardInterrupt):   # (a stop signal too): said as execute says it
            raise _failed(run, status, error, code) from None
        raise
    run.log.info("run directory %s", path)
    return run


def end_entries(metadata: dict, status: str, error: str | None, exit_code: int, masker: Masker,
                diagnosis: list | None = None, ended: float | None = None) -> dict:
    """The metadata.json entries a run's end writes (here and in runtime.runs.jobend); `ended`
    (epoch seconds) when the end was earlier than now."""
    ended = time.time() if ended is None else ended
    return dict(status=status, error=masker.text(error) if error else None, exit_code=exit_code,
                end=datetime.fromtimestamp(ended).astimezone().isoformat(timespec="seconds"),
                duration_s=round(ended - metadata["start_ts"], 3),
                diagnosis=[{"problem": f.signature, "advice": f.advice, "source": f.source, "line": f.line}
                           for f in diagnosis or []])


def finish(run: Run, status: str, error: str | None = None, exit_code: int = 0, result: Any = None,
           diagnosis: list | None = None) -> None:
    """Record the run's end; a second Ctrl-C or stop signal waits until it is written (then raised)."""
    with signals.deferred():
        if result is not None:
            run.write_json(names.RESULT, result)
        run.update_metadata(**end_entries(run.metadata, status, error, exit_code, run.masker, diagnosis))
        rundir.release_space(run.path)


def execute(ctx, spec: RunSpec, body: Callable[[Run], Any]) -> Any:
    """Create the run, run hooks and body, record the outcome; see the module doc."""
    run = create(ctx, spec)
    result, failure = None, None
    try:
        if spec.hooks:
            _run_pre(run)
        result = body(run)
    except BaseException as exc:  # noqa: BLE001 - recorded, post hooks told, then re-raised as RunFailed
        failure = exc
    # Post hooks run also after a failed pre hook, told what the run will record (a Ctrl-C: interrupted).
    status, error, code = ended_by(failure) if failure is not None else (run.end_status, None, 0)
    post_error = _run_post(run, {"status": status, "error": error}) if spec.hooks else None

    if failure is None and post_error is None:
        finish(run, run.end_status, result=result)
        return result

    if failure is not None:
        if post_error:
            error += f"\n(also: {post_error})"
    else:
        status, error, code = "failed", str(post_error), post_error.exit_code
    findings = diagnose.scan(diagnose.log_files(run.path), extra_text=error)
    finish(run, status, error=error, exit_code=code, result=result, diagnosis=findings)
    raise _failed(run, status, error, code, findings)


def _failed(run: Run, status: str, error: str, code: int, findings: list = ()) -> "RunFailed":
    """The RunFailed of a run that ended `status`: the task, the cause, the run directory, known problems."""
    said = run.masker.text(error)
    # "train.pretrain interrupted (Ctrl-C) ...", not "train.pretrain interrupted: interrupted (Ctrl-C) ..."
    head = f"{run.spec.task} {said}" if said.startswith(status + " ") else f"{run.spec.task} {status}: {said}"
    message = [head, f"run directory: {run.path}"]
    for finding in findings:
        message.append(f"known problem [{finding.signature}]: {finding.advice}")
    return RunFailed("\n".join(message), code, status)


class RunFailed(AnvilError):
    """A run that did not end ok: the message names the task, the cause and the run directory."""

    def __init__(self, message: str, exit_code: int, status: str):
        super().__init__(message, exit_code)
        self.status = status
