"""envs: detection parsers on real-format tool output and sysfs trees, profiles, layered resolution."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import envs
from envs import netinfo, profiles
from envs.detect import machine_from
from envs.probes import amd, nvidia
from envs.spec import Computed

# ---- sample outputs (formats as the tools print them) -----------------------------------------

# rocm-smi --showproductname ... --json, ROCm 5 on an MI250X node (LUMI-like): "Card series",
# "GPU ID", and "Card model" holding the subsystem id.
ROCM_SMI_ROCM5 = json.dumps({
    "card0": {"GPU ID": "0x740c", "Card series": "AMD INSTINCT MI250 (MCM) OAM AC MBA", "Card model": "0x0b0c",
              "Card vendor": "Advanced Micro Devices, Inc. [AMD/ATI]", "Card SKU": "D65209",
              "VRAM Total Memory (B)": "68702699520", "PCI Bus": "0000:C1:00.0"},
    "card1": {"GPU ID": "0x740c", "Card series": "AMD INSTINCT MI250 (MCM) OAM AC MBA", "Card model": "0x0b0c",
              "Card SKU": "D65209", "VRAM Total Memory (B)": "68702699520", "PCI Bus": "0000:C6:00.0"},
    "system": {"Driver version": "6.2.4"},
})
# ROCm 6: "Card Series", "Device ID", and "GFX Version" printed as gfx9010 for gfx90a.
ROCM_SMI_ROCM6 = json.dumps({
    "card0": {"Device Name": "AMD INSTINCT MI250 (MCM) OAM AC MBA", "Device ID": "0x740c",
              "Card Series": "AMD INSTINCT MI250 (MCM) OAM AC MBA", "Card Model": "0x740c",
              "GFX Version": "gfx9010", "PCI Bus": "0000:29:00.0"},
    "system": {"Driver version": "6.2.4"},
})
# amd-smi static --asic --vram --bus --driver --json (ROCm 6.4+ wraps the list in gpu_data).
AMD_SMI_STATIC = json.dumps({"gpu_data": [
    {"gpu": i, "asic": {"market_name": "AMD Instinct MI300X", "vendor_id": "0x1002", "device_id": "0x74a1",
                        "target_graphics_version": "gfx942", "num_compute_units": 304},
     "bus": {"bdf": f"0000:{0x11 + i:02x}:00.0"}, "vram": {"type": "HBM3", "size": {"value": 196592, "unit": "MB"}},
     "driver": {"name": "amdgpu", "version": "6.10.5"}} for i in range(2)]})
# nvidia-smi --query-gpu=index,name,memory.total,driver_version,compute_cap,pci.bus_id --format=csv,noheader,nounits
NVIDIA_SMI_CSV = """0, NVIDIA H100 80GB HBM3, 81559, 535.104.05, 9.0, 00000000:18:00.0
1, NVIDIA H100 80GB HBM3, 81559, 535.104.05, 9.0, 00000000:2A:00.0
"""
NVIDIA_SMI_BANNER = "| NVIDIA-SMI 535.104.05   Driver Version: 535.104.05   CUDA Version: 12.2     |"
# /proc/net/route as the kernel prints it (this machine's, plus an IB subnet)
PROC_NET_ROUTE = """Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT
eth0\t00000000\t010200C0\t0003\t0\t0\t0\t00000000\t0\t0\t0
eth0\t000200C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0
ib0\t0000010A\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0
"""


def kfd_node(root: Path, node: int, props: dict, vram: int = 0) -> None:
    path = root / amd.KFD_NODES / str(node)
    path.mkdir(parents=True)
    (path / "properties").write_text("".join(f"{k} {v}\n" for k, v in props.items()))
    if vram:
        (path / "mem_banks/0").mkdir(parents=True)
        (path / "mem_banks/0/properties").write_text(f"heap_type 1\nsize_in_bytes {vram}\nflags 0\nwidth 4096\n")


def gpu_props(device_id: int, target: int, simd: int, location: int) -> dict:
    return {"cpu_cores_count": 0, "simd_count": simd, "mem_banks_count": 1, "simd_per_cu": 4,
            "gfx_target_version": target, "vendor_id": 4098, "device_id": device_id, "location_id": location,
            "domain": 0, "drm_render_minor": 128}


# ---- AMD parsers --------------------------------------------------------------------------

@pytest.mark.parametrize("value, arch", [(90402, "gfx942"), (90010, "gfx90a"), (90500, "gfx950"),
                                         ("110000", "gfx1100"), (0, None)])
def test_gfx_target_version(value, arch):
    assert amd.gfx_from_target_version(value) == arch


def test_normalize_gfx_undoes_rocm_smi_decimal_stepping():
    assert amd.normalize_gfx("gfx9010") == "gfx90a"
    assert amd.normalize_gfx("gfx90a:sramecc+:xnack-") == "gfx90a"
    assert amd.normalize_gfx("gfx942") == "gfx942"
    assert amd.normalize_gfx("N/A") is None


def test_rocm_smi_rocm5_mi250x():
    gpus, driver = amd.parse_rocm_smi_json(ROCM_SMI_ROCM5)
    assert driver == "6.2.4" and len(gpus) == 2
    assert gpus[0].device_id == 0x740C  # GPU ID, not the subsystem id in "Card model"
    assert gpus[1].bus_id == "0000:c6:00.0" and gpus[0].memory_gib == 64.0
    machine = machine_from("amd", gpus, driver, "6.0.3", "rocm-smi")
    assert machine.model == "MI250X" and machine.arch == "gfx90a" and machine.count == 2
    assert any("compute units" in n for n in machine.notes)  # MI250 vs MI250X assumed, and said so


def test_rocm_smi_rocm6_gfx_version():
    gpus, _ = amd.parse_rocm_smi_json(ROCM_SMI_ROCM6)
    assert gpus[0].arch == "gfx90a" and gpus[0].device_id == 0x740C


def test_amd_smi_static_mi300x():
    gpus, driver = amd.parse_amd_smi_static(AMD_SMI_STATIC)
    assert driver == "6.10.5" and [g.index for g in gpus] == [0, 1]
    assert gpus[0].memory_gib == 192.0 and gpus[0].arch == "gfx942" and gpus[1].bus_id == "0000:12:00.0"
    assert machine_from("amd", gpus, driver, None, "amd-smi").profile == "mi300x"
    # ROCm 6.0-6.3 print a bare list
    assert len(amd.parse_amd_smi_static(json.dumps(json.loads(AMD_SMI_STATIC)["gpu_data"]))[0]) == 2
    assert amd.parse_amd_smi_static("not json") == ([], None)


def test_amd_smi_version():
    text = "AMDSMI Tool: 24.6.3+9578815 | AMDSMI Library version: 24.6.3.0 | ROCm version: 6.2.4"
    assert amd.parse_amd_smi_version(text) == "6.2.4"


def test_sysfs_mi300x_node(tmp_path):
    kfd_node(tmp_path, 0, {"cpu_cores_count": 96, "simd_count": 0, "gfx_target_version": 0})
    for n in (1, 2):
        kfd_node(tmp_path, n, gpu_props(29857, 90402, 1216, 0x1100 * n), vram=206141652992)
    (tmp_path / "sys/module/amdgpu").mkdir(parents=True)
    (tmp_path / "sys/module/amdgpu/version").write_text("6.8.5\n")
    (tmp_path / "opt/rocm/.info").mkdir(parents=True)
    (tmp_path / "opt/rocm/.info/version").write_text("6.2.4-120\n")
    gpus, driver, rocm, source = amd.probe(tmp_path)
    assert (driver, rocm, source) == ("6.8.5", "6.2.4", "sysfs")
    assert [g.arch for g in gpus] == ["gfx942", "gfx942"] and gpus[0].compute_units == 304
    assert gpus[1].bus_id == "0000:22:00.0" and gpus[0].memory_gib == 192.0
    machine = machine_from("amd", gpus, driver, rocm, source)
    assert machine.model == "MI300X" and machine.profile == "mi300x"


def test_sysfs_tells_mi250_from_mi250x_by_compute_units(tmp_path):
    kfd_node(tmp_path / "x", 1, gpu_props(0x740C, 90010, 440, 0xC100))
    kfd_node(tmp_path / "plain", 1, gpu_props(0x740C, 90010, 416, 0xC100))
    assert machine_from("amd", amd.read_sysfs(tmp_path / "x"), None, None, "sysfs").model == "MI250X"
    plain = machine_from("amd", amd.read_sysfs(tmp_path / "plain"), None, None, "sysfs")
    assert plain.model is None and plain.unknown_gpu and plain.arch == "gfx90a"


def test_no_amd_gpu_in_empty_root(tmp_path):
    assert amd.probe(tmp_path) is None
    assert amd.read_sysfs(tmp_path) == []


def test_rocm_smi_status_pids():
    text = json.dumps({"card0": {"VRAM Total Memory (B)": "68702699520", "VRAM Total Used Memory (B)": "11010048",
                                 "Temperature (Sensor junction) (C)": "44.0"},
                       "system": {"PID4242": "python3, 1, 2147483648, 0, 0"}})
    status = amd.parse_rocm_smi_status(text)
    assert status.pids == [4242] and status.devices[0].temperature_c == 44.0
    assert status.devices[0].memory_total_gib == pytest.approx(64.0, abs=0.1)


# ---- NVIDIA parsers -------------------------------------------------------------------------

def test_nvidia_smi_csv_h100():
    gpus, driver = nvidia.parse_nvidia_smi_csv(NVIDIA_SMI_CSV)
    assert driver == "535.104.05" and len(gpus) == 2
    assert gpus[0].arch == "sm_90" and gpus[1].bus_id == "0000:2a:00.0" and gpus[0].memory_gib == 79.6
    machine = machine_from("nvidia", gpus, driver, nvidia.parse_cuda_version(NVIDIA_SMI_BANNER), "nvidia-smi")
    assert (machine.model, machine.platform_version, machine.platform) == ("H100", "12.2", "cuda")


def test_nvidia_status_csv_attributes_processes():
    status = nvidia.parse_status_csv("0, 81559, 1024, 41, 0, 00000000:18:00.0\n1, 81559, 3, 38, [N/A], "
                                     "00000000:2A:00.0\n", apps="777, 00000000:18:00.0\n")
    assert status.pids == [777] and status.devices[0].pids == [777] and status.devices[1].pids == []
    assert status.devices[1].ecc_uncorrected is None and status.devices[0].temperature_c == 41.0


def test_nvml_and_pyrsmi_fail_cleanly_without_a_gpu():
    # The real libraries, on a machine without their drivers: guarded, no exception.
    assert nvidia.probe() is None
    assert amd._with_pyrsmi(amd.read_pyrsmi) is None
    machine = envs.detect()
    assert machine.vendor == "cpu" and not machine.has_gpu and machine.summary() == "no GPU (CPU only)"


# ---- model catalogue ------------------------------------------------------------------------

@pytest.mark.parametrize("reported, model", [
    ("AMD Instinct MI300X", "MI300X"), ("AMD Instinct MI325X", "MI325X"), ("AMD Instinct MI355X", "MI355X"),
    ("NVIDIA A100-SXM4-80GB", "A100"), ("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H200", "H200"),
    ("NVIDIA B200", "B200"), ("NVIDIA GH200 480GB", None), ("AMD Instinct MI308X", None)])
def test_match_reported_names(reported, model):
    found = profiles.match_reported(reported)
    assert (found.name if found else None) == model


def test_override_synthesizes_a_machine():
    machine = envs.detect("mi300x")
    assert (machine.model, machine.arch, machine.count, machine.source) == ("MI300X", "gfx942", 8, "override")
    assert envs.detect("H100:4").count == 4
    assert envs.detect(environ={"ANVIL_GPU": "MI250X"}).arch == "gfx90a"
    with pytest.raises(envs.EnvError, match="known models: .*MI300X.*H100"):
        envs.detect("MI999")


@pytest.mark.parametrize("typed, model, gib", [
    ("A100", "A100", 80), ("h100", "H100", 80), ("mi-300x", "MI300X", 192), ("AMD Instinct MI300X", "MI300X", 192),
    ("NVIDIA A100", "A100", 80), ("A100-40", "A100", 40), ("A100-40GB", "A100", 40), ("A100 40 GiB", "A100", 40)])
def test_a_typed_gpu_name_is_an_exact_model_with_an_optional_size(typed, model, gib):
    found = profiles.by_name(typed, "--gpu")
    assert (found.name, found.memory_gib) == (model, gib)


@pytest.mark.parametrize("typed, message", [
    ("xA100y", "unknown GPU model 'xA100y'; did you mean A100"), ("A100-foo", "got '-foo' after the model name"),
    ("NVIDIA A100-SXM4-40GB", "after the model name"), ("H100-0GB", "0 GiB per GPU is refused"),
    ("H100-999GB", "at most 100 GiB"), ("MI250X-128", "at most 80 GiB"), ("RTX4090", "known models: MI210")])
def test_a_typed_gpu_name_is_not_matched_loosely(typed, message):
    """match_reported finds "A100" anywhere in a driver's name; a name a user typed is the model, exactly."""
    with pytest.raises(envs.EnvError, match=message):
        profiles.by_name(typed, "--gpu")


