"""Process group, device, the ranks' layout and model wrapping (DDP or FSDP2, with tensor parallelism).

Reads the rank layout that torchrun (RANK, WORLD_SIZE, LOCAL_RANK) or srun
(SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID) put in the environment; started
directly it runs as a single process without a process group.

With parallel.tp or parallel.cp above 1 the ranks form data x cp x tp (tp innermost, so that a
tensor-parallel group shares a node's links, as torchtitan orders them): the ranks of one data index
read the same batch and split its rows (trainer/sequence.py), FSDP2 shards over data x cp, and the
tensor-parallel plan (trainer/models/tensor_parallel.py) splits the layers over tp.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from trainer import config
from trainer.config import TrainConfig
from core.errors import UserError


class DistributedError(UserError):
    """A launch/environment problem the user can fix (no GPU, missing MASTER_ADDR, ...)."""


@dataclass
class Layout:
    """Where this rank sits among data x cp x tp. `mesh`: their DeviceMesh ("dp", "cp", "tp") when cp or
    tp is above 1 (None otherwise: every rank is a data rank)."""

    dp: int = 1
    cp: int = 1
    tp: int = 1
    dp_rank: int = 0
    cp_rank: int = 0
    tp_rank: int = 0
    mesh: object | None = None

    @property
    def model_ranks(self) -> int:
        """The ranks that share one batch (its rows split between them)."""
        return self.cp * self.tp

    @property
    def cp_group(self):
        return self.mesh["cp"].get_group() if self.cp > 1 else None

    @property
    def tp_mesh(self):
        return self.mesh["tp"] if self.tp > 1 else None

    def fsdp_mesh(self, device_type: str, world_size: int):
        """What FSDP2 shards over: data x cp (cp ranks hold the same weights), never tp."""
        if self.mesh is None or self.tp == 1:
            from torch.distributed.device_mesh import init_device_mesh
            return init_device_mesh(device_type, (world_size,))
        return self.mesh["dp", "cp"]._flatten("dp_cp") if self.cp > 1 else self.mesh["dp"]


@dataclass
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str | None      # None when no process group was created
    layout: Layout | None = None   # None: every rank a data rank

    def __post_init__(self):
        if self.layout is None:
            self.layout = Layout(dp=self.world_size, dp_rank=self.rank)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def _env_int(*names: str, default: int | None = None) -> int | None:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise DistributedError(f"{name}={value!r} is not an integer") from None
    return default


def rank_layout() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun's or Slurm's environment."""
    world = _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
    rank = _env_int("RANK", "SLURM_PROCID", default=0)
    local = _env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)
    return rank, local, world


def select_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DistributedError("train.device is 'cuda' but no GPU is visible to torch "
                               f"(torch {torch.__version__}); use train.device=cpu or auto")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise DistributedError(f"local rank {local_rank} but only {count} GPU(s) visible; "
                               "start at most one process per GPU")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def init(cfg: TrainConfig) -> DistInfo:
    rank, local_rank, world = rank_layout()
    config.check_world(cfg, world)
    device = select_device(cfg.train.device, local_rank)
    if world == 1:
        return DistInfo(rank, local_rank, world, device, None)
    backend = cfg.parallel.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise DistributedError("parallel.backend nccl needs GPUs; use gloo (or auto) on CPU")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name):
            raise DistributedError(f"{world} processes but {name} is not set; start through "
                                   "torchrun or set it (srun: the runner exports it)")
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world))
    os.environ.setdefault("LOCAL_RANK", str(local_rank))
    dist.init_process_group(
        backend=backend, rank=rank, world_size=world,
        timeout=datetime.timedelta(minutes=cfg.parallel.timeout_minutes),
        device_id=device if device.type == "cuda" else None)
    return DistInfo(rank, local_rank, world, device, backend, layout_of(cfg, rank, world, device))


