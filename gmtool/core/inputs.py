"""Persistent input buffers: one device arena sized for the largest shape, sliced per bucket.

Every field lives in one int64 device tensor, at offsets fixed per bucket key, so copy-in is one host-to-device
copy from a pinned staging arena (captured as the first node of each graph), and a graph captured for a bucket
always reads the same addresses.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gmtool.core.batch import Batch
from gmtool.core.buckets import BucketKey


@dataclass
class StepViews:
    """Slices of the persistent buffers that one bucket's graph reads and writes."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    token_seq: torch.Tensor  # sequence index of each token (-1 for padding)
    logits_indices: torch.Tensor
    kv_lens: torch.Tensor
    cu_q: torch.Tensor
    block_tables: torch.Tensor
    logits: torch.Tensor  # output, outside any graph pool


_TOKEN_PAD = np.array([[0], [0], [0], [-1]], dtype=np.int64)  # padding tokens: id 0, null slot, no sequence


class PersistentInputs:
    """Each bucket key lays its fields out back to back from the arena's start:

        [4 x T token fields][2 x S sequence fields][cu_q: S + 1][block tables: S x blocks_per_seq]

    so copy-in writes two 2-D blocks, cu_q and the block tables, then copies one prefix of the arena. The
    arena is sized for the largest key; a key's views never move, which is all a captured graph needs.
    """

    def __init__(
        self,
        max_tokens: int,
        max_seqs: int,
        blocks_per_seq: int,
        vocab_size: int,
        logits_dtype: torch.dtype,
        device: torch.device,
    ):
        self.max_tokens, self.max_seqs, self.blocks_per_seq = max_tokens, max_seqs, blocks_per_seq
        self.device = device
        size = 4 * max_tokens + 3 * max_seqs + 1 + max_seqs * blocks_per_seq
        pin = device.type == "cuda"
        self.arena = torch.zeros(size, dtype=torch.int64, device=device)
        self.staging = torch.zeros(size, dtype=torch.int64, pin_memory=pin)
        self.host = self.staging.numpy()
        self.logits = torch.zeros(max_seqs, vocab_size, dtype=logits_dtype, device=device)
        self._views: dict[BucketKey, StepViews] = {}
        self._host: dict[BucketKey, tuple] = {}
        self._outputs: dict[tuple, torch.Tensor] = {}
        self._written_key: BucketKey | None = None  # the key whose layout the staging arena holds now,
        self._written: tuple | None = None  # and its last batch's (tokens, seqs, block-table width)
        # the key whose layout the arena holds, whatever its padding: another key's graph would read these
        # fields at its own offsets (positions from token ids, sequence lengths from positions)
        self._layout_key: BucketKey | None = None
        # external: captured into a graph, record() becomes an event-record node, so a graph that copies its
        # own inputs still tells the host when the staging arena may be rewritten
        self._copied = torch.cuda.Event(external=True) if device.type == "cuda" else None

    @property
    def nbytes(self) -> int:
        return self.arena.nbytes + self.logits.nbytes

    def seq_slots(self, key: BucketKey) -> int:
        return key.num_seqs or min(key.num_tokens, self.max_seqs)

    def _layout(self, buf, key: BucketKey):
        """(token block [4, T], sequence block [2, S], cu_q [S + 1], block tables [S, W]) of buf for key."""
        t, s, w = key.num_tokens, self.seq_slots(key), self.blocks_per_seq
        assert t <= self.max_tokens and s <= self.max_seqs, (key, self.max_tokens, self.max_seqs)
        a, b, c = 4 * t, 4 * t + 2 * s, 4 * t + 3 * s + 1
        return buf[:a].reshape(4, t), buf[a:b].reshape(2, s), buf[b:c], buf[c : c + s * w].reshape(s, w)

    def views(self, key: BucketKey) -> StepViews:
        """The same view objects every time for a key: a captured graph holds these addresses."""
        v = self._views.get(key)
        if v is None:
            tok, seq, cu, bt = self._layout(self.arena, key)
            v = StepViews(*tok, *seq, cu, bt, self.logits[: seq.shape[1]])
            self._views[key] = v
        return v

    def output(self, key: BucketKey, num_seqs: int) -> torch.Tensor:
        """The logits rows of a key's first num_seqs sequences (one view per pair, made once)."""
        o = self._outputs.get((key, num_seqs))
        if o is None:
            o = self._outputs[(key, num_seqs)] = self.views(key).logits[:num_seqs]
        return o

    def _host_slots(self, key: BucketKey) -> tuple:
        """Per key, made once: numpy views of the staging arena, and the one copy's source and target."""
        tok, seq, cu, bt = self._layout(self.host, key)
        end = tok.size + seq.size + cu.size + bt.size
        h = (tok, seq, cu, bt, self.arena[:end], self.staging[:end])
        self._host[key] = h
        return h

    def load(self, batch: Batch, key: BucketKey, copy: bool = True) -> StepViews:
        """Write the batch into the staging arena (padding included), then one copy to the device.
        copy=False leaves the copy to a graph that captured copy_in(key) as its first step."""
        tok, seq, cu, bt, _, _ = self._host.get(key) or self._host_slots(key)
        n, b = batch.num_tokens, batch.num_seqs
        if n > key.num_tokens or b > seq.shape[1]:
            raise ValueError(f"batch ({n} tokens, {b} seqs) does not fit key {key}")
        if self._copied is not None:
            self._copied.synchronize()  # the previous copy may still be reading the staging arena
        src = batch.block_table_array
        w = src.shape[1]
        before = self._written if self._written_key is key else None
        self._written_key = self._layout_key = None  # a write that raises part-way leaves nothing to trust
        tok[:, :n] = batch.token_fields
        seq[:, :b] = batch.seq_fields
        cu[: b + 1] = batch.cu_q
        bt[:b, :w] = src
        self._pad(tok, seq, cu, bt, (n, b, w), before)
        self._written_key, self._written, self._layout_key = key, (n, b, w), key
        if copy:
            self.copy_in(key)
        return self.views(key)

    @staticmethod
    def _pad(tok, seq, cu, bt, now: tuple, before: tuple | None) -> None:
        """Padding after the batch's data. All of it when another key wrote the arena last (keys overlap);
        else only what this key's previous batch left beyond the new one (the rest is padding already),
        which is what keeps a steady decode step at four writes."""
        n, b, w = now
        if before is None:
            tok[:, n:] = _TOKEN_PAD
            seq[:, b:] = 0
            cu[b + 1 :] = n
            bt[:b, w:] = 0
            bt[b:] = 0
            return
        n0, b0, w0 = before
        if n0 > n:
            tok[:, n:n0] = _TOKEN_PAD
        if b0 > b:
            seq[:, b:b0] = 0
            bt[b:b0] = 0
        if b0 > b or n0 != n:  # cu_q's tail holds the token count; entries up to b0 held the old cu_q
            cu[b + 1 :] = n
        if w0 > w:
            bt[: min(b, b0), w:w0] = 0

    def staged(self, key: BucketKey) -> tuple:
        """The staging arena's host views of key's fields: (token block [4, T], sequence block [2, S],
        cu_q [S + 1], block tables [S, W]); what the next copy-in of key sends to the device."""
        return (self._host.get(key) or self._host_slots(key))[:4]

    def holds(self, key: BucketKey) -> bool:
        """True when the last load was for key: the arena (and what the last copy-in sent) is in key's layout."""
        return self._layout_key is key or self._layout_key == key

    def invalidate(self) -> None:
        """Forget what the staging arena holds: the next load rewrites all of its key's padding."""
        self._written_key = self._written = None

    def copied_in(self) -> bool:
        """True once the device has run the last copy-in (a graph that copies its inputs has begun)."""
        return self._copied is None or self._copied.query()

    def copy_in(self, key: BucketKey) -> None:
        """Staging to device for key's fields. Captured, it is a memcpy node that reads the pinned staging
        arena at every replay (what the host wrote just before), and an event-record node after it."""
        _, _, _, _, dst, stage = self._host.get(key) or self._host_slots(key)
        dst.copy_(stage, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
