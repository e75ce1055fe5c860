"""What a machine is, as far as environment profiles care."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Optional

from core.vendor import Vendor


@dataclass
class Gpu:
    """One device as a probe reported it."""

    index: int
    name: str
    memory_gib: Optional[float] = None
    arch: Optional[str] = None
    bus_id: Optional[str] = None  # PCI "0000:c1:00.0", lower case
    device_id: Optional[int] = None
    compute_units: Optional[int] = None


@dataclass
class Machine:
    vendor: Vendor  # amd | nvidia | cpu (a string is read with Vendor.parse)
    model: Optional[str]  # canonical model name ("MI300X") when Anvil has a profile for it
    name: str  # product name as reported ("AMD Instinct MI300X"), or "no GPU"
    arch: Optional[str]  # "gfx942", "sm_90"
    count: int
    memory_gib: Optional[float]  # per device
    driver: Optional[str] = None
    platform_version: Optional[str] = None  # the ROCm or CUDA version (Vendor.platform)
    source: str = "none"  # which probe answered: pyrsmi, amd-smi, rocm-smi, sysfs, nvml, nvidia-smi, override
    profile: Optional[str] = None  # model profile key ("mi300x")
    gpus: list = field(default_factory=list)  # list[Gpu]
    notes: list = field(default_factory=list)  # caveats of the detection

    def __post_init__(self):
        self.vendor = Vendor.parse(self.vendor)

    @classmethod
    def from_dict(cls, data: dict) -> "Machine":
        """What to_dict wrote, or a record of an older run (its runtime_version is the platform's)."""
        data = dict(data)
        data.setdefault("platform_version", data.get("runtime_version"))
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    @property
    def platform(self) -> Optional[str]:
        """rocm | cuda | None"""
        return self.vendor.platform

    @property
    def has_gpu(self) -> bool:
        return self.vendor.has_gpu and self.count > 0

    @property
    def unknown_gpu(self) -> bool:
        return self.has_gpu and self.profile is None

    def summary(self) -> str:
        if not self.has_gpu:
            return "no GPU (CPU only)"
        model = self.model or f"unknown GPU {self.name!r}"
        return f"{self.count} x {model} ({self.arch or '?'})"

    def to_dict(self) -> dict:
        data = asdict(self)
        data["vendor"] = self.vendor.value
        data["platform"] = self.platform
        data["memory"] = self.memory_gib  # the key `inv env.detect --json` has always used
        return data


@dataclass
class DeviceStatus:
    """Live state of one device, for preflight and the GPUs-idle hook (None: not reported)."""

    index: int
    memory_total_gib: Optional[float] = None
    memory_used_gib: Optional[float] = None
    temperature_c: Optional[float] = None
    ecc_uncorrected: Optional[int] = None
    pids: list = field(default_factory=list)


@dataclass
class GpuStatus:
    devices: list  # list[DeviceStatus]
    pids: list  # every compute process on any GPU (AMD tools report them node-wide)
    source: str

