"""Memory strategies: which pool each captured shape goes into, and what each costs.

The executor calls `pool_for(key)` before a capture (every piece of a piecewise bucket goes into that pool),
`captured(key, entry)` after it, and `release()` once its graphs are gone (a pool must outlive its graphs).
- independent: a private pool per shape: memory is sum(shape).
- shared: one pool for every shape, captured largest first: later shapes reuse the largest one's blocks.
- shared-ascending: the same pool captured smallest first: each larger shape mostly needs fresh blocks.
- vmm: a virtual range per shape, all mapped onto one growing set of physical chunks: max(shape).
"""

from __future__ import annotations

import os

import torch

from gmtool.errors import GmtoolError
from gmtool.listopt import comma_items

_REGISTRY: dict[str, type] = {}  # name -> strategy class: a subclass with a name is a strategy, in definition order


def parse_strategies(text: str) -> list[str]:
    names = comma_items(text, "--strategies")
    if not names:
        raise GmtoolError(f"no memory strategy given (use {'|'.join(STRATEGIES)})")
    for n in names:
        if n not in STRATEGIES:
            raise GmtoolError(f"unknown strategy {n!r} (use {'|'.join(STRATEGIES)})")
    return list(dict.fromkeys(names))


def make_strategy(name: str, device: torch.device, **vmm_opts) -> "MemoryStrategy":
    """GmtoolError for an unknown name, for no CUDA, and (vmm) when the allocator is unavailable."""
    classes = _REGISTRY
    if name not in classes:
        raise GmtoolError(f"unknown strategy {name!r} (use {'|'.join(STRATEGIES)})")
    if device.type != "cuda":
        raise GmtoolError(f"memory strategy {name!r} chooses CUDA graph pools: it needs a CUDA device, not {device}")
    return classes[name](device, **vmm_opts) if name == "vmm" else classes[name](device)


def pool_segments(pool_ids, device_index: int) -> dict[tuple, list[dict]]:
    """The caching allocator's segments of each pool (its own view of the memory a pool holds)."""
    want = {tuple(p): [] for p in pool_ids}
    for seg in torch.cuda.memory_snapshot():
        pid = tuple(seg.get("segment_pool_id") or ())
        if pid in want and seg.get("device", device_index) == device_index:
            want[pid].append(seg)
    return want


class DeviceMeter:
    """Device memory as the driver (cudaMemGetInfo) and NVML see it; NVML per process where it can."""

    def __init__(self, device: torch.device):
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.nvml, self.nvml_source = None, None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._pynvml = pynvml
            self.nvml = self._handle(pynvml)
        except Exception:  # NVML is optional: only the mem_get_info figures remain
            self.nvml = None

    def _handle(self, pynvml):
        try:  # by PCI bus id, so CUDA_VISIBLE_DEVICES renumbering cannot pick another GPU
            p = torch.cuda.get_device_properties(self.index)
            bus = f"{p.pci_domain_id:08x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
            return pynvml.nvmlDeviceGetHandleByPciBusId(bus)
        except Exception:
            if os.environ.get("CUDA_VISIBLE_DEVICES"):
                return None
            return pynvml.nvmlDeviceGetHandleByIndex(self.index)

    def read(self) -> tuple[int, int | None]:
        """(free bytes from the driver, bytes NVML says are used: this process's, else the device's)."""
        free = torch.cuda.mem_get_info(self.index)[0]
        if self.nvml is None:
            return free, None
        try:
            pid = os.getpid()
            for p in self._pynvml.nvmlDeviceGetComputeRunningProcesses(self.nvml):
                if p.pid == pid and p.usedGpuMemory is not None:
                    self.nvml_source = "process"
                    return free, int(p.usedGpuMemory)
            self.nvml_source = "device"  # another PID namespace (a container): the whole device
            return free, int(self._pynvml.nvmlDeviceGetMemoryInfo(self.nvml).used)
        except Exception:
            return free, None


