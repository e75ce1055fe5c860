"""benchmarks.kernels on the CPU with real (tiny) timings: ceilings, floors, ratios, the table."""
import json
import os
import subprocess
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from benchmarks import kernels as kb  # noqa: E402

from helpers.program import REPO, run_inv  # noqa: E402


def tiny_case():
    import torch.nn.functional as F

    def setup(device):
        return {"x": torch.randn(64, 2000, device=device).requires_grad_(),
                "t": torch.randint(0, 2000, (64,), device=device)}

    def eager(s):
        return lambda: F.cross_entropy(s["x"], s["t"]).backward()

    def slow(s):  # the same work and a 100 ms sleep: slower than eager even when a busy machine stalls it
        return lambda: (F.cross_entropy(s["x"], s["t"]).backward(), time.sleep(0.1))

    def missing(s):
        raise kb.Unavailable("not installed here")

    return kb.Case(op="cross_entropy", shape="64x2000", setup=setup,
                   providers={"eager": eager, "compile": slow, "liger": missing},
                   bytes_moved=2 * 64 * 2000 * 4, grad_to_none=lambda s: [s["x"]])


@pytest.fixture(scope="module")
def ceilings():
    return kb.measure_ceilings("cpu", quick=True)


def test_ceilings_are_measured(ceilings):
    assert 0.001 < ceilings.copy_tbps < 10  # TB/s of a CPU copy
    assert 1e-4 < ceilings.matmul_tflops < 100


def test_rows_ratios_and_floor(ceilings):
    rows = kb.measure_case(tiny_case(), "cpu", ceilings, quick=True)
    by = {r["provider"]: r for r in rows}
    assert [r["provider"] for r in rows] == list(kb.PROVIDERS)
    assert by["anvil"]["note"].startswith("n/a") and by["anvil"]["ms"] is None
    assert by["liger"]["note"] == "n/a: not installed here"
    eager, slow = by["eager"], by["compile"]
    assert eager["ms"] > 0 and slow["ms"] > eager["ms"]
    assert eager["ratio"] == pytest.approx(slow["ms"] / eager["ms"]) and eager["ratio"] > 1
    assert slow["ratio"] == pytest.approx(eager["ms"] / slow["ms"]) and slow["ratio"] < 1
    floor = 2 * 64 * 2000 * 4 / (ceilings.copy_tbps * 1e12) * 1e3
    assert eager["floor_ms"] == pytest.approx(floor)
    assert eager["throughput"] == pytest.approx(2 * 64 * 2000 * 4 / (eager["ms"] * 1e-3) / 1e12)
    assert eager["pct_ceiling"] == pytest.approx(100 * eager["throughput"] / ceilings.copy_tbps)
    assert eager["peak_gib"] is None  # only measured on a GPU


def test_flop_case_uses_matmul_ceiling(ceilings):
    case = tiny_case()
    case.bytes_moved, case.flops = None, 10**9
    assert ceilings.floor_ms(case) == pytest.approx(1e9 / (ceilings.matmul_tflops * 1e12) * 1e3)


def test_report_renders_and_writes(tmp_path):
    report = kb.run(device="cpu", quick=True, cases=[tiny_case()])
    text = kb.render(report)
    for header in kb.HEADERS:
        assert header in text
    assert "n/a: not installed here" in text
    out = tmp_path / "table.json"
    kb.write_atomic(str(out), json.dumps(report))
    assert json.loads(out.read_text())["rows"][1]["provider"] == "eager"


def test_unknown_op_is_a_clear_error():
    with pytest.raises(kb.KernelBenchError, match="unknown op"):
        kb.load_cases("layernorm")


