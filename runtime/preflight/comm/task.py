"""run_comm_check: the body of `inv preflight.comm`. Checks the options, takes the hosts (--hosts or
anvil.hosts over SSH, or the members of this Slurm allocation) and the transport, runs screen_links
as a run (runs/<time>_preflight.comm/) and prints the report."""
from __future__ import annotations

import os
import sys
from typing import Mapping, Sequence

from runtime.preflight.comm.check import MAX_ROUNDS, TIMEOUT_S, screen_links
from runtime.preflight.comm.errors import CommError, CommFailed
from runtime.preflight.comm.measurement import Transport
from runtime.preflight.comm.report import render
from runtime.preflight.comm.rounds import RATIO
from runtime.preflight.comm.transports import SlurmTransport, SshTransport


def _slurm_hosts(hosts: Sequence[str], env: Mapping[str, str]) -> list[str]:
    from runtime.launch.commands import in_allocation
    from runtime.cluster.slurm.control import hostnames
    from runtime.cluster.slurm.allocation import require_slurm

    if not in_allocation(env):
        raise CommError("preflight.comm with runtime slurm runs inside an allocation: salloc -N<nodes> inv "
                        "preflight.comm --runtime slurm (the pairs are srun steps of that allocation)")
    require_slurm(env)
    members = hostnames(env.get("SLURM_JOB_NODELIST", ""), env)
    if hosts:
        missing = [h for h in hosts if h not in members]
        if missing:
            raise CommError(f"--hosts {','.join(missing)}: not in this allocation ({','.join(members)})")
        return list(hosts)
    return members


def run_comm_check(c, hosts: list[str] | str | None, slurm: bool, size: str = "64M", iters: int = 10, *,
                   json: bool = False, timeout: float = 0.0, nproc: int = 0, ratio: float = RATIO,
                   max_rounds: int = MAX_ROUNDS, run_options=None, env: Mapping[str, str] | None = None,
                   options=None, transport: Transport | None = None) -> dict:
    """`inv preflight.comm`: the screen as a run (runs/<time>_preflight.comm/) with report.json,
    report.txt, pairs/ (every launch's JSON and output) and nodes/{pass,fail}.txt, fail.json; prints
    the table and the exclude line (or the JSON with json=True). Returns the report's dict when every
    node passes; on a failing node (or a failed all-reduce) the run ends failed and RunFailed carries
    exit status 1. Bad input: CommError (exit 2), before any run directory. options: FanoutOptions
    for SSH (default: from the anvil settings); transport: measure through this one instead."""
    import json as jsonlib

    from benchmarks.collectives import parse_size
    from runtime import settings as settings_mod
    from runtime.cluster import ssh
    from runtime.cluster.results import slurm_name
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
    default = settings.hosts
    given = settings_mod.split_list(hosts) if hosts else []
    if slurm:
        host_list = _slurm_hosts(given, env)
    else:
        try:
            host_list = ssh.parse_hosts(given or default, default)
        except ssh.FanoutError as exc:
            raise CommError(f"--hosts: {exc} (or set anvil.hosts in invoke.yaml)") from None
    if len(host_list) < 2:
        raise CommError(f"the comm check needs at least 2 nodes, got {len(host_list)}: {','.join(host_list)}")
    limit = timeout or TIMEOUT_S

    def body(run):
        work = run.path / "pairs"
        if transport is not None:
            via = transport
        elif slurm:
            via = SlurmTransport(work, settings, env, nproc=nproc)
        else:
            fanout = options or ssh.FanoutOptions(
                remote_path=settings.remote_path or str(settings.root), remote_inv=settings.remote_inv,
                user=settings.user or None, key_filename=list(settings.key_filename),
                connect_timeout=float(settings.connect_timeout))
            via = SshTransport(fanout, work, nproc=nproc)

        def progress(line):
            print(f"preflight.comm: {line}", file=sys.stderr, flush=True)

        print(f"preflight.comm on {len(host_list)} node(s) over {via.name}: {', '.join(host_list)}; "
              f"run directory {run.path}", file=sys.stderr, flush=True)
        report = screen_links(host_list, via, size, int(iters), progress, timeout=limit, ratio=ratio,
                              max_rounds=max_rounds)
        document = {"task": "preflight.comm", "run_dir": str(run.path), **report.to_dict()}
        run.write_json("report.json", document)
        nodes_mod.write(run.path, [slurm_name(h) for h in report.passing],
                        {slurm_name(h): reasons for h, reasons in report.failing.items()})
        text = render(report, run.path)
        run.write_text("report.txt", text + "\n")
        print(jsonlib.dumps(document, indent=2) if json else text, flush=True)
        run.update_metadata(hosts=report.hosts, passing=report.passing, failing=list(report.failing))
        if report.failed:
            what = (f"{len(report.failing)} of {len(report.hosts)} node(s) failing: {', '.join(report.failing)}"
                    if report.failing else "the all-reduce across all nodes failed")
            raise CommFailed(what)
        return document

    extra = {"hosts_checked": host_list, "size": size, "iters": int(iters), "transport": "srun" if slurm else "ssh"}
    spec = (run_options.spec("preflight.comm", extra=extra) if run_options is not None
            else RunSpec(task="preflight.comm", extra=extra))
    return execute(c, spec, body)
