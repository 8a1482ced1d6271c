"""The graph memory ledger on CUDA: qwen3-0.6b over the 35 default decode buckets under every memory strategy,
predicted from 4 sampled buckets and checked against a capture of all 35 (memreport --sample 4 --check); then
`plan` on the three built-in workloads from those measured costs, against every engine default at equal or
lower graph memory. Prints the ledger, the prediction and the plan tables (run with -s to see them). One
composition per bucket and 2 timed iterations keep it to a few minutes on an H200."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEFAULT_DECODE = [1, 2, 4] + list(range(8, 257, 8))
MiB = 2**20


def _print(table) -> None:
    from rich.console import Console

    Console(width=160).print(table)


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    from gmtool.app import run_memreport
    from gmtool.config import SweepConfig
    from gmtool.memory.strategies import STRATEGIES

    cfg = SweepConfig(
        model="qwen3-0.6b",
        device="cuda",
        buckets=",".join(map(str, DEFAULT_DECODE)),
        compositions=",".join(f"1*{b}" for b in DEFAULT_DECODE),
        modes=("eager", "full"),
        max_kv_len=256,
        kv_cache_gb=10,
        num_iters=2,
        num_iters_warmup=1,
    )
    doc, _ = run_memreport(cfg, list(STRATEGIES), tmp_path_factory.mktemp("memreport"), sample=4, check=True)
    return doc


def test_ledger_per_bucket_and_strategy(checked):
    from gmtool.memory.ledger import cublas_workspace_bytes
    from gmtool.report.ledger import memreport_ledger_table

    d = checked.to_dict()
    _print(memreport_ledger_table(d))
    measured = [r for r in checked.strategies if r.status != "unavailable"]  # VMM needs g++ and cuda.h
    assert {r.strategy for r in measured} >= {"independent", "shared", "shared-ascending"}
    for r in measured:
        assert r.status == "ok", (r.strategy, r.reason)
        assert [x["bucket"] for x in r.ledger] == DEFAULT_DECODE, r.strategy
        first = max(r.ledger, key=lambda x: x["workspace_bytes"])  # the executor's first capture
        assert first["workspace_bytes"] == cublas_workspace_bytes(torch.cuda.get_device_capability())
        for x in r.ledger:
            parts = x["pool_bytes"] + x["outside_pool_bytes"] + x["inputs_bytes"] + x["workspace_bytes"]
            assert x["total_bytes"] == pytest.approx(parts) and x["pool_bytes"] >= 0, (r.strategy, x)
            # instantiation and upload cost little outside the pool (the driver counts in 2 MiB pages)
            assert -2 * MiB <= x["outside_pool_bytes"] < 256 * MiB, (r.strategy, x)
            assert x["kv_tokens_given_up"] == pytest.approx(x["total_bytes"] / 114_688, abs=1)  # K+V, 28 layers, bf16
        print(
            f"{r.strategy}: ledger total {r.ledger_total_bytes / MiB:.1f} MiB = {r.kv_tokens_given_up:,} KV "
            f"tokens; physical {r.physical_bytes / MiB:.1f} MiB; not given back after release "
            f"{r.after_release_bytes / MiB:.1f} MiB"
        )
    by = {r.strategy: r for r in measured}
    # the shared pool (largest first) costs far less than a pool per bucket, bucket by bucket summed
    assert by["shared"].ledger_total_bytes < by["independent"].ledger_total_bytes


def test_prediction_from_four_buckets_within_5_percent(checked):
    from gmtool.report.ledger import prediction_table

    d = checked.to_dict()
    _print(prediction_table(d))
    assert checked.sampled_buckets == [1, 72, 168, 256]
    errors = {p.strategy: p.error_pct for p in checked.prediction}
    methods = {p.strategy: p.method for p in checked.prediction}
    print("prediction error per strategy:", {k: f"{v:+.1f}% ({methods[k]})" for k, v in errors.items()})
    for p in checked.prediction:
        print(f"{p.strategy} notes: {p.notes}")
    # the pools are simulated from the sampled captures' allocator traces (gmtool.memory.allocsim): what a
    # shared pool reuses and what the ascending order fragments; vmm keeps the line (max of the shapes' needs)
    assert {k: v for k, v in methods.items() if k != "vmm"} == dict.fromkeys(set(methods) - {"vmm"}, "allocsim")
    for name in ("independent", "shared", "shared-ascending", "vmm"):
        if name in errors:
            assert abs(errors[name]) <= 5.0, (name, errors)


def test_plan_beats_each_engine_default_at_equal_or_lower_memory(checked):
    from rich.table import Table

    from gmtool.plan.costs import from_results
    from gmtool.plan.engines import ENGINE_DEFAULTS
    from gmtool.plan.lazy import lazy_capture
    from gmtool.plan.optimizer import Budgets, PoolSharing, Problem
    from gmtool.plan.workload import builtin_workloads, by_size, load_workload

    shared = next(r for r in checked.strategies if r.strategy == "shared")
    costs = from_results({"records": shared.records})  # the shared pool: what engines run
    cands = sorted(set(costs.buckets) | {s for d in ENGINE_DEFAULTS for s in d.sizes})
    graph = costs.graph_at(cands)
    t = Table(title="plan vs engine defaults (qwen3-0.6b, H200, full graphs, one shared pool)")
    for c in (
        "workload",
        "default",
        "graphs",
        "default ms",
        "plan ms",
        "plan faster by",
        "default mem",
        "plan mem",
        "plan graphs",
    ):
        t.add_column(c)
    for name in builtin_workloads():
        steps, _ = load_workload(name)
        sizes = by_size(steps)
        problem = Problem(sizes, costs.eager_at(sizes.index), graph, PoolSharing.SHARED)
        for d in {(d.sizes, d.padding): d for d in ENGINE_DEFAULTS}.values():  # gmtool's list is vLLM's 35
            c = problem.evaluate(d.sizes, d.padding)
            # among the measured buckets and the default's own sizes: the default is one of the sets tried
            p = problem.optimize(
                Budgets(memory_bytes=c.graph_memory_bytes), among=sorted(set(costs.buckets) | set(d.sizes))
            )
            gain = 100 * (c.total_ms - p.total_ms) / c.total_ms
            t.add_row(
                name,
                d.name,
                str(len(c.sizes)),
                f"{c.ms_per_step:.4f}",
                f"{p.ms_per_step:.4f}",
                f"{gain:+.1f}%",
                f"{c.graph_memory_bytes / MiB:.0f} MiB",
                f"{p.graph_memory_bytes / MiB:.0f} MiB",
                str(len(p.sizes)),
            )
            assert p.graph_memory_bytes <= c.graph_memory_bytes and p.total_ms <= c.total_ms * (1 + 1e-9), (
                name,
                d.name,
            )
        best = problem.optimize(Budgets(), among=costs.buckets)
        lazy = lazy_capture(steps, best.sizes, graph, costs.eager_at(list(best.sizes)))
        print(
            f"{name}: unbounded plan {len(best.sizes)} graphs, {best.ms_per_step:.4f} ms/step; captured lazily: "
            f"{lazy['captures']} captures, {lazy['capture_s_in_serving']:.2f} s inside serving, worst first hit "
            f"{lazy['max_spike_ms']:.1f} ms"
        )
    _print(t)
