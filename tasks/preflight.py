"""inv preflight.*: is this node ready to train? PASS / WARN / FAIL per check, with reason and fix.

Every task creates a run directory (runs/<time>_preflight.<check>/) holding
preflight.json beside the usual snapshot, prints one table (or --json in the
shape the fan-out merges), and exits 1 on any FAIL. On many nodes:
`inv -H a,b preflight.all` (SSH) or `inv preflight.all --runtime slurm` (one
task per node of the Slurm allocation); both write the passing and failing
node lists that `inv train.pretrain --exclude-from RUN` reads.

Why preflight.all is not `@task(pre=[gpu, host, ...])`: Invoke runs pre-tasks
without the caller's arguments (--gpu, --env, --json would be lost, invoke
#229), each would print its own table and make its own run directory, and
under -H Fabric runs pre-tasks once locally instead of on each host. The
checks do not depend on each other; they are parts of one report, so
preflight.all runs the same check functions the single tasks run, into one
table and one JSON document.
"""
from __future__ import annotations

import json as jsonlib

from invoke import Collection

from core import names
from core.host import this_host
from runtime.jobs.environment import print_warnings, resolved_env
from runtime.runs.run import run_task
from core.errors import AnvilError

HELP = {
    "gpu": "Validate the environment another GPU model's profile gives (default: this node's)",
    "site": "Site overlay: lumi, or none (default: auto-detect)",
    "json": "Print JSON ({host, status, checks: [{name, status, value, reason, fix}]})",
    "require-gpu": "No GPU is a FAIL (default: a WARN, so CPU machines pass)",
    "allow-unknown-gpu": f"A GPU without an Anvil profile is a WARN, not a FAIL (env {names.ALLOW_UNKNOWN_GPU}=1)",
}
ALL = ("gpu", "host", "software", "network", "affinity", "topology", "screen")
PERF_HELP = {
    "floor": "Floor NAME=VALUE over the GPU profile's (gemm_tflops, hbm_gbps, h2d_gbps, allreduce_gbps; repeatable)",
    "baseline": "Also fail a GPU more than --tolerance below this baseline (a --save-baseline file)",
    "save-baseline": "Write this node's figures to FILE, the baseline for other nodes (run it on a known-good node)",
    "force": "Write over an existing --save-baseline file that is not a baseline",
    "tolerance": "How far under the baseline still passes: a fraction, 0.05 or 5% (default 0.05)",
    "timeout": "Seconds per GPU before it counts as hung (default 120)",
}


def run_preflight(c, task_name, check_names, gpu, site, json, require_gpu, allow_unknown_gpu, run_options,
                  inputs_extra=None, after=None):
    """Run the named checks into one table / JSON document; `after(inputs, run)` runs before the verdict."""
    import envs
    from runtime import settings as settings_mod
    from runtime.preflight import FAIL, CheckInputs, run_checks, table, worst
    from runtime.runs.run import execute

    env = resolved_env(gpu, site, None, run_options.env)
    machine = envs.detect() if gpu else env.machine  # the checks look at this node, whatever --gpu says
    runs_dir = settings_mod.load(c).runs_dir
    host = this_host()

    def body(run):
        inputs = CheckInputs(machine, env, runs_dir, require_gpu=require_gpu, allow_unknown_gpu=allow_unknown_gpu,
                             **(inputs_extra or {}))
        results = run_checks(check_names, inputs)
        if inputs.topology is not None:      # the map the topology check saw: inv snapshot.report draws it
            run.write_json(names.TOPOLOGY, inputs.topology.to_dict())
        if after:
            after(inputs, run)
        payload = {"host": host, "status": worst(results), "checks": [r.to_dict() for r in results],
                   "machine": machine.to_dict(), "run_dir": str(run.path)}
        run.write_json(names.PREFLIGHT, payload)
        if json:
            print(jsonlib.dumps(payload, indent=2))
        else:
            print(f"preflight on {host}: {machine.summary()}")
            print(table(results))
            counts = {s: sum(r.status == s for r in results) for s in ("PASS", "WARN", "FAIL")}
            print(f"{counts['PASS']} PASS, {counts['WARN']} WARN, {counts['FAIL']} FAIL   (details: {run.path})")
        print_warnings(env.warnings)
        failed = [r.name for r in results if r.status == FAIL]
        if failed:
            raise AnvilError(f"{len(failed)} check(s) FAIL: {', '.join(failed)}", 1)
        return {"status": payload["status"], "checks": len(results)}

    return execute(c, run_options.spec(task_name, env=env, extra={"checks": list(check_names)}), body)


