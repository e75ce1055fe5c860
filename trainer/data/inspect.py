"""What the model will read: token counts, document lengths, decoded samples."""
from __future__ import annotations

import hashlib

import numpy as np

from core.files import sha256_file

from .dataset import Dataset
from .errors import DataError
from .tokenizers import load_tokenizer


def length_histogram(lengths: np.ndarray) -> list[dict]:
    """Document lengths in power-of-two buckets [2^k, 2^(k+1))."""
    if not len(lengths):
        return []
    buckets = np.floor(np.log2(np.maximum(lengths, 1))).astype(int)
    counts = np.bincount(buckets)
    return [{"from": 1 << k, "to": (1 << (k + 1)) - 1, "documents": int(c)}
            for k, c in enumerate(counts) if c or (1 << k) >= lengths.min()]


def text_bars(histogram: list[dict], width: int = 40) -> str:
    peak = max((h["documents"] for h in histogram), default=0) or 1
    lines = []
    for h in histogram:
        bar = "#" * round(h["documents"] / peak * width)
        lines.append(f"{h['from']:>10,} - {h['to']:<10,} {h['documents']:>8,} {bar}".rstrip())
    return "\n".join(lines) or "    (no documents)"


def verify(dataset: Dataset) -> list[str]:
    """Recompute every shard's sha256; returns the files that do not match."""
    bad = []
    for split in dataset.manifest["splits"].values():
        for item in [*split["shards"], *([split["doc_index"]] if split.get("doc_index") else [])]:
            if sha256_file(dataset.path / item["file"]) != item["sha256"]:
                bad.append(item["file"])
    return bad


SCAN_LIMIT_BYTES = 1 << 30  # token ids are scanned by default up to this much shard data


def inspect_dataset(path, samples: int = 3, sample_chars: int = 400, split: str = "train",
                    seed: int = 0, check: bool = False) -> dict:
    """A report on a prepared dataset (plain data; the task prints it). Every token id is
    checked against the tokenizer's vocabulary when the shards total at most 1 GiB or with
    `check` (which also recomputes the checksums); an id outside it is a DataError."""
    if samples < 0:
        raise DataError(f"--samples: expected a number of documents >= 0, got {samples}")
    if sample_chars < 1:
        raise DataError(f"--chars: expected a positive number of characters per sample, got {sample_chars}")
    ds = Dataset(path)
    tok = load_tokenizer(path)
    m = ds.manifest
    shard_bytes = sum(int(shard["tokens"]) * ds.dtype.itemsize
                      for info in m["splits"].values() for shard in info["shards"])
    scan = check or shard_bytes <= SCAN_LIMIT_BYTES
    source = m.get("source") if isinstance(m.get("source"), dict) else {}
    report = {"path": str(ds.path), "created": m.get("created"), "anvil_version": m.get("anvil_version"),
              "dtype": m["dtype"], "documents": m["documents"], "tokens": m["tokens"],
              "tokenizer": m["tokenizer"], "source": {k: v for k, v in source.items()
                                                      if k != "skipped_examples"},
              "splits": {}, "samples": [], "token_ids_checked": scan}
    for name in m["splits"]:
        stream = ds.split(name)
        if scan:
            stream.check_ids(ds.vocab_size)
        lengths = stream.doc_lengths()
        stats = {"documents": stream.documents, "tokens": stream.tokens,
                 "shards": len(m["splits"][name]["shards"])}
        if len(lengths):
            stats |= {"min_len": int(lengths.min()), "median_len": int(np.median(lengths)),
                      "mean_len": round(float(lengths.mean()), 1), "max_len": int(lengths.max())}
        stats["histogram"] = length_histogram(lengths)
        report["splits"][name] = stats
    stream = ds.split(split)  # DataError naming the splits there are
    if samples and stream.documents:
        # a seeded, evenly spread choice of documents, the same on every call
        rng = np.random.default_rng(int.from_bytes(hashlib.sha256(f"{seed}".encode()).digest()[:4], "big"))
        picks = sorted(rng.choice(stream.documents, size=min(samples, stream.documents), replace=False))
        for i in picks:
            doc = stream.document(int(i))
            text = tok.decode(doc[: sample_chars * 2].tolist())
            report["samples"].append({"split": split, "document": int(i), "tokens": len(doc),
                                      "text": text[:sample_chars]})
    if check:
        report["checksums_bad"] = verify(ds)
    return report


def inspect_blend(sources, seq_len: int, samples: int, split: str = "train") -> dict:
    """What a blend (Source tuples: name, path, weight) gives over a run of `samples` global samples
    of seq_len+1 tokens: each source's share of the samples, its tokens, and how many passes over its
    windows that is (more than one: it repeats). Plain data; the task prints it."""
    from .blend import Source, blend_counts, check_same_tokenizer, shares

    if seq_len < 1 or samples < 0:
        raise DataError(f"a blend's report needs seq_len >= 1 and samples >= 0 (got {seq_len}, {samples})")
    sources = [Source(*s) for s in sources]
    datasets = [Dataset(s.path) for s in sources]
    check_same_tokenizer([(str(s.path), ds.manifest) for s, ds in zip(sources, datasets)])
    counts, exact = blend_counts([s.weight for s in sources], samples)
    rows = []
    for source, ds, share, count in zip(sources, datasets, shares([s.weight for s in sources]), counts):
        stream = ds.split(split)
        windows = (stream.tokens - 1) // seq_len
        if windows < 1:
            raise DataError(f"split {split!r} of {ds.path} has {stream.tokens:,} tokens, too few for one "
                            f"sequence of {seq_len}+1")
        rows.append({"name": source.name, "path": str(ds.path), "weight": source.weight, "share": share,
                     "split_tokens": stream.tokens, "windows": windows, "samples": count,
                     "realised_share": count / samples if samples else None, "tokens": count * seq_len,
                     "epochs": count / windows})
    return {"split": split, "seq_len": seq_len, "samples": samples, "tokens": samples * seq_len,
            "exact": exact, "tokenizer": datasets[0].manifest["tokenizer"], "sources": rows}
