"""benchmarks.train_throughput on the CPU: variant names, the command lines it builds for
Anvil and torchtitan, the step-time breakdown of a profiler trace, the FP8 loss comparison."""
from pathlib import Path

import pytest

from benchmarks import train_throughput as tt

from helpers.program import REPO


def test_variant_names():
    assert tt.parse_variant("compile_kernels_fp32_fp8") == {
        "family": "anvil", "base": "compile_kernels", "compile": True, "kernels": True,
        "params": "fp32", "fp8": "tensorwise", "fp8_fused": True, "f8act": False, "f8head": False, "docs": None}
    assert tt.parse_variant("compile_kernels_fp32_fp8_f8act")["f8act"] is True   # float8 saved activations
    both = tt.parse_variant("compile_kernels_fp8_f8head_f8act")   # and the LM head in float8
    assert both["f8head"] is True and both["f8act"] is True
    assert tt.parse_variant("compile_f8act")["f8act"] is True
    assert tt.parse_variant("compile_kernels_fp8_f8act32")["f8act"] == 32   # its own threshold, in MiB
    assert tt.parse_variant("compile_kernels_fp8ref")["fp8_fused"] is False   # torchao's casts: the reference
    assert tt.parse_variant("titan_eager_fp8rw")["fp8"] == "rowwise"
    assert tt.parse_variant("titan_compile")["family"] == "titan"
    assert tt.parse_variant("hf_liger")["family"] == "hf"
    assert tt.parse_variant("kernels") == {"family": "anvil", "base": "kernels", "compile": False,
                                           "kernels": True, "params": "bf16", "fp8": "off",
                                           "fp8_fused": True, "f8act": False, "f8head": False, "docs": None}
    assert tt.parse_variant("compile_kernels_docs")["docs"] == "flex"        # attention inside documents
    assert tt.parse_variant("compile_kernels_fp8_docsdpa_f8act")["docs"] == "sdpa"
    for bad in ("kernels_fp8_fp32", "titan", "compile_kernels_bf16", "kernels_fp8_fp8rw", "titan_compile_fp8ref",
                "kernels_f8act", "titan_compile_f8act", "compile_f8act_fp8", "compile_kernels_f8head",
                "compile_fp8_f8head", "titan_compile_fp8_f8head", "compile_kernels_fp8_f8act_f8head",
                "compile_kernels_f8head_fp8", "compile_f8act0", "compile_f8actx", "compile_f8act32_f8act",
                "titan_compile_docs", "compile_docs_docsdpa", "compile_f8act_docs"):
        with pytest.raises(ValueError):
            tt.parse_variant(bad)


def test_each_anvil_variant_has_its_torchtitan_twin():
    assert tt.titan_counterpart("kernels") == "titan_eager"
    assert tt.titan_counterpart("compile_kernels_fp32_fp8") == "titan_compile_fp32_fp8"
    assert tt.titan_counterpart("compile_fp8rw") == "titan_compile_fp8rw"
    assert tt.titan_counterpart("compile_kernels_fp8_f8head") == "titan_compile_fp8"
    assert tt.titan_counterpart("titan_compile") is None and tt.titan_counterpart("hf_liger") is None


def test_anvil_command_line():
    args = tt.parse_args(["--nproc", "2", "--steps", "12", "--profile-steps", "2",
                          "--sets", "train.activation_checkpoint=none"])
    argv = tt.anvil_argv(args, "compile_kernels_fp32_fp8", Path("/tmp/r"))
    assert argv[1:4] == ["-m", "torch.distributed.run", "--standalone"] and "--nproc-per-node=2" in argv
    joined = " ".join(argv)
    for item in ("precision.fp8=tensorwise", "precision.params=fp32", "train.steps=14",
                 "train.activation_checkpoint=none", "--compile", "--kernels"):
        assert item in joined
    one = tt.anvil_argv(tt.parse_args([]), "kernels", Path("/tmp/r"))
    assert one[1:3] == ["-m", "trainer"] and "--compile" not in one
    assert "precision.fp8" not in " ".join(one)   # off: the config's default, not a YAML `off` (false)
    ref = " ".join(tt.anvil_argv(args, "compile_kernels_fp8ref", Path("/tmp/r")))
    assert "precision.fp8=tensorwise" in ref and "precision.fp8_fused=false" in ref
    assert "fp8_fused" not in joined and "fp8_lm_head" not in joined
    head = " ".join(tt.anvil_argv(args, "compile_kernels_fp8_f8head", Path("/tmp/r")))
    assert "precision.fp8=tensorwise" in head and "precision.fp8_lm_head=true" in head
    assert "float8_activations_min_mib" not in " ".join(tt.anvil_argv(args, "compile_f8act", Path("/tmp/r")))
    low = " ".join(tt.anvil_argv(args, "compile_f8act32", Path("/tmp/r")))
    assert "train.float8_activations=true" in low and "train.float8_activations_min_mib=32" in low
    docs = " ".join(tt.anvil_argv(args, "compile_kernels_docsdpa", Path("/tmp/r")))
    assert "data.document_mask=true" in docs and "train.attention=sdpa" in docs
    assert "data.document_mask=false" in joined     # causal, as torchtitan's and transformers' runs


