"""Mixture-of-experts training throughput on one GPU, bf16: Anvil against torchtitan 0.2.2.

    python -m benchmarks.moe_throughput [--cases deepseek_v2_lite,qwen3_30b_a3b]
        [--variants titan_compile,compile_kernels,compile] [--quick] [--batch N] [--seq 4096]
        [--steps 10] [--budget 420] [--timeout 240] [--sets KEY=VALUE] [--out DIR] [--run-root DIR]

The cases: published shapes with fewer layers, so that each trains on one GPU.
  deepseek_v2_lite  configs/deepseek_v2_lite.yaml with 4 layers (1 dense + 3 MoE): 64 routed experts
                    top-6 and 2 shared (moe.ffn_dim 1408), latent attention as the 16B (q_lora_rank
                    0, kv_lora_rank 512, qk_nope 128, qk_rope 64, v 128), dim 2048, 16 heads, vocab
                    102400; batch 4 x 4096 tokens
  qwen3_30b_a3b     configs/qwen3_30b_a3b.yaml with 4 layers: 128 experts top-8 (moe.ffn_dim 768),
                    dim 2048, 32 heads and 4 key/value heads of 128, vocab 151936; batch 2 x 4096
  deepseek_tiny, qwen3_tiny  the same families at toy sizes: the harness on a CPU in seconds
The variants (benchmarks/train_throughput.py's names): compile_kernels, Anvil's trainer with
--compile --kernels (kernels/: the Triton grouped GEMM, permutation and router); compile, --compile
alone (torch._grouped_mm); titan_compile, torchtitan's Trainer and model (deepseek_v3 or qwen3) with
its torch.compile (each block; in a MoE layer all but the grouped experts, as torchtitan applies it);
the eager twins kernels, eager and titan_eager. Both sides: bf16 weights and AdamW state, the same
synthetic token stream, batch, length, AdamW settings and gradient clipping, SDPA causal attention,
and activation checkpointing `none` (--sets train.activation_checkpoint=full is the other mode that
means the same on both sides: torchtitan's `selective` recomputes the expert GEMMs Anvil's keeps).

The measurement is train_throughput's (each variant in its own process, medians of steps 4..--steps
of tokens/s per GPU and step time, peak allocated GPU memory over those steps, one FLOP count from
Anvil's model for both); this module adds:
- the shape check: before any timing, each case's parameters are counted on the meta device in
  Anvil's model and in torchtitan's, and must agree within MAX_PARAM_GAP (0.1%), else the case's
  torchtitan variants are not run (their rows say why);
- the schedule: every case's first two --variants (the headline pair) before any case's others; a
  compiled variant of the pair that fails queues the pair's eager twins for that case, so that a
  ratio still comes out;
- robustness: a failing variant is a row with its error; a variant is skipped (a row saying so)
  when less than MIN_VARIANT_S of --budget is left, and its time-out is the smaller of --timeout and
  what is left; torchtitan's variants are skipped without a CUDA GPU (its Trainer needs one);
- one table: tokens/s and peak memory of each Anvil row over its torchtitan twin (same compile
  setting), --kernels over the same run without, and whether the row meets the goal (GOAL_SPEEDUP
  or more at no more memory). results.json in --out keeps every row and the shape checks.

torchtitan's model arguments from Anvil's config (train_throughput.titan_moe_args; Anvil's keys under model.):

  DeepSeek (family deepseek_v2, deepseek_v3) -> torchtitan.models.deepseek_v3.DeepSeekV3ModelArgs
    vocab_size, dim, n_layers, n_heads, norm_eps, rope_theta     = the same names
    inter_dim = ffn_dim (the dense layer's MLP)                  moe_inter_dim = moe.ffn_dim
    n_dense_layers = moe.first_k_dense                           max_seq_len = --seq
    q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim = mla.(the same names)
    original_seq_len, rope_factor, beta_fast, beta_slow, mscale
        = rope_scaling.original_max_position_embeddings, factor, beta_fast, beta_slow, mscale_all_dim
        (no rope_scaling: original_seq_len = --seq, rope_factor 1, mscale 1: no YaRN)
    attn_type "sdpa", attn_mask_type "causal"                    (Anvil: SDPA, causal)
    moe_args = MoEArgs(num_experts = moe.n_routed_experts, num_shared_experts = moe.n_shared_experts,
        top_k = moe.top_k, score_func = moe.score_func, route_norm = moe.norm_topk_prob,
        route_scale = moe.route_scale, num_expert_groups / num_limited_groups = moe.n_group /
        moe.topk_group (None when n_group is 1), load_balance_coeff = moe.bias_update_speed (None
        when 0), score_before_experts False (the weights scale the experts' outputs, as Anvil's
        unpermute), use_grouped_mm True)
  Qwen3-MoE (family qwen3_moe) -> torchtitan.models.qwen3.Qwen3ModelArgs
    vocab_size, dim, n_layers, n_heads, n_kv_heads, norm_eps, rope_theta = the same names
    head_dim = head_dim (head_dim_size)   hidden_dim = ffn_dim (a dense MLP's; none is built)
    moe_enabled True (experts in every layer: moe.first_k_dense must be 0), moe_inter_dim = moe.ffn_dim
    qk_norm True, enable_weight_tying = tie_embeddings, max_seq_len = --seq, attn_type "sdpa",
    attn_mask_type "causal", moe_args = MoEArgs as above (num_shared_experts 0)

  Parameter for parameter (Anvil -> torchtitan): embed_tokens -> tok_embeddings; q_proj -> wq
  (Qwen3: k_proj, v_proj, q_norm, k_norm -> wk, wv, q_norm, k_norm); kv_a_proj_with_mqa -> wkv_a;
  kv_a_layernorm -> kv_norm; kv_b_proj -> wkv_b; o_proj -> wo; input_layernorm,
  post_attention_layernorm -> attention_norm, ffn_norm; mlp.gate.weight -> moe.router.gate.weight;
  experts.gate_up_proj [E, dim, 2f] -> experts.w1, w3 [E, f, dim]; experts.down_proj [E, f, dim] ->
  experts.w2 [E, dim, f]; shared_experts (one SwiGLU of n_shared x moe.ffn_dim) -> shared_experts
  (FeedForward of n_shared x moe_inter_dim); a dense layer's mlp -> feed_forward; norm -> norm;
  lm_head -> output.

  What differs and stays (no parameter count changes): Anvil's DeepSeek-V2 and Qwen3 recipes add
  the sequence-level balance loss (moe.aux_loss_alpha 0.001) inside the layer, which torchtitan
  0.2.2 does not have: extra work on Anvil's side only. Anvil's YaRN table applies at every length
  (as transformers), torchtitan's only past original_seq_len: a different table, the same work.
  torchtitan pads each expert's rows to a multiple of 8 for torch._grouped_mm; Anvil's grouped GEMM
  takes them as they come. Each initialises its weights its own way, so the experts' loads differ
  from step to step on either side.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks import train_throughput as tt
from core import names

REPO = tt.REPO
MAX_PARAM_GAP = 0.001        # the shape check: Anvil's and torchtitan's parameter counts, relative
GOAL_SPEEDUP = 1.15          # issue 45: Anvil's tokens/s over torchtitan's, at no more peak memory
MIN_VARIANT_S = 45           # a variant started with less of the budget left would only time out
DEFAULT_VARIANTS = "titan_compile,compile_kernels,compile"
QUICK_VARIANTS = "titan_compile,compile_kernels"
DEFAULT_STEPS, QUICK_STEPS = 10, 6
# The same run without torch.compile, and without --kernels (bases of train_throughput's names).
EAGER_BASES = {"compile": "eager", "compile_kernels": "kernels", "titan_compile": "titan_eager"}
PLAIN_BASES = {"kernels": "eager", "compile_kernels": "compile"}
# The one activation checkpointing mode that means the same in both frameworks (module docstring).
COMMON_SETS = ("train.activation_checkpoint=none",)


@dataclass(frozen=True)
class Case:
    config: str                  # under configs/
    batch: int                   # sequences per step, of --seq tokens each
    sets: tuple[str, ...] = ()   # config overrides that make the shape


FOUR_LAYERS = ("model.n_layers=4",)
CASES = {
    "deepseek_v2_lite": Case("deepseek_v2_lite.yaml", batch=4, sets=FOUR_LAYERS),   # 1 dense + 3 MoE layers
    # batch 2: torchtitan keeps the batch's logits (x 151936) and their gradient whole
    "qwen3_30b_a3b": Case("qwen3_30b_a3b.yaml", batch=2, sets=FOUR_LAYERS),
    # both families at toy sizes: the harness on a CPU (tests/bench/test_moe_throughput_bench.py)
    "deepseek_tiny": Case("deepseek_v2_debug.yaml", batch=2, sets=(
        "model.dim=64", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=2", "model.ffn_dim=128",
        "model.mla.kv_lora_rank=32", "model.mla.qk_nope_head_dim=16", "model.mla.qk_rope_head_dim=8",
        "model.mla.v_head_dim=16", "model.moe.n_routed_experts=4", "model.moe.ffn_dim=32")),
    "qwen3_tiny": Case("qwen3_30b_a3b.yaml", batch=2, sets=(
        "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim_size=16",
        "model.ffn_dim=128", "model.vocab_size=256", "model.moe.n_routed_experts=8", "model.moe.top_k=2",
        "model.moe.ffn_dim=32")),
}
DEFAULT_CASES = "deepseek_v2_lite,qwen3_30b_a3b"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=DEFAULT_CASES, help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--variants", default=None,
                   help=f"comma-separated, headline pair first (default {DEFAULT_VARIANTS}; --quick: {QUICK_VARIANTS})")
    p.add_argument("--quick", action="store_true",
                   help=f"the headline pair alone and {QUICK_STEPS} steps (explicit --variants / --steps win)")
    p.add_argument("--batch", type=int, default=0, help="sequences per step for every case (default: the case's)")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=None, help=f"steps per variant (default {DEFAULT_STEPS}); "
                   f"medians over steps {tt.FIRST_MEASURED_STEP}..steps")
    p.add_argument("--sets", action="append", default=[], metavar="KEY=VALUE",
                   help="config overrides for every case, after the case's own (both frameworks follow them)")
    p.add_argument("--budget", type=int, default=420, help="seconds for all the variants together")
    p.add_argument("--timeout", type=int, default=240, help="seconds per variant at most")
    p.add_argument("--peak-tflops", type=float, default=float(os.environ.get(names.GPU_PEAK_TFLOPS) or 989.0),
                   help="bf16 dense peak of one GPU (MFU denominator; H100/H200 SXM: 989)")
    p.add_argument("--out", default="", help="directory for results.json and each case's bench.log")
    p.add_argument("--run-root", default="", help="where the trainers' run dirs go, a folder per case "
                   "(default: --out)")
    args = p.parse_args(argv)
    unknown = [c for c in _split(args.cases) if c not in CASES]
    if unknown:
        p.error(f"unknown case(s) {', '.join(unknown)}: expected some of {', '.join(CASES)}")
    args.variants = args.variants or (QUICK_VARIANTS if args.quick else DEFAULT_VARIANTS)
    args.steps = args.steps or (QUICK_STEPS if args.quick else DEFAULT_STEPS)
    for variant in _split(args.variants):
        tt.parse_variant(variant)   # an unknown name fails here, before anything runs
    if args.steps < tt.FIRST_MEASURED_STEP:
        p.error(f"--steps {args.steps}: at least {tt.FIRST_MEASURED_STEP} (the first measured step)")
    return args


def _split(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


# --------------------------------------------------------------------------- torchtitan's shape



def shape_check(case_args) -> dict:
    """Parameters of Anvil's and torchtitan's models of the case's shape, on the meta device; ok when they
    agree within MAX_PARAM_GAP. `skipped` where torchtitan is not installed, `error` where it fails."""
    import importlib.util
    cfg = tt._train_cfg(case_args)
    anvil = tt.flops_for_shape(cfg)[0]
    if importlib.util.find_spec("torchtitan") is None:
        return {"anvil_params": anvil, "skipped": "torchtitan is not installed"}
    try:
        titan = tt.titan_param_count(cfg.model, case_args.seq)
    except Exception as exc:
        return {"anvil_params": anvil, "error": f"torchtitan's model of this shape: {type(exc).__name__}: {exc}"}
    gap = abs(titan - anvil) / anvil
    return {"anvil_params": anvil, "titan_params": titan, "rel_gap": gap, "ok": gap <= MAX_PARAM_GAP}


# --------------------------------------------------------------------------- the schedule

def case_args(args, name: str, out: Path):
    """train_throughput's arguments for one case: its config and shape, then COMMON_SETS, then --sets."""
    case = CASES[name]
    argv = ["--config", str(REPO / names.CONFIGS_DIR / case.config), "--batch", str(args.batch or case.batch),
            "--seq", str(args.seq), "--steps", str(args.steps), "--timeout", str(args.timeout),
            "--peak-tflops", str(args.peak_tflops), "--out", str(out / name)]
    if args.run_root:
        argv += ["--run-root", str(Path(args.run_root) / name)]
    for item in (*case.sets, *COMMON_SETS, *args.sets):
        argv += ["--sets", item]
    return tt.parse_args(argv)


