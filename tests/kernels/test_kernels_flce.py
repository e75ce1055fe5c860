"""kernels.fused_linear_cross_entropy against matmul + F.cross_entropy in fp64.

CPU: TRITON_INTERPRET=1, small shapes, chunks that do not divide the tokens. GPU: real
sizes, and the memory test (peak grows with the chunk, not with the tokens).
Poisoned outputs: torch.empty is NaN-filled here, so unwritten elements show.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402
from helpers.kernels import CUDA, CUDA_OR_CPU, rel_err  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels.fused_linear_cross_entropy import fused_linear_cross_entropy  # noqa: E402
from kernels.loss_modules import FusedLinearCrossEntropy, causal_lm_loss  # noqa: E402

# torch.empty NaN-filled in every test: an output element a kernel never writes shows
pytestmark = pytest.mark.usefixtures("nan_filled_empty")
# (tokens, hidden, vocab, chunk)
SHAPES = [(1000, 1024, 32003, 256), (2048, 4096, 128256, None)] if CUDA else [(37, 32, 1003, 16), (9, 16, 32003, 4)]
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def hidden_weight_targets(n, h, v, dtype):
    x = torch.randn(n, h, device=CUDA_OR_CPU).to(dtype)
    w = (torch.randn(v, h, device=CUDA_OR_CPU) / h**0.5).to(dtype)
    t = torch.randint(0, v, (n,), device=CUDA_OR_CPU)
    t[::4] = -100
    return x, w, t


def check(x, w, t, dtype, chunk=None, scale=1.0, **kw):
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    xb, wb = x.double().requires_grad_(), w.double().requires_grad_()
    out = fused_linear_cross_entropy(xa, wa, t, chunk_size=chunk, **kw)
    ref = F.cross_entropy(xb @ wb.t(), t, reduction=kw.get("reduction", "mean"))
    (out * scale).backward()
    (ref * scale).backward()
    tol = REL_TOL[dtype]
    assert out.dtype == dtype
    assert rel_err(out, ref) < tol
    assert rel_err(xa.grad, xb.grad) < tol
    assert rel_err(wa.grad, wb.grad) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(dtype, shape):
    n, h, v, chunk = shape
    check(*hidden_weight_targets(n, h, v, dtype), dtype, chunk)


def test_sum_reduction_and_upstream_scale():
    n, h, v, chunk = SHAPES[0]
    check(*hidden_weight_targets(n, h, v, torch.float32), torch.float32, chunk, scale=0.3, reduction="sum")


def test_only_hidden_or_only_weight_needs_grad():
    n, h, v, chunk = SHAPES[0]
    x, w, t = hidden_weight_targets(n, h, v, torch.float32)
    xa = x.clone().requires_grad_()
    fused_linear_cross_entropy(xa, w, t, chunk_size=chunk).backward()
    xb = x.double().requires_grad_()
    F.cross_entropy(xb @ w.double().t(), t).backward()
    assert rel_err(xa.grad, xb.grad) < 1e-5
    wa = w.clone().requires_grad_()
    fused_linear_cross_entropy(x, wa, t, chunk_size=chunk).backward()
    wb = w.double().requires_grad_()
    F.cross_entropy(x.double() @ wb.t(), t).backward()
    assert rel_err(wa.grad, wb.grad) < 1e-5


def test_all_ignored_is_nan_with_zero_grads_like_torch():
    n, h, v, chunk = SHAPES[0]
    x, w, _ = hidden_weight_targets(n, h, v, torch.float32)
    t = torch.full((n,), -100, device=CUDA_OR_CPU)
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = fused_linear_cross_entropy(xa, wa, t, chunk_size=chunk)
    out.backward()
    assert out.isnan() and F.cross_entropy(x @ w.t(), t).isnan()
    assert (xa.grad == 0).all() and (wa.grad == 0).all()


def test_causal_lm_loss_matches_transformers_shift():
    n, h, v, chunk = SHAPES[0]
    b, s = 2, max(2, n // 2)
    x = torch.randn(b, s, h, device=CUDA_OR_CPU)
    w = torch.randn(v, h, device=CUDA_OR_CPU) / h**0.5
    labels = torch.randint(0, v, (b, s), device=CUDA_OR_CPU)
    labels[0, :2] = -100
    logits = (x.double() @ w.double().t())[:, :-1].reshape(-1, v)
    ref = F.cross_entropy(logits, labels[:, 1:].reshape(-1), reduction="sum") / 5
    out = causal_lm_loss(x, w, labels, num_items_in_batch=5)
    assert out.dtype == torch.float32 and rel_err(out, ref) < 1e-5
    mod = FusedLinearCrossEntropy()
    assert rel_err(mod(x[:, :-1], w, labels[:, 1:]), F.cross_entropy(logits, labels[:, 1:].reshape(-1))) < 1e-5


def test_compiles_without_graph_breaks():
    n, h, v, chunk = SHAPES[0]
    x, w, t = hidden_weight_targets(n, h, v, torch.float32)
    fn = torch.compile(lambda x, w, t: fused_linear_cross_entropy(x * 1.0, w, t, chunk_size=chunk),
                       backend="aot_eager", fullgraph=True)
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    fn(xa, wa, t).backward()
    xb, wb = x.double().requires_grad_(), w.double().requires_grad_()
    F.cross_entropy(xb @ wb.t(), t).backward()
    assert rel_err(xa.grad, xb.grad) < 1e-5 and rel_err(wa.grad, wb.grad) < 1e-5


def test_bad_arguments_raise_clear_errors():
    x, w, t = hidden_weight_targets(4, 8, 50, torch.float32)
    with pytest.raises(ValueError, match="weight must be"):
        fused_linear_cross_entropy(x, w.t(), t)
    with pytest.raises(ValueError, match="reduction"):
        fused_linear_cross_entropy(x, w, t, reduction="none")
    with pytest.raises(TypeError, match="differ"):
        fused_linear_cross_entropy(x, w.double(), t)


# --------------------------------------------------------------------------- float8 head

# (GPU: a chunk of 37 is taken as 48, so that each chunk's row scales start 16-byte aligned for cuBLASLt)
F8_SHAPES = ([(2048, 4096, 128256, None), (1000, 1024, 32000, 37)] if CUDA
             else [(37, 32, 1008, 16), (64, 48, 512, None)])


@pytest.mark.parametrize("f8", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
@pytest.mark.parametrize("shape", F8_SHAPES)
def test_float8_head_is_within_float8_error(f8, shape):
    """Loss and weight gradient near bf16's accuracy (gW stays bf16), the hidden gradient at float8's:
    an e4m3 operand carries 3 mantissa bits, so a few percent in norm."""
    if CUDA and f8 is torch.float8_e4m3fnuz:
        pytest.skip("fnuz float8 is MI300's; not this GPU")
    n, h, v, chunk = shape
    x, w, t = hidden_weight_targets(n, h, v, torch.bfloat16)
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = fused_linear_cross_entropy(xa, wa, t, chunk_size=chunk, float8=f8, loss_dtype=torch.float32)
    out.backward()
    xb, wb = x.double().requires_grad_(), w.double().requires_grad_()
    ref = F.cross_entropy(xb @ wb.t(), t)
    ref.backward()
    assert rel_err(out, ref) < 1e-2
    assert 1e-2 < rel_err(xa.grad, xb.grad) < 6e-2      # float8: 2.7e-2 here; the bf16 path: 3-4e-3
    assert rel_err(wa.grad, wb.grad) < 2e-2


def test_float8_head_row_scale_is_the_target_term():
    """The gradient row's |max| is (1 - p_target) / n, so the float8 head reads it off the loss: checked
    against the measured |max| on random logits, with ignored rows (all-zero rows, loss 0)."""
    from kernels.cross_entropy import launch_ce
    torch.manual_seed(1)
    logits = (torch.randn(40, 1000, device=CUDA_OR_CPU) * torch.linspace(0.1, 12, 40, device=CUDA_OR_CPU)[:, None])
    target = torch.randint(0, 1000, (40,), device=CUDA_OR_CPU)
    target[::5] = -100
    target[1] = logits[1].argmax()   # a confident row: the target is also the largest probability
    grad, row_loss = torch.empty_like(logits), torch.empty(40, device=CUDA_OR_CPU)
    norm = torch.tensor(35.0, device=CUDA_OR_CPU)
    launch_ce(logits, target, grad, row_loss, norm, -100, 0.0, 0.0)
    measured = grad.abs().amax(dim=1)
    assert torch.allclose(-torch.expm1(-row_loss) / norm, measured, rtol=1e-5, atol=0)


@pytest.mark.parametrize("mode", ["row", "persistent"])
@pytest.mark.parametrize("f8", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
def test_cross_entropy_writes_the_float8_gradient_as_the_cast_would(monkeypatch, mode, f8):
    """The kernel's float8 gradient and row scales are cast_rowwise's of the bf16 gradient it stores, bit
    for bit (its scale comes from the target entry, which is the measured |max|); ignored rows are zeros."""
    import importlib
    ce = importlib.import_module("kernels.cross_entropy")   # the package exports a function of that name
    from kernels.cross_entropy import launch_ce
    from kernels.float8 import cast_rowwise
    if CUDA and (f8 is torch.float8_e4m3fnuz or mode == "persistent" and ce.arch.detect(CUDA_OR_CPU).name != "sm_90"):
        pytest.skip("fnuz float8 is MI300's; the persistent path is sm_90's")
    monkeypatch.setattr(ce, "_CE_MODE", mode)
    torch.manual_seed(2)
    rows, vocab = 40, 3000
    logits = (torch.randn(rows, vocab, device=CUDA_OR_CPU) * torch.linspace(0.1, 12, rows, device=CUDA_OR_CPU)[:, None])
    logits = logits.to(torch.bfloat16)
    target = torch.randint(0, vocab, (rows,), device=CUDA_OR_CPU)
    target[::5] = -100
    target[1] = logits[1].float().argmax()   # a confident row
    grad, row_loss = torch.empty_like(logits), torch.empty(rows, device=CUDA_OR_CPU)
    g8, g8_inv = torch.empty(rows, vocab, device=CUDA_OR_CPU, dtype=f8), torch.empty(rows, 1, device=CUDA_OR_CPU)
    launch_ce(logits, target, grad, row_loss, torch.tensor(32.0, device=CUDA_OR_CPU), -100, 0.0, 0.0,
              float8_grad=(g8, g8_inv))
    ref, ref_inv = cast_rowwise(grad, f8)
    assert torch.equal(g8.view(torch.uint8), ref.view(torch.uint8))
    assert torch.equal(g8_inv[target != -100], ref_inv[target != -100])
    assert not g8[::5].float().any() and g8_inv.isfinite().all()
    with pytest.raises(ValueError, match="no z-loss"):
        launch_ce(logits, target, grad, row_loss, None, -100, 1e-4, 0.0, float8_grad=(g8, g8_inv))


def test_float8_head_fused_cast_matches_the_cast_pass(monkeypatch):
    """The float8 head with the cross-entropy kernel writing the float8 gradient gives the gradients of
    the separate cast pass (scales from the stored target entry vs expm1 of the loss: a float8 ulp apart)."""
    import importlib
    flce = importlib.import_module("kernels.fused_linear_cross_entropy")
    if CUDA and flce.arch.detect(CUDA_OR_CPU).name != "sm_90":
        pytest.skip("the float8 head needs sm_90 here")
    x, w, t = hidden_weight_targets(37, 32, 1008, torch.bfloat16)
    grads = []
    for fused in (True, False):
        monkeypatch.setattr(flce, "_FUSED_GRAD_CAST", fused)
        xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = fused_linear_cross_entropy(xa, wa, t, chunk_size=16, float8=torch.float8_e4m3fn)
        loss.backward()
        grads.append((loss.detach(), xa.grad, wa.grad))
    (l1, gx1, gw1), (l2, gx2, gw2) = grads
    assert torch.equal(l1, l2) and torch.equal(gw1, gw2)
    assert 0 < rel_err(gx1, gx2) < 2e-2 or torch.equal(gx1, gx2)


def test_float8_head_needs_aligned_weight():
    x, w, t = hidden_weight_targets(8, 16, 1000, torch.bfloat16)
    with pytest.raises(ValueError, match="multiples of 16"):
        fused_linear_cross_entropy(x, w, t, float8=torch.float8_e4m3fn)


@pytest.mark.skipif(not CUDA, reason="memory is measured on the GPU")
def test_peak_memory_grows_with_chunk_not_tokens():
    h, v = 1024, 32003

    def extra_peak(n, chunk):
        x, w, t = hidden_weight_targets(n, h, v, torch.bfloat16)
        x.requires_grad_(), w.requires_grad_()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fused_linear_cross_entropy(x, w, t, chunk_size=chunk).backward()
        torch.cuda.synchronize()
        grads = x.numel() * 2 + w.numel() * 2  # gx and gW, which any method returns
        return torch.cuda.max_memory_allocated() - base - grads

    chunk_bytes = 512 * v * 2
    small, large = extra_peak(4096, 512), extra_peak(32768, 512)
    assert large - small < chunk_bytes / 4  # 8x the tokens, the same scratch
    assert small < 1.5 * chunk_bytes
    assert extra_peak(4096, 2048) > 3 * chunk_bytes  # 4x the chunk, ~4x the scratch
