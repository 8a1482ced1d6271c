"""What a tensor-parallel step's collectives cost alone: the all-reduces of one forward (two per decoder layer,
after o_proj and down_proj, each [num_tokens, hidden]) captured in one CUDA graph and replayed, per bucket.
Set against the step's replay time, it is the collective's share of the step. On the CPU they run eagerly."""

from __future__ import annotations

import statistics

import torch

from gmtool.measure.timing import time_ms
from gmtool.model import families
from gmtool.parallel import comm  # noqa: F401 (registers torch.ops.gmtool.all_reduce)


def all_reduce_ms(cfg, hidden: int, calls: int, iters: int = 20) -> dict[int, float]:
    """Median ms of `calls` all-reduces of [bucket, hidden] in cfg's dtype, per bucket of cfg; run on every rank
    (gmtool.parallel.launch.run), rank 0's figures come back."""
    device, out = cfg.torch_device, {}
    for bucket in cfg.bucket_sizes:
        x = torch.randn(bucket, hidden, dtype=cfg.torch_dtype, device=device)

        def step():
            for _ in range(calls):
                torch.ops.gmtool.all_reduce(x)

        graph = None
        if device.type == "cuda":
            step()  # NCCL sets up its channels on the first call, outside the capture
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
        out[bucket] = statistics.median(time_ms(graph.replay if graph else step, iters, 3, device))
        del graph  # before the group is destroyed (a live graph holding NCCL work hangs the teardown)
    return out


class CollectiveShare:
    """A sweep probe under --tp: the all-reduces of one step timed alone per bucket, set against the first graph
    mode's median replay on this rank; one note in the results."""

    def after_sweep(self, bench, executors, res) -> None:
        from gmtool.parallel.shard import RowParallelLinear

        calls = sum(isinstance(m, RowParallelLinear) for m in bench.lm.model.modules())
        ms = all_reduce_ms(bench.cfg, families.text_config(bench.lm.config).hidden_size, calls, bench.cfg.num_iters)
        mode = next(iter(executors), None)
        parts = []
        for bucket, t in ms.items():
            lat = [
                r.latency_ms.median
                for r in res.records
                if r.mode == mode and r.bucket == bucket and r.latency_ms is not None
            ]
            share = f" ({100 * t / statistics.median(lat):.0f}% of {mode}'s replay)" if lat else ""
            parts.append(f"{bucket}: {t:.3f} ms{share}")
        res.notes.append(
            f"--tp {bench.cfg.tp}: the {calls} all-reduces of a step, timed alone "
            f"({'in one CUDA graph' if bench.device.type == 'cuda' else 'eagerly'}), per bucket: " + ", ".join(parts)
        )