def with_base(variant: str, bases: dict) -> str | None:
    """The variant with its base swapped by `bases` (suffixes kept), or None where its base has no entry."""
    base = tt.parse_variant(variant)["base"]
    return bases[base] + variant[len(base):] if base in bases else None


def schedule(cases: list[str], variants: list[str]) -> list[tuple[str, str]]:
    """(case, variant) in running order: every case's headline pair (the first two variants), then the rest."""
    head, rest = variants[:2], variants[2:]
    return [(c, v) for c in cases for v in head] + [(c, v) for c in cases for v in rest]


def _skip_reason(variant: str, check: dict, left: float, cuda: bool) -> str | None:
    if left < MIN_VARIANT_S:
        return f"time budget spent ({left:.0f} s of --budget left)"
    if tt.parse_variant(variant)["family"] != "titan":
        return None
    if not cuda:
        return "torchtitan's Trainer needs a CUDA GPU"
    if check.get("ok") is False:
        return (f"shape check failed: Anvil {check['anvil_params']:,} parameters, torchtitan "
                f"{check['titan_params']:,} ({check['rel_gap']:.3%} apart, more than {MAX_PARAM_GAP:.1%})")
    if "ok" not in check:
        return f"no shape check: {check.get('error') or check.get('skipped')}"
    return None


