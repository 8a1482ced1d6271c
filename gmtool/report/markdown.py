"""report.md, and the sections it shares with report.html (each renderer only escapes and lays them out)."""

from __future__ import annotations

import re

from dataclasses import dataclass, field

from gmtool.records import Status
from gmtool.report import ledger
from gmtool.report.summary import bucket_summary, mode_order, row_keys, run_tp, safety_matrix
from gmtool.report.tables import baseline_counts, fmt_bytes, noise_warning


@dataclass
class Section:
    title: str
    headers: list[str]
    rows: list[list[str]] = field(default_factory=list)
    intro: str = ""
    empty: str = "none"


def _num(x, spec: str, suffix: str = "") -> str:
    return "-" if x is None else format(x, spec) + suffix


def _pct(x) -> str:
    return "-" if x is None else f"{x:+.1f}%"


def overview(doc: dict) -> list[tuple[str, str]]:
    m, c, mod = doc["machine"], doc["config"], doc["model"]
    gpu = m.get("gpu") or f"{m['backend']} (no GPU: timings are not GPU figures)"
    items = [
        ("model", f"{mod['name']} ({mod['source']}, {mod.get('params') or 0:,} parameters)"),
        (
            "machine",
            f"{gpu}; torch {m['torch']}, transformers {m['transformers']}"
            + (f", CUDA {m['cuda']}, driver {m['driver']}" if m.get("cuda") else ""),
        ),
        (
            "sweep",
            f"{c['scenario']}, {c['dtype']}, buckets {', '.join(map(str, c['bucket_sizes']))}, "
            f"modes {', '.join(mode_order(doc))}, {c['num_iters']} timed iterations after "
            f"{c['num_iters_warmup']} warm-up, max_kv_len {c['max_kv_len']}",
        ),
        ("run", f"{doc.get('command')} at {doc.get('created')}, {doc.get('wall_s') or 0:.1f} s"),
    ]
    partial = doc.get("partial")
    if partial:  # said at the top: every table below holds only what was measured before the stop
        items.insert(
            0,
            (
                "PARTIAL RUN",
                f"{partial['reason']} after {partial['measured']} of {partial['planned']} "
                f"{partial.get('unit', 'rows')}; the tables hold only what was measured",
            ),
        )
    if doc.get("baseline"):
        b = doc["baseline"]
        items.append(("baseline", f"{b['path']} ({b.get('created')}): {baseline_counts(b)}"))
    return items


def _comp_label(row_or_rec: dict, dup: bool) -> str:
    return row_or_rec["composition"] + (f" #{row_or_rec['n']}" if dup else "")


