"""data.prepare through the runtime: on this machine, or with its work shared by every node.

    result = prepare(c, inputs, out, runtime="slurm", nodes=2, ...)     # the trainer's prepare() result

Here (direct) it is trainer.data.prepare as it is. Under a runtime that spans nodes (slurm: the
allocation's nodes or --nodes of them; ssh: -H / --hosts or anvil.hosts) this process plans the
units, opens the work folder beside --out (which must be on a file system every node shares, as
the checkout is) and has the runtime's transport run `python -m trainer.data.node FOLDER` once
on every node (each_node): each node makes its share of the parts with all its cores. This
process then checks the parts and assembles the dataset, so it is the same dataset, shard for
shard, as one node makes. A node that fails or cannot be reached is named in one line; the
parts the others finished are kept, and the same command again makes only what is missing.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

from runtime import settings as settings_mod
from runtime.cluster import Runtime
from runtime.cluster.results import Interrupted as NodesInterrupted
from runtime.runs.options import per_node_runtime
from core.errors import UserError


def where(c, runtime: str, nodes: int, hosts: str):
    """(runtime, transport or None) of a prepare: None when it runs here."""
    from runtime.cluster.ssh import parse_hosts

    settings = settings_mod.load(c)
    if nodes < 0:
        raise UserError(f"--nodes {nodes}: expected 1 or more")
    chosen, note = per_node_runtime(runtime, settings.runtime)
    if note:
        print(f"data.prepare: {note}", file=sys.stderr, flush=True)
    host_list: list[str] = []
    if hosts:
        if runtime and chosen.transport != "ssh":
            raise UserError(f"--runtime {runtime} with --hosts {hosts}: the hosts are reached over SSH; give one or "
                            f"the other")
        host_list = parse_hosts(hosts, settings.hosts)
        chosen = chosen.over("ssh")
    if nodes and not chosen.scheduler:
        raise UserError(f"--nodes needs --runtime slurm (runtime is {chosen})")
    if not chosen.spans_nodes:
        return chosen, None
    slurm = dataclasses.replace(settings.slurm_options(), job_name="anvil-data.prepare")
    options = settings.cluster_options(nodes=nodes, slurm=slurm, **({"hosts": host_list} if host_list else {}))
    transport = chosen.open(options)
    transport.check(os.environ, each_node=True)   # Slurm there and answering, hosts reachable: before any writing
    return chosen, transport


def on_every_node(transport, workers: int | None):
    """prepare(on_nodes=...): the node command once on every node of `transport`, and wait."""
    from trainer.data import DataError

    def run(folder: Path) -> None:
        command = [transport.python(), "-m", "trainer.data.node", str(folder)]
        command += ["--workers", str(workers)] if workers else []
        print(f"data.prepare: making the parts on every node ({transport.via})", file=sys.stderr, flush=True)
        try:
            results = transport.each_node(command, os.environ)
        except NodesInterrupted:
            raise KeyboardInterrupt from None    # the nodes were told to stop: prepare() says what is kept
        for result in results:
            if result.interrupted:
                raise KeyboardInterrupt
        failed = [r for r in results if not r.ok]
        if failed:
            first = failed[0]
            reason = "; ".join(first.failure_reasons("data.prepare")) or f"exit status {first.exit_code}"
            raise DataError(f"the parts were not all made: {first.host}: {reason}"
                            + (f" (and {len(failed) - 1} more node(s))" if len(failed) > 1 else "")
                            + f"; the parts finished are kept in {folder}: the same command again makes the rest")
    return run


def prepare(c, inputs, out, tokenizer: str, *, runtime: str = "", nodes: int = 0, hosts: str = "", **options) -> dict:
    """trainer.data.prepare, here or with its parts made on every node of the runtime."""
    from trainer.data import prepare as prepare_dataset

    chosen, transport = where(c, runtime, nodes, hosts)
    if transport is None:
        return prepare_dataset(inputs, out, tokenizer, **options)
    result = prepare_dataset(inputs, out, tokenizer, on_nodes=on_every_node(transport, options.get("workers")),
                             **options)
    result["runtime"] = str(chosen)
    return result
