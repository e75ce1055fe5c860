"""A throwaway Invoke project for the runner's tests (runner/test_cli.py, test_hooks.py, test_replay.py, ...).

Its tasks.py defines a few small tasks of its own (a run-creating one, a
check-shaped one, one with auto short flags) and mounts the checkout's real
snapshot collection, so the installed `inv` is exercised end to end without
depending on what other collections do.
"""
from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

from helpers.program import run_inv

TASKS_PY = textwrap.dedent('''
    import importlib.util
    import json as jsonlib
    import os
    import sys

    from invoke import Collection, task
    from invoke.exceptions import Exit

    import runtime.settings
    from runtime.runs.run import execute, run_task


    @run_task(help={"fail": "raise inside the body", "say": "text to log and return",
                    "config": "a YAML config file"})
    def hello(c, fail=False, say="hello", config="", run_options=None):
        """Make a run that logs, writes a child log and returns a result."""
        if config:
            import yaml
            with open(config) as handle:
                say = yaml.safe_load(handle).get("say", say)
        configs = {"demo.yaml": config} if config else {"demo.yaml": {"say": say, "api_key": say}}
        spec = run_options.spec("demo.hello", configs=configs, env={"DEMO_LAYER": "task"})
        if run_options.env:
            spec.env.update(dict(item.split("=", 1) for item in run_options.env))

        def body(run):
            run.log.info("saying %s with token %s", say, run.env.get("HF_TOKEN"))
            run.write_text("logs/child.txt", "child saw " + str(run.env.get("HF_TOKEN")) + "\\n")
            if fail:
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return {"said": say, "hook_env": run.env.get("HOOKED"), "replayed": run.env.get("DEMO_LAYER")}

        print(jsonlib.dumps(execute(c, spec, body)))


    @task(help={"bad": "host name whose check fails"})
    def checks(c, json=False, bad=""):
        """Check-shaped JSON for fan-out merging."""
        host = os.environ.get("ANVIL_HOST", "local")
        out = {"checks": [{"name": "same", "status": "PASS", "value": 1, "reason": "r"},
                          {"name": "host", "status": "FAIL" if host == bad else "PASS", "value": host,
                           "reason": "r", "fix": "f"}]}
        print(jsonlib.dumps(out) if json else out)


    @task
    def shape(c, hidden_size=0, heads=0):
        """Auto short flags: hidden_size would take -h."""
        print(f"hidden_size={hidden_size} heads={heads}")


    @task
    def settings(c):
        """Print the runner settings as JSON."""
        print(jsonlib.dumps(runtime.settings.load(c).to_dict()))


    @task
    def prep(c):
        print("pre on", os.environ.get("ANVIL_HOST", "local"))


    @task
    def after(c):
        print("post on", os.environ.get("ANVIL_HOST", "local"))


    @task(pre=[prep], post=[after])
    def main(c):
        """A task with pre and post tasks."""
        print("main on", os.environ.get("ANVIL_HOST", "local"))


    demo = Collection("demo")
    for t in (hello, checks, shape, settings, prep, after, main):
        demo.add_task(t)
    ns = Collection()
    ns.add_collection(demo)
    _spec = importlib.util.spec_from_file_location(
        "anvil_snapshot_tasks", runtime.settings.CHECKOUT / "tasks" / "snapshot.py")
    _snapshot = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_snapshot)
    ns.add_collection(_snapshot.ns)
''')


def make_project(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "tasks.py").write_text(TASKS_PY)
    (root / "invoke.yaml").write_text("anvil:\n  runs_dir: runs\n  connect_timeout: 3\n")
    return root


def in_project(project: Path, *args, env: dict[str, str] | None = None,
               timeout: float = 120) -> subprocess.CompletedProcess:
    """The installed inv in `project` as its own user would run it: none of this shell's INVOKE_* and
    ANVIL_* settings (the project's invoke.yaml says where its runs go), `env` on top."""
    return run_inv(*args, cwd=project, clean=True, env=env, timeout=timeout)
