"""inv bench.*: measurements of this machine's GPUs and of our kernels.

Each benchmark is a run (runs/<time>_bench.<name>/, with the snapshot) and runs
in a child process that gets the resolved environment, so what the GPU
profile sets (TunableOp, hipBLASLt, NCCL/RCCL variables) is what is measured.
The work itself is in runtime/jobs/benchmarks.py.
"""
import json as jsonlib

from invoke import Collection

from core import names
from runtime.runs.run import run_task
from core.errors import AnvilError, UserError

GPU_HELP = {"gpu": "Resolve the environment for another GPU model (default: detect)",
            "json": "Print the result as JSON",
            "dry-run": "Print the resolved environment and the exact command; start nothing"}


def _resolve(gpu: str, run_options, tune_gemm: bool = False):
    """The resolved environment (its warnings on stderr): the GEMM's default size depends on its machine."""
    from runtime.jobs.environment import print_warnings, resolved_env

    env = resolved_env(gpu, None, None, run_options.env, tune_gemm)
    print_warnings(env.warnings)
    return env


def _execute(c, task_name, run_options, env, body, extra=None, dry=None):
    """Run body(run, env) as a run; dry(env) instead with --dry-run."""
    from runtime.runs.run import execute

    if dry is not None:
        return dry(env)
    return execute(c, run_options.spec(task_name, env=env, extra=extra), lambda run: body(run, env))


@run_task(per_node=True, help={**GPU_HELP,
                               "M": "Rows of A and of the product, an integer (default 8192 on a GPU, 1024 on a CPU)",
                               "N": "Columns of B (default: M)", "K": "Inner dimension (default: M)",
                               "dtype": "bf16 | fp16 | fp32", "iters": "Timed products (default 20)",
                               "tune-gemm": "TunableOp tuning, its results kept per GPU model, torch and CUDA/ROCm "
                                            "build (the first product tunes the shape; later runs read it back)",
                               "force": "Run even when A, B and the product need more than the device's memory"})
def gemm(c, M=None, N=None, K=None, dtype="bf16", iters=20, gpu="", json=False, dry_run=False, tune_gemm=False,
         force=False, run_options=None):
    """GEMM throughput: median time and TFLOP/s of an M x N x K product (and % of the GPU's peak)."""
    import sys

    from runtime import settings as settings_mod
    from runtime.jobs import benchmarks

    def body(run, env):
        result = benchmarks.gemm(run, m, n, k, dtype, iters)
        if json:
            print(jsonlib.dumps(result, indent=2))
        else:
            from tabulate import tabulate
            print(tabulate([[result["device"], result["dtype"], f"{result['m']}x{result['n']}x{result['k']}",
                             f"{result['median_ms']:.3f}", f"{result['tflops']:.1f}", benchmarks.peak_cell(result)]],
                           headers=["device", "dtype", "M x N x K", "median ms", "TFLOP/s", "of peak"]))
        return result
    m, n, k = benchmarks.parse_dims(M, N, K)   # None defaults: a typed 0 is refused, not taken for "as M"
    benchmarks.check_gemm(m, n, k, dtype, iters)
    benchmarks.check_runtime(run_options.runtime, settings_mod.load(c))
    env = _resolve(gpu, run_options, tune_gemm)
    m, note = benchmarks.gemm_rows(m, env)
    if note:
        print(note, file=sys.stderr)
    benchmarks.check_gemm_fits(m, n, k, dtype, env, force or dry_run)
    dry = (lambda env: benchmarks.dry_run(env, argv=benchmarks.gemm_argv(m, n, k, dtype, iters))) if dry_run else None
    _execute(c, "bench.gemm", run_options, env, body, extra={"M": m, "N": n or m, "K": k or m, "dtype": dtype},
             dry=dry)


@run_task(per_node=True, help={**GPU_HELP,
                               "op": "all_reduce (default), all_gather, reduce_scatter, broadcast",
                               "sizes": "Message sizes, e.g. 1M,64M,1G", "iters": "Timed repetitions per size",
                               "nproc": "Processes per node (default: one per visible GPU; 2 on a CPU, over gloo)",
                               "eager": "On GPUs, time eager calls (what a training loop pays per call) instead of "
                                        "replays of a CUDA graph of the calls (nccl-tests -G: the fabric's figure)",
                               "dtype": "Element type, bf16 or fp32 (default: bf16 on GPUs, fp32 on a CPU; "
                                        "nccl-tests' default is fp32)"})
