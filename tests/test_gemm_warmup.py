"""cuBLAS warm-up during the model's build (gmtool.model.gemm_warmup): the GEMM shapes the captures will run,
each at every row count asked for, with stand-in weights; nothing starts off CUDA."""

import pytest
import torch

from gmtool.model import gemm_warmup
from gmtool.model.gemm_warmup import GemmShape

from .helpers import Rig


def test_the_shapes_are_every_projection_and_the_fused_ones():
    rig = Rig()
    model, cfg = rig.lm.model, rig.lm.model.config
    shapes = gemm_warmup.gemm_shapes_of(model)
    hidden, dim = cfg.hidden_size, cfg.head_dim
    q, kv, inter = cfg.num_attention_heads * dim, cfg.num_key_value_heads * dim, cfg.intermediate_size
    want = {
        GemmShape(q, hidden, False),
        GemmShape(kv, hidden, False),
        GemmShape(hidden, q, False),
        GemmShape(inter, hidden, False),
        GemmShape(hidden, inter, False),
        GemmShape(q + 2 * kv, hidden, False),  # --fuse's QKV
        GemmShape(2 * inter, hidden, False),  # --fuse's gate/up
    }
    assert shapes == want


def test_each_shape_runs_once_at_each_row_count(monkeypatch):
    rig = Rig()
    model = rig.lm.model
    seen = []
    linear = torch.nn.functional.linear

    def spy(x, w, b=None):
        seen.append((x.shape[0], *w.shape))
        return linear(x, w, b)

    monkeypatch.setattr(gemm_warmup.F, "linear", spy)
    made = []
    gemm_warmup.run_gemms(model, [1, 4], [1, 2], made)
    shapes = gemm_warmup.gemm_shapes_of(model)
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    assert sorted(seen) == sorted((m, s.out_features, s.in_features) for s in shapes for m in (1, 4))
    assert sorted(made) == sorted(seen + [(1, vocab, hidden), (2, vocab, hidden)])


def test_nothing_starts_off_cuda():
    rig = Rig()
    warm = gemm_warmup.start(rig.lm.model, [1, 2], [1])
    assert warm.thread is None and warm.made == []
    warm.join()  # nothing to wait for


def test_a_gemm_too_large_for_the_build_s_memory_is_left_to_the_capture(monkeypatch):
    rig = Rig()
    model = rig.lm.model
    made = []
    hidden = model.config.hidden_size
    monkeypatch.setattr(gemm_warmup, "MAX_BYTES", 4 * (hidden + model.config.vocab_size) * 4)  # fp32: 4 rows
    gemm_warmup.run_gemms(model, [1, 64], [4, 5], made)
    assert (5, model.config.vocab_size, hidden) not in made and (4, model.config.vocab_size, hidden) in made
    assert all(m * (n + k) * 4 <= gemm_warmup.MAX_BYTES for m, n, k in made)
    assert {m for m, n, _ in made if n != model.config.vocab_size} == {1}  # 64 rows: over the limit at every shape


def test_a_build_that_fails_after_the_load_waits_for_the_warm_up_first(monkeypatch):
    """The thread must not outlive a failed build: the caller may go on to capture while its GEMMs still run."""
    from gmtool.config import SweepConfig
    from gmtool.measure import workbench
    from gmtool.model import fused, loading

    joined = []

    class Warmup:
        def join(self):
            joined.append(True)

    def load(*a, **k):
        lm = loading.load_model(*a, **k)
        lm.gemm_warmup = Warmup()
        return lm

    def fail(*a, **k):
        raise RuntimeError("fuse failed")

    monkeypatch.setattr(workbench, "load_model", load)
    monkeypatch.setattr(fused, "fuse_layers", fail)
    cfg = SweepConfig(model="tiny-qwen3", device="cpu", dtype="fp32", buckets="4", max_kv_len=32, fuse=True)
    with pytest.raises(RuntimeError, match="fuse failed"):
        workbench.Workbench.build(cfg, num_blocks=16)
    assert joined == [True]
