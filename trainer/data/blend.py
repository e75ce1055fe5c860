"""Weighted blends of prepared datasets (Megatron's `--data-path 0.3 A 0.7 B`), read as one stream.

Every global sample g (counted over all ranks, as in loader.py) comes from one source: the one
with the largest deficit share_s * (g+1) - count_s, where count_s is how many of samples 0..g-1
it gave and share_s its weight over the sum of the weights; ties go to the first source.
That is Megatron's greedy blending rule: each source's count stays close to share_s * samples
(within half a sample for two sources, within one for three; with more, now and then a little
over one). A source's k-th sample is sample k of its own TokenLoader stream: its windows in a
seeded order per epoch of its own, so a small source with a large weight repeats, each
epoch in a new order, while a large one may not finish its first.

The state is the global cursor and each source's count at it: the greedy rule continues from
there exactly, on any world size (every rank computes the sources of the whole global batch
and takes its slice of it, as TokenLoader does with its samples).
"""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np

from .dataset import Dataset
from .errors import DataError
from .loader import TokenLoader, Loader, inputs_and_labels


class Source(NamedTuple):
    """One dataset of a blend: its name (in metrics), directory and weight (any positive scale)."""
    name: str
    path: str | Path
    weight: float


def shares(weights) -> list[float]:
    """The weights as shares of their sum (the same floats on every rank and run)."""
    weights = [float(w) for w in weights]
    if not weights or any(not w > 0 for w in weights):
        raise DataError(f"a blend needs positive weights, got {weights}")
    total = sum(weights)
    return [w / total for w in weights]


def assign(shares: list[float], counts: list[int], start: int, n: int) -> tuple[np.ndarray, list[int]]:
    """The sources of global samples start..start+n-1 (int64 [n]), given each source's count of the
    samples before `start`; and the counts after them. The deficit of each sample is computed afresh
    from (g, count), so the result does not depend on where a run resumed."""
    out = np.empty(n, dtype=np.int64)
    counts = list(counts)
    rest = range(1, len(shares))
    first_share = shares[0]
    for j in range(n):
        t = start + j + 1
        best, deficit = 0, first_share * t - counts[0]
        for s in rest:
            d = shares[s] * t - counts[s]
            if d > deficit:
                best, deficit = s, d
        counts[best] += 1
        out[j] = best
    return out, counts


EXACT_SAMPLES = 1 << 22  # blend_counts replays the rule up to this many samples (about a second)


def blend_counts(weights, samples: int) -> tuple[list[int], bool]:
    """How many of the first `samples` samples each source gives, and whether that is exact: the
    rule replayed up to EXACT_SAMPLES; beyond, the shares times samples rounded to whole samples
    that sum to `samples` (largest remainders), which the rule matches within about a sample."""
    share = shares(weights)
    if samples <= EXACT_SAMPLES:
        return assign(share, [0] * len(share), 0, samples)[1], True
    ideal = [s * samples for s in share]
    counts = [int(x) for x in ideal]
    by_remainder = sorted(range(len(share)), key=lambda i: (counts[i] - ideal[i], i))
    for i in by_remainder[:samples - sum(counts)]:
        counts[i] += 1
    return counts, False


SHOWN = 5   # sources a console line names before "... N more" (1000 of them made every summary row 114k wide)


def fold(items: list, shown: int = SHOWN) -> tuple[list, int]:
    """(the items a console line shows, how many it leaves out): the first `shown` of a long blend's
    per-source items, so a line stays short however many sources there are (the run's files keep all)."""
    if len(items) <= shown + 1:   # "... 1 more" would take the room of the one it hides
        return list(items), 0
    return list(items[:shown]), len(items) - shown


def folded(texts: list[str], shown: int = SHOWN) -> list[str]:
    """The texts fold() keeps, then "... N more" for those it leaves out."""
    kept, hidden = fold(texts, shown)
    return kept + ([f"... {hidden} more"] if hidden else [])


def tokenizer_text(spec: dict) -> str:
    """"byte, vocab 259" or "bpe, vocab 8192, sha256 1a2b3c4d5e6f": how a tokenizer is told apart."""
    text = f"{spec.get('kind')}, vocab {spec.get('vocab_size')}"
    return text + (f", sha256 {spec['sha256'][:12]}" if spec.get("sha256") else "")


def _tokenizer_identity(spec: dict) -> tuple:
    """What must agree for two datasets' ids to mean the same tokens: the byte tokenizer, or the
    same tokenizer.json (its sha256), with the same vocabulary size and special ids."""
    return (spec.get("kind") == "byte", spec.get("vocab_size"), spec.get("bos_id"), spec.get("eos_id"),
            spec.get("pad_id"), spec.get("sha256"))


