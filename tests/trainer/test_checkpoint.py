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
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from helpers.program import REPO
from trainer import checkpoint as ck

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
    """The loader protocol trainer.checkpoint relies on: state_dict()/load_state_dict()."""

    def __init__(self):
        self.cursor = 0

    def state_dict(self):
        return {"cursor": self.cursor}

    def load_state_dict(self, state):
        self.cursor = state["cursor"]


def toy_training(seed=0):
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
    model, optimizer, scheduler = toy_training()
    return ck.save(root, step, model=model, optimizer=optimizer, scheduler=scheduler,
                   loader=CountingLoader(), keep_last=keep_last, **kw)


# ----------------------------------------------------------------------------- single process

def test_roundtrip_is_exact(tmp_path):
    model, optimizer, scheduler = toy_training()
    loader = CountingLoader()
    train_steps(model, optimizer, scheduler, loader, 3)
    path = ck.save(tmp_path / "checkpoints", 3, model=model, optimizer=optimizer, scheduler=scheduler,
                   loader=loader, extra={"tokens_seen": 96}, config={"model": {"dim": 16}})
    assert path == tmp_path / "checkpoints" / "step_3" and ck.is_complete(path)
    continued = train_steps(model, optimizer, scheduler, loader, 3)

    fresh_model, fresh_opt, fresh_sched = toy_training(seed=123)  # different init: load must overwrite it
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
    model, optimizer, scheduler = toy_training()
    train_steps(model, optimizer, scheduler, CountingLoader(), 1)
    path = ck.save(tmp_path, 1, model=model, optimizer=optimizer, scheduler=scheduler)
    other, _, _ = toy_training(seed=5)
    assert ck.load(path, model=other)["step"] == 1
    assert torch.equal(other.layers[0].weight, model.layers[0].weight)
    weights = ck.load_model_state(path)
    assert set(weights) == set(model.state_dict())
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


