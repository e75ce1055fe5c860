"""A stand-in for torchtitan 0.2's `python -m torchtitan.train` (not a test module: the tests copy it to
torchtitan/train.py of a package folder they put on PYTHONPATH): what train.launch --backend torchtitan
relies on, with no GPU and no torchtitan.

    python -m torchtitan.train --job.config_file FILE.toml [--job.dump_folder DIR] [--checkpoint.enable]
                               [--checkpoint.initial_load_path DIR --checkpoint.no_initial_load_model_only]
                               [--training.steps N] [--checkpoint.interval K] [--training.sleep S]

As torchtitan does: the TOML config (an unknown section is refused with its error, in its words), then the command line's
overrides; with checkpointing on, the newest complete DUMP/checkpoint/step-N (with .metadata) is loaded,
else initial_load_path; every rank logs "[titan] ... step: N  loss: X ..." (coloured) and a checkpoint
is saved every interval steps; no signal handler: SIGTERM ends it where it is. --training.sleep (seconds
before each step) is the tests' own.
"""
from __future__ import annotations

import os
import re
import sys
import time
import tomllib

KNOWN = {"job", "training", "checkpoint", "model", "metrics"}


def torchtitan_stand_in(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def option(name, default=None):
        found = default
        for i, token in enumerate(argv):
            if token == name and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                found = argv[i + 1]
            elif token.startswith(name + "="):
                found = token.split("=", 1)[1]
        return found

    with open(option("--job.config_file"), "rb") as handle:
        config = tomllib.load(handle)
    unknown = set(config) - KNOWN
    if unknown:   # torchtitan 0.2.2's ConfigManager._dict_to_dataclass, word for word
        raise ValueError(f"Invalid field names in <class 'torchtitan.config.job_config.JobConfig'> data: {unknown}.\n"
                         "Please modify your .toml config file or override these fields from the command line.\n"
                         "Run `NGPU=1 ./run_train.sh --help` to read all valid fields.")
    steps = int(option("--training.steps", config.get("training", {}).get("steps", 8)))
    interval = int(option("--checkpoint.interval", config.get("checkpoint", {}).get("interval", 2)))
    sleep = float(option("--training.sleep", config.get("training", {}).get("sleep", 0.0)))   # the tests' own
    folder = os.path.join(option("--job.dump_folder", "./outputs"), "checkpoint")
    enabled = "--checkpoint.enable" in argv
    rank = int(os.environ["RANK"])
    log = "[titan] %s - root - INFO - %s"
    start = 0
    if enabled and os.path.isdir(folder):
        done = [int(m.group(1)) for name in os.listdir(folder) if (m := re.fullmatch(r"step-(\d+)", name))
                and os.path.isfile(os.path.join(folder, name, ".metadata"))]
        start = max(done, default=0)
        if start:
            print(log % (time.strftime("%Y-%m-%d %H:%M:%S,000"),
                         f"Loading the checkpoint from {os.path.join(folder, f'step-{start}')}."), flush=True)
    elif enabled and option("--checkpoint.initial_load_path"):
        start = int(re.search(r"step-(\d+)", option("--checkpoint.initial_load_path")).group(1))
        print(log % (time.strftime("%Y-%m-%d %H:%M:%S,000"),
                     f"Loading the checkpoint from {option('--checkpoint.initial_load_path')}."), flush=True)
    print(log % (time.strftime("%Y-%m-%d %H:%M:%S,000"), f"Training starts at step {start + 1}"), flush=True)
    for step in range(start + 1, steps + 1):
        time.sleep(sleep)
        print(log % (time.strftime("%Y-%m-%d %H:%M:%S,000"),
                     f"\033[31mstep: {step:2}  \033[32mloss: {8.0 / step:8.5f}  \033[38;2;180;60;0mgrad_norm: "
                     f"{1.0:7.4f}  \033[38;2;54;234;195mmemory: {0.5:5.2f}GiB({0.6:.2f}%)  \033[34mtps: {1234:,}  "
                     f"\033[36mtflops: {0.05:,.2f}  \033[35mmfu: {0.01:.2f}%\033[39m"), flush=True)
        if enabled and rank == 0 and step % interval == 0:
            os.makedirs(os.path.join(folder, f"step-{step}"), exist_ok=True)
            open(os.path.join(folder, f"step-{step}", ".metadata"), "wb").close()
    return 0


if __name__ == "__main__":
    sys.exit(torchtitan_stand_in())
