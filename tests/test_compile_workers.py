"""Triton compiles in worker processes (gmtool.kernels.compile_workers): a worker compiles a real gmtool kernel for
an H200 (sm_90; Triton compiles without a GPU) into the shared disk cache, where the parent's own compile of the
same source then finds it, running no compile stage. A worker not ready, a source rebuilt to another hash or a
module that is not there: the caller is told to compile itself, and why is counted."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

triton = pytest.importorskip("triton")


def _source():
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from gmtool.kernels.layers import _rms_norm_kernel

    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "stride_x": "i32", "eps": "fp32"}
    sig |= {"H": "constexpr", "BLOCK": "constexpr", "PDL": "constexpr"}
    return ASTSource(_rms_norm_kernel, sig, {"H": 1024, "BLOCK": 1024, "PDL": 0}), {"target": GPUTarget("cuda", 90, 32)}


@pytest.fixture
def workers(tmp_path, monkeypatch):
    from gmtool.kernels.compile_workers import CompileWorkers

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    w = CompileWorkers(1, str(tmp_path))
    deadline = time.monotonic() + 120
    while w.ready == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    yield w
    w.close()


def test_a_worker_compiles_into_the_cache_the_parent_then_reads(workers, monkeypatch):
    from triton.backends.nvidia.compiler import CUDABackend

    src, kwargs = _source()
    assert workers.ready == 1
    assert workers.compile(src, kwargs) is True
    assert (workers.stats.jobs, workers.stats.in_workers, workers.stats.fallbacks) == (1, 1, {})

    def no_stage(*a, **k):
        raise AssertionError("the parent compiled what the worker had put in the cache")

    monkeypatch.setattr(CUDABackend, "add_stages", no_stage)
    kernel = triton.compile(src, **kwargs)
    assert kernel.metadata.name == "_rms_norm_kernel" and kernel.asm["cubin"]


def test_what_a_worker_cannot_compile_falls_back_to_the_caller(workers):
    from gmtool.kernels import compile_workers

    src, kwargs = _source()
    wrong = compile_workers.job_of(src, kwargs)
    assert wrong is not None and wrong[0] == "gmtool.kernels.layers" and wrong[1] == "_rms_norm_kernel"
    w = workers.idle.get()
    assert w.ask(wrong[:-1] + ("another hash",))[0] == "mismatch"
    assert w.ask(("gmtool.no_such_module",) + wrong[1:])[0] == "error"
    workers.idle.put(w)
    gone = SimpleNamespace(fn=SimpleNamespace(__module__="gmtool.no_such_module"), name="k", signature={}, hash=str)
    assert workers.compile(gone, kwargs) is False  # the worker's error: the caller compiles
    src.fn = None  # not a module-level kernel's source
    assert workers.compile(src, kwargs) is False
    assert workers.stats.in_workers == 0 and workers.stats.jobs == 2
    assert workers.stats.fallbacks == {
        "ModuleNotFoundError: No module named 'gmtool.no_such_module'": 1,
        "not a module-level kernel's source": 1,
    }


def test_none_ready_means_the_caller_compiles(tmp_path):
    from gmtool.kernels.compile_workers import CompileWorkers

    w = CompileWorkers(0, str(tmp_path))
    src, kwargs = _source()
    assert w.compile(src, kwargs) is False and w.stats.fallbacks == {"no worker ready yet": 1}


def test_requested_reads_the_environment(monkeypatch):
    from gmtool.kernels.compile_workers import ENV, requested

    for raw, n in [("", 0), ("0", 0), ("4", 4), ("many", 0), ("-2", 0), ("99", 32)]:
        monkeypatch.setenv(ENV, raw)
        assert requested() == n
    monkeypatch.delenv(ENV)
    assert requested() == 0  # off by default


def test_once_every_worker_exited_the_caller_compiles_at_once(workers):
    """A worker that died (killed, or crashed in a compile) takes no more jobs; with none left, a compile does not
    wait for one to come free (60 s) but falls back at once."""
    src, kwargs = _source()
    w = workers.idle.get()
    workers.idle.put(w)
    w.proc.kill()
    w.proc.wait()
    assert workers.compile(src, kwargs) is False  # its job finds it gone
    t0 = time.monotonic()
    assert workers.compile(src, kwargs) is False
    assert time.monotonic() - t0 < 5
    assert workers.stats.in_workers == 0 and workers.stats.fallbacks.get("every worker exited") == 1
