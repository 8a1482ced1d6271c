"""--fuse judged against the model's own layers once per run (gmtool.measure.fused_check): eager and graphs both
run the fused layers, so only this sees a fused block that computes another model; it is then the run's error."""

import torch

from gmtool.config import SweepConfig
from gmtool.measure.sweep import Sweep
from gmtool.model import fused as fused_mod


def _cfg(**kw):
    return SweepConfig(
        device="cpu",
        dtype="fp32",
        buckets="4,8",
        compositions="1*4,3+1*2",
        modes=("eager", "full"),
        fuse=True,
        num_iters=1,
        num_iters_warmup=0,
        **kw,
    )


def test_a_fused_run_notes_its_error_against_the_model_s_own_layers():
    """The largest bucket's first composition and the smallest's: the fused layers pick kernels by token count."""
    res = Sweep(_cfg()).run()
    notes = [n for n in res.notes if n.startswith("--fuse against the model's own layers")]
    assert len(notes) == 2 and "3+1*2" in notes[0] and "(eager, 1*4)" in notes[1] and not res.errors
    assert res.document("capture").exit_code() == 0


def test_a_fused_block_that_computes_another_model_fails_the_run(monkeypatch):
    mlp_forward = fused_mod._mlp_forward

    def scaled(m, ops):  # a fused MLP that forgets a factor: eager and graphs still agree with each other
        forward = mlp_forward(m, ops)
        return lambda x, partial_sums=False: forward(x) * 1.5

    monkeypatch.setattr(fused_mod, "_mlp_forward", scaled)
    res = Sweep(_cfg()).run()
    graph_rows = [r for r in res.records if r.mode.captures]
    assert graph_rows and all(r.status.name == "OK" for r in graph_rows)  # the rows cannot see it
    assert ["--fuse computes another model than tiny-qwen3's own layers" in e for e in res.errors] == [True, True]
    assert res.document("capture").exit_code() == 1
    from gmtool.report.summary import verdict

    assert "2 run errors, printed above" in verdict(res.document("capture").to_dict())


def test_without_fuse_nothing_is_checked():
    cfg = SweepConfig(device="cpu", buckets="4", compositions="1*4", modes=("eager",), num_iters=1, num_iters_warmup=0)
    res = Sweep(cfg).run()
    assert not any("against the model's own layers" in n for n in res.notes) and not res.errors


def test_a_check_out_of_memory_leaves_the_rows_and_says_so(monkeypatch):
    from gmtool.measure import fused_check

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(fused_check, "check_fused", oom)
    res = Sweep(_cfg()).run()
    assert not res.errors and any("out of memory beside the graphs" in n for n in res.notes)
    assert res.document("capture").exit_code() == 0