def layout_of(cfg: TrainConfig, rank: int, world: int, device: torch.device) -> Layout | None:
    """This rank's place in data x cp x tp (a collective where cp or tp is above 1: the mesh's groups);
    None where every rank is a data rank."""
    cp, tp, shared = cfg.parallel.cp, cfg.parallel.tp, cfg.parallel.model_ranks
    if shared == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh
    dp = world // shared
    mesh = init_device_mesh(device.type, (dp, cp, tp), mesh_dim_names=("dp", "cp", "tp"))
    return Layout(dp, cp, tp, rank // shared, rank // tp % cp, rank % tp, mesh)


def shutdown(info: DistInfo) -> None:
    if info.distributed and dist.is_initialized():
        dist.destroy_process_group()


def compute_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    choice = cfg.precision.compute
    if choice == "auto":
        choice = "bf16" if device.type == "cuda" else "fp32"
    return torch.bfloat16 if choice == "bf16" else torch.float32


def param_dtype(cfg: TrainConfig) -> torch.dtype:
    return torch.bfloat16 if cfg.precision.params == "bf16" else torch.float32


def wrap(model: nn.Module, cfg: TrainConfig, info: DistInfo) -> nn.Module:
    """Returns the module to call for forward/backward. FSDP2 shards `model` in place;
    DDP returns a wrapper (checkpoints always use the plain `model`)."""
    if cfg.parallel.strategy == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = None
        if info.distributed:
            mesh = info.layout.fsdp_mesh(info.device.type, info.world_size)
        if info.layout.tp > 1:   # before FSDP2, which then shards each tensor-parallel piece over the data ranks
            from trainer.models import tensor_parallel
            tensor_parallel.apply(model, info.layout.tp_mesh)
            if cfg.parallel.async_tp:
                tensor_parallel.enable_async(info.layout.tp_mesh)
        # Gradients are reduced in fp32 so the sum over ranks does not lose bits.
        mp = MixedPrecisionPolicy(param_dtype=compute_dtype(cfg, info.device),
                                  reduce_dtype=torch.float32)
        reshard = cfg.parallel.reshard_after_forward
        if cfg.parallel.ep > 1:
            _shard_experts(model, cfg, info, mp, reshard)
        untied = model.lm_head.weight is not model.model.embed_tokens.weight
        if untied:
            # Groups of their own (as torchtitan): the embedding is gathered only around its forward
            # and its backward, the head's gradient is reduced right after the loss backward. In the
            # root group both stay gathered all step and both gradients wait for the end of backward
            # (6 bytes a parameter more at the peak: 2.9 GiB for Llama 3 8B on 2 GPUs).
            fully_shard(model.model.embed_tokens, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
        layers = list(model.model.layers)
        for i, layer in enumerate(layers):
            # The last layer's params are needed again at once by backward: keep them gathered.
            fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard and i < len(layers) - 1)
        if untied:   # needed again at once by its backward, like the last layer
            fully_shard(model.lm_head, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
        return model
    if info.distributed:
        from torch.nn.parallel import DistributedDataParallel as DDP
        ids = [info.device.index] if info.device.type == "cuda" else None
        return DDP(model, device_ids=ids)
    return model


def _shard_experts(model: nn.Module, cfg: TrainConfig, info: DistInfo, mp, reshard: bool) -> None:
    """Expert parallelism under FSDP2 (torchtitan's layout): the ranks form (world / ep) x ep; each of an ep
    group's ranks keeps its experts (trainer/models/expert_parallel.py), and FSDP2 shards them again over
    the ranks that hold the same experts (on dim 1, so the two shardings never split one dimension twice).
    Their gradients are divided by the world size, as every other parameter's: each expert's gradient
    sums the tokens of its whole ep group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    from trainer.models.expert_parallel import shard_experts
    from trainer.models.moe import moe_layers

    config.check_world(cfg, info.world_size)
    ep = cfg.parallel.ep
    mesh = init_device_mesh(info.device.type, (info.world_size // ep, ep), mesh_dim_names=("dp_mod_ep", "ep"))
    shard_experts(model, mesh["ep"])
    for _, moe in moe_layers(model):
        fully_shard(moe.experts, mesh=mesh["dp_mod_ep"], mp_policy=mp, reshard_after_forward=reshard,
                    shard_placement_fn=lambda param: Shard(1))
        moe.experts.set_gradient_divide_factor(float(info.world_size))


def all_reduce_mean(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.distributed:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= info.world_size
    return t


def barrier(info: DistInfo) -> None:
    if info.distributed:
        dist.barrier()