def check_same_tokenizer(manifests: list[tuple[str, dict]]) -> None:
    """DataError unless every (label, manifest) was made with the first one's tokenizer."""
    (first_label, first), *rest = manifests
    for label, manifest in rest:
        if _tokenizer_identity(manifest["tokenizer"]) != _tokenizer_identity(first["tokenizer"]):
            raise DataError(f"{label}: its tokenizer ({tokenizer_text(manifest['tokenizer'])}) is not "
                            f"{first_label}'s ({tokenizer_text(first['tokenizer'])}); the datasets of a "
                            f"blend must share one tokenizer (the same ids): prepare them with the same "
                            f"--tokenizer")


class BlendLoader(Loader):
    """(input_ids, labels) LongTensors [batch_size, seq_len] from several prepared datasets, each
    global sample from the source the greedy rule picks (module docstring); iterates forever."""

    kind = "blend"

    def __init__(self, sources: list[Source], split: str = "train", seq_len: int = 1024,
                 batch_size: int = 8, rank: int = 0, world_size: int = 1, seed: int = 0,
                 vocab_size: int | None = None):
        super().__init__(seq_len, batch_size, rank, world_size, seed, None)
        sources = [Source(*s) for s in sources]
        if not sources:
            raise DataError("a blend needs at least one dataset")
        names = [s.name for s in sources]
        if len(set(names)) != len(names):
            raise DataError(f"the sources of a blend need different names, got {names}")
        self.names, self.weights = names, [float(s.weight) for s in sources]
        self.shares = shares(self.weights)
        self.split = split
        check_same_tokenizer([(str(s.path), Dataset(s.path).manifest) for s in sources])
        # each source: its own stream of samples (rank 0 of 1: the blend slices the global batch)
        self.sources = [TokenLoader(s.path, split, seq_len, 1, 0, 1, seed, vocab_size=vocab_size)
                        for s in sources]
        self.vocab_size = self.sources[0].vocab_size
        self.windows = sum(source.windows for source in self.sources)   # a nominal epoch: every window once
        self.counts = [0] * len(sources)   # samples each source gave before the cursor

    def __next__(self):
        picked, after = assign(self.shares, self.counts, self.cursor, self.global_batch)
        local = np.empty_like(picked)   # each sample's index in its source's own stream
        for s, count in enumerate(self.counts):
            mine = picked == s
            local[mine] = count + np.arange(int(mine.sum()))
        part = slice(self.rank * self.batch_size, (self.rank + 1) * self.batch_size)
        picked, local = picked[part], local[part]
        rows = np.empty((self.batch_size, self.seq_len + 1), dtype=np.int64)
        for s in np.unique(picked):
            mine = picked == s
            rows[mine] = self.sources[int(s)].rows(local[mine])
        self.cursor += self.global_batch
        self.counts = after
        return inputs_and_labels(rows)

    def document_tokens(self) -> tuple[int | None, int]:
        return self.sources[0].document_tokens()   # one tokenizer for every source (check_same_tokenizer)

    def tokens_by_source(self) -> dict[str, int]:
        return {name: count * self.seq_len for name, count in zip(self.names, self.counts)}

    def source_summary(self) -> dict[str, dict]:
        """Per source: its share by weight, tokens given (all ranks) and their share, and passes over its
        windows so far (epochs; above 1 it repeats)."""
        total = max(1, sum(self.counts))
        return {name: {"weight": share, "tokens": count * self.seq_len, "token_share": count / total,
                       "epochs": count / source.windows}
                for name, share, count, source in zip(self.names, self.shares, self.counts, self.sources)}

    def _identity(self) -> dict:
        return {"split": self.split,
                "sources": [[name, weight, source.stream.tokens]
                            for name, weight, source in zip(self.names, self.weights, self.sources)]}

    def state_dict(self) -> dict:
        return super().state_dict() | {"counts": list(self.counts)}

    def load_state_dict(self, state: dict) -> None:
        mine = self._identity()["sources"]
        if state.get("kind") == self.kind and state.get("sources") != mine:
            def said(sources) -> str:
                return ", ".join(f"{name} (weight {weight:g}, {tokens:,} tokens)" for name, weight, tokens in sources)
            raise DataError(f"cannot resume the blend's position: it was {said(state.get('sources') or [])} "
                            f"when saved, it is {said(mine)} now; a run resumes on the blend it started with")
        super().load_state_dict(state)
        counts = state.get("counts")
        if (not isinstance(counts, list) or len(counts) != len(self.names)
                or any(not isinstance(c, int) or c < 0 for c in counts) or sum(counts) != self.cursor):
            raise DataError(f"cannot resume the blend's position: its per-source counts {counts!r} do not "
                            f"add up to its {self.cursor} samples (a damaged checkpoint)")
        self.counts = list(counts)

    def describe(self) -> str:
        parts = folded([f"{name} {source.stream.tokens:,} tokens" for name, source in zip(self.names, self.sources)])
        return (f"blend [{self.split}]: {', '.join(parts)}; windows of {self.seq_len}+1, "
                f"rank {self.rank}/{self.world_size}")
