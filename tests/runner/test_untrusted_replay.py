"""A run directory from elsewhere is data, never code (issue 44): snapshot.replay applies no variable that
loads code from a foreign run's command line (--env, --set env.NAME), its config copy's env: block, its
env.json or an -f file of someone else's, unless --trust-run; --dry-run names each with where it came
from and says why the run is or is not trusted. A run is the user's own when its records are sealed
with the user's run key (runtime/runs/trust.py); an unkeyed, foreign-keyed or missing seal reads as
untrusted, never as an error."""
from __future__ import annotations

import json
import os
import shutil
import stat

import pytest

from core.files import KEYED_SEAL, SEAL, seal
from helpers.program import explain, inv, runs
from helpers.project import in_project, make_project

SMALL_GEMM = ["bench.gemm", "-M", "32", "-N", "32", "-K", "32", "--iters", "1", "--dtype", "fp32"]


def _reseal_record(run_dir, name, change=lambda data: None, key=None):
    """An edit as someone else makes it: the checksum recomputed (anyone can), with no key or theirs."""
    data = json.loads((run_dir / name).read_text())
    data.pop(KEYED_SEAL, None)
    change(data)
    (run_dir / name).write_text(json.dumps(seal(data, key), indent=2))


def _sitecustomize(folder, marker):
    """A folder that, on PYTHONPATH, makes every Python started with it write `marker`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    return folder


def _listed(dry) -> list[str]:
    return [line.strip() for line in dry.stdout.splitlines() if line.startswith("  ")]


@pytest.fixture(scope="module")
def gemm_run(tmp_path_factory):
    """A bench.gemm run of this user's (its child process gets the run's environment)."""
    cwd = tmp_path_factory.mktemp("gemm")
    made = inv(cwd, *SMALL_GEMM, timeout=300)
    assert made.returncode == 0, made.stdout + made.stderr[-3000:]
    (run_dir,) = runs(cwd)
    return cwd, run_dir


def test_an_env_flag_added_to_a_foreign_runs_command_line_is_left_out(gemm_run, tmp_path):
    cwd, original = gemm_run
    run_dir = cwd / "runs" / (original.name + "-env")
    shutil.copytree(original, run_dir)
    marker = tmp_path / "pythonpath-ran"
    evil = _sitecustomize(tmp_path / "py", marker)
    planted = ["--env", f"PYTHONPATH={evil}", f"--env=LD_PRELOAD={tmp_path / 'evil.so'}", "--env", "DEMO_PLAIN=1"]
    _reseal_record(run_dir, "metadata.json", lambda d: d.update(argv=d["argv"] + planted))

    dry = inv(cwd, "snapshot.replay", run_dir, "--dry-run")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "untrusted: metadata.json sealed without a key" in dry.stdout, dry.stdout
    listed = _listed(dry)
    assert any(line.startswith(f"--env PYTHONPATH={evil} (from the command line (--env)): where Python finds code")
               for line in listed), listed
    assert any(line.startswith(f"--env=LD_PRELOAD={tmp_path / 'evil.so'} (from the command line (--env))")
               or line.startswith(f"--env LD_PRELOAD={tmp_path / 'evil.so'} (from the command line (--env))")
               for line in listed), listed
    assert not any("DEMO_PLAIN" in line for line in listed)
    command = dry.stdout.split("would replay: inv ")[1]
    assert "PYTHONPATH" not in command and "LD_PRELOAD" not in command and "DEMO_PLAIN=1" in command
    assert "names nothing that can run code" not in dry.stdout

    replayed = inv(cwd, "snapshot.replay", run_dir, timeout=300)
    out = replayed.stdout + replayed.stderr
    assert replayed.returncode == 0, out[-3000:]
    assert f"note: left out --env PYTHONPATH={evil} (where Python finds code" in replayed.stdout
    assert not marker.exists(), "the replay ran the run's sitecustomize.py"
    assert "cannot be preloaded" not in out, "the replay gave the benchmark the run's LD_PRELOAD"
    env = json.loads((runs(cwd)[-1] / "env.json").read_text())["vars"]
    assert "PYTHONPATH" not in env and "LD_PRELOAD" not in env and env["DEMO_PLAIN"]["value"] == "1"


def test_trust_run_gives_the_foreign_runs_variables_back(gemm_run, tmp_path):
    cwd, original = gemm_run
    run_dir = cwd / "runs" / (original.name + "-trusted")
    shutil.copytree(original, run_dir)
    marker = tmp_path / "pythonpath-ran"
    evil = _sitecustomize(tmp_path / "py", marker)
    _reseal_record(run_dir, "metadata.json", lambda d: d.update(argv=d["argv"] + ["--env", f"PYTHONPATH={evil}"]))
    replayed = inv(cwd, "snapshot.replay", run_dir, "--trust-run", timeout=300)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr[-3000:]
    assert marker.exists()


def test_a_config_env_block_of_a_foreign_run_is_left_out_by_the_replaying_task(tmp_path):
    """The config copy goes to the task as written (its checksum is sealed): the replaying task itself
    leaves out what in its env: block can run code, and says so in the new run's env.json."""
    from invoke import Context

    from runtime.program.cli import AnvilConfig
    from runtime.runs.run import RunSpec, execute
    from trainer import config as config_mod

    marker = tmp_path / "pythonpath-ran"
    evil = _sitecustomize(tmp_path / "py", marker)
    cfg = config_mod.load(config_mod.DEFAULT_CONFIG).to_dict()
    cfg["env"] = {"PYTHONPATH": str(evil), "DEMO_PLAIN": "kept"}
    cfg["data"]["path"] = "synthetic"
    sets = ["data.path=synthetic", "train.steps=1", "data.seq_len=16", "data.batch_size=2", "model.dim=32",
            "model.n_layers=1", "model.ffn_dim=64", "train.val_interval=0", "train.val_batches=0",
            "schedule.warmup_steps=0", "checkpoint.interval=0"]
    argv = ["inv", "train.pretrain", "--nproc", "1"] + [t for s in sets for t in ("--set", s)]
    ctx = Context(config=AnvilConfig(overrides={"anvil": {"runs_dir": str(tmp_path / "runs")}}))
    execute(ctx, RunSpec(task="train.pretrain", configs={"train.yaml": cfg},
                         config_sources={"train.yaml": "configs/tiny.yaml"}, config_options={"train.yaml": "--config"},
                         argv=argv, hooks=False), lambda run: None)
    (run_dir,) = runs(tmp_path)
    for name in ("metadata.json", "env.json"):   # as copied from elsewhere: sealed without this user's key
        _reseal_record(run_dir, name)

    dry = inv(tmp_path, "snapshot.replay", run_dir, "--dry-run")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert any(line.startswith(f"env PYTHONPATH={evil} (from configs/train.yaml (env:))") for line in _listed(dry)), \
        dry.stdout
    assert f"note: left out env PYTHONPATH={evil} (where Python finds code" in dry.stdout

    replayed = inv(tmp_path, "snapshot.replay", run_dir, timeout=300)
    assert replayed.returncode == 0, replayed.stdout[-2000:] + replayed.stderr[-3000:]
    assert not marker.exists(), "the trainer ran the config's sitecustomize.py"
    new = runs(tmp_path)[-1]
    env = json.loads((new / "env.json").read_text())
    assert "PYTHONPATH" not in env["vars"] and env["vars"]["DEMO_PLAIN"]["value"] == "kept"
    assert any(w.startswith(f"replay: left out PYTHONPATH={evil} (from config:") for w in env["warnings"]), env