def test_a_bad_anvil_gpu_says_it_came_from_anvil_gpu(monkeypatch):
    monkeypatch.setenv("ANVIL_GPU", "RTX4090:2")
    with pytest.raises(envs.EnvError, match="'RTX4090' in the ANVIL_GPU variable; known models: MI210") as bad:
        envs.detect()
    assert bad.value.exit_code == 2 and "unset ANVIL_GPU" in str(bad.value)
    monkeypatch.setenv("ANVIL_GPU", "A100-foo")
    with pytest.raises(envs.EnvError, match="^ANVIL_GPU='A100-foo': "):
        envs.detect()
    monkeypatch.setenv("ANVIL_GPU", "A100-40GB:2")
    assert (envs.detect().memory_gib, envs.detect().count) == (40, 2)
    with pytest.raises(envs.EnvError, match="^unknown GPU model 'RTX4090'; "):   # --gpu wins; not ANVIL_GPU's
        envs.detect("RTX4090")


def test_env_detect_names_anvil_gpu_in_one_line(tmp_path):
    from helpers.program import inv, one_line_error

    proc = inv(tmp_path, "env.detect", env={"ANVIL_GPU": "RTX4090"})
    one_line_error(proc, "env.detect: unknown GPU model 'RTX4090' in the ANVIL_GPU variable", "known models: ")


