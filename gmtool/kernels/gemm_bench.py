"""The small-M GEMM (gmtool.kernels.small_m) against cuBLAS (F.linear) at a model's projection shapes.

At small M a projection is a weight read, so the figure of merit is weight bytes per second. Each side is
timed as a CUDA graph of back-to-back calls, each call on its own copy of the weight, the copies together
larger than the H200's 50 MB L2: in a decode step every layer reads other weights, so a weight still in L2
from the call before would flatter both sides. `python -m gmtool.kernels.gemm_bench --model qwen3-0.6b`
prints the table; `--tune` also tries a small grid of block sizes per shape and prints the fastest, to
check pick's choice against.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics
from dataclasses import dataclass

import torch

L2_FLUSH_BYTES = 160 << 20  # weight copies per timing: at least this many bytes, well past an H200's L2


def projection_shapes(config: dict) -> dict[str, tuple[int, int, bool]]:
    """name -> (N, K, bias) of the fused layers' projections for an HF config dict (a model profile's
    "config"): fused QKV, o_proj, fused gate/up, down."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    dim = config.get("head_dim") or hidden // heads
    attn_bias = bool(config.get("attention_bias")) or config.get("model_type") == "qwen2"  # Qwen2: q/k/v bias
    return {
        "qkv": ((heads + 2 * kv_heads) * dim, hidden, attn_bias),
        "o_proj": (hidden, heads * dim, bool(config.get("attention_bias"))),
        "gate_up": (2 * inter, hidden, False),
        "down": (hidden, inter, False),
    }


@dataclass
class GemmTiming:
    name: str
    m: int
    n: int
    k: int
    ours_us: float
    cublas_us: float

    @property
    def weight_bytes(self) -> int:
        return 2 * self.n * self.k  # bf16

    @property
    def ours_tbps(self) -> float:
        return self.weight_bytes / self.ours_us / 1e6

    @property
    def cublas_tbps(self) -> float:
        return self.weight_bytes / self.cublas_us / 1e6


def graph_us_per_call(calls, reps: int = 20) -> float:
    """Median time of one call among `calls` (callables), captured back to back in one CUDA graph, warmed up
    on the capture stream first (gmtool's capture rule: cuBLAS allocates its workspace there, outside the
    graph's pool)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:
            c()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) * 1e3 / len(calls)


class _Case:
    """One shape's inputs at M rows, bf16: x, the bias, and enough weight copies to pass the L2."""

    def __init__(self, m: int, n: int, k: int, bias: bool):
        dev, dt = torch.device("cuda"), torch.bfloat16
        copies = max(2, min(64, -(-L2_FLUSH_BYTES // (2 * n * k))))
        self.ws = [torch.randn(n, k, device=dev, dtype=dt) * k**-0.5 for _ in range(copies)]
        self.b = torch.randn(n, device=dev, dtype=dt) if bias else None
        self.x = torch.randn(m, k, device=dev, dtype=dt)

    def ours_us(self, config=None) -> float:
        from gmtool.kernels.small_m import linear

        return graph_us_per_call([lambda w=w: linear(self.x, w, self.b, config) for w in self.ws])

    def cublas_us(self) -> float:
        return graph_us_per_call([lambda w=w: torch.nn.functional.linear(self.x, w, self.b) for w in self.ws])


def time_gemm(name: str, m: int, n: int, k: int, bias: bool = False) -> GemmTiming:
    """One shape at M rows: ours (pick's blocks) and F.linear."""
    case = _Case(m, n, k, bias)
    return GemmTiming(name, m, n, k, case.ours_us(), case.cublas_us())


def model_timings(model: str = "qwen3-0.6b", ms=(1, 8, 32)) -> list[GemmTiming]:
    from gmtool.profiles import load_model_profile

    shapes = projection_shapes(load_model_profile(model)["config"])
    return [time_gemm(name, m, n, k, bias) for m in ms for name, (n, k, bias) in shapes.items()]


def tune(m: int, n: int, k: int) -> tuple[float, object]:
    """The fastest of a small grid of block sizes at one shape: (us per call, Config)."""
    from triton.runtime.errors import OutOfResources

    from gmtool.kernels.small_m import Config

    case, best = _Case(m, n, k, False), None
    for bn, bk, split, stages in itertools.product((16, 32, 64), (128, 256, 512), (1, 2, 4, 8), (3, 4)):
        if split > 1 and -(-k // bk) < 2 * split:
            continue
        cfg = Config(16 if m <= 16 else 32, bn, bk, split, 4, stages)
        try:
            us = case.ours_us(cfg)
        except OutOfResources:  # more shared memory than an SM has
            continue
        best = (us, cfg) if best is None or us < best[0] else best
    return best


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--tune", action="store_true", help="also try a grid of block sizes per shape (minutes)")
    ap.add_argument("--m", default="1,8,32", help="token counts (rows of x), comma-separated")
    args = ap.parse_args(argv)
    from gmtool.kernels.small_m import pick
    from gmtool.kernels.common import num_sms

    print(f"{'shape':8} {'M':>3} {'N':>6} {'K':>6}  {'ours us':>8} {'TB/s':>5}  {'cuBLAS us':>9} {'TB/s':>5}  pick")
    for t in model_timings(args.model, tuple(int(m) for m in args.m.split(","))):
        cfg = pick(t.m, t.n, t.k, num_sms(torch.device("cuda")))
        print(
            f"{t.name:8} {t.m:3d} {t.n:6d} {t.k:6d}  {t.ours_us:8.2f} {t.ours_tbps:5.2f}  {t.cublas_us:9.2f} "
            f"{t.cublas_tbps:5.2f}  {dataclasses.astuple(cfg)}"
        )
        if args.tune:
            us, best = tune(t.m, t.n, t.k)
            print(f"{'':8} tuned {us:8.2f} us {t.weight_bytes / us / 1e6:5.2f} TB/s  {dataclasses.astuple(best)}")


if __name__ == "__main__":
    main()
