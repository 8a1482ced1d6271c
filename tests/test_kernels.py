"""Attention ops on CPU: backend dispatch, the torch reference paths against a float64 per-sequence oracle,
and (when triton is installed) the Triton kernels under the Triton interpreter.

The interpreter must be switched on before triton is imported, so those tests run in a child pytest with
TRITON_INTERPRET=1; the parent only starts it. The interpreter mis-computes bf16 tl.dot (triton 3.9), so
these use fp32 and fp16: bf16 is covered by tests/gpu/test_kernels_gpu.py.
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
import torch

from gmtool.model import attention as ref
from gmtool.errors import GmtoolError
from gmtool.kernels import available, get_attention_ops
from gmtool.kernels.testing import decode_case, make_case, naive_decode, naive_varlen, poison_unused
from tests.interpreted import INTERPRETED, HAS_TRITON, interp_only, run_interpreted


GQA = [(4, 1), (2, 2), (1, 4)]  # (kv heads, query heads per kv head)
DECODE_LENS = [1, 17, 5, 40, 33]  # none but 1 a multiple of anything; block sizes 16 and 8
PREFILL = ([3, 1, 40, 20, 1], [10, 17, 40, 85, 33])  # (q_lens, kv_lens): cached prefixes, whole prompts, decode


# ---------------------------------------------------------------- dispatch


@pytest.fixture
def fresh_ops():
    get_attention_ops.cache_clear()
    yield
    get_attention_ops.cache_clear()


def test_torch_backend_is_the_reference(fresh_ops):
    ops = get_attention_ops("torch")
    assert ops.write_kv is ref.write_kv and ops.decode is ref.decode_attention
    assert callable(ops.varlen)


def test_unknown_backend(fresh_ops):
    with pytest.raises(GmtoolError, match="unknown attention backend"):
        get_attention_ops("cutlass")


def test_triton_without_cuda_is_a_clear_error(fresh_ops, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not available()
    with pytest.raises(GmtoolError, match="CUDA"):
        get_attention_ops("triton")


def test_available_needs_triton(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` raise ImportError
    assert not available()


# ---------------------------------------------------------------- torch reference paths


@pytest.mark.parametrize("kv_heads,group", GQA)
@pytest.mark.parametrize("block_size", [16, 8])
def test_reference_decode(kv_heads, group, block_size):
    case, q = decode_case(
        DECODE_LENS, num_slots=8, kv_heads=kv_heads, group=group, block_size=block_size, blocks_per_seq=6, seed=kv_heads
    )
    out = ref.decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.kv_lens_t, 0.3)
    n = case.num_seqs
    torch.testing.assert_close(out[:n].double(), naive_decode(case, q, 0.3)[:n], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out[n:]).all()  # padded slots read the null block: any finite value will do


def _views(case):
    token_seq = torch.full((case.num_tokens,), -1, dtype=torch.int64)
    token_seq[: sum(case.q_lens)] = torch.repeat_interleave(torch.arange(case.num_seqs), torch.tensor(case.q_lens))
    return SimpleNamespace(
        block_tables=case.block_tables, kv_lens=case.kv_lens_t, positions=case.positions, token_seq=token_seq
    )


@pytest.mark.parametrize("kv_heads,group", GQA)
def test_reference_varlen(kv_heads, group):
    case = make_case(*PREFILL, num_slots=7, num_tokens=72, kv_heads=kv_heads, group=group, blocks_per_seq=7)
    expect = naive_varlen(case, 0.25)
    masked = ref.masked_varlen_attention(case.q, case.k_cache, case.v_cache, _views(case), 7, 0.25)
    torch.testing.assert_close(masked.double(), expect, atol=1e-5, rtol=1e-5)
    planned = ref.planned_varlen_attention(
        case.q, case.k_cache, case.v_cache, _views(case), tuple(zip(case.q_lens, case.kv_lens)), 0.25
    )
    torch.testing.assert_close(planned.double(), expect, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_heads,group", GQA)
def test_torch_ops_varlen_derives_token_metadata(kv_heads, group, fresh_ops):
    """The dispatch adapter rebuilds positions/token_seq on device from cu_q and kv_lens alone."""
    case = make_case(*PREFILL, num_slots=7, num_tokens=72, kv_heads=kv_heads, group=group, blocks_per_seq=7)
    ops = get_attention_ops("torch")
    out = ops.varlen(case.q, case.k_cache, case.v_cache, case.cu_q, case.kv_lens_t, case.block_tables, 7, None, 0.25)
    torch.testing.assert_close(out.double(), naive_varlen(case, 0.25), atol=1e-5, rtol=1e-5)


def test_reference_write_kv():
    # The reference cannot skip slots: padding writes into the null block (slot 0) instead.
    case = make_case(*PREFILL, num_tokens=72, pad_slot=0)
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    ref.write_kv(kc, vc, case.k_new, case.v_new, case.slot_mapping)
    real = sum(case.q_lens)
    slots = case.slot_mapping[:real]
    assert torch.equal(kc.view(-1, *kc.shape[2:])[slots], case.k_new[:real])
    assert torch.equal(vc.view(-1, *vc.shape[2:])[slots], case.v_new[:real])
    bs = kc.shape[1]
    untouched = torch.ones(kc.shape[0] * bs, dtype=torch.bool)
    untouched[slots] = False
    untouched[:bs] = False
    assert torch.equal(kc.view(-1, *kc.shape[2:])[untouched], case.k_cache.view(-1, *kc.shape[2:])[untouched])


def test_oracle_matches_sdpa():
    """The oracle itself, on one sequence, against torch's own causal attention."""
    case = make_case([24], [24], kv_heads=2, group=2, dtype=torch.float64)
    k = case.k_cache[case.block_tables[0]].flatten(0, 1)[:24].repeat_interleave(2, 1).transpose(0, 1)
    v = case.v_cache[case.block_tables[0]].flatten(0, 1)[:24].repeat_interleave(2, 1).transpose(0, 1)
    sdpa = torch.nn.functional.scaled_dot_product_attention(case.q.transpose(0, 1), k, v, is_causal=True, scale=0.2)
    torch.testing.assert_close(naive_varlen(case, 0.2), sdpa.transpose(0, 1))


