"""A run directory is data, through the installed inv (runtime/runs/trust.py, runtime/runs/replay.py): what
an edited run directory names that could run code (a --patch file, PYTHONPATH, LD_PRELOAD, BASH_ENV, a
hooks folder, task folders, a working directory outside the checkout) is shown by --dry-run, left out
of a replay with a note, and replayed only with --trust-run. A settings file that is gone is dropped
with a note, and a benchmark replays the sizes it resolved."""
from __future__ import annotations

import json
import shutil
import sys

import pytest

from core.files import seal
from helpers.program import anvil_context, explain, inv, runs
from helpers.project import in_project, make_project


def _edit(run_dir, name, change):
    """An edit as a hostile colleague would make it: resealed, so the record reads as intact."""
    data = json.loads((run_dir / name).read_text())
    change(data)
    (run_dir / name).write_text(json.dumps(seal(data), indent=2))


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """A recorded demo.hello run, then edited to name code in every way a replay could start it; each
    piece of code leaves a marker file when it runs."""
    root = tmp_path_factory.mktemp("trust")
    project = make_project(root / "p")
    made = in_project(project, "demo.hello", "--name", "orig")
    assert made.returncode == 0, explain(made)
    (run_dir,) = runs(project)
    evil = root / "evil"
    markers = root / "markers"
    markers.mkdir()
    (evil / "py").mkdir(parents=True)
    (evil / "py" / "sitecustomize.py").write_text(f"open({str(markers / 'pythonpath')!r}, 'w').write('ran')\n")
    (evil / "patch.py").write_text(f"def hook(ctx):\n    open({str(markers / 'patch')!r}, 'w').write('ran')\n")
    (evil / "bash_env.sh").write_text(f"echo ran > {markers / 'bash_env'}\n")
    (evil / "tasks").mkdir()
    (evil / "tasks" / "planted.py").write_text(f"open({str(markers / 'tasks_path')!r}, 'w').write('ran')\n")
    pre = evil / "hooks" / "demo" / "hello" / "pre"
    pre.mkdir(parents=True)
    (pre / "10_planted.sh").write_text(f"echo ran > {markers / 'hooks_dir'}\n")
    (project / "hooks" / "demo" / "hello" / "pre").mkdir(parents=True)
    (project / "hooks" / "demo" / "hello" / "pre" / "10_own.sh").write_text("echo own hook\n")   # runs anyway
    planted_env = {"PYTHONPATH": str(evil / "py"), "LD_PRELOAD": str(evil / "missing.so"),
                   "BASH_ENV": str(evil / "bash_env.sh"), "ANVIL_TASKS_PATH": str(evil / "tasks"),
                   "INVOKE_ANVIL_HOOKS_DIR": str(evil / "hooks"), "DEMO_PLAIN": "kept"}
    _edit(run_dir, "env.json", lambda d: d["vars"].update(
        {name: {"value": value, "source": "task"} for name, value in planted_env.items()}))
    _edit(run_dir, "metadata.json", lambda d: d.update(argv=d["argv"] + ["--patch", str(evil / "patch.py")]))
    return project, run_dir, markers


def _fired(markers):
    return sorted(p.name for p in markers.iterdir())


ITEMS = ["env PYTHONPATH=", "env LD_PRELOAD=", "env BASH_ENV=", "env ANVIL_TASKS_PATH=",
         "env INVOKE_ANVIL_HOOKS_DIR=", "--patch "]


def test_the_dry_run_lists_what_could_run_code_and_runs_none_of_it(planted):
    project, run_dir, markers = planted
    dry = in_project(project, "snapshot.replay", str(run_dir), "--dry-run")
    assert dry.returncode == 0, explain(dry)
    listed = [line.strip() for line in dry.stdout.splitlines() if line.startswith("  ")]
    for item in ITEMS:
        (line,) = [entry for entry in listed if entry.startswith(item)]
        assert "--trust-run " in line, line
    assert "the run directory names 6 thing(s) that can run code (left out without --trust-run)" in dry.stdout
    assert "--patch" not in dry.stdout.split("would replay: inv ")[1]
    assert "DEMO_PLAIN" not in "\n".join(listed)
    trusted = in_project(project, "snapshot.replay", str(run_dir), "--dry-run", "--trust-run")
    assert "(replayed: --trust-run)" in trusted.stdout and "--patch" in trusted.stdout.split("would replay")[1]
    assert _fired(markers) == [] and len(runs(project)) == 1


