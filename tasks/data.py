"""inv data.*: prepare a corpus into token shards, train a BPE tokenizer, inspect a dataset."""
import json
import sys

from invoke import Collection, task

DEFAULT_DATASET = "data/stdlib"


def _paths(values) -> list[str] | None:
    """--input may repeat and may hold comma-separated paths; None when it was not given.
    Given but naming nothing (--input '', --input ,) is an error, not the default corpus."""
    from trainer.data import DataError

    paths = [p for v in values or () for p in v.split(",") if p.strip()]
    if values and not paths:
        raise DataError("--input is empty; expected a file or directory (leave --input out for "
                        "the Python standard library)")
    return paths or None


@task(iterable=["input"], help={
    "input": "text, JSONL (.gz/.zst), Parquet or Arrow file, a folder of them, or a datasets.save_to_disk "
             "folder; repeat or comma-separate. Default: the Python stdlib",
    "out": f"dataset directory to write (default {DEFAULT_DATASET})",
    "tokenizer": "byte (default), bpe (trained on the inputs), or a tokenizer.json or a folder holding one",
    "vocab_size": "vocabulary size when --tokenizer bpe (default 8192; only with bpe)",
    "val_fraction": "share of documents held out for validation (default 0.01)",
    "text_field": "JSONL field or Parquet/Arrow column holding the text (default text)",
    "workers": "worker processes (default: all cores)",
    "shard_tokens": "tokens per shard file (default 134217728, at least 1000)",
    "max_docs": "stop after this many documents",
    "max_tokens": "stop once this many tokens are written",
    "max_doc_bytes": "a longer document is skipped (a text file: cut there), e.g. 64M (the default) or 1G",
    "max_ratio": "a compressed file whose content grows more than this many times its compressed bytes is "
                 "left out as a bomb (default 100; 0: off)",
    "pattern": "file-name glob inside directories (default * ; *.py for the stdlib)",
    "seed": "seed of the validation split",
    "force": "rebuild even if the dataset is up to date",
    "quiet": "no progress display",
    "json": "print the result as JSON",
    "runtime": "direct (this machine), slurm (every node of the allocation, or --nodes N) or ssh (--hosts): "
               "the nodes share the work (default: the anvil.runtime setting)",
    "nodes": "Slurm: nodes to share the work (default: the allocation's)",
    "hosts": "SSH hosts to share the work, comma-separated (inv -H a,b data.prepare gives them too)",
})
def prepare(c, input=None, out=DEFAULT_DATASET, tokenizer="byte", vocab_size=0, val_fraction="0.01",
            text_field="text", workers=0, shard_tokens=1 << 27, max_docs=0, max_tokens=0, pattern=None,
            seed=0, force=False, quiet=False, json_=False, runtime="", nodes=0, hosts="", max_doc_bytes="",
            max_ratio=""):
    """Tokenize a corpus into train/val token shards with a manifest (streamed, parallel, resumable, multi-node)."""
    from runtime.jobs.data import prepare as prepare_dataset
    from trainer.data import DataError
    from trainer.data.options import limit_options
    from trainer.data.prepare import DEFAULT_BPE_VOCAB

    try:
        val_fraction = float(val_fraction)
    except ValueError:
        raise DataError(f"--val-fraction: expected a number in [0, 1), got {val_fraction!r}") from None
    if vocab_size and tokenizer != "bpe":
        raise DataError(f"--vocab-size applies to --tokenizer bpe only (with {tokenizer!r} the "
                        f"vocabulary is the tokenizer's own); expected --tokenizer bpe or no --vocab-size")
    vocab_size = vocab_size or DEFAULT_BPE_VOCAB
    # a DataError (a UserError) reaches the program's executor: one line, exit 2
    result = prepare_dataset(c, _paths(input), out, tokenizer, runtime=runtime, nodes=nodes, hosts=hosts,
                             val_fraction=val_fraction, text_field=text_field, workers=workers or None,
                             shard_tokens=shard_tokens, max_docs=max_docs or None,
                             max_tokens=max_tokens or None, vocab_size=vocab_size, seed=seed,
                             pattern=pattern, force=force, progress=not quiet,
                             **limit_options(max_doc_bytes, max_ratio))
    if json_:
        print(json.dumps(result, indent=1))
        return
    from tabulate import tabulate

    m = result["manifest"]
    _print_notes(result["notes"], f"{result['path']}/manifest.json")
    if result["status"] == "up-to-date":
        print(f"{result['path']} is up to date ({m['documents']:,} documents, {m['tokens']:,} tokens; "
              f"--force rebuilds)")
        return
    rows = [[name, s["documents"], s["tokens"], len(s["shards"])] for name, s in m["splits"].items()]
    print(tabulate(rows, headers=["split", "documents", "tokens", "shards"], intfmt=","))
    formats = ", ".join(f"{n:,} {name}" for name, n in (m["source"].get("formats") or {}).items())
    print(f"tokenizer {m['tokenizer']['kind']} (vocab {m['tokenizer']['vocab_size']:,}, {m['dtype']}); "
          f"{m['source']['files_used']:,}/{m['source']['files']:,} files used"
          + (f" ({formats})" if formats else "") + "; skipped: "
          + _skipped_text(m["source"]["skipped"]) + _changed_text(m["source"].get("changed"))
          + (" (stopped at --max-docs/--max-tokens)" if m["source"]["truncated"] else ""))
    print(f"wrote {result['path']} in {result['seconds']:.1f}s")


