"""Before training: record which data this run trains on, so it can be told apart months later.

Writes RUN/dataset.json: the data.path as given and resolved, the sha256 of the
dataset's manifest.json (which lists every shard with its size and token
count), the tokenizer, and the token counts. A blend (data.blend) lists the
same for every source under "blend", each with its name, weight and share.
Two runs with the same fingerprints trained on the same shards; `inv
snapshot.diff` shows the file. (That the datasets exist and fit the model was
checked before the run directory was made: trainer.train.check_data.)
"""
import hashlib
import json
from pathlib import Path


def dataset_record(path: str) -> dict:
    """What identifies the prepared dataset at `path`: its manifest's sha256 and what it says."""
    directory = Path(path).expanduser()   # relative paths: to the working directory (the checkout)
    raw = (directory / "manifest.json").read_bytes()
    info = json.loads(raw)
    return {"path": path, "resolved": str(directory.resolve()), "manifest_sha256": hashlib.sha256(raw).hexdigest(),
            "fingerprint": info.get("fingerprint"), "tokenizer": info.get("tokenizer"), "tokens": info.get("tokens"),
            "splits": {name: split.get("tokens") for name, split in (info.get("splits") or {}).items()
                       if isinstance(split, dict)}}


def hook(ctx):
    data = (ctx.config or {}).get("data") or {}
    blend = data.get("blend") or []
    path = data.get("path")
    if blend:
        total = sum(float(source["weight"]) for source in blend)
        record = {"blend": [{"name": source.get("name") or Path(source["path"]).name,
                             "weight": source["weight"], "share": float(source["weight"]) / total,
                             **dataset_record(source["path"])} for source in blend]}
        from trainer.data.blend import folded   # a long blend's line names the first few ("... N more")
        said = ", ".join(folded([f"{s['name']} {s['manifest_sha256'][:16]}" for s in record["blend"]]))
    elif path and path != "synthetic":
        record = dataset_record(path)
        said = record["manifest_sha256"][:16]
    else:
        record, said = {"path": path}, "synthetic tokens"
    if ctx.run_dir is not None:
        (Path(ctx.run_dir) / "dataset.json").write_text(json.dumps(record, indent=2) + "\n")
    ctx.log.info("dataset %s: %s", "blend" if blend else path, said)
