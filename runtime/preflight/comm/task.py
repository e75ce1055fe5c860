"""run_comm_check: the body of `inv preflight.comm`. Checks the options, takes the hosts (--hosts or
anvil.hosts over SSH, or the members of this Slurm allocation) and the transport, runs screen_links
as a run (runs/<time>_preflight.comm/) and prints the report."""
from __future__ import annotations

import os
import sys
from typing import Mapping

from core import names
from runtime.preflight.comm.check import MAX_ROUNDS, TIMEOUT_S, screen_links
from runtime.preflight.comm.errors import CommError, CommFailed
from runtime.preflight.comm.measure import OverCluster
from runtime.preflight.comm.measurement import Transport
from runtime.preflight.comm.report import render
from runtime.preflight.comm.rounds import RATIO


def run_comm_check(c, hosts: list[str] | str | None, runtime=None, size: str = "64M", iters: int = 10, *,
                   json: bool = False, timeout: float = 0.0, nproc: int = 0, ratio: float = RATIO,
                   max_rounds: int = MAX_ROUNDS, run_options=None, env: Mapping[str, str] | None = None,
                   transport: Transport | None = None) -> dict:
    """`inv preflight.comm`: the screen as a run (runs/<time>_preflight.comm/) with report.json,
    report.txt, pairs/ (every launch's JSON and output) and nodes/{pass,fail}.txt, fail.json; prints
    the table and the exclude line (or the JSON with json=True). runtime: a Runtime (default: the
    anvil.runtime setting); one whose scheduler places the nodes screens the allocation's members,
    any other screens the hosts over SSH. Returns the report's dict when every node passes; on a
    failing node (or a failed all-reduce) the run ends failed and RunFailed carries exit status 1.
    Bad input: CommError (exit 2), before any run directory. transport: measure through this one
    instead."""
    import json as jsonlib

    from benchmarks.collectives import parse_size
    from runtime import settings as settings_mod
    from runtime.cluster import Runtime
    from runtime.cluster.results import slurm_name
    from runtime.cluster.ssh import HostsError, parse_hosts
    from runtime.runs import nodes as nodes_mod
    from runtime.runs.run import RunSpec, execute

    env = dict(os.environ if env is None else env)
    try:
        if "," in str(size):
            raise ValueError(f"bad size {size!r}: one size, e.g. 64M")
        parse_size(str(size))
    except ValueError as exc:
        raise CommError(f"--size: {exc}") from None
    if int(iters) < 1:
        raise CommError(f"--iters must be >= 1, got {iters}")
    if timeout < 0:
        raise CommError(f"--timeout must be >= 0, got {timeout}")
    if not 0 < ratio < 1:
        raise CommError(f"--slow-below must be between 0 and 100 (% of the median), got {100 * ratio:g}")
    settings = settings_mod.load(c)
    if runtime is not None and runtime.container:
        raise CommError(f"--runtime {runtime}: the comm check measures the nodes' own links, not a container's; "
                        "use --runtime ssh (the hosts) or slurm (the nodes of this allocation)")
    runtime = (runtime or settings.runtime).bare()    # the setting's container is for training
    given = parse_hosts(hosts) if hosts else []
    if runtime.scheduler:            # the nodes of this allocation, each pair an srun step in it
        cluster = runtime.open(settings.cluster_options())
        if cluster.allocation(env) is None:
            raise CommError(f"preflight.comm with runtime {runtime} runs inside an allocation: salloc -N<nodes> inv "
                            f"preflight.comm --runtime {runtime} (the pairs are srun steps of that allocation)")
        cluster.check(env)
        members = cluster.nodes(env)
        missing = [h for h in given if h not in members]
        if missing:
            raise CommError(f"--hosts {','.join(missing)}: not in this allocation ({','.join(members)})")
        host_list = given or members
    else:                            # the hosts, over SSH
        try:
            host_list = parse_hosts(given or settings.hosts or "", settings.hosts)
        except HostsError as exc:
            raise CommError(f"--hosts: {exc} (or set anvil.hosts in invoke.yaml)") from None
        cluster = Runtime("ssh").open(settings.cluster_options(hosts=host_list))
    if len(host_list) < 2:
        raise CommError(f"the comm check needs at least 2 nodes, got {len(host_list)}: {','.join(host_list)}")
    limit = timeout or TIMEOUT_S

    def body(run):
        via = transport or OverCluster(cluster, run.path / "pairs", nproc=nproc, env=env, record=run.write_json)

        def progress(line):
            print(f"preflight.comm: {line}", file=sys.stderr, flush=True)

        print(f"preflight.comm on {len(host_list)} node(s) over {via.name}: {', '.join(host_list)}; "
              f"run directory {run.path}", file=sys.stderr, flush=True)
        report = screen_links(host_list, via, size, int(iters), progress, timeout=limit, ratio=ratio,
                              max_rounds=max_rounds)
        document = {"task": "preflight.comm", "run_dir": str(run.path), **report.to_dict()}
        run.write_json(names.FANOUT_REPORT, document)
        nodes_mod.write(run.path, [slurm_name(h) for h in report.passing],
                        {slurm_name(h): reasons for h, reasons in report.failing.items()})
        text = render(report, run.path)
        run.write_text(names.FANOUT_TEXT, text + "\n")
        print(jsonlib.dumps(document, indent=2) if json else text, flush=True)
        run.update_metadata(hosts=report.hosts, passing=report.passing, failing=list(report.failing))
        if report.failed:
            what = (f"{len(report.failing)} of {len(report.hosts)} node(s) failing: {', '.join(report.failing)}"
                    if report.failing else "the all-reduce across all nodes failed")
            raise CommFailed(what)
        return document

    extra = {"hosts_checked": host_list, "size": size, "iters": int(iters),
             "transport": transport.name if transport is not None else cluster.via}
    spec = (run_options.spec("preflight.comm", extra=extra) if run_options is not None
            else RunSpec(task="preflight.comm", extra=extra))
    return execute(c, spec, body)
