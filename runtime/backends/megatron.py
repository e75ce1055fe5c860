"""--backend megatron: a script of a Megatron-LM checkout (pretrain_gpt.py) with its own arguments.

    inv train.launch --backend megatron --megatron ~/Megatron-LM -- pretrain_gpt.py --num-layers 2 ...
    inv train.launch --backend megatron -- pretrain_gpt.py ...       # the checkout of anvil.megatron_path

The checkout is named by --megatron or the setting anvil.megatron_path; the script is found in it (or
as a path). Each rank runs `python CHECKOUT/pretrain_gpt.py ARGS` with, unless ARGS give them:
--exit-signal-handler (on its signal, SIGTERM unless --exit-signal names another, Megatron-LM saves a
checkpoint and exits 0: a requeue all the same), --save RUN/checkpoints, and --load where it resumes from:
its own --save folder once that has a checkpoint (a requeued job), else the one `--resume` found (with
--ckpt-step when that is not the folder's newest), else ARGS' own --load.

Its checkpoints: SAVE/latest_checkpointed_iteration.txt names the newest, SAVE/iter_0000100/ holds it.

Its metric lines (megatron/training/training.py, training_log; print_rank_last, so on the last rank):

     [2025-06-01 12:00:00] iteration       10/     100 | consumed samples:          320 | elapsed time per iteration (ms): 123.4 | throughput per GPU (TFLOP/s/GPU): 12.3 | learning rate: 1.000000E-04 | global batch size:    32 | lm loss: 1.023456E+01 | loss scale: 1.0 | grad norm: 2.345 | number of skipped iterations:   0 | number of nan iterations:   0 |
     validation loss at iteration 100 on validation set | lm loss value: 5.123456E+00 | lm loss PPL: 1.678901E+02 |
    [Rank 3] (after 10 iterations) memory (MB) | allocated: 1234.56 | max allocated: 2345.67 | reserved: 3000.00 | max reserved: 3000.00

tokens/s is global batch size x --seq-length over the iteration time; MFU is TFLOP/s/GPU over
names.GPU_PEAK_TFLOPS (the GPU's profile).
"""
from __future__ import annotations

import re
import signal
from pathlib import Path

from core import names
from runtime.backends.base import (UNREADABLE, Backend, BackendError, Checkpoint, Options, Plan, number, option_value,
                                   plain, train_record)

TRACKER = "latest_checkpointed_iteration.txt"
_ITERATION = re.compile(r"(?:^|\s)iteration\s+(\d+)\s*/\s*\d+\s*\|(.*)$")
_VALIDATION = re.compile(r"validation\S* loss at iteration (\d+)[^|]*\|(.*)$")
_MEMORY = re.compile(r"\(after (\d+) iterations\) memory \(MB\)(.*)$")
_CHECKPOINT = re.compile(r"^iter_(\d+)$")
GIB_IN_MB = 1024.0


def _without(argv: list[str], *options: str) -> list[str]:
    """argv less each `--option VALUE` / `--option=VALUE` of `options`."""
    out, i = [], 0
    while i < len(argv):
        token = argv[i]
        if token in options:
            i += 2
            continue
        if token.split("=", 1)[0] in options and "=" in token:
            i += 1
            continue
        out.append(token)
        i += 1
    return out


def _fields(text: str) -> dict[str, str]:
    """' a: 1 | b c: 2 |' -> {'a': '1', 'b c': '2'}."""
    out = {}
    for part in text.split("|"):
        key, colon, value = part.rpartition(":")
        if colon and key.strip():
            out[key.strip()] = value.strip()
    return out


