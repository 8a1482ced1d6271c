"""gmtool compare: several modes side by side over the same buckets and batch compositions, in one process."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from gmtool.cli import options as o
from gmtool.parallel import launch
from gmtool.parallel.launch import resolve_tp
from gmtool.app import run_compare
from gmtool.cli.output import Output, document_if_interrupted
from gmtool.cli.progress import progress_bars
from gmtool.cli.report import BaselineOpt
from gmtool.cli.run_sweep import build_config, show_sweep
from gmtool.modes import GraphMode
from gmtool.errors import GmtoolError
from gmtool.core.buckets import parse_buckets
from gmtool.measure.hf_compiled import NEEDS_CUDA, PeerCompile
from gmtool.profiles import load_sweep_profile
from gmtool.report.baseline import check_same_model, load_baseline
from gmtool.report.results import RESULTS_JSON, default_out_dir
from gmtool.report.tables import compare_table
from gmtool.listopt import comma_items

VALID_MODES = tuple(GraphMode)


def parse_modes(text: str) -> list[str]:
    modes = list(dict.fromkeys(comma_items(text, "modes")))
    if not modes:
        raise GmtoolError(f"no mode given: choose from {', '.join(VALID_MODES)}")
    bad = [m for m in modes if m not in VALID_MODES]
    if bad:
        raise GmtoolError(f"unknown mode {bad[0]!r}: choose from {', '.join(VALID_MODES)}")
    return [GraphMode(m) for m in modes]


def _expected_model_name(spec: str) -> str:
    """The name load_model will give the model, known before loading it (to refuse a baseline early)."""
    return Path(spec).name if Path(spec).exists() else spec


DEFAULT_MODES = "eager,full,piecewise"  # compare's own default (a sweep profile's "modes" comes first)
ModesArg = Annotated[
    Optional[str], typer.Argument(help=f"Comma-separated modes: {', '.join(VALID_MODES)}.", show_default=DEFAULT_MODES)
]
OutOpt = Annotated[Optional[Path], o.out_dir_option("compare")]
TraceOpt = Annotated[
    bool,
    typer.Option(
        "--trace",
        help="Write trace-<mode>.json (torch.profiler, Chrome format) of a few replays of each mode's "
        "largest bucket, each replay in an NVTX range on CUDA.",
    ),
]


def _peer_buckets(text: str | None, sweep_buckets: list[int]) -> list[int] | None:
    if text is None:
        return None
    chosen = parse_buckets(text)
    missing = [b for b in chosen if b not in sweep_buckets]
    if missing:
        raise GmtoolError(f"--peer-buckets {missing[0]} is not among the sweep's buckets")
    return chosen


def compare(
    modes: ModesArg = None,
    model: o.ModelOpt = None,
    buckets: o.BucketsOpt = None,
    compositions: o.CompositionsOpt = None,
    scenario: o.ScenarioOpt = None,
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
    out: OutOpt = None,
    force: o.ForceOpt = False,
    fmt: o.FormatOpt = o.OutputFormat.HUMAN,
    trace: TraceOpt = False,
    baseline: BaselineOpt = None,
    peer_buckets: Annotated[
        Optional[str],
        typer.Option(
            "--peer-buckets",
            help="Buckets hf-compiled runs on (each compiles for ~40 s on an H200). "
            "Default: every bucket of the sweep.",
        ),
    ] = None,
    peer_compile: Annotated[
        Optional[PeerCompile],
        typer.Option(
            "--peer-compile",
            help="hf-compiled: 'shared' compiles once for all buckets (static, then one graph with "
            "the batch symbolic, as users get it); 'per-bucket' compiles each bucket for its own shape (its fastest "
            "kernels, ~40 s each on an H200).",
            show_default=PeerCompile.SHARED.value,
        ),
    ] = None,  # None: not given (refused without hf-compiled), then shared
) -> None:
    """Run every mode over every bucket and composition in one process; write results and reports."""
    prof = load_sweep_profile(profile) if profile else {}
    # a profile's empty "modes" is refused as an empty argument is, not replaced by the default
    wanted = parse_modes(modes if modes is not None else ",".join(prof["modes"]) if "modes" in prof else DEFAULT_MODES)
    out_ = Output(fmt)
    base = load_baseline(baseline) if baseline else None
    sweep_modes = tuple(m for m in wanted if m.in_sweep) or (GraphMode.EAGER,)  # the peer's reference is gmtool eager
    cfg = build_config(
        prof,
        model=model,
        buckets=buckets,
        compositions=compositions,
        scenario=scenario,
        modes=sweep_modes,
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
    peer_list = _peer_buckets(peer_buckets, cfg.bucket_sizes)
    peer_opts = [
        name
        for name, given in (("--peer-buckets", peer_buckets is not None), ("--peer-compile", peer_compile is not None))
        if given
    ]
    if peer_opts and GraphMode.HF_COMPILED not in wanted:  # they shape hf-compiled's run alone
        raise GmtoolError(f"{peer_opts[0]} applies to hf-compiled, which is not among the modes ({','.join(wanted)})")
    if base is not None:
        check_same_model(base, _expected_model_name(cfg.model), scenario=cfg.scenario)
    if GraphMode.HF_COMPILED in wanted and cfg.torch_device.type != "cuda":
        raise GmtoolError(NEEDS_CUDA.format(device=cfg.torch_device.type))
    for note in cfg.notes:
        out_.note(note)
    if cfg.tp > 1 and (GraphMode.HF_COMPILED in wanted or trace):
        raise GmtoolError(
            f"--tp runs gmtool's modes only: {'hf-compiled' if not trace else '--trace'} is single-device"
        )
    with (
        launch.out_dir_for(out or default_out_dir("compare"), force) as out_dir,
        document_if_interrupted(out_, out_dir / RESULTS_JSON),
    ):
        doc, files = launch.run(
            run_compare,
            cfg,
            wanted,
            out_dir,
            progress=progress_bars(out_.console),
            trace=trace,
            peer_buckets=peer_list,
            peer_compile=peer_compile or PeerCompile.SHARED,
            baseline=(base, baseline) if base is not None else None,
            timeout=tp_timeout,
        )

    show_sweep(out_, doc, compare_table, "wrote " + ", ".join(str(f) for f in files), shown=cfg.notes)