# ---------------------------------------------------------------- triton kernels, interpreted


@pytest.mark.skipif(INTERPRETED, reason="the child runs the tests itself")
def test_triton_kernels_under_interpreter():
    """Every interp_only test of this module, run by the Triton interpreter in a child pytest: all of them
    must pass (triton is a test dependency: a child that skipped them fails here)."""
    assert HAS_TRITON, "triton is not installed: pip install -e '.[test]' (the kernel interpreter tests need it)"
    run_interpreted(sys.modules[__name__], interp_only)


def test_num_splits_depends_on_bucket_only():
    pytest.importorskip("triton")
    from gmtool.kernels.decode_attention import MAX_SPLITS, choose_num_splits

    assert choose_num_splits(32, 8, 4096, 132) * 32 * 8 >= 4 * 132  # fills an H200 at the goal shape
    assert choose_num_splits(1, 8, 1024, 132) == 16  # capped by the kv length: >= 64 tokens per split
    assert choose_num_splits(1, 1, 1 << 20, 132) == MAX_SPLITS
    assert choose_num_splits(512, 8, 4096, 132) == 1
    assert choose_num_splits(8, 8, 16, 132) == 1
    from gmtool.core.buckets import DEFAULT_DECODE_BUCKETS

    splits = {choose_num_splits(b, 8, 1024, 132) for b in DEFAULT_DECODE_BUCKETS}
    assert splits == {1, 2, 4, 8, 16}  # powers of two only


