"""Terminal tables (rich)."""

from __future__ import annotations

from gmtool.modes import GraphMode
from gmtool.records import style_of
from gmtool.report.fitted import Column, FittedTable
from gmtool.report.summary import bucket_summary, mode_order, run_tp


def fmt_bytes(n) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _f(x, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


# the non-obvious columns, explained once under every table that shows them
MIXES = Column("mixes", rank=6, legend="batch compositions replayed per bucket")
PIECES = Column("pieces/runners", rank=8, legend="captured graph pieces / attention calls run between them")
TP_RANK = Column("rank", legend="--tp: the rank that measured the row")
HOST = Column(
    "host us idle/steady",
    rank=7,
    legend="host time per step (copy-in + launch), from an idle device / issued behind the previous step",
)


def _replay(s: dict) -> str:
    """The median replay latency, '!' when it is noisy (noise_warning says what that means)."""
    return _f(s["replay_ms"], ".3f") + ("!" if s["noisy"] and s["replay_ms"] is not None else "")


def _speedup(s: dict) -> str:
    return _f(s["speedup"], ".2f") + ("x" if s["speedup"] else "")


def _status(s: dict) -> str:
    return f"[{style_of(s['status'])}]{s['status']}[/]"


def capture_table(doc: dict) -> FittedTable:
    """One row per mode x bucket: capture, memory, replay vs eager, worst error over the compositions."""
    title = f"gmtool capture: {doc['model']['name']} on {doc['machine'].get('gpu') or doc['machine']['backend']}"
    by_rank = run_tp(doc.get("config")) > 1  # --tp: a row per rank (its graphs, memory, timings)
    cols = (
        [Column("mode", justify="left"), Column("bucket")]
        + ([TP_RANK] if by_rank else [])
        + [
            MIXES,
            Column("capture s", rank=5),
            Column("graph mem", rank=4),
            Column("replay ms", rank=1),
            Column("eager ms", rank=3),
            Column("speedup", rank=1),
            HOST,
            Column("max rel err", rank=2),
            PIECES,
            Column("status", justify="left"),
        ]
    )
    rows = []
    for s in bucket_summary(doc["records"], by_rank):
        if s["mode"] == GraphMode.EAGER:
            continue
        rows.append(
            [
                s["mode"],
                str(s["bucket"]),
                *([str(s["rank"])] if by_rank else []),
                str(s["compositions"]),
                _f(s["capture_s"], ".3f"),
                fmt_bytes(s["graph_mem_bytes"]),
                _replay(s),
                _f(s["eager_ms"], ".3f"),
                _speedup(s),
                _f(s["host_us"], ".0f") + "/" + _f(s["host_steady_us"], ".0f"),
                _f(s["max_rel_err"], ".2e"),
                f"{s['pieces'] or '-'}/{s['runners'] if s['runners'] is not None else '-'}",
                _status(s),
            ]
        )
    return FittedTable(title, cols, rows)


def _signed_pct(x) -> str:
    return "-" if x is None else f"{x:+.1f}%"


def compare_table(doc: dict) -> FittedTable:
    """Every mode side by side, bucket by bucket; '!' marks a bucket one of whose timings is noisy (IQR above 10%
    of its median)."""
    machine = doc["machine"].get("gpu") or doc["machine"]["backend"]
    title = f"gmtool {doc.get('command', 'compare')}: {doc['model']['name']} on {machine}"
    deltas = {(d["mode"], d["bucket"], d.get("rank")): d for d in (doc.get("baseline") or {}).get("buckets", [])}
    by_rank = run_tp(doc.get("config")) > 1  # --tp: a row per rank
    cols = (
        [Column("bucket"), Column("mode", justify="left")]
        + ([TP_RANK] if by_rank else [])
        + [
            MIXES,
            Column("replay ms", rank=1),
            Column("eager ms", rank=3),
            Column("speedup", rank=1),
            Column("max rel err", rank=2),
            Column("capture/compile s", rank=5),
            Column("graph mem", rank=4),
            Column("status", justify="left"),
        ]
    )
    # auto picks a graph kind per batch: which served its rows is the point of running it (report.md has it too)
    served = GraphMode.AUTO in mode_order(doc)
    cols += [Column("served by", rank=3, justify="left")] if served else []
    cols += [Column("vs baseline", rank=2)] if deltas else []
    order = {m: i for i, m in enumerate(mode_order(doc))}
    summary = sorted(
        bucket_summary(doc["records"], by_rank), key=lambda s: (s["bucket"], order.get(s["mode"], 99), s["rank"] or 0)
    )
    rows: list[list[str] | None] = []
    for i, s in enumerate(summary):
        if i and s["bucket"] != summary[i - 1]["bucket"]:
            rows.append(None)
        # a traced shape's setup: its trace (compile_s, fx and --compile) and its capture, together
        setup = (
            None if s["capture_s"] is None and s["compile_s"] is None else (s["capture_s"] or 0) + (s["compile_s"] or 0)
        )
        cells = [
            str(s["bucket"]),
            s["mode"],
            *([str(s["rank"])] if by_rank else []),
            str(s["compositions"]),
            _replay(s),
            _f(s["eager_ms"], ".3f"),
            _speedup(s),
            _f(s["max_rel_err"], ".2e"),
            _f(setup, ".2f"),
            fmt_bytes(s["graph_mem_bytes"]),
            _status(s),
        ]
        if served:
            cells.append(s["served_by"] or "-")
        if deltas:
            # a rank's own change, else the pooled one (a baseline attached to one rank's rows, or by an older gmtool)
            d = deltas.get((s["mode"], s["bucket"], s["rank"])) or deltas.get((s["mode"], s["bucket"], None))
            cells.append(_signed_pct((d or {}).get("replay_delta_pct")))
        rows.append(cells)
    return FittedTable(title, cols, rows)


def noise_warning(doc: dict) -> str | None:
    noisy = [r for r in doc["records"] if (r.get("latency_ms") or {}).get("noisy")]
    if not noisy:
        return None
    return (
        f"{len(noisy)} of {sum(1 for r in doc['records'] if r.get('latency_ms'))} timings are noisy (IQR above "
        "10% of the median; a bucket with one is marked '!' where its mode is shown): raise --num-iters or run on an "
        "idle machine before trusting them"
    )


def baseline_counts(b: dict) -> str:
    """How the rows of this run and its baseline joined: a baseline with fewer (or other) rows is not an error,
    but the reader should know how much of the run it speaks for."""
    text = f"{b['matched']} rows matched, {b['unmatched']} new"
    gone = b.get("only_in_baseline")  # absent in documents written before it was counted
    text += f", {gone} only in the baseline (not measured in this run)" if gone else ""
    changed, moved = b.get("status_changed"), b.get("served_by_changed")
    text += f"; {changed} matched row{'s' if changed > 1 else ''} changed status" if changed else ""
    text += f"; {moved} served by another path than in the baseline (served_by)" if moved else ""
    part = [d for d in b.get("buckets") or [] if d.get("mixes_compared", 0) < d.get("mixes", 0) and d["rank"] is None]
    if part:
        text += f"; {len(part)} bucket change{'s' if len(part) > 1 else ''} over the matched rows only"
    text += "; the baseline is a partial run" if b.get("partial") else ""
    return text + ("; the runs differ: " + ", ".join(b["differs"]) if b.get("differs") else "")


def baseline_line(doc: dict) -> str | None:
    """The terminal's line under a table compared with --baseline: which run, and how many rows joined."""
    b = doc.get("baseline")
    return None if not b else f"baseline {b['path']}: {baseline_counts(b)}"