def run_cases(args, out: Path, run_variant=tt.run_variant, cuda: bool | None = None) -> dict:
    """Every (case, variant) of the schedule, each in its own process(es) through `run_variant`; a row per
    run (its figures, or its error, or why it was skipped). results.json is rewritten after each row."""
    if cuda is None:
        import torch
        cuda = torch.cuda.is_available()
    case_names = _split(args.cases)
    variants = _split(args.variants)
    env = tt.bench_env(args.peak_tflops)
    per_case = {name: case_args(args, name, out) for name in case_names}
    report = {"cases": {}, "results": [], "steps": f"{tt.FIRST_MEASURED_STEP}-{args.steps} medians",
              "budget_s": args.budget, "date": time.strftime("%Y-%m-%d"), "versions": tt._versions()}
    for name, cargs in per_case.items():
        Path(cargs.out).mkdir(parents=True, exist_ok=True)
        report["cases"][name] = {"config": cargs.config, "sets": cargs.sets, "batch": cargs.batch,
                                 "seq": cargs.seq, "shape_check": shape_check(cargs)}
        print(json.dumps({"case": name, **report["cases"][name]["shape_check"]}), flush=True)
    queue, seen = schedule(case_names, variants), set()
    started = time.monotonic()
    while queue:
        name, variant = queue.pop(0)
        if (name, variant) in seen:
            continue
        seen.add((name, variant))
        cargs = argparse.Namespace(**vars(per_case[name]))
        left = args.budget - (time.monotonic() - started)
        t0 = time.monotonic()
        skip = _skip_reason(variant, report["cases"][name]["shape_check"], left, cuda)
        if skip:
            row = {"skipped": skip}
        else:
            cargs.timeout = int(min(args.timeout, left))
            try:
                row = run_variant(cargs, variant, Path(cargs.out), env)
            except Exception as exc:   # one failing variant must not lose the others
                row = {"error": f"{type(exc).__name__}: {exc}"}
            if row.get("error") and variant in variants[:2] and tt.parse_variant(variant)["compile"]:
                # the headline ratio still comes out of the eager twins of the case's pair
                twins = [with_base(v, EAGER_BASES) for v in variants[:2]]
                queue += [(name, twin) for twin in twins if twin]
        row.update(case=name, variant=variant, wall_s=round(time.monotonic() - t0, 1))
        report["results"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "step_times_s"}), flush=True)
        (out / "results.json").write_text(json.dumps(report, indent=2))
    report["wall_s"] = round(time.monotonic() - started, 1)
    (out / "results.json").write_text(json.dumps(report, indent=2))
    return report


