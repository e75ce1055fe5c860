"""inv train.*: pretrain with Anvil's trainer, export a checkpoint to Hugging Face, plot a run.

    inv train.pretrain [--config configs/tiny.yaml] [--set optim.lr=3e-4]... [--nproc N]
                       [--resume auto|PATH] [--compile] [--kernels] [--gpu X] [--site S]
                       [--name X] [--env K=V]... [--no-hooks] [--patch FILE] [--json]
    inv train.export RUN [--format hf] [--out DIR] [--dtype bfloat16]
    inv train.plot RUN [--out DIR]

pretrain: validate the config, resolve the environment (its env: block is a layer), make the
run directory with its snapshot (runtime.runs.run.execute), write the config as used, and launch
`python -m trainer` through torchrun (one process per visible GPU, one on CPU).
"""
from __future__ import annotations

import json as jsonlib
import sys

from invoke import Collection, task
from invoke.exceptions import Exit

from runtime.runs.run import run_task

PRETRAIN_HELP = {
    "config": "Training config YAML (default: configs/tiny.yaml)",
    "set": "Config override KEY=VALUE with a dotted key, e.g. optim.lr=3e-4 (repeatable)",
    "nproc": "Processes per node (default: one per visible GPU, one on CPU)",
    "resume": "auto (newest checkpoint among runs/*_train.pretrain_<name>) or a run/checkpoint path",
    "compile": "torch.compile the decoder blocks and the loss",
    "kernels": "Use the fused Triton kernels (kernels.patch)",
    "gpu": "Resolve the environment for another GPU model (default: detect)",
    "site": "Site overlay: lumi, or none (default: auto-detect)",
    "runtime": "direct | slurm | container | slurm+container (default: the anvil.runtime setting)",
    "nodes": "Slurm: nodes to run on (default: the whole allocation; 1 when submitting)",
    "partition": "Slurm: --partition (default: anvil.slurm_partition)",
    "account": "Slurm: --account (default: anvil.slurm_account)",
    "time": "Slurm: --time limit, e.g. 02:00:00 (default: anvil.slurm_time)",
    "wait": "Slurm, outside an allocation: follow the submitted job (--no-wait: submit and return)",
    "exclude": "Slurm: a node to leave out (repeatable)",
    "exclude-from": "Slurm: leave out the nodes that failed in this preflight run directory",
    "dry-run": "Print the resolved config and the launch command; start nothing",
    "json": "Print the run summary as JSON on stdout",
}


@run_task(help=PRETRAIN_HELP, iterable=["set_", "exclude"])
def pretrain(c, config="", set_=None, nproc=0, resume="", compile=False, kernels=False, gpu="",
             site="", runtime="", nodes=0, partition="", account="", time="", wait=True, exclude=None,
             exclude_from="", dry_run=False, json=False, run_options=None):
    """Train a Llama model with Anvil's trainer (run dir, snapshot, hooks, one rank per GPU)."""
    from runtime.jobs.training import TrainingJob, run_training

    job = TrainingJob(config=config, sets=list(set_ or []), nproc=nproc, resume=resume, compile=compile,
                      kernels=kernels, gpu=gpu, site=site, runtime=runtime, nodes=nodes, partition=partition,
                      account=account, time=time, wait=wait, exclude=list(exclude or []),
                      exclude_from=exclude_from, dry_run=dry_run)
    result = run_training(c, "train.pretrain", job, run_options)
    if result.get("dry_run"):
        return
    # The trainer's rank 0 has shown the summary table (tabulate) on the console already.
    if json:
        print(jsonlib.dumps({**(result["summary"] or {}), "run_dir": str(result["run_dir"])}, indent=2))
    print(f"run directory: {result['run_dir']}", file=sys.stderr if json else sys.stdout)


@task(help={"run": "Run directory or checkpoint (step_N) to export",
            "format": "Output format: hf (config.json + model.safetensors)",
            "out": "Output directory (default: RUN/export/hf-step_N)",
            "dtype": "bfloat16 | float16 | float32"})
def export(c, run, format="hf", out="", dtype="bfloat16"):
    """Export a checkpoint for transformers' LlamaForCausalLM."""
    if format != "hf":
        raise Exit(f"train.export: unknown --format {format!r} (hf)", 2)
    from trainer.export import ExportError, export_hf
    try:
        path = export_hf(run, out or None, dtype=dtype)
    except ExportError as exc:
        raise Exit(f"train.export: {exc}", 2)
    print(f"exported to {path}")


@task(help={"run": "Run directory (reads its metrics.jsonl)",
            "out": "Output .png file or directory (default: RUN/plots/metrics.png)"})
def plot(c, run, out=""):
    """Draw loss, throughput and memory over steps to PNG."""
    from trainer.plot import PlotError, plot_run
    try:
        path = plot_run(run, out or None)
    except PlotError as exc:
        raise Exit(f"train.plot: {exc}", 2)
    print(path)


ns = Collection("train")
ns.add_task(pretrain)
ns.add_task(export)
ns.add_task(plot)