def test_decode_split_count_is_bounded():
    """More splits than the combine reads (MAX_SPLITS) would drop the last ones' tokens: refused."""
    pytest.importorskip("triton")
    from gmtool.kernels.decode_attention import MAX_SPLITS, decode_attention
    from gmtool.kernels.testing import decode_case

    case, q = decode_case([3], num_slots=1, kv_heads=1, group=1, blocks_per_seq=1, dtype=torch.float32)
    for bad in (0, MAX_SPLITS + 1):
        with pytest.raises(ValueError, match=f"num_splits {bad}"):
            decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.kv_lens_t, 0.3, num_splits=bad)


_INDEX_PTRS = ("bt_ptr", "lens_ptr", "cu_ptr", "slot_ptr")


def _compile_for_hopper(jit_fn, consts, dtype="bf16"):
    """Unit strides as constants, index pointers int64, split partials fp32, the rest of dtype."""
    from gmtool.kernels.testing import compile_for_hopper

    consts = {**consts, **{n: 1 for n in jit_fn.arg_names if n == "stride_btn"}}

    def arg_type(name):
        if name.endswith("_ptr"):
            return "*i64" if name in _INDEX_PTRS else "*fp32" if name in ("part_ptr", "lse_ptr") else "*" + dtype
        return "fp32" if name in ("qk_scale", "scale") else "i32"

    return compile_for_hopper(jit_fn, consts, arg_type)


