"""How a replay is judged: poison what the graph must write, replay, compare with eager on the same batch.

A graph's outputs and the KV slots of the batch's new tokens may already hold the right values before a
checked replay: the eager reference (and, where a key was captured from the batch itself, the capture and its
warm-up) computed the same batch into the same buffers. So a replay
that does nothing, or a graph that never writes K/V, would compare equal. Both are set to NaN first; a replay
must rewrite every byte the check reads. Logits and the K/V written are compared with two eager runs: the
unpadded batch (the reference, loose tolerance: other GEMM shapes round differently) and the same padded
computation without a graph (tight: identical kernels, so anything above rounding is stale data). Then what
the numbers can miss: the device inputs the replay read must be the batch's, padding as attention needs it, and
the K/V the batch's sequences held before the step must be as it was.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from gmtool.core.batch import Batch
from gmtool.core.kv_cache import NULL_BLOCK, PagedKVCache
from gmtool.errors import InputsNotLoaded, first_line
from gmtool.measure.timing import rel_err_per_seq
from gmtool.modes import GraphMode


def _slots(cache: PagedKVCache, batch: Batch) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(batch.slot_mapping)).to(cache.device)


def written_kv(cache: PagedKVCache, batch: Batch, slots: torch.Tensor | None = None) -> torch.Tensor:
    """K and V of the batch's new tokens, every layer: [2 x layers x tokens, kv_heads x head_dim]. Where V's
    head dim differs from K's (MLA), the narrower rows are zero-padded: zeros on both sides of a comparison
    change no relative error."""
    slots = _slots(cache, batch) if slots is None else slots
    rows = [t.view(-1, *t.shape[2:])[slots].flatten(1) for t in cache.k + cache.v]
    width = max(r.shape[1] for r in rows)
    return torch.cat([r if r.shape[1] == width else torch.nn.functional.pad(r, (0, width - r.shape[1])) for r in rows])


def poison_kv(cache: PagedKVCache, slots: torch.Tensor) -> None:
    """NaN into the batch's new-token slots: only a replay that writes K/V (and reads what it wrote) is clean."""
    for t in cache.k + cache.v:
        t.view(-1, *t.shape[2:])[slots] = float("nan")


@dataclass
class EagerReference:
    """The unpadded batch run eagerly: its logits and the K/V it wrote."""

    logits: torch.Tensor
    kv: torch.Tensor


def eager_reference(run, logits: torch.Tensor, cache: PagedKVCache, batch: Batch) -> EagerReference:
    """run() computes the batch eagerly into `logits`."""
    run()
    return EagerReference(logits.clone(), written_kv(cache, batch))


# -- what the replay read and what it left -------------------------------------------------------------------
# The numbers alone cannot judge every stale input: the same-shape eager pass loads the batch through the same
# executor (a copy-in that keeps last step's kv_lens feeds both), and an off-by-one length moves logits by about
# 1/context, under the unpadded comparison's loose tolerance. So the device buffers the replay read are compared
# with the batch itself, field by field, and the K/V the batch's sequences already held must be left untouched.
_INPUT_FIELDS = (
    "input_ids",
    "positions",
    "slot_mapping",
    "token_seq",
    "logits_indices",
    "kv_lens",
    "cu_q",
    "block_tables",
)


