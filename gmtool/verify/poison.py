"""Memory a correct graph never reads, poisoned around a checked replay, and the checks on what it wrote.

Each Buffer below is poisoned (NaN, or a sentinel where a correct graph does read the memory but must ignore
it) just before a checked replay and cleaned afterwards. A correct graph is unaffected. A graph whose result
changes when one buffer alone is poisoned reads it: `attribute` names it by replaying the failing step with
each buffer poisoned in turn against a clean replay.

Finite sentinels where NaN would be wrong for a correct graph: gmtool's torch reference attention gathers
whole blocks and masks past each sequence's length, so the null block and the slots past a sequence's length
are read and multiplied by zero (NaN times zero is NaN). Index fields hold valid but wrong indices (a
sentinel out of range would crash a CUDA context instead of naming the buffer).
"""

from __future__ import annotations

import ctypes
from enum import StrEnum

import numpy as np
import torch

from gmtool.core.auto import part_owning, parts_of
from gmtool.core.batch import Batch
from gmtool.core.kv_cache import NULL_BLOCK
from gmtool.model import families

SENTINEL = 1e3  # for memory read under a mask: large enough to be plain in any result that uses it


class Buffer(StrEnum):
    PAD_INPUT_IDS = "input_ids padding lanes"
    PAD_POSITIONS = "positions padding lanes"
    PAD_LOGITS_INDICES = "logits_indices padding lanes"
    ARENA_TAIL = "input arena past this bucket's fields"
    ATTN_OUT_TAIL = "attention output buffer past this bucket"
    KV_UNUSED_BLOCKS = "KV blocks no live request owns"
    KV_SLOT_TAILS = "KV slots past each request's length"
    KV_NULL_BLOCK = "KV null block"
    GRAPH_MEMORY = "graph-private memory (freed graph-pool blocks / tape intermediates)"


