"""What a newcomer sees that is not theirs to fix: warnings every run prints.

Anvil starts its own programs as `python -m PACKAGE.MODULE` (a Slurm step, the SSH far end, the
agent, the batch script's helpers, a node's share of data.prepare, hooks). When importing the
package already imports the module, runpy warns before running it ("'x' found in sys.modules
after import of package ..."): under Slurm once per node of every launch. And the test cluster's hosts
name each other (below), as torch's c10d asks of every rank of a multi-node run.
"""
from __future__ import annotations

import ast
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.program import REPO

FOLDERS = ("runtime", "trainer", "benchmarks", "envs", "core", "kernels")


def _main_modules() -> list[str]:
    """Every module of the layers that runs as `python -m` (it has `if __name__ == "__main__"`), and the
    packages with a __main__.py, by dotted name."""
    found = []
    for folder in FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            if path.name == "__main__.py":
                found.append(".".join(path.parent.relative_to(REPO).parts) + ".__main__")
                continue
            tree = ast.parse(path.read_text())
            if any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) for node in tree.body):
                found.append(".".join(path.with_suffix("").relative_to(REPO).parts))
    return found


def test_the_modules_anvil_launches_are_found():
    modules = _main_modules()
    for launched in ("runtime.cluster.slurm.step", "runtime.cluster.slurm.nodetask", "runtime.cluster.ssh.remote",
                     "runtime.launch.agent", "runtime.runs.jobend", "trainer.__main__", "trainer.data.node"):
        assert launched in modules


@pytest.mark.parametrize("module", _main_modules())
def test_python_m_runs_a_module_its_package_did_not_import_first(module):
    """`python -m X` imports X's package, then runs X: a package that imported X already makes runpy warn
    ('found in sys.modules ... prior to execution'), and the module runs twice over."""
    package = module.rpartition(".")[0]
    probe = (f"import importlib, sys\nimportlib.import_module({package!r})\n"
             f"print({module!r} in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False", f"importing {package} imports {module} before `python -m {module}` runs it"


# ---- c10d: "[c10d] The hostname of the client socket cannot be retrieved. err=-3" -----------------
#
# Every rank's TCPStore client connects to the master over a dual-stack socket (::ffff:<IPv4>) and names
# it with getnameinfo, which looks an IPv4-mapped address up as IPv6: a machine whose /etc/hosts does not
# name it asks DNS, and the test cluster's namespaces reach no DNS server (EAI_AGAIN, -3): one warning
# per rank of every multi-node run. Their hosts file names every host in both forms (tests/helpers/cluster.py).
# The runs themselves: test_ssh_train and test_slurm_train check that no warning is printed.

NAME_OF = ("import socket, sys\n"
           "print(' '.join(socket.getnameinfo((a, 0), 0)[0] for a in sys.argv[1:]))")


def _names(run, python: str, addresses: list[str]) -> str:
    done = run(f"{python} -c {shlex.quote(NAME_OF)} {' '.join(addresses)}")
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_the_ssh_hosts_name_each_other_as_c10d_asks(netns_cluster):
    python = REPO / ".venv" / "bin" / "python"
    addresses = [a for h in netns_cluster.hosts for a in (h.address, f"::ffff:{h.address}")]
    expected = " ".join(h.name for h in netns_cluster.hosts for _ in range(2))
    for host in netns_cluster.hosts:
        assert _names(lambda command: netns_cluster.ssh(host, command), python, addresses) == expected


def test_the_slurm_nodes_name_each_other_as_c10d_asks(slurm_cluster):
    python = REPO / ".venv" / "bin" / "python"
    addresses = [f"::ffff:{h.address}" for h in slurm_cluster.hosts]
    said = _names(lambda command: slurm_cluster.slurm_run("srun", "-N2", "bash", "-c", command), python, addresses)
    assert said.splitlines() == [" ".join(h.name for h in slurm_cluster.hosts)] * 2
