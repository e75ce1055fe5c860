"""snapshot.list/show/diff/replay through the installed inv (runtime/runs/replay.py, runtime/runs/history.py)."""
from __future__ import annotations

import json

import pytest

from runtime.runs import replay
from core.files import seal
from helpers.program import anvil_context, explain, run_inv, runs
from helpers.project import in_project, make_project


@pytest.fixture(scope="module")
def recorded_demo(tmp_path_factory):
    """A project with one recorded run of demo.hello (config file + --env + fan-out flags)."""
    project = make_project(tmp_path_factory.mktemp("replay"))
    config = project / "cfg.yaml"
    config.write_text("say: from-file\n")
    result = in_project(project, "-i", "/nonexistent/key", "demo.hello", "--config", "cfg.yaml", "--name", "orig",
                        "--env", "DEMO_LAYER=cli")
    assert result.returncode == 0, explain(result)
    config.write_text("say: changed-since\n")          # the replay must use the recorded copy
    (run_dir,) = runs(project)
    return project, run_dir


def test_plan_swaps_config_drops_fanout_flags_and_keeps_env(recorded_demo):
    project, run_dir = recorded_demo
    plan = replay.plan(run_dir)
    assert plan.argv == ["demo.hello", "--config", str(run_dir / "configs" / "demo.yaml"), "--name", "orig",
                         "--env", "DEMO_LAYER=cli"]
    assert any("-i /nonexistent/key" in note for note in plan.dropped)
    assert plan.env["DEMO_LAYER"] == "cli" and "ANVIL_HOST" not in plan.env


def test_list_show_and_diff(recorded_demo):
    project, run_dir = recorded_demo
    listed = in_project(project, "snapshot.list", "--json")
    rows = json.loads(listed.stdout)
    assert [(r["task"], r["name"], r["status"]) for r in rows] == [("demo.hello", "orig", "ok")]
    shown = in_project(project, "snapshot.show", run_dir.name)
    assert shown.returncode == 0 and "demo.hello" in shown.stdout and "DEMO_LAYER" in shown.stdout
    missing = in_project(project, "snapshot.show", "runs/nope")
    assert missing.returncode == 2 and "no such run directory" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_replay_matches_here_then_refuses_a_different_machine_unless_forced(recorded_demo):
    project, run_dir = recorded_demo
    ok = in_project(project, "snapshot.replay", str(run_dir))
    assert ok.returncode == 0, explain(ok)
    assert "matches the recorded one" in ok.stdout
    assert json.loads([l for l in ok.stdout.splitlines() if l.startswith("{")][0])["said"] == "from-file"
    new = runs(project)[-1]
    md = json.loads((new / "metadata.json").read_text())
    assert md["replay_of"] == str(run_dir) and (new / "replay_of").resolve() == run_dir
    env = json.loads((new / "env.json").read_text())["vars"]
    assert env["DEMO_LAYER"]["value"] == "cli" and env["DEMO_LAYER"]["source"].startswith("replay:")

    diffed = in_project(project, "snapshot.diff", str(run_dir), str(new), "--json")
    kinds = {(r["kind"], r["key"]) for r in json.loads(diffed.stdout)}
    assert ("config", "demo.yaml:say") not in kinds and ("run", "argv") in kinds

    machine = json.loads((run_dir / "machine.json").read_text())
    machine["gpu"] = {**machine.get("gpu", {}), "vendor": "rocm", "model": "MI300X", "count": 8,
                      "driver": "6.10.5"}
    (run_dir / "machine.json").write_text(json.dumps(seal(machine)))   # as recorded on that machine
    before = len(runs(project))
    refused = in_project(project, "snapshot.replay", str(run_dir))
    assert refused.returncode == 2, explain(refused)
    assert "replay refused" in refused.stderr and "gpu.model" in refused.stderr
    assert "MI300X" in refused.stdout and len(runs(project)) == before
    assert "would replay: inv demo.hello" in refused.stdout and "replaying:" not in refused.stdout
    forced = in_project(project, "snapshot.replay", str(run_dir), "--force")
    assert forced.returncode == 0, explain(forced)
    assert len(runs(project)) == before + 1


def _training_run_with_config(tmp_path, source: str, argv: list[str]):
    """A recorded train.pretrain run whose config came from `source` (its copy in RUN/configs/train.yaml)."""
    from runtime.runs.run import RunSpec, execute
    ctx = anvil_context(tmp_path / "runs")
    spec = RunSpec(task="train.pretrain", configs={"train.yaml": {"optim": {"lr": 0.5}}},
                   config_sources={"train.yaml": source}, config_options={"train.yaml": "--config"}, argv=argv)
    execute(ctx, spec, lambda run: None)
    (run_dir,) = runs(tmp_path)
    return run_dir


def test_replay_passes_the_recorded_config_when_the_run_used_the_default(tmp_path):
    run_dir = _training_run_with_config(tmp_path, "configs/tiny.yaml", ["inv", "train.pretrain", "--set",
                                                                          "optim.lr=0.5"])
    plan = replay.plan(run_dir)
    assert plan.argv == ["train.pretrain", "--set", "optim.lr=0.5", "--config", str(run_dir / "configs" / "train.yaml")]


def _recorded_run(tmp_path, argv: list[str], task: str, **extra):
    from runtime.runs.run import RunSpec, execute
    ctx = anvil_context(tmp_path / "runs")
    execute(ctx, RunSpec(task=task, argv=argv, extra=extra), lambda run: None)
    (run_dir,) = runs(tmp_path)
    return run_dir


