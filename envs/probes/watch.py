"""What a GPU says about its health while a run trains: the readings the node agent's watch takes.

One reading per GPU: SM clock (and its maximum), power, temperature, the reasons its clocks are held
down, the uncorrected ECC errors since the driver loaded, and the Xid errors reported since the last
reading. Each vendor's library is passed in (the module), so the reading code is the same whether the
library is the real one or, in the tests, one built from its documented calls and values.

- NVIDIA: NVML through nvidia-ml-py (`pynvml`): nvmlDeviceGetClockInfo / GetMaxClockInfo (NVML_CLOCK_SM),
  GetPowerUsage (mW), GetTemperature (NVML_TEMPERATURE_GPU), GetCurrentClocksEventReasons (the bit
  mask; GetCurrentClocksThrottleReasons on older bindings), GetTotalEccErrors (uncorrected, volatile;
  NotSupported on boards without ECC), and Xid errors as NVML events (nvmlEventSetCreate,
  nvmlDeviceRegisterEvents with nvmlEventTypeXidCriticalError, nvmlEventSetWait_v2 with a 0 ms timeout:
  NVMLError_Timeout when none is pending). Ran on no GPU here yet (the lent machines' time went to
  training figures): tested against NVML's documented calls.
- AMD: amdsmi (ROCm 6+): amdsmi_get_processor_handles, amdsmi_get_clock_info (AmdSmiClkType.GFX:
  cur_clk, max_clk), amdsmi_get_power_info (average_socket_power or current_socket_power, W),
  amdsmi_get_temp_metric (AmdSmiTemperatureType.HOTSPOT, CURRENT), amdsmi_get_gpu_total_ecc_count
  (uncorrectable_count), amdsmi_get_gpu_metrics_info (throttle_status). Written from AMD's
  documentation; never ran on an AMD GPU.

Which readings are trouble (`trouble`): an Xid, more uncorrected ECC errors than at the watch's start,
clocks held down by a slowdown (hardware, thermal or power-brake: not the power cap a GPU at full load
sits at, nor idleness).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

#: NVML clock event reasons (nvmlClocksEventReason*): bit -> name.
NVML_REASONS = {0x1: "idle", 0x2: "application clocks", 0x4: "power cap", 0x8: "hw slowdown",
                0x10: "sync boost", 0x20: "sw thermal", 0x40: "hw thermal", 0x80: "hw power brake",
                0x100: "display clock"}
#: The reasons that mean a GPU runs slower than it should.
SLOWDOWNS = ("hw slowdown", "sw thermal", "hw thermal", "hw power brake", "thermal", "power brake", "prochot")
#: amdsmi's gpu_metrics throttle_status: a non-zero value means the SMU throttles (the bits differ between
#: ASICs, so it is kept as one reason).
AMD_THROTTLED = "throttled"


@dataclass
class Reading:
    index: int                          # the GPU's index as the library counts them
    sm_clock_mhz: Optional[float] = None
    max_sm_clock_mhz: Optional[float] = None
    power_w: Optional[float] = None
    temperature_c: Optional[float] = None
    reasons: list[str] = field(default_factory=list)
    ecc_uncorrected: Optional[int] = None
    xids: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v not in (None, [])}


def trouble(reading: Reading, ecc_at_start: Optional[int]) -> list[str]:
    """What is wrong in a reading, as short phrases ([] when nothing)."""
    found = [f"Xid {x}" for x in reading.xids]
    if reading.ecc_uncorrected is not None and ecc_at_start is not None and reading.ecc_uncorrected > ecc_at_start:
        found.append(f"{reading.ecc_uncorrected - ecc_at_start} new uncorrected ECC error(s)")
    slow = [r for r in reading.reasons if r in SLOWDOWNS or r == AMD_THROTTLED]
    if slow:
        clock = (f" at {reading.sm_clock_mhz:.0f} of {reading.max_sm_clock_mhz:.0f} MHz"
                 if reading.sm_clock_mhz and reading.max_sm_clock_mhz else "")
        found.append(f"clocks held down ({', '.join(slow)}){clock}")
    return found


class NvmlWatch:
    """Readings of chosen GPUs through NVML (`nvml`: the pynvml module)."""

    vendor = "nvidia"

    def __init__(self, nvml, indices: list[int]):
        self.nvml = nvml
        nvml.nvmlInit()
        self.handles = {i: nvml.nvmlDeviceGetHandleByIndex(i) for i in indices}
        self.events = None
        try:   # Xid errors arrive as events; a driver or a container may not allow them
            self.events = nvml.nvmlEventSetCreate()
            for handle in self.handles.values():
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, self.events)
        except nvml.NVMLError:
            self.events = None

    def _call(self, name: str, *args):
        try:
            return getattr(self.nvml, name)(*args)
        except (self.nvml.NVMLError, AttributeError):
            return None

    def _xids(self) -> dict[int, list[int]]:
        found: dict[int, list[int]] = {}
        if self.events is None:
            return found
        by_handle = {id(h): i for i, h in self.handles.items()}
        for _ in range(64):   # every pending event, not forever
            try:
                data = self.nvml.nvmlEventSetWait_v2(self.events, 0)
            except self.nvml.NVMLError:
                break          # NVMLError_Timeout: none pending
            index = by_handle.get(id(data.device))
            if index is None:
                index = next((i for i, h in self.handles.items() if h == data.device), -1)
            found.setdefault(index, []).append(int(data.eventData))
        return found

    def read(self) -> list[Reading]:
        nvml, xids = self.nvml, self._xids()
        out = []
        for index, handle in self.handles.items():
            mask = self._call("nvmlDeviceGetCurrentClocksEventReasons", handle)
            if mask is None:
                mask = self._call("nvmlDeviceGetCurrentClocksThrottleReasons", handle)
            power = self._call("nvmlDeviceGetPowerUsage", handle)
            out.append(Reading(
                index=index,
                sm_clock_mhz=self._call("nvmlDeviceGetClockInfo", handle, nvml.NVML_CLOCK_SM),
                max_sm_clock_mhz=self._call("nvmlDeviceGetMaxClockInfo", handle, nvml.NVML_CLOCK_SM),
                power_w=power / 1000 if power is not None else None,
                temperature_c=self._call("nvmlDeviceGetTemperature", handle, nvml.NVML_TEMPERATURE_GPU),
                reasons=[name for bit, name in NVML_REASONS.items() if mask and mask & bit],
                ecc_uncorrected=self._call("nvmlDeviceGetTotalEccErrors", handle,
                                           nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC),
                xids=xids.get(index, [])))
        return out

    def close(self) -> None:
        if self.events is not None:
            self._call("nvmlEventSetFree", self.events)
        self._call("nvmlShutdown")


class AmdSmiWatch:
    """Readings of chosen GPUs through amdsmi (`amdsmi`: the module). Not run on an AMD GPU."""

    vendor = "amd"

    def __init__(self, amdsmi, indices: list[int]):
        self.smi = amdsmi
        amdsmi.amdsmi_init()
        handles = amdsmi.amdsmi_get_processor_handles()
        self.handles = {i: handles[i] for i in indices if i < len(handles)}

    def _call(self, name: str, *args):
        try:
            return getattr(self.smi, name)(*args)
        except Exception:   # amdsmi raises AmdSmiLibraryException (and others) for what a GPU cannot say
            return None

    def read(self) -> list[Reading]:
        smi, out = self.smi, []
        for index, handle in self.handles.items():
            clock = self._call("amdsmi_get_clock_info", handle, smi.AmdSmiClkType.GFX) or {}
            power = self._call("amdsmi_get_power_info", handle) or {}
            watts = power.get("average_socket_power") or power.get("current_socket_power")
            temp = self._call("amdsmi_get_temp_metric", handle, smi.AmdSmiTemperatureType.HOTSPOT,
                              smi.AmdSmiTemperatureMetric.CURRENT)
            ecc = self._call("amdsmi_get_gpu_total_ecc_count", handle) or {}
            metrics = self._call("amdsmi_get_gpu_metrics_info", handle) or {}
            status = metrics.get("throttle_status")
            out.append(Reading(index=index, sm_clock_mhz=_number(clock.get("cur_clk")),
                               max_sm_clock_mhz=_number(clock.get("max_clk")), power_w=_number(watts),
                               temperature_c=_number(temp), reasons=[AMD_THROTTLED] if _number(status) else [],
                               ecc_uncorrected=_int(ecc.get("uncorrectable_count"))))
        return out

    def close(self) -> None:
        self._call("amdsmi_shut_down")


def _number(value) -> Optional[float]:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None   # amdsmi says "N/A" for what a GPU does not report


def _int(value) -> Optional[int]:
    number = _number(value)
    return int(number) if number is not None else None


def open_watch(indices: list[int]):
    """A watch of these GPUs through the vendor's library that loads here (NVML, then amdsmi), or None."""
    try:
        import pynvml
        return NvmlWatch(pynvml, indices)
    except Exception:   # no nvidia-ml-py, no driver (NVMLError_LibraryNotFound), no such GPU
        pass
    try:
        import amdsmi
        return AmdSmiWatch(amdsmi, indices)
    except Exception:
        return None
