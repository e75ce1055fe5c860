"""RMSNorm and SwiGLU writing a Float8Linear's input themselves (kernels/float8.py), against today's
path as the reference: our kernel's high-precision output cast by torchao. The float8 bytes and the
scale must be the same bits, and a model trained through either path the same losses and gradients
(torchao's emulation mode: float8 casts, high-precision matmuls)."""
import pytest
import torch

from helpers.kernels import DEVICE  # noqa: I001  (first: it sets TRITON_INTERPRET without a GPU)

torchao_float8 = pytest.importorskip("torchao.float8", reason="torchao is not installed (pip install 'anvil[fp8]')")

from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic  # noqa: E402
from torchao.float8.float8_training_tensor import (Float8TrainingTensor, GemmInputRole,  # noqa: E402
                                                   LinearMMConfig, ScaledMMConfig)

from kernels import patch  # noqa: E402
from kernels.float8 import Float8Target  # noqa: E402
from kernels.patch import patch_float8_inputs  # noqa: E402
from kernels.rms_norm import rms_norm, rms_norm_float8  # noqa: E402
from kernels.swiglu import swiglu, swiglu_float8  # noqa: E402
from trainer import fp8  # noqa: E402
from trainer.config import load  # noqa: E402
from trainer.models import Transformer  # noqa: E402

# NVIDIA and MI350-class, and MI300-class (fnuz): the interpreter runs both, a GPU its own
FP8 = ([torch.float8_e4m3fn, torch.float8_e4m3fnuz] if DEVICE == "cpu" or torch.version.hip
       else [torch.float8_e4m3fn])
EMULATED = LinearMMConfig(*(ScaledMMConfig(True, False, False, False),) * 3)


def torchaos_cast(hp: torch.Tensor, dtype) -> Float8TrainingTensor:
    """`hp` cast to float8 as torchao casts a Float8Linear's input: the reference the fused kernels must match."""
    return hp_tensor_to_float8_dynamic(hp, dtype, EMULATED, gemm_input_role=GemmInputRole.INPUT)


def assert_same_float8(got, ref):
    assert isinstance(got, Float8TrainingTensor) and got._data.dtype == ref._data.dtype
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert torch.equal(got._scale, ref._scale), (got._scale, ref._scale)
    differ = got._data.view(torch.uint8) != ref._data.view(torch.uint8)
    assert not differ.any(), (f"{int(differ.sum())} of {differ.numel()} float8 values differ: "
                              f"{got._data[differ][:5].float()} vs {ref._data[differ][:5].float()}")


