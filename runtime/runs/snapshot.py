"""What a run records about where it ran: machine, versions, git, packages.

Cheap by design (a run's snapshot is taken before every task): package
versions come from importlib.metadata (no ``pip freeze`` subprocess, no torch
import); torch's build flavour (CUDA/HIP version) is read from
torch/version.py without importing torch unless it is already imported.
"""
from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path

from core.host import this_host
from runtime.settings import CHECKOUT

PACKAGES = ("torch", "triton", "numpy", "invoke", "fabric", "paramiko", "transformers",
            "liger-kernel", "pyrsmi", "nvidia-ml-py", "anvil")


def _run(cmd: list[str], cwd: Path, timeout: float = 20) -> tuple[int, str]:
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 127, str(exc)
    return proc.returncode, proc.stdout if proc.returncode == 0 else proc.stderr


def git_info(repo: Path = CHECKOUT) -> tuple[dict, str]:
    """({commit, branch, dirty, status}, dirty diff against HEAD)."""
    code, commit = _run(["git", "rev-parse", "HEAD"], repo)
    if code != 0:
        return {"commit": None, "error": commit.strip() or "not a git checkout"}, ""
    _, branch = _run(["git", "rev-parse", "--abbrev-ref", "HEAD"], repo)
    _, status = _run(["git", "status", "--porcelain"], repo)
    _, diff = _run(["git", "diff", "HEAD"], repo)
    lines = [line for line in status.splitlines() if line.strip()]
    return ({"commit": commit.strip(), "branch": branch.strip(), "dirty": bool(lines),
             "status": lines, "path": str(repo)}, diff)


def pip_freeze() -> str:
    """`pip freeze`-style list from importlib.metadata (40x faster than the subprocess)."""
    seen = {}
    for dist in md.distributions():
        name = dist.metadata.get("Name")
        if not name or name.lower() in seen:
            continue
        line = f"{name}=={dist.version}"
        direct = dist.read_text("direct_url.json")
        if direct and '"editable": true' in direct.replace("'", '"'):
            line += "  # editable"
        seen[name.lower()] = line
    return "\n".join(sorted(seen.values(), key=str.lower)) + "\n"


def _version(package: str) -> str | None:
    try:
        return md.version(package)
    except md.PackageNotFoundError:
        return None


def torch_build() -> dict:
    """torch's CUDA / HIP build versions without importing torch."""
    torch = sys.modules.get("torch")
    if torch is not None:
        version = torch.version
        return {"cuda": getattr(version, "cuda", None), "hip": getattr(version, "hip", None),
                "git": getattr(version, "git_version", None)}
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return {}
    path = Path(list(spec.submodule_search_locations)[0]) / "version.py"
    values: dict = {}
    try:
        # version.py is plain assignments; run it in an empty namespace.
        source = path.read_text()
        namespace: dict = {}
        exec(compile(source, str(path), "exec"), {"__builtins__": __builtins__}, namespace)
        values = {"cuda": namespace.get("cuda"), "hip": namespace.get("hip"),
                  "git": namespace.get("git_version")}
    except Exception as exc:  # a broken torch install is worth recording, not fatal
        values = {"error": str(exc)}
    return values


def machine() -> dict:
    """GPU info from envs.detect() plus the host's basics."""
    info: dict = {"hostname": socket.gethostname(), "host": this_host(),
                  "platform": platform.platform(), "cpu_count": os.cpu_count(),
                  "python": sys.version.split()[0]}
    try:
        info["memory_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    try:
        import envs
        detected = envs.detect()
        info["gpu"] = detected.to_dict()
    except Exception as exc:  # detection trouble must not stop the run; say so
        info["gpu"] = {"vendor": "unknown", "error": f"{type(exc).__name__}: {exc}"}
    return info


def versions(git: dict | None = None, gpu: dict | None = None) -> dict:
    gpu = gpu or {}
    out = {"python": sys.version.split()[0], "executable": sys.executable,
           "driver": gpu.get("driver"), "platform_version": gpu.get("platform_version"),
           "anvil_commit": (git or {}).get("commit"), "torch_build": torch_build()}
    for package in PACKAGES:
        out[package] = _version(package)
    return out
