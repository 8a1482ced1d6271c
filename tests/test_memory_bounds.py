"""Memory bounded: a run that cannot fit is refused before any weights are built; the CPU tape holds no more
than an eager forward does; torch threads on the CPU backend are bounded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from gmtool.cli.main import main
from gmtool.errors import GmtoolError
from gmtool.config import SweepConfig
from gmtool.core.backends.cpu import CpuTapeBackend
from gmtool.measure import workbench
from gmtool.memory import estimate

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def sixteen_gib(monkeypatch):
    """A 16 GiB machine, whatever this one has; building a model would fail the test."""
    monkeypatch.setattr(estimate, "available_bytes", lambda device: 16 * estimate.GiB)

    def no_model(*a, **k):
        raise AssertionError("the model was built before the run was refused")

    monkeypatch.setattr(workbench, "load_model", no_model)


@pytest.mark.parametrize(
    "args, option",
    [
        (["--compositions", "1@10000000"], "--max-kv-len"),
        (["--max-kv-len", "100000000"], "--max-kv-len"),
        # a bucket too large to run (a list too long to hold is refused before the estimate: parse_buckets)
        (["--scenario", "prefill", "--buckets", "4000000", "--compositions", "1000000*4"], "--buckets (the largest)"),
    ],
)
def test_a_run_that_cannot_fit_is_refused_before_the_model_is_built(
    sixteen_gib, tmp_path, monkeypatch, capsys, args, option
):
    monkeypatch.setattr(sys, "argv", ["gmtool", "capture", "--device", "cpu", "--out", str(tmp_path / "o"), *args])
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err
    line = [ln for ln in err.splitlines() if "needs about" in ln]
    assert e.value.code == 2 and len(line) == 1, err
    assert option in line[0] and "16.0 GiB available" in line[0], err
    assert not (tmp_path / "o" / "results.json").exists()


def test_a_normal_run_fits_and_its_estimate_is_small():
    cfg = SweepConfig(
        device="cpu", scenario="prefill", buckets="128,512", compositions="512=64*8,512=1*100+400@7", max_kv_len=2048
    )
    est = estimate.check_fits(cfg)
    assert est is not None and est.total < 2 * estimate.GiB
    assert estimate.check_fits(SweepConfig(device="cpu")).total < estimate.GiB


def test_the_estimate_grows_with_what_the_options_ask():
    cfg = lambda **kw: SweepConfig(device="cpu", **kw)  # noqa: E731
    cfgs = cfg(), cfg(max_kv_len=8192), cfg(buckets="1:64:1")
    small, long_kv, many = (estimate.estimate(c, estimate._model_config(c.model)) for c in cfgs)
    assert long_kv.parts["KV cache"] > 10 * small.parts["KV cache"]
    assert many.parts["graph tapes"] > 5 * small.parts["graph tapes"]


def test_the_tape_drops_intermediates_after_their_last_use():
    """A chain of 50 big intermediates: the tape keeps none of them (the old tape kept every op's output)."""
    be = CpuTapeBackend()
    x, out = torch.ones(1 << 20), torch.zeros(1 << 20)
    be.begin()
    y = x
    for _ in range(50):
        y = y * 1.01
    out.copy_(y)
    del y
    g = be.end()
    assert not g.escaped
    kept = [v for op in g.ops for v in op[1] if isinstance(v, torch.Tensor)]
    assert all(v is x or v is out for v in kept)
    x.fill_(2.0)
    with _LiveProducts() as live:  # and a replay drops each after its last use too
        g.replay()
    assert torch.allclose(out, torch.full_like(out, 2.0 * 1.01**50))
    assert len(live.made) == 50 and live.most <= 2


class _LiveProducts(TorchDispatchMode):
    """Counts, at each mul, how many of the muls' outputs are still alive."""

    def __init__(self):
        super().__init__()
        self.made, self.most = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.mul.Tensor:
            self.made.append(weakref.ref(out))
            self.most = max(self.most, sum(r() is not None for r in self.made))
        return out


def test_what_outlives_the_capture_is_written_at_replay():
    """A tensor made during capture that the caller still holds (a piece's output) gets each replay's value."""
    be = CpuTapeBackend()
    x = torch.arange(4.0)
    be.begin()
    kept = (x + 1).relu()
    g = be.end()
    x.fill_(-3.0)
    g.replay()
    assert kept.tolist() == [0.0] * 4


def test_many_short_prefill_sequences_stay_bounded(tmp_path):
    """101 sequences in a 128-token bucket over a 2048-token cache: the old tape and per-sequence masked
    attention held 5.8 GB here. Peak RSS of the child, under an address-space limit so a regression fails
    instead of taking the machine."""
    out = tmp_path / "o"
    code = (
        "import atexit, resource, sys; resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30)); "
        "atexit.register(lambda: print('peak_kb', next(l for l in open('/proc/self/status') if l.startswith('VmHWM'))"
        ".split()[1], file=sys.stderr)); "
        "from gmtool.cli.main import main; sys.argv[1:] = sys.argv[2:]; main()"
    )
    cmd = [
        sys.executable,
        "-c",
        code,
        "-",
        "capture",
        "--device",
        "cpu",
        "--scenario",
        "prefill",
        "--buckets",
        "128",
        "--compositions",
        "128=1*100+28@7",
        "--max-kv-len",
        "2048",
        "--num-iters",
        "1",
        "--num-iters-warmup",
        "0",
        "--out",
        str(out),
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT), GMTOOL_CPU_THREADS="1")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    # the child's own peak (VmHWM: its address space's): RUSAGE_CHILDREN is the largest of every child this worker
    # ran (a --tp test's ranks), and the child's ru_maxrss starts at this worker's, which vfork lends it until exec
    # (2.01 GB read in a full run, against the child's 0.69)
    peak_kb = int(r.stderr.rsplit("peak_kb ", 1)[1].split()[0])
    assert json.loads((out / "results.json").read_text())["records"]
    assert 2**17 < peak_kb < 2 * 2**20, f"peak RSS {peak_kb / 2**20:.2f} GB"


