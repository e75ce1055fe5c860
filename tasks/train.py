"""inv train.*: pretrain with Anvil's trainer, export a checkpoint to Hugging Face, plot a run.

    inv train.pretrain [--config configs/tiny.yaml] [--set optim.lr=3e-4]... [--nproc N]
                       [--resume auto|PATH] [--init-from HF_DIR] [--compile] [--kernels] [--gpu X] [--site S]
                       [--runtime R] [-H a,b [--master a]] [--nodes N ...]
                       [--force] [--name X] [--env K=V]... [--no-hooks] [--patch FILE] [--json] [--tune-gemm]
    inv train.export RUN [--format hf] [--out DIR] [--dtype bfloat16 (default) | float16 | float32]
    inv train.plot RUN [--out DIR]
    inv train.plan [--config X] [--init-from HF_DIR] [--gpus N] [--nodes M] [--gpu MODEL] [--set k=v]... [--json]
    inv train.launch --backend command|torchtitan|megatron [--config X] [--megatron DIR] [--metrics-regex RE]
                     [--hang-timeout S] [--nproc N] [--resume auto|PATH] [--gpu X] [--site S] [--runtime R]
                     [-H a,b] [--nodes N ...] [--name X] [--env K=V]... [--json] -- PROGRAM ARGS...

pretrain: validate the config, resolve the environment (its env: block is a layer), make the
run directory with its snapshot (runtime.runs.run.execute: the config as used, once), and launch
`python -m trainer` through the runtime (runtime.cluster) and Anvil's per-node agent
(runtime.launch.agent: one process per visible GPU, one on CPU; one agent per node, or per host
of -H).

launch: another trainer's program (runtime.backends) through the same runner (runtime.jobs.launching):
the same run directory, environment, hooks, transports and node agent, the backend's log lines read into
metrics.jsonl.

plan: parameters, FLOPs per token and the per-GPU memory of the run (trainer.plan), against the
memory of the detected GPU or of the named one (envs' profiles); nothing is started.
"""
from __future__ import annotations

import json as jsonlib
import re
import sys

from invoke import Collection, task

from runtime.runs.run import run_task
from core.errors import UserError

PRETRAIN_HELP = {
    "config": "Training config YAML (default: configs/tiny.yaml)",
    "set": "Config override KEY=VALUE with a dotted key, e.g. optim.lr=3e-4 (repeatable)",
    "nproc": "Processes per node (default: one per visible GPU, one on CPU)",
    "resume": "auto (newest checkpoint among runs/*_train.pretrain_<name>) or a run/checkpoint path",
    "init-from": "Start from a Hugging Face directory (config.json + safetensors) of Llama, DeepSeek-V2, "
                 "DeepSeek-V3 or Qwen3-MoE: its weights, its model shape; the optimizer and the step count "
                 "start fresh",
    "compile": "torch.compile the decoder blocks and the loss",
    "kernels": "Use the fused Triton kernels (kernels.patch)",
    "gpu": "Resolve the environment for another GPU model (default: detect)",
    "site": "Site overlay: lumi, or none (default: auto-detect)",
    "runtime": "direct | ssh | slurm | container | ssh+container | slurm+container (default: the anvil.runtime "
               "setting; ssh with -H)",
    "hosts": "SSH: train across these hosts, one agent each, node ranks in this order (comma-separated; '@' = "
             "anvil.hosts); `inv -H a,b train.pretrain` says the same",
    "master": "SSH: the host of node rank 0, where the ranks meet (default: the first host)",
    "nodes": "Slurm: nodes to run on (default: the whole allocation; 1 when submitting)",
    "partition": "Slurm: --partition (default: anvil.slurm_partition)",
    "account": "Slurm: --account (default: anvil.slurm_account)",
    "time": "Slurm: --time limit, e.g. 02:00:00 (default: anvil.slurm_time)",
    "wait": "Slurm, outside an allocation: follow the submitted job (--no-wait: submit and return)",
    "exclude": "Slurm, SSH: a node to leave out (repeatable)",
    "exclude-from": "Slurm, SSH: leave out the nodes that failed in this preflight run directory",
    "dry-run": "Print the resolved config and the launch command; start nothing",
    "force": "Launch even when the memory plan says the run cannot fit this machine's memory (or the GPU's)",
    "json": "Print the run summary as JSON on stdout",
    "tune-gemm": "TunableOp GEMM tuning: each GEMM shape tuned once, its result kept per GPU model, torch and "
                 "CUDA/ROCm build and reused by later runs (inv env.explain PYTORCH_TUNABLEOP_FILENAME --tune-gemm)",
}