def _check_task(check_names, doc):
    """A preflight task running `check_names`; the same options on every one."""

    def check(c, gpu="", site="", json=False, require_gpu=False, allow_unknown_gpu=False, run_options=None):
        name = "all" if check_names == ALL else check_names[0]
        run_preflight(c, f"preflight.{name}", check_names, gpu, site, json, require_gpu, allow_unknown_gpu,
                      run_options)

    check.__doc__ = doc
    check.__name__ = "all" if check_names == ALL else check_names[0]
    return run_task(help=HELP, per_node=True)(check)


gpu = _check_task(("gpu",), "GPUs: count, model has a profile, free memory, idle (no processes), temperature, ECC.")
host = _check_task(("host",), "Host: memory, /dev/shm size, memlock limit, NUMA, disk space for runs.")
software = _check_task(("software",), "Versions: driver, ROCm/CUDA, torch build, triton, python, Anvil commit.")
network = _check_task(("network",), "Network: interfaces, RDMA ports, NCCL_SOCKET_IFNAME / NCCL_IB_HCA exist, "
                                    "route to MASTER_ADDR.")
affinity = _check_task(("affinity",), "GPU to NUMA/CPU mapping; warns where ranks would run on the far socket.")
topology = _check_task(("topology",), "GPU <-> NIC <-> NUMA map against the GPU profile: GPU pairs without their "
                                      "NVLink/XGMI, NICs on another NUMA node than their GPUs.")
screen = _check_task(("screen",), "Fast node screen: each GPU in its own process (init, 256 MiB, finite GEMM), "
                                  "kernel log scanned for GPU faults, machine checks, hung tasks.")
all_checks = _check_task(ALL, "All checks in one table (gpu, host, software, network, affinity, topology, screen); "
                              "exit 1 on FAIL.")


@run_task(help={**HELP, **PERF_HELP}, per_node=True, iterable=["floor"])
def perf(c, gpu="", site="", json=False, require_gpu=False, allow_unknown_gpu=False, floor=None, baseline="",
         save_baseline="", tolerance="0.05", timeout=0.0, force=False, run_options=None):
    """GPU performance screen: GEMM, HBM copy, host-to-device per GPU, local all-reduce; exit 1 on FAIL.

    Each GPU's figures are judged against its model's floors (--floor) and, when given, a
    --baseline recorded on a known-good node with --save-baseline."""
    from runtime.preflight import perf as perf_mod

    # tolerance is a string option so that "5%" reaches check_tolerance (Invoke would cast a float default).
    extra = {"floors": perf_mod.parse_floors(floor), "tolerance": perf_mod.check_tolerance(tolerance),
             "baseline": perf_mod.read_baseline(baseline) if baseline else None, "timeout": float(timeout)}
    if save_baseline:
        perf_mod.check_save_path(save_baseline, force)

    def save(inputs, run):
        if save_baseline:
            document = perf_mod.save_baseline(inputs, save_baseline)
            run.write_json(names.BASELINE, document)
            print(f"baseline written to {save_baseline}: " + ", ".join(f"{k} {v:.4g}"
                                                                     for k, v in document["measured"].items()))
    run_preflight(c, "preflight.perf", ("perf",), gpu, site, json, require_gpu, allow_unknown_gpu, run_options,
                  inputs_extra=extra, after=save)


@run_task(help={"hosts": "Nodes to screen, comma-separated (default: anvil.hosts; under Slurm: the allocation's)",
                "size": "All-reduce message size of each measurement, e.g. 64M",
                "iters": "Timed all-reduces per measurement",
                "runtime": "ssh (or direct): SSH to --hosts | slurm: srun steps inside this allocation "
                           "(default: the anvil.runtime setting)",
                "timeout": "Seconds per launch before it counts as failed (default 120)",
                "nproc": "Ranks per node (default: one per GPU, one on a CPU node)",
                "slow-below": "A pair under this % of the median pair busbw is slow (default 70)",
                "json": "Print the report as JSON"}, takes_hosts=True)
def comm(c, hosts="", size="64M", iters=10, runtime="", timeout=0, nproc=0, slow_below=70, json=False,
         run_options=None):
    """Cross-node communication: all-reduce over all nodes, then node pairs in rounds; names the slow node or link."""
    from runtime.cluster import Runtime
    from runtime.preflight.comm import run_comm_check

    run_comm_check(c, hosts or None, Runtime.parse(runtime) if runtime else None, size, iters, json=json,
                   timeout=float(timeout), nproc=nproc, ratio=slow_below / 100, run_options=run_options)


ns = Collection("preflight")
for _name, _task in (("gpu", gpu), ("host", host), ("software", software), ("network", network),
                     ("affinity", affinity), ("topology", topology), ("screen", screen), ("perf", perf),
                     ("comm", comm),
                     ("all", all_checks)):
    ns.add_task(_task, name=_name)