# --------------------------------------------------------------------------- the table

def comparisons(rows: list[dict]) -> list[dict]:
    """Each row with the ratios the table shows: vs_titan and mem_vs_titan (its torchtitan twin: the same
    compile setting), vs_plain (the same Anvil run without --kernels), vs_titan_best (torchtitan's
    fastest row of the case, compiled or not), goal (vs_titan_best >= GOAL_SPEEDUP at no more memory
    than that row: the goal is against torchtitan at its best), where the figures exist."""
    ok = {(r["case"], r["variant"]): r for r in rows if r.get("tokens_per_s")}
    fastest_titan: dict[str, dict] = {}
    for (case, variant), r in ok.items():
        if variant.startswith("titan") and r["tokens_per_s"] > fastest_titan.get(case, {}).get("tokens_per_s", 0):
            fastest_titan[case] = r
    out = []
    for r in rows:
        r = dict(r)
        if r.get("tokens_per_s"):
            twin = ok.get((r["case"], tt.titan_counterpart(r["variant"]) or ""))
            plain = ok.get((r["case"], with_base(r["variant"], PLAIN_BASES) or ""))
            best = fastest_titan.get(r["case"])
            if twin:
                r["vs_titan"] = r["tokens_per_s"] / twin["tokens_per_s"]
                if r.get("peak_mem_gib") and twin.get("peak_mem_gib"):
                    r["mem_vs_titan"] = r["peak_mem_gib"] / twin["peak_mem_gib"]
            if best and not r["variant"].startswith("titan"):
                r["vs_titan_best"] = r["tokens_per_s"] / best["tokens_per_s"]
                if r.get("peak_mem_gib") and best.get("peak_mem_gib"):
                    r["goal"] = r["vs_titan_best"] >= GOAL_SPEEDUP and r["peak_mem_gib"] <= best["peak_mem_gib"]
            if plain:
                r["vs_plain"] = r["tokens_per_s"] / plain["tokens_per_s"]
        out.append(r)
    return out


