"""gmtool plan on the CPU: the optimizer against brute force and hand-checked optima, budgets, padding, workload
errors, cost estimates, flags, and the command end to end (from a results file, and measured on the spot)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from gmtool.errors import GmtoolError
from gmtool.plan.costs import Source, estimate, from_results
from gmtool.plan.engines import ENGINE_DEFAULTS, flags
from gmtool.plan.optimizer import Budgets, PoolSharing, Problem
from gmtool.plan.workload import load_workload
from tests.test_compare import one_error, run_cli


def problem(
    steps: dict, sizes, graph_ms, pool=None, capture=None, overhead=None, eager=100.0, sharing=PoolSharing.SHARED
) -> Problem:
    sizes = list(sizes)
    costs = pd.DataFrame(
        {
            "graph_ms": graph_ms,
            "pool_bytes": pool if pool is not None else np.nan,
            "overhead_bytes": overhead if overhead is not None else 0.0,
            "capture_s": capture if capture is not None else 0.0,
        },
        index=sizes,
        dtype=float,
    )
    wl = pd.Series(steps)
    return Problem(wl, pd.Series(eager, index=wl.index, dtype=float), costs, sharing)


# a step of n tokens on a graph of size s costs s ms; eager costs 100 ms
HAND = dict(steps={1: 10, 3: 10, 8: 1}, sizes=[1, 2, 3, 4, 8], graph_ms=[1, 2, 3, 4, 8])


def test_unbounded_optimum_captures_each_step_size_once():
    c = problem(**HAND).optimize()
    assert c.sizes == (1, 3, 8)  # 2 and 4 serve no step: the tie goes to fewer graphs
    assert c.total_ms == 10 * 1 + 10 * 3 + 8
    assert c.eager_steps == 0


def test_max_graphs_binds_and_padding_is_paid():
    c = problem(**HAND).optimize(Budgets(max_graphs=2))
    assert c.sizes == (3, 8)  # the 1-token steps pad to 3: 30 + 30 + 8
    assert c.total_ms == 68


def test_one_graph_budget_prefers_eager_for_the_rare_big_step():
    c = problem(**HAND).optimize(Budgets(max_graphs=1))  # {8}: 21 steps x 8 = 168; {3}: 60 + 100 eager
    assert (c.sizes, c.total_ms, c.eager_steps) == ((3,), 160, 1)


def test_a_decode_only_engine_runs_prefill_and_mixed_steps_eager():
    """SGLang and TensorRT-LLM replay graphs for decode batches only: of size 3's ten steps, four are a prefill
    chunk; on their lists those run eager (100 ms), where vLLM's piecewise graphs take them by token count."""
    p = problem(**HAND)
    p = Problem(
        pd.Series(HAND["steps"]),
        pd.Series(100.0, index=list(HAND["steps"])),
        p.costs,
        eager_extrapolated=[3],
        decode_steps=pd.Series({1: 10, 3: 6}),  # 8: none of its one step is decode
    )
    every = p.evaluate((1, 3, 8))
    assert (every.total_ms, every.eager_steps) == (10 * 1 + 10 * 3 + 8, 0)
    decode = p.evaluate((1, 3, 8), decode_only=True)
    assert decode.total_ms == 10 * 1 + 6 * 3 + 4 * 100 + 1 * 100
    assert decode.eager_steps == 5 and decode.eager_extrapolated_steps == 4  # size 3's four: an eager guess
    flagged = {d.name for d in ENGINE_DEFAULTS if d.decode_only}
    assert flagged == {"sglang", "trtllm", "trtllm-padded"}


def test_memory_budget_shared_pool_is_the_largest_pool():
    p = problem(**HAND, pool=[10, 20, 30, 40, 80])
    c = p.optimize(Budgets(memory_bytes=35))
    assert c.sizes == (1, 3) and c.graph_memory_bytes == 30 and c.total_ms == 10 + 30 + 100


def test_memory_budget_independent_pools_add_up():
    p = problem(**HAND, pool=[10, 20, 30, 40, 80], sharing=PoolSharing.INDEPENDENT)
    c = p.optimize(Budgets(memory_bytes=35))
    assert c.sizes == (3,) and c.graph_memory_bytes == 30


def test_overhead_outside_the_pool_counts_per_graph():
    p = problem(**HAND, pool=[10, 20, 30, 40, 80], overhead=[5, 5, 5, 5, 5])
    assert p.memory((1, 3)) == 30 + 10
    assert p.optimize(Budgets(memory_bytes=39)).sizes == (3,)


def test_capture_budget_binds():
    c = problem(**HAND, capture=[1, 1, 1, 1, 1]).optimize(Budgets(capture_s=1.5))
    assert c.sizes == (3,) and c.capture_s == 1


def test_a_graph_slower_than_eager_is_not_captured():
    c = problem({5: 10}, [8], [200.0]).optimize()
    assert c.sizes == () and c.total_ms == 1000


def test_without_padding_only_exact_sizes_replay():
    p = problem(**HAND)
    assert p.evaluate((2, 8), padding=False).total_ms == 10 * 100 + 10 * 100 + 8
    assert p.evaluate((2, 8), padding=True).total_ms == 10 * 2 + 10 * 8 + 8


def _brute(p: Problem, b: Budgets, sizes) -> float:
    best = p.evaluate(()).total_ms
    for k in range(1, len(sizes) + 1):
        for s in itertools.combinations(sizes, k):
            c = p.evaluate(s)
            if (
                (b.max_graphs is None or k <= b.max_graphs)
                and (b.capture_s is None or c.capture_s <= b.capture_s)
                and (b.memory_bytes is None or c.graph_memory_bytes <= b.memory_bytes)
            ):
                best = min(best, c.total_ms)
    return best


