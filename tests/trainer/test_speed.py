"""The speed prediction's arithmetic (trainer.speed): each part moves with the rate it is built from, the
layouts and modes cost what they should, and every GPU model's datasheet gives a prediction."""
from __future__ import annotations

import math

import pytest

from trainer import speed
from trainer.config import load
from trainer.plan import Device, ParamCount, with_changes

from helpers.program import REPO

LLAMA_1B = REPO / "configs" / "llama3_1b.yaml"
LLAMA_8B = REPO / "configs" / "llama3_8b.yaml"


def measured(gemm=600.0, attention=400.0, gbps=2500.0, fp8=900.0, **extra) -> speed.Rates:
    """Rates of a made-up device: one rate for every GEMM shape, attention kernel and memory-bound op."""
    return speed.Rates(gpu="X", source="test", measured=True, peak_tflops=1000.0,
                       gemm_tflops={"bf16": gemm, "fp32": gemm / 8}, fp8_tflops=fp8, attention_tflops=attention,
                       hbm_gbps=gbps / speed.HBM_EFFICIENCY, launch_us=0.0, link_gbps=400.0, **extra)


def test_the_gemm_part_is_the_layers_products_at_the_gemm_rate():
    cfg = with_changes(load(LLAMA_1B), **{"data.document_mask": False})
    p = speed.predict(cfg, measured(gemm=500.0))
    count = ParamCount.of(cfg.model)
    n_tok = cfg.data.batch_size * cfg.data.seq_len
    # every weight but the norms once a token, the tied head too: 6 FLOPs a parameter and token
    norms = cfg.model.dim * (2 * cfg.model.n_layers + 1)
    expected = 6 * (count.total - norms) * n_tok / 500e12
    assert p.parts["gemm"] == pytest.approx(expected, rel=1e-6)
    assert speed.predict(cfg, measured(gemm=1000.0)).parts["gemm"] == pytest.approx(expected / 2, rel=1e-6)


def test_attention_costs_the_causal_half_forward_and_two_and_a_half_times_that_backward():
    cfg = with_changes(load(LLAMA_1B), **{"data.document_mask": False})
    m, d = cfg.model, cfg.data
    p = speed.predict(cfg, measured(attention=250.0))
    flops = m.n_layers * 2 * d.batch_size * d.seq_len * m.n_heads * 2 * m.head_dim * (d.seq_len + 1) / 2 * 3.5
    assert p.parts["attention"] == pytest.approx(flops / 250e12, rel=1e-9)


def test_checkpointing_costs_more_the_more_it_recomputes():
    cfg = load(LLAMA_1B)
    steps = {mode: speed.predict(cfg, measured(), mode=mode) for mode in ("none", "selective", "selective_lean", "full")}
    assert steps["none"].parts["recompute"] == 0
    recompute = [steps[mode].parts["recompute"] for mode in ("selective", "selective_lean", "full")]
    assert 0 < recompute[0] < recompute[1] < recompute[2]
    # full recomputes the whole forward of the layers: about a third of their products
    assert recompute[2] > steps["full"].parts["gemm"] / 3 * 0.9


def test_fp8_linears_run_at_their_own_rate_and_the_head_stays_bf16():
    cfg = with_changes(load(LLAMA_1B), **{"precision.fp8": "tensorwise"})
    slow, fast = speed.predict(cfg, measured(fp8=600.0)), speed.predict(cfg, measured(fp8=1200.0))
    bf16 = speed.predict(load(LLAMA_1B), measured())
    n_tok = cfg.data.batch_size * cfg.data.seq_len
    head = 6 * cfg.model.vocab_size * cfg.model.dim * n_tok / 600e12
    assert slow.parts["gemm"] - head == pytest.approx(2 * (fast.parts["gemm"] - head), rel=1e-6)
    assert fast.tokens_per_s_per_gpu > bf16.tokens_per_s_per_gpu


