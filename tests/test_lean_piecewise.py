"""Lean piecewise runners on the CPU tape: a step's metadata prepared once for all its runners, runners that
borrow shared buffers instead of holding the pieces' tensors, and the pieces of a bucket needing no more pool
than one full graph (the tape's live-tensor accounting)."""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch

from gmtool.core.backends.cpu import CpuTapeBackend, TapeGraph, pool_bytes
from gmtool.core.executor import AttentionRunner
from gmtool.profiles import PROFILES_DIR
from tests.helpers import Rig, rel


@pytest.fixture(scope="module")
def rigs():
    return {
        "piecewise": Rig(mode="piecewise", buckets=(16, 64)),
        "full": Rig(mode="full", wide_key=True, buckets=(16, 64)),
    }


def test_metadata_is_prepared_once_per_step_for_all_runners(rigs):
    rig = rigs["piecewise"]
    a, b = rig.batch("20+12@40", seed=1), rig.batch("8*4", seed=2)
    rig.graph(a)
    entry = rig.ex.graphs[rig.ex.key_for(b)]
    assert entry.runners == rig.lm.num_layers >= 2
    calls = []
    real = entry.ctx.backend.plan_signature
    entry.ctx.backend = type("Counting", (), {})()  # same methods, counted plan signatures
    for name in ("write_kv", "decode", "masked", "planned", "step_grid", "bind"):
        setattr(entry.ctx.backend, name, getattr(rig.ex.attention, name))
    entry.ctx.backend.plan_signature = lambda plan: calls.append(plan) or real(plan)
    before = entry.ctx.prepares
    for _ in range(3):
        out = rig.graph(b)
    assert entry.ctx.prepares - before == 3  # one per step, not one per runner
    assert calls == [b.plan] * 3
    assert rel(out, rig.eager(b)) < 1e-5  # and the runners attended with this step's plan
    assert len(entry.ctx.planned_with) == entry.runners  # what one step consumed, not every step's


def test_runners_borrow_the_shared_buffers(rigs):
    """No runner holds a tensor a piece made: q and the output are the executor's shared buffers, and the
    step's K/V is written inside the piece (one launch per runner)."""
    rig = rigs["piecewise"]
    b = rig.batch("30+10", seed=3)
    rig.graph(b)
    entry = rig.ex.graphs[rig.ex.key_for(b)]
    runners = [s for s in entry.steps if isinstance(s, AttentionRunner)]
    assert len(runners) == rig.lm.num_layers
    shared = {rig.ex.attn_q.untyped_storage().data_ptr(), rig.ex.attn_out.untyped_storage().data_ptr()}
    for r in runners:
        assert {r.q.untyped_storage().data_ptr(), r.out.untyped_storage().data_ptr()} == shared
        assert not hasattr(r, "k") and not hasattr(r, "v")
    # the runners pin nothing of the pool (the old runners held every layer's q/k/v there)
    assert pool_bytes(entry.steps) == pool_bytes([s for s in entry.steps if isinstance(s, TapeGraph)])
    # the pieces' q/k/v died with the capture: the tapes no longer write them back
    alive = [ref() for s in entry.steps if isinstance(s, TapeGraph) for _, ref in s.escaped]
    assert sum(t is not None for t in alive) <= 2 * (rig.lm.num_layers + 1)  # hidden + residual, at most


@pytest.mark.parametrize("text", ["64", "40+24@16", "8*8"])
def test_piecewise_pool_within_1_1x_of_full(rigs, text):
    """The pieces of one bucket reuse each other's memory as one graph does: their pool (the tapes' live
    tensors, replayed in order) is within 1.1x of the full graph's for the same bucket."""
    got = {}
    for mode, rig in rigs.items():
        b = rig.batch(text, seed=4)
        assert rel(rig.graph(b), rig.eager(b)) < 1e-5
        got[mode] = pool_bytes(rig.ex.graphs[rig.ex.key_for(b)].steps)
    assert got["full"] > 0
    assert got["piecewise"] <= 1.1 * got["full"], got


def test_a_runner_holding_a_piece_tensor_pins_it():
    """The accounting sees what the old runners did: a tensor a piece made and a runner holds cannot be reused
    by later pieces, so it adds to the pool."""
    be = CpuTapeBackend()
    x, out = torch.ones(1 << 16), torch.zeros(1 << 16)
    be.begin()
    held = x * 2  # handed to the runner
    g1 = be.end()
    be.begin()
    out.copy_((x * 3) * 4)
    g2 = be.end()

    class Runner:
        def __init__(self, t):
            self.t = t

    lean = pool_bytes([g1, g2])
    assert lean == max(g1.peak_bytes, g2.peak_bytes) == 2 * x.nbytes
    assert pool_bytes([g1, Runner(held), g2]) == lean + held.nbytes
    assert pool_bytes([g1, Runner(out), g2]) == lean  # a buffer from outside the tapes is not the pool's


def test_live_bytes_count_a_chain_once_and_views_not_at_all():
    be = CpuTapeBackend()
    x, out = torch.ones(1 << 16), torch.zeros(1 << 16)
    be.begin()
    y = x
    for _ in range(20):
        y = (y * 1.01).view(-1)  # the view shares its storage: counted once
    out.copy_(y[: 1 << 16])
    del y
    g = be.end()
    assert g.peak_bytes == 2 * x.nbytes  # an op's input and its output, never the whole chain
    assert g.exports == {}


