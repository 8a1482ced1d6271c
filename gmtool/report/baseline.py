"""Change against an older run of the same model: rows matched on mode, bucket and composition."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from gmtool.errors import GmtoolError
from gmtool.records import Document
from gmtool.report.results import load_results
from gmtool.report.summary import bucket_summary, row_keys, run_tp


def load_baseline(path: Path) -> Document:
    try:
        return load_results(path)
    except GmtoolError as e:
        raise GmtoolError(f"--baseline: {e}") from None


SHAPE_FIELDS = ("params", "layers", "heads", "kv_heads", "head_dim", "vocab")  # a model's shape in model_info


def check_same_model(
    base: Document, name: str, params: int | None = None, scenario: str | None = None, shape: dict | None = None
) -> None:
    """Timings of two different models, or of decode against prefill steps, say nothing about each other:
    refuse rather than print noise (or match no row without a word). shape: this run's model fields; two
    checkpoint folders of one name (a folder name is all a checkpoint's name is) must agree on each both have."""
    old_scenario = base.config.get("scenario")
    if scenario is not None and old_scenario is not None and old_scenario != scenario:
        raise GmtoolError(
            f"--baseline is a {old_scenario} run, this run is {scenario}: compare runs of the same scenario"
        )
    old = base.model
    same = old.get("name") == name and (params is None or old.get("params") in (None, params))
    if not same:
        old_desc = f"{old.get('name')!r}" + (f" ({old['params']:,} parameters)" if old.get("params") else "")
        new_desc = f"{name!r}" + (f" ({params:,} parameters)" if params else "")  # params: checked on reading
        raise GmtoolError(
            f"--baseline is a run of model {old_desc}, this run is {new_desc}: compare runs of the same model"
        )
    differ = [
        f"{k} {old[k]} then, {shape[k]} now"
        for k in SHAPE_FIELDS
        if shape and old.get(k) is not None and shape.get(k) is not None and old[k] != shape[k]
    ]
    if differ:
        raise GmtoolError(
            f"--baseline is a run of another model named {name!r} ({', '.join(differ)}): compare runs of the same model"
        )


def _pct(new, old):
    return None if new is None or not old else (new - old) / old * 100.0


def _diff(new, old):
    return None if new is None or old is None else new - old


def _median(r: dict):
    return (r.get("latency_ms") or {}).get("median")


def _label(r: dict, rank: int) -> tuple:
    return r["mode"], r["bucket"], r["composition"], rank


def attach_baseline(doc: Document, base: Document, path: Path) -> None:
    """Sets every record's baseline (None when the old run has no such row) and the document's."""
    check_same_model(base, doc.model["name"], doc.model.get("params"), doc.config.get("scenario"), doc.model)
    rows, old_rows = [r.to_dict() for r in doc.records], [r.to_dict() for r in base.records]
    old = {(o.get("rank") or 0, key): o for key, o in zip(row_keys(old_rows), old_rows)}
    old_ranks = {rank for rank, _ in old}
    base_tp = run_tp(base.config)
    # a label a bucket runs more than once is told apart by order: where two whole runs hold it another number
    # of times (an edited file, other mixes), order no longer pairs the same mixes, and those rows stay unpaired.
    # A partial run lost its last rows only: its first occurrences are still the other run's first.
    new_n = Counter(_label(r, r.get("rank") or 0) for r in rows)
    old_n = Counter(_label(o, o.get("rank") or 0) for o in old_rows)
    whole = doc.partial is None and base.partial is None
    matched, used, changed, moved = 0, set(), 0, 0
    pairs = []  # (this run's row, the baseline's) of every matched row: the bucket changes are over these alone
    for key, r, rec in zip(row_keys(rows), rows, doc.records):
        # each rank against the same rank of the baseline, or against its single rank (TP=1 against TP=2)
        rank = r.get("rank") or 0
        # a TP=1 baseline's one rank stands for each; a --tp baseline's missing rank (a partial run) for none
        at = (rank if rank in old_ranks or base_tp > 1 else 0, key)
        o = old.get(at)
        n, n_old = new_n[_label(r, rank)], old_n[_label(r, at[0])]
        if o is None or (whole and n != n_old and max(n, n_old) > 1):
            rec.baseline = None
            continue
        matched += 1
        used.add(at)
        pairs.append((r, o))
        changed += o["status"] != r["status"]
        moved += bool(o.get("served_by") and r.get("served_by") and o["served_by"] != r["served_by"])
        rec.baseline = {
            "status": o["status"],
            "served_by": o.get("served_by"),
            "latency_ms": _median(o),
            "latency_delta_pct": _pct(_median(r), _median(o)),
            "max_rel_err": o.get("max_rel_err"),
            "err_delta": _diff(r.get("max_rel_err"), o.get("max_rel_err")),
        }
    # every rank pooled (rank null); under --tp also each rank, against the same rank of the baseline where it has
    # one, else against the baseline's pooled rows (a TP=1 run's only rank). Both sides summarize the matched rows
    # only: a bucket's median over three mixes against the baseline's over one was a change on the same data.
    new_rows, old_matched = [r for r, _ in pairs], [o for _, o in pairs]
    pooled = {(s["mode"], s["bucket"]): s for s in bucket_summary(old_matched)}
    per_rank = {(s["mode"], s["bucket"], s["rank"] or 0): s for s in bucket_summary(old_matched, True)}
    several = len({r.get("rank") or 0 for r in rows}) > 1
    # each bucket's mixes in this run, against the matched ones its change is over
    mixes = {(s["mode"], s["bucket"], s["rank"]): s["compositions"] for s in bucket_summary(rows, several)}
    mixes.update({(s["mode"], s["bucket"], None): s["compositions"] for s in bucket_summary(rows)})
    buckets = []
    for s in bucket_summary(new_rows) + (bucket_summary(new_rows, True) if several else []):
        o = pooled.get((s["mode"], s["bucket"]))
        if s["rank"] is not None and len(old_ranks) > 1:
            o = per_rank.get((s["mode"], s["bucket"], s["rank"]), o)
        if o is not None:
            buckets.append(
                {
                    "mode": s["mode"],
                    "bucket": s["bucket"],
                    "rank": s["rank"],
                    "old_status": o["status"],
                    "old_replay_ms": o["replay_ms"],
                    "replay_delta_pct": _pct(s["replay_ms"], o["replay_ms"]),
                    "old_max_rel_err": o["max_rel_err"],
                    "err_delta": _diff(s["max_rel_err"], o["max_rel_err"]),
                    "mixes_compared": s["compositions"],
                    "mixes": mixes[(s["mode"], s["bucket"], s["rank"])],
                }
            )
    doc.baseline = {
        "path": str(path),
        "created": base.created,
        "machine": base.machine,
        "matched": matched,
        "unmatched": len(rows) - matched,
        "only_in_baseline": len(old) - len(used),  # rows the older run had and this one did not measure
        "status_changed": changed,  # matched rows whose status differs (ok -> UNSAFE, error -> ok, ...)
        "served_by_changed": moved,  # matched auto rows another path served (piecewise -> eager, ...)
        "partial": base.partial is not None,
        "differs": _differs(doc, base),  # what else the two runs did not share (dtype, device, ...)
        "buckets": buckets,
    }


# what moves every row's timing: the forward's kernels, the KV layout it reads, the device
TIMING_SETTINGS = (
    *(("config", k) for k in ("dtype", "tp", "fuse", "small_m_gemm", "pdl", "compile", "piecewise_impl")),
    *(("config", k) for k in ("attention_backend", "block_size", "max_kv_len")),
    ("machine", "backend"),
    ("machine", "gpu"),
)


def _differs(doc: Document, base: Document) -> list[str]:
    """Settings the two runs did not share that move every timing: said with the counts, not refused (a dtype
    or a GPU change is what one may want to see)."""
    out = []
    for section, key in TIMING_SETTINGS:
        new, old = getattr(doc, section).get(key), getattr(base, section).get(key)
        if new is not None and old is not None and new != old:
            out.append(f"{key} {old} then, {new} now")
    return out