def sections(doc: dict) -> list[Section]:
    records, order = doc["records"], {m: i for i, m in enumerate(mode_order(doc))}
    deltas = {(d["mode"], d["bucket"], d.get("rank")): d for d in (doc.get("baseline") or {}).get("buckets", [])}
    by_rank = run_tp(doc.get("config")) > 1  # --tp: a row per rank, as the terminal's table
    summary = Section(
        "Summary (mode x bucket)",
        [
            "bucket",
            "mode",
            *(["rank"] if by_rank else []),
            "mixes",
            "status",
            "replay ms",
            "eager ms",
            "speedup",
            "max rel err",
            "capture s",
            "compile s",
            "graph mem",
            "served by",
            "x floor",
            "noisy",
        ]
        + (["vs baseline"] if deltas else []),
        intro="Medians over each bucket's compositions; max rel err is the worst sequence of any "
        "composition. A bucket that is UNSAFE for any composition shows no latency or speedup. served by: "
        "what ran the batches (auto picks per batch); x floor: median latency over the "
        "hardware floor (gmtool.measure.floor).",
    )
    rows = bucket_summary(records, by_rank)
    for s in sorted(rows, key=lambda s: (s["bucket"], order.get(s["mode"], 99), s.get("rank") or 0)):
        row = [
            str(s["bucket"]),
            s["mode"],
            *([str(s.get("rank") or 0)] if by_rank else []),
            str(s["compositions"]),
            s["status"],
            _num(s["replay_ms"], ".3f"),
            _num(s["eager_ms"], ".3f"),
            _num(s["speedup"], ".2f", "x"),
            _num(s["max_rel_err"], ".2e"),
            _num(s["capture_s"], ".3f"),
            _num(s["compile_s"], ".1f"),
            fmt_bytes(s["graph_mem_bytes"]),
            s["served_by"] or "-",
            _num(s["replay_over_floor"], ".1f", "x"),
            "yes" if s["noisy"] else "",
        ]
        if deltas:
            own = deltas.get((s["mode"], s["bucket"], s.get("rank") or 0)) if by_rank else None
            row.append(_pct((own or deltas.get((s["mode"], s["bucket"], None)) or {}).get("replay_delta_pct")))
        summary.rows.append(row)
    noise = noise_warning(doc)
    if by_rank:
        summary.intro += " Under --tp, a row per rank: each rank's own medians."
    if noise:
        summary.intro += f" Warning: {noise}."

    unsafe = Section(
        "UNSAFE replays",
        ["mode", "bucket", "composition", "key", "max rel err", "error"],
        intro="Replays that differ from eager (or froze a host plan from capture). full-narrow's are "
        "the expected finding: a num_tokens-only key is wrong for prefill.",
    )
    unsafe.rows = [
        [
            r["mode"],
            str(r["bucket"]),
            r["composition"],
            str(r.get("key") or "-"),
            _num(r.get("max_rel_err"), ".2e"),
            r.get("error") or "",
        ]
        for r in records
        if r["status"] == Status.UNSAFE
    ]
    problems = Section("Errors and skipped rows", ["mode", "bucket", "composition", "status", "error"])
    problems.rows = [
        [r["mode"], str(r["bucket"]), r["composition"], r["status"], r.get("error") or ""]
        for r in records
        if Status(r["status"]) in (Status.ERROR, Status.OOM, Status.SKIPPED)
    ]

    modes, matrix = safety_matrix(doc)
    labels = [(m["bucket"], m["composition"]) for m in matrix]
    safety = Section(
        "Safety per composition",
        ["bucket", "composition"] + modes,
        intro="Which modes replay each batch composition correctly (ok), and which do not (UNSAFE); "
        "'-': the mode did not run this composition.",
    )
    for m in matrix:
        dup = labels.count((m["bucket"], m["composition"])) > 1
        safety.rows.append([str(m["bucket"]), _comp_label(m, dup)] + [m["statuses"].get(x, "-") for x in modes])

    memory = Section(
        "Graph memory ledger",
        *ledger.records_ledger_cells(doc),
        intro=ledger.INTRO,
        empty="no graph was captured",
    )
    out = [summary, memory, unsafe, problems, safety]
    if doc.get("baseline"):
        base = Section(
            "Change vs baseline",
            [
                "mode",
                "bucket",
                "composition",
                "status",
                "latency ms",
                "baseline ms",
                "latency change",
                "max rel err",
                "err change",
            ],
            intro=f"Against {doc['baseline']['path']}, rows matched on mode, bucket and composition (a label "
            f"that repeats within a bucket is told apart by its order, #n): {baseline_counts(doc['baseline'])}.",
        )
        keyed = [(k, r) for k, r in zip(row_keys(records), records) if r.get("baseline") is not None]
        dups = {(k[0], k[1], k[2]) for k, _ in keyed if k[3] > 1}
        keyed.sort(key=lambda kr: (kr[1]["bucket"], order.get(kr[1]["mode"], 99), kr[1].get("rank") or 0, kr[0][3]))
        ranked = any(r.get("rank") for _, r in keyed)  # --tp: each rank's rows against the baseline's
        for (mode, bucket, comp, n), r in keyed:
            b = r["baseline"]
            status = r["status"] if b["status"] == r["status"] else f"{b['status']} -> {r['status']}"
            base.rows.append(
                [
                    r["mode"] + (f" (rank {r.get('rank') or 0})" if ranked else ""),
                    str(r["bucket"]),
                    _comp_label({"composition": comp, "n": n}, (mode, bucket, comp) in dups),
                    status,
                    _num((r.get("latency_ms") or {}).get("median"), ".3f"),
                    _num(b["latency_ms"], ".3f"),
                    _pct(b["latency_delta_pct"]),
                    _num(r.get("max_rel_err"), ".2e"),
                    _num(b["err_delta"], "+.2e"),
                ]
            )
        out.append(base)
    return out


def notes(doc: dict) -> list[str]:
    """Run notes, then each distinct per-record note (the hf-compiled peer explains itself there)."""
    return list(dict.fromkeys(list(doc.get("notes") or []) + [r["notes"] for r in doc["records"] if r.get("notes")]))


def _md_cell(text: str) -> str:
    """Free text (an error, a note, a path) as a table cell or list item: shown as written, never rendered."""
    return md_text(text).replace("\n", " ")


def _md_code(text: str) -> str:
    """Composition labels (1*4+2*8@512) would turn into emphasis as plain Markdown."""
    return f"`{text}`" if text not in ("", "-") else text


def md_text(text: str) -> str:
    """A name the user chose (a checkpoint folder's), as Markdown shows it: its marks escaped, not rendered."""
    return re.sub(r"([\\`*_\[\]<>#|])", r"\\\1", str(text))


def render_markdown(doc: dict) -> str:
    lines = [f"# gmtool {doc.get('command', '')}: {md_text(doc['model']['name'])}", ""]
    lines += [f"- **{k}**: {_md_cell(v)}" for k, v in overview(doc)]
    for sec in sections(doc):
        lines += ["", f"## {sec.title}", ""]
        if sec.intro:
            lines += [md_text(sec.intro), ""]
        if not sec.rows:
            lines.append(sec.empty)
            continue
        comp = sec.headers.index("composition") if "composition" in sec.headers else -1
        lines.append("| " + " | ".join(sec.headers) + " |")
        lines.append("|" + "|".join("---" for _ in sec.headers) + "|")
        for row in sec.rows:
            cells = [_md_code(c).replace("|", "\\|") if i == comp else _md_cell(c) for i, c in enumerate(row)]
            cells = [f"**{c}**" if c == Status.UNSAFE else c for c in cells]
            lines.append("| " + " | ".join(cells) + " |")
    if doc.get("errors"):  # what went wrong outside the rows (a mode's failure, the fused check's)
        lines += ["", "## Errors", ""] + [f"- {_md_cell(e)}" for e in doc["errors"]]
    extra = notes(doc)
    if extra:
        lines += ["", "## Notes", ""] + [f"- {_md_cell(n)}" for n in extra]
    return "\n".join(lines) + "\n"
