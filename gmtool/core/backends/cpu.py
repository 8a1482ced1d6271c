"""CPU emulation of CUDA graphs: a tape of ATen ops recorded at capture, re-run over the same tensors.

What it emulates: capture freezes the op sequence, every argument (host scalars, shapes, Python control flow
taken) and every tensor that existed before the capture (weights, the KV cache, the persistent buffers);
replay re-runs the ops over those same tensors. A tensor made during the capture is a slot of the tape: at
replay each op reads the slots its recorded inputs came from, and a slot is dropped after its last use, so a
replay holds no more memory than an eager forward does. A tensor made during the capture that is still alive
when it ends (what a graph hands to the next piece or to an attention runner) keeps its recorded storage and
every replay writes its new value there, as a CUDA graph writes the same address.
What it does not emulate: timing, memory pools and kernel launch shapes; CUDA-specific capture errors are
approximated by refusing host syncs (.item(), nonzero) during capture.
"""

from __future__ import annotations

import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from gmtool.errors import CaptureError

_HOST_SYNC_OPS = {"_local_scalar_dense", "nonzero", "item", "is_nonzero", "equal"}
# ops whose output's size is read from a tensor's values: on CUDA the host waits for the device to learn it
_DATA_SIZED_OPS = {"masked_select", "_unique", "_unique2", "unique_dim", "unique_consecutive"}
_MASK_INDEXED_OPS = {"index", "index_put", "index_put_", "_index_put_impl_"}  # a bool index is a nonzero


def host_sync(func, args, kwargs) -> str | None:
    """What a CUDA capture would refuse in this op: a host sync, or an output sized by a tensor's values."""
    name = func.__name__.split(".")[0]
    if name in _HOST_SYNC_OPS:
        return f"host sync inside graph capture: aten.{func.__name__}"
    sized = func.__name__ == "repeat_interleave.Tensor" and kwargs.get("output_size") is None
    if name in _DATA_SIZED_OPS or sized:
        return f"an output sized by a tensor's values inside graph capture (a host sync): aten.{func.__name__}"
    if name in _MASK_INDEXED_OPS and len(args) > 1:
        masked = any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1])
        accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
        # x[mask] = one value: ATen makes it a masked_fill_, no sync
        fill = name != "index" and len(args[1]) == 1 and len(args) > 2 and args[2].numel() == 1 and not accumulate
        if masked and not fill:
            return f"indexing by a boolean mask inside graph capture (a host sync): aten.{func.__name__}"
    return None


class _NoHostReads(TorchFunctionMode):
    """Tensor.tolist() and .numpy() read a tensor's values on the host without an ATen op the tape would see;
    under a CUDA capture they wait for the device."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.tolist, torch.Tensor.numpy):
            raise CaptureError(f"host read inside graph capture: Tensor.{func.__name__}()")
        return func(*args, **(kwargs or {}))


class _Slot(int):
    """An argument of a recorded op that was made during the capture: the index of the value it reads."""


class _Tape(TorchDispatchMode):
    """ops: one (func, leaves, spec, outs) per ATen op, in order. leaves are the op's flattened (args, kwargs)
    with a _Slot for every tensor made during the capture; outs the slot of each tensor output (-1: an output
    that is one of the inputs, as in-place ops return)."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple] = []
        self.num_slots = 0
        self._live: dict[int, tuple[weakref.ref, int]] = {}  # id(tensor) -> (weak ref, slot)
        self.storage_of: list[tuple[int, int]] = []  # per slot: (storage address, bytes) when it was made
        self.reads: set[int] = set()  # storage addresses of the tensors from outside the tape that ops read

    def _slot_of(self, t: torch.Tensor) -> int | None:
        e = self._live.get(id(t))
        return e[1] if e is not None and e[0]() is t else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (why := host_sync(func, args, kwargs)) is not None:
            raise CaptureError(why)
        out = func(*args, **kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        inputs = {id(x) for x in leaves if isinstance(x, torch.Tensor)}
        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor):
                if (s := self._slot_of(x)) is not None:
                    leaves[i] = _Slot(s)
                else:
                    self.reads.add(x.untyped_storage().data_ptr())
        outs = []
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and id(t) not in inputs:
                self._live[id(t)] = (weakref.ref(t), self.num_slots)
                st = t.untyped_storage()
                self.storage_of.append((st.data_ptr(), st.nbytes()))
                outs.append(self.num_slots)
                self.num_slots += 1
            else:
                outs.append(-1)
        self.ops.append((func, leaves, spec, outs))
        return out

    def escaped(self) -> list[tuple[int, torch.Tensor]]:
        """(slot, tensor) of what the capture made and something outside the tape still holds."""
        alive = ((e[1], e[0]()) for e in self._live.values())
        return [(s, t) for s, t in alive if t is not None]


