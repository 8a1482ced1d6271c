"""CPU emulation of CUDA graphs: a tape of ATen ops recorded at capture, re-run over the same tensors.

What it emulates: capture freezes the op sequence, every argument (host scalars, shapes, Python control flow
taken) and every tensor's identity; replay re-runs the ops and writes each result into the tensor recorded
at capture, so later ops read the same storage, as a CUDA graph reads the same addresses. What it does not
emulate: timing, memory pools and kernel launch shapes; CUDA-specific capture errors are approximated by
refusing host syncs (.item(), nonzero) during capture.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gmtool.errors import CaptureError

_HOST_SYNC_OPS = {"_local_scalar_dense", "nonzero", "item", "is_nonzero", "equal"}


class _Tape(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.__name__.split(".")[0] in _HOST_SYNC_OPS:
            raise CaptureError(f"host sync inside graph capture: aten.{func.__name__}")
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


class TapeGraph:
    def __init__(self, ops):
        self.ops = ops

    def replay(self) -> None:
        with torch.no_grad():
            for func, args, kwargs, recorded in self.ops:
                fresh = func(*args, **kwargs)
                for new, old in zip(tree_flatten(fresh)[0], tree_flatten(recorded)[0]):
                    if isinstance(old, torch.Tensor) and new is not old and not _aliases(new, old):
                        old.copy_(new)


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    """A view op's fresh result shares the recorded one's storage: nothing to copy."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.storage_offset() == b.storage_offset()


class CpuTapeBackend:
    name = "cpu-tape"

    def __init__(self):
        self._tape: _Tape | None = None
        self.graphs: list[TapeGraph] = []

    def warmup(self, fn) -> None:
        fn()

    def begin(self) -> None:
        assert self._tape is None, "capture already in progress"
        self._tape = _Tape()
        self._tape.__enter__()

    def end(self) -> TapeGraph:
        tape, self._tape = self._tape, None
        tape.__exit__(None, None, None)
        g = TapeGraph(tape.ops)
        self.graphs.append(g)
        return g

    def abort(self) -> None:
        if self._tape is not None:
            self._tape.__exit__(None, None, None)
            self._tape = None

    def synchronize(self) -> None:
        pass

    pool = None  # the executor may set it; the tape keeps its tensors alive itself

    def release(self) -> None:
        self.graphs.clear()
