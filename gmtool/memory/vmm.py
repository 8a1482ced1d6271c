"""Build, load and drive vmm_allocator.cpp: one virtual range per captured shape, one shared physical pool.

The .so is compiled at run time with g++ (cached under ~/.cache/gmtool by source hash). Its state is
process-wide: one VmmPools at a time. Everything that can be missing (CUDA, g++, cuda.h, driver support)
raises GmtoolError, so a caller can mark the strategy unavailable and go on.
"""

from __future__ import annotations

import ctypes
import gc
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from gmtool.errors import GmtoolError

SOURCE = Path(__file__).with_name("vmm_allocator.cpp")
MALLOC, FREE = "gmtool_vmm_malloc", "gmtool_vmm_free"


def cache_dir() -> Path:
    base = os.environ.get("GMTOOL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "gmtool"
    )
    return Path(base)


def cuda_include_dir() -> Path | None:
    """Where cuda.h is: CUDA_HOME/CUDA_PATH, /usr/local/cuda, or an nvidia pip package."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    cands = [Path(r) / "include" for r in roots if r]
    for site in sys.path:
        cands += [Path(p).parent for p in glob.glob(os.path.join(site, "nvidia", "*", "include", "cuda.h"))]
    return next((c for c in cands if (c / "cuda.h").is_file()), None)


def _lib_dirs() -> list[str]:
    """Where a libcuda to link against may be: toolkit stubs, the driver's own directories."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    dirs = [
        os.path.join(r, sub)
        for r in roots
        if r
        for sub in ("lib64/stubs", "lib/stubs", "targets/x86_64-linux/lib/stubs")
    ]
    dirs += ["/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/local/nvidia/lib64"]
    return [d for d in dirs if os.path.isdir(d)]


def _writable_dir(d: Path) -> Path | None:
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return d if os.access(d, os.W_OK) else None


def build_library(fake: bool = False) -> Path:
    """Compile (or reuse) the allocator. fake: the recording fake driver, no CUDA needed."""
    gxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("g++")
    if gxx is None:
        raise GmtoolError("the VMM allocator needs a C++ compiler: g++ is not on PATH")
    flags = ["-O2", "-std=c++17", "-shared", "-fPIC"]
    if fake:
        flags.append("-DGMTOOL_FAKE_DRIVER")
        links = [[]]
        inc = None
    else:
        inc = cuda_include_dir()
        if inc is None:
            raise GmtoolError(
                "the VMM allocator needs cuda.h: set CUDA_HOME (looked in CUDA_HOME, CUDA_PATH, "
                "/usr/local/cuda/include and the nvidia pip packages)"
            )
        flags.append(f"-I{inc}")
        # -lcuda needs an unversioned libcuda.so (toolkit stubs); without one, leave the symbols to be
        # resolved at load time from the driver's libcuda.so.1 (VmmLibrary makes it global first)
        dirs = [f"-L{d}" for d in _lib_dirs()]
        links = [dirs + ["-lcuda"], dirs + ["-l:libcuda.so.1"], []]
    h = hashlib.sha256(SOURCE.read_bytes() + " ".join(flags).encode())
    if inc is not None:  # another toolkit's header may declare other symbol versions
        h.update((inc / "cuda.h").read_bytes())
    key = h.hexdigest()[:16]
    out_dir = _writable_dir(cache_dir()) or _writable_dir(Path(tempfile.gettempdir()) / "gmtool-cache")
    if out_dir is None:
        raise GmtoolError(
            f"no writable directory for the VMM allocator build (tried {cache_dir()}): set GMTOOL_CACHE_DIR"
        )
    target = out_dir / f"vmm-{'fake' if fake else 'cuda'}-{key}.so"
    if target.is_file():
        return target
    errors = []
    for link in links:
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
        cmd = [gxx, *flags, str(SOURCE), "-o", tmp, *link]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode == 0:
            os.replace(tmp, target)  # atomic: a concurrent build never sees half a file
            return target
        Path(tmp).unlink(missing_ok=True)
        errors.append(f"$ {' '.join(cmd)}\n{proc.stderr.strip()}")
    raise GmtoolError("could not compile the VMM allocator:\n" + "\n".join(errors[-1:]))


