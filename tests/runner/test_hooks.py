"""Hooks: order, env extension, failure, post-after-failure, --patch, --no-hooks, containment."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.runs import hooks
from runtime.runs.run import RunFailed, RunSpec, execute
from helpers.program import anvil_context, explain
from helpers.project import in_project

TASK = "demo.work"


@pytest.fixture
def context_with_hooks(tmp_path):
    """(an Invoke context whose runs and hooks folders are in tmp_path, the hooks folder, tmp_path)"""
    root = tmp_path / "hooks"
    (root / "demo" / "work" / "pre").mkdir(parents=True)
    (root / "demo" / "work" / "post").mkdir(parents=True)
    ctx = anvil_context(tmp_path / "runs", hooks_dir=root)
    return ctx, root, tmp_path


def write_file(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


TRACE = "import os\ndef hook(ctx):\n    open(os.environ['TRACE'], 'a').write('{name}:' + ctx.phase + ':' + str((ctx.outcome or {{}}).get('status')) + '\\n')\n"


def trace_hook(folder: Path, name: str) -> None:
    write_file(folder / f"{name}.py", TRACE.format(name=name))


def test_hooks_run_in_name_order_and_extend_env(context_with_hooks, monkeypatch):
    ctx, root, tmp = context_with_hooks
    trace = tmp / "trace.txt"
    monkeypatch.setenv("TRACE", str(trace))
    pre = root / "demo" / "work" / "pre"
    trace_hook(pre, "20_second")
    write_file(pre / "10_first.sh", f'echo "10_first:pre:None" >> {trace}\necho FROM_SHELL=1\necho plain output\n')
    write_file(pre / "30_third.py",
               "def hook(ctx):\n    assert ctx.env['FROM_SHELL'] == '1'\n    ctx.env['FROM_PY'] = ctx.task\n")
    write_file(pre / "README.md", "not a hook")
    trace_hook(root / "demo" / "work" / "post", "10_post")
    got = execute(ctx, RunSpec(task=TASK), lambda run: {"py": run.env["FROM_PY"], "sh": run.env["FROM_SHELL"]})
    assert got == {"py": TASK, "sh": "1"}
    assert trace.read_text().splitlines() == ["10_first:pre:None", "20_second:pre:None", "10_post:post:ok"]
    (run_dir,) = list((tmp / "runs").iterdir())
    env = json.loads((run_dir / "env.json").read_text())["vars"]
    assert env["FROM_SHELL"]["source"] == "hook:10_first.sh" and env["FROM_PY"]["source"] == "hook:30_third.py"
    assert "plain output" in (run_dir / "hooks" / "pre.log").read_text()


def test_failing_pre_hook_stops_the_task_and_post_hooks_still_run(context_with_hooks, monkeypatch):
    ctx, root, tmp = context_with_hooks
    trace = tmp / "trace.txt"
    monkeypatch.setenv("TRACE", str(trace))
    pre = root / "demo" / "work" / "pre"
    write_file(pre / "10_check.sh", 'echo "data directory /nope is missing"\nexit 4\n')
    trace_hook(pre, "20_never")
    trace_hook(root / "demo" / "work" / "post", "10_post")
    called = []
    with pytest.raises(RunFailed) as caught:
        execute(ctx, RunSpec(task=TASK), lambda run: called.append(1))
    assert not called
    message = str(caught.value)
    assert str(pre / "10_check.sh") in message and "exit status 4" in message
    assert "data directory /nope is missing" in message
    assert trace.read_text().splitlines() == ["10_post:post:failed"]     # not 20_never; post told it failed
    md = json.loads(next((tmp / "runs").iterdir()).joinpath("metadata.json").read_text())
    assert md["status"] == "failed"


def test_post_hooks_run_after_a_failed_body_and_see_the_outcome(context_with_hooks, monkeypatch):
    ctx, root, tmp = context_with_hooks
    trace = tmp / "trace.txt"
    monkeypatch.setenv("TRACE", str(trace))
    post = root / "demo" / "work" / "post"
    write_file(post / "10_fails.sh", 'echo "outcome=$ANVIL_OUTCOME"\nexit 1\n')
    trace_hook(post, "20_after")
    with pytest.raises(RunFailed) as caught:
        execute(ctx, RunSpec(task=TASK), lambda run: 1 / 0)
    assert "ZeroDivisionError" in str(caught.value) and "10_fails.sh" in str(caught.value)
    assert trace.read_text().splitlines() == ["20_after:post:failed"]     # ran despite 10_fails
    run_dir = next((tmp / "runs").iterdir())
    assert "outcome=failed" in (run_dir / "hooks" / "post.log").read_text()


def test_post_hooks_are_told_a_ctrl_c_was_an_interruption(context_with_hooks, monkeypatch):
    ctx, root, tmp = context_with_hooks
    trace = tmp / "trace.txt"
    monkeypatch.setenv("TRACE", str(trace))
    trace_hook(root / "demo" / "work" / "post", "10_post")

    def body(run):
        raise KeyboardInterrupt

    with pytest.raises(RunFailed) as caught:
        execute(ctx, RunSpec(task=TASK), body)
    assert trace.read_text().splitlines() == ["10_post:post:interrupted"]   # what the run records, too
    assert caught.value.exit_code == 130
    md = json.loads(next((tmp / "runs").iterdir()).joinpath("metadata.json").read_text())
    assert md["status"] == "interrupted"


def test_patch_runs_first_and_no_hooks_skips(context_with_hooks, monkeypatch):
    ctx, root, tmp = context_with_hooks
    trace = tmp / "trace.txt"
    monkeypatch.setenv("TRACE", str(trace))
    trace_hook(root / "demo" / "work" / "pre", "10_pre")
    patch = write_file(tmp / "fix.py", TRACE.format(name="patch"))
    execute(ctx, RunSpec(task=TASK, patch=patch), lambda run: None)
    assert trace.read_text().splitlines() == ["patch:pre:None", "10_pre:pre:None"]
    trace.unlink()
    execute(ctx, RunSpec(task=TASK, hooks=False), lambda run: None)
    assert not trace.exists()
    with pytest.raises(RunFailed, match="no such file"):
        execute(ctx, RunSpec(task=TASK, patch=tmp / "missing.sh"), lambda run: None)



def test_a_stop_that_names_its_status_is_not_said_twice(context_with_hooks):
    from core.errors import AnvilError

    class Stopped(AnvilError):
        status = "interrupted"

    def body(run):
        raise Stopped("interrupted (Ctrl-C) after checkpointing", 130)

    ctx, _root, _tmp = context_with_hooks
    with pytest.raises(RunFailed) as caught:
        execute(ctx, RunSpec(task=TASK, hooks=False), body)
    assert str(caught.value).startswith(f"{TASK} interrupted (Ctrl-C) after checkpointing\n"), str(caught.value)
    assert caught.value.status == "interrupted" and caught.value.exit_code == 130


def test_hooks_never_come_from_outside_the_hooks_root(tmp_path):
    root = tmp_path / "hooks"
    outside = tmp_path / "elsewhere"
    (outside / "pre").mkdir(parents=True)
    write_file(outside / "pre" / "10_evil.py", "def hook(ctx):\n    raise SystemExit('ran')\n")
    (root / "demo").mkdir(parents=True)
    for bad in ("../elsewhere", "demo/../../elsewhere", "..", "demo/x"):
        with pytest.raises(hooks.HookError):
            hooks.discover(root, bad, "pre")
    (root / "demo" / "linked").symlink_to(outside)          # folder symlink leaving the root
    with pytest.raises(hooks.HookError, match="leaves the hooks root"):
        hooks.discover(root, "demo.linked", "pre")
    (root / "demo" / "ok" / "pre").mkdir(parents=True)
    (root / "demo" / "ok" / "pre" / "10_link.py").symlink_to(outside / "pre" / "10_evil.py")
    with pytest.raises(hooks.HookError, match="outside the hooks root"):
        hooks.discover(root, "demo.ok", "pre")


def test_run_options_on_the_command_line(tmp_path, project):
    helped = in_project(project, "--help", "demo.hello")
    for flag in ("--name=STRING", "--env ", "--no-hooks", "--patch=STRING"):
        assert flag in helped.stdout, explain(helped)
    pre = project / "hooks" / "demo" / "hello" / "pre"
    pre.mkdir(parents=True)
    write_file(pre / "10_set.sh", "echo HOOKED=yes\n")
    patch = write_file(tmp_path / "patch.sh", "echo patched-output\n")
    ran = in_project(project, "demo.hello", "--patch", str(patch), "--name", "n1", "--env", "A=1", "--env", "B=2")
    assert ran.returncode == 0, explain(ran)
    assert json.loads(ran.stdout.strip().splitlines()[-1])["hook_env"] == "yes"
    run_dir = next((project / "runs").iterdir())
    assert run_dir.name.endswith("_demo.hello_n1")
    assert "patched-output" in (run_dir / "hooks" / "pre.log").read_text()
    env = json.loads((run_dir / "env.json").read_text())["vars"]
    assert env["A"]["value"] == "1" and env["B"]["value"] == "2"
    skipped = in_project(project, "demo.hello", "--no-hooks")
    assert json.loads(skipped.stdout.strip().splitlines()[-1])["hook_env"] is None, explain(skipped)
    before = sorted((project / "runs").iterdir())
    missing = in_project(project, "demo.hello", "--patch", str(tmp_path / "nope.py"))
    assert missing.returncode == 2 and f"--patch {tmp_path / 'nope.py'}: no such file" in missing.stderr, explain(missing)
    assert sorted((project / "runs").iterdir()) == before        # refused before a run directory