def _skipped_text(skipped: dict | None) -> str:
    """{"empty": 3, "binary": 1} -> "1 binary, 3 empty" (the manifest's skipped-file counts by reason)."""
    return ", ".join(f"{n:,} {reason}" for reason, n in sorted((skipped or {}).items())) or "none"


def _changed_text(changed: dict | None) -> str:
    """"; changed: 2 replaced_unencodable" (documents kept but altered, by reason), or "" when none was."""
    return f"; changed: {_skipped_text(changed)}" if changed else ""


def _print_notes(notes: list[str], where: str) -> None:
    """The first ten notes (what was skipped or changed, and where), and where the rest are."""
    for note in notes[:10]:
        print(f"  note: {note}")
    if len(notes) > 10:
        print(f"  note: ... and {len(notes) - 10} more in {where}")


def _documents_text(result: dict) -> str:
    """What data.tokenizer trained on: "1,234 documents from 30 files", and where it stopped early."""
    documents, files = result["documents"], result["files"]
    text = f"{documents:,} document{'' if documents == 1 else 's'} from {files:,} file{'' if files == 1 else 's'}"
    if result.get("max_docs") and documents >= result["max_docs"]:
        text += " (stopped at --max-docs)"
    return text


@task(iterable=["input"], help={
    "vocab_size": "vocabulary size including the 3 special tokens",
    "input": "corpus files/directories as for data.prepare (default: the Python stdlib)",
    "out": "where to write tokenizer.json (default data/tokenizer-bpe<N>.json)",
    "text_field": "JSONL field holding the text",
    "max_docs": "train on at most this many documents",
    "pattern": "file-name glob inside directories",
    "max_doc_bytes": "as for data.prepare: a longer document is left out (default 64M)",
    "max_ratio": "as for data.prepare: a compressed file past this ratio is left out (default 100; 0: off)",
    "json": "print the result as JSON",
})
def tokenizer(c, vocab_size=8192, input=None, out=None, text_field="text", max_docs=0, pattern=None,
              json_=False, max_doc_bytes="", max_ratio=""):
    """Train a byte-level BPE tokenizer (Hugging Face tokenizers) and save tokenizer.json."""
    from trainer.data import train_tokenizer

    from trainer.data import DataError
    from trainer.data.options import limit_options

    if out is not None and not out.strip():
        raise DataError("--out is empty; expected a file path such as data/bpe8192.json "
                        f"(left out: data/tokenizer-bpe{vocab_size}.json)")
    out = out or f"data/tokenizer-bpe{vocab_size}.json"
    result = train_tokenizer(_paths(input), out, vocab_size, text_field=text_field,
                             max_docs=max_docs or None, pattern=pattern, **limit_options(max_doc_bytes, max_ratio))
    if result["vocab_size"] < vocab_size:   # BPE stops when no pair is left to merge
        print(f"WARNING: the corpus gave only {result['vocab_size']:,} of the {vocab_size:,} tokens asked for "
              "(too little text to merge more pairs); a larger corpus gives the full vocabulary", file=sys.stderr)
    if not json_ and (result["skipped"] or result["changed"]):
        _print_notes(result["notes"], "the --json result")
        print(f"skipped: {_skipped_text(result['skipped'])}{_changed_text(result['changed'])}")
    if json_:
        print(json.dumps(result, indent=1))
        return
    print(f"trained BPE (vocab {result['vocab_size']:,}) on {_documents_text(result)} in "
          f"{result['seconds']:.1f}s -> {result['path']}")
    print(f"use it: inv data.prepare --tokenizer {out}")


