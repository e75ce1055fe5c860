"""The data a profile is made of: settings with a reason and a public source.

A profile is a list of entries. `Setting` is a fixed value (or `None`: unset
what an earlier layer set); `Computed` is a function of the machine it runs on
(`envs.resolve.Context`), returning a value, `(value, detail)` or `None` (not
set here). Every entry carries a one-line reason and the public document it
comes from, so `inv env.explain VAR` can say why a value is what it is.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

from core.vendor import Vendor
from core import names

ComputeResult = Union[None, str, "tuple[str, str]"]


@dataclass(frozen=True)
class Setting:
    name: str
    value: Optional[str]  # None: unset a value an earlier layer set
    reason: str
    ref: str


@dataclass(frozen=True)
class Computed:
    name: str
    compute: Callable[..., ComputeResult]  # compute(ctx) -> value | (value, detail) | None
    reason: str
    ref: str
    per_node: bool = True  # each node of a multi-node job computes its own (interface, host name);
    #                        False: one value for the whole job (the GPU model's peak)


Entry = Union[Setting, Computed]


@dataclass(frozen=True)
class Profile:
    key: str  # "mi300x", "rocm", "lumi", ...
    layer: str  # "base" | "vendor" | "model" | "site"
    title: str
    entries: tuple = ()

    @property
    def label(self) -> str:
        """How a layer is named in sources: "model:mi300x", "site:lumi", "base"."""
        return self.layer if self.layer == self.key else f"{self.layer}:{self.key}"


@dataclass(frozen=True)
class Floors:
    """What one healthy device of a model measures at least in the node screen (preflight.perf).

    gemm_tflops: bf16 8192^3 matmul; hbm_gbps: device-to-device copy, bytes
    read + written; h2d_gbps: pinned host-to-device copy; allreduce_gbps:
    nccl-tests-style busbw of a 1 GiB all-reduce over `allreduce_gpus` GPUs of
    one node (the check is skipped with another GPU count). `ref` says where
    the numbers come from: published thresholds or measurements where they
    exist, otherwise a stated fraction of the datasheet figure.
    """

    gemm_tflops: float
    hbm_gbps: float
    h2d_gbps: float
    allreduce_gbps: Optional[float] = None
    allreduce_gpus: int = 8
    ref: str = ""

    def as_dict(self) -> dict:
        return {"gemm_tflops": self.gemm_tflops, "hbm_gbps": self.hbm_gbps, "h2d_gbps": self.h2d_gbps,
                "allreduce_gbps": self.allreduce_gbps}


@dataclass(frozen=True)
class GpuModel:
    """What Anvil knows about one GPU model: how to recognise it and its peak.

    `peak_tflops` is the dense bf16 peak of ONE device as torch sees it (one
    GCD for MI250X), the MFU denominator. `peak_variants` are (substring of
    the reported product name, TFLOP/s) for form factors with other clocks.
    """

    key: str
    name: str  # canonical, as users type it: "MI300X"
    vendor: Vendor  # a string is read with Vendor.parse
    arch: str  # "gfx942", "sm_90"
    memory_gib: float
    peak_tflops: float
    peak_ref: str
    patterns: tuple  # regexes (case-insensitive) over the reported product name
    device_ids: tuple = ()  # PCI device ids (AMD sysfs fallback)
    default_count: int = 8
    compute_units: Optional[int] = None  # set only where it tells two models apart
    peak_variants: tuple = ()
    floors: Optional[Floors] = None  # node-screen minimums (preflight.perf)
    # the link every GPU pair of a node has where this model is built as its usual 8-GPU board:
    # "NVLink" | "XGMI" | "" (PCIe cards: no expectation); preflight's topology check holds a
    # node's pairs against it. Form factors without it (PCIe) are named in link_exempt.
    gpu_link: str = ""
    gpu_link_ref: str = ""
    link_exempt: tuple = ()  # substrings of the product name of boards without that link ("PCIe")
    # Datasheet figures the speed prediction falls back to where nothing was measured (trainer.speed):
    # HBM bandwidth (GB/s), the dense FP8 peak (TFLOP/s; None: no FP8 matrix cores), and the GPU link's
    # bandwidth per direction to the other GPUs of its node (GB/s; None: PCIe only).
    hbm_gbps: Optional[float] = None
    fp8_tflops: Optional[float] = None
    link_gbps: Optional[float] = None
    speed_ref: str = ""

    def __post_init__(self):
        object.__setattr__(self, "vendor", Vendor.parse(self.vendor))


def setting(name: str, value: Optional[str], reason: str, ref: str) -> Setting:
    return Setting(name, value, reason, ref)


def computed(name: str, compute: Callable[..., ComputeResult], reason: str, ref: str,
             per_node: bool = True) -> Computed:
    return Computed(name, compute, reason, ref, per_node)


def model_profile(model: GpuModel, *entries: Entry) -> Profile:
    """The model layer: names.GPU_ARCH and names.GPU_PEAK_TFLOPS from the spec, then extras."""

    def peak(ctx) -> ComputeResult:
        reported = (ctx.machine.name or "") if ctx.machine.model == model.name else ""
        for needle, tflops in model.peak_variants:
            if needle.lower() in reported.lower():
                return _fmt(tflops), f"{needle} form factor ({reported})"
        return _fmt(model.peak_tflops)

    base = (
        setting(names.GPU_ARCH, model.arch, f"{model.name} is {model.arch}; kernels and caches key on it",
                "vendor ISA/compute-capability tables (ROCm GPU specs; CUDA compute capabilities)"),
        computed(names.GPU_PEAK_TFLOPS, peak,
                 f"dense bf16 peak of one {model.name} device, the MFU denominator", model.peak_ref,
                 per_node=False),
    )
    return Profile(model.key, "model", f"{model.name} ({model.arch})", base + tuple(entries))


def _fmt(number: float) -> str:
    return f"{number:g}"
