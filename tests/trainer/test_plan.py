"""trainer.plan / `inv train.plan`: the plan is checked against reality where a CPU can check it
(the real model's parameters, the MFU FLOP count, autograd's saved tensors) and against figures
measured on an H200 (BENCHMARKS.md); the rest against hand-computed Llama 3 numbers. What the plan knows
cannot fit is refused before launch (exit 2, no run directory) unless forced; what probably will not fit
is a warning; through the installed inv (`--set model.dim=1000000000000` used to launch and fail with
exit 1 and an allocator's message)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer import plan as planner
from trainer.config import load
from trainer.models import Transformer, flops_per_token
from trainer.plan import GIB, Device, ParamCount, make_plan, memory

from helpers.program import ONE_THREAD, REPO, inv, metadata, run_inv, runs

H100 = Device("H100", 80, "nvidia", True)
H200 = Device("H200", 141, "nvidia", True)


def cfg_of(name: str, *sets: str):
    return load(REPO / "configs" / f"{name}.yaml", list(sets))


# ---- against the real model ------------------------------------------------------------------

@pytest.mark.parametrize("tied", [False, True])
def test_parameters_match_the_real_tiny_model_exactly(tied):
    cfg = cfg_of("tiny", f"model.tie_embeddings={str(tied).lower()}")
    model = Transformer(cfg.model)
    real = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert planner.param_shapes(cfg.model) == real
    count = ParamCount.of(cfg.model)
    assert count.total == model.num_params() == make_plan(cfg).params.total
    assert count.non_embedding == model.num_params(exclude_embedding=True)
    layer = model.model.layers[0]
    assert count.per_layer == sum(p.numel() for p in layer.parameters())
    assert count.layer_matmul == sum(p.numel() for p in layer.parameters() if p.dim() == 2)


def test_flops_per_token_is_the_mfu_formula_itself(monkeypatch):
    cfg = cfg_of("tiny")
    model = Transformer(cfg.model)
    # What trainer/train.py hands Metrics for MFU:
    expected = flops_per_token(cfg.model, model.num_params(exclude_embedding=True), cfg.data.seq_len)
    assert make_plan(cfg).flops_per_token == expected
    # ...and it is that function, called: not a second copy of the formula.
    import trainer.models
    monkeypatch.setattr(trainer.models, "flops_per_token", lambda m, n, t: 12345)
    assert make_plan(cfg).flops_per_token == 12345


def saved_by_first_layer(model, B: int, T: int, dtype) -> dict:
    """What autograd keeps for backward of the model's first decoder layer on a [B, T, dim] input:
    {storage address: (bytes, shape)}, the parameters left out (a weight's transpose is a view)."""
    x = torch.randn(B, T, model.model.layers[0].self_attn.q_proj.in_features, dtype=dtype, requires_grad=True)
    cos, sin = model.model.rotary_emb(T)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = (storage.nbytes(), tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model.layers[0](x, cos, sin)
    return saved


@pytest.mark.parametrize("weights", ["bf16", "fp32_autocast"])
def test_layer_activation_formula_is_what_autograd_saves(weights):
    """Saved tensors of one real decoder layer on CPU (bf16, SDPA's CPU flash kernel with GQA)
    against layer_activation_bytes(mode none), byte for byte; autocast's weight copies apart."""
    cfg = cfg_of("tiny")
    m = cfg.model
    B, T = 2, 48                               # B * T = 96: no weight has a dimension of 96
    torch.manual_seed(0)
    model = Transformer(m)
    dtype = torch.bfloat16 if weights == "bf16" else torch.float32
    model.to(dtype)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=weights != "bf16")
    with autocast:
        saved = saved_by_first_layer(model, B, T, dtype)
    per_token = sum(n for n, shape in saved.values() if shape[:1] in ((B,), (B * T,)))
    copies = sum(n for n, shape in saved.values() if shape[:1] not in ((1,), (B,), (B * T,)))  # cast weights
    world_one = planner.dtypes(cfg if weights != "bf16" else cfg_of("tiny", "precision.params=bf16"), 1)
    assert world_one.casts == (weights != "bf16")
    assert per_token == B * T * planner.layer_activation_bytes(m, T, "none", world_one)
    assert copies == (2 * ParamCount.of(m).layer_matmul if weights != "bf16" else 0)


def test_eager_fp8_layer_keeps_what_the_bf16_layer_keeps():
    """A real decoder layer turned FP8 by trainer.fp8.convert (torchao's emulation on CPU):
    autograd's saved tensors are the plan's eager FP8 figure, which is the bf16 one (torchao keeps
    the 16-bit input; the float8 cast is made again in backward)."""
    pytest.importorskip("torchao.float8", reason="torchao is not installed (pip install 'anvil[fp8]')")
    from trainer import fp8
    cfg = cfg_of("tiny", "precision.params=bf16", "precision.fp8=tensorwise")
    m = cfg.model
    B, T = 2, 48
    torch.manual_seed(0)
    model = Transformer(m)
    state = fp8.convert(model, "tensorwise", emulate=True)
    assert len(state.converted) == 7 * m.n_layers            # every linear of the blocks
    model.to(torch.bfloat16)
    saved = saved_by_first_layer(model, B, T, torch.bfloat16)
    dt = planner.dtypes(cfg, 1)
    layout = planner.fp8_layout(cfg, dt)
    assert layout.attn_in and layout.mlp_in and layout.down and not layout.compiled
    assert layout.converted == ParamCount.of(m).layer_matmul
    expected = planner.layer_activation_bytes(m, T, "none", dt, fp8=layout)
    assert expected == planner.layer_activation_bytes(m, T, "none", dt)
    per_token = sum(n for n, shape in saved.values() if shape[:1] in ((B,), (B * T,)))
    others = {shape for n, shape in saved.values() if shape[:1] not in ((B,), (B * T,))}
    # the rest: float8 scales (0-d) and RoPE's [T, head_dim] cos/sin tables
    assert all(shape == () or torch.Size(shape).numel() == T * m.head_dim for shape in others), others
    assert per_token == B * T * expected


def test_compiled_fp8_keeps_the_shared_linear_inputs_in_float8():
    """Under torch.compile the three inputs the FP8 linears share (attention's, the MLP's, SwiGLU's
    output) are kept in one byte, once each, however many autocast casts made them."""
    m = cfg_of("llama3_1b").model
    D, F = m.dim, m.ffn_dim
    for params, kernels in (("bf16", True), ("bf16", False), ("fp32", True)):
        sets = [f"precision.params={params}", f"train.kernels={str(kernels).lower()}", "train.compile=true"]
        plain = cfg_of("llama3_1b", *sets)
        fp8 = cfg_of("llama3_1b", *sets, "precision.fp8=rowwise")
        dt = planner.dtypes(plain, 1)
        layout = planner.fp8_layout(fp8, dt)
        assert layout.compiled and planner.fp8_layout(plain, dt) is None
        saved = planner.layer_activation_bytes(m, 4096, "none", dt, kernels, layout)
        inputs = 2 * D * (5 if dt.casts else 2)                   # attention's and the MLP's, in bf16
        assert planner.layer_activation_bytes(m, 4096, "none", dt, kernels) - saved == inputs - 2 * D + F
        for mode in ("selective", "selective_lean", "full"):       # checkpointing keeps what it kept
            assert (planner.layer_activation_bytes(m, 4096, mode, dt, kernels, layout)
                    == planner.layer_activation_bytes(m, 4096, mode, dt, kernels))


def test_fp8_layout_follows_the_convert_filter():
    """A linear whose dimensions are not multiples of 16 stays bf16 (trainer.fp8.convert_filter), and
    its input keeps its 16 bits in the plan."""
    cfg = cfg_of("tiny", "model.ffn_dim=200", "precision.fp8=tensorwise", "train.compile=true")
    m = cfg.model
    layout = planner.fp8_layout(cfg, planner.dtypes(cfg, 1))
    assert layout.attn_in and not layout.mlp_in and not layout.down      # 200 % 16 != 0
    assert layout.converted == ParamCount.of(m).layer_matmul - 3 * m.dim * 200
    assert layout.widest_out == m.n_heads * m.head_dim


def test_fp8_under_fsdp2_gathers_tensorwise_weights_in_float8():
    """llama3_8b on 8 GPUs: tensorwise all-gathers the 7 linears of a layer in float8, so the layer
    kept gathered for backward costs 1 byte a weight and 2 per norm weight; rowwise gathers bf16."""
    D, layer = 4096, 218_112_000
    linear = layer - 2 * D
    bf16 = {t.key: t.bytes for t in memory(cfg_of("llama3_8b"), 8, H100).peak.terms}
    tw = {t.key: t.bytes for t in memory(cfg_of("llama3_8b", "precision.fp8=tensorwise"), 8, H100).peak.terms}
    rw = {t.key: t.bytes for t in memory(cfg_of("llama3_8b", "precision.fp8=rowwise"), 8, H100).peak.terms}
    assert bf16["fsdp_layers"] == rw["fsdp_layers"] == 2 * layer
    assert tw["fsdp_layers"] == linear + 2 * 2 * D
    assert tw["fsdp_head"] == bf16["fsdp_head"]                      # the LM head stays bf16
    plan = make_plan(cfg_of("llama3_8b", "precision.fp8=tensorwise"), gpus=8, device=H100)
    assert any("all-gathered in float8" in note for note in plan.notes)
    assert not any("not modelled" in note for note in plan.notes)


def test_fp8_with_fp32_weights_needs_no_autocast_copies_of_its_linears():
    """One GPU, fp32 weights under autocast: Float8Linear casts its fp32 weight to float8 itself,
    so autocast's bf16 copies of the layers' weights (kept for backward without checkpointing) go."""
    sets = ["train.kernels=true", "train.activation_checkpoint=none"]
    plain = memory(cfg_of("llama3_1b", *sets), 1, H200)
    fp8 = memory(cfg_of("llama3_1b", *sets, "precision.fp8=tensorwise"), 1, H200)
    copies = {mo.key: sum(t.bytes for t in mo.terms if t.key == "copies") for mo in plain.moments}
    copies_fp8 = {mo.key: sum(t.bytes for t in mo.terms if t.key == "copies") for mo in fp8.moments}
    layers = 2 * 16 * ParamCount.of(cfg_of("llama3_1b").model).layer_matmul
    assert copies["layer_backward"] == layers and copies_fp8["layer_backward"] == 0
    assert copies["forward"] - copies_fp8["forward"] == layers


# Peak allocated memory of real runs (BENCHMARKS.md): config, GPUs, overrides, measured GiB.
# Llama-3.2-1B at batch 4 x 4096 without checkpointing; one H200, 2026-11-23:
MEASURED = [
    ("llama3_1b", 1, H200, ["precision.params=bf16", "train.kernels=false"], 57.3),
    ("llama3_1b", 1, H200, ["precision.params=bf16"], 26.7),
    ("llama3_1b", 1, H200, ["precision.params=fp32"], 40.9),
    # one H100, 2026-11-24, `python -m benchmarks.plan_check ... --kernels [--compile] --fp8 ...`
    ("llama3_1b", 1, H100, ["precision.params=bf16", "train.compile=true"], 26.67),
    ("llama3_1b", 1, H100, ["precision.params=bf16", "train.compile=true", "precision.fp8=tensorwise"], 23.714),
    ("llama3_1b", 1, H100, ["precision.params=bf16", "train.compile=true", "precision.fp8=rowwise"], 23.808),
    ("llama3_1b", 1, H100, ["precision.params=bf16", "precision.fp8=tensorwise"], 27.51),
    ("llama3_1b", 1, H100, ["precision.params=fp32", "train.compile=true", "precision.fp8=tensorwise"], 33.254),
    ("llama3_1b", 1, H100, ["precision.params=bf16", "train.compile=true", "precision.fp8=tensorwise",
                            "train.activation_checkpoint=selective"], 20.837),
    # one H200, 2026-11-29, benchmarks.train_throughput compile_kernels_fp8_f8head[_f8act]: the float8 LM head
    ("llama3_1b", 1, H200, ["precision.params=bf16", "train.compile=true", "precision.fp8=tensorwise",
                            "precision.fp8_lm_head=true"], 24.442),
    ("llama3_1b", 1, H200, ["precision.params=bf16", "train.compile=true", "precision.fp8=tensorwise",
                            "precision.fp8_lm_head=true", "train.float8_activations=true"], 18.445),
    ("llama3_8b", 1, H200, ["precision.params=bf16", "train.compile=true", "precision.fp8=tensorwise",
                            "precision.fp8_lm_head=true"], 70.52),
    ("llama3_8b", 1, H200, ["precision.params=bf16", "train.compile=true", "precision.fp8=tensorwise",
                            "precision.fp8_lm_head=true", "train.float8_activations=true"], 63.53),
    # two H200s, FSDP2, fp32 master weights, --compile --kernels (after the FSDP2 groups change)
    ("llama3_8b", 2, H200, ["train.compile=true"], 72.7),
    ("llama3_8b", 2, H200, ["train.compile=true", "train.activation_checkpoint=selective_lean"], 63.49),
    ("llama3_8b", 2, H200, ["train.compile=true", "precision.fp8=tensorwise"], 72.3),
]


@pytest.mark.parametrize("name,world,device,sets,gib", MEASURED,
                         ids=[f"{n}-{w}-{'-'.join(s.split('=')[1] for s in sets)}" for n, w, _, sets, _ in MEASURED])
def test_plan_within_two_percent_of_measured_peaks(name, world, device, sets, gib):
    base = ["data.batch_size=4", "data.seq_len=4096", "train.activation_checkpoint=none"] if name == "llama3_1b" else []
    cfg = cfg_of(name, *base, "precision.compute=bf16", "train.kernels=true", *sets)
    training = [mo for mo in memory(cfg, world, device).moments if mo.key != "init"]
    got = max(mo.bytes for mo in training) / GIB
    assert abs(got / gib - 1) < 0.02, (got, gib)


# ---- hand-computed Llama 3 figures --------------------------------------------------------------

def test_llama3_8b_on_8_h100_hand_computed():
    cfg = cfg_of("llama3_8b")                  # selective checkpointing, batch 1 x 8192, FSDP, fp32 weights
    plan = make_plan(cfg, gpus=8, device=H100)
    D, F, V, L, T, H, Dkv = 4096, 14336, 128256, 32, 8192, 32, 1024
    layer = 2 * D + 2 * D * D + 2 * D * Dkv + 3 * D * F
    assert layer == 218_112_000
    n = L * layer + 2 * V * D + D
    assert n == plan.params.total == 8_030_261_248               # "8.03B"
    assert plan.flops_per_token == 6 * (n - V * D) + 12 * L * H * 128 * T == 57_914_449_920
    mem = plan.memory
    state = {t.key: t.bytes for t in mem.state}
    assert state == {"weights": n * 4 // 8, "gradients": n * 4 // 8, "optimizer": n * 8 // 8}
    selective = 2 * D + 2 * (3 * D + 2 * Dkv) + 2 * 2 * F + 4 * H   # input, q k v o + SDPA outputs, lse
    assert mem.activations == L * T * selective == 24_729_616_384   # 23.03 GiB (down_proj's output not kept)
    lean = memory(cfg, 8, H100, mode="selective_lean").activations
    assert lean == L * T * (2 * D + 2 * (2 * D + Dkv) + 2 * F + 4 * H)    # k, o, up recomputed too
    peak = mem.peak
    assert peak.key == "loss_backward"
    terms = {t.key: t.bytes for t in peak.terms}
    assert terms["loss"] == 12 * T * V                        # 11.74 GiB of logits and their grads
    assert terms["fsdp_root"] == 2 * D                        # the final norm; embedding and head have
    assert terms["fsdp_head"] == 2 * V * D                    # groups of their own (bf16 head gathered)
    assert terms["fsdp_layers"] == 2 * layer                  # the last layer stays gathered
    assert terms["final"] == T * (4 * D + 2 * D + 4 + 2 * D)
    assert terms["attention_mask"] == 16 * (T // 128) ** 2      # the config's document mask: FlexAttention's
    assert peak.bytes == sum(terms.values()) == (n * 12 // 8 + 2 * (V * D + D) + 2 * layer   # block tables
                                                 + L * T * selective + T * (8 * D + 4) + 12 * T * V
                                                 + 16 * (T // 128) ** 2)
    assert round(peak.bytes / GIB, 2) == 47.63
    assert plan.fits and plan.max_batch == {"none": 1, "selective": 1, "selective_lean": 2, "full": 4}
    one = make_plan(cfg, gpus=1, device=H100)                 # 16 bytes a parameter alone: 120 GiB
    assert one.fits is False and one.memory.peak_bytes > 16 * n


def test_activation_checkpointing_lowers_activations_and_the_peak():
    for name in ("tiny", "llama3_8b", "llama3_70b"):
        cfg = cfg_of(name)
        for world in (1, 8):
            by = {mode: memory(cfg, world, H100, mode=mode) for mode in planner.AC_MODES}
            acts = [by[mode].activations for mode in planner.AC_MODES]     # most memory first
            assert acts == sorted(acts, reverse=True) and len(set(acts)) == len(acts) and acts[-1] > 0
            peaks = [by[mode].peak_bytes for mode in planner.AC_MODES]
            assert peaks == sorted(peaks, reverse=True) and peaks[0] > peaks[-1]   # (another moment may cap)


def test_more_gpus_lower_the_per_gpu_sharded_state():
    cfg = cfg_of("llama3_70b")
    state = []
    for gpus, nodes in ((2, 1), (4, 1), (8, 1), (8, 2), (8, 4)):
        mem = make_plan(cfg, gpus=gpus, nodes=nodes, device=H200).memory
        state.append(sum(t.bytes for t in mem.state))
        assert state[-1] == pytest.approx(16 * mem_params(cfg) / (gpus * nodes), rel=1e-3)
    assert state == sorted(state, reverse=True) and len(set(state)) == len(state)


def mem_params(cfg) -> int:
    return ParamCount.of(cfg.model).total


def test_largest_batch_fits_and_is_monotonic():
    cfg = cfg_of("llama3_8b")
    previous = {mode: -1 for mode in planner.AC_MODES}
    for gib in (40, 64, 80, 141, 192, 288):
        device = Device("GPU", gib, "nvidia", True)
        best = make_plan(cfg, gpus=8, device=device).max_batch
        assert best["none"] <= best["selective"] <= best["selective_lean"] <= best["full"]
        for mode, b in best.items():
            assert b >= previous[mode]          # more memory never fits less
            previous[mode] = b
            if b:
                assert memory(cfg, 8, device, b, mode).fits(8)
            assert not memory(cfg, 8, device, b + 1, mode).fits(8)
    assert previous["full"] > 4


def test_bad_counts_are_plan_errors():
    cfg = cfg_of("tiny")
    for kwargs in ({"gpus": 0}, {"gpus": -1}, {"nodes": 0}, {"gpus": 1.5}):
        with pytest.raises(planner.PlanError, match="expected a positive integer"):
            make_plan(cfg, **kwargs)


# ---- through the installed inv ------------------------------------------------------------------

def train_plan(*args) -> subprocess.CompletedProcess:
    """`inv train.plan ARGS` from the checkout, with no GPU named by this shell (ANVIL_GPU empty)."""
    return run_inv("train.plan", *args, env={"ANVIL_GPU": ""}, timeout=120)


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [1\n")
    cases = [(["--gpus", "0"], "--gpus 0: expected a positive integer"),
             (["--nodes", "0"], "--nodes 0: expected a positive integer"),
             (["--gpus", "eight"], "--gpus 'eight'"),
             (["--gpu", "NOPE9000"], "unknown GPU model 'NOPE9000'"),
             (["--config", str(broken)], "invalid YAML"),
             (["--config", str(tmp_path / "missing.yaml")], "no such config file"),
             (["--set", "data.batch_size=0"], "data.batch_size: expected a positive integer")]
    for args, message in cases:
        proc = train_plan(*args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0] and lines[0].startswith("train.plan: "), (args, lines)
        assert "Traceback" not in proc.stderr + proc.stdout and not proc.stdout.strip()


def test_llama3_70b_on_8_h200_says_whether_it_fits():
    args = ["--config", "configs/llama3_70b.yaml", "--gpus", "8", "--gpu", "H200"]
    table = train_plan(*args)
    assert table.returncode == 0, table.stderr
    verdict = table.stdout.strip().splitlines()[-1]
    # fp32 weights + gradients + AdamW = 16 bytes a parameter: 131 GiB per GPU on 8 before anything else
    assert verdict.startswith("DOES NOT FIT on 8 x H200: needs ") and "of 141 GiB per GPU" in verdict
    assert "--nodes 2" in verdict and "--set precision.params=bf16" in verdict
    assert "largest data.batch_size" in table.stdout and "FSDP2 over 8 ranks" in table.stdout
    as_json = json.loads(train_plan(*args, "--json").stdout)
    assert as_json["fits"] is False and as_json["verdict"] == verdict
    assert as_json["device"] == {"name": "H200", "memory_gib": 141, "vendor": "nvidia",
                                 "source": "envs/profiles/h200.py"}
    two = json.loads(train_plan(*args, "--nodes", "2", "--json").stdout)
    assert two["fits"] is True and two["run"]["world_size"] == 16
    assert two["verdict"].startswith("FITS on 8 x H200 x 2 nodes")


def test_named_memory_and_no_gpu():
    a100 = json.loads(train_plan("--config", "configs/llama3_8b.yaml", "--gpu", "A100-40GB:8", "--json").stdout)
    assert a100["device"]["memory_gib"] == 40 and a100["run"]["gpus"] == 8
    if not Path("/dev/nvidia0").exists() and not Path("/dev/kfd").exists():
        here = train_plan("--config", "configs/tiny.yaml")
        assert here.returncode == 0 and here.stdout.strip().splitlines()[-1].startswith("NO GPU TO CHECK")


def test_gpu_size_with_or_without_a_unit_and_bad_sizes_refused(monkeypatch):
    """A100-40 is the 40 GB card as A100-40GB is; junk after the model, 0, negative or absurd sizes are
    refused, not planned for the profile's 80 GiB."""
    from envs import EnvError
    from runtime.jobs.planning import split_gpu_size

    monkeypatch.delenv("ANVIL_GPU", raising=False)
    for typed, expected in [("A100-40", ("A100", 40)), ("A100-40GB", ("A100", 40)), ("a100_40g", ("A100", 40)),
                            ("A100-40GiB:8", ("A100:8", 40)), ("MI300X-24GB", ("MI300X", 24)),
                            ("H100:4", ("H100:4", None)), ("h100", ("H100", None)), ("", ("", None))]:
        assert split_gpu_size(typed) == expected, typed
    for typed, message in [("A100-foo", "got '-foo' after the model name"), ("H100-0GB", "0 GiB per GPU is refused"),
                           ("H100--5", "-5 GiB per GPU is refused"), ("H100-999GB", "at most 100 GiB"),
                           ("H100:0", "count after ':' must be 1 or more"), ("xA100y", "unknown GPU model")]:
        with pytest.raises(EnvError, match=message) as refused:
            split_gpu_size(typed)
        assert refused.value.exit_code == 2


def test_a100_40_plans_for_40_gib_and_bad_gpu_sizes_are_one_line():
    forty = train_plan("--config", "configs/llama3_8b.yaml", "--gpu", "A100-40")
    assert forty.returncode == 0, forty.stderr
    assert "DOES NOT FIT on 8 x A100: needs 51.8 of 40 GiB" in forty.stdout.strip().splitlines()[-1]
    for gpu, message in [("A100-foo", "expected A100 or A100-<GiB per GPU>"), ("H100-0GB", "more than 0"),
                         ("H100-999GB", "at most 100 GiB"), ("NVIDIA H100 80GB HBM3", "after the model name")]:
        proc = train_plan("--config", "configs/llama3_8b.yaml", "--gpu", gpu)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], (gpu, proc.stderr)
        assert lines[0].startswith(f"train.plan: --gpu {gpu!r}: ") and not proc.stdout.strip()


def test_plan_check_stops_cleanly_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: plan_check would measure")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.plan_check", "--config", "configs/tiny.yaml",
                           "--ac", "none,full"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"plan_check: no GPU visible to torch ({torch.__version__}): nothing measured; run it on a GPU machine"]
    report = json.loads(proc.stdout)
    assert [r["ac"] for r in report["runs"]] == ["none", "full"]
    assert report["runs"][0]["plan_peak_allocated_gib"] > report["runs"][1]["plan_peak_allocated_gib"]


# ---- train.pretrain asks the planner before it launches ---------------------------------------------

def test_pretrain_warns_before_launch_when_the_plan_says_it_will_not_fit(monkeypatch):
    import envs
    from runtime.jobs import planning

    cfg = load("configs/llama3_8b.yaml", ["data.path=synthetic"])
    h100 = envs.resolve(gpu="H100", config_env=cfg.env)
    one = planning.fit_warning(cfg, h100, 1, 1, on_this_machine=True)
    assert one and "cannot fit" in one and "on H100 (80 GiB)" in one and "inv train.plan" in one
    assert planning.fit_warning(cfg, h100, 8, 1, on_this_machine=True) is None        # 51.8 of 80 GiB
    assert planning.fit_warning(cfg, h100, 4, 2, on_this_machine=False) is None       # a named GPU counts
    tiny = load("configs/tiny.yaml", [])
    cpu = envs.resolve(config_env=tiny.env)
    if cpu.machine.has_gpu:
        pytest.skip("a GPU is visible: the host-memory check is for machines without one")
    assert planning.fit_warning(tiny, cpu, 1, 1, on_this_machine=True) is None
    monkeypatch.setattr(planning, "host_memory_gib", lambda: 64.0)
    big = planning.fit_warning(cfg, cpu, 2, 1, on_this_machine=True)
    assert big and "this machine's 64 GiB of memory shared by 2 ranks" in big
    assert "lower data.batch_size" in big and "--gpu NAME" in big       # train.plan plans for GPUs
    assert planning.fit_warning(cfg, cpu, 1, 2, on_this_machine=False) is None   # Slurm nodes unseen from here


def test_pretrain_dry_run_prints_the_warning():
    proc = run_inv("train.pretrain", "--config", "configs/llama3_8b.yaml", "--set", "data.path=synthetic", "--gpu",
                   "H100:2", "--dry-run", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "WARNING: the memory plan says this run will not fit: it needs about 87" in proc.stderr


def test_float8_activations_count_gate_and_up_in_one_byte():
    """train.float8_activations: SwiGLU's stash (FP8 tensorwise, fused inputs) keeps gate and up in
    float8 under selective and none (its output rebuilt from them); without it
    the partitioner stores gate and up in float8 (plus a row scale) once they reach the size, and
    nothing below it."""
    base = ["train.compile=true", "train.kernels=true", "precision.params=bf16", "data.batch_size=1",
            "data.seq_len=8192"]
    on = ["train.float8_activations=true"]
    m = cfg_of("llama3_8b").model
    F = m.ffn_dim

    def per_token(*sets, mode="selective"):
        cfg = cfg_of("llama3_8b", *base, *sets)
        dt = planner.dtypes(cfg, 1)
        fp8 = planner.fp8_layout(cfg, dt)
        f8 = planner.float8_acts(cfg, dt, fp8, cfg.data.batch_size * cfg.data.seq_len)
        return planner.layer_activation_bytes(m, cfg.data.seq_len, mode, dt, True, fp8, f8)

    fp8 = ["precision.fp8=tensorwise"]
    assert per_token(*fp8) - per_token(*fp8, *on) == 4 * F - 2 * F                  # gate + up bf16 -> stash
    # none: gate and up in bf16 and SwiGLU's float8 output (the partitioner's) -> the stash alone
    assert per_token(*fp8, mode="none") - per_token(*fp8, *on, mode="none") == 5 * F - 2 * F
    # selective_lean keeps gate alone: no stash there (it would keep more), the partitioner's copy
    assert per_token(*fp8, mode="selective_lean") - per_token(*fp8, *on, mode="selective_lean") == 2 * F - (F + 4)
    assert per_token(*fp8, mode="full") == per_token(*fp8, *on, mode="full")
    assert per_token(*fp8, "precision.fp8_fused=false") - per_token(*fp8, "precision.fp8_fused=false", *on) \
        == 2 * (2 * F - (F + 4))                                                    # the partitioner's rows
    assert per_token() - per_token(*on) == 2 * (2 * F - (F + 4))                     # bf16, no FP8
    assert per_token(mode="none") - per_token(*on, mode="none") == 2 * (2 * F - (F + 4))
    assert per_token("data.seq_len=1024") == per_token("data.seq_len=1024", *on)     # 28 MiB: under 100
    # the output the stash rebuilds is live during each layer's backward, whatever the mode
    def layer_bwd(*sets, mode):
        cfg = cfg_of("llama3_8b", *base, *fp8, *sets, f"train.activation_checkpoint={mode}")
        return {t.key: t.bytes for t in memory(cfg, 1, H200).peak.terms}["layer_bwd"]
    assert layer_bwd(*on, mode="none") - layer_bwd(mode="none") == 8192 * F
    assert layer_bwd(*on, mode="selective") == layer_bwd(mode="selective")   # rebuilt from gate and up either way
    plan = planner.make_plan(cfg_of("llama3_8b", *base, *fp8, *on))
    assert any(n.startswith("train.float8_activations: gate and up counted in float8") for n in plan.notes)
    assert plan.memory.peak_bytes < planner.make_plan(cfg_of("llama3_8b", *base, *fp8)).memory.peak_bytes


# ---- what cannot fit is refused before launch, through the installed inv -------------------------

HUGE = ["--set", "model.dim=1000000000000"]     # 10**12: more memory than any machine has


def test_a_model_that_cannot_fit_is_refused_before_launch(tmp_path, dataset):
    proc = inv(tmp_path, "train.pretrain", "--set", f"data.path={dataset}", *HUGE, env=ONE_THREAD)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("train.pretrain: the memory plan says this run cannot fit: its peak alone, before any "
                           "allowance, is ") and line.endswith("; --force launches it anyway"), line
    assert " GiB per rank (data.batch_size 16, activation checkpointing none) on this machine's " in line
    assert runs(tmp_path) == []          # before any run directory


def test_dry_run_shows_the_refusal_as_a_warning(tmp_path, dataset):
    proc = inv(tmp_path, "train.pretrain", "--set", f"data.path={dataset}", *HUGE, "--dry-run", env=ONE_THREAD)
    assert proc.returncode == 0, proc.stderr
    assert "WARNING: the memory plan says this run cannot fit" in proc.stderr
    assert "; a launch is refused without --force" in proc.stderr and runs(tmp_path) == []


def test_force_launches_what_the_plan_refuses(tmp_path, dataset):
    proc = inv(tmp_path, "train.pretrain", "--set", f"data.path={dataset}", *HUGE, "--force", env=ONE_THREAD)
    assert "WARNING: the memory plan says this run cannot fit" in proc.stderr, proc.stderr
    (run,) = runs(tmp_path)              # it launched; the rank then could not allocate the model
    assert proc.returncode == 1 and metadata(run)["status"] == "failed"
    assert "can't allocate memory" in proc.stderr


def test_a_run_that_probably_will_not_fit_is_only_warned_about(tmp_path):
    """Between the peak and the peak with the plan's allowances (fragmentation, context, buffers):
    two H100s for llama3_8b need about 87 GiB each with them, 81.3 GiB without."""
    proc = inv(tmp_path, "train.pretrain", "--config", REPO / "configs" / "llama3_8b.yaml", "--set",
               "data.path=synthetic", "--gpu", "H100:2", "--nproc", "2", "--dry-run", env=ONE_THREAD, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "WARNING: the memory plan says this run will not fit: it needs about 87" in proc.stderr
    assert "refused" not in proc.stderr


def test_fit_tells_certain_from_probable(monkeypatch):
    """The line between them: the peak alone against the memory, beyond the plan's own error."""
    import envs
    from runtime.jobs import planning

    cfg = load("configs/tiny.yaml", [])
    cpu = envs.resolve(config_env=cfg.env)
    if cpu.machine.has_gpu:
        pytest.skip("a GPU is visible: the host-memory check is for machines without one")
    fp32 = planning.with_changes(cfg, **{"precision.compute": "fp32"})
    peak = memory(fp32, 1, Device("CPU", 1000.0, "cpu")).peak_bytes / planning.GIB
    for ram, certain in ((peak / 1.05, True), (peak / 1.01, False)):
        monkeypatch.setattr(planning, "host_memory_gib", lambda ram=ram: ram)
        verdict = planning.fit(cfg, cpu, 1, 1, on_this_machine=True)
        assert verdict is not None and verdict.certain is certain, (ram, verdict)
        assert ("cannot fit" if certain else "will not fit") in verdict.message
    monkeypatch.setattr(planning, "host_memory_gib", lambda: peak * 2)
    assert planning.fit(cfg, cpu, 1, 1, on_this_machine=True) is None
    assert planning.fit(cfg, cpu, 1, 1, on_this_machine=False) is None   # Slurm nodes, unseen from here


# --------------------------------------------------------------------------- tensor and context parallelism

def test_tensor_parallelism_splits_the_layers_weights_and_the_tokens():
    cfg = load(REPO / "configs" / "llama3_8b.yaml", ["parallel.strategy=fsdp", "data.batch_size=1"])
    split = load(REPO / "configs" / "llama3_8b.yaml", ["parallel.strategy=fsdp", "data.batch_size=1", "parallel.tp=8"])
    whole, tp = memory(cfg, 8, H100), memory(split, 8, H100)
    count = ParamCount.of(cfg.model)
    layers = count.total - 2 * cfg.model.vocab_size * cfg.model.dim   # the untied embedding and head stay whole
    # FSDP2 over 8 data ranks holds 1/8 of everything; tp 8 holds 1/8 of the layers and all of the rest
    assert whole.state[0].bytes == pytest.approx(4 * count.total / 8, rel=1e-3)
    assert tp.state[0].bytes == pytest.approx(4 * (layers / 8 + count.total - layers), rel=1e-2)
    # each GPU computes 1/8 of the row's tokens: the layers' activations shrink by 8 (with checkpointing)
    assert tp.activations == pytest.approx(whole.activations / 8, rel=1e-6)
    traffic = planner.parallel_traffic(split)
    # 2 all-gathers + 2 reduce-scatters of 8192 x 4096 bf16 a layer each way, 7/8 of it sent
    per_layer = 4 * 2 * 8192 * 4096 * 7 // 8
    assert traffic["tp_bytes"] > 2 * 32 * per_layer and "cp_bytes" not in traffic


def test_128k_tokens_of_llama3_8b_fit_8_h100s_with_cp_8_and_not_without():
    sets = ["parallel.strategy=fsdp", "data.batch_size=1", "data.seq_len=131072", "model.max_seq_len=131072",
            "train.kernels=true", "train.activation_checkpoint=selective_lean"]
    alone = make_plan(load(REPO / "configs" / "llama3_8b.yaml", sets), gpus=8, device=H100)
    assert alone.fits is False
    assert "--set parallel.cp=8" in alone.hints, alone.hints   # the plan's own suggestion
    split = make_plan(load(REPO / "configs" / "llama3_8b.yaml", sets + ["parallel.cp=8"]), gpus=8, device=H100)
    assert split.fits, split.verdict()
    assert "data 1 x cp 8 x tp 1" in split.strategy and split.tokens_per_step == 131072
    # the other ranks' keys and values: 2 x 8 heads x 128 x 2 bytes for 7/8 of the row, one layer at a time
    kv = planner.kv_gathered_bytes(split.cfg, 1)
    assert kv == 2 * 2 * 8 * 128 * (131072 - 131072 // 8)
    assert split.to_dict()["run"]["traffic_bytes_per_step"] == {"cp_bytes": 2 * 32 * kv}
    assert "cp 8:" in planner.render(split)


def test_a_layout_that_does_not_fit_the_gpus_is_a_config_error():
    from trainer.config import ConfigError
    cfg = load(REPO / "configs" / "llama3_8b.yaml", ["parallel.strategy=fsdp", "parallel.tp=8"])
    with pytest.raises(ConfigError, match="parallel.tp x parallel.cp: expected a divisor of the 4 process"):
        make_plan(cfg, gpus=4, device=H100)
