"""inv bench.*: measurements of this machine's GPUs and of our kernels.

Each benchmark is a run (runs/<time>_bench.<name>/, with the snapshot) and runs
in a child process that gets the resolved environment, so what the GPU
profile sets (TunableOp, hipBLASLt, NCCL/RCCL variables) is what is measured.
"""
import json as jsonlib
import subprocess
import sys

from invoke import Collection
from invoke.exceptions import Exit

from runtime.runs.run import run_task

GPU_HELP = {"gpu": "Resolve the environment for another GPU model (default: detect)",
            "json": "Print the result as JSON"}


def _execute(c, task_name, run_options, body, gpu="", extra=None):
    from runtime.runs.run import execute
    from tasks.env import print_warnings, resolved_env

    env = resolved_env(gpu, None, None, run_options.env)
    print_warnings(env.warnings)
    return execute(c, run_options.spec(task_name, env=env, extra=extra), lambda run: body(run, env))


@run_task(per_node=True, help={**GPU_HELP, "M": "Rows of A (and of the product)", "N": "Columns of B (default: M)",
                "K": "Inner dimension (default: M)", "dtype": "bf16 | fp16 | fp32", "iters": "Timed products"})
def gemm(c, M=8192, N=0, K=0, dtype="bf16", iters=20, gpu="", json=False, run_options=None):
    """GEMM throughput: median time and TFLOP/s of an M x N x K product (and % of the GPU's peak)."""
    def body(run, env):
        argv = [sys.executable, "-m", "benchmarks.gemm", "-M", str(M), "--dtype", dtype,
                "--iters", str(iters), "--json"] + (["-N", str(N)] if N else []) + (["-K", str(K)] if K else [])
        proc = subprocess.run(argv, env=run.env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise Exit(f"bench.gemm: the benchmark failed: {proc.stderr.strip().splitlines()[-1:]}", 1)
        result = jsonlib.loads(proc.stdout.strip().splitlines()[-1])
        # the row the fan-out merges per node (inv -H, --runtime slurm)
        result["measurements"] = [{"name": f"gemm {result['m']}x{result['n']}x{result['k']} {result['dtype']}",
                                   "value": result["tflops"], "unit": "TFLOP/s"}]
        run.write_json("gemm.json", result)
        if json:
            print(jsonlib.dumps(result, indent=2))
        else:
            from tabulate import tabulate
            peak = f"{result['percent_of_peak']:.1f}%" if result["percent_of_peak"] else "n/a (no GPU profile)"
            print(tabulate([[result["device"], result["dtype"], f"{result['m']}x{result['n']}x{result['k']}",
                             f"{result['median_ms']:.3f}", f"{result['tflops']:.1f}", peak]],
                           headers=["device", "dtype", "M x N x K", "median ms", "TFLOP/s", "of peak"]))
        return result
    if min(M, N or M, K or M) <= 0:
        raise Exit("bench.gemm: M, N and K must be positive", 2)
    if dtype not in ("bf16", "fp16", "fp32"):
        raise Exit(f"bench.gemm: unknown --dtype {dtype!r} (bf16, fp16, fp32)", 2)
    _execute(c, "bench.gemm", run_options, body, gpu, extra={"M": M, "N": N or M, "K": K or M, "dtype": dtype})


@run_task(per_node=True, help={**GPU_HELP, "op": "all_reduce (default), all_gather, reduce_scatter, broadcast",
                "sizes": "Message sizes, e.g. 1M,64M,1G", "iters": "Timed repetitions per size",
                "nproc": "Processes per node (default: one per visible GPU; 2 on a CPU, over gloo)"})
def allreduce(c, op="all_reduce", sizes="1M,16M,64M", iters=20, nproc=0, gpu="", json=False, run_options=None):
    """Collective bandwidth (nccl-tests algbw / busbw) through the configured runtime; values are checked."""
    from benchmarks.collectives import OPS, parse_size

    if op not in OPS:
        raise Exit(f"bench.allreduce: unknown --op {op!r} ({', '.join(OPS)})", 2)
    try:
        [parse_size(s) for s in sizes.split(",") if s.strip()]
    except ValueError as exc:
        raise Exit(f"bench.allreduce: {exc}", 2)

    def body(run, env):
        from runtime import settings as settings_mod
        from runtime.launch import LaunchError, LaunchSpec, launch

        settings = settings_mod.load(c)
        out = run.path / "collectives.json"
        procs = nproc or (None if env.machine.count else 2)  # a collective needs two ranks
        spec = LaunchSpec(module="benchmarks.collectives", runtime=settings.runtime, nproc=procs,
                          gpus=env.machine.count, vendor=env.machine.vendor,
                          args=["--op", op, "--sizes", sizes, "--iters", str(iters), "--out", str(out)])
        try:
            code = launch(spec, env=run.env, run_dir=run.path, masker=run.masker)
        except LaunchError as exc:
            raise Exit(f"bench.allreduce: {exc}", 2)
        if code != 0 or not out.is_file():
            raise Exit(f"bench.allreduce: the benchmark exited with status {code}; see {run.path}/logs", code or 1)
        report = jsonlib.loads(out.read_text())
        report["measurements"] = [{"name": f"{r['op']} {r['bytes']} B x {r['ranks']} busbw", "value": r["busbw_GBps"],
                                   "unit": "GB/s"} for r in report.get("results", [])]
        if json:
            print(jsonlib.dumps(report, indent=2))
        return report
    _execute(c, "bench.allreduce", run_options, body, gpu, extra={"op": op, "sizes": sizes})


@run_task(help={"op": "rms_norm, rope, swiglu, cross_entropy, flce or all (default)",
                "json": "print the report as JSON", "quick": "fewer repetitions (a rough table fast)",
                "out": "also write the table (or the JSON) to this file"})
def kernels(c, op="all", json=False, quick=False, out="", run_options=None):
    """Fused kernels vs eager, torch.compile and Liger-Kernel (forward + backward, bf16)."""
    import torch

    from benchmarks import kernels as kb

    if not torch.cuda.is_available():
        raise Exit("bench.kernels needs a CUDA or ROCm GPU and this machine has none visible "
                   "(torch.cuda.is_available() is False)", 1)

    def body(run, env):
        try:
            report = kb.run(op, quick)
            text = jsonlib.dumps(report, indent=2) if json else kb.render(report)
            if out:
                kb.write_atomic(out, text + "\n")
        except kb.KernelBenchError as exc:
            raise Exit(f"bench.kernels: {exc}", 2) from None
        run.write_json("kernels.json", report)
        print(text)
        return {"op": op}
    _execute(c, "bench.kernels", run_options, body, extra={"op": op, "quick": quick})


ns = Collection("bench")
ns.add_task(gemm)
ns.add_task(allreduce)
ns.add_task(kernels)