def test_model_mismatch_is_one_clear_error(tmp_path):
    path = save_toy(tmp_path, 1, config={"model": {"dim": 16, "n_layers": 2}})
    model, optimizer, scheduler = toy_training()
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
    sys.path[:0] = [{tests!r}, {here!r}]        # the package helpers, and this file
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
    code = _SLOW_SAVE.format(tests=str(REPO / "tests"), here=str(Path(__file__).resolve().parent), root=str(root))
    proc = subprocess.Popen([PYTHON, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert proc.stdout.readline().strip() == "SAVING"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert (root / ".tmp_step_2" / ".metadata").exists()  # the interrupted save's shards
    assert ck.find_latest(root) == root / "step_1"
    model, optimizer, scheduler = toy_training(seed=9)
    assert ck.load(ck.resolve("auto", root), model=model, optimizer=optimizer)["step"] == 1


# ----------------------------------------------------------------------------- checksums

def flip_byte(path: Path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x40
    path.write_bytes(bytes(data))


def test_every_file_is_checksummed_before_complete(tmp_path):
    path = save_toy(tmp_path, 1)
    manifest = json.loads((path / ck.CHECKSUMS_FILE).read_text())
    on_disk = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
    assert sorted(manifest["files"]) == sorted(set(on_disk) - {ck.CHECKSUMS_FILE, ck.COMPLETE_MARKER})
    assert {".metadata", "__0_0.distcp", "ranks/rank0.pt", "trainer.pt", "meta.json"} <= set(manifest["files"])
    from trainer.checkpoint import checksums
    assert manifest["algorithm"] == checksums.ALGORITHM == "xxh3_64"   # xxhash is a dependency
    for name, record in manifest["files"].items():   # what the writer hashed is what is on disk
        assert checksums.hash_file(path / name) == (record["size"], record["digest"]), name
    assert ck.verify(path) is True


def test_write_threads_split_the_rank_into_files_each_checksummed(tmp_path):
    """checkpoint.write_threads: each rank writes that many files at once; every one is hashed as
    it is written, and the load is exact."""
    model, optimizer, scheduler = toy_training()
    train_steps(model, optimizer, scheduler, CountingLoader(), 1)
    saver = ck.Checkpointer(tmp_path, async_save=True, write_threads=3)
    saver.save(1, model=model, optimizer=optimizer, scheduler=scheduler)
    path = saver.wait()
    saver.close()
    manifest = json.loads((path / ck.CHECKSUMS_FILE).read_text())
    assert {"__0_0.distcp", "__0_1.distcp", "__0_2.distcp"} <= set(manifest["files"])
    from trainer.checkpoint import checksums
    for name, record in manifest["files"].items():
        assert checksums.hash_file(path / name) == (record["size"], record["digest"]), name
    other, other_opt, _ = toy_training(seed=9)
    ck.load(path, model=other, optimizer=other_opt)
    for (name, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("failing", ["__0_0.distcp", "__0_2.distcp"])
def test_a_writer_thread_that_fails_fails_the_save_in_one_line(tmp_path, monkeypatch, capfd, failing):
    """With write_threads > 1, DCP writes files on threads of its own, whose failures it neither
    sees nor waits for: whichever file fails, the save fails naming it, nothing is committed,
    no traceback reaches stderr, and the checkpoint before it stays the newest."""
    import errno

    from trainer.checkpoint import checksums

    model, optimizer, scheduler = toy_training()
    train_steps(model, optimizer, scheduler, CountingLoader(), 1)
    saver = ck.Checkpointer(tmp_path, async_save=True, write_threads=3)
    saver.save(1, model=model, optimizer=optimizer, wait=True)
    write = checksums.HashingStream.write

    def full(self, data):
        if self.path.name == failing:
            self.error = checksums.named(OSError(errno.ENOSPC, "No space left on device"), self.path)
            raise self.error
        return write(self, data)
    monkeypatch.setattr(checksums.HashingStream, "write", full)
    saver.save(2, model=model, optimizer=optimizer)
    with pytest.raises(ck.CheckpointWriteError) as failed:
        saver.wait()
    saver.close()
    assert f"{failing}: No space left on device" in str(failed.value) and "\n" not in str(failed.value)
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["step_1"] and ck.find_latest(tmp_path).name == "step_1"
    assert "Traceback" not in capfd.readouterr().err


def test_flipped_byte_resume_auto_takes_the_one_before_and_names_it(tmp_path, caplog):
    root = tmp_path / "checkpoints"
    save_toy(root, 1)
    newest = save_toy(root, 2)
    flip_byte(newest / "__0_0.distcp")
    assert ck.find_latest(root) == newest     # same size: only reading the bytes tells
    model, optimizer, scheduler = toy_training(seed=3)
    with pytest.raises(ck.DamagedCheckpoint, match=r"step_2 is damaged: __0_0\.distcp: its bytes differ"):
        ck.load(newest, model=model, optimizer=optimizer)

    with caplog.at_level("WARNING", logger="anvil.trainer"):
        state = ck.load_first_intact(ck.candidates("auto", root), model=model, optimizer=optimizer,
                                     scheduler=scheduler, loader=CountingLoader())
    assert state["step"] == 1 and state["path"] == root / "step_1"
    assert "step_2 is damaged: __0_0.distcp" in caplog.text and "set aside as damaged_step_2" in caplog.text
    assert sorted(p.name for p in root.iterdir()) == ["damaged_step_2", "step_1"]   # kept for a look
    assert ck.find_latest(root) == root / "step_1"


def test_explicit_resume_of_a_damaged_checkpoint_is_an_error_naming_the_file(tmp_path):
    root = tmp_path / "checkpoints"
    save_toy(root, 1)
    newest = save_toy(root, 2)
    flip_byte(newest / "ranks" / "rank0.pt")
    model, optimizer, scheduler = toy_training()
    found = ck.candidates(str(newest), tmp_path / "fresh-run" / "checkpoints")
    assert [(c.path, c.fallback) for c in found] == [(newest, False)]
    with pytest.raises(ck.DamagedCheckpoint) as raised:
        ck.load_first_intact(found, model=model, optimizer=optimizer)
    assert str(raised.value).count("\n") == 0 and raised.value.exit_code == 2
    assert f"checkpoint {newest} is damaged: ranks/rank0.pt: its bytes differ" in str(raised.value)
    assert f"resume from an earlier checkpoint (--resume {root / 'step_1'})" in str(raised.value)
    assert newest.exists()                     # not set aside: the user named it
    # the folder (a run or its checkpoints) means its newest intact checkpoint
    state = ck.load_first_intact(ck.candidates(str(root), tmp_path / "fresh-run" / "checkpoints"),
                                 model=model, optimizer=optimizer)
    assert state["step"] == 1


def test_missing_metadata_or_a_short_file_is_seen_without_reading_the_data(tmp_path):
    root = tmp_path / "checkpoints"
    save_toy(root, 1)
    two, three = save_toy(root, 2), save_toy(root, 3)
    (three / ".metadata").unlink()
    with open(two / "__0_0.distcp", "r+b") as handle:
        handle.truncate(100)
    assert ck.find_latest(root) == root / "step_1"
    with pytest.raises(ck.DamagedCheckpoint, match=r"step_3 is damaged: \.metadata is missing; resume from an "
                                                    r"earlier checkpoint \(--resume .*step_1\)"):
        ck.resolve(str(three), root)
    with pytest.raises(ck.DamagedCheckpoint, match=r"__0_0\.distcp has 100 bytes, [\d,]+ when it was saved"):
        ck.resolve(str(two), root)


def test_missing_metadata_of_an_old_checkpoint_is_one_line(tmp_path, caplog):
    """A checkpoint saved before checksums loads unverified (said once); without its .metadata DCP
    logged two tracebacks (through the root logger) before the error."""
    root = tmp_path / "checkpoints"
    old = save_toy(root, 1)
    (old / ck.CHECKSUMS_FILE).unlink()
    model, optimizer, _ = toy_training(seed=4)
    assert ck.load(old, model=model, optimizer=optimizer)["step"] == 1
    (old / ".metadata").unlink()
    with pytest.raises(ck.DamagedCheckpoint, match=r"\.metadata is missing"):
        ck.load(old, model=model, optimizer=optimizer)
    assert not [record for record in caplog.records if record.exc_info]


def test_an_unchecksummed_checkpoint_is_said_once(tmp_path, caplog, monkeypatch):
    from trainer.checkpoint import reader
    monkeypatch.setattr(reader, "_said_unverified", False)
    paths = [save_toy(tmp_path, step) for step in (1, 2)]
    for path in paths:
        (path / ck.CHECKSUMS_FILE).unlink()
    with caplog.at_level("WARNING", logger="anvil.trainer"):
        for path in paths:
            assert ck.verify(path) is False
    assert caplog.text.count("has no checksums") == 1


def test_prune_keeps_the_checkpoint_just_saved(tmp_path):
    """A run resumed from step_2 below a newer step_9 (say, one put back by hand): saving step_4
    with keep_last=1 must not delete step_4 itself."""
    save_toy(tmp_path, 9)
    save_toy(tmp_path, 2)
    four = save_toy(tmp_path, 4, keep_last=1)
    assert four.exists() and ck.is_complete(four)


# ----------------------------------------------------------------------------- asynchronous saves

def test_async_save_writes_the_state_of_its_step_while_training_goes_on(tmp_path, monkeypatch):
    from trainer.checkpoint.writer import TEST_DELAY_ENV
    monkeypatch.setenv(TEST_DELAY_ENV, "3.0")   # long enough for a busy machine (tests run two files at once)
    model, optimizer, scheduler = toy_training()
    loader = CountingLoader()
    train_steps(model, optimizer, scheduler, loader, 2)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    saver = ck.Checkpointer(tmp_path, async_save=True)
    assert saver.save(2, model=model, optimizer=optimizer, scheduler=scheduler, loader=loader) is None
    train_steps(model, optimizer, scheduler, loader, 2)    # changes every weight while the write waits
    # The writer thread may not have made its folder yet when two tiny steps are done (it raced
    # them, and lost when the process was warm): wait for it; the commit is 3 s after.
    deadline = time.monotonic() + 2.0
    while not (tmp_path / ".tmp_step_2").is_dir() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert (tmp_path / ".tmp_step_2").is_dir() and ck.find_latest(tmp_path) is None   # not yet
    assert saver.wait() == tmp_path / "step_2" and saver.last_saved == tmp_path / "step_2"
    saver.close()
    fresh, fresh_opt, fresh_sched = toy_training(seed=11)
    fresh_loader = CountingLoader()
    state = ck.load(tmp_path / "step_2", model=fresh, optimizer=fresh_opt, scheduler=fresh_sched, loader=fresh_loader)
    assert state["step"] == 2 and fresh_loader.cursor == 8 and fresh_sched.last_epoch == 2
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    meta = ck.read_meta(tmp_path / "step_2")
    assert meta["async"] is True and 0 <= meta["stall_s"] < meta["save_s"]


def test_the_next_save_waits_for_the_one_in_flight(tmp_path, monkeypatch):
    from trainer.checkpoint.writer import TEST_DELAY_ENV
    monkeypatch.setenv(TEST_DELAY_ENV, "0.5")
    model, optimizer, scheduler = toy_training()
    saver = ck.Checkpointer(tmp_path, async_save=True, keep_last=5)
    for step in (1, 2, 3):
        saver.save(step, model=model, optimizer=optimizer)
        # one in flight at a time: the previous one is complete once the next has started
        assert [p.name for p in ck.list_checkpoints(tmp_path)] == [f"step_{s}" for s in range(1, step)]
    assert saver.save(4, model=model, optimizer=optimizer, wait=True) == tmp_path / "step_4"
    saver.close()
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["step_1", "step_2", "step_3", "step_4"]


def test_dtensor_shards_are_staged_without_a_copy_of_their_own(tmp_path, monkeypatch):
    """Staging a DTensor fills a host buffer around the DTensor's own spec. It must not first
    copy the shard whole (DTensor.to("cpu") or a deepcopy, as DCP's staging does): on two
    H200s that copy, into fresh pageable memory on the training thread, paused a llama3_8b
    save for 38 s. A second save reuses the same buffers."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from trainer.checkpoint.staging import Stager

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        weight = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
        state = {"model": {"w": weight}, "optim": {"step": 3}}

        def refused(*args, **kwargs):
            raise AssertionError("the whole shard was copied to make the staging shell")
        monkeypatch.setattr(DTensor, "to", refused)
        monkeypatch.setattr(DTensor, "__deepcopy__", refused, raising=False)
        stager = Stager()
        staged, event = stager.stage(state)
        shell = staged["model"]["w"]
        assert isinstance(shell, DTensor) and event is None
        assert shell._local_tensor.data_ptr() != weight._local_tensor.data_ptr()
        assert torch.equal(shell._local_tensor, weight._local_tensor)
        assert shell.placements == weight.placements and shell.shape == weight.shape
        assert staged["optim"] == {"step": 3}
        weight._local_tensor.add_(1.0)     # the next save: the same buffer, the new values
        again, _ = stager.stage(state)
        assert again["model"]["w"] is shell and torch.equal(shell._local_tensor, weight._local_tensor)
        stager.close()
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- 2 ranks -> 1

def _worker(out: Path) -> None:
    """torchrun --nproc-per-node 2 tests/trainer/test_checkpoint.py OUT: train the toy model 2 steps
    under DDP and under FSDP2 (gloo, CPU), checkpoint each (FSDP2's asynchronously, training a
    step more while it is written), and let rank 0 dump the full model and optimizer state for
    the single-process side to compare against."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for mode in ("ddp", "fsdp"):
        model, optimizer, scheduler = toy_training()
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
        full_model, full_optim = get_state_dict(model, optimizer,
                                                options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            (out / mode).mkdir(parents=True)
            torch.save({"model": full_model, "optim": full_optim["state"]}, out / mode / "expected.pt")
        if mode == "ddp":
            ck.save(out / mode / "checkpoints", 2, model=model, optimizer=optimizer, scheduler=scheduler,
                    loader=loader)
        else:   # FSDP2 in the background: DTensor shards staged, the write on its own gloo group
            saver = ck.Checkpointer(out / mode / "checkpoints", async_save=True)
            saver.save(2, model=model, optimizer=optimizer, scheduler=scheduler, loader=loader)
            train_steps(model, optimizer, scheduler, CountingLoader(), 1, wrapped=wrapped)   # collectives meanwhile
            saver.wait()
            saver.close()
    # Tear down together: a rank that destroys its gloo group while the other still has work
    # in flight has aborted at exit ('terminate called without an active exception') under load.
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_rank_checkpoints_resume_on_one(tmp_path):
    # the checkout first: tests/trainer/ must not stand in for the package trainer; tests/ for helpers
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]))
    cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(Path(__file__).resolve()), str(tmp_path)]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for mode in ("ddp", "fsdp"):
        expected = torch.load(tmp_path / mode / "expected.pt", weights_only=True)
        path = ck.find_latest(tmp_path / mode)
        assert ck.read_meta(path)["world_size"] == 2
        assert sorted(p.name for p in (path / "ranks").iterdir()) == ["rank0.pt", "rank1.pt"]
        model, optimizer, scheduler = toy_training(seed=77)
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
