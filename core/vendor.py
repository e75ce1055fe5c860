"""Who made the GPUs, the one vocabulary for it: amd, nvidia, or cpu (no GPU).

    Vendor.AMD.platform        # "rocm": the compute platform torch is built for (PyTorch's own word)
    Vendor.parse("cuda")       # Vendor.NVIDIA: older records and tools say the platform instead

Detection (envs), launch, containers, profilers, preflight, the plan and the kernels' tuning tables
all take this type, so a vendor written one way is never compared with one written the other.
"""
from __future__ import annotations

from enum import Enum


class Vendor(str, Enum):
    AMD = "amd"
    NVIDIA = "nvidia"
    CPU = "cpu"

    @property
    def platform(self) -> str | None:
        """rocm | cuda | None: what its GPUs are programmed with."""
        return _PLATFORMS.get(self)

    @property
    def has_gpu(self) -> bool:
        return self is not Vendor.CPU

    @classmethod
    def parse(cls, text: "str | Vendor | None") -> "Vendor":
        """A vendor or its platform as written anywhere (records of older runs say rocm/cuda/hip)."""
        if isinstance(text, Vendor):
            return text
        word = (text or "cpu").strip().lower()
        for vendor, names in _SPELLINGS.items():
            if word in names:
                return vendor
        raise ValueError(f"unknown GPU vendor {text!r} (amd | nvidia | cpu)")

    def __str__(self) -> str:
        return self.value


_PLATFORMS = {Vendor.AMD: "rocm", Vendor.NVIDIA: "cuda"}
_SPELLINGS = {Vendor.AMD: ("amd", "rocm", "hip"), Vendor.NVIDIA: ("nvidia", "cuda"), Vendor.CPU: ("cpu", "none", "")}
