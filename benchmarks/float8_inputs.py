"""RMSNorm and SwiGLU writing float8 GEMM inputs (kernels/float8.py) against today's path.

    python -m benchmarks.float8_inputs [--rows 16384 --dim 2048 --ffn 8192] [--json] [--out FILE]

Per op, at llama3_1b's shapes for a batch of 4 x 4096 tokens by default:
first the check, that the fused output is bit for bit torchao's tensorwise
cast of our plain kernel's output (bf16 input, and fp32 under bf16 autocast
as with fp32 master weights; SwiGLU's backward: its two gradients as e5m2);
then the time of the fused op (two passes) against our plain kernel
followed by torchao's cast, eager and compiled.
GPU only (the CPU tests cover the same code through Triton's interpreter).
"""
from __future__ import annotations

import argparse
import json
import sys

from core.files import write_atomic


def _cases(rows: int, dim: int, ffn: int, e4m3, e5m2):
    """(name, shape, fused() -> [(float8 data, scale)], plain() -> [high-precision tensors], float8 dtype,
    input tensors)."""
    import torch

    from kernels.float8 import Float8Target
    from kernels.rms_norm import rms_norm, rms_norm_float8
    from kernels.swiglu import _backward, _backward_float8, swiglu, swiglu_float8

    target = Float8Target(e4m3, _mm_config())
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, dim, device="cuda", generator=g).mul_(3)
    w = torch.rand(dim, device="cuda", generator=g).add_(0.5)
    xb, wb = x.bfloat16(), w.bfloat16()
    gate, up, dout = (torch.randn(rows, ffn, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))

    def parts(t):
        return [(t._data, t._scale)]

    yield ("rms_norm", (rows, dim), lambda: parts(rms_norm_float8(xb, wb, 1e-5, target)),
           lambda: [rms_norm(xb, wb, 1e-5)], e4m3, (xb, wb))
    yield ("swiglu", (rows, ffn), lambda: parts(swiglu_float8(gate, up, target)), lambda: [swiglu(gate, up)],
           e4m3, (gate, up))
    yield ("swiglu backward (d gate, d up)", (rows, ffn),
           lambda: (lambda qg, qu, sc: [(qg, sc[0]), (qu, sc[1])])(*_backward_float8(dout, gate, up, e5m2)),
           lambda: list(_backward(dout, gate, up)), e5m2, (dout, gate, up))
    # fp32 master weights: the norm runs in fp32 and Float8Linear casts its input to bf16 under autocast
    yield ("rms_norm fp32, autocast", (rows, dim), lambda: parts(rms_norm_float8(x, w, 1e-5, target)),
           lambda: [rms_norm(x, w, 1e-5)], e4m3, (x, w))


def _mm_config():
    from torchao.float8.float8_training_tensor import LinearMMConfig
    return LinearMMConfig()


def measure(rows: int, dim: int, ffn: int) -> list[dict]:
    import torch
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole
    from triton.testing import do_bench, do_bench_cudagraph

    from trainer.fp8 import float8_dtypes

    e4m3, e5m2 = float8_dtypes(torch.device("cuda"))

    def cast(hps, dtype):
        """Float8Linear's cast of each: to the autocast dtype first, then torchao's tensorwise cast."""
        role = GemmInputRole.INPUT if dtype == e4m3 else GemmInputRole.GRAD_OUTPUT
        return [hp_tensor_to_float8_dynamic(hp.to(torch.bfloat16) if torch.is_autocast_enabled() else hp, dtype,
                                            _mm_config(), gemm_input_role=role) for hp in hps]

    compiled_cast = torch.compile(cast)
    rows_out = []
    for name, shape, fused, plain, dtype, inputs in _cases(rows, dim, ffn, e4m3, e5m2):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled="autocast" in name):
            got, ref = fused(), cast(plain(), dtype)
            same = all(torch.equal(d.view(torch.uint8), r._data.view(torch.uint8)) and torch.equal(s, r._scale)
                       for (d, s), r in zip(got, ref))
            # GPU time from a CUDA graph of the calls (at these sizes a call's host time exceeds its
            # kernels' time, which is not what a training step sees), and wall time of eager calls
            calls = {"fused": fused, "plain_then_torchao_cast": lambda: cast(plain(), dtype),
                     "plain_then_compiled_cast": lambda: compiled_cast(plain(), dtype)}
            ms = {k: do_bench_cudagraph(f) for k, f in calls.items()}
            wall_ms = {k: do_bench(f) for k, f in calls.items()}
        rows_out.append({"op": name, "shape": list(shape), "bit_equal": bool(same),
                         "scales": [float(s) for _, s in got], "ms": ms, "wall_ms": wall_ms,
                         "input_bytes": sum(t.numel() * t.element_size() for t in inputs),
                         "vs_eager": ms["plain_then_torchao_cast"] / ms["fused"],
                         "vs_compiled": ms["plain_then_compiled_cast"] / ms["fused"]})
    return rows_out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=16384)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=8192)
    p.add_argument("--json", action="store_true")
    p.add_argument("--out")
    a = p.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("benchmarks.float8_inputs needs a GPU with FP8 (the CPU tests cover the kernels)", file=sys.stderr)
        return 2
    rows = measure(a.rows, a.dim, a.ffn)
    if a.out:
        write_atomic(a.out, json.dumps(rows, indent=1))
    if a.json:
        print(json.dumps(rows))
    else:
        from tabulate import tabulate
        print(tabulate([[r["op"], "x".join(map(str, r["shape"])), r["bit_equal"], f"{r['ms']['fused']:.3f}",
                         f"{r['ms']['plain_then_torchao_cast']:.3f}", f"{r['ms']['plain_then_compiled_cast']:.3f}",
                         f"{r['vs_eager']:.2f}x", f"{r['vs_compiled']:.2f}x"] for r in rows],
                       headers=["op", "shape", "same bits", "fused GPU ms", "plain + torchao cast",
                                "plain + compiled cast", "vs eager", "vs compiled"]))
        print("wall ms of eager calls (host included): " + "; ".join(
            f"{r['op']}: " + ", ".join(f"{v:.3f}" for v in r["wall_ms"].values()) for r in rows))
    return 0 if all(r["bit_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