@run_task(help=PRETRAIN_HELP, iterable=["set_", "exclude"], takes_hosts=True)
def pretrain(c, config=None, set_=None, nproc=0, resume=None, init_from=None, compile=False, kernels=False,
             gpu="", site="", runtime="", hosts=None, master="", nodes=0, partition="", account="", time="",
             wait=True, exclude=None, exclude_from="", dry_run=False, force=False, json=False, tune_gemm=False,
             run_options=None):
    """Train a Llama model with Anvil's trainer (run dir, snapshot, hooks, one rank per GPU)."""
    from runtime.cluster import Runtime
    from runtime.jobs.training import TrainingJob, run_training

    job = TrainingJob(config=config, sets=list(set_ or []), nproc=nproc, resume=resume, init_from=init_from,
                      compile=compile, kernels=kernels, gpu=gpu, site=site,
                      runtime=Runtime.parse(runtime) if runtime else None, hosts=hosts, master=master, nodes=nodes,
                      partition=partition, account=account, time=time, wait=wait, exclude=list(exclude or []),
                      exclude_from=exclude_from, dry_run=dry_run, force=force, tune_gemm=tune_gemm)
    result = run_training(c, "train.pretrain", job, run_options)
    if result.get("dry_run") or result.get("complete"):
        return
    # The trainer's rank 0 has shown the summary table (tabulate) on the console already.
    if json:
        submitted = {"slurm_job_id": result["slurm_job_id"]} if result.get("slurm_job_id") else {}   # --no-wait
        print(jsonlib.dumps({**(result["summary"] or {}), **submitted, "run_dir": str(result["run_dir"])}, indent=2))
    print(f"run directory: {result['run_dir']}", file=sys.stderr if json else sys.stdout)


LAUNCH_HELP = {
    "backend": "The trainer the ranks run: command (any torchrun-style program after --) | torchtitan | megatron",
    "config": "torchtitan: its TOML config (torchtitan 0.2), or MODULE:NAME of its Python configs",
    "megatron": "megatron: the Megatron-LM checkout whose script follows -- (default: anvil.megatron_path)",
    "metrics-regex": "Metric lines of another format: a regex with (?P<step>...) and (?P<loss>...) (optionally "
                     "tokens_per_s, mfu, mem_gib, lr)",
    "hang-timeout": "Seconds without a metric line, once there was one, before the ranks are taken for hung, "
                    "named and stopped (exit 4; 0 = off; default 1800)",
    "max-restarts": "After a rank fails or hangs, start every rank again from the program's newest checkpoint, "
                    "this many times (0 = off; as torchrun's --max-restarts)",
    "resume": "auto (newest checkpoint among runs/*_train.launch_<name>) or a run directory or checkpoint: the "
              "program resumes there (the backend's own flags; for command, variables: docs/training.md)",
    **{k: PRETRAIN_HELP[k] for k in ("nproc", "gpu", "site", "runtime", "master", "nodes", "partition",
                                     "account", "time", "wait", "exclude", "exclude-from", "json")},
    "hosts": "SSH: run across these hosts, one agent each, node ranks in this order (comma-separated; '@' = "
             "anvil.hosts); `inv -H a,b train.launch` says the same",
    "dry-run": "Print the program and the launch command; start nothing",
}


@run_task(help=LAUNCH_HELP, iterable=["exclude"], takes_hosts=True)
def launch(c, backend="command", config="", megatron="", metrics_regex="", hang_timeout=1800.0, max_restarts=0,
           nproc=0, resume=None, gpu="", site="", runtime="", hosts=None, master="", nodes=0, partition="", account="",
           time="", wait=True, exclude=None, exclude_from="", dry_run=False, json=False, run_options=None):
    """Run another trainer under the runner: `--backend command -- PROGRAM ARGS`, torchtitan (--config FILE.toml),
    megatron (-- pretrain_gpt.py ARGS); run dir, snapshot, hooks, rank logs, metrics, requeue, report."""
    from runtime import settings as settings_mod
    from runtime.cluster import Runtime
    from runtime.jobs.launching import LaunchJob, run_launch

    job = LaunchJob(backend=backend, program=settings_mod.program_args(c), config=config, megatron=megatron,
                    metrics_regex=metrics_regex, hang_timeout=float(hang_timeout), max_restarts=int(max_restarts),
                    nproc=nproc, resume=resume,
                    gpu=gpu, site=site, runtime=Runtime.parse(runtime) if runtime else None, hosts=hosts,
                    master=master, nodes=nodes, partition=partition, account=account, time=time, wait=wait,
                    exclude=list(exclude or []), exclude_from=exclude_from, dry_run=dry_run)
    result = run_launch(c, job, run_options)
    if result.get("dry_run"):
        return
    summary = result.get("summary") or {}
    if json:
        submitted = {"slurm_job_id": result["slurm_job_id"]} if result.get("slurm_job_id") else {}
        print(jsonlib.dumps({**summary, **submitted, "run_dir": str(result["run_dir"])}, indent=2))
    elif summary:
        from tabulate import tabulate

        from runtime.runs.history import summary_rows
        print(tabulate(summary_rows(summary), tablefmt="plain"))
    print(f"run directory: {result['run_dir']}", file=sys.stderr if json else sys.stdout)


@task(help={"run": "Run directory or checkpoint (step_N) to export",
            "format": "Output format: hf (config.json + model.safetensors)",
            "out": "Output directory (default: RUN/export/hf-step_N)",
            "dtype": "dtype of the exported weights: bfloat16 (the default; half the bytes of fp32), float16 or "
                     "float32"})
