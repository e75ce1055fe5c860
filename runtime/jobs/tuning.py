"""TunableOp's results file around a run (--tune-gemm): which one it used, kept with the run, and the same one
for its replay.

    with tuning.kept(run):        # nothing at all unless the run's environment turns TunableOp on
        code = transport.launch(...)

Before the launch: a replay (names.REPLAY_OF) whose cache has lost a results file the replayed run kept gets
that file back, so the replay runs the GEMM solutions the run ran; then what the cache holds is recorded.
After it: metadata.json's `tunableop` says which file (`cache`: its key; the path with %d for the device
ordinal), each file's sha256 and number of tuned GEMMs before and after, and a copy of each goes into
RUN/tunableop/. The file itself is TunableOp's: read at the first GEMM, rewritten at exit with what was tuned.
"""
from __future__ import annotations

import contextlib
import hashlib
import re
import shutil
from pathlib import Path


KEPT = "tunableop"


def enabled(env) -> bool:
    return env.get("PYTORCH_TUNABLEOP_ENABLED") == "1" and bool(env.get("PYTORCH_TUNABLEOP_FILENAME"))


def results_files(pattern: str) -> list[Path]:
    """The files TunableOp writes for `pattern` (its %d is each process's device ordinal)."""
    path = Path(pattern)
    if "%d" not in path.name:
        return [path] if path.is_file() else []
    head, _, tail = path.name.partition("%d")
    match = re.compile(re.escape(head) + r"\d+" + re.escape(tail) + "$")
    return sorted(p for p in path.parent.glob(f"{head}*{tail}") if match.match(p.name)) if path.parent.is_dir() else []


def describe(path: Path) -> dict:
    """sha256 of a results file, its GEMMs (lines other than the Validator ones) and how many of those chose a
    solution other than the library's default."""
    data = path.read_bytes()
    rows = [line.split(",") for line in data.decode("utf-8", "replace").splitlines()
            if line.strip() and not line.startswith("Validator")]
    return {"sha256": hashlib.sha256(data).hexdigest(), "gemms": len(rows),
            "not_default": sum(1 for row in rows if len(row) > 2 and row[2].strip() != "Default")}


def _state(pattern: str) -> dict:
    out = {}
    for path in results_files(pattern):
        try:
            out[path.name] = describe(path)
        except OSError:
            continue
    return out


def restore(run, pattern: str) -> list[str]:
    """On a replay, the results files the replayed run kept, put back where the cache lost them."""
    original = run.metadata.get("replay_of")
    if not original:
        return []
    kept = Path(original) / KEPT
    restored = []
    target = Path(pattern).parent
    for copy in sorted(kept.glob("*.csv")) if kept.is_dir() else []:
        dest = target / copy.name
        if not dest.exists():
            target.mkdir(parents=True, exist_ok=True)
            shutil.copy2(copy, dest)
            restored.append(copy.name)
    return restored


@contextlib.contextmanager
def kept(run):
    env = run.env
    if not enabled(env):
        yield
        return
    pattern = env["PYTORCH_TUNABLEOP_FILENAME"]
    try:   # TunableOp writes its file at exit and makes no folder: without one its tuning is lost
        Path(pattern).parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        run.log.warning(f"--tune-gemm: cannot create {Path(pattern).parent} ({exc.strerror or exc}): "
                        "the shapes tuned in this run will not be kept")
    restored = restore(run, pattern)
    record = {"file": pattern, "cache": Path(pattern).parent.name, "before": _state(pattern),
              **({"restored_from_replayed_run": restored} if restored else {})}
    run.update_metadata(tunableop=record)
    try:
        yield
    finally:
        record["after"] = _state(pattern)
        for path in results_files(pattern):
            try:
                run.write_text(f"{KEPT}/{path.name}", path.read_text(encoding="utf-8", errors="replace"))
            except OSError:
                continue
        record["kept"] = KEPT if record["after"] else None
        run.update_metadata(tunableop=record)
