"""NVIDIA detection: NVML through nvidia-ml-py (pynvml), then nvidia-smi.

The NVML path runs on the team's lent H100/H200 machines; on this CPU
machine the tests exercise the nvidia-smi CSV parser on real-format output
and the guarded NVML call failing cleanly (no libnvidia-ml).
"""
from __future__ import annotations

import re
from typing import Optional

from envs.machine import DeviceStatus, Gpu, GpuStatus
from envs.probes.common import GIB, bus_id, run_tool, to_float, to_int

QUERY_GPU = "index,name,memory.total,driver_version,compute_cap,pci.bus_id"
QUERY_STATUS = "index,memory.total,memory.used,temperature.gpu,ecc.errors.uncorrected.volatile.total,pci.bus_id"


def sm_arch(capability: Optional[str]) -> Optional[str]:
    """Compute capability "9.0" -> "sm_90"."""
    if not capability or not re.fullmatch(r"\d+\.\d+", capability.strip()):
        return None
    major, minor = capability.strip().split(".")
    return f"sm_{major}{minor}"


def cuda_version_from_int(value: int) -> str:
    """NVML's CUDA driver version 12040 -> "12.4"."""
    return f"{value // 1000}.{value % 1000 // 10}"


def parse_nvidia_smi_csv(text: str) -> tuple[list[Gpu], Optional[str]]:
    """`nvidia-smi --query-gpu=QUERY_GPU --format=csv,noheader,nounits`."""
    gpus, driver = [], None
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 6 or to_int(fields[0]) is None:
            continue
        memory_mib = to_float(fields[2])
        driver = driver or fields[3]
        gpus.append(Gpu(index=int(fields[0]), name=fields[1],
                        memory_gib=round(memory_mib / 1024, 1) if memory_mib else None,
                        arch=sm_arch(fields[4]), bus_id=bus_id(fields[5])))
    return gpus, driver


def parse_cuda_version(text: str) -> Optional[str]:
    """The "CUDA Version: 12.4" in nvidia-smi's banner."""
    match = re.search(r"CUDA Version:\s*([\d.]+)", text or "")
    return match.group(1) if match else None


def parse_status_csv(text: str, apps: str = "") -> GpuStatus:
    """`--query-gpu=QUERY_STATUS` plus `--query-compute-apps=pid,gpu_bus_id` (csv,noheader,nounits)."""
    devices, by_bus = [], {}
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 6 or to_int(fields[0]) is None:
            continue
        total, used = to_float(fields[1]), to_float(fields[2])
        device = DeviceStatus(int(fields[0]), total / 1024 if total else None,
                              used / 1024 if used is not None else None,
                              to_float(fields[3]), to_int(fields[4]))  # "[N/A]" where ECC is off -> None
        devices.append(device)
        by_bus[bus_id(fields[5])] = device
    pids = []
    for line in apps.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) >= 2 and to_int(fields[0]) is not None:
            pids.append(int(fields[0]))
            if bus_id(fields[1]) in by_bus:
                by_bus[bus_id(fields[1])].pids.append(int(fields[0]))
    return GpuStatus(devices, pids, "nvidia-smi")


def read_nvml(nvml) -> tuple[list[Gpu], Optional[str], Optional[str]]:
    """(gpus, driver, CUDA version) through an initialised pynvml module."""

    def text(value):
        return value.decode() if isinstance(value, bytes) else value

    gpus = []
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
        gpus.append(Gpu(index=index, name=text(nvml.nvmlDeviceGetName(handle)),
                        memory_gib=round(nvml.nvmlDeviceGetMemoryInfo(handle).total / GIB, 1),
                        arch=f"sm_{major}{minor}",
                        bus_id=bus_id(text(nvml.nvmlDeviceGetPciInfo(handle).busId))))
    cuda = cuda_version_from_int(nvml.nvmlSystemGetCudaDriverVersion())
    return gpus, text(nvml.nvmlSystemGetDriverVersion()), cuda


def _with_nvml(read):
    try:
        import pynvml as nvml
        nvml.nvmlInit()
    except Exception:  # no library, no driver, no device, no permission
        return None
    try:
        return read(nvml)
    except Exception:
        return None
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def probe():
    """(gpus, driver, CUDA version, source) or None when no NVIDIA GPU answers."""
    found = _with_nvml(read_nvml)
    if found and found[0]:
        return (*found, "nvml")
    text = run_tool(["nvidia-smi", f"--query-gpu={QUERY_GPU}", "--format=csv,noheader,nounits"])
    gpus, driver = parse_nvidia_smi_csv(text) if text else ([], None)
    if not gpus:
        return None
    return gpus, driver, parse_cuda_version(run_tool(["nvidia-smi"]) or ""), "nvidia-smi"


def status() -> Optional[GpuStatus]:
    """Live memory, temperature, uncorrected ECC and compute processes per GPU."""

    def read(nvml):
        devices, pids = [], []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            device = DeviceStatus(index, memory.total / GIB, memory.used / GIB)
            try:
                device.temperature_c = float(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))
            except nvml.NVMLError:
                pass
            try:
                device.ecc_uncorrected = int(nvml.nvmlDeviceGetTotalEccErrors(
                    handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC))
            except nvml.NVMLError:  # ECC off or not supported
                pass
            device.pids = [p.pid for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)]
            pids += device.pids
            devices.append(device)
        return GpuStatus(devices, pids, "nvml")

    found = _with_nvml(read)
    if found:
        return found
    text = run_tool(["nvidia-smi", f"--query-gpu={QUERY_STATUS}", "--format=csv,noheader,nounits"])
    if not text:
        return None
    apps = run_tool(["nvidia-smi", "--query-compute-apps=pid,gpu_bus_id", "--format=csv,noheader,nounits"]) or ""
    return parse_status_csv(text, apps)


def topology_text() -> Optional[str]:
    """`nvidia-smi topo -m`: the GPU/NIC matrix that envs.topology parses (None without the tool)."""
    return run_tool(["nvidia-smi", "topo", "-m"])
