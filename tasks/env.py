"""inv env.*: what GPU this is, which environment Anvil gives it (with the source of every value), and
how its GPUs, NICs, NUMA nodes and CPUs are wired (env.topology)."""
from __future__ import annotations

import json as jsonlib
import sys

from invoke import Collection, task

from core import names
from runtime.jobs.environment import explained_var, print_warnings, resolve_on_hosts, resolved_env, write_export
from core.errors import UserError

COMMON_HELP = {
    "gpu": f"Show another machine's profile: MI300X, H100, MI250X:8 ... (default: detect; env {names.GPU})",
    "site": "Site overlay: lumi, or none (default: auto-detect)",
    "config": "Training config whose env: block is a layer",
    "env": "KEY=VALUE on top of every layer (repeatable)",
    "json": "Print JSON instead of a table",
}
TUNE_HELP = {"tune-gemm": "With the GEMM-tuning layer (--tune-gemm of train.pretrain, profile.train, bench.gemm)"}


def _table(rows, headers=()) -> str:
    from tabulate import tabulate
    return tabulate(rows, headers=headers, tablefmt="simple" if headers else "plain", disable_numparse=True,
                    missingval="-")


@task(auto_shortflags=False, help={"gpu": COMMON_HELP["gpu"], "json": COMMON_HELP["json"]})
def detect(c, gpu="", json=False):
    """Detect the GPUs: vendor, model, architecture, count, memory, driver, ROCm/CUDA version."""
    import envs
    machine = envs.detect(gpu or None)
    if json:
        print(jsonlib.dumps(machine.to_dict(), indent=2))
        return
    if not machine.has_gpu:
        print("no GPU on this machine (no AMD KFD device, no NVIDIA driver answered): CPU only")
        return
    rows = [("vendor", machine.vendor), ("model", machine.model or f"UNKNOWN ({machine.name})"),
            ("product name", machine.name), ("architecture", machine.arch), ("count", machine.count),
            ("memory per GPU", f"{machine.memory_gib} GiB" if machine.memory_gib else "?"),
            ("driver", machine.driver), ({"rocm": "ROCm", "cuda": "CUDA"}.get(machine.platform, "platform"),
                                         machine.platform_version), ("detected by", machine.source)]
    print(_table(rows))
    for note in machine.notes:
        print(f"note: {note}")
    if machine.unknown_gpu:
        from envs.resolve import unknown_gpu_message
        print_warnings([unknown_gpu_message(machine)])


@task(auto_shortflags=False, iterable=["env"], help={**COMMON_HELP, **TUNE_HELP})
def show(c, gpu="", site="", config="", env=None, json=False, tune_gemm=False):
    """The resolved environment: every variable, its value and the layer that set it."""
    resolved = resolved_env(gpu, site, config, env, tune_gemm)
    if json:
        print(jsonlib.dumps(resolved.to_json(), indent=2))
        print_warnings(resolved.warnings)
        return
    print(f"{resolved.machine.summary()}; layers: {' -> '.join(resolved.layers)}")
    rows = [(name, "(unset)" if var.value is None else var.value, var.source)
            for name, var in sorted(resolved.vars.items())]
    print(_table(rows, ("variable", "value", "source")))
    print("why a value is what it is: inv env.explain VARIABLE")
    print_warnings(resolved.warnings)


@task(auto_shortflags=False, iterable=["env"], help={"var": "Variable name, e.g. NCCL_SOCKET_IFNAME",
                                                     **COMMON_HELP, **TUNE_HELP})
def explain(c, var, gpu="", site="", config="", env=None, json=False, tune_gemm=False):
    """Every layer that touched VAR, in order, with its reason and public source."""
    resolved = resolved_env(gpu, site, config, env, tune_gemm)
    entry = explained_var(resolved, var)
    if json:
        print(jsonlib.dumps(entry.to_dict(), indent=2))
        return
    final = "(unset)" if entry.value is None else entry.value
    print(f"{entry.name}={final}  [{entry.source}]  for {resolved.machine.summary()}")
    for step, change in enumerate(entry.history, 1):
        value = "(unset)" if change.value is None else change.value
        print(f"{step}. {change.layer}: {value}\n   why: {change.reason}\n   source: {change.ref}")


