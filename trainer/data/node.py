"""One node's share of a prepare that runs on several: `python -m trainer.data.node FOLDER`.

The process that runs data.prepare plans the units, opens the work folder (on a file system
every node sees) and starts this once on every node; each makes the parts of its share of
the units (units.share: the largest first to the least loaded node, the same on every node
without talking) with its own pool of workers, and leaves the assembly to that process.
A part another node or an earlier run finished is not made again.

    python -m trainer.data.node FOLDER [--workers N] [--node K --nodes N]

The node's rank and count default to the runner's environment: names.NODE_RANK and
names.NODE_COUNT (what the runtime's each_node sets), else Slurm's SLURM_NODEID and SLURM_NNODES. Exit status: 0 done, 2 bad input
(the message says what), 130 stopped (Ctrl-C or SIGTERM: finished parts are kept).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

from .dataset import dtype_for_vocab
from .errors import DataError
from .parts import PLAN, WorkFolder
from .tokenizers import get_tokenizer
from .units import Unit, share
from .workers import make_parts

from core import names
from core.host import this_host

EXIT_STOPPED = 130


def _env_int(*names: str, default: int) -> int:
    for name in names:
        value = os.environ.get(name, "").strip()
        if value:
            try:
                return int(value)
            except ValueError:
                raise DataError(f"{name}={value!r} is not a number") from None
    return default


def run(folder: Path, node: int, nodes: int, workers: int | None = None, progress: bool = False) -> dict:
    """Make this node's share of the parts in `folder`; returns what it made."""
    try:
        plan_data = json.loads((folder / PLAN).read_text())
    except (OSError, ValueError) as exc:
        raise DataError(f"{folder / PLAN}: cannot read the plan of the prepare ({exc}); the work folder must "
                        f"be on a file system every node shares") from None
    if not 0 <= node < nodes:
        raise DataError(f"node {node} is not one of {nodes} nodes")
    plan = [Unit.from_dict(u) for u in plan_data["units"]]
    settings = plan_data["settings"]
    name = plan_data["tokenizer"]
    tokenizer = str(folder / "tokenizer.json") if name == "bpe" else name
    tok = get_tokenizer(tokenizer)
    mine = share(plan, nodes, node)
    work = WorkFolder(folder)
    parts = {u.index: info for u in mine if (info := work.finished(u.index)) is not None}
    already = len(parts)
    state = {"parts": len(parts)}
    make_parts(plan, parts, work, tok, tokenizer, dtype_for_vocab(tok.vocab_size), settings, workers, progress,
               state, mine=mine)
    return {"node": node, "nodes": nodes, "host": this_host(), "units": len(mine),
            "made": len(parts) - already, "already_finished": already}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.data.node", description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--workers", type=int, default=0, help="worker processes (0: all cores)")
    p.add_argument("--node", type=int, default=None)
    p.add_argument("--nodes", type=int, default=None)
    p.add_argument("--progress", action="store_true")
    args = p.parse_args(argv)
    # SIGTERM (scancel, a stopping runner) stops like Ctrl-C: the workers finish their batch, and
    # the parts already finished stay for the next run
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        node = args.node if args.node is not None else _env_int(names.NODE_RANK, "SLURM_NODEID", default=0)
        nodes = args.nodes if args.nodes is not None else _env_int(names.NODE_COUNT, "SLURM_NNODES", default=1)
        result = run(args.folder, node, nodes, args.workers or None, args.progress)
    except DataError as exc:
        print(f"data.prepare on {this_host()}: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"data.prepare on {this_host()}: stopped; its finished parts are kept", file=sys.stderr)
        return EXIT_STOPPED
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
