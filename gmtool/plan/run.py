"""gmtool plan's work: a workload and per-bucket costs in, the chosen capture set and its comparison with the
engines' defaults out."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from gmtool.errors import GmtoolError
from gmtool.plan.costs import CostTable
from gmtool.plan.engines import ENGINE_DEFAULTS
from gmtool.plan.lazy import lazy_capture
from gmtool.plan.optimizer import Budgets, Choice, PoolSharing, Problem
from gmtool.plan.workload import by_size
from gmtool.records import MAX_SIZE

MAX_CANDIDATES = 128  # the exact program is quadratic in candidates: beyond this, the most frequent sizes


@dataclass
class PlanInputs:
    steps: pd.DataFrame  # the workload: num_tokens, num_seqs, count
    workload_path: Path
    costs: CostTable
    budgets: Budgets
    sharing: PoolSharing = PoolSharing.SHARED
    candidates: list[int] | None = None  # None: the measured buckets and the workload's sizes within them
    max_tokens: int | None = None  # the largest step the engine allows
    notes: list[str] = field(default_factory=list)


@dataclass
class PlanResult:
    plan: Choice
    all_eager: Choice
    defaults: list[tuple[object, Choice]]  # (EngineDefault, its figures on the workload)
    curve: list[Choice]  # the best set at each memory cap (or graph count): the Pareto curve
    costs: pd.DataFrame  # per candidate size: graph_ms, pool_bytes, overhead_bytes, capture_s, source
    candidates: list[int]
    notes: list[str]
    lazy: dict | None = None  # the plan's sizes captured on first miss instead (gmtool.plan.lazy)
    extrapolated: dict[str, int] = field(default_factory=dict)  # per default list: its sizes beyond the measured
    plan_decode_only: Choice | None = None  # the plan's list as a decode-only engine runs it


def check_candidates(candidates: list[int] | None, max_tokens: int | None) -> None:
    """--candidates as plan takes them: at most MAX_CANDIDATES sizes, none above --max-tokens (a step never gets
    there: a graph of that size would only be captured for nothing)."""
    if candidates is None:
        return
    # a size numpy's int64 would wrap, or none a step could have
    if (bad := next((c for c in candidates if not 1 <= c < MAX_SIZE), None)) is not None:
        raise GmtoolError(f"--candidates: size {bad} is not a token count from 1 to {MAX_SIZE - 1:,}")
    if len(set(candidates)) > MAX_CANDIDATES:
        raise GmtoolError(f"--candidates: {len(set(candidates))} sizes; plan takes at most {MAX_CANDIDATES}")
    if max_tokens is not None and max(candidates) > max_tokens:
        raise GmtoolError(f"--candidates: size {max(candidates)} is above --max-tokens {max_tokens}")


def check_steps(sizes, max_tokens: int | None) -> None:
    if max_tokens is not None and max(sizes) > max_tokens:
        raise GmtoolError(f"the workload has a step of {max(sizes)} tokens, above --max-tokens {max_tokens}")


def candidate_sizes(inp: PlanInputs, sizes: pd.Series) -> tuple[list[int], list[str]]:
    """inp's candidates (checked with check_candidates, and its steps with check_steps, before any measurement)."""
    measured, failed = inp.costs.buckets, set(inp.costs.failed)
    if inp.candidates is not None:
        bad = sorted(failed & set(inp.candidates))
        said = [
            f"--candidates {', '.join(map(str, bad))}: left out, {inp.costs.mode} replays there were not ok in the "
            "results (UNSAFE, error or out of memory); a plan never captures such a size"
        ]
        if not set(inp.candidates) - failed:
            raise GmtoolError(said[0].replace("left out", "none can be captured"))
        return sorted(set(inp.candidates) - failed), said if bad else []
    notes = []
    top = max(measured)
    if inp.max_tokens is not None and top > inp.max_tokens:  # no step goes there: the workload's sizes up to it
        above = [b for b in measured if b > inp.max_tokens]
        notes.append(
            f"measured buckets {', '.join(map(str, above))} are above --max-tokens {inp.max_tokens}: not candidates"
        )
        measured, top = [b for b in measured if b <= inp.max_tokens], inp.max_tokens
    if len(measured) > MAX_CANDIDATES:  # the measured buckets alone are too many: those the most steps pad to
        arr = np.asarray(measured)
        serving = pd.Series(sizes.to_numpy(), index=arr[np.minimum(np.searchsorted(arr, sizes.index), len(arr) - 1)])
        ranked = serving.groupby(level=0).sum().sort_values(ascending=False).index.tolist()
        kept = sorted(set(ranked[: MAX_CANDIDATES - 1]) | {top})
        notes.append(
            f"{len(measured)} measured buckets: the {len(kept)} the most steps pad to are candidates (give "
            "--candidates to choose them)"
        )
        return [int(b) for b in kept], notes
    # a failed bucket's size is no candidate, though a line between its neighbours would cost it
    extra = sizes[(sizes.index <= top) & ~sizes.index.isin(measured) & ~sizes.index.isin(list(failed))]
    room = MAX_CANDIDATES - len(measured)
    if len(extra) > room:
        notes.append(
            f"{len(extra)} step sizes within the measured range: the {max(room, 0)} most frequent are "
            f"candidates (give --candidates to choose them)"
        )
        extra = extra.sort_values(ascending=False).iloc[: max(room, 0)]
    return sorted(set(measured) | {int(s) for s in extra.index}), notes


