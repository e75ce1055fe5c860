"""SwiGLU kernel vs silu(gate) * up in fp64: out, dgate, dup."""

from helpers.kernels import DEVICE, DTYPES, ON_GPU, assert_close, fresh_seed, poisoned_allocations, sizes  # noqa: I001

import pytest
import torch
import torch.nn.functional as F

from kernels import SwiGLUMLP, swiglu


def compare_swiglu(gate, up, dtype):
    seed = fresh_seed()
    gate.requires_grad_(True)
    up.requires_grad_(True)
    with poisoned_allocations():
        out = swiglu(gate, up)
        dout = torch.randn_like(out)
        out.backward(dout)
    g_ref = gate.detach().double().requires_grad_(True)
    u_ref = up.detach().double().requires_grad_(True)
    out_ref = F.silu(g_ref) * u_ref
    out_ref.backward(dout.double())
    assert out.dtype == dtype
    assert_close(out, out_ref, "swiglu", dtype, "out", seed)
    assert_close(gate.grad, g_ref.grad, "swiglu", dtype, "dgate", seed)
    assert_close(up.grad, u_ref.grad, "swiglu", dtype, "dup", seed)


SHAPES = sizes(cpu=[(3, 5, 1000), (4095,), (2, 1)], gpu=[(16384, 14336), (3, 1000, 4095), (7,), (4096, 11008)])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_reference(shape, dtype):
    # gate spans silu's curved region and both tails
    gate = 4 * torch.randn(shape, device=DEVICE, dtype=dtype)
    up = torch.randn(shape, device=DEVICE, dtype=dtype)
    compare_swiglu(gate, up, dtype)


def test_non_contiguous_halves_of_a_fused_projection():
    fused = torch.randn(6, 2 * 300, device=DEVICE)
    gate, up = fused.chunk(2, dim=-1)
    compare_swiglu(gate, up, torch.float32)


def test_bad_inputs_give_clear_errors():
    with pytest.raises(ValueError, match="same shape"):
        swiglu(torch.randn(4, 8, device=DEVICE), torch.randn(4, 9, device=DEVICE))


def test_mlp_module_matches_llama_mlp():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    cfg = LlamaConfig(hidden_size=32, intermediate_size=80, hidden_act="silu")
    hf = LlamaMLP(cfg).to(DEVICE)
    ours = SwiGLUMLP(32, 80).to(DEVICE)
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(2, 3, 32, device=DEVICE)
    torch.testing.assert_close(ours(x), hf(x), atol=1e-5, rtol=1e-5)


def test_torch_compile_fullgraph_and_opcheck():
    fresh_seed()
    gate = torch.randn(4, 100, device=DEVICE, requires_grad=True)
    up = torch.randn(4, 100, device=DEVICE, requires_grad=True)
    dout = torch.randn(4, 100, device=DEVICE)
    compiled = torch.compile(swiglu, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    out_c = compiled(gate, up)
    grads_c = torch.autograd.grad(out_c, (gate, up), dout)
    out_e = swiglu(gate, up)
    grads_e = torch.autograd.grad(out_e, (gate, up), dout)
    for a, b in zip((out_c, *grads_c), (out_e, *grads_e)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    torch.library.opcheck(torch.ops.anvil.swiglu_fwd, (gate, up))
