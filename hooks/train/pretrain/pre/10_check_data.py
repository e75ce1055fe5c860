"""Before training: the dataset named by data.path exists and was prepared (it has manifest.json).

A missing or half-prepared dataset otherwise surfaces minutes later, inside
every rank at once. data.path "synthetic" needs no files.
"""
import json
from pathlib import Path


def hook(ctx):
    data = (ctx.config or {}).get("data") or {}
    path = data.get("path")
    if not path or path == "synthetic":
        ctx.log.info("data.path is %r: no dataset files to check", path)
        return
    directory = Path(path).expanduser()  # relative paths: to the working directory (the checkout)
    prepare = f"inv data.prepare --out {path}"
    if not directory.is_dir():
        raise RuntimeError(f"data.path {path}: no such directory ({directory.resolve()}); prepare it: {prepare}")
    manifest = directory / "manifest.json"
    if not manifest.is_file():
        raise RuntimeError(f"data.path {path}: no manifest.json (unfinished or not a prepared dataset); "
                           f"run: {prepare}")
    try:
        info = json.loads(manifest.read_text())
    except (OSError, ValueError) as exc:
        raise RuntimeError(f"{manifest}: unreadable ({exc}); re-run: {prepare}") from None
    ctx.log.info("dataset %s: %s tokens", directory, info.get("tokens", "?") if isinstance(info, dict) else "?")
