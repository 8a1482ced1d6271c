"""Workbenches the GPU tests share: qwen3-0.6b in bf16 with gmtool's Triton attention, eager and piecewise."""

import functools

from gmtool.config import SweepConfig
from gmtool.measure.workbench import Workbench
from gmtool.modes import GraphMode

MODEL = "qwen3-0.6b"


@functools.cache  # one workbench per configuration for the session: building the model is most of the time
def piecewise_bench(scenario: str, buckets: str, impl: str) -> Workbench:
    cfg = SweepConfig(
        model=MODEL,
        device="cuda",
        dtype="bf16",
        attention="triton",
        scenario=scenario,
        buckets=buckets,
        modes=(GraphMode.EAGER, GraphMode.PIECEWISE),
        max_kv_len=1024,
        piecewise_impl=impl,
    )
    return Workbench.build(cfg, num_blocks=4096)


@functools.cache
def small_m_pdl_bench(buckets: str) -> Workbench:
    """qwen3-0.6b --fuse --small-m-gemm --pdl, full graphs, kv up to 1,152: the decode of issue 17's goals."""
    cfg = SweepConfig(
        model=MODEL,
        device="cuda",
        dtype="bf16",
        fuse=True,
        small_m_gemm=True,
        pdl=True,
        buckets=buckets,
        modes=(GraphMode.EAGER, GraphMode.FULL),
        max_kv_len=1152,
    )
    return Workbench.build(cfg, num_blocks=4096)


def piecewise_rig(scenario: str, buckets: str, impl: str):
    """The shared workbench and a new piecewise executor on it (release it when done)."""
    bench = piecewise_bench(scenario, buckets, impl)
    return bench, bench.executor(GraphMode.PIECEWISE)
