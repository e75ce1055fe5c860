"""Batches for training: a packed token stream cut into windows, shuffled, split over ranks.

The split's token stream is cut into N windows of seq_len+1 tokens (window w starts
at token w*seq_len, so neighbouring windows share one token: every token is a
label exactly once). Window order within epoch e is a seeded random bijection of
range(N) (a Feistel network, O(1) memory, independent of numpy's RNG versions).

Global sample g (counted over all ranks) is window perm_e(g mod N) of epoch
e = g div N. A step takes the next batch_size*world_size samples: rank r gets the
contiguous slice [r*batch_size, (r+1)*batch_size) of them, so ranks are disjoint,
deterministic and together cover every window once per epoch.

The state is that one global cursor (samples consumed by all ranks). Resuming with
the same global batch replays the identical sequence; resuming on a different world
size continues from the same sample with no sample repeated or skipped.
(blend.py reads several datasets as one such stream, by weight.)
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from .dataset import Dataset, bad_token_error
from .errors import DataError

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a fast, well-spread hash of uint64 values."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def _seed_words(*parts) -> list[int]:
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return [int.from_bytes(digest[i:i + 8], "little") for i in range(0, 32, 8)]


class Permutation:
    """A seeded random bijection of range(n): 4 Feistel rounds over the next even power
    of two, cycle-walking values that land outside range(n) back in."""

    def __init__(self, n: int, *seed):
        self.n = n
        bits = max(2, (n - 1).bit_length())
        bits += bits % 2
        self._half = np.uint64(bits // 2)
        self._mask = np.uint64((1 << (bits // 2)) - 1)
        self._keys = [np.uint64(k) for k in _seed_words("perm", n, *seed)]

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self._half, x & self._mask
        for key in self._keys:
            left, right = right, left ^ (_mix64(right ^ key) & self._mask)
        return (left << self._half) | right

    def __call__(self, index) -> np.ndarray:
        x = self._feistel(np.asarray(index, dtype=np.uint64))
        outside = x >= self.n
        while outside.any():
            x[outside] = self._feistel(x[outside])
            outside = x >= self.n
        return x.astype(np.int64)


def inputs_and_labels(rows: np.ndarray):
    """(input_ids, labels) LongTensors [batch, seq_len] of windows of seq_len+1 tokens."""
    import torch

    rows = torch.from_numpy(rows)
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


class Loader:
    """What every loader shares: the global cursor, rank slicing, iteration, state."""

    kind = ""

    def __init__(self, seq_len: int, batch_size: int, rank: int, world_size: int, seed: int,
                 epochs: int | None):
        if seq_len < 1 or batch_size < 1:
            raise DataError(f"seq_len and batch_size must be positive (got {seq_len}, {batch_size})")
        if world_size < 1 or not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is not in a world of {world_size}")
        self.seq_len, self.batch_size = seq_len, batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.epochs = epochs
        self.cursor = 0  # global samples consumed, all ranks together
        self.windows = 0  # samples per epoch; set by the subclass

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    @property
    def epoch(self) -> int:
        return self.cursor // self.windows

    def __len__(self) -> int:
        """Batches per epoch for one rank (whole global batches only)."""
        return self.windows // self.global_batch

    def __iter__(self):
        return self

    def __next__(self):
        if self.epochs is not None and self.cursor + self.global_batch > self.epochs * self.windows:
            raise StopIteration
        first = self.cursor + self.rank * self.batch_size
        samples = np.arange(first, first + self.batch_size, dtype=np.int64)
        rows = self.rows(samples)
        self.cursor += self.global_batch
        return inputs_and_labels(rows)

    def rows(self, samples: np.ndarray) -> np.ndarray:
        """The windows of global samples `samples`: [len(samples), seq_len+1] int64."""
        raise NotImplementedError

    def document_tokens(self) -> tuple[int | None, int]:
        """(BOS id or None, EOS id): what cuts the stream into documents (trainer/sequence.py)."""
        raise NotImplementedError

    def tokens_by_source(self) -> dict[str, int]:
        """Tokens each source of a blend gave, all ranks together ({}: one source)."""
        return {}

    def source_summary(self) -> dict[str, dict]:
        """Each source of a blend: its share by weight, its tokens and share of them, its epochs ({}: one
        source)."""
        return {}

    def _identity(self) -> dict:
        return {}

    def state_dict(self) -> dict:
        return {"kind": self.kind, "cursor": self.cursor, "seq_len": self.seq_len,
                "seed": self.seed, "windows": self.windows, "global_batch": self.global_batch,
                **self._identity()}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        if state.get("kind") != self.kind:
            raise DataError(f"loader state is for a {state.get('kind')!r} loader, this one is {self.kind!r}")
        for key in ("seq_len", "seed", "windows", *self._identity()):
            if state.get(key) != mine[key]:
                raise DataError(f"cannot resume the data position: {key} was {state.get(key)!r} "
                                f"when saved, it is {mine[key]!r} now (changed dataset or settings)")
        self.cursor = int(state["cursor"])


def document_tokens(manifest: dict, path) -> tuple[int | None, int]:
    """(BOS id or None, EOS id) that a dataset's manifest records for its tokenizer; DataError when it
    records no usable EOS id, which data.document_mask cuts documents by."""
    spec = manifest.get("tokenizer") or {}
    bos, eos = spec.get("bos_id"), spec.get("eos_id")

    def an_id(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    if not an_id(eos) or not (bos is None or an_id(bos)):
        raise DataError(f"data.document_mask: dataset {path} records no BOS/EOS ids for its tokenizer (bos_id "
                        f"{bos!r}, eos_id {eos!r}), so its documents cannot be told apart; prepare it again "
                        f"with `inv data.prepare --force`, or set data.document_mask=false")
    return bos, eos


class TokenLoader(Loader):
    """(input_ids, labels) LongTensors [batch_size, seq_len] from a prepared dataset.

    path "synthetic" (with vocab_size=) gives a SyntheticLoader instead.
    epochs=None iterates forever; epochs=k stops after k passes (whole global batches).
    shuffle=False keeps the stream order (e.g. for validation).
    """

    kind = "tokens"

    def __new__(cls, path, *args, **kwargs):
        if str(path) == "synthetic":
            vocab_size = kwargs.pop("vocab_size", None)
            if vocab_size is None:
                raise DataError('TokenLoader("synthetic") needs vocab_size=')
            kwargs.pop("shuffle", None)
            split = kwargs.pop("split", args[0] if args else "train")
            names = ("seq_len", "batch_size", "rank", "world_size", "seed", "epochs")
            params = dict(zip(names, args[1:]), **kwargs)
            return SyntheticLoader(vocab_size, split=split, **params)
        return super().__new__(cls)

    def __init__(self, path: str | Path, split: str = "train", seq_len: int = 1024,
                 batch_size: int = 8, rank: int = 0, world_size: int = 1, seed: int = 0,
                 epochs: int | None = None, shuffle: bool = True, vocab_size: int | None = None,
                 documents: bool = False):
        super().__init__(seq_len, batch_size, rank, world_size, seed, epochs)   # (documents: synthetic only)
        self.dataset = Dataset(path)
        self.split = split
        self.shuffle = shuffle
        self.stream = self.dataset.split(split)
        self.vocab_size = self.dataset.vocab_size
        if vocab_size is not None and vocab_size < self.vocab_size:
            raise DataError(f"the model's vocab_size {vocab_size} is smaller than the dataset "
                            f"tokenizer's {self.vocab_size} ({self.dataset.path})")
        self.windows = (self.stream.tokens - 1) // seq_len
        if self.windows < 1:
            raise DataError(f"split {split!r} of {self.dataset.path} has {self.stream.tokens} tokens, "
                            f"too few for one sequence of {seq_len}+1")
        self._perms: dict[int, Permutation] = {}

    def _permutation(self, epoch: int) -> Permutation:
        if epoch not in self._perms:
            if len(self._perms) > 2:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = Permutation(self.windows, self.seed, self.split, epoch)
        return self._perms[epoch]

    def window_ids(self, samples: np.ndarray) -> np.ndarray:
        """Which window each global sample index reads."""
        samples = np.asarray(samples, dtype=np.int64)
        epochs, positions = np.divmod(samples, self.windows)
        if not self.shuffle:
            return positions
        out = np.empty_like(positions)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._permutation(int(e))(positions[sel])
        return out

    def rows(self, samples: np.ndarray) -> np.ndarray:
        rows = np.empty((len(samples), self.seq_len + 1), dtype=np.int64)
        windows = self.window_ids(samples)
        for i, w in enumerate(windows):
            rows[i] = self.stream.read(int(w) * self.seq_len, self.seq_len + 1)
        if len(rows) and int(rows.max()) >= self.vocab_size:  # one max() per batch: a damaged shard
            i, j = np.argwhere(rows >= self.vocab_size)[0]
            file, at = self.stream.locate(int(windows[i]) * self.seq_len + int(j))
            raise bad_token_error(self.dataset.path, file, int(rows[i, j]), at, self.vocab_size)
        return rows

    def document_tokens(self) -> tuple[int | None, int]:
        return document_tokens(self.dataset.manifest, self.dataset.path)

    def _identity(self) -> dict:
        return {"split": self.split, "shuffle": self.shuffle, "tokens": self.stream.tokens}

    def describe(self) -> str:
        return (f"{self.dataset.path} [{self.split}]: {self.stream.tokens:,} tokens, "
                f"{self.windows:,} windows of {self.seq_len}+1, rank {self.rank}/{self.world_size}")


class SyntheticLoader(Loader):
    """SYNTHETIC uniform random tokens, for throughput runs without a dataset.

    Deterministic per (seed, global sample), so it resumes and splits over ranks
    like TokenLoader; the loss it gives says nothing about learning. With `documents`
    (data.document_mask), each row holds documents of seq_len / 4 tokens on average
    (geometric lengths), each begun by BOS = vocab_size - 2 and ended by EOS =
    vocab_size - 1, which the random tokens then never are.
    """

    kind = "synthetic"
    synthetic = True

    def __init__(self, vocab_size: int, seq_len: int = 1024, batch_size: int = 8, rank: int = 0,
                 world_size: int = 1, seed: int = 0, epochs: int | None = None,
                 windows: int = 1 << 40, split: str = "train", documents: bool = False):
        super().__init__(seq_len, batch_size, rank, world_size, seed, epochs)
        if vocab_size < (4 if documents else 2):
            raise DataError(f"synthetic data needs vocab_size >= {4 if documents else 2} (got {vocab_size})")
        self.vocab_size = vocab_size
        self.split = split
        self.windows = windows
        self.documents = documents
        self._key = _seed_words("synthetic", seed, split)[0]

    def rows(self, samples: np.ndarray) -> np.ndarray:
        rows = np.empty((len(samples), self.seq_len + 1), dtype=np.int64)
        bos, eos = self.document_tokens()
        for i, g in enumerate(samples):
            rng = np.random.default_rng([self._key, int(g)])
            rows[i] = rng.integers(0, self.vocab_size - 2 * self.documents, self.seq_len + 1)
            if self.documents:   # an EOS then a BOS at each boundary; the row starts inside a document
                ends = np.cumsum(rng.geometric(min(1.0, 4 / self.seq_len), self.seq_len + 1))
                ends = ends[ends < self.seq_len]
                rows[i, ends - 1], rows[i, ends] = eos, bos
        return rows

    def document_tokens(self) -> tuple[int | None, int]:
        return self.vocab_size - 2, self.vocab_size - 1

    def _identity(self) -> dict:
        return {"split": self.split, "vocab_size": self.vocab_size} | ({"documents": True} if self.documents else {})

    def describe(self) -> str:
        return (f"SYNTHETIC random tokens (vocab {self.vocab_size}), seq {self.seq_len}, "
                f"rank {self.rank}/{self.world_size}")
