"""preflight.software: the version fingerprint to compare across nodes (no torch import)."""
from __future__ import annotations

import sys
from importlib import metadata

from core.vendor import Vendor
from runtime.preflight.result import FAIL, PASS, WARN, CheckResult


def _version(package: str):
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def run(inp) -> list[CheckResult]:
    m = inp.machine
    results = []
    py = sys.version.split()[0]
    results.append(CheckResult("software.python", PASS if sys.version_info >= (3, 10) else FAIL, py,
                               "Python interpreter", "" if sys.version_info >= (3, 10) else "use Python >= 3.10"))
    if m.has_gpu:
        platform = {"rocm": "ROCm", "cuda": "CUDA"}[m.platform]
        results.append(CheckResult("software.driver", PASS if m.driver else WARN, m.driver,
                                   f"{m.vendor} kernel driver" if m.driver else "driver version not reported",
                                   "" if m.driver else "check the driver is loaded (dmesg, lsmod)"))
        results.append(CheckResult("software.platform", PASS if m.platform_version else WARN, m.platform_version,
                                   f"{platform} version" if m.platform_version else f"{platform} version not found",
                                   "" if m.platform_version else
                                   f"install {platform} or set {'ROCM_PATH' if m.platform == 'rocm' else 'CUDA_HOME'}"))
    results.append(_torch(m))
    triton = _version("triton") or _version("pytorch-triton-rocm")
    results.append(CheckResult("software.triton", PASS if triton else WARN, triton,
                               "Triton (fused kernels)" if triton else "Triton missing: --kernels runs unavailable",
                               "" if triton else "pip install triton (or the ROCm build)"))
    results.append(_anvil())
    return results


def _torch(m) -> CheckResult:
    version = _version("torch")
    if version is None:
        return CheckResult("software.torch", FAIL, None, "torch is not installed", "run the bootstrap (README)")
    build = version.partition("+")[2]  # "rocm6.2", "cu124", "cpu", or "" (PyPI's default CUDA build)
    if m.vendor is Vendor.AMD and not build.startswith("rocm"):
        return CheckResult("software.torch", FAIL, version, f"an AMD GPU node with a non-ROCm torch build ({version})",
                           "install torch from the ROCm index (download.pytorch.org/whl/rocm*) or use a ROCm image")
    if m.vendor is Vendor.NVIDIA and (build.startswith("rocm") or build == "cpu"):
        return CheckResult("software.torch", FAIL, version, f"an NVIDIA GPU node with a {build} torch build",
                           "install a CUDA build of torch")
    return CheckResult("software.torch", PASS, version, "torch build matches the node" if m.has_gpu else "torch")


def _anvil() -> CheckResult:
    from runtime.runs import snapshot
    version = _version("anvil") or "?"
    git, _diff = snapshot.git_info()
    commit = git.get("commit")
    if not commit:
        why = (str(git.get("error") or "no commit").splitlines() or ["no commit"])[0]
        return CheckResult("software.anvil", WARN, version, f"not a git checkout ({why})",
                           "run from the cloned repository so runs can be traced to a commit")
    value = f"{version} {commit[:12]}" + ("+dirty" if git.get("dirty") else "")
    return CheckResult("software.anvil", PASS, value, "Anvil version and commit (compare across nodes)")