@dataclass
class RangeStats:
    base: int
    used_bytes: int
    mapped_bytes: int


@dataclass
class VmmStats:
    granularity: int
    chunk_bytes: int
    range_bytes: int
    physical_bytes: int
    virtual_reserved_bytes: int
    virtual_mapped_bytes: int
    live_segments: int
    mallocs: int
    ranges: list[RangeStats]

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["ranges"] = [r.__dict__ for r in self.ranges]
        return d


class VmmLibrary:
    """ctypes view of the .so: control and statistics (torch calls malloc/free itself)."""

    _SIZE_GETTERS = (
        "granularity",
        "chunk_bytes",
        "range_bytes",
        "physical_bytes",
        "virtual_reserved_bytes",
        "virtual_mapped_bytes",
        "live_segments",
        "current_used",
    )

    def __init__(self, path: Path):
        self.path = Path(path)
        self.fake = "-fake-" in self.path.name
        if not self.fake:
            try:  # resolves the cu* symbols of a build that was not linked against libcuda
                ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
            except OSError as e:
                raise GmtoolError(f"the CUDA driver library libcuda.so.1 cannot be loaded: {e}") from None
        try:
            lib = ctypes.CDLL(str(self.path))
        except OSError as e:
            raise GmtoolError(f"the VMM allocator {self.path} cannot be loaded: {e}") from None
        c = ctypes
        sigs = {
            "gmtool_vmm_init": (c.c_int, [c.c_int, c.c_size_t, c.c_size_t]),
            "gmtool_vmm_begin_range": (c.c_int, []),
            "gmtool_vmm_shutdown": (c.c_int, [c.c_int]),
            "gmtool_vmm_last_error": (c.c_char_p, []),
            "gmtool_vmm_num_ranges": (c.c_int, []),
            "gmtool_vmm_num_mallocs": (c.c_ulonglong, []),
            "gmtool_vmm_num_frees": (c.c_ulonglong, []),
            "gmtool_vmm_range_used": (c.c_size_t, [c.c_int]),
            "gmtool_vmm_range_mapped": (c.c_size_t, [c.c_int]),
            "gmtool_vmm_range_base": (c.c_ulonglong, [c.c_int]),
            MALLOC: (c.c_void_p, [c.c_ssize_t, c.c_int, c.c_void_p]),
            FREE: (None, [c.c_void_p, c.c_ssize_t, c.c_int, c.c_void_p]),
        }
        sigs.update({f"gmtool_vmm_{n}": (c.c_size_t, []) for n in self._SIZE_GETTERS})
        if self.fake:
            sigs.update(
                {
                    "gmtool_fake_configure": (None, [c.c_size_t, c.c_int, c.c_int, c.c_int]),
                    "gmtool_fake_log": (c.c_char_p, []),
                    "gmtool_fake_live_mappings": (c.c_size_t, []),
                    "gmtool_fake_live_handles": (c.c_size_t, []),
                    "gmtool_fake_live_reservations": (c.c_size_t, []),
                }
            )
        for name, (res, args) in sigs.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        self.lib = lib

    def __getattr__(self, name):
        """lib.physical_bytes() -> gmtool_vmm_physical_bytes(); fake_log() -> gmtool_fake_log()."""
        if name.startswith("_") or name == "lib":
            raise AttributeError(name)
        prefix = "gmtool_" if name.startswith("fake_") else "gmtool_vmm_"
        return getattr(self.lib, prefix + name)

    def error(self) -> str:
        return (self.lib.gmtool_vmm_last_error() or b"").decode(errors="replace")

    def init(self, device: int, range_bytes: int, chunk_bytes: int = 0) -> None:
        if self.lib.gmtool_vmm_init(device, range_bytes, chunk_bytes) != 0:
            raise GmtoolError(f"VMM allocator: {self.error()}")

    def begin_range(self) -> int:
        i = self.lib.gmtool_vmm_begin_range()
        if i < 0:
            raise GmtoolError(f"VMM allocator: {self.error()}")
        return i

    def shutdown(self, force: bool = False) -> str | None:
        """None when everything was released, else why not."""
        return None if self.lib.gmtool_vmm_shutdown(int(force)) == 0 else self.error()

    def stats(self) -> VmmStats:
        L = self.lib
        n = L.gmtool_vmm_num_ranges()
        ranges = [
            RangeStats(L.gmtool_vmm_range_base(i), L.gmtool_vmm_range_used(i), L.gmtool_vmm_range_mapped(i))
            for i in range(n)
        ]
        g = {k: getattr(L, f"gmtool_vmm_{k}")() for k in self._SIZE_GETTERS if k != "current_used"}
        return VmmStats(mallocs=L.gmtool_vmm_num_mallocs(), ranges=ranges, **g)