# ---- trust: the user's own runs, by their key ------------------------------------------------------

@pytest.fixture
def own_run(tmp_path):
    """A demo.hello run the user made with a PYTHONPATH of theirs (the replaying inv gets it)."""
    project = make_project(tmp_path / "p")
    marker = tmp_path / "pythonpath-ran"
    mine = _sitecustomize(tmp_path / "mine", marker)
    made = in_project(project, "demo.hello", "--env", f"PYTHONPATH={mine}")
    assert made.returncode == 0, explain(made)
    (run_dir,) = runs(project)
    return project, run_dir, marker


def test_a_run_sealed_with_your_key_is_yours_and_replays_its_variables(own_run, own_run_key):
    project, run_dir, marker = own_run
    assert stat.S_IMODE(own_run_key.stat().st_mode) == 0o600            # made on first use, for its user only
    assert stat.S_IMODE(own_run_key.parent.stat().st_mode) == 0o700
    for name in ("metadata.json", "env.json", "machine.json", "versions.json", "git.json"):
        assert KEYED_SEAL in json.loads((run_dir / name).read_text()), name
    dry = in_project(project, "snapshot.replay", str(run_dir), "--dry-run")
    assert "trusted: sealed with your run key: made by you" in dry.stdout, explain(dry)
    assert "(replayed: sealed with your run key: made by you)" in dry.stdout
    replayed = in_project(project, "snapshot.replay", str(run_dir))
    assert replayed.returncode == 0, explain(replayed)
    assert marker.exists()


