"""Hooks that hang, end their process or print secrets, through the installed inv (runtime/runs/hooks.py):
a hook past anvil.hook_timeout is killed with what it started and the task stops naming it (exit 124); a
Python hook's os._exit ends the hook's own process, never inv; what hooks print or log is masked."""
from __future__ import annotations

import json
import os
import time

import pytest

from helpers.program import explain, metadata, runs
from helpers.project import in_project


def hook(project, phase: str, name: str, text: str):
    path = project / "hooks" / "demo" / "hello" / phase / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _gone(pid: int) -> bool:
    """The process ended (gone, or a zombie that whoever adopted it has not reaped yet)."""
    deadline = time.monotonic() + 15   # returns as soon as it ends; the margin is for a busy machine
    while time.monotonic() < deadline:
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.1)
    return False


def _failure_line(proc) -> str:
    """The line the task's failure starts with (the one line a user reads)."""
    return next(line for line in proc.stderr.splitlines() if line.startswith("demo.hello failed:"))


@pytest.mark.parametrize("kind", ["py", "sh"])
def test_a_hook_that_hangs_is_killed_and_the_task_stops_naming_it(project, tmp_path, kind):
    pids = tmp_path / "pids"
    if kind == "py":
        hook(project, "pre", "10_hang.py", "import os, subprocess, time\n"
             f"def hook(ctx):\n    child = subprocess.Popen(['sleep', '600'])\n"
             f"    open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
             "    print('waiting for a lock', flush=True)\n    time.sleep(600)\n")
    else:
        hook(project, "pre", "10_hang.sh", f"sleep 600 &\necho \"$$ $!\" > {pids}\necho waiting for a lock\nwait\n")
    started = time.monotonic()
    proc = in_project(project, "demo.hello", env={"INVOKE_ANVIL_HOOK_TIMEOUT": "2"}, timeout=60)
    assert time.monotonic() - started < 30
    assert proc.returncode == 124, explain(proc)
    first = _failure_line(proc)
    assert f"hook {project / 'hooks/demo/hello/pre' / f'10_hang.{kind}'} failed: did not finish within 2 s " \
           "(anvil.hook_timeout); it was killed" in first, explain(proc)
    assert "waiting for a lock" in proc.stderr and "Traceback" not in proc.stderr
    assert '"said"' not in proc.stdout                      # the task's body never ran
    md = metadata(runs(project)[-1])
    assert md["status"] == "failed" and md["exit_code"] == 124
    for pid in map(int, pids.read_text().split()):         # the hook and what it started are gone
        assert _gone(pid), pid


def test_a_post_hook_that_hangs_fails_the_run_with_the_same_status(project):
    hook(project, "post", "10_hang.sh", "sleep 600\n")
    proc = in_project(project, "demo.hello", env={"INVOKE_ANVIL_HOOK_TIMEOUT": "1"}, timeout=60)
    assert proc.returncode == 124 and "10_hang.sh failed: did not finish within 1 s" in proc.stderr, explain(proc)
    assert metadata(runs(project)[-1])["exit_code"] == 124


def test_a_hook_under_its_timeout_runs_as_before(project):
    hook(project, "pre", "10_quick.sh", "sleep 1\necho HOOKED=yes\n")
    proc = in_project(project, "demo.hello", env={"INVOKE_ANVIL_HOOK_TIMEOUT": "30"})
    assert proc.returncode == 0, explain(proc)
    assert json.loads(proc.stdout.strip().splitlines()[-1])["hook_env"] == "yes"
    default = in_project(project, "demo.settings")
    assert json.loads(default.stdout.strip().splitlines()[-1])["hook_timeout"] == 600