@task(name="inspect", iterable=["set_"], help={
    "path": f"dataset directory (default {DEFAULT_DATASET})",
    "config": "a training config instead of --path: its data.path, or its data.blend's shares over the run",
    "set": "override KEY=VALUE of --config, as for train.pretrain (repeatable)",
    "world": "data-parallel ranks of the run (GPUs x nodes) for a blend's report (default 1)",
    "samples": "decoded sample documents to show (default 3)",
    "chars": "characters per sample (default 400)",
    "split": "split to sample from (default train)",
    "verify": "recompute every shard's sha256 against the manifest",
    "json": "print the report as JSON",
})
def inspect_(c, path=None, samples=3, chars=400, split="train", verify=False, json_=False, config=None, set_=None,
             world=1):
    """Token counts, document length histogram, decoded samples and tokenizer of a dataset;
    with --config, of the config's dataset, or what each dataset of its blend gives over the run."""
    from trainer.data import DataError, inspect_dataset
    from trainer.data.inspect import text_bars

    if config is not None or set_:
        from trainer.config import SYNTHETIC, load

        if path is not None:
            raise DataError("--path and --config both name data; give one (--config reads data.path or "
                            "data.blend from the training config)")
        cfg = load(config or None, list(set_ or []))
        if cfg.data.blend:
            return _print_blend(cfg, world, json_)
        if cfg.data.path == SYNTHETIC:
            raise DataError(f"{config or 'the default config'}: data.path is synthetic (random tokens): "
                            f"no dataset to inspect")
        path = cfg.data.path
    path = DEFAULT_DATASET if path is None else path
    report = inspect_dataset(path, samples=samples, sample_chars=chars, split=split, check=verify)
    if json_:
        print(json.dumps(report, indent=1))
    else:
        from tabulate import tabulate

        tok = report["tokenizer"]
        print(f"{report['path']}: {report['documents']:,} documents, {report['tokens']:,} tokens "
              f"({report['dtype']}), made {report['created']} by anvil {report['anvil_version']}")
        print(f"tokenizer: {tok['kind']}, vocab {tok['vocab_size']:,}, bos {tok['bos_id']}, "
              f"eos {tok['eos_id']}, pad {tok['pad_id']}" + (f", {tok['path']}" if tok.get("path") else ""))
        src = report["source"]
        formats = ", ".join(f"{n:,} {name}" for name, n in (src.get("formats") or {}).items())
        print(f"source: {', '.join(map(str, src.get('inputs') or ['?']))} ({src.get('files_used', '?')}/"
              f"{src.get('files', '?')} files used" + (f": {formats}" if formats else "")
              + f", skipped: {_skipped_text(src.get('skipped'))}{_changed_text(src.get('changed'))})")
        cols = ["documents", "tokens", "shards", "min_len", "median_len", "mean_len", "max_len"]
        rows = [[name] + [s.get(k, "") for k in cols] for name, s in report["splits"].items()]
        print(tabulate(rows, headers=["split"] + cols, intfmt=",", floatfmt=",.0f"))
        for name, s in report["splits"].items():
            print(f"\ndocument length ({name}, tokens):\n{text_bars(s['histogram'])}")
        for sample in report["samples"]:
            print(f"\n--- {sample['split']} document {sample['document']} ({sample['tokens']:,} tokens) ---")
            print(sample["text"])
    if verify and report["checksums_bad"]:
        raise DataError(f"dataset {report['path']} is damaged: the sha256 of "
                        f"{', '.join(report['checksums_bad'])} differs from the manifest; "
                        f"prepare it again with --force")
    if verify and not json_:
        print("\nchecksums: all shards match the manifest")


def _print_blend(cfg, world: int, json_: bool) -> None:
    """What each dataset of cfg's blend gives over train.steps steps on `world` ranks."""
    from trainer.data import DataError, inspect_blend
    from trainer.data.blend import tokenizer_text

    if world < 1:
        raise DataError(f"--world: expected a positive number of data-parallel ranks, got {world}")
    d = cfg.data
    per_step = d.batch_size * d.grad_accum * world
    report = inspect_blend([(s.name, s.path, s.weight) for s in d.blend], d.seq_len, cfg.train.steps * per_step)
    report |= {"steps": cfg.train.steps, "samples_per_step": per_step, "world": world}
    if json_:
        print(json.dumps(report, indent=1))
        return
    from tabulate import tabulate

    print(f"blend of {len(report['sources'])} datasets ({tokenizer_text(report['tokenizer'])}) over "
          f"train.steps={cfg.train.steps:,} x {per_step:,} samples (batch {d.batch_size} x accum {d.grad_accum} "
          f"x world {world}): {report['samples']:,} samples of {d.seq_len}+1, {report['tokens']:,} tokens")
    rows = [[s["name"], s["weight"], f"{s['share']:.1%}", s["split_tokens"], s["samples"],
             "" if s["realised_share"] is None else f"{s['realised_share']:.2%}", s["tokens"], f"{s['epochs']:.2f}",
             s["path"]] for s in report["sources"]]
    print(tabulate(rows, headers=["source", "weight", "share", "train tokens", "samples", "realised",
                                  "tokens", "epochs", "path"], intfmt=",", disable_numparse=[5, 7]))
    if not report["exact"]:
        print("(samples: each share of the run rounded to whole samples; the blend stays within about a "
              "sample of these)")
    data_tokens = sum(s["split_tokens"] for s in report["sources"])
    for s in report["sources"]:
        if s["epochs"] > 1:
            why = (f": its share of the run ({s['share']:.1%}) is larger than its share of the data "
                   f"({s['split_tokens'] / data_tokens:.1%})" if s["share"] > s["split_tokens"] / data_tokens else "")
            print(f"note: {s['name']} repeats, {s['epochs']:.2f} epochs of its {s['windows']:,} windows{why}; "
                  f"each epoch in a new order")


prepare.takes_hosts = True   # inv -H a,b data.prepare: once, here, with the hosts sharing the work

ns = Collection("data")
ns.add_task(prepare)
ns.add_task(tokenizer)
ns.add_task(inspect_)
