"""The GPU watch: readings through NVML (a stand-in with NVML's documented calls, tests/helpers/fake_nvml.py)
and amdsmi (one built from AMD's documentation), what counts as trouble, the agent's watch thread, the
run's record of it (metadata, the step time it cost, nodes/ for --exclude-from), and, end to end, a real
`inv train.pretrain --nproc 2` whose agent finds the stand-in as `pynvml`."""
from __future__ import annotations

import importlib
import io
import json
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from envs.probes import watch
from helpers.program import INV, REPO, inv_environ, metadata, runs
from helpers.training import TINY_RUN
from runtime.launch.gpuwatch import GpuWatcher, gpu_indices
from runtime.runs import gpuhealth, nodes

FAKE = Path(__file__).resolve().parents[1] / "helpers" / "fake_nvml.py"


@pytest.fixture
def nvml():
    import helpers.fake_nvml as module
    return importlib.reload(module)      # its counters start again


def test_nvml_readings_and_what_counts_as_trouble(nvml):
    gpus = watch.NvmlWatch(nvml, [0, 1])
    first, second, third = gpus.read(), gpus.read(), gpus.read()
    assert first[0].to_dict() == {"index": 0, "sm_clock_mhz": 1980, "max_sm_clock_mhz": 1980, "power_w": 690.0,
                                  "temperature_c": 64, "reasons": ["power cap"], "ecc_uncorrected": 0}
    assert watch.trouble(first[1], 0) == []                          # the power cap alone is no trouble
    assert watch.trouble(second[1], 0) == ["clocks held down (hw thermal) at 1100 of 1980 MHz"]
    assert third[1].xids == [79] and watch.trouble(third[1], 0) == [
        "Xid 79", "2 new uncorrected ECC error(s)", "clocks held down (hw thermal) at 1100 of 1980 MHz"]
    assert third[0].xids == [] and watch.trouble(third[0], 0) == []
    gpus.close()


def test_amdsmi_readings_from_its_documented_calls():
    smi = types.SimpleNamespace(
        AmdSmiClkType=types.SimpleNamespace(GFX="gfx"),
        AmdSmiTemperatureType=types.SimpleNamespace(HOTSPOT="hotspot"),
        AmdSmiTemperatureMetric=types.SimpleNamespace(CURRENT="current"),
        amdsmi_init=lambda: None, amdsmi_shut_down=lambda: None,
        amdsmi_get_processor_handles=lambda: ["gpu0", "gpu1"],
        amdsmi_get_clock_info=lambda h, kind: {"cur_clk": 1400 if h == "gpu1" else 2100, "max_clk": 2100},
        amdsmi_get_power_info=lambda h: {"average_socket_power": 650, "current_socket_power": "N/A"},
        amdsmi_get_temp_metric=lambda h, kind, metric: 95 if h == "gpu1" else 70,
        amdsmi_get_gpu_total_ecc_count=lambda h: {"correctable_count": 4, "uncorrectable_count": 0},
        amdsmi_get_gpu_metrics_info=lambda h: {"throttle_status": 1 if h == "gpu1" else 0})
    readings = watch.AmdSmiWatch(smi, [0, 1]).read()
    assert readings[0].to_dict() == {"index": 0, "sm_clock_mhz": 2100.0, "max_sm_clock_mhz": 2100.0,
                                     "power_w": 650.0, "temperature_c": 70.0, "ecc_uncorrected": 0}
    assert watch.trouble(readings[1], 0) == ["clocks held down (throttled) at 1400 of 2100 MHz"]


