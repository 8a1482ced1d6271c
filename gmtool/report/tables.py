"""Terminal tables (rich)."""
from __future__ import annotations

from rich.table import Table

from gmtool.modes import GraphMode
from gmtool.records import style_of
from gmtool.report.summary import bucket_summary, mode_order


def fmt_bytes(n) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _f(x, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)




def capture_table(doc: dict) -> Table:
    """One row per mode x bucket: capture, memory, replay vs eager, worst error over the compositions."""
    t = Table(title=f"gmtool capture: {doc['model']['name']} on {doc['machine'].get('gpu') or doc['machine']['backend']}")
    by_rank = (doc.get("config") or {}).get("tp", 1) > 1  # --tp: a row per rank (its own graphs, memory and timings)
    for col in ("mode", "bucket") + (("rank",) if by_rank else ()) + (
            "mixes", "capture s", "graph mem", "replay ms", "eager ms", "speedup",
            "host us idle/steady", "max rel err", "pieces/runners", "status"):
        t.add_column(col, justify="left" if col in ("mode", "status") else "right")
    for s in bucket_summary(doc["records"], by_rank):
        if s["mode"] == GraphMode.EAGER:
            continue
        style = style_of(s["status"])
        t.add_row(s["mode"], str(s["bucket"]), *([str(s["rank"])] if by_rank else []), str(s["compositions"]), _f(s["capture_s"], ".3f"),
                  fmt_bytes(s["graph_mem_bytes"]), _f(s["replay_ms"], ".3f"), _f(s["eager_ms"], ".3f"),
                  _f(s["speedup"], ".2f", "-") + ("x" if s["speedup"] else ""),
                  _f(s["host_us"], ".0f") + "/" + _f(s["host_steady_us"], ".0f"),
                  _f(s["max_rel_err"], ".2e"), f"{s['pieces'] or '-'}/{s['runners'] if s['runners'] is not None else '-'}",
                  f"[{style}]{s['status']}[/]")
    return t


def _signed_pct(x) -> str:
    return "-" if x is None else f"{x:+.1f}%"


def compare_table(doc: dict) -> Table:
    """Every mode side by side, bucket by bucket; '!' marks a noisy median (IQR above 10% of it)."""
    machine = doc["machine"].get("gpu") or doc["machine"]["backend"]
    t = Table(title=f"gmtool {doc.get('command', 'compare')}: {doc['model']['name']} on {machine}")
    deltas = {(d["mode"], d["bucket"]): d for d in (doc.get("baseline") or {}).get("buckets", [])}
    by_rank = (doc.get("config") or {}).get("tp", 1) > 1  # --tp: a row per rank
    cols = ["bucket", "mode"] + (["rank"] if by_rank else []) + ["mixes", "replay ms", "eager ms", "speedup", "max rel err", "capture/compile s",
            "graph mem", "status"] + (["vs baseline"] if deltas else [])
    for col in cols:
        t.add_column(col, justify="left" if col in ("mode", "status") else "right")
    order = {m: i for i, m in enumerate(mode_order(doc))}
    rows = sorted(bucket_summary(doc["records"], by_rank),
                  key=lambda s: (s["bucket"], order.get(s["mode"], 99), s["rank"] or 0))
    for i, s in enumerate(rows):
        if i and s["bucket"] != rows[i - 1]["bucket"]:
            t.add_section()
        setup = s["compile_s"] if s["compile_s"] is not None else s["capture_s"]
        style = style_of(s["status"])
        cells = [str(s["bucket"]), s["mode"], *([str(s["rank"])] if by_rank else []), str(s["compositions"]),
                 _f(s["replay_ms"], ".3f") + ("!" if s["noisy"] and s["replay_ms"] is not None else ""),
                 _f(s["eager_ms"], ".3f"), _f(s["speedup"], ".2f") + ("x" if s["speedup"] else ""),
                 _f(s["max_rel_err"], ".2e"), _f(setup, ".2f"), fmt_bytes(s["graph_mem_bytes"]),
                 f"[{style}]{s['status']}[/]"]
        if deltas:
            cells.append(_signed_pct((deltas.get((s["mode"], s["bucket"])) or {}).get("replay_delta_pct")))
        t.add_row(*cells)
    return t


def noise_warning(doc: dict) -> str | None:
    noisy = [r for r in doc["records"] if (r.get("latency_ms") or {}).get("noisy")]
    if not noisy:
        return None
    return (f"{len(noisy)} of {sum(1 for r in doc['records'] if r.get('latency_ms'))} timings are noisy (IQR above "
            "10% of the median, marked '!'): raise --num-iters or run on an idle machine before trusting them")
