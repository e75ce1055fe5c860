"""train.float8_activations: saved activations kept in float8 between forward and backward
(trainer/saved_activations.py), on CPU through Inductor."""
from __future__ import annotations

import re

import pytest
import torch

from helpers.program import inv, sets
from helpers.training import TINY_RUN
from trainer import saved_activations
from trainer.config import ConfigError, load


def _mlp(x, w1, w2):
    h = x @ w1           # saved for backward: silu(h) * h needs it
    return (torch.nn.functional.silu(h) * h) @ w2


def _grad_errors(compiled: bool) -> list[float]:
    """Relative error of each gradient of _mlp (compiled or not) against eager, in bf16."""
    torch.manual_seed(0)
    inputs = [torch.randn(256, 128), torch.randn(128, 512), torch.randn(512, 64)]
    inputs = [t.to(torch.bfloat16).requires_grad_() for t in inputs]

    def grads(fn):
        for t in inputs:
            t.grad = None
        fn(*inputs).float().square().mean().backward()
        return [t.grad.float().clone() for t in inputs]

    reference = grads(_mlp)
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True):
        got = grads(torch.compile(_mlp) if compiled else _mlp)
    return [float((a - b).norm() / a.norm()) for a, b in zip(reference, got)]


@pytest.fixture
def float8_storage():
    yield lambda on, mib: saved_activations.configure(on, mib)
    saved_activations.configure(False, 100)
    torch._dynamo.reset()


def test_the_saved_activation_comes_back_at_float8_precision(float8_storage):
    float8_storage(False, 100)
    plain = _grad_errors(compiled=True)
    assert max(plain) < 0.01          # Inductor against eager, bf16 both: rounding only

    before = saved_activations.graphs_stored()
    float8_storage(True, 0.1)         # h is 256 x 512 bf16 = 0.25 MiB
    stored = _grad_errors(compiled=True)
    assert saved_activations.graphs_stored() == before + 1
    # e4m3 keeps 3 mantissa bits: gradients that read h are off by a few percent, no more
    assert all(0.005 < e < 0.08 for e in stored), stored
    assert all(s > 3 * p for s, p in zip(stored, plain))

    float8_storage(True, 1.0)         # above h's size: nothing is stored in float8
    before = saved_activations.graphs_stored()
    assert max(_grad_errors(compiled=True)) < 0.01
    assert saved_activations.graphs_stored() == before


def test_weights_kept_for_backward_stay_as_they_are(float8_storage):
    """Backward keeps w's transpose for x's gradient: a view of a graph input, not an activation. It
    reaches the size, and stays 16-bit (the partitioner's own check skips only inputs kept as is)."""
    def linear(x, w):
        return torch.nn.functional.silu(x @ w)

    torch.manual_seed(0)
    x = torch.randn(8, 128).to(torch.bfloat16).requires_grad_()
    w = torch.randn(128, 1024).to(torch.bfloat16).requires_grad_()   # 0.25 MiB; x @ w 16 KiB
    eager = torch.autograd.grad(linear(x, w).float().sum(), (x, w))
    float8_storage(True, 0.2)
    before = saved_activations.graphs_stored()
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True):
        compiled = torch.autograd.grad(torch.compile(linear)(x, w).float().sum(), (x, w))
    assert saved_activations.graphs_stored() == before
    for a, b in zip(eager, compiled):
        assert float((a.float() - b.float()).norm() / a.float().norm()) < 0.01


def test_it_needs_compile_and_a_positive_size():
    with pytest.raises(ConfigError, match=r"train\.float8_activations: .*train\.compile"):
        load(None, ["train.float8_activations=true"])
    with pytest.raises(ConfigError, match=r"train\.float8_activations_min_mib: .*positive"):
        load(None, ["train.compile=true", "train.float8_activations=true", "train.float8_activations_min_mib=0"])
    cfg = load(None, ["train.compile=true", "train.float8_activations=true"])
    assert cfg.train.float8_activations and cfg.train.float8_activations_min_mib == 100


def test_a_compiled_run_says_what_it_stored_in_float8(tmp_path, dataset):
    run_sets = sets(f"data.path={dataset}", *TINY_RUN, "train.steps=3", "train.log_interval=1",
                    "train.float8_activations=true", "train.float8_activations_min_mib=0.01")
    proc = inv(tmp_path, "train.pretrain", "--compile", *run_sets, timeout=600,
               env={"OMP_NUM_THREADS": "1", "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    said = re.search(r"float8 activations: (\d+) compiled graph\(s\) keep their saved activations of 0\.01 MiB "
                     r"or more in float8", proc.stderr)
    assert said and int(said.group(1)) >= 2, proc.stderr[-3000:]   # the decoder block's graph, at least
    losses = [float(x) for x in re.findall(r"step \d/3 \| loss ([\d.]+)", proc.stderr)]
    assert len(losses) == 3 and all(0 < x < 20 for x in losses)


def test_the_log_line_names_the_swiglu_stash_apart():
    line = saved_activations.describe(100, stashed_layers=32)
    assert line.startswith("float8 activations: 32 SwiGLU(s) keep gate and up in float8 themselves; ")
    assert "other saved activation" in line
    assert "SwiGLU" not in saved_activations.describe(100)


def test_swiglu_stashes_only_where_it_keeps_less():
    """The stash (gate and up in float8, SwiGLU's output rebuilt from them) under none and selective, with
    the fused FP8 inputs; selective_lean keeps gate alone and full nothing, so there the stash would cost,
    not save."""
    from trainer.fp8 import stashes

    fused = ["train.compile=true", "train.kernels=true", "precision.fp8=tensorwise", "train.float8_activations=true"]
    for mode in ("none", "selective"):
        assert stashes(load(None, [*fused, f"train.activation_checkpoint={mode}"]))
    for extra in ("train.activation_checkpoint=selective_lean", "train.activation_checkpoint=full",
                  "precision.fp8=rowwise", "precision.fp8_fused=false", "train.kernels=false",
                  "train.float8_activations=false", "precision.fp8=off"):
        assert not stashes(load(None, [*fused, extra])), extra


def test_a_gpu_without_float8_is_refused_in_one_message(monkeypatch):
    from trainer import fp8

    saved_activations.check_device(torch.device("cpu"))        # the CPU casts in software
    monkeypatch.setattr(fp8, "gpu_unsupported_reason", lambda device: "NVIDIA A100 is sm_80")
    with pytest.raises(fp8.Fp8Error, match=r"train\.float8_activations .* NVIDIA A100 is sm_80\. Set "
                                           r"train\.float8_activations=false"):
        saved_activations.check_device(torch.device("cuda", 0))
    assert fp8.Fp8Error.exit_code == 2
