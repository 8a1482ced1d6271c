"""The --fuse decode variants in one process, taking turns: `bench --stages decode-ab`.

A GPU's speed drifts within a run. On the H200 (2026-12-01, .diag firstex) qwen3-0.6b's --fuse graphs replayed
at 1.258 ms (B=1) in a fresh machine's first seconds and at 1.375 ms later, the same graph and kernels: the first
executor's graphs slowed too, once a second one had run. Stages timed one after another inherit that order, so a
variant measured first looks faster. Here one model is built, each variant's graphs are captured once, and the
variants take turns, round after round, the order rotating: the figures of one round share the machine's state.

Variants (the fused layers' LayerOps, set before each capture; a graph keeps what it captured): --fuse alone,
--fuse --small-m-gemm, and with --pdl (left out, with a note, where PDL cannot run). Every graph's logits are
checked against the plain --fuse eager forward of the same batch, computed right before its capture.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field

import torch

from gmtool.measure.bench import DECODE_VARIANTS
from gmtool.records import Status

ROUNDS_PER_VARIANT = 2  # each variant goes first in as many rounds as the others


@dataclass(frozen=True)
class Variant:
    name: str  # the decode stage that times it alone
    label: str
    small_m: bool
    pdl: bool


# the bench's --fuse decode stages without --compile, by their stage names
VARIANTS = tuple(
    Variant(stage, label, small_m, pdl)
    for stage, label, compile_, fuse, small_m, pdl, _ in DECODE_VARIANTS
    if fuse and not compile_
)


@dataclass
class Workload:
    """One (variant, batch) pair: its graph's first output and error against eager, and each round's median."""

    variant: str
    bucket: int
    kv_len: int
    rel_err: float = float("nan")
    ok: bool = False
    rounds: list[float] = field(default_factory=list)
    samples: list[float] = field(default_factory=list)

    def row(self) -> dict:
        from gmtool.measure.timing import summarize

        t = summarize(self.samples)
        return {
            "variant": self.variant,
            "bucket": self.bucket,
            "composition": f"1*{self.bucket}@{self.kv_len - 1}",
            "status": Status.OK if self.ok else Status.UNSAFE,
            "max_rel_err": self.rel_err,
            # pooled over the rounds, as a decode stage's rows (its median is what the summary compares)
            "latency_ms": dataclasses.asdict(t) if t and self.ok else None,
            "round_medians_ms": [round(r, 4) for r in self.rounds],
        }


def rotated(items: list, k: int) -> list:
    """items starting at position k mod len: round k's order (no variant always goes first)."""
    k %= len(items)
    return items[k:] + items[:k]


def as_stages(result: dict) -> dict[str, dict]:
    """The stage's rows per variant, as the decode stage of that name writes them ({"rows": [...]}, the notes on
    the PDL one's): the summary judges them as it judges those."""
    out: dict[str, dict] = {}
    for r in result.get("rows", []):
        out.setdefault(r["variant"], {"rows": []})["rows"].append(r)
    for v in VARIANTS:
        if v.pdl and result.get("notes"):  # PDL could not run: the variant is absent, its reason is not
            out.setdefault(v.name, {"rows": []})["notes"] = result["notes"]
    return out


def run(iters: int, rounds: int | None = None, warmup: int = 10) -> dict:
    """rounds: default ROUNDS_PER_VARIANT per variant that runs."""
    from gmtool.core.compositions import parse_composition
    from gmtool.measure.bench import BATCHES, KV_LENS, _decode_cfg
    from gmtool.measure.timing import rel_err_per_seq, time_ms, tolerances_for
    from gmtool.measure.workbench import Workbench
    from gmtool.modes import GraphMode

    bench = Workbench.build(_decode_cfg(False, iters, fuse=True, small_m=True, pdl=True))
    ops = bench.lm.fused.ops
    rows_on, pdl_on = ops.small_m, ops.pdl  # what --small-m-gemm and --pdl set here (0: PDL cannot run)
    notes = [n for n in bench.lm.notes if n.startswith("--pdl")]
    variants = [v for v in VARIANTS if not v.pdl or pdl_on]
    batches = {(b, kv): bench.batch(parse_composition(f"1*{b}@{kv - 1}", seed=b)) for b in BATCHES for kv in KV_LENS}
    _, tol = tolerances_for(bench.lm.model.dtype)

    def eager(batch) -> torch.Tensor:
        ops.small_m, ops.pdl = 0, 0
        fn, logits = bench.eager_fn(batch)
        fn()
        return logits.clone()

    rounds = rounds or ROUNDS_PER_VARIANT * len(variants)
    held, work = {}, []
    try:  # a failing stage leaves the bench's process: its graphs and pools go with it
        for v in variants:
            for (b, kv), batch in batches.items():
                ref = eager(batch)  # the batches share K/V blocks: eager right before the graph reads the same K/V
                ops.small_m, ops.pdl = (rows_on if v.small_m else 0), (pdl_on if v.pdl else 0)
                ex = held.get(v.name) or held.setdefault(v.name, bench.executor(GraphMode.FULL))
                w = Workload(v.name, b, kv)
                w.rel_err = rel_err_per_seq(ex.step(batch), ref)
                w.ok = w.rel_err < tol
                work.append(w)
        for k in range(rounds):
            for w in rotated(work, k * len(batches)):
                if not w.ok:
                    continue
                ex = held[w.variant]
                batch = batches[(w.bucket, w.kv_len)]
                entry = ex.prepare(batch)  # loads this batch's layout: the graph reads nothing another bucket left
                ms = time_ms(lambda: entry.replay(batch, False), iters, warmup, bench.device)  # noqa: B023
                w.rounds.append(statistics.median(ms))
                w.samples += ms
    finally:
        ops.small_m, ops.pdl = rows_on, pdl_on
        for ex in held.values():
            ex.release()
    return {
        "variants": {v.name: v.label for v in variants},
        "rounds": rounds,
        "iters": iters,
        "small_m_rows": rows_on,
        "pdl_mode": int(pdl_on),
        "notes": notes,
        "rows": [w.row() for w in work],
    }
