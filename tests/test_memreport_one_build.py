"""memreport builds its model once per command: every strategy, the sampled run and the --check run share one
workbench (gmtool.measure.workbench.SharedWorkbench), and each run's figures are what a build of its own gave.

Memory strategies need CUDA: on the CPU backend a recording stand-in (tests.test_vmm_bookkeeping._Recorder)
takes their place, and the builds are counted."""

from __future__ import annotations

import pytest
import torch

from gmtool.config import SweepConfig
from gmtool.core.buckets import DEFAULT_DECODE_BUCKETS, DEFAULT_PREFILL_BUCKETS
from gmtool.measure.workbench import SharedWorkbench, Workbench, build_need
from gmtool.memory.predict import sampled_config
from tests.test_vmm_bookkeeping import _Recorder

TIMED = {"latency_ms", "host_us", "host_copy_us", "host_steady_us", "capture_s", "compile_s"}
TIMED |= {"eager_latency_ms", "speedup"}


class _Metered(_Recorder):
    """The stand-in with a physical total that grows by each captured bucket (what the predictor reads)."""

    def __init__(self, order):
        super().__init__(order)
        self.physical = 0

    def captured(self, key, entry):
        super().captured(key, entry)
        self.physical += key.num_tokens * 4096
        self.per_key[str(key)]["physical_after_bytes"] = self.physical

    def measure(self):
        return {"graph_pool_bytes": self.physical, "physical_bytes": self.physical}


@pytest.fixture
def builds(monkeypatch):
    """The bucket lists Workbench.build was called with; strategies are stand-ins, device memory reads 0."""
    import gmtool.memory.report as report

    seen, real = [], Workbench.build.__func__

    def build(cls, cfg, num_blocks=None):
        seen.append(list(cfg.bucket_sizes))
        return real(cls, cfg, num_blocks)

    monkeypatch.setattr(Workbench, "build", classmethod(build))
    monkeypatch.setattr(
        report,
        "make_strategy",
        lambda name, device, **kw: _Metered("ascending" if name.endswith("ascending") else "descending"),
    )
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, 0))
    return seen


def _cfg(**kw) -> SweepConfig:
    opts = dict(device="cpu", model="tiny-qwen3", buckets="1,2,4", modes=("eager", "full"), max_kv_len=64)
    return SweepConfig(**{**opts, "num_iters": 1, "num_iters_warmup": 0, **kw})


def _measured(row) -> dict:
    """A strategy row less what a clock decides: its records' checks, captures and shuffled replays."""
    return {
        "strategy": row.strategy,
        "status": row.status,
        "reason": row.reason,
        "records": [{k: v for k, v in r.items() if k not in TIMED} for r in row.records],
        "per_key": [{k: v for k, v in p.items() if k != "capture_s"} for p in row.per_key],
        "shuffled": row.shuffled,
        "ledger": row.ledger,
    }


def test_memreport_sample_and_check_build_the_model_once(tmp_path, builds):
    from gmtool.app import run_memreport
    from gmtool.memory.report import run_strategy

    cfg, names = _cfg(), ["independent", "shared", "shared-ascending"]
    rows = []
    doc, _ = run_memreport(cfg, names, tmp_path, on_strategy=rows.append, sample=2, check=True)
    assert builds == [[1, 2, 4]]  # built once, for the whole list, which serves the sample too
    assert doc.sampled_buckets == [1, 4] and [p.strategy for p in doc.prediction] == names
    # the same runs, each on a model of its own (the old way): the same documents
    small = sampled_config(cfg, 2)
    alone = [run_strategy(c, n)[0] for c in (small, cfg) for n in names]
    assert builds[1:] == [[1, 4]] * 3 + [[1, 2, 4]] * 3
    assert [r.captures for r in rows] == [2, 2, 2, 3, 3, 3]
    assert all(r.status == "ok" and r.shuffled_ok == r.shuffled_replays > 0 for r in rows), rows
    for shared, own in zip(rows, alone):
        assert _measured(shared) == _measured(own), shared.strategy
    assert [_measured(r) for r in doc.strategies] == [_measured(r) for r in alone[3:]]


def test_a_run_of_another_need_gets_its_own_build(builds):
    """A config whose KV cache differs is built for itself, the other model dropped first; back to the first
    need, it is built again; a config of the same need is served by the one already built."""
    wide, other = _cfg(), _cfg(max_kv_len=32)
    shared = SharedWorkbench(wide)
    first = shared.for_config(sampled_config(wide, 2))
    assert builds == [[1, 2, 4]] and first.cfg.bucket_sizes == [1, 4]  # built from the whole list
    assert shared.for_config(other).cfg is other and len(builds) == 2
    assert shared.for_config(wide).lm is not first.lm and len(builds) == 3
    assert shared.for_config(wide).lm is shared.bench.lm and len(builds) == 3


@pytest.mark.parametrize("scenario,max_kv_len", [("decode", 256), ("prefill", 2048), ("mixed", 2048)])
def test_the_sample_needs_the_whole_lists_workbench(scenario, max_kv_len):
    """The default lists (decode: the GPU run's options): the sample's KV cache and eager buffers are the whole
    list's, so one build serves both; another --max-kv-len is another need."""
    buckets = DEFAULT_DECODE_BUCKETS if scenario == "decode" else DEFAULT_PREFILL_BUCKETS
    cfg = SweepConfig(
        device="cpu",
        model="llama-3.1-8b",
        scenario=scenario,
        buckets=",".join(map(str, buckets)),
        modes=("eager", "full"),
        max_kv_len=max_kv_len,
        kv_cache_gb=10,
    )
    for k in (2, 4, 7):
        assert build_need(sampled_config(cfg, k)) == build_need(cfg)
    assert build_need(_cfg()) != build_need(_cfg(max_kv_len=32))