def test_loss_cases_are_registered():
    cases, _ = kb.load_cases("all")
    ops = {c.op for c in cases}
    assert {"cross_entropy", "flce"} <= ops
    assert all(set(c.providers) == set(kb.PROVIDERS) for c in cases if c.op in ("cross_entropy", "flce"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_no_gpu_says_so_and_fails():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.kernels", "--op", "cross_entropy"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "needs a CUDA or ROCm GPU" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_inv("bench.kernels", "--quick", timeout=120)
    assert proc.returncode != 0
    assert "needs a CUDA or ROCm GPU" in proc.stderr + proc.stdout and "Traceback" not in proc.stderr


def test_every_case_module_loads_and_covers_the_issue_shapes():
    """A broken case module would only show on a GPU machine: load them here too."""
    from benchmarks.kernels import load_cases

    cases, notes = load_cases("all")
    assert notes == []
    assert {c.op for c in cases} == {"rms_norm", "rope", "swiglu", "cross_entropy", "flce", "grouped_gemm",
                                     "moe_permute", "router"}


def test_a_case_may_bring_its_own_providers(ceilings):
    case = tiny_case()
    case.providers["torch"] = case.providers["eager"]
    rows = kb.measure_case(case, "cpu", ceilings, quick=True)
    assert [r["provider"] for r in rows] == [*kb.PROVIDERS, "torch"] and rows[-1]["ms"] > 0


def test_moe_cases_run_at_tiny_shapes(ceilings, monkeypatch):
    """Each MoE case's anvil and eager providers on the CPU (the kernels in the interpreter)."""
    from benchmarks import cases_moe

    monkeypatch.setattr(cases_moe, "TOKENS", 24)
    tiny = cases_moe.MoeShape("tiny", 32, 16, 4, 2)
    monkeypatch.setattr(cases_moe, "SHAPES", (tiny, cases_moe.MoeShape("tiny-k1", 16, 8, 3, 1)))
    cases = [cases_moe.grouped_gemm_case(tiny, "down"), cases_moe.permute_case(tiny),
             cases_moe.router_case("tiny", 8, {"top_k": 2, "score_func": "sigmoid", "n_group": 2, "topk_group": 1},
                                   bias=True)]
    for case in cases:
        rows = kb.measure_case(case, "cpu", ceilings, quick=True, providers=("anvil", "eager"))
        assert all(r["ms"] and not r["note"] for r in rows), rows
    profile = cases_moe.permute_profile("cpu", rounds=1)
    assert sum("ms a round trip" in line for line in profile) == len(cases_moe.SHAPES)
    # the sweep's per-product rows: grouped_mm as it runs (anvil) and a config forced (c0)
    sweep = cases_moe.sweep_cases("cpu", ("input_grad", "weight_grad"), (tiny,))
    assert len(sweep) == 4 and all({"torch", "anvil", "c0"} <= set(case.providers) for case in sweep)
    for case in sweep[:2]:
        rows = kb.measure_case(case, "cpu", ceilings, quick=True, providers=("anvil", "c0"))
        assert all(r["ms"] and not r["note"] for r in rows), rows


@pytest.mark.parametrize("walk1", [False, True])
def test_ce_floor_walks_touch_what_their_labels_say(walk1):
    """benchmarks.ce_floor's skeleton: with WRITE2 every element becomes exp(x); without it only
    the row's walk-2 sum is stored (in column 0), so the rest of G is left as it was."""
    from benchmarks import ce_floor
    x = torch.randn(5, 700, device="cuda" if torch.cuda.is_available() else "cpu").to(torch.bfloat16)
    g = torch.full_like(x, 7.0)
    ce_floor.launch_walks(x, g, walk1, True, True, 2, 256, 4)
    assert torch.allclose(g.float(), x.float().exp(), rtol=1e-2)
    g = torch.full_like(x, 7.0)
    ce_floor.launch_walks(x, g, walk1, True, False, 2, 256, 4)
    assert torch.allclose(g[:, 0].float(), x.float().exp().sum(dim=1), rtol=1e-2)
    assert (g[:, 1:] == 7.0).all()
    g = torch.full_like(x, 7.0)
    ce_floor.launch_walks(x, g, walk1, False, True, 2, 256, 4)
    assert (g == 1.0).all()  # exp(0): the write-only walk reads nothing


def test_ce_floor_without_a_gpu_says_so():
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    out = subprocess.run([sys.executable, "-m", "benchmarks.ce_floor"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 2 and "needs a GPU" in out.stderr


def test_ce_floor_lm_head_loop_without_cross_entropy_is_the_gemms_alone():
    """The LM-head floor runs Anvil's own chunk loop with the cross-entropy call taken out: the
    gradients are then the GEMMs of the raw logits, and the real call is back afterwards."""
    import importlib

    from benchmarks import ce_floor
    flce = importlib.import_module("kernels.fused_linear_cross_entropy")
    real = flce.launch_ce
    x, w = torch.randn(40, 16, dtype=torch.float64), torch.randn(50, 16, dtype=torch.float64)
    target = torch.randint(0, 50, (40,))
    _, gx, gw = ce_floor.lm_head_loop(x, w, target, chunk=16, cross_entropy=False)
    logits = x @ w.t()
    torch.testing.assert_close(gx, logits @ w)
    torch.testing.assert_close(gw, logits.t() @ x)
    assert flce.launch_ce is real
    loss, gx, gw = ce_floor.lm_head_loop(x, w, target, chunk=16)
    grad_logits = (torch.softmax(logits, dim=1) - torch.nn.functional.one_hot(target, 50)) / 40
    torch.testing.assert_close(gx, grad_logits @ w)
    torch.testing.assert_close(loss.sum().double() / 40, torch.nn.functional.cross_entropy(logits, target))
    big, small, out = torch.randn(6, 4), torch.randn(5, 4), torch.empty(6, 5)
    gx, gw = torch.empty(6, 4), torch.empty(5, 4)
    ce_floor.lm_head_gemms(big, small, out, gx, gw)
    torch.testing.assert_close(gw, (big @ small.t()).t() @ big)


def test_ce_floor_table_has_a_column_per_round_and_names_the_kernels():
    from benchmarks import ce_floor
    one = ce_floor.render([{"what": "a", "ms": 1.5}, {"what": "b", "ms": 2.0}])
    assert [h.strip() for h in one.splitlines()[0].split("|")[1:-1]] == ["what", "ms"] and len(one.splitlines()) == 4
    rounds = ce_floor.render([{"what": "gemm", "ms": [1.0, 1.25, 1.5], "kernels": ["nvjet_x", "ce_row"]}])
    header, _, row, kernels = rounds.splitlines()
    assert [h.strip() for h in header.split("|")[1:-1]] == ["what", "round 1 ms", "round 2 ms", "round 3 ms"]
    assert [c.strip() for c in row.split("|")[1:-1]] == ["gemm", "1", "1.25", "1.5"]
    assert kernels == "gemm: nvjet_x, ce_row"


def test_ce_floor_gw_updates_sum_every_chunk():
    from benchmarks import ce_floor
    x, g = torch.randn(10, 3, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    gw = torch.full((5, 3), float("nan"), dtype=torch.float64)
    ce_floor.lm_head_gw_updates(x, g, gw)  # chunks of 4, 4 and 2 rows, each with g's first rows
    expected = g.t() @ x[:4] + g.t() @ x[4:8] + g[:2].t() @ x[8:]
    torch.testing.assert_close(gw, expected)


def test_ce_floor_chunk_gemms_cover_every_row():
    """The per-GEMM rows of the LM-head floor: "logits" leaves the last chunk's x_c @ W^T in the chunk
    buffer; "gx" writes grad_c @ W into every row of gx, chunks that do not divide the rows included;
    "logits V x C" writes W @ x_c^T into the chunk buffer's memory, [V, rows] contiguous."""
    from benchmarks import ce_floor
    x, w = torch.randn(10, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    buf = torch.full((4, 5), float("nan"), dtype=torch.float64)
    gx = torch.full((10, 3), float("nan"), dtype=torch.float64)
    ce_floor.lm_head_chunk_gemms(x, w, buf, gx, "logits")  # chunks of 4, 4 and 2 rows
    torch.testing.assert_close(buf[:2], x[8:] @ w.t())
    torch.testing.assert_close(buf[2:], x[6:8] @ w.t())
    ce_floor.lm_head_chunk_gemms(x, w, buf, gx, "gx")
    expected = torch.cat([buf @ w, buf @ w, buf[:2] @ w])
    torch.testing.assert_close(gx, expected)
    buf.fill_(float("nan"))
    ce_floor.lm_head_chunk_gemms(x, w, buf, gx, "logits V x C")  # the same products, transposed, same memory
    torch.testing.assert_close(buf.view(-1)[:10].view(5, 2), w @ x[8:].t())
    torch.testing.assert_close(buf.view(-1)[10:], (w @ x[4:8].t()).reshape(-1)[10:])
    logits, gw = torch.empty(10, 5, dtype=torch.float64), torch.full((5, 3), float("nan"), dtype=torch.float64)
    ce_floor.lm_head_gemms(x, w, logits, gx, gw, ("logits",))
    torch.testing.assert_close(logits, x @ w.t())
    assert gw.isnan().all()  # only the GEMM asked for ran


def test_flce_variants_compute_the_shipped_loop(monkeypatch):
    """benchmarks.flce_variants times only variants that compute what the shipped loop does: its
    Triton gW update (C tile loaded before the K loop, chunks that do not divide the vocabulary) and
    the loop built on it give the shipped gradients, poisoned outputs and all."""
    import importlib

    from benchmarks import flce_variants as fv
    flce = importlib.import_module("kernels.fused_linear_cross_entropy")
    cfg = {"BV": 16, "BH": 16, "BK": 16, "GROUP": 2, "num_warps": 4, "num_stages": 1}
    g, x = torch.randn(32, 70), torch.randn(32, 24)
    gw = torch.full((70, 24), float("nan"))
    fv.gw_update_triton(g, x, gw, False, cfg)
    torch.testing.assert_close(gw, g.t() @ x, rtol=1e-4, atol=1e-4)
    fv.gw_update_triton(g, x, gw, True, cfg)
    torch.testing.assert_close(gw, 2 * g.t() @ x, rtol=1e-4, atol=1e-4)
    x, w = torch.randn(48, 24), torch.randn(70, 24) * 0.2
    target = torch.randint(0, 70, (48,))
    shipped = flce._flce(x, w, target, torch.tensor(48.0), -100, 0.0, 0.0, True, 16, True, True)
    for variant in (None, "torch.mm gW", "tuned logits", "tuned all"):  # the tuned GEMMs are torch.mm on CPU
        for a, b in zip(fv.head_loop(x, w, target, 16, variant), shipped):
            torch.testing.assert_close(a, b)
    monkeypatch.setattr(fv, "GW_CONFIG", cfg)
    triton_gw = fv.head_loop(x, w, target, 16, "Triton gW")
    torch.testing.assert_close(triton_gw[2], shipped[2], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(triton_gw[1], shipped[1])


def test_flce_variants_without_a_gpu_says_so():
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    out = subprocess.run([sys.executable, "-m", "benchmarks.flce_variants"], cwd=REPO, capture_output=True,
                         text=True)
    assert out.returncode == 2 and "needs a GPU" in out.stderr


def test_run_times_only_the_providers_asked_for(ceilings):
    report = kb.run(device="cpu", quick=True, cases=[tiny_case()], providers=("eager",))
    assert [(r["provider"], bool(r["ms"])) for r in report["rows"]] == [("eager", True)]