def _returns_a_tensor(func) -> bool:
    """One Tensor, not a list of them: a split into one piece returns a list of one."""
    schema = getattr(func, "_schema", None)
    return schema is None or (len(schema.returns) == 1 and str(schema.returns[0].type) == "Tensor")


class TapeGraph:
    def __init__(
        self,
        ops,
        num_slots: int = 0,
        escaped: list | None = None,
        storage_of: list | None = None,
        reads: set | None = None,
    ):
        """ops: _Tape.ops; escaped: (slot, recorded tensor) pairs written back after every replay, held weakly:
        once nothing outside the tape holds one (a piece's q once the capture is over), it is no longer
        written and its memory is free, as a CUDA pool reuses a freed block. storage_of, reads: _Tape's, for
        the live-tensor accounting (peak_bytes, exports, reads)."""
        self.ops = ops
        self.num_slots = num_slots
        self.escaped = [(s, weakref.ref(t)) for s, t in escaped or []]
        keep = {s for s, _ in self.escaped}
        last: dict[int, int] = {}  # slot -> index of the last op that reads it (or makes it)
        for i, (_, leaves, _, outs) in enumerate(ops):
            for s in outs:
                if s >= 0:
                    last[s] = i
            for x in leaves:
                if type(x) is _Slot:
                    last[int(x)] = i
        frees: list[list[int]] = [[] for _ in ops]
        for s, i in last.items():
            if s not in keep:
                frees[i].append(s)
        # per op: func, args (slots where the args hold them at the top level, else all leaves and their
        # spec: pytree only for ops such as index or cat that take a list of made tensors), outputs, frees
        self._steps = []
        for (func, leaves, spec, outs), free in zip(ops, frees):
            args, kwargs = tree_unflatten(leaves, spec)
            nested = sum(type(x) is _Slot for x in leaves) != sum(type(a) is _Slot for a in args)
            if nested:
                args, kwargs = tuple(leaves), spec
            subs = tuple((i, int(x)) for i, x in enumerate(args) if type(x) is _Slot)
            out = outs[0] if len(outs) == 1 and _returns_a_tensor(func) else tuple(outs)
            self._steps.append((func, tuple(args), kwargs, subs, nested, out, tuple(free)))
        self.reads = reads or set()
        self.peak_bytes, self.exports = _live_bytes(ops, frees, storage_of or [], self.reads, keep)

    def replay(self) -> None:
        with torch.no_grad():
            vals: list = [None] * self.num_slots
            for func, args, kwargs, subs, nested, out, free in self._steps:
                if subs:
                    args = list(args)
                    for i, s in subs:
                        args[i] = vals[s]
                if nested:
                    a, kw = tree_unflatten(list(args), kwargs)
                    fresh = func(*a, **kw)
                else:
                    fresh = func(*args, **kwargs)
                if type(out) is int:
                    if out >= 0:
                        vals[out] = fresh
                else:
                    for s, t in zip(out, tree_leaves(fresh)):
                        if s >= 0:
                            vals[s] = t
                for s in free:
                    vals[s] = None
            for s, ref in self.escaped:
                recorded = ref()
                if recorded is None:  # nothing reads it any more
                    continue
                new = vals[s]
                if new.data_ptr() != recorded.data_ptr() or new.stride() != recorded.stride():
                    recorded.copy_(new)