def sample(shape, dtype, outlier=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    if outlier is not None:      # one huge value: most of the tensor lands in float8's subnormals
        x.view(-1)[7] = outlier
    return x.to(DEVICE)


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("x_dtype,shape,outlier", [
    (torch.bfloat16, (3, 37, 96), None),          # rows not a multiple of a program's rows; H not a power of 2
    (torch.bfloat16, (2, 16, 64), 4000.0),
    (torch.float32, (5, 128), None),
])
def test_rms_norm_float8_is_torchaos_cast_of_rms_norm(fp8_dtype, x_dtype, shape, outlier):
    x = sample(shape, x_dtype, outlier)
    w = (torch.rand(shape[-1], generator=torch.Generator().manual_seed(1)) + 0.5).to(x_dtype).to(DEVICE)
    got = rms_norm_float8(x, w, 1e-5, Float8Target(fp8_dtype, EMULATED))
    assert_same_float8(got, torchaos_cast(rms_norm(x, w, 1e-5), fp8_dtype))


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("shape,outlier", [((3, 50, 96), None), ((4, 1000), 300.0), ((1, 7), None)])
def test_swiglu_float8_is_torchaos_cast_of_swiglu(fp8_dtype, shape, outlier):
    gate, up = sample(shape, torch.bfloat16, seed=2), sample(shape, torch.bfloat16, outlier, seed=3)
    got = swiglu_float8(gate, up, Float8Target(fp8_dtype, EMULATED))
    assert_same_float8(got, torchaos_cast(swiglu(gate, up), fp8_dtype))


GRAD_FP8 = ([torch.float8_e5m2, torch.float8_e5m2fnuz] if DEVICE == "cpu" or torch.version.hip
            else [torch.float8_e5m2])


@pytest.mark.parametrize("grad_dtype", GRAD_FP8)
@pytest.mark.parametrize("shape,outlier", [((3, 50, 96), None), ((4, 1000), 300.0)])
def test_swiglu_backward_float8_is_torchaos_cast_of_its_gradients(grad_dtype, shape, outlier):
    """Its backward's d gate and d up as e5m2, each with its own scale, as Float8Linear would cast them."""
    from kernels.swiglu import _backward, _backward_float8

    gate, up = sample(shape, torch.bfloat16, seed=2), sample(shape, torch.bfloat16, outlier, seed=3)
    dout = sample(shape, torch.bfloat16, seed=4)
    qg, qu, scales = _backward_float8(dout, gate, up, grad_dtype)
    for q, scale, hp in zip((qg, qu), scales, _backward(dout, gate, up)):
        ref = hp_tensor_to_float8_dynamic(hp, grad_dtype, EMULATED, gemm_input_role=GemmInputRole.GRAD_OUTPUT)
        assert torch.equal(scale, ref._scale)
        assert torch.equal(q.view(torch.uint8), ref._data.view(torch.uint8))


@pytest.mark.parametrize("shape,outlier", [((3, 50, 96), None), ((4, 1000), 300.0), ((1, 7), None)])
def test_the_stash_keeps_gate_and_up_as_block_scaled_float8(shape, outlier):
    """train.float8_activations: gate and up as e4m3, each block of the kernel's grid scaled by its own
    |max|; the float8 output from the stash and the backward from it are those of the values it holds."""
    import triton

    from kernels import arch
    from kernels.swiglu import _backward, _backward_float8, _forward_float8, _stash_gate_up

    gate, up = sample(shape, torch.bfloat16, seed=2), sample(shape, torch.bfloat16, outlier, seed=3)
    dout = sample(shape, torch.bfloat16, seed=4)
    e4m3 = torch.float8_e4m3fn
    qg, qu, scales, amax_h = _stash_gate_up(gate, up, e4m3, torch.bfloat16)
    block, _ = arch.elementwise_config(arch.detect(gate.device))
    n = gate.numel()
    assert scales.shape == (2, triton.cdiv(n, block)) and qg.dtype == qu.dtype == e4m3
    restored = []
    for v, stash, s in ((gate, qg, scales[0]), (up, qu, scales[1])):
        flat = torch.nn.functional.pad(v.float().reshape(-1), (0, s.numel() * block - n)).view(-1, block)
        amax = flat.abs().amax(dim=1)
        assert torch.allclose(s, 448.0 / amax, rtol=1e-6)       # the block's |max| lands on e4m3's largest
        want = (flat * s[:, None]).clamp(-448, 448).to(e4m3).reshape(-1)[:n]
        assert torch.equal(stash.reshape(-1).view(torch.uint8), want.view(torch.uint8))
        back = (stash.float().reshape(-1) * (1 / s).repeat_interleave(block)[:n]).view(shape)
        assert ((back - v.float()).abs() <= v.float().abs() / 16 + amax.max() / 448 * 2 ** -9).all()
        restored.append(back)
    # the output: the float8 SwiGLU (torchao's cast, test above) of the restored fp32 values, in bf16
    q, scale = _forward_float8(qg, qu, e4m3, torch.bfloat16, (scales, amax_h), torch.bfloat16)
    want_q, want_scale = _forward_float8(*restored, e4m3, torch.bfloat16)
    assert torch.equal(scale, want_scale) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    # against the output from bf16 gate and up: apart by e4m3's error in gate and up (a few percent)
    plain_q, plain_scale = _forward_float8(gate, up, e4m3, torch.bfloat16)
    got, plain = q.float() / scale, plain_q.float() / plain_scale
    assert not torch.equal(got, plain) and (got - plain).norm() <= 0.1 * plain.norm()
    for got, want in zip(_backward(dout, qg, qu, scales), _backward(dout, *restored)):   # want: fp32
        # the same fp32 values, rounded to bf16 (the interpreter truncates): within one bf16 ulp
        ulp = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 7)
        assert got.dtype == torch.bfloat16 and ((got.float() - want).abs() <= ulp).all()
    for got, want in zip(_backward_float8(dout, qg, qu, torch.float8_e5m2, scales),
                         _backward_float8(dout, *restored, torch.float8_e5m2)):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    with pytest.raises(RuntimeError, match="does not match"):
        _backward(dout, qg, qu, scales[:, :-1])
    with pytest.raises(RuntimeError, match="does not match"):
        _forward_float8(qg, qu, e4m3, torch.bfloat16, (scales[:, :-1], amax_h), torch.bfloat16)
    with pytest.raises(ValueError, match="needs the dtype"):
        _forward_float8(qg, qu, e4m3, torch.bfloat16, (scales, amax_h))