def table(rows: list[dict]) -> str:
    from tabulate import tabulate

    def ratio(value):
        return f"{value:.2f}x" if value is not None else ""

    lines = []
    for r in comparisons(rows):
        if not r.get("tokens_per_s"):
            status = "skipped" if r.get("skipped") else "failed"
            lines.append([r["case"], r["variant"], status, "", "", "", "", "", "", "", "",
                          (r.get("skipped") or r.get("error") or "")[:90]])
            continue
        mem = f"{r['peak_mem_gib']:.1f}" if r.get("peak_mem_gib") is not None else "n/a"
        goal = {True: "met", False: "not met"}.get(r.get("goal"), "")
        lines.append([r["case"], r["variant"], f"{r['tokens_per_s']:,.0f}", f"{r['step_time_s'] * 1000:.0f}",
                      f"{r['tflops']:.0f}", mem, ratio(r.get("vs_titan")), ratio(r.get("mem_vs_titan")),
                      ratio(r.get("vs_titan_best")), ratio(r.get("vs_plain")), goal, ""])
    return tabulate(lines, headers=["case", "variant", "tokens/s/GPU", "ms/step", "TFLOP/s", "peak GiB",
                                    "vs torchtitan", "memory vs torchtitan", "vs torchtitan's fastest",
                                    "vs no --kernels",
                                    f"goal {GOAL_SPEEDUP}x", "error"], tablefmt="github")


def shape_table(cases: dict) -> str:
    from tabulate import tabulate
    lines = []
    for name, case in cases.items():
        check = case["shape_check"]
        verdict = ("agree" if check["ok"] else "DIFFER") if "ok" in check else (check.get("error") or check["skipped"])
        lines.append([name, f"{check['anvil_params']:,}",
                      f"{check['titan_params']:,}" if "titan_params" in check else "", verdict[:90]])
    return tabulate(lines, headers=["case", "Anvil parameters", "torchtitan parameters",
                                    f"within {MAX_PARAM_GAP:.1%}"], tablefmt="github")


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out or f"/tmp/moe_throughput_{int(time.time())}")
    out.mkdir(parents=True, exist_ok=True)
    report = run_cases(args, out)
    print(shape_table(report["cases"]))
    print()
    print(table(report["results"]))
    print(f"\nresults: {out / 'results.json'}; each case's bench.log in {out}/<case>")
    failed = any(r.get("error") for r in report["results"]) or any(
        c["shape_check"].get("ok") is False or c["shape_check"].get("error") for c in report["cases"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
