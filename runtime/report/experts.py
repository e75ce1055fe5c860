"""A mixture-of-experts run's load: how the tokens spread over each layer's experts (the trainer's "moe"
records in metrics.jsonl, one per log step).

    blocks(curves) -> [chart or table blocks]     [] for a run without experts

Drawn: each expert's share of its layer's tokens over the whole run (layer x expert), the same per log
step for the layer whose load was least even (step x expert), each layer's coefficient of variation
over the steps, and the balance loss and DeepSeek-V3's bias range where the run has them.
"""
from __future__ import annotations

from runtime.report import charts
from runtime.runs import metrics


def _shares(row: list) -> list:
    total = sum(row) or 1
    return [round(100 * v / total, 2) for v in row]


def blocks(curves: metrics.Curves) -> list[dict]:
    records = [e for e in curves.events if e.get("kind") == "moe" and isinstance(e.get("load"), list)]
    if not records:
        return []
    layers = records[-1]["layers"]
    width = len(records[-1]["load"][0])
    total = [[0.0] * width for _ in layers]
    for record in records:
        if record.get("layers") != layers:
            continue   # (a resumed run of another shape: its records are not summed with these)
        for row, counts in zip(total, record["load"]):
            for e, v in enumerate(counts):
                row[e] += v
    experts = [str(e) for e in range(width)]
    out = [{"type": "chart", "title": "experts' load over the run",
            "figure": charts.heatmap(experts, [_shares(row) for row in total],
                                     "each expert's share of its layer's tokens, the whole run", "% of tokens",
                                     ylabels=[f"layer {i}" for i in layers], xtitle="expert", colorscale="Viridis")}]
    cvs = {i: [r["load_cv"][k] for r in records if r.get("layers") == layers] for k, i in enumerate(layers)}
    steps = [r["step"] for r in records if r.get("layers") == layers]
    worst = max(range(len(layers)), key=lambda k: sum(cvs[layers[k]]) / max(1, len(steps)))
    out.append({"type": "chart", "title": f"layer {layers[worst]}'s load over the steps",
                "figure": charts.heatmap(experts, [_shares(r["load"][worst]) for r in records
                                                   if r.get("layers") == layers],
                                         f"layer {layers[worst]} (its load the least even): share per log step",
                                         "% of tokens", ylabels=[str(s) for s in steps], xtitle="expert",
                                         ytitle="step", colorscale="Viridis")})
    traces = [charts.line(steps, cvs[i], f"layer {i}") for i in layers]
    out.append({"type": "chart", "title": "load balance",
                "figure": charts.figure(traces, "coefficient of variation of each layer's load (0: even)", "CV")})
    aux = [(r["step"], r["aux_loss"]) for r in records if r.get("aux_loss") is not None]
    if aux:
        out.append({"type": "chart", "title": "balance loss",
                    "figure": charts.figure([charts.line([s for s, _ in aux], [v for _, v in aux], "balance loss")],
                                            "sequence-level balance loss (mean over the MoE layers)", "loss")})
    bias = [r for r in records if r.get("bias_max") is not None]
    if bias:
        out.append({"type": "chart", "title": "balancing bias",
                    "figure": charts.figure(
                        [charts.line([r["step"] for r in bias], [max(r["bias_max"]) for r in bias], "highest"),
                         charts.line([r["step"] for r in bias], [min(r["bias_min"]) for r in bias], "lowest")],
                        "auxiliary-loss-free balancing: the bias range over the layers", "bias")})
    return [b for b in out if b.get("figure")]
