"""Step-time fast paths of the trainer: they must give what the plain code gives."""
import pytest
import torch

from trainer import optim
from trainer.models import RotaryEmbedding


def _params(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype)) for shape in ((8, 4), (4,), (3, 5))]
    for p in ps:
        p.grad = (torch.randn(p.shape, generator=gen) * 3).to(dtype)
    return ps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_norm", [0.5, 1e6, 0.0])
def test_clip_inside_fused_adamw_matches_clipping_the_grads(dtype, max_norm):
    # eps comparable to the gradients: Adam is otherwise nearly blind to a gradient scale
    ref, fast = _params(dtype), _params(dtype)
    # reference: clip the gradients themselves, then a fused step without a grad_scale
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, eps=1.0, fused=True)
    norm_ref = optim.clip_grad_norm(ref, max_norm)
    ref_opt.step()
    fast_opt = torch.optim.AdamW(fast, lr=1e-2, eps=1.0, fused=True)
    norm_fast = optim.clip_grad_norm(fast, max_norm, fast_opt)
    assert (fast_opt.grad_scale is None) == (max_norm == 0.0)
    if max_norm == 0.5:
        assert fast_opt.grad_scale.item() > 1.0  # these gradients do get clipped
    fast_opt.step()
    torch.testing.assert_close(norm_fast, norm_ref)
    tol = {} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}
    for a, b in zip(fast, ref):
        torch.testing.assert_close(a.detach(), b.detach(), **tol)
    # next step without clipping: no stale grad_scale left behind
    optim.clip_grad_norm(fast, 0.0, fast_opt)
    assert fast_opt.grad_scale is None


def test_non_fused_optimizer_clips_the_grads():
    ps = _params(torch.float32)
    opt = torch.optim.AdamW(ps, lr=1e-2, foreach=False)
    total = optim.clip_grad_norm(ps, 0.5, opt)
    assert total.item() > 0.5
    assert opt.grad_scale is None
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ps]))
    assert clipped.item() == pytest.approx(0.5, rel=1e-4)


def test_rope_tables_are_cached_and_rebuilt_when_stale():
    from trainer.config import ModelConfig
    rope = RotaryEmbedding(ModelConfig())
    cos, sin = rope(16)
    again = rope(16)
    assert again[0] is cos and again[1] is sin  # no recompute per step
    longer = rope(32)
    assert longer[0].shape[0] == 32
    torch.testing.assert_close(longer[0][:16], cos)
    old_freq = rope.inv_freq
    rope.reset_parameters()
    assert rope.inv_freq is not old_freq
    fresh = rope(16)
    assert fresh[0] is not cos
    torch.testing.assert_close(fresh[0], cos)
    torch.testing.assert_close(fresh[1], sin)
    with torch.inference_mode():
        rope.reset_parameters()
        rope(16)
    assert rope._cache is None  # inference tensors would break a later backward
