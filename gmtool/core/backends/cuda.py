"""CUDA graphs on one dedicated capture stream, all graphs of a pool kept alive together.

The stream is warmed up by an eager pass before the first capture: otherwise cuBLAS creates its workspace
inside the first graph's pool, where memory shared with later graphs can overwrite it (GPU-NOTES pitfall 1).
"""

from __future__ import annotations

import gc

import torch

from gmtool.errors import CaptureError, OutOfMemory


class CudaGraph:
    __slots__ = ("graph", "replay")

    def __init__(self, graph: torch.cuda.CUDAGraph):
        self.graph = graph
        self.replay = graph.replay  # bound once: no Python frame of ours on the launch path

    def exec_handle(self) -> int:
        """The cudaGraphExec_t the native step loop launches (gmtool.kernels.native_loop): torch's
        raw_cuda_graph_exec (documented from torch 2.8 on), once the graph is instantiated."""
        from gmtool.kernels.launcher import NotNative

        get = getattr(self.graph, "raw_cuda_graph_exec", None)
        if get is None:
            raise NotNative(f"torch {torch.__version__} has no CUDAGraph.raw_cuda_graph_exec")
        try:
            return int(get())
        except RuntimeError as e:
            raise NotNative(f"no instantiated graph: {str(e).splitlines()[0]}") from None

    def instantiate(self) -> None:
        """A graph whose backend deferred its instantiation (gmtool.core.overlap): torch releases the GIL for it."""
        self.graph.instantiate()

    def upload(self) -> bool:
        """The driver's copy of the graph to the device, as its first launch makes it, on the current stream:
        cuGraphUpload runs no kernel, where a first replay would run the whole step. False where it cannot
        (no cuda-bindings, no exec handle, a driver error): the caller replays instead."""
        from gmtool.kernels.launcher import NotNative
        from gmtool.verify.graphnodes import load_driver

        driver = load_driver()
        if driver is None:
            return False
        try:
            handle = self.exec_handle()
        except NotNative:
            return False
        try:
            stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
            (err,) = driver.cuGraphUpload(driver.CUgraphExec(handle), stream)
        except Exception:  # bindings of another shape (an old cuda-python): the replay does it
            return False
        return int(err) == 0

    def graph_handle(self) -> int:
        """The cudaGraph_t a stitched graph embeds (native_loop.NativeProgram.stitch): kept by torch only for
        a graph made with keep_graph=True (the backend's default)."""
        from gmtool.kernels.launcher import NotNative

        get = getattr(self.graph, "raw_cuda_graph", None)
        if get is None:
            raise NotNative(f"torch {torch.__version__} has no CUDAGraph.raw_cuda_graph")
        try:
            return int(get())
        except RuntimeError as e:
            raise NotNative(f"the graph was not kept: {str(e).splitlines()[0]}") from None


class CudaGraphBackend:
    name = "cuda"

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.pool = None  # a pool id; None: one private pool made at the first capture and shared after
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self._capturing: torch.cuda.CUDAGraph | None = None
        self._stream_ctx = None
        self.warmed = False
        # graphs keep their cudaGraph_t: piecewise steps embed them in one stitched graph (gmtool.kernels.native_loop),
        # gmtool.verify.graphnodes reads their nodes; host memory only
        self.keep_graph = True
        # gmtool.core.overlap: end() leaves instantiation to a worker thread, and captures are thread_local, so
        # that thread's instantiations and uploads do not invalidate the capture under way
        self.defer_instantiation = False

    def warmup(self, fn) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            fn()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self.stream.synchronize()
        self.warmed = True

    def begin(self) -> None:
        assert self.warmed, "warm up the capture stream before the first capture"
        if self._capturing is None:
            torch.cuda.synchronize(self.device)
        g = torch.cuda.CUDAGraph(keep_graph=True) if self.keep_graph else torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        self._stream_ctx = torch.cuda.stream(self.stream)
        self._stream_ctx.__enter__()
        try:
            g.capture_begin(pool=self.pool, capture_error_mode="thread_local" if self.defer_instantiation else "global")
        except RuntimeError as e:
            self._stream_ctx.__exit__(None, None, None)
            raise CaptureError(f"capture could not begin: {e}") from None
        self._capturing = g

    def end(self) -> CudaGraph:
        g, self._capturing = self._capturing, None
        try:
            g.capture_end()
        except torch.OutOfMemoryError:
            raise OutOfMemory("out of memory while capturing") from None
        finally:
            self._stream_ctx.__exit__(None, None, None)
        if self.keep_graph and not self.defer_instantiation:
            g.instantiate()  # a kept graph is otherwise instantiated by its first replay, on the timed path
        self.graphs.append(g)
        return CudaGraph(g)

    def abort(self) -> None:
        """End a capture that failed part-way, leaving the stream usable."""
        if self._capturing is not None:
            g, self._capturing = self._capturing, None
            try:
                g.capture_end()
            except Exception:
                pass
            self._stream_ctx.__exit__(None, None, None)
        torch.cuda.synchronize(self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def release(self) -> None:
        self.graphs.clear()
        self.pool = None
        gc.collect()
        torch.cuda.empty_cache()