@pytest.mark.parametrize("key", sorted(profiles.MODELS))
def test_every_model_profile_sets_arch_and_peak_with_sources(key):
    resolved = envs.resolve(gpu=key, site="none", context={"environ": {}, "root": "/nonexistent"})
    peak = resolved.vars["ANVIL_GPU_PEAK_TFLOPS"]
    assert float(peak.value) == profiles.MODELS[key].peak_tflops and peak.source == f"model:{key}"
    assert resolved.vars["ANVIL_GPU_ARCH"].value == profiles.MODELS[key].arch
    for var in resolved.vars.values():
        assert var.reason and var.ref, var.name


def test_every_profile_entry_has_reason_and_public_source():
    every = [profiles.BASE, *profiles.VENDOR_PROFILES.values(), *profiles.MODEL_PROFILES.values(),
             *(m.PROFILE for m in profiles.sites.SITES.values())]
    for profile in every:
        for entry in profile.entries:
            assert len(entry.reason) > 15 and len(entry.ref) > 10, (profile.key, entry.name)


def test_peak_follows_the_form_factor():
    gpus, _ = nvidia.parse_nvidia_smi_csv("0, NVIDIA H100 PCIe, 81559, 535.104.05, 9.0, 00000000:18:00.0\n")
    machine = machine_from("nvidia", gpus, None, None, "nvidia-smi")
    assert envs.resolve(machine, site="none").vars["ANVIL_GPU_PEAK_TFLOPS"].value == "756"
    assert envs.resolve(gpu="MI250X", site="none").vars["ANVIL_GPU_PEAK_TFLOPS"].value == "191.5"