def test_optimizer_matches_brute_force_on_random_cases():
    rng = np.random.default_rng(7)
    for trial in range(40):
        m = int(rng.integers(1, 7))
        sizes = np.sort(rng.choice(np.arange(1, 40), m, replace=False))
        steps = np.sort(rng.choice(np.arange(1, 45), int(rng.integers(1, 9)), replace=False))
        p = problem(
            dict(zip(steps.tolist(), rng.integers(1, 20, len(steps)).tolist())),
            sizes,
            1 + sizes * 0.1 + rng.random(m),
            pool=sizes * 10 + rng.integers(0, 30, m),
            capture=rng.random(m),
            overhead=rng.integers(0, 5, m) * (trial % 2),
            eager=(2 + steps * 0.2),
            sharing=PoolSharing.INDEPENDENT if trial % 3 == 0 else PoolSharing.SHARED,
        )
        b = Budgets(
            float(rng.integers(50, 400)) if trial % 2 else None,
            float(rng.random() * 2) if trial % 4 < 2 else None,
            int(rng.integers(1, 4)) if trial % 5 else None,
        )
        assert p.optimize(b).total_ms == pytest.approx(_brute(p, b, sizes.tolist())), trial


def test_the_pareto_sets_stay_small_with_memory_outside_the_pool(monkeypatch):
    """35 buckets, each graph with memory outside the shared pool, under memory, capture and count budgets:
    with exact sums the labels kept per state grew with the subsets (plan ran for minutes on a CUDA run's
    costs). Counted in steps of the budget they stay within GRID + 1 per resource, and the set found fits."""
    import gmtool.plan.optimizer as opt

    sizes = np.array([1, 2, 4, *range(8, 257, 8)])
    rng = np.random.default_rng(3)
    p = problem(
        {int(n): int(c) for n, c in zip(rng.integers(1, 257, 400), rng.integers(1, 50, 400))},
        sizes,
        0.3 + sizes * 0.004,
        pool=(26 + sizes * 0.5) * 2**20,
        capture=0.03 + rng.random(len(sizes)) * 0.02,
        overhead=(1 + rng.random(len(sizes))) * 2**20,
        eager=3.0,
    )
    biggest = []
    real = opt._pareto
    monkeypatch.setattr(opt, "_pareto", lambda labels, dims: biggest.append(len(kept := real(labels, dims))) or kept)
    b = Budgets(100 * 2**20, 1.0, 16)
    best = p.optimize(b)
    assert max(biggest) <= (opt.GRID + 1) * 2, max(biggest)
    assert best.graph_memory_bytes <= b.memory_bytes and best.capture_s <= b.capture_s and len(best.sizes) <= 16
    assert best.total_ms < p.evaluate(()).total_ms  # graphs were worth taking


def test_memory_budget_without_memory_figures_is_refused():
    with pytest.raises(GmtoolError, match="memory budget needs graph memory"):
        problem(**HAND).optimize(Budgets(memory_bytes=1e9))


# -- costs ------------------------------------------------------------------------------------------------
def test_estimate_labels_and_lines():
    vals, how = estimate(pd.Series([1.0, 2.0, 4.0], index=[3, 4, 6]), [1, 3, 5, 10])
    assert how == [Source.EXTRAPOLATED, Source.MEASURED, Source.INTERPOLATED, Source.EXTRAPOLATED]
    # slope 1 per token above the range; below it the smallest size's value (the line reached 0 ms there: free
    # steps, and a division by zero in plan's table)
    assert vals.tolist() == pytest.approx([1.0, 1.0, 3.0, 8.0])


def test_extrapolation_never_falls_below_the_last_measured_value():
    vals, _ = estimate(pd.Series([5.0, 4.0], index=[1, 2]), [8])
    assert vals.tolist() == [4.0]


def _timing(median: float) -> dict:
    return {"median": median, "p90": median, "p99": median, "min": median, "iqr": 0.0, "n": 3, "noisy": False}


def results_doc(buckets=(1, 2, 4, 8, 16), unsafe=()) -> dict:
    recs = []
    for b in buckets:
        recs.append(
            {
                "mode": "eager",
                "bucket": b,
                "composition": f"1*{b}",
                "num_tokens": b,
                "num_seqs": b,
                "status": "ok",
                "latency_ms": _timing(10.0 + b),
            }
        )
        for n, ms in ((b, 1.0 + b / 4), (b, 1.0 + b / 4 + 0.5)):  # two mixes: the median is taken
            recs.append(
                {
                    "mode": "full",
                    "bucket": b,
                    "composition": f"1*{n}",
                    "num_tokens": n,
                    "num_seqs": n,
                    "status": "UNSAFE" if b in unsafe else "ok",
                    "latency_ms": _timing(ms) if ms is not None else None,
                    "graph_mem_bytes": b * 2**20,
                    "capture_s": 0.5,
                }
            )
            ms = None
    return {
        "tool": "gmtool",
        "command": "compare",
        "model": {"name": "tiny-qwen3"},
        "config": {},
        "machine": {"backend": "cuda"},
        "records": recs,
        "notes": [],
        "errors": [],
    }


