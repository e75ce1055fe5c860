"""metrics.jsonl -> one PNG: loss (train, val), throughput (tokens/s, MFU), memory, lr/grad norm.

    plot_run(run_dir, out_png=None, curves=None) -> Path   (default RUN_DIR/plots/metrics.png; out_png
                                                           may also be a directory to put metrics.png in)

A step logged twice (before a kill and again after the resume) is drawn once, with its last
value, and each resume is marked with a dotted vertical line. `inv train.plot` hands it every
segment of a run resumed into a new run directory (runtime.runs.metrics). Needs matplotlib (the `plot`
extra); drawn with the Agg backend, so no display is needed.
"""
from __future__ import annotations

import io
import os
from pathlib import Path

from core import names, runfiles
from core.errors import UserError
from core.files import file_in_the_way, make_parent, refuse_foreign, write_atomic

#: The PNG's Software text (a chunk before the image data): what an --out may replace is a plot of ours.
MARK = "Anvil train.plot"
PANELS = ("Loss", "Throughput", "Memory", "Learning rate and gradient norm")


class PlotError(UserError):
    """No run dir, no metrics yet, or matplotlib missing: the message says which."""


def read_metrics(run_dir: Path) -> tuple[dict[int, dict], dict[int, dict], list[int]]:
    """(train records by step, val records by step, steps at which a resume restarted the
    log) of this run directory's metrics.jsonl. Lines cut short by a kill are skipped. (A run
    resumed into a new run directory continues an earlier one's curve: runtime.runs.metrics
    reads every segment, and `inv train.plot` draws those.)"""
    path = Path(run_dir) / names.METRICS
    if Path(run_dir).exists() and not Path(run_dir).is_dir():
        raise PlotError(f"{run_dir}: not a directory; expected a run directory (it holds metrics.jsonl)")
    if not Path(run_dir).is_dir():
        raise PlotError(f"{run_dir}: no such run directory")
    if not path.is_file():
        raise PlotError(f"{run_dir}: no metrics.jsonl (rank 0 writes it from the first logged "
                        "step; has this run trained yet?)")
    log = runfiles.read_metrics(path)
    if not log.train:
        raise PlotError(f"{path}: no training steps logged yet")
    return log.train, log.val, log.restarts


def _series(records: dict[int, dict], key: str) -> tuple[list[int], list[float]]:
    steps = [s for s in sorted(records) if isinstance(records[s].get(key), (int, float))]
    return steps, [float(records[s][key]) for s in steps]