def test_nothing_is_stashed_where_no_backward_runs_and_empty_inputs_stash_nothing(monkeypatch):
    import importlib

    sw = importlib.import_module("kernels.swiglu")   # (kernels.swiglu, the attribute, is the function)

    asked = []
    real = sw._stash_gate_up
    monkeypatch.setattr(sw, "_stash_gate_up", lambda *a: asked.append(a) or real(*a))
    target = Float8Target(torch.float8_e4m3fn, EMULATED)
    gate, up = sample((4, 64), torch.bfloat16, seed=2), sample((4, 64), torch.bfloat16, seed=3)
    with torch.no_grad():
        swiglu_float8(gate, up, target, stash=True)
    swiglu_float8(gate, up, target, stash=True)                       # inputs without grad
    assert not asked
    swiglu_float8(gate.requires_grad_(), up, target, stash=True)
    assert len(asked) == 1
    empty = torch.zeros(0, 64, dtype=torch.bfloat16, device=DEVICE)
    qg, qu, scales, amax = real(empty, empty, torch.float8_e4m3fn, torch.bfloat16)
    assert qg.shape == qu.shape == (0, 64) and scales.shape == (2, 0)
    q, scale = sw._forward_float8(qg, qu, torch.float8_e4m3fn, torch.bfloat16, (scales, amax), torch.bfloat16)
    assert q.shape == (0, 64) and scale.item() == torch.tensor(448.0 / 1e-12, dtype=torch.float32).item()
    d_gate, d_up = sw._backward(empty, qg, qu, scales)
    assert d_gate.shape == d_up.shape == (0, 64) and d_gate.dtype == torch.bfloat16


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("transposed", [False, True])
def test_cast_rowwise_is_torchaos_rowwise_cast(fp8_dtype, transposed):
    """The float8 LM head's casts (kernels.float8.cast_rowwise): torchao's per-row cast, bit for bit,
    from a row-major or a transposed view (the weight read down its columns); the scale handed back
    is the one torch._scaled_mm multiplies by, 1 / torchao's."""
    from torchao.float8.config import ScalingGranularity
    from kernels.float8 import cast_rowwise
    torch.manual_seed(0)
    x = (torch.randn(70, 300, device=DEVICE) * torch.logspace(-3, 3, 70, device=DEVICE)[:, None])
    x[3] = 0.0   # an all-zero row: the amax floor
    x = x.to(torch.bfloat16)
    if transposed:
        x = x.t().contiguous().t()
    got, inv = cast_rowwise(x, fp8_dtype)
    ref = hp_tensor_to_float8_dynamic(x, fp8_dtype, EMULATED, gemm_input_role=GemmInputRole.INPUT,
                                      scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=-1)
    assert got.is_contiguous() and inv.shape == (70, 1)
    assert torch.equal(inv, ref._scale.reciprocal())
    assert torch.equal(got.view(torch.uint8), ref._data.view(torch.uint8))
    low, _ = cast_rowwise(x, fp8_dtype, amax=x.float().abs().amax(1) / 2)   # a given amax: beyond it, saturate
    assert low.float().abs().max() == torch.finfo(fp8_dtype).max


