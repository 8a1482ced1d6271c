"""Which ops of a forward would break graph capture or freeze host state, and in which module.

The forward runs once eagerly under a TorchFunctionMode (tensor methods: `.item()`, `.tolist()`, `bool(t)`)
and a TorchDispatchMode (ATen ops: `_local_scalar_dense`, `nonzero`, RNG, tensors made from host data), while
global module hooks keep the path of the module running. Nothing is refused during the run: every finding is
collected, so one pass names them all.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from enum import StrEnum

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class Hazard(StrEnum):
    HOST_SYNC = "host sync"  # capture fails (CUDA refuses a sync on a capturing stream)
    BRANCH = "Python branch on a tensor value"  # a host sync, and the branch taken is frozen into the graph
    DATA_DEPENDENT_SHAPE = "data-dependent output shape"  # needs a sync; the shape would be frozen
    HOST_TENSOR = "host tensor made inside forward"  # its values are frozen at capture (or the copy fails)
    RNG = "RNG op"  # replays draw from the state registered at capture, not the eager generator's

    @property
    def breaks_capture(self) -> bool:
        return self is not Hazard.RNG


@dataclass(frozen=True)
class Finding:
    hazard: Hazard
    op: str
    module: str  # dotted path from the model's root ("" for the root itself)

    def __str__(self) -> str:
        return f"{self.op} ({self.hazard}) in {self.module or '<root>'}"

    def to_dict(self) -> dict:
        return asdict(self)


_METHOD_SYNCS = {
    "item": Hazard.HOST_SYNC,
    "tolist": Hazard.HOST_SYNC,
    "numpy": Hazard.HOST_SYNC,
    "cpu": Hazard.HOST_SYNC,
    "__bool__": Hazard.BRANCH,
    "__int__": Hazard.HOST_SYNC,
    "__float__": Hazard.HOST_SYNC,
    "__index__": Hazard.HOST_SYNC,
}
_ATEN_SYNCS = {"_local_scalar_dense", "is_nonzero", "equal", "allclose"}
_DATA_SHAPES = {"nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim"}
_RNG = {
    "rand",
    "randn",
    "randint",
    "randperm",
    "rand_like",
    "randn_like",
    "randint_like",
    "bernoulli",
    "normal",
    "uniform",
    "multinomial",
    "native_dropout",
    "exponential",
    "geometric",
    "cauchy",
    "log_normal",
    "random",
}


class ModuleTracker:
    """The dotted path of the innermost module of `root` whose forward is running."""

    def __init__(self, root: torch.nn.Module):
        self.names = {id(m): n for n, m in root.named_modules()}
        self.stack: list[str] = []
        self.on_change = None  # called before the stack changes (graphnodes: what ran so far ran in `current`)

    @property
    def current(self) -> str:
        return self.stack[-1] if self.stack else ""

    @contextlib.contextmanager
    def active(self):
        from torch.nn.modules import module as nn_module

        def pre(mod, args):
            name = self.names.get(id(mod))
            if name is not None:
                if self.on_change is not None:
                    self.on_change()
                self.stack.append(name)

        def post(mod, args, out):
            if self.names.get(id(mod)) is not None and self.stack:
                if self.on_change is not None:
                    self.on_change()
                self.stack.pop()

        handles = [nn_module.register_module_forward_pre_hook(pre), nn_module.register_module_forward_hook(post)]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()
            self.stack.clear()


class _Methods(TorchFunctionMode):
    def __init__(self, seen):
        super().__init__()
        self.seen, self.inside = seen, False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name not in _METHOD_SYNCS or self.inside:
            return func(*args, **(kwargs or {}))
        self.seen(_METHOD_SYNCS[name], f"Tensor.{name}()" if not name.startswith("__") else f"{name}(tensor)")
        self.inside = True  # the ATen sync under it is the same finding
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.inside = False


class _Aten(TorchDispatchMode):
    def __init__(self, seen, device: torch.device, methods: _Methods):
        super().__init__()
        self.seen, self.device, self.methods = seen, device, methods

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        base = func.__name__.split(".")[0]
        name = f"aten.{func.__name__}"
        plain = base.rstrip("_")
        if base in _ATEN_SYNCS:
            if not self.methods.inside:
                self.seen(Hazard.HOST_SYNC, name)
        elif base in _DATA_SHAPES or (base == "index" and _bool_index(args)):
            self.seen(Hazard.DATA_DEPENDENT_SHAPE, name)
        elif base == "repeat_interleave" and kwargs.get("output_size") is None and _tensor_arg(args, 1):
            self.seen(Hazard.DATA_DEPENDENT_SHAPE, name)
        elif plain in _RNG:
            self.seen(Hazard.RNG, name)
        elif base == "lift_fresh":
            self.seen(Hazard.HOST_TENSOR, f"{name} (torch.tensor(...) of host data)")
        out = func(*args, **kwargs)
        if self.device.type != "cpu" and base != "_local_scalar_dense":
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                    self.seen(Hazard.HOST_TENSOR, f"{name} (a CPU tensor)")
                    break
        return out


def _tensor_arg(args, i: int) -> bool:
    return len(args) > i and isinstance(args[i], torch.Tensor)


def _bool_index(args) -> bool:
    idx = args[1] if len(args) > 1 else ()
    return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in idx or ())


def find_hazards(root: torch.nn.Module, fn, device: torch.device) -> list[Finding]:
    """Run fn() (a forward of root) once and name every op that a graph could not capture faithfully."""
    tracker = ModuleTracker(root)
    found: dict[Finding, None] = {}

    def seen(hazard: Hazard, op: str) -> None:
        found.setdefault(Finding(hazard, op, tracker.current))

    methods = _Methods(seen)
    with tracker.active(), methods, _Aten(seen, device, methods), torch.no_grad():
        fn()
    return list(found)


def refusal(model_name: str, findings: list[Finding]) -> str | None:
    """The one sentence `gmtool capture` refuses with, or None when nothing would break capture."""
    bad = [f for f in findings if f.hazard.breaks_capture]
    if not bad:
        return None
    return (
        f"{model_name} cannot be captured as a CUDA graph: "
        + "; ".join(map(str, bad))
        + " (gmtool verify lists every op that would break capture or freeze host state)"
    )


def model_hazards(bench, compositions: tuple[str, ...] | None = None) -> list[Finding]:
    """The hazards of the workbench model's forward as gmtool runs it, on small batches of the run's scenario
    (default: one decode request, or one three-token prefill: any KV cache the run built holds them)."""
    from gmtool.core.compositions import parse_composition

    from gmtool.config import kv_len

    cfg = bench.cfg
    if compositions is None:
        compositions = ("1",) if cfg.scenario == "decode" else ("3",)
    comps = [parse_composition(text, cfg.seed) for text in compositions]
    # a run of small buckets, few sequences or a short context has no buffers for these batches: probe with the
    # ones it holds, else with the smallest step of its kind (any batch of the kind shows the forward's ops)
    fits = [
        c
        for c in comps
        if c.num_tokens <= cfg.policy().max_tokens
        and c.num_seqs <= cfg.max_num_seqs
        and all(kv_len(p) <= cfg.max_kv_len for p in c.parts)
    ]
    smallest = "1" if cfg.scenario == "decode" else str(min(3, cfg.policy().max_tokens, cfg.max_kv_len))
    found: dict[Finding, None] = {}
    for comp in fits or [parse_composition(smallest, cfg.seed)]:
        fn, _ = bench.eager_fn(bench.batch(comp))
        found.update(dict.fromkeys(find_hazards(bench.lm.model, fn, bench.device)))
    return list(found)
