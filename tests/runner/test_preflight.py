"""Preflight: the checks on real and sample sysfs trees, and `inv preflight.*` through the installed inv (a
stop signal while it runs records the run interrupted)."""
from __future__ import annotations

import hashlib
import json
import os
import signal
from pathlib import Path

import pytest

import envs
from envs.detect import machine_from
from envs.probes import amd
from runtime.preflight import FAIL, PASS, WARN, CheckInputs, affinity, run_checks

from helpers.interrupts import interrupted_run, send, sleeping_hook
from helpers.processes import wait_until
from helpers.program import start_inv

# ---- checks on sample trees ----------------------------------------------------------------


def by_name(results):
    return {r.name: r for r in results}


def mi308x_node(root: Path) -> envs.Machine:
    """An AMD node with a GPU Anvil has no profile for (MI308X, gfx942, 0x74a2), read from a KFD tree."""
    node = root / amd.KFD_NODES / "1"
    node.mkdir(parents=True)
    node.joinpath("properties").write_text("simd_count 320\nsimd_per_cu 4\ngfx_target_version 90402\n"
                                           "device_id 29858\nlocation_id 4352\ndomain 0\n")
    return machine_from("amd", amd.read_sysfs(root), None, None, "sysfs")


def test_unknown_gpu_fails_unless_allowed(tmp_path):
    machine = mi308x_node(tmp_path)
    env = envs.resolve(machine, site="none")
    failed = by_name(run_checks(["gpu"], CheckInputs(machine, env, tmp_path, environ={})))
    assert failed["gpu.model"].status == FAIL and "no Anvil profile" in failed["gpu.model"].reason
    assert "--allow-unknown-gpu" in failed["gpu.model"].fix
    allowed = by_name(run_checks(["gpu"], CheckInputs(machine, env, tmp_path, allow_unknown_gpu=True, environ={})))
    assert allowed["gpu.model"].status == WARN
    by_env = by_name(run_checks(["gpu"], CheckInputs(machine, env, tmp_path,
                                                     environ={"ANVIL_ALLOW_UNKNOWN_GPU": "1"})))
    assert by_env["gpu.model"].status == WARN


def test_no_gpu_is_a_warning_unless_required(tmp_path):
    machine = envs.detect()
    env = envs.resolve(machine)
    plain = by_name(run_checks(["gpu"], CheckInputs(machine, env, tmp_path)))
    assert plain["gpu.present"].status == WARN and "no GPU on this machine" in plain["gpu.present"].reason
    required = by_name(run_checks(["gpu"], CheckInputs(machine, env, tmp_path, require_gpu=True)))
    assert required["gpu.present"].status == FAIL


def ib_root(root: Path, ports: dict) -> Path:
    for (device, port), state in ports.items():
        path = root / "sys/class/infiniband" / device / "ports" / str(port)
        path.mkdir(parents=True)
        path.joinpath("state").write_text(state + "\n")
    return root


def test_ib_hca_must_name_active_ports(tmp_path):
    root = ib_root(tmp_path, {("mlx5_0", 1): "4: ACTIVE", ("mlx5_1", 1): "1: DOWN"})
    machine = envs.detect()

    def check(hca):
        env = envs.resolve(machine, overrides=[f"NCCL_IB_HCA={hca}"], context={"environ": {}, "root": root})
        return by_name(run_checks(["network"], CheckInputs(machine, env, tmp_path, root=root, environ={})))

    assert check("mlx5_0:1")["network.ib_hca"].status == PASS
    down = check("mlx5_0:1,mlx5_1:1")["network.ib_hca"]
    assert down.status == FAIL and "mlx5_1:1 is not ACTIVE" in down.reason and "mlx5_0:1" in down.fix
    assert check("mlx9")["network.ib_hca"].status == FAIL
    results = check("mlx5_0")
    assert results["network.rdma"].status == WARN  # one port down
    assert "mlx5_0:1 ACTIVE" in results["network.rdma"].value


def test_affinity_maps_gpus_to_numa_and_spots_the_far_socket(tmp_path):
    # Two sockets: CPUs 0-3 on NUMA0, 4-7 on NUMA1; GPU0 on NUMA1 (LUMI-style crossed wiring).
    for node, cpus in ((0, "0-3"), (1, "4-7")):
        path = tmp_path / f"sys/devices/system/node/node{node}"
        path.mkdir(parents=True)
        path.joinpath("cpulist").write_text(cpus + "\n")
    pci = tmp_path / "sys/bus/pci/devices/0000:c1:00.0"
    pci.mkdir(parents=True)
    pci.joinpath("numa_node").write_text("1\n")
    pci1 = tmp_path / "sys/bus/pci/devices/0000:c6:00.0"
    pci1.mkdir(parents=True)
    pci1.joinpath("numa_node").write_text("0\n")
    machine = envs.synthesize("MI250X:2")  # affinity needs only the GPUs' bus ids
    machine.gpus[0].bus_id, machine.gpus[1].bus_id = "0000:c1:00.0", "0000:c6:00.0"

    def binding(cpus, environ):
        inputs = CheckInputs(machine, None, tmp_path, root=tmp_path, environ=environ, cpus=cpus)
        return by_name(affinity.run(inputs))

    far = binding({0, 1}, {"LOCAL_RANK": "0"})
    assert far["affinity.gpu_numa"].value == "GPU0->NUMA1, GPU1->NUMA0"
    assert far["affinity.binding"].status == WARN and "far socket" in far["affinity.binding"].reason
    assert "--numa-binding" in far["affinity.binding"].fix
    assert binding({4, 5}, {"LOCAL_RANK": "0"})["affinity.binding"].status == PASS
    unbound = binding(set(range(8)), {})["affinity.binding"]
    assert unbound.status == WARN and "not bound" in unbound.reason
    assert affinity.parse_cpulist("0-2,8,10-11") == {0, 1, 2, 8, 10, 11}
    assert affinity.node_cpus(tmp_path, 1) == {4, 5, 6, 7}