def make_plan(inp: PlanInputs) -> PlanResult:
    sizes = by_size(inp.steps)
    notes = list(inp.costs.notes) + list(inp.notes)
    cands, more = candidate_sizes(inp, sizes)
    notes += more
    every = sorted(set(cands) | {s for d in ENGINE_DEFAULTS for s in d.sizes})
    costs = inp.costs.graph_at(every)
    est = costs.loc[cands, "source"]
    n_est = int((est != "measured").sum())
    if n_est:
        notes.append(_estimated_note(cands, est, inp.costs.buckets))
    eager_est = inp.costs.eager_estimated(sizes.index)
    if eager_est:
        notes.append(
            f"eager latency of {eager_est} of {len(sizes)} step sizes estimated linearly from the measured eager rows"
        )
    memory = inp.costs.graph["pool_bytes"]
    if memory.isna().all():
        notes.append("no graph memory in these costs (the CPU backend measures none): memory is not planned")
    elif memory.isna().any():
        notes.append(
            f"graph memory is missing for measured buckets {', '.join(map(str, memory.index[memory.isna()]))}: "
            "theirs is estimated from the buckets that have it"
        )
    elif not costs["overhead_bytes"].any():
        notes.append("graph memory is the allocator pool only (no per-graph memory outside the pool measured)")
    guessed = inp.costs.eager_extrapolated(sizes.index)
    steps = inp.steps
    decode = steps[steps["num_tokens"] == steps["num_seqs"]].groupby("num_tokens")["count"].sum()
    problem = Problem(sizes, inp.costs.eager_at(sizes.index), costs, inp.sharing, guessed, decode)
    plan = problem.optimize(inp.budgets, among=cands)
    defaults = [(d, problem.evaluate(d.sizes, d.padding, d.decode_only)) for d in ENGINE_DEFAULTS]
    # the plan's list given to a decode-only engine (its flags pad, as TensorRT-LLM's enable_padding: true)
    plan_decode_only = problem.evaluate(plan.sizes, True, True)
    other = int(sizes.sum() - decode.sum())
    if other:
        only = [d.name for d in ENGINE_DEFAULTS if d.decode_only]
        notes.append(
            f"{', '.join(only)} replay their graphs for decode batches only: their rows run the workload's {other} "
            "prefill and mixed steps eager"
        )
    extrapolated = {}
    for d, _ in defaults:
        n = int((costs.loc[list(d.sizes), "source"] == "extrapolated").sum())
        extrapolated[d.name] = n
        if n:
            lo, hi = min(inp.costs.buckets), max(inp.costs.buckets)
            where = [
                (sum(s > hi for s in d.sizes), f"above the largest, {hi}"),
                (sum(s < lo for s in d.sizes), f"below the smallest, {lo}"),
            ]
            notes.append(
                f"{d.name}: {n} of its {len(d.sizes)} sizes lie outside the measured buckets "
                f"({', '.join(f'{k} {w}' for k, w in where if k)}): their figures are extrapolated"
            )
    extrapolated["plan"] = int((costs.loc[list(plan.sizes), "source"] == "extrapolated").sum())
    notes += _beyond_measured(sizes, inp, cands)
    lazy = lazy_capture(inp.steps, plan.sizes, costs, inp.costs.eager_at(list(plan.sizes)))
    return PlanResult(
        plan,
        problem.evaluate(()),
        defaults,
        _curve(problem, inp.budgets, cands, plan),
        costs.loc[cands],
        cands,
        notes,
        lazy,
        extrapolated,
        plan_decode_only,
    )


