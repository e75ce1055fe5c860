"""trainer.checkpoint: exact round trip, atomic saves, keep-last-k, resume resolution, and a
checkpoint written by 2 gloo processes (DDP and FSDP2) loaded by 1.

Run as a script under torchrun, this file is also the 2-process worker (see _worker)."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from trainer import checkpoint as ck

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


class Toy(torch.nn.Module):
    """Small enough for CPU, with a tied weight like the Llama embedding/lm_head."""

    def __init__(self, vocab=32, dim=16):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(dim, dim, bias=False) for _ in range(2))
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return self.head(x)


class CountingLoader:
    """The loader protocol checkpoint.py relies on: state_dict()/load_state_dict()."""

    def __init__(self):
        self.cursor = 0

    def state_dict(self):
        return {"cursor": self.cursor}

    def load_state_dict(self, state):
        self.cursor = state["cursor"]


def build(seed=0):
    torch.manual_seed(seed)
    model = Toy()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    return model, optimizer, scheduler


def train_steps(model, optimizer, scheduler, loader, n, wrapped=None):
    losses = []
    for _ in range(n):
        ids = torch.randint(0, 32, (4, 8))  # draws from the torch RNG: resume must restore it
        noise = random.random() + float(np.random.rand())  # and python's and numpy's
        loss = torch.nn.functional.cross_entropy((wrapped or model)(ids).flatten(0, 1),
                                                 ids.roll(1, 1).flatten()) * (1 + 1e-3 * noise)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        loader.cursor += 4
        losses.append(loss.item())
    return losses


def save_toy(root, step, keep_last=3, **kw):
    model, optimizer, scheduler = build()
    return ck.save(root, step, model=model, optimizer=optimizer, scheduler=scheduler,
                   loader=CountingLoader(), keep_last=keep_last, **kw)


# ----------------------------------------------------------------------------- single process

def test_roundtrip_is_exact(tmp_path):
    model, optimizer, scheduler = build()
    loader = CountingLoader()
    train_steps(model, optimizer, scheduler, loader, 3)
    path = ck.save(tmp_path / "checkpoints", 3, model=model, optimizer=optimizer, scheduler=scheduler,
                   loader=loader, extra={"tokens_seen": 96}, config={"model": {"dim": 16}})
    assert path == tmp_path / "checkpoints" / "step_3" and ck.is_complete(path)
    continued = train_steps(model, optimizer, scheduler, loader, 3)

    fresh_model, fresh_opt, fresh_sched = build(seed=123)  # different init: load must overwrite it
    fresh_loader = CountingLoader()
    state = ck.load(ck.resolve("auto", tmp_path / "checkpoints"), model=fresh_model, optimizer=fresh_opt,
                    scheduler=fresh_sched, loader=fresh_loader, config={"model": {"dim": 16}})
    assert state["step"] == 3 and state["extra"] == {"tokens_seen": 96} and fresh_loader.cursor == 12
    assert fresh_sched.last_epoch == 3
    resumed = train_steps(fresh_model, fresh_opt, fresh_sched, fresh_loader, 3)
    assert resumed == continued  # bit-exact: weights, Adam moments, schedule and all RNGs restored
    for (name, a), (_, b) in zip(model.state_dict().items(), fresh_model.state_dict().items()):
        assert torch.equal(a, b), name
    assert fresh_model.head.weight is fresh_model.embed.weight  # tie survives the load
    meta = json.loads((path / "meta.json").read_text())
    assert meta["step"] == 3 and meta["world_size"] == 1 and meta["config"] == {"model": {"dim": 16}}


def test_model_only_load_and_full_weights(tmp_path):
    model, optimizer, scheduler = build()
    train_steps(model, optimizer, scheduler, CountingLoader(), 1)
    path = ck.save(tmp_path, 1, model=model, optimizer=optimizer, scheduler=scheduler)
    other, _, _ = build(seed=5)
    assert ck.load(path, model=other)["step"] == 1
    assert torch.equal(other.layers[0].weight, model.layers[0].weight)
    weights = ck.load_model_state(path)
    assert set(weights) == set(model.state_dict())
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


def test_model_mismatch_is_one_clear_error(tmp_path):
    path = save_toy(tmp_path, 1, config={"model": {"dim": 16, "n_layers": 2}})
    model, optimizer, scheduler = build()
    with pytest.raises(ck.CheckpointError, match=r"n_layers: checkpoint 2 vs config 4"):
        ck.load(path, model=model, optimizer=optimizer, config={"model": {"dim": 16, "n_layers": 4}})
    with pytest.raises(ck.CheckpointError, match="cannot load"):  # no config: DCP's shape check
        ck.load(path, model=torch.nn.Linear(3, 3))


def test_keep_last_k(tmp_path):
    for step in (10, 20, 30, 40):
        save_toy(tmp_path, step, keep_last=2)
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["step_30", "step_40"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_30", "step_40"]  # no debris
    save_toy(tmp_path, 40, keep_last=0)  # same step again replaces it; 0 keeps all
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["step_30", "step_40"]


def test_leftover_tmp_and_unmarked_dirs_are_ignored(tmp_path):
    root = tmp_path / "checkpoints"
    save_toy(root, 5)
    # A save that died after writing shards: no COMPLETE, still under its temporary name ...
    crashed = root / ".tmp_step_10"
    crashed.mkdir()
    (crashed / ".metadata").write_bytes(b"partial")
    # ... and a step dir whose marker never got written (e.g. copied by hand mid-save).
    (root / "step_20").mkdir()
    assert ck.find_latest(tmp_path) == root / "step_5"  # run dir
    assert ck.find_latest(root) == root / "step_5"  # checkpoints dir
    assert ck.resolve("auto", root) == root / "step_5"
    with pytest.raises(ck.CheckpointError, match="incomplete"):
        ck.resolve(str(root / "step_20"), root)
    save_toy(root, 15)  # the next save clears the debris of the crashed one
    assert not crashed.exists() and ck.find_latest(root) == root / "step_15"


def test_resolve(tmp_path):
    assert ck.resolve(None, tmp_path) is None and ck.resolve("none", tmp_path) is None
    assert ck.resolve("auto", tmp_path / "nothing-yet") is None  # fresh start
    with pytest.raises(ck.CheckpointError, match="no such file"):
        ck.resolve(str(tmp_path / "missing"), tmp_path)
    with pytest.raises(ck.CheckpointError, match="no complete checkpoint"):
        ck.resolve(str(tmp_path), tmp_path)
    other_run = tmp_path / "other_run"
    save_toy(other_run / "checkpoints", 7)
    assert ck.resolve(str(other_run), tmp_path) == other_run / "checkpoints" / "step_7"
    assert ck.resolve(str(other_run / "checkpoints" / "step_7"), tmp_path).name == "step_7"


_SLOW_SAVE = textwrap.dedent("""
    import sys, time, torch
    from pathlib import Path
    import torch.distributed.checkpoint as dcp
    sys.path.insert(0, {tests!r})
    from test_checkpoint import save_toy
    save_toy(Path({root!r}), 1)
    real_save = dcp.save
    def slow_save(*a, **kw):  # shards written, then stuck before the rename: killed here
        real_save(*a, **kw)
        print("SAVING", flush=True)
        time.sleep(60)
    dcp.save = slow_save
    save_toy(Path({root!r}), 2)