@task(iterable=["env"],  # auto short flags for -o FILE; no parameter starts with h
      help={**{k: v for k, v in COMMON_HELP.items() if k != "json"},
            "output": "Write to this file (atomically) instead of stdout",
            "force": "Write over an existing --output file that env.export did not write"})
def export(c, gpu="", site="", config="", env=None, output="", force=False):
    """A shell file to `source`: export lines with quoted values, each naming its layer."""
    import envs
    resolved = resolved_env(gpu, site, config, env)
    print_warnings(resolved.warnings)
    if not output:
        sys.stdout.write(envs.shell_script(resolved))
        return
    write_export(resolved, output, force)     # UserError: one line, exit 2
    print(f"wrote {output} ({len(resolved.environ())} variables); use: source {output}")


@task(auto_shortflags=False, help={
    "a": "First GPU model (e.g. MI300X)", "b": "Second GPU model (e.g. H100)",
    "hosts": "Two hosts a,b: compare what each resolves (runs inv env.show --json there)",
    "site": COMMON_HELP["site"], "all": "Also list variables that are the same", "json": COMMON_HELP["json"]})
def diff(c, a="", b="", hosts="", site="", all=False, json=False):
    """Two profiles (-a MI300X -b H100) or two hosts (--hosts a,b) side by side."""
    import envs
    if hosts:
        left_name, right_name, left, right = resolve_on_hosts(c, hosts)
    elif a and b:
        left_name, right_name = a, b
        left, right = resolved_env(a, site), resolved_env(b, site)
    else:
        raise UserError("give -a MODEL -b MODEL, or --hosts HOST1,HOST2")
    rows = envs.diff(left, right, all_vars=all)
    if json:
        print(jsonlib.dumps({"a": left_name, "b": right_name, "rows": rows}, indent=2))
        return
    print(f"{left_name}: {left.machine.summary()}   vs   {right_name}: {right.machine.summary()}")
    if not rows:
        print("no differences")
        return
    print(_table([(r["name"], _cell(r["a"], r["a_source"]), _cell(r["b"], r["b_source"]),
                   "" if r["same"] else "*") for r in rows], ("variable", left_name, right_name, "differs")))


def _cell(value, source) -> str:
    if source is None:
        return "-"
    return f"{'(unset)' if value is None else value}  [{source}]"




@task(auto_shortflags=False, help={"gpu": "Hold the map against another GPU model's profile (default: detect)",
                                   "json": COMMON_HELP["json"],
                                   "tool_output": "Show this recorded `nvidia-smi topo -m` or `rocm-smi --showtopo` "
                                                  "output (another node's, say) instead of this node's map"})
def topology(c, gpu="", json=False, tool_output=""):
    """GPU <-> NIC <-> NUMA <-> CPU map of this node, held against the GPU profile (WARN with the fix)."""
    import envs
    from envs import topology as topo_mod
    from runtime.preflight import table
    from runtime.preflight import topology as check
    here = envs.detect()
    profile = envs.detect(gpu) if gpu else here
    topo = topo_mod.from_file(tool_output) if tool_output else topo_mod.probe(here)
    results = check.judge(topo, profile)
    if json:
        print(jsonlib.dumps({"topology": topo.to_dict(), "checks": [r.to_dict() for r in results]}, indent=2))
        return
    print(f"{'recorded output' if tool_output else here.summary()}; held against "
          f"{profile.model or 'no GPU profile'}; from {topo.source or 'nothing'}")
    for title, headers, rows in check.tables(topo):
        if rows:
            print(f"\n{title}")
            print(_table(rows, headers))
    print()
    print(table(results))
    for note in topo.notes:
        print(f"note: {note}")

ns = Collection("env")
for _task in (detect, show, explain, export, diff, topology):
    ns.add_task(_task)
