"""Profiling a few training steps, and what the profile says.

    window.py      StepProfiler: the chosen steps on the chosen ranks (torch.profiler, or a vendor tool's
                   capture range); names.PROFILE_STEPS / _RANKS / _TOOL
    trace.py       reading a chrome trace: GPU events, the host ops that launched them, intervals
    categories.py  which category a kernel is (rules on CUDA and ROCm names, Inductor's op lists, host ops)
    breakdown.py   step time by category, exposed communication, GPU idle and where it came from
    advice.py      the categories worth a look and what to do about each
    report.py      the table, the advice, two runs compared, the bar chart

`inv profile.train` and `inv profile.compare` show them; benchmarks.train_throughput's split is
breakdown.legacy_split of the same breakdown.
"""
from trainer.profiling.window import (TOOLS, ProfileSettingsError, StepProfiler, parse_ranks, parse_steps,  # noqa: F401
                                      parse_tool)