def _live_bytes(ops, frees, storage_of, external: set, keep: set) -> tuple[int, dict[int, int]]:
    """The most bytes the tape's own tensors hold at once during a replay (a storage counted once, however
    many views of it are live; views of tensors from outside the tape count nothing), and the storages still
    live at its end (address -> bytes): what it hands on."""
    live: dict[int, list[int]] = {}  # storage address -> [bytes, live slots viewing it]
    at: dict[int, int] = {}  # slot -> its storage address, for slots that hold tape memory
    cur = peak = 0
    for (_, _, _, outs), free in zip(ops, frees):
        for s in outs:
            if s < 0 or s >= len(storage_of) or storage_of[s][0] in external:
                continue
            ptr, nbytes = storage_of[s]
            at[s] = ptr
            if ptr in live:
                live[ptr][1] += 1
            else:
                live[ptr] = [nbytes, 1]
                cur += nbytes
        peak = max(peak, cur)
        for s in free:
            ptr = at.pop(s, None)
            if ptr is not None:
                live[ptr][1] -= 1
                if not live[ptr][1]:
                    cur -= live.pop(ptr)[0]
    return peak, {at[s]: live[at[s]][0] for s in keep if s in at}


def pool_bytes(steps) -> int:
    """Memory one pool needs for a captured entry's steps replayed in order, from the tapes' live-tensor
    accounting: the largest of (a piece's own peak + what earlier pieces handed on that a later step still
    reads), plus what a runner holds of a piece's memory, which no later piece can reuse (a runner keeps its
    tensors for the life of the graph)."""
    made: dict[int, tuple[int, int]] = {}  # storage a piece handed on -> (bytes, the piece's step index)
    last: dict[int, int] = {}  # -> the last step that reads it
    pinned: set[int] = set()
    for i, st in enumerate(steps):
        if isinstance(st, TapeGraph):
            reads = st.reads
        else:  # an attention runner: whatever tensors it is bound to
            reads = {t.untyped_storage().data_ptr() for t in tree_leaves(vars(st)) if isinstance(t, torch.Tensor)}
            pinned |= reads & made.keys()
        for ptr in reads & made.keys():
            last[ptr] = i
        if isinstance(st, TapeGraph):
            made.update({ptr: (n, i) for ptr, n in st.exports.items()})
    peak = 0
    for i, st in enumerate(steps):
        if isinstance(st, TapeGraph):
            carried = sum(n for ptr, (n, j) in made.items() if j < i <= last.get(ptr, j) and ptr not in pinned)
            peak = max(peak, st.peak_bytes + carried)
    return peak + sum(made[ptr][0] for ptr in pinned)


class CpuTapeBackend:
    name = "cpu-tape"

    def __init__(self):
        self._tape: _Tape | None = None
        self.graphs: list[TapeGraph] = []

    warmed = False  # an eager pass has run (the executor warms up once, as on CUDA)

    def warmup(self, fn) -> None:
        fn()
        self.warmed = True

    def begin(self) -> None:
        assert self._tape is None, "capture already in progress"
        self._reads = _NoHostReads()
        self._reads.__enter__()
        self._tape = _Tape()
        self._tape.__enter__()

    def _stop(self) -> "_Tape":
        tape, self._tape = self._tape, None
        try:
            tape.__exit__(None, None, None)
        finally:
            self._reads.__exit__(None, None, None)
        return tape

    def end(self) -> TapeGraph:
        tape = self._stop()
        g = TapeGraph(tape.ops, tape.num_slots, tape.escaped(), tape.storage_of, tape.reads)
        self.graphs.append(g)
        return g

    def abort(self) -> None:
        if self._tape is not None:
            self._stop()

    def synchronize(self) -> None:
        pass

    pool = None  # the executor may set it; the tape keeps its tensors alive itself

    def release(self) -> None:
        self.graphs.clear()