def test_costs_from_results_leave_out_buckets_that_were_not_ok():
    t = from_results(results_doc(unsafe=(4,)))
    assert t.buckets == [1, 2, 8, 16] and t.mode == "full"
    assert t.graph.loc[8, "graph_ms"] == 3.25 and t.graph.loc[8, "pool_bytes"] == 8 * 2**20
    assert t.graph.loc[8, "capture_s"] == 1.0  # both rows' capture seconds (only the first captures, in a sweep)
    assert "left out" in t.notes[0]


def test_a_size_that_replayed_wrong_is_never_a_capture_size(tmp_path):
    """Bucket 4 UNSAFE: left out of the measured buckets, it came back as a candidate from the workload's own
    sizes, costed on the line between 2 and 8, and the plan captured it. --candidates 4 took it as well."""
    doc = results_doc(unsafe=(4,))
    for r in doc["records"]:
        if r["mode"] == "full":
            r["latency_ms"] = _timing(0.5)  # graphs well worth taking: only the failure keeps 4 out
    res = tmp_path / "r.json"
    res.write_text(json.dumps(doc))
    wl = tmp_path / "w.csv"
    wl.write_text("num_tokens,num_seqs,count\n4,4,100\n")
    code, out, err = run_cli("plan", "-w", wl, "--from", res, "--out", tmp_path / "p")
    assert code == 0, err
    plan = json.loads((tmp_path / "p" / "plan.json").read_text())
    assert 4 not in plan["capture_sizes"] and plan["capture_sizes"] == [8], plan["capture_sizes"]
    assert 4 not in [c["size"] for c in plan["candidates"]]
    code, out, err = run_cli("plan", "-w", wl, "--from", res, "--candidates", "4,8", "--out", tmp_path / "q")
    plan = json.loads((tmp_path / "q" / "plan.json").read_text())
    assert code == 0 and plan["capture_sizes"] == [8], err
    assert any(n.startswith("--candidates 4: left out, full replays there were not ok") for n in plan["notes"])
    code, _, err = run_cli("plan", "-w", wl, "--from", res, "--candidates", "4", "--out", tmp_path / "r")
    assert code == 2 and "--candidates 4: none can be captured" in one_error(err), err


def test_flags_are_ready_to_paste():
    f = flags([8, 1, 4])
    assert f["vllm"]["cli"] == "--cudagraph-capture-sizes 1 4 8"
    assert f["vllm"]["compilation_config"] == """--compilation-config '{"cudagraph_capture_sizes": [1, 4, 8]}'"""
    assert f["sglang"]["cli"] == "--cuda-graph-bs 1 4 8"
    assert f["trtllm"]["yaml"] == "cuda_graph_config:\n  batch_sizes: [1, 4, 8]\n  enable_padding: true"
    assert flags([])["vllm"]["cli"] == "--enforce-eager"


def test_engine_default_lists():
    n = {d.name: len(d.sizes) for d in ENGINE_DEFAULTS}
    assert (n["vllm"], n["vllm-512"], n["sglang"], n["gmtool"], n["trtllm"]) == (35, 51, 36, 35, 34)


# -- workloads --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text,why",
    [
        ("", "is empty"),
        ("# only a comment\n", "is empty"),
        ("num_tokens,num_seqs,count\n", "no steps"),
        ("num_tokens,count\n4,1\n", "missing column num_seqs"),
        ("num_tokens,num_seqs,count\n4,4,-1\n", "row 1: count must be 0 or more, got -1"),
        ("num_tokens,num_seqs\n0,1\n", "row 1: num_tokens must be positive, got 0"),
        ("num_tokens,num_seqs\n4,4\n2,3\n", "row 2: 3 sequences cannot share 2 tokens"),
        ("num_tokens,num_seqs\nfour,4\n", "row 1: num_tokens must be a whole number, got 'four'"),
        ("num_tokens,num_seqs,count\n4,4,0\n", "every count is 0"),
        ("num_tokens,num_seqs\n4,2,7,9\n", "more fields than its header"),
        ("num_tokens,num_seqs,counts\n4,2,1000\n600,1,1\n", "unknown column 'counts' \\(did you mean 'count'\\?\\)"),
        ("num_token,num_seqs\n4,2\n", "unknown column 'num_token'"),
        # a count written as NaN/NA/null is a value, not a count left out: it was read as one step
        ("num_tokens,num_seqs,count\n4,4,NaN\n8,8,2\n", "row 1: count must be a whole number, got 'NaN'"),
        ("num_tokens,num_seqs,count\n4,4,3\n8,8,null\n", "row 2: count must be a whole number, got 'null'"),
    ],
)
def test_bad_workloads_are_one_line(tmp_path, text, why):
    f = tmp_path / "w.csv"
    f.write_text(text)
    with pytest.raises(GmtoolError, match=why):
        load_workload(str(f))


def test_other_columns_of_a_log_are_not_the_workload_s(tmp_path):
    """A trailing comma, pandas' index column, a log's timestamps: read past, as before; a misspelt column is not."""
    f = tmp_path / "w.csv"
    for text in ("num_tokens,num_seqs,count,\n4,2,3,\n", ",num_tokens,num_seqs,count\n0,4,2,3\n"):
        f.write_text(text)
        steps, _ = load_workload(str(f))
        assert steps[["num_tokens", "num_seqs", "count"]].values.tolist() == [[4, 2, 3]], text
    j = tmp_path / "w.jsonl"
    j.write_text('{"num_tokens": 4, "num_seqs": 2, "t_ms": 17.5}\n')
    assert load_workload(str(j))[0]["count"].tolist() == [1]
    f.write_text("num_tokens,num_seqs,weight\n1,1,0.3\n2,2,0.7\n")  # each row was taken as one step
    with pytest.raises(GmtoolError, match="unknown column 'weight' \\(did you mean 'count'\\?\\)"):
        load_workload(str(f))


