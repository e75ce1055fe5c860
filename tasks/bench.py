"""inv bench.*: measurements of this machine's GPUs and of our kernels."""
from invoke import Collection, task
from invoke.exceptions import Exit


@task(help={"op": "rms_norm, rope, swiglu, cross_entropy, flce or all (default)",
            "json": "print the report as JSON", "quick": "fewer repetitions (a rough table fast)",
            "out": "also write the table (or the JSON) to this file"})
def kernels(c, op="all", json=False, quick=False, out=None):
    """Fused kernels vs eager, torch.compile and Liger-Kernel (forward + backward, bf16)."""
    import json as json_mod

    import torch

    from benchmarks import kernels as kb

    if not torch.cuda.is_available():
        raise Exit("bench.kernels needs a CUDA or ROCm GPU and this machine has none visible "
                   "(torch.cuda.is_available() is False)", 1)
    try:
        report = kb.run(op, quick)
        text = json_mod.dumps(report, indent=2) if json else kb.render(report)
        if out:
            kb.write_atomic(out, text + "\n")
    except kb.KernelBenchError as exc:
        raise Exit(f"bench.kernels: {exc}", 2) from None
    print(text)


ns = Collection("bench")
ns.add_task(kernels)