def test_a_handed_on_tensor_is_written_while_held_and_freed_after():
    be = CpuTapeBackend()
    x = torch.arange(4.0)
    be.begin()
    kept = x + 1
    g = be.end()
    assert list(g.exports.values()) == [kept.untyped_storage().nbytes()]
    ref = weakref.ref(kept)
    x.fill_(5.0)
    g.replay()
    assert kept.tolist() == [6.0] * 4
    del kept
    gc.collect()
    assert ref() is None  # the tape does not keep it alive
    g.replay()  # and replays without it


def test_bench_lean_stage_on_the_cpu_tape():
    """gmtool bench's lean stage, on tiny-qwen3: memory from the tape's accounting, host time per runner."""
    from gmtool.measure.bench import piecewise_vs_full

    x = piecewise_vs_full("tiny-qwen3", 32, iters=5, device="cpu")
    full, pw = x["full"], x["piecewise"]
    assert (full["runners"], pw["runners"]) == (0, 2) and pw["pieces"] == 3
    assert 0 < x["mem_ratio"] <= 1.1
    assert pw["runner_us"] > 0 and full["runner_us"] is None
    assert pw["launch_paths"] == []  # the torch reference binds no Triton launch
    assert pw["launch_path"] == "python: TapeGraph steps have no native launch" and pw["host_steady_python_us"] > 0
    assert x["host_extra_us_per_runner"] == pytest.approx((pw["host_steady_us"] - full["host_steady_us"]) / 2)


@pytest.mark.parametrize("impl", ["breakable", "fx"])
def test_the_lm_head_ends_the_last_graph_writing_the_persistent_logits(impl, tmp_path):
    """A num_tokens key pads the logits rows to every sequence the bucket could hold: as a temporary in a piece,
    those logits were most of the pieces' memory on the H200 (35 of 38.5 MiB at 128 tokens). The LM head ends
    the last graph and writes straight into the persistent logits rows: the pieces' pool does not depend on
    max_num_seqs, a step is graphs and runners only (one stitched launch on CUDA), and a later step with more
    sequences than the capture's gets all its rows."""
    config = json.loads((PROFILES_DIR / "models" / "tiny-qwen3.json").read_text())["config"]
    path = tmp_path / "config.json"  # a vocabulary as large against the model as a real one's: logits dominate
    path.write_text(json.dumps(config | {"vocab_size": 16384}))
    pools = {}
    for max_seqs in (4, 32):
        rig = Rig(str(path), mode="piecewise", buckets=(32,), max_num_seqs=max_seqs, piecewise_impl=impl)
        a, b = rig.batch("30+2", seed=5), rig.batch("8*4", seed=6)
        assert rel(rig.graph(a), rig.eager(a)) < 1e-5
        entry = rig.ex.graphs[rig.ex.key_for(a)]
        assert isinstance(entry.steps[-1], TapeGraph)
        assert entry.pieces == rig.lm.num_layers + 1 + (impl == "fx")  # fx: the head is a graph of its own
        assert rel(rig.graph(b), rig.eager(b)) < 1e-5  # captured with 2 sequences, replayed with 4
        pools[max_seqs] = pool_bytes(entry.steps)
    assert pools[4] == pools[32], pools


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-gemma2"])  # tiny-gemma2 soft-caps its logits
def test_logits_into_writes_in_place_else_through_a_copy(model, monkeypatch):
    """A bias-free linear head of out's dtype and shape multiplies into out itself and applies the family's
    logit rule there: no temporary of the logits' size (logits_of is never called). Any other head (a bias
    here) is computed and copied, with the same values; logits of another width raise instead of resizing
    the persistent view."""
    rig = Rig(model, mode="piecewise", buckets=(16,))
    lm, head = rig.lm, rig.lm.model.get_output_embeddings()
    real = lm.logits_of
    with torch.no_grad():
        hidden = torch.randn(3, lm.head_in_features, dtype=head.weight.dtype)
        expect = real(hidden)
        out = torch.zeros(3, lm.vocab_size, dtype=head.weight.dtype)
        monkeypatch.setattr(lm, "logits_of", lambda h: pytest.fail("a temporary of the logits' size"))
        lm.logits_into(hidden, out)
        assert rel(out, expect) < 1e-6
        if model == "tiny-gemma2":
            assert out.abs().max() <= lm.config.final_logit_softcapping  # the soft-cap was applied
        monkeypatch.setattr(lm, "logits_of", real)
        head.bias = torch.nn.Parameter(torch.randn(lm.vocab_size, dtype=head.weight.dtype))
        try:
            lm.logits_into(hidden, out)
            assert rel(out, real(hidden)) < 1e-6 and not torch.equal(out, expect)
        finally:
            head.bias = None
        narrow = torch.zeros(3, lm.vocab_size - 1, dtype=head.weight.dtype)
        with pytest.raises(RuntimeError):
            lm.logits_into(hidden, narrow)
        assert narrow.shape == (3, lm.vocab_size - 1)
