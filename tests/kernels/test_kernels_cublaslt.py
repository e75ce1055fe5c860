"""kernels.cublaslt: the row-major to column-major mapping (emulated on CPU), the torch.mm fallback, and
on a GPU every heuristic candidate and the tuned mm against torch.mm."""
import pytest
import torch

from helpers.kernels import CUDA
from kernels import cublaslt


def view(t: torch.Tensor, transposed: bool) -> torch.Tensor:
    """t as given, or the same values as a transposed view of a contiguous tensor."""
    return t.t().contiguous().t() if transposed else t


def as_column_major(t: torch.Tensor, rows: int, cols: int, ld: int) -> torch.Tensor:
    """The [rows, cols] column-major matrix with leading dimension ld that t's memory holds."""
    base = t.as_strided((t.untyped_storage().nbytes() // t.element_size(),), (1,), 0)
    return base.as_strided((rows, cols), (1, ld), t.storage_offset())


@pytest.mark.parametrize("a_t", [False, True])
@pytest.mark.parametrize("b_t", [False, True])
def test_column_major_problem_computes_the_row_major_product(a_t, b_t):
    """What cuBLASLt computes from column_major's description (op(A) @ op(B) into D, column-major) is a @ b."""
    torch.manual_seed(0)
    m, k, n = 5, 7, 3
    a, b = view(torch.randn(m, k, dtype=torch.float64), a_t), view(torch.randn(k, n, dtype=torch.float64), b_t)
    out = torch.empty(m, n, dtype=torch.float64)
    p = cublaslt.column_major(a, b, out)

    def factor(t, rows, cols, ld, op):
        mat = as_column_major(t, rows, cols, ld)
        return mat.t() if op == cublaslt._OP_T else mat
    A, B = factor(b, *p["A"]), factor(a, *p["B"])
    assert A.shape == (p["m"], p["k"]) and B.shape == (p["k"], p["n"])
    as_column_major(out, *p["D"]).copy_(A @ B)
    torch.testing.assert_close(out, a @ b)


def test_column_major_refuses_operands_without_a_unit_stride():
    a = torch.randn(4, 8)[:, ::2]
    with pytest.raises(cublaslt.LtError, match="unit stride"):
        cublaslt.column_major(a, torch.randn(4, 3), torch.empty(4, 3))


def test_signature_tells_apart_addresses_of_lesser_alignment():
    """A kernel chosen for 256-byte aligned operands refuses a less aligned one: such a call is another signature."""
    t = torch.empty(4 * 64 + 1, dtype=torch.bfloat16)
    aligned, shifted = t[:256].view(4, 64), t[1:257].view(4, 64)
    out = torch.empty(4, 4, dtype=torch.bfloat16)
    assert cublaslt._alignment(shifted) == 2 and cublaslt._alignment(aligned) >= 16
    assert cublaslt.signature(aligned, aligned.t(), out) != cublaslt.signature(shifted, shifted.t(), out)


class RecordingPlan:
    """Stands in for a tuned cuBLASLt plan: computes what cublasLtMatmul would and records each beta."""

    def __init__(self, fail=False):
        self.betas, self.fail = [], fail

    def __call__(self, a, b, out, algo, beta=0.0):
        if self.fail:
            raise cublaslt.LtError("cuBLASLt matmul failed with status 15")
        self.betas.append(beta)
        out.copy_(a @ b + beta * out)


@pytest.fixture
def dispatch(monkeypatch):
    """mm's dispatch on CPU: every call counts as tunable, a tune returns a RecordingPlan."""
    tunes = []

    def tune(a, b, out):
        tunes.append(cublaslt.signature(a, b, out))
        torch.mm(a, b, out=out)
        return RecordingPlan(), "algo"
    monkeypatch.setattr(cublaslt, "_choices", {})
    monkeypatch.setattr(cublaslt, "_tunable", lambda a, b, out: True)
    monkeypatch.setattr(cublaslt, "_tune", tune)
    return tunes


def test_mm_tunes_on_an_overwrite_and_then_accumulates_through_the_choice(dispatch):
    torch.manual_seed(0)
    a, b = torch.randn(6, 4, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    out = torch.ones(6, 5, dtype=torch.float64)
    cublaslt.mm(a, b, out, accumulate=True)        # not tuned yet: addmm_, and no tune (it must add once)
    torch.testing.assert_close(out, 1 + a @ b)
    assert dispatch == []
    cublaslt.mm(a, b, out)                          # the overwrite tunes
    cublaslt.mm(a, b, out, accumulate=True)
    cublaslt.mm(a, b, out)                          # tuned once per signature
    cublaslt.mm(a, b, out, accumulate=True)
    torch.testing.assert_close(out, 2 * (a @ b))
    assert len(dispatch) == 1
    plan, _ = cublaslt._choices[dispatch[0]]
    assert plan.betas == [1.0, 0.0, 1.0]


def test_mm_falls_back_to_torch_for_good_when_the_choice_is_refused(dispatch, monkeypatch):
    a, b = torch.randn(3, 4, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    out = torch.empty(3, 2, dtype=torch.float64)
    key = cublaslt.signature(a, b, out)
    cublaslt._choices[key] = (RecordingPlan(fail=True), "algo")
    cublaslt.mm(a, b, out)
    torch.testing.assert_close(out, a @ b)
    assert cublaslt._choices[key] is None
    cublaslt.mm(a, b, out, accumulate=True)
    torch.testing.assert_close(out, 2 * (a @ b))


def test_mm_tunes_a_bounded_number_of_signatures(dispatch):
    b = torch.randn(4, 2, dtype=torch.float64)
    for rows in range(1, cublaslt._MAX_SIGNATURES + 4):
        a = torch.randn(rows, 4, dtype=torch.float64)
        out = torch.empty(rows, 2, dtype=torch.float64)
        cublaslt.mm(a, b, out)
        torch.testing.assert_close(out, a @ b)
    assert len(dispatch) == len(cublaslt._choices) == cublaslt._MAX_SIGNATURES


@pytest.mark.skipif(CUDA, reason="the fallback path: without CUDA")
def test_mm_without_cuda_is_torch_mm_and_addmm():
    torch.manual_seed(0)
    a, b = torch.randn(6, 4).to(torch.bfloat16), torch.randn(4, 5).to(torch.bfloat16)
    out = torch.empty(6, 5, dtype=torch.bfloat16)
    cublaslt.mm(a.t().contiguous().t(), b, out)
    assert torch.equal(out, a @ b)
    cublaslt.mm(a, b, out, accumulate=True)
    assert torch.equal(out, (a @ b) + (a @ b))
    assert not cublaslt.available() and cublaslt.choices() == {}


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_every_candidate_and_the_tuned_mm_match_torch_on_the_weight_gradient_shape():
    """gW [V, H] (+)= grad^T @ x, grad [C, V] row-major: each candidate the heuristic offers, and mm."""
    torch.manual_seed(0)
    c, h, v = 256, 512, 5003
    grad = torch.randn(c, v, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(c, h, device="cuda", dtype=torch.bfloat16)
    ref = grad.t().float() @ x.float()
    out = torch.empty(v, h, device="cuda", dtype=torch.bfloat16)
    plan = cublaslt.Matmul(grad.t(), x, out)
    candidates = plan.candidates(16)
    assert candidates
    for algo in candidates:
        out.fill_(float("nan"))
        plan(grad.t(), x, out, algo)
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-1)
        plan(grad.t(), x, out, algo, beta=1.0)
        torch.testing.assert_close(out.float(), 2 * ref, rtol=2e-2, atol=4e-1)
    out.fill_(float("nan"))
    cublaslt.mm(grad.t(), x, out)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-1)
    cublaslt.mm(grad.t(), x, out, accumulate=True)
    torch.testing.assert_close(out.float(), 2 * ref, rtol=2e-2, atol=4e-1)
    assert f"{v}x{c} @ {c}x{h} -> {v}x{h} bfloat16" in cublaslt.choices()
    # an accumulating call on a signature not tuned yet (another chunk size) adds once, through addmm_
    part = torch.full((v, h), 1.0, device="cuda", dtype=torch.bfloat16)
    cublaslt.mm(grad[:128].t(), x[:128], part, accumulate=True)
    torch.testing.assert_close(part.float(), 1 + grad[:128].t().float() @ x[:128].float(), rtol=2e-2, atol=2e-1)
    # operands at addresses 2 bytes apart from aligned ones: tuned (or torch.mm) for their own alignment
    x_odd = torch.empty(c * h + 1, device="cuda", dtype=torch.bfloat16)[1:].view(c, h).copy_(x)
    out.fill_(float("nan"))
    cublaslt.mm(grad.t(), x_odd, out)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-1)
