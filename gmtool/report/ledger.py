"""The graph memory ledger and memreport's prediction as tables: cells shared by the terminal, report.md and
report.html ('-' where the backend measures no such memory: the CPU tape has no pool, no driver figures)."""

from __future__ import annotations

from gmtool.memory.ledger import ledger_from_records
from gmtool.report.fitted import Column, FittedTable
from gmtool.report.summary import mode_order, run_tp
from gmtool.report.tables import _f, fmt_bytes

# graph: the key a row's graph was captured under; a prefill bucket of full graphs holds one graph per number of
# sequences (t16xs2, t16xs4, ...), which without it read as the same row repeated
HEADERS = ["mode", "bucket", "graph", "pool", "outside pool", "inputs", "cuBLAS ws", "total", "KV tokens"]
INTRO = (
    "What each captured bucket costs the device: the allocator pool its capture added, memory the driver "
    "took outside the pool (graph instantiation and upload), the bucket's slice of the persistent inputs, "
    "the capture stream's cuBLAS workspace (charged to the first graph), the total, and the KV-cache tokens "
    "that total could have held."
)


def _n(x) -> float | None:
    return None if x is None or x != x else x


def ledger_cells(rows: list[dict], by_rank: bool = False) -> list[list[str]]:
    """rows: ledger rows (gmtool.memory.ledger: bucket, mode, the parts, total_bytes, kv_tokens_given_up);
    by_rank: a rank cell after the bucket (--tp: a row per rank)."""
    return [
        [
            str(r["mode"]),
            str(int(r["bucket"])),
            *([str(int(r.get("rank") or 0))] if by_rank else []),
            str(r.get("key") or "-"),
            fmt_bytes(_n(r["pool_bytes"])),
            fmt_bytes(_n(r["outside_pool_bytes"])),
            fmt_bytes(_n(r["inputs_bytes"])),
            fmt_bytes(_n(r["workspace_bytes"])),
            fmt_bytes(_n(r["total_bytes"])),
            _f(_n(r["kv_tokens_given_up"]), ",.0f"),
        ]
        for r in rows
    ]


def records_ledger(doc: dict) -> list[dict]:
    """A results document's ledger rows (compare, capture): one per captured graph, the modes in the order the
    summary shows them (as asked), then by bucket."""
    order = {m: i for i, m in enumerate(mode_order(doc))}
    rows = ledger_from_records(doc["records"]).to_dict("records")
    return sorted(rows, key=lambda r: (order.get(r["mode"], len(order)), r["bucket"], r.get("rank", 0)))


# at 80 columns the parts go first (the results files keep them); total and KV tokens stay
_RANK = {
    "outside pool": 3,
    "inputs": 4,
    "cuBLAS ws": 5,
    "pool": 2,
    "sample": 3,
    "each later bucket adds": 2,
    "first capture": 1,
}
_LEGEND = {
    "outside pool": "driver memory beyond the pool (instantiation, upload)",
    "KV tokens": "KV-cache tokens the total could have held",
}


def _table(title: str, headers: list[str], rows: list[list[str]]) -> FittedTable:
    cols = [
        Column(h, rank=_RANK.get(h, 0), justify="left" if h in ("mode", "strategy") else "right", legend=_LEGEND.get(h))
        for h in headers
    ]
    return FittedTable(title, cols, rows)


def records_ledger_cells(doc: dict) -> tuple[list[str], list[list[str]]]:
    """compare/capture: the ledger's headers and cells, with a rank column under --tp (every rank's graphs)."""
    by_rank = run_tp(doc.get("config")) > 1
    headers = HEADERS[:2] + ["rank"] + HEADERS[2:] if by_rank else HEADERS
    return headers, ledger_cells(records_ledger(doc), by_rank)


def ledger_table(doc: dict) -> FittedTable | None:
    """compare/capture: the ledger of every captured bucket, None when nothing was captured."""
    headers, cells = records_ledger_cells(doc)
    return _table("graph memory ledger", headers, cells) if cells else None


def memreport_ledger_table(doc: dict) -> FittedTable | None:
    """memreport: the ledger per strategy x bucket."""
    cells = [[r["strategy"]] + c for r in doc["strategies"] for c in ledger_cells(r.get("ledger") or [])]
    return _table("graph memory ledger per strategy", ["strategy"] + HEADERS, cells) if cells else None


def prediction_table(doc: dict) -> FittedTable | None:
    """memreport --sample/--check: each strategy's predicted memory for the whole list, and its error."""
    pred = doc.get("prediction") or []
    if not pred:
        return None
    sampled = ", ".join(map(str, doc.get("sampled_buckets") or []))
    rows = [
        [
            p["strategy"],
            f"{p['first_bucket']}: {fmt_bytes(p['first_bytes'])}",
            f"{fmt_bytes(p['intercept'])} + {fmt_bytes(p['slope'])}/token"
            if p.get("method", "line") == "line"
            else "allocator simulated",
            fmt_bytes(p["sample_bytes"]),
            fmt_bytes(p["predicted_bytes"]),
            fmt_bytes(p["measured_bytes"]),
            "-" if p["error_pct"] is None else f"{p['error_pct']:+.1f}%",
        ]
        for p in pred
    ]
    return _table(
        f"predicted from buckets {sampled}",
        ["strategy", "first capture", "each later bucket adds", "sample", "predicted", "measured", "error"],
        rows,
    )
