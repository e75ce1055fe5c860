"""envs.topology and preflight's topology check, on recorded tool outputs (tests/envs/topology/,
SOURCES.md says where each comes from: a real H200 capture, public NVIDIA and AMD examples) and on
a sysfs tree written to disk; `inv env.topology` as a user runs it."""
from __future__ import annotations

import json
from pathlib import Path

from envs import synthesize, topology
from envs.machine import Gpu, Machine
from helpers.program import run_inv
from runtime.preflight import topology as check
from runtime.report import svg

DATA = Path(__file__).resolve().parent / "topology"


def status_by_check(results):
    return {r.name: r.status for r in results}


def test_nvidia_h200_capture_one_gpu_with_its_numa_and_cpus():
    topo = topology.parse((DATA / "nvidia_h200_x1_topo_m.txt").read_text())   # ANSI escapes in the header
    assert topo.vendor == "nvidia" and [(g.index, g.numa, g.cpus) for g in topo.gpus] == [(0, 0, "0-15")]
    assert topo.links == {} and topo.nics == [] and not topo.notes
    results = check.judge(topo, synthesize("H200:1"))
    assert status_by_check(results) == {"topology.map": "PASS", "topology.gpu_links": "PASS",
                                        "topology.nic_numa": "PASS"}


def test_dgx_h100_every_pair_nvlink_passes_and_is_drawn_as_one_fabric():
    topo = topology.parse((DATA / "nvidia_dgx_h100_guide_topo_m.txt").read_text())
    assert len(topo.gpus) == 8 and set(topo.links.values()) == {"NV18"} and len(topo.links) == 28
    assert topo.gpu_numa() == {0: 0, 1: 0, 2: 0, 3: 0, 4: 1, 5: 1, 6: 1, 7: 1}
    assert topo.gpus[4].cpus == "52-103"
    links = next(r for r in check.judge(topo, synthesize("H100")) if r.name == "topology.gpu_links")
    assert links.status == "PASS" and links.value == "28 of 28 pairs NVLink"
    picture = svg.draw(topo)
    assert picture.count('class="gpu"') == 8 and "NV18 between every pair" in picture


def test_pcie_only_gpus_against_an_hgx_profile_warn_with_the_fix():
    topo = topology.parse((DATA / "nvidia_8x4090_2nic_topo_m.txt").read_text())
    assert [n.column for n in topo.nics] == ["NIC0", "NIC1"] and topo.nic_links["6-NIC0"] == "PHB"
    links = next(r for r in check.judge(topo, synthesize("H100")) if r.name == "topology.gpu_links")
    assert links.status == "WARN" and links.value == "0 of 28 pairs NVLink"
    assert "28 GPU pair(s) without NVLink" in links.reason and "GPU0-GPU1 SYS" in links.reason
    assert "nvidia-fabricmanager" in links.fix
    # the PCIe form factor is not expected to have NVLink between every pair
    pcie = Machine(vendor="nvidia", model="H100", name="NVIDIA H100 PCIe", arch="sm_90", count=8, memory_gib=80,
                   gpus=[Gpu(i, "NVIDIA H100 PCIe") for i in range(8)])
    assert status_by_check(check.judge(topo, pcie))["topology.gpu_links"] == "PASS"


def test_amd_rocm_smi_showtopo_pcie_against_mi300x_warns():
    topo = topology.parse((DATA / "amd_4gpu_pcie_showtopo.txt").read_text())
    assert topo.vendor == "amd" and topo.gpu_numa() == {0: 0, 1: 1, 2: 3, 3: 2}
    assert topo.link(0, 3) == "PCIE" and len(topo.links) == 6
    links = next(r for r in check.judge(topo, synthesize("MI300X")) if r.name == "topology.gpu_links")
    assert links.status == "WARN" and "without XGMI" in links.reason and "amd-smi xgmi" in links.fix


def _sysfs(root: Path, gpus: dict[str, int], rdma: dict[str, int]) -> None:
    """A /sys tree: two NUMA nodes, GPUs by PCI bus with their node, RDMA devices with theirs."""
    for node, cpus in ((0, "0-7"), (1, "8-15")):
        (root / f"sys/devices/system/node/node{node}").mkdir(parents=True)
        (root / f"sys/devices/system/node/node{node}/cpulist").write_text(cpus + "\n")
    for bus, node in gpus.items():
        (root / "sys/bus/pci/devices" / bus).mkdir(parents=True)
        (root / "sys/bus/pci/devices" / bus / "numa_node").write_text(f"{node}\n")
    for name, node in rdma.items():
        device = root / "sys/class/infiniband" / name / "device"
        (device / "net" / f"ib{name[-1]}").mkdir(parents=True)
        (device / "numa_node").write_text(f"{node}\n")


