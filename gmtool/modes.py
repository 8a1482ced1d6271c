"""The modes a sweep can measure, and what each one means to the executor, the checks and the reports.

A new mode is one entry here plus, if it captures, what its executor does differently; nothing else compares
mode names.
"""

from __future__ import annotations

from enum import StrEnum


class GraphMode(StrEnum):
    EAGER = "eager"  # gmtool's eager forward: the reference and the baseline latency
    FULL = "full"  # one graph per bucket; prefill keys are widened to num_tokens x num_seqs
    FULL_NARROW = "full-narrow"  # prefill keyed by num_tokens alone: shown to freeze host metadata
    PIECEWISE = "piecewise"  # graphs between attention calls; attention runs eagerly between them
    HF_COMPILED = "hf-compiled"  # the peer: HF static cache + torch.compile reduce-overhead (compare only)
    AUTO = "auto"  # as engines default to: full graphs for uniform decode, piecewise otherwise, eager above

    @property
    def composed_of(self) -> dict[str, GraphMode]:
        """A composite mode: the mode serving each kind of batch ("decode": every request one new token;
        "mixed": prefill and mixed batches); a batch above the largest bucket runs eager. Empty: a plain mode."""
        if self is GraphMode.AUTO:
            return {"decode": GraphMode.FULL, "mixed": GraphMode.PIECEWISE}
        return {}

    @property
    def served_by(self) -> str | None:
        """What serves this mode's batches, as a record's served_by says: full, piecewise or eager (None: decided
        per batch, by a composite mode)."""
        if self.composed_of:
            return None
        if self is GraphMode.EAGER:
            return "eager"
        return "piecewise" if self.piecewise else "full"

    @property
    def captures(self) -> bool:
        """gmtool captures graphs for it (an executor serves it)."""
        return self in (GraphMode.FULL, GraphMode.FULL_NARROW, GraphMode.PIECEWISE, GraphMode.AUTO)

    @property
    def piecewise(self) -> bool:
        return self is GraphMode.PIECEWISE

    @property
    def has_pieces(self) -> bool:
        """Piecewise graphs serve some of its batches (piecewise itself, auto through its part): what
        --piecewise-impl shapes."""
        return GraphMode.PIECEWISE in (self, *self.composed_of.values())

    @property
    def wide_key(self) -> bool:
        """Full graphs for prefill need num_seqs in the key: the attention launch shape depends on it."""
        return self is GraphMode.FULL

    @property
    def expected_unsafe(self) -> bool:
        """Its UNSAFE rows are the finding it exists to show, not a failure of the run."""
        return self is GraphMode.FULL_NARROW

    @property
    def in_sweep(self) -> bool:
        """Run by gmtool's own sweep (the peer runs after it, on the sweep's model)."""
        return self is not GraphMode.HF_COMPILED


SWEEP_MODES = tuple(m for m in GraphMode if m.in_sweep)
CAPTURE_MODES = tuple(m for m in GraphMode if m.captures)
MEMORY_MODES = tuple(m for m in CAPTURE_MODES if not m.expected_unsafe)  # memreport measures these