def test_torchtitan_command_line_follows_anvils_config():
    args = tt.parse_args(["--config", str(REPO / "configs" / "llama3_8b.yaml"), "--batch", "1",
                          "--seq", "8192", "--steps", "12"])
    argv = tt.titan_job_args(args, "titan_compile_fp32_fp8", Path("/tmp/d"), tie=False)
    opts = dict(zip(argv[::1], argv[1:] + [""]))
    assert opts["--training.local_batch_size"] == "1" and opts["--training.seq_len"] == "8192"
    assert opts["--training.dtype"] == "float32"           # fp32 master weights, bf16 FSDP compute
    assert opts["--activation_checkpoint.mode"] == "selective"       # the 8b config's setting
    assert opts["--activation_checkpoint.selective_ac_option"] == "op"
    assert "--compile.enable" in argv and opts["--model.converters"] == "quantize.linear.float8"
    assert opts["--quantize.linear.float8.filter_fqns"] == "output"   # the head stays bf16, as in Anvil
    assert "--quantize.linear.float8.enable_fsdp_float8_all_gather" in argv
    one = tt.titan_job_args(tt.parse_args([]), "titan_eager", Path("/tmp/d"), tie=True)
    assert "--compile.enable" not in one and one[one.index("--training.dtype") + 1] == "bfloat16"
    assert one[one.index("--activation_checkpoint.mode") + 1] == "none"      # llama3_1b: none
    assert one[one.index("--model.flavor") + 1] == "tied"


def test_torchtitan_model_has_anvils_shape():
    import importlib.util
    if importlib.util.find_spec("torchtitan") is None:
        pytest.skip("torchtitan is not installed")
    import torch
    for config, seq in (("llama3_1b.yaml", 4096), ("llama3_8b.yaml", 8192), ("tiny.yaml", 256)):
        args = tt.parse_args(["--config", str(REPO / "configs" / config), "--seq", str(seq)])
        cfg = tt._train_cfg(args)
        with torch.device("meta"):
            model = tt.titan_train_spec("llama").model_cls(tt.titan_model_args(cfg.model, seq))
        assert model.layers["0"].feed_forward.w1.weight.shape == (cfg.model.ffn_dim, cfg.model.dim)
        assert tt.titan_param_count(cfg.model, seq) == tt.flops_for_shape(cfg)[0]   # a tied head once


def test_a_failed_variant_says_why(tmp_path):
    log = tmp_path / "bench.log"
    oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB"
    log.write_text("\n===== compile: python -m trainer --compile\nstep 1 loss 11.2\n"
                   f"Traceback (most recent call last):\n  File \"x.py\", line 1\n{oom}\n"
                   "\n===== compile_kernels: python -m trainer --compile --kernels\n"
                   "12:00:01 anvil.trainer ERROR out of memory: CUDA out of memory -- lower data.batch_size\n"
                   "\n===== titan_eager: python -m benchmarks.train_throughput --worker titan_eager\nstarting\n")
    assert tt.failure_reason(log, "compile", 1, 60) == oom
    assert tt.failure_reason(log, "compile_kernels", 1, 60).startswith("out of memory: CUDA out of memory")
    assert tt.failure_reason(log, "titan_eager", 1, 60) == "starting"    # no error line: the last words
    assert tt.failure_reason(log, "compile", 124, 60) == "timed out after 60 s"


def test_torchtitans_unused_imports_are_stubbed_where_they_do_not_import():
    code = ("import sys\nsys.modules['datasets'] = None   # as if not installed\n"
            "from benchmarks import train_throughput as tt\n"
            "stubbed = tt._stub_unused_imports()\n"
            "from datasets import Dataset, load_dataset\nfrom datasets.distributed import split_dataset_by_node\n"
            "from torch.utils.tensorboard import SummaryWriter\n"
            "try:\n    load_dataset('c4')\nexcept RuntimeError as exc:\n    print('stub says', exc)\n"
            "print(stubbed)\n")
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "stub says not importable here" in out.stdout and "'datasets'" in out.stdout


def test_one_flop_count_for_every_variant():
    cfg = tt._train_cfg(tt.parse_args([]))
    n, fpt = tt.flops_for_shape(cfg)
    assert n == 1_235_814_400 and fpt == 9_025_499_136   # BENCHMARKS.md: 9.025 GFLOP/token


