"""Each row's distance to the hardware floor: the least time its step could take on this device.

- Bandwidth floor: the bytes the step must read (the weights once, the K/V of every sequence's context, the
  activations: the residual stream once per layer and the logits written) over the device's copy bandwidth,
  bytes read + written per second by one large copy, measured once per run (on the CPU, a memcpy).
- Launch floor: kernels one replay runs x the measured cost of one graph node (a graph of tiny kernels
  replayed; on the CPU tape, a tape of tiny ops).
- floor = the larger of the two; replay_over_floor = the row's median latency / floor.

Kernels are counted after every row is timed (a sweep probe): on CUDA with the profiler (which slows every
later CUDA call of the process, so a run that measures the hf-compiled peer afterwards leaves the launch floor
out), on the CPU as the ATen ops one replay dispatches. Under --trace, the traced replays' time is split by
kernel class (time_by_class).
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gmtool.core.batch import Batch
from gmtool.errors import GmtoolError
from gmtool.model import families
from gmtool.modes import GraphMode
from gmtool.records import Status

NODES = 500  # tiny kernels in the graph that measures the cost of one node
COPY_BYTES = {"cuda": 256 << 20, "cpu": 64 << 20}


@dataclass
class DeviceFloor:
    """Measured once per run."""

    copy_bytes_per_s: float  # bytes read + written per second by one large copy
    node_us: float  # replay time per graph node (a tape op on the CPU)


@dataclass
class Floor:
    bytes: int
    bandwidth_ms: float
    launch_ms: float | None  # None: kernels not counted

    @property
    def ms(self) -> float:
        return max(self.bandwidth_ms, self.launch_ms or 0.0)


def step_bytes(lm, batch: Batch) -> int:
    """What the step must read at least: every weight once (of an untied input embedding only the batch's
    rows), K/V of each sequence's context (a sliding-window layer: its window), the residual stream once per layer,
    the logits written. Of a multimodal model, the text decoder's and the head's weights: a vision tower runs no
    text step."""
    model = lm.model
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    skip = emb.weight.untyped_storage().data_ptr() if head is None or head.weight is not emb.weight else None
    seen, weights = set(), 0
    base = families.base_model(model) or model
    for p in [*base.parameters(), *(head.parameters() if head is not None else ())]:
        st = p.untyped_storage()
        if st.data_ptr() in seen or st.data_ptr() == skip:
            continue
        seen.add(st.data_ptr())
        weights += st.nbytes()
    item = next(model.parameters()).element_size()
    if skip is not None:
        weights += batch.num_tokens * emb.weight.shape[1] * item
    layout = getattr(lm, "layout", None)
    v_dim = layout.v_head_dim if layout is not None else lm.head_dim
    windows = layout.windows if layout is not None else [None] * lm.num_layers
    # a sliding-window layer reads only its window of each sequence's context
    tokens = sum(sum(min(n, w) if w else n for n in batch.kv_lens) for w in windows)
    kv = lm.rank_kv_heads * (lm.head_dim + v_dim) * item * int(tokens)
    hidden = families.text_config(model.config).hidden_size
    acts = batch.num_tokens * hidden * item * lm.num_layers + batch.num_seqs * lm.vocab_size * item
    return weights + kv + acts


def floor_of(nbytes: int, kernels: int | None, dev: DeviceFloor) -> Floor:
    launch = kernels * dev.node_us / 1e3 if kernels is not None else None
    return Floor(nbytes, nbytes / dev.copy_bytes_per_s * 1e3, launch)


# -- measured once per run ----------------------------------------------------------------------------
def measure_device(device: torch.device, rounds: int = 5) -> DeviceFloor:
    n = COPY_BYTES["cuda" if device.type == "cuda" else "cpu"]
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    copy_ms = _median_ms(lambda: dst.copy_(src), device, rounds)
    x = torch.zeros(1, device=device)
    if device.type == "cuda":
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream(device)
        s.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(s):
            x.add_(1)  # warm-up off the capture
            with torch.cuda.graph(g, stream=s):
                for _ in range(NODES):
                    x.add_(1)
        torch.cuda.current_stream(device).wait_stream(s)
        replay = g.replay
    else:
        from gmtool.core.backends.cpu import CpuTapeBackend

        be = CpuTapeBackend()
        be.begin()
        for _ in range(NODES):
            x.add_(1)
        replay = be.end().replay
    node_ms = _median_ms(replay, device, rounds * 4)
    if device.type != "cuda":  # a tape op can cost more than the same op run eagerly: the floor is the cheaper
        node_ms = min(node_ms, _median_ms(lambda: [x.add_(1) for _ in range(NODES)], device, rounds * 4))
    return DeviceFloor(2 * n / (copy_ms * 1e-3), node_ms * 1e3 / NODES)


def _median_ms(fn, device: torch.device, iters: int) -> float:
    from gmtool.measure.timing import time_ms

    return statistics.median(time_ms(fn, iters, 2, device))


# -- kernels per replay -------------------------------------------------------------------------------
class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def kernels_per_replay(run, device: torch.device) -> int | None:
    """Kernels one call of run() launches: CUDA kernels and copies the profiler sees (graph nodes included);
    on the CPU, the ATen ops it dispatches (the tape's ops and its runners' alike)."""
    if device.type != "cuda":
        with _CountOps() as c:
            run()
        return c.n
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize(device)
        return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)
    except Exception:  # the profiler is optional: the launch floor is left out
        return None


class FloorProbe:
    """After every row is timed: each row's floor (floor_ms, its bandwidth and launch parts, the bytes and
    kernels behind them) and replay_over_floor; the device figures go into the document's machine section."""

    def __init__(self, count_kernels: bool = True):
        self.count_kernels = count_kernels

    def after_sweep(self, bench, executors, res) -> None:
        device = bench.device
        dev = measure_device(device)
        res.machine.update(copy_bytes_per_s=dev.copy_bytes_per_s, graph_node_us=dev.node_us)
        count = self.count_kernels or device.type != "cuda"
        if not count:
            res.notes.append(
                "floor: the launch floor is left out (counting kernels attaches the profiler, which "
                "would slow the hf-compiled rows measured after)"
            )
        counted: dict[tuple, int | None] = {}
        for rec, batch in _rows_with_batches(bench, res.records):
            if rec.mode not in executors and rec.mode is not GraphMode.EAGER:
                continue
            kernels = None
            if count:
                kernels = self._kernels(bench, executors.get(rec.mode), rec, batch, counted)
            f = floor_of(step_bytes(bench.lm, batch), kernels, dev)
            rec.floor_bytes, rec.kernels = f.bytes, kernels
            rec.floor_bandwidth_ms, rec.floor_launch_ms, rec.floor_ms = f.bandwidth_ms, f.launch_ms, f.ms
            if rec.latency_ms is not None and f.ms > 0:
                rec.replay_over_floor = rec.latency_ms.median / f.ms

    @staticmethod
    def _kernels(bench, ex, rec, batch: Batch, counted: dict) -> int | None:
        """Counted once per graph, and once per kind of eager step (the profiler is slow): the count depends
        on the batch only where torch's reference attention loops over the sequences of the host plan."""
        plan = batch.plan if bench.cfg.attention_backend == "torch" else None
        if ex is None or rec.key not in {str(k) for k in ex.graphs}:  # eager, or auto above its buckets
            key = ("eager", batch.is_decode, batch.num_seqs if plan else None, plan)
            if key not in counted:
                fn, _ = bench.eager_fn(batch)
                counted[key] = kernels_per_replay(fn, bench.device)
            return counted[key]
        entry = ex.prepare(batch)
        key = (rec.mode, rec.key, plan if entry.runners else None)
        if key not in counted:
            counted[key] = kernels_per_replay(lambda: entry.replay(batch), bench.device)
        return counted[key]