def test_workload_jsonl_and_counts(tmp_path):
    f = tmp_path / "w.jsonl"
    f.write_text(
        '{"num_tokens": 4, "num_seqs": 4, "count": 3}\n{"num_tokens": 4, "num_seqs": 4}\n'
        '{"num_tokens": 9, "num_seqs": 1, "count": 2}\n'
    )
    steps, _ = load_workload(str(f))
    assert steps.values.tolist() == [[4, 4, 4, 0], [9, 1, 2, 4]]  # num_tokens, num_seqs, count, first_step
    f.write_text('{"num_tokens": 4, "num_seqs": 4, "count": null}\n{"num_tokens": 4, "num_seqs": 4, "count": 2}\n')
    assert load_workload(str(f))[0]["count"].tolist() == [3]  # JSON's null: the count left out, one step
    f.write_text('{"num_tokens": 4, "num_seqs": 4, "count": 2}\n{"num_tokens": 4, "num_seqs": 4, "count": NaN}\n')
    with pytest.raises(GmtoolError, match="row 2: count must be a whole number, got nan"):
        load_workload(str(f))
    f.write_text('{"num_tokens": 4\n')
    with pytest.raises(GmtoolError, match="not valid JSONL"):
        load_workload(str(f))
    f.write_text('{"num_tokens": 4, "num_seqs": 2}\n\n{"num_tokens": 8\n')  # the file's line 3, not json's "line 1"
    with pytest.raises(GmtoolError, match="not valid JSONL: line 3, column 17: Expecting"):
        load_workload(str(f))


def test_unreadable_workloads(tmp_path):
    with pytest.raises(GmtoolError, match="no workload file"):
        load_workload(str(tmp_path / "missing.csv"))
    with pytest.raises(GmtoolError, match="is a directory"):
        load_workload(str(tmp_path))
    (tmp_path / "bin.csv").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(GmtoolError):
        load_workload(str(tmp_path / "bin.csv"))


def test_builtin_workloads_load():
    for name in ("chat", "long-context", "bursty"):
        steps, path = load_workload(name)
        assert path.name == f"{name}.csv" and steps["count"].sum() == 100_000


def test_lazy_capture_follows_the_trace_order(tmp_path):
    from gmtool.plan.lazy import lazy_capture

    f = tmp_path / "trace.csv"  # a log: one row per step, the big one first
    f.write_text("num_tokens,num_seqs\n30,30\n1,1\n2,2\n1,1\n5,5\n")
    steps, _ = load_workload(str(f))
    assert dict(zip(steps["num_tokens"], steps["first_step"])) == {1: 1, 2: 2, 5: 4, 30: 0}
    costs = pd.DataFrame(
        {"graph_ms": [1.0, 2.0, 4.0, 8.0], "capture_s": [0.1, 0.2, 0.4, 0.8], "source": ["measured"] * 4},
        index=[1, 2, 4, 8],
    )
    eager = pd.Series([10.0, 20.0, 40.0, 80.0], index=[1, 2, 4, 8])
    lazy = lazy_capture(steps, [1, 2, 4, 8], costs, eager)
    # 30 runs eager (above every graph); 5 pads to 8; 4 is never reached
    assert [(h["size"], h["at_step"]) for h in lazy["first_hits"]] == [(1, 1), (2, 2), (8, 4)]
    assert lazy["capture_s_in_serving"] == pytest.approx(1.1) and lazy["never_captured"] == [4]
    assert lazy["max_spike_ms"] == pytest.approx(800 + 80 + 8)
    assert lazy_capture(steps, [], costs, eager)["captures"] == 0


# -- the command ------------------------------------------------------------------------------------------
@pytest.fixture()
def results_file(tmp_path) -> Path:
    f = tmp_path / "results.json"
    f.write_text(json.dumps(results_doc()))
    return f


def test_plan_from_results_end_to_end(tmp_path, results_file):
    wl = tmp_path / "w.csv"
    wl.write_text("num_tokens,num_seqs,count\n1,1,50\n3,3,30\n12,12,20\n40,40,1\n")
    code, out, err = run_cli(
        "plan",
        "--workload",
        wl,
        "--from",
        results_file,
        "--max-graphs",
        "2",
        "--memory-budget",
        "1",
        "--out",
        tmp_path / "p",
    )
    assert code == 0, err
    doc = json.loads((tmp_path / "p" / "plan.json").read_text())
    # candidates: 1, 2, 4, 8, 16 measured and 3, 12 interpolated; two graphs: 3 then 12 (the 1s pad to 3)
    assert doc["capture_sizes"] == [3, 12] and doc["num_graphs"] == 2
    g3, g12, e40 = 1 + 3 / 4 + 0.25, 1 + 12 / 4 + 0.25, 10 + 16 + (40 - 16)  # eager extrapolated by its slope
    assert doc["expected_ms_per_step"] == pytest.approx((80 * g3 + 20 * g12 + e40) / 101)
    assert doc["graph_memory_bytes"] == 12 * 2**20 and doc["capture_s"] == pytest.approx(2.0)
    assert doc["flags"]["sglang"]["cli"] == "--cuda-graph-bs 3 12"
    vllm = next(d for d in doc["defaults"] if d["engine"] == "vllm")
    assert vllm["num_graphs"] == 35 and vllm["plan_gain_pct"] == pytest.approx(
        100 * (vllm["expected_ms_per_step"] - doc["expected_ms_per_step"]) / vllm["expected_ms_per_step"]
    )
    md = (tmp_path / "p" / "plan.md").read_text()
    assert "`3, 12`" in md and "| vllm | 35 |" in md
    assert (tmp_path / "p" / "plan.png").stat().st_size > 0
    assert "capture sizes: 3,12" in out
    # captured on first miss instead: 3 at the first step (1 pads to 3), 12 at step 80; each a 1 s capture, a
    # warm-up (eager) and a replay
    lazy = doc["lazy_capture"]
    assert lazy["captures"] == 2 and lazy["capture_s_in_serving"] == pytest.approx(2.0)
    assert [(h["size"], h["at_step"]) for h in lazy["first_hits"]] == [(3, 0), (12, 80)]
    assert [h["spike_ms"] for h in lazy["first_hits"]] == pytest.approx([1000 + 13 + 2.0, 1000 + 22 + 4.25])
    assert "2 captures take 2.00 s inside serving; the worst first-hit step takes 1026.2 ms (size 12" in md
    assert "2 captures take 2.00 s inside serving" in " ".join(out.split())  # the terminal says it too