# ---- resolution -----------------------------------------------------------------------------

def test_layers_in_order_with_history():
    resolved = envs.resolve(gpu="MI250X", site="lumi", config_env={"NCCL_DEBUG": "INFO"},
                            overrides=["NCCL_NET_GDR_LEVEL=LOC"], context={"environ": {}})
    assert resolved.layers == ["base", "vendor:rocm", "model:mi250x", "site:lumi", "config", "cli"]
    ifname = resolved.vars["NCCL_SOCKET_IFNAME"]
    assert ifname.value == "hsn0,hsn1,hsn2,hsn3" and ifname.source == "site:lumi"
    assert [c.layer for c in ifname.history][-1] == "site:lumi" and "LUMI" in ifname.ref
    assert resolved.vars["NCCL_DEBUG"].source == "config"
    assert [c.value for c in resolved.vars["NCCL_DEBUG"].history] == ["WARN", "INFO"]
    gdr = resolved.vars["NCCL_NET_GDR_LEVEL"]
    assert (gdr.value, gdr.source) == ("LOC", "cli") and gdr.history[0].value == "PHB"
    assert resolved.environ()["HSA_NO_SCRATCH_RECLAIM"] == "1"


def test_model_layer_can_unset():
    resolved = envs.resolve(gpu="B200", site="none")
    alloc = resolved.vars["PYTORCH_CUDA_ALLOC_CONF"]
    assert alloc.value is None and alloc.source == "model:b200" and alloc.history[0].layer == "vendor:cuda"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in resolved.environ()


