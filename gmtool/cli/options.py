"""Option aliases shared by every command, so names and help stay the same everywhere."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from gmtool.profiles import model_profiles

ModelOpt = Annotated[Optional[str], typer.Option(
    "--model", "-m", help=f"Built-in profile ({', '.join(model_profiles())}), a local HF checkpoint directory, "
    "or a config.json. Default: qwen3-0.6b on CUDA, tiny-qwen3 on the CPU backend.")]
BucketsOpt = Annotated[Optional[str], typer.Option(
    "--buckets", "-b", help="Token buckets: '1,2,4,8', ranges 'start:stop:step' (stop included). "
    "Default: the engines' decode list 1,2,4,8..256 (prefill: 128,512,2048).")]
CompositionsOpt = Annotated[Optional[str], typer.Option(
    "--compositions", "-c", help="Batch mixes, e.g. '128=64+64,32*4,16*8,100+28@512': N*K is K requests of N "
    "new tokens, @P a cached prefix of P tokens, B= pins a bucket. Default: 3+ mixes per bucket.")]
ScenarioOpt = Annotated[str, typer.Option("--scenario", "-s", help="decode | prefill | mixed")]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto | cuda | cuda:N | cpu (the CPU tape backend)")]
DtypeOpt = Annotated[Optional[str], typer.Option("--dtype", help="bf16 | fp16 | fp32 (default bf16 on CUDA, fp32 on CPU)")]
MaxKvLenOpt = Annotated[Optional[int], typer.Option("--max-kv-len", help="Longest context a sequence may have (block tables are sized for it).")]
MaxTokensOpt = Annotated[Optional[int], typer.Option("--max-tokens", help="Configured maximum bucket (persistent buffers' size). Default: the largest bucket.")]
MaxSeqsOpt = Annotated[int, typer.Option("--max-num-seqs", help="Most sequences in one step.")]
KvCacheGbOpt = Annotated[Optional[float], typer.Option("--kv-cache-gb", help="KV cache memory budget in GiB (default: 40% of free GPU memory).")]
BlockSizeOpt = Annotated[int, typer.Option("--block-size", help="KV cache block size in tokens.")]
ItersOpt = Annotated[int, typer.Option("--num-iters", help="Timed iterations per measurement.")]
WarmupOpt = Annotated[int, typer.Option("--num-iters-warmup", help="Untimed iterations before timing.")]
PiecewiseImplOpt = Annotated[str, typer.Option("--piecewise-impl", help="breakable (end capture at each attention) | fx (torch.compile FX split)")]
OutOpt = Annotated[Path, typer.Option("--out", "-o", help="Directory for results.json / results.csv and reports.")]
ForceOpt = Annotated[bool, typer.Option("--force", help="Write into an existing output directory.")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed for weights, token ids, contexts and block placement.")]
ProfileOpt = Annotated[Optional[str], typer.Option("--profile", "-p", help="A sweep profile from profiles/sweeps (or a path to one); explicit options win.")]
AttentionOpt = Annotated[str, typer.Option("--attention", help="Attention kernels: auto (Triton on CUDA when available) | torch (reference) | triton")]
FuseOpt = Annotated[bool, typer.Option("--fuse", help="Fuse the model's layers as engines do (one QKV and one gate/up GEMM; Triton RMSNorm, QK-norm+RoPE and SiLU-and-mul): fewer kernels per step. Eager and every graph mode run the fused model.")]
CompileOpt = Annotated[bool, typer.Option("--compile", help="Compile the non-attention parts with Inductor before capture (piecewise: through the FX split); compile time is reported apart from capture time.")]
