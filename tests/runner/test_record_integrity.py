"""Integrity of what Anvil reads back, through the installed inv: a run's records (metadata.json, env.json,
machine.json, versions.json, git.json), a fan-out's nodes/fail.json and the config copies a replay passes
on carry a checksum of their own (core.files.seal, runtime.runs.rundir.write_record). An edited or
damaged one is one line naming the file (a marked row in snapshot.list), never believed; a record
written before records were sealed is read as before."""
from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from core.files import SEAL
from helpers.hostile import alias_bomb
from helpers.program import explain, inv, one_line_error, runs
from helpers.project import in_project, make_project
from runtime.runs import nodes


@pytest.fixture(scope="module")
def sealed_demo(tmp_path_factory):
    project = make_project(tmp_path_factory.mktemp("integrity"))
    made = in_project(project, "demo.hello", "--name", "orig")
    assert made.returncode == 0, explain(made)
    (run_dir,) = runs(project)
    return project, run_dir


def _copy(project, run_dir, name, edit):
    copy = run_dir.parent / f"{run_dir.name}-{name}"
    shutil.copytree(run_dir, copy)
    edit(copy)
    return copy


def _edit_json(name, change, unseal=False):
    def edit(path):
        data = json.loads((path / name).read_text())
        change(data)
        if unseal:
            data.pop(SEAL)
        (path / name).write_text(json.dumps(data, indent=2))
    return edit


def test_every_record_is_sealed_when_written(sealed_demo):
    _project, run_dir = sealed_demo
    for name in ("metadata.json", "env.json", "machine.json", "versions.json", "git.json"):
        assert SEAL in json.loads((run_dir / name).read_text()), name
    assert "demo.yaml" in json.loads((run_dir / "metadata.json").read_text())["config_sha256"]


@pytest.mark.parametrize("name, change", [
    ("metadata.json", lambda d: d.update(status="ok", argv=["inv", "demo.hello", "--patch", "/tmp/x.py"])),
    ("metadata.json", lambda d: d.update(start_ts=d["start_ts"] + 1)),
    ("env.json", lambda d: d["vars"].update(LD_PRELOAD={"value": "/tmp/evil.so", "source": "task"})),
    ("machine.json", lambda d: d.update(gpu={"vendor": "cuda", "model": "H100", "count": 8})),
    ("versions.json", lambda d: d.update(torch="9.9.9")),
    ("git.json", lambda d: d.update(commit="0" * 40)),
])
def test_an_edited_record_is_one_line_naming_it(sealed_demo, name, change):
    project, run_dir = sealed_demo
    copy = _copy(project, run_dir, f"edited-{name}-{abs(hash(str(change)))}", _edit_json(name, change))
    said = f"{copy / name} does not match its own checksum (edited or damaged since it was written)"
    for task in (["snapshot.show", str(copy)], ["snapshot.replay", str(copy), "--dry-run"],
                 ["snapshot.diff", str(run_dir), str(copy)]):
        one_line_error(in_project(project, *task), said)
    listed = in_project(project, "snapshot.list")
    assert listed.returncode == 0, explain(listed)
    if name == "metadata.json":       # the list marks the run whose metadata cannot be believed
        assert f"{copy.name}: metadata.json unreadable: does not match its own checksum" in listed.stdout
        row = json.loads(in_project(project, "snapshot.list", "--json").stdout)
        assert {r["dir"]: r["status"] for r in row}[copy.name] == "(unreadable)"
    shutil.rmtree(copy)


def test_a_byte_flipped_record_is_damaged_too(sealed_demo):
    project, run_dir = sealed_demo

    def flip(path):
        data = (path / "env.json").read_bytes()
        at = data.index(b'"value": "task"') + len(b'"value": "')
        (path / "env.json").write_bytes(data[:at] + b"T" + data[at + 1:])
    copy = _copy(project, run_dir, "flipped", flip)
    one_line_error(in_project(project, "snapshot.show", str(copy)), "env.json does not match its own checksum")


def test_a_record_written_before_records_were_sealed_is_read_as_before(sealed_demo):
    project, run_dir = sealed_demo
    copy = run_dir
    for name in ("metadata.json", "env.json", "machine.json", "versions.json", "git.json"):
        copy = _copy(project, copy, "old", _edit_json(name, lambda d: d.pop("config_sha256", None), unseal=True))
    shown = in_project(project, "snapshot.show", str(copy))
    assert shown.returncode == 0 and "demo.hello" in shown.stdout, explain(shown)
    assert SEAL not in shown.stdout
    replayed = in_project(project, "snapshot.replay", str(copy))
    assert replayed.returncode == 0, explain(replayed)


