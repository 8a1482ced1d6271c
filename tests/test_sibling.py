"""Each graph key is captured from a sibling of the first batch it checks (gmtool.core.batch.sibling_of): the
same key, other counts and contexts, its new tokens written only into blocks of its own."""

import pytest
import torch

from gmtool.core.batch import make_batch, sibling_of
from gmtool.core.compositions import parse_composition
from gmtool.core.kv_cache import KVCacheSpec, PagedKVCache, blocks_needed
from gmtool.errors import GmtoolError

SPEC = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, max_kv_len=64, dtype=torch.float32)


def _cache(seqs: int) -> PagedKVCache:
    return PagedKVCache(SPEC, blocks_needed(seqs, SPEC.blocks_per_seq), torch.device("cpu"))


def _batch(text, cache, keep=()):
    return make_batch(parse_composition(text, 3), cache, 100, 64, keep)


def test_a_decode_sibling_has_one_sequence_fewer_and_half_the_contexts():
    cache = _cache(8)
    b = _batch("1*8", cache)
    sib = _batch_of(sibling_of(b), cache, b)
    assert sib.num_seqs == 7 and sib.is_decode
    assert [kv - 1 for kv in sib.kv_lens] == [(kv - 1) // 2 for kv in b.kv_lens[:7]]
    same = _batch_of(sibling_of(b, fewer=False), cache, b)
    assert same.num_seqs == 8 and same.composition.label == "sibling of 1*8"


def test_a_prefill_sibling_keeps_its_sequences_and_evens_its_chunks_out():
    cache = _cache(4)
    b = _batch("12+4@20+1", cache)
    comp = sibling_of(b)
    assert [p.new_tokens for p in comp.parts] == [12 - 5 - 1, 4, 1 + 5]  # evened out by 5, one token fewer
    assert [p.prefix for p in comp.parts][:2] == [0, 10]
    assert [p.new_tokens for p in sibling_of(b, fewer=False).parts] == [7, 4, 6]
    alike = _batch("8*2", cache)  # all alike: two of them unevened, then one token fewer
    assert [p.new_tokens for p in sibling_of(alike).parts] == [7, 8]  # 7+9, then the longest one fewer
    assert sibling_of(_batch("1@0", cache), fewer=False) is None  # nothing can differ


def _batch_of(comp, cache, row):
    return make_batch(comp, cache, 100, 64, {b for t in row.block_tables for b in t})


def test_a_sibling_writes_no_block_of_the_batch_it_stands_beside():
    """Its contexts may read the batch's blocks (the cache is sized for one full batch and a block a sequence
    more), its new tokens never land there: the capture would change the context the batch's check reads."""
    cache = _cache(8)
    for seed in range(20):
        row = make_batch(parse_composition("1*8@63", seed), cache, 100, 64)  # every block of a full batch
        held = {b for t in row.block_tables for b in t}
        sib = _batch_of(sibling_of(row), cache, row)
        written = {int(s) // SPEC.block_size for s in sib.slot_mapping}
        assert written and not written & held
        assert all(len(set(t)) == len(t) for t in sib.block_tables)
        assert len({b for t in sib.block_tables for b in t}) == sum(map(len, sib.block_tables))  # distinct
    small = PagedKVCache(SPEC, 8 * SPEC.blocks_per_seq + 1, torch.device("cpu"))  # no room beside a full batch
    row = make_batch(parse_composition("1*8@63", 0), small, 100, 64)
    with pytest.raises(GmtoolError, match="another batch's, which it may not write"):
        _batch_of(sibling_of(row), small, row)