def _planned(tmp_path, results_file, rows: str) -> tuple[dict, str, str]:
    """plan --from results_file on a workload of these CSV rows (num_tokens,num_seqs,count): plan.json, plan.md
    and what it printed."""
    wl = tmp_path / "w.csv"
    wl.write_text(f"num_tokens,num_seqs,count\n{rows}\n")
    code, out, err = run_cli("plan", "--workload", wl, "--from", results_file, "--out", tmp_path / "p")
    assert code == 0, err
    return json.loads((tmp_path / "p" / "plan.json").read_text()), (tmp_path / "p" / "plan.md").read_text(), out


def test_steps_beyond_the_measured_buckets_are_named_and_extrapolated_lists_marked(tmp_path, results_file):
    """Buckets measured up to 16, steps up to 64: the plan may capture only measured-range sizes, while the
    engines' lists reach past them on extrapolated figures. A plan "slower" than those lists must say why,
    and their figures must read as estimates."""
    doc, md, out = _planned(tmp_path, results_file, "1,1,60\n8,8,15\n64,64,25")
    assert max(doc["capture_sizes"]) <= 16
    said = [n for n in doc["notes"] if "above the largest candidate size" in n]
    assert len(said) == 1 and said[0].startswith("25.0% of the workload's steps") and "up to 64 tokens" in said[0]
    vllm = next(d for d in doc["defaults"] if d["engine"] == "vllm")
    assert vllm["extrapolated_sizes"] == 30  # vLLM's 35 sizes: 1, 2, 4, 8, 16 measured
    assert "vllm: 30 of its 35 sizes lie outside the measured buckets (30 above the largest, 16)" in " ".join(
        doc["notes"]
    )
    assert f"| vllm | 35 | ~{vllm['expected_ms_per_step']:.4f} | ~" in md and "~: the row's figures" in md
    assert "~: the row's figures are partly extrapolated" in " ".join(out.split())
    # the plan and all eager run the 64-token steps eager, on an eager latency beyond the measured 16: guesses too
    assert doc["eager_extrapolated_steps"] == 25 and doc["all_eager_extrapolated_steps"] == 25
    assert f"| plan | {doc['num_graphs']} | ~{doc['expected_ms_per_step']:.4f} |" in md
    assert f"| all eager | 0 | ~{doc['eager_ms_per_step']:.4f} | ~" in md


def test_eager_steps_within_the_measured_eager_sizes_are_not_marked(tmp_path, results_file):
    """Every step inside the measured range: no row is a guess, so none is marked and no legend shows."""
    doc, md, _ = _planned(tmp_path, results_file, "1,1,60\n8,8,15\n16,16,25")
    assert doc["eager_extrapolated_steps"] == 0 and doc["all_eager_extrapolated_steps"] == 0
    assert f"| all eager | 0 | {doc['eager_ms_per_step']:.4f} |" in md


def test_plan_bad_inputs_are_one_line(tmp_path, results_file):
    wl = tmp_path / "w.csv"
    wl.write_text("num_tokens,num_seqs\n5,5\n")
    for args, why in (
        (["--workload", tmp_path / "none.csv"], "no workload file"),
        (["--workload", wl, "--max-graphs", "0"], "--max-graphs must be positive"),
        (["--workload", wl, "--mode", "eager"], "--mode must be full or piecewise"),
        (["--workload", wl, "--max-tokens", "4"], "a step of 5 tokens, above --max-tokens 4"),
        (["--workload", wl, "--model", "llama-3.1-8b"], "measured tiny-qwen3"),
    ):
        code, _, err = run_cli("plan", "--from", results_file, "--out", tmp_path / "o", *args)
        assert code == 2 and why in one_error(err), (args, err)


def test_tp_ranks_capture_side_by_side():
    """Under --tp each rank captures its own graphs at once: a bucket's capture costs its slowest rank's."""
    doc = results_doc()
    ranked = []
    for r in doc["records"]:
        for rank, scale in ((0, 1.0), (1, 1.5)):
            ranked.append({**r, "rank": rank, **({"capture_s": r["capture_s"] * scale} if "capture_s" in r else {})})
    doc["records"] = ranked
    t = from_results(doc)
    assert t.graph.loc[8, "capture_s"] == 1.5  # rank 1's two rows, 0.75 each; not 2.5 for both ranks


