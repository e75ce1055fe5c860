"""Before training: record which data this run trains on, so it can be told apart months later.

Writes RUN/dataset.json: the data.path as given and resolved, the sha256 of the
dataset's manifest.json (which lists every shard with its size and token
count), the tokenizer, and the token counts. Two runs with the same
fingerprint trained on the same shards; `inv snapshot.diff` shows the file.
(That the dataset exists and fits the model was checked before the run
directory was made: trainer.train.check_data.)
"""
import hashlib
import json
from pathlib import Path


def hook(ctx):
    data = (ctx.config or {}).get("data") or {}
    path = data.get("path")
    record = {"path": path}
    if path and path != "synthetic":
        directory = Path(path).expanduser()   # relative paths: to the working directory (the checkout)
        manifest = directory / "manifest.json"
        raw = manifest.read_bytes()
        info = json.loads(raw)
        record.update(resolved=str(directory.resolve()), manifest_sha256=hashlib.sha256(raw).hexdigest(),
                      fingerprint=info.get("fingerprint"), tokenizer=info.get("tokenizer"), tokens=info.get("tokens"),
                      splits={name: split.get("tokens") for name, split in (info.get("splits") or {}).items()
                              if isinstance(split, dict)})
    if ctx.run_dir is not None:
        (Path(ctx.run_dir) / "dataset.json").write_text(json.dumps(record, indent=2) + "\n")
    ctx.log.info("dataset %s: %s", path, record.get("manifest_sha256", "synthetic tokens")[:16])
