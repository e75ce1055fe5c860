"""The rates the speed prediction needs, measured on this device at a config's own shapes.

    python -m benchmarks.rates --config configs/llama3_1b.yaml [--set KEY=VALUE] [--out rates.json] [--quick]

What trainer/speed.py multiplies its FLOPs and bytes by, each timed here in isolation (CUDA/HIP events
on a GPU, wall clock on a CPU; medians after warm-up):
- every GEMM of a micro-batch (forward, input and weight gradient shapes) in the compute dtype;
- with a GPU and torchao, each layer linear as torchao's float8 linear, forward + backward, casts in;
- attention forward + backward: SDPA causal, and FlexAttention with documents of seq/4 tokens (GPU);
- the memory-bound ops as the trainer runs them, eager and (on a GPU) our fused kernels: RMSNorm,
  RoPE, SwiGLU, a residual add, cross-entropy after the LM head, AdamW's step: GB/s of the bytes
  trainer.speed counts for them;
- a device-to-device copy (HBM GB/s) and the host's time to issue one small kernel.
The JSON is a trainer.speed.Rates; `inv bench.rates` records it for the GPU model.
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def measure(cfg, quick: bool = False, say=print) -> dict:
    import torch
    import torch.nn.functional as F

    from trainer import speed

    from benchmarks.device import timed as timed_on

    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    iters = 5 if quick else 10

    def timed(fn, n: int) -> float:
        """Median seconds of fn() on this device, after two warm-up calls."""
        return timed_on(fn, device, iters=n)
    dtype = torch.bfloat16 if gpu and cfg.precision.compute != "fp32" else torch.float32
    dname = "bf16" if dtype == torch.bfloat16 else "fp32"
    c = 2 if dtype == torch.bfloat16 else 4
    m, d = cfg.model, cfg.data
    n_tok = d.batch_size * d.seq_len
    out: dict = {"gemm": {dname: []}, "fp8": [], "attention": {}, "op_gbps": {}, "host_is_device": not gpu,
                 "device": torch.cuda.get_device_name(0) if gpu else "cpu",
                 "versions": {"torch": torch.__version__}, "date": time.strftime("%Y-%m-%d"),
                 "config": {"model": m.name, "batch_size": d.batch_size, "seq_len": d.seq_len}}
    try:
        import triton
        out["versions"]["triton"] = triton.__version__
    except ImportError:
        pass

    def randn(*shape, dt=dtype, grad=False):
        return torch.randn(*shape, device=device, dtype=dt, requires_grad=grad)

    # ---- GEMMs: A[m, k] @ B[n, k].T as F.linear runs them
    for (gm, gn, gk) in speed.gemm_shapes(cfg):
        a, b = randn(gm, gk), randn(gn, gk)
        s = timed(lambda: F.linear(a, b), iters)
        out["gemm"][dname].append([gm, gn, gk, round(2.0 * gm * gn * gk / s / 1e12, 3)])
        del a, b
    say(f"GEMM: {len(out['gemm'][dname])} shapes")

    # ---- FP8 linears (torchao), forward + backward
    if gpu and cfg.precision.fp8 != "off":
        try:
            from trainer.fp8 import convert
            for (tokens, n_in, n_out) in speed.fp8_shapes(cfg):
                lin = torch.nn.Sequential(torch.nn.Linear(n_in, n_out, bias=False, device=device, dtype=dtype))
                convert(lin, cfg.precision.fp8, device=device, module_filter=lambda mod, fqn: True)
                x = randn(tokens, n_in, grad=True)
                gy = randn(tokens, n_out)
                s = timed(lambda: lin(x).backward(gy), iters)
                out["fp8"].append([tokens, n_in, n_out, round(6.0 * tokens * n_in * n_out / s / 1e12, 3)])
            say(f"FP8 linears: {len(out['fp8'])} shapes")
        except Exception as exc:   # torchao absent or the GPU without FP8: the prediction says so
            out.setdefault("notes", []).append(f"FP8 linears not measured: {type(exc).__name__}: {exc}")

    # ---- attention, forward + backward
    heads, kv = m.n_heads, m.n_kv_heads if m.mla is None else m.n_heads
    if m.mla is not None:
        qk, vd = m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim, m.mla.v_head_dim
    else:
        qk = vd = m.head_dim
    b_, t_ = d.batch_size, d.seq_len
    q, k_, v = randn(b_, heads, t_, qk, grad=True), randn(b_, kv, t_, qk, grad=True), randn(b_, kv, t_, vd, grad=True)
    flops = speed.attention_flops(cfg, n_tok) * (1 + speed.FLASH_BACKWARD)

    def sdpa():
        o = F.scaled_dot_product_attention(q, k_, v, is_causal=True, enable_gqa=kv != heads)
        o.backward(torch.ones_like(o))
    out["attention"]["sdpa_causal"] = round(flops / timed(sdpa, iters) / 1e12, 3)
    # documents of seq/4 tokens through SDPA's additive mask (train.attention=sdpa; the CPU's path)
    doc_ids = torch.arange(t_, device=device) // max(1, t_ // 4)
    allowed = (doc_ids[:, None] == doc_ids[None, :]) & torch.ones(t_, t_, dtype=torch.bool, device=device).tril()
    additive = torch.zeros(t_, t_, device=device, dtype=dtype).masked_fill(~allowed, float("-inf"))

    def sdpa_docs():
        o = F.scaled_dot_product_attention(q, k_, v, attn_mask=additive, enable_gqa=kv != heads)
        o.backward(torch.ones_like(o))
    out["attention"]["sdpa_docs"] = round(flops / timed(sdpa_docs, iters) / 1e12, 3)
    if gpu and not quick:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
            doc = torch.arange(t_, device=device) // max(1, t_ // 4)

            def docs(b, h, qi, ki):
                return (qi >= ki) & (doc[qi] == doc[ki])
            mask = create_block_mask(docs, None, None, t_, t_, device=device)
            flex = torch.compile(flex_attention)

            def run_flex():
                o = flex(q, k_, v, block_mask=mask, enable_gqa=kv != heads)
                o.backward(torch.ones_like(o))
            out["attention"]["flex_docs"] = round(flops / timed(run_flex, iters) / 1e12, 3)
        except Exception as exc:
            out.setdefault("notes", []).append(f"FlexAttention not measured: {type(exc).__name__}: {exc}")
    del q, k_, v
    say(f"attention: {out['attention']}")

    # ---- memory-bound ops, eager and fused
    from trainer.models.blocks import RMSNorm, apply_rotary_emb, silu_mul
    bytes_of = speed.op_bytes(cfg, c)
    ffn = m.ffn_dim if m.moe is None else m.moe.ffn_dim
    impls = ["eager"] + (["kernels"] if gpu else [])
    for impl in impls:
        x = randn(n_tok, m.dim, grad=True)
        gy = randn(n_tok, m.dim)
        if impl == "eager":
            norm = RMSNorm(m.dim).to(device)
            run_norm = lambda: norm(x).backward(gy)   # noqa: E731
        else:
            from kernels.rms_norm import rms_norm
            w = torch.ones(m.dim, device=device, dtype=dtype, requires_grad=True)
            run_norm = lambda: rms_norm(x, w, 1e-5).backward(gy)   # noqa: E731
        per_token = sum(bytes_of["norm"]) / 2     # the table counts two a layer
        out["op_gbps"][f"norm/{impl}"] = round(n_tok * per_token / timed(run_norm, iters) / 1e9, 2)

        qr = randn(b_, t_, heads, m.head_dim, grad=True)
        kr = randn(b_, t_, kv, m.head_dim, grad=True)
        cos, sin = torch.randn(t_, m.head_dim, device=device), torch.randn(t_, m.head_dim, device=device)
        if impl == "eager":
            rope = lambda: apply_rotary_emb(qr, kr, cos, sin)   # noqa: E731
        else:
            from kernels.rope import apply_rope
            rope = lambda: apply_rope(qr, kr, cos, sin)   # noqa: E731

        def run_rope():
            a, b = rope()
            torch.autograd.backward([a, b], [torch.ones_like(a), torch.ones_like(b)])
        out["op_gbps"][f"rope/{impl}"] = round(n_tok * sum(bytes_of["rope"]) / timed(run_rope, iters) / 1e9, 2)
        del qr, kr

        g, u = randn(n_tok, ffn, grad=True), randn(n_tok, ffn, grad=True)
        gout = randn(n_tok, ffn)
        if impl == "eager":
            run_swiglu = lambda: silu_mul(g, u).backward(gout)   # noqa: E731
        else:
            from kernels.swiglu import swiglu
            run_swiglu = lambda: swiglu(g, u).backward(gout)   # noqa: E731
        per_token = (3 + 5) * ffn * c
        out["op_gbps"][f"swiglu/{impl}"] = round(n_tok * per_token / timed(run_swiglu, iters) / 1e9, 2)
        del g, u, gout

        y = randn(n_tok, m.dim, grad=True)
        run_add = lambda: (x + y).backward(gy)   # noqa: E731
        out["op_gbps"][f"residual/{impl}"] = round(n_tok * 3 * m.dim * c * 2 / timed(run_add, iters) / 1e9, 2)
        del x, y, gy
    say(f"memory-bound: {out['op_gbps']}")

    # ---- the loss after the LM head: whole time less its three products at the rates just measured
    h = randn(n_tok, m.dim, grad=True)
    head = randn(m.vocab_size, m.dim, grad=True)
    labels = torch.randint(0, m.vocab_size, (n_tok,), device=device)
    rates = speed.Rates(gpu="", source="", measured=True, peak_tflops=None, gemm=out["gemm"])
    gemms = sum(2.0 * n_tok * m.dim * m.vocab_size / (rates.gemm_rate(*shape, dname) * 1e12) for shape in
                ((n_tok, m.vocab_size, m.dim), (n_tok, m.dim, m.vocab_size), (m.vocab_size, m.dim, n_tok)))
    from trainer.models.blocks import linear_cross_entropy
    loss_impls = [("eager", lambda: linear_cross_entropy(h, head, labels).backward())]
    if gpu:
        from kernels.fused_linear_cross_entropy import fused_linear_cross_entropy
        loss_impls.append(("kernels", lambda: fused_linear_cross_entropy(h, head, labels, reduction="sum").backward()))
    for impl, fn in loss_impls:
        rest = max(timed(fn, iters) - gemms, gemms * 0.02)
        out["op_gbps"][f"loss/{impl}"] = round(n_tok * speed.loss_bytes(cfg, c, impl) / rest / 1e9, 2)
    del h, head, labels

    # ---- AdamW over a parameter of 2^28 elements (2^22 on a CPU), its gradient clipped
    numel = 2 ** 28 if gpu else 2 ** 22
    pdtype = torch.bfloat16 if cfg.precision.params == "bf16" else torch.float32
    p = torch.zeros(numel, device=device, dtype=pdtype, requires_grad=True)
    p.grad = torch.randn(numel, device=device, dtype=pdtype)
    from trainer.optim import TritonAdamW
    optims = [("eager", torch.optim.AdamW([p], lr=1e-4, fused=gpu))]
    if gpu:
        optims.append(("kernels", TritonAdamW([p], lr=1e-4)))
    for impl, opt in optims:
        def step():
            torch.nn.utils.clip_grad_norm_([p], 1.0, foreach=True)
            opt.step()
        out["op_gbps"][f"adamw/{impl}"] = round(speed.optimizer_bytes(cfg, numel) / timed(step, iters) / 1e9, 2)
    del p

    # ---- HBM copy and the host's launch time
    big = torch.empty(2 ** 28 if gpu else 2 ** 24, device=device, dtype=torch.uint8)
    out["hbm_gbps"] = round(2 * big.numel() / timed(lambda: big.clone(), iters) / 1e9, 1)
    small = torch.zeros(16, device=device)
    n_launch = 2000

    def launches():
        for _ in range(n_launch):
            small.add_(1)
    if gpu:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    launches()
    host = (time.perf_counter() - t0) / n_launch
    out["launch_us"] = round(host * 1e6, 2)
    say(f"HBM copy {out['hbm_gbps']} GB/s; launch {out['launch_us']} us")
    return out


def main(argv=None) -> int:
    from trainer import flags
    from trainer.hf import load_config

    p = argparse.ArgumentParser(prog="python -m benchmarks.rates", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", default="")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    cfg = load_config(args.config or None, flags.overrides(args.set))
    result = measure(cfg, args.quick, say=lambda text: print(text, file=sys.stderr, flush=True))
    text = json.dumps(result)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
