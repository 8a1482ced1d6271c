"""Option aliases shared by every command, so names and help stay the same everywhere.

Every sweep option defaults to None, meaning "not given": build_config then takes the sweep profile's value, else
SweepConfig's default. --help shows that default, read from SweepConfig (show_default), so it is written once."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated, Optional

import typer

from gmtool.modes import GraphMode
from gmtool.core.buckets import DEFAULT_DECODE_BUCKETS, DEFAULT_PREFILL_BUCKETS
from gmtool.config import (
    CPU_DEFAULT_BUCKETS,
    CPU_DEFAULT_MODEL,
    GPU_DEFAULT_MODEL,
    AttentionChoice,
    PiecewiseImpl,
    Scenario,
    option_default,
)
from gmtool.parallel.launch import DEFAULT_TIMEOUT_S
from gmtool.profiles import model_profiles


def shown(name: str) -> str:
    """SweepConfig's default for an option, as --help shows it."""
    return str(option_default(name))


def shown_mode() -> str:
    """The graph mode capture and memreport run when neither --mode nor the profile names one."""
    return ",".join(m for m in option_default("modes") if GraphMode(m).captures)


BUCKET_SYNTAX = "Token buckets: '1,2,4,8', ranges 'start:stop:step' (stop included)."  # capture's and verify's


def _short(sizes: list[int]) -> str:
    if len(sizes) <= 5:
        return ",".join(map(str, sizes))
    # the count says what the ellipsis holds: the decode list is not powers of two (1, 2, 4, then 8..256 by 8)
    return f"{','.join(map(str, sizes[:5]))}..{sizes[-1]} ({len(sizes)} sizes)"


def flag(name: str, help: str):
    """An on/off option that is None unless given (--x or --no-x), so it never masks a profile."""
    opt = name.replace("_", "-")
    return typer.Option(f"--{opt}/--no-{opt}", help=help, show_default=opt if option_default(name) else f"no-{opt}")


ModelOpt = Annotated[
    Optional[str],
    typer.Option(
        "--model",
        "-m",
        help=f"Built-in profile ({', '.join(model_profiles())}), a local HF checkpoint directory, "
        f"or a config.json. Default: {GPU_DEFAULT_MODEL} on CUDA, {CPU_DEFAULT_MODEL} on the CPU backend.",
    ),
]
BucketsOpt = Annotated[
    Optional[str],
    typer.Option(
        "--buckets",
        "-b",
        help=f"{BUCKET_SYNTAX} "
        f"Default: the engines' decode list {_short(DEFAULT_DECODE_BUCKETS)} (prefill: {_short(DEFAULT_PREFILL_BUCKETS)}); "
        f"on the CPU backend {_short(CPU_DEFAULT_BUCKETS['decode'])} (prefill: {_short(CPU_DEFAULT_BUCKETS['prefill'])}).",
    ),
]
CompositionsOpt = Annotated[
    Optional[str],
    typer.Option(
        "--compositions",
        "-c",
        help="Batch compositions, e.g. '128=64+64,32*4,16*8,100+28@512': N*K is K requests of "
        "N new tokens, @P a cached prefix of P tokens, B= pins a bucket. Default: 3 or more per bucket.",
    ),
]
ScenarioOpt = Annotated[
    Optional[Scenario],
    typer.Option(
        "--scenario",
        "-s",
        help="What each step holds: decode tokens, prefill chunks, or both.",
        show_default=shown("scenario"),
    ),
]
DeviceOpt = Annotated[
    Optional[str],
    typer.Option(
        "--device",
        help="auto | cuda | cuda:N | cpu (the CPU backend, which records and replays the forward's operations in place of CUDA graphs)",
        show_default=shown("device"),
    ),
]
DtypeOpt = Annotated[
    Optional[str], typer.Option("--dtype", help="bf16 | fp16 | fp32 (default bf16 on CUDA, fp32 on CPU)")
]
MaxKvLenOpt = Annotated[
    Optional[int],
    typer.Option("--max-kv-len", help="Longest context a sequence may have (block tables are sized for it)."),
]
MaxTokensOpt = Annotated[
    Optional[int],
    typer.Option(
        "--max-tokens", help="Configured maximum bucket (persistent buffers' size). Default: the largest bucket."
    ),
]
MaxSeqsOpt = Annotated[
    Optional[int],
    typer.Option("--max-num-seqs", help="Most sequences in one step.", show_default=shown("max_num_seqs")),
]
KvCacheGbOpt = Annotated[
    Optional[float],
    typer.Option("--kv-cache-gb", help="KV cache memory budget in GiB (default: 40% of free GPU memory)."),
]
BlockSizeOpt = Annotated[
    Optional[int], typer.Option("--block-size", help="KV cache block size in tokens.", show_default=shown("block_size"))
]
ItersOpt = Annotated[
    Optional[int],
    typer.Option("--num-iters", help="Timed iterations per measurement.", show_default=shown("num_iters")),
]
WarmupOpt = Annotated[
    Optional[int],
    typer.Option(
        "--num-iters-warmup", help="Untimed iterations before timing.", show_default=shown("num_iters_warmup")
    ),
]
PiecewiseImplOpt = Annotated[
    Optional[PiecewiseImpl],
    typer.Option(
        "--piecewise-impl",
        help="breakable (end capture at each attention) | fx (torch.compile FX split)",
        show_default=shown("piecewise_impl"),
    ),
]
OutOpt = Annotated[Path, typer.Option("--out", "-o", help="Directory for results.json / results.csv and reports.")]


