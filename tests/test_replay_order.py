"""Replays in any order on the CPU tape backend: the CPU twin of tests/gpu/test_core_gpu.py's shuffled test.

Every bucket is captured first (largest first, as the sweep does); then every composition is replayed in a
shuffled order and in its reverse, so each graph runs right after graphs of other shapes and batches, and each
replay is compared with eager on the same batch. The output buffer is poisoned with NaN before each replay:
only what the replay itself writes can pass."""

import random

import pytest

from gmtool.core.batch import make_batch
from gmtool.core.compositions import default_compositions
from tests.helpers import Rig, rel

BUCKETS = (1, 2, 4, 8)


def decode_work(rig):
    work, below = [], 0
    for b in BUCKETS:
        work += [
            make_batch(c, rig.cache, rig.lm.vocab_size, rig.max_num_seqs)
            for c in default_compositions(b, "decode", below)
        ]
        below = b
    return work


@pytest.mark.parametrize("mode", ["full", "piecewise"])
def test_replays_in_shuffled_and_reversed_order_match_eager(mode):
    rig = Rig(buckets=BUCKETS, mode=mode)
    work = decode_work(rig)
    assert len(work) == 3 * len(BUCKETS)
    for first in work[::3][::-1]:  # capture each bucket with its first mix, largest first
        assert rel(rig.graph(first), rig.eager(first)) < 1e-5, first.composition.label
    assert sorted(k.num_tokens for k in rig.ex.graphs) == list(BUCKETS)
    graphs = dict(rig.ex.graphs)

    order = list(work)
    random.Random(0).shuffle(order)
    assert [b.num_tokens for b in order] != sorted(b.num_tokens for b in order)  # shapes interleave
    for i, b in enumerate(order + order[::-1]):
        key = rig.ex.key_for(b)
        rig.ex.inputs.views(key).logits.fill_(float("nan"))
        out = rig.graph(b)
        assert not out.isnan().any(), (i, b.composition.label)
        err = rel(out, rig.eager(b))
        assert err < 1e-5, (i, b.composition.label, err)
        # the replay against its own computation run eagerly (same padded shape, this batch's metadata)
        assert rel(out, rig.ex.eager_same_shape(b).clone()) < 1e-5, (i, b.composition.label)
    # every replay hit a graph captured before: nothing was captured again
    assert rig.ex.graphs.keys() == graphs.keys() and all(rig.ex.graphs[k] is g for k, g in graphs.items())
