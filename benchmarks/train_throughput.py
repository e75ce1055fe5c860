"""Training throughput of Anvil's trainer against torchtitan and transformers (+ Liger-Kernel).

    python -m benchmarks.train_throughput [--config configs/llama3_1b.yaml] [--batch 4]
        [--seq 4096] [--steps 12] [--nproc 1] [--profile-steps 2]
        [--variants hf_liger,titan_eager,titan_compile,kernels,compile_kernels]
        [--out DIR] [--json]
    python -m benchmarks.train_throughput --quality --config configs/llama3_1b.yaml
        --data data/stdlib_bpe8k --batch 8 --seq 1024 --steps 300
        --variants compile_kernels_fp32,compile_kernels_fp32_fp8,compile_kernels_fp32_fp8rw

Every variant runs in fresh processes (--nproc of them, one per GPU, through
torch.distributed.run when more than one). Anvil's variants are the real
trainer (`python -m trainer`, synthetic tokens, log interval 1), read back from
its metrics.jsonl. torchtitan's are its own Trainer and model for the config's
family (torchtitan.train.Trainer; the llama3 train spec, or deepseek_v3 and
qwen3 for the mixture-of-experts families: benchmarks/moe_throughput.py) with
the same shape from --config, the same synthetic token stream (Anvil's SyntheticLoader), local
batch, sequence length, precision, FSDP2, activation checkpointing (its
per-op selective policy where Anvil's config says selective) and compile
setting; tied embeddings are tied on one GPU as in Anvil. The reference
variants (hf, hf_liger) are transformers' LlamaForCausalLM with SDPA attention
(Liger: apply_liger_kernel_to_llama with RoPE, RMSNorm, SwiGLU and fused linear
cross-entropy), bf16 weights, fused AdamW, one GPU. Reported: medians over
steps 4..steps of tokens/s per GPU and step time, MFU with one FLOP count for
every variant (torchtitan's formula on Anvil's parameter count of the shape)
against --peak-tflops, and peak allocated GPU memory of rank 0 (weights,
optimizer state and activations) over those steps. With --profile-steps N, N
more steps after the measured window run under torch.profiler and rank 0's
trace is split into matmul, attention, exposed communication and the rest
(trainer.profiling.breakdown: the table `inv profile.train` prints, in the
columns of BENCHMARKS.md).

Variant names:
  hf, hf_liger
  Anvil:      {eager|compile|kernels|compile_kernels}[_fp32][_fp8|_fp8rw|_fp8ref][_f8head][_f8act[<MiB>]]
  torchtitan: titan_{eager|compile}[_fp32][_fp8|_fp8rw]
_fp32: fp32 master weights (+ bf16 autocast, or FSDP2's bf16 mixed precision)
instead of bf16 weights; _fp8 / _fp8rw: FP8 linear layers, torchao float8
tensorwise / rowwise (Anvil: precision.fp8; torchtitan: its float8 converter,
with float8 all-gather and precomputed scales under FSDP for tensorwise; the
output head stays bf16 in both). With --kernels and tensorwise, RMSNorm and
SwiGLU write the FP8 linears' inputs as float8 themselves; _fp8ref is the same
run with torchao casting them (precision.fp8_fused=false), the reference path.
_f8head (Anvil --kernels with FP8): the LM head's logits and hidden-gradient GEMMs
in float8 inside the fused loss (precision.fp8_lm_head).
_f8act (compiled Anvil variants): saved activations of 100 MiB or more kept in
float8 until backward (train.float8_activations); _f8act<N>, those of N MiB or more
(train.float8_activations_min_mib=N), e.g. _f8act32.
_docs (Anvil): attention inside documents (data.document_mask) through FlexAttention; _docsdpa,
through SDPA's additive mask (train.attention=sdpa). The synthetic rows then hold documents of
--seq / 4 tokens on average. `--worker attention` also times the two kernels on one such mask.

--quality trains each variant on a real prepared dataset (--data) for --steps
and compares every loss curve with the first variant's: final and mean loss
differences, against --tolerance.

Why one module of this size: every variant (Anvil, HF + Liger, torchtitan; bf16, FP8; eager,
compile) must run the same measurement (process per variant, step window, FLOP count, peak memory,
profile split) so the ratios are fair; the variants are small functions over that one harness.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from core import checkout, names, runfiles

REPO = checkout.ROOT
DEFAULT_VARIANTS = "hf_liger,titan_eager,titan_compile,eager,compile,kernels,compile_kernels"
FIRST_MEASURED_STEP = 4
GIB = 1024 ** 3
OUR_BASES = ("eager", "compile", "kernels", "compile_kernels")
TITAN_BASES = ("titan_eager", "titan_compile")
FP8_SUFFIXES = {"fp8": "tensorwise", "fp8rw": "rowwise", "fp8ref": "tensorwise"}
# Kept off on these machines whatever the caller's environment says (NVLink multicast can
# take a shared host's GPUs out of service).
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(REPO / names.CONFIGS_DIR / "llama3_1b.yaml"))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--variants", default=DEFAULT_VARIANTS)
    p.add_argument("--nproc", type=int, default=1, help="GPUs (processes) per variant")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="profile this many steps after the measured ones; split rank 0's GPU time")
    p.add_argument("--quality", action="store_true",
                   help="loss curves on real data (--data) instead of throughput")
    p.add_argument("--data", default="", help="--quality: a prepared dataset (inv data.prepare)")
    p.add_argument("--tolerance", type=float, default=0.01,
                   help="--quality: allowed relative difference of the mean loss over the last "
                        "50 steps and of the final validation loss against the first variant")
    p.add_argument("--sets", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config overrides for Anvil's trainer (and the shape torchtitan copies)")
    p.add_argument("--peak-tflops", type=float,
                   default=float(os.environ.get(names.GPU_PEAK_TFLOPS) or 989.0),
                   help="bf16 dense peak of one GPU (MFU denominator; H100/H200 SXM: 989)")
    p.add_argument("--out", default="", help="directory for results.json and bench.log")
    p.add_argument("--run-root", default="", help="where the trainers' run dirs go (default: --out)")
    p.add_argument("--timeout", type=int, default=240, help="seconds per variant")
    p.add_argument("--budget", type=int, default=0, help="skip variants once this many seconds passed")
    p.add_argument("--json", action="store_true")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _train_cfg(args):
    from trainer.config import load
    # train.compile: the sets may hold settings that need it (the variants add --compile themselves)
    return load(args.config, [f"data.seq_len={args.seq}", *args.sets, "train.compile=true"])


def _model_cfg(args):
    return _train_cfg(args).model


def parse_variant(name: str) -> dict:
    """'compile_kernels_fp32_fp8' -> {family: anvil, base: compile_kernels, compile: True,
    kernels: True, params: fp32, fp8: tensorwise}; ValueError for an unknown name."""
    if name in ("hf", "hf_liger"):
        return {"family": "hf", "base": name, "compile": False, "kernels": name == "hf_liger",
                "params": "bf16", "fp8": "off", "fp8_fused": True, "f8act": False, "f8head": False, "docs": None}
    bases = sorted(OUR_BASES + TITAN_BASES, key=len, reverse=True)
    base = next((b for b in bases if name == b or name.startswith(b + "_")), None)
    if base is None:
        raise ValueError(f"unknown variant {name!r}")
    params, fp8, fused, f8act, f8head, docs = "bf16", "off", True, False, False, None
    family = "titan" if base.startswith("titan_") else "anvil"
    for token in filter(None, name[len(base):].split("_")):
        if f8act:
            raise ValueError(f"variant {name!r}: _f8act comes last")
        if token in ("docs", "docsdpa") and family == "anvil" and docs is None:
            docs = "flex" if token == "docs" else "sdpa"
            continue
        mib = token[len("f8act"):] if token.startswith("f8act") else None
        if mib is not None and (mib == "" or mib.isdigit() and int(mib) > 0) and family == "anvil" \
                and "compile" in base:
            f8act = int(mib) if mib else True   # _f8act32: saved activations of 32 MiB or more
        elif token == "f8head" and not f8head and fp8 != "off" and base.endswith("kernels"):
            f8head = True
        elif token == "fp32" and params == "bf16" and fp8 == "off":
            params = "fp32"
        elif token in FP8_SUFFIXES and fp8 == "off" and not f8head and not (token == "fp8ref" and family == "titan"):
            fp8, fused = FP8_SUFFIXES[token], token != "fp8ref"
        else:
            raise ValueError(f"variant {name!r}: unexpected suffix {token!r} "
                             "(allowed, in this order: _fp32, then _fp8, _fp8rw or, Anvil only, _fp8ref, then, "
                             "Anvil --kernels with FP8 only, _f8head, then, compiled Anvil only, _f8act or "
                             "_f8act<MiB>; Anvil's _docs or _docsdpa anywhere before _f8act)")
    return {"family": family, "base": base, "compile": "compile" in base,
            "kernels": base.endswith("kernels"), "params": params, "fp8": fp8, "fp8_fused": fused, "f8act": f8act,
            "f8head": f8head, "docs": docs}


def flops_for_shape(cfg) -> tuple[int, int]:
    """(parameters, FLOPs per token) of Anvil's model of this shape: one count for every variant."""
    import torch

    from trainer.models import Transformer, flops_per_token
    with torch.device("meta"):
        model = Transformer(cfg.model)
    return model.num_params(), flops_per_token(cfg.model, model.num_params(exclude_embedding=True),
                                               cfg.data.seq_len)


