"""The node screen: floor and baseline rules, kernel-log faults, per-device processes, and the real tasks on CPU.

Rules are tested with fake measurements (a GPU at 50% of its floor fails, at
97% passes; the baseline rule with its tolerance). The tasks run for real
through the installed inv: on this CPU machine the same measurement path runs
on the CPU, and a baseline recorded by --save-baseline is read back.
"""
from __future__ import annotations

import json

import pytest

import envs.profiles as profiles
from envs.machine import Machine
from runtime.preflight import perf, rules, screen
from runtime.preflight.result import FAIL, PASS, WARN

from helpers.program import ONE_THREAD, inv


def test_a_gpu_at_half_its_floor_fails_and_at_97_percent_passes():
    floor = profiles.MODELS["h200"].floors.gemm_tflops
    bad = rules.judge("perf.gemm", "TFLOP/s", {"GPU0": floor * 1.1, "GPU3": floor * 0.5}, floor=floor,
                      floor_ref="H200 floors", floor_why="83% of measured")
    assert bad.status == FAIL and "83% of measured" in bad.reason
    assert "GPU3" in bad.reason and "under the floor" in bad.reason and "(50%" in bad.reason
    assert "H200 floors" in bad.reason and "GPU0" not in bad.reason
    good = rules.judge("perf.gemm", "TFLOP/s", {"GPU0": floor * 0.97 + floor * 0.03, "GPU1": floor * 1.2},
                       floor=floor * 0.97, floor_ref="H200 floors")
    assert good.status == PASS
    assert rules.judge("perf.gemm", "TFLOP/s", {"GPU0": floor * 0.97}, floor=floor).status == FAIL


def test_the_baseline_rule_allows_its_tolerance_and_no_more():
    judged = {got: rules.judge("perf.hbm_copy", "GB/s", {"GPU0": got}, baseline=4000, baseline_ref="node7",
                               tolerance=0.05).status for got in (3840, 3790)}
    assert judged == {3840: PASS, 3790: FAIL}            # 4% below passes, 5.25% below fails
    failed = rules.judge("perf.hbm_copy", "GB/s", {"GPU0": 3000}, floor=2000, baseline=4000,
                         baseline_ref="node7")
    assert failed.status == FAIL and "25% below the baseline 4000" in failed.reason and "node7" in failed.reason
    assert rules.judge("x", "u", {}).status == WARN


def test_every_gpu_model_has_floors_with_a_source():
    for key, model in profiles.MODELS.items():
        assert model.floors is not None, key
        assert model.floors.gemm_tflops < model.peak_tflops, key      # a floor under the datasheet peak
        assert len(model.floors.ref) > 30, key


def test_floors_come_from_the_profile_and_give_way_to_overrides():
    machine = Machine(vendor="nvidia", model="H200", name="NVIDIA H200", arch="sm_90", count=8, memory_gib=140,
                      profile="h200")
    floors, source, gpus, why = perf.floors_for(machine, {})
    assert floors["gemm_tflops"] == 650 and gpus == 8 and "envs/profiles/h200.py" in source and "Azure" in why
    floors, source, _, _ = perf.floors_for(machine, {"gemm_tflops": 700.0})
    assert floors["gemm_tflops"] == 700 and floors["hbm_gbps"] == 3400 and source.startswith("--floor")
    cpu = Machine(vendor="cpu", model=None, name="no GPU", arch=None, count=0, memory_gib=None)
    assert perf.floors_for(cpu, {})[0] == {}
    with pytest.raises(perf.PerfOptionError):
        perf.parse_floors(["gemm=1"])
    with pytest.raises(perf.PerfOptionError):
        perf.parse_floors(["gemm_tflops=-3"])
    with pytest.raises(perf.PerfOptionError):
        perf.check_tolerance(1.5)