def test_lumi_site_detection_and_per_node_miopen_cache(tmp_path):
    context = {"environ": {"LUMI_STACK_VERSION": "23.09", "SLURM_NODEID": "7", "USER": "ana"}, "root": tmp_path}
    resolved = envs.resolve(gpu="MI250X", context=context)
    assert resolved.site == "lumi"
    assert resolved.vars["MIOPEN_USER_DB_PATH"].value == "/tmp/ana-miopen-cache-7"
    assert envs.resolve(gpu="MI250X", site="none", context=context).site is None
    with pytest.raises(envs.EnvError, match="known sites: lumi"):
        envs.resolve(gpu="MI250X", site="atlantis")


def test_bad_override_is_an_env_error():
    with pytest.raises(envs.EnvError, match="KEY=VALUE"):
        envs.resolve(gpu="H100", overrides=["NOEQUALS"])
    with pytest.raises(envs.EnvError):
        envs.resolve(gpu="H100", overrides=["1BAD=x"])


def test_shell_value_replaced_is_warned():
    resolved = envs.resolve(gpu="H100", site="none", context={"environ": {"NCCL_DEBUG": "INFO"}})
    assert any("NCCL_DEBUG=INFO in your environment" in w for w in resolved.warnings)


def test_unknown_gpu_warns():
    gpus, _ = amd.parse_amd_smi_static(json.dumps([{"gpu": 0, "asic": {"market_name": "AMD Instinct MI308X",
                                                                        "target_graphics_version": "gfx942"}}]))
    machine = machine_from("amd", gpus, None, None, "amd-smi")
    resolved = envs.resolve(machine, site="none")
    assert machine.unknown_gpu and "ANVIL_GPU_PEAK_TFLOPS" not in resolved.vars
    assert "vendor:rocm" in resolved.layers and "no Anvil profile" in resolved.warnings[0]


def test_a_computed_value_that_breaks_is_a_warning_not_a_crash(monkeypatch):
    def boom(ctx):
        raise OSError("sysfs went away")
    broken = profiles.BASE.entries + (Computed("BROKEN_PROBE", boom, "a probe that fails", "test"),)
    monkeypatch.setattr(profiles, "BASE", profiles.BASE.__class__("base", "base", "t", broken))
    resolved = envs.resolve(gpu="H100", site="none")
    assert "BROKEN_PROBE" not in resolved.vars and any("sysfs went away" in w for w in resolved.warnings)


# ---- computed values: routes and RDMA ports -------------------------------------------------

def test_proc_net_route_longest_prefix():
    assert netinfo.route_from_table(PROC_NET_ROUTE, "10.1.7.9") == "ib0"
    assert netinfo.route_from_table(PROC_NET_ROUTE, "192.0.2.77") == "eth0"
    assert netinfo.route_from_table(PROC_NET_ROUTE, "8.8.8.8") == "eth0"  # default route
    assert netinfo.route_from_table(PROC_NET_ROUTE, "127.0.0.1") == "lo"
    assert netinfo.route_from_table("Iface\tDestination\n", "10.0.0.1") is None


def test_ip_route_get_output():
    assert netinfo.parse_ip_route_get("8.8.8.8 via 192.0.2.1 dev eth0 src 192.0.2.2 uid 0 \\    cache ") == "eth0"
    assert netinfo.parse_ip_route_get("local 127.0.0.1 dev lo src 127.0.0.1 uid 0") == "lo"


