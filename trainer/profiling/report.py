"""The breakdown as people read it: a table, the candidates with their actions, two runs side by side, a chart.

    print(table(bd))                     # category | ms/step | share
    print(advice_lines(candidates))      # one line per candidate
    print(compare_table(bd_a, bd_b, "A", "B"))
    chart(summary, out_png)              # a bar chart per profiled rank (matplotlib; None without it)
"""
from __future__ import annotations

from pathlib import Path

from core.files import write_atomic
from trainer.profiling.breakdown import row_of


def _ms(value: float) -> str:
    return f"{value:.2f}"


def _share(value: float) -> str:
    return f"{value * 100:.1f}%"


def table(bd: dict) -> str:
    """category | ms/step | share of the step, then the step itself."""
    from tabulate import tabulate

    rows = []
    for row in bd["rows"]:
        label = row["label"]
        ms = _ms(row["ms"])
        if row["category"] == "communication":
            label, ms = "communication exposed / total", f"{row['ms']:.2f} / {row['total_ms']:.2f}"
        rows.append([label, ms, _share(row["share"])])
    if bd.get("overlap_ms", 0) > 0.005 * bd["step_ms"]:
        rows.append(["(kernels at once on two streams)", f"-{bd['overlap_ms']:.2f}",
                     f"-{bd['overlap_ms'] / bd['step_ms'] * 100:.1f}%"])
    rows.append(["step", _ms(bd["step_ms"]), "100.0%"])
    return tabulate(rows, headers=["category", "ms/step", "share"], tablefmt="simple", disable_numparse=True, colalign=("left", "right",
                                                                                                  "right"))


def advice_lines(found: list[dict]) -> str:
    if not found:
        return "no category other than the GEMMs is over 2% of the step."
    return "\n".join(f"- {c['label']} ({_share(c['share'])}, {c['ms']:.2f} ms): {c['action']}" for c in found)


def compare_table(a: dict, b: dict, name_a: str = "A", name_b: str = "B") -> str:
    """The two tables side by side with B - A per category (ms per step and share points)."""
    from tabulate import tabulate

    rows = []
    keys = [r["category"] for r in a["rows"]] + [r["category"] for r in b["rows"] if r["category"] not in {x["category"] for x in a["rows"]}]
    for key in keys:
        ra = _row_or_zero(a, key)
        rb = _row_or_zero(b, key)
        label = ra.get("label") or rb.get("label")
        rows.append([label, _ms(ra["ms"]), _share(ra["share"]), _ms(rb["ms"]), _share(rb["share"]),
                     f"{rb['ms'] - ra['ms']:+.2f}", f"{(rb['share'] - ra['share']) * 100:+.1f}"])
        if key == "communication":
            rows.append(["communication total", _ms(ra.get("total_ms", 0.0)), "", _ms(rb.get("total_ms", 0.0)), "",
                         f"{rb.get('total_ms', 0.0) - ra.get('total_ms', 0.0):+.2f}", ""])
    rows.append(["step", _ms(a["step_ms"]), "", _ms(b["step_ms"]), "", f"{b['step_ms'] - a['step_ms']:+.2f}",
                 f"{(b['step_ms'] / a['step_ms'] - 1) * 100:+.1f}% time" if a["step_ms"] else ""])
    return tabulate(rows, headers=["category", f"{name_a} ms", "share", f"{name_b} ms", "share", "diff ms",
                                   "diff pts"], tablefmt="simple", disable_numparse=True, colalign=("left",) + ("right",) * 6)


def _row_or_zero(bd: dict, key: str) -> dict:
    try:
        return row_of(bd, key)
    except StopIteration:
        return {"category": key, "label": "", "ms": 0.0, "share": 0.0, "total_ms": 0.0}


def chart(per_rank: dict[str, dict], out_png: str | Path, title: str = "") -> Path | None:
    """Horizontal bars of ms per step by category, one group per profiled rank; None where matplotlib is
    missing (the table and summary.json carry the same figures)."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    ranks = [r for r, bd in per_rank.items() if "rows" in bd]
    if not ranks:
        return None
    labels = [row["label"] for row in per_rank[ranks[0]]["rows"]]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(labels) * max(1, len(ranks)) + 1.5), constrained_layout=True)
    height = 0.8 / len(ranks)
    for i, rank in enumerate(ranks):
        bd = per_rank[rank]
        values = [row["ms"] for row in bd["rows"]]
        ys = [j + i * height for j in range(len(labels))]
        bars = ax.barh(ys, values, height=height, label=f"rank {rank} ({bd['step_ms']:.1f} ms/step)")
        for bar, row in zip(bars, bd["rows"]):
            if row["ms"] > 0:
                ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {row['share'] * 100:.1f}%",
                        va="center", fontsize=8)
    ax.set_yticks([j + height * (len(ranks) - 1) / 2 for j in range(len(labels))])
    ax.set_yticklabels(labels)
    ax.invert_yaxis()
    ax.set_xlabel("ms per step")
    ax.set_title(title or "step time by category")
    ax.legend(loc="lower right", fontsize=8)
    import io
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return write_atomic(out_png, buffer.getvalue())
