"""Random paged-cache inputs and a naive per-sequence oracle, for the kernel tests and the bandwidth bench.

The oracle gathers each sequence's tokens explicitly and computes in float64 (or a given dtype), sharing no
code with the kernels or with gmtool.model.attention, so it checks both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class PagedCase:
    """One step: real sequences first, then padded slots (kv_len 0, q_len 0) up to the bucket's size."""

    q_lens: list[int]
    kv_lens: list[int]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [S, blocks_per_seq] int64, padded rows and tails point at block 0
    kv_lens_t: torch.Tensor  # [S] int64
    cu_q: torch.Tensor  # [S + 1] int64, padded slots repeat the total
    slot_mapping: torch.Tensor  # [T] int64: the new tokens' slots, pad_slot for padded tokens
    positions: torch.Tensor  # [T] int64
    q: torch.Tensor  # [T, H, D]
    k_new: torch.Tensor  # [T, Hkv, D]
    v_new: torch.Tensor

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def num_tokens(self) -> int:
        return self.q.shape[0]


def make_case(
    q_lens,
    kv_lens,
    *,
    num_slots=None,
    num_tokens=None,
    kv_heads=2,
    group=2,
    head_dim=32,
    block_size=16,
    blocks_per_seq=None,
    dtype=torch.float32,
    device="cpu",
    seed=0,
    pad_slot=-1,
    spare_blocks=3,
    num_blocks=None,
) -> PagedCase:
    q_lens, kv_lens = list(q_lens), list(kv_lens)
    assert all(0 < q <= k for q, k in zip(q_lens, kv_lens)), "each real sequence has 1 <= q_len <= kv_len"
    n_slots = num_slots if num_slots is not None else len(q_lens)
    total = sum(q_lens)
    tokens = num_tokens if num_tokens is not None else total
    need = [math.ceil(k / block_size) for k in kv_lens]
    width = blocks_per_seq if blocks_per_seq is not None else max(need + [1])
    g = torch.Generator().manual_seed(seed)
    # Bulk data straight on the device: GPU tests build caches of hundreds of MB.
    gd = torch.Generator(device=device).manual_seed(seed)
    rand = lambda *shape: torch.randn(shape, generator=gd, device=device).to(dtype)  # noqa: E731
    if num_blocks is None:
        num_blocks = 1 + sum(need) + spare_blocks
    assert num_blocks > sum(need), "not enough blocks for the sequences"
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = rand(*shape), rand(*shape)

    # Scattered blocks, as a real allocator leaves them; block 0 (null) is never handed out.
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables = torch.zeros(n_slots, width, dtype=torch.int64)
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor(perm[at : at + n])
        at += n
    lens = torch.zeros(n_slots, dtype=torch.int64)
    lens[: len(kv_lens)] = torch.tensor(kv_lens)
    cu = torch.full((n_slots + 1,), total, dtype=torch.int64)
    cu[: len(q_lens) + 1] = torch.tensor([0] + q_lens).cumsum(0)

    slots = torch.full((tokens,), pad_slot, dtype=torch.int64)
    positions = torch.zeros(tokens, dtype=torch.int64)
    t = 0
    for i, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
        pos = torch.arange(kl - ql, kl)
        positions[t : t + ql] = pos
        slots[t : t + ql] = tables[i, pos // block_size] * block_size + pos % block_size
        t += ql
    q = rand(tokens, kv_heads * group, head_dim)
    k_new, v_new = rand(tokens, kv_heads, head_dim), rand(tokens, kv_heads, head_dim)
    dev = lambda x: x.to(device)  # noqa: E731
    return PagedCase(
        q_lens, kv_lens, k_cache, v_cache, dev(tables), dev(lens), dev(cu), dev(slots), dev(positions), q, k_new, v_new
    )


def poison_unused(case: PagedCase) -> None:
    """NaN into every cache slot that no sequence owns (null block and page tails included): a kernel that
    reads beyond kv_len, or lets a masked value through, turns its output NaN."""
    bs = case.k_cache.shape[1]
    used = torch.zeros(case.k_cache.shape[0] * bs, dtype=torch.bool, device=case.k_cache.device)
    for i, n in enumerate(case.kv_lens):
        pos = torch.arange(n, device=used.device)
        used[case.block_tables[i, pos // bs] * bs + pos % bs] = True
    for c in (case.k_cache, case.v_cache):
        c.view(-1, *c.shape[2:])[~used] = float("nan")


def _gather(cache: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    bs = cache.shape[1]
    return cache[table[: math.ceil(n / bs)]].flatten(0, 1)[:n]  # [n, Hkv, D]


def _attend(q, k, v, positions, scale):
    """q [n, H, D] at `positions`; k/v [L, Hkv, D]; causal by position."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) * scale
    allowed = torch.arange(k.shape[0], device=q.device)[None, :] <= positions[:, None]
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


def naive_varlen(case: PagedCase, scale: float, q=None, dtype=torch.float64) -> torch.Tensor:
    """[T, H, D] in `dtype`; padded token rows are zeros."""
    q = (case.q if q is None else q).to(dtype)
    out = torch.zeros_like(q)
    t = 0
    for i, (ql, kl) in enumerate(zip(case.q_lens, case.kv_lens)):
        k = _gather(case.k_cache, case.block_tables[i], kl).to(dtype)
        v = _gather(case.v_cache, case.block_tables[i], kl).to(dtype)
        pos = torch.arange(kl - ql, kl, device=q.device)
        out[t : t + ql] = _attend(q[t : t + ql], k, v, pos, scale)
        t += ql
    return out


def naive_decode(case: PagedCase, q: torch.Tensor, scale: float, dtype=torch.float64) -> torch.Tensor:
    """q [S, H, D], one token per slot at position kv_len - 1; padded slots (kv_len 0) give zeros."""
    out = torch.zeros(q.shape, dtype=dtype, device=q.device)
    for i, kl in enumerate(case.kv_lens):
        k = _gather(case.k_cache, case.block_tables[i], kl).to(dtype)
        v = _gather(case.v_cache, case.block_tables[i], kl).to(dtype)
        pos = torch.tensor([kl - 1], device=q.device)
        out[i] = _attend(q[i : i + 1].to(dtype), k, v, pos, scale)[0]
    return out


def decode_case(kv_lens, num_slots=None, **kw) -> tuple[PagedCase, torch.Tensor]:
    """A decode step: one new token per real sequence; q [S, H, D] has a row for every slot."""
    case = make_case([1] * len(kv_lens), kv_lens, num_slots=num_slots, **kw)
    s = case.block_tables.shape[0]
    g = torch.Generator(device=case.q.device).manual_seed(kw.get("seed", 0) + 1)
    q = torch.randn(s, case.q.shape[1], case.q.shape[2], generator=g, device=case.q.device)
    return case, q.to(case.q.dtype)


def compile_for_hopper(jit_fn, consts: dict, arg_type, num_stages: int = 2):
    """Compile jit_fn as a launch on an H200 would (16-aligned pointers and strides): no GPU needed.
    arg_type(name) gives the signature type of each argument that is not in consts ("*bf16", "i32"...)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    import inspect

    # constexprs with a default (the kernels' PDL mode) take it unless consts names them, as a launch does
    defaults = {
        p.name: p.default
        for p in jit_fn.params
        if p.is_constexpr and p.default is not inspect.Parameter.empty and p.name not in consts
    }
    consts = {**defaults, **consts}
    sig, attrs = {}, {}
    for i, name in enumerate(jit_fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
            continue
        sig[name] = arg_type(name)
        if name.endswith("_ptr") or name.startswith("stride"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(jit_fn, sig, constexprs={(jit_fn.arg_names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    return compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": num_stages})
