"""Persistent input buffers: one device arena sized for the largest shape, sliced per bucket.

Every field lives at a fixed offset of one int64 device tensor, so copy-in is one host-to-device copy from a
pinned staging arena, and a graph captured for a bucket always reads the same addresses.
"""
from __future__ import annotations

from dataclasses import dataclass

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
        self._host: dict[BucketKey, dict] = {}
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

    def _host_slots(self, key: BucketKey) -> dict:
        """Per key, made once: numpy views of the staging arena, and the one copy's source and target."""
        t, s = key.num_tokens, self.seq_slots(key)
        h = {name: self._field(self.host, name, n) for name, n in (
            ("input_ids", t), ("positions", t), ("slot_mapping", t), ("token_seq", t),
            ("logits_indices", s), ("kv_lens", s), ("cu_q", s + 1))}
        h["block_tables"] = self._field(self.host, "block_tables", s * self.blocks_per_seq).reshape(s, -1)
        end = self.offsets["block_tables"][0] + s * self.blocks_per_seq
        h["copy"] = (self.arena[:end], self.staging[:end])
        self._host[key] = h
        return h

    def load(self, batch: Batch, key: BucketKey) -> StepViews:
        """Write the batch into the staging arena (padding zeroed), then one copy to the device."""
        h = self._host.get(key) or self._host_slots(key)
        n, b = batch.num_tokens, batch.num_seqs
        if n > key.num_tokens or b > len(h["kv_lens"]):
            raise ValueError(f"batch ({n} tokens, {b} seqs) does not fit key {key}")
        if self._copied is not None:
            self._copied.synchronize()  # the previous copy may still be reading the staging arena
        for name, src, pad in (("input_ids", batch.input_ids, 0), ("positions", batch.positions, 0),
                               ("slot_mapping", batch.slot_mapping, 0), ("token_seq", batch.token_seq, -1),
                               ("logits_indices", batch.logits_indices, 0), ("kv_lens", batch.kv_len_array, 0)):
            dst = h[name]
            dst[:len(src)] = src
            dst[len(src):] = pad
        cu = h["cu_q"]
        cu[:b + 1] = batch.cu_q
        cu[b + 1:] = n
        bt, src = h["block_tables"], batch.block_table_array
        bt[:b, :src.shape[1]] = src
        bt[:b, src.shape[1]:] = 0
        bt[b:] = 0
        dst, stage = h["copy"]
        dst.copy_(stage, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        return self.views(key)