def test_ddp_hides_its_all_reduce_under_the_backward_and_fsdp_across_nodes_is_held_by_the_network():
    cfg = load(LLAMA_1B)
    one = speed.predict(cfg, measured())
    ddp = speed.predict(cfg, measured(), gpus=8)
    assert set(ddp.comm) == {"all_reduce"}
    assert 0 < ddp.parts["communication (exposed)"] < ddp.comm["all_reduce"][0]
    assert ddp.tokens_per_s_per_gpu < one.tokens_per_s_per_gpu
    fsdp = with_changes(load(LLAMA_8B), **{"parallel.strategy": "fsdp"})
    inside = speed.predict(fsdp, measured(), gpus=8)
    across = speed.predict(fsdp, measured(), gpus=8, nodes=8)
    assert "network" in across.comm["all_gather"][2] and "link" in inside.comm["all_gather"][2]
    assert across.comm["all_gather"][0] > inside.comm["all_gather"][0]
    assert across.tokens_per_s == pytest.approx(across.tokens_per_s_per_gpu * 64)


def test_expert_parallelism_adds_all_to_all_that_is_not_hidden():
    cfg = load(REPO / "configs" / "deepseek_v2_lite.yaml")
    apart = speed.predict(with_changes(cfg, **{"parallel.ep": 8}), measured(), gpus=8)
    assert "all_to_all" in apart.comm
    assert apart.parts["communication (exposed)"] >= apart.comm["all_to_all"][0]


def test_tensor_and_context_parallelism_split_the_work_and_add_their_collectives():
    cfg = with_changes(load(LLAMA_8B), **{"parallel.strategy": "fsdp", "data.batch_size": 1, "data.document_mask": False})
    one = speed.predict(with_changes(cfg, **{"parallel.strategy": "ddp"}), measured())
    for tp, cp in ((8, 1), (2, 4), (1, 8)):
        split = speed.predict(with_changes(cfg, **{"parallel.tp": tp, "parallel.cp": cp}), measured(), gpus=8)
        # one rate for every shape: a GPU runs 1/8 of the row's products and of its attention
        assert split.parts["gemm"] == pytest.approx(one.parts["gemm"] / 8, rel=1e-6)
        assert split.parts["attention"] == pytest.approx(one.parts["attention"] / 8, rel=1e-6)
        assert {"tp", "cp"} & set(split.comm) == {k for k, n in (("tp", tp), ("cp", cp)) if n > 1}
        assert split.parts["communication (exposed)"] >= sum(split.comm[k][0] for k in ("tp", "cp") if k in split.comm)
        assert split.tokens_per_step == 8192   # one data rank: the row is the step's
        assert split.tokens_per_s_per_gpu < one.tokens_per_s_per_gpu   # the collectives are not free


def test_a_device_measured_at_some_shapes_takes_the_nearest_and_the_fallback_beyond_them():
    rates = speed.Rates(gemm={"bf16": [[4096, 4096, 4096, 700.0], [128, 128, 128, 20.0]]},
                        gemm_tflops={"bf16": 500.0})
    assert rates.gemm_rate(4096, 4096, 4096, "bf16") == 700.0
    assert rates.gemm_rate(5000, 4096, 3000, "bf16") == 700.0       # within a factor of 2 in each dimension
    assert rates.gemm_rate(150, 100, 128, "bf16") == 20.0
    assert rates.gemm_rate(65536, 512, 4096, "bf16") == 500.0       # nothing near: the fallback
    with pytest.raises(speed.SpeedError):
        speed.Rates().gemm_rate(1, 1, 1, "bf16")


