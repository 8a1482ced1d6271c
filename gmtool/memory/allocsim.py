"""A simulator of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp) for allocations into CUDA
graph private pools, and the memory predictor built on it.

The rules, at torch's defaults (max_split_size unlimited, no roundup_power2_divisions, expandable segments off):
- a request is rounded up to a multiple of kMinBlockSize (512 B), at least 512 (round_size);
- rounded sizes up to kSmallSize (1 MiB) go to the pool's small blocks, larger ones to its large blocks;
- a request no free block fits gets a new segment (cudaMalloc) of get_allocation_size: 2 MiB (kSmallBuffer) for
  a small one, 20 MiB (kLargeBuffer) below kMinLargeAlloc (10 MiB), else the size rounded up to 2 MiB;
- best fit: the free block of the smallest size >= the request, lowest address among equal sizes (the block
  set is ordered by (stream, size, address); a capture allocates on one stream);
- the chosen block is split when what remains is >= 512 B (small) or > 1 MiB (large) (should_split); else the
  whole block is handed out;
- a freed block merges with its free neighbours in the segment (try_merge_blocks) and goes back to its pool;
  a block freed during a capture (no other stream used it) is reusable within the same capture;
- a private pool never gives segments back while a graph captured into it lives: what it holds is the sum of
  its segments, the high-water mark of its captures' fragmentation.
The oversize rules (max_split_size) never apply at the default; `AllocatorConfig` keeps them for completeness.

Input: per capture, its events from gmtool.memory.alloctrace ([code, addr, size, pool]: "a" alloc of `size`
requested bytes at addr, "f" free of the block at addr, "S" a segment). A capture's `Program` is the same list
with block ids instead of addresses: ("a", size) allocates the next id, ("f", id) frees one.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

K_MIN_BLOCK = 512
K_SMALL_SIZE = 1 << 20
K_SMALL_BUFFER = 2 << 20
K_LARGE_BUFFER = 20 << 20
K_MIN_LARGE_ALLOC = 10 << 20
K_ROUND_LARGE = 2 << 20
UNLIMITED = (1 << 64) - 1  # max_split_size's default (SIZE_MAX)


@dataclass(frozen=True)
class AllocatorConfig:
    max_split_size: int = UNLIMITED


DEFAULT = AllocatorConfig()
CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
HARMLESS_OPTIONS = ("release_lock_on_cudamalloc", "pinned_", "graph_capture_record_stream_reuse")  # no effect on pools


def unmodeled_settings(environ=None) -> list[str]:
    """The allocator options set in the environment that change what the simulator assumes (the defaults):
    max_split_size_mb, roundup_power2_divisions, expandable_segments, garbage_collection_threshold, ..."""
    import os

    env = os.environ if environ is None else environ
    out = []
    for var in CONF_VARS:
        for item in (env.get(var) or "").split(","):
            name = item.split(":")[0].strip()
            if name and not name.startswith(HARMLESS_OPTIONS):
                value = item.split(":", 1)[1].strip() if ":" in item else ""
                if not (name == "expandable_segments" and value.lower() == "false"):
                    out.append(f"{var}={item.strip()}")
    return out


def round_size(size: int) -> int:
    if size < K_MIN_BLOCK:
        return K_MIN_BLOCK
    return K_MIN_BLOCK * ((size + K_MIN_BLOCK - 1) // K_MIN_BLOCK)


def allocation_size(size: int) -> int:
    """The segment cudaMalloc'd for a rounded request no free block fits (get_allocation_size)."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return K_ROUND_LARGE * ((size + K_ROUND_LARGE - 1) // K_ROUND_LARGE)


@dataclass(eq=False)
class Block:
    addr: int
    size: int
    small: bool
    allocated: bool = False
    requested: int = 0
    prev: "Block | None" = None
    next: "Block | None" = None


class BlockPool:
    """Free blocks of one kind (small or large), ordered by (size, address)."""

    def __init__(self, small: bool):
        self.small = small
        self.keys: list[tuple[int, int]] = []
        self.blocks: dict[tuple[int, int], Block] = {}

    def insert(self, b: Block) -> None:
        k = (b.size, b.addr)
        bisect.insort(self.keys, k)
        self.blocks[k] = b

    def remove(self, b: Block) -> None:
        k = (b.size, b.addr)
        i = bisect.bisect_left(self.keys, k)
        assert i < len(self.keys) and self.keys[i] == k, "free block missing from its pool"
        del self.keys[i]
        del self.blocks[k]

    def best_fit(self, size: int) -> Block | None:
        i = bisect.bisect_left(self.keys, (size, -1))
        return self.blocks[self.keys[i]] if i < len(self.keys) else None


