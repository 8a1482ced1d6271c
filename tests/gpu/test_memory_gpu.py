"""Memory strategies on a GPU: every strategy's graphs match eager in any replay order, and the VMM strategy
holds about max(shape) of physical memory where independent pools hold sum(shape)."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# decode attention gathers each sequence's K/V in fp32: the graphs' memory grows with the bucket, far past
# a 2 MiB chunk (roughly 40, 80, 160, 320 MiB for qwen3-0.6b at 256 tokens of context)
CFG = dict(
    model="qwen3-0.6b",
    device="cuda",
    scenario="decode",
    buckets="16,32,64,128",
    max_kv_len=256,
    kv_cache_gb=4,
    num_iters=2,
    num_iters_warmup=1,
)


def _cfg(mode="full", **kw):
    from gmtool.config import SweepConfig

    return SweepConfig(**{**CFG, "modes": ("eager", mode), **kw})


@pytest.fixture(scope="module")
def rows():
    from gmtool.memory.report import run_strategy
    from gmtool.memory.strategies import STRATEGIES

    cfg = _cfg()
    return {name: asdict(run_strategy(cfg, name)[0]) for name in STRATEGIES}, cfg


def _check_replays(row, cfg):
    assert row["status"] == "ok", f"{row['strategy']}: {row['reason']}"
    assert row["captures"] == len(cfg.bucket_sizes)
    assert row["replays"] == row["replays_ok"] > 0
    comps = sum(len(c) for c in cfg.compositions_by_bucket.values())
    assert row["shuffled_replays"] == row["shuffled_ok"] == comps, row["shuffled"]
    assert row["warnings"] == 0, row["warning_list"]


@pytest.mark.parametrize("name", ["independent", "shared", "shared-ascending", "vmm"])
def test_every_strategy_replays_like_eager_in_shuffled_order(rows, name):
    by_name, cfg = rows
    _check_replays(by_name[name], cfg)


def test_memory_follows_the_strategy(rows):
    by_name, _ = rows
    ind, shared, vmm = by_name["independent"], by_name["shared"], by_name["vmm"]
    figures = {
        n: {k: r.get(k) for k in ("graph_pool_bytes", "sum_shape_bytes", "physical_bytes")} for n, r in by_name.items()
    }
    # every independent pool holds at least its own shape's peak
    assert ind["graph_pool_bytes"] >= ind["sum_shape_bytes"], figures
    assert shared["graph_pool_bytes"] < ind["graph_pool_bytes"], figures
    st = vmm["vmm"]
    chunk, ranges = st["chunk_bytes"], st["ranges"]
    assert len(ranges) == vmm["captures"]
    # a shape's need as its pool saw it (torch rounds segments up, e.g. to 20 MiB for 1-10 MiB requests)
    used = [r["used_bytes"] for r in ranges]
    largest_pool = max(used)
    assert vmm["physical_bytes"] <= largest_pool + len(ranges) * chunk, (used, figures)
    assert vmm["physical_bytes"] == -(-largest_pool // chunk) * chunk, (used, figures)  # the largest, rounded
    # max(shape), not sum: less than the ranges' sum (what separate pools hold). Not against sum_shape_bytes,
    # the peaks: since the LM head writes the persistent logits, a decode shape's graph holds a few MiB, and
    # rounding to chunks can pass the peaks' sum (as test_vmm_piecewise_pieces_share_physical_memory_safely)
    assert vmm["physical_bytes"] < sum(used), (used, figures)
    assert vmm["physical_bytes"] < ind["graph_pool_bytes"], figures
    assert vmm["virtual_mapped_bytes"] >= vmm["physical_bytes"]


def test_vmm_piecewise_pieces_share_physical_memory_safely():
    """Prefill shapes: since the LM head's logits left the pool, a decode bucket's pieces hold a few MiB, under VMM's
    2 MiB chunk granularity (32 and 128 tokens: 6 MiB physical against 4.2 MiB summed, H200 2026-12-01)."""
    from gmtool.memory.report import run_strategy

    cfg = _cfg("piecewise", scenario="prefill", buckets="512,2048", max_kv_len=4096)
    row = asdict(run_strategy(cfg, "vmm")[0])
    _check_replays(row, cfg)
    # max(shape), not sum: the largest range's memory, rounded to chunks, and less than the ranges' sum (what
    # separate pools hold). Not against sum_shape_bytes, the peaks: a pool's segments round its requests up
    # (2 shapes, 512 and 2,048 tokens: 74 MiB physical against peaks summing to 66.6 MiB, H200 2026-12-01)
    st = row["vmm"]
    used = [r["used_bytes"] for r in st["ranges"]]
    assert row["physical_bytes"] == -(-max(used) // st["chunk_bytes"]) * st["chunk_bytes"]
    assert row["physical_bytes"] < sum(used), used


def test_vmm_check_flags_an_allocation_that_outlives_capture():
    from gmtool.core.buckets import BucketKey
    from gmtool.memory.strategies import make_strategy

    s = make_strategy("vmm", torch.device("cuda"))
    key = BucketKey(8, None, True)
    s.pool_for(key)
    with torch.cuda.memory.use_mem_pool(s.vmm.pools[key]):
        stray = torch.empty(3 * 2**20, dtype=torch.uint8, device="cuda")  # like a workspace made in capture
    assert s.vmm.lib.stats().physical_bytes >= stray.nbytes
    warnings = s.check()
    assert any("outlives its capture" in w for w in warnings), warnings
    del stray
    s.release()
    assert not any("left mapped" in w for w in s.warnings), s.warnings


def test_strategies_on_one_model_measure_what_they_measured_on_their_own(rows):
    """memreport runs every strategy on one model (SharedWorkbench): each still starts clean, its pools held
    and its captures' needs as when it built its own model, and nothing the model holds counts as left behind."""
    from gmtool.measure.workbench import SharedWorkbench
    from gmtool.memory.report import run_strategy

    by_name, cfg = rows
    shared, mib = SharedWorkbench(cfg), 2**20
    for name in ("independent", "shared", "independent"):  # the first again: the pools before it are gone
        row, alone = asdict(run_strategy(cfg, name, shared=shared)[0]), by_name[name]
        _check_replays(row, cfg)
        print(
            f"{name}: physical {row['physical_bytes'] / mib:.1f} MiB (alone {alone['physical_bytes'] / mib:.1f}), "
            f"after release {row['after_release_bytes'] / mib:.1f} MiB (alone {alone['after_release_bytes'] / mib:.1f})"
        )
        assert abs(row["physical_bytes"] - alone["physical_bytes"]) <= 2 * mib
        needs = [(k["key"], k["graph_mem_bytes"]) for k in row["per_key"]]
        assert needs == [(k["key"], k["graph_mem_bytes"]) for k in alone["per_key"]]
        assert row["after_release_bytes"] < 64 * mib  # the model and its KV cache are nobody's leftovers
