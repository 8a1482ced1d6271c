"""Terminal tables (rich)."""
from __future__ import annotations

from rich.table import Table

from gmtool.report.summary import bucket_summary


def fmt_bytes(n) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _f(x, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


STATUS_STYLE = {"ok": "green", "UNSAFE": "bold red", "error": "red", "oom": "red", "skipped": "yellow"}


def capture_table(doc: dict) -> Table:
    """One row per mode x bucket: capture, memory, replay vs eager, worst error over the compositions."""
    t = Table(title=f"gmtool capture: {doc['model']['name']} on {doc['machine'].get('gpu') or doc['machine']['backend']}")
    for col in ("mode", "bucket", "mixes", "capture s", "graph mem", "replay ms", "eager ms", "speedup",
                "host us", "max rel err", "pieces/runners", "status"):
        t.add_column(col, justify="left" if col in ("mode", "status") else "right")
    for s in bucket_summary(doc["records"]):
        if s["mode"] == "eager":
            continue
        style = STATUS_STYLE.get(s["status"], "")
        t.add_row(s["mode"], str(s["bucket"]), str(s["compositions"]), _f(s["capture_s"], ".3f"),
                  fmt_bytes(s["graph_mem_bytes"]), _f(s["replay_ms"], ".3f"), _f(s["eager_ms"], ".3f"),
                  _f(s["speedup"], ".2f", "-") + ("x" if s["speedup"] else ""), _f(s["host_us"], ".0f"),
                  _f(s["max_rel_err"], ".2e"), f"{s['pieces'] or '-'}/{s['runners'] if s['runners'] is not None else '-'}",
                  f"[{style}]{s['status']}[/]")
    return t
