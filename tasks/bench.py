"""inv bench.*: measurements of this machine's GPUs and of our kernels.

Each benchmark is a run (runs/<time>_bench.<name>/, with the snapshot) and runs
in a child process that gets the resolved environment, so what the GPU
profile sets (TunableOp, hipBLASLt, NCCL/RCCL variables) is what is measured.
The work itself is in runtime/jobs/benchmarks.py.
"""
import json as jsonlib

from invoke import Collection

from runtime.runs.run import run_task
from trainer.errors import AnvilError, UserError

GPU_HELP = {"gpu": "Resolve the environment for another GPU model (default: detect)",
            "json": "Print the result as JSON",
            "dry-run": "Print the resolved environment and the exact command; start nothing"}


def _execute(c, task_name, run_options, body, gpu="", extra=None, dry=None):
    """Resolve the environment, then run body(run, env) as a run; dry(env) instead with --dry-run."""
    from runtime.jobs.environment import print_warnings, resolved_env
    from runtime.runs.run import execute

    env = resolved_env(gpu, None, None, run_options.env)
    print_warnings(env.warnings)
    if dry is not None:
        return dry(env)
    return execute(c, run_options.spec(task_name, env=env, extra=extra), lambda run: body(run, env))


@run_task(per_node=True, help={**GPU_HELP, "M": "Rows of A (and of the product)", "N": "Columns of B (default: M)",
                               "K": "Inner dimension (default: M)", "dtype": "bf16 | fp16 | fp32",
                               "iters": "Timed products"})
def gemm(c, M=8192, N=0, K=0, dtype="bf16", iters=20, gpu="", json=False, dry_run=False, run_options=None):
    """GEMM throughput: median time and TFLOP/s of an M x N x K product (and % of the GPU's peak)."""
    from runtime.jobs import benchmarks

    def body(run, env):
        result = benchmarks.gemm(run, M, N, K, dtype, iters)
        if json:
            print(jsonlib.dumps(result, indent=2))
        else:
            from tabulate import tabulate
            peak = f"{result['percent_of_peak']:.1f}%" if result["percent_of_peak"] else "n/a (no GPU profile)"
            print(tabulate([[result["device"], result["dtype"], f"{result['m']}x{result['n']}x{result['k']}",
                             f"{result['median_ms']:.3f}", f"{result['tflops']:.1f}", peak]],
                           headers=["device", "dtype", "M x N x K", "median ms", "TFLOP/s", "of peak"]))
        return result
    benchmarks.check_gemm(M, N, K, dtype)
    dry = (lambda env: benchmarks.dry_run(env, argv=benchmarks.gemm_argv(M, N, K, dtype, iters))) if dry_run else None
    _execute(c, "bench.gemm", run_options, body, gpu, extra={"M": M, "N": N or M, "K": K or M, "dtype": dtype},
             dry=dry)


@run_task(per_node=True, help={**GPU_HELP, "op": "all_reduce (default), all_gather, reduce_scatter, broadcast",
                               "sizes": "Message sizes, e.g. 1M,64M,1G", "iters": "Timed repetitions per size",
                               "nproc": "Processes per node (default: one per visible GPU; 2 on a CPU, over gloo)"})
def allreduce(c, op="all_reduce", sizes="1M,16M,64M", iters=20, nproc=0, gpu="", json=False, dry_run=False,
              run_options=None):
    """Collective bandwidth (nccl-tests algbw / busbw) through the configured runtime; values are checked."""
    from runtime import settings as settings_mod
    from runtime.jobs import benchmarks

    benchmarks.check_collective(op, sizes)

    def body(run, env):
        report = benchmarks.collective(settings_mod.load(c), run, env, op, sizes, iters, nproc)
        if json:
            print(jsonlib.dumps(report, indent=2))
        return report
    def dry(env):
        spec = benchmarks.collective_spec(settings_mod.load(c), env, op, sizes, iters, nproc,
                                          "RUN_DIR/collectives.json")
        benchmarks.dry_run(env, spec=spec)
    _execute(c, "bench.allreduce", run_options, body, gpu, extra={"op": op, "sizes": sizes},
             dry=dry if dry_run else None)


@run_task(help={"op": "rms_norm, rope, swiglu, cross_entropy, flce or all (default)",
                "json": "print the report as JSON", "quick": "fewer repetitions (a rough table fast)",
                "out": "also write the table (or the JSON) to this file"})
def kernels(c, op="all", json=False, quick=False, out="", run_options=None):
    """Fused kernels vs eager, torch.compile and Liger-Kernel (forward + backward, bf16)."""
    import torch

    from benchmarks import kernels as kb

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
        run.write_json("kernels.json", report)
        print(text)
        return {"op": op}
    _execute(c, "bench.kernels", run_options, body, extra={"op": op, "quick": quick})


ns = Collection("bench")
ns.add_task(gemm)
ns.add_task(allreduce)
ns.add_task(kernels)
