"""Training throughput of Anvil's trainer against transformers (+ Liger-Kernel), same machine.

    python -m benchmarks.train_throughput [--config configs/llama3_1b.yaml] [--batch 4]
        [--seq 4096] [--steps 12] [--variants hf_liger,eager,compile,kernels,compile_kernels]
        [--out DIR] [--json]

Every variant runs in a fresh process. Anvil's variants are the real trainer
(`python -m trainer`, synthetic tokens, log interval 1), read back from its
metrics.jsonl; the reference variants (hf, hf_liger) are transformers'
LlamaForCausalLM with SDPA attention (Liger: apply_liger_kernel_to_llama with
RoPE, RMSNorm, SwiGLU and fused linear cross-entropy), bf16 weights, fused
AdamW. Reported: medians over steps 4..steps of tokens/s and step time, MFU with
torchtitan's FLOP count against --peak-tflops, and peak allocated GPU memory
(whole process: weights, optimizer state and activations) over those steps.

Variant names: hf, hf_liger, and for Anvil any of eager|compile|kernels|compile_kernels,
optionally suffixed _fp32 (fp32 master weights + bf16 autocast instead of bf16 weights).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_VARIANTS = "hf_liger,eager,compile,kernels,compile_kernels"
FIRST_MEASURED_STEP = 4
GIB = 1024 ** 3


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(REPO / "configs" / "llama3_1b.yaml"))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--variants", default=DEFAULT_VARIANTS)
    p.add_argument("--peak-tflops", type=float,
                   default=float(os.environ.get("ANVIL_GPU_PEAK_TFLOPS") or 989.0),
                   help="bf16 dense peak of one GPU (MFU denominator; H100/H200 SXM: 989)")
    p.add_argument("--out", default="", help="directory for results.json and bench.log")
    p.add_argument("--run-root", default="", help="where the trainer's run dirs go (default: --out)")
    p.add_argument("--timeout", type=int, default=240, help="seconds per variant")
    p.add_argument("--budget", type=int, default=0, help="skip variants once this many seconds passed")
    p.add_argument("--json", action="store_true")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _model_cfg(args):
    from trainer.config import load
    return load(args.config, [f"data.seq_len={args.seq}"]).model


# --------------------------------------------------------------------------- reference (HF)

def run_hf(args, liger: bool) -> dict:
    """transformers LlamaForCausalLM training steps, in this process."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.model import flops_per_token, hf_config

    cfg = _model_cfg(args)
    if liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True,
                                    fused_linear_cross_entropy=True, cross_entropy=False)
    hf_cfg = {k: v for k, v in hf_config(cfg).items()
              if k not in ("architectures", "model_type", "torch_dtype")}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**hf_cfg, attn_implementation="sdpa"))
    model.to(torch.bfloat16).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device.type == "cuda")
    n_params = sum(p.numel() for p in model.parameters())
    fpt = flops_per_token(cfg, n_params if cfg.tie_embeddings else
                          n_params - model.model.embed_tokens.weight.numel(), args.seq)
    gen = torch.Generator().manual_seed(0)
    times, peaks = [], []
    for step in range(1, args.steps + 1):
        x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=gen).to(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_value = loss.item()  # sync
        times.append(time.perf_counter() - start)
        peaks.append(torch.cuda.max_memory_allocated() / GIB if device.type == "cuda" else None)
        print(f"step {step} loss {loss_value:.4f} {times[-1] * 1000:.0f} ms", flush=True)
    steady = slice(FIRST_MEASURED_STEP - 1, None)
    step_s = statistics.median(times[steady])
    tps = args.batch * args.seq / step_s
    mem = [m for m in peaks[steady] if m is not None]
    return {"tokens_per_s": tps, "step_time_s": step_s, "mfu": tps * fpt / (args.peak_tflops * 1e12),
            "tflops": tps * fpt / 1e12, "peak_mem_gib": max(mem) if mem else None,
            "params": n_params, "flops_per_token": fpt}


# --------------------------------------------------------------------------- Anvil

def run_anvil(args, variant: str, out: Path, env: dict) -> dict:
    """The real trainer on synthetic tokens; figures read back from its metrics.jsonl."""
    base = variant.removesuffix("_fp32")
    run_dir = Path(args.run_root or out) / f"run_{variant}"
    sets = ["data.path=synthetic", f"data.batch_size={args.batch}", f"data.seq_len={args.seq}",
            "data.grad_accum=1", f"train.steps={args.steps}", "train.log_interval=1",
            "train.val_batches=0", "checkpoint.interval=0", "checkpoint.save_final=false",
            "logging.progress=false", "logging.tensorboard=false", "precision.compute=bf16",
            f"precision.params={'fp32' if variant.endswith('_fp32') else 'bf16'}"]
    argv = [sys.executable, "-m", "trainer", "--config", args.config, "--run-dir", str(run_dir)]
    for item in sets:
        argv += ["--set", item]
    argv += {"eager": [], "compile": ["--compile"], "kernels": ["--kernels"],
             "compile_kernels": ["--compile", "--kernels"]}[base]
    code = _stream(argv, env, args.timeout, out / "bench.log", variant)
    if code != 0:
        raise RuntimeError(f"trainer exited with {code}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in records if r["kind"] == "train" and r["step"] >= FIRST_MEASURED_STEP]
    summary = json.loads((run_dir / "summary.json").read_text())
    step_s = statistics.median(r["step_time_s"] for r in steady)
    tps = args.batch * args.seq / step_s
    fpt = summary["flops_per_token"]
    mem = [r["gpu_mem_gib"] for r in steady if r.get("gpu_mem_gib") is not None]
    return {"tokens_per_s": tps, "step_time_s": step_s, "mfu": tps * fpt / (args.peak_tflops * 1e12),
            "tflops": tps * fpt / 1e12, "peak_mem_gib": max(mem) if mem else None,
            "params": summary["params"], "flops_per_token": fpt,
            "final_loss": summary["final_loss"]}


# --------------------------------------------------------------------------- where the time goes

CATEGORIES = [  # (category, substrings of CUDA kernel names), first match wins
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90_", "matmul")),
    ("loss (LM head CE)", ("cross_entropy", "flce", "logsumexp", "nll", "_ce_")),
    ("rms_norm", ("rms",)),
    ("rope", ("rope", "rotary")),
    ("swiglu", ("swiglu", "silu")),
    ("optimizer", ("adam", "multi_tensor")),
]


def profile_anvil(args) -> dict:
    """CUDA kernel time per step of the trainer's model (variant by flags), by category."""
    import logging

    import torch

    from trainer import distributed, optim, train
    from trainer.config import load
    from trainer.data import TokenLoader

    sets = ["data.path=synthetic", f"data.batch_size={args.batch}", f"data.seq_len={args.seq}",
            "precision.compute=bf16", "precision.params=bf16", "train.kernels=true"]
    cfg = load(args.config, sets)
    info = distributed.init(cfg)
    model, train_model = train.build_model(cfg, info, logging.getLogger("profile"))
    opt = optim.build_optimizer(model, cfg.optim, info.device)
    loader = TokenLoader("synthetic", "train", args.seq, args.batch, 0, 1, 0,
                         vocab_size=cfg.model.vocab_size)

    def step():
        x, y = (t.to(info.device) for t in next(loader))
        (train_model(x, y) / y.numel()).backward()
        optim.clip_grad_norm(model.parameters(), 1.0, opt)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    steps = 3
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    per_cat: dict[str, float] = {}
    top = []
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", 0) or 0
        if (us <= 0 or event.device_type != torch.autograd.DeviceType.CUDA
                or event.key.startswith(("Optimizer.", "ProfilerStep"))):
            continue  # CPU ops and GPU-side annotation ranges repeat their kernels' time
        name = event.key.lower()
        cat = next((c for c, keys in CATEGORIES if any(k in name for k in keys)), "other")
        per_cat[cat] = per_cat.get(cat, 0.0) + us / 1000 / steps
        top.append((us / 1000 / steps, cat, event.key[:90]))
    top.sort(reverse=True)
    # Which framework op launched the time (e.g. which adds and copies): aten ops by the
    # device time of the kernels they launched themselves, with their input shapes.
    ops = []
    for event in prof.key_averages(group_by_input_shape=True):
        us = getattr(event, "self_device_time_total", 0) or 0
        if us > 0 and event.device_type == torch.autograd.DeviceType.CPU and "::" in event.key:
            ops.append((round(us / 1000 / steps, 3), event.count // steps, event.key[:40],
                        str(event.input_shapes)[:110]))
    ops.sort(reverse=True)
    return {"ms_per_step_by_category": dict(sorted(per_cat.items(), key=lambda kv: -kv[1])),
            "top_ops": ops[:25],
            "gpu_ms_per_step": sum(per_cat.values()), "top_kernels": top[:15]}


def attention_backends(args) -> dict:
    """fwd+bwd ms of causal GQA attention at the model's shape, per SDPA backend."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    cfg = _model_cfg(args)
    b, t, h, kv, d = args.batch, args.seq, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, kv, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, kv, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = {}
    for label, backend, gqa in [("flash (enable_gqa)", SDPBackend.FLASH_ATTENTION, True),
                                ("cudnn (enable_gqa)", SDPBackend.CUDNN_ATTENTION, True),
                                ("cudnn (repeat kv)", SDPBackend.CUDNN_ATTENTION, False),
                                ("efficient (repeat kv)", SDPBackend.EFFICIENT_ATTENTION, False)]:
        def run():
            kk, vv = (k, v) if gqa else (k.repeat_interleave(h // kv, 1), v.repeat_interleave(h // kv, 1))
            with sdpa_kernel(backend):
                y = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=gqa)
            y.sum().backward()
        try:
            out[label] = round(do_bench(run, warmup=5, rep=50), 3)
        except Exception as exc:
            out[label] = f"unsupported: {str(exc).splitlines()[0][:80]}"
    return {"attention_fwd_bwd_ms_per_layer": out}


# --------------------------------------------------------------------------- driver

def _stream(argv, env, timeout, log_path: Path, label: str) -> int:
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"\n===== {label}: {' '.join(argv)}\n")
        log.flush()
        try:
            return subprocess.run(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            log.write(f"===== {label}: timed out after {timeout} s\n")
            return 124


def _versions() -> dict:
    import torch
    out = {"torch": torch.__version__, "python": sys.version.split()[0],
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    for name in ("triton", "transformers", "liger_kernel"):
        try:
            from importlib.metadata import version
            out[name] = version(name.replace("_", "-"))
        except Exception:
            out[name] = None
    return out


def table(results: list[dict]) -> str:
    from tabulate import tabulate
    anchor = next((r for r in results if r["variant"] == "hf_liger" and r.get("tokens_per_s")), None)
    rows = []
    for r in results:
        if r.get("error"):
            rows.append([r["variant"], "failed", "", "", "", "", r["error"][:60]])
            continue
        rel = f"{r['tokens_per_s'] / anchor['tokens_per_s']:.2f}x" if anchor else ""
        mem = f"{r['peak_mem_gib']:.1f}" if r.get("peak_mem_gib") is not None else "n/a"
        rows.append([r["variant"], f"{r['tokens_per_s']:,.0f}", f"{r['step_time_s'] * 1000:.0f}",
                     f"{r['tflops']:.0f}", f"{r['mfu']:.1%}", mem, rel])
    return tabulate(rows, headers=["variant", "tokens/s", "ms/step", "TFLOP/s", "MFU",
                                   "peak GiB", "vs hf_liger"], tablefmt="github")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker in ("profile", "attention"):
        result = profile_anvil(args) if args.worker == "profile" else attention_backends(args)
        print(json.dumps(result, indent=1), flush=True)
        return 0
    if args.worker:
        result = run_hf(args, liger=args.worker == "hf_liger")
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    out = Path(args.out or f"/tmp/train_throughput_{int(time.time())}")
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "ANVIL_GPU_PEAK_TFLOPS": str(args.peak_tflops), "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    started = time.time()
    results = []
    for variant in [v.strip() for v in args.variants.split(",") if v.strip()]:
        if args.budget and time.time() - started > args.budget:
            results.append({"variant": variant, "error": "skipped: time budget spent"})
            continue
        t0 = time.time()
        try:
            if variant in ("hf", "hf_liger"):
                argv_w = [sys.executable, "-m", "benchmarks.train_throughput", "--worker", variant,
                          "--config", args.config, "--batch", str(args.batch), "--seq", str(args.seq),
                          "--steps", str(args.steps), "--peak-tflops", str(args.peak_tflops)]
                code = _stream(argv_w, env, args.timeout, out / "bench.log", variant)
                own = (out / "bench.log").read_text().rsplit(f"===== {variant}: ", 1)[-1]
                lines = [line for line in own.splitlines() if line.startswith("RESULT ")]
                if code != 0 or not lines:
                    raise RuntimeError(f"worker exited with {code}")
                result = json.loads(lines[-1][len("RESULT "):])
            else:
                result = run_anvil(args, variant, out, env)
        except Exception as exc:  # one failing variant must not lose the others
            result = {"error": f"{type(exc).__name__}: {exc}"}
        result.update(variant=variant, wall_s=round(time.time() - t0, 1))
        results.append(result)
        print(json.dumps(result), flush=True)
        (out / "results.json").write_text(json.dumps(
            {"results": results, "versions": _versions(), "batch": args.batch, "seq": args.seq,
             "steps": f"{FIRST_MEASURED_STEP}-{args.steps} medians", "config": args.config,
             "date": time.strftime("%Y-%m-%d")}, indent=2))
    print(json.dumps({"versions": _versions()}) if args.json else table(results))
    return 0 if all(not r.get("error") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
