"""AMD Instinct detection: pyrsmi, then amd-smi, rocm-smi, then KFD sysfs.

NOT RUN ON AMD HARDWARE HERE. The parsers below were written from the
vendors' documented formats and real outputs published by others (rocm-smi
JSON from ROCm 5 and 6 on MI250X, amd-smi static JSON on MI300X, KFD
topology properties files) and are tested on those samples; the live calls
(pyrsmi initialisation, the tools' exit behaviour) were not exercised on an
AMD GPU from this machine.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Optional

from envs.machine import DeviceStatus, Gpu, GpuStatus
from envs.probes.common import GIB, bus_id, run_tool, to_float, to_int

KFD_NODES = "sys/class/kfd/kfd/topology/nodes"


# ---- architecture names ---------------------------------------------------------

def gfx_from_target_version(value) -> Optional[str]:
    """KFD gfx_target_version (major*10000 + minor*100 + stepping) -> "gfx942"; 0 (a CPU node) -> None.

    Minor and stepping are printed as hex digits: 90010 is gfx90a, 90402 gfx942, 90500 gfx950.
    """
    number = to_int(value)
    if not number:
        return None
    major, minor, step = number // 10000, (number // 100) % 100, number % 100
    return f"gfx{major}{minor:x}{step:x}"


def normalize_gfx(name: Optional[str]) -> Optional[str]:
    """Clean an arch string: drop feature flags (gfx90a:sramecc+:xnack-) and undo
    rocm-smi 6's "gfx9010" (it prints the stepping of gfx90a in decimal)."""
    if not name:
        return None
    name = name.strip().lower().split(":")[0]
    odd = re.fullmatch(r"gfx9(\d)(\d\d)", name)
    if odd:
        return f"gfx9{int(odd.group(1)):x}{int(odd.group(2)):x}"
    return name if name.startswith("gfx") else None


# ---- KFD sysfs --------------------------------------------------------------------

def parse_properties(text: str) -> dict[str, int]:
    """A KFD "properties" file: one "name value" pair per line."""
    props = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2:
            value = to_int(parts[1])
            if value is not None:
                props[parts[0]] = value
    return props


def bdf_from_location(domain: int, location_id: int) -> str:
    """KFD location_id packs bus<<8 | device<<3 | function."""
    return f"{domain:04x}:{location_id >> 8 & 0xff:02x}:{location_id >> 3 & 0x1f:02x}.{location_id & 0x7}"


def read_sysfs(root: Path = Path("/")) -> list[Gpu]:
    """GPUs in the KFD topology under `root` (CPU nodes have gfx_target_version 0)."""
    nodes = root / KFD_NODES
    found = []
    try:
        node_dirs = sorted(nodes.iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else 1 << 30)
    except OSError:
        return []
    for node in node_dirs:
        try:
            props = parse_properties((node / "properties").read_text())
        except OSError:
            continue
        arch = gfx_from_target_version(props.get("gfx_target_version"))
        if not arch:
            continue
        memory = 0
        for bank in node.glob("mem_banks/*/properties"):
            try:
                bank_props = parse_properties(bank.read_text())
            except OSError:
                continue
            if bank_props.get("heap_type") in (1, 2):  # frame buffer, public and private
                memory += bank_props.get("size_in_bytes", 0)
        memory = memory or props.get("local_mem_size", 0)
        simd_per_cu = props.get("simd_per_cu") or 4
        device_id = props.get("device_id")
        found.append(Gpu(
            index=len(found),
            name=f"AMD GPU {arch}" + (f" (0x{device_id:04x})" if device_id else ""),
            memory_gib=round(memory / GIB, 1) if memory else None,
            arch=arch,
            bus_id=bdf_from_location(props.get("domain", 0), props["location_id"]) if "location_id" in props else None,
            device_id=device_id,
            compute_units=props["simd_count"] // simd_per_cu if props.get("simd_count") else None,
        ))
    return found


def read_driver_version(root: Path = Path("/")) -> Optional[str]:
    try:
        return (root / "sys/module/amdgpu/version").read_text().strip() or None
    except OSError:
        return None


def read_rocm_version(root: Path = Path("/"), environ=os.environ) -> Optional[str]:
    """ROCm release from <ROCM_PATH>/.info/version ("6.2.4-120" -> "6.2.4")."""
    rocm = Path(environ.get("ROCM_PATH", "/opt/rocm"))
    path = root / rocm.relative_to("/") / ".info/version" if rocm.is_absolute() else rocm / ".info/version"
    try:
        return path.read_text().strip().split("-")[0] or None
    except OSError:
        return None


def parse_amd_smi_version(text: str) -> Optional[str]:
    """`amd-smi version`: "AMDSMI Tool: 24.6.3+9578815 | AMDSMI Library version: 24.6.3.0 | ROCm version: 6.2.4"."""
    match = re.search(r"ROCm version:\s*([\w.]+)", text)
    return match.group(1) if match and match.group(1) != "N/A" else None