XID_79 = "[ 812.1] NVRM: Xid (PCI:0000:1b:00): 79, pid=1234, GPU has fallen off the bus."
XID_13 = "[ 90.2] NVRM: Xid (PCI:0000:3b:00): 13, Graphics Exception: ESR 0x404600=0x80000002"
AMD_FAULT = "[ 55.0] amdgpu 0000:c1:00.0: amdgpu: [gfxhub] page fault (src_id:0 ring:24 vmid:3 pasid:32770)"
HUNG = "[ 77.0] INFO: task python:4242 blocked for more than 120 seconds."


def test_kernel_log_faults_are_found_and_graded():
    assert screen.kernel_log_check("[ 1.0] Linux version 6.1\n").status == PASS
    assert screen.kernel_log_check(None).status == PASS                         # unreadable: says so
    assert "not scanned" in screen.kernel_log_check(None).reason
    hardware = screen.kernel_log_check("\n".join(["ok", XID_79, XID_13]))
    assert hardware.status == FAIL and "Xid 13, 79" in hardware.reason and "fallen off the bus" in hardware.reason
    assert screen.kernel_log_check(XID_13).status == WARN                     # an application's Xid
    assert screen.kernel_log_check(AMD_FAULT).status == FAIL
    assert screen.kernel_log_check(HUNG).status == WARN
    assert set(screen.scan_kernel_log("\n".join([XID_13, AMD_FAULT, HUNG]))) == {"nvidia_xid", "amd_gpu_fault",
                                                                                  "hung_task"}


def test_each_device_runs_in_its_own_process_and_a_hung_one_costs_its_timeout():
    ok = screen.per_device("smoke", ["cpu"], timeout=60)
    assert ok["cpu"]["ok"] and ok["cpu"]["gemm_finite"]
    hung = screen.per_device("smoke", ["cpu"], timeout=0.01)       # killed long before it could answer
    assert hung["cpu"] == {"ok": False, "error": "no answer within 0.01 s (hung)"}
    broken = screen.per_device("smoke", ["cuda:7"], timeout=60)    # no such device on this machine
    assert broken["cuda:7"]["ok"] is False and broken["cuda:7"]["error"]


def test_perf_records_a_baseline_and_judges_against_one(tmp_path):
    saved = inv(tmp_path, "preflight.perf", "--save-baseline", str(tmp_path / "base.json"), "--json",
                env=ONE_THREAD)
    assert saved.returncode == 0, saved.stderr[-2000:]
    baseline = json.loads((tmp_path / "base.json").read_text())
    assert baseline["format"] == "anvil-perf-baseline/1"
    assert set(baseline["measured"]) == {"gemm_tflops", "hbm_gbps", "h2d_gbps", "allreduce_gbps"}
    report = json.loads(saved.stdout[saved.stdout.index("{"):])
    assert {c["name"] for c in report["checks"]} >= {"perf.gemm", "perf.hbm_copy", "perf.h2d", "perf.allreduce"}

    # A node ten times slower than this baseline says so, by metric, and exits 1.
    fast = {**baseline, "measured": {k: v * 10 for k, v in baseline["measured"].items()}}
    (tmp_path / "fast.json").write_text(json.dumps(fast))
    judged = inv(tmp_path, "preflight.perf", "--baseline", str(tmp_path / "fast.json"), env=ONE_THREAD)
    assert judged.returncode == 1, judged.stderr[-2000:]
    assert "below the baseline" in judged.stdout and "perf.gemm" in judged.stderr
    assert "Traceback" not in judged.stderr


def test_bad_perf_options_are_one_line(tmp_path):
    (tmp_path / "junk.json").write_text("{}")
    for argv, expected in ((["--floor", "speed=3"], "expected NAME=VALUE"),
                           (["--baseline", str(tmp_path / "missing.json")], "no such file"),
                           (["--baseline", str(tmp_path / "junk.json")], "not a baseline"),
                           (["--tolerance", "2"], "expected a fraction")):
        proc = inv(tmp_path, "preflight.perf", *argv, env=ONE_THREAD)
        assert proc.returncode == 2 and expected in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