def test_a_tasks_own_hosts_option_and_its_dash_h_input_are_replayed(tmp_path):
    """-H is dropped where it fanned a task out; a task's own --hosts, and -H where the task took it
    as its input (preflight.comm reaches the hosts itself: no fan-out run), are kept."""
    own = _recorded_run(tmp_path / "a", ["inv", "preflight.comm", "--hosts", "n1,n2"], "preflight.comm")
    assert replay.plan(own).argv == ["preflight.comm", "--hosts", "n1,n2"]
    given = _recorded_run(tmp_path / "b", ["inv", "-i", "k", "-H", "n1,n2", "preflight.comm"], "preflight.comm")
    assert replay.plan(given).argv == ["-i", "k", "-H", "n1,n2", "preflight.comm"]
    fanned = _recorded_run(tmp_path / "c", ["inv", "-i", "k", "-H", "n1,n2", "preflight.all"], "preflight.all",
                           fanout="ssh")
    plan = replay.plan(fanned)
    assert plan.argv == ["preflight.all"] and "dropped -H n1,n2" in plan.dropped


def test_a_slurm_training_run_replays_on_as_many_nodes(tmp_path):
    run_dir = _recorded_run(tmp_path, ["inv", "train.pretrain", "--set", "train.steps=4"], "train.pretrain",
                            runtime="slurm", nodes=2, world_size=4)
    plan = replay.plan(run_dir)
    assert plan.argv[:3] == ["train.pretrain", "--set", "train.steps=4"]
    assert plan.argv[-4:] == ["--runtime", "slurm", "--nodes", "2"]
    assert "added --nodes 2 (the run had 2 node(s), world size 4)" in plan.dropped
    recorded_demo = plan.recorded
    assert replay.check_topology(recorded_demo, {}) == []                                  # sbatch asks for 2
    assert replay.check_topology(recorded_demo, {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2"}) == []
    (short,) = replay.check_topology(recorded_demo, {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1"})
    assert (short.item, short.recorded, short.here, short.blocking) == ("nodes", "2", "1 (Slurm job 7)", True)
    # given on the command line: kept as typed; a one-node direct run pins nothing
    typed = _recorded_run(tmp_path / "t", ["inv", "train.pretrain", "--runtime", "slurm", "--nodes", "1"],
                          "train.pretrain", runtime="slurm", nodes=1)
    assert replay.plan(typed).argv[1:] == ["--runtime", "slurm", "--nodes", "1"]
    direct = _recorded_run(tmp_path / "d", ["inv", "train.pretrain"], "train.pretrain", runtime="direct", nodes=1)
    assert replay.plan(direct).argv[:1] == ["train.pretrain"] and "--nodes" not in replay.plan(direct).argv


def test_resume_auto_replays_from_the_checkpoint_the_run_found_or_fresh(tmp_path):
    """Resolving 'auto' again would pick whatever is newest today (another run's, or the run's own
    last checkpoint, which makes the replay 'already complete')."""
    found = str(tmp_path / "runs" / "older_train.pretrain_tiny" / "checkpoints" / "step_20")
    resumed = _recorded_run(tmp_path / "a", ["inv", "train.pretrain", "--resume", "auto", "--set", "train.steps=40"],
                            "train.pretrain", resume=found)
    plan = replay.plan(resumed)
    assert plan.argv == ["train.pretrain", "--resume", found, "--set", "train.steps=40"]
    assert f"--resume auto -> --resume {found} (the checkpoint the run resumed from)" in plan.dropped
    fresh = _recorded_run(tmp_path / "b", ["inv", "train.pretrain", "--resume=auto"], "train.pretrain", resume="auto")
    plan = replay.plan(fresh)
    assert plan.argv == ["train.pretrain"] and "dropped --resume auto (the run found no checkpoint and started " \
                                                  "fresh)" in plan.dropped


def test_a_run_whose_config_copy_is_gone_is_not_replayed_with_another_config(tmp_path):
    run_dir = _training_run_with_config(tmp_path, "configs/llama3_1b.yaml", ["inv", "train.pretrain", "--config",
                                                                               "configs/llama3_1b.yaml"])
    (run_dir / "configs" / "train.yaml").unlink()
    with pytest.raises(replay.ReplayError, match=r"its copy of the config it ran with \(configs/train.yaml, from "
                                                 r"configs/llama3_1b.yaml\) is missing; the run directory is damaged"):
        replay.plan(run_dir)
    result = run_inv("snapshot.replay", str(run_dir), cwd=tmp_path, clean=True)
    assert result.returncode == 2 and "is missing; the run directory is damaged" in result.stderr, explain(result)
    assert "Traceback" not in result.stderr and len(runs(tmp_path)) == 1


def test_diff_says_when_two_runs_ran_on_different_numbers_of_processes(tmp_path):
    from runtime.runs import history
    one = _recorded_run(tmp_path / "a", ["inv", "train.pretrain"], "train.pretrain", world_size=1, nodes=1,
                        runtime="direct")
    two = _recorded_run(tmp_path / "b", ["inv", "train.pretrain"], "train.pretrain", world_size=2, nodes=1,
                        runtime="direct")
    rows = {(r["kind"], r["key"]): (r["a"], r["b"]) for r in history.diff(history.load(one), history.load(two))}
    assert rows[("run", "world_size")] == ("1", "2") and ("run", "nodes") not in rows