def test_a_newer_measurement_adds_shapes_and_replaces_the_same_ones():
    old = speed.Rates(gemm={"bf16": [[1, 2, 3, 10.0], [4, 5, 6, 20.0]]}, op_gbps={"norm/eager": 1.0})
    new = speed.Rates(gemm={"bf16": [[4, 5, 6, 30.0], [7, 8, 9, 40.0]]}, op_gbps={"rope/eager": 2.0}, hbm_gbps=9.0)
    merged = old.merged(new)
    assert sorted(map(tuple, merged.gemm["bf16"])) == [(1, 2, 3, 10.0), (4, 5, 6, 30.0), (7, 8, 9, 40.0)]
    assert merged.op_gbps == {"norm/eager": 1.0, "rope/eager": 2.0} and merged.hbm_gbps == 9.0
    # what a later measurement did not measure stays as it was
    bus = merged.merged(speed.Rates(bus_gbps={"all_reduce": 300.0}, bus_gpus=8))
    assert (bus.hbm_gbps, bus.gemm, bus.bus_gbps, bus.bus_gpus) == (9.0, merged.gemm, {"all_reduce": 300.0}, 8)
    assert speed.Rates.from_dict(merged.to_dict()) == merged


@pytest.mark.parametrize("key", ["a100", "h100", "h200", "b200", "mi210", "mi250x", "mi300x", "mi325x", "mi350x",
                                 "mi355x"])
def test_every_gpu_model_predicts_from_its_datasheet(key):
    from envs import profiles
    model = profiles.MODELS[key]
    rates = speed.datasheet(model)
    cfg = with_changes(load(LLAMA_8B), **{"parallel.strategy": "fsdp"})
    p = speed.predict(cfg, rates, gpus=8)
    assert not rates.measured and model.name in rates.source and f"profiles/{key}.py" in rates.source
    assert 0.2 < p.mfu < 0.75, p.to_dict()
    assert math.isclose(p.time_to(1e12), 1e12 / p.tokens_per_s)
    # across 8 nodes the gathers also pass a 400 Gb/s NIC a GPU: never less of them exposed
    across = speed.predict(cfg, rates, gpus=8, nodes=8)
    exposed = "communication (exposed)"
    assert across.parts[exposed] >= p.parts[exposed] > 0


def test_search_ranks_only_layouts_that_fit_fastest_first():
    cfg = with_changes(load(LLAMA_8B), **{"parallel.strategy": "fsdp", "data.batch_size": 4, "data.grad_accum": 1})
    device = Device("H100", 80, None)
    rows = speed.search(cfg, measured(), device, gpus=8, nodes=1)
    # the global batch kept: 4 rows on each of 8 data ranks, or as many over the ranks that split rows
    assert rows and all(r["batch_size"] * r["grad_accum"] * 8 // (r["tp"] * r["cp"]) == 32 for r in rows)
    assert [r["tokens_per_s_per_gpu"] for r in rows] == sorted((r["tokens_per_s_per_gpu"] for r in rows), reverse=True)
    assert all(r["needed_gib"] <= 80 for r in rows)
    assert not any(r["activation_checkpoint"] == "none" and r["batch_size"] == 4 for r in rows)   # 4 x 8192: too big


def test_search_splits_long_rows_over_ranks_where_one_gpu_cannot_hold_them():
    cfg = with_changes(load(LLAMA_8B), **{"parallel.strategy": "fsdp", "data.batch_size": 1, "data.seq_len": 131072,
                                          "train.kernels": True})
    cfg.model.max_seq_len = 131072
    rows = speed.search(cfg, measured(), Device("H100", 80, None), gpus=8, nodes=1)
    assert rows and all(r["needed_gib"] <= 80 for r in rows)
    # at selective_lean and above only a split row fits; full checkpointing fits whole rows too
    assert all(r["tp"] * r["cp"] > 1 for r in rows if r["activation_checkpoint"] != "full")
    assert any(r["tp"] * r["cp"] > 1 for r in rows)
    assert all(f"parallel.cp={r['cp']}" in r["sets"] for r in rows if r["cp"] > 1)


@pytest.mark.parametrize("text, tokens", [("1T", 1e12), ("300B", 3e11), ("2.5e9", 2.5e9), ("500m", 5e8)])
def test_token_counts_read_as_people_write_them(text, tokens):
    assert speed.parse_tokens(text) == tokens


@pytest.mark.parametrize("text", ["", "lots", "-1T", "0", "1X"])
def test_a_token_count_that_is_not_one_is_refused(text):
    with pytest.raises(speed.SpeedError):
        speed.parse_tokens(text)