class VmmPools:
    """One torch.cuda.MemPool per captured shape, each on a fresh virtual range of the shared allocator."""

    def __init__(self, device, range_bytes: int | None = None, chunk_bytes: int = 0):
        import torch

        if not torch.cuda.is_available():
            raise GmtoolError("the VMM allocator needs CUDA, and torch sees no CUDA device")
        if not hasattr(torch.cuda, "MemPool"):
            raise GmtoolError(f"torch {torch.__version__} has no torch.cuda.MemPool: the VMM strategy needs torch>=2.6")
        self.device = torch.device(device)
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        torch.cuda.synchronize(index)  # the runtime's primary context is current on this thread from here
        self.lib = VmmLibrary(build_library(fake=False))
        if range_bytes is None:  # no shape can need more physical memory than the device has
            range_bytes = torch.cuda.get_device_properties(index).total_memory
        try:
            self.lib.init(index, range_bytes, chunk_bytes)
        except GmtoolError:  # one allocator per process: an earlier owner's pools may only now be collectable
            gc.collect()
            torch.cuda.synchronize(index)
            torch.cuda.empty_cache()
            why = self.lib.shutdown()
            if why:
                raise GmtoolError(
                    f"VMM allocator: an earlier VMM strategy in this process still holds memory ({why}): "
                    "its graphs are alive"
                ) from None
            self.lib.init(index, range_bytes, chunk_bytes)
        try:
            self.allocator = torch.cuda.memory.CUDAPluggableAllocator(str(self.lib.path), MALLOC, FREE)
        except (RuntimeError, AttributeError, AssertionError) as e:
            self.lib.shutdown(force=True)
            raise GmtoolError(f"torch cannot load the VMM allocator: {e}") from None
        self.pools: dict = {}  # key -> MemPool
        self.range_of: dict = {}  # key -> range index

    def new_pool(self, key):
        """A fresh range, then a MemPool whose segments all land in it. Returns the pool id to capture into."""
        import torch

        self.range_of[key] = self.lib.begin_range()
        try:
            with torch.cuda.device(self.device):  # a MemPool belongs to the current device
                pool = torch.cuda.MemPool(self.allocator.allocator())
        except (RuntimeError, TypeError) as e:
            raise GmtoolError(f"torch cannot make a MemPool on the VMM allocator: {e}") from None
        self.pools[key] = pool
        return pool.id

    def close(self) -> str | None:
        """Drop the pools (their graphs must be gone), then unmap. None, or why memory was left mapped."""
        import torch

        self.pools.clear()
        gc.collect()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # lets torch hand the pools' segments back (free is only bookkeeping)
        return self.lib.shutdown()
