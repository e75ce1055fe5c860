"""trainer.profiling's step-time breakdown: the rules that name a kernel's category (CUDA and ROCm names, Inductor's
fused kernels, the host ops that launched a generic kernel), the breakdown of recorded traces (tests/trainer/traces:
steps of real GPU traces, README there), and the advice that follows from it."""
import gzip
import json
from pathlib import Path

import pytest

from trainer.profiling import advice, trace
from trainer.profiling.breakdown import breakdown, legacy_split, ms_of, row_of
from trainer.profiling.categories import KEYS, RULES, category, inductor_ops

DATA = Path(__file__).resolve().parent / "traces"


# ---------------------------------------------------------------- rules on names

@pytest.mark.parametrize("name, expected", [
    # NVIDIA H100/H200: cuBLAS, cuDNN, NCCL (BENCHMARKS.md's H200 traces, benchmarks/train_throughput.py)
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", "gemm"),
    ("nvjet_sm90_qqtst_128x128_128x6_2x1_v_bz_ovscale_TNT", "gemm_fp8"),
    ("nvjet_sm90_qrtst_128x160_128x5_1x2_h_bz_coopA_algo2_TNT", "gemm_fp8"),   # backward: an e5m2 gradient
    ("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT", "gemm"),
    ("sm90_xmma_gemm_e4m3e4m3_bf16_f32_tn_n_tilesize128x128x64", "gemm_fp8"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off", "gemm"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_7_64x128x128_4x2x1_kernel0_0", "attention"),
    ("void cutlass::device_kernel<flash::FlashAttnFwdSm90<flash::CollectiveMainloopFwd<2, 1, false>>>", "attention"),
    ("void pytorch_flash::flash_fwd_kernel<pytorch_flash::Flash_fwd_kernel_traits<128, 128, 64, 4>>", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<bfloat16_t>::Params)",
     "attention"),
    ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("void splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true, false>", "gemm"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4>>", "optimizer"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
     "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>", "loss"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>(int, float)", "norm"),
    # AMD MI300X: hipBLASLt/Tensile, CK/aiter attention, RCCL, ROCclr copies (public rocprof outputs)
    ("Cijk_Alik_Bljk_BBS_BH_Bias_HA_S_SAV_UserArgs_MT256x256x64_MI16x16x1_SN_LDSB1_GRPM1_GSU1_ISA942", "gemm"),
    ("Cijk_Ailk_Bljk_BBS_BH_Bias_HA_S_SAV_UserArgs_MT128x128x64_MI16x16x1_SN_LDSB1_GSU1_ISA942", "gemm"),
    ("Custom_Cijk_Alik_Bljk_F8B8BS_BH_Bias_HA_S_SAB_SAV_UserArgs_MT256x256x128_MI16x16x1", "gemm_fp8"),
    ("Cijk_Alik_Bljk_F8BS_BH_Bias_HA_S_SAB_SAV_UserArgs_MT256x256x64_MI16x16x1", "gemm_fp8"),
    ("aiter::fmha_bwd_hd64_bf16_causal_a16_rtne_recompile", "attention"),
    ("void ck_tile::kentry<1, ck_tile::FmhaFwdKernel<ck_tile::BlockFmhaPipelineQRKSVSAsync<>>>", "attention"),
    ("attn_fwd", "attention"),
    ("ncclDevKernel_Generic_4(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("__amd_rocclr_copyBuffer", "memory"),
    ("__amd_rocclr_fillBufferAligned", "memory"),
    ("ck::kernel_gemm_xdl_cshuffle_v3<ck::GridwiseGemm_xdl_cshuffle_v3<>>", "gemm"),
    # Anvil's own Triton kernels (kernels/*.py)
    ("_rms_norm_fwd_kernel", "norm"), ("_rms_norm_bwd_kernel", "norm"), ("_rope_kernel", "rope"),
    ("_swiglu_fwd_kernel", "activation"), ("_swiglu_bwd_kernel", "activation"),
    ("ce_row_kernel", "loss"), ("ce_row_persistent_kernel", "loss"), ("ce_split_kernel", "loss"),
    ("_adamw_kernel", "optimizer"),
    # Inductor, by the ops it fused (names from BENCHMARKS.md's FP8 traces and HTA's triton example)
    ("triton_poi_fused__scaled_mm__to_copy_clamp_clone_mul_reciprocal_t_view_6", "fp8_cast"),
    ("triton_red_fused__to_copy_abs_max_0", "fp8_cast"),
    ("triton_tem_fused_mm_0", "gemm"),
    ("triton_tem_fused__scaled_mm_3", "gemm_fp8"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_2", "norm"),
    ("triton_poi_fused_mul_silu_5", "activation"),
    ("triton_per_fused__log_softmax_nll_loss_4", "loss"),
    ("triton_poi_fused__to_copy_clone_t_view_3", "memory"),
    ("triton_poi_fused_add_cos_sin_0", "other"),
    ("triton_poi_fused_add_mul_0", "other"),
    # torch's generic kernels: their names say only that they copy or fill
    ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::"
     "direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}>>", "memory"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, at::detail::Array<char*, 1>>",
     "memory"),
    ("void fbgemm_gpu::permute_2D_lengths_kernel<int>(int, int, int const*, int const*, int*)", "other"),
])
def test_a_kernel_name_says_its_category(name, expected):
    assert category(name) == expected


def test_a_generic_kernel_takes_the_category_of_the_host_op_that_launched_it():
    elementwise = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>"
    assert category(elementwise) == "other"
    assert category(elementwise, ["aten::_foreach_add_", "Optimizer.step#AdamW.step", "ProfilerStep#3"]) == "optimizer"
    assert category(elementwise, ["aten::mul", "anvil::cross_entropy_fwd"]) == "loss"
    assert category(elementwise, ["aten::mul", "GeneratedBackwardFor_anvil_rms_norm_fwd_defaultBackward"]) == "norm"
    assert category("_sum_rows_kernel", ["anvil::rms_norm_bwd"]) == "norm"   # rms_norm's weight gradient
    assert category(elementwise, ["aten::rsqrt", "ProfilerStep#3"]) == "norm"  # eager RMSNorm
    assert category(elementwise, ["aten::silu", "ProfilerStep#3"]) == "activation"
    # aotriton's attention backward on ROCm: the name says nothing, SDPA's backward op does
    assert category("bwd_kernel_dk_dv", ["aten::_scaled_dot_product_flash_attention_backward",
                                         "ScaledDotProductFlashAttentionBackward0"]) == "attention"
    # ... but a name that says it wins over the context, and a copy is a copy wherever it runs
    assert category("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", ["Optimizer.step#AdamW.step"]) == "gemm"
    assert category("Memcpy HtoD (Pinned -> Device)", [], kind="gpu_memcpy") == "memory"


def test_every_rule_names_a_category_and_is_used_in_order():
    assert {rule.category for rule in RULES} <= set(KEYS)
    assert {rule.on for rule in RULES} == {"name", "fused", "host", "generic"}
    assert inductor_ops("triton_poi_fused_mul_silu_5") == "mul_silu" and inductor_ops("nvjet_x") is None


# ---------------------------------------------------------------- recorded traces

def _kernels(doc, prefix):
    return sum(float(e["dur"]) for e in trace.gpu_events(doc) if e["name"].startswith(prefix))


def test_a_recorded_cuda_step_is_split_by_category():
    """A100, NCCL across 8 ranks: one ProfilerStep of a real training trace."""
    doc = trace.load(DATA / "a100_dlrm_step.trace.json.gz")
    bd = breakdown(doc, steps=1)
    step_us = next(e["dur"] for e in doc["traceEvents"] if e.get("name") == "ProfilerStep#1010")
    # every NCCL kernel, and nothing else, is communication; all the cuBLAS/CUTLASS kernels are GEMMs
    assert ms_of(bd, "communication") == pytest.approx(_kernels(doc, "ncclKernel") / 1e3, abs=1e-3)
    cublas = _kernels(doc, "void cutlass::Kernel<cutlass_80_tensorop") + _kernels(doc, "void splitKreduce_kernel")
    assert ms_of(bd, "gemm") >= cublas / 1e3 - 1e-3
    assert row_of(bd, "norm")["ms"] > 0 and row_of(bd, "optimizer")["ms"] > 0 and row_of(bd, "memory")["ms"] > 0
    # exposed communication is part of all of it; the rows, communication by its exposed part, make the step
    assert 0 < bd["communication_exposed_ms"] < bd["communication_total_ms"]
    busy = sum(r["ms"] for r in bd["rows"] if r["category"] not in ("idle", "communication")) + bd["communication_exposed_ms"]
    assert bd["overlap_ms"] > 0                        # pinned host-to-device copies beside compute
    assert busy + bd["idle_ms"] - bd["overlap_ms"] == pytest.approx(bd["step_ms"], abs=0.01)
    assert bd["step_source"] == "trace" and bd["step_ms"] == pytest.approx(step_us / 1e3, rel=0.02)
    # with the measured wall time of the window, idle is that time less the GPU's busy time
    walled = breakdown(doc, steps=1, wall_ms=bd["step_ms"] + 10)
    assert walled["idle_ms"] == pytest.approx(bd["idle_ms"] + 10, abs=0.01) and walled["step_source"] == "wall"


def test_a_recorded_rocm_step_is_split_by_category():
    """MI250, ROCm 6.2 (roctracer): hipBLASLt GEMMs, SGD's multi-tensor kernel, HIP copies."""
    doc = trace.load(DATA / "mi250_rocm_step.trace.json.gz")
    bd = breakdown(doc, steps=1)
    gemms = _kernels(doc, "Cijk_")
    assert gemms > 0 and ms_of(bd, "gemm") == pytest.approx(gemms / 1e3, abs=1e-3)
    assert row_of(bd, "optimizer")["ms"] > 0          # multi_tensor_apply under Optimizer.step#SGD.step
    assert row_of(bd, "loss")["ms"] > 0               # mse_loss and its backward
    assert row_of(bd, "memory")["ms"] > 0             # hipMemcpy and fills
    assert bd["idle_ms"] > 0.9 * bd["step_ms"]         # a toy model: the GPU waits on the host
    assert [c["category"] for c in advice.candidates(bd, advice.RunSettings())] == ["idle"]


def test_the_host_ops_of_a_recorded_anvil_step_are_found():
    """Anvil's trainer on the CPU: the loop's data annotation, the optimizer step, autograd's ops."""
    doc = trace.load(DATA / "cpu_tiny_step.trace.json.gz")
    stacks = trace.HostStacks(doc)
    batch = next(e for e in doc["traceEvents"] if e.get("name") == "anvil::next_batch")
    thread = (batch["pid"], batch["tid"])
    assert stacks.at(thread, batch["ts"] + batch["dur"] / 2)[-1] == "anvil::next_batch"
    step = next(e for e in doc["traceEvents"] if e.get("name", "").startswith("Optimizer.step#"))
    inside = [e for e in doc["traceEvents"] if e.get("cat") == "cpu_op" and step["ts"] < e["ts"] < step["ts"] + step["dur"]]
    assert inside and step["name"] in stacks.at(thread, inside[0]["ts"] + 0.01)
    assert breakdown(doc, 1)["error"].startswith("no GPU kernels")


LLAMA_STEPS = sorted(DATA.glob("llama3_1b_*.trace.json.gz"))


@pytest.mark.parametrize("path", LLAMA_STEPS, ids=[p.name.split(".")[0] for p in LLAMA_STEPS])
def test_a_recorded_llama_step_with_anvils_kernels_is_named_kernel_by_kernel(path):
    """Steps of llama3_1b on an H200 (benchmarks/profile_gpu.sh cuts them): with --kernels every part of a block
    has kernels of its own; the GEMMs are the largest part, and little is left unnamed. The breakdown written
    beside each excerpt when it was cut is the one the rules give now: a rule that moves a kernel shows here."""
    bd = breakdown(trace.load(path), steps=1)
    ms = {row["category"]: row["ms"] for row in bd["rows"]}
    assert max(ms, key=ms.get) == "gemm"
    assert all(ms[k] > 0 for k in ("attention", "norm", "rope", "activation", "loss", "optimizer")), ms
    assert ms["other"] < 0.15 * bd["step_ms"]
    total = sum(v for k, v in ms.items() if k != "communication") + bd["communication_exposed_ms"] - bd["overlap_ms"]
    assert total == pytest.approx(bd["step_ms"], abs=0.01)
    recorded = json.loads(path.with_name(path.name.replace(".trace.json.gz", ".breakdown.json")).read_text())
    assert {r["category"]: r["ms"] for r in recorded["rows"]} == pytest.approx(ms, abs=1e-3)


def test_the_benchmark_split_is_the_breakdown_in_its_columns():
    doc = trace.load(DATA / "a100_dlrm_step.trace.json.gz")
    bd = breakdown(doc, 1)
    split = legacy_split(bd, step_time_s=0.08)
    assert split["matmul_ms"] == pytest.approx(ms_of(bd, "gemm") + ms_of(bd, "gemm_fp8"), abs=1e-3)
    others = [k for k in KEYS if k not in ("gemm", "gemm_fp8", "attention", "communication")]
    assert split["other_kernels_ms"] == pytest.approx(sum(ms_of(bd, k) for k in others), abs=1e-2)
    assert split["everything_else_ms"] == pytest.approx(80 - split["matmul_ms"] - split["attention_ms"]
                                                        - split["exposed_communication_ms"], abs=0.01)


def test_idle_gaps_name_what_the_host_was_doing():
    doc = trace.load(DATA / "a100_dlrm_step.trace.json.gz")
    gaps = breakdown(doc, 1)["idle_gaps"]
    assert gaps["gaps_per_step"] > 0 and gaps["by_host_op"]
    assert sum(row[2] for row in gaps["by_host_op"]) <= gaps["ms_per_step"] + 1e-6


def test_excerpt_keeps_what_the_breakdown_reads(tmp_path):
    doc = trace.load(DATA / "a100_dlrm_step.trace.json.gz")
    events = trace.gpu_events(doc)
    first, last = min(float(e["ts"]) for e in events), max(float(e["ts"]) for e in events)
    half = trace.excerpt(doc, first, (first + last) / 2)
    path = trace.write_gz(half, tmp_path / "half.trace.json.gz")
    again = trace.load(path)
    assert 0 < len(trace.gpu_events(again)) < len(events)
    assert all(set(e.get("args", {})) <= {"External id", "correlation", "device", "stream", "grid", "Sequence number",
                                          "Fwd thread id"} for e in again["traceEvents"])
    # the host ops around a kept kernel came along: its category is the same as in the whole trace
    stacks_all, stacks_half = trace.HostStacks(doc), trace.HostStacks(again)
    for e in trace.gpu_events(again)[:200]:
        whole = next(w for w in events if w["ts"] == e["ts"] and w["name"] == e["name"])
        assert category(e["name"], stacks_half.ops(e), e["cat"]) == category(whole["name"], stacks_all.ops(whole),
                                                                              whole["cat"])
    assert gzip.decompress(path.read_bytes())[:1] == b"{"


def test_a_broken_trace_is_one_clear_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(trace.TraceError, match="not a readable chrome trace"):
        trace.load(bad)
    (tmp_path / "list.json").write_text(json.dumps([{"ph": "X", "cat": "kernel", "name": "nvjet_a", "ts": 0, "dur": 5}]))
    assert ms_of(breakdown(tmp_path / "list.json", 1), "gemm") == 0.005


# ---------------------------------------------------------------- advice

def _bd(**ms):
    """A breakdown of a 100 ms step with the given ms per category."""
    rows = [{"category": k, "label": k, "ms": ms.get(k, 0.0), "share": ms.get(k, 0.0) / 100,
             **({"total_ms": ms.get("comm_total", 0.0)} if k == "communication" else {})}
            for k in (*KEYS, "idle")]
    return {"steps": 1, "step_ms": 100.0, "rows": rows, "top_by_category": {"attention": [["cudnn_sdpa", "", 20]]},
            "idle_gaps": {"by_host_op": ms.get("gaps", [])}}


def test_candidates_are_the_non_gemm_categories_over_two_percent_with_an_action():
    bd = _bd(gemm=60, attention=20, norm=5, loss=1.5, idle=8, gaps=[["ProfilerStep#4", "cudaLaunchKernel", 8, 300]])
    found = advice.candidates(bd, advice.RunSettings())
    assert [c["category"] for c in found] == ["attention", "idle", "norm"]      # largest first; no GEMM, loss under 2%
    actions = {c["category"]: c["action"] for c in found}
    assert actions["norm"].startswith("--kernels")
    assert "--compile" in actions["idle"] and "launch-bound" in actions["idle"]


def test_advice_follows_what_the_run_already_does():
    eager = advice.RunSettings()
    fused = advice.RunSettings(kernels=True, compile=True, strategy="fsdp", world_size=8, reshard_after_forward=True)
    bd = _bd(norm=5, communication=4, comm_total=30, fp8_cast=6, optimizer=3, idle=5,
             gaps=[["Optimizer.step#TritonAdamW.step", "aten::_foreach_copy_", 5, 10]])
    assert advice.action("norm", bd, eager).startswith("--kernels")
    assert "inv bench.kernels --op rms_norm" in advice.action("norm", bd, fused)
    assert "reshard_after_forward=false" in advice.action("communication", bd, fused)
    assert "batch_size" in advice.action("communication", bd, eager)          # DDP: more backward to hide behind
    assert "--compile" in advice.action("fp8_cast", bd, eager)
    assert "tensorwise" in advice.action("fp8_cast", bd, advice.RunSettings(fp8="rowwise", compile=True))
    assert "TritonAdamW" in advice.action("idle", bd, eager)                   # idle inside the optimizer step
    waiting = _bd(idle=6, gaps=[["anvil::next_batch", "anvil::next_batch", 6, 1]])
    assert "file system" in advice.action("idle", waiting, eager)
    syncing = _bd(idle=6, gaps=[["ProfilerStep#3", "cudaStreamSynchronize", 6, 1]])
    assert "reads its loss a step late" in advice.action("idle", syncing, eager)


def test_run_settings_come_from_the_config_as_used():
    cfg = {"train": {"compile": True, "kernels": False}, "precision": {"fp8": False, "params": "bf16"},
           "parallel": {"strategy": "fsdp", "reshard_after_forward": False}}
    run = advice.RunSettings.from_config(cfg, world_size=16, config="configs/llama3_8b.yaml")
    assert (run.compile, run.kernels, run.fp8, run.params, run.strategy, run.world_size, run.reshard_after_forward) \
        == (True, False, "off", "bf16", "fsdp", 16, False)


def test_idle_waiting_for_synthetic_tokens_is_not_blamed_on_the_file_system():
    """On one H200, llama3_1b on data.path=synthetic spent its idle gaps in anvil::next_batch (1.9 of
    3.0 ms a step): the host draws random tokens each step. The advice says so instead of sending the
    user to a faster file system, which it says for a prepared dataset."""
    bd = {"idle_gaps": {"by_host_op": [["anvil::next_batch", "anvil::next_batch", 1.913, 1.0],
                                       ["_RMSNormFunction", "_RMSNormFunction", 0.238, 1.0]]}}
    assert max(advice.idle_causes(bd).items(), key=lambda kv: kv[1])[0] == "data"
    synthetic = advice._idle_action(bd, advice.RunSettings(kernels=True, synthetic=True))
    dataset = advice._idle_action(bd, advice.RunSettings(kernels=True))
    assert "data.path=synthetic draws its random tokens on the host" in synthetic
    assert "local or faster file system" in dataset and "synthetic" not in dataset
    assert advice.RunSettings.from_config({"data": {"path": "synthetic"}}).synthetic
