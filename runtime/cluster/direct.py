"""Runtime direct: this machine. The agent is inv's own child; each_node runs the command here, once."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import IO, Mapping, Sequence

from core import names
from core.host import this_host
from runtime.cluster.results import HostResult, Interrupted, parse_json_output
from runtime.cluster.transport import Progress, Transport, Wrap, node_env
from runtime.launch import process
from runtime.launch.commands import launch_env, travelling
from runtime.launch.spec import LaunchSpec, Layout, processes_per_node


class Direct(Transport):
    name, via = "direct", "here"
    spans_nodes = False

    def nodes(self, env: Mapping[str, str]) -> list[str]:
        return [this_host()]

    def where(self, env: Mapping[str, str]) -> str:
        return f"this machine ({this_host()})"

    def layout(self, spec: LaunchSpec, env: Mapping[str, str]) -> Layout:
        return Layout(processes_per_node(spec, env), 1)

    def launch(self, spec: LaunchSpec, env: Mapping[str, str], run_dir: Path | None = None, *,
               wrap: Wrap | None = None, nodes: Sequence[str] | None = None, log_name: str = names.LAUNCHER_LOG,
               dry_run: bool = False, masker=None, stdout: IO | None = None, stderr: IO | None = None,
               timeout: float | None = None) -> int:
        prefix = wrap(travelling(launch_env(spec, env, run_dir))) if wrap else []
        return process.launch(spec, env, run_dir, wrap=prefix, log_name=log_name, dry_run=dry_run, masker=masker,
                              stdout=stdout, stderr=stderr, timeout=timeout)

    def each_node(self, command: list[str], env: Mapping[str, str] | None = None, *,
                  hosts_dir: Path | None = None, timeout: float | None = None, progress: Progress | None = None,
                  nodes: Sequence[str] | None = None) -> list[HostResult]:
        host = this_host()
        limit = timeout or self.options.command_timeout or None
        started = time.monotonic()
        child = {**os.environ, **node_env(env, host, 0, 1, hosts_dir)}
        try:
            proc = subprocess.Popen(command, env=child, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    stdin=subprocess.DEVNULL)
        except OSError as exc:
            result = HostResult(host, error=f"cannot start {command[0]}: {exc.strerror or exc}")
        else:
            try:
                out, err = proc.communicate(timeout=limit)
                result = HostResult(host, exit_code=proc.returncode, stdout=out, stderr=err,
                                    payload=parse_json_output(out))
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
                result = HostResult(host, stdout=out, stderr=err, error=f"command timed out after {limit:g} s")
            except KeyboardInterrupt:       # the child got the terminal's Ctrl-C too
                out, err = proc.communicate()
                raise Interrupted([HostResult(host, exit_code=proc.returncode, stdout=out, stderr=err,
                                              interrupted=True)]) from None
        result.seconds = round(time.monotonic() - started, 2)
        if progress:
            progress(result)
        return [result]