def _rows_with_batches(bench, records):
    """(record, its batch) for the OK rows: the k-th composition of a bucket with a label is the k-th row of
    each mode with that bucket and label (default decode mixes share labels and differ by their contexts)."""
    cfg, seen, batches = bench.cfg, {}, {}
    for bucket, comps in cfg.compositions_by_bucket.items():
        for comp in comps:
            n = seen[(bucket, comp.label)] = seen.get((bucket, comp.label), 0) + 1
            batches[(bucket, comp.label, n)] = comp
    nth: dict[tuple, int] = {}
    for rec in records:
        k = (rec.mode, rec.bucket, rec.composition)
        nth[k] = nth.get(k, 0) + 1
        comp = batches.get((rec.bucket, rec.composition, nth[k]))
        if comp is None or rec.status != Status.OK:
            continue
        try:
            yield rec, bench.batch(comp)
        except GmtoolError:
            continue


# -- under --trace: the step's time by kernel class ----------------------------------------------------
# first match wins: attention kernels may name a GEMM inside them. With --fuse on Triton the K/V write is inside
# the QK-norm + RoPE kernel, so it counts as norm there (write_kv, attention, elsewhere).
KERNEL_CLASSES = (
    ("attention", re.compile(r"attention|attn|sdpa|flash|fmha|decode_split|combine_kernel|varlen|write_kv", re.I)),
    ("GEMM", re.compile(r"gemm|gemv|matmul|\bmm\b|aten::mm|addmm|bmm|linear|cutlass|xmma|cublas|nvjet|sm\d+_", re.I)),
    ("norm", re.compile(r"norm|rsqrt", re.I)),
    (
        "elementwise",
        re.compile(
            r"elementwise|vectorized|silu|sigmoid|mul|add|sub|div|neg|exp|pow|copy|fill|"
            r"cat|index|embedding|where|mean|softmax|rotary|rope",
            re.I,
        ),
    ),
)


def kernel_class(name: str) -> str:
    return next((cls for cls, rx in KERNEL_CLASSES if rx.search(name)), "other")


def time_by_class(trace: Path, replays: int) -> dict[str, float]:
    """ms per replay by kernel class from a Chrome trace written by gmtool.measure.trace: device kernels on
    CUDA; on the CPU the outermost ATen ops (an op's own callees are not counted twice)."""
    events = json.loads(Path(trace).read_text()).get("traceEvents", [])
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    if not kernels:
        kernels = _outermost([e for e in events if e.get("cat") == "cpu_op" and "dur" in e])
    out = {cls: 0.0 for cls, _ in KERNEL_CLASSES} | {"other": 0.0}
    for e in kernels:
        out[kernel_class(e.get("name", ""))] += e["dur"] / 1e3 / max(1, replays)
    return out


def _outermost(ops: list[dict]) -> list[dict]:
    by_thread: dict = {}
    for e in ops:
        by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    out = []
    for evs in by_thread.values():
        end = float("-inf")
        for e in sorted(evs, key=lambda e: (e["ts"], -e["dur"])):
            if e["ts"] >= end:
                out.append(e)
                end = e["ts"] + e["dur"]
    return out