def test_cpu_threads_are_bounded_and_overridable(monkeypatch):
    monkeypatch.delenv(workbench.CPU_THREADS_ENV, raising=False)
    assert 1 <= workbench.cpu_threads() <= workbench.CPU_THREADS_MAX
    monkeypatch.setenv(workbench.CPU_THREADS_ENV, "3")
    assert workbench.cpu_threads() == 3
    for bad in ("lots", "0", "99999999999999999999", "\u00b2"):  # '²' is a digit to str.isdigit, not to int()
        monkeypatch.setenv(workbench.CPU_THREADS_ENV, bad)
        with pytest.raises(GmtoolError, match="GMTOOL_CPU_THREADS=.*: give a number of threads from 1 to 1024"):
            workbench.cpu_threads()


def test_tp_ranks_share_the_cpu_threads(monkeypatch):
    """Each --tp rank takes its share of the cores: two ranks of two threads on two cores spun at each gloo
    collective (a --tp 2 compare on 2 cores: 42 s, 200 s beside other work, against 14 s with a thread a rank)."""
    monkeypatch.delenv(workbench.CPU_THREADS_ENV, raising=False)
    for cores, ranks, threads in ((2, 1, 2), (2, 2, 1), (4, 2, 2), (8, 2, 2), (2, 4, 1)):
        monkeypatch.setattr(workbench.os, "sched_getaffinity", lambda _pid, n=cores: set(range(n)), raising=False)
        assert workbench.cpu_threads(ranks) == threads, (cores, ranks)
    monkeypatch.setenv(workbench.CPU_THREADS_ENV, "3")  # asked for: as given
    assert workbench.cpu_threads(2) == 3