class Megatron(Backend):
    name = "megatron"
    summary = ("a script of a Megatron-LM checkout (--megatron or anvil.megatron_path) after --; "
               "--exit-signal-handler, --save, --load")
    stops_with_zero = True
    on_signal = "every rank gets SIGTERM (its --exit-signal): Megatron-LM saves a checkpoint and stops"

    def plan(self, argv: list[str], options: Options) -> Plan:
        if not options.megatron:
            raise BackendError("--backend megatron needs a Megatron-LM checkout: --megatron PATH, or "
                               "anvil.megatron_path in invoke.yaml")
        checkout = Path(options.megatron).expanduser()
        checkout = checkout if checkout.is_absolute() else options.cwd / checkout
        if not checkout.is_dir():
            raise BackendError(f"Megatron-LM checkout {options.megatron}: no such folder (--megatron, "
                               "anvil.megatron_path)")
        if not (checkout / "megatron").is_dir():
            raise BackendError(f"{options.megatron}: not a Megatron-LM checkout (no megatron/ package in it)")
        if argv and argv[0] in ("python", "python3"):
            argv = argv[1:]
        if not argv or argv[0].startswith("-"):
            scripts = ", ".join(sorted(p.name for p in checkout.glob("pretrain_*.py"))) or "none"
            raise BackendError(f"--backend megatron runs a script of the checkout after --: pretrain_gpt.py ARGS "
                               f"(its pretrain scripts: {scripts})")
        given = Path(argv[0]).expanduser()
        script = next((p for p in ((given,) if given.is_absolute() else (checkout / given, options.cwd / given))
                       if p.is_file()), None)
        if script is None:
            scripts = ", ".join(sorted(p.name for p in checkout.glob("pretrain_*.py"))) or "none"
            raise BackendError(f"{argv[0]}: not in the Megatron-LM checkout {checkout} (its pretrain scripts: "
                               f"{scripts})")
        return Plan([str(script.resolve()), *argv[1:]], mounts=[str(checkout.resolve())],
                    notes=[self.on_signal.replace("SIGTERM", signal.Signals(self.stop_signal_of(argv)).name)])

    def stop_signal_of(self, argv: list[str]) -> int:
        given = option_value(argv, "--exit-signal")
        if given:
            name = given.upper() if given.upper().startswith("SIG") else f"SIG{given.upper()}"
            if given.isdigit():
                return int(given)
            if hasattr(signal, name):
                return int(getattr(signal, name))
        return int(signal.SIGTERM)

    def checkpoint_dir(self, argv: list[str], run_dir: Path) -> Path:
        return Path(option_value(argv, "--save") or Path(run_dir) / names.CHECKPOINTS_DIR)

    def command(self, argv: list[str], run_dir: Path, resume: Checkpoint | None) -> list[str]:
        out = list(argv)
        if "--exit-signal-handler" not in out:
            out.append("--exit-signal-handler")
        if option_value(out, "--save") is None:
            out += ["--save", str(self.checkpoint_dir(out, run_dir))]
        if resume is not None:
            folder = Path(resume.path).parent
            newest = self.latest(folder)
            out = _without(out, "--load", "--ckpt-step") + ["--load", str(folder)]
            if newest is None or newest.step != resume.step:
                out += ["--ckpt-step", str(resume.step)]
        return out

    def latest(self, folder: Path) -> Checkpoint | None:
        try:
            text = (Path(folder) / TRACKER).read_text().strip()
        except OSError:
            return None
        if not text.isdigit():      # "release": a converted checkpoint, no training state to go on from
            return None
        path = Path(folder) / f"iter_{int(text):07d}"
        return Checkpoint(path, int(text)) if path.is_dir() else None

    def at(self, path: Path) -> Checkpoint | None:
        found = _CHECKPOINT.match(Path(path).name)
        return Checkpoint(Path(path), int(found.group(1))) if found and Path(path).is_dir() else None

    def metrics_rank(self, argv: list[str], world_size: int) -> int:
        return max(0, world_size - 1)

    def parser(self, argv: list[str], world_size: int, peak_tflops: float | None = None):
        return Parser(number(option_value(argv, "--seq-length") or ""), world_size, peak_tflops)


class Parser:
    """Megatron-LM's lines -> records; a memory report after iteration N adds its figure to N's record."""

    def __init__(self, seq_length: float | None = None, world_size: int = 1, peak_tflops: float | None = None):
        self.seq_length, self.world_size, self.peak_tflops = seq_length, max(1, world_size), peak_tflops
        self.last: dict | None = None

    def __call__(self, line: str) -> dict | str | None:
        text = plain(line)
        found = _ITERATION.search(text)
        if found:
            self.last = self._train(int(found.group(1)), _fields(found.group(2)))
            return self.last
        found = _VALIDATION.search(text)
        if found:
            values = _fields(found.group(2))
            loss = next((number(v) for k, v in values.items() if k.endswith(" value")), None)
            return {"kind": "val", "step": int(found.group(1)), "val_loss": loss} if loss is not None else UNREADABLE
        found = _MEMORY.search(text)
        if found and isinstance(self.last, dict) and self.last["step"] == int(found.group(1)):
            peak = number(_fields(found.group(2)).get("max allocated", ""))
            if peak is None:
                return UNREADABLE
            self.last = {**self.last, "gpu_mem_gib": peak / GIB_IN_MB}
            return self.last
        return None

    def _train(self, step: int, values: dict[str, str]) -> dict | str:
        loss_key = "lm loss" if "lm loss" in values else next(
            (k for k in values if k.endswith("loss") and k != "loss scale"), None)
        ms = number(values.get("elapsed time per iteration (ms)", ""))
        batch = number(values.get("global batch size", ""))
        tflops = number(values.get("throughput per GPU (TFLOP/s/GPU)", ""))
        tokens = batch * self.seq_length / (ms / 1000) if ms and batch and self.seq_length else None
        return train_record(step, loss=number(values[loss_key]) if loss_key else None,
                            lr=number(values.get("learning rate", "")), grad_norm=number(values.get("grad norm", "")),
                            step_time_s=ms / 1000 if ms is not None else None, tokens_per_s=tokens,
                            tokens_per_s_per_device=tokens / self.world_size if tokens is not None else None,
                            tflops=tflops, mfu=tflops / self.peak_tflops if tflops and self.peak_tflops else None)


BACKEND = Megatron()
