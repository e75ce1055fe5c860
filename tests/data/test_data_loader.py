"""TokenLoader: packing, rank disjointness and coverage, determinism, exact resume
(also on another world size), SyntheticLoader."""
import json

import numpy as np
import pytest
import torch

from helpers.corpus import make_corpus, take
from trainer.data import DataError, Dataset, SyntheticLoader, TokenLoader, prepare
from trainer.data.loader import Permutation

SEQ = 32


@pytest.fixture(scope="module")
def sharded_dataset(tmp_path_factory):
    """A dataset of make_corpus in shards of 3,000 tokens, 20% validation."""
    root = tmp_path_factory.mktemp("loader")
    corpus, _ = make_corpus(root)
    # several shards so windows cross shard boundaries
    prepare([corpus], root / "ds", val_fraction=0.2, shard_tokens=3000, workers=1, progress=False)
    return root / "ds"


@pytest.mark.parametrize("n", [1, 2, 3, 17, 1000, 4097])
def test_permutation_is_a_seeded_bijection(n):
    p = Permutation(n, 0, "train", 0)(np.arange(n))
    assert sorted(p.tolist()) == list(range(n))
    if n >= 17:
        assert not np.array_equal(p, np.arange(n))
        assert not np.array_equal(p, Permutation(n, 1, "train", 0)(np.arange(n)))


def test_batches_are_packed_windows_with_shifted_labels(sharded_dataset):
    loader = TokenLoader(sharded_dataset, "train", SEQ, 4, 0, 1, seed=3)
    stream = Dataset(sharded_dataset).split("train")
    assert len(stream.info["shards"]) > 2 and loader.windows == (stream.tokens - 1) // SEQ
    for _ in range(5):
        windows = loader.window_ids(np.arange(loader.cursor, loader.cursor + 4))
        x, y = next(loader)
        assert x.shape == y.shape == (4, SEQ) and x.dtype == y.dtype == torch.int64
        for row, w in enumerate(windows):
            tokens = torch.from_numpy(stream.read(int(w) * SEQ, SEQ + 1).astype(np.int64))
            assert torch.equal(x[row], tokens[:-1]) and torch.equal(y[row], tokens[1:])


def test_ranks_are_disjoint_and_cover_an_epoch(sharded_dataset):
    world, batch = 3, 2
    loaders = [TokenLoader(sharded_dataset, "train", SEQ, batch, r, world, seed=5, epochs=1) for r in range(world)]
    n = loaders[0].windows
    seen = {r: [] for r in range(world)}
    for r, loader in enumerate(loaders):
        while True:
            start = loader.cursor + r * batch
            try:
                next(loader)
            except StopIteration:
                break
            seen[r].extend(loader.window_ids(np.arange(start, start + batch)).tolist())
    steps = n // (world * batch)
    assert all(len(s) == steps * batch for s in seen.values()) and len(loaders[0]) == steps
    everything = [w for s in seen.values() for w in s]
    assert len(set(everything)) == len(everything) == steps * world * batch  # disjoint
    full = TokenLoader(sharded_dataset, "train", SEQ, 1, 0, 1, seed=5, epochs=1)
    assert set(full.window_ids(np.arange(n)).tolist()) == set(range(n))  # an epoch covers all


def test_deterministic_and_epochs_reshuffle(sharded_dataset):
    a = take(TokenLoader(sharded_dataset, "train", SEQ, 4, 1, 2, seed=7), 6)
    b = take(TokenLoader(sharded_dataset, "train", SEQ, 4, 1, 2, seed=7), 6)
    c = take(TokenLoader(sharded_dataset, "train", SEQ, 4, 1, 2, seed=8), 6)
    assert all(torch.equal(p[0], q[0]) for p, q in zip(a, b))
    assert not all(torch.equal(p[0], q[0]) for p, q in zip(a, c))
    loader = TokenLoader(sharded_dataset, "train", SEQ, 1, 0, 1, seed=7)
    n = loader.windows
    e0, e1 = loader.window_ids(np.arange(n)), loader.window_ids(np.arange(n, 2 * n))
    assert sorted(e0.tolist()) == sorted(e1.tolist()) and not np.array_equal(e0, e1)
    ordered = TokenLoader(sharded_dataset, "train", SEQ, 2, 0, 1, shuffle=False, epochs=1)
    assert ordered.window_ids(np.arange(5)).tolist() == [0, 1, 2, 3, 4]
    assert len(list(ordered)) == len(ordered) == ordered.windows // 2


