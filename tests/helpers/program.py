"""The installed `inv` run the way the bad-input tests run it: in a fresh temporary folder, run
directories under it, and the checks that a failure is one clear line (tests/test_bad_input_more.py,
test_bench_input.py, test_preflight_env_input.py)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
INV = REPO / ".venv" / "bin" / "inv"


def inv(cwd: Path, *args, timeout=300, env=None, unset=()):
    """Run the installed inv in `cwd` (a tmp dir), run directories under cwd/runs; `unset`: variables
    of this shell the command must not see."""
    environ = {**os.environ, "INVOKE_ANVIL_RUNS_DIR": str(Path(cwd) / "runs"), **(env or {})}
    for name in unset:
        environ.pop(name, None)
    return subprocess.run([str(INV), *map(str, args)], cwd=cwd, env=environ, capture_output=True,
                          text=True, timeout=timeout)


def one_line_error(proc, *fragments, code=2) -> str:
    """The failure is exit `code`, no traceback, and one stderr line holding every fragment."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == code, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    lines = [line for line in proc.stderr.splitlines() if all(f in line for f in fragments)]
    assert lines, f"no line with {fragments} in:\n{proc.stderr[-3000:]}"
    return lines[0]


def runs(cwd: Path) -> list[Path]:
    """The run directories under cwd/runs."""
    folder = Path(cwd) / "runs"
    return sorted(folder.iterdir()) if folder.is_dir() else []
