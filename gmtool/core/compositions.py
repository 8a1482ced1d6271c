"""Batch compositions: which requests make up one step of num_tokens tokens.

Grammar (comma-separated compositions, '+' joins parts of one composition):
    part  := N[*K][@P]     K requests of N new tokens each, after a cached prefix of P tokens
    comp  := [B=]part(+part)*   B pins the composition to bucket B
Examples: '64+64', '32*4', '1*13' (thirteen decode requests), '100+28@512' (a chunk of 28 tokens after a
512-token cached prefix). A one-token part without '@P' is a decode request with a random (seeded) context.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from gmtool.errors import GmtoolError

_PART = re.compile(r"^(\d+)(?:\*(\d+))?(?:@(\d+))?$")


@dataclass(frozen=True)
class Part:
    new_tokens: int
    count: int = 1
    prefix: int | None = None  # None: 0 for chunks, random for one-token (decode) requests


@dataclass(frozen=True)
class Composition:
    parts: tuple[Part, ...]
    bucket: int | None = None  # pinned bucket, else the smallest that fits
    seed: int = 0  # makes random decode contexts and block placement reproducible
    text: str = field(default="", compare=False)

    @property
    def num_tokens(self) -> int:
        return sum(p.new_tokens * p.count for p in self.parts)

    @property
    def num_seqs(self) -> int:
        return sum(p.count for p in self.parts)

    @property
    def is_decode(self) -> bool:
        return all(p.new_tokens == 1 for p in self.parts)

    @property
    def label(self) -> str:
        return self.text or "+".join(_part_text(p) for p in self.parts)


def _part_text(p: Part) -> str:
    s = str(p.new_tokens) + (f"*{p.count}" if p.count != 1 else "")
    return s + (f"@{p.prefix}" if p.prefix is not None else "")


def parse_composition(text: str, seed: int = 0) -> Composition:
    raw = text.strip()
    bucket = None
    body = raw
    if "=" in raw:
        head, body = raw.split("=", 1)
        try:
            bucket = int(head)
        except ValueError:
            raise GmtoolError(f"bad composition {raw!r}: '{head}=' must be a bucket size") from None
    parts = []
    for item in body.split("+"):
        m = _PART.match(item.strip())
        if not m:
            raise GmtoolError(f"bad composition {raw!r}: {item.strip()!r} is not N, N*K or N@P (e.g. 32*4, 28@512)")
        n, k, p = int(m[1]), int(m[2] or 1), (int(m[3]) if m[3] is not None else None)
        if n <= 0 or k <= 0:
            raise GmtoolError(f"bad composition {raw!r}: token counts and request counts must be > 0")
        parts.append(Part(n, k, p))
    comp = Composition(tuple(parts), bucket, seed, body.strip())
    if bucket is not None and comp.num_tokens > bucket:
        raise GmtoolError(f"composition {raw!r} has {comp.num_tokens} tokens, more than its bucket {bucket}")
    return comp


def parse_compositions(text: str) -> list[Composition]:
    items = (text or "").split(",")
    if not any(t.strip() for t in items):
        raise GmtoolError("empty composition list")
    if not all(t.strip() for t in items):  # as parse_buckets: a stray comma may be a mix the user lost
        raise GmtoolError(f"malformed composition list {text!r}: empty item")
    return [parse_composition(t, seed=i) for i, t in enumerate(items)]


def default_compositions(
    bucket: int, scenario: str, below: int = 0, max_seqs: int | None = None, max_kv_len: int | None = None
) -> list[Composition]:
    """Three or more mixes that the bucket serves (more than `below`, the next smaller bucket, tokens): a decode
    graph serves them all; a full prefill key (tokens x sequences) one each, checked on a graph captured from a
    sibling batch (gmtool.core.batch.sibling_of) as every key is. Prefill and mixed mixes of more
    than max_seqs sequences (--max-num-seqs) give way to one-sequence prefills of the bucket's sizes; a decode
    bucket above it is refused by the config, as the user's own mixes are. A chunk's cached prefix is 512 tokens,
    or what a given --max-kv-len leaves of it (max_kv_len)."""
    seed = bucket * 16
    if scenario == "decode":
        mid = max(below + 1, math.ceil((below + bucket) / 2))
        sizes = [bucket, mid if mid < bucket else bucket, max(below + 1, bucket - 1)]
        return [Composition((Part(1, n),), None, seed + i, f"1*{n}") for i, n in enumerate(sizes)]
    texts = [f"{bucket // k}*{k}" for k in ((2, 4, 8) if bucket >= 16 else (2, 4)) if bucket // k]
    if scenario == "mixed" or bucket >= 16:  # a prefill chunk after a cached prefix, beside decodes
        chunk = max(1, bucket // 4)
        decodes = min(4, bucket - chunk - 1)
        # one token short of the bucket where the next smaller one does not serve it: the other mixes fill their
        # bucket exactly, and a prefill graph must meet padding lanes too (a pad slot left on a live token's)
        fresh = bucket - chunk - decodes - (bucket - 1 > below and bucket - chunk - decodes > 2)
        prefix = 512 if max_kv_len is None else min(512, max_kv_len - chunk)
        if decodes >= 1 and prefix >= 1:
            texts.append(f"{fresh}+{chunk}@{prefix}+1*{decodes}")
    comps = [parse_composition(t, seed + i) for i, t in enumerate(texts)]
    # a mix the next smaller bucket serves would never reach this bucket in an engine
    comps = [c for c in comps if c.num_tokens > below]
    fit = [c for c in comps if max_seqs is None or c.num_seqs <= max_seqs]
    if len(fit) < len(comps) or not fit:
        # prefills of one sequence: of two tokens at least (one new token is a decode, and a decode step in a
        # bucket of more tokens than --max-num-seqs is refused)
        least = min(bucket, max(below + 1, 2))
        mid = max(least, math.ceil((below + bucket) / 2))
        fit += [parse_composition(str(n), seed + 8 + i) for i, n in enumerate(dict.fromkeys((bucket, mid, least)))]
    return fit


def assign_buckets(comps: list[Composition], policy) -> dict[int, list[Composition]]:
    """Group compositions by the bucket that serves them; a pinned bucket must be in the list."""
    out: dict[int, list[Composition]] = {}
    for c in comps:
        if c.bucket is not None:
            if c.bucket not in policy.sizes:
                raise GmtoolError(f"composition {c.bucket}={c.label}: bucket {c.bucket} is not captured")
            b = c.bucket
        else:
            b = policy.bucket_for(c.num_tokens)
        out.setdefault(b, []).append(c)
    return out
