"""Aggregations of result records shared by the terminal, Markdown and HTML reports."""
from __future__ import annotations

import statistics

_WORST = ["ok", "skipped", "error", "oom", "UNSAFE"]


def _worst(statuses) -> str:
    return max(statuses, key=lambda s: _WORST.index(s) if s in _WORST else 0)


def bucket_summary(records: list[dict]) -> list[dict]:
    """mode x bucket rows: the worst status and error over the compositions, median latencies."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["mode"], r["bucket"]), []).append(r)
    out = []
    for (mode, bucket), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        lat = [r["latency_ms"]["median"] for r in rs if r.get("latency_ms")]
        eager = [r["eager_latency_ms"] for r in rs if r.get("eager_latency_ms")]
        host = [r["host_us"]["median"] for r in rs if r.get("host_us")]
        errs = [r["max_rel_err"] for r in rs if r.get("max_rel_err") is not None]
        caps = [r["capture_s"] for r in rs if r.get("capture_s") is not None]
        mems = [r["graph_mem_bytes"] for r in rs if r.get("graph_mem_bytes") is not None]
        status = _worst([r["status"] for r in rs])
        replay = statistics.median(lat) if lat else None
        eager_ms = statistics.median(eager) if eager else None
        out.append({
            "mode": mode, "bucket": bucket, "compositions": len(rs), "status": status,
            "capture_s": sum(caps) if caps else None, "graph_mem_bytes": max(mems) if mems else None,
            "replay_ms": replay, "eager_ms": eager_ms,
            "speedup": (eager_ms / replay) if (replay and eager_ms and status == "ok") else None,
            "host_us": statistics.median(host) if host else None,
            "max_rel_err": max(errs) if errs else None,
            "pieces": max((r["pieces"] or 0) for r in rs) or None,
            "runners": max((r["runners"] or 0) for r in rs) if any(r.get("runners") is not None for r in rs) else None,
        })
    return out