def fake_root(tmp_path: Path, ports: dict) -> Path:
    (tmp_path / "proc/net").mkdir(parents=True)
    (tmp_path / "proc/net/route").write_text(PROC_NET_ROUTE)
    for (device, port), state in ports.items():
        path = tmp_path / "sys/class/infiniband" / device / "ports" / str(port)
        path.mkdir(parents=True)
        (path / "state").write_text(state + "\n")
        (path / "link_layer").write_text("InfiniBand\n")
    return tmp_path


def test_socket_ifname_from_route_to_master_addr(tmp_path):
    root = fake_root(tmp_path, {})
    context = {"environ": {"MASTER_ADDR": "10.1.0.5"}, "root": root}
    var = envs.resolve(gpu="H100", site="none", context=context).vars["NCCL_SOCKET_IFNAME"]
    assert var.value == "ib0" and "MASTER_ADDR=10.1.0.5" in var.reason
    no_master = envs.resolve(gpu="H100", site="none", context={"environ": {}, "root": root})
    assert no_master.vars["GLOO_SOCKET_IFNAME"].value == "eth0"


def test_ib_hca_from_active_ports(tmp_path):
    root = fake_root(tmp_path, {("mlx5_0", 1): "4: ACTIVE", ("mlx5_1", 1): "1: DOWN", ("mlx5_2", 1): "4: ACTIVE"})
    resolved = envs.resolve(gpu="H100", site="none", context={"environ": {}, "root": root})
    assert resolved.vars["NCCL_IB_HCA"].value == "mlx5_0:1,mlx5_2:1"
    assert "NCCL_IB_HCA" not in envs.resolve(gpu="H100", site="none",
                                             context={"environ": {}, "root": fake_root(tmp_path / "n", {})}).vars


def test_nccl_ifname_rules():
    names = ["eth0", "hsn0", "hsn1", "lo"]
    assert netinfo.match_ifname_list("hsn", names) == (["hsn0", "hsn1"], [])
    assert netinfo.match_ifname_list("=hsn", names) == ([], ["hsn"])
    assert netinfo.match_ifname_list("^lo,eth", names) == (["hsn0", "hsn1"], [])
    assert netinfo.match_ifname_list("hsn0,doesnotexist0", names) == (["hsn0"], ["doesnotexist0"])


def test_shell_script_quotes(tmp_path):
    resolved = envs.resolve(gpu="H100", site="none", overrides=["WEIRD=it's $HOME; rm -rf x"])
    text = envs.shell_script(resolved)
    assert "export WEIRD='it'\"'\"'s $HOME; rm -rf x'  # cli" in text


def test_diff_two_profiles():
    rows = {r["name"]: r for r in envs.diff(envs.resolve(gpu="MI300X", site="none"),
                                            envs.resolve(gpu="H100", site="none"))}
    assert rows["ANVIL_GPU_PEAK_TFLOPS"]["a"] == "1307.4" and rows["ANVIL_GPU_PEAK_TFLOPS"]["b"] == "989"
    assert rows["HSA_NO_SCRATCH_RECLAIM"]["b"] is None and "NCCL_DEBUG" not in rows


def test_a_job_wide_value_is_not_recomputed_per_node():
    """The GPU peak is the model's, the same on every node: a node must not recompute it from
    every model's profile (it once came back as B200's 2250 on an H100 job)."""
    resolved = envs.resolve(gpu="H100")
    assert resolved.vars["ANVIL_GPU_PEAK_TFLOPS"].value == "989"
    assert "ANVIL_GPU_PEAK_TFLOPS" not in resolved.node_local()
    assert "ANVIL_GPU_PEAK_TFLOPS" not in envs.compute_here(["ANVIL_GPU_PEAK_TFLOPS", "ANVIL_HOST"])
    assert "ANVIL_HOST" in resolved.node_local()


def test_a_gpu_count_of_0_is_refused_not_read_as_the_default():
    import re

    from envs.detect import detect
    from envs.errors import EnvError
    for given, env, said in (("H100:0", {}, "--gpu H100:0: the GPU count after ':' must be 1 or more"),
                             (None, {"ANVIL_GPU": "MI300X:0"}, "ANVIL_GPU MI300X:0: the GPU count after ':' must be")):
        with pytest.raises(EnvError, match=re.escape(said)):
            detect(given, environ=env)
    assert detect(None, environ={"ANVIL_GPU": "A100-40GB:2"}).gpus[1].memory_gib == 40