def test_exact_resume_same_world(sharded_dataset):
    uninterrupted = [TokenLoader(sharded_dataset, "train", SEQ, 3, r, 2, seed=1) for r in range(2)]
    expected = [take(l, 12) for l in uninterrupted]
    for r in range(2):
        first = TokenLoader(sharded_dataset, "train", SEQ, 3, r, 2, seed=1)
        take(first, 7)
        state = json.loads(json.dumps(first.state_dict()))  # plain, JSON-able
        resumed = TokenLoader(sharded_dataset, "train", SEQ, 3, r, 2, seed=1)
        resumed.load_state_dict(state)
        for got, want in zip(take(resumed, 5), expected[r][7:]):
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_resume_on_a_different_world_size(sharded_dataset):
    two = [TokenLoader(sharded_dataset, "train", SEQ, 2, r, 2, seed=4) for r in range(2)]
    for loader in two:
        take(loader, 3)
    state = two[0].state_dict()
    assert state["cursor"] == 12
    following = torch.cat([next(l)[0] for l in two])  # step 4 on 2 ranks: samples 12..15
    one = TokenLoader(sharded_dataset, "train", SEQ, 4, 0, 1, seed=4)
    one.load_state_dict(state)
    assert torch.equal(next(one)[0], following)


def test_resume_refuses_changed_settings(sharded_dataset):
    state = TokenLoader(sharded_dataset, "train", SEQ, 2, 0, 1, seed=4).state_dict()
    with pytest.raises(DataError, match="seq_len was 32"):
        TokenLoader(sharded_dataset, "train", 64, 2, 0, 1, seed=4).load_state_dict(state)
    with pytest.raises(DataError, match="seed"):
        TokenLoader(sharded_dataset, "train", SEQ, 2, 0, 1, seed=5).load_state_dict(state)
    with pytest.raises(DataError, match="synthetic"):
        SyntheticLoader(300, SEQ, 2).load_state_dict(state)


def test_loader_errors_are_clear(sharded_dataset, tmp_path):
    with pytest.raises(DataError, match="no prepared dataset"):
        TokenLoader(tmp_path / "none", "train", SEQ, 2)
    with pytest.raises(DataError, match="no split 'test'"):
        TokenLoader(sharded_dataset, "test", SEQ, 2)
    with pytest.raises(DataError, match="too few"):
        TokenLoader(sharded_dataset, "val", 10**7, 2)
    with pytest.raises(DataError, match="rank 2 is not in a world of 2"):
        TokenLoader(sharded_dataset, "train", SEQ, 2, rank=2, world_size=2)
    with pytest.raises(DataError, match="smaller than the dataset"):
        TokenLoader(sharded_dataset, "train", SEQ, 2, vocab_size=100)


def test_synthetic_loader(sharded_dataset):
    loader = TokenLoader("synthetic", vocab_size=1000, seq_len=SEQ, batch_size=2, rank=1, world_size=2, seed=9)
    assert isinstance(loader, SyntheticLoader) and loader.synthetic and "SYNTHETIC" in loader.describe()
    batches = take(loader, 4)
    assert all(x.shape == (2, SEQ) and int(x.max()) < 1000 and torch.equal(x[:, 1:], y[:, :-1])
               for x, y in batches)
    other = take(SyntheticLoader(1000, SEQ, 2, 0, 2, 9), 4)
    assert not any(torch.equal(a[0], b[0]) for a, b in zip(batches, other))  # ranks differ
    resumed = SyntheticLoader(1000, SEQ, 2, 1, 2, 9)
    resumed.load_state_dict(SyntheticLoader(1000, SEQ, 2, 1, 2, 9).state_dict() | {"cursor": 8})
    assert torch.equal(next(resumed)[0], batches[2][0])