def test_show_and_diff_never_show_the_seal(sealed_demo):
    project, run_dir = sealed_demo
    shown = in_project(project, "snapshot.show", str(run_dir), "--json")
    assert shown.returncode == 0 and SEAL not in shown.stdout, explain(shown)
    other = in_project(project, "demo.hello", "--name", "other")
    assert other.returncode == 0, explain(other)
    diffed = in_project(project, "snapshot.diff", str(run_dir), str(runs(project)[-1]), "--json")
    assert diffed.returncode == 0 and SEAL not in diffed.stdout, explain(diffed)


TRAIN = ("train.pretrain", "--set", "data.path=synthetic", "--runtime", "slurm", "--dry-run")


def test_an_edited_node_list_is_not_believed(tmp_path):
    preflight = tmp_path / "pre"
    nodes.write(preflight, ["n1", "n2"], {"n7": ["gpu: FAIL"]})
    assert SEAL in json.loads((preflight / "nodes" / "fail.json").read_text())
    believed = inv(tmp_path, *TRAIN, "--exclude-from", preflight)
    assert believed.returncode == 0, believed.stderr[-3000:]
    assert "#SBATCH --exclude=n7" in believed.stdout
    data = json.loads((preflight / "nodes" / "fail.json").read_text())
    data["n1"] = ["added by hand"]                 # one more host left out than preflight found
    (preflight / "nodes" / "fail.json").write_text(json.dumps(data))
    refused = inv(tmp_path, *TRAIN, "--exclude-from", preflight)
    one_line_error(refused, f"--exclude-from {preflight}", "nodes/fail.json does not match its own checksum")
    data.pop(SEAL)                                  # a list written before node lists were sealed
    (preflight / "nodes" / "fail.json").write_text(json.dumps(data))
    old = inv(tmp_path, *TRAIN, "--exclude-from", preflight)
    assert old.returncode == 0 and "#SBATCH --exclude=n1,n7" in old.stdout, old.stderr[-3000:]


def test_jobend_keeps_the_seal_of_a_run_it_records(sealed_demo, tmp_path):
    project, run_dir = sealed_demo
    copy = _copy(project, run_dir, "submitted", lambda p: None)
    data = json.loads((copy / "metadata.json").read_text())
    from core.files import seal
    data.update(status="submitted")
    (copy / "metadata.json").write_text(json.dumps(seal(data)))
    import sys
    done = subprocess.run([sys.executable, "-m", "runtime.runs.jobend", str(copy), "0"], capture_output=True,
                          text=True, cwd=project)
    assert done.returncode == 0, done.stderr
    shown = in_project(project, "snapshot.show", str(copy), "--json")
    assert shown.returncode == 0, explain(shown)
    assert json.loads(shown.stdout)["metadata"]["status"] == "ok"


def test_a_config_copy_changed_since_the_run_is_not_replayed_nor_expanded(sealed_demo):
    project, run_dir = sealed_demo
    copy = _copy(project, run_dir, "bomb", lambda p: (p / "configs" / "demo.yaml").write_text(alias_bomb(8, 10)))
    import time
    started = time.monotonic()
    shown = in_project(project, "snapshot.show", str(copy), "--json")
    assert shown.returncode == 0, explain(shown)
    assert "aliases expand to more than" in json.loads(shown.stdout)["configs"]["demo.yaml"]
    diffed = in_project(project, "snapshot.diff", str(run_dir), str(copy))
    assert diffed.returncode == 0 and "aliases expand" in diffed.stdout, explain(diffed)
    assert time.monotonic() - started < 30
    (project / "cfg.yaml").write_text("say: from-file\n")   # a run whose config copy a replay passes on
    made = in_project(project, "demo.hello", "--config", "cfg.yaml", "--name", "filed")
    assert made.returncode == 0, explain(made)
    filed = runs(project)[-1]
    (filed / "configs" / "demo.yaml").write_text("say: edited\n")
    refused = in_project(project, "snapshot.replay", str(filed))
    one_line_error(refused, f"{filed / 'configs' / 'demo.yaml'}: changed since the run wrote it")
