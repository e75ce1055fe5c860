"""The node screen's verdicts: a measurement against its floor and against a recorded baseline.

    judge("perf.gemm", "TFLOP/s", {"GPU0": 702.0, "GPU1": 351.0}, floor=650, floor_ref="H200 floors: ...")
    -> CheckResult FAIL "GPU1 351 TFLOP/s is under the floor 650 (54%) ..."

Floor rule: every device must reach the floor (the GPU model's, from its
envs profile, or one given with --floor). Baseline rule: every device must be
within `tolerance` (default 5%) of the baseline a known-good node recorded
(`inv preflight.perf --save-baseline FILE`). Both apply when both exist;
each failure says what was measured, the limit and where the limit came from.
"""
from __future__ import annotations

from typing import Mapping, Optional

from runtime.preflight.result import FAIL, PASS, WARN, CheckResult

DEFAULT_TOLERANCE = 0.05


def _num(value: float) -> str:
    return f"{value:.4g}"


def judge(name: str, unit: str, measured: Mapping[str, float], floor: Optional[float] = None,
          floor_ref: str = "", baseline: Optional[float] = None, baseline_ref: str = "",
          tolerance: float = DEFAULT_TOLERANCE, floor_why: str = "") -> CheckResult:
    """One row: the worst device's value, PASS / FAIL by the floor and baseline rules.
    `floor_ref` names where the floor is (shown always); `floor_why` how it was set (on a failure)."""
    if not measured:
        return CheckResult(name, WARN, None, "nothing was measured", "")
    worst_device = min(measured, key=measured.__getitem__)
    worst = measured[worst_device]
    value = f"{_num(worst)} {unit}" + (f" (min of {len(measured)})" if len(measured) > 1 else "")
    problems = []
    if floor is not None:
        under = {d: v for d, v in measured.items() if v < floor}
        for device, got in sorted(under.items(), key=lambda kv: kv[1]):
            problems.append(f"{device} {_num(got)} {unit} is under the floor {_num(floor)} ({got / floor:.0%}; "
                            f"floor from {floor_ref or 'the GPU profile'}" + (f": {floor_why}" if floor_why else "")
                            + ")")
    if baseline is not None and baseline > 0:
        limit = baseline * (1 - tolerance)
        for device, got in sorted(measured.items(), key=lambda kv: kv[1]):
            if got < limit:
                problems.append(f"{device} {_num(got)} {unit} is {1 - got / baseline:.0%} below the baseline "
                                f"{_num(baseline)} (allowed {tolerance:.0%}; baseline from {baseline_ref or '?'})")
    if problems:
        return CheckResult(name, FAIL, value, "; ".join(problems),
                           "drain the node and check the device (nvidia-smi -q / rocm-smi, dmesg), or --exclude it")
    limits = []
    if floor is not None:
        limits.append(f">= floor {_num(floor)} ({floor_ref or 'GPU profile'})")
    if baseline is not None:
        limits.append(f"within {tolerance:.0%} of baseline {_num(baseline)} ({baseline_ref})")
    return CheckResult(name, PASS, value, "; ".join(limits) if limits else "measured; no floor for this device")
