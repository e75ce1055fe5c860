"""Benchmark cases for the mixture-of-experts kernels: grouped GEMM, permute + unpermute, router.

    python -m benchmarks.kernels --op grouped_gemm|moe_permute|router     # the table, all providers
    python -m benchmarks.cases_moe --sweep [--product weight_grad] [--no-configs]
        # each grouped-GEMM product alone: torch._grouped_mm, anvil (what grouped_mm runs) and each config
    python -m benchmarks.cases_moe --permute-profile   # moe_permute's round trip kernel by kernel

Shapes (tokens = 4096 x BATCH): DeepSeek-V2-Lite (hidden 2048, moe_intermediate 1408, 64 routed
experts, top-6) and Qwen3-30B-A3B (hidden 2048, moe_intermediate 768, 128 experts, top-8); the router
also at DeepSeek-V3's gate (256 experts, sigmoid, 8 groups keep 4, top-8). Routing is uniform random
top-k, so the experts get about T k / E rows each, unequal.

Providers, forward + backward, bf16:
- grouped_gemm, a projection's experts as transformers stores them ([E, N, K], so w = its transposed
  view): anvil = kernels.grouped_gemm.grouped_mm, torch = torch._grouped_mm (CUDA sm_90+), eager = a
  loop over the experts' slices with sizes known on the host, compile = torch.compile of that loop.
  The gate/up projection (K = hidden, N = 2 x intermediate) and the down projection (K = intermediate,
  N = hidden). Floor: the three products' 6 x rows x K x N FLOPs at the measured matmul rate.
- moe_permute: permute, unpermute of the permuted rows (no expert in between), backward through both;
  anvil = kernels.moe_permute, eager = its permute_reference / unpermute_reference (argsort,
  index_select, scatter-add), compile = torch.compile of those. Floor: (4 + 5k) x T x D x 2 bytes.
- router: the gate's scores to routing weights with the auxiliary loss's gradient on the scores too;
  anvil = router_triton at every size (route() takes it on NVIDIA GPUs from 128 experts, where it wins),
  eager / compile = router_reference.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from benchmarks.kernels import Case, Unavailable

BATCH = 2
TOKENS = 4096 * BATCH
BF16_BYTES = 2


@dataclass(frozen=True)
class MoeShape:
    name: str
    hidden: int
    intermediate: int
    experts: int
    top_k: int


DEEPSEEK_V2_LITE = MoeShape("DeepSeek-V2-Lite", 2048, 1408, 64, 6)
QWEN3_30B_A3B = MoeShape("Qwen3-30B-A3B", 2048, 768, 128, 8)
SHAPES = (DEEPSEEK_V2_LITE, QWEN3_30B_A3B)


def _routing(device, tokens: int, experts: int, top_k: int):
    import torch
    return torch.rand(tokens, experts, device=device).topk(top_k, dim=1).indices


# ---------------------------------------------------------------- grouped GEMM

def _gemm_setup(shape: MoeShape, k: int, n: int):
    def setup(device):
        import torch
        ids = _routing(device, TOKENS, shape.experts, shape.top_k)
        counts = torch.bincount(ids.flatten(), minlength=shape.experts)
        rows = TOKENS * shape.top_k
        stored = (torch.randn(shape.experts, n, k, device=device) / k**0.5).to(torch.bfloat16).requires_grad_()
        return {"x": torch.randn(rows, k, device=device, dtype=torch.bfloat16).requires_grad_(),
                "stored": stored, "offs": counts.cumsum(0).to(torch.int32), "sizes": counts.tolist(),
                "dy": torch.randn(rows, n, device=device, dtype=torch.bfloat16)}
    return setup


def _expert_loop(x, w, sizes):
    import torch
    return torch.cat([part @ w[e] for e, part in enumerate(x.split(sizes))])


def _gemm_provider(product):
    def make(state):
        x, stored, offs, sizes, dy = state["x"], state["stored"], state["offs"], state["sizes"], state["dy"]
        fn = product()
        return lambda: fn(x, stored.transpose(1, 2), offs, sizes).backward(dy)   # w [E, K, N], K innermost
    return make


def _gemm_anvil():
    from kernels.grouped_gemm import grouped_mm
    return lambda x, w, offs, sizes: grouped_mm(x, w, offs)


def _gemm_torch():
    import torch
    if not (hasattr(torch, "_grouped_mm") and torch.cuda.is_available() and not torch.version.hip
            and torch.cuda.get_device_capability() >= (9, 0)):
        raise Unavailable("torch._grouped_mm runs on CUDA sm_90+")
    return lambda x, w, offs, sizes: torch._grouped_mm(x, w, offs=offs)


def _gemm_compile():
    import torch
    loop = torch.compile(_expert_loop)
    return lambda x, w, offs, sizes: loop(x, w, sizes)


def _dims(shape: MoeShape, projection: str) -> tuple[int, int]:
    """(K, N) of a projection: gate_up maps hidden to both halves, down maps back."""
    return (shape.hidden, 2 * shape.intermediate) if projection == "gate_up" else (shape.intermediate, shape.hidden)


def grouped_gemm_case(shape: MoeShape, projection: str) -> Case:
    k, n = _dims(shape, projection)
    rows = TOKENS * shape.top_k
    return Case(op="grouped_gemm", shape=f"{shape.name} {projection} {rows}x{k}->{n} E{shape.experts}",
                setup=_gemm_setup(shape, k, n),
                providers={"anvil": _gemm_provider(_gemm_anvil), "torch": _gemm_provider(_gemm_torch),
                           "eager": _gemm_provider(lambda: lambda x, w, offs, sizes: _expert_loop(x, w, sizes)),
                           "compile": _gemm_provider(_gemm_compile)},
                flops=6 * rows * k * n, grad_to_none=lambda s: [s["x"], s["stored"]])


# ---------------------------------------------------------------- permute + unpermute

def _permute_setup(shape: MoeShape):
    def setup(device):
        import torch
        return {"x": torch.randn(TOKENS, shape.hidden, device=device, dtype=torch.bfloat16).requires_grad_(),
                "ids": _routing(device, TOKENS, shape.experts, shape.top_k), "experts": shape.experts,
                "weights": torch.rand(TOKENS, shape.top_k, device=device).requires_grad_(),
                "dout": torch.randn(TOKENS, shape.hidden, device=device, dtype=torch.bfloat16)}
    return setup


def _permute_round_trip(permute, unpermute):
    def round_trip(x, ids, experts, weights):
        x_sorted, plan = permute(x, ids, experts)
        return unpermute(x_sorted, plan, weights)
    return round_trip


def _permute_provider(round_trip_of):
    def make(state):
        fn = round_trip_of()
        x, ids, experts, weights, dout = state["x"], state["ids"], state["experts"], state["weights"], state["dout"]
        return lambda: fn(x, ids, experts, weights).backward(dout)
    return make


def _permute_anvil():
    from kernels.moe_permute import permute, unpermute
    return _permute_round_trip(permute, unpermute)


def _permute_reference():
    from kernels.moe_permute import permute_reference, unpermute_reference
    return _permute_round_trip(permute_reference, unpermute_reference)


def _compiled(make_fn):
    def make():
        import torch
        return torch.compile(make_fn())
    return make


def permute_case(shape: MoeShape) -> Case:
    return Case(op="moe_permute", shape=f"{shape.name} {TOKENS}x{shape.hidden} E{shape.experts} k{shape.top_k}",
                setup=_permute_setup(shape),
                providers={"anvil": _permute_provider(_permute_anvil),
                           "eager": _permute_provider(_permute_reference),
                           "compile": _permute_provider(_compiled(_permute_reference))},
                bytes_moved=(4 + 5 * shape.top_k) * TOKENS * shape.hidden * BF16_BYTES,
                grad_to_none=lambda s: [s["x"], s["weights"]])


# ---------------------------------------------------------------- router

def _router_setup(experts: int, bias: bool):
    def setup(device):
        import torch
        return {"logits": torch.randn(TOKENS, experts, device=device).requires_grad_(),
                "bias": 0.01 * torch.randn(experts, device=device) if bias else None,
                "d_scores": torch.randn(TOKENS, experts, device=device)}
    return setup


def _router_provider(impl_of, spec):
    def make(state):
        import torch
        impl = impl_of()
        logits, bias, d_scores = state["logits"], state["bias"], state["d_scores"]
        d_weights = torch.randn(TOKENS, spec.top_k, device=logits.device)

        def fn():
            weights, _, scores = impl(logits, spec, bias)
            torch.autograd.backward((weights, scores), (d_weights, d_scores))
        return fn
    return make


def _router_triton():
    from kernels.router import router_triton
    return router_triton


def _router_reference():
    from kernels.router import router_reference
    return router_reference


def router_case(name: str, experts: int, spec_args: dict, bias: bool = False) -> Case:
    from kernels.router import RouterSpec
    spec = RouterSpec(**spec_args)
    # fwd: logits in, scores out; bwd: logits, d scores in, d logits out (fp32), plus the [T, k] tensors
    bytes_moved = 5 * TOKENS * experts * 4 + 4 * TOKENS * spec.top_k * 8
    return Case(op="router", shape=f"{name} {TOKENS}x{experts} k{spec.top_k}", setup=_router_setup(experts, bias),
                providers={"anvil": _router_provider(_router_triton, spec),
                           "eager": _router_provider(_router_reference, spec),
                           "compile": _router_provider(_compiled(_router_reference), spec)},
                bytes_moved=bytes_moved, grad_to_none=lambda s: [s["logits"]])


CASES: list[Case] = [
    *(grouped_gemm_case(s, p) for s in SHAPES for p in ("gate_up", "down")),
    *(permute_case(s) for s in SHAPES),
    router_case("DeepSeek-V2-Lite", 64, {"top_k": 6}),
    router_case("Qwen3-30B-A3B", 128, {"top_k": 8, "norm_topk_prob": True}),
    router_case("DeepSeek-V3", 256, {"top_k": 8, "score_func": "sigmoid", "n_group": 8, "topk_group": 4,
                                     "norm_topk_prob": True, "routed_scaling_factor": 2.5}, bias=True),
]


# ---------------------------------------------------------------- tile sweep

PRODUCTS = ("forward", "input_grad", "weight_grad")


def _product_provider(product: str, config=None):
    """One product alone (forward, input gradient or weight gradient): with a config, our kernel with those
    tiles; without, what grouped_mm runs (the tuner's pick, torch._grouped_mm included where it is one)."""
    def make(state):
        import contextlib

        from kernels import grouped_gemm as gg
        x, w, offs, dy = state["x"].detach(), state["stored"].detach().transpose(1, 2), state["offs"], state["dy"]
        w_shape, w_stride = list(w.shape), list(w.stride())
        run = {"forward": lambda: gg._forward(x, w, offs),
               "input_grad": lambda: gg._forward(dy, w.transpose(1, 2), offs),
               "weight_grad": lambda: gg._weight_grad(x, dy, offs, w_shape, w_stride)}[product]

        def fn():
            with gg.forced_config(config) if config is not None else contextlib.nullcontext():
                run()
        return fn
    return make


def _torch_product(product: str):
    def make(state):
        import torch
        _gemm_torch()
        x, w, offs, dy = state["x"].detach(), state["stored"].detach().transpose(1, 2), state["offs"], state["dy"]
        # the weight gradient laid out as the weight ([E, N, K] storage), as grouped_mm's backward needs it
        return {"forward": lambda: torch._grouped_mm(x, w, offs=offs),
                "input_grad": lambda: torch._grouped_mm(dy, w.transpose(1, 2), offs=offs),
                "weight_grad": lambda: torch._grouped_mm(dy.t(), x, offs=offs)}[product]
    return make


def sweep_cases(device: str = "cuda", products=PRODUCTS, shapes=SHAPES) -> list[Case]:
    """Per shape, projection and product: torch._grouped_mm, grouped_mm as it runs (anvil: the tuner's
    pick), then each of the arch's candidate configs (c0, c1, ...)."""
    from kernels import arch
    cases = []
    for shape in shapes:
        for projection in ("gate_up", "down"):
            base = grouped_gemm_case(shape, projection)
            k, n = _dims(shape, projection)
            for product in products:
                providers = {"torch": _torch_product(product), "anvil": _product_provider(product)}
                for i, config in enumerate(arch.gemm_configs(arch.detect(device))):
                    providers[f"c{i}"] = _product_provider(product, config)
                cases.append(Case(op="grouped_gemm", shape=f"{base.shape} {product}", setup=base.setup,
                                  providers=providers, flops=2 * TOKENS * shape.top_k * k * n))
    return cases


def permute_profile(device: str = "cuda", rounds: int = 5) -> list[str]:
    """Where moe_permute's forward + backward spends its time: each GPU kernel's mean microseconds a round
    trip (torch.profiler), the round trip replayed from a CUDA graph (GPU time alone) and the CPU's time
    to launch it (kernel launches and autograd)."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile
    gpu = str(device).startswith("cuda")
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    lines = []
    for shape in SHAPES:
        case = permute_case(shape)
        state = case.setup(device)
        fn = _permute_provider(_permute_anvil)(state)

        def once():
            for leaf in case.grad_to_none(state):
                leaf.grad = None
            fn()
        once()
        sync()
        start = time.perf_counter()
        for _ in range(rounds):
            once()
        cpu_ms = (time.perf_counter() - start) / rounds * 1e3
        sync()
        with profile(activities=[ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU]) as prof:
            for _ in range(rounds):
                once()
            sync()
        kernels = [(e.key, e.count // rounds, (e.device_time_total if gpu else e.self_cpu_time_total) / rounds)
                   for e in prof.key_averages()]
        kernels = [k for k in kernels if k[2] > 0]
        total = sum(us for _, _, us in kernels)
        graph = ""
        if gpu:   # the round trip replayed from a CUDA graph: its GPU time with no host in between
            import triton.testing
            graph_ms = triton.testing.do_bench_cudagraph(fn, rep=50, grad_to_none=case.grad_to_none(state),
                                                         return_mode="median")
            graph = f", {graph_ms:.3f} ms replayed from a CUDA graph"
        lines.append(f"{case.shape}: GPU kernels {total / 1e3:.3f} ms a round trip (floor "
                     f"{case.bytes_moved / 3.0e12 * 1e3:.3f} ms at 3.0 TB/s){graph}, CPU {cpu_ms:.3f} ms to launch it")
        lines += [f"    {us:8.1f} us  x{n}  {name[:70]}" for name, n, us in sorted(kernels, key=lambda k: -k[2])]
    return lines


def main(argv: list[str]) -> None:
    import argparse

    import torch

    from benchmarks import kernels as kb
    from kernels import arch, grouped_gemm
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cases_moe")
    parser.add_argument("--sweep", action="store_true",
                        help="time each grouped-GEMM product alone: torch, anvil (the tuner's pick), each config")
    parser.add_argument("--product", choices=PRODUCTS, action="append", help="only these products (repeatable)")
    parser.add_argument("--no-configs", dest="configs", action="store_false",
                        help="only torch and anvil, not each candidate config alone (c0, c1, ...)")
    parser.add_argument("--permute-profile", action="store_true",
                        help="moe_permute's round trip kernel by kernel (torch.profiler) and its CPU time")
    args = parser.parse_args(argv)
    dev = "cuda"
    if args.permute_profile:
        print("\n".join(permute_profile(dev)))
        return
    if not args.sweep:
        parser.error("--sweep or --permute-profile")
    for i, config in enumerate(arch.gemm_configs(arch.detect(dev))):
        print(f"c{i}: {config}")
    ceil = kb.measure_ceilings(dev, quick=True)
    rows = []
    for case in sweep_cases(dev, tuple(args.product or PRODUCTS)):
        names = tuple(p for p in case.providers if args.configs or not p.startswith("c"))
        rows += kb.measure_case(case, dev, ceil, quick=True, providers=names)
    print(kb.render({"device": torch.cuda.get_device_name(), "versions": kb._versions(), "date": "",
                     "ceilings": vars(ceil), "notes": [], "rows": rows}))
    for case in sorted({r["shape"] for r in rows}):
        ms = {r["provider"]: r["ms"] for r in rows if r["shape"] == case and r["ms"]}
        ours = {p: t for p, t in ms.items() if p.startswith("c")}
        best = f"best config {min(ours, key=ours.get)} {min(ours.values()):.3f} ms, " if ours else ""
        anvil, torch_ms = ms.get("anvil", float("nan")), ms.get("torch", float("nan"))
        print(f"BEST {case}: {best}anvil {anvil:.3f} ms, torch {torch_ms:.3f} ms")
    for key, config in grouped_gemm.chosen().items():
        print(f"CHOSEN {key}: {config}")


if __name__ == "__main__":
    main(sys.argv[1:])
