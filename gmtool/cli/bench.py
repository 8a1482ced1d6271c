"""gmtool bench: the peer and every gmtool mode on the same model and work, in one process (GPU only)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gmtool.config import MAX_ITERS
from gmtool.errors import GmtoolError
from gmtool.measure.bench import STAGES, main, unknown_stages


def bench(
    stages: Annotated[str, typer.Option("--stages", help=f"Comma list of {', '.join(STAGES)}.")] = ",".join(STAGES),
    iters: Annotated[int, typer.Option("--iters", help="Timed iterations per measurement.")] = 50,
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory for bench-<stage>.json.")] = Path(
        "gmtool-out/bench"
    ),
) -> None:
    """Benchmark stages on qwen3-0.6b: attention bandwidth, decode against hf-compiled, prefill, capture time and
    host time per replay. Reports figures; asserts nothing."""
    import torch

    if not 1 <= iters <= MAX_ITERS:
        raise GmtoolError(f"--iters must be between 1 and {MAX_ITERS:,}, got {iters}")
    unknown = unknown_stages(stages)
    if unknown:
        raise GmtoolError(f"unknown stage {unknown[0]!r}: choose from {', '.join(STAGES)}")
    if not torch.cuda.is_available():  # refused here, so it is one line on stderr as every other bad input
        raise GmtoolError("gmtool bench needs CUDA (run it on the GPU machine)")
    code = main(["--stages", stages, "--iters", str(iters), "--out", str(out)])
    if code:
        raise typer.Exit(code)
