"""The ledger's measured part on CUDA: every captured bucket records the device memory taken outside its pool."""
from __future__ import annotations

import pytest
import torch

from gmtool.config import SweepConfig
from gmtool.measure.sweep import Sweep
from gmtool.memory.ledger import cublas_workspace_bytes, ledger_from_records

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_capture_records_memory_outside_the_pool():
    cfg = SweepConfig(model="qwen3-0.6b", device="cuda", buckets="1,8,64,256", modes=("eager", "full"), num_iters=3,
                      max_kv_len=256, kv_cache_gb=4)
    res = Sweep(cfg).run()
    records = [r.to_dict() for r in res.records]
    captured = [r for r in records if r["mode"] == "full" and r.get("graph_mem_bytes") is not None]
    assert len(captured) == 4
    for r in captured:
        # instantiation costs little outside the pool (the driver counts in 2 MiB pages: allow one either way)
        assert r["outside_pool_bytes"] is not None and -2 * 2**20 <= r["outside_pool_bytes"] < 256 * 2**20, r
    cap = torch.cuda.get_device_capability()
    df = ledger_from_records(records, res.model, 2, workspace_bytes=cublas_workspace_bytes(cap))
    assert (df["total_bytes"] >= df["pool_bytes"]).all()
    assert (df["kv_tokens_given_up"] > 0).all()
    print(df.to_string())  # the ledger table, for the closing note
