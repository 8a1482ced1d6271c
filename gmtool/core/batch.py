"""One engine step, described on the host: the requests, their tokens, positions and KV placement."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gmtool.core.compositions import Composition, Part
from gmtool.errors import GmtoolError
from gmtool.core.kv_cache import PagedKVCache


@dataclass
class Batch:
    """Host-side description of a step. `plan` is what a host-planned attention consumes."""

    composition: Composition
    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T]
    q_lens: list[int]  # per sequence
    kv_lens: list[int]  # per sequence, the new tokens included
    block_tables: list[list[int]]
    block_table_array: np.ndarray | None = None  # [num_seqs, widest row], zero-padded: what copy-in reads

    def __post_init__(self) -> None:
        self.num_tokens, self.num_seqs = len(self.input_ids), len(self.q_lens)  # read on every replay
        # derived once here, so that copy-in on the replay path only copies arrays
        self.cu_q = np.concatenate([[0], np.cumsum(self.q_lens)]).astype(np.int64)
        self.logits_indices = self.cu_q[1:] - 1  # each sequence's last token: the one an engine samples
        self.token_seq = np.repeat(np.arange(len(self.q_lens)), self.q_lens)
        self.kv_len_array = np.asarray(self.kv_lens, dtype=np.int64)
        # copy-in writes these two blocks whole (gmtool.core.inputs lays the fields out in this order)
        self.token_fields = np.stack([self.input_ids, self.positions, self.slot_mapping, self.token_seq])
        self.seq_fields = np.stack([self.logits_indices, self.kv_len_array])
        self.plan = tuple(zip(self.q_lens, self.kv_lens))
        self.is_decode = all(q == 1 for q in self.q_lens)

    @property
    def blocks(self) -> set[int]:
        """Every KV block the batch's sequences hold (context and new tokens): what another batch beside it must
        not write. Not on the replay path."""
        return {b for table in self.block_tables for b in table}


def make_batch(
    comp: Composition, cache: PagedKVCache, vocab_size: int, max_num_seqs: int, keep=(), run_seed: int = 0
) -> Batch:
    """The step comp describes: seeded token ids, decode contexts and block placement. keep: blocks of another
    batch, which this one's new tokens are not written into (its contexts may read them). run_seed: the run's
    --seed, so that another seed draws other batches of the same mixes (0: the mix's own seed alone)."""
    spec = cache.spec
    if comp.num_seqs > max_num_seqs:
        raise GmtoolError(
            f"composition {comp.label} has {comp.num_seqs} sequences, above --max-num-seqs {max_num_seqs}"
        )
    g = torch.Generator().manual_seed((1000 + comp.seed + 1_000_003 * run_seed) % 2**63)
    q_lens, prefixes = [], []
    for p in comp.parts:
        if p.prefix is not None:
            drawn = [p.prefix] * p.count
        elif p.new_tokens == 1:  # one draw of count values: the stream of count draws of one (CPU generator)
            drawn = torch.randint(1, spec.max_kv_len, (p.count,), generator=g).tolist()
        else:
            drawn = [0] * p.count
        for prefix in drawn:
            if prefix + p.new_tokens > spec.max_kv_len:
                raise GmtoolError(
                    f"composition {comp.label}: prefix {prefix} + {p.new_tokens} new tokens exceeds "
                    f"--max-kv-len {spec.max_kv_len}"
                )
        q_lens += [p.new_tokens] * p.count
        prefixes += drawn
    kv_lens = [p + q for p, q in zip(prefixes, q_lens)]
    tables = cache.allocate(kv_lens, g, (set(keep), prefixes) if keep else None)
    # per token, without a loop over sequences: its sequence, its position, its slot through the block table
    token_seq = np.repeat(np.arange(len(q_lens)), q_lens)
    starts = np.cumsum(q_lens) - np.asarray(q_lens)
    positions = np.arange(len(token_seq)) - starts[token_seq] + np.asarray(prefixes, dtype=np.int64)[token_seq]
    table_array = np.zeros((len(tables), max(len(t) for t in tables)), dtype=np.int64)
    for i, t in enumerate(tables):
        table_array[i, : len(t)] = t
    bs = spec.block_size
    slots = table_array[token_seq, positions // bs] * bs + positions % bs
    ids = torch.randint(0, vocab_size, (len(positions),), generator=g).numpy()
    return Batch(
        comp,
        ids.astype(np.int64),
        positions.astype(np.int64),
        slots.astype(np.int64),
        q_lens,
        kv_lens,
        tables,
        table_array,
    )


def sibling_of(batch: Batch, fewer: bool = True) -> Composition:
    """Another mix for batch's graph key, to capture that key from, so that no row is checked on the very batch
    its graph was captured from: a graph that froze a host value of its capture batch (a count of sequences or
    tokens, a context length, a table width, a block) then fails its first check. Prefill and mixed: the longest
    and shortest chunks evened out (the same sequences), their cached prefixes dropped; decode contexts halved;
    fewer: one sequence fewer (decode) or one token fewer (prefill), as the caller checks the key still takes.
    Its blocks are placed anew (another seed), so even a one-token prefill's sibling differs in its block table
    and slots."""
    q = list(batch.q_lens)
    prefix = [kv - n for kv, n in zip(batch.kv_lens, q)]
    if not batch.is_decode and len(q) > 1:
        i, j = int(np.argmax(q)), int(np.argmin(q))
        j = j if j != i else len(q) - 1 - i  # all alike: two of them, unevened
        d = max(1, (q[i] - q[j]) // 2)
        if q[i] - d >= 1:
            q[i], q[j] = q[i] - d, q[j] + d
    if fewer and batch.is_decode and len(q) > 1:
        q, prefix = q[:-1], prefix[:-1]
    elif fewer and not batch.is_decode and max(q) > 1:
        q[int(np.argmax(q))] -= 1
    # decode contexts halved; a chunk's cached prefix dropped: a graph that froze "no sequence has a cached
    # prefix" (a fresh-prefill fast path) then meets a mix that has one
    prefix = [p // 2 if n == 1 else 0 for n, p in zip(q, prefix)]
    parts = tuple(Part(n, 1, p) for n, p in zip(q, prefix))
    own = "+".join(f"{n}@{p}" if p or n == 1 else str(n) for n, p in zip(q, prefix))  # 1 alone: a random context
    if len(parts) > 6:  # a decode bucket's: hundreds of contexts
        own = f"{len(q)} sequences, {sum(q)} tokens, contexts {min(prefix)}-{max(prefix)}"
    comp = batch.composition
    return Composition(parts, comp.bucket, comp.seed + 7919, f"{own} (sibling of {comp.label})")