def test_the_agents_watch_writes_each_reading_says_trouble_once_and_reports_it(tmp_path, nvml):
    out = io.StringIO()
    watcher = GpuWatcher(watch.NvmlWatch(nvml, [0, 1]), tmp_path, node_rank=1, host="n2", interval=60,
                         first_rank=2, indices=[0, 1], out=out)
    for _ in range(4):
        watcher.sample()
    report = watcher.stop()
    lines = [json.loads(line) for line in (tmp_path / "logs" / "gpu-1.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and lines[0]["host"] == "n2" and len(lines[0]["gpus"]) == 2
    said = out.getvalue().splitlines()
    assert said == ["anvil-agent: GPU 1 (rank 3) on n2: clocks held down (hw thermal) at 1100 of 1980 MHz",
                    "anvil-agent: GPU 1 (rank 3) on n2: Xid 79",
                    "anvil-agent: GPU 1 (rank 3) on n2: 2 new uncorrected ECC error(s)"]
    thermal, xid, ecc = report["gpu_events"]
    assert (thermal["gpu"], thermal["rank"], thermal["samples"]) == (1, 3, 3) and xid["samples"] == 1
    assert report["gpu_watch"]["samples"] == 4 and 0 <= report["gpu_watch"]["seconds"] < 1


def test_the_watch_is_off_without_a_library_a_run_directory_or_an_interval(tmp_path):
    env = {"ANVIL_RUN_DIR": str(tmp_path)}
    assert GpuWatcher.start(env, 2, 0, "h", opener=lambda indices: None) is None
    assert GpuWatcher.start({}, 2, 0, "h", opener=lambda indices: pytest.fail("opened")) is None
    assert GpuWatcher.start({**env, "ANVIL_GPU_WATCH_S": "0"}, 2, 0, "h",
                            opener=lambda indices: pytest.fail("opened")) is None
    assert gpu_indices({"CUDA_VISIBLE_DEVICES": "4,5,6"}, 2) == [4, 5]
    assert gpu_indices({"CUDA_VISIBLE_DEVICES": "GPU-1a2b"}, 2) == [0, 1]


def test_an_event_costs_the_step_time_it_slowed(tmp_path):
    train = [{"time": 100.0 + i, "step_time_s": 0.5 if 110 <= 100 + i <= 125 else 0.4} for i in range(60)]
    paid = gpuhealth.cost({"first": 110.0, "last": 115.0}, train, interval=10)
    assert paid == {"during_s": 0.5, "otherwise_s": 0.4, "slower": 0.25}
    assert "(+25%)" in gpuhealth.describe({"gpu": 1, "rank": 3, "host": "n2", "what": "Xid 79", "cost": paid})


@pytest.mark.slow
def test_a_run_names_the_gpu_in_trouble_and_lists_its_host_for_exclude_from(tmp_path, dataset):
    """The real agent and inv, on the CPU: the agent's `import pynvml` finds the stand-in."""
    shim = tmp_path / "shim"
    shim.mkdir()
    shutil.copy(FAKE, shim / "pynvml.py")
    env = inv_environ(tmp_path / "runs", {"PYTHONPATH": str(shim), "ANVIL_GPU_WATCH_S": "0.3",
                                          "OMP_NUM_THREADS": "1"})
    argv = [str(INV), "train.pretrain", "--nproc", "2", "--name", "watched"]
    for item in [f"data.path={dataset}", *TINY_RUN, "train.steps=400", "train.log_interval=10"]:
        argv += ["--set", item]
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = runs(tmp_path)
    host = metadata(run)["hosts"][0]
    assert f"anvil-agent: GPU 1 (rank 1) on {host}: clocks held down (hw thermal)" in proc.stderr
    events = metadata(run)["gpu_events"]
    assert {e["what"].split(" at ")[0] for e in events} >= {"clocks held down (hw thermal)"}
    assert all(e["host"] == host and e["gpu"] == 1 and e["rank"] == 1 for e in events)
    assert f"gpu watch: GPU 1 (rank 1) on {host}: clocks held down" in proc.stderr
    assert list(nodes.failing(run)) == [host]                          # what --exclude-from RUN reads
    assert f"--exclude-from {run}` leaves them out" in proc.stderr
    agent = json.loads((run / "logs" / "agent-0.json").read_text())
    assert agent["gpu_watch"]["samples"] >= 2 and (run / "logs" / "gpu-0.jsonl").is_file()
    assert not (run / "logs" / "gpu-0.jsonl").read_text().count("\n") < agent["gpu_watch"]["samples"]