def test_a_crashing_check_is_reported_not_raised(tmp_path, monkeypatch):
    from runtime import preflight as checks

    def broken(inputs):
        raise RuntimeError("probe exploded")
    monkeypatch.setitem(checks.CHECKS, "host", broken)
    results = run_checks(["host", "software"], CheckInputs(envs.detect(), envs.resolve(), tmp_path))
    assert results[0].status == FAIL and "probe exploded" in results[0].reason
    assert any(r.name == "software.python" for r in results)


# ---- the installed inv -----------------------------------------------------------------------

def test_preflight_all_on_this_machine(checked_inv, tmp_path):
    result = checked_inv("preflight.all", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(result.stdout)
    assert set(data) >= {"host", "status", "checks"} and data["status"] in (PASS, WARN)
    for check in data["checks"]:
        assert set(check) == {"name", "status", "value", "reason", "fix"} and check["status"] in (PASS, WARN, FAIL)
    names = [c["name"] for c in data["checks"]]
    for group in ("gpu.", "host.", "software.", "network.", "affinity."):
        assert any(n.startswith(group) for n in names), group
    gpu = next(c for c in data["checks"] if c["name"] == "gpu.present")
    assert gpu["status"] == WARN and "no GPU on this machine" in gpu["reason"]
    run_dir = Path(data["run_dir"])
    assert run_dir.parent == tmp_path / "runs" and json.loads((run_dir / "preflight.json").read_text()) == data
    assert json.loads((run_dir / "metadata.json").read_text())["status"] == "ok"

    table = checked_inv("preflight.all")
    assert table.returncode == 0 and "no GPU on this machine" in table.stdout and "software.torch" in table.stdout


def test_preflight_fails_on_a_missing_interface(checked_inv):
    result = checked_inv("preflight.network", "--env", "NCCL_SOCKET_IFNAME=doesnotexist0", check=False)
    assert result.returncode == 1
    assert "network.nccl_ifname  FAIL" in result.stdout and "doesnotexist0" in result.stdout
    assert "fix: use one of:" in result.stdout
    assert "1 check(s) FAIL: network.nccl_ifname" in result.stderr


def test_preflight_require_gpu_fails_here(checked_inv):
    result = checked_inv("preflight.gpu", "--require-gpu", "--json", check=False)
    assert result.returncode == 1
    assert json.loads(result.stdout)["checks"][0]["status"] == FAIL


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR2])
def test_a_signal_during_preflight_records_it_interrupted(tmp_path, signum):
    hook, started = sleeping_hook(tmp_path, "sh")
    proc = start_inv(tmp_path, "preflight.all", "--patch", str(hook))
    assert wait_until(started.exists, proc, timeout=120)
    send(proc, signum)
    interrupted_run(proc, tmp_path, "preflight.all", signum)


# ---- the shipped train.pretrain pre hooks, through the real hook engine ---------------------

def run_pretrain_pre_hooks(repo: Path, config: dict, cwd: Path, run_dir: Path | None = None):
    from runtime.runs import hooks
    ctx = hooks.HookContext(task="train.pretrain", phase="pre", config=config, run_dir=run_dir)
    old = os.getcwd()
    os.chdir(cwd)  # data.path is relative to the working directory
    try:
        return hooks.run_phase(repo / "hooks", ctx)
    finally:
        os.chdir(old)


def test_pretrain_hooks_record_the_dataset_fingerprint(repo, tmp_path):
    (tmp_path / "data/mine").mkdir(parents=True)
    manifest = json.dumps({"tokens": 1234, "fingerprint": "abc", "tokenizer": {"kind": "byte"},
                           "splits": {"train": {"tokens": 1000}, "val": {"tokens": 234}}})
    (tmp_path / "data/mine/manifest.json").write_text(manifest)
    run = tmp_path / "run"
    run.mkdir()
    records = run_pretrain_pre_hooks(repo, {"data": {"path": "data/mine"}}, tmp_path, run)
    # both hooks ran; on this CPU machine the GPUs-idle hook passes with nothing to check
    assert [r.path.name for r in records] == ["10_dataset_fingerprint.py", "20_gpus_idle.py"]
    assert all(r.ok for r in records)
    recorded = json.loads((run / "dataset.json").read_text())
    assert recorded["manifest_sha256"] == hashlib.sha256(manifest.encode()).hexdigest()
    assert recorded["fingerprint"] == "abc" and recorded["splits"] == {"train": 1000, "val": 234}
    assert run_pretrain_pre_hooks(repo, {"data": {"path": "synthetic"}}, tmp_path, run)[0].ok
    assert json.loads((run / "dataset.json").read_text()) == {"path": "synthetic"}
