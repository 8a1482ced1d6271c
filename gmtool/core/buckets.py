"""Token buckets: which captured shape serves a batch, and how the bucket list is written."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from gmtool.errors import GmtoolError

# The engines' default decode capture sizes (vLLM: 1, 2, 4, then every 8 up to the max).
DEFAULT_DECODE_BUCKETS = [1, 2, 4] + list(range(8, 257, 8))
DEFAULT_PREFILL_BUCKETS = [128, 512, 2048]


@dataclass(frozen=True, order=True)
class BucketKey:
    """What selects a graph. num_seqs is set only when the key is widened (num_tokens x num_seqs)."""

    num_tokens: int
    num_seqs: int | None = None
    decode: bool = False  # pure-decode batches get their own graphs, as in the engines

    def __str__(self) -> str:
        s = ("d" if self.decode else "t") + str(self.num_tokens)
        return s + (f"xs{self.num_seqs}" if self.num_seqs is not None else "")


MAX_BUCKETS = 4096  # one graph each: a list longer than this is a typo in a range, not a plan


def _bounded(sizes: range, held: int, text: str) -> range:
    """A range's sizes, refused before they are made when the list would pass MAX_BUCKETS (a stray digit in
    '1:10000000000' would otherwise build ten billion buckets)."""
    if held + len(sizes) > MAX_BUCKETS:
        raise GmtoolError(
            f"bucket list {text!r} holds {held + len(sizes):,} sizes: at most {MAX_BUCKETS:,}, one graph each"
        )
    return sizes


def parse_buckets(text: str) -> list[int]:
    """'1,2,4,8' and ranges 'start:stop:step' (stop included), e.g. '1,2,4,8:256:8'."""
    if text is None or not str(text).strip():
        raise GmtoolError("empty bucket list: give sizes like '1,2,4,8' or a range like '8:256:8'")
    sizes: set[int] = set()
    singles: set[int] = set()
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            raise GmtoolError(f"malformed bucket list {text!r}: empty item")
        try:
            if ":" in part:
                fields = [int(f) for f in part.split(":")]
                if len(fields) not in (2, 3):
                    raise ValueError
                start, stop = fields[0], fields[1]
                step = fields[2] if len(fields) == 3 else 1
                if step <= 0 or stop < start:
                    raise ValueError
                sizes.update(_bounded(range(start, stop + 1, step), len(sizes), text))
            else:
                size = int(part)
                if size in singles:  # a range may overlap the list (a union); a size written twice is a typo
                    raise GmtoolError(f"bucket {size} is given twice in {text!r}")
                singles.add(size)
                sizes.add(size)
        except ValueError:
            raise GmtoolError(
                f"malformed bucket item {part!r} in {text!r}: use an integer or start:stop[:step]"
            ) from None
    bad = sorted(s for s in sizes if s <= 0)
    if bad:
        raise GmtoolError(f"bucket sizes must be positive, got {bad[0]}")
    return sorted(sizes)


@dataclass
class BucketPolicy:
    """Smallest captured size that fits; batches are padded up to it."""

    sizes: list[int]
    max_tokens: int | None = None  # the configured ceiling (persistent buffers are sized for it)
    wide_key: bool = False  # key full graphs by (num_tokens, num_seqs)

    def __post_init__(self) -> None:
        self.sizes = sorted(set(self.sizes))
        self._keys: dict[tuple, BucketKey] = {}
        self._one: dict[BucketKey, BucketKey] = {}  # each key's one object
        if not self.sizes:
            raise GmtoolError("no buckets given")
        if self.max_tokens is None:
            self.max_tokens = self.sizes[-1]
        over = [s for s in self.sizes if s > self.max_tokens]
        if over:
            raise GmtoolError(f"bucket {over[0]} is above the configured maximum of {self.max_tokens} tokens")

    @property
    def largest(self) -> int:
        return self.sizes[-1]

    def bucket_for(self, num_tokens: int) -> int:
        i = bisect.bisect_left(self.sizes, num_tokens)
        if num_tokens <= 0 or i == len(self.sizes):
            raise GmtoolError(f"a batch of {num_tokens} tokens fits no bucket (largest is {self.largest})")
        return self.sizes[i]

    def key_for(self, num_tokens: int, num_seqs: int, decode: bool, pinned: int | None = None) -> BucketKey:
        """pinned: replay on that bucket's graph instead of the smallest that fits (it must fit)."""
        asked = (num_tokens, num_seqs, decode, pinned)
        key = self._keys.get(asked)  # the replay path asks this every step: answer from a dict
        if key is None:
            # one object per key, whatever batch asked: copy-in trusts its last write to a key by identity and
            # rewrites only what the previous batch left (a batch of another size got a key of its own before, so
            # every load after a change of batch size padded in full, and the run never judged the other way)
            key = self._key_for(num_tokens, num_seqs, decode, pinned)
            key = self._keys[asked] = self._one.setdefault(key, key)
        return key

    def _key_for(self, num_tokens: int, num_seqs: int, decode: bool, pinned: int | None) -> BucketKey:
        if pinned is not None:
            if pinned not in self.sizes or pinned < num_tokens:
                raise GmtoolError(f"a batch of {num_tokens} tokens cannot run on bucket {pinned}")
            bucket = pinned
        else:
            bucket = self.bucket_for(num_tokens)
        wide = self.wide_key and not decode  # in a decode bucket num_seqs is already bounded by it
        return BucketKey(bucket, num_seqs if wide else None, decode)