def input_faults(ex, key, batch: Batch, staged: bool = False) -> list[str]:
    """Fields of key's device buffers that do not hold this batch (or the padding attention relies on):
    what a graph read, whatever the host meant to send. staged: the staging arena instead, what the next
    copy-in sends (host memory, no device sync: cheap enough for every step)."""
    n, b, w = batch.num_tokens, batch.num_seqs, batch.block_table_array.shape[1]
    bs = ex.cache.spec.block_size
    if staged:
        tok, seq, cu, bt = ex.inputs.staged(key)
        got = dict(zip(_INPUT_FIELDS, (*tok, *seq, cu, bt)))
    else:
        # one copy back (one sync) for every field: a copy each took 2-3 s of a 400-step soak (H200)
        v = [getattr(ex.inputs.views(key), name) for name in _INPUT_FIELDS]
        flat = torch.cat([t.reshape(-1) for t in v]).cpu().numpy()
        ends = np.cumsum([t.numel() for t in v])[:-1]
        got = {name: a.reshape(t.shape) for name, t, a in zip(_INPUT_FIELDS, v, np.split(flat, ends))}
    checks = [
        ("input_ids", got["input_ids"][:n], batch.input_ids),
        ("positions", got["positions"][:n], batch.positions),
        ("slot_mapping", got["slot_mapping"][:n], batch.slot_mapping),
        ("token_seq", got["token_seq"][:n], batch.token_seq),
        ("logits_indices", got["logits_indices"][:b], batch.logits_indices),
        ("kv_lens", got["kv_lens"][:b], batch.kv_len_array),
        ("cu_q", got["cu_q"][: b + 1], batch.cu_q),
        ("block_tables", got["block_tables"][:b, :w], batch.block_table_array),
    ]
    out = [
        f"{name} holds other values than this batch's" for name, have, want in checks if not np.array_equal(have, want)
    ]
    pad = got["slot_mapping"][n:]
    if ((pad < 0) | (pad >= bs)).any():
        out.append("slot_mapping padding lanes point outside the null block (padding writes K/V into live blocks)")
    if (got["token_seq"][n:] != -1).any():
        out.append("token_seq padding lanes name a sequence")
    if got["kv_lens"][b:].any():
        out.append("kv_lens padding lanes are not 0")
    if (got["cu_q"][b + 1 :] != n).any():
        out.append("cu_q padding lanes do not hold the token count")
    if got["block_tables"][:b, w:].any() or got["block_tables"][b:].any():
        out.append("block_tables padding lanes point to blocks other than the null block")
    return out


DIGEST_CHUNK = 1 << 16  # slots gathered at once: bounds the digest's temporaries on a large cache


class SlotDigest:
    """A digest per K/V slot (every layer) of the given slots, but the batch's new-token ones: what a replay
    must not change."""

    def __init__(self, cache: PagedKVCache, slots: np.ndarray, batch: Batch):
        self.cache = cache
        self.slots = torch.from_numpy(np.setdiff1d(slots, batch.slot_mapping)).to(cache.device)
        self.before = self._digest()

    def _digest(self) -> torch.Tensor:
        # fp32 sums straight from the cache's dtype, a chunk of slots at a time: a double copy of every held slot
        # took 4 GB and half a second per checked replay on a 60 GB cache (H200)
        out = []
        for kv in self.cache.k + self.cache.v:
            rows = kv.view(-1, kv[0, 0].numel())
            sums = [rows.index_select(0, s).sum(-1, dtype=torch.float32) for s in self.slots.split(DIGEST_CHUNK)]
            out.append(torch.cat(sums) if sums else rows.new_zeros(0, dtype=torch.float32))
        return torch.stack(out)

    def changed(self) -> int:
        """How many of those slots the replay changed (in any layer); NaN that stayed NaN is no change."""
        if not len(self.slots):
            return 0
        return int(_changed(self._digest(), self.before).sum())