def test_plan_costs_full_or_piecewise_only(tmp_path):
    """auto's rows are full and piecewise graphs batch by batch: plan neither takes --mode auto nor plans auto
    rows it was given; a profile of auto alone is refused, not replaced by full without a word."""
    doc = results_doc()
    for r in doc["records"]:
        r["mode"] = "auto" if r["mode"] == "full" else r["mode"]
    with pytest.raises(GmtoolError, match=r"no full or piecewise rows \(graph modes there: auto\)"):
        from_results(doc)
    prof = tmp_path / "auto.json"
    prof.write_text('{"modes": ["eager", "auto"], "buckets": "1,2"}')
    code, _, err = run_cli("plan", "--workload", "chat", "--profile", prof, "--out", tmp_path / "o")
    assert code == 2 and "the profile's modes (auto) hold no full or piecewise graphs" in one_error(err), err
    assert not (tmp_path / "o").exists()


def test_plan_measures_a_profile_s_scenario_not_the_workload_s(tmp_path):
    """A sweep profile names its scenario and a KV length fit for it (smoke: decode, 128): plan measures that,
    saying which steps it costs by their token count. It measured the chat workload's mixed scenario instead,
    whose compositions need a 512-token prefix, and refused its own built-in profile."""
    code, _, err = run_cli(
        "plan", "-w", "chat", "--profile", "smoke", "--num-iters", "1", "--num-iters-warmup", "0",
        "--out", tmp_path / "o",
    )  # fmt: skip
    assert code == 0, err
    assert json.loads((tmp_path / "o" / "results.json").read_text())["config"]["scenario"] == "decode"
    notes = json.loads((tmp_path / "o" / "plan.json").read_text())["notes"]
    assert any("are not pure decode but the costs are of decode graphs" in n for n in notes), notes


def test_plan_keeps_what_it_reads_and_what_it_refuses_over(tmp_path, results_file):
    """--force clears a directory only to write the plan: not when the request is refused, and never the
    directory of the --from results it reads."""
    old = tmp_path / "old"
    old.mkdir()
    (old / "plan.json").write_text("{}")
    code, _, err = run_cli(
        "plan", "-w", "chat", "--from", results_file, "--out", old, "--force", "--scenario", "decode"
    )
    assert code == 2 and "--scenario sets how costs are measured" in one_error(err)
    assert (old / "plan.json").exists()
    code, _, err = run_cli("plan", "-w", "chat", "--from", results_file, "--out", results_file.parent, "--force")
    assert code == 2 and "holds the --from results" in one_error(err) and results_file.exists()
    prof = tmp_path / "typo.json"
    prof.write_text('{"modes": ["eager", "ful"]}')
    code, _, err = run_cli("plan", "-w", "chat", "--profile", prof, "--out", tmp_path / "o")
    assert code == 2 and "unknown mode 'ful' in the profile" in one_error(err), err


def test_plan_refuses_an_output_directory_before_it_measures(tmp_path):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    code, out, err = run_cli(
        "plan", "--workload", "chat", "--device", "cpu", "--buckets", "1,2", "--num-iters", "1", "--out", taken
    )
    assert code == 2 and "exists and is not empty" in one_error(err), err
    assert "bucket" not in out and sorted(p.name for p in taken.iterdir()) == ["notes.txt"]


def test_plan_measured_on_the_spot_then_from_its_results(tmp_path):
    """The one slow test here (about 10 s on a busy 2-core machine): a real two-bucket sweep of tiny-qwen3, one
    mix per bucket, feeds the plan."""
    wl = tmp_path / "w.csv"
    wl.write_text("num_tokens,num_seqs,count\n1,1,10\n2,2,5\n")
    code, _, err = run_cli(
        "plan",
        "--workload",
        wl,
        "--device",
        "cpu",
        "--buckets",
        "1,2",
        "--compositions",
        "1*1,1*2",
        "--num-iters",
        "2",
        "--num-iters-warmup",
        "1",
        "--out",
        tmp_path / "m",
    )
    assert code == 0, err
    doc = json.loads((tmp_path / "m" / "plan.json").read_text())
    assert doc["source"] == {"kind": "measured now", "buckets": [1, 2]}
    assert {c["size"] for c in doc["candidates"]} == {1, 2}
    assert all(c["source"] == "measured" for c in doc["candidates"])
    assert doc["graph_memory_bytes"] is None  # the CPU backend measures no memory
    code, _, err = run_cli("plan", "--workload", wl, "--from", tmp_path / "m", "--out", tmp_path / "f")
    assert code == 0, err
    again = json.loads((tmp_path / "f" / "plan.json").read_text())
    assert again["capture_sizes"] == doc["capture_sizes"]
    assert again["expected_ms_per_step"] == pytest.approx(doc["expected_ms_per_step"])