def test_gpus_on_a_numa_node_without_an_rdma_nic_warn(tmp_path):
    buses = {f"0000:{0x18 + 0x10 * i:02x}:00.0": (0 if i < 2 else 1) for i in range(4)}
    _sysfs(tmp_path, buses, {"mlx5_0": 0, "mlx5_1": 0})
    machine = Machine(vendor="nvidia", model="H100", name="NVIDIA H100 80GB HBM3", arch="sm_90", count=4, memory_gib=80,
                      gpus=[Gpu(i, "NVIDIA H100 80GB HBM3", bus_id=bus) for i, bus in enumerate(buses)])
    topo = topology.merge_sysfs(topology.Topology(vendor="nvidia", source="test"), machine, tmp_path)
    assert topo.numa_nodes == {0: "0-7", 1: "8-15"} and topo.gpu_numa() == {0: 0, 1: 0, 2: 1, 3: 1}
    assert [(n.name, n.kind, n.numa, n.netdev) for n in topo.nics] == [("mlx5_0", "rdma", 0, "ib0"),
                                                                       ("mlx5_1", "rdma", 0, "ib1")]
    nic = next(r for r in check.judge(topo, machine) if r.name == "topology.nic_numa")
    assert nic.status == "WARN" and "GPU2,3 on NUMA1 have no RDMA NIC on their node" in nic.reason
    assert "NCCL_IB_HCA" in nic.fix
    # one NIC per node: fine
    (tmp_path / "sys/class/infiniband/mlx5_1/device/numa_node").write_text("1\n")
    topo = topology.merge_sysfs(topology.Topology(vendor="nvidia", source="test"), machine, tmp_path)
    assert status_by_check(check.judge(topo, machine))["topology.nic_numa"] == "PASS"


def test_a_nic_on_another_node_than_the_gpus_on_its_switch_warns():
    topo = topology.Topology(vendor="nvidia", gpus=[topology.TopoGpu(0, numa=0), topology.TopoGpu(1, numa=1)],
                             nics=[topology.TopoNic("mlx5_0", numa=1, kind="rdma"),
                                   topology.TopoNic("mlx5_1", numa=1, kind="rdma")],
                             numa_nodes={0: "0-7", 1: "8-15"}, links={"0-1": "NV18"},
                             nic_links={"0-mlx5_0": "PIX", "1-mlx5_0": "SYS", "0-mlx5_1": "SYS", "1-mlx5_1": "PIX"})
    nic = next(r for r in check.judge(topo, None) if r.name == "topology.nic_numa")
    assert nic.status == "WARN" and "mlx5_0 is on NUMA1 but its GPUs (same PCIe switch) GPU0 on NUMA0" in nic.reason
    picture = svg.draw(topo)
    assert 'stroke="#dd6b20"' in picture          # the cross-node NIC line is drawn in orange


def test_the_map_round_trips_through_json():
    topo = topology.parse((DATA / "nvidia_dgx_h100_guide_topo_m.txt").read_text())
    again = topology.Topology.from_dict(json.loads(json.dumps(topo.to_dict())))
    assert again == topo


def test_env_topology_task(tmp_path):
    recorded = DATA / "nvidia_8x4090_2nic_topo_m.txt"
    run = run_inv("env.topology", "--tool-output", recorded, "--gpu", "H100", "--json", timeout=120)
    assert run.returncode == 0, run.stderr
    document = json.loads(run.stdout)
    assert len(document["topology"]["gpus"]) == 8
    assert {c["name"]: c["status"] for c in document["checks"]}["topology.gpu_links"] == "WARN"
    table = run_inv("env.topology", "--tool-output", DATA / "amd_4gpu_pcie_showtopo.txt", timeout=120)
    assert table.returncode == 0 and "PCIE to all" in table.stdout and "topology.gpu_links" in table.stdout
    here = run_inv("env.topology", timeout=120)
    assert here.returncode == 0 and "NUMA nodes" in here.stdout and "topology.map" in here.stdout
    (tmp_path / "junk.txt").write_text("not a tool output\n")
    for path in (tmp_path / "missing.txt", tmp_path / "junk.txt"):
        bad = run_inv("env.topology", "--tool-output", path, timeout=120)
        assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
        assert bad.stderr.startswith("env.topology: --tool-output") and "Traceback" not in bad.stderr


def test_the_h200_machine_as_captured(tmp_path):
    """nvidia-smi topo -m and the sysfs facts of the real H200 VM, rebuilt as a /sys tree: the GPU's
    NUMA node comes from nvidia-smi where sysfs says -1, eth0 is found under its PCI function."""
    facts = json.loads((DATA / "nvidia_h200_x1_sysfs.json").read_text())
    (tmp_path / "sys/devices/system/node/node0").mkdir(parents=True)
    (tmp_path / "sys/devices/system/node/node0/cpulist").write_text(facts["/sys/devices/system/node/node0/cpulist"])
    (tmp_path / "sys/bus/pci/devices/0000:00:06.0").mkdir(parents=True)
    (tmp_path / "sys/bus/pci/devices/0000:00:06.0/numa_node").write_text(facts["gpu 00000000:00:06.0"] + "\n")
    for name in ("eth0", "lo", "ifb0", "ifb1"):
        (tmp_path / "sys/class/net" / name).mkdir(parents=True)
        real = facts[f"/sys/class/net/{name}"]["real"]
        if real:
            target = tmp_path / real.lstrip("/")
            target.mkdir(parents=True)
            (tmp_path / "sys/class/net" / name / "device").symlink_to(target)
    machine = Machine(vendor="nvidia", model="H200", name="NVIDIA H200", arch="sm_90", count=1, memory_gib=140,
                      gpus=[Gpu(0, "NVIDIA H200", bus_id="0000:00:06.0")])
    topo = topology.merge_sysfs(topology.parse((DATA / "nvidia_h200_x1_topo_m.txt").read_text()), machine, tmp_path)
    assert [(g.index, g.numa, g.cpus, g.bus_id) for g in topo.gpus] == [(0, 0, "0-15", "0000:00:06.0")]
    assert [(n.name, n.kind, n.numa, n.bus_id) for n in topo.nics] == [("eth0", "net", None, "0000:00:03.0")]
    assert topo.numa_nodes == {0: "0-15"}
    assert all(r.status == "PASS" for r in check.judge(topo, machine))