def allreduce(c, op="all_reduce", sizes="1M,16M,64M", iters=20, nproc=0, gpu="", eager=False, dtype="", json=False,
              dry_run=False, run_options=None):
    """Collective bandwidth (nccl-tests algbw / busbw) through the configured runtime; values are checked."""
    from runtime import settings as settings_mod
    from runtime.jobs import benchmarks

    benchmarks.check_collective(op, sizes, iters, nproc, dtype)
    settings = settings_mod.load(c)
    runtime = benchmarks.check_runtime(run_options.runtime, settings)

    def body(run, env):
        # With --json the ranks' table goes to stderr: stdout is the JSON alone.
        report = benchmarks.collective(settings, run, env, op, sizes, iters, nproc, runtime, quiet=json, eager=eager,
                                       dtype=dtype)
        if json:
            print(jsonlib.dumps(report, indent=2))
        return report
    def dry(env):
        spec = benchmarks.collective_spec(env, op, sizes, iters, nproc, "RUN_DIR/collectives.json", eager, dtype)
        benchmarks.dry_run(env, spec=spec, transport=runtime.open(settings.cluster_options()))
    _execute(c, "bench.allreduce", run_options, _resolve(gpu, run_options), body,
             extra={"op": op, "sizes": sizes, "eager": eager, "dtype": dtype},
             dry=dry if dry_run else None)


@run_task(help={"op": "rms_norm, rope, swiglu, cross_entropy, flce, grouped_gemm, moe_permute, router or all "
                      "(default)",
                "json": "print the report as JSON", "quick": "fewer repetitions (a rough table fast)",
                "out": "also write the table (or the JSON) to this file",
                "force": "write over an existing --out file that bench.kernels did not write"})
def kernels(c, op="all", json=False, quick=False, out="", force=False, run_options=None):
    """Fused kernels vs eager, torch.compile and Liger-Kernel or torch._grouped_mm (forward + backward, bf16)."""
    import torch

    from benchmarks import kernels as kb

    if out:
        kb.check_out(out, force)        # before minutes of measuring: one line, exit 2
    if not torch.cuda.is_available():
        raise AnvilError("needs a CUDA or ROCm GPU and this machine has none visible "
                         "(torch.cuda.is_available() is False)", 1)

    def body(run, env):
        try:
            report = kb.run(op, quick)
            text = jsonlib.dumps(report, indent=2) if json else kb.render(report)
            if out:
                kb.write_atomic(out, text + "\n")
        except kb.KernelBenchError as exc:
            raise UserError(str(exc)) from None
        run.write_json(names.KERNELS, report)
        print(text)
        return {"op": op}
    _execute(c, "bench.kernels", run_options, _resolve("", run_options), body, extra={"op": op, "quick": quick})


@run_task(iterable=["set_"], help={"config": "The training config whose shapes are measured (default: the embedded "
                                                "tiny one)",
                                      "set": "Override a config value KEY=VALUE (repeatable)",
                                      "quick": "Fewer repetitions, no FlexAttention (a rough record fast)",
                                      "json": "Print the measured figures as JSON"})
def rates(c, config="", set_=None, quick=False, json=False, run_options=None):
    """Measure what the speed prediction needs at a config's shapes (GEMMs, attention, memory-bound ops, HBM,
    launches) and record it for this GPU model: `inv train.plan` and `train.pretrain` predict with it."""
    from runtime import settings as settings_mod
    from runtime.jobs import benchmarks
    from trainer import flags, hf

    hf.load_config(config or None, flags.overrides(set_ or []))   # a bad config: one line before any run
    settings = settings_mod.load(c)

    def body(run, env):
        done = benchmarks.rates(run, settings, env, config, list(set_ or []), quick)
        r = done["rates"]
        if json:
            print(jsonlib.dumps(done, indent=2))
        else:
            gemms = [row[3] for rows in r["gemm"].values() for row in rows]
            print(f"{done['model']} ({r['device']}): GEMM {min(gemms):,.1f}-{max(gemms):,.1f} TFLOP/s over "
                  f"{len(gemms)} shapes; attention " + ", ".join(f"{k} {v:,.1f}" for k, v in r["attention"].items())
                  + f" TFLOP/s; HBM copy {r['hbm_gbps']:,.0f} GB/s; launch {r['launch_us']:.1f} us")
            print(f"recorded in {done['recorded']}: `inv train.plan` predicts with it")
        return {"model": done["model"], "recorded": done["recorded"]}
    _execute(c, "bench.rates", run_options, _resolve("", run_options), body,
             extra={"config": config, "set": list(set_ or []), "quick": quick})


ns = Collection("bench")
ns.add_task(gemm)
ns.add_task(allreduce)
ns.add_task(kernels)
ns.add_task(rates)
