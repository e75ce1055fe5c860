"""precision.fp8 on the CPU: the config rule, the GPU check and its error, the module filter,
torchao's dtypes per GPU, and (torchao installed) the conversion of the tiny model, run in
torchao's emulation mode (float8 casts, high-precision matmuls)."""
import logging
import types

import pytest
import torch
from torch import nn

from trainer import fp8, train
from trainer.config import ConfigError, load
from core.errors import UserError
from trainer.models import _SAVE_OPS, LMHead, Transformer

try:
    import torchao.float8  # noqa: F401
    HAVE_TORCHAO = True
except Exception:  # not installed, or built for another torch
    HAVE_TORCHAO = False
needs_torchao = pytest.mark.skipif(not HAVE_TORCHAO, reason="torchao is not installed "
                                   "(pip install 'anvil[fp8]'); the filter rule is tested without it")

LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny(*sets):
    return load(None, ["data.path=synthetic", *sets])


def fake_props(monkeypatch, name="GPU", major=9, minor=0, arch=None, hip=None):
    props = types.SimpleNamespace(name=name, major=major, minor=minor, gcnArchName=arch or "")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *_a, **_k: props)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", hip)


# --------------------------------------------------------------------------- the config rule

def test_fp8_is_off_by_default_and_checked_by_the_config():
    assert tiny().precision.fp8 == "off"
    assert tiny("precision.fp8=rowwise").precision.fp8 == "rowwise"
    with pytest.raises(ConfigError, match="precision.fp8"):
        tiny("precision.fp8=e4m3")


def test_off_needs_nothing():
    fp8.check_supported(tiny(), torch.device("cpu"))  # no error, no torchao needed
    assert not fp8.enabled(tiny())


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_cpu_is_a_user_error_with_exit_2(recipe):
    with pytest.raises(fp8.Fp8Error) as err:
        fp8.check_supported(tiny(f"precision.fp8={recipe}"), torch.device("cpu"))
    assert isinstance(err.value, UserError) and err.value.exit_code == 2
    assert "precision.fp8 needs a GPU with FP8 support (sm_89+ / MI300+)" in str(err.value)
    assert "precision.fp8=off" in str(err.value)


def test_fp32_compute_is_refused_before_looking_at_the_gpu():
    cfg = tiny("precision.fp8=tensorwise", "precision.compute=fp32")
    with pytest.raises(fp8.Fp8Error, match="precision.compute=bf16"):
        fp8.check_supported(cfg, torch.device("cuda", 0))


@pytest.mark.parametrize("props, ok", [
    (dict(name="NVIDIA H100", major=9, minor=0), True),
    (dict(name="NVIDIA L40S", major=8, minor=9), True),
    (dict(name="NVIDIA B200", major=10, minor=0), True),
    (dict(name="NVIDIA A100", major=8, minor=0), False),
    (dict(name="AMD Instinct MI300X", arch="gfx942:sramecc+:xnack-", hip="6.4"), True),
    (dict(name="AMD Instinct MI355X", arch="gfx950:sramecc+:xnack-", hip="7.0"), True),
    (dict(name="AMD Instinct MI250X", arch="gfx90a:sramecc+:xnack-", hip="6.4"), False),
])
def test_which_gpus_have_fp8(monkeypatch, props, ok):
    fake_props(monkeypatch, **props)
    reason = fp8.gpu_unsupported_reason(torch.device("cuda", 0))
    assert (reason is None) == ok
    if not ok:
        assert props["name"] in reason and ("sm_80" in reason or "gfx90a" in reason)


def test_an_old_gpu_is_the_same_user_error(monkeypatch):
    fake_props(monkeypatch, name="NVIDIA A100", major=8, minor=0)
    with pytest.raises(fp8.Fp8Error, match=r"sm_89\+ / MI300\+\); NVIDIA A100 is sm_80"):
        fp8.check_supported(tiny("precision.fp8=tensorwise"), torch.device("cuda", 0))