def test_plan_keeps_a_profile_s_mixes_on_the_buckets_it_measures_and_says_which_it_leaves(tmp_path):
    """A profile's mixes pinned to buckets the workload never reaches leave with those buckets (the built-in
    prefill-default with chat failed: 'bucket 2048 is not captured'); the note is in plan.json, not only on the
    terminal, as every note of a measuring plan is."""
    prof = tmp_path / "p.json"
    prof.write_text('{"scenario": "prefill", "buckets": "16,32,64", "compositions": "16=8*2,12,64=32*2"}')
    wl = tmp_path / "w.csv"
    wl.write_text("num_tokens,num_seqs,count\n16,2,5\n12,1,3\n")
    code, _, err = run_cli(
        "plan", "-w", wl, "--profile", prof, "--num-iters", "1", "--num-iters-warmup", "0", "--out", tmp_path / "o"
    )
    assert code == 0, err
    results = json.loads((tmp_path / "o" / "results.json").read_text())
    assert results["config"]["buckets"] == "16" and results["config"]["compositions"] == "16=8*2,12"
    notes = json.loads((tmp_path / "o" / "plan.json").read_text())["notes"]
    assert "the mixes 64=32*2 run on buckets the workload never reaches: not measured" in notes
    assert any(n.startswith("no CUDA") for n in notes), notes  # the first config's notes too (the CPU default)
    # every mix on buckets the workload never reaches, one of them too big for any: each kept bucket's defaults
    prof.write_text('{"scenario": "prefill", "buckets": "16,32,64", "compositions": "64=32*2,40"}')
    code, _, err = run_cli(
        "plan", "-w", wl, "--profile", prof, "--num-iters", "1", "--num-iters-warmup", "0", "--out", tmp_path / "p"
    )
    assert code == 0, err
    results = json.loads((tmp_path / "p" / "results.json").read_text())
    assert results["config"]["buckets"] == "16" and results["config"]["compositions"] is None


def test_max_tokens_bounds_the_candidates_and_is_checked_before_measuring(tmp_path, results_file):
    wl = tmp_path / "w.csv"
    wl.write_text("num_tokens,num_seqs,count\n3,3,100\n")
    code, _, err = run_cli("plan", "-w", wl, "--from", results_file, "--max-tokens", "3", "--out", tmp_path / "a")
    assert code == 0, err
    plan = json.loads((tmp_path / "a" / "plan.json").read_text())
    assert max(plan["capture_sizes"]) <= 3, plan["capture_sizes"]
    assert [c["size"] for c in plan["candidates"]] == [1, 2, 3]  # 3: the workload's own size, up to --max-tokens
    assert any("measured buckets 4, 8, 16 are above --max-tokens 3: not candidates" in n for n in plan["notes"])
    code, _, err = run_cli(
        "plan", "-w", wl, "--from", results_file, "--max-tokens", "3", "--candidates", "2,4", "--out", tmp_path / "b"
    )
    assert code == 2 and "--candidates: size 4 is above --max-tokens 3" in one_error(err)
    # a step above --max-tokens: refused before a measurement, not after it
    code, out, err = run_cli("plan", "-w", wl, "--buckets", "1,2", "--max-tokens", "2", "--out", tmp_path / "c")
    assert code == 2 and "a step of 3 tokens, above --max-tokens 2" in one_error(err)
    assert "measure" not in out and not (tmp_path / "c").exists()


def test_plan_refuses_an_infinite_budget_and_too_many_candidates(tmp_path, results_file):
    code, _, err = run_cli("plan", "-w", "chat", "--from", results_file, "--capture-budget", "inf")
    assert code == 2 and "--capture-budget must be positive and finite, got inf" in one_error(err)
    code, _, err = run_cli("plan", "-w", "chat", "--from", results_file, "--candidates", "1:400:1")
    assert code == 2 and "--candidates: 400 sizes; plan takes at most 128" in one_error(err)


def test_workload_counts_that_overflow_or_are_booleans_are_refused(tmp_path):
    big = tmp_path / "big.csv"
    big.write_text("num_tokens,num_seqs,count\n" + "1,1,4000000000000000000\n" * 3)
    with pytest.raises(GmtoolError, match=r"its counts add up to 12,000,000,000,000,000,000 steps, more than 2\*\*62"):
        load_workload(str(big))
    flag = tmp_path / "flag.csv"
    flag.write_text("num_tokens,num_seqs,count\n3,3,true\n")
    with pytest.raises(GmtoolError, match="row 1: count must be a whole number, got 'True'"):
        load_workload(str(flag))
    flag = tmp_path / "flag.jsonl"
    flag.write_text('{"num_tokens": true, "num_seqs": 1}\n')
    with pytest.raises(GmtoolError, match="row 1: num_tokens must be a whole number"):
        load_workload(str(flag))


def test_plan_says_when_its_costs_are_of_other_graphs_or_of_a_partial_run(tmp_path):
    """Decode steps costed from a mixed or prefill run's graphs were costed without a word (the other way round
    had its note), and so was a run that stopped before all its rows."""
    wl = tmp_path / "w.csv"
    wl.write_text("num_tokens,num_seqs,count\n1,1,50\n3,3,30\n")
    doc = results_doc()
    doc["config"] = {"scenario": "mixed"}
    doc["partial"] = {"reason": "interrupted", "measured": 9, "planned": 15, "unit": "rows"}
    (tmp_path / "r.json").write_text(json.dumps(doc))
    code, _, err = run_cli("plan", "--workload", wl, "--from", tmp_path / "r.json", "--out", tmp_path / "p")
    assert code == 0, err
    notes = json.loads((tmp_path / "p" / "plan.json").read_text())["notes"]
    assert "80 of 80 steps are pure decode but the costs are of mixed graphs" in " ".join(notes), notes
    assert any("from a partial run (9 of 15 rows)" in n for n in notes), notes


def test_auto_s_eager_mixes_are_no_failed_graph_buckets_in_plan():
    """A run's mixes above its largest bucket have full and piecewise rows skipped by design (auto runs them
    eagerly): plan said 'full buckets 40 left out: some replay there was not ok'."""
    doc = results_doc()
    doc["config"] = {"eager_sizes": [40]}
    doc["records"] += [
        {"mode": "eager", "bucket": 40, "composition": "40", "num_tokens": 40, "num_seqs": 1, "status": "ok",
         "latency_ms": _timing(30.0)},
        {"mode": "full", "bucket": 40, "composition": "40", "num_tokens": 40, "num_seqs": 1, "status": "skipped",
         "error": "above the largest bucket (16): no full graph (auto runs it eagerly)"},
    ]  # fmt: skip
    t = from_results(doc)
    assert 40 not in t.buckets and not any("left out" in n for n in t.notes), t.notes