# --------------------------------------------------------------------------- measuring

def _summarise(args, times: list[float], peaks: list, fpt: int, n_params: int, world: int = 1) -> dict:
    """Medians over steps FIRST_MEASURED_STEP..args.steps (1-based) of per-step wall times."""
    steady = slice(FIRST_MEASURED_STEP - 1, args.steps)
    step_s = statistics.median(times[steady])
    tps = args.batch * args.seq / step_s  # per GPU
    mem = [m for m in peaks[steady] if m is not None]
    return {"tokens_per_s": tps, "step_time_s": step_s, "mfu": tps * fpt / (args.peak_tflops * 1e12),
            "tflops": tps * fpt / 1e12, "peak_mem_gib": max(mem) if mem else None,
            "params": n_params, "flops_per_token": fpt, "world_size": world,
            "step_times_s": [round(t, 5) for t in times]}


class _Profiled:
    """torch.profiler around steps steps+1 .. steps+profile_steps of rank 0 (as Anvil's
    StepProfiler: synchronised at both ends, the window's wall time kept); the trace goes to `path`."""

    def __init__(self, args, path: Path, rank: int = 0):
        self.first, self.last = args.steps + 1, args.steps + args.profile_steps
        self.path, self.prof, self.rank = path, None, rank
        self.started, self.wall_ms = 0.0, None

    def before(self, step: int) -> None:
        if step == self.first and self.prof is None and self.rank == 0:
            import torch
            from torch.profiler import ProfilerActivity, profile
            torch.cuda.synchronize()
            self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self.prof.__enter__()
            self.started = time.perf_counter()

    def after(self, step: int) -> None:
        if step == self.last and self.prof is not None:
            import torch
            torch.cuda.synchronize()
            self.wall_ms = (time.perf_counter() - self.started) * 1e3
            self.prof.__exit__(None, None, None)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.prof.export_chrome_trace(str(self.path))
            self.prof = None


