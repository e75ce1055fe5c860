"""kernels.cross_entropy against F.cross_entropy in fp64: loss and gradient, every option.

CPU: TRITON_INTERPRET=1 on small shapes. GPU: the same tests at real sizes.
Launch paths (kernels.cross_entropy._CE_MODE): the tests before test_path_* run the device's default
("persistent" on sm_90 for long rows, "row" elsewhere); test_path_* force each path. The interpreter
runs programs one after another, so a "split" program waiting for a later program of its row
would hang: on CPU "split" runs with one chunk per row (ticket, publish and wait, nothing to
wait for) and the multi-chunk combine runs as "two_pass" (same kernel, no waiting).
"persistent" runs with fewer programs than rows (the interpreter counts 2 "SMs"; a GPU 132
for 512 rows), so each program's row loop passes through ignored and scored rows.
Outputs are poisoned: torch.empty returns NaN-filled memory here (deterministic mode's
fill_uninitialized_memory), so an element the kernel never writes shows up as NaN.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402
from helpers.kernels import CUDA, CUDA_OR_CPU, rel_err  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import importlib  # noqa: E402

from kernels.cross_entropy import cross_entropy  # noqa: E402

ce = importlib.import_module("kernels.cross_entropy")  # the module (its name is also the function's)

# torch.empty NaN-filled in every test: an output element a kernel never writes shows
pytestmark = pytest.mark.usefixtures("nan_filled_empty")
ROWS = 512 if CUDA else 5
VOCABS = (32003, 128256) if CUDA else (1003, 32003)
# ||out - ref|| / ||ref|| against fp64 (grad rounding to the dtype dominates).
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def logits_and_targets(rows, vocab, dtype, ignore_every=3):
    logits = (torch.randn(rows, vocab, device=CUDA_OR_CPU) * 4).to(dtype)
    target = torch.randint(0, vocab, (rows,), device=CUDA_OR_CPU)
    target[::ignore_every] = -100
    return logits, target


def run_both(logits, target, **kw):
    ref_kw = {k: v for k, v in kw.items() if k in ("reduction", "label_smoothing", "ignore_index")}
    a = logits.clone().requires_grad_()
    b = logits.detach().double().requires_grad_()
    out = cross_entropy(a, target, **kw)
    ref = F.cross_entropy(b, target, **ref_kw)
    (out.sum() if out.dim() else out).backward()
    (ref.sum() if ref.dim() else ref).backward()
    return out, ref, a.grad, b.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_matches_torch(dtype, vocab, reduction):
    logits, target = logits_and_targets(ROWS, vocab, dtype)
    out, ref, g, g_ref = run_both(logits, target, reduction=reduction)
    assert out.dtype == dtype and out.shape == ref.shape
    assert rel_err(out, ref) < REL_TOL[dtype]
    assert rel_err(g, g_ref) < REL_TOL[dtype]
    assert g.dtype == dtype
    assert (g[target == -100] == 0).all()


def test_label_smoothing_matches_torch():
    logits, target = logits_and_targets(ROWS, VOCABS[0], torch.float32)
    out, ref, g, g_ref = run_both(logits, target, label_smoothing=0.1)
    assert rel_err(out, ref) < 1e-5 and rel_err(g, g_ref) < 1e-5


def test_z_loss_matches_formula():
    logits, target = logits_and_targets(ROWS, VOCABS[0], torch.float32)
    z = 1e-3
    a = logits.clone().requires_grad_()
    b = logits.double().requires_grad_()
    cross_entropy(a, target, z_loss=z, label_smoothing=0.05).backward()
    valid = target != -100
    lse = torch.logsumexp(b, dim=-1)
    ce = F.cross_entropy(b, target, reduction="none", label_smoothing=0.05)
    ref = ((ce + z * lse**2) * valid).sum() / valid.sum()
    ref.backward()
    out = cross_entropy(logits.clone(), target, z_loss=z, label_smoothing=0.05)
    assert rel_err(out, ref) < 1e-5 and rel_err(a.grad, b.grad) < 1e-5


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_ignored_matches_torch(reduction):
    logits, _ = logits_and_targets(ROWS, VOCABS[0], torch.float32)
    target = torch.full((ROWS,), -100, device=CUDA_OR_CPU)
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    out = cross_entropy(a, target, reduction=reduction)
    ref = F.cross_entropy(b, target, reduction=reduction)
    out.backward()
    ref.backward()
    assert torch.equal(out.isnan(), ref.isnan())  # mean: 0/0 -> nan, like torch
    if reduction == "sum":
        assert out.item() == 0.0
    assert torch.equal(a.grad, b.grad) and (a.grad == 0).all()


def test_scale_inplace_strides_over_every_block():
    """More blocks than programs (CPU: 8 programs of 1024), a partial last block; S == 1 leaves x as it was."""
    block, _ = ce.arch.elementwise_config(ce.arch.detect(torch.device(CUDA_OR_CPU)))
    programs = ce.arch.detect(torch.device(CUDA_OR_CPU)).sm_count * ce._SCALE_PROGRAMS_PER_SM
    x = torch.randn(programs * block * 3 + 17, device=CUDA_OR_CPU, dtype=torch.bfloat16)
    before = x.clone()
    ce.scale_inplace(x, torch.tensor(1.0, device=CUDA_OR_CPU))
    assert torch.equal(x, before)
    ce.scale_inplace(x, torch.tensor(0.5, device=CUDA_OR_CPU))
    assert torch.equal(x, (before.float() * 0.5).to(torch.bfloat16))


def test_upstream_gradient_scales():
    logits, target = logits_and_targets(ROWS, VOCABS[0], torch.float32)
    a, b = logits.clone().requires_grad_(), logits.double().requires_grad_()
    (cross_entropy(a, target) * 2.5).backward()
    (F.cross_entropy(b, target) * 2.5).backward()
    assert rel_err(a.grad, b.grad) < 1e-5
    a.grad, b.grad = None, None
    w = torch.rand(ROWS, device=CUDA_OR_CPU)
    (cross_entropy(a, target, reduction="none") * w).sum().backward()
    (F.cross_entropy(b, target, reduction="none") * w.double()).sum().backward()
    assert rel_err(a.grad, b.grad) < 1e-5


def test_inplace_grad_overwrites_logits_and_is_guarded():
    logits, target = logits_and_targets(ROWS, VOCABS[0], torch.bfloat16)
    ref_out, _, _, g_ref = run_both(logits, target)
    x = logits.clone().requires_grad_()
    h = x * 1.0  # non-leaf, as logits from an LM head are
    version = h._version
    out = cross_entropy(h, target, inplace_grad=True)
    assert h._version > version  # the storage now holds the gradient
    out.backward()
    assert torch.equal(h.detach(), x.grad)  # the gradient lives in the logits' own storage
    assert rel_err(out, ref_out) < 1e-2 and rel_err(x.grad, g_ref) < 1e-2
    # Something that saved the logits for its own backward fails loudly, not silently.
    w = torch.ones((), device=CUDA_OR_CPU, requires_grad=True)
    h2 = logits.clone().requires_grad_() * 1.0
    saved_it = (h2 * w).sum()  # mul saves h2 to compute w's gradient
    loss = cross_entropy(h2, target, inplace_grad=True) + saved_it
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_default_leaves_logits_untouched_and_no_grad_path():
    logits, target = logits_and_targets(ROWS, VOCABS[0], torch.float32)
    x = logits.clone().requires_grad_()
    cross_entropy(x, target).backward()
    assert torch.equal(x.detach(), logits)
    with torch.no_grad():
        out = cross_entropy(logits, target)
    assert rel_err(out, F.cross_entropy(logits.double(), target)) < 1e-5


def test_3d_noncontiguous_and_int32_targets():
    b, s, v = 2, (ROWS + 1) // 2 + 1, VOCABS[0]
    base = (torch.randn(b, v, s, device=CUDA_OR_CPU) * 3)
    logits = base.transpose(1, 2)  # [b, s, v] with stride(-1) != 1
    target = torch.randint(0, v, (b, s), device=CUDA_OR_CPU, dtype=torch.int32)
    target[0, 0] = -100
    a = logits.clone().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()  # same non-contiguous layout
    ref = F.cross_entropy(logits.double().reshape(-1, v), target.long().reshape(-1))
    out = cross_entropy(a, target)
    out.backward()
    assert rel_err(out, ref) < 1e-5
    assert a.grad.shape == a.shape and not torch.isnan(a.grad).any()


def test_num_items_divides_the_sum():
    logits, target = logits_and_targets(ROWS, VOCABS[0], torch.float32)
    out = cross_entropy(logits, target, num_items=7)
    ref = F.cross_entropy(logits.double(), target, reduction="sum") / 7
    assert rel_err(out, ref) < 1e-5


def test_compiles_without_graph_breaks():
    logits, target = logits_and_targets(ROWS, VOCABS[0], torch.float32)
    fn = torch.compile(lambda x, t: cross_entropy(x * 1.0, t, inplace_grad=True), backend="aot_eager",
                       fullgraph=True)
    a, b = logits.clone().requires_grad_(), logits.double().requires_grad_()
    out = fn(a, target)
    out.backward()
    F.cross_entropy(b, target).backward()
    assert rel_err(a.grad, b.grad) < 1e-5


def test_bad_arguments_raise_clear_errors():
    logits, target = logits_and_targets(4, 100, torch.float32)
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy(logits, target, reduction="avg")
    with pytest.raises(ValueError, match="target"):
        cross_entropy(logits, target[:3])
    with pytest.raises(TypeError, match="int64"):
        cross_entropy(logits, target.float())


# (mode, _SPLIT_BLOCK): on CPU vocab 700 -> 3 chunks of 256 in two_pass, 1 chunk in split.
# On the GPU: 128256 -> 63 x 2048, 32 x 4096, 16 x 8192 (default), 8 x 16384; 32003 -> 16/8/4/2.
# ("persistent", block, programs_per_sm, evict, group, stream_stores) of PersistentConfig: on CPU 700
# columns are 3 blocks of 256 (the last partial) or one of 1024; 2 or 4 programs for 5 rows. Group 1 is
# the per-lane update, 8 the default's grouped one.
PERSISTENT_PATHS = ([("persistent", 4096, 1, True, 1, False), ("persistent", 8192, 2, False, 1, False),
                     ("persistent", 8192, 2, True, 8, True), ("persistent", 2048, 1, True, 4, True)]
                    if CUDA else [("persistent", 256, 1, True, 1, False), ("persistent", 1024, 2, False, 1, True),
                                 ("persistent", 256, 2, True, 8, True), ("persistent", 1024, 1, False, 4, False)])
PATHS = ([("split", 2048), ("split", 4096), ("split", 8192), ("split", 16384), ("two_pass", 8192),
          ("row", None)] if CUDA else [("two_pass", 256), ("split", 1 << 15), ("row", None)]) + PERSISTENT_PATHS
PATH_VOCABS = VOCABS if CUDA else (700,)


@pytest.fixture(params=PATHS, ids=lambda p: "-".join(str(x) for x in p))
def path(request, monkeypatch):
    mode, block, *persistent = request.param
    monkeypatch.setattr(ce, "_CE_MODE", mode)
    if mode == "persistent":
        pps, evict, group, stream = persistent
        monkeypatch.setattr(ce, "_PERSIST", ce.PersistentConfig(pps, block, 32, evict, group, stream))
    elif block:
        monkeypatch.setattr(ce, "_SPLIT_BLOCK", block)
    return request.param


@pytest.mark.parametrize("vocab", PATH_VOCABS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("options", [{}, {"reduction": "none"}, {"label_smoothing": 0.1, "reduction": "sum"}])
def test_path_matches_torch(path, vocab, dtype, options):
    logits, target = logits_and_targets(ROWS, vocab, dtype)
    out, ref, g, g_ref = run_both(logits, target, **options)
    assert rel_err(out, ref) < REL_TOL[dtype]
    assert rel_err(g, g_ref) < REL_TOL[dtype]
    assert (g[target == -100] == 0).all()


def test_path_z_loss_inplace_and_no_grad(path):
    logits, target = logits_and_targets(ROWS, PATH_VOCABS[0], torch.float32)
    z, eps = 1e-3, 0.05
    b = logits.double().requires_grad_()
    valid = target != -100
    ce_ref = F.cross_entropy(b, target, reduction="none", label_smoothing=eps)
    ref = ((ce_ref + z * torch.logsumexp(b, dim=-1) ** 2) * valid).sum() / valid.sum()
    ref.backward()
    x = logits.clone().requires_grad_()
    h = x * 1.0
    out = cross_entropy(h, target, z_loss=z, label_smoothing=eps, inplace_grad=True)
    out.backward()
    assert torch.equal(h.detach(), x.grad)  # gradient written over the logits
    assert rel_err(out, ref) < 1e-5 and rel_err(x.grad, b.grad) < 1e-5
    with torch.no_grad():
        out_ng = cross_entropy(logits, target, z_loss=z, label_smoothing=eps)
    assert rel_err(out_ng, ref) < 1e-5


def test_row_one_exp_update_matches_torch(monkeypatch):
    """The row kernel's optional one-exp online update (off by default: slower on an H200)."""
    monkeypatch.setattr(ce, "_CE_MODE", "row")
    monkeypatch.setattr(ce, "_ROW_ONE_EXP", True)
    logits, target = logits_and_targets(ROWS, VOCABS[1], torch.float32)
    logits[1, : VOCABS[1] // 2] = float("-inf")  # a running max that starts at -inf lanes
    target[1] = VOCABS[1] - 1  # a finite target logit
    out, ref, g, g_ref = run_both(logits, target, label_smoothing=0.0)
    assert rel_err(out, ref) < 1e-5 and rel_err(g, g_ref) < 1e-5


@pytest.mark.parametrize("programs_per_sm", [1, 2])
def test_persistent_programs_loop_over_rows(monkeypatch, programs_per_sm):
    """Fewer programs than rows, so the tests above run each program's row loop more than once."""
    monkeypatch.setattr(ce, "_PERSIST", ce.PersistentConfig(programs_per_sm=programs_per_sm))
    programs, consts = ce.ce_persistent_config(torch.device(CUDA_OR_CPU), ROWS, PATH_VOCABS[0])
    block, group = consts["BLOCK"], consts["GROUP"]
    assert 1 <= programs < ROWS and block & (block - 1) == 0 and consts["num_warps"] >= 1
    assert 1 <= group <= block and block % group == 0
    # never more programs than rows
    assert ce.ce_persistent_config(torch.device(CUDA_OR_CPU), 1, PATH_VOCABS[0])[0] == 1


@pytest.mark.parametrize("name, n_cols, mode", [("sm_90", 128256, "persistent"), ("sm_90", 32000, "persistent"),
                                                ("sm_90", 16384, "row"), ("sm_80", 128256, "row"),
                                                ("gfx942", 128256, "row"), ("cpu", 128256, "row")])
def test_default_mode_follows_the_architecture(monkeypatch, name, n_cols, mode):
    """The persistent path only where it was measured faster (sm_90, long rows); elsewhere the row path."""
    vendor = "cpu" if name == "cpu" else "hip" if name.startswith("gfx") else "cuda"
    fake = ce.arch.Arch(vendor, name, 132, ce.arch._params_for(vendor, name))
    monkeypatch.setattr(ce.arch, "detect", lambda device=None: fake)
    monkeypatch.setattr(ce, "_CE_MODE", None)
    assert ce.ce_mode(torch.device("cpu"), n_cols) == mode


@pytest.mark.parametrize("vocab", [3, 8, 9])
def test_persistent_grouped_path_on_rows_shorter_than_its_steps(monkeypatch, vocab):
    """Rows of fewer columns than a group (3), exactly one group (8) and just over (9): BLOCK and GROUP
    shrink to the row, and the masked lanes of a partial group never win a max."""
    monkeypatch.setattr(ce, "_CE_MODE", "persistent")
    monkeypatch.setattr(ce, "_PERSIST", ce.PersistentConfig(group=8))
    logits, target = logits_and_targets(ROWS, vocab, torch.float32)
    out, ref, g, g_ref = run_both(logits, target, label_smoothing=0.1)
    assert rel_err(out, ref) < 1e-5 and rel_err(g, g_ref) < 1e-5


def test_persistent_config_follows_the_row_length_unless_one_is_set(monkeypatch):
    monkeypatch.setattr(ce, "_PERSIST", None)
    long, medium = ce.persistent_defaults(128256), ce.persistent_defaults(50304)
    assert (long.programs_per_sm, long.warps, long.block) == (2, 32, 8192)
    assert (medium.programs_per_sm, medium.warps, medium.block) == (4, 16, 4096)
    forced = ce.PersistentConfig(programs_per_sm=1)
    monkeypatch.setattr(ce, "_PERSIST", forced)
    assert ce.persistent_defaults(128256) is forced and ce.persistent_defaults(50304) is forced


@pytest.mark.parametrize("changes", [dict(group=3), dict(block=1000), dict(warps=6), dict(programs_per_sm=0)])
def test_persistent_config_refuses_what_the_kernel_cannot_take(changes):
    with pytest.raises(ValueError, match="PersistentConfig"):
        ce.PersistentConfig(**changes)


def test_unknown_mode_is_refused(monkeypatch):
    monkeypatch.setattr(ce, "_CE_MODE", "persistant")
    logits, target = logits_and_targets(4, 100, torch.float32)
    with pytest.raises(ValueError, match="persistent"):
        cross_entropy(logits, target)


def test_split_plan_covers_the_row_without_empty_chunks(monkeypatch):
    for split_block in (256, 2048, 8192, 16384):
        monkeypatch.setattr(ce, "_SPLIT_BLOCK", split_block)
        for v in (1, 700, 1003, 32003, 128256, 256000):
            n, block = ce.split_plan(v)
            assert block & (block - 1) == 0 and n * block >= v > (n - 1) * block, (split_block, v, n, block)


@pytest.mark.skipif(not CUDA, reason="races show only with programs running at once")
@pytest.mark.parametrize("split_block", [2048, 8192])
def test_split_is_deterministic_at_scale(monkeypatch, split_block):
    """Programs of a row meet through global memory: a missing ordering would show as runs that differ."""
    monkeypatch.setattr(ce, "_CE_MODE", "split")
    monkeypatch.setattr(ce, "_SPLIT_BLOCK", split_block)
    logits, target = logits_and_targets(4096, 128256, torch.bfloat16, ignore_every=7)
    outs = []
    for _ in range(3):
        a = logits.clone().requires_grad_()
        loss = cross_entropy(a, target, reduction="none")
        loss.sum().backward()
        outs.append((loss.detach(), a.grad))
    for loss, grad in outs[1:]:
        assert torch.equal(loss, outs[0][0]) and torch.equal(grad, outs[0][1])
    ref = F.cross_entropy(logits[:256].double(), target[:256], reduction="none")
    assert rel_err(outs[0][0][:256], ref) < 1e-2
