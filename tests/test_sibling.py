"""Each graph key is captured from a sibling of the first batch it checks (gmtool.core.batch.sibling_of): the
same key, other counts and contexts, its new tokens written only into blocks of its own."""

import pytest
import torch

from gmtool.core.batch import make_batch, sibling_of
from gmtool.core.compositions import parse_composition
from gmtool.core.kv_cache import KVCacheSpec, PagedKVCache, blocks_needed
from gmtool.errors import GmtoolError

SPEC = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, max_kv_len=64, dtype=torch.float32)


def _cache(seqs: int, tokens: int | None = None) -> PagedKVCache:
    blocks = blocks_needed(seqs, SPEC.blocks_per_seq, seqs if tokens is None else tokens, SPEC.block_size)
    return PagedKVCache(SPEC, blocks, torch.device("cpu"))


def _batch(text, cache, keep=()):
    return make_batch(parse_composition(text, 3), cache, 100, 64, keep)


def test_a_decode_sibling_has_one_sequence_fewer_and_half_the_contexts():
    cache = _cache(8)
    b = _batch("1*8", cache)
    sib = _batch_of(sibling_of(b), cache, b)
    assert sib.num_seqs == 7 and sib.is_decode
    assert [kv - 1 for kv in sib.kv_lens] == [(kv - 1) // 2 for kv in b.kv_lens[:7]]
    same = _batch_of(sibling_of(b, fewer=False), cache, b)
    assert same.num_seqs == 8 and same.composition.label.endswith("(sibling of 1*8)")
    assert sibling_of(b).label.startswith("7 sequences, 7 tokens, contexts ")


def test_a_prefill_sibling_keeps_its_sequences_and_evens_its_chunks_out():
    cache = _cache(4, 64)
    b = _batch("12+4@20+1", cache)
    comp = sibling_of(b)
    assert [p.new_tokens for p in comp.parts] == [12 - 5 - 1, 4, 1 + 5]  # evened out by 5, one token fewer
    assert [p.prefix for p in comp.parts][:2] == [0, 0]  # a chunk's cached prefix dropped
    assert comp.label == "6+4+6 (sibling of 12+4@20+1)"  # the decode became a chunk: its context dropped too
    row = _batch("4+1*3", cache)
    decodes = sibling_of(row)  # 4+1+1+1: evened to 3+2+1+1, then one token fewer: 2+2+1+1
    assert [p.new_tokens for p in decodes.parts] == [2, 2, 1, 1]
    assert [p.prefix for p in decodes.parts][2:] == [(kv - 1) // 2 for kv in row.kv_lens[2:]]  # decodes halved
    assert [p.new_tokens for p in sibling_of(b, fewer=False).parts] == [7, 4, 6]
    alike = _batch("8*2", cache)  # all alike: two of them unevened, then one token fewer
    assert [p.new_tokens for p in sibling_of(alike).parts] == [7, 8]  # 7+9, then the longest one fewer
    one = _batch("1@0", cache)  # nothing but its blocks can differ: placed anew, they do
    again = _batch_of(sibling_of(one, fewer=False), cache, one)
    assert again.q_lens == one.q_lens and again.kv_lens == one.kv_lens
    assert set(again.block_tables[0]).isdisjoint(one.block_tables[0])


def _batch_of(comp, cache, row):
    return make_batch(comp, cache, 100, 64, {b for t in row.block_tables for b in t})


def test_a_sibling_writes_no_block_of_the_batch_it_stands_beside():
    """Its contexts may read the batch's blocks (the cache is sized for one full batch and the new tokens of a
    sibling beside it), its new tokens never land there: the capture would change the context the batch's check
    reads."""
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


@pytest.mark.parametrize("text", ["16*4", "60+4", "1*8@63", "30@20+30@20+4"])
def test_the_cache_holds_a_full_batch_and_its_siblings_new_tokens(text):
    """blocks_needed: a batch at its longest contexts and a sibling's new tokens, prefill chunks included (one
    block a sequence more covered decode only: a 128-token prefill's sibling found no room)."""
    comp = parse_composition(text, 1)
    cache = _cache(comp.num_seqs, comp.num_tokens)
    row = _batch(text, cache)
    for fewer in (True, False):
        _batch_of(sibling_of(row, fewer), cache, row)  # no GmtoolError


def test_a_key_no_sibling_fits_beside_is_captured_from_its_batch_and_a_note_says_so():
    from gmtool.config import SweepConfig
    from gmtool.measure.sweep import Sweep
    from gmtool.measure.workbench import Workbench

    cfg = SweepConfig(
        device="cpu", buckets="4", compositions="1*4@40", modes=("eager", "full"), max_kv_len=48, block_size=8,
        num_iters=2, num_iters_warmup=0,
    )  # fmt: skip
    bench = Workbench.build(cfg, num_blocks=4 * 6 + 1)  # the batch's 24 blocks: none left for a sibling's tokens
    res = Sweep(cfg).run(bench)
    full = next(r for r in res.records if r.mode == "full")
    assert full.status == "ok" and full.captured_with == "1*4@40"
    note = next(n for n in res.notes if "captured from the first batch" in n)
    assert (
        note.startswith("1 graph key was captured from the first batch it checks")
        and "full d4 (the batch needs" in note
    )


def test_trace_finds_a_mix_its_graph_serves_past_one_the_cache_cannot_hold(tmp_path):
    """The first mix of the bucket needs more blocks than a small cache holds: --trace takes the next one, where
    it gave up on the mode."""
    from tests.test_compare import FAST, run_cli

    out = tmp_path / "t"
    comps = "16=8+4@512+1*4,16=8*2,16=4*4"
    code, _, err = run_cli("compare", "eager,full", *FAST, "--buckets", "16", "--compositions", comps,
                           "--kv-cache-gb", "0.0002", "--trace", "--out", out)  # fmt: skip
    assert code == 1 and (out / "trace-full.json").exists(), err


def test_the_runs_seed_draws_other_tokens_contexts_and_blocks():
    """--seed said it seeds token ids, contexts and block placement; they followed the mix's position alone.
    Through the workbench, as every sweep, decoy and sibling draws its batches."""
    from gmtool.config import SweepConfig
    from gmtool.measure.workbench import Workbench

    comp = parse_composition("1*4", 3)
    benches = {s: Workbench.build(SweepConfig(device="cpu", seed=s), num_blocks=64) for s in (0, 7)}

    def draw(seed):
        b = benches[seed].batch(comp)
        return b.input_ids.tolist(), b.kv_lens, b.block_tables

    assert draw(0) == draw(0) and draw(7) == draw(7)
    ids, kv, blocks = draw(7)
    ids0, kv0, blocks0 = draw(0)
    assert ids != ids0 and kv != kv0 and blocks != blocks0