# --------------------------------------------------------------------------- reference (HF)

def run_hf(args, liger: bool, out: Path) -> dict:
    """transformers LlamaForCausalLM training steps, in this process."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.hf.config import to_hf as hf_config

    cfg = _train_cfg(args)
    if liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True,
                                    fused_linear_cross_entropy=True, cross_entropy=False)
    hf_cfg = {k: v for k, v in hf_config(cfg.model).items()
              if k not in ("architectures", "model_type", "torch_dtype")}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**hf_cfg, attn_implementation="sdpa"))
    model.to(torch.bfloat16).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device.type == "cuda")
    n_params, fpt = flops_for_shape(cfg)
    gen = torch.Generator().manual_seed(0)
    prof = _Profiled(args, out / f"trace_{'hf_liger' if liger else 'hf'}.json")
    times, peaks = [], []
    for step in range(1, args.steps + args.profile_steps + 1):
        x = torch.randint(0, cfg.model.vocab_size, (args.batch, args.seq), generator=gen).to(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
        prof.before(step)
        start = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_value = loss.item()  # sync
        times.append(time.perf_counter() - start)
        peaks.append(torch.cuda.max_memory_allocated() / GIB if device.type == "cuda" else None)
        prof.after(step)
        print(f"step {step} loss {loss_value:.4f} {times[-1] * 1000:.0f} ms", flush=True)
    result = _summarise(args, times, peaks, fpt, n_params)
    if args.profile_steps:
        result.update(trace=str(prof.path), profile_wall_ms=prof.wall_ms)
    return result


# --------------------------------------------------------------------------- Anvil

def _launcher(args) -> list[str]:
    """argv prefix that starts --nproc ranks (torchrun's environment: RANK, LOCAL_RANK, ...)."""
    if args.nproc <= 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={args.nproc}"]


def anvil_argv(args, variant: str, run_dir: Path, steps: int | None = None) -> list[str]:
    spec = parse_variant(variant)
    total = args.steps + args.profile_steps if steps is None else steps
    sets = ["data.path=synthetic", f"data.batch_size={args.batch}", f"data.seq_len={args.seq}",
            "data.grad_accum=1", f"train.steps={total}", "train.log_interval=1",
            "train.val_batches=0", "checkpoint.interval=0", "checkpoint.save_final=false",
            "logging.progress=false", "logging.tensorboard=false", "precision.compute=bf16",
            f"precision.params={spec['params']}", *args.sets]
    if spec["fp8"] != "off":  # (a bare `off` is YAML 1.1's false: leave the config's default)
        sets.append(f"precision.fp8={spec['fp8']}")
    if not spec["fp8_fused"]:
        sets.append("precision.fp8_fused=false")
    if spec["f8act"]:
        sets.append("train.float8_activations=true")
        if spec["f8act"] is not True:
            sets.append(f"train.float8_activations_min_mib={spec['f8act']}")
    if spec["f8head"]:
        sets.append("precision.fp8_lm_head=true")
    # causal over the row unless _docs: the same attention as the torchtitan and transformers variants
    sets += ["data.document_mask=true", f"train.attention={spec['docs']}"] if spec["docs"] else \
        ["data.document_mask=false"]
    argv = [*_launcher(args), "-m", "trainer", "--config", args.config, "--run-dir", str(run_dir)]
    for item in sets:
        argv += ["--set", item]
    return argv + ["--compile"] * spec["compile"] + ["--kernels"] * spec["kernels"]


def run_anvil(args, variant: str, out: Path, env: dict) -> dict:
    """The real trainer on synthetic tokens; figures read back from its metrics.jsonl."""
    run_dir = Path(args.run_root or out) / f"run_{variant}"
    env = dict(env)
    if args.profile_steps:
        # StepProfiler counts completed steps: "a:b" records steps a .. b-1
        env[names.PROFILE_STEPS] = f"{args.steps + 1}:{args.steps + args.profile_steps + 1}"
    code = _stream(anvil_argv(args, variant, run_dir), env, args.timeout, out / "bench.log", variant)
    if code != 0:
        reason = failure_reason(out / "bench.log", variant, code, args.timeout)
        raise RuntimeError(f"trainer exited with {code}: {reason}")
    records = runfiles.metrics_records(run_dir)
    train = sorted((r for r in records if r["kind"] == "train"), key=lambda r: r["step"])
    summary = runfiles.read_summary(run_dir)
    n_params, fpt = flops_for_shape(_train_cfg(args))
    result = _summarise(args, [r["step_time_s"] for r in train], [r.get("gpu_mem_gib") for r in train],
                        fpt, n_params, summary.get("world_size", args.nproc))
    result["final_loss"] = summary.get("final_loss")
    trace = run_dir / names.PROFILE_DIR / "rank0.trace.json"
    if args.profile_steps and trace.is_file():
        window = json.loads((run_dir / names.PROFILE_DIR / "rank0.ops.json").read_text())
        result.update(trace=str(trace), profile_wall_ms=window.get("wall_ms"))
    return result


# --------------------------------------------------------------------------- torchtitan

def _stub_unused_imports() -> list[str]:
    """torchtitan imports at module level two packages these runs never use: HF `datasets` (its C4
    loaders; these runs read Anvil's synthetic stream) and TensorBoard (torch.utils.tensorboard's
    SummaryWriter; its TensorBoard logging stays off). Where one does not import (not installed, or a
    pyarrow `datasets` does not accept), a stub with the imported names stands in, so neither has to
    travel to a GPU machine. Returns the names stubbed."""
    import importlib
    import types

    def unavailable(*_a, **_k):
        raise RuntimeError("not importable here (stubbed by the benchmark)")

    stubs = {   # package: {module: the names torchtitan imports from it}
        "datasets": {"datasets": {"Dataset": type("Unavailable", (), {}), "load_dataset": unavailable,
                                  "IterableDataset": type("Unavailable", (), {})},
                     "datasets.distributed": {"split_dataset_by_node": unavailable}},
        "torch.utils.tensorboard": {"torch.utils.tensorboard": {"SummaryWriter": unavailable}},
    }
    stubbed = []
    for package, modules in stubs.items():
        try:
            importlib.import_module(package)
            continue
        except Exception:
            stubbed.append(package)
        for name, attrs in modules.items():
            module = types.ModuleType(name)
            module.__dict__.update(attrs)
            sys.modules[name] = module
    return stubbed


#: torchtitan's package (under torchtitan.models) for each of Anvil's model families
TITAN_PACKAGES = {"llama": "llama3", "deepseek_v2": "deepseek_v3", "deepseek_v3": "deepseek_v3",
                  "qwen3_moe": "qwen3"}


def titan_model_args(model_cfg, seq_len: int):
    """torchtitan's model arguments with exactly Anvil's shape: its llama3 for llama; its deepseek_v3 and
    qwen3 for the mixture-of-experts families."""
    if model_cfg.family == "llama":
        return titan_llama_args(model_cfg, seq_len)
    return titan_moe_args(model_cfg, seq_len)


def titan_moe_args(model_cfg, seq_len: int):
    """torchtitan 0.2.2's model arguments with exactly Anvil's shape (the mapping in benchmarks/moe_throughput.py's docstring)."""
    from torchtitan.models.moe import MoEArgs

    e = model_cfg.moe
    moe_args = MoEArgs(
        num_experts=e.n_routed_experts, num_shared_experts=e.n_shared_experts, top_k=e.top_k,
        score_func=e.score_func, route_norm=e.norm_topk_prob, route_scale=e.route_scale,
        num_expert_groups=e.n_group if e.n_group > 1 else None,
        num_limited_groups=e.topk_group if e.n_group > 1 else None,
        load_balance_coeff=e.bias_update_speed or None, score_before_experts=False, use_grouped_mm=True)
    if model_cfg.family == "qwen3_moe":
        from torchtitan.models.qwen3 import Qwen3ModelArgs
        if e.first_k_dense:
            raise ValueError(f"model.moe.first_k_dense {e.first_k_dense}: torchtitan's Qwen3 has experts in "
                             "every layer")
        return Qwen3ModelArgs(
            dim=model_cfg.dim, n_layers=model_cfg.n_layers, n_heads=model_cfg.n_heads,
            n_kv_heads=model_cfg.n_kv_heads, vocab_size=model_cfg.vocab_size, head_dim=model_cfg.head_dim,
            hidden_dim=model_cfg.ffn_dim, norm_eps=model_cfg.norm_eps, rope_theta=model_cfg.rope_theta,
            qk_norm=True, max_seq_len=seq_len, attn_type="sdpa", attn_mask_type="causal",
            enable_weight_tying=model_cfg.tie_embeddings, moe_enabled=True, moe_inter_dim=e.ffn_dim,
            moe_args=moe_args)
    if model_cfg.family not in ("deepseek_v2", "deepseek_v3"):
        raise ValueError(f"model.family {model_cfg.family!r}: no torchtitan mixture-of-experts model for it")
    from torchtitan.models.deepseek_v3 import DeepSeekV3ModelArgs
    a, rs = model_cfg.mla, model_cfg.rope_scaling
    yarn = ({"original_seq_len": rs.original_max_position_embeddings, "rope_factor": rs.factor,
             "beta_fast": rs.beta_fast, "beta_slow": rs.beta_slow, "mscale": rs.mscale_all_dim or 1.0}
            if rs is not None else {"original_seq_len": seq_len, "rope_factor": 1.0, "mscale": 1.0})
    margs = DeepSeekV3ModelArgs(
        max_seq_len=seq_len, vocab_size=model_cfg.vocab_size, dim=model_cfg.dim, inter_dim=model_cfg.ffn_dim,
        moe_inter_dim=e.ffn_dim, n_layers=model_cfg.n_layers, n_dense_layers=e.first_k_dense,
        n_heads=model_cfg.n_heads, norm_eps=model_cfg.norm_eps, moe_args=moe_args,
        q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank, qk_nope_head_dim=a.qk_nope_head_dim,
        qk_rope_head_dim=a.qk_rope_head_dim, v_head_dim=a.v_head_dim, attn_type="sdpa", attn_mask_type="causal",
        rope_theta=model_cfg.rope_theta, **yarn)
    margs.moe_impl = "standard"   # MoE without DeepEP: the Trainer sets it from the job config, a bare build needs it
    return margs

def titan_train_spec(family: str):
    """torchtitan's TrainSpec for the family's model (stubbing what its imports need and these runs do not)."""
    import importlib
    _stub_unused_imports()
    return importlib.import_module(f"torchtitan.models.{TITAN_PACKAGES[family]}").get_train_spec()


def titan_param_count(model_cfg, seq_len: int) -> int:
    """Parameters of torchtitan's model of this shape, built on the meta device; a tied head counted once,
    as Anvil counts it."""
    import torch
    with torch.device("meta"):
        model = titan_train_spec(model_cfg.family).model_cls(titan_model_args(model_cfg, seq_len))
    n = sum(p.numel() for p in model.parameters())
    return n - model.output.weight.numel() if model_cfg.tie_embeddings else n


def titan_llama_args(model_cfg, seq_len: int):
    """torchtitan TransformerModelArgs with exactly Anvil's shape (FFN width, GQA, RoPE scaling)."""
    from torchtitan.models.llama3 import TransformerModelArgs
    from torchtitan.models.llama3.model.args import RoPEScalingArgs

    rs = model_cfg.rope_scaling
    # torchtitan's FFN width: multiple_of * ceil(int(multiplier * int(8 * dim / 3)) / multiple_of);
    # multiple_of = ffn_dim and a multiplier just under ffn_dim / int(8 dim / 3) give ffn_dim.
    base = int(2 * 4 * model_cfg.dim / 3)
    scaling = (RoPEScalingArgs(scaling_factor=rs.factor, low_freq_factor=rs.low_freq_factor,
                               high_freq_factor=rs.high_freq_factor,
                               original_max_position_embeddings=rs.original_max_position_embeddings)
               if rs is not None else  # factor 1: the scaling formula is the identity
               RoPEScalingArgs(scaling_factor=1.0, low_freq_factor=1.0, high_freq_factor=4.0))
    return TransformerModelArgs(
        dim=model_cfg.dim, n_layers=model_cfg.n_layers, n_heads=model_cfg.n_heads,
        n_kv_heads=model_cfg.n_kv_heads, vocab_size=model_cfg.vocab_size,
        multiple_of=model_cfg.ffn_dim, ffn_dim_multiplier=model_cfg.ffn_dim / base * (1 - 1e-9),
        norm_eps=model_cfg.norm_eps, rope_theta=model_cfg.rope_theta,
        rope_scaling_args=scaling, max_seq_len=seq_len)


def titan_spec_name(family: str) -> str:
    """The name run_titan registers its TrainSpec (torchtitan's model, Anvil's shape and data) under."""
    return f"anvil_{family}"


def titan_job_args(args, variant: str, dump: Path, tie: bool) -> list[str]:
    """torchtitan's command line (its JobConfig) for the variant, matching Anvil's settings."""
    spec = parse_variant(variant)
    cfg = _train_cfg(args)
    ac = cfg.train.activation_checkpoint
    argv = ["--job.dump_folder", str(dump), "--model.name", titan_spec_name(cfg.model.family), "--model.flavor",
            "tied" if tie else "anvil",
            "--training.local_batch_size", str(args.batch), "--training.seq_len", str(args.seq),
            "--training.steps", str(args.steps + args.profile_steps),
            "--training.max_norm", str(cfg.optim.grad_clip),
            "--training.dtype", "float32" if spec["params"] == "fp32" else "bfloat16",
            "--training.mixed_precision_param", "bfloat16",
            "--optimizer.name", "AdamW", "--optimizer.lr", str(cfg.optim.lr),
            "--optimizer.eps", str(cfg.optim.eps), "--optimizer.weight_decay", str(cfg.optim.weight_decay),
            "--optimizer.implementation", "fused",
            "--lr_scheduler.warmup_steps", "2",
            "--metrics.log_freq", "1", "--checkpoint.no-enable", "--validation.no-enable",
            "--parallelism.data_parallel_shard_degree", "-1",
            "--parallelism.fsdp_reshard_after_forward",
            "default" if cfg.parallel.reshard_after_forward else "never",
            "--activation_checkpoint.mode", {"none": "none", "selective": "selective",
                                             "selective_lean": "selective", "full": "full"}[ac]]
    if ac.startswith("selective"):   # its "op" policy recomputes what selective_lean does (k, o, up)
        argv += ["--activation_checkpoint.selective_ac_option", "op"]
    if spec["compile"]:
        argv += ["--compile.enable", "--compile.components", "model,loss"]
    if spec["fp8"] != "off":
        argv += ["--model.converters", "quantize.linear.float8",
                 "--quantize.linear.float8.filter_fqns", "output"]
        if spec["fp8"] == "rowwise":
            argv += ["--quantize.linear.float8.recipe_name", "rowwise"]
        else:
            argv += ["--quantize.linear.float8.enable_fsdp_float8_all_gather",
                     "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp"]
    return argv


def run_titan(args, variant: str, out: Path) -> dict | None:
    """One rank of torchtitan's Trainer (its model for the config's family, Anvil's shape and data); rank
    0 returns the result. Runs inside the process(es) _launcher started."""
    import dataclasses as dc

    import torch
    stubbed = _stub_unused_imports()
    import torchtitan
    import torchtitan.protocols.train_spec as ts
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger
    from torchtitan.train import Trainer

    from trainer.data import SyntheticLoader

    cfg = _train_cfg(args)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # Anvil ties the LM head to the embedding where the config says so; torchtitan's FSDP plan
    # shards the two in different units, so they are tied on one GPU only.
    tie = cfg.model.tie_embeddings and world == 1
    base = titan_train_spec(cfg.model.family)

    class TiedModel(base.model_cls):
        def init_weights(self, *a, **k):
            super().init_weights(*a, **k)
            self.output.weight = self.tok_embeddings.weight  # after to_empty(), which unties

    class Loader:
        """Anvil's synthetic token stream in torchtitan's (input dict, labels) form."""

        def __init__(self, dp_world_size, dp_rank, tokenizer=None, job_config=None, **_):
            self.inner = SyntheticLoader(cfg.model.vocab_size, seq_len=args.seq, batch_size=args.batch,
                                         rank=dp_rank, world_size=dp_world_size, seed=0)

        def __iter__(self):
            for x, y in self.inner:
                yield {"input": x}, y

        def state_dict(self):
            return self.inner.state_dict()

        def load_state_dict(self, state):
            self.inner.load_state_dict(state)

    margs = titan_model_args(cfg.model, args.seq)
    spec = dc.replace(base, model_cls=TiedModel if tie else base.model_cls,
                      model_args={"tied" if tie else "anvil": margs},
                      build_dataloader_fn=lambda **kw: Loader(**kw),
                      build_tokenizer_fn=None, build_validator_fn=None)
    if titan_spec_name(cfg.model.family) not in ts._extra_train_specs:
        ts.register_train_spec(titan_spec_name(cfg.model.family), spec)
    dump = Path(args.run_root or out) / f"titan_{variant}"   # torchtitan's run dir, beside Anvil's
    job = ConfigManager().parse_args(titan_job_args(args, variant, dump, tie))
    profiled = _Profiled(args, out / f"trace_{variant}.json", int(os.environ.get("RANK", "0")))
    times, peaks, seen = [], [], [0]

    class TimedTrainer(Trainer):
        def __init__(self, job_config):
            super().__init__(job_config)
            # torchtitan's metrics reset the peak-memory counter when they log (inside
            # train_step): read the step's peak just before that reset.
            monitor = self.metrics_processor.device_memory_monitor
            reset = monitor.reset_peak_stats

            def read_then_reset():
                seen[0] = max(seen[0], torch.cuda.max_memory_allocated())
                reset()
            monitor.reset_peak_stats = read_then_reset

        def train_step(self, data_iterator):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            seen[0] = 0
            profiled.before(self.step)
            start = time.perf_counter()
            super().train_step(data_iterator)   # logs every step: loss and grad norm .item()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            peaks.append(max(seen[0], torch.cuda.max_memory_allocated()) / GIB)
            profiled.after(self.step)

    init_logger()  # torchtitan's own per-step log lines (loss, memory, tps) into bench.log
    trainer = TimedTrainer(job)
    try:
        trainer.train()
    finally:
        trainer.close()
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if rank != 0:
        return None
    n_params, fpt = flops_for_shape(cfg)
    result = _summarise(args, times, peaks, fpt, n_params, world)
    result.update(torchtitan=getattr(torchtitan, "__version__", None), tied=tie,
                  stubbed_imports=stubbed, titan_params=sum(p.numel() for p in trainer.model_parts[0].parameters()))
    if args.profile_steps:
        result.update(trace=str(profiled.path), profile_wall_ms=profiled.wall_ms)
    return result


# --------------------------------------------------------------------------- where the time goes

def trace_breakdown(trace: str | Path | dict, steps: int, step_time_s: float | None = None,
                    wall_ms: float | None = None) -> dict:
    """The split of BENCHMARKS.md's tables (matmul, attention, communication all / exposed, other kernels,
    idle; everything else = the measured step less matmul, attention and exposed communication) of one rank's
    trace of `steps` steps: trainer.profiling's breakdown, the same one `inv profile.train` shows, with its
    category rows, largest kernels and idle gaps beside."""
    from trainer.profiling.breakdown import breakdown, legacy_split

    bd = breakdown(trace, steps, wall_ms)
    if "error" in bd:
        return bd
    out = legacy_split(bd, step_time_s)
    out.update(categories={row["category"]: row["ms"] for row in bd["rows"]}, profile_step_ms=bd["step_ms"],
               top_kernels=bd["top_kernels"], top_by_category=bd["top_by_category"], idle_gaps=bd["idle_gaps"])
    return out


# --------------------------------------------------------------------------- kernel categories (profile worker)

def profile_anvil(args) -> dict:
    """CUDA kernel time per step of the trainer's model (variant by flags), by category."""
    import logging

    import torch

    from trainer import distributed, optim, train
    from trainer.config import load
    from trainer.data import TokenLoader
    from trainer.profiling.categories import category

    sets = ["data.path=synthetic", f"data.batch_size={args.batch}", f"data.seq_len={args.seq}",
            "precision.compute=bf16", "precision.params=bf16", "train.kernels=true"]
    cfg = load(args.config, sets)
    info = distributed.init(cfg)
    model, train_model = train.build_model(cfg, info, logging.getLogger("profile"))
    opt = optim.build_optimizer(model, cfg.optim, info.device, kernels=cfg.train.kernels)
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
        cat = category(event.key)
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
    """fwd+bwd ms of causal GQA attention at the model's shape, per SDPA backend; and attention inside
    documents (synthetic rows' documents, --seq / 4 tokens on average), FlexAttention's block mask against
    SDPA's additive mask, each with its mask built as the trainer builds it once a batch."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    from trainer.data import SyntheticLoader
    from trainer.models.masking import SequenceLayout, attend
    from trainer.sequence import document_ids

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
    loader = SyntheticLoader(cfg.vocab_size, seq_len=t, batch_size=b, documents=True)
    tokens = next(loader)[0].cuda()
    layout = SequenceLayout(t, document_ids(tokens, *loader.document_tokens()))
    documents = {}
    for kernel in ("flex", "sdpa"):
        def masked():
            y = attend(q, k, v, layout.mask(kernel, tokens.device, q.dtype), enable_gqa=h != kv)
            y.sum().backward()
        try:
            documents[kernel] = round(do_bench(masked, warmup=5, rep=50), 3)
        except Exception as exc:
            documents[kernel] = f"unsupported: {str(exc).splitlines()[0][:80]}"
    return {"attention_fwd_bwd_ms_per_layer": out,
            "document_mask_fwd_bwd_ms_per_layer": {**documents, "documents_per_row": round(
                float(layout.documents.max(1).values.float().mean()) + 1, 1)}}


# --------------------------------------------------------------------------- FP8 quality

def run_quality(args, out: Path, env: dict) -> dict:
    """Each variant trains on the real dataset args.data (same seed, same batches); every loss
    curve is compared with the first variant's."""
    from trainer.data import load_tokenizer
    if not args.data:
        raise SystemExit("--quality needs --data DIR (a dataset from inv data.prepare)")
    vocab = load_tokenizer(Path(args.data)).vocab_size
    vocab = -(-vocab // 64) * 64                      # the LM head's width, padded as usual
    warmup = max(1, args.steps // 10)
    runs = {}
    for variant in [v.strip() for v in args.variants.split(",") if v.strip()]:
        run_dir = Path(args.run_root or out) / f"quality_{variant}"
        argv = anvil_argv(args, variant, run_dir, steps=args.steps)
        argv = [a.replace("data.path=synthetic", f"data.path={args.data}") for a in argv]
        for item in (f"model.vocab_size={vocab}", f"schedule.warmup_steps={warmup}",
                     "train.val_batches=16", "train.val_interval=0"):
            argv += ["--set", item]
        t0 = time.time()
        code = _stream(argv, env, args.timeout, out / "bench.log", f"quality {variant}")
        if code != 0:
            runs[variant] = {"error": f"trainer exited with {code}"}
            continue
        records = runfiles.metrics_records(run_dir)
        losses = [r["loss"] for r in sorted((r for r in records if r["kind"] == "train"),
                                            key=lambda r: r["step"])]
        val = [r["val_loss"] for r in records if r["kind"] == "val"]
        summary = runfiles.read_summary(run_dir)
        runs[variant] = {"losses": [round(x, 5) for x in losses], "val_loss": val[-1] if val else None,
                         "step_time_s": summary.get("step_time_s"), "wall_s": round(time.time() - t0, 1)}
        print(json.dumps({"variant": variant, "final_loss": losses[-1], "val_loss": runs[variant]["val_loss"]}),
              flush=True)
    return {"runs": runs, "comparison": compare_losses(runs, args.tolerance), "vocab_size": vocab,
            "data": args.data, "steps": args.steps, "tolerance": args.tolerance}


def compare_losses(runs: dict, tolerance: float, tail: int = 50) -> list[dict]:
    """Each run against the first: mean loss over the last `tail` steps, final validation loss,
    the largest per-step gap after the first 10 steps; ok when both relative differences are
    within `tolerance`."""
    ok_runs = [(name, r) for name, r in runs.items() if not r.get("error")]
    if len(ok_runs) < 2:
        return []
    ref_name, ref = ok_runs[0]
    rows = []
    for name, r in ok_runs[1:]:
        n = min(len(ref["losses"]), len(r["losses"]))
        k = min(tail, n)
        ref_mean = statistics.fmean(ref["losses"][n - k:n])
        mean = statistics.fmean(r["losses"][n - k:n])
        gaps = [abs(a - b) for a, b in zip(ref["losses"][10:n], r["losses"][10:n])]
        row = {"variant": name, "reference": ref_name, "steps": n,
               f"mean_loss_last{k}": round(mean, 4), f"reference_mean_loss_last{k}": round(ref_mean, 4),
               "mean_loss_rel_diff": round((mean - ref_mean) / ref_mean, 5),
               "max_step_gap": round(max(gaps), 4) if gaps else None}
        checks = [abs(row["mean_loss_rel_diff"]) <= tolerance]
        if r.get("val_loss") is not None and ref.get("val_loss") is not None:
            row["val_loss"], row["reference_val_loss"] = round(r["val_loss"], 4), round(ref["val_loss"], 4)
            row["val_loss_rel_diff"] = round((r["val_loss"] - ref["val_loss"]) / ref["val_loss"], 5)
            checks.append(abs(row["val_loss_rel_diff"]) <= tolerance)
        row["within_tolerance"] = all(checks)
        rows.append(row)
    return rows


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


# What a failed process's last words look like: the trainer's own log lines (trainer/__main__.py) or
# the last line of a Python traceback.
_FAILURE_LINE = re.compile(r"(out of memory: .*|training failed: .*|error: .*|[A-Za-z_][\w.]*(?:Error|Exception): .*)")


def failure_reason(log_path: Path, label: str, code: int, timeout: int) -> str:
    """Why the process of `label` failed, for its row: its time-out, or the last error line of its
    section of bench.log (else that section's last line)."""
    if code == 124:
        return f"timed out after {timeout} s"
    section = log_path.read_text(errors="replace").rsplit(f"===== {label}: ", 1)[-1].split("\n===== ", 1)[0]
    lines = [line.strip() for line in section.splitlines()[1:] if line.strip()]   # after the command line
    for line in reversed(lines):
        match = _FAILURE_LINE.search(line)
        if match:
            return match.group(1)[:300]
    return lines[-1][:300] if lines else "no output"


def _versions() -> dict:
    import torch
    out = {"torch": torch.__version__, "python": sys.version.split()[0],
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0}
    for name in ("triton", "transformers", "liger_kernel", "torchtitan", "torchao"):
        try:
            from importlib.metadata import version
            out[name] = version(name.replace("_", "-"))
        except Exception:
            out[name] = None
    return out


def titan_counterpart(variant: str) -> str | None:
    """The torchtitan variant with the same compile / precision / fp8 settings."""
    spec = parse_variant(variant)
    if spec["family"] != "anvil":
        return None
    name = "titan_compile" if spec["compile"] else "titan_eager"
    if spec["params"] == "fp32":
        name += "_fp32"
    return name + {"off": "", "tensorwise": "_fp8", "rowwise": "_fp8rw"}[spec["fp8"]]


def table(results: list[dict]) -> str:
    from tabulate import tabulate
    ok = {r["variant"]: r for r in results if r.get("tokens_per_s")}
    anchor = ok.get("hf_liger")
    rows = []
    for r in results:
        if r.get("error"):
            rows.append([r["variant"], "failed", "", "", "", "", "", r["error"][:60]])
            continue
        rel = f"{r['tokens_per_s'] / anchor['tokens_per_s']:.2f}x" if anchor else ""
        twin = ok.get(titan_counterpart(r["variant"]) or "")
        vs_titan = f"{r['tokens_per_s'] / twin['tokens_per_s']:.2f}x" if twin else ""
        mem = f"{r['peak_mem_gib']:.1f}" if r.get("peak_mem_gib") is not None else "n/a"
        rows.append([r["variant"], f"{r['tokens_per_s']:,.0f}", f"{r['step_time_s'] * 1000:.0f}",
                     f"{r['tflops']:.0f}", f"{r['mfu']:.1%}", mem, rel, vs_titan])
    return tabulate(rows, headers=["variant", "tokens/s/GPU", "ms/step", "TFLOP/s", "MFU",
                                   "peak GiB", "vs hf_liger", "vs torchtitan"], tablefmt="github")


def _worker(args, out: Path) -> int:
    if args.worker in ("profile", "attention"):
        result = profile_anvil(args) if args.worker == "profile" else attention_backends(args)
        print(json.dumps(result, indent=1), flush=True)
        return 0
    spec = parse_variant(args.worker)
    result = (run_titan(args, args.worker, out) if spec["family"] == "titan"
              else run_hf(args, liger=args.worker == "hf_liger", out=out))
    if result is not None:
        print("RESULT " + json.dumps(result), flush=True)
    return 0


def run_worker_variant(args, variant: str, out: Path, env: dict) -> dict:
    """hf / titan variants: this module again, in fresh process(es); rank 0 prints RESULT."""
    spec = parse_variant(variant)
    if spec["family"] == "hf" and args.nproc > 1:
        raise RuntimeError("the transformers variants run on one GPU (--nproc 1)")
    env = dict(env)
    if args.nproc <= 1 and spec["family"] == "titan":  # torchtitan always makes a process group
        import socket
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    argv = [*(_launcher(args) if spec["family"] == "titan" else [sys.executable]),
            "-m", "benchmarks.train_throughput", "--worker", variant, "--config", args.config,
            "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
            "--profile-steps", str(args.profile_steps), "--peak-tflops", str(args.peak_tflops),
            "--out", str(out)] + (["--run-root", args.run_root] if args.run_root else [])
    for item in args.sets:
        argv += ["--sets", item]
    code = _stream(argv, env, args.timeout, out / "bench.log", variant)
    own = (out / "bench.log").read_text(errors="replace").rsplit(f"===== {variant}: ", 1)[-1]
    lines = [line for line in own.splitlines() if line.startswith("RESULT ")]
    if code != 0 or not lines:
        reason = failure_reason(out / "bench.log", variant, code, args.timeout)
        raise RuntimeError(f"worker exited with {code}: {reason}")
    return json.loads(lines[-1][len("RESULT "):])


def bench_env(peak_tflops: float) -> dict:
    """The variants' environment: this checkout first on the path, unbuffered output, multicast off."""
    return {**os.environ, names.GPU_PEAK_TFLOPS: str(peak_tflops), "PYTHONUNBUFFERED": "1", **SAFE_ENV,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def run_variant(args, variant: str, out: Path, env: dict) -> dict:
    """One variant in its own process(es): Anvil's trainer, or this module's worker (hf, torchtitan)."""
    if parse_variant(variant)["family"] == "anvil":
        return run_anvil(args, variant, out, env)
    return run_worker_variant(args, variant, out, env)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out or f"/tmp/train_throughput_{int(time.time())}")
    if args.worker:
        return _worker(args, out)
    out.mkdir(parents=True, exist_ok=True)
    env = bench_env(args.peak_tflops)
    if args.quality:
        report = run_quality(args, out, env)
        report.update(versions=_versions(), date=time.strftime("%Y-%m-%d"), config=args.config,
                      batch=args.batch, seq=args.seq)
        (out / "quality.json").write_text(json.dumps(report, indent=2))
        from tabulate import tabulate
        print(tabulate([{k: v for k, v in row.items() if k != "reference"} for row in report["comparison"]],
                       headers="keys", tablefmt="github"))
        return 0 if report["comparison"] and all(r["within_tolerance"] for r in report["comparison"]) else 1
    started = time.time()
    results = []
    for variant in [v.strip() for v in args.variants.split(",") if v.strip()]:
        if args.budget and time.time() - started > args.budget:
            results.append({"variant": variant, "error": "skipped: time budget spent"})
            continue
        t0 = time.time()
        try:
            result = run_variant(args, variant, out, env)
        except Exception as exc:  # one failing variant must not lose the others
            result = {"error": f"{type(exc).__name__}: {exc}"}
        if result.get("trace"):
            try:
                result["breakdown"] = trace_breakdown(result["trace"], args.profile_steps,
                                                      result["step_time_s"], result.get("profile_wall_ms"))
            except Exception as exc:  # the figures stand without it
                result["breakdown"] = {"error": f"{type(exc).__name__}: {exc}"}
        result.update(variant=variant, wall_s=round(time.time() - t0, 1))
        results.append(result)
        print(json.dumps({k: v for k, v in result.items() if k != "step_times_s"}), flush=True)
        (out / "results.json").write_text(json.dumps(
            {"results": results, "versions": _versions(), "batch": args.batch, "seq": args.seq,
             "nproc": args.nproc, "steps": f"{FIRST_MEASURED_STEP}-{args.steps} medians",
             "config": args.config, "sets": args.sets, "date": time.strftime("%Y-%m-%d")}, indent=2))
    print(json.dumps({"versions": _versions()}) if args.json else table(results))
    return 0 if all(not r.get("error") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
