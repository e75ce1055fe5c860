"""--backend torchtitan: `python -m torchtitan.train` with its config, overrides passed through.

    inv train.launch --backend torchtitan --config debug_model.toml -- --training.steps 50
    inv train.launch --backend torchtitan --config llama3:llama3_debugmodel     # torchtitan's Python configs

A .toml config is `--job.config_file FILE` (torchtitan 0.2) and is kept with the run (RUN/configs/); MODULE:NAME
is `--module MODULE --config NAME` (the config registry of torchtitan after 0.2). The run directory is its
dump folder (--job.dump_folder RUN, unless the overrides name one), so its checkpoints are in
RUN/checkpoint/step-N (a complete one has .metadata) and its TensorBoard files beside them; checkpointing is on
(--checkpoint.enable). A requeued job finds its own checkpoints there and torchtitan loads the newest
itself; `--resume RUN` starts from RUN's newest (--checkpoint.initial_load_path, the whole training state).

Preemption: torchtitan 0.2 has no signal handler, so SIGTERM ends it where it is; the requeued job goes on
from the last periodic checkpoint (checkpoint.interval), which the launch says beforehand.

Its metric lines (torchtitan/components/metrics.py, MetricsProcessor.log), on rank 0:

    [titan] 2025-06-01 10:00:00,000 - root - INFO - step:  1  loss: 12.25000  grad_norm:  3.1172  memory:  1.20GiB(1.52%)  tps: 2,405  tflops: 0.17  mfu: 0.02%
    [titan] ... - root - INFO - validate step: 10  loss:  9.8125  memory:  1.20GiB(1.52%)  tps: 8,000

tps is per device: tokens_per_s is tps x the world size.
"""
from __future__ import annotations

import re
import signal
from pathlib import Path

from runtime.backends.base import (UNREADABLE, Backend, BackendError, Checkpoint, Options, Plan, number, option_value,
                                   plain, train_record)

MODULE = "torchtitan.train"
CONFIG_FILE = "torchtitan.toml"          # the config's copy in RUN/configs/
_STEP = re.compile(r"(?<![A-Za-z_])(validate )?step:\s*(\d+)\s+loss:\s*(\S+)")
_FIELD = re.compile(r"(grad_norm|memory|tps|tflops|mfu):\s*([0-9.,eE+-]+(?:GiB)?%?)")
_CHECKPOINT = re.compile(r"^step-(\d+)$")


class Torchtitan(Backend):
    name = "torchtitan"
    summary = "torchtitan's train.py with --config FILE.toml (or MODULE:NAME), overrides after --"
    stop_signal = signal.SIGTERM
    on_signal = ("torchtitan saves no checkpoint on a signal: the requeued run goes on from its last periodic "
                 "checkpoint (--checkpoint.interval)")

    def plan(self, argv: list[str], options: Options) -> Plan:
        config = options.config.strip()
        if not config:
            raise BackendError("--backend torchtitan needs --config: its TOML file (torchtitan 0.2: "
                               "torchtitan/models/llama3/train_configs/debug_model.toml) or MODULE:NAME")
        if config.endswith(".toml"):
            path = Path(config).expanduser()
            path = path if path.is_absolute() else options.cwd / path
            if not path.is_file():
                raise BackendError(f"--config {config}: no such file")
            _check_toml(path)
            return Plan(["-m", MODULE, "--job.config_file", str(path.resolve()), *argv],
                        configs={CONFIG_FILE: path.resolve()}, config_option="--config",
                        mounts=[str(path.resolve().parent)], notes=[self.on_signal])
        module, colon, name = config.partition(":")
        if not colon or not module or not name:
            raise BackendError(f"--config {config}: expected a .toml file or MODULE:NAME (llama3:llama3_debugmodel)")
        return Plan(["-m", MODULE, "--module", module, "--config", name, *argv], notes=[self.on_signal])

    def checkpoint_dir(self, argv: list[str], run_dir: Path) -> Path:
        dump = option_value(argv, "--job.dump_folder") or str(run_dir)
        return Path(dump) / (option_value(argv, "--checkpoint.folder") or "checkpoint")

    def command(self, argv: list[str], run_dir: Path, resume: Checkpoint | None) -> list[str]:
        out = list(argv)
        if option_value(argv, "--job.dump_folder") is None:
            out += ["--job.dump_folder", str(run_dir)]
        if "--checkpoint.enable" not in argv:
            out.append("--checkpoint.enable")
        own = self.checkpoint_dir(out, run_dir)
        if resume is not None and Path(resume.path).parent != own:   # its own it finds itself
            out += ["--checkpoint.initial_load_path", str(resume.path), "--checkpoint.no_initial_load_model_only"]
        return out

    def latest(self, folder: Path) -> Checkpoint | None:
        try:
            found = [(int(m.group(1)), p) for p in Path(folder).iterdir()
                     if (m := _CHECKPOINT.match(p.name)) and (p / ".metadata").is_file()]
        except OSError:
            return None
        if not found:
            return None
        step, path = max(found, key=lambda e: e[0])
        return Checkpoint(path, step)

    def at(self, path: Path) -> Checkpoint | None:
        found = _CHECKPOINT.match(Path(path).name)
        return Checkpoint(Path(path), int(found.group(1))) if found and (Path(path) / ".metadata").is_file() else None

    def parser(self, argv: list[str], world_size: int, peak_tflops: float | None = None):
        return lambda line: parse(line, world_size)


def parse(line: str, world_size: int = 1) -> dict | str | None:
    """One of torchtitan's log lines -> a train or val record; None for the others."""
    text = plain(line)
    found = _STEP.search(text)
    if found is None:
        return None
    validate, step, loss = found.group(1), found.group(2), number(found.group(3))
    if loss is None:
        return UNREADABLE
    fields = {key: value for key, value in _FIELD.findall(text[found.end():])}
    if validate:
        return {"kind": "val", "step": int(step), "val_loss": loss}
    tps = number(fields.get("tps", ""))
    mfu = number(fields.get("mfu", ""))
    memory = number(fields.get("memory", "").replace("GiB", ""))
    return train_record(step, loss=loss, grad_norm=number(fields.get("grad_norm", "")),
                        tokens_per_s=tps * world_size if tps is not None else None, tokens_per_s_per_device=tps,
                        tflops=number(fields.get("tflops", "")), mfu=mfu / 100 if mfu is not None else None,
                        gpu_mem_reserved_gib=memory)


def _check_toml(path: Path) -> None:
    """A config torchtitan would refuse at once, refused here: one line (TOML it cannot read)."""
    import tomllib
    try:
        with open(path, "rb") as handle:
            tomllib.load(handle)
    except (OSError, UnicodeDecodeError) as exc:
        raise BackendError(f"--config {path}: cannot read it ({exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise BackendError(f"--config {path}: torchtitan cannot read it: invalid TOML ({exc})") from None


BACKEND = Torchtitan()
