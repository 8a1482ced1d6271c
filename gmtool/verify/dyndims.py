"""Dynamic-dimension analysis: capture one bucket twice, with two compositions, and diff what was recorded.

A graph replays whatever host values its capture saw. If two compositions that share a bucket key record
different scalar arguments or shapes for the same op, that value is baked into the graph and depends on the
batch: it should come from a device buffer, or be part of the key. Each capture runs in a fresh executor under
a dispatch mode that records every ATen op issued between capture begin and end (the CPU tape records exactly
these), with the module that issued it. On CUDA the captured graphs themselves are diffed too, node by node
(gmtool.verify.graphnodes, nodediff): kernel names, grids, blocks and scalar arguments, Triton launches included,
which no ATen hook sees.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gmtool.core.batch import Batch
from gmtool.verify.capturable import ModuleTracker
from gmtool.verify.nodediff import NodeDiff, diff_nodes


@dataclass
class Op:
    name: str
    module: str
    args: tuple  # every non-tensor leaf, tensors as their shape


@dataclass
class BakedScalar:
    op_index: int
    op: str
    module: str
    arg: int  # position among the op's flattened arguments
    value_a: object
    value_b: object

    def __str__(self) -> str:
        return f"op {self.op_index} {self.op} in {self.module or '<root>'}: argument {self.arg} is {self.value_a!r} vs {self.value_b!r}"


@dataclass
class DynDimResult:
    mode: str
    key: str
    compositions: tuple[str, str]
    ops: tuple[int, int]
    baked: list[BakedScalar] = field(default_factory=list)
    diverged_at: str | None = None  # the op sequences themselves differ (host control flow taken)
    note: str | None = None
    graph_nodes: NodeDiff | None = None  # CUDA: the two graphs diffed node by node

    @property
    def clean(self) -> bool:
        return not self.baked and self.diverged_at is None and (self.graph_nodes is None or self.graph_nodes.clean)

    @property
    def compared(self) -> bool:
        """False where a capture recorded no op: nothing was compared, and clean says nothing."""
        return all(self.ops)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["graph_nodes"] = self.graph_nodes.to_dict() if self.graph_nodes else None
        d["baked"] = [{**asdict(b), "value_a": repr(b.value_a), "value_b": repr(b.value_b)} for b in self.baked]
        d["clean"] = self.clean
        d["compared"] = self.compared
        return d


class _Recorder(TorchDispatchMode):
    def __init__(self, tracker: ModuleTracker):
        super().__init__()
        self.tracker, self.on, self.ops = tracker, False, []
        self.sample = None  # graphnodes: called around every op while recording

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.on:
            return func(*args, **kwargs)
        leaves = tree_flatten((args, kwargs))[0]
        sig = tuple(("shape", tuple(x.shape)) if isinstance(x, torch.Tensor) else x for x in leaves)
        self.ops.append(Op(f"aten.{func.__name__}", self.tracker.current, sig))
        if self.sample is None:
            return func(*args, **kwargs)
        self.sample()
        out = func(*args, **kwargs)
        self.sample()
        return out


def recorded_ops(
    bench, mode, batch: Batch, make_executor=None, reader=None, held: list | None = None
) -> tuple[list[Op], str, list | None]:
    """The ops a capture of batch's bucket records, in a fresh executor (released after, or appended to held for
    the caller to release). Returns (ops, key, nodes): with a graphnodes.NodeReader (CUDA), the captured graphs'
    nodes, attributed to modules; else None."""
    ex = (make_executor or bench.executor)(mode)
    tracker = ModuleTracker(bench.lm.model)
    rec = _Recorder(tracker)
    sampler = None
    if reader is not None:
        ex.backend.keep_graph = True
        sampler = reader.sampler(tracker)
        rec.sample = tracker.on_change = lambda: rec.on and sampler.sample()
    record = ex.forward_impl.record

    def fx_split():
        """The fx split under way, or None. torch.compile traces nothing, and runs none of its code, under a dispatch
        mode: entered around an fx split's call, the recorder made the split fall back to the run-time one, here
        and (the code then marked skipped) in every later executor; its pieces enter it instead. Asked after the
        warm-up, where a model fx cannot trace has fallen back to the run-time split."""
        fx = getattr(getattr(ex.forward_impl, "active", None), "fx", None)
        return fx if fx is not None and fx.split else None

    def record_on(ex_, entry, fn):
        rec.on = True
        try:
            record(ex_, entry, fn)
        finally:
            rec.on = False

    capture_into = ex._record

    def capture_in_mode(entry, fn):
        # entered before the capture begins: a backend's own mode (the CPU tape's) must sit above it, and leave first
        fx = fx_split()
        if fx is None:
            with tracker.active(), rec:
                return capture_into(entry, fn)
        # no tracker: dynamo would trace its global hooks into the split, guarded on what they read (rec.on, and
        # on CUDA the node sampler's driver calls, which it cannot trace); its ops name no module
        fx.piece_mode = rec
        try:
            return capture_into(entry, fn)
        finally:
            fx.piece_mode = None

    ex.forward_impl.record = record_on
    ex._record = capture_in_mode
    try:
        entry = ex.capture(ex.key_for(batch), batch)
        return rec.ops, str(entry.key), reader.entry_nodes(entry, sampler) if reader is not None else None
    finally:
        if held is None:
            ex.release()
        else:
            held.append(ex)


def diff_ops(a: list[Op], b: list[Op], limit: int = 20) -> tuple[list[BakedScalar], str | None]:
    baked, diverged = [], None
    for i, (x, y) in enumerate(zip(a, b)):
        if x.name != y.name or len(x.args) != len(y.args):
            diverged = f"op {i}: {x.name} in {x.module or '<root>'} vs {y.name} in {y.module or '<root>'}"
            break
        for j, (u, v) in enumerate(zip(x.args, y.args)):
            if u != v and len(baked) < limit:
                baked.append(BakedScalar(i, x.name, x.module, j, u, v))
    if diverged is None and len(a) != len(b):
        diverged = f"op {min(len(a), len(b))}: one capture records {len(a)} ops, the other {len(b)}"
    return baked, diverged


def dynamic_dims(bench, mode, a: Batch, b: Batch, make_executor=None) -> DynDimResult:
    from gmtool.verify.graphnodes import NodeReader, unavailable

    why_not = unavailable(bench.device) if bench.device.type == "cuda" else None
    reader = NodeReader() if bench.device.type == "cuda" and why_not is None else None
    # On CUDA all three captures stay alive until the end: each then owns memory at addresses the others do not,
    # so every argument word that holds an address (whole, halved or offset inside a struct) differs in the
    # control too and is ignored. Released one by one, a later capture can reuse the first one's addresses
    # exactly and make the control blind to them.
    held: list | None = [] if reader is not None else None
    try:
        ops_a, key_a, nodes_a = recorded_ops(bench, mode, a, make_executor, reader, held)
        ops_b, key_b, nodes_b = recorded_ops(bench, mode, b, make_executor, reader, held)
        res = DynDimResult(str(mode), key_a, (a.composition.label, b.composition.label), (len(ops_a), len(ops_b)))
        if key_a != key_b:
            res.note = f"the compositions landed on different keys ({key_a}, {key_b}): nothing to compare"
            return res
        res.baked, res.diverged_at = diff_ops(ops_a, ops_b)
        if reader is not None:  # the control: a captured again, for what differs between two captures of one batch
            control = recorded_ops(bench, mode, a, make_executor, reader, held)[2]
            res.graph_nodes = diff_nodes(nodes_a, nodes_b, control)
            res.graph_nodes.notes += sorted(reader.notes)
        elif why_not:
            res.note = f"ATen ops only ({why_not}): Triton kernel launches (grids, scalar arguments) are not seen"
        if not res.compared:
            res.note = "; ".join(filter(None, ("a capture recorded no op: nothing was compared", res.note)))
        return res
    finally:
        for ex in held or ():
            ex.release()