def test_all_zero_and_empty_inputs_give_torchaos_scale():
    target = Float8Target(torch.float8_e4m3fn, EMULATED)
    zeros = torch.zeros(4, 64, dtype=torch.bfloat16, device=DEVICE)
    w = torch.ones(64, dtype=torch.bfloat16, device=DEVICE)
    assert_same_float8(rms_norm_float8(zeros, w, 1e-5, target), torchaos_cast(rms_norm(zeros, w, 1e-5), target.dtype))
    assert_same_float8(swiglu_float8(zeros, zeros, target), torchaos_cast(swiglu(zeros, zeros), target.dtype))
    empty = torch.zeros(0, 64, dtype=torch.bfloat16, device=DEVICE)
    assert rms_norm_float8(empty, w, 1e-5, target).shape == (0, 64)


def test_gradients_reach_the_norm_and_swiglu_inputs_unchanged():
    """Into a torchao Float8Linear: the float8 tensor's gradient is the high-precision one, as through
    torchao's own cast, and the weight gradient (which reuses the float8 input) is the same bits."""
    from torchao.float8 import convert_to_float8_training

    from kernels.float8 import target_of

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False)).to(torch.bfloat16).to(DEVICE)
    convert_to_float8_training(net, config=fp8.float8_config("tensorwise", fsdp=False, emulate=True))
    linear = net[0]
    target = target_of(linear)
    assert target is not None and target.dtype == torch.float8_e4m3fn
    x = sample((2, 8, 64), torch.bfloat16).requires_grad_()
    w = torch.ones(64, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    gate, up = (sample((2, 8, 64), torch.bfloat16, seed=s).requires_grad_() for s in (6, 7))
    grads = []
    for fused in (True, False):
        for t in (x, w, gate, up, linear.weight):
            t.grad = None
        y = rms_norm_float8(x, w, 1e-5, target) if fused else rms_norm(x, w, 1e-5)
        h = swiglu_float8(gate, up, target) if fused else swiglu(gate, up)
        (linear(y).float().square().sum() + linear(h).float().square().sum()).backward()
        grads.append([t.grad.clone() for t in (x, w, gate, up, linear.weight)])
    for name, a, b in zip(("x", "w", "gate", "up", "linear weight"), *grads):
        assert torch.equal(a, b), name


@pytest.fixture
def deterministic():
    """On a GPU, RMSNorm's backward sums dW with atomics in any order unless deterministic mode is on."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(was)


# Two layers: enough to count sites per layer; the interpreter makes every layer cost seconds.
# The compiled tests take one: the layers share one compiled graph, so a second adds time, not cases.
SMALL = ["data.path=synthetic", "model.n_layers=2"]


def _tiny_fp8_model(fuse: bool, recipe="tensorwise", stash=False, layers=2):
    cfg = load(None, [*SMALL, f"model.n_layers={layers}"])
    torch.manual_seed(0)
    model = Transformer(cfg.model).to(torch.bfloat16).to(DEVICE)
    model.model.rotary_emb.reset_parameters()
    patch(model)
    state = fp8.convert(model, recipe, emulate=True, fuse_inputs=fuse, stash=stash)
    return cfg, model, state


def test_a_model_trains_the_same_through_the_fused_inputs(deterministic):
    # one layer, two steps: the second already runs on weights the first step's fused gradients updated
    cfg, fused, state = _tiny_fp8_model(True, layers=1)
    _, plain, plain_state = _tiny_fp8_model(False, layers=1)
    n = cfg.model.n_layers
    assert state.fused_inputs.count("rms_norm_float8") == 2 * n and state.fused_inputs.count("swiglu_float8") == n
    assert state.fused_inputs.count("swiglu_float8_grads") == n
    assert f"{2 * n} RMSNorm, {n} SwiGLU (and its gradients)" in state.describe() and not plain_state.fused_inputs
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    losses = []
    for model in (fused, plain):
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        steps = []
        for _ in range(2):
            opt.zero_grad()
            loss = model(tokens, tokens)
            loss.backward()
            opt.step()
            steps.append(loss.item())
        losses.append(steps)
    assert losses[0] == losses[1], losses
    for (name, a), b in zip(fused.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_the_final_norm_and_rowwise_layers_keep_torchaos_casts():
    _, model, _ = _tiny_fp8_model(True)
    assert "forward" not in vars(model.model.norm) or not hasattr(model.model.norm, "_anvil_float8_target")
    _, rowwise, state = _tiny_fp8_model(True, recipe="rowwise")
    assert state.fused_inputs == [] and not hasattr(rowwise.model.layers[0].input_layernorm, "_anvil_float8_target")
    with pytest.raises(TypeError, match="not trainer.models.Transformer"):
        patch_float8_inputs(torch.nn.Linear(4, 4))


def test_under_torch_compile_the_fused_inputs_train_as_torchaos_casts(deterministic):
    """The decoder layers compiled (Inductor on the CPU; our kernels stay custom ops): the same loss
    and gradients, bit for bit, as compiled layers with torchao's casts."""
    cfg, fused, _ = _tiny_fp8_model(True, layers=1)
    _, plain, _ = _tiny_fp8_model(False, layers=1)
    for layer in [*fused.model.layers, *plain.model.layers]:
        layer.compile()
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    losses = []
    for model in (fused, plain):
        loss = model(tokens, tokens)
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == losses[1]
    for (name, a), b in zip(fused.named_parameters(), plain.parameters()):
        assert torch.equal(a.grad, b.grad), name


@pytest.mark.parametrize("mode", ["selective", "none"])
def test_with_the_stash_compiled_layers_keep_float8_instead_of_gate_and_up(deterministic, mode):
    """Compiled layers under `selective` and `none`: with the stash, backward holds gate and up only as
    float8 (the bf16 projections are neither kept nor recomputed, SwiGLU's output is rebuilt from the
    stash: under `none` through the MLP's rebuild region), and training follows the plain run within
    e4m3's precision."""
    cfg, stashed, state = _tiny_fp8_model(True, stash=True, layers=1)
    _, plain, _ = _tiny_fp8_model(True, layers=1)
    n, ffn = cfg.model.n_layers, cfg.model.ffn_dim
    assert state.fused_inputs.count("swiglu_float8_stash") == n and "keeps gate and up in float8" in state.describe()
    assert all(layer.mlp.stashes for layer in stashed.model.layers)
    for layer in [*stashed.model.layers, *plain.model.layers]:
        layer.activation_checkpoint = mode
        layer.compile()
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    kept, losses, grads = [], [], []
    for model in (stashed, plain):
        wide: dict = {}

        def pack(t, wide=wide):
            if t.dim() and t.shape[-1] == ffn and t.numel() == 2 * 32 * ffn:     # a tokens x ffn_dim activation
                wide[t.dtype] = wide.get(t.dtype, 0) + 1
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(tokens, tokens)
        loss.backward()
        kept.append(wide)
        losses.append(loss.item())
        grads.append([p.grad.float() for p in model.parameters()])
    # the stash's gate and up, not SwiGLU's float8 output (rebuilt from the stash for down's backward)
    assert kept[0] == {torch.float8_e4m3fn: 2 * n}, kept[0]
    assert kept[1].get(torch.bfloat16, 0) >= 2 * n, kept[1]       # plain layers keep gate and up
    assert abs(losses[0] - losses[1]) < 1e-3 * abs(losses[1])     # the forward's SwiGLU reads the stash too
    # e4m3 keeps 3 mantissa bits of gate and up; through random layers the weight gradients move by
    # up to 10% (layer 0's k_proj on an H200); a wrong scale or block would move them by their size
    for (name, _), a, b in zip(stashed.named_parameters(), *grads):
        assert (a - b).norm() <= 0.2 * b.norm() + 1e-6, name


def test_under_fsdp2_with_float8_all_gather_the_fused_inputs_train_the_same():
    """Two gloo ranks under torchrun: FSDP2 shards the layers, torchao all-gathers the weights in float8;
    the fused inputs give the same losses as torchao's casts, step for step."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from helpers.program import REPO

    if DEVICE != "cpu":
        pytest.skip("the two-rank check runs on gloo through the interpreter")
    here = Path(__file__).resolve().parent
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          str(here / "float8_fsdp_run.py")], capture_output=True, text=True, timeout=600,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(result["fused"]) == 2 and result["fused"] == result["plain"], result
    assert result["sites"].count("swiglu_float8_grads") == load(None, SMALL).model.n_layers == 2