""")


def test_kill_during_save_keeps_previous(tmp_path):
    root = tmp_path / "checkpoints"
    proc = subprocess.Popen([PYTHON, "-c", _SLOW_SAVE.format(tests=str(REPO / "tests"), root=str(root))],
                            stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert proc.stdout.readline().strip() == "SAVING"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert (root / ".tmp_step_2" / ".metadata").exists()  # the interrupted save's shards
    assert ck.find_latest(root) == root / "step_1"
    model, optimizer, scheduler = build(seed=9)
    assert ck.load(ck.resolve("auto", root), model=model, optimizer=optimizer)["step"] == 1


# ----------------------------------------------------------------------------- 2 ranks -> 1

def _worker(out: Path) -> None:
    """torchrun --nproc-per-node 2 tests/test_checkpoint.py OUT: train the toy model 2 steps
    under DDP and under FSDP2 (gloo, CPU), checkpoint each, and let rank 0 dump the full
    model and optimizer state for the single-process side to compare against."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for mode in ("ddp", "fsdp"):
        model, optimizer, scheduler = build()
        if mode == "fsdp":
            for layer in model.layers:
                fully_shard(layer)
            fully_shard(model)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
            wrapped = model
        else:
            wrapped = DistributedDataParallel(model)
        torch.manual_seed(rank)  # different data per rank
        loader = CountingLoader()
        train_steps(model, optimizer, scheduler, loader, 2, wrapped=wrapped)
        ck.save(out / mode / "checkpoints", 2, model=model, optimizer=optimizer, scheduler=scheduler,
                loader=loader)
        full_model, full_optim = get_state_dict(model, optimizer,
                                                options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save({"model": full_model, "optim": full_optim["state"]}, out / mode / "expected.pt")
    # Tear down together: a rank that destroys its gloo group while the other still has work
    # in flight has aborted at exit ('terminate called without an active exception') under load.
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_rank_checkpoints_resume_on_one(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "tests"))
    cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(Path(__file__).resolve()), str(tmp_path)]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for mode in ("ddp", "fsdp"):
        expected = torch.load(tmp_path / mode / "expected.pt", weights_only=True)
        path = ck.find_latest(tmp_path / mode)
        assert ck.read_meta(path)["world_size"] == 2
        assert sorted(p.name for p in (path / "ranks").iterdir()) == ["rank0.pt", "rank1.pt"]
        model, optimizer, scheduler = build(seed=77)
        loader = CountingLoader()
        state = ck.load(path, model=model, optimizer=optimizer, scheduler=scheduler, loader=loader)
        assert state["step"] == 2 and state["world_size"] == 2 and loader.cursor == 8
        assert scheduler.last_epoch == 2
        for name, tensor in model.state_dict().items():
            assert torch.equal(tensor, expected["model"][name]), (mode, name)
        _, optim = get_state_dict(model, optimizer)
        for name, slots in expected["optim"].items():
            for slot in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(optim["state"][name][slot], slots[slot]), (mode, name, slot)
        # and training continues from there
        train_steps(model, optimizer, scheduler, loader, 1)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
