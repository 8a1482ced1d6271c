"""An engine-like scheduler: requests arrive with prompts, prefill in chunks, decode and finish; their KV blocks
are freed and handed to the next request first (last freed, first reused), as engines' free lists do.

Each step is one Batch: decodes first, then prefill chunks, within a token budget (the largest bucket) and a
sequence cap. Token ids are drawn from the seed, not sampled from logits, so the workload does not depend on
the graph under test: the same seed gives the same steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from gmtool.core.batch import Batch
from gmtool.core.compositions import Composition, Part


@dataclass
class Request:
    rid: int
    tokens: list[int]  # the prompt, then one token per decode step
    prompt_len: int
    max_new: int
    computed: int = 0  # tokens whose K/V is in the cache
    blocks: list[int] = field(default_factory=list)

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len


@dataclass
class Workload:
    """The shape of the traffic; every draw comes from the seed."""

    token_budget: int  # tokens per step (the largest bucket)
    max_seqs: int
    max_kv_len: int
    arrival_p: float = 0.35  # chance that a request arrives at a step (a second one: its square)
    max_prompt: int | None = None  # default: half the longest context
    max_new: int | None = None  # default: a quarter of it

    def __post_init__(self) -> None:
        self.max_prompt = self.max_prompt or max(1, self.max_kv_len // 2)
        self.max_new = self.max_new or max(1, self.max_kv_len // 4)
        self.max_new = min(self.max_new, self.max_kv_len - 1)
        self.max_prompt = min(self.max_prompt, self.max_kv_len - self.max_new)


class Scheduler:
    def __init__(self, work: Workload, num_blocks: int, block_size: int, vocab_size: int, seed: int):
        self.work, self.block_size, self.vocab = work, block_size, vocab_size
        self.rng = np.random.default_rng(seed)
        self.free = [int(b) for b in self.rng.permutation(np.arange(1, num_blocks))]  # block 0: the null block
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.scheduled: list[tuple[Request, int]] = []  # this step's (request, new tokens)
        self.next_id = 0
        self.finished = 0
        self.reused_blocks = 0  # blocks handed out again after a request freed them
        self._ever_used: set[int] = set()

    # -- one step ---------------------------------------------------------------------------------------
    def next_batch(self) -> Batch:
        self._arrivals()
        while True:
            self.scheduled = self._schedule()
            if self.scheduled:
                return self._batch()
            self._arrive()  # an idle engine: the next request arrives now

    def commit(self) -> None:
        """The step ran: advance its requests, sample one token for each that caught up, free finished ones."""
        for r, q in self.scheduled:
            r.computed += q
            if r.computed < len(r.tokens):
                continue  # more of its prompt to prefill
            if r.generated >= r.max_new:
                self._finish(r)
            else:
                r.tokens.append(int(self.rng.integers(self.vocab)))
        self.scheduled = []

    def live(self) -> list[tuple[list[int], int]]:
        """(blocks, tokens held in the cache once this step ran) of every request holding blocks."""
        this = {id(r): q for r, q in self.scheduled}
        return [(r.blocks, r.computed + this.get(id(r), 0)) for r in self.running if r.blocks]

    # -- internals --------------------------------------------------------------------------------------
    def _arrivals(self) -> None:
        for _ in range(2):
            if self.rng.random() < self.work.arrival_p:
                self._arrive()

    def _arrive(self) -> None:
        w = self.work
        n = int(self.rng.integers(1, w.max_prompt + 1))
        self.waiting.append(
            Request(
                self.next_id,
                [int(t) for t in self.rng.integers(self.vocab, size=n)],
                n,
                int(self.rng.integers(1, w.max_new + 1)),
            )
        )
        self.next_id += 1

    def _schedule(self) -> list[tuple[Request, int]]:
        budget, out = self.work.token_budget, []
        decodes = [r for r in self.running if len(r.tokens) - r.computed == 1]
        chunks = [r for r in self.running if len(r.tokens) - r.computed > 1]
        for r in decodes + chunks:
            if len(out) == self.work.max_seqs or budget == 0:
                break
            q = min(len(r.tokens) - r.computed, budget)
            if self._reserve(r, r.computed + q):
                out.append((r, q))
                budget -= q
        while self.waiting and len(out) < self.work.max_seqs and budget > 0:
            r = self.waiting[0]
            q = min(len(r.tokens), budget)
            if not self._reserve(r, q):
                break  # no free blocks: it waits for a request to finish
            self.running.append(self.waiting.pop(0))
            out.append((r, q))
            budget -= q
        return out

    def _reserve(self, r: Request, tokens: int) -> bool:
        need = math.ceil(tokens / self.block_size) - len(r.blocks)
        if need > len(self.free):
            return False
        for _ in range(need):
            b = self.free.pop()
            self.reused_blocks += b in self._ever_used
            self._ever_used.add(b)
            r.blocks.append(b)
        return True

    def _finish(self, r: Request) -> None:
        self.running.remove(r)
        self.free.extend(reversed(r.blocks))  # the last freed is the first handed out again
        r.blocks = []
        self.finished += 1

    def _batch(self) -> Batch:
        bs = self.block_size
        ids, pos, slots, q_lens, kv_lens, tables, parts = [], [], [], [], [], [], []
        for r, q in self.scheduled:
            p = np.arange(r.computed, r.computed + q)
            ids.append(np.asarray(r.tokens[r.computed : r.computed + q], dtype=np.int64))
            pos.append(p)
            slots.append(np.asarray(r.blocks, dtype=np.int64)[p // bs] * bs + p % bs)
            q_lens.append(q)
            kv_lens.append(r.computed + q)
            tables.append(list(r.blocks))
            parts.append(Part(q, 1, r.computed))
        width = max(len(t) for t in tables)
        table_array = np.zeros((len(tables), width), dtype=np.int64)
        for i, t in enumerate(tables):
            table_array[i, : len(t)] = t
        comp = Composition(tuple(parts), text=_label(q_lens))
        return Batch(
            comp,
            np.concatenate(ids),
            np.concatenate(pos).astype(np.int64),
            np.concatenate(slots).astype(np.int64),
            q_lens,
            kv_lens,
            tables,
            table_array,
        )


def _label(q_lens: list[int]) -> str:
    """'1*5+12+3': five decodes, then chunks of 12 and 3 tokens."""
    decodes = sum(q == 1 for q in q_lens)
    parts = ([f"1*{decodes}" if decodes > 1 else "1"] if decodes else []) + [str(q) for q in q_lens if q > 1]
    return "+".join(parts)
