"""GPU checks of the executor: capture/replay per bucket and composition against eager, in any order."""

import random

import pytest
import torch

from gmtool.core.buckets import BucketKey
from gmtool.core.compositions import default_compositions, parse_composition
from gmtool.config import SweepConfig
from gmtool.modes import GraphMode
from gmtool.measure.sweep import Sweep
from gmtool.measure.workbench import Workbench
from tests.helpers import graph_mode
from gmtool.measure.timing import rel_err_per_seq, tolerances_for

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEV = torch.device("cuda")


class GpuRig:
    """The CPU Rig's twin: torch reference attention in eager and graphs alike, bf16, a fixed KV cache."""

    def __init__(self, model, buckets, mode="full", wide_key=False, max_kv_len=1024, piecewise_impl="breakable"):
        mode = graph_mode(mode, wide_key)
        cfg = SweepConfig(
            model=model,
            device="cuda",
            dtype="bf16",
            attention="torch",
            buckets=",".join(map(str, buckets)),
            modes=(GraphMode.EAGER, mode),
            max_kv_len=max_kv_len,
            piecewise_impl=piecewise_impl,
        )
        self.bench = Workbench.build(cfg, num_blocks=4096)
        self.lm, self.cache = self.bench.lm, self.bench.cache
        self.ex = self.bench.executor(mode)

    def batch(self, comp):
        return self.bench.batch(comp)

    def eager(self, b):
        fn, logits = self.bench.eager_fn(b)
        fn()
        return logits.clone()


def test_decode_full_graphs_match_eager_in_any_order():
    buckets = [1, 2, 4, 8, 16, 32]
    rig = GpuRig("qwen3-0.6b", buckets)
    tol_same, tol = tolerances_for(torch.bfloat16)
    work, below = [], 0
    for b in buckets:
        work += [rig.batch(c) for c in default_compositions(b, "decode", below)]
        below = b
    for b in sorted(work, key=lambda b: -b.num_tokens):  # capture largest first
        assert rel_err_per_seq(rig.ex.step(b), rig.eager(b)) < tol
    assert len(rig.ex.graphs) == len(buckets)
    random.Random(0).shuffle(work)
    for b in work + work[::-1]:
        out = rig.ex.step(b).clone()
        err = rel_err_per_seq(out, rig.eager(b))
        assert err < tol, (b.composition.label, err)
        # replay and the same computation run eagerly: identical kernels, so only rounding noise
        assert rel_err_per_seq(out, rig.ex.eager_same_shape(b)) < tol_same, b.composition.label
    rig.ex.release()


def test_piecewise_prefill_matches_eager_and_narrow_full_is_flagged():
    comps = [parse_composition(t, i) for i, t in enumerate(["64+64", "32*4", "16*8", "100+28@512"])]
    pw = GpuRig("qwen3-0.6b", [128], mode="piecewise")
    narrow = GpuRig("qwen3-0.6b", [128], mode="full")
    tol_same, tol = tolerances_for(torch.bfloat16)
    for i, c in enumerate(comps):
        b = pw.batch(c)
        assert rel_err_per_seq(pw.ex.step(b), pw.eager(b)) < tol, c.label
        nb = narrow.batch(c)
        err = rel_err_per_seq(narrow.ex.step(nb), narrow.eager(nb))
        entry = narrow.ex.graphs[narrow.ex.key_for(nb)]
        if i == 0:
            assert err < tol and not entry.stale_metadata(nb)
        else:
            assert entry.stale_metadata(nb) and err > tol, (c.label, err)
    assert pw.ex.graphs[BucketKey(128)].pieces == pw.lm.num_layers + 1
    pw.ex.release()
    narrow.ex.release()