def test_a_replay_leaves_it_out_and_says_so(planted):
    project, run_dir, markers = planted
    replayed = in_project(project, "snapshot.replay", str(run_dir))
    assert replayed.returncode == 0, explain(replayed)
    for item in ITEMS:
        assert any(line.startswith(f"note: left out {item}") for line in replayed.stdout.splitlines()), item
    assert _fired(markers) == [], _fired(markers)
    new = runs(project)[-1]
    env = json.loads((new / "env.json").read_text())["vars"]
    assert env["DEMO_PLAIN"]["value"] == "kept"                   # the rest of the environment is replayed
    assert not {"PYTHONPATH", "LD_PRELOAD", "BASH_ENV", "ANVIL_TASKS_PATH", "INVOKE_ANVIL_HOOKS_DIR"} & set(env)
    assert "--patch" not in json.loads((new / "metadata.json").read_text())["argv"]
    assert "own hook" in (new / "hooks" / "pre.log").read_text()   # this checkout's hooks run as ever


def test_trust_run_replays_it(planted):
    project, run_dir, markers = planted
    replayed = in_project(project, "snapshot.replay", str(run_dir), "--trust-run")
    assert replayed.returncode == 0, explain(replayed)
    # (ANVIL_TASKS_PATH is read by the checkout's tasks.py, not by this test project's: listed, not fired)
    assert _fired(markers) == ["bash_env", "hooks_dir", "patch", "pythonpath"], replayed.stderr
    for marker in markers.iterdir():
        marker.unlink()


def test_a_working_directory_outside_the_checkout_is_not_where_the_replay_runs(planted, tmp_path):
    project, run_dir, markers = planted
    outside = tmp_path / "outside"
    shadow = outside / "runtime" / "program"
    shadow.mkdir(parents=True)
    (outside / "runtime" / "__init__.py").write_text("")
    (shadow / "__init__.py").write_text("")
    (shadow / "main.py").write_text(f"open({str(markers / 'cwd')!r}, 'w').write('ran')\n")
    copy = run_dir.parent / (run_dir.name + "-cwd")
    shutil.copytree(run_dir, copy)
    _edit(copy, "metadata.json", lambda d: d.update(cwd=str(outside)))
    dry = in_project(project, "snapshot.replay", str(copy), "--dry-run")
    assert f"working directory {outside}: outside this checkout" in dry.stdout, explain(dry)
    replayed = in_project(project, "snapshot.replay", str(copy))
    assert replayed.returncode == 0, explain(replayed)
    assert f"note: runs in {project}, not in {outside}" in replayed.stdout
    assert "cwd" not in _fired(markers)
    trusted = in_project(project, "snapshot.replay", str(copy), "--trust-run")
    assert "cwd" in _fired(markers), explain(trusted)
    shutil.rmtree(copy)
    for marker in markers.iterdir():
        marker.unlink()


def test_the_replays_own_control_variable_is_never_taken_from_a_run(planted):
    project, run_dir, markers = planted
    copy = run_dir.parent / (run_dir.name + "-control")
    shutil.copytree(run_dir, copy)
    _edit(copy, "env.json", lambda d: d["vars"].update(ANVIL_REPLAY_TRUSTED={"value": "1", "source": "task"}))
    replayed = in_project(project, "snapshot.replay", str(copy))
    assert replayed.returncode == 0, explain(replayed)
    assert "note: left out env ANVIL_REPLAY_TRUSTED=1 (the replay's own control variable" in replayed.stdout
    assert _fired(markers) == []
    shutil.rmtree(copy)


def test_an_ordinary_environment_value_the_shell_already_has_is_no_item(planted):
    """A variable of the kind that runs code, recorded with the value this environment has, changes
    nothing: it is neither listed nor left out."""
    project, run_dir, _markers = planted
    copy = run_dir.parent / (run_dir.name + "-same")
    shutil.copytree(run_dir, copy)
    _edit(copy, "env.json", lambda d: d.update(vars={"PYTHONHASHSEED": {"value": "0"}, "PYTHONPATH": {"value": "/x"}}))
    _edit(copy, "metadata.json", lambda d: d.update(argv=[a for a in d["argv"] if "patch" not in a]))
    dry = in_project(project, "snapshot.replay", str(copy), "--dry-run", env={"PYTHONPATH": "/x"})
    assert "names nothing that can run code" in dry.stdout, explain(dry)
    shutil.rmtree(copy)


