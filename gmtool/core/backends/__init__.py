"""Graph backends: CUDA graphs, and a CPU emulation that honours the same capture/replay contract."""

from gmtool.core.backends.base import Graph, GraphBackend
from gmtool.core.backends.cpu import CpuTapeBackend


def make_backend(device) -> GraphBackend:
    if device.type == "cuda":
        from gmtool.core.backends.cuda import CudaGraphBackend

        return CudaGraphBackend(device)
    return CpuTapeBackend()


__all__ = ["Graph", "GraphBackend", "CpuTapeBackend", "make_backend"]