@pytest.mark.skipif(INTERPRETED or not HAS_TRITON, reason="needs triton, not interpreted")
def test_kernels_compile_for_hopper():
    """The interpreter runs the kernels as Python: this runs triton's compiler and ptxas for sm_90, which
    needs no GPU and catches what only compiled code rejects (non-constexpr globals, type mismatches)."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    from gmtool.kernels import decode_attention as da, kv_write as kw, prefill_attention as pa

    try:
        import triton.compiler  # noqa: F401
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except ImportError:
        pytest.skip("this triton has another AOT compile API")
    plain = dict(WINDOW=0, SOFTCAP=0.0, SINKS=False)
    feats = dict(WINDOW=4096, SOFTCAP=50.0, SINKS=True)  # every layer option at once (gmtool.model.attention)
    dec = dict(NUM_HEADS=16, G=2, G_PAD=16, D=128, D_PAD=128, DV=128, DV_PAD=128, PAGE=16, BLOCK_N=64, PREC="tf32")
    for split in (False, True):
        for opts in (plain, feats):
            assert _compile_for_hopper(da._decode_split_kernel, {**dec, **opts, "SPLIT": split}).asm["cubin"]
    assert _compile_for_hopper(da._decode_split_kernel, {**dec, **plain, "SPLIT": True, "PRE_LENS": 1})
    for sinks in (False, True):
        window = 4096 if sinks else 0
        consts = dict(NUM_HEADS=16, D=128, D_PAD=128, S_PAD=64, SINKS=sinks, WINDOW=window, BLOCK_N=64, DC=32)
        assert _compile_for_hopper(da._combine_kernel, consts)
    for wide in (False, True):
        for opts in (plain, feats):
            assert _compile_for_hopper(
                pa._varlen_kernel,
                dict(
                    G=2,
                    D=128,
                    D_PAD=128,
                    DV=128,
                    DV_PAD=128,
                    PAGE=16,
                    BLOCK_M=64,
                    BLOCK_N=64,
                    WIDE=wide,
                    PREC="tf32",
                    **opts,
                ),
            )
    mla = dict(G=16, D=192, D_PAD=256, DV=128, DV_PAD=128, PAGE=16, BLOCK_M=64, BLOCK_N=32, WIDE=True, PREC="tf32")
    assert _compile_for_hopper(pa._varlen_kernel, {**mla, **plain})  # DeepSeek's K 192 / V 128
    assert _compile_for_hopper(kw._write_kv_kernel, dict(HKV=8, H_PAD=8, D=128, D_PAD=128, DV=128, DV_PAD=128, PAGE=16))
    fp32 = {**dec, **plain, "D": 96, "DV": 96, "SPLIT": True, "PREC": "ieee"}  # fp32 check path, head_dim padded
    assert _compile_for_hopper(da._decode_split_kernel, fp32, dtype="fp32")


TOL = {torch.float32: 2e-5, torch.float16: 2e-3}


F32, F16 = torch.float32, torch.float16


@interp_only  # the interpreter is slow: each GQA ratio, split count and dtype once, not every combination
@pytest.mark.parametrize(
    "kv_heads,group,num_splits,dtype,pre_lens,head_dim",
    # pre_lens: kv_lens read before the (here absent) PDL wait, as under --pdl; split 0 of a padded slot goes on.
    # head_dim 128 over 8 slots of 4 heads: each head's combine shared out over 4 programs of 32 dims
    [
        (4, 1, 1, F32, False, 32),
        (2, 2, 3, F32, True, 32),
        (1, 4, 8, F32, False, 32),
        (2, 2, 1, F16, True, 32),
        (1, 4, 3, F16, False, 32),
        (2, 2, 4, F32, False, 128),
    ],
)
def test_interp_decode(kv_heads, group, num_splits, dtype, pre_lens, head_dim):
    from gmtool.kernels.decode_attention import combine_dims, decode_attention

    case, q = decode_case(
        DECODE_LENS,
        num_slots=8,
        kv_heads=kv_heads,
        group=group,
        head_dim=head_dim,
        blocks_per_seq=4,
        dtype=dtype,
        seed=num_splits,
    )
    assert head_dim == 32 or combine_dims(8 * kv_heads * group, head_dim, 132) == 32
    poison_unused(case)
    out = torch.full_like(q, float("nan"))
    decode_attention(
        q,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.kv_lens_t,
        0.3,
        num_splits=num_splits,
        out=out,
        block_n=16,
        # NaN split partials: a split past a sequence's tokens writes none, and the combine must not read it
        scratch=lambda role, n: torch.full((n,), float("nan")),
        pre_lens=pre_lens,
    )
    expect = naive_decode(case, q, 0.3)
    torch.testing.assert_close(out.double(), expect, atol=TOL[dtype], rtol=TOL[dtype])
    assert (out[case.num_seqs :] == 0).all()  # padded slots: zeros


@interp_only
@pytest.mark.parametrize("block_size,block_n,head_dim", [(8, 32, 24), (32, 16, 32)])
def test_interp_decode_shapes(block_size, block_n, head_dim):
    """Pages smaller and larger than a tile; a head_dim that is not a power of two."""
    from gmtool.kernels.decode_attention import decode_attention

    case, q = decode_case(
        [1, 31, 64, 65], num_slots=5, kv_heads=2, group=2, head_dim=head_dim, block_size=block_size, blocks_per_seq=9
    )
    poison_unused(case)
    out = decode_attention(
        q, case.k_cache, case.v_cache, case.block_tables, case.kv_lens_t, 0.2, num_splits=2, block_n=block_n
    )
    torch.testing.assert_close(out.double(), naive_decode(case, q, 0.2), atol=2e-5, rtol=2e-5)


@interp_only
@pytest.mark.parametrize(
    "kv_heads,group,wide,dtype",
    [(4, 1, False, F32), (2, 2, True, F32), (1, 4, False, F32), (1, 4, True, F16), (2, 2, False, F16)],
)
def test_interp_varlen(kv_heads, group, wide, dtype):
    from gmtool.kernels.prefill_attention import varlen_attention, varlen_attention_wide

    case = make_case(
        *PREFILL,
        num_slots=7,
        num_tokens=72,
        kv_heads=kv_heads,
        group=group,
        blocks_per_seq=7,
        dtype=dtype,
        seed=kv_heads,
    )
    poison_unused(case)
    out = torch.full_like(case.q, float("nan"))
    args = (case.q, case.k_cache, case.v_cache, case.cu_q, case.kv_lens_t, case.block_tables, 7)
    if wide:
        varlen_attention_wide(*args, 0.25, out=out, block_m=16, block_n=16)
    else:
        varlen_attention(*args, max(case.q_lens), 0.25, out=out, block_m=16, block_n=32)
    torch.testing.assert_close(out.double(), naive_varlen(case, 0.25), atol=TOL[dtype], rtol=TOL[dtype])


@interp_only
def test_interp_varlen_wide_many_short_sequences():
    """More sequences than tiles of tokens: the wide grid's tile-to-sequence search at its edges."""
    from gmtool.kernels.prefill_attention import varlen_attention_wide

    q_lens = [1, 2, 1, 17, 1, 1, 3, 1, 16, 1]
    kv_lens = [5, 2, 30, 17, 1, 64, 3, 9, 40, 16]
    case = make_case(q_lens, kv_lens, num_slots=12, num_tokens=50, blocks_per_seq=4)
    poison_unused(case)
    out = torch.full_like(case.q, float("nan"))
    varlen_attention_wide(
        case.q,
        case.k_cache,
        case.v_cache,
        case.cu_q,
        case.kv_lens_t,
        case.block_tables,
        12,
        0.25,
        out=out,
        block_m=16,
        block_n=16,
    )
    torch.testing.assert_close(out.double(), naive_varlen(case, 0.25), atol=2e-5, rtol=2e-5)


