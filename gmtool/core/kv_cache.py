"""gmtool's own paged KV cache: per-layer K/V blocks, block tables and slot mapping.

Block 0 is the null block: padding tokens write their K/V there and padded sequences read from it, so the
padded tail of a bucket never touches a real sequence's memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gmtool.errors import GmtoolError, OutOfMemory

NULL_BLOCK = 0


@dataclass
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    max_kv_len: int = 1024
    dtype: torch.dtype = torch.bfloat16
    v_head_dim: int | None = None  # V's own head dim where it differs from K's (DeepSeek MLA); None: head_dim

    @property
    def v_dim(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def blocks_per_seq(self) -> int:
        return math.ceil(self.max_kv_len / self.block_size)

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * self.block_size * self.num_kv_heads * (self.head_dim + self.v_dim) * elem

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_block // self.block_size


def blocks_needed(seqs: int, per_seq: int, tokens: int, block_size: int) -> int:
    """The blocks a run's cache is sized for: its fullest batch (seqs) at the longest contexts (per_seq blocks
    each); beside it the new tokens of the sibling its graphs are captured from (gmtool.core.batch.sibling_of:
    it reads blocks of the batch but writes only blocks of its own): at most its largest mix's `tokens`, and
    two blocks more a sequence (a chunk's rounding at both ends); and the null block."""
    return seqs * per_seq + math.ceil(tokens / block_size) + 2 * seqs + 1


class PagedKVCache:
    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device):
        if num_blocks < 2:
            raise GmtoolError("the KV cache needs at least 2 blocks (one is the null block)")
        self.spec, self.num_blocks, self.device = spec, num_blocks, device
        shape = (num_blocks, spec.block_size, spec.num_kv_heads)
        try:
            self.k = [
                torch.empty(*shape, spec.head_dim, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)
            ]
            self.v = [torch.empty(*shape, spec.v_dim, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
        except torch.OutOfMemoryError:
            raise OutOfMemory(
                f"KV cache of {num_blocks} blocks ({num_blocks * spec.bytes_per_block / 2**30:.1f} GiB) "
                "does not fit: lower --max-kv-len or --kv-cache-gb"
            ) from None

    @classmethod
    def from_budget(cls, spec: KVCacheSpec, budget_bytes: int, needed_blocks: int, device) -> "PagedKVCache":
        """As many blocks as the workload needs, capped by the memory budget."""
        fit = max(2, budget_bytes // spec.bytes_per_block)
        return cls(spec, int(min(fit, needed_blocks + 1)), device)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.spec.bytes_per_block

    def fill_random(self, seed: int, rank: int = 0, world: int = 1) -> None:
        """Cached prefixes are random K/V: attention must read exactly the right slots to match eager.
        Under --tp, rank's KV heads of the values a one-rank cache would hold (so TP=N matches TP=1)."""
        g = torch.Generator(device=self.device).manual_seed(seed)
        for t in self.k + self.v:
            if world == 1:
                t.normal_(generator=g)
            else:
                full = torch.empty(*t.shape[:2], t.shape[2] * world, t.shape[3], dtype=t.dtype, device=t.device)
                t.copy_(full.normal_(generator=g).chunk(world, 2)[rank])

    def scrub(self) -> None:
        """Non-finite K/V set to 0: what a wrong replay left (the poison it never overwrote, NaN it wrote into
        other requests' blocks), which later batches' contexts would read and their eager references turn NaN.
        One pass over the cache, run only after an unsafe replay."""
        for t in self.k + self.v:
            t.nan_to_num_(0.0, 0.0, 0.0)

    def allocate(self, kv_lens: list[int], generator: torch.Generator, keep=None) -> list[list[int]]:
        """Distinct random blocks per sequence, so block tables differ from batch to batch. keep: (blocks, the
        index of each sequence's first new token): another batch's blocks, which this one may read but must not
        write, so each sequence's blocks from the one of its first new token on are none of them."""
        bs = self.spec.block_size
        need = [math.ceil(n / bs) for n in kv_lens]
        perm = (torch.randperm(self.num_blocks - 1, generator=generator) + 1).tolist()
        held, starts = keep if keep is not None else (set(), [0] * len(kv_lens))
        free = [b for b in perm if b not in held]
        written = sum(n - min(start // bs, n) for n, start in zip(need, starts))
        if sum(need) > self.num_blocks - 1 or written > len(free):
            raise GmtoolError(
                f"the batch needs {sum(need)} KV blocks, the cache has {self.num_blocks - 1}"
                + (f" ({len(held)} of them another batch's, which it may not write)" if held else "")
                + ": raise --kv-cache-gb or lower --max-kv-len"
            )
        tables = []
        shared = [b for b in perm if b in held] + free[written:]  # what read-only blocks come from
        for n, start in zip(need, starts):
            read_only = min(start // bs, n)
            tables.append(shared[:read_only] + free[: n - read_only])
            shared, free = shared[read_only:], free[n - read_only :]
        return tables
