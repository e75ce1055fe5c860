"""Vendor profilers around the chosen ranks, recording only the trainer's profiling window.

    wrap(["python", "-m", "trainer", ...], rank=0, environ)  ->  ["ncu", "--profile-from-start", "off", ...,
                                                                "python", "-m", "trainer", ...]

The agent calls wrap() for each rank it starts. names.PROFILE_TOOL names the
tool, names.PROFILE_RANKS the ranks (as for torch.profiler), names.PROFILE_TOOL_KERNELS
a regular expression on kernel names (ncu, rocprofv3-counters: measure only
those), names.PROFILE_TOOL_ARGS more options for the tool (one shell-quoted
string). Each tool starts with its recording off and follows the capture range
the trainer opens at the window's first step and closes after its last
(trainer.profiling.window.capture):

  nsys                nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop
                      (cudaProfilerStart/Stop)                   -> RUN/profile/rank{R}.nsys-rep
  ncu                 ncu --profile-from-start off (cudaProfilerStart/Stop), each launch configuration of the
                      chosen kernels once (--filter-mode per-launch-config --launch-count 1)
                                                                 -> RUN/profile/rank{R}.ncu-rep
  rocprofv3           rocprofv3 --selected-regions (roctxProfilerResume/Pause): kernel, HIP runtime,
                      memory copy and marker traces, Perfetto and CSV -> RUN/profile/rank{R}/
  rocprofv3-counters  the same window, hardware counters per kernel (--pmc; the default set is collected
                      in one pass on CDNA)                       -> RUN/profile/rank{R}/

References: Nsight Systems User Guide (CLI profile command switches: --capture-range, --capture-range-end);
Nsight Compute CLI (--profile-from-start, --kernel-name regex:, --kernel-name-base, --filter-mode,
--launch-count, --export); rocprofv3 (ROCprofiler-SDK "Using rocprofv3": --selected-regions, --kernel-trace,
--hip-runtime-trace, --memory-copy-trace, --marker-trace, --pmc, --kernel-include-regex, -d, -o,
--output-format).
"""
from __future__ import annotations

import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from core.vendor import Vendor
from core import names

TOOL_VAR = names.PROFILE_TOOL
KERNELS_VAR = names.PROFILE_TOOL_KERNELS
ARGS_VAR = names.PROFILE_TOOL_ARGS
#: Counters collectable together in one pass on MI200/MI300 (rocprofv3 fails a set that needs more).
DEFAULT_COUNTERS = ("SQ_WAVES", "SQ_INSTS_VALU", "SQ_INSTS_SALU", "GRBM_GUI_ACTIVE")


@dataclass(frozen=True)
class Tool:
    name: str
    binary: str
    vendor: Vendor     # whose GPUs it profiles
    output: str        # what it leaves in RUN/profile/, for the task to name
    install: str       # where it comes from, for the one line when it is missing


TOOLS = {
    "nsys": Tool("nsys", "nsys", Vendor.NVIDIA, "rank{rank}.nsys-rep", "Nsight Systems (CUDA toolkit or NVIDIA's "
                                                               "nsight-systems package)"),
    "ncu": Tool("ncu", "ncu", Vendor.NVIDIA, "rank{rank}.ncu-rep", "Nsight Compute (CUDA toolkit)"),
    "rocprofv3": Tool("rocprofv3", "rocprofv3", Vendor.AMD, "rank{rank}/", "ROCprofiler-SDK (ROCm 6.2 or later)"),
    "rocprofv3-counters": Tool("rocprofv3-counters", "rocprofv3", Vendor.AMD, "rank{rank}/",
                               "ROCprofiler-SDK (ROCm 6.2 or later)"),
}


def tool_command(tool: str, rank: int, out_dir: Path | str, kernels: str = "", extra: str = "") -> list[str]:
    """The tool's command line that goes before the rank's own."""
    out = Path(out_dir)
    more = shlex.split(extra) if extra else []
    if tool == "nsys":
        return ["nsys", "profile", "--capture-range=cudaProfilerApi", "--capture-range-end=stop",
                "--trace=cuda,nvtx,cublas,cudnn", "--sample=none", "--force-overwrite=true",
                f"--output={out / f'rank{rank}'}", *more]
    if tool == "ncu":
        select = ["--kernel-name-base", "function", "--kernel-name", f"regex:{kernels}"] if kernels else []
        return ["ncu", "--profile-from-start", "off", "--target-processes", "all", *select,
                "--filter-mode", "per-launch-config", "--launch-count", "1",
                "--export", str(out / f"rank{rank}"), "--force-overwrite", *more]
    if tool in ("rocprofv3", "rocprofv3-counters"):
        what = (["--kernel-trace", "--hip-runtime-trace", "--memory-copy-trace", "--marker-trace"]
                if tool == "rocprofv3" else
                ["--pmc", *DEFAULT_COUNTERS, *(["--kernel-include-regex", kernels] if kernels else [])])
        return ["rocprofv3", "--selected-regions", *what, "--output-format", "pftrace", "csv",
                "-d", str(out / f"rank{rank}"), "-o", f"rank{rank}", *more, "--"]
    raise ValueError(f"unknown profiler {tool!r}")


def chosen(rank: int, environ: Mapping[str, str]) -> bool:
    from trainer.profiling.window import parse_ranks

    ranks = parse_ranks(environ.get(names.PROFILE_RANKS, "0"))
    return ranks is None or rank in ranks


def wrap(command: list[str], rank: int, environ: Mapping[str, str], run_dir: Path | str | None) -> list[str]:
    """`command` under the profiler names.PROFILE_TOOL names when `rank` is one of those asked for."""
    tool = environ.get(TOOL_VAR, "").strip()
    if not tool or run_dir is None or not chosen(rank, environ):
        return command
    return tool_command(tool, rank, Path(run_dir) / names.PROFILE_DIR, environ.get(KERNELS_VAR, ""),
                        environ.get(ARGS_VAR, "")) + command


def missing(tool: str, path: str | None = None) -> str | None:
    """One line when the tool's program is not on PATH, else None."""
    spec = TOOLS[tool]
    if shutil.which(spec.binary, path=path) is not None:
        return None
    return f"{spec.binary} is not installed here (not on PATH): --tool {tool} needs {spec.install}"
