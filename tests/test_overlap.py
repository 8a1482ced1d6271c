"""capture_all: every bucket captured once, in order; on CUDA each graph's instantiation and upload overlap the next
capture (gmtool.core.overlap), here driven by stand-in graphs and a stand-in free-memory counter."""

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from gmtool.core.buckets import BucketKey
from gmtool.core.overlap import OverlappedInstantiation, attribute, refusal
from gmtool.errors import CaptureError
from tests.helpers import Rig, rel


def test_capture_all_captures_each_bucket_once_in_order_and_replays_match_eager():
    rig = Rig()
    batches = [rig.batch(t, seed=i) for i, t in enumerate(["1*30", "1*16", "1*12", "1*3", "1*4"])]
    entries = rig.ex.capture_all(batches)
    keys = [BucketKey(n, None, True) for n in (32, 16, 4)]
    assert [e.key for e in entries] == keys  # 12 -> 16 and 3 -> 4 already taken: skipped
    assert list(rig.ex.graphs) == keys
    assert rig.ex.overlap_note == "not on CUDA: nothing to instantiate"
    assert rig.ex.capture_all(batches) == []  # nothing left to capture
    for b in batches:
        assert rel(rig.graph(b), rig.eager(b)) < 1e-5


def test_capture_all_refuses_to_overlap_piecewise_steps():
    rig = Rig(mode="piecewise")
    rig.ex.device = torch.device("cuda")  # only read by refusal()
    assert refusal(rig.ex) == "piecewise: a step's upload replays its runners"


class FakeMemory:
    """The device's free bytes, and what torch's allocator reserved of them: the pool and the driver take."""

    def __init__(self):
        self.free, self.reserved, self.lock = 10_000_000, 0, threading.Lock()

    def take(self, n, pool=False):
        with self.lock:
            self.free -= n
            self.reserved += n if pool else 0

    def read(self):
        with self.lock:
            return self.free

    def read_reserved(self):
        with self.lock:
            return self.reserved


class FakeGraph:
    """A captured graph whose instantiation and upload take driver bytes, slowly, in whatever thread runs them."""

    def __init__(self, memory, inst_bytes, upload_bytes, ok=True, fails=False):
        self.memory, self.inst_bytes, self.upload_bytes, self.ok, self.fails = (
            memory,
            inst_bytes,
            upload_bytes,
            ok,
            fails,
        )
        self.threads = []

    def instantiate(self):
        self.threads.append(threading.get_ident())
        time.sleep(0.02)  # longer than a capture here: a reading that does not wait for it misses its bytes
        if self.fails:
            raise RuntimeError("CUDA error: invalid argument")
        self.memory.take(self.inst_bytes)

    def upload(self):
        self.memory.take(self.upload_bytes)
        return self.ok


class SideStream:
    def synchronize(self):
        pass


def overlap_for(memory, backend):
    return OverlappedInstantiation(backend, torch.device("cpu"), memory.read, memory.read_reserved, SideStream())


def run_overlapped(memory, captures, capture_s=0.002):
    """captures: (pool bytes, [graphs]) per bucket; each capture takes its pool bytes while the worker runs."""
    backend = SimpleNamespace(defer_instantiation=False)
    entries = []
    with overlap_for(memory, backend) as overlap:
        assert backend.defer_instantiation
        for i, (pool, graphs) in enumerate(captures):
            time.sleep(capture_s)  # the forward under capture, while the worker instantiates the previous graph
            memory.take(pool, pool=True)
            entry = SimpleNamespace(
                key=BucketKey(i + 1, None, True),
                steps=graphs,
                outside_pool_bytes=None,
                instantiate_s=None,
                measure_s=0.0,
            )
            overlap.submit(entry)
            entries.append(entry)
        overlap.finish()
    assert not backend.defer_instantiation
    return entries, overlap


def test_each_graph_gets_the_driver_bytes_of_its_own_instantiation_and_upload():
    """Free memory is read only between captures, while the worker instantiates; what torch reserved over each
    interval is taken out, so each graph still gets exactly what its instantiation and upload took."""
    memory = FakeMemory()
    captures = [
        (4096, [FakeGraph(memory, 700, 50)]),
        (2048, [FakeGraph(memory, 300, 20), FakeGraph(memory, 100, 5)]),
        (0, [FakeGraph(memory, 900, 90)]),
        (1024, [FakeGraph(memory, 11, 1)]),
    ]
    entries, _ = run_overlapped(memory, captures)
    assert [e.outside_pool_bytes for e in entries] == [750, 425, 990, 12]
    assert all(e.instantiate_s is not None and e.instantiate_s > 0 for e in entries)
    # off the capturing thread
    main = threading.get_ident()
    assert all(t != main for _, graphs in captures for g in graphs for t in g.threads)
    # nothing lost: what the device lost is the pools' growth and every graph's driver bytes
    assert 10_000_000 - memory.read() == sum(p for p, _ in captures) + sum(e.outside_pool_bytes for e in entries)


