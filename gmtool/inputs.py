"""Persistent input buffers: one device arena sized for the largest shape, sliced per bucket.

Every field lives at a fixed offset of one int64 device tensor, so copy-in is one host-to-device copy from a
pinned staging arena, and a graph captured for a bucket always reads the same addresses.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gmtool.batch import Batch
from gmtool.buckets import BucketKey


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

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seq_slots(self) -> int:
        return self.kv_lens.shape[0]


class PersistentInputs:
    def __init__(self, max_tokens: int, max_seqs: int, blocks_per_seq: int, vocab_size: int,
                 logits_dtype: torch.dtype, device: torch.device):
        self.max_tokens, self.max_seqs, self.blocks_per_seq = max_tokens, max_seqs, blocks_per_seq
        self.device = device
        sizes = {
            "input_ids": max_tokens, "positions": max_tokens, "slot_mapping": max_tokens,
            "token_seq": max_tokens, "logits_indices": max_seqs, "kv_lens": max_seqs,
            "cu_q": max_seqs + 1, "block_tables": max_seqs * blocks_per_seq,
        }
        self.offsets, at = {}, 0
        for name, n in sizes.items():
            self.offsets[name] = (at, n)
            at += n
        pin = device.type == "cuda"
        self.arena = torch.zeros(at, dtype=torch.int64, device=device)
        self.staging = torch.zeros(at, dtype=torch.int64, pin_memory=pin)
        self.host = self.staging.numpy()
        self.logits = torch.zeros(max_seqs, vocab_size, dtype=logits_dtype, device=device)
        self._views: dict[BucketKey, StepViews] = {}
        self._copied = torch.cuda.Event() if device.type == "cuda" else None

    @property
    def nbytes(self) -> int:
        return self.arena.nbytes + self.logits.nbytes

    def seq_slots(self, key: BucketKey) -> int:
        return key.num_seqs or min(key.num_tokens, self.max_seqs)

    def _field(self, buf, name: str, n: int):
        at, cap = self.offsets[name]
        assert n <= cap, (name, n, cap)
        return buf[at:at + n]

    def views(self, key: BucketKey) -> StepViews:
        """The same view objects every time for a key: a captured graph holds these addresses."""
        v = self._views.get(key)
        if v is None:
            t, s = key.num_tokens, self.seq_slots(key)
            f = lambda name, n: self._field(self.arena, name, n)  # noqa: E731
            v = StepViews(f("input_ids", t), f("positions", t), f("slot_mapping", t), f("token_seq", t),
                          f("logits_indices", s), f("kv_lens", s), f("cu_q", s + 1),
                          f("block_tables", s * self.blocks_per_seq).view(s, self.blocks_per_seq),
                          self.logits[:s])
            self._views[key] = v
        return v

    def load(self, batch: Batch, key: BucketKey) -> StepViews:
        """Write the batch into the staging arena (padding zeroed), then one copy to the device."""
        t, s = key.num_tokens, self.seq_slots(key)
        n, b = batch.num_tokens, batch.num_seqs
        assert n <= t and b <= s, f"batch ({n} tokens, {b} seqs) does not fit key {key}"
        if self._copied is not None:
            self._copied.synchronize()  # the previous copy may still be reading the staging arena
        h = lambda name, k: self._field(self.host, name, k)  # noqa: E731
        for name, src in (("input_ids", batch.input_ids), ("positions", batch.positions),
                          ("slot_mapping", batch.slot_mapping)):
            dst = h(name, t)
            dst[:n] = src
            dst[n:] = 0
        tok = h("token_seq", t)
        tok[:n] = batch.token_seq
        tok[n:] = -1
        li = h("logits_indices", s)
        li[:b] = batch.logits_indices
        li[b:] = 0
        kv = h("kv_lens", s)
        kv[:b] = batch.kv_lens
        kv[b:] = 0
        cu = h("cu_q", s + 1)
        cu[:b + 1] = batch.cu_q
        cu[b + 1:] = n
        bt = h("block_tables", s * self.blocks_per_seq).reshape(s, self.blocks_per_seq)
        bt[:] = 0
        src = batch.block_table_array
        bt[:b, :src.shape[1]] = src
        end = self.offsets["block_tables"][0] + s * self.blocks_per_seq
        self.arena[:end].copy_(self.staging[:end], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        return self.views(key)