@interp_only
@pytest.mark.parametrize("dtype", [F32, F16])
def test_interp_write_kv(dtype):
    from gmtool.kernels.kv_write import write_kv

    case = make_case(*PREFILL, num_tokens=72, kv_heads=2, head_dim=24, dtype=dtype, pad_slot=-1)
    kc = torch.full_like(case.k_cache, float("nan"))
    vc = torch.full_like(case.v_cache, float("nan"))
    k_new = case.k_new.transpose(0, 1).contiguous().transpose(0, 1)  # strided, as attention modules hand it
    write_kv(kc, vc, k_new, case.v_new, case.slot_mapping)
    real = sum(case.q_lens)
    slots = case.slot_mapping[:real]
    flat_k, flat_v = kc.view(-1, *kc.shape[2:]), vc.view(-1, *vc.shape[2:])
    assert torch.equal(flat_k[slots], case.k_new[:real]) and torch.equal(flat_v[slots], case.v_new[:real])
    written = torch.isfinite(flat_k).all(-1).all(-1)
    assert written.sum() == real  # padded tokens (slot -1) wrote nothing


def test_one_compiled_variant_serves_every_split_count():
    """The split count is a run-time argument: over the default decode buckets the split kernel compiles two
    variants (one split, several) and the combine kernel two (32 dims a program at B=1 and 2, whole heads at the
    rest), whatever counts the buckets choose."""
    pytest.importorskip("triton")
    from gmtool.core.buckets import DEFAULT_DECODE_BUCKETS
    from gmtool.kernels.decode_attention import _arguments

    heads, kv_heads, dv, page, blocks = 16, 8, 128, 16, 64
    cache = torch.zeros(4, page, kv_heads, dv)
    split_variants, combine_variants, counts, dims = set(), set(), set(), {}
    for b in DEFAULT_DECODE_BUCKETS:
        q = torch.zeros(b, heads, dv)
        bt, lens = torch.zeros(b, blocks, dtype=torch.int64), torch.zeros(b, dtype=torch.int64)
        _, (grid, args, consts), combine = _arguments(q, cache, cache, bt, lens, 1.0, None, None, 64, None, None, None)
        split_variants.add(tuple(sorted(consts.items())))
        counts.add(grid[2])
        if combine is not None:
            combine_variants.add(tuple(sorted(combine[2].items())))
            assert combine[1][-1] == grid[2] == args[-1]  # the count travels as an argument to both kernels
            dims[b] = combine[2]["DC"]
            assert combine[0] == (b, heads, dv // dims[b])  # the grid covers every dim of every head once
    assert len(counts) >= 3 and len(split_variants) == 2 and len(combine_variants) == 2
    assert (dims[1], dims[2], dims[4], dims[8]) == (32, 32, 128, 128)
