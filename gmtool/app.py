"""The application layer: each command's work, from a config to a written document. No terminal here: the CLI
parses, calls one of these, prints the document and exits with its code (gmtool.records.exit_code).

progress(label) is a context manager giving a progress object (start(total), advance(label)) or None.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

from gmtool.config import SweepConfig
from gmtool.modes import GraphMode
from gmtool.report.results import to_document, write_reports, write_results
from gmtool.measure.sweep import Sweep


def _no_progress(label: str):
    return contextlib.nullcontext()


def run_capture(cfg: SweepConfig, out_dir: Path, progress=_no_progress) -> dict:
    """Every bucket of the config captured and replayed with each composition; results.json and .csv."""
    with progress("capture") as p:
        result = Sweep(cfg, p).run()
    doc = to_document(result, "capture")
    write_results(out_dir, doc)
    return doc


def run_compare(cfg: SweepConfig, modes: list[GraphMode], out_dir: Path, progress=_no_progress,
                trace: bool = False, peer_buckets: list[int] | None = None, peer_compile: str = "shared",
                baseline: tuple[dict, Path] | None = None) -> tuple[dict, list[Path]]:
    """The sweep's modes, then the hf-compiled peer on the same workbench; results, reports and traces.
    baseline: (an older results document, its path) to attach. Returns the document and the files written."""
    from gmtool.measure.hf_compiled import HfCompiled
    from gmtool.report.baseline import attach_baseline
    from gmtool.measure.trace import TraceProbe

    tracer = TraceProbe(out_dir) if trace else None
    with progress("compare") as p:
        sweep = Sweep(cfg, p, probes=(tracer,) if tracer else ())
        result = sweep.run()
    traces = list(tracer.trace_files) if tracer else []
    if GraphMode.HF_COMPILED in modes:
        peer = HfCompiled(sweep.bench, out_dir if trace else None, peer_buckets, peer_compile)
        with progress(GraphMode.HF_COMPILED) if peer.runnable else contextlib.nullcontext() as p:
            result.records += peer.run(p)
        traces += peer.trace_files
    if trace and not traces:
        result.notes.append("--trace: no trace was written")
    doc = to_document(result, "compare")
    doc["config"]["modes"] = list(modes)  # the peer is not a SweepConfig mode, but the reports list it in order
    if baseline is not None:
        attach_baseline(doc, *baseline)
    return doc, write_results(out_dir, doc) + write_reports(out_dir, doc) + traces


def run_memreport(cfg: SweepConfig, strategies: list[str], out_dir: Path, progress=_no_progress,
                  on_strategy=None) -> tuple[dict, list[Path]]:
    """The sweep of the config's one graph mode under each memory strategy; the files are rewritten after every
    strategy, so a later failure keeps what was measured. on_strategy(row): told of each finished strategy."""
    from gmtool.memory.report import build_document, run_strategy, write_report

    rows, result, doc, paths = [], None, None, []
    for name in strategies:
        with progress(f"memreport {name}") as p:
            row, res = run_strategy(cfg, name, p)
        rows.append(row)
        result = result or res
        if on_strategy:
            on_strategy(row)
        doc = build_document(cfg, rows, result)
        paths = write_report(out_dir, doc)
    return doc, paths
