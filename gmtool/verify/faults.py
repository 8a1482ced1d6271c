"""Bugs injected on purpose (`gmtool verify --inject NAME`), each the kind engines have shipped, each applied to
one executor only: verify must catch every one and name where it is.

- stale-positions / stale-slot-mapping: copy-in skips that field when the token count repeats (a steady
  decode); the graph reads the previous step's values, and with stale slots writes K/V over live tokens.
- skip-pad-zero: padding is not rewritten; padded lanes keep an earlier batch's slots, sequences, lengths.
- stale-block-table: the entries past each sequence's blocks keep an earlier batch's block ids, and attention
  gathers whole rows (as gmtool's torch decode reference does, masking past the length): once such a block is
  freed, the replay reads a block no live request owns.
- freeze-block-tables / freeze-seq-lens: attention reads the block tables / kv lengths of the capture's batch
  (host data frozen into the graph); once those requests finish, their blocks are unused memory.
- pad-read[:L]: under capture only, decoder layer L's MLP output adds the bucket's last row to every row: a
  graph that reads a padding lane (L defaults to 0).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

from gmtool.errors import GmtoolError
from gmtool.model import families

FAULTS = (
    "stale-positions",
    "stale-slot-mapping",
    "skip-pad-zero",
    "stale-block-table",
    "freeze-block-tables",
    "freeze-seq-lens",
    "pad-read",
    "share-output-across-buckets",
)


@dataclass(frozen=True)
class Fault:
    name: str
    layer: int = 0

    def __str__(self) -> str:
        return self.name + (f":{self.layer}" if self.name == "pad-read" and self.layer else "")


def parse_fault(text: str | None, num_layers: int | None = None) -> Fault | None:
    if text is None:
        return None
    name, _, arg = text.partition(":")
    if name not in FAULTS or (arg and name != "pad-read") or (arg and not arg.isdigit()):
        raise GmtoolError(f"unknown --inject {text!r}: choose from {', '.join(FAULTS)} (pad-read takes :LAYER)")
    layer = int(arg) if arg else 0
    if num_layers is not None and layer >= num_layers:
        raise GmtoolError(f"--inject {text!r}: the model has layers 0..{(num_layers or 1) - 1}")
    return Fault(name, layer)


def inject(fault: Fault, ex) -> contextlib.AbstractContextManager:
    """Apply fault to executor ex; leaving the context removes what it added to shared objects (the model).
    Under auto, the input faults patch the one arena its parts share, the others every part's graphs."""
    from gmtool.core.auto import parts_of  # torch: not loaded when options are parsed

    if fault.name in ("stale-positions", "stale-slot-mapping"):
        _stale_field(ex, 1 if fault.name == "stale-positions" else 2)
    elif fault.name == "skip-pad-zero":
        ex.inputs._pad = lambda *a: None
    elif fault.name == "stale-block-table":
        _stale_table_tails(ex)
    elif fault.name in ("freeze-block-tables", "freeze-seq-lens"):
        for part in parts_of(ex):
            _freeze(part, "block_tables" if fault.name == "freeze-block-tables" else "kv_lens")
    elif fault.name == "pad-read":
        return _pad_read(parts_of(ex), fault.layer)
    elif fault.name == "share-output-across-buckets":
        _share_output(parts_of(ex))
    return contextlib.nullcontext()


def _stale_field(ex, row: int) -> None:
    """Copy-in skips the field when a batch has the same token count as the key's previous one (a steady
    decode): it keeps the previous step's values, which are valid positions and slots, only not this step's."""
    inputs, load = ex.inputs, ex.inputs.load
    last = {}

    def stale_load(batch, key, copy=True):
        tok = inputs.staged(key)[0]
        kept = tok[row].copy()
        load(batch, key, copy=False)
        if last.get(key) == batch.num_tokens:
            tok[row] = kept
        last[key] = batch.num_tokens
        if copy:
            inputs.copy_in(key)
        return inputs.views(key)

    inputs.load = stale_load


def _stale_table_tails(ex) -> None:
    pad = ex.inputs._pad

    def pad_keeping_tables(tok, seq, cu, bt, now, before):
        _, b, w = now
        kept = bt.copy()
        pad(tok, seq, cu, bt, now, before)
        bt[:b, w:] = kept[:b, w:]
        bt[b:] = kept[b:]

    ex.inputs._pad = pad_keeping_tables