class Poisoner:
    def __init__(self, ex, persistent: list[torch.Tensor], seed: int):
        """persistent: tensors outside the graphs' own memory (weights, the KV cache, taps) besides ex's."""
        self.ex, self.cache, self.seed = ex, ex.cache, seed
        self.persistent = {t.untyped_storage().data_ptr() for t in persistent}
        self.parts = parts_of(ex)  # auto: full and piecewise executors over one arena, each its own runner buffers
        self.persistent |= {
            t.untyped_storage().data_ptr()
            for t in (
                ex.inputs.arena,
                ex.inputs.logits,
                *(b for p in self.parts for b in p.runner_buffers()),
                *ex.cache.k,
                *ex.cache.v,
            )
        }
        self.skipped: dict[str, str] = {}  # buffer -> why it is not poisoned here
        self._memset = None
        if "longrope" in families.rope_types(ex.lm.config):
            self.skipped[Buffer.PAD_POSITIONS] = (
                "the model reads them: longrope's factors follow the step's largest position, padding lanes' included"
            )
        if not any(p.mode.piecewise for p in self.parts):
            self.skipped[Buffer.ATTN_OUT_TAIL] = "full graphs have no attention output buffer between pieces"

    # -- poison and clean ----------------------------------------------------------------------------
    def apply(self, entry, batch: Batch, live, step: int, only: set[Buffer] | None = None) -> None:
        """Poison every buffer (or `only` those) before entry replays batch; live: scheduler.live()."""
        want = (lambda b: b not in self.skipped) if only is None else (lambda b: b in only)
        rng = np.random.default_rng((self.seed, step))
        tok, seq, _, _ = self.ex.inputs.staged(entry.key)
        n, b, t = batch.num_tokens, batch.num_seqs, entry.key.num_tokens
        staged = False
        if want(Buffer.PAD_INPUT_IDS) and n < t:
            tok[0, n:] = rng.integers(self.ex.lm.vocab_size, size=t - n)
            staged = True
        if want(Buffer.PAD_POSITIONS) and n < t:
            tok[1, n:] = rng.integers(self.cache.spec.max_kv_len, size=t - n)
            staged = True
        if want(Buffer.PAD_LOGITS_INDICES) and b < seq.shape[1]:
            seq[0, b:] = rng.integers(t, size=seq.shape[1] - b)
            staged = True
        if staged:
            self.ex.inputs.invalidate()  # the next load rewrites the padding
            if not entry.copies_inputs:
                self.ex.inputs.copy_in(entry.key)
        if want(Buffer.ARENA_TAIL):
            self.ex.inputs.arena[self._arena_end(entry.key) :] = 1  # a valid index of every kind, and wrong
        attn_out = self._attn_out(entry)
        if want(Buffer.ATTN_OUT_TAIL) and attn_out is not None and entry.mode.piecewise:
            attn_out[t:] = float("nan")
        unused, tails = self._kv_spans(live)
        for kv in self.cache.k + self.cache.v:
            if want(Buffer.KV_UNUSED_BLOCKS) and len(unused):
                kv.index_fill_(0, unused, float("nan"))
            if want(Buffer.KV_SLOT_TAILS) and len(tails):
                kv.view(-1, *kv.shape[2:]).index_fill_(0, tails, SENTINEL)
            if want(Buffer.KV_NULL_BLOCK):
                kv[NULL_BLOCK] = SENTINEL
        if want(Buffer.GRAPH_MEMORY):
            self._fill_graph_memory(entry, poison=True)

    def after_replay(self, entry, only: set[Buffer] | None = None) -> None:
        """Graph memory poisoned again once the replay is done, before its result is read. A result handed out
        from memory the pool counts free (a weak reference to a graph's output) is what the next replay of
        another bucket overwrites; here it reads NaN at once. A correct result sits outside the graphs' memory."""
        if (Buffer.GRAPH_MEMORY not in self.skipped) if only is None else (Buffer.GRAPH_MEMORY in only):
            self._fill_graph_memory(entry, poison=True)

    def clean(self, entry, live) -> None:
        """Back to harmless values: memory nobody owns holds zeros, the next load rewrites the padding."""
        self.ex.inputs.invalidate()
        self.ex.inputs.arena[self._arena_end(entry.key) :] = 0
        attn_out = self._attn_out(entry)
        if attn_out is not None:
            attn_out[entry.key.num_tokens :] = 0
        unused, tails = self._kv_spans(live)
        for kv in self.cache.k + self.cache.v:
            if len(unused):
                kv.index_fill_(0, unused, 0.0)
            if len(tails):
                kv.view(-1, *kv.shape[2:]).index_fill_(0, tails, 0.0)
            kv[NULL_BLOCK] = 0.0
        if Buffer.GRAPH_MEMORY not in self.skipped:
            self._fill_graph_memory(entry, poison=False)

    def _attn_out(self, entry) -> torch.Tensor | None:
        """The attention-output buffer entry's pieces use (None: an eager step of auto's, no graph)."""
        owner = part_owning(self.ex, entry) if len(self.parts) > 1 else self.ex
        return owner.attn_out if owner is not None else None

    def _arena_end(self, key) -> int:
        return sum(v.size for v in self.ex.inputs.staged(key))

    def _kv_spans(self, live) -> tuple[torch.Tensor, torch.Tensor]:
        """(blocks no live request owns, slots past each live request's length in its own blocks)."""
        bs, dev = self.cache.spec.block_size, self.cache.device
        owned = np.zeros(self.cache.num_blocks, dtype=bool)
        owned[NULL_BLOCK] = True
        tails = []
        for blocks, length in live:
            owned[blocks] = True
            slots = np.asarray(blocks, dtype=np.int64)[:, None] * bs + np.arange(bs)
            tails.append(slots.reshape(-1)[length:])
        unused = torch.from_numpy(np.flatnonzero(~owned)).to(dev)
        tails = torch.from_numpy(np.concatenate(tails) if tails else np.zeros(0, np.int64)).to(dev)
        return unused, tails

    # -- the graph's own memory ----------------------------------------------------------------------
    def _fill_graph_memory(self, entry, poison: bool) -> None:
        """NaN (poison) or zeros: a replay that reads what it did not write sees one or the other."""
        if self.ex.device.type == "cuda":
            self._fill_free_pool_blocks(0xFF if poison else 0)
            return
        for t in self._tape_intermediates(entry):
            t.fill_(float("nan") if poison else 0.0)

    def _tape_intermediates(self, entry) -> list[torch.Tensor]:
        """CPU tape: the floating tensors a graph made and hands out (written back after each replay) outside the
        persistent buffers: the tape's stand-in for graph-pool memory. Its other intermediates are made afresh
        at every replay, so there is nothing of theirs to poison."""
        out = []
        for step in entry.steps:
            for _, ref in getattr(step, "escaped", ()):
                t = ref()
                if t is not None and t.is_floating_point() and t.untyped_storage().data_ptr() not in self.persistent:
                    out.append(t)
        return out

    def _fill_free_pool_blocks(self, byte: int) -> None:
        """CUDA: every free block of the executor's graph pools set to one byte (0xFF: NaN in fp32/bf16/fp16)."""
        ex = self.ex
        pools = (
            set(map(tuple, ex.memory.pool_ids.values())) if ex.memory is not None else {tuple(ex.backend.pool or ())}
        )
        try:
            memset = self._memset or _driver_memset()
            self._memset = memset
            stream = ctypes.c_void_p(torch.cuda.current_stream(ex.device).cuda_stream)
            for seg in torch.cuda.memory_snapshot():
                if tuple(seg.get("segment_pool_id") or ()) not in pools:
                    continue
                at = seg["address"]
                for blk in seg.get("blocks", []):
                    start = blk.get("address", at)
                    at = start + blk["size"]
                    if blk.get("state") == "inactive":
                        rc = memset(ctypes.c_uint64(start), ctypes.c_ubyte(byte), ctypes.c_size_t(blk["size"]), stream)
                        if rc != 0:
                            raise RuntimeError(f"cuMemsetD8Async returned {rc}")
        except Exception as e:  # the driver library or the snapshot format: say so, check the rest
            self.skipped[Buffer.GRAPH_MEMORY] = f"freed graph-pool memory not poisoned: {e}"


def _driver_memset():
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuMemsetD8Async
    fn.argtypes = [ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn
