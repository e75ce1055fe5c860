"""Small helpers shared by the vendor probes."""
from __future__ import annotations

import shutil
import subprocess
from typing import Optional

GIB = 1024 ** 3


def run_tool(argv: list[str], timeout: float = 15) -> Optional[str]:
    """stdout of a vendor tool, or None when it is missing, fails or hangs (a wedged GPU can)."""
    if not shutil.which(argv[0]):
        return None
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 and out.stdout.strip() else None


def to_int(value) -> Optional[int]:
    """"0x74a1" / "29857" / 29857 -> int; anything else -> None."""
    if isinstance(value, int):
        return value
    if not isinstance(value, str):
        return None
    value = value.strip()
    try:
        return int(value, 16) if value.lower().startswith("0x") else int(value)
    except ValueError:
        return None


def to_float(value) -> Optional[float]:
    try:
        return float(str(value).strip())
    except (TypeError, ValueError):
        return None


def bus_id(value: Optional[str]) -> Optional[str]:
    """Normalise a PCI address to "dddd:bb:dd.f" lower case (nvidia-smi prints 8 domain digits)."""
    if not value:
        return None
    value = value.strip().lower()
    parts = value.split(":")
    if len(parts) == 3:
        parts[0] = parts[0][-4:].rjust(4, "0")
    elif len(parts) == 2:
        parts.insert(0, "0000")
    return ":".join(parts)