def test_rocm_float8_types_follow_torchao(monkeypatch):
    """MI300-class (gfx940/941/942): the fnuz pair; MI350 (gfx950) and NVIDIA: OCP. Not run on AMD."""
    fake_props(monkeypatch, arch="gfx942:sramecc+:xnack-", hip="6.4")
    assert fp8.float8_dtypes() == (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
    fake_props(monkeypatch, arch="gfx950", hip="7.0")
    assert fp8.float8_dtypes() == (torch.float8_e4m3fn, torch.float8_e5m2)
    fake_props(monkeypatch, major=9, minor=0)
    assert fp8.float8_dtypes() == (torch.float8_e4m3fn, torch.float8_e5m2)


@pytest.mark.parametrize("sets, why", [
    (["train.kernels=true"], "needs precision.fp8"),
    (["precision.fp8=tensorwise"], "needs --kernels"),
    (["precision.fp8=tensorwise", "train.kernels=true", "model.vocab_size=500"], "divisible by 16, got 500"),
])
def test_the_float8_head_is_refused_where_it_cannot_run(sets, why):
    with pytest.raises(fp8.Fp8Error, match=why):
        fp8.check_supported(tiny("precision.fp8_lm_head=true", *sets), torch.device("cuda", 0))


def test_the_float8_head_needs_rowwise_scaled_gemms(monkeypatch):
    cfg = tiny("precision.fp8_lm_head=true", "precision.fp8=tensorwise", "train.kernels=true")
    fake_props(monkeypatch, name="NVIDIA L40S", major=8, minor=9)    # FP8, but no per-row scales
    with pytest.raises(fp8.Fp8Error, match="L40S is sm_89; per-row FP8 GEMM scales need sm_90"):
        fp8.check_supported(cfg, torch.device("cuda", 0))
    fake_props(monkeypatch, name="NVIDIA H100", major=9, minor=0)
    assert fp8.lm_head_unsupported_reason(torch.device("cuda", 0)) is None


def test_the_trainer_stops_on_cpu_with_exit_2(tmp_path):
    cfg = tiny("precision.fp8=tensorwise", "train.steps=2", "train.device=cpu")
    with pytest.raises(fp8.Fp8Error):
        train.build_model(cfg, train.distributed.init(cfg), logging.getLogger("test"))
    assert fp8.Fp8Error in train.user_errors()
    assert train.run(cfg, tmp_path / "run", log=logging.getLogger("test")) == 2


# --------------------------------------------------------------------------- the module filter

def test_filter_keeps_the_head_and_unaligned_layers():
    model = Transformer(tiny().model)
    chosen = [fqn for fqn, m in model.named_modules() if fp8.convert_filter(m, fqn)]
    expected = [f"model.layers.{i}.{'self_attn' if n.endswith(('q_proj', 'k_proj', 'v_proj', 'o_proj')) else 'mlp'}.{n}"
                for i in range(tiny().model.n_layers) for n in LINEARS]
    assert sorted(chosen) == sorted(expected)
    assert not fp8.convert_filter(model.lm_head, "lm_head")
    assert not fp8.convert_filter(nn.Linear(100, 64), "model.layers.0.mlp.up_proj")   # 100 % 16
    assert not fp8.convert_filter(nn.Linear(64, 200), "x")                            # 200 % 16
    assert fp8.convert_filter(nn.Linear(64, 208), "x")
    assert not fp8.convert_filter(model.model.norm, "model.norm")                     # not a Linear
    assert fp8.convert_filter(nn.Linear(64, 64), "model.layers.0.lm_head_adapter")    # name, not prefix


def test_selective_checkpointing_keeps_fp8_matmul_outputs():
    assert torch.ops.aten._scaled_mm.default in _SAVE_OPS and torch.ops.aten.mm.default in _SAVE_OPS


# --------------------------------------------------------------------------- torchao

@needs_torchao
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_convert_the_tiny_model(recipe):
    from torchao.float8.float8_linear import Float8Linear
    cfg = tiny()
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    ref = Transformer(cfg.model)
    ref.load_state_dict(model.state_dict())
    state = fp8.convert(model, recipe, emulate=True)
    assert len(state.converted) == cfg.model.n_layers * len(LINEARS)
    assert state.kept == ["lm_head"] and not state.fsdp_float8_all_gather
    assert all(isinstance(model.get_submodule(f), Float8Linear) for f in state.converted)
    assert type(model.lm_head) is LMHead                     # not converted to Float8Linear
    assert "lm_head" in state.describe() and recipe in state.describe()
    assert set(model.state_dict()) == set(ref.state_dict())      # checkpoints and export unchanged

    x = torch.randint(0, cfg.model.vocab_size, (2, 64))
    model.to(torch.bfloat16)
    ref.to(torch.bfloat16)
    loss, ref_loss = model(x, x), ref(x, x)
    loss.backward()
    assert torch.isfinite(loss) and abs(loss.item() - ref_loss.item()) / ref_loss.item() < 0.02
    grad = model.model.layers[0].mlp.down_proj.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0


@needs_torchao
def test_convert_with_the_float8_head():
    """precision.fp8_lm_head: the patched model's fused loss runs the head in float8 (the CPU runs
    torch._scaled_mm too), within float8's error of the bf16 head, and the log says so."""
    import kernels
    cfg = tiny()
    torch.manual_seed(0)
    model = kernels.patch(Transformer(cfg.model)).to(torch.bfloat16)
    ref = kernels.patch(Transformer(cfg.model)).to(torch.bfloat16)
    ref.load_state_dict(model.state_dict())
    state = fp8.convert(model, "tensorwise", emulate=True, lm_head=True)
    assert "lm_head_float8" in state.fused_inputs and "LM head's logits" in state.describe()
    x = torch.randint(0, cfg.model.vocab_size, (2, 64))
    loss, ref_loss = model(x, x), ref(x, x)
    assert loss.item() != ref_loss.item()                 # the head did run in float8
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 0.02
    loss.backward()
    assert torch.isfinite(model.model.embed_tokens.weight.grad).all()
    with pytest.raises(TypeError, match="patched by kernels.patch"):
        fp8.convert(Transformer(cfg.model), "tensorwise", emulate=True, lm_head=True)


@needs_torchao
def test_torchao_configs():
    tw = fp8.float8_config("tensorwise", fsdp=True)
    assert tw.enable_fsdp_float8_all_gather
    assert tw.cast_config_input.target_dtype == torch.float8_e4m3fn
    assert tw.cast_config_grad_output.target_dtype == torch.float8_e5m2
    rw = fp8.float8_config("rowwise", fsdp=True)   # float8 all-gather is tensorwise-only in torchao
    assert not rw.enable_fsdp_float8_all_gather and rw.round_scales_to_power_of_2
    assert rw.cast_config_weight.scaling_granularity.name == "AXISWISE"
    assert rw.cast_config_grad_output_for_grad_weight.target_dtype == torch.float8_e4m3fn
    with pytest.raises(fp8.Fp8Error):
        fp8.float8_config("mxfp8", fsdp=False)


def test_torchao_missing_is_a_user_error(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_torchao(name, *a, **k):
        if name.startswith("torchao"):
            raise ImportError("No module named 'torchao'")
        return real_import(name, *a, **k)
    fake_props(monkeypatch, major=9, minor=0)
    monkeypatch.setattr(builtins, "__import__", no_torchao)
    with pytest.raises(fp8.Fp8Error, match=r"anvil\[fp8\]"):
        fp8.check_supported(tiny("precision.fp8=tensorwise"), torch.device("cuda", 0))
