"""TritonAdamW (kernels.adamw) against torch.optim.AdamW: the same parameters and state after
several steps (weight decay groups, fp32 and bf16 weights, the clip factor as grad_scale), the
same checkpoints both ways, and FSDP2-style DTensor parameters updated through their shards."""

from helpers.kernels import DEVICE  # noqa: I001  (sets TRITON_INTERPRET on a CPU before kernels import)

import copy

import pytest
import torch

from trainer import optim
from trainer.optim import TritonAdamW

HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8)


def params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(37, 53), (1000,), (3, 5, 7), (1,)]
    return [torch.randn(s, generator=g).to(DEVICE, dtype).requires_grad_() for s in shapes]


def groups(ps):
    return [{"params": [p for p in ps if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}]


def stepped(opt_cls, ps, steps, clip=0.0, seed=1, **kw):
    opt = opt_cls(groups(ps), **HYPER, **kw)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in ps:
            p.grad = (torch.randn(p.shape, generator=g) * 3).to(DEVICE, p.dtype)
        optim.clip_grad_norm(ps, clip, opt)
        opt.step()
    return opt


# fp32: four steps against the for-loop AdamW. bf16: one step against torch's fused AdamW (both do
# the math in fp32 and round once), within one bf16 step of the value (2**-7 relative): Triton's
# interpreter rounds fp32 -> bf16 toward zero, the GPU to nearest.
@pytest.mark.parametrize("dtype, steps, tol, ref_kw", [(torch.float32, 4, 1e-6, {"foreach": False}),
                                                       (torch.bfloat16, 1, 2 ** -7, {"fused": True})],
                         ids=["fp32", "bf16"])
@pytest.mark.parametrize("clip", [0.0, 1.0], ids=["no-clip", "clip"])
def test_matches_torch_adamw(dtype, steps, tol, ref_kw, clip):
    ref, ours = params(dtype), params(dtype)
    ref_opt = stepped(torch.optim.AdamW, ref, steps=steps, clip=clip, **ref_kw)
    our_opt = stepped(TritonAdamW, ours, steps=steps, clip=clip)
    if clip:
        assert our_opt.grad_scale is not None and float(our_opt.grad_scale) > 1   # clipped, by the kernel
    for a, b in zip(ref, ours):
        torch.testing.assert_close(b, a, rtol=tol, atol=tol)
        sa, sb = ref_opt.state[a], our_opt.state[b]
        assert float(sb["step"]) == float(sa["step"]) == steps
        for key in ("exp_avg", "exp_avg_sq"):
            assert sb[key].dtype == sa[key].dtype == dtype
            torch.testing.assert_close(sb[key], sa[key], rtol=tol, atol=tol)


def test_checkpoints_move_between_torch_and_triton():
    """A run saved by torch's AdamW resumes under TritonAdamW (and back) on the same trajectory."""
    ref, ours = params(torch.float32), params(torch.float32)
    ref_opt = stepped(torch.optim.AdamW, ref, steps=2, foreach=False)
    for a, b in zip(ref, ours):
        b.data.copy_(a.data)
    our_opt = TritonAdamW(groups(ours), **HYPER)
    our_opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))   # (it would share the state tensors)
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    for opt, ps, g in ((ref_opt, ref, g1), (our_opt, ours, g2)):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g).to(DEVICE)
        opt.step()
    for a, b in zip(ref, ours):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
    back = torch.optim.AdamW(groups(ref), **HYPER, foreach=False)
    back.load_state_dict(copy.deepcopy(our_opt.state_dict()))
    assert float(back.state[ref[0]]["step"]) == 3


def test_build_optimizer_picks_it_only_with_kernels_on_a_gpu():
    from trainer.config import OptimConfig
    model = torch.nn.Linear(4, 4)
    cpu = optim.build_optimizer(model, OptimConfig(), torch.device("cpu"), kernels=True)
    assert type(cpu) is torch.optim.AdamW                     # no Triton optimizer without a GPU
    if torch.cuda.is_available():
        gpu = optim.build_optimizer(model.cuda(), OptimConfig(), torch.device("cuda"), kernels=True)
        assert type(gpu) is TritonAdamW


def test_dtensor_parameters_are_updated_through_their_shards(tmp_path):
    """FSDP2 hands DTensors: the kernel updates each local shard in place and clipping by
    grad_scale covers them too (torch's fused AdamW leaves DTensors to a foreach multiply)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    backend = "nccl" if DEVICE == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh(DEVICE, (1,))
        plain = params(torch.float32)
        dts = [torch.nn.Parameter(distribute_tensor(p.detach().clone(), mesh, [Shard(0)])) for p in plain]
        stepped(torch.optim.AdamW, plain, steps=3, clip=1.0, foreach=False)
        our_opt = stepped(TritonAdamW, dts, steps=3, clip=1.0)
        assert our_opt.grad_scale is not None
        for a, b in zip(plain, dts):
            torch.testing.assert_close(b.full_tensor(), a.detach(), rtol=1e-6, atol=1e-6)
    finally:
        dist.destroy_process_group()


def test_float8_all_gather_weights_are_updated_inside_their_wrapper():
    """precision.fp8 with FSDP2 wraps each converted weight in torchao's float8 all-gather tensor:
    the kernel must write the wrapped elements (it failed on the wrapper itself before)."""
    fsdp_utils = pytest.importorskip("torchao.float8.fsdp_utils", reason="torchao not installed (anvil[fp8])")
    from torchao.float8.float8_training_tensor import LinearMMConfig
    plain = params(torch.float32)
    wrapped = [torch.nn.Parameter(fsdp_utils.WeightWithDynamicFloat8CastTensor(
        p.detach().clone(), LinearMMConfig(), torch.float8_e4m3fn)) for p in plain]
    stepped(torch.optim.AdamW, plain, steps=2, foreach=False)
    stepped(TritonAdamW, wrapped, steps=2)
    for a, b in zip(plain, wrapped):
        torch.testing.assert_close(b._tensor, a.detach(), rtol=1e-6, atol=1e-6)


def test_float8_wrappers_are_opened_without_a_host_sync(monkeypatch):
    """The wrapper's __tensor_flatten__ reads `if self._precomputed_scale:`, which on a GPU waits for the
    GPU to finish (a sync per FP8 weight every step); the optimizer reaches the elements without it."""
    fsdp_utils = pytest.importorskip("torchao.float8.fsdp_utils", reason="torchao not installed (anvil[fp8])")
    from torchao.float8.float8_training_tensor import LinearMMConfig
    cls = fsdp_utils.WeightWithDynamicFloat8CastTensor
    plain = params(torch.float32)
    wrapped = [torch.nn.Parameter(cls(p.detach().clone(), LinearMMConfig(), torch.float8_e4m3fn,
                                      precomputed_scale=torch.tensor(1.0, device=DEVICE))) for p in plain]

    def flatten_syncs(self):
        raise AssertionError("__tensor_flatten__ called: bool(_precomputed_scale) syncs the host with the GPU")
    monkeypatch.setattr(cls, "__tensor_flatten__", flatten_syncs)
    stepped(torch.optim.AdamW, plain, steps=2, foreach=False)
    stepped(TritonAdamW, wrapped, steps=2)
    for a, b in zip(plain, wrapped):
        torch.testing.assert_close(b._tensor, a.detach(), rtol=1e-6, atol=1e-6)
