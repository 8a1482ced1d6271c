"""cuBLAS's first use of each GEMM shape the captures will run, made in a thread while the model is built.

The first GEMM of a shape in a process costs cuBLAS 1-4 ms (loading the kernel it picks, its heuristics); a
second use costs microseconds. A warm capture of the 35 default decode buckets makes about 175 such first uses
(4 projections and the LM head a bucket), 0.3-0.4 s of its time in a profile (H200, 2026-12-01, a second
executor in the same process captured the same buckets without them). The shapes are known once the weights
exist: this runs each (rows, weight shape) pair once, on its own stream, while the main thread finishes the
model's build, and is joined before the KV cache is sized (from what is free once torch's cache is emptied).

Made eagerly in another thread, a first use is process-wide: the capture's later use of the shape was cheap
(H200, 2026-12-01: 5 GEMMs 0.4-1.0 ms against 8-15). Run beside the captures instead, the two threads
serialized (cuBLAS's kernel loads hold a lock), which is why this happens before capture, not during it.

Measured (H200, 2026-12-01, .diag/gwab.py: GMTOOL_GEMM_WARMUP=0 against on, one tree, cold then warm processes
alternated, --fuse, the 35 default decode buckets): warm 1.18, 1.41, 1.59 s off against 1.12 and 1.11 on; cold
2.84, 2.82, 2.75 against 2.25, 1.84, 2.16. The thread ran 280 GEMMs in 0.47-0.67 s inside a build of 11-14 s
(either way), and the join never waited (under 0.1 ms). GMTOOL_GEMM_WARMUP=0 turns it off.

The weights are stand-ins: views of the embedding's storage with each weight's shape (the values do not
matter, the shape, dtype and alignment do), so nothing the size of a weight is allocated.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

# a GEMM whose input and output take more than this is left to the capture: the build's own allocations must
# not meet a warm-up's gigabyte (a prefill bucket of 8,192 tokens through llama-3.1-8b's gate/up: 470 MB out)
MAX_BYTES = 256 << 20
# a fused projection is one GEMM over these modules' weights, concatenated (gmtool.model.fused)
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


@dataclass(frozen=True)
class GemmShape:
    out_features: int
    in_features: int
    bias: bool


def gemm_shapes_of(model: torch.nn.Module) -> set[GemmShape]:
    """Every linear layer's shape but the LM head's, and the fused projections' (both: whether --fuse runs is
    decided later, and a shape warmed for nothing costs the thread a few milliseconds)."""
    head = model.get_output_embeddings()
    shapes = {
        GemmShape(m.out_features, m.in_features, m.bias is not None)
        for m in model.modules()
        if type(m) is torch.nn.Linear and m is not head
    }
    for m in model.modules():
        for group in FUSED_GROUPS:
            parts = [getattr(m, n, None) for n in group]
            if all(type(p) is torch.nn.Linear for p in parts) and len({p.in_features for p in parts}) == 1:
                out = sum(p.out_features for p in parts)
                shapes.add(GemmShape(out, parts[0].in_features, any(p.bias is not None for p in parts)))
    return shapes


@dataclass
class GemmWarmup:
    """The thread warming cuBLAS up; join() waits for it (its freed blocks stay in torch's cache)."""

    thread: threading.Thread | None = None
    made: list = field(default_factory=list)  # (rows, out_features, in_features) of each GEMM run
    error: str | None = None
    seconds: float = 0.0  # the thread's run
    waited: float = 0.0  # what join() waited for it: the part the build did not cover

    def join(self) -> None:
        if self.thread is None:
            return
        t0 = time.perf_counter()
        self.thread.join()
        self.waited = time.perf_counter() - t0
        self.thread = None


def run_gemms(model: torch.nn.Module, rows: list[int], head_rows: list[int], made: list) -> None:
    """Each projection shape at each of rows, the LM head at each of head_rows, on the current stream, with
    stand-in weights; (rows, out_features, in_features) of each appended to made."""
    head, source = model.get_output_embeddings(), model.get_input_embeddings().weight
    device, dtype = source.device, source.dtype
    storage = source.detach().reshape(-1)

    def stand_in(n: int, k: int) -> torch.Tensor:
        if n * k <= storage.numel():
            return storage[: n * k].view(n, k)
        return torch.empty(n, k, dtype=dtype, device=device)

    with torch.no_grad():
        for s in sorted(gemm_shapes_of(model), key=lambda s: (s.out_features, s.in_features)):
            w, b = stand_in(s.out_features, s.in_features), storage[: s.out_features] if s.bias else None
            for m in rows:
                if m * (s.in_features + s.out_features) * source.element_size() > MAX_BYTES:
                    continue
                F.linear(torch.empty(m, s.in_features, dtype=dtype, device=device), w, b)
                made.append((m, s.out_features, s.in_features))
        w = stand_in(head.out_features, head.in_features)
        for m in head_rows:  # as LoadedModel.logits_into runs it
            if m * (head.in_features + head.out_features) * source.element_size() > MAX_BYTES:
                continue
            out = torch.empty(m, head.out_features, dtype=dtype, device=device)
            torch.matmul(torch.empty(m, head.in_features, dtype=dtype, device=device), w.t(), out=out)
            made.append((m, head.out_features, head.in_features))


def start(model: torch.nn.Module, rows: list[int], head_rows: list[int]) -> GemmWarmup:
    """rows: the token counts the projections will see (the buckets); head_rows: the LM head's row counts.
    Nothing starts unless the embedding is on CUDA and the LM head a plain linear layer."""
    warm = GemmWarmup()
    source = getattr(model.get_input_embeddings(), "weight", None)
    if source is None or not source.is_cuda or type(model.get_output_embeddings()) is not torch.nn.Linear:
        return warm

    def run() -> None:
        t0 = time.perf_counter()
        stream = torch.cuda.Stream(source.device)
        try:
            with torch.cuda.device(source.device), torch.cuda.stream(stream):
                run_gemms(model, rows, head_rows, warm.made)
            stream.synchronize()
        except Exception as e:  # a warm-up only: the capture makes these first uses itself
            warm.error = f"{type(e).__name__}: {e}"
        warm.seconds = time.perf_counter() - t0

    warm.thread = threading.Thread(target=run, name="gmtool-gemm-warmup", daemon=True)
    warm.thread.start()
    return warm
