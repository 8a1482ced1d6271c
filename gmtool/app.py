"""The application layer: each command's work, from a config to a written document. No terminal here: the CLI
parses, calls one of these, prints the document and exits with its code (Document.exit_code).

Nothing measured is lost: every record goes to the output directory's journal (records.jsonl) as it is measured,
and on Ctrl-C or a crash the result files are written from what was measured, marked partial; Ctrl-C then
becomes gmtool.errors.Interrupted ("interrupted after N of M rows", exit 130).

progress(label) is a context manager giving a progress object (start(total), advance(label)) or None.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from gmtool.config import SweepConfig
from gmtool.errors import GmtoolError, Interrupted
from gmtool.measure.sweep import Sweep, planned_rows
from gmtool.modes import GraphMode
from gmtool.parallel.comm import gather_records, is_writer
from gmtool.records import Document
from gmtool.report.results import Journal, write_reports, write_results


def _no_progress(label: str):
    return contextlib.nullcontext()


def _on_writer(write):
    """write, on the process that writes (rank 0 under --tp; the other ranks only measure)."""
    return write if is_writer() else (lambda *a: None)


def _tp_probes(cfg: SweepConfig) -> tuple:
    """Under --tp: the collectives' share of a step, profiled once the rows are measured."""
    from gmtool.parallel.profile import CollectiveShare

    return (CollectiveShare(),) if cfg.tp > 1 else ()


def _gathered(result) -> bool:
    """Under --tp: every rank's rows onto rank 0's result (each with its rank); False on the other ranks."""
    records = gather_records(result.records)
    if records is None:
        return False
    result.records = records
    return True


@contextlib.contextmanager
def _keeping(out_dir: Path, command: str, planned: int, sweep: Sweep, write):
    """On Ctrl-C or a crash inside: write(document) of what the sweep measured, marked partial. Ctrl-C comes
    out as Interrupted saying how far the run got; any other failure goes on as it was."""
    try:
        yield
    except BaseException as e:
        res = sweep.result
        measured = len(res.records) if res else 0
        if measured:
            doc = res.document(command)
            first = (str(e).strip().splitlines() or [""])[0]
            doc.mark_partial(
                "interrupted"
                if isinstance(e, KeyboardInterrupt)
                else f"stopped by {type(e).__name__}: {first}".rstrip(": "),
                planned,
            )
            if sweep.cfg.tp > 1:  # the ranks' rows meet only at the end (gather_records): this rank's alone
                doc.notes.append(
                    f"--tp {sweep.cfg.tp}: these are this rank's rows only (each rank measures every row; they are "
                    "gathered when the run ends, and it did not)"
                )
            write(doc)
        if isinstance(e, KeyboardInterrupt):
            kept = f"; what was measured is in {out_dir}" if measured else ""
            raise Interrupted(f"interrupted after {measured} of {planned} rows{kept}") from None
        raise


def run_capture(cfg: SweepConfig, out_dir: Path, progress=_no_progress) -> Document:
    """Every bucket of the config captured and replayed with each composition; results.json and .csv."""
    planned = planned_rows(cfg)
    sweep = Sweep(cfg, probes=_tp_probes(cfg), on_record=_on_writer(Journal(out_dir, "capture", planned).write))
    with _keeping(out_dir, "capture", planned, sweep, _on_writer(lambda doc: write_results(out_dir, doc))):
        with progress("capture") as sweep.progress:
            result = sweep.run()
    if not _gathered(result):
        return None
    doc = result.document("capture")
    write_results(out_dir, doc)
    return doc


def run_plan_measure(cfg: SweepConfig, out_dir: Path, progress=_no_progress) -> tuple[Document, list[Path]]:
    """plan's measurement (eager and the plan's graph mode on the buckets its workload reaches), journaled and
    kept on Ctrl-C or a crash as compare's is: results.json and .csv in the plan's directory."""
    planned = planned_rows(cfg)
    sweep = Sweep(cfg, on_record=Journal(out_dir, "compare", planned).write)
    with _keeping(out_dir, "compare", planned, sweep, lambda doc: write_results(out_dir, doc)):
        with progress("plan: measure") as sweep.progress:
            result = sweep.run()
    doc = result.document("compare")
    return doc, write_results(out_dir, doc)


def run_compare(
    cfg: SweepConfig,
    modes: list[GraphMode],
    out_dir: Path,
    progress=_no_progress,
    trace: bool = False,
    peer_buckets: list[int] | None = None,
    peer_compile: str = "shared",
    baseline: tuple[Document, Path] | None = None,
) -> tuple[Document, list[Path]]:
    """The sweep's modes, then the hf-compiled peer on the same workbench; results, reports and traces.
    baseline: (an older results document, its path) to attach. Returns the document and the files written."""
    from gmtool.measure.hf_compiled import HfCompiled
    from gmtool.measure.floor import FloorProbe
    from gmtool.measure.trace import TraceProbe
    from gmtool.report.baseline import attach_baseline

    with_peer = GraphMode.HF_COMPILED in modes
    planned = planned_rows(cfg) + (len(peer_buckets or cfg.bucket_sizes) if with_peer else 0)
    tracer = TraceProbe(out_dir) if trace else None
    floors = FloorProbe(count_kernels=not with_peer)  # each row's distance to the hardware floor
    sweep = Sweep(
        cfg,
        probes=((floors, tracer) if tracer else (floors,)) + _tp_probes(cfg),
        on_record=_on_writer(Journal(out_dir, "compare", planned).write),
    )
    files: list[Path] = []

    def write(doc: Document) -> None:
        doc.config["modes"] = list(modes)  # the peer is not a SweepConfig mode, but the reports list it in order
        if baseline is not None:
            try:
                attach_baseline(doc, *baseline)
            except GmtoolError as e:  # known only once the model is built (its parameters): keep the measurement
                doc.notes.append(f"{e}; the results are written without it")
        files[:] = write_results(out_dir, doc) + write_reports(out_dir, doc)

    with _keeping(out_dir, "compare", planned, sweep, _on_writer(write)):
        with progress("compare") as sweep.progress:
            result = sweep.run()
        traces = list(tracer.trace_files) if tracer else []
        if with_peer:
            peer = HfCompiled(sweep.bench, out_dir if trace else None, peer_buckets, peer_compile)
            with progress(GraphMode.HF_COMPILED) if peer.runnable else contextlib.nullcontext() as p:
                peer.run(p, result.add)
            traces += peer.trace_files
    if trace and not traces:
        result.notes.append("--trace: no trace was written")
    if not _gathered(result):
        return None, []
    doc = result.document("compare")
    write(doc)
    return doc, files + traces


def run_memreport(
    cfg: SweepConfig,
    strategies: list[str],
    out_dir: Path,
    progress=_no_progress,
    on_strategy=None,
    sample: int | None = None,
    check: bool = False,
):
    """The sweep of the config's one graph mode under each memory strategy; the files are rewritten after every
    strategy, so a later failure keeps what was measured. on_strategy(row): told of each finished strategy.
    sample: capture only that many of the buckets and predict the whole list per strategy; check: then capture
    every bucket too, and give the prediction's error. Returns the MemDocument and the files written.
    The model is built once for all of it (a SharedWorkbench; twice only if the sample needs another KV cache)."""
    from gmtool.measure.workbench import SharedWorkbench
    from gmtool.memory.predict import check_document, predict_document, sampled_config
    from gmtool.memory.report import write_report

    out_dir.mkdir(parents=True, exist_ok=True)  # a library caller's folder, as the CLI makes it
    if not sample and not check:
        return _memreport_runs(cfg, strategies, out_dir, progress, on_strategy, SharedWorkbench(cfg))
    small = sampled_config(cfg, sample)
    shared = SharedWorkbench(cfg if check else small)
    # the sampled captures' allocator events: the simulator predicts from them (gmtool.memory.allocsim)
    doc, paths = _memreport_runs(small, strategies, out_dir, progress, on_strategy, shared, "sampled ", traces=True)
    predicted = predict_document(doc, cfg.bucket_sizes)
    if check:
        doc, paths = _memreport_runs(cfg, strategies, out_dir, progress, on_strategy, shared)
        predicted = check_document(predicted, doc)
    else:
        doc.notes.append(
            f"captured {len(small.bucket_sizes)} sampled buckets of {len(cfg.bucket_sizes)}: the "
            "whole list's memory is predicted (--check captures every bucket and gives the error)"
        )
    doc.sampled_buckets, doc.prediction = list(small.bucket_sizes), predicted
    return doc, write_report(out_dir, doc)


def _memreport_runs(cfg, strategies, out_dir, progress, on_strategy, shared, what: str = "", traces: bool = False):
    from gmtool.memory.report import build_document, run_strategy, write_report

    rows, result, doc, paths = [], None, None, []
    try:
        for name in strategies:
            with progress(f"memreport {what}{name}") as p:
                row, res = run_strategy(cfg, name, p, shared, **({"record_traces": True} if traces else {}))
            rows.append(row)
            result = result or res
            if on_strategy:
                on_strategy(row)
            doc = build_document(cfg, rows, result)
            paths = write_report(out_dir, doc) if is_writer() else []  # under --tp: rank 0's figures
    except KeyboardInterrupt:
        if rows:
            doc.mark_partial("interrupted", len(strategies))
            write_report(out_dir, doc)
        kept = f"; what was measured is in {out_dir}" if rows else ""
        raise Interrupted(f"interrupted after {len(rows)} of {len(strategies)} strategies{kept}") from None
    return doc, paths