def out_dir_option(command: str):
    """--out for a command that names its own directory when none is given (report.results.default_out_dir)."""
    return typer.Option("--out", "-o", help=f"Output directory (default gmtool-out/{command}-<time>-<pid>).")


ForceOpt = Annotated[bool, typer.Option("--force", help="Write into an existing output directory.")]
SeedOpt = Annotated[
    Optional[int],
    typer.Option(
        "--seed", help="Seed for weights, token ids, contexts and block placement.", show_default=shown("seed")
    ),
]
ProfileOpt = Annotated[
    Optional[str],
    typer.Option(
        "--profile",
        "-p",
        help="A sweep profile from profiles/sweeps (or a path to a JSON file of option: value, names as in results.json's config): it sets what the command line leaves out; the defaults fill the rest.",
    ),
]
AttentionOpt = Annotated[
    Optional[AttentionChoice],
    typer.Option(
        "--attention",
        help="Attention kernels: auto (Triton on CUDA when available) | torch (reference) | triton",
        show_default=shown("attention"),
    ),
]
FuseOpt = Annotated[
    Optional[bool],
    flag(
        "fuse",
        help="Fuse the model's layers as engines do (one QKV and one gate/up GEMM; Triton RMSNorm, QK-norm+RoPE and SiLU-and-mul): fewer kernels per step. Eager and every graph mode run the fused model.",
    ),
]
SmallMGemmOpt = Annotated[
    Optional[bool],
    flag(
        "small_m_gemm",
        help="With --fuse: the projections of steps of up to 16 tokens (decode) on gmtool's small-M GEMM, a Triton kernel that streams the weights, instead of cuBLAS (not in what --compile hands to Inductor, which picks its own GEMMs).",
    ),
]
PdlOpt = Annotated[
    Optional[bool],
    flag(
        "pdl",
        help="With --small-m-gemm: launch the fused layers' Triton kernels with Programmatic Dependent Launch, each GEMM prefetching its weight into L2 while the kernel before it runs. Hopper or later, Triton 3.4+; elsewhere (CPU, interpreter, older GPUs) the kernels launch plainly and the run's notes say why.",
    ),
]
CompileOpt = Annotated[
    Optional[bool],
    flag(
        "compile",
        help="CUDA only. Compile the non-attention parts with Inductor before capture (piecewise: through the FX split); compile time is reported apart from capture time.",
    ),
]
TpOpt = Annotated[
    Optional[int],
    typer.Option(
        "--tp",
        help="Tensor-parallel ranks: gmtool starts N processes (one per GPU; gloo on the CPU), each holding 1/N of the heads and MLP width, with an all-reduce captured in the graphs; rank 0 writes every rank's rows. Under torchrun: its WORLD_SIZE.",
        show_default=shown("tp"),
    ),
]
TpTimeoutOpt = Annotated[
    Optional[float],
    typer.Option(
        "--tp-timeout",
        help="Seconds a rank waits for the others in a collective, and the others get to stop once one rank fails "
        "(a --tp or torchrun run only).",
        show_default=f"{DEFAULT_TIMEOUT_S:g}",
    ),
]


class OutputFormat(StrEnum):
    HUMAN = "human"  # tables, notes, progress, the verdict
    JSON = "json"  # the command's document on stdout, nothing else there (notes and progress go to stderr)
    QUIET = "quiet"  # errors (stderr) and the verdict line only


FormatOpt = Annotated[
    OutputFormat,
    typer.Option(
        "--format",
        "-f",
        help="human (tables) | json (the command's document on stdout, nothing else) | quiet "
        "(errors and the verdict line only)",
    ),
]
