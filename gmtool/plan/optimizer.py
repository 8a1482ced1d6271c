"""The capture set that minimizes the expected step time of a workload under memory, capture-time and graph-count
budgets.

The cost model is the engines' dispatch rule: a step of n tokens runs on the smallest captured size s >= n,
padded, and pays that graph's replay latency g(s); a step larger than every captured size runs eager and pays
e(n). Graph memory is the pools' (max over graphs when they share one pool, captured largest first; the sum
when each has its own) plus each graph's memory outside the pool where it is known; capture time is the sum.

The method: with candidate sizes s_1 < ... < s_m and chosen sizes i_1 < ... < i_k, the steps split into
runs (0, s_i1], (s_i1, s_i2], ..., (s_ik, inf): the total is
    sum_j g(s_ij) * W(s_i{j-1}, s_ij]  +  sum over steps n > s_ik of e(n)
where W(a, b] counts the steps of a < n <= b. It depends on consecutive pairs only, so a dynamic program over
the sorted candidates ("the last chosen size is s_i") finds the optimum: each state keeps the Pareto set of
(time so far, graphs, capture seconds, summed memory, largest pool) over the resources a budget constrains, so
no feasible set that could still win is dropped. Under a shared pool the memory is the largest pool plus the
summed memory outside it. Budgeted capture time and memory are counted in whole steps of 1/GRID of their budget,
rounded up: every set the program accepts fits, and the Pareto sets stay small (with exact sums they grew with
every subset: minutes for 35 buckets with memory outside the pool). A set within one step of a budget may be
missed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum

import numpy as np
import pandas as pd

from gmtool.errors import GmtoolError


class PoolSharing(StrEnum):
    SHARED = "shared"  # one pool for all graphs (vLLM, SGLang, gmtool): the largest pool + overheads
    INDEPENDENT = "independent"  # a pool per graph: the sum


@dataclass(frozen=True)
class Budgets:
    memory_bytes: float | None = None
    capture_s: float | None = None
    max_graphs: int | None = None


@dataclass
class Choice:
    sizes: tuple[int, ...]
    total_ms: float  # over every step of the workload
    steps: int
    graph_memory_bytes: float | None  # None: the costs hold no memory figures (the CPU backend)
    capture_s: float
    eager_steps: int  # steps above every captured size (or, without padding, not captured exactly)
    eager_extrapolated_steps: int = 0  # of those, steps whose eager latency lies beyond the measured eager sizes

    @property
    def ms_per_step(self) -> float:
        return self.total_ms / self.steps

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(sizes=list(self.sizes), ms_per_step=self.ms_per_step)
        return d


class Problem:
    """workload: step counts per num_tokens; eager_ms: eager latency per num_tokens (the workload's sizes);
    costs: per size (index) graph_ms, pool_bytes, overhead_bytes, capture_s, for every size that a set to
    optimize or evaluate may hold."""

    def __init__(
        self,
        workload: pd.Series,
        eager_ms: pd.Series,
        costs: pd.DataFrame,
        sharing: PoolSharing = PoolSharing.SHARED,
        eager_extrapolated=(),
        decode_steps: pd.Series | None = None,
    ):
        """decode_steps: per size, how many of its steps are pure decode (what a decode-only engine's graphs may
        serve); None: every step."""
        self.n = workload.index.to_numpy(dtype=np.int64)
        self.w = workload.to_numpy(dtype=float)
        self.wd = self.w if decode_steps is None else decode_steps.reindex(workload.index).fillna(0).to_numpy(float)
        self.e = eager_ms.reindex(workload.index).to_numpy(dtype=float)
        self.e_guess = np.isin(self.n, np.asarray(list(eager_extrapolated), dtype=np.int64))
        if np.isnan(self.e).any():
            raise GmtoolError("no eager latency for some step size of the workload")
        self.costs, self.sharing = costs.sort_index(), PoolSharing(sharing)
        self.steps = int(self.w.sum())
        self._cum_w = np.concatenate([[0.0], np.cumsum(self.w)])
        self._tail_e = np.concatenate([np.cumsum((self.w * self.e)[::-1])[::-1], [0.0]])  # steps from index i on

    # -- the figures of a given set ------------------------------------------------------------------
    def memory(self, sizes) -> float | None:
        c = self.costs.loc[list(sizes)]
        if c["pool_bytes"].isna().any() or self.costs["pool_bytes"].isna().all():
            return None
        if not len(c):
            return 0.0
        if self.sharing is PoolSharing.SHARED:
            return float(c["pool_bytes"].max() + c["overhead_bytes"].sum())
        return float((c["pool_bytes"] + c["overhead_bytes"]).sum())

    def evaluate(self, sizes, padding: bool = True, decode_only: bool = False) -> Choice:
        """The set's figures on this workload. padding=False: only a step whose size was captured exactly runs
        on a graph (TensorRT-LLM's default); the others run eager. decode_only: only pure decode steps may run
        on a graph (SGLang's and TensorRT-LLM's graphs)."""
        sizes = tuple(sorted({int(s) for s in sizes}))
        g = self.costs.loc[list(sizes), "graph_ms"].to_numpy(dtype=float)
        arr = np.asarray(sizes, dtype=np.int64)
        at = np.searchsorted(arr, self.n, side="left")  # index of the smallest size >= n
        fits = at < len(arr)
        if not padding:
            fits &= np.isin(self.n, arr)
        per = np.where(fits, g[np.minimum(at, max(len(arr) - 1, 0))] if len(arr) else 0.0, self.e)
        served = self.wd if decode_only else self.w  # steps a graph may serve; the rest run eager
        eager = np.where(fits, 0.0, served) + (self.w - served)
        return Choice(
            sizes,
            float((per * served).sum() + (self.e * (self.w - served)).sum()),
            self.steps,
            self.memory(sizes),
            float(self.costs.loc[list(sizes), "capture_s"].sum()),
            int(eager.sum()),
            int(eager[self.e_guess].sum()),
        )

    # -- the optimum -----------------------------------------------------------------------------------
    def optimize(self, budgets: Budgets = Budgets(), among=None) -> Choice:
        cand = self.costs.loc[sorted({int(s) for s in (among if among is not None else self.costs.index)})]
        if budgets.memory_bytes is not None and cand["pool_bytes"].isna().any():
            raise GmtoolError(
                "a memory budget needs graph memory figures: plan from a CUDA results file or measure on CUDA"
            )
        best = self.evaluate(())
        found = self._dp(cand, budgets)
        return found if found is not None and _better(found, best) else best

    def _dp(self, cand: pd.DataFrame, budgets: Budgets) -> Choice | None:
        sizes = cand.index.to_numpy(dtype=np.int64)
        if not len(sizes):
            return None
        g = cand["graph_ms"].to_numpy(dtype=float)
        upto = np.searchsorted(self.n, sizes, side="right")  # steps with n <= size: indices < upto
        W, tail = self._cum_w[upto], self._tail_e[upto]
        zero = np.zeros(len(sizes))
        cap = zero if budgets.capture_s is None else _steps(cand["capture_s"].to_numpy(dtype=float), budgets.capture_s)
        add, pool = zero, zero  # memory, in steps of the budget: summed, and the largest pool (shared)
        m = budgets.memory_bytes
        if m is not None:
            pools, over = cand["pool_bytes"].to_numpy(dtype=float), cand["overhead_bytes"].to_numpy(dtype=float)
            if self.sharing is PoolSharing.SHARED:
                add, pool = _steps(over, m), _steps(pools, m)
            else:
                add = _steps(pools + over, m)
        # labels: (time so far, (graphs, capture steps, memory steps summed, largest pool's steps), chosen)
        dims = (budgets.max_graphs is not None, budgets.capture_s is not None, bool(add.any()), bool(pool.any()))
        most = budgets.max_graphs

        def fits(res) -> bool:
            return (most is None or res[0] <= most) and res[1] <= GRID and res[2] + res[3] <= GRID

        labels: list[list[tuple]] = []  # per last chosen index
        done = None
        for i in range(len(sizes)):
            new = []
            first = (g[i] * W[i], (1, cap[i], add[i], pool[i]), (i,))
            if fits(first[1]):
                new.append(first)
            for j in range(i):
                step = g[i] * (W[i] - W[j])
                for t, (k, c, a, p), ch in labels[j]:
                    res = (k + 1, c + cap[i], a + add[i], max(p, pool[i]))
                    if fits(res):
                        new.append((t + step, res, ch + (i,)))
            labels.append(_pareto(new, dims))
            for t, res, ch in labels[i]:
                total = t + tail[i]
                if done is None or (total, len(ch)) < (done[0], len(done[1])):
                    done = (total, ch)
        if done is None:
            return None
        return self.evaluate(tuple(int(sizes[i]) for i in done[1]))


GRID = 256  # steps a budgeted capture time or graph memory is counted in (rounded up: what fits, fits)


def _steps(x: np.ndarray, budget: float) -> np.ndarray:
    """x in whole steps of budget / GRID, rounded up (over the budget: GRID + 1, which never fits)."""
    if budget <= 0:
        return np.where(x > 0, GRID + 1, 0).astype(float)
    return np.minimum(np.ceil(x / (budget / GRID) - 1e-9), GRID + 1).astype(float)


def _better(a: Choice, b: Choice) -> bool:
    """Faster, then fewer graphs, then less memory."""
    return (round(a.total_ms, 9), len(a.sizes), a.graph_memory_bytes or 0) < (
        round(b.total_ms, 9),
        len(b.sizes),
        b.graph_memory_bytes or 0,
    )


def _pareto(labels: list[tuple], dims: tuple[bool, ...]) -> list[tuple]:
    """Labels no other beats on time and on every budgeted resource; without budgets, the fastest (fewest
    graphs on a tie)."""
    labels.sort(key=lambda lab: (lab[0], lab[1][0], lab[1][2], lab[1][1]))
    if not any(dims):
        return labels[:1]
    if not any(dims[1:]):  # only the graph count: the fastest label per count, fewer graphs only if faster
        kept, fewest = [], None
        for lab in labels:
            if fewest is None or lab[1][0] < fewest:
                kept.append(lab)
                fewest = lab[1][0]
        return kept
    on = [i for i, d in enumerate(dims) if d]
    if len(on) == 1:  # one resource: a label is kept when it uses less than every faster one
        kept, least = [], None
        for lab in labels:
            if least is None or lab[1][on[0]] < least:
                kept.append(lab)
                least = lab[1][on[0]]
        return kept
    kept: list[tuple] = []
    seen = set()
    for lab in labels:  # every kept label is at least as fast: it dominates when no resource is higher
        r = tuple(lab[1][i] for i in on)
        if r in seen:  # resources in whole steps: the faster label with the same ones is already kept
            continue
        seen.add(r)
        if not any(all(k[1][i] <= x + 1e-12 for i, x in zip(on, r)) for k in kept):
            kept.append(lab)
    return kept
