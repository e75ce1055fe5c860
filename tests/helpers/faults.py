"""Faults put into real training runs from outside the product: a sitecustomize.py that a test writes and
puts on PYTHONPATH (Python's site module loads it in every process). It acts in the rank that
ANVIL_TEST_FAULT_RANK names, or in every rank of the host ANVIL_TEST_FAULT_HOST names (as the launcher
named it: ANVIL_HOST). Nothing in trainer/ or runtime/ reads these variables.

ANVIL_TEST_FAULT is one of
    slow:SECONDS          every forward of the rank sleeps that long
    hang:STEP             step STEP never finishes (its gradient clip waits forever)
    kill:STEP             the rank SIGKILLs itself in step STEP
    nan:CALL[,CALL...]    those training forward calls of the process (1-based) return a NaN loss
and, with ANVIL_TEST_FAULT_TIMES=N, fires in at most N processes' lifetimes (a restarted rank is a new
process): the count is kept in files beside the sitecustomize.py.
"""
from __future__ import annotations

import os
from pathlib import Path

from helpers.program import inv_environ

FAULTS = '''
import os

def _chosen():
    rank, host = os.environ.get("ANVIL_TEST_FAULT_RANK"), os.environ.get("ANVIL_TEST_FAULT_HOST")
    if os.environ.get("RANK") is None or "ANVIL_TEST_FAULT" not in os.environ:
        return False
    if rank is not None and os.environ.get("RANK") != rank:
        return False
    return host is None or os.environ.get("ANVIL_HOST") == host

def _fires():
    """Whether this process is one of the ANVIL_TEST_FAULT_TIMES that fire (each takes a numbered file)."""
    times = os.environ.get("ANVIL_TEST_FAULT_TIMES")
    if times is None:
        return True
    folder = os.path.dirname(os.path.abspath(__file__))
    for n in range(int(times)):
        try:
            os.close(os.open(os.path.join(folder, f"fired-{os.environ['RANK']}-{n}"), os.O_CREAT | os.O_EXCL))
            return True
        except FileExistsError:
            continue
    return False

if _chosen():
    import importlib.abc
    import importlib.util
    import signal
    import sys
    import threading
    import time

    kind, _, value = os.environ["ANVIL_TEST_FAULT"].partition(":")
    armed = [None]

    def fire():
        if armed[0] is None:
            armed[0] = _fires()
        return armed[0]

    def patch(module):
        if kind in ("slow", "nan") and module.__name__ == "trainer.models.transformer":
            forward, calls = module.Transformer.forward, [0]

            def faulty_forward(self, *args, **kwargs):
                if kind == "slow":
                    time.sleep(float(value))          # this rank computes slower
                    return forward(self, *args, **kwargs)
                loss = forward(self, *args, **kwargs)
                if self.training:
                    calls[0] += 1
                    if calls[0] in {int(c) for c in value.split(",")} and fire():
                        return loss * float("nan")
                return loss
            module.Transformer.forward = faulty_forward
        if kind in ("hang", "kill") and module.__name__ == "trainer.optim":
            clip, calls = module.clip_grad_norm, [0]

            def faulty_clip(*args, **kwargs):
                calls[0] += 1
                if calls[0] == int(value) and fire():
                    if kind == "kill":
                        os.kill(os.getpid(), signal.SIGKILL)
                    threading.Event().wait()          # step N never finishes on this rank
                return clip(*args, **kwargs)
            module.clip_grad_norm = faulty_clip

    class PatchOnImport(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name not in ("trainer.models.transformer", "trainer.optim"):
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            load = spec.loader.exec_module

            def exec_module(module):
                load(module)
                patch(module)
            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, PatchOnImport())
'''


def fault_environ(folder: Path, fault: str, *, rank: int | None = None, host: str | None = None,
                  times: int | None = None) -> dict[str, str]:
    """The variables that put `fault` into the chosen rank or host's processes: FAULTS written to
    folder/sitecustomize.py, and PYTHONPATH with it first."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(FAULTS)
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH")) if p),
           "ANVIL_TEST_FAULT": fault}
    if rank is not None:
        env["ANVIL_TEST_FAULT_RANK"] = str(rank)
    if host is not None:
        env["ANVIL_TEST_FAULT_HOST"] = host
    if times is not None:
        env["ANVIL_TEST_FAULT_TIMES"] = str(times)
    return env


def environ_with_fault(tmp_path: Path, fault: str | None = None, rank: int = 1, times: int | None = None) -> dict:
    """inv's environment, its runs in tmp_path/runs; with `fault`, FAULTS put in rank `rank`."""
    env = inv_environ(tmp_path / "runs", {"OMP_NUM_THREADS": "1"})
    if fault:
        env.update(fault_environ(tmp_path / "inject", fault, rank=rank, times=times))
    return env
