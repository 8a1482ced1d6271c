"""Two CUDA graphs of one bucket, captured with two compositions, compared node by node: which kernels' launch
configuration (grid, block, dynamic shared memory) or scalar arguments depend on the composition. Pure Python:
the node records come from gmtool.verify.graphnodes (CUDA) or, in the tests, are made by hand.

Nodes are aligned on (kind, kernel, module) with difflib rather than by position, so a kernel that one capture has
and the other lacks (a host branch taken differently) is named without misaligning everything after it. A third
capture, of the first composition again, is the control: an argument word that differs between two captures of the
same batch (struct padding never written, an address the pointer test missed) is not the composition's doing; it
is left out and counted.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import asdict, dataclass, field

PTR = "ptr"  # an argument word that holds a device address: a buffer, not a scalar


@dataclass(frozen=True)
class Node:
    kind: str  # kernel, memset, memcpy, event_record, ...
    name: str = ""  # kernel name as the driver gives it (C++ kernels mangled)
    module: str = ""  # dotted path of the module whose forward issued it ("" outside the model)
    grid: tuple[int, ...] = ()
    block: tuple[int, ...] = ()
    smem: int = 0  # dynamic shared memory per block
    args: tuple[tuple, ...] = ()  # per argument: its 8-byte words (ints), PTR for a device address

    @property
    def key(self) -> tuple[str, str, str]:
        return self.kind, self.name, self.module

    def fields(self) -> dict[str, object]:
        out: dict[str, object] = {"grid": self.grid, "block": self.block, "smem": self.smem}
        for i, words in enumerate(self.args):
            for j, w in enumerate(words):
                out[f"arg {i}" if len(words) == 1 else f"arg {i} word {j}"] = w
        return out


@dataclass
class Change:
    index: int  # the node's position in the first capture (-1: only in the second)
    index_b: int  # and in the second (-1: only in the first)
    kind: str
    name: str
    module: str
    field: str  # grid, block, smem, arg N [word M], or "node" (present in one capture only)
    a: object
    b: object

    def __str__(self) -> str:
        return f"{short_name(self.name) or self.kind} in {self.module or '<root>'}: {self.field} {self.a} vs {self.b}"


@dataclass
class NodeDiff:
    nodes: tuple[int, int]
    kernels: tuple[int, int]
    changes: list[Change] = field(default_factory=list)
    unstable: int = 0  # argument words that differ between two captures of the same batch: ignored
    notes: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.changes

    def dependent(self) -> list[dict]:
        """The composition-dependent kernels, one row per kernel and module pattern (layers folded)."""
        rows: dict[tuple, dict] = {}
        for c in self.changes:
            label = short_name(c.name) or c.kind
            row = rows.setdefault(
                (label, fold_layers(c.module)),
                {"kernel": label, "module": fold_layers(c.module), "nodes": set(), "fields": set()},
            )
            row["nodes"].add((c.index, c.index_b))
            row["fields"].add(re.sub(r" word \d+$", "", c.field))
        return [{**r, "nodes": len(r["nodes"]), "fields": sorted(r["fields"])} for r in rows.values()]

    def to_dict(self, limit: int = 40) -> dict:
        d = asdict(self)
        d["changes"] = [{**asdict(c), "a": repr(c.a), "b": repr(c.b)} for c in self.changes[:limit]]
        d.update(changes_total=len(self.changes), clean=self.clean, dependent=self.dependent())
        return d


def short_name(name: str) -> str:
    """at::native::foo for a mangled _ZN2at6native3fooE...; other names as they are."""
    m = re.match(r"_Z(N?)", name)
    if not m:
        return name
    parts, i = [], m.end()
    while i < len(name) and name[i].isdigit():
        n = re.match(r"\d+", name[i:]).group()
        i += len(n)
        parts.append(name[i : i + int(n)])
        i += int(n)
        if not m.group(1):  # not nested: one name only
            break
    return "::".join(parts) or name


def fold_layers(module: str) -> str:
    """model.layers.3.self_attn -> model.layers.*.self_attn: one row for every layer's copy of a kernel."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", module)


def _align(a: list[Node], b: list[Node]) -> tuple[list[tuple[int, int]], list[int], list[int]]:
    sm = difflib.SequenceMatcher(None, [n.key for n in a], [n.key for n in b], autojunk=False)
    pairs, only_a, only_b = [], [], []
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag == "equal":
            pairs += zip(range(i1, i2), range(j1, j2))
        else:
            only_a += range(i1, i2)
            only_b += range(j1, j2)
    return pairs, only_a, only_b


def _field_changes(x: Node, y: Node) -> list[tuple[str, object, object]]:
    fx, fy = x.fields(), y.fields()
    return [(f, fx.get(f), fy.get(f)) for f in dict.fromkeys([*fx, *fy]) if fx.get(f) != fy.get(f)]


def diff_nodes(a: list[Node], b: list[Node], control: list[Node] | None = None) -> NodeDiff:
    """a and b: the same bucket captured with two compositions; control: a captured again (optional)."""
    res = NodeDiff((len(a), len(b)), tuple(sum(n.kind == "kernel" for n in x) for x in (a, b)))
    unstable: set[tuple[int, str]] = set()
    if control is not None:
        pairs, only_a, only_c = _align(a, control)
        unstable = {(i, f) for i, j in pairs for f, _, _ in _field_changes(a[i], control[j])}
        if only_a or only_c:
            res.notes.append(
                f"the same batch captured twice gave different nodes ({len(only_a)} vs {len(only_c)} "
                "unmatched): the graphs are not deterministic, read the differences with care"
            )
    pairs, only_a, only_b = _align(a, b)
    for i, j in pairs:
        for f, u, v in _field_changes(a[i], b[j]):
            if (i, f) in unstable:
                res.unstable += 1
            else:
                res.changes.append(Change(i, j, a[i].kind, a[i].name, a[i].module, f, u, v))
    res.changes += [Change(i, -1, a[i].kind, a[i].name, a[i].module, "node", "present", "absent") for i in only_a]
    res.changes += [Change(-1, j, b[j].kind, b[j].name, b[j].module, "node", "absent", "present") for j in only_b]
    return res