# ---- rocm-smi ----------------------------------------------------------------------

_NAME_KEYS = ("Card Series", "Card series", "Device Name", "Card SKU")
_ID_KEYS = ("Device ID", "GPU ID", "Card Model", "Card model")


def parse_rocm_smi_json(text: str) -> tuple[list[Gpu], Optional[str]]:
    """`rocm-smi --showproductname --showmeminfo vram --showbus --showdriverversion --json`.

    Keys changed between releases ("Card series" in ROCm 5, "Card Series",
    "Device Name", "GFX Version" in ROCm 6); cards are "card0", "card1", ...
    """
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return [], None
    if not isinstance(data, dict):
        return [], None
    driver = (data.get("system") or {}).get("Driver version")
    cards = sorted((k for k in data if re.fullmatch(r"card\d+", k)), key=lambda k: int(k[4:]))
    gpus = []
    for index, key in enumerate(cards):
        card = data[key]
        name = next((card[k] for k in _NAME_KEYS if card.get(k)), "AMD GPU")
        device_id = next((to_int(card[k]) for k in _ID_KEYS if to_int(card.get(k)) not in (None, 0)), None)
        # "Card model" in ROCm 5 is the subsystem id (0x0b0c on MI250X), not the device id: GPU ID wins.
        if card.get("GPU ID"):
            device_id = to_int(card["GPU ID"])
        memory = to_int(card.get("VRAM Total Memory (B)"))
        gpus.append(Gpu(index=index, name=name.strip(), memory_gib=round(memory / GIB, 1) if memory else None,
                        arch=normalize_gfx(card.get("GFX Version")), bus_id=bus_id(card.get("PCI Bus")),
                        device_id=device_id))
    return gpus, driver


def parse_rocm_smi_status(text: str) -> Optional[GpuStatus]:
    """`rocm-smi --showmeminfo vram --showtemp --showpids --json`."""
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return None
    devices = []
    for index, key in enumerate(sorted((k for k in data if re.fullmatch(r"card\d+", k)), key=lambda k: int(k[4:]))):
        card = data[key]
        total, used = to_int(card.get("VRAM Total Memory (B)")), to_int(card.get("VRAM Total Used Memory (B)"))
        temp = next((to_float(card[k]) for k in ("Temperature (Sensor junction) (C)", "Temperature (Sensor edge) (C)")
                     if k in card), None)
        devices.append(DeviceStatus(index, total / GIB if total else None, used / GIB if used is not None else None,
                                    temp))
    # "system": {"PID12345": "python3, 1, 2147483648, 0, 0"} (name, GPUs, VRAM, SDMA, CU occupancy)
    pids = [int(k[3:]) for k in (data.get("system") or {}) if re.fullmatch(r"PID\d+", k)]
    return GpuStatus(devices, pids, "rocm-smi")


# ---- amd-smi -----------------------------------------------------------------------

def _size_gib(size) -> Optional[float]:
    """amd-smi vram size: {"value": 196592, "unit": "MB"} or "196592 MB"."""
    if isinstance(size, str):
        parts = size.split()
        size = {"value": parts[0], "unit": parts[1] if len(parts) > 1 else "MB"}
    if not isinstance(size, dict):
        return None
    value = to_float(size.get("value"))
    if value is None:
        return None
    scale = {"B": 1, "KB": 1024, "MB": 1024 ** 2, "GB": GIB}.get(str(size.get("unit", "MB")).upper(), 1024 ** 2)
    return round(value * scale / GIB, 1)


def parse_amd_smi_static(text: str) -> tuple[list[Gpu], Optional[str]]:
    """`amd-smi static --asic --vram --bus --driver --json`: a list (ROCm 6.0-6.3) or {"gpu_data": [...]} (later)."""
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return [], None
    entries = data.get("gpu_data", []) if isinstance(data, dict) else data
    if not isinstance(entries, list):
        return [], None
    gpus, driver = [], None
    for position, entry in enumerate(e for e in entries if isinstance(e, dict)):
        asic = entry.get("asic") or {}
        driver = driver or (entry.get("driver") or {}).get("version")
        gpus.append(Gpu(
            index=to_int(entry.get("gpu")) if to_int(entry.get("gpu")) is not None else position,
            name=(asic.get("market_name") or "AMD GPU").strip(),
            memory_gib=_size_gib((entry.get("vram") or {}).get("size")),
            arch=normalize_gfx(asic.get("target_graphics_version")),
            bus_id=bus_id((entry.get("bus") or {}).get("bdf")),
            device_id=to_int(asic.get("device_id")),
            compute_units=to_int(asic.get("num_compute_units")),
        ))
    return gpus, driver