def test_a_settings_file_that_is_gone_is_dropped_with_a_note_and_one_that_names_code_needs_trust(tmp_path, project):
    settings = tmp_path / "s.yaml"
    settings.write_text("anvil:\n  connect_timeout: 4\n")
    made = in_project(project, "-f", str(settings), "demo.hello", "--name", "f")
    assert made.returncode == 0, explain(made)
    (run_dir,) = runs(project)
    settings.unlink()
    replayed = in_project(project, "snapshot.replay", str(run_dir))
    assert replayed.returncode == 0, explain(replayed)
    assert f"note: dropped -f {settings} (the settings file is gone; this checkout's settings are used)" \
        in replayed.stdout
    settings.write_text(f"anvil:\n  hooks_dir: {tmp_path / 'elsewhere'}\n")
    settings.chmod(0o644)
    own = in_project(project, "snapshot.replay", str(run_dir), "--dry-run")      # your own settings: yours to trust
    assert f"-f {settings} demo.hello" in own.stdout.split("would replay: inv ")[1], explain(own)
    assert "names nothing that can run code" in own.stdout
    settings.chmod(0o666)                                                   # anyone can write it: not yours
    dry = in_project(project, "snapshot.replay", str(run_dir), "--dry-run")
    assert f"-f {settings}: settings of someone else's, or that others can write, that say where code comes " \
           "from (anvil.hooks_dir)" in dry.stdout, explain(dry)
    assert f"-f {settings}" not in dry.stdout.split("would replay: inv ")[1]
    trusted = in_project(project, "snapshot.replay", str(run_dir), "--dry-run", "--trust-run")
    assert f"-f {settings} demo.hello" in trusted.stdout.split("would replay: inv ")[1], explain(trusted)


def test_a_fan_out_run_whose_settings_file_is_gone_replays_here_without_it(tmp_path, project):
    from runtime.runs.run import RunSpec, execute
    ctx = anvil_context(project / "runs")
    gone = tmp_path / "cluster.yaml"
    execute(ctx, RunSpec(task="demo.checks", argv=["inv", "-f", str(gone), "-H", "n1,n2", "demo.checks"],
                         extra={"fanout": "ssh"}), lambda run: None)
    (run_dir,) = runs(project)
    replayed = in_project(project, "snapshot.replay", str(run_dir))
    assert replayed.returncode == 0, explain(replayed)
    assert f"note: dropped -f {gone} (the settings file is gone" in replayed.stdout
    assert "note: dropped -H n1,n2" in replayed.stdout and "replaying: inv demo.checks" in replayed.stdout


def test_a_benchmark_replays_the_sizes_it_resolved(tmp_path):
    made = inv(tmp_path, "bench.gemm", "--iters", "1", "--json", timeout=120)
    assert made.returncode == 0, made.stderr[-3000:]
    size = json.loads(made.stdout)["m"]
    (run_dir,) = runs(tmp_path)
    dry = inv(tmp_path, "snapshot.replay", run_dir, "--dry-run")
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert f"would replay: inv bench.gemm --iters 1 --json -M {size} -N {size} -K {size}" in dry.stdout, dry.stdout
    assert f"note: added -M {size} -N {size} -K {size} (the sizes the run resolved and measured)" in dry.stdout
    given = inv(tmp_path, "bench.gemm", "-M", "64", "-K", "32", "--iters", "1", "--json", timeout=120)
    assert given.returncode == 0, given.stderr[-3000:]
    again = inv(tmp_path, "snapshot.replay", runs(tmp_path)[-1], "--dry-run")
    assert "would replay: inv bench.gemm -M 64 -K 32 --iters 1 --json -N 64" in again.stdout, again.stdout


def test_a_replayed_argv_that_would_break_the_batch_script_is_refused(tmp_path):
    from runtime.runs.run import RunSpec, execute
    ctx = anvil_context(tmp_path / "runs")
    argv = ["inv", "train.pretrain", "--set", "data.path=synthetic", "--runtime", "slurm",
            "--partition", "gpu\necho pwned"]
    execute(ctx, RunSpec(task="train.pretrain", configs={"train.yaml": {"data": {"path": "synthetic"}}},
                         config_sources={"train.yaml": "configs/tiny.yaml"}, config_options={"train.yaml": "--config"},
                         argv=argv), lambda run: None)
    (run_dir,) = runs(tmp_path)
    replayed = inv(tmp_path, "snapshot.replay", run_dir)
    assert replayed.returncode == 2, replayed.stdout + replayed.stderr
    assert "Slurm partition (--partition, anvil.slurm_partition) 'gpu\\necho pwned': has a control character" \
        in replayed.stderr and "Traceback" not in replayed.stderr
    assert len(runs(tmp_path)) == 1 and sys.executable