def test_results_of_both_planned_modes_say_which_one_is_costed():
    """A compare of full and piecewise holds both: plan costs full unless --mode says piecewise, and says so."""
    doc = results_doc()
    doc["records"] += [{**r, "mode": "piecewise"} for r in doc["records"] if r["mode"] == "full"]
    t = from_results(doc)
    assert t.mode == "full" and any("full and piecewise rows" in n for n in t.notes)
    assert not any("rows: the plan costs" in n for n in from_results(doc, "piecewise").notes)
    assert not any("rows: the plan costs" in n for n in from_results(results_doc()).notes)


def test_plan_from_refuses_to_force_its_way_over_another_runs_results(tmp_path, results_file):
    """plan --from writes three plan files: --force into a directory of a compare run deleted its results."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "results.json").write_text(json.dumps(results_doc()))
    (other / "report.md").write_text("# a compare run\n")
    code, _, err = run_cli("plan", "-w", "chat", "--from", results_file, "--out", other, "--force")
    assert code == 2 and "holds another run's files (report.md, results.json)" in " ".join(err.split()), err
    assert sorted(p.name for p in other.iterdir()) == ["report.md", "results.json"]
    code, _, err = run_cli("plan", "-w", "chat", "--from", results_file, "--out", tmp_path / "p")
    assert code == 0, err
    code, _, err = run_cli("plan", "-w", "chat", "--from", results_file, "--out", tmp_path / "p", "--force")
    assert code == 0, err  # its own plan files: replaced


def test_a_plan_of_extrapolated_sizes_is_marked_as_the_lists_are(tmp_path, results_file):
    """A plan of a candidate beyond the measured buckets showed the largest bucket's figure as measured, while
    the engines' lists were marked ~."""
    wl = tmp_path / "w.csv"
    wl.write_text("num_tokens,num_seqs,count\n900,1,10\n")
    code, out, err = run_cli("plan", "-w", wl, "--from", results_file, "--candidates", "1000", "--out", tmp_path / "p")
    assert code == 0, err
    doc = json.loads((tmp_path / "p" / "plan.json").read_text())
    assert doc["capture_sizes"] == [1000] and doc["extrapolated_sizes"] == 1
    row = next(ln for ln in (tmp_path / "p" / "plan.md").read_text().splitlines() if ln.startswith("| plan |"))
    assert "| ~" in row
    code, _, err = run_cli("plan", "-w", "chat", "--from", results_file, "--candidates", "4,8", "--out", tmp_path / "q")
    doc = json.loads((tmp_path / "q" / "plan.json").read_text())
    assert code == 0 and doc["extrapolated_sizes"] == 0
    row = next(ln for ln in (tmp_path / "q" / "plan.md").read_text().splitlines() if ln.startswith("| plan |"))
    # its graphs are measured, but the chat steps above 8 run eager on an eager latency beyond the measured 16
    assert doc["eager_extrapolated_steps"] > 0 and "| ~" in row


def test_the_note_on_unmeasured_candidates_says_how_each_was_costed():
    """Sizes below one measured bucket were said to be 'estimated linearly (3 beyond them)': they hold its
    figures, and one point gives no line."""
    from gmtool.plan.run import _estimated_note

    src = pd.Series({1: "extrapolated", 3: "extrapolated", 16: "measured", 40: "extrapolated"})
    note = _estimated_note([1, 3, 16, 40], src, [16])
    assert note.startswith("3 of 4 candidate sizes were not measured")
    assert "2 below them: bucket 16's figures" in note and "1 above them: bucket 16's figures" in note
    note = _estimated_note([3, 12], pd.Series({3: "interpolated", 12: "extrapolated"}), [2, 8])
    assert "1 between the measured buckets: interpolated linearly" in note and "1 above them: on a line" in note


def test_decode_only_engines_rows_count_the_mixed_steps_eager(tmp_path, results_file):
    doc, _, _ = _planned(tmp_path, results_file, "1,1,60\n8,2,40")
    rows = {d["engine"]: d for d in doc["defaults"]}
    assert rows["sglang"]["eager_steps"] == 40 and rows["trtllm-padded"]["eager_steps"] == 40
    assert rows["vllm"]["eager_steps"] == 0
    # the plan's gain over them is of the plan as they would run it, its mixed steps eager there too: with size 1
    # captured by both, the same figures (it was +4.4%, the plan credited with graphs those engines never run)
    assert 1 in doc["capture_sizes"] and rows["sglang"]["plan_gain_pct"] == pytest.approx(0.0)
    assert rows["trtllm-padded"]["plan_gain_pct"] == pytest.approx(0.0)
    assert any(
        n.startswith("sglang, trtllm, trtllm-padded replay their graphs for decode batches only") for n in doc["notes"]
    )


def test_a_bucket_of_several_full_prefill_graphs_says_what_a_size_stands_for():
    doc = results_doc()
    for i, r in enumerate(doc["records"]):
        r["key"] = f"t{r['bucket']}xs{1 + i % 2}"  # full's two mixes of a bucket: two graphs
    t = from_results(doc)
    assert any("buckets hold up to 2 graphs each" in n for n in t.notes), t.notes
    assert not any("graphs each" in n for n in from_results(results_doc()).notes)
