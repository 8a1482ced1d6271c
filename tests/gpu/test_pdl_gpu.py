"""PDL on the GPU (gmtool.kernels.pdl): qwen3-0.6b's fused decode graph with the small-M GEMM, captured with the
kernels launched with Programmatic Dependent Launch (after-wait, as --pdl runs it, and early), against the same
graph launched plainly and against eager, at B=1 and B=32 (kv 1024). A kernel that read an earlier kernel's
output before its gdc_wait would race: its replays would differ from each other or from the plain graph, so
each graph is replayed many times and every replay must give the first one's logits exactly."""

import pytest
import torch

from gmtool.core.compositions import parse_composition
from gmtool.measure.timing import rel_err_per_seq, tolerances_for
from gmtool.modes import GraphMode

from tests.gpu.rigs import small_m_pdl_bench

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
REPLAYS = 30


@pytest.fixture(scope="module")
def bench():
    from gmtool.kernels import pdl

    why = pdl.problem(torch.device("cuda"))
    if why:
        pytest.skip(f"PDL cannot run here: {why}")
    wb = small_m_pdl_bench("1,32")
    assert wb.lm.fused.ops.pdl == pdl.Pdl.EARLY and "PDL" in wb.lm.fused.summary  # what --pdl runs
    return wb


def _eager(bench, batch):
    fn, logits = bench.eager_fn(batch)
    fn()
    return logits.clone()


@pytest.mark.parametrize("b, comp", [(1, "1*1@1023"), (32, "1*32@1023"), (32, "1*20@1023")])
def test_pdl_graph_equals_the_plain_graph_and_eager(bench, b, comp):
    from gmtool.kernels.pdl import Pdl

    ops = bench.lm.fused.ops
    batch = bench.batch(parse_composition(f"{b}={comp}", seed=b))
    tol_same, tol = tolerances_for(torch.bfloat16)
    graphs, eagers = {}, {}
    try:
        for mode in (Pdl.OFF, Pdl.AFTER_WAIT, Pdl.EARLY):
            ops.pdl = mode
            ex = bench.executor(GraphMode.FULL)
            try:
                first = ex.step(batch).clone()
                for i in range(REPLAYS):
                    assert torch.equal(ex.step(batch), first), f"pdl={mode.name}: replay {i} differs from the first"
                graphs[mode] = first
            finally:
                ex.release()
            eagers[mode] = _eager(bench, batch)  # eager with the same launches (PDL too, outside a graph)
    finally:
        ops.pdl = Pdl.EARLY
    for mode in graphs:
        # the same kernels on the same shapes: rounding noise at most; eager runs the batch unpadded
        assert rel_err_per_seq(graphs[mode], graphs[Pdl.OFF]) < tol_same, f"pdl={mode.name} against the plain graph"
        assert rel_err_per_seq(eagers[mode], eagers[Pdl.OFF]) < tol_same, f"pdl={mode.name} eager against plain"
        assert rel_err_per_seq(graphs[mode], eagers[Pdl.OFF]) < tol, f"pdl={mode.name} graph against eager"


def test_small_m_launches_with_pdl_only_when_asked(bench):
    """The small-M GEMM gets launch_pdl=True with pdl and no launch option without it (the plain launch as
    before), and computes the same product either way; tools/pdl_decode.py reads the captured graph's edges."""
    from gmtool.kernels import small_m

    seen = []
    real = small_m._small_m_kernel.run

    def spy(*args, **kw):
        seen.append(kw.get("launch_pdl"))
        return real(*args, **kw)

    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16) / 32
    small_m._small_m_kernel.run = spy
    try:
        y = small_m.linear(x, w, pdl=1)
        small_m.linear(x, w)
    finally:
        del small_m._small_m_kernel.run  # the class's method again
    torch.testing.assert_close(y.float(), x.float() @ w.float().t(), atol=2e-2, rtol=2e-2)
    assert seen == [True, None]