def export(c, run, format="hf", out="", dtype="bfloat16"):
    """Export a checkpoint for transformers: LlamaForCausalLM, DeepseekV2ForCausalLM, DeepseekV3ForCausalLM or
    Qwen3MoeForCausalLM, after model.family; weights in bfloat16 unless --dtype says so."""
    if format != "hf":
        raise UserError(f"unknown --format {format!r} (hf)")
    from trainer.export import export_hf, exported
    path = export_hf(run, out or None, dtype=dtype)      # ExportError: a UserError, one line, exit 2
    print(exported(path, dtype))


@task(help={"run": "Run directory (reads its metrics.jsonl, and those of the runs it resumed from)",
            "out": "Output .png file or directory (default: RUN/plots/metrics.png)",
            "force": "Write over an existing --out file that train.plot did not draw"})
def plot(c, run, out="", force=False):
    """Draw loss, throughput and memory over steps to PNG (every segment of a resumed run)."""
    from pathlib import Path

    from runtime.runs import metrics
    from trainer.plot import plot_run
    curves = metrics.read(run) if str(run).strip() and Path(run).is_dir() else None
    path = plot_run(run, out or None, (curves.train, curves.val, curves.resumes) if curves else None,
                    force)   # one line, exit 2
    print(path)


PLAN_HELP = {
    "config": "Training config YAML (default: configs/tiny.yaml)",
    "set": "Config override KEY=VALUE, e.g. data.batch_size=2 (repeatable)",
    "init-from": "Plan the model of this Hugging Face directory (its config.json)",
    "gpus": "GPUs per node (default: the detected or named machine's count, e.g. H100:4; 1 without a GPU)",
    "nodes": "Nodes (default 1); the data-parallel world is gpus x nodes",
    "gpu": "Plan for this GPU model: H100, H200, MI300X, MI250X, A100-40GB ... (default: detect)",
    "json": "Print the plan as JSON",
    "predict": "Predict the speed even without measured figures for the GPU (its datasheet at stated efficiencies)",
    "tokens": "Time to train this many tokens (300B, 1T, 2.5e9) at the predicted speed",
    "search": "Rank the layouts that fit (batch, accumulation, checkpointing, ep) by predicted tokens/s",
    "net-gbps": "Network bandwidth per GPU each way across nodes, GB/s (default 50: a 400 Gb/s NIC a GPU)",
}


@task(auto_shortflags=False, iterable=["set_"], help=PLAN_HELP)
def plan(c, config="", set_=None, init_from=None, gpus=None, nodes=1, gpu="", json=False, predict=False,
         tokens="", search=False, net_gbps=None):
    """Plan before launch: parameters, FLOPs/token, per-GPU memory, does it fit; predicted tokens/s and MFU."""
    import envs
    from runtime.jobs import planning
    from trainer import config as trainer_config
    from trainer import flags, hf
    from runtime import settings as settings_mod
    from trainer import speed
    from trainer.plan import PlanError, make_plan, render

    if gpus is not None and not re.fullmatch(r"\s*-?\d+\s*", str(gpus)):
        raise PlanError(f"--gpus {gpus!r}: expected a positive integer")
    cfg = hf.load_config(config or None, flags.overrides(set_ or [], init_from=init_from))
    model, memory_gib = planning.split_gpu_size(gpu)      # A100-40GB: the A100 profile with 40 GiB
    device, count = planning.plan_device(envs.resolve(gpu=model or None, config_env=cfg.env), memory_gib)
    per_node, nodes = planning.nodes_of(count if gpus is None else int(gpus), int(nodes), device)
    result = make_plan(cfg, gpus=per_node, nodes=nodes, device=device,
                       config_path=config or str(trainer_config.DEFAULT_CONFIG.relative_to(
                           trainer_config.DEFAULT_CONFIG.parents[1])))
    target = speed.parse_tokens(tokens) if tokens else None
    settings = settings_mod.load(c)
    net = planning.positive(net_gbps, "--net-gbps")
    rates = planning.rates_for(device, settings.runs_dir, net)
    prediction = planning.speed_of(cfg, rates, per_node, nodes, always=predict or bool(tokens) or search)
    searched = (speed.search(cfg, rates, device, per_node, nodes) if rates else []) if search else None
    if json:
        out = result.to_dict()
        if prediction:
            out["prediction"] = {**prediction.to_dict(), **({"tokens": target, "time_to_tokens_s":
                                                             prediction.time_to(target)} if target else {})}
        if searched is not None:
            out["search"] = searched
        print(jsonlib.dumps(out, indent=2))
        return
    body, _, verdict = render(result).rpartition("\n\n")
    if prediction:
        body += "\n\n" + speed.render(prediction, target, searched)
    elif predict or tokens or search:
        body += ("\n\nspeed: nothing known of this device's speed; name a GPU with --gpu, or measure this machine "
                 "with `inv bench.rates`")
    print(body + "\n\n" + verdict)      # the verdict stays the last line


ns = Collection("train")
ns.add_task(pretrain)
ns.add_task(launch)
ns.add_task(export)
ns.add_task(plot)
ns.add_task(plan)
