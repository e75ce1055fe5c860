"""One self-contained HTML page: plotly.js, the data and the styles inline; nothing fetched.

    html = render(sections, title)

The charts' specs sit in one JSON island that a short script hands to Plotly.newPlot; tables and
SVG pictures are plain HTML. Text from run files is escaped; the JSON island escapes "</" so no
value can end its script element.
"""
from __future__ import annotations

import datetime
import json
import math
import re
from html import escape

STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#1a202c;background:#fff}
header{background:#1a365d;color:#fff;padding:14px 24px}header h1{margin:0;font-size:20px}
header p{margin:4px 0 0;font-size:12px;color:#cbd5e0}
main{padding:8px 24px 40px;max-width:1400px}
section.run{border-top:3px solid #2b6cb0;margin-top:24px}section.run>h2{margin:12px 0 2px;font-size:18px}
.sub{color:#4a5568;font-size:13px;margin:0 0 8px}
.notes{background:#fffaf0;border-left:4px solid #dd6b20;padding:6px 12px;font-size:13px;margin:8px 0}
.notes li{margin:2px 0}
.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(560px,1fr));gap:8px}
.chart{min-height:320px;border:1px solid #e2e8f0;border-radius:6px}
details{margin:10px 0}summary{cursor:pointer;font-weight:600;font-size:14px}
table{border-collapse:collapse;font-size:12px;margin:6px 0;max-width:100%}
th,td{border:1px solid #e2e8f0;padding:3px 6px;text-align:left;vertical-align:top;white-space:pre-wrap;
max-width:520px}th{background:#edf2f7}
.nb{white-space:nowrap}.any{overflow-wrap:anywhere}
td.PASS{background:#f0fff4}td.WARN{background:#fffaf0}td.FAIL{background:#fff5f5;font-weight:600}
pre{background:#f7fafc;border:1px solid #e2e8f0;padding:8px;font-size:12px;overflow:auto;max-height:480px}
.svg{overflow-x:auto}
"""

SCRIPT = """
(function(){
  var specs = JSON.parse(document.getElementById('anvil-charts').textContent);
  specs.forEach(function(s){
    var el = document.getElementById(s.id);
    Plotly.newPlot(el, s.figure.data, s.figure.layout,
                   {displaylogo:false, responsive:true, modeBarButtonsToRemove:['sendDataToCloud']});
  });
  document.body.setAttribute('data-charts-drawn', String(specs.length));
})();
"""


#: A token (what lies between spaces) longer than this may break anywhere; a shorter one never breaks.
LONG_TOKEN = 32
_PLAIN = re.compile(r"[\w.,:;]+")     # a token a browser breaks nowhere inside


def _wrapping(text: str) -> str:
    """Escaped text whose lines break at its spaces only: a token a browser would break at a hyphen or a
    slash ("--set", "h-newcomer/ds_a") is kept whole, and one longer than LONG_TOKEN (a path, a digest)
    may break anywhere (overflow-wrap: anywhere), so no column needs its whole width. A cell's
    overflow-wrap: anywhere, or word-break: break-word, would let a table squeeze its columns below
    their words ("resu|lt")."""
    out = []
    for part in re.split(r"(\s+)", text):
        if len(part) > LONG_TOKEN and not part.isspace():
            out.append(f'<span class="any">{escape(part)}</span>')
        elif part and not part.isspace() and not _PLAIN.fullmatch(part):
            out.append(f'<span class="nb">{escape(part)}</span>')
        else:
            out.append(escape(part))
    return "".join(out)


def _cell(value, status_cells: bool) -> str:
    text = "" if value is None else str(value)
    first = text.split(":", 1)[0]
    css = f' class="{first}"' if status_cells and first in ("PASS", "WARN", "FAIL") else ""
    return f"<td{css}>{_wrapping(text)}</td>"


def _table(block: dict) -> str:
    head = "".join(f"<th>{_wrapping(str(h))}</th>" for h in block["headers"]) if any(block["headers"]) else ""
    rows = "".join("<tr>" + "".join(_cell(c, True) for c in row) + "</tr>" for row in block["rows"])
    opened = " open" if block.get("open", True) else ""
    return (f'<details{opened}><summary>{escape(block["title"])}</summary><table>'
            + (f"<thead><tr>{head}</tr></thead>" if head else "") + f"<tbody>{rows}</tbody></table></details>")


def _finite(value):
    """NaN and infinity (a diverged loss) become null: JSON.parse takes no NaN. Every string becomes
    plain text for Plotly, which draws a subset of HTML in names, titles and hover text (a link among
    it): a metrics key or a source's name from a run directory is data, shown as written."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        return value.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def render(sections: list[dict], title: str, plotly_js: str) -> str:
    specs, body = [], []
    for s_index, section in enumerate(sections):
        parts = [f'<section class="run"><h2>{escape(section["title"])}</h2>',
                 f'<p class="sub">{escape(section.get("subtitle", ""))}</p>']
        if section.get("notes"):
            parts.append('<div class="notes"><b>Not in this report, or not as expected:</b><ul>'
                         + "".join(f"<li>{escape(n)}</li>" for n in section["notes"]) + "</ul></div>")
        charts = [b for b in section["blocks"] if b["type"] == "chart"]
        if charts:
            parts.append('<div class="grid">')
            for c_index, block in enumerate(charts):
                chart_id = f"chart-{s_index}-{c_index}"
                specs.append({"id": chart_id, "figure": block["figure"]})
                parts.append(f'<div class="chart" id="{chart_id}" data-title="{escape(block["title"])}"></div>')
            parts.append("</div>")
        for block in section["blocks"]:
            if block["type"] == "table":
                parts.append(_table(block))
            elif block["type"] == "svg":
                parts.append(f'<details open><summary>{escape(block["title"])}</summary>'
                             f'<div class="svg">{block["svg"]}</div></details>')
            elif block["type"] == "text":
                parts.append(f'<details><summary>{escape(block["title"])}</summary>'
                             f'<pre>{escape(block["text"])}</pre></details>')
        parts.append("</section>")
        body.append("".join(parts))
    data = json.dumps(_finite(specs), separators=(",", ":"), allow_nan=False, default=str).replace("</", "<\\/")
    made = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            # No request may leave the file: scripts, styles and images only from the page itself.
            "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; "
            "script-src 'unsafe-inline' 'unsafe-eval'; style-src 'unsafe-inline'; img-src data: blob:; "
            "font-src data:\">"
            f"<title>{escape(title)}</title><style>{STYLE}</style></head><body>"
            f"<header><h1>{escape(title)}</h1><p>Anvil run report · made {made} · one file, no network: "
            f"the data is downsampled for drawing, the full data stays in each run's metrics.jsonl</p></header>"
            f"<main>{''.join(body)}</main>"
            f'<script type="application/json" id="anvil-charts">{data}</script>'
            f"<script>{plotly_js}</script><script>{SCRIPT}</script></body></html>")
