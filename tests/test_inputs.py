"""Copy-in: what the staging arena holds for a key must not depend on what was loaded before it."""

import functools
import random

import pytest
import torch

from gmtool.core.buckets import BucketKey
from gmtool.core.inputs import PersistentInputs
from tests.helpers import Rig

# (composition, keys it fits): token counts, sequence counts and block-table widths that grow and shrink
MIXES = [
    ("1*5", "d8 t8 t16 t16xs8"),
    ("1*2", "d8 t8 t16 t16xs8"),
    ("1*8", "d8 t8 t16 t16xs8"),
    ("1*1@150", "d8 t8 t16 t16xs8"),
    ("1*3@20", "d8 t8 t16 t16xs8"),
    ("7+1@100", "t8 t16 t16xs8"),
    ("3+2", "t8 t16 t16xs8"),
    ("16", "t16"),
    ("5*2+1@40", "t16 t16xs8"),
    ("1", "d8 t8 t16 t16xs8"),
]


@functools.cache  # one object per key, as BucketPolicy hands out: copy-in trusts its last write by identity
def _key(text):
    decode, rest = text[0] == "d", text[1:]
    tokens, _, seqs = rest.partition("xs")
    return BucketKey(int(tokens), int(seqs) if seqs else None, decode)


def test_staging_written_in_place_equals_a_fresh_write(monkeypatch):
    pads = {"in place": 0, "full": 0}
    real_pad = PersistentInputs._pad

    def pad(tok, seq, cu, bt, now, before):
        pads["full" if before is None else "in place"] += 1
        real_pad(tok, seq, cu, bt, now, before)

    monkeypatch.setattr(PersistentInputs, "_pad", staticmethod(pad))
    rig = Rig(buckets=(8, 16), max_num_seqs=16)
    w = rig.cache.spec.blocks_per_seq
    make = lambda: PersistentInputs(16, 16, w, rig.lm.vocab_size, torch.float32, rig.ex.device)  # noqa: E731
    inputs = make()
    batches = [(rig.batch(text, seed=i), [_key(k) for k in keys.split()]) for i, (text, keys) in enumerate(MIXES)]
    rng = random.Random(0)
    for step in range(200):
        batch, keys = rng.choice(batches)
        # runs of the same key exercise the in-place padding; a key change forces the full one
        key = keys[0] if step % 7 else rng.choice(keys)
        inputs.load(batch, key)
        fresh = make()
        fresh.load(batch, key)
        s = inputs.seq_slots(key)
        end = 4 * key.num_tokens + 3 * s + 1 + s * w
        assert torch.equal(inputs.arena[:end], fresh.arena[:end]), (step, batch.composition.label, key)
    # both branches ran: the in-place one for most loads (a run of one key), the full one on key changes
    assert pads["in place"] > 50 and pads["full"] > 200


def test_output_view_is_made_once_per_key_and_size():
    rig = Rig()
    b = rig.batch("1*3")
    out = rig.ex.step(b)
    assert out.shape[0] == 3 and out is rig.ex.step(b)
    assert rig.ex.step(rig.batch("1*2")).shape[0] == 2


def test_a_load_that_fails_part_way_is_not_trusted_for_padding():
    """The next load of the key must pad in full: the failed one wrote tokens, then raised."""
    import copy

    import numpy as np

    rig = Rig(buckets=(8,), max_num_seqs=8)
    w = rig.cache.spec.blocks_per_seq
    make = lambda: PersistentInputs(8, 8, w, rig.lm.vocab_size, torch.float32, rig.ex.device)  # noqa: E731
    inputs, key = make(), BucketKey(8)
    small, big = rig.batch("1"), rig.batch("6", seed=1)
    inputs.load(small, key)
    bad = copy.copy(big)
    bad.block_table_array = np.zeros((1, w + 1), dtype=np.int64)  # wider than the arena's tables
    with pytest.raises(ValueError):  # after writing the tokens: the block tables do not fit
        inputs.load(bad, key)
    inputs.load(small, key)
    fresh = make()
    fresh.load(small, key)
    end = 4 * 8 + 3 * 8 + 1 + 8 * w
    assert torch.equal(inputs.arena[:end], fresh.arena[:end])


def test_a_load_that_fails_part_way_leaves_no_layout_to_replay():
    """A load that raised after writing some fields leaves the arena neither the old batch nor the new: no graph
    may replay over it (GraphExecutor's replay asks holds()) until a load succeeds."""
    import copy

    import numpy as np

    rig = Rig(buckets=(8,), max_num_seqs=8)
    w = rig.cache.spec.blocks_per_seq
    inputs, key = PersistentInputs(8, 8, w, rig.lm.vocab_size, torch.float32, rig.ex.device), BucketKey(8)
    small = rig.batch("1")
    inputs.load(small, key)
    assert inputs.holds(key) and inputs.holds(BucketKey(8)) and not inputs.holds(BucketKey(4))
    bad = copy.copy(rig.batch("6", seed=1))
    bad.block_table_array = np.zeros((1, w + 1), dtype=np.int64)  # wider than the arena's tables
    with pytest.raises(ValueError):
        inputs.load(bad, key)
    assert not inputs.holds(key)
    inputs.load(small, key)
    assert inputs.holds(key)
