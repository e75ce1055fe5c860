"""The installed `inv` run as a user runs it, and what it leaves: run directories, one-line errors.

    run_inv(*args, cwd=..., runs=..., env=...)   any way of running it; the others are made of it
    inv(work, *args)                             as a user in a fresh folder `work`, run directories in work/runs
    start_inv(work, *args)                       the same, started as from a terminal (its own process group)
"""
from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path

from helpers.processes import start_as_from_a_terminal

REPO = Path(__file__).resolve().parents[2]
INV = REPO / ".venv" / "bin" / "inv"
# This shell's choices of GPU and network, which a test of what Anvil itself finds or resolves must not see.
SHELL_CHOICES = ("ANVIL_GPU", "MASTER_ADDR", "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA")
# One thread per process: the suite runs two test files at once on a machine of two cores.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def inv_environ(runs: Path | None = None, env: Mapping[str, str] | None = None, clean: bool = False,
                unset: Iterable[str] = ()) -> dict[str, str]:
    """The environment inv runs in: this process's (`clean`: without INVOKE_* and ANVIL_* settings), its
    run directories in `runs` (INVOKE_ANVIL_RUNS_DIR) if given, `env` on top, the names in `unset` left out."""
    environ = {k: v for k, v in os.environ.items() if not (clean and k.startswith(("INVOKE_", "ANVIL_")))}
    if runs is not None:
        environ["INVOKE_ANVIL_RUNS_DIR"] = str(runs)
    environ.update(env or {})
    for name in unset:
        environ.pop(name, None)
    return environ


def run_inv(*args, cwd: Path = REPO, runs: Path | None = None, env: Mapping[str, str] | None = None,
            clean: bool = False, unset: Iterable[str] = (), timeout: float = 300, program: Path = INV,
            no_traceback: bool = False) -> subprocess.CompletedProcess:
    """`program` (the installed inv) with `args` in `cwd`, its output captured, no input; the environment
    is inv_environ's. `no_traceback`: assert that its stderr shows none, whatever its exit."""
    done = subprocess.run([str(program), *map(str, args)], cwd=cwd, env=inv_environ(runs, env, clean, unset),
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=timeout)
    if no_traceback:
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return done


def inv(work: Path, *args, **options) -> subprocess.CompletedProcess:
    """run_inv as a user in the folder `work` (a fresh tmp_path): there, its run directories in work/runs.
    Every output path a test gives is inside it, so a wrong guard can never reach the checkout."""
    return run_inv(*args, cwd=work, runs=Path(work) / "runs", **options)


def start_inv(work: Path, *args, **env: str) -> subprocess.Popen:
    """inv as typed on a terminal in `work` (os.killpg is what the terminal does), run directories in
    work/runs, one thread per process, `env` on top; stdout and stderr piped as text."""
    return start_as_from_a_terminal([str(INV), *map(str, args)], cwd=work,
                                    env=inv_environ(Path(work) / "runs", {**ONE_THREAD, **env}),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def anvil_context(runs_dir: Path, **settings: Path | str):
    """An Invoke context as inv makes one (AnvilConfig), its runs in `runs_dir` and `settings` (hooks_dir,
    ...) as its anvil settings: for a task's body or execute() run in this process."""
    from invoke import Context

    from runtime.program.cli import AnvilConfig
    anvil = {"runs_dir": str(runs_dir), **{name: str(value) for name, value in settings.items()}}
    return Context(config=AnvilConfig(overrides={"anvil": anvil}))


def sets(*items: str) -> list[str]:
    """--set for each of `items`, as train.pretrain takes them."""
    return [arg for item in items for arg in ("--set", item)]


def runs(work: Path) -> list[Path]:
    """What is in work/runs (run directories only, when Anvil made it), oldest first: by the second in the
    name, then, for runs begun in the same second, by metadata.json's start_ts (the name alone would put
    `..._failing` before `..._killed` whatever their order)."""
    folder = Path(work) / "runs"
    return sorted(folder.iterdir(), key=_begun) if folder.is_dir() else []


def _begun(run: Path) -> tuple:
    try:
        start = float(json.loads((run / "metadata.json").read_text())["start_ts"])
    except (OSError, ValueError, KeyError, TypeError):
        start = 0.0
    return run.name.split("_", 1)[0], start, run.name


def metadata(run: Path) -> dict:
    """A run directory's metadata.json."""
    return json.loads((Path(run) / "metadata.json").read_text())


def explain(result: subprocess.CompletedProcess, tail: int = 4000) -> str:
    """A finished command for an assertion's message: its exit status and the ends of its output."""
    return f"exit {result.returncode}\n--- stdout\n{result.stdout[-tail:]}\n--- stderr\n{result.stderr[-tail:]}"


def assert_no_traceback(out: str, err: str = "") -> None:
    """Neither output shows a Python traceback or a KeyboardInterrupt: what ended the command was said."""
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in err, (out + err)[-3000:]


def one_line_error(proc, *fragments, code=2) -> str:
    """The failure is exit `code`, no traceback, and one stderr line holding every fragment."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == code, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    lines = [line for line in proc.stderr.splitlines() if all(f in line for f in fragments)]
    assert lines, f"no line with {fragments} in:\n{proc.stderr[-3000:]}"
    return lines[0]


def failure_line(stderr: str, task: str = "train.pretrain") -> str:
    """The one "TASK failed: ..." line of a task's stderr."""
    (line,) = [line for line in stderr.splitlines() if line.startswith(f"{task} failed: ")]
    return line


def assert_output_refused(work: Path, task: str, run: Path, out: str, *fragments: str) -> None:
    """`inv TASK RUN --out OUT` in `work`, beside a file and a folder of the user's, is one line holding
    every fragment, and leaves `work` as it was: nothing of the user's lost, nothing half-written left."""
    (work / "afile").write_text("mine")
    (work / "adir").mkdir()
    (work / "adir" / "keep").write_text("mine too")
    one_line_error(inv(work, task, run, "--out", out, timeout=120), f"{task}: ", *fragments)
    assert (work / "afile").read_text() == "mine" and (work / "adir" / "keep").read_text() == "mine too"
    assert sorted(p.name for p in work.iterdir()) == ["adir", "afile"]  # no temp left behind
