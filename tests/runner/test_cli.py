"""The installed `inv` program: Invoke users' expectations plus -H (runtime/program/cli.py, runtime/program/shim.py),
and a stop signal to a task that makes no run (runtime/program/interrupts.py)."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from helpers.interrupts import SIGNAL_NAME, ended, send
from helpers.processes import wait_until
from helpers.program import INV, REPO, assert_no_traceback, explain, inv_environ, run_inv, start_inv
from helpers.project import in_project


def test_list_has_all_seven_collections_without_torch_or_paramiko():
    env = {"PYTHONPROFILEIMPORTTIME": "1"}
    result = run_inv("--list", "--list-format", "json", clean=True, env=env)
    assert result.returncode == 0, explain(result)
    names = {c["name"] for c in json.loads(result.stdout)["collections"]}
    assert {"env", "preflight", "data", "train", "bench", "profile", "snapshot"} <= names
    imported = {line.split("|")[-1].strip().split(".")[0] for line in result.stderr.splitlines()
                if line.startswith("import time:")}
    assert "invoke" in imported                       # the profile really was taken
    assert not imported & {"torch", "paramiko", "fabric"}, sorted(imported & {"torch", "paramiko", "fabric"})
    helped = run_inv("--help", "train.pretrain", clean=True, env=env)
    assert helped.returncode == 0 and "--config" in helped.stdout, explain(helped)
    assert not {line.split("|")[-1].strip().split(".")[0] for line in helped.stderr.splitlines()
                if line.startswith("import time:")} & {"torch", "paramiko", "fabric"}


def test_help_of_a_task_and_h_not_shadowed(project):
    helped = in_project(project, "--help", "demo.shape")
    assert helped.returncode == 0, explain(helped)
    assert "--hidden-size" in helped.stdout and "--heads" in helped.stdout
    # hidden_size's auto short flag would have been -h: it must print help instead.
    short = in_project(project, "demo.shape", "-h")
    assert short.returncode == 0, explain(short)
    assert "Usage: inv" in short.stdout and "hidden_size=" not in short.stdout
    assert "-h INT" not in helped.stdout
    ran = in_project(project, "demo.shape", "--hidden-size", "7")
    assert "hidden_size=7" in ran.stdout, explain(ran)


def test_help_after_a_task_that_takes_a_positional_argument(tmp_path):
    """`inv snapshot.show --help` is the task's help, not a run named --help; and a float option's
    bad value says it expects a number."""
    for argv in (["snapshot.show", "--help"], ["snapshot.diff", "-h"], ["snapshot.show", "some-run", "--help"]):
        helped = run_inv(*argv, runs=tmp_path / "runs", clean=True)
        assert helped.returncode == 0 and f"inv [--core-opts] {argv[0]} [--options]" in helped.stdout, explain(helped)
    assert not (tmp_path / "runs").exists()
    bad = run_inv("preflight.perf", "--timeout", "2m", runs=tmp_path / "runs", clean=True)
    assert bad.returncode == 2 and "--timeout: expected a number, got '2m'" in bad.stderr, explain(bad)


def test_a_mistyped_task_gets_the_closest_names():
    typo = run_inv("train.pretrian", clean=True)
    assert typo.returncode == 2 and "(did you mean train.pretrain" in typo.stderr, explain(typo)
    nothing = run_inv("zzz", clean=True)
    assert nothing.returncode == 2 and "`inv --list` lists the tasks" in nothing.stderr, explain(nothing)


def test_complete_and_completion_script(project):
    done = in_project(project, "--complete", "--", "inv", "snapshot.")
    assert {"snapshot.list", "snapshot.replay"} <= set(done.stdout.split()), explain(done)
    script = in_project(project, "--print-completion-script", "bash")
    assert "complete -F" in script.stdout and " inv" in script.stdout and "anvil" in script.stdout


def test_settings_from_invoke_yaml_f_file_and_env(project, tmp_path):
    base = json.loads(in_project(project, "demo.settings").stdout)
    assert base["runs_dir"] == str(project / "runs") and base["connect_timeout"] == 3.0
    override = tmp_path / "other.yaml"
    override.write_text("anvil:\n  runs_dir: /srv/runs\n  user: alice\n")
    from_file = json.loads(in_project(project, "-f", str(override), "demo.settings").stdout)
    assert from_file["runs_dir"] == "/srv/runs" and from_file["user"] == "alice"
    from_env = json.loads(in_project(project, "demo.settings", env={"INVOKE_ANVIL_RUNS_DIR": "/env/runs",
                                                                    "INVOKE_ANVIL_CONNECT_TIMEOUT": "7"}).stdout)
    assert from_env["runs_dir"] == "/env/runs" and from_env["connect_timeout"] == 7.0


def test_config_after_a_task_without_that_option_is_an_error(project, tmp_path):
    cfg = tmp_path / "x.yaml"
    cfg.write_text("anvil:\n  user: bob\n")
    result = in_project(project, "demo.settings", "--config", str(cfg))
    assert result.returncode == 2, explain(result)
    assert "has no --config option" in result.stderr and "Traceback" not in result.stderr
    # A task that has --config keeps it.
    ok = in_project(project, "demo.hello", "--config", str(cfg), "--no-hooks")
    assert ok.returncode == 0, explain(ok)


def test_bad_configuration_is_one_message(tmp_path, project):
    (project / "invoke.yaml").write_text("anvil:\n  runs_dir: [unclosed\n")
    broken = in_project(project, "--list")
    (project / "invoke.yaml").write_text("anvil:\n  run_dir: typo\n")
    unknown = in_project(project, "demo.checks")
    missing = in_project(project, "-f", str(tmp_path / "nope.yaml"), "demo.checks")
    for result, text in ((broken, "invalid YAML"), (unknown, "unknown anvil setting(s): run_dir"),
                         (missing, "no such configuration file")):
        assert result.returncode == 2, explain(result)
        assert text in result.stderr and "Traceback" not in result.stderr


def test_anvil_works_from_any_directory(tmp_path):
    result = run_inv("--list", cwd=tmp_path, clean=True, program=INV.with_name("anvil"))
    assert result.returncode == 0, explain(result)
    assert "snapshot.list" in result.stdout


def test_fanout_to_an_unreachable_host_fails_cleanly(project):
    result = in_project(project, "-H", "127.0.0.1:1", "-t", "2", "demo.checks", timeout=60)
    assert result.returncode == 1, explain(result)
    assert "UNREACHABLE" in result.stdout and "failing hosts: 127.0.0.1:1" in result.stdout
    assert "passing hosts: (none)" in result.stdout
    assert "Traceback" not in result.stderr


def test_a_reader_that_leaves_does_not_fail_the_run(tmp_path):
    """`inv preflight.host | head -1`: the task's output has nowhere to go, which is not its failure."""
    proc = subprocess.Popen([str(INV), "preflight.host"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                            env=inv_environ(tmp_path / "runs", clean=True))
    proc.stdout.close()                  # the reader is gone before the first line
    stderr = proc.communicate(timeout=120)[1]
    assert proc.returncode == 0, stderr
    assert "BrokenPipe" not in stderr and "Traceback" not in stderr, stderr
    (run,) = (tmp_path / "runs").iterdir()
    assert json.loads((run / "metadata.json").read_text())["status"] == "ok"


@pytest.mark.parametrize("given", [["--runtime", "slurm"], ["--nodes", "2"]])
def test_dash_h_with_slurm_choosing_the_nodes_is_one_line_before_any_connection(tmp_path, given):
    result = run_inv("-H", "127.0.0.1:1", "-t", "2", "preflight.host", *given, cwd=tmp_path, runs=tmp_path / "runs",
                     clean=True, timeout=60)
    assert result.returncode == 2, explain(result)
    assert result.stderr.strip() == (f"-H: preflight.host {' '.join(given)}: -H already says where it runs (over "
                                     f"SSH, on the hosts named); drop -H to run it on Slurm's nodes, or {given[0]} "
                                     f"to run it on the hosts"), explain(result)
    assert not (tmp_path / "runs").exists() and "UNREACHABLE" not in result.stdout


@pytest.mark.netns
def test_pre_and_post_tasks_run_on_every_host_with_the_task(netns_cluster, project, tmp_path):
    """Not Fabric's way (pre/post once, locally; hosts one after another): each host runs all three."""
    settings = json.loads(netns_cluster.invoke_yaml(project, connect_timeout=5))
    settings["anvil"]["remote_inv"] = str(INV)
    config = tmp_path / "hosts.yaml"
    config.write_text(json.dumps(settings))
    hosts = [h.address for h in netns_cluster.hosts]
    result = in_project(project, "-f", str(config), "-H", ",".join(hosts), "demo.main", timeout=120)
    assert result.returncode == 0, explain(result)
    for host in hosts:
        block = result.stdout.split(f"=== {host} (exit 0) ===\n")[1].split("\n\n")[0]
        assert block.split() == ["pre", "on", host, "main", "on", host, "post", "on", host]
    assert "pre on local" not in result.stdout and "post on local" not in result.stdout
    assert f"passing hosts: {','.join(hosts)}" in result.stdout


def _repack_installed_invoke(dest: Path) -> Path:
    """A wheel of the installed invoke, from its RECORD (offline, what pip would install)."""
    from importlib import metadata
    dist = metadata.distribution("invoke")
    wheel = dest / f"invoke-{dist.version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for file in dist.files:
            path = Path(dist.locate_file(file))
            if str(file).startswith("..") or "__pycache__" in str(file) or not path.is_file():
                continue
            zf.write(path, str(file))
    return wheel


@pytest.mark.slow
def test_inv_survives_a_forced_reinstall_of_invoke(tmp_path):
    """pip rewrites bin/inv to Invoke's script; the .pth shim keeps it Anvil's."""
    venv = tmp_path / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = subprocess.run([str(venv / "bin" / "python"), "-c",
                              "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    # Our code and the main environment's packages as plain path entries (their .pth files,
    # including the main venv's own shim, are NOT processed: this venv stands alone).
    (Path(purelib) / "paths.pth").write_text(f"{REPO}\n{sysconfig.get_paths()['purelib']}\n")
    wheel = _repack_installed_invoke(tmp_path)
    python = str(venv / "bin" / "python")
    subprocess.run([python, "-c", "import runtime.program.shim as s; assert s.ensure_installed()"], check=True, cwd=tmp_path)
    subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index",
                    "--force-reinstall", str(wheel)], check=True, capture_output=True)
    venv_inv = venv / "bin" / "inv"
    assert "from invoke.main import program" in venv_inv.read_text()   # pip wrote Invoke's script

    helped = subprocess.run([str(venv_inv), "-H", "127.0.0.1:1", "--help", "snapshot.list"],
                            capture_output=True, text=True, cwd=REPO)
    assert helped.returncode == 0, helped.stderr
    assert "Usage: inv" in helped.stdout and "snapshot.list" in helped.stdout
    version = subprocess.run([str(venv_inv), "--version"], capture_output=True, text=True, cwd=REPO)
    assert version.stdout.startswith("Anvil")
    top = subprocess.run([str(venv_inv), "--help"], capture_output=True, text=True, cwd=REPO)
    assert "-H STRING, --hosts=STRING" in top.stdout
    # Without the shim the same script is stock Invoke: the .pth is what keeps `inv` ours.
    subprocess.run([python, "-c", "import runtime.program.shim as s; s.remove()"], check=True, cwd=tmp_path)
    stock = subprocess.run([str(venv_inv), "--version"], capture_output=True, text=True, cwd=REPO)
    assert stock.returncode == 0 and "Anvil" not in stock.stdout
    # Other programs in that environment are untouched by the shim.
    other = subprocess.run([str(venv / "bin" / "python"), "-c", "import sys; print('invoke.main' in sys.modules)"],
                           capture_output=True, text=True)
    assert other.stdout.strip() == "False"


@pytest.mark.parametrize("argv, said", [
    (["train.pretrain", "--resume", ""], "train.pretrain: --resume is empty; expected auto or a run directory or "
                                         "checkpoint path"),
    (["train.pretrain", "--name", " "], "train.pretrain: --name is empty; expected a word for "
                                        "runs/<time>_<task>_<name>"),
    (["bench.gemm", "-M", "64", "--patch", ""], "bench.gemm: --patch is empty; expected a .py or .sh hook file"),
    (["bench.gemm", "-M", "64", "--patch", "README.md"],
     "bench.gemm: --patch README.md: expected a .py file with def hook(ctx) or a .sh script"),
])
def test_an_option_given_empty_or_a_patch_that_is_no_hook_is_refused_before_a_run(tmp_path, argv, said):
    """Given empty is not left out: `--resume ''` used to start a fresh full run, `--name ''` to drop the name."""
    result = run_inv(*argv, *(["--dry-run"] if argv[0] == "train.pretrain" else []), runs=tmp_path / "runs", clean=True)
    assert result.returncode == 2 and result.stderr.strip() == said, explain(result)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("content, said", [
    (b"anvil:\n  # runtime: slurm\n",
     "'anvil' must be a mapping of settings (runs_dir, hosts, runtime, ...), got nothing"),
    (b"anvil: 5\n", "'anvil' must be a mapping of settings (runs_dir, hosts, runtime, ...), got int"),
    (b"- a\n", "expected a mapping of settings (e.g. 'anvil:' with keys under it), got a list"),
    (b"\xff\xfe", "not a text file (invalid UTF-8 at byte 0); expected YAML or JSON"),
    (b"anvil:\n  runtim: slurm\n", "unknown anvil setting(s): runtim"),
])
def test_a_malformed_dash_f_file_is_one_line_naming_it(tmp_path, project, content, said):
    """Invoke merged these with a traceback (AmbiguousMergeError, AttributeError, UnicodeDecodeError)."""
    site = tmp_path / "site.yaml"
    site.write_bytes(content)
    result = in_project(project, "-f", str(site), "demo.checks")
    assert result.returncode == 2 and said in result.stderr and "Traceback" not in result.stderr, explain(result)
    assert str(site) in result.stderr      # the file is named, not only invoke.yaml
    folder = in_project(project, "-f", str(tmp_path), "demo.checks")
    assert folder.returncode == 2 and "is a directory; expected a YAML or JSON configuration file" in folder.stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_in_a_task_without_a_run_is_one_line(tmp_path, signum):
    """A task of a site folder (ANVIL_TASKS_PATH) with no handling of its own: Invoke used to end a
    Ctrl-C with exit 1 and no word, and SIGTERM killed it (143, no word)."""
    site = tmp_path / "site"
    site.mkdir()
    started = tmp_path / "started"
    (site / "slow.py").write_text(
        "import time\nfrom pathlib import Path\nfrom invoke import Collection, task\n\n\n@task\n"
        f"def wait(c):\n    Path({str(started)!r}).touch()\n    time.sleep(120)\n\n\nns = Collection('slow')\n"
        "ns.add_task(wait)\n")
    proc = start_inv(tmp_path, "slow.wait", ANVIL_TASKS_PATH=str(site))
    assert wait_until(started.exists, proc, timeout=60)
    send(proc, signum)
    code, out, err = ended(proc)
    assert_no_traceback(out, err)
    assert code == 128 + signum, err
    assert err.strip().splitlines()[-1] == f"slow.wait interrupted ({SIGNAL_NAME[signum]})", err


def test_inv_launches_training_without_importing_torch(tmp_path):
    """The ranks import torch; inv, which checks the config, the data and the memory plan of a dense model
    and launches them (on a login node too), does not: a launch starts a second sooner and inv stays small."""
    task = ["train.pretrain", "--dry-run", "--set", "data.path=synthetic"]
    proc = subprocess.run([sys.executable, "-X", "importtime", str(INV), *task], cwd=REPO,
                          env=inv_environ(tmp_path / "runs"), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "trainer.config" in imported and "torch" not in imported, sorted(m for m in imported if "torch" in m)