def test_sweep_end_to_end_small():
    cfg = SweepConfig(
        model="tiny-qwen3",
        device="cuda",
        buckets="1,2,4,8",
        modes=("eager", "full", "piecewise"),
        num_iters=5,
        num_iters_warmup=2,
    )
    res = Sweep(cfg).run()
    rows = [r.to_dict() for r in res.records if r.mode != "eager"]
    assert rows and all(r["status"] == "ok" for r in rows), [r["error"] for r in rows if r["status"] != "ok"]
    assert all(r["latency_ms"]["median"] > 0 for r in rows)
    assert all(r["graph_mem_bytes"] is not None for r in rows if r["capture_s"] is not None)


def test_fx_piecewise_matches_eager_for_prefill_mixes():
    comps = [parse_composition(t, i) for i, t in enumerate(["64+64", "32*4", "16*8", "100+28@512"])]
    rig = GpuRig("qwen3-0.6b", [128], mode="piecewise", piecewise_impl="fx")
    fx = rig.ex.forward_impl.active.fx
    tol_same, tol = tolerances_for(torch.bfloat16)
    for c in comps:
        b = rig.batch(c)
        out = rig.ex.step(b).clone()
        assert rel_err_per_seq(out, rig.eager(b)) < tol, c.label
        assert rel_err_per_seq(out, rig.ex.eager_same_shape(b)) < tol_same, c.label
    entry = rig.ex.graphs[BucketKey(128)]
    assert entry.piecewise_impl == "fx" and (entry.pieces, entry.runners) == (30, 28)  # 29 pieces + the LM head
    assert fx.splits == [(29, 28)]
    rig.ex.release()


def test_fused_layers_match_hf_layers_and_replay():
    """--fuse on the GPU: the fused Triton layers against the Hugging Face layers (decode and prefill with a
    prefix), then a sweep whose every graph mode runs the fused model."""
    from gmtool.model.fused import fuse_layers, unfused

    rig = GpuRig("qwen3-0.6b", [128])  # the reference inputs must hold the 128-token prefill
    fused = fuse_layers(rig.lm.model, "triton", rope_positions=1024)  # RoPE from a table, checked bit for bit
    assert fused.counts == {"attention": 28, "mlp": 28, "rmsnorm": 57, "residual_adds": 56, "rope_positions": 1024}
    for text in ("1*32", "100+28@300"):
        b = rig.batch(parse_composition(text))
        out = rig.eager(b)
        with unfused(fused):
            ref = rig.eager(b)
        err = rel_err_per_seq(out, ref)
        assert err < tolerances_for(torch.bfloat16)[1], f"{text}: fused vs HF layers {err:.3g}"
    cfg = SweepConfig(
        model="qwen3-0.6b",
        device="cuda",
        buckets="1,8,32",
        modes=("eager", "full", "piecewise"),
        fuse=True,
        kv_cache_gb=4,
        num_iters=3,
        num_iters_warmup=1,
    )
    res = Sweep(cfg).run()
    rows = [r.to_dict() for r in res.records if r.mode != "eager"]
    assert len(rows) >= 18 and all(r["status"] == "ok" for r in rows), [r["error"] for r in rows if r["error"]]
    # the run's own check of the fused layers against the model's (gmtool.measure.fused_check), in bf16
    assert not res.errors and any("--fuse against the model's own layers" in n for n in res.notes), res.errors


def test_a_whole_graph_uploads_without_running_and_then_replays():
    """The capture's upload (the ledger's memory outside the pool) runs no kernel: cuGraphUpload, not a replay;
    the first replay after it runs the graph once."""
    from gmtool.core.backends.cuda import CudaGraphBackend

    backend = CudaGraphBackend(DEV)
    x = torch.zeros(4, device=DEV)
    backend.warmup(lambda: x.add_(1))
    backend.begin()
    x.add_(1)
    graph = backend.end()
    torch.cuda.synchronize()
    before = x.clone()
    assert graph.upload()
    torch.cuda.synchronize()
    assert torch.equal(x, before)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(x, before + 1)
    backend.release()
