"""Aggregations of result records shared by the terminal, Markdown and HTML reports."""

from __future__ import annotations

import statistics

from gmtool.modes import GraphMode
from gmtool.records import Status, worst as _worst


def run_tp(config: dict | None) -> int:
    """A document's --tp (1 for a run without it, or one written before it): above 1, its rows are per rank."""
    return (config or {}).get("tp") or 1


def bucket_summary(records: list[dict], by_rank: bool = False) -> list[dict]:
    """mode x bucket rows: the worst status and error over the compositions, median latencies. A --tp run's
    rows of every rank are summarized together, or one summary per rank (by_rank)."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["mode"], r["bucket"], r.get("rank", 0) if by_rank else 0), []).append(r)
    out = []
    for (mode, bucket, rank), rs in sorted(groups.items(), key=lambda kv: kv[0]):
        first = min(r.get("rank", 0) for r in rs)  # each rank measures every mix: count them once
        lat = [r["latency_ms"]["median"] for r in rs if r.get("latency_ms")]
        eager = [r["eager_latency_ms"] for r in rs if r.get("eager_latency_ms")]
        host = [r["host_us"]["median"] for r in rs if r.get("host_us")]
        steady = [r["host_steady_us"]["median"] for r in rs if r.get("host_steady_us")]
        errs = [r["max_rel_err"] for r in rs if r.get("max_rel_err") is not None]
        caps: dict = {}  # per rank: the ranks capture side by side, so a pooled row takes the slowest rank's sum
        for r in rs:
            if r.get("capture_s") is not None:
                rank_of = r.get("rank") or 0
                caps[rank_of] = caps.get(rank_of, 0.0) + r["capture_s"]
        mems = [r["graph_mem_bytes"] for r in rs if r.get("graph_mem_bytes") is not None]
        comps = [r["compile_s"] for r in rs if r.get("compile_s") is not None]
        over = [r["replay_over_floor"] for r in rs if r.get("replay_over_floor") is not None]
        floors = [r["floor_ms"] for r in rs if r.get("floor_ms") is not None]
        status = _worst([r["status"] for r in rs])
        # a bucket that is unsafe for one mix shows no latency, even from the mixes it served correctly
        replay = statistics.median(lat) if lat and status != Status.UNSAFE else None
        eager_ms = statistics.median(eager) if eager else None
        out.append(
            {
                "mode": mode,
                "bucket": bucket,
                "rank": rank if by_rank else None,
                "status": status,
                "compositions": sum(1 for r in rs if r.get("rank", 0) == first),
                "capture_s": max(caps.values()) if caps else None,
                "graph_mem_bytes": max(mems) if mems else None,
                "replay_ms": replay,
                "eager_ms": eager_ms,
                "speedup": (eager_ms / replay) if (replay and eager_ms and status == Status.OK) else None,
                "host_us": statistics.median(host) if host and status != Status.UNSAFE else None,
                "host_steady_us": statistics.median(steady) if steady and status != Status.UNSAFE else None,
                # NaN (a replay that wrote NaN) is the worst error: max() kept or dropped it by its place
                "max_rel_err": (float("nan") if any(e != e for e in errs) else max(errs)) if errs else None,
                "pieces": max((r["pieces"] or 0) for r in rs) or None,
                "runners": max((r["runners"] or 0) for r in rs)
                if any(r.get("runners") is not None for r in rs)
                else None,
                "compile_s": sum(comps) if comps else None,
                "replay_over_floor": statistics.median(over) if over and status != Status.UNSAFE else None,
                "floor_ms": statistics.median(floors) if floors else None,
                "served_by": "/".join(dict.fromkeys(r["served_by"] for r in rs if r.get("served_by"))) or None,
                "noisy": any((r.get("latency_ms") or {}).get("noisy") for r in rs),
            }
        )
    return out


def mode_order(doc: dict) -> list[str]:
    """The modes in the order they were asked for, then any other mode the records hold."""
    modes = list(dict.fromkeys(doc.get("config", {}).get("modes") or []))
    return modes + [m for m in dict.fromkeys(r["mode"] for r in doc["records"]) if m not in modes]


def row_keys(records: list[dict]) -> list[tuple]:
    """(mode, bucket, composition, n) per record: n tells apart mixes of one bucket that share a label
    (the default decode mixes differ only by their random contexts). n counts within a rank: every rank of a
    --tp run measures the same mixes, so rank 1's first '1*8' is the same mix as rank 0's, not a fourth one."""
    seen: dict[tuple, int] = {}
    keys = []
    for r in records:
        k = (r["mode"], r["bucket"], r["composition"])
        ranked = k + (r.get("rank") or 0,)
        seen[ranked] = seen.get(ranked, 0) + 1
        keys.append(k + (seen[ranked],))
    return keys


def safety_matrix(doc: dict) -> tuple[list[str], list[dict]]:
    """Per composition (bucket, label, n): the status every mode got on it, buckets ascending."""
    modes = mode_order(doc)
    rows: dict[tuple, dict] = {}
    for (mode, bucket, comp, n), r in zip(row_keys(doc["records"]), doc["records"]):
        row = rows.setdefault((bucket, comp, n), {"bucket": bucket, "composition": comp, "n": n, "statuses": {}})
        seen = row["statuses"].get(mode)  # a --tp run's ranks: the mix is safe only if it is on every rank
        row["statuses"][mode] = r["status"] if seen is None else _worst([seen, r["status"]])
    return modes, sorted(rows.values(), key=lambda row: row["bucket"])  # stable: the run's order within a bucket


def verdict(doc: dict) -> str:
    """The run in one line, "N ok, M UNSAFE, K errors": its replays checked against eager (every record but
    eager's own, which are the reference, unless eager itself failed)."""
    checked = [r for r in doc["records"] if r["mode"] != GraphMode.EAGER or Status(r["status"]).failed]
    count = {s: sum(1 for r in checked if r["status"] == s) for s in Status}
    extra = [f"{count[Status.SKIPPED]} skipped"] if count[Status.SKIPPED] else []
    expected = sum(1 for r in checked if r["status"] == Status.UNSAFE and GraphMode(r["mode"]).expected_unsafe)
    if expected:
        extra.append(f"{expected} UNSAFE of full-narrow, as expected")
    rows_said = {r.get("error") for r in doc["records"]}
    own = [e for e in doc.get("errors", []) if e not in rows_said]  # the run's, not a row's (the fused check)
    if own:
        extra.append(f"{len(own)} run error{'s' if len(own) > 1 else ''}, printed above")
    partial = doc.get("partial")
    if partial:
        extra.append(
            f"partial run: {partial['reason']} after {partial['measured']} of {partial['planned']} {partial['unit']}"
        )
    # a row that failed before its replay (an eager reference that could not run) checked none
    replays = sum(1 for r in checked if r["mode"] != GraphMode.EAGER and r["status"] in (Status.OK, Status.UNSAFE))
    return (
        f"{count[Status.OK]} ok, {count[Status.UNSAFE]} UNSAFE, {count[Status.ERROR] + count[Status.OOM]} "
        f"errors ({'; '.join([f'{replays} replays checked against eager'] + extra)})"
    )
