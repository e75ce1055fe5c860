"""--backend command: any program that follows torchrun's rank environment, after `--`.

    inv train.launch --backend command -- python train.py --lr 3e-4
    inv train.launch --backend command -- train.py --lr 3e-4          # a .py runs with the node's Python, as torchrun does
    inv train.launch --backend command -- ./train.sh

Every rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT, and
names.CHECKPOINT_DIR (RUN/checkpoints). SIGTERM and SIGUSR2 are forwarded as they came; a program that saves
and exits 3 asks for a requeue, and the requeued run (or `--resume RUN`) starts it again with the same
arguments and names.RESUME=1, names.RESUME_FROM=<the newest checkpoint: the entry of the checkpoint folder
with the highest number in its name>. A stdout line that is a JSON object with "step" and "loss" (and
optionally tokens_per_s, mfu as a fraction, mem_gib, lr) is a metric; --metrics-regex reads other formats.
"""
from __future__ import annotations

import re
from pathlib import Path

from runtime.backends.base import Backend, BackendError, Checkpoint, Options, Plan, json_line

#: A checkpoint's name: a step number in it (step_40, step-40, iter_0000040, checkpoint-40, 40).
_NUMBERED = re.compile(r"^(?:[A-Za-z]+[_-]?)?(\d+)(?:\.[A-Za-z0-9]+)?$")


def numbered(path: Path) -> int | None:
    """The step a checkpoint's name carries, or None (a hidden or temporary entry is none)."""
    if path.name.startswith(".") or "tmp" in path.name.lower():
        return None
    found = _NUMBERED.match(path.name)
    return int(found.group(1)) if found else None


#: torchrun and the modules behind it: train.launch does their work (a rank per GPU, the rank environment).
_LAUNCHERS = ("torch.distributed.run", "torch.distributed.launch")
_PYTHON = re.compile(r"^python[\d.]*$")


def launcher(program: str, args: list[str]) -> bool:
    """Whether the program after -- is torchrun itself (torchrun ..., python -m torch.distributed.run ...):
    under train.launch it would start its own ranks inside each rank."""
    if Path(program).name == "torchrun":
        return True
    if not _PYTHON.match(Path(program).name):
        return False
    options = iter(args)                     # Python's own options, up to the script or -m MODULE
    for arg in options:
        if arg == "-m":
            return next(options, None) in _LAUNCHERS
        if arg.startswith("-m"):
            return arg[2:] in _LAUNCHERS
        if arg in ("-W", "-X"):              # an option with its value apart
            next(options, None)
        elif not arg.startswith("-") or arg == "-c":
            return False
    return False


class Command(Backend):
    name = "command"
    summary = "any torchrun-style program after --; JSON metric lines; SIGTERM/SIGUSR2 forwarded, exit 3 requeues"

    def plan(self, argv: list[str], options: Options) -> Plan:
        if not argv:
            raise BackendError("--backend command runs the program after --: inv train.launch --backend command -- "
                               "python train.py ARGS")
        program, *args = argv
        if launcher(program, args):
            raise BackendError(f"{program} after --: train.launch starts the ranks itself, as torchrun does; give "
                               "the program torchrun would start (-- train.py ARGS), with --nproc for --nproc_per_node")
        if program in ("python", "python3") and args and not args[0].startswith("-"):
            program, *args = args          # python train.py: the node's Python runs it (the one a container has)
        path = Path(program).expanduser()
        if program.endswith(".py") or "/" in program:
            where = path if path.is_absolute() else options.cwd / path
            if not where.is_file():
                raise BackendError(f"{program}: no such file (the program after --)")
            program = str(where.resolve())
        return Plan([program, *args], mounts=[str(Path(program).parent)] if "/" in program else [])

    def latest(self, folder: Path) -> Checkpoint | None:
        try:
            entries = [(numbered(p), p) for p in Path(folder).iterdir()]
        except OSError:
            return None
        found = [(step, p) for step, p in entries if step is not None]
        if not found:
            return None
        step, path = max(found, key=lambda e: e[0])
        return Checkpoint(path, step)

    def at(self, path: Path) -> Checkpoint | None:
        step = numbered(Path(path))
        return Checkpoint(Path(path), step) if step is not None and Path(path).exists() else None

    def parser(self, argv: list[str], world_size: int, peak_tflops: float | None = None):
        return json_line


BACKEND = Command()