def _estimated_note(cands: list[int], source: pd.Series, measured: list[int]) -> str:
    """How the candidate sizes no bucket measured were costed (gmtool.plan.costs.estimate), by where they lie."""
    lo, hi = min(measured), max(measured)
    unmeasured = [c for c in cands if source[c] != "measured"]
    ways = [
        (sum(lo < c < hi for c in unmeasured), "between the measured buckets: interpolated linearly"),
        (sum(c < lo for c in unmeasured), f"below them: bucket {lo}'s figures"),
        (
            sum(c > hi for c in unmeasured),
            f"above them: bucket {hi}'s figures" if len(measured) == 1 else "above them: on a line through them",
        ),
    ]
    how = "; ".join(f"{n} {text}" for n, text in ways if n)
    return (
        f"{len(unmeasured)} of {len(cands)} candidate sizes were not measured, their latency, memory and capture "
        f"time estimated ({how})"
    )


def _beyond_measured(sizes: pd.Series, inp: PlanInputs, cands: list[int]) -> list[str]:
    """Steps above every candidate run eager in the plan, while the engines' longer lists are costed there on
    figures extrapolated from the measured buckets: a plan "slower" than the defaults then says more about the
    buckets measured than about the plan. Say so, and which buckets to measure."""
    top, largest = max(cands), int(sizes.index.max())
    above = int(sizes[sizes.index > top].sum())
    if not above:
        return []
    return [
        f"{100 * above / sizes.sum():.1f}% of the workload's steps are above the largest candidate size ({top}): "
        f"the plan runs them eager, while the engines' lists are costed there from extrapolated figures (marked "
        f"~); measure buckets up to {largest} tokens (compare --buckets, then --from) to plan those steps"
    ]


def _curve(problem: Problem, budgets: Budgets, cands: list[int], plan: Choice, points: int = 40) -> list[Choice]:
    """The best set under each memory cap (each candidate's pool size), or under each graph count when the
    costs hold no memory: the Pareto curve of step time against graph memory, ending at the plan."""
    c = problem.costs.loc[cands]
    if c["pool_bytes"].isna().any():
        top = min(len(cands), budgets.max_graphs or len(cands), points)
        return [problem.optimize(Budgets(None, budgets.capture_s, k), among=cands) for k in range(top + 1)]
    # each single graph's memory, then up to the plan's, and the plan: caps at single pools alone never reached
    # a plan of independent pools, or of memory outside the pool
    top = plan.graph_memory_bytes or 0.0
    single = sorted(float(v) for v in (c["pool_bytes"] + c["overhead_bytes"]).unique() if v <= top)
    caps = [single[i] for i in sorted({round(x) for x in np.linspace(0, len(single) - 1, min(points, len(single)))})]
    if caps and top > caps[-1]:  # above the largest single graph (pools apart, or memory outside the pool)
        caps += [float(x) for x in np.linspace(caps[-1], top, points // 8 + 1)[1:-1]]
    found = [problem.optimize(Budgets(cap, budgets.capture_s, budgets.max_graphs), among=cands) for cap in caps]
    found.append(plan)
    return list({ch.sizes: ch for ch in found}.values())


def needed_buckets(available: list[int], largest_step: int) -> list[int]:
    """The buckets worth measuring for a workload: those up to the first that holds its largest step."""
    over = [b for b in available if b >= largest_step]
    return [b for b in available if b <= (over[0] if over else available[-1])]
