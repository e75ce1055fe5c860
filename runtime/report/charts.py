"""Plotly figure specs (plain dicts, drawn by the inlined plotly.js) for the report's charts.

Only the few shapes the report needs: lines over steps (with resume marks), bars, a heatmap.
Every series is thinned by downsample.minmax before it is put in the page.
"""
from __future__ import annotations

from runtime.report.downsample import minmax

PALETTE = ("#2b6cb0", "#c53030", "#2f855a", "#805ad5", "#dd6b20", "#319795", "#b83280", "#718096")


def line(x: list, y: list, name: str, *, axis: str = "y", mode: str = "lines", color: str | None = None,
         dash: str | None = None, scale: float = 1.0, hover: list | None = None) -> dict | None:
    """One series; None when it has no finite point (the chart then leaves it out)."""
    xs, ys = minmax(x, y)
    if not xs:
        return None
    trace = {"type": "scatter", "mode": mode, "name": name, "x": xs,
             "y": [v * scale for v in ys], "yaxis": axis}
    style = {k: v for k, v in (("color", color), ("dash", dash)) if v}
    if style:
        trace["line"] = style
        if color:
            trace["marker"] = {"color": color}
    if hover is not None:
        trace["text"], trace["hoverinfo"] = hover, "text+x+y"
    return trace


def figure(traces: list, title: str, ytitle: str, *, y2title: str = "", xtitle: str = "step",
           marks: list | None = None, ymin0: bool = False) -> dict | None:
    """A figure of the traces that have data (None when none has); vertical dotted marks at `marks`."""
    data = [t for t in traces if t]
    if not data:
        return None
    layout = {"title": {"text": title, "x": 0, "font": {"size": 14}}, "height": 320,
              "margin": {"l": 60, "r": 60 if y2title else 20, "t": 40, "b": 40},
              "xaxis": {"title": {"text": xtitle}}, "yaxis": {"title": {"text": ytitle}},
              "legend": {"orientation": "h", "y": -0.25}, "showlegend": True, "hovermode": "x unified"}
    if ymin0:
        layout["yaxis"]["rangemode"] = "tozero"
    if y2title:
        layout["yaxis2"] = {"title": {"text": y2title}, "overlaying": "y", "side": "right", "rangemode": "tozero"}
    if marks:
        layout["shapes"] = [{"type": "line", "xref": "x", "yref": "paper", "x0": m, "x1": m, "y0": 0, "y1": 1,
                             "line": {"dash": "dot", "color": "#718096", "width": 1}} for m in marks]
        layout["annotations"] = [{"x": m, "xref": "x", "yref": "paper", "y": 1, "text": "resumed",
                                  "showarrow": False, "font": {"size": 10, "color": "#718096"},
                                  "yanchor": "bottom"} for m in marks]
    return {"data": data, "layout": layout}


def bars(categories: list, series: dict[str, list], title: str, ytitle: str, *, stacked: bool = False,
         lines: dict[str, float] | None = None, horizontal: bool = False) -> dict | None:
    """Grouped (or stacked) bars, one trace per series; `lines`: labelled reference levels (anchors)."""
    data = []
    for i, (name, values) in enumerate(series.items()):
        if not any(isinstance(v, (int, float)) for v in values):
            continue
        bar = {"type": "bar", "name": name, "marker": {"color": PALETTE[i % len(PALETTE)]}}
        bar.update({"y": categories, "x": values, "orientation": "h"} if horizontal else
                   {"x": categories, "y": values})
        data.append(bar)
    if not data:
        return None
    layout = {"title": {"text": title, "x": 0, "font": {"size": 14}}, "height": 340,
              "margin": {"l": 140 if horizontal else 60, "r": 20, "t": 40, "b": 80},
              "barmode": "stack" if stacked else "group", "legend": {"orientation": "h", "y": -0.3},
              ("xaxis" if horizontal else "yaxis"): {"title": {"text": ytitle}}}
    if lines:
        axis = "x" if horizontal else "y"
        layout["shapes"] = [{"type": "line", "xref": "x" if horizontal else "paper",
                             "yref": "paper" if horizontal else "y",
                             f"{axis}0": value, f"{axis}1": value,
                             ("y0" if horizontal else "x0"): 0, ("y1" if horizontal else "x1"): 1,
                             "line": {"dash": "dash", "color": "#c53030"}} for value in lines.values()]
        layout["annotations"] = [{("x" if horizontal else "y"): value, ("y" if horizontal else "x"): 1,
                                  "xref": "x" if horizontal else "paper", "yref": "paper" if horizontal else "y",
                                  "text": label, "showarrow": False, "font": {"size": 10, "color": "#c53030"},
                                  "xanchor": "right", "yanchor": "bottom"} for label, value in lines.items()]
    return {"data": data, "layout": layout}


def heatmap(labels: list, matrix: list[list], title: str, unit: str, hover: list[list] | None = None, *,
            ylabels: list | None = None, xtitle: str = "", ytitle: str = "", colorscale: str = "RdYlGn") -> dict | None:
    """labels along x (and y, for a square matrix such as link speeds); `ylabels` for rows of their own."""
    ylabels = labels if ylabels is None else ylabels
    if not labels or not any(v is not None for row in matrix for v in row):
        return None
    trace = {"type": "heatmap", "x": labels, "y": ylabels, "z": matrix, "colorscale": colorscale,
             "colorbar": {"title": {"text": unit}}, "hoverongaps": False}
    if hover is not None:
        trace["text"], trace["hoverinfo"] = hover, "text"
    return {"data": [trace],
            "layout": {"title": {"text": title, "x": 0, "font": {"size": 14}},
                       "height": 120 + max(8, min(36, 600 // max(1, len(ylabels)))) * len(ylabels),
                       "margin": {"l": 100, "r": 20, "t": 40, "b": 100},
                       "xaxis": {"title": {"text": xtitle}}, "yaxis": {"autorange": "reversed", "title": {"text": ytitle}}}}