@pytest.mark.parametrize("code", [0, 3])
def test_os_exit_in_a_python_hook_does_not_end_inv(project, code):
    hook(project, "pre", "10_exit.py", f"import os\ndef hook(ctx):\n    print('leaving early', flush=True)\n"
                                      f"    os._exit({code})\n")
    proc = in_project(project, "demo.hello")
    assert proc.returncode == 1, explain(proc)
    assert (f"10_exit.py failed: ended its process (exit status {code}) without returning from hook(ctx)"
            in _failure_line(proc)), explain(proc)
    assert "leaving early" in proc.stderr and '"said"' not in proc.stdout
    md = metadata(runs(project)[-1])
    assert md["status"] == "failed" and md["exit_code"] == 1
    assert "leaving early" in (runs(project)[-1] / "hooks" / "pre.log").read_text()


def test_a_python_hook_keeps_its_contract_in_its_own_process(project, tmp_path):
    """ctx: task, phase, config, run_dir; ctx.env extended (the body and later hooks see it); ctx.log into
    the run's log; a post hook gets the outcome; sys.exit inside a hook is a failure, not inv's exit."""
    seen = tmp_path / "seen.json"
    hook(project, "pre", "10_set.py", "import os\ndef hook(ctx):\n    ctx.env['HOOKED'] = ctx.task + ':' + ctx.phase\n"
         "    ctx.log.info('set by a hook in pid %d', os.getpid())\n")
    hook(project, "pre", "20_sees.sh", 'echo "shell saw $HOOKED"\n')
    hook(project, "post", "10_outcome.py", "import json\ndef hook(ctx):\n"
         f"    json.dump({{'outcome': ctx.outcome, 'config': ctx.config, 'run_dir': str(ctx.run_dir), "
         f"'hooked': ctx.env.get('HOOKED')}}, open({str(seen)!r}, 'w'))\n")
    proc = in_project(project, "demo.hello")
    assert proc.returncode == 0, explain(proc)
    assert json.loads(proc.stdout.strip().splitlines()[-1])["hook_env"] == "demo.hello:pre"
    run = runs(project)[-1]
    assert "shell saw demo.hello:pre" in (run / "hooks" / "pre.log").read_text()
    log = (run / "logs" / "runner.log").read_text()
    assert "set by a hook in pid" in log and f"pid {os.getpid()}" not in log
    got = json.loads(seen.read_text())
    assert got == {"outcome": {"status": "ok", "error": None}, "config": {"say": "hello", "api_key": "hello"},
                   "run_dir": str(run), "hooked": "demo.hello:pre"}
    hook(project, "pre", "30_exits.py", "import sys\ndef hook(ctx):\n    sys.exit(0)\n")
    failed = in_project(project, "demo.hello")
    assert failed.returncode == 1 and "30_exits.py failed: SystemExit: 0" in failed.stderr, explain(failed)


def test_what_hooks_print_and_log_is_masked_short_secrets_too(project):
    secret = "k9Zq2"          # shorter than 6 characters: masked where it stands as a word
    hook(project, "pre", "10_print.sh", 'echo "token is $API_TOKEN"\n')
    hook(project, "pre", "20_log.py", "def hook(ctx):\n    print('py token', ctx.env['API_TOKEN'])\n"
         "    ctx.log.info('logged token %s', ctx.env['API_TOKEN'])\n")
    hook(project, "post", "10_fails.sh", 'echo "failing with $API_TOKEN"\nexit 5\n')
    proc = in_project(project, "demo.hello", "--env", f"API_TOKEN={secret}")
    assert proc.returncode == 1 and "10_fails.sh failed: exit status 5" in proc.stderr, explain(proc)
    run = runs(project)[-1]
    written = {path.relative_to(run): path.read_text(errors="replace") for path in run.rglob("*") if path.is_file()}
    for name, text in written.items():
        assert secret not in text, name
    assert "token is <masked>" in (run / "hooks" / "pre.log").read_text()
    assert "py token <masked>" in (run / "hooks" / "pre.log").read_text()
    assert "logged token <masked>" in (run / "logs" / "runner.log").read_text()
    assert secret not in proc.stdout + proc.stderr and "failing with <masked>" in proc.stderr
