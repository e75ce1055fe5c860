"""preflight.host: memory, /dev/shm, locked-memory limit, NUMA, disk space for runs."""
from __future__ import annotations

import os
import resource
import shutil
from pathlib import Path

from runtime.preflight.result import FAIL, PASS, WARN, CheckResult

GIB = 1024 ** 3
SHM_FLOOR_MIB = 64  # Docker's default size; below it even CPU runs fail (no GPU needed to break)
SHM_MIN_GIB = 8  # Primus node-smoke: /dev/shm >= 8 GiB (NCCL and data-loader workers live there)
MEMLOCK_MIN_GIB = 32  # Primus node-smoke: RLIMIT_MEMLOCK >= 32 GiB for RDMA registrations
DISK_WARN_GIB, DISK_FAIL_GIB = 20, 1


def run(inp) -> list[CheckResult]:
    return [_memory(), _shm(inp), _memlock(inp), _numa(inp), _disk(inp)]


def _memory() -> CheckResult:
    import psutil
    mem = psutil.virtual_memory()
    value = f"{mem.available / GIB:.1f} of {mem.total / GIB:.1f} GiB free"
    if mem.available < 2 * GIB:
        return CheckResult("host.memory", FAIL, value, "under 2 GiB of host memory available",
                           "stop what uses it or pick another node")
    if mem.available < 8 * GIB or mem.available < 0.1 * mem.total:
        return CheckResult("host.memory", WARN, value, "little host memory available (data loaders, checkpoints)",
                           "check for leftover processes (ps aux --sort=-rss)")
    return CheckResult("host.memory", PASS, value, "available host memory")


def _shm(inp) -> CheckResult:
    try:
        st = os.statvfs(inp.root / "dev/shm")
    except OSError:
        return CheckResult("host.shm", WARN, None, "/dev/shm missing", "mount a tmpfs at /dev/shm")
    size = st.f_blocks * st.f_frsize / GIB
    value = f"{size:.1f} GiB" if size >= 0.1 else f"{size * 1024:.0f} MiB"
    fix = "enlarge it (docker: --shm-size=16g or --ipc=host)"
    if inp.machine.has_gpu and size < 1:
        return CheckResult("host.shm", FAIL, value, "/dev/shm under 1 GiB (a container default): NCCL and "
                           "data-loader workers fail with bus errors", fix)
    if size * 1024 < SHM_FLOOR_MIB:
        return CheckResult("host.shm", FAIL, value, f"/dev/shm under {SHM_FLOOR_MIB} MiB: torch's shared-memory "
                           "tensors (data-loader workers, multiprocessing) fail with bus errors", fix)
    if size < (SHM_MIN_GIB if inp.machine.has_gpu else 1):
        return CheckResult("host.shm", WARN, value, f"/dev/shm under {SHM_MIN_GIB} GiB", fix)
    return CheckResult("host.shm", PASS, value, "/dev/shm size")


def _memlock(inp) -> CheckResult:
    from envs import netinfo
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    unlimited = soft == resource.RLIM_INFINITY
    value = "unlimited" if unlimited else f"{soft / GIB:.2f} GiB"
    if unlimited or soft >= MEMLOCK_MIN_GIB * GIB:
        return CheckResult("host.memlock", PASS, value, "locked-memory limit is enough for RDMA")
    fix = "raise it: ulimit -l unlimited (limits.conf memlock, docker --ulimit memlock=-1)"
    if netinfo.rdma_ports(inp.root):
        return CheckResult("host.memlock", FAIL, value,
                           f"RDMA devices present but locked memory is limited (< {MEMLOCK_MIN_GIB} GiB): "
                           "NCCL's IB transport cannot register buffers", fix)
    return CheckResult("host.memlock", PASS, value, "limited, but no RDMA devices here (matters for RDMA only)")


def _numa(inp) -> CheckResult:
    nodes = sorted((inp.root / "sys/devices/system/node").glob("node[0-9]*"))
    try:
        balancing = (inp.root / "proc/sys/kernel/numa_balancing").read_text().strip()
    except OSError:
        balancing = None
    value = f"{len(nodes) or 1} node(s)" + (f", balancing {'on' if balancing == '1' else 'off'}"
                                            if balancing is not None else "")
    if balancing == "1" and len(nodes) > 1 and inp.machine.has_gpu:
        return CheckResult("host.numa", WARN, value, "automatic NUMA balancing migrates pages under running ranks",
                           "echo 0 > /proc/sys/kernel/numa_balancing (ROCm system validation guide)")
    return CheckResult("host.numa", PASS, value, "NUMA layout")


def _disk(inp) -> CheckResult:
    path = Path(inp.run_dir)
    while not path.exists() and path != path.parent:
        path = path.parent
    free = shutil.disk_usage(path).free / GIB
    value = f"{free:.1f} GiB free"
    fix = "free space, or point anvil.runs_dir (invoke.yaml) at a larger file system"
    if free < DISK_FAIL_GIB:
        return CheckResult("host.disk", FAIL, value, f"under {DISK_FAIL_GIB} GiB free for runs in {inp.run_dir}", fix)
    if free < DISK_WARN_GIB:
        return CheckResult("host.disk", WARN, value, f"under {DISK_WARN_GIB} GiB free in {inp.run_dir}: "
                           "checkpoints may not fit", fix)
    return CheckResult("host.disk", PASS, value, f"space for runs in {inp.run_dir}")
