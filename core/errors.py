"""The one error base of the project: every error a user can cause carries its exit code.

Each layer (envs, runtime, benchmarks, tasks) derives its errors from these; the
program (runtime.program.cli) turns any AnvilError into one message and its exit
code, in one place. They live here, in the lowest layer that knows about users,
so the trainer, envs and the runtime can all import them (kernels raise plain
Python errors: they are called by code, not by people).
"""
from __future__ import annotations


class AnvilError(Exception):
    """Something went wrong that Anvil explains in one message; exits with `exit_code`."""

    exit_code = 1

    def __init__(self, message: str = "", exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class UserError(AnvilError, ValueError):
    """Bad input the user can fix (a config, an option, a path, a host): exit status 2."""

    exit_code = 2