class PrivatePool:
    """One graph private pool: its small and large free blocks and its segments (never released)."""

    def __init__(self, config: AllocatorConfig = DEFAULT, addresses=None):
        """addresses: an iterator of segment addresses to use (a recorded run's, to compare block addresses);
        default: consecutive, as if cudaMalloc handed out fresh address space in order."""
        self.config = config
        self.small, self.large = BlockPool(True), BlockPool(False)
        self.segments: list[tuple[int, int]] = []  # (addr, size)
        self._addresses = addresses
        self._next = 1 << 40

    @property
    def reserved_bytes(self) -> int:
        return sum(s for _, s in self.segments)

    def _new_address(self, size: int) -> int:
        if self._addresses is not None:
            got = next(self._addresses, None)
            if got is not None:
                return got
        a = self._next
        self._next += size + K_SMALL_BUFFER  # a gap: no two segments touch (they never merge anyway)
        return a

    def malloc(self, requested: int) -> Block:
        size = round_size(requested)
        small = size <= K_SMALL_SIZE
        pool = self.small if small else self.large
        block = self._get_free_block(pool, size)
        if block is None:
            seg = allocation_size(size)
            block = Block(self._new_address(seg), seg, small)
            self.segments.append((block.addr, seg))
        else:
            pool.remove(block)
        if self._should_split(block, size):
            rest = Block(block.addr + size, block.size - size, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            pool.insert(rest)
        block.allocated, block.requested = True, requested
        return block

    def free(self, block: Block) -> None:
        assert block.allocated, "double free"
        block.allocated = False
        pool = self.small if block.small else self.large
        for other in (block.prev, block.next):
            if other is not None and not other.allocated:
                pool.remove(other)
                if other is block.prev:  # [other block]
                    block.addr, block.prev = other.addr, other.prev
                    if block.prev is not None:
                        block.prev.next = block
                else:  # [block other]
                    block.next = other.next
                    if block.next is not None:
                        block.next.prev = block
                block.size += other.size
        pool.insert(block)

    def _get_free_block(self, pool: BlockPool, size: int) -> Block | None:
        b = pool.best_fit(size)
        if b is None:
            return None
        mss = self.config.max_split_size
        if size < mss and b.size >= mss:  # no oversize block for a small-enough request
            return None
        if size >= mss and b.size >= size + K_LARGE_BUFFER:  # an oversize one only within 20 MiB of the request
            return None
        return b

    def _should_split(self, block: Block, size: int) -> bool:
        remaining = block.size - size
        if block.small:
            return remaining >= K_MIN_BLOCK
        return size < self.config.max_split_size and remaining > K_SMALL_SIZE


# -- programs: a capture's events with block ids -------------------------------------------------------------
@dataclass
class Program:
    """A capture's allocations and frees in order: ("a", requested bytes) allocates the next block id (0, 1,
    ...); ("f", id) frees block id; ("f", ("ext", n)) frees a block an earlier capture of the pool made, n-th
    of those still alive in the pool (what a pool inherits: rare)."""

    bucket: int | None
    ops: list[tuple] = field(default_factory=list)

    @property
    def signature(self) -> tuple:
        """The structure without the sizes: programs of equal signature interpolate op by op."""
        return tuple(op if op[0] == "f" else ("a",) for op in self.ops)

    @property
    def alloc_sizes(self) -> list[int]:
        return [op[1] for op in self.ops if op[0] == "a"]

    def with_sizes(self, sizes: list[int], bucket: int | None) -> "Program":
        it = iter(sizes)
        return Program(bucket, [("a", next(it)) if op[0] == "a" else op for op in self.ops])


def programs_of(captures: list[dict]) -> list[Program]:
    """Each capture's Program (its events, then its `after` events), from one pool's captures in order. A free
    of a block an earlier capture made becomes ("f", ("ext", bucket of that capture, its id there))."""
    out, owner = [], {}  # addr -> (capture index, block id) of the live block there
    for ci, c in enumerate(captures):
        p, n = Program(c.get("bucket")), 0
        for code, addr, size, *_ in list(c.get("events", [])) + list(c.get("after", [])):
            if code == "a":
                owner[addr] = (ci, n)
                p.ops.append(("a", size))
                n += 1
            elif code == "f" and addr in owner:
                src, bid = owner.pop(addr)
                p.ops.append(("f", bid) if src == ci else ("f", ("ext", src, bid)))
        out.append(p)
    return out


@dataclass
class SimResult:
    total_bytes: int  # the segments of every pool
    pool_bytes: list[int]  # per pool
    after_capture: list[int]  # per program, in run order: its pool's bytes once it ran


def run_programs(
    programs: list[Program], pools_of: list[int], config: AllocatorConfig = DEFAULT, addresses: dict | None = None
) -> SimResult:
    """Simulate programs in order, program i into pool pools_of[i] (pools made on first use). addresses: per
    pool, the segment addresses to hand out in order (a recorded run's; default: consecutive ones). Only the
    order of addresses matters: best fit breaks ties between equal free blocks by the lowest address."""
    pools: dict[int, PrivatePool] = {}
    live: dict[tuple, Block] = {}  # (program index, block id) -> block
    after = []
    for pi, (prog, pid) in enumerate(zip(programs, pools_of)):
        pool = pools.get(pid)
        if pool is None:
            got = (addresses or {}).get(pid)
            pool = pools[pid] = PrivatePool(config, iter(got) if got is not None else None)
        n = 0
        for op in prog.ops:
            if op[0] == "a":
                live[(pi, n)] = pool.malloc(op[1])
                n += 1
            else:
                ref = op[1]
                key = (ref[1], ref[2]) if isinstance(ref, tuple) else (pi, ref)
                b = live.pop(key, None)
                if b is not None:
                    pool.free(b)
        after.append(pool.reserved_bytes)
    per = [pools[k].reserved_bytes for k in sorted(pools)]
    return SimResult(sum(per), per, after)


def segment_addresses(captures: list[dict]) -> dict[int, list[int]]:
    """Per pool ordinal, the addresses of the segments its captures cudaMalloc'd, in order."""
    out: dict[int, list[int]] = {}
    for c in captures:
        out.setdefault(c["pool"], []).extend(a for code, a, *_ in c.get("events", []) if code == "S")
    return out


def replay_recorded(data: dict, config: AllocatorConfig = DEFAULT, real_addresses: bool = True) -> SimResult:
    """The full replay of a recorded strategy run (gmtool.memory.alloctrace: data["captures"] in capture order,
    each with its pool ordinal): every capture's own events, into its own pool; new segments get the recorded
    segments' addresses in order (real_addresses), else consecutive ones, as the predictor gives them."""
    caps = data.get("captures", [])
    by_pool: dict[int, list[int]] = {}
    for i, c in enumerate(caps):
        by_pool.setdefault(c["pool"], []).append(i)
    programs: list[Program | None] = [None] * len(caps)
    for idx in by_pool.values():  # block ids per pool: a free in one pool refers to that pool's earlier blocks
        for i, p in zip(idx, programs_of([caps[i] for i in idx])):
            programs[i] = p
    # "ext" frees name the capture index within the pool: map them to the run's program index
    for idx in by_pool.values():
        for i in idx:
            programs[i].ops = [
                ("f", ("ext", idx[op[1][1]], op[1][2])) if op[0] == "f" and isinstance(op[1], tuple) else op
                for op in programs[i].ops
            ]
    addrs = segment_addresses(caps) if real_addresses else None
    return run_programs(programs, [c["pool"] for c in caps], config, addrs)


def check_replay(data: dict, config: AllocatorConfig = DEFAULT) -> dict:
    """The full replay against the recorded run, event by event: each pool simulated with the recorded segment
    addresses, every allocation's address and every segment's size compared. exact: no difference at all;
    else the first differences and the per-capture pool bytes that differ."""
    caps = data.get("captures", [])
    pools: dict[int, PrivatePool] = {}
    seg_addrs = segment_addresses(caps)
    live: dict[tuple[int, int], Block] = {}  # (pool, real addr) -> simulated block
    first, n_diff, per_capture = [], 0, []
    for ci, c in enumerate(caps):
        pid = c["pool"]
        pool = pools.get(pid)
        if pool is None:
            pool = pools[pid] = PrivatePool(config, iter(seg_addrs.get(pid, [])))
        nseg = len(pool.segments)
        for ei, (code, addr, size, *_) in enumerate(list(c.get("events", [])) + list(c.get("after", []))):
            if code == "a":
                b = pool.malloc(size)
                live[(pid, addr)] = b
                if b.addr != addr:
                    n_diff += 1
                    if len(first) < 5:
                        first.append(
                            {
                                "capture": ci,
                                "bucket": c.get("bucket"),
                                "event": ei,
                                "size": size,
                                "real": addr,
                                "sim": b.addr,
                            }
                        )
            elif code == "f":
                b = live.pop((pid, addr), None)
                if b is not None:
                    pool.free(b)
        real_segs = [s for code, _, s, *_ in c.get("events", []) if code == "S"]
        sim_segs = [s for _, s in pool.segments[nseg:]]
        if real_segs != sim_segs or pool.reserved_bytes != c.get("pool_bytes"):
            per_capture.append(
                {
                    "capture": ci,
                    "bucket": c.get("bucket"),
                    "real_segments": real_segs,
                    "sim_segments": sim_segs,
                    "real_pool_bytes": c.get("pool_bytes"),
                    "sim_pool_bytes": pool.reserved_bytes,
                }
            )
    return {
        "exact": n_diff == 0 and not per_capture,
        "address_differences": n_diff,
        "first_address_differences": first,
        "captures_differing": len(per_capture),
        "first_captures_differing": per_capture[:5],
    }


# -- the predictor ---------------------------------------------------------------------------------------------
def captures_of(data: dict, buckets) -> list[dict]:
    """The recorded captures of the given buckets, in the run's order."""
    want = set(buckets)
    return [c for c in data.get("captures", []) if c.get("bucket") in want]


def _tokens(p: Program) -> tuple[list, list[int | None]]:
    """The program as tokens that survive requests added or removed elsewhere, and per token the allocation's
    index (None for a free). An allocation is ("a", its bytes per token as a power of two): a request of the
    same role in another bucket has the same, as most sizes are proportional to the tokens; a free is ("f", r),
    of the r-th most recent live block."""
    live: list[int] = []
    toks, index, n = [], [], 0
    per = max(1, p.bucket or 1)
    for op in p.ops:
        if op[0] == "a":
            toks.append(("a", round(math.log2(max(op[1], 1) / per))))
            index.append(n)
            live.append(n)
            n += 1
            continue
        index.append(None)
        bid = op[1]
        if isinstance(bid, tuple) or bid not in live:
            toks.append(("f", "ext"))
            continue
        toks.append(("f", len(live) - 1 - live.index(bid)))
        live.remove(bid)
    return toks, index


def aligned_sizes(base: Program, other: Program) -> list[int | None]:
    """For each allocation of base, the size of the allocation matching it in other (None where other has no
    counterpart): the programs aligned as token sequences, matched along a longest common subsequence."""
    if base.signature == other.signature:
        return list(other.alloc_sizes)
    tb, ib = _tokens(base)
    to, io = _tokens(other)
    sizes = other.alloc_sizes
    out: list[int | None] = [None] * len(base.alloc_sizes)
    for i, j in common_pairs(tb, to):
        if ib[i] is not None:
            out[ib[i]] = sizes[io[j]]
    return out


MAX_EDITS = 2000  # programs further apart than this many insertions and deletions are not aligned


def common_pairs(a: list, b: list, max_edits: int = MAX_EDITS) -> list[tuple[int, int]]:
    """(i, j) of a longest common subsequence of a and b (Myers' O((N+M)D) shortest edit script: fast when
    the two differ in a few requests, as buckets of one model do); [] when they differ in more than max_edits."""
    n, m = len(a), len(b)
    v = {1: 0}
    trace = []
    for d in range(min(n + m, max_edits) + 1):
        trace.append(dict(v))
        for k in range(-d, d + 1, 2):
            x = v[k + 1] if k == -d or (k != d and v[k - 1] < v[k + 1]) else v[k - 1] + 1
            y = x - k
            while x < n and y < m and a[x] == b[y]:
                x, y = x + 1, y + 1
            v[k] = x
            if x >= n and y >= m:
                return _backtrack(trace, n, m)
    return []


def _backtrack(trace: list[dict], x: int, y: int) -> list[tuple[int, int]]:
    pairs = []
    for d in range(len(trace) - 1, -1, -1):
        v, k = trace[d], x - y
        pk = k + 1 if k == -d or (k != d and v[k - 1] < v[k + 1]) else k - 1
        px = v[pk]
        py = px - pk
        while x > px and y > py:
            x, y = x - 1, y - 1
            pairs.append((x, y))
        x, y = px, py
    return pairs[::-1]


@dataclass(frozen=True)
class Interpolated:
    """How a bucket's program was made where the samples around it differ in structure (else None)."""

    near: int  # the sample whose events it has
    lo: int | None
    hi: int | None
    across: int  # requests on the line to their match in the sample on the other side
    beyond: int  # on the line through their match in another sample
    scaled: int  # no match anywhere: scaled by the token ratio

    def note(self, buckets: list[int]) -> str:
        n = self.across + self.beyond + self.scaled
        return (
            f"bucket{'s' if len(buckets) > 1 else ''} {_spans(buckets)}: samples {self.lo} and {self.hi} differ in "
            f"structure: bucket {self.near}'s events, of its {n} requests {self.across} on the line to their match "
            f"across, {self.beyond} through a match in another sample, {self.scaled} scaled by the tokens"
        )


def _spans(xs: list[int]) -> str:
    return ", ".join(map(str, xs)) if len(xs) <= 4 else f"{xs[0]}, {xs[1]}, ..., {xs[-1]} ({len(xs)})"


def interpolate(programs: dict[int, Program], bucket: int) -> tuple[Program, Interpolated | None]:
    """bucket's Program from the sampled ones around it. Equal structure on both sides: each allocation's size on
    the line between them (the allocator rounds it when simulated). Else the nearest sample's events, each
    request on the line to its match (aligned_sizes) in the sample across the bucket, else through its match
    in the nearest other sample, else scaled by the token ratio; the Interpolated says how many of each."""
    if bucket in programs:
        return programs[bucket], None
    ks = sorted(programs)
    lo = max((k for k in ks if k < bucket), default=None)
    hi = min((k for k in ks if k > bucket), default=None)
    if lo is not None and hi is not None and programs[lo].signature == programs[hi].signature:
        a, b, t = programs[lo].alloc_sizes, programs[hi].alloc_sizes, (bucket - lo) / (hi - lo)
        return programs[lo].with_sizes([round(x + (y - x) * t) for x, y in zip(a, b)], bucket), None
    near = min((k for k in (lo, hi) if k is not None), key=lambda k: (abs(k - bucket), k))
    far = hi if near == lo else lo
    base = programs[near]
    matches = {k: aligned_sizes(base, programs[k]) for k in ks if k != near}
    sizes, counts = [], {"across": 0, "beyond": 0, "scaled": 0}
    for i, s in enumerate(base.alloc_sizes):
        cands = [k for k in matches if matches[k][i] is not None]
        if cands:
            k = min(cands, key=lambda k: (k != far, abs(k - bucket)))
            counts["across" if k == far else "beyond"] += 1
            sizes.append(max(1, round(s + (matches[k][i] - s) * (bucket - near) / (k - near))))
        else:
            counts["scaled"] += 1
            sizes.append(max(1, round(s * bucket / near)))
    return base.with_sizes(sizes, bucket), Interpolated(near, lo, hi, **counts)


@dataclass
class StrategyPrediction:
    strategy: str
    total_bytes: int
    order: list[int]
    notes: list[str]
    per_bucket_pool_bytes: list[int]  # the pool holding each bucket, once it was captured (run order)


ORDERS = {"independent": "descending", "shared": "descending", "shared-ascending": "ascending"}
SEPARATE_POOLS = {"independent"}


def predict_strategy(strategy: str, sampled: list[dict], buckets, order: str | None = None) -> StrategyPrediction:
    """A strategy's pool bytes over `buckets`, from its sampled captures' traces: every bucket's Program (the
    sampled ones as recorded, the others interpolated), run in the strategy's order (order: ascending |
    descending, default the strategy's) into its pools."""
    if strategy not in ORDERS:
        raise ValueError(f"the allocator simulator does not model strategy {strategy!r}")
    if not sampled:
        raise ValueError(f"{strategy}: no sampled capture has traces")
    progs, notes = {}, []
    for c in sampled:  # each capture on its own: what it frees of other captures' blocks is left out
        p = programs_of([c])[0]
        ext = sum(1 for op in p.ops if op[0] == "f" and isinstance(op[1], tuple))
        if ext:
            notes.append(f"bucket {c['bucket']}: {ext} frees of blocks earlier captures made were left out")
        p.ops = [op for op in p.ops if not (op[0] == "f" and isinstance(op[1], tuple))]
        progs[c["bucket"]] = p
    order = sorted(set(buckets), reverse=(order or ORDERS[strategy]) != "ascending")
    run, how = [], {}
    for b in order:
        p, made = interpolate(progs, b)
        run.append(p)
        if made is not None:
            how.setdefault(made, []).append(b)
    notes += [made.note(sorted(bs)) for made, bs in how.items()]
    pools = list(range(len(run))) if strategy in SEPARATE_POOLS else [0] * len(run)
    res = run_programs(run, pools)
    return StrategyPrediction(strategy, res.total_bytes, order, notes, res.after_capture)