def test_attribute_takes_the_pool_growth_out():
    assert attribute(1000, 400, 500) == 100
    assert attribute(1000, 1000, 0) == 0


def test_a_refused_upload_is_left_to_the_first_replay_and_counted():
    memory = FakeMemory()
    entries, overlap = run_overlapped(
        memory, [(10, [FakeGraph(memory, 1, 1, ok=False)]), (10, [FakeGraph(memory, 1, 1)])]
    )
    assert overlap.refused_uploads == 1 and all(e.instantiate_s for e in entries)


@pytest.mark.parametrize("failing", [1, 2])
def test_a_failed_instantiation_ends_capture_all_without_keeping_that_graph(monkeypatch, failing):
    """The worker's failure is said as a CaptureError naming the bucket; the graphs it did not finish are not
    kept (a replay would fail, or instantiate on the timed path); the capture after it is not retried for it."""
    from gmtool.core import overlap as overlap_module

    rig = Rig()
    memory = FakeMemory()
    keys = [BucketKey(n, None, True) for n in (32, 16, 4)]

    class Fake(overlap_module.OverlappedInstantiation):
        def __init__(self, backend, device):
            super().__init__(backend, device, memory.read, memory.read_reserved, SideStream())

        def _instantiate(self, entry):
            for step in entry.steps:
                step.instantiate = lambda: None
                step.upload = lambda: True
            if entry.key == keys[failing]:
                entry.steps = [FakeGraph(memory, 1, 1, fails=True)]
            super()._instantiate(entry)

    monkeypatch.setattr(overlap_module, "refusal", lambda ex: None)
    monkeypatch.setattr(overlap_module, "OverlappedInstantiation", Fake)
    warmups = []
    real = rig.ex._warm_up
    rig.ex._warm_up = lambda entry, fn: warmups.append(entry.key) or real(entry, fn)
    batches = [rig.batch(t, seed=i) for i, t in enumerate(["1*30", "1*16", "1*4"])]
    with pytest.raises(CaptureError, match=rf"instantiation of bucket {keys[failing]} failed: CUDA error"):
        rig.ex.capture_all(batches)
    assert list(rig.ex.graphs) == keys[:failing]
    assert warmups == [keys[0]]  # the first capture's only: no retry of the capture after the failed graph
    assert not rig.ex.backend.defer_instantiation


def test_a_failed_capture_keeps_the_graph_before_it_with_its_driver_bytes(monkeypatch):
    """The main thread's capture fails while the worker instantiates the graph before it: that graph is kept,
    finished, and its driver bytes are read (not left None); the failed bucket is not kept."""
    from gmtool.core import overlap as overlap_module

    rig = Rig()
    memory = FakeMemory()

    class Fake(overlap_module.OverlappedInstantiation):
        def __init__(self, backend, device):
            super().__init__(backend, device, memory.read, memory.read_reserved, SideStream())

        def _instantiate(self, entry):
            entry.steps = [FakeGraph(memory, 700, 50)]
            super()._instantiate(entry)

    monkeypatch.setattr(overlap_module, "refusal", lambda ex: None)
    monkeypatch.setattr(overlap_module, "OverlappedInstantiation", Fake)
    record = rig.ex._record

    def failing_at_4(entry, fn):
        if entry.key.num_tokens == 4:
            raise CaptureError("capture of bucket 4 failed: boom")
        record(entry, fn)

    monkeypatch.setattr(rig.ex, "_record", failing_at_4)
    batches = [rig.batch(t, seed=i) for i, t in enumerate(["1*30", "1*16", "1*8", "1*4"])]
    with pytest.raises(CaptureError, match="bucket 4 failed: boom"):
        rig.ex.capture_all(batches)
    keys = [BucketKey(n, None, True) for n in (32, 16, 8)]
    assert list(rig.ex.graphs) == keys
    assert [rig.ex.graphs[k].outside_pool_bytes for k in keys[1:]] == [750, 750]
    assert all(rig.ex.graphs[k].instantiate_s is not None for k in keys[1:])
