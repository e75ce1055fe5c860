"""inv train.*: pretrain with Anvil's trainer, export a checkpoint to Hugging Face, plot a run.

    inv train.pretrain [--config configs/tiny.yaml] [--set optim.lr=3e-4]... [--nproc N]
                       [--resume auto|PATH] [--compile] [--kernels] [--gpu X] [--site S]
                       [--name X] [--env K=V]... [--no-hooks] [--patch FILE] [--json]
    inv train.export RUN [--format hf] [--out DIR] [--dtype bfloat16]
    inv train.plot RUN [--out DIR]

pretrain: validate the config, resolve the environment (its env: block is a layer), make the
run directory with its snapshot (runtime.run.execute), write the config as used, and launch
`python -m trainer` through torchrun (one process per visible GPU, one on CPU).
"""
from __future__ import annotations

import json as jsonlib
import sys
from pathlib import Path

from invoke import Collection, task
from invoke.exceptions import Exit

from runtime.run import run_task

PRETRAIN_HELP = {
    "config": "Training config YAML (default: configs/tiny.yaml)",
    "set": "Config override KEY=VALUE with a dotted key, e.g. optim.lr=3e-4 (repeatable)",
    "nproc": "Processes per node (default: one per visible GPU, one on CPU)",
    "resume": "auto (newest checkpoint of the last run with this name) or a run/checkpoint path",
    "compile": "torch.compile the decoder blocks and the loss",
    "kernels": "Use the fused Triton kernels (kernels.patch)",
    "gpu": "Resolve the environment for another GPU model (default: detect)",
    "site": "Site overlay: lumi, or none (default: auto-detect)",
    "json": "Print the run summary as JSON on stdout",
}


def _load_config(config: str, sets):
    from trainer.config import ConfigError, load
    try:
        return load(config or None, sets or ())
    except ConfigError as exc:
        raise Exit(f"train.pretrain: {exc}", 2)


def _previous_checkpoint(runs_dir: Path, name: str) -> str | None:
    """--resume auto: the newest complete checkpoint among earlier runs with this name."""
    from trainer.checkpoint import find_latest
    for run_dir in sorted(runs_dir.glob(f"*_train.pretrain_{name}"), reverse=True):
        found = find_latest(run_dir)
        if found is not None:
            return str(found)
    return None


@run_task(help=PRETRAIN_HELP, iterable=["set_"])
def pretrain(c, config="", set_=None, nproc=0, resume="", compile=False, kernels=False, gpu="",
             site="", json=False, run_options=None):
    """Train a Llama model with Anvil's trainer (run dir, snapshot, hooks, torchrun)."""
    import envs
    from runtime import settings as settings_mod
    from runtime.launch import ContainerOptions, LaunchError, LaunchSpec, launch
    from runtime.run import execute
    from trainer.config import DEFAULT_CONFIG, dump
    from trainer.data import DataError
    from trainer.train import check_data

    sets = list(set_ or [])
    sets += ["train.compile=true"] if compile else []
    sets += ["train.kernels=true"] if kernels else []
    cfg = _load_config(config, sets)
    try:
        check_data(cfg)
    except DataError as exc:
        raise Exit(f"train.pretrain: {exc}", 2)
    config_path = config or str(DEFAULT_CONFIG)
    try:
        env = envs.resolve(gpu=gpu or None, site=site or None, config_env=cfg.env,
                           overrides=run_options.env, config_ref=f"{config_path} (env:)")
    except envs.EnvError as exc:
        raise Exit(f"train.pretrain: {exc}", 2)
    for warning in env.warnings:
        print(f"WARNING: {warning}")
    settings = settings_mod.load(c)
    name = run_options.name or cfg.name
    if resume == "auto":
        resume = _previous_checkpoint(settings.runs_dir, name) or "auto"

    def body(run):
        run.write_text("config.yaml", dump(cfg))
        args = ["--config", str(run.path / "config.yaml"), "--run-dir", str(run.path)]
        if resume:
            args += ["--resume", resume]
        spec = LaunchSpec(module="trainer", args=args, runtime=settings.runtime,
                          nproc=nproc or None, gpus=env.machine.count, vendor=env.machine.vendor,
                          container=ContainerOptions(engine=settings.container_engine or "docker",
                                                     image=settings.container_image))
        try:
            code = launch(spec, env=run.env, run_dir=run.path, masker=run.masker)
        except LaunchError as exc:
            raise Exit(f"train.pretrain: {exc}", 2)
        summary_path = run.path / "summary.json"
        summary = jsonlib.loads(summary_path.read_text()) if summary_path.is_file() else None
        if code == 3:
            raise Exit(f"train.pretrain: stopped on a signal after checkpointing; continue with "
                       f"`inv train.pretrain --resume {run.path}` (same config)", 3)
        if code != 0:
            raise Exit(f"train.pretrain: the trainer exited with status {code}; see "
                       f"{run.path}/logs/rank0.log", code)
        # The trainer's rank 0 has shown the summary table (tabulate) on the console already.
        if json:
            print(jsonlib.dumps({**(summary or {}), "run_dir": str(run.path)}, indent=2))
        print(f"run directory: {run.path}", file=sys.stderr if json else sys.stdout)
        return summary

    spec = run_options.spec("train.pretrain", name=name, configs={"train.yaml": cfg.to_dict()},
                            config_sources={"train.yaml": config_path}, env=env,
                            extra={"resume": resume or None})
    execute(c, spec, body)


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
