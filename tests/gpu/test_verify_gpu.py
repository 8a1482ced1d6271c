"""gmtool verify on a GPU: a soak of qwen3-0.6b under the default pool and VMM finds nothing, with freed
graph-pool memory poisoned; an injected bug is found within 50 steps; the model has no capture hazard and its
decode graphs bake in no composition-dependent value."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _cfg(**kw):
    from gmtool.verify.run import VerifyConfig

    return VerifyConfig(
        **{
            **dict(
                model="qwen3-0.6b",
                device="cuda",
                modes="full,piecewise",
                steps=300,
                check_every=10,
                strategy="default,vmm",
                max_num_seqs=16,
                max_kv_len=256,
                buckets="1,2,4,8,16,32,64,128",
            ),
            **kw,
        }
    )


def test_soak_is_clean_under_the_default_pool_and_vmm():
    from gmtool.verify.run import run_verify

    doc = run_verify(_cfg())
    assert doc["capturability"] == []
    assert all(d["clean"] for d in doc["dynamic_dims"]), doc["dynamic_dims"]
    assert len(doc["runs"]) == 4
    for r in doc["runs"]:
        assert r["mismatch"] is None, r["mismatch"]
        # every tenth step, and each graph's first two replays
        assert r["steps"] == 300 and 30 <= r["checks"] < 300 and r["blocks_reused"] > 0
        # every buffer poisoned, freed graph-pool memory included (full graphs have no attention buffer)
        assert set(r["poison_skipped"]) <= {"attention output buffer past this bucket"}, r["poison_skipped"]
        print(f"{r['mode']} {r['strategy']}: {r['steps_per_min']:.0f} steps/min, {r['graphs']} graphs")
    assert doc["exit_code"] == 0, doc["findings"]


@pytest.mark.parametrize("fault", ["stale-block-table", "stale-slot-mapping", "pad-read:3"])
def test_an_injected_bug_is_found_within_50_steps(fault):
    from gmtool.verify.run import run_verify

    doc = run_verify(_cfg(modes="full", strategy="default", steps=50, check_every=1, inject=fault))
    m = doc["runs"][0]["mismatch"]
    assert m is not None and doc["exit_code"] == 3
    if fault == "pad-read:3":
        assert m["first_divergence"]["module"] == "model.layers.3.mlp"
    print(fault, m["step"], m["suspects"], m["first_divergence"])


def test_full_narrow_bakes_the_host_plan_into_its_prefill_graphs():
    from gmtool.verify.run import run_verify

    doc = run_verify(_cfg(modes="full-narrow", strategy="default", steps=20, check_every=5, attention="torch"))
    prefill = [d for d in doc["dynamic_dims"] if d["kind"] == "prefill"]
    assert prefill and not prefill[0]["clean"] and "self_attn" in prefill[0]["baked"][0]["module"]
