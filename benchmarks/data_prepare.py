"""data.prepare against plain `tokenizers` on the same documents and cores: MB/s, tokens/s, peak RSS.

    python -m benchmarks.data_prepare [--sizes 20M,200M,2G] [--kinds jsonl,parquet,files]
        [--tokenizer tokenizer.json | --vocab 32768] [--workdir DIR] [--keep] [--json]

The corpus is real text: the standard library's modules, repeated to each size, one JSON line
per module (`jsonl`), the same rows as Parquet (`parquet`), and the smallest size as 100 JSONL
files (`files`). The tokenizer is a byte-level BPE of --vocab tokens trained on the standard
library (or --tokenizer). Each row runs, in separate processes one after the other:

    anvil      `inv data.prepare --input X --tokenizer T --out D --workers N --force -q`
    baseline   the loop a user writes with plain tokenizers: read the rows, encode_batch()
               1 MB of them at a time on the library's own thread pool (all cores), count ids

and samples the whole process tree's resident memory every 50 ms (workers included). Printed:
MB/s and tokens/s of both, their ratio, peak RSS, and seconds per GB (linear in size when it
stays flat). Goals (issue): peak RSS under 2 GiB at every size, at least 0.9x the baseline.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

REPO = checkout.ROOT
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}

BASELINE = r'''
import json, sys, os, pathlib
from tokenizers import Tokenizer

from core import checkout
tok = Tokenizer.from_file(sys.argv[1])
kind, paths = sys.argv[2], sys.argv[3:]
tokens = 0
def encode(texts):
    global tokens
    for e in tok.encode_batch(texts, add_special_tokens=False):
        tokens += len(e.ids) + 2           # BOS and EOS, as data.prepare counts them
def rows():
    for path in paths:
        if kind == "parquet":
            import pyarrow.parquet as pq
            for batch in pq.ParquetFile(path).iter_batches(batch_size=1024, columns=["text"]):
                yield from (t for t in batch.column(0).to_pylist() if t.strip())
        else:
            with open(path, "rb") as f:
                for line in f:
                    text = json.loads(line)["text"] if line.strip() else ""
                    if text.strip():               # data.prepare skips blank documents too
                        yield text
texts, size = [], 0
for text in rows():
    texts.append(text); size += len(text)
    if size >= 1 << 20:
        encode(texts); texts, size = [], 0
encode(texts)
print(json.dumps({"tokens": tokens}))
'''


def parse_size(text: str) -> int:
    text = text.strip().upper().rstrip("B")
    return int(float(text[:-1]) * UNITS[text[-1]]) if text[-1] in UNITS else int(text)


def documents() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(stdlib.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts or "tests" in path.parts:
            continue
        try:
            out.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return out


def write_jsonl(path: Path, docs: list[str], size: int) -> None:
    written, i = 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < size:
            line = json.dumps({"id": i, "text": docs[i % len(docs)]}) + "\n"
            f.write(line)
            written += len(line.encode())
            i += 1


def write_parquet(jsonl: Path, path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    writer, batch = None, []

    def flush():
        nonlocal writer, batch
        table = pa.table({"id": [r["id"] for r in batch], "text": [r["text"] for r in batch]})
        writer = writer or pq.ParquetWriter(path, table.schema)
        writer.write_table(table, row_group_size=2048)
        batch = []
    with open(jsonl, encoding="utf-8") as f:
        for line in f:
            batch.append(json.loads(line))
            if len(batch) == 8192:
                flush()
    if batch:
        flush()
    writer.close()


def split_files(jsonl: Path, folder: Path, count: int) -> None:
    folder.mkdir()
    lines = jsonl.read_text(encoding="utf-8").splitlines(keepends=True)
    per = -(-len(lines) // count)
    for i in range(count):
        (folder / f"part-{i:03d}.jsonl").write_text("".join(lines[i * per:(i + 1) * per]), encoding="utf-8")


def measure(command: list[str], cwd: Path, env: dict) -> dict:
    """Run `command`; wall seconds, peak RSS of its whole process tree, stdout."""
    import psutil
    started = time.perf_counter()
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = 0
    done = threading.Event()

    def sample():
        nonlocal peak
        root = psutil.Process(proc.pid)
        while not done.is_set():
            try:
                tree = [root, *root.children(recursive=True)]
                rss = 0
                for p in tree:
                    try:
                        rss += p.memory_info().rss
                    except psutil.Error:
                        pass
                peak = max(peak, rss)
            except psutil.Error:
                pass
            time.sleep(0.05)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate()
    done.set()
    sampler.join()
    if proc.returncode:
        raise SystemExit(f"{' '.join(command)} failed ({proc.returncode}):\n{err[-3000:]}")
    return {"seconds": time.perf_counter() - started, "peak_rss_gib": peak / (1 << 30), "stdout": out}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="20M,200M,2G")
    p.add_argument("--kinds", default="jsonl,parquet,files")
    p.add_argument("--tokenizer", default="", help="a tokenizer.json (default: train a BPE of --vocab)")
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--workdir", default="")
    p.add_argument("--keep", action="store_true", help="keep the corpora and datasets")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    kinds = args.kinds.split(",")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="anvil-data-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "INVOKE_ANVIL_RUNS_DIR": str(work / "runs")}
    inv = [str(Path(sys.executable).with_name("inv"))]
    if not Path(inv[0]).is_file():   # Anvil on PYTHONPATH, not installed (a lent GPU machine)
        inv = [sys.executable, "-m", "runtime.program.main"]
    docs = documents()
    tokenizer = args.tokenizer
    if not tokenizer:
        tokenizer = str(work / f"bpe{args.vocab}.json")
        if not Path(tokenizer).is_file():
            from trainer.data.tokenizers import train_bpe
            train_bpe(docs, args.vocab, Path(tokenizer))
    rows = []
    try:
        for size in sizes:
            jsonl = work / f"corpus-{size}.jsonl"
            if not jsonl.is_file():
                write_jsonl(jsonl, docs, size)
            inputs = {"jsonl": (jsonl, "jsonl", [jsonl])}
            if "parquet" in kinds:
                parquet = work / f"corpus-{size}.parquet"
                if not parquet.is_file():
                    write_parquet(jsonl, parquet)
                inputs["parquet"] = (parquet, "parquet", [parquet])
            if "files" in kinds and size == min(sizes):
                folder = work / f"files-{size}"
                if not folder.is_dir():
                    split_files(jsonl, folder, 100)
                inputs["files"] = (folder, "jsonl", sorted(folder.iterdir()))
            for kind in kinds:
                if kind not in inputs:
                    continue
                given, reader, paths = inputs[kind]
                mb = jsonl.stat().st_size / 1e6       # the same text in every kind: MB of JSONL
                out = work / f"ds-{kind}-{size}"
                ours = measure([*inv, "data.prepare", "--input", str(given), "--tokenizer", tokenizer, "--out",
                                str(out), "--workers", str(args.workers), "--force", "-q", "--json"], REPO, env)
                manifest = json.loads(ours["stdout"])["manifest"]
                base = measure([sys.executable, "-c", BASELINE, tokenizer, reader, *map(str, paths)], REPO, env)
                base_tokens = json.loads(base["stdout"])["tokens"]
                if base_tokens != manifest["tokens"]:
                    print(f"note: {kind} {size}: baseline counted {base_tokens:,} tokens, data.prepare "
                          f"{manifest['tokens']:,}", file=sys.stderr)
                row = {"kind": kind, "mb": round(mb, 1), "files": len(paths), "tokens": manifest["tokens"],
                       "anvil_s": round(ours["seconds"], 1), "anvil_mb_s": round(mb / ours["seconds"], 3),
                       "anvil_tok_s": round(manifest["tokens"] / ours["seconds"]),
                       "anvil_peak_rss_gib": round(ours["peak_rss_gib"], 3),
                       "anvil_s_per_gb": round(ours["seconds"] / mb * 1000, 1),
                       "baseline_s": round(base["seconds"], 1), "baseline_mb_s": round(mb / base["seconds"], 3),
                       "baseline_peak_rss_gib": round(base["peak_rss_gib"], 3),
                       "ratio": round(base["seconds"] / ours["seconds"], 3)}
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
                if not args.keep:
                    shutil.rmtree(out, ignore_errors=True)
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    result = {"workers": args.workers, "cores": len(os.sched_getaffinity(0)), "tokenizer": tokenizer,
              "vocab": json.loads(Path(tokenizer).read_text())["model"].get("vocab") and args.vocab, "rows": rows}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        from tabulate import tabulate
        print(tabulate([[r["kind"], r["mb"], r["files"], r["anvil_mb_s"], r["anvil_tok_s"], r["anvil_peak_rss_gib"],
                         r["anvil_s_per_gb"], r["baseline_mb_s"], r["baseline_peak_rss_gib"], r["ratio"]]
                        for r in rows],
                       headers=["input", "MB", "files", "MB/s", "tokens/s", "peak RSS GiB", "s/GB",
                                "tokenizers MB/s", "its RSS GiB", "x tokenizers"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