# ---- pyrsmi (rocm-smi-lib / amdsmi through ctypes) ----------------------------------

def read_pyrsmi(rocml) -> tuple[list[Gpu], Optional[str]]:
    """Read devices through an initialised `pyrsmi.rocml`; the caller initialises and shuts down."""
    gpus = []
    for index in range(rocml.smi_get_device_count()):
        total = rocml.smi_get_device_memory_total(index)
        device_id = rocml.smi_get_device_id(index)
        gpus.append(Gpu(index=index, name=(rocml.smi_get_device_name(index) or "AMD GPU").strip(),
                        memory_gib=round(total / GIB, 1) if total and total > 0 else None,
                        device_id=device_id if device_id and device_id > 0 else None))
    return gpus, rocml.smi_get_kernel_version() or None


def _with_pyrsmi(read):
    """Run read(rocml) inside an initialised pyrsmi session; None when pyrsmi or the driver is missing."""
    try:
        from pyrsmi import rocml
    except Exception:
        return None
    try:
        rocml.smi_initialize()
    except Exception:  # library missing, driver not loaded, no permission
        return None
    try:
        return read(rocml)
    except Exception:
        return None
    finally:
        try:
            rocml.smi_shutdown()
        except Exception:
            pass


def _live_sources(root: Path):
    """(gpus, driver, source) from the first probe that answers on this machine."""
    if root == Path("/"):
        found = _with_pyrsmi(read_pyrsmi)
        if found and found[0]:
            return (*found, "pyrsmi")
        text = run_tool(["amd-smi", "static", "--asic", "--vram", "--bus", "--driver", "--json"])
        gpus, driver = parse_amd_smi_static(text) if text else ([], None)
        if gpus:
            return gpus, driver, "amd-smi"
        text = run_tool(["rocm-smi", "--showproductname", "--showmeminfo", "vram", "--showbus",
                         "--showdriverversion", "--json"])
        gpus, driver = parse_rocm_smi_json(text) if text else ([], None)
        if gpus:
            return gpus, driver, "rocm-smi"
    return [], None, None


def probe(root: Path = Path("/")):
    """(gpus, driver, rocm version, source) or None when this is not an AMD GPU machine.

    sysfs is read every time: it is cheap and it alone states the ISA (gfx942)
    and compute-unit count that tell MI250 from MI250X.
    """
    sysfs = read_sysfs(root)
    if not sysfs and not (root / "dev/kfd").exists():
        return None  # no KFD: no ROCm-usable AMD GPU; skip the slow tools
    gpus, driver, source = _live_sources(root)
    if not gpus:
        gpus, source = sysfs, "sysfs"
    elif len(sysfs) == len(gpus):
        for gpu, kfd in zip(gpus, sysfs):
            gpu.arch = gpu.arch or kfd.arch
            gpu.bus_id = gpu.bus_id or kfd.bus_id
            gpu.device_id = gpu.device_id or kfd.device_id
            gpu.compute_units = gpu.compute_units or kfd.compute_units
            gpu.memory_gib = gpu.memory_gib or kfd.memory_gib
    if not gpus:
        return None
    version = read_rocm_version(root)
    if version is None and root == Path("/"):
        text = run_tool(["amd-smi", "version"])
        version = parse_amd_smi_version(text) if text else None
    return gpus, driver or read_driver_version(root), version, source


def status() -> Optional[GpuStatus]:
    """Live memory, temperature and compute processes (pyrsmi, else rocm-smi). NOT RUN on AMD here."""

    def read(rocml):
        devices = []
        for index in range(rocml.smi_get_device_count()):
            total, used = rocml.smi_get_device_memory_total(index), rocml.smi_get_device_memory_used(index)
            devices.append(DeviceStatus(index, total / GIB if total > 0 else None,
                                        used / GIB if used >= 0 else None))
        return GpuStatus(devices, list(rocml.smi_get_device_compute_process()), "pyrsmi")

    found = _with_pyrsmi(read)
    if found and found.devices:
        # pyrsmi has no temperature call; rocm-smi adds it when present.
        text = run_tool(["rocm-smi", "--showtemp", "--json"])
        temps = parse_rocm_smi_status(text) if text else None
        if temps and len(temps.devices) == len(found.devices):
            for device, other in zip(found.devices, temps.devices):
                device.temperature_c = other.temperature_c
        return found
    text = run_tool(["rocm-smi", "--showmeminfo", "vram", "--showtemp", "--showpids", "--json"])
    return parse_rocm_smi_status(text) if text else None


def topology_text() -> Optional[str]:
    """`rocm-smi --showtopo`: the link-type matrix and NUMA nodes that envs.topology parses."""
    return run_tool(["rocm-smi", "--showtopo"])
