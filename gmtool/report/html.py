"""report.html: the Markdown report's sections as HTML tables, with the plots embedded as data URIs, in one
file that opens anywhere (no scripts, no external stylesheet or image)."""

from __future__ import annotations

from html import escape

from gmtool.records import Status
from gmtool.report.markdown import notes, overview, sections
from gmtool.report.plots import all_plots

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 1400px; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
th { background: #f3f3f3; }
td.text { text-align: left; }
td.s-ok { color: #176b2c; } td.s-UNSAFE { color: #fff; background: #c0392b; font-weight: bold; }
td.s-error, td.s-oom { color: #c0392b; } td.s-skipped { color: #a06800; }
figure { display: inline-block; margin: 0 1em 1em 0; } figcaption { font-size: 0.9em; color: #555; }
.note { color: #555; }
"""
_STATUSES = tuple(Status)
_TEXT_COLUMNS = ("mode", "composition", "key", "error", "status")


def _cell(header: str, value: str) -> str:
    cls = ["text"] if header in _TEXT_COLUMNS else []
    if value in _STATUSES:
        cls.append(f"s-{value}")
    attr = f' class="{" ".join(cls)}"' if cls else ""
    return f"<td{attr}>{escape(value)}</td>"


def render_html(doc: dict) -> str:
    title = f"gmtool {doc.get('command', '')}: {doc['model']['name']}"
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{escape(title)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>{escape(title)}</h1>",
        "<ul>",
    ]
    out += [f"<li><b>{escape(k)}</b>: {escape(v)}</li>" for k, v in overview(doc)]
    out.append("</ul><h2>Plots</h2>")
    for caption, uri in all_plots(doc):
        if uri is None:
            # not only the backend: a capture run measures no floor, a run stopped early none either
            out.append(f'<p class="note">{escape(caption)}: no figures for it in this run.</p>')
        else:
            out.append(
                f'<figure><img src="{uri}" alt="{escape(caption)}"><figcaption>{escape(caption)}</figcaption></figure>'
            )
    for sec in sections(doc):
        out.append(f"<h2>{escape(sec.title)}</h2>")
        if sec.intro:
            out.append(f'<p class="note">{escape(sec.intro)}</p>')
        if not sec.rows:
            out.append(f"<p>{escape(sec.empty)}</p>")
            continue
        out.append("<table><tr>" + "".join(f"<th>{escape(h)}</th>" for h in sec.headers) + "</tr>")
        out += ["<tr>" + "".join(_cell(h, v) for h, v in zip(sec.headers, row)) + "</tr>" for row in sec.rows]
        out.append("</table>")
    if doc.get("errors"):
        out.append("<h2>Errors</h2><ul>" + "".join(f"<li>{escape(e)}</li>" for e in doc["errors"]) + "</ul>")
    extra = notes(doc)
    if extra:
        out.append("<h2>Notes</h2><ul>" + "".join(f"<li>{escape(n)}</li>" for n in extra) + "</ul>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"