def _kernel(name, ts, dur):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_trace_breakdown_counts_exposed_communication():
    trace = {"traceEvents": [
        _kernel("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", 0, 100),                # matmul
        _kernel("ncclDevKernel_AllGather_RING_LL", 50, 100),                          # 50 hidden, 50 exposed
        _kernel("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 160, 40),        # attention
        _kernel("triton_poi_fused_add_mul_0", 200, 20),                               # other
        _kernel("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 210, 30),              # 10 hidden, 20 exposed
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500},        # not GPU time
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 245, "dur": 5},
    ]}
    out = tt.trace_breakdown(trace, steps=1, step_time_s=300e-6)
    assert out["matmul_ms"] == 0.1 and out["attention_ms"] == 0.04
    assert out["communication_ms"] == 0.13 and out["exposed_communication_ms"] == 0.07
    assert out["other_kernels_ms"] == 0.025
    assert out["window_ms"] == 0.25 and out["idle_ms"] == 0.015   # 150..160 and 240..245
    assert out["everything_else_ms"] == pytest.approx(0.3 - 0.1 - 0.04 - 0.07)
    assert {row[0] for row in out["top_kernels"][:2]} == {"gemm", "communication"}
    assert out["top_by_category"]["gemm"] == [["nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", "", 0.1]]
    assert out["categories"]["memory"] == 0.005 and out["categories"]["other"] == 0.02
    assert tt.trace_breakdown({"traceEvents": []}, 1)["error"]


def test_trace_breakdown_lists_each_category_by_kernel_and_grid():
    trace = {"traceEvents": [dict(_kernel("nvjet_a", 0, 10), args={"grid": [4, 2, 1]}),
                             dict(_kernel("nvjet_a", 10, 30), args={"grid": [8, 1, 1]}),
                             dict(_kernel("nvjet_a", 40, 10), args={"grid": [4, 2, 1]}),
                             _kernel("triton_poi_fused_add_0", 50, 5)]}
    top = tt.trace_breakdown(trace, steps=1)["top_by_category"]
    assert top["gemm"] == [["nvjet_a", "[8, 1, 1]", 0.03], ["nvjet_a", "[4, 2, 1]", 0.02]]
    assert top["other"] == [["triton_poi_fused_add_0", "", 0.005]]


def test_idle_gaps_are_charged_to_what_the_launching_thread_was_doing():
    def host(name, ts, dur, tid, cat="cpu_op", **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": args}
    trace = {"traceEvents": [
        dict(_kernel("nvjet_a", 0, 100), args={"correlation": 1}),
        dict(_kernel("triton_poi_b", 400, 50), args={"correlation": 2}),      # after a 300 us gap
        dict(_kernel("nvjet_c", 460, 40), args={"correlation": 3}),           # a 10 us gap: under min_us
        host("Optimizer.step#TritonAdamW.step", 90, 320, tid=7, cat="user_annotation"),
        host("aten::_foreach_copy_", 150, 200, tid=7),                       # covers the gap's middle (250)
        host("cudaLaunchKernel", 395, 5, tid=7, cat="cuda_runtime", correlation=2),
        host("cudaLaunchKernel", 450, 5, tid=7, cat="cuda_runtime", correlation=3),
        host("autograd::engine::evaluate_function", 0, 500, tid=9),           # another thread: not charged
    ]}
    gaps = tt.trace_breakdown(trace, steps=1)["idle_gaps"]
    assert gaps["by_host_op"] == [["Optimizer.step#TritonAdamW.step", "aten::_foreach_copy_", 0.3, 1]]
    assert gaps["longest"] == [[300.0, "nvjet_a", "triton_poi_b", "Optimizer.step#TritonAdamW.step",
                                "aten::_foreach_copy_"]]


def test_loss_comparison():
    ref = [10 - i * 0.03 for i in range(100)]
    runs = {"compile_kernels_fp32": {"losses": ref, "val_loss": 7.0},
            "compile_kernels_fp32_fp8": {"losses": [x * 1.004 for x in ref], "val_loss": 7.02},
            "compile_kernels_fp32_fp8rw": {"losses": [x * 1.03 for x in ref], "val_loss": 7.3},
            "broken": {"error": "trainer exited with 1"}}
    rows = {r["variant"]: r for r in tt.compare_losses(runs, tolerance=0.01)}
    assert set(rows) == {"compile_kernels_fp32_fp8", "compile_kernels_fp32_fp8rw"}
    good, bad = rows["compile_kernels_fp32_fp8"], rows["compile_kernels_fp32_fp8rw"]
    assert good["within_tolerance"] and good["mean_loss_rel_diff"] == pytest.approx(0.004, abs=1e-5)
    assert not bad["within_tolerance"] and bad["reference"] == "compile_kernels_fp32"
    assert tt.compare_losses({"a": {"losses": ref}}, 0.01) == []
