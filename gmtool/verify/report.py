"""verify.json, the run table and the verdict: what was found, and the exit code it earns.

Exit codes: 0 nothing found; 3 a wrong replay, a baked-in composition-dependent value, or an op that breaks
capture, in a mode that should be safe (full-narrow's findings are the bug it exists to show); 2 bad input
(raised before anything runs).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from rich.markup import escape
from rich.table import Table

from gmtool.modes import GraphMode
from gmtool.verify.nodediff import fold_layers
from gmtool import json_text

EXIT_CLEAN, EXIT_FOUND, EXIT_INTERRUPTED = 0, 3, 130


def _baked_what(d: dict) -> str:
    """The first composition-dependent value of a dynamic-dimension record, in words."""
    if d["baked"]:
        return f"{d['baked'][0]['op']} in {d['baked'][0]['module']}"
    if d["diverged_at"]:
        return str(d["diverged_at"])
    dep = d["graph_nodes"]["dependent"][0]
    return f"kernel {dep['kernel']} in {dep['module'] or '<root>'} ({', '.join(dep['fields'])})"


def _findings(doc: dict) -> list[str]:
    out = [f"capture: {f['text']}" for f in doc["capturability"] if f["breaks_capture"]]
    out += [
        f"{d['mode']} {d['kind']} bucket {d['key']}: composition-dependent value baked into the graph: "
        + _baked_what(d)
        for d in doc["dynamic_dims"]
        if not d["clean"] and not d["expected_unsafe"]
    ]
    for r in doc["runs"]:
        m = r["mismatch"]
        if m is None or r["expected_unsafe"]:
            continue
        where = m["first_divergence"]["tensor"] if m["first_divergence"] else "no layer output differs"
        out.append(
            f"{r['mode']} under {r['strategy']}: wrong replay at step {m['step']} (bucket {m['key']}, "
            f"{m['composition']}): {where}; suspected: {m['suspects'][0]}; reproduce: {m['repro']}"
        )
    return out


def _served_notes(doc: dict, cfg) -> list[str]:
    """What served a composite mode's steps (auto: full, piecewise, eager), and how many of each were checked:
    a soak whose steps never left one kind checked only that kind."""
    out = []
    for r in doc["runs"]:
        if not GraphMode(r["mode"]).composed_of:
            continue  # a plain mode serves its own steps
        served = r.get("served_by") or {}
        checked = r.get("checked_by") or {}
        parts = ", ".join(f"{k} {n} ({checked.get(k, 0)} checked)" for k, n in served.items())
        out.append(f"{r['mode']} under {r['strategy']}: steps served by {parts}")
        largest = cfg.sweep.bucket_sizes[-1]
        if cfg.max_tokens is not None and cfg.max_tokens > largest and not checked.get("eager"):
            out.append(
                f"{r['mode']} under {r['strategy']}: no checked step was above the largest bucket ({largest}), "
                "so the eager path --max-tokens opens was not checked: raise --steps or lower --check-every"
            )
    return out


def finish_document(doc: dict, cfg, wall_s: float) -> dict:
    doc["wall_s"] = wall_s
    doc.setdefault("notes", []).extend(_served_notes(doc, cfg))
    # each soak's own notes (a fallback split, skipped decoys, a stop), said where the terminal shows notes
    doc["notes"] += [f"{r['mode']} under {r['strategy']}: {n}" for r in doc["runs"] for n in r.get("notes", [])]
    doc["findings"] = _findings(doc)
    blind = [f"{d['mode']} {d['kind']}" for d in doc["dynamic_dims"] if not d.get("compared", True)]
    if blind:
        doc["notes"].append(
            f"dynamic dimensions: a capture recorded no op in {', '.join(blind)}: nothing was compared there"
        )
    fault = doc.get("config", {}).get("inject")
    missed = [f"{r['mode']} under {r['strategy']}" for r in doc["runs"] if r["mismatch"] is None]
    if fault and doc["findings"] and missed:  # the verdict names the catch; the soaks that missed it are said here
        doc["notes"].append(
            f"the injected {fault} was never caught in {', '.join(missed)}: these soaks ran nothing it changes, or "
            "verify missed it"
        )
    doc["exit_code"] = EXIT_FOUND if doc["findings"] else EXIT_CLEAN
    steps = sum(r["steps"] for r in doc["runs"])
    checks = sum(r["checks"] for r in doc["runs"])
    if doc["findings"]:
        doc["verdict"] = f"verify: WRONG REPLAY FOUND ({len(doc['findings'])}): {doc['findings'][0]}"
    elif doc.get("partial"):  # not clean: what it did not run was not checked
        doc["exit_code"] = EXIT_INTERRUPTED
        doc["verdict"] = (
            f"verify: interrupted after {doc['partial']['measured']} of {doc['partial']['planned']} soaks: "
            f"{steps} steps, {checks} checked replays against eager, no wrong replay among them"
        )
    else:
        doc["verdict"] = (
            f"verify: clean: {steps} steps, {checks} checked replays against eager, "
            f"{len(doc['runs'])} soak(s), no op that breaks capture, no baked-in value" + _expected(doc)
        )
        if blind:
            doc["verdict"] += f"; but dynamic dimensions compared nothing in {', '.join(blind)}"
        if fault:  # a self-test that found nothing is no clean bill
            doc["verdict"] += (
                f"; but the injected {fault} was never caught: these soaks ran nothing it changes (as freeze-seq-lens "
                "under piecewise prefill, whose attention reads the lengths from its host plan), or verify missed it"
            )
    return doc


def _expected(doc: dict) -> str:
    """What was found in the modes expected to be unsafe (full-narrow), for the clean verdict: without it the
    verdict said 'no baked-in value' under a table of them."""
    found: dict[str, list[str]] = {}
    for d in doc["dynamic_dims"]:
        if not d["clean"] and d["expected_unsafe"]:
            found.setdefault(d["mode"], []).append(f"{len(d['baked']) or 'a'} baked-in value(s) ({d['kind']})")
    for r in doc["runs"]:
        if r["mismatch"] is not None and r["expected_unsafe"]:
            found.setdefault(r["mode"], []).append(f"a wrong replay at step {r['mismatch']['step']}")
    said = "; ".join(f"{mode}, expected unsafe, showed {' and '.join(what)}" for mode, what in found.items())
    return f" in the modes that should be safe; {said}" if said else ""


def runs_frame(doc: dict) -> pd.DataFrame:
    rows = []
    for r in doc["runs"]:
        m = r["mismatch"]
        result = (
            "clean"
            if m is None
            else (
                f"step {m['step']}: " + (m["first_divergence"]["tensor"] if m["first_divergence"] else m["reason"][:60])
            )
        )
        rows.append(
            {
                "mode": r["mode"],
                "strategy": r["strategy"],
                "steps": r["steps"],
                "checks": r["checks"],
                "graphs": r["graphs"],
                "requests done": r["finished_requests"],
                "blocks reused": r["blocks_reused"],
                "steps/min": round(r["steps_per_min"], 1),
                "result": result + (" (expected)" if m is not None and r["expected_unsafe"] else ""),
            }
        )
    return pd.DataFrame(rows)


def dyndims_frame(doc: dict) -> pd.DataFrame:
    """One row per mode x kind: the ATen-op diff, the graph-node diff (CUDA) and what depends on the batch: the
    kernels (CUDA), else the first baked op."""
    rows = []
    for d in doc["dynamic_dims"]:
        g = d.get("graph_nodes")
        if g:
            dep = "; ".join(
                f"{r['kernel']} in {r['module'] or '<root>'} x{r['nodes']} ({', '.join(r['fields'])})"
                for r in g["dependent"][:4]
            ) + (" ..." if len(g["dependent"]) > 4 else "")
        elif d["baked"]:
            b = d["baked"][0]
            dep = f"{b['op']} in {fold_layers(b['module']) or '<root>'}: {b['value_a']} vs {b['value_b']}"
        else:
            dep = d["diverged_at"] or ""
        result = "clean" if d["clean"] else "BAKED IN" + (" (expected)" if d["expected_unsafe"] else "")
        if d["clean"] and not d.get("compared", True):
            result = "NOT COMPARED"
        rows.append(
            {
                "mode": d["mode"],
                "kind": d["kind"],
                "bucket": d["key"],
                "compositions": " vs ".join(d["compositions"]),
                "aten ops": f"{d['ops'][0]}: " + ("diverged" if d["diverged_at"] else f"{len(d['baked'])} baked"),
                "graph nodes": f"{g['kernels'][0]} kernels, {g['changes_total']} changed" if g else "-",
                "depends on the composition": dep or "-",
                "result": result,
            }
        )
    df = pd.DataFrame(rows)
    if not any(d.get("graph_nodes") for d in doc["dynamic_dims"]) and not df.empty:
        # no CUDA graph was compared node by node (the CPU tape has no nodes): an all '-' column only pushes the
        # table past a 100-column terminal (verify.json keeps graph_nodes: null per row)
        df = df.drop(columns=["graph nodes"])
    return df


def _table(df: pd.DataFrame, title: str) -> Table:
    t = Table(title=escape(title))
    for c in df.columns:
        t.add_column(c, justify="right" if df[c].dtype.kind in "if" else "left")
    for row in df.itertuples(index=False):
        style = "green" if row[-1] == "clean" else "yellow" if str(row[-1]).endswith("(expected)") else "bold red"
        t.add_row(*(str(v) for v in row), style=style)
    return t


def runs_table(doc: dict) -> Table:
    return _table(runs_frame(doc), "gmtool verify")


def dyndims_table(doc: dict) -> Table:
    return _table(dyndims_frame(doc), "dynamic dimensions: one bucket, two compositions")


def write_document(out_dir: Path, doc: dict) -> Path:
    path = out_dir / "verify.json"
    path.write_text(json_text.dumps(doc, indent=1, default=str) + "\n")
    return path
