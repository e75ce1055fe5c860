"""benchmarks.moe_throughput on the CPU: the tiny cases through Anvil's real trainer (one process per
variant) into results.json and the table; the schedule under a time budget, a failing variant as a
row, the eager fallback; the ratios and the goal. torchtitan's Trainer needs a CUDA GPU, so its rows
are skipped here (the rows say so), and its MoE model does not run on a CPU either (torch.histc of
int64 has no CPU kernel); where torchtitan is installed, its models are built from the mapping on
the meta device and must hold Anvil's parameters layer by layer."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import moe_throughput as mt
from helpers.program import REPO

TINY = ["--cases", "deepseek_tiny,qwen3_tiny", "--seq", "64", "--steps", "4"]


def test_tiny_cases_run_through_the_trainer_into_the_json_and_the_table(tmp_path):
    out = subprocess.run([sys.executable, "-m", "benchmarks.moe_throughput", *TINY, "--variants", "titan_eager,eager",
                          "--out", str(tmp_path), "--run-root", str(tmp_path / "runs")],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "results.json").read_text())
    rows = {(r["case"], r["variant"]): r for r in report["results"]}
    assert list(rows) == [("deepseek_tiny", "titan_eager"), ("deepseek_tiny", "eager"),
                          ("qwen3_tiny", "titan_eager"), ("qwen3_tiny", "eager")]
    for case in ("deepseek_tiny", "qwen3_tiny"):
        anvil = rows[(case, "eager")]
        assert anvil["tokens_per_s"] > 0 and len(anvil["step_times_s"]) == 4 and anvil["final_loss"] > 0
        assert anvil["params"] == report["cases"][case]["shape_check"]["anvil_params"]
        assert "train.activation_checkpoint=none" in report["cases"][case]["sets"]
        assert rows[(case, "titan_eager")]["skipped"] == "torchtitan's Trainer needs a CUDA GPU"
        assert (tmp_path / "runs" / case / "run_eager" / "metrics.jsonl").is_file()   # beside, not in --out
        assert (tmp_path / case / "bench.log").is_file() and not (tmp_path / case / "run_eager").exists()
    lines = out.stdout.splitlines()
    header = next(line for line in lines if line.startswith("| case ") and "tokens/s/GPU" in line)
    assert "vs torchtitan" in header and "memory vs torchtitan" in header and "vs no --kernels" in header
    table = [line for line in lines if line.startswith(("| deepseek_tiny ", "| qwen3_tiny "))]
    assert any("| eager " in line and "| n/a " in line for line in table)        # no GPU: no peak memory
    assert any("| titan_eager " in line and "skipped" in line for line in table)


@pytest.fixture
def checked(monkeypatch):
    """Shape checks that pass without torchtitan (the schedule's tests run no model)."""
    monkeypatch.setattr(mt, "shape_check", lambda cargs: {"anvil_params": 100, "titan_params": 100,
                                                          "rel_gap": 0.0, "ok": True})


def fake_result(tokens_per_s, peak=10.0):
    return {"tokens_per_s": tokens_per_s, "step_time_s": 1.0, "tflops": 1.0, "peak_mem_gib": peak,
            "step_times_s": [1.0] * 4}


def test_the_headline_pairs_run_first_a_failure_is_a_row_and_brings_the_eager_twins(tmp_path, checked):
    ran = []

    def run_variant(cargs, variant, out, env):
        ran.append((Path(out).name, variant, cargs.timeout))
        if (Path(out).name, variant) == ("deepseek_tiny", "titan_compile"):
            raise RuntimeError("worker exited with 1: torch._dynamo.exc.Unsupported: grouped experts")
        if (Path(out).name, variant) == ("qwen3_tiny", "compile"):   # not of the headline pair: no twins
            raise RuntimeError("trainer exited with 1: out of memory: CUDA out of memory")
        return fake_result(100.0)

    args = mt.parse_args([*TINY, "--variants", "titan_compile,compile_kernels,compile", "--timeout", "50"])
    report = mt.run_cases(args, tmp_path, run_variant=run_variant, cuda=True)
    assert [(case, variant) for case, variant, _ in ran] == [
        ("deepseek_tiny", "titan_compile"), ("deepseek_tiny", "compile_kernels"),
        ("qwen3_tiny", "titan_compile"), ("qwen3_tiny", "compile_kernels"),
        ("deepseek_tiny", "compile"), ("qwen3_tiny", "compile"),
        ("deepseek_tiny", "titan_eager"), ("deepseek_tiny", "kernels")]   # the failed case's eager pair
    assert all(timeout <= 50 for *_, timeout in ran)
    failed = report["results"][0]
    assert failed["variant"] == "titan_compile" and "grouped experts" in failed["error"]
    assert json.loads((tmp_path / "results.json").read_text())["results"] == report["results"]
    assert "failed" in mt.table(report["results"])


def test_the_budget_skips_what_would_only_time_out(tmp_path, checked):
    args = mt.parse_args([*TINY, "--budget", str(mt.MIN_VARIANT_S - 1)])
    report = mt.run_cases(args, tmp_path, run_variant=lambda *a: pytest.fail("nothing may start"), cuda=True)
    assert len(report["results"]) == 6 and all("time budget spent" in r["skipped"] for r in report["results"])


def test_a_shape_that_differs_runs_no_torchtitan_variant(tmp_path, monkeypatch):
    monkeypatch.setattr(mt, "shape_check", lambda cargs: {"anvil_params": 1000, "titan_params": 1002,
                                                          "rel_gap": 0.002, "ok": False})
    ran = []
    args = mt.parse_args([*TINY, "--cases", "qwen3_tiny", "--variants", "titan_eager,kernels"])
    report = mt.run_cases(args, tmp_path, run_variant=lambda c, v, o, e: ran.append(v) or fake_result(1.0), cuda=True)
    assert ran == ["kernels"]
    assert report["results"][0]["skipped"].startswith("shape check failed: Anvil 1,000 parameters, torchtitan 1,002")


def test_ratios_against_torchtitan_and_without_kernels_and_the_goal():
    rows = [dict(fake_result(100.0, peak=40.0), case="q", variant="titan_compile"),
            dict(fake_result(120.0, peak=36.0), case="q", variant="compile_kernels"),
            dict(fake_result(110.0, peak=44.0), case="q", variant="compile"),
            {"case": "q", "variant": "titan_eager", "error": "worker exited with 1: boom"},
            dict(fake_result(90.0), case="q", variant="kernels")]
    by = {r["variant"]: r for r in mt.comparisons(rows)}
    assert by["compile_kernels"]["vs_titan"] == pytest.approx(1.2)
    assert by["compile_kernels"]["mem_vs_titan"] == pytest.approx(0.9) and by["compile_kernels"]["goal"] is True
    assert by["compile_kernels"]["vs_plain"] == pytest.approx(120 / 110)
    assert by["compile"]["goal"] is False                       # 1.10x and more memory
    assert "vs_titan" not in by["kernels"] and "vs_titan" not in by["titan_compile"]   # its twin failed
    # the goal is against torchtitan's fastest row: an eager Anvil run against its compiled one too
    assert by["kernels"]["vs_titan_best"] == pytest.approx(0.9) and by["kernels"]["goal"] is False
    assert "vs_titan_best" not in by["titan_compile"]
    text = mt.table(rows)
    assert "| 1.20x " in text and "| 0.90x " in text and "| met " in text and "| not met " in text
    assert "worker exited with 1: boom" in text
    rows[3] = dict(fake_result(80.0, peak=50.0), case="q", variant="titan_eager")
    rows[4] = dict(fake_result(120.0, peak=39.0), case="q", variant="kernels")
    eager = {r["variant"]: r for r in mt.comparisons(rows)}["kernels"]
    assert eager["vs_titan"] == pytest.approx(1.5) and eager["vs_titan_best"] == pytest.approx(1.2)
    assert eager["goal"] is True                                # 1.2x the compiled 100, 39 GiB <= its 40
    rows[3:5] = rows[3:5][:1] + [dict(fake_result(120.0, peak=41.0), case="q", variant="kernels")]
    assert {r["variant"]: r for r in mt.comparisons(rows)}["kernels"]["goal"] is False   # more memory than 40


def test_variant_twins_and_arguments():
    assert mt.with_base("compile_kernels", mt.EAGER_BASES) == "kernels"
    assert mt.with_base("titan_compile", mt.EAGER_BASES) == "titan_eager"
    assert mt.with_base("compile_kernels_fp8", mt.EAGER_BASES) == "kernels_fp8"
    assert mt.with_base("eager", mt.EAGER_BASES) is None
    assert mt.with_base("compile_kernels", mt.PLAIN_BASES) == "compile"
    quick = mt.parse_args(["--quick"])
    assert quick.variants == mt.QUICK_VARIANTS and quick.steps == mt.QUICK_STEPS
    assert mt.parse_args(["--quick", "--steps", "9"]).steps == 9
    with pytest.raises(SystemExit):
        mt.parse_args(["--cases", "deepseek_v2_lite,llama"])
    with pytest.raises(ValueError):
        mt.parse_args(["--variants", "titan_compile,turbo"])
    args = mt.case_args(mt.parse_args(["--sets", "train.activation_checkpoint=full"]), "deepseek_v2_lite", Path("/o"))
    assert args.batch == 4 and args.seq == 4096 and args.out == "/o/deepseek_v2_lite"
    assert args.sets == ["model.n_layers=4", "train.activation_checkpoint=none", "train.activation_checkpoint=full"]


@pytest.mark.parametrize("case", list(mt.CASES))
def test_torchtitans_model_holds_anvils_parameters_layer_by_layer(case):
    import importlib.util
    if importlib.util.find_spec("torchtitan") is None:
        pytest.skip("torchtitan is not installed")
    import torch

    from benchmarks import train_throughput as tt
    from trainer.models import Transformer

    cargs = mt.case_args(mt.parse_args(["--seq", "64"]), case, Path("/o"))
    check = mt.shape_check(cargs)
    assert check["ok"] and check["rel_gap"] == 0.0
    cfg = tt._train_cfg(cargs).model
    with torch.device("meta"):
        anvil = Transformer(cfg)
        titan = tt.titan_train_spec(cfg.family).model_cls(tt.titan_model_args(cfg, 64))

    def count(module):
        return sum(p.numel() for p in module.parameters())
    for i, layer in enumerate(anvil.model.layers):
        theirs = titan.layers[str(i)]
        assert count(layer.self_attn) == count(theirs.attention)
        assert count(layer.mlp) == count(theirs.moe if theirs.moe_enabled else theirs.feed_forward)
        assert theirs.moe_enabled == cfg.moe_layer(i)
    assert count(anvil.lm_head) == count(titan.output)