def build_figure(train: dict[int, dict], val: dict[int, dict], resumes=(), title: str = ""):
    """The matplotlib Figure (2x2 panels named in PANELS)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5), sharex=True, constrained_layout=True)
    (ax_loss, ax_tput), (ax_mem, ax_lr) = axes
    resume_lines = []
    for ax, name in zip(axes.flat, PANELS):
        ax.set_title(name, fontsize=11, loc="left")
        ax.grid(True, alpha=0.3)
        resume_lines = [ax.axvline(step, color="0.5", linestyle=":", linewidth=1) for step in resumes]
    for ax in (ax_mem, ax_lr):
        ax.set_xlabel("step")

    handles = ax_loss.plot(*_series(train, "loss"), label="train", color="C0", linewidth=1.2)
    if val:
        handles += ax_loss.plot(*_series(val, "val_loss"), "o-", label="validation", color="C3", markersize=4)
    if resume_lines:
        resume_lines[0].set_label("resumed from a checkpoint")
        handles.append(resume_lines[0])
    ax_loss.set_ylabel("loss (nats/token)")
    ax_loss.legend(handles=handles, loc="upper right", framealpha=0.9)

    steps, tps = _series(train, "tokens_per_s")
    handles = ax_tput.plot(steps, [t / 1e3 for t in tps], color="C2", label="tokens/s (all ranks)")
    ax_tput.set_ylabel("thousand tokens/s")
    mfu_steps, mfu = _series(train, "mfu")
    if mfu_steps:
        twin = ax_tput.twinx()
        handles += twin.plot(mfu_steps, [m * 100 for m in mfu], color="C1", linestyle="--", label="MFU")
        twin.set_ylabel("MFU (%)")
        twin.set_ylim(0, max(mfu) * 100 * 1.25)
    if tps:  # from zero: jitter of a few percent should look like a few percent
        ax_tput.set_ylim(0, max(tps) / 1e3 * 1.25)
    ax_tput.legend(handles=handles, loc="lower right", framealpha=0.9)

    peak = 0.0
    for key, label, color in (("gpu_mem_gib", "GPU peak allocated", "C4"),
                              ("gpu_mem_reserved_gib", "GPU reserved", "C5"),
                              ("rss_gib", "process RSS (rank 0)", "C7")):
        steps, values = _series(train, key)
        if steps:
            ax_mem.plot(steps, values, label=label, color=color)
            peak = max(peak, *values)
    ax_mem.set_ylabel("GiB")
    if peak:
        ax_mem.legend(loc="best", framealpha=0.9)
        ax_mem.set_ylim(0, peak * 1.15)

    lr_handles = ax_lr.plot(*_series(train, "lr"), color="C0", label="learning rate")
    ax_lr.set_ylabel("learning rate")
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    gsteps, gnorm = _series(train, "grad_norm")
    if gsteps:
        twin = ax_lr.twinx()
        lr_handles += twin.plot(gsteps, gnorm, color="C3", alpha=0.7, linewidth=1, label="grad norm")
        twin.set_ylabel("gradient norm (before clipping)")
    ax_lr.legend(handles=lr_handles, loc="upper right", framealpha=0.9)

    if title:
        fig.suptitle(title, fontsize=12)
    return fig


def _title(run_dir: Path, train: dict) -> str:
    parts = [run_dir.name]
    try:
        summary = runfiles.read_summary(run_dir)
        world = summary.get("world_size", "?")
        parts.append(f"{summary.get('config', '')} · {world} process{'' if world == 1 else 'es'} · "
                     f"{summary.get('device', '')} · {summary.get('status', '')}")
    except (OSError, ValueError):
        parts.append("running")
    parts.append(f"{max(train)} steps")
    return "  |  ".join(p for p in parts if p)


def plot_run(run_dir: str | os.PathLike, out_png: str | os.PathLike | None = None, curves=None,
             force: bool = False) -> Path:
    """Draw RUN_DIR/metrics.jsonl to out_png (a .png path or a directory; default
    RUN_DIR/plots/metrics.png); returns the PNG's path. curves: (train, val, resumes) already
    read, e.g. every segment of a resumed run (runtime.runs.metrics), instead of this file's.
    An out_png that is a file this function did not draw is refused unless `force`."""
    if not str(run_dir).strip():
        raise PlotError("the run is empty; expected a run directory (it holds metrics.jsonl)")
    run_dir = Path(run_dir)
    train, val, resumes = curves if curves is not None and curves[0] else read_metrics(run_dir)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotError("matplotlib is not installed; install the plot extra: "
                        "pip install -e '.[plot]'") from None
    out = Path(out_png) if out_png else run_dir / "plots"
    if out.suffix == "" or out.is_dir():  # a directory: the PNG goes inside it
        out = out / "metrics.png"
    if out.suffix.lower() != ".png":
        raise PlotError(f"{out}: the output must be a .png file or a directory")
    blocker = file_in_the_way(out)
    if blocker is not None:
        raise PlotError(f"--out {out}: a file is in the way where a directory is needed ({blocker})")
    if out.is_dir():
        raise PlotError(f"--out {out} is a directory; expected a .png file or a directory to put "
                        f"metrics.png in")
    if out_png:   # (the default, RUN/plots/metrics.png, is the run's own, whoever drew it)
        refuse_foreign(out, PlotError, (MARK,), "a plot train.plot drew", force=force)
    make_parent(out, PlotError)
    fig = build_figure(train, val, resumes, title=_title(run_dir, train))
    try:
        buffer = io.BytesIO()
        fig.savefig(buffer, dpi=110, format="png", metadata={"Software": MARK})
    finally:
        from matplotlib import pyplot as plt

        plt.close(fig)
    try:
        write_atomic(out, buffer.getvalue())  # (its mode: as savefig made it, the umask's, not mkstemp's 0600)
    except OSError as exc:
        raise PlotError(f"--out {out}: cannot write it in {out.parent} ({exc.strerror or exc})") from None
    return out