def test_your_key_vouches_for_the_records_not_for_files_they_name(tmp_path):
    """A --patch file of your own run may have changed since: it still needs --trust-run."""
    project = make_project(tmp_path / "p")
    marker = tmp_path / "patch-ran"
    patch = tmp_path / "patch.py"
    patch.write_text(f"def hook(ctx):\n    open({str(marker)!r}, 'w').write('ran')\n")
    mine = _sitecustomize(tmp_path / "mine", tmp_path / "pythonpath-ran")
    made = in_project(project, "demo.hello", "--env", f"PYTHONPATH={mine}", "--patch", str(patch))
    assert made.returncode == 0 and marker.exists(), explain(made)
    marker.unlink()
    (run_dir,) = runs(project)
    dry = in_project(project, "snapshot.replay", str(run_dir), "--dry-run")
    assert ("the run directory names 3 thing(s) that can run code (2 replayed: sealed with your run key: made by "
            "you; the rest left out without --trust-run)") in dry.stdout, explain(dry)
    assert any(line.startswith(f"--patch {patch}") and line.endswith("[left out]") for line in _listed(dry))
    assert any(line.startswith(f"env PYTHONPATH={mine}") and line.endswith("[replayed]") for line in _listed(dry))
    replayed = in_project(project, "snapshot.replay", str(run_dir))
    assert replayed.returncode == 0, explain(replayed)
    assert not marker.exists() and (tmp_path / "pythonpath-ran").exists()


@pytest.mark.parametrize("how, said", [
    ("unkeyed", "metadata.json sealed without a key (made elsewhere, or before runs were keyed)"),
    ("other key", "metadata.json sealed with another key"),
    ("no seal", "metadata.json not sealed"),
])
def test_a_resealed_or_foreign_or_unsealed_record_is_untrusted_not_an_error(own_run, how, said):
    project, run_dir, marker = own_run
    data = json.loads((run_dir / "metadata.json").read_text())
    data.pop(KEYED_SEAL)
    if how == "no seal":
        data.pop(SEAL)
    else:
        data = seal(data, os.urandom(32) if how == "other key" else None)
    (run_dir / "metadata.json").write_text(json.dumps(data))
    shown = in_project(project, "snapshot.show", str(run_dir))
    assert shown.returncode == 0, explain(shown)
    dry = in_project(project, "snapshot.replay", str(run_dir), "--dry-run")
    assert dry.returncode == 0, explain(dry)
    assert f"untrusted: {said}" in dry.stdout, dry.stdout
    assert "(left out without --trust-run)" in dry.stdout
    replayed = in_project(project, "snapshot.replay", str(run_dir))
    assert replayed.returncode == 0, explain(replayed)
    assert "note: left out env PYTHONPATH=" in replayed.stdout and not marker.exists()


