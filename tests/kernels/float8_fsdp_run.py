"""Run under torchrun (gloo): the tiny Llama sharded with FSDP2 and trained in FP8 (torchao's
emulation, float8 all-gather of the weights, the scales after each step) for 2 steps, once with the
float8 inputs our kernels write and once with torchao's casts. Rank 0 prints both loss lists as JSON."""
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")   # before the kernels are imported: no GPU here
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the checkout's kernels/, as Anvil's programs do

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from kernels import patch  # noqa: E402
from trainer import fp8  # noqa: E402
from trainer.config import load  # noqa: E402
from trainer.distributed import DistInfo, wrap  # noqa: E402
from trainer.models import Transformer  # noqa: E402


def train(fuse: bool, cfg, info) -> tuple[list[float], list[str]]:
    torch.manual_seed(0)
    model = Transformer(cfg.model).to(torch.bfloat16)
    model.model.rotary_emb.reset_parameters()
    patch(model)
    state = fp8.convert(model, "tensorwise", fsdp=True, emulate=True, fuse_inputs=fuse)
    wrap(model, cfg, info)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + info.rank)
    losses = []
    for _ in range(2):
        tokens = torch.randint(0, cfg.model.vocab_size, (2, 32), generator=g)
        opt.zero_grad()
        loss = model(tokens, tokens)
        loss.backward()
        opt.step()
        fp8.after_optimizer_step(model, state)
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(total.item())
    return losses, state.fused_inputs


def main():
    dist.init_process_group("gloo")
    info = DistInfo(dist.get_rank(), dist.get_rank(), dist.get_world_size(), torch.device("cpu"), "gloo")
    cfg = load(None, ["data.path=synthetic", "model.n_layers=2", "parallel.strategy=fsdp", "precision.params=bf16",
                      "precision.compute=bf16"])
    fused, sites = train(True, cfg, info)
    plain, _ = train(False, cfg, info)
    if info.rank == 0:
        print(json.dumps({"fused": fused, "plain": plain, "sites": sites}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
