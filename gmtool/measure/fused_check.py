"""--fuse judged against the model's own layers, once per run.

Every row of a --fuse run compares graphs with eager, and both run the fused layers: a fused block that computes
another model than the Hugging Face layers (a rotation, a gate or a norm the fused forward lacks) agrees with
itself everywhere. A review found twelve architectures doing that (relative error 0.06-1.05), unseen. So after
the rows are measured, one batch of the run runs eagerly through the fused layers and through the model's own,
and the error between them joins the run's notes; above the cross-shape tolerance for the dtype it is the run's
error (exit 1), since every figure of the run is then of another model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gmtool.core.compositions import Composition
from gmtool.errors import GmtoolError
from gmtool.measure.timing import rel_err_per_seq, tolerances_for


@dataclass(frozen=True)
class FusedCheck:
    composition: str
    rel_err: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.rel_err <= self.tolerance

    @property
    def note(self) -> str:
        return (
            f"--fuse against the model's own layers (eager, {self.composition}): relative error "
            f"{self.rel_err:.2g}, tolerance {self.tolerance:.2g}"
        )

    def error(self, model: str) -> str:
        return (
            f"--fuse computes another model than {model}'s own layers: relative error {self.rel_err:.3g} on "
            f"{self.composition} (tolerance {self.tolerance:.3g}); its rows measure that other model: run without "
            "--fuse"
        )


def check_fused(bench, comp: Composition, tolerance: float) -> FusedCheck:
    """comp's batch eagerly through bench's fused layers, then through the model's own (the same inputs and KV
    cache); the largest relative error of a sequence's logits."""
    from gmtool.model.fused import unfused

    batch = bench.batch(comp)
    with torch.no_grad():
        fn, logits = bench.eager_fn(batch)
        fn()
        fused = logits.clone()
        with unfused(bench.lm.fused):
            fn, logits = bench.eager_fn(batch)
            fn()
            own = logits.clone()
    return FusedCheck(comp.label, float(rel_err_per_seq(fused, own)), tolerance)


def judge_fused(bench, cfg, notes: list[str], errors: list[str]) -> None:
    """A sweep's check, once its rows are measured: the first composition of the largest bucket (prefill mixes
    there when the run has any) and of the smallest (the fused layers pick kernels by token count: the small-M
    GEMM, PDL, and at one token the norms folded into the GEMMs); a note for each, and an error where the fused
    layers compute another model."""
    if bench.lm.fused is None or not cfg.compositions_by_bucket:
        return
    if cfg.tp > 1:  # both forwards would need every rank in step; a --tp 1 run checks the same layers
        notes.append("--fuse not checked against the model's own layers under --tp (run --tp 1 for that)")
        return
    by_bucket = cfg.compositions_by_bucket
    for bucket in dict.fromkeys((cfg.largest_graph_bucket, min(by_bucket))):
        try:
            checked = check_fused(bench, by_bucket[bucket][0], tolerances_for(cfg.torch_dtype)[1])
        except GmtoolError as e:
            notes.append(f"--fuse not checked against the model's own layers on bucket {bucket}: {e}")
            continue
        except torch.OutOfMemoryError:  # the graphs are still alive: the rows stand, unchecked against the model
            notes.append(
                f"--fuse not checked against the model's own layers on bucket {bucket}: out of memory beside the graphs"
            )
            continue
        notes.append(checked.note)
        if not checked.ok:
            errors.append(checked.error(bench.lm.name))