def test_an_env_json_resealed_in_a_run_of_yours_makes_it_untrusted(own_run):
    project, run_dir, marker = own_run
    _reseal_record(run_dir, "env.json")
    dry = in_project(project, "snapshot.replay", str(run_dir), "--dry-run")
    assert "untrusted: env.json sealed without a key" in dry.stdout, explain(dry)
    assert in_project(project, "snapshot.replay", str(run_dir)).returncode == 0
    assert not marker.exists()


def test_a_clean_foreign_run_is_not_called_safe_beyond_what_was_checked(own_run):
    project, run_dir, _marker = own_run
    _reseal_record(run_dir, "env.json", lambda d: d["vars"].pop("PYTHONPATH"))
    _reseal_record(run_dir, "metadata.json", lambda d: d.update(argv=[a for a in d["argv"] if "PYTHONPATH" not in a
                                                                and a != "--env"]))
    dry = in_project(project, "snapshot.replay", str(run_dir), "--dry-run")
    assert dry.returncode == 0, explain(dry)
    assert "untrusted: env.json, metadata.json sealed without a key" in dry.stdout
    assert ("the run directory names nothing that can run code among what a replay checks: variables that load "
            "code (env.json, --env, --set env.*, the configs' env: blocks), --patch, -c/-r, -f settings files and "
            "the working directory") in dry.stdout


# ---- the key and the list of variables ------------------------------------------------------------

def test_the_key_is_found_where_the_user_config_is(tmp_path, monkeypatch):
    from runtime.runs import trust
    assert trust.key_path({"XDG_CONFIG_HOME": str(tmp_path)}) == tmp_path / "anvil" / "run-key"
    assert trust.key_path({"XDG_CONFIG_HOME": "relative"}).parent.parent.name == ".config"   # XDG: absolute only
    assert trust.key_path({trust.KEY_ENV: str(tmp_path / "k"), "XDG_CONFIG_HOME": "/x"}) == tmp_path / "k"


def test_a_key_others_can_read_is_no_key(tmp_path, monkeypatch):
    from runtime.runs import trust
    key = tmp_path / "run-key"
    monkeypatch.setenv(trust.KEY_ENV, str(key))
    monkeypatch.setattr(trust, "_KEYS", {})
    made, problem = trust.run_key()
    assert made and not problem and stat.S_IMODE(key.stat().st_mode) == 0o600
    assert trust.run_key() == (made, "")             # the same key every time (and for every process)
    key.chmod(0o644)
    monkeypatch.setattr(trust, "_KEYS", {})
    assert trust.run_key() == (None, f"{key} can be read or written by others (chmod 600 {key})")
    assert KEYED_SEAL not in seal({"a": 1}, trust.run_key()[0])


@pytest.mark.parametrize("name", ["LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "PYTHONPATH", "PYTHONSTARTUP",
                                  "PYTHONHOME", "PYTHONUSERBASE", "BASH_ENV", "ENV", "PERL5LIB", "NODE_OPTIONS",
                                  "SITE_HOOKS_DIR", "ANVIL_TASKS_PATH", "GIT_CONFIG_COUNT", "HOME",
                                  "GCONV_PATH", "OPENSSL_CONF", "NCCL_NET_PLUGIN", "XDG_CONFIG_HOME", "ANVIL_RUN_KEY"])
def test_one_list_names_every_variable_that_loads_code(name):
    from runtime.runs import trust
    assert trust.executes(name)


def test_a_settings_file_of_someone_elses_that_sets_a_ranks_environment_needs_trust(tmp_path):
    from runtime.runs import trust
    settings = tmp_path / "s.yaml"
    settings.write_text(f"anvil:\n  container_extra: -e LD_PRELOAD={tmp_path / 'x.so'}\n")
    settings.chmod(0o644)
    assert trust.settings_file(settings) == ""                                  # your own
    assert "anvil.container_extra" in trust.settings_file(settings, within=tmp_path)   # came with the run
    settings.chmod(0o666)
    assert "anvil.container_extra" in trust.settings_file(settings)             # others can write it
