"""A stand-in for nvidia-ml-py's `pynvml` on a machine without an NVIDIA driver: the calls the GPU watch
makes (envs/probes/watch.py), with NVML's documented names, constants, units and errors, over two GPUs.

GPU 0 stays healthy. GPU 1 from its second reading on holds its clocks down for a hardware thermal
slowdown (reason bit 0x40) at 1,100 of 1,980 MHz, and raises Xid 79 once, before its third reading;
its uncorrected ECC count goes from 0 to 2 at the same time. Readings are counted per process: each
reading first drains the Xid events (the watch's first call), which ends in NVMLError_Timeout once.
Copied as `pynvml.py` first on PYTHONPATH, it is what `import pynvml` finds (tests/envs/test_gpu_watch.py).
"""
from __future__ import annotations

NVML_CLOCK_SM = 1
NVML_TEMPERATURE_GPU = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
nvmlEventTypeXidCriticalError = 8


class NVMLError(Exception):
    pass


class NVMLError_Timeout(NVMLError):
    pass


class NVMLError_NotSupported(NVMLError):
    pass


class _Handle:
    def __init__(self, index: int):
        self.index = index


class _EventData:
    def __init__(self, device, xid: int):
        self.device, self.eventData, self.eventType = device, xid, nvmlEventTypeXidCriticalError


_HANDLES = [_Handle(0), _Handle(1)]
_reads = [0]              # readings begun so far
_pending: list[_EventData] = []
_xid_raised = [False]


def nvmlInit():
    pass


def nvmlShutdown():
    pass


def nvmlDeviceGetHandleByIndex(index):
    if not 0 <= index < len(_HANDLES):
        raise NVMLError("Invalid Argument")
    return _HANDLES[index]


def nvmlEventSetCreate():
    return object()


def nvmlDeviceRegisterEvents(handle, types, event_set):
    pass


def nvmlEventSetFree(event_set):
    pass


def nvmlEventSetWait_v2(event_set, timeout_ms):
    if _reads[0] == 2 and not _xid_raised[0]:     # before the third reading
        _xid_raised[0] = True
        _pending.append(_EventData(_HANDLES[1], 79))
    if not _pending:
        _reads[0] += 1                           # the reading this wait began goes on with the GPUs
        raise NVMLError_Timeout("Timeout")
    return _pending.pop(0)


def _troubled(handle) -> bool:
    return handle.index == 1 and _reads[0] >= 2


def nvmlDeviceGetClockInfo(handle, kind):
    return 1100 if _troubled(handle) else 1980


def nvmlDeviceGetMaxClockInfo(handle, kind):
    return 1980


def nvmlDeviceGetPowerUsage(handle):
    return 690_000          # milliwatts


def nvmlDeviceGetTemperature(handle, sensor):
    return 91 if _troubled(handle) else 64


def nvmlDeviceGetCurrentClocksEventReasons(handle):
    return 0x40 | 0x4 if _troubled(handle) else 0x4     # power cap alone is a GPU at full load


def nvmlDeviceGetTotalEccErrors(handle, error_type, counter_type):
    return 2 if _xid_raised[0] and handle.index == 1 else 0
