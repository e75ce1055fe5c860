"""Preflight checks: is this node ready to train? Each returns CheckResults (PASS / WARN / FAIL).

    inputs = CheckInputs(machine=envs.detect(), env=envs.resolve(), run_dir=Path("runs"))
    results = run_checks(["gpu", "host"], inputs)
"""
from __future__ import annotations

from runtime.preflight import affinity, gpu, host, network, perf, screen, software, topology
from runtime.preflight.result import FAIL, PASS, WARN, CheckInputs, CheckResult, table, worst

CHECKS = {"gpu": gpu.run, "host": host.run, "software": software.run, "network": network.run,
          "affinity": affinity.run, "topology": topology.run, "screen": screen.run, "perf": perf.run}


def run_checks(names, inputs: CheckInputs) -> list[CheckResult]:
    """Run the named checks in order; a check that crashes is a FAIL of its own, not the end of the report."""
    results = []
    for name in names:
        try:
            results += CHECKS[name](inputs)
        except Exception as exc:  # noqa: BLE001 - reported as a result
            results.append(CheckResult(name, FAIL, None, f"the {name} check crashed: {type(exc).__name__}: {exc}",
                                       "report this; run the other checks alone meanwhile"))
    return results


__all__ = ["CHECKS", "CheckInputs", "CheckResult", "FAIL", "PASS", "WARN", "run_checks", "table", "worst"]