class MemoryStrategy:
    name = ""
    order = "descending"  # the sweep captures the largest bucket first unless "ascending"

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if cls.name:
            _REGISTRY[cls.name] = cls

    def __init__(self, device: torch.device):
        self.device = device
        self.meter = DeviceMeter(device)
        self.pool_ids: dict = {}  # key -> pool id
        self.per_key: dict[str, dict] = {}  # str(key) -> what its capture cost
        self.warnings: list[str] = []
        self._before = None
        self.released = False
        self.traces = None  # a CaptureTraces when record_traces() asked for each capture's allocator events

    def record_traces(self) -> None:
        """Record each capture's allocator events (gmtool.memory.alloctrace), for gmtool.memory.allocsim."""
        from gmtool.memory.alloctrace import CaptureTraces

        self.traces = CaptureTraces(self.meter.index)

    # -- the executor's hooks ------------------------------------------------------------------------
    def pool_for(self, key):
        self.pool_ids[key] = self._pool(key)
        if self.traces is not None:  # before the meter: cutting the history takes a snapshot
            self.traces.begin(key, self.pool_ids[key])
        self._before = self.meter.read()  # after the pool is set up: only the capture's own memory counts
        return self.pool_ids[key]

    def captured(self, key, entry) -> None:
        (free0, nv0), (free1, nv1) = self._before, self.meter.read()
        segs = pool_segments([self.pool_ids[key]], self.meter.index)[tuple(self.pool_ids[key])]
        if self.traces is not None:
            self.traces.end(key, self.pool_ids[key], segs)
        self.per_key[str(key)] = {
            "key": str(key),
            "bucket": key.num_tokens,
            "capture_s": entry.capture_s,
            "graph_mem_bytes": entry.graph_mem_bytes,
            "pool_growth_bytes": entry.pool_growth_bytes,
            "pool_bytes": sum(s["total_size"] for s in segs),  # the key's pool after this capture
            "device_delta_bytes": free0 - free1,
            "nvml_delta_bytes": (nv1 - nv0) if nv0 is not None and nv1 is not None else None,
            **self._key_extra(key),
        }

    def release(self) -> None:
        if self.traces is not None:
            self.traces.finish()
        self.pool_ids.clear()  # torch frees a handle's pool once its graphs are gone
        self.released = True

    # -- what memreport reads while the graphs are alive ---------------------------------------------
    def measure(self) -> dict:
        if self.traces is not None:  # the captures are over: their traces end here, graphs still alive
            self.traces.finish()
        pools = pool_segments(set(map(tuple, self.pool_ids.values())), self.meter.index)
        total = sum(s["total_size"] for segs in pools.values() for s in segs)
        return {
            "pools": len(pools),
            "graph_pool_bytes": total,
            "physical_bytes": total,
            "virtual_reserved_bytes": None,
            "virtual_mapped_bytes": None,
            "nvml_source": self.meter.nvml_source,
        }

    def check(self, held=()) -> list[str]:
        """Allocations that shared memory could corrupt; none when no pool aliases another."""
        return []

    def failure_detail(self) -> str | None:
        return None

    def physical_bytes(self) -> int | None:
        """The device memory the pools hold, where the allocator's reserved bytes do not say it (None)."""
        return None

    def _pool(self, key):
        raise NotImplementedError

    def _key_extra(self, key) -> dict:
        return {}


class Independent(MemoryStrategy):
    name = "independent"

    def _pool(self, key):
        return torch.cuda.graph_pool_handle()


class Shared(MemoryStrategy):
    name = "shared"

    def __init__(self, device):
        super().__init__(device)
        self._shared = None

    def _pool(self, key):
        if self._shared is None:
            self._shared = torch.cuda.graph_pool_handle()
        return self._shared

    def release(self) -> None:
        self._shared = None
        super().release()


class SharedAscending(Shared):
    name = "shared-ascending"
    order = "ascending"


class Vmm(MemoryStrategy):
    name = "vmm"

    def __init__(self, device, range_bytes: int | None = None, chunk_bytes: int = 0):
        from gmtool.memory.vmm import VmmPools

        self.vmm = VmmPools(device, range_bytes, chunk_bytes)  # GmtoolError when VMM is unavailable
        super().__init__(device)

    def _pool(self, key):
        return self.vmm.new_pool(key)

    def _key_extra(self, key) -> dict:
        i = self.vmm.range_of[key]
        st = self.vmm.lib.stats()
        return {
            "range": i,
            "range_used_bytes": st.ranges[i].used_bytes,
            "range_mapped_bytes": st.ranges[i].mapped_bytes,
            "physical_after_bytes": st.physical_bytes,
        }

    def measure(self) -> dict:
        m = super().measure()
        st = self.vmm.lib.stats()
        m.update(
            physical_bytes=st.physical_bytes,
            virtual_reserved_bytes=st.virtual_reserved_bytes,
            virtual_mapped_bytes=st.virtual_mapped_bytes,
            vmm=st.to_dict(),
        )
        return m

    def check(self, held=()) -> list[str]:
        """Live blocks in the aliased ranges that no graph owns (e.g. a cuBLAS workspace created during a
        capture), and other pools' segments there: another shape's replay would overwrite them."""
        st = self.vmm.lib.stats()
        spans = [(r.base, r.base + st.range_bytes, i) for i, r in enumerate(st.ranges)]
        ours = {tuple(p) for p in self.pool_ids.values()}
        held = [(p, p + n) for p, n in held]
        out = []
        for seg in torch.cuda.memory_snapshot():
            addr = seg["address"]
            rng = next((i for lo, hi, i in spans if lo <= addr < hi), None)
            if rng is None:
                continue
            pid = tuple(seg.get("segment_pool_id") or ())
            if pid not in ours:
                out.append(
                    f"a {seg['total_size']}-byte segment of pool {pid} (not a graph pool) lies in "
                    f"shared range {rng} at {addr:#x}: graphs of other shapes will overwrite it"
                )
                continue
            at = addr
            for b in seg.get("blocks", []):
                start = b.get("address", at)
                at = start + b["size"]
                if b.get("state") != "active_allocated":
                    continue
                if any(lo < start + b["size"] and start < hi for lo, hi in held):
                    continue  # a tensor a graph step reads and writes itself (piecewise attention inputs)
                out.append(
                    f"a {b['size']}-byte allocation at {start:#x} (range {rng}) outlives its capture "
                    "and shares physical memory with other shapes' graphs: they will overwrite it "
                    "(a cuBLAS workspace made during capture is the usual cause: warm up on the capture stream)"
                )
        self.warnings.extend(w for w in out if w not in self.warnings)
        return out

    def failure_detail(self) -> str | None:
        return self.vmm.lib.error() or None

    def physical_bytes(self) -> int | None:
        return self.vmm.lib.stats().physical_bytes

    def release(self) -> None:
        if self.released:
            return
        self.pool_ids.clear()
        why = self.vmm.close()
        if why:
            self.warnings.append(f"VMM memory left mapped until exit: {why}")
        super().release()


STRATEGIES = tuple(_REGISTRY)