class _FrozenAttention:
    """The executor's attention backend, reading one metadata field from a copy made at capture."""

    def __init__(self, inner, field: str):
        self.inner, self.field, self.frozen = inner, field, {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _views(self, ctx):
        frozen = self.frozen.get(id(getattr(ctx.views, self.field)))
        return ctx if frozen is None else replace(ctx, views=replace(ctx.views, **{self.field: frozen}))

    def decode(self, ctx, *a):
        return self.inner.decode(self._views(ctx), *a)

    def masked(self, ctx, *a):
        return self.inner.masked(self._views(ctx), *a)

    def planned(self, ctx, *a):
        return self.inner.planned(self._views(ctx), *a)

    def bind(self, ctx, *a):  # a piecewise runner binds its kernels to the frozen copy, its plan stays ctx's
        return self.inner.bind(ctx, *a, views=self._views(ctx).views)


def _freeze(ex, field: str) -> None:
    frozen = _FrozenAttention(ex.attention, field)
    ex.attention = frozen
    capture = ex.capture

    def capture_frozen(key, batch):
        live = getattr(ex.inputs.load(batch, key), field)
        frozen.frozen[id(live)] = live.clone()  # made before capture: a constant the graph reads
        return capture(key, batch)

    ex.capture = capture_frozen


@contextlib.contextmanager
def _pad_read(parts: list, layer: int):
    lm = parts[0].lm
    stack = families.decoder_layers(lm.model, lm.num_layers)
    mlp = families.part(stack[layer], families.MLP_NAMES) if stack is not None else None
    if mlp is None:
        raise GmtoolError(f"--inject pad-read:{layer}: no MLP found in layer {layer} of {type(lm.model).__name__}")
    recording = [False]

    def flagged(record):
        def record_flagged(ex_, entry, fn):
            recording[0] = True
            try:
                record(ex_, entry, fn)
            finally:
                recording[0] = False

        return record_flagged

    def hook(module, args, out):
        if recording[0]:
            return out + out[..., -1:, :]

    for ex in parts:
        ex.forward_impl.record = flagged(ex.forward_impl.record)
    handle = mlp.register_forward_hook(hook, prepend=True)  # before any tap sees it
    try:
        yield
    finally:
        handle.remove()


def weak_view(t):
    """A tensor over t's memory that does not own it: the allocator counts the memory free once t is gone, as
    engines' weak references to graph outputs (vLLM's weak_ref_tensor, TensorRT-LLM's make_weak_ref) do."""
    import torch

    st = t.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(st.data_ptr(), t.device, st.nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(alias, t.storage_offset(), t.shape, t.stride())


def _share_output(parts: list) -> None:
    """Graphs hand out their logits from graph memory through a weak reference instead of copying them into the
    persistent output buffer: the capture frees that memory to the pool, where the graphs of later buckets
    (sharing the pool) reuse it, so a bucket's result is overwritten by the next replay of another one."""
    graphs = [ex for ex in parts if not ex.mode.piecewise]
    if not graphs:
        raise GmtoolError(
            "--inject share-output-across-buckets: it is modeled on full graphs (piecewise ends with the LM "
            "head's own write into the persistent logits); use full, full-narrow or auto"
        )
    inputs, held = graphs[0].inputs, {}
    output = inputs.output
    for ex in graphs:
        impl, current = ex.forward_impl, [None]

        def run_sharing(ex_, views, run=impl.run, current=current):
            if current[0] is None:  # eager (warm-up, the same-shape check): as before
                return run(ex_, views)
            out = ex_.lm.forward_logits(views.input_ids, views.positions, views.logits_indices)
            # CUDA: a weak reference, its memory back in the pool. The CPU tape has no pool to give memory back
            # to (freed host memory may be unmapped): the tensor stays one of the tape's intermediates, the
            # memory verify poisons as the graph's own
            held[current[0]] = weak_view(out) if out.is_cuda else out

        def record_sharing(ex_, entry, fn, record=impl.record, current=current):
            current[0] = entry.key
            try:
                record(ex_, entry, fn)
            finally:
                current[0] = None

        impl.run, impl.record = run_sharing, record_sharing
    inputs.output = lambda key, n: held[key][:n] if key in held else output(key, n)