class BlockDigest:
    """An fp32 sum per K/V block (every layer) of the whole cache. A replay writes only the blocks of its
    batch's new tokens, and the null block where padding lanes write; a change anywhere else is K/V of a request
    it does not serve (a slot frozen at capture, a kernel writing past its rows). One pass over the cache each
    way: read at the device's bandwidth, no copy on CUDA (sum upcasts as it reads)."""

    def __init__(self, cache: PagedKVCache, batch: Batch):
        self.cache = cache
        mine = np.unique(np.asarray(batch.slot_mapping, dtype=np.int64) // cache.spec.block_size)
        self.allowed = torch.zeros(cache.num_blocks, dtype=torch.bool, device=cache.device)
        self.allowed[torch.from_numpy(mine).to(cache.device)] = True
        self.allowed[NULL_BLOCK] = True
        self.before = self._digest()

    def _digest(self) -> torch.Tensor:
        return torch.stack(
            [kv.reshape(kv.shape[0], -1).sum(-1, dtype=torch.float32) for kv in self.cache.k + self.cache.v]
        )

    def changed(self) -> int:
        """How many blocks outside the allowed ones the replay changed (in any layer)."""
        return int((_changed(self._digest(), self.before) & ~self.allowed).sum())


def _changed(now: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """[layers x n] digests -> which of the n changed in any layer; NaN that stayed NaN is no change."""
    return ~((now == before) | (now.isnan() & before.isnan())).all(0)


def slots_held(tables, lengths, block_size: int) -> np.ndarray:
    """The K/V slots of sequences holding lengths[i] tokens through block table tables[i]: each one's first
    lengths[i] slots."""
    held = [
        (np.asarray(row, dtype=np.int64)[:, None] * block_size + np.arange(block_size)).reshape(-1)[:length]
        for row, length in zip(tables, lengths)
    ]
    return np.concatenate(held) if held else np.zeros(0, np.int64)


def context_slots(cache: PagedKVCache, batch: Batch) -> np.ndarray:
    """The K/V slots the batch's sequences hold before this step (the new tokens' among them; SlotDigest leaves
    those out)."""
    return slots_held(batch.block_table_array, batch.kv_len_array, cache.spec.block_size)


@dataclass
class ReplayCheck:
    max_rel_err: float  # logits vs the unpadded eager batch
    max_rel_err_same_shape: float  # logits vs the same padded computation without a graph
    kv_rel_err: float  # K/V written vs the unpadded eager batch
    kv_rel_err_same_shape: float
    stale_metadata: bool  # a host plan frozen at capture differs from this batch's
    replay_error: str | None = None  # the replay raised (an index out of range, say): nothing it wrote counts
    input_faults: list[str] = field(default_factory=list)  # device inputs the replay read that are not the batch's
    context_changed: int = 0  # K/V slots held before the replay (the batch's context, or more) it overwrote
    held_by: str = "the batch's sequences"  # whose slots those are
    stray_blocks: int = 0  # K/V blocks outside the batch's new tokens (and the null block) the replay changed

    def failure(self, tol_same: float, tol: float) -> str | None:
        """Why this replay is unsafe, or None. Comparisons are written so that NaN fails them."""
        if self.replay_error:
            return f"replay failed: {self.replay_error}"
        if self.stale_metadata:
            why = "stale host metadata frozen at capture"
        elif self.input_faults:
            why = "the device inputs the replay read are not this batch's: " + "; ".join(self.input_faults)
        elif self.context_changed:
            n = self.context_changed
            why = f"the replay overwrote the K/V of {n} slot{'s' if n != 1 else ''} {self.held_by} hold"
        elif self.stray_blocks:
            n = self.stray_blocks
            why = f"the replay wrote K/V into {n} block{'s' if n != 1 else ''} none of the batch's new tokens is in"
        elif not self.max_rel_err_same_shape <= tol_same:
            why = "replay differs from the same computation run eagerly"
        elif not self.max_rel_err <= tol:
            why = "replay differs from eager on the unpadded batch"
        elif not (self.kv_rel_err_same_shape <= tol_same and self.kv_rel_err <= tol):
            why = "the K/V the replay wrote differs from eager's"
        else:
            return None
        return (
            f"{why}: max relative error {self.max_rel_err_same_shape:.3g} vs same-shape eager (tolerance "
            f"{tol_same:g}), {self.max_rel_err:.3g} vs unpadded eager (tolerance {tol:g}); K/V "
            f"{self.kv_rel_err_same_shape:.3g} and {self.kv_rel_err:.3g}"
        )


@dataclass
class ReplayRead:
    """One replay of a batch and what it left, read before anything reloads the inputs: its logits and K/V, the
    device inputs it read that are not the batch's, and the held K/V slots it overwrote."""

    entry: object  # the executor's CapturedGraph
    slots: torch.Tensor  # the batch's new-token slots
    out: torch.Tensor
    kv: torch.Tensor
    input_faults: list[str]
    context_changed: int
    replay_error: str | None
    held_by: str
    stray_blocks: int


def replay_once(
    ex, batch: Batch, before_replay=None, after_replay=None, held_slots=None, held_by="the batch's sequences"
) -> ReplayRead:
    """Replay batch through executor ex (capturing its graph on a miss) over poisoned outputs and new-token
    slots. before_replay(entry) / after_replay(entry): run just before and just after the replay (gmtool verify
    poisons more memory). held_slots: the K/V slots the replay must leave as they were (default: the batch's own
    context; verify: every live request's, held_by "live requests"), digested after before_replay."""
    entry = ex.prepare(batch)
    out = ex.output(entry, batch)  # the rows step() hands out, as an engine reads them
    ex.inputs.logits.fill_(float("nan"))  # every row: a replay must write its own
    slots = _slots(ex.cache, batch)
    poison_kv(ex.cache, slots)
    if before_replay is not None:
        before_replay(entry)
    held = SlotDigest(ex.cache, context_slots(ex.cache, batch) if held_slots is None else held_slots, batch)
    blocks = BlockDigest(ex.cache, batch)
    try:
        entry.replay(batch, ex.refresh_runner_metadata)
        replay_error = None
    except torch.OutOfMemoryError:
        raise
    # on the CPU tape, a graph replayed out of its shape's bounds; anywhere, a graph served for another bucket
    except (RuntimeError, IndexError, InputsNotLoaded) as e:
        replay_error = first_line(e, typed=True)
    if after_replay is not None:
        after_replay(entry)
    faults, changed = input_faults(ex, entry.key, batch), held.changed()  # before the eager pass reloads them
    kv = written_kv(ex.cache, batch, slots)
    return ReplayRead(entry, slots, out.clone(), kv, faults, changed, replay_error, held_by, blocks.changed())


def judge(ex, batch: Batch, ref: EagerReference, read: ReplayRead) -> ReplayCheck:
    """read against eager: the unpadded reference, and the same padded computation run now without a graph."""
    same = ex.eager_same_shape(batch).clone()
    kv_same = written_kv(ex.cache, batch, read.slots)
    return ReplayCheck(
        rel_err_per_seq(read.out, ref.logits),
        rel_err_per_seq(read.out, same),
        rel_err_per_seq(read.kv, ref.kv),
        rel_err_per_seq(read.kv, kv_same),
        read.entry.stale_metadata(batch),
        read.replay_error,
        read.input_faults,
        read.context_changed,
        read.held_by,
        read.stray_blocks,
    )


def capture_first(ex, batch: Batch) -> None:
    """Capture batch's graph where it has none, before the decoy: the capture's warm-up and recording run batch
    itself. Not for a step auto runs eagerly: loading it twice would hide a second load that skips its copy."""
    if ex.key_for(batch) not in ex.graphs and ex.served_by(batch) != GraphMode.EAGER.served_by:
        ex.prepare(batch)


def dispatch_fault(ex, batch: Batch, entry) -> str | None:
    """auto's rule, stated apart from its dispatch: full graphs for uniform decode, piecewise for prefill and
    mixed batches, eager above the largest bucket. Why entry (what ran) breaks it, or None."""
    kinds = ex.mode.composed_of  # the mode's declaration, not the executor's dispatch
    if not kinds:
        return None
    above = batch.num_tokens > ex.policy.largest
    want = GraphMode.EAGER if above else kinds["decode" if batch.is_decode else "mixed"]
    if entry.mode.served_by == want.served_by:
        return None
    kind = "a decode" if batch.is_decode else "a prefill or mixed"
    return f"auto served {kind} batch of {batch.num_tokens} tokens with {entry.mode.served_by}, not {want.served_by}"


def checked_replay(ex, batch: Batch, ref: EagerReference, decoy=None):
    """One replay of batch through executor ex, judged against eager. decoy(): an eager step of another batch, run
    first (Workbench.decoy). Returns (the graph entry, the check, the logits the replay wrote)."""
    if decoy is not None:
        capture_first(ex, batch)
        decoy()
    read = replay_once(ex, batch)
    return read.entry, judge(ex, batch, ref, read), read.out
