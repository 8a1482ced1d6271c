"""gmtool capture: per token bucket, a captured graph checked against eager and timed."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from gmtool.app import run_capture
from gmtool.cli.output import Output, document_if_interrupted
from gmtool.cli.progress import progress_bars

from gmtool.cli import options as o
from gmtool.parallel import launch
from gmtool.parallel.launch import resolve_tp
from gmtool.cli.run_sweep import build_config, show_sweep
from gmtool.errors import GmtoolError
from gmtool.modes import CAPTURE_MODES, GraphMode
from gmtool.report.results import RESULTS_JSON, default_out_dir
from gmtool.report.tables import capture_table


def capture(
    model: o.ModelOpt = None,
    buckets: o.BucketsOpt = None,
    compositions: o.CompositionsOpt = None,
    scenario: o.ScenarioOpt = None,
    mode: Annotated[
        Optional[str],
        typer.Option(
            "--mode",
            help=" | ".join(CAPTURE_MODES) + " (full-narrow: num_tokens-only "
            "key, unsafe for prefill: shown to be detected)",
            show_default=o.shown_mode(),
        ),
    ] = None,
    piecewise_impl: o.PiecewiseImplOpt = None,
    attention: o.AttentionOpt = None,
    compile: o.CompileOpt = None,
    fuse: o.FuseOpt = None,
    small_m_gemm: o.SmallMGemmOpt = None,
    pdl: o.PdlOpt = None,
    device: o.DeviceOpt = None,
    dtype: o.DtypeOpt = None,
    max_kv_len: o.MaxKvLenOpt = None,
    max_tokens: o.MaxTokensOpt = None,
    max_num_seqs: o.MaxSeqsOpt = None,
    kv_cache_gb: o.KvCacheGbOpt = None,
    block_size: o.BlockSizeOpt = None,
    num_iters: o.ItersOpt = None,
    num_iters_warmup: o.WarmupOpt = None,
    seed: o.SeedOpt = None,
    tp: o.TpOpt = None,
    tp_timeout: o.TpTimeoutOpt = None,
    profile: o.ProfileOpt = None,
    out: Annotated[Optional[Path], o.out_dir_option("capture")] = None,
    force: o.ForceOpt = False,
    fmt: o.FormatOpt = o.OutputFormat.HUMAN,
) -> None:
    """Capture one graph per bucket, replay it with several batch compositions, compare each with eager."""
    out_ = Output(fmt)
    if mode is not None and "," in mode:
        raise GmtoolError(
            f"--mode {mode!r}: capture runs one graph mode; compare takes a list (gmtool compare eager,{mode})"
        )
    if mode is not None and mode not in CAPTURE_MODES:
        why = "captures nothing" if mode in tuple(GraphMode) else "is an unknown mode"
        raise GmtoolError(f"--mode {mode!r} {why}: choose from {', '.join(CAPTURE_MODES)} (compare runs eager)")
    cfg = build_config(
        profile,
        model=model,
        buckets=buckets,
        compositions=compositions,
        scenario=scenario,
        modes=("eager", mode) if mode else None,
        piecewise_impl=piecewise_impl,
        attention=attention,
        compile=compile,
        fuse=fuse,
        small_m_gemm=small_m_gemm,
        pdl=pdl,
        device=device,
        dtype=dtype,
        max_kv_len=max_kv_len,
        max_tokens=max_tokens,
        max_num_seqs=max_num_seqs,
        kv_cache_gb=kv_cache_gb,
        block_size=block_size,
        num_iters=num_iters,
        num_iters_warmup=num_iters_warmup,
        seed=seed,
        tp=resolve_tp(tp),
    )
    if not cfg.graph_modes:  # a profile's modes: --mode is checked above
        raise GmtoolError(
            f"the profile's modes ({', '.join(cfg.modes)}) capture nothing: give one of {', '.join(CAPTURE_MODES)} "
            "(--mode, or the profile's modes); compare runs eager alone"
        )
    for note in cfg.notes:
        out_.note(note)
    with (
        launch.out_dir_for(out or default_out_dir("capture"), force) as out_dir,
        document_if_interrupted(out_, out_dir / RESULTS_JSON),
    ):
        doc = launch.run(run_capture, cfg, out_dir, progress=progress_bars(out_.console), timeout=tp_timeout)
    wrote = f"results: {out_dir / 'results.json'}, {out_dir / 'results.csv'}"
    show_sweep(out_, doc, capture_table, wrote, shown=cfg.notes)
