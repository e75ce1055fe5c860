"""Runs you can look at: one self-contained HTML file per report (`inv snapshot.report`).

    path = write(["runs/A"], out=None, runs_dir=Path("runs"))   # -> runs/A/report.html
    path = write(["runs/A", "runs/B"], out="ab.html")           # curves overlaid + snapshot.diff

Modules: sections (what each kind of run shows: training, preflight, fan-out, comm, benchmark),
charts (Plotly figure specs), downsample (min/max buckets for drawing), svg (the node topology
picture), page (the HTML: plotly.js from the plotly package, the data and styles inline).
The page loads nothing: no network, no server; it opens from a mail attachment or a shared file
system. Written atomically (core.files.write_atomic); an unwritable path is one line, exit 2.
"""
from __future__ import annotations

import datetime
from pathlib import Path

from core import names
from core.errors import UserError
from core.files import file_in_the_way, refuse_foreign, write_atomic

#: What every page page.render makes says in its header: a file with it is a report --out may replace.
MARK = "<p>Anvil run report · made "


class ReportError(UserError):
    """A run that is not there, an output that cannot be written, plotly not installed."""


def plotly_js() -> str:
    """plotly.min.js as the plotly package ships it (no CDN)."""
    try:
        from plotly.offline import get_plotlyjs
    except ImportError:
        raise ReportError("the plotly package is not installed; install the plot extra: "
                          "pip install -e '.[plot]'") from None
    return get_plotlyjs()


def default_out(paths: list[Path], runs_dir: Path) -> Path:
    if len(paths) == 1:
        return paths[0] / names.REPORT_HTML
    stamp = datetime.datetime.now().strftime("%Y-%m-%dT%H-%M-%S")
    return Path(runs_dir) / f"report_{stamp}_{len(paths)}-runs.html"


def check_out(out: Path, force: bool = False) -> Path:
    """The output path as given: a .html file (a folder gets report.html), new or a report; any file
    with `force`."""
    if out.is_dir():
        out = out / names.REPORT_HTML
    if out.suffix.lower() not in (".html", ".htm"):
        raise ReportError(f"--out {out}: expected an .html file or a folder")
    blocker = file_in_the_way(out)
    if blocker is not None:
        raise ReportError(f"--out {out}: cannot write it: {blocker} is a file, not a folder")
    refuse_foreign(out, ReportError, (MARK,), "a report snapshot.report wrote", force=force)
    return out


def build(runs: list, runs_dir: Path | None = None) -> tuple[str, list[Path]]:
    """(the HTML of the report of these runs, their directories)."""
    from runtime.report import page, sections

    if not runs:
        raise ReportError("no run given; expected one or more run directories")
    loaded = []
    for run in runs:
        rec, notes = sections.load(run, runs_dir)    # RunDirError (a UserError): not a run
        loaded.append((rec, notes))
    parts = []
    if len(loaded) > 1:
        parts.append(sections.compare([rec for rec, _ in loaded]))
    for rec, notes in loaded:
        part = sections.section(rec)
        part["notes"] = notes + part["notes"]
        parts.append(part)
    title = loaded[0][0].path.name if len(loaded) == 1 else f"{len(loaded)} runs: " + \
        ", ".join(rec.path.name for rec, _ in loaded)
    return page.render(parts, title, plotly_js()), [rec.path for rec, _ in loaded]


def write(runs: list, out: str | Path | None = None, runs_dir: Path | None = None, force: bool = False) -> Path:
    """Write the report of `runs` to `out` (default: RUN/report.html for one run, a dated file in
    the runs folder for several; both Anvil's own); returns its path. An --out that is a file the
    report did not write is refused unless `force`."""
    target = check_out(Path(out), force) if out else None      # before any work: a bad --out is one line
    html, paths = build(runs, runs_dir)
    target = target or default_out(paths, runs_dir or paths[0].parent)
    try:
        write_atomic(target, html)
    except OSError as exc:
        raise ReportError(f"cannot write {target}: {exc.strerror or exc}") from None
    return target
