"""cuBLAS warm-up on the GPU (gmtool.model.gemm_warmup): a CUDA workbench's build ran every projection shape at
every bucket and the LM head at every logits row count in its thread, without error, and joined it before
sizing the KV cache; the captures after it replay as eager computes."""

import pytest
import torch

from gmtool.config import SweepConfig
from gmtool.core.compositions import parse_composition
from gmtool.measure.timing import rel_err_per_seq, tolerances_for
from gmtool.measure.workbench import Workbench
from gmtool.model.gemm_warmup import gemm_shapes_of
from gmtool.modes import GraphMode

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_the_build_warms_every_shape_and_bucket_and_the_graphs_stay_exact():
    cfg = SweepConfig(
        model="qwen3-0.6b", device="cuda", buckets="1,2,4,8,16", modes=("full",), max_kv_len=256, fuse=True
    )
    bench = Workbench.build(cfg, num_blocks=512)
    lm = bench.lm
    warm = lm.gemm_warmup
    assert warm is not None and warm.thread is None and warm.error is None, warm and warm.error
    mc = lm.model.config
    shapes = gemm_shapes_of(lm.model)
    want = {(m, s.out_features, s.in_features) for s in shapes for m in (1, 2, 4, 8, 16)}
    want |= {(m, mc.vocab_size, mc.hidden_size) for m in (1, 2, 4, 8, 16)}
    assert set(warm.made) == want and len(warm.made) == len(want)
    ex = bench.executor(GraphMode.FULL)
    for text in ("1*1", "1*5", "1*16"):
        b = bench.batch(parse_composition(text, seed=3))
        out = ex.step(b).clone()
        fn, logits = bench.eager_fn(b)
        fn()
        assert rel_err_per_seq(out, logits) < tolerances_for(torch.bfloat16)[1], text
    ex.release()
