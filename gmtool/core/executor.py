"""The graph executor: bucket, copy into persistent buffers, capture on miss, replay on hit.

A captured entry is a list of steps replayed in order: one graph for a full graph; graph -> attention runner
-> graph ... for a piecewise one. Runners read the current batch's metadata at replay, never the capture's.
"""

from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass, field

import torch

from gmtool.kernels.native_loop import PENDING_RETRIES, build_step_loop
from gmtool.model.attention import PLAIN, TORCH_ATTENTION, ForwardContext, LayerOpts, forward_context
from gmtool.core.backends import make_backend
from gmtool.core.batch import Batch
from gmtool.kernels import compile_ahead
from gmtool.core.buckets import BucketKey, BucketPolicy
from gmtool.errors import CaptureError, GmtoolError, InputsNotLoaded, OutOfMemory, first_line
from gmtool.core.inputs import PersistentInputs, StepViews
from gmtool.core.kv_cache import PagedKVCache
from gmtool.model.loading import LoadedModel
from gmtool.modes import GraphMode


@contextlib.contextmanager
def gc_frozen():
    """Python's cyclic GC leaves the objects alive on entry alone until exit (gc.freeze). A full collection
    walks every object the process holds (a built model, transformers, torch: about 370,000 objects, 0.2 s on the
    CPU machine) and can fall inside any capture; frozen, it walks only what was made since (vLLM's and SGLang's
    graph runners freeze it too). Four captures of qwen3-0.6b on the CPU backend: without it, full collections
    took 0.58 s of 1.68; with it, 0.34 s (the backend's tapes keep their ops alive, and those it walks). On the
    H200 (2026-12-02, .diag/gcab.py, nine processes capturing the 35 default decode buckets, with this freeze) the
    one full collection in each was release()'s own, after the captures; no run without it was made there, so no
    gain on the GPU is claimed. Where objects are frozen already (an outer scope, or a caller that froze the GC,
    as an engine may), it leaves them so: an unfreeze would thaw the caller's too."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@dataclass
class AttentionRunner:
    """Attention left outside the graphs. It borrows the executor's shared q and output buffers (one each for
    every layer and bucket) and owns no tensor of a piece: the piece before it wrote this step's K/V into the
    cache and q into the shared buffer, so the pieces' own tensors are free for the next piece to reuse, as in
    one graph. The step's metadata was prepared once, before the first piece (ForwardContext.prepare). The
    attention is bound once, here: with Triton, its kernels launch straight from the compiled kernel after the
    first replay (gmtool.kernels.launcher), so a runner costs one launch of host time."""

    is_runner = True

    layer: int
    q: torch.Tensor
    out: torch.Tensor
    scale: float
    ctx: ForwardContext
    opts: LayerOpts = PLAIN

    def __post_init__(self) -> None:
        self.launch = self.ctx.bind(self.layer, self.q, self.scale, self.out, self.opts)

    def replay(self) -> None:
        self.launch()

    @property
    def launch_paths(self) -> tuple[str, ...]:
        """How its Triton kernels launch (gmtool.kernels.launcher: direct, pending, triton: why); () for torch."""
        return getattr(self.launch, "paths", ())


@dataclass
class CapturedGraph:
    key: BucketKey
    mode: GraphMode
    impl: str
    steps: list
    ctx: ForwardContext
    # capture, instantiation and the wait for them (the upload not included); capture_all: capture alone (its
    # worker instantiates: instantiate_s)
    capture_s: float = 0.0
    warmup_s: float = 0.0  # the eager pass before it, if any (warmed_up)
    # its memory reading (CUDA: mem_get_info, allocator stats) and the upload (piecewise: a first replay, which
    # also builds the native step loop, compiling step_loop.c once per machine)
    measure_s: float = 0.0
    # capture_all: its instantiation and upload, in a worker thread while the next bucket was captured (not in
    # capture_s); None where capture_s holds them
    instantiate_s: float | None = None
    graph_mem_bytes: int | None = None  # peak memory the capture allocated (the shape's need; CUDA only)
    pool_growth_bytes: int | None = None  # reserved memory the capture added (CUDA only)
    outside_pool_bytes: int | None = None  # device memory the capture took beyond the pool (CUDA only)
    baked_plans: list = field(default_factory=list)  # host plans frozen into the graph, if any
    captured_with: str = ""  # the composition whose batch was live during capture
    compile_s: float | None = None  # FX piecewise: trace + split (+ one eager pass) for this shape
    copies_inputs: bool = False  # its first step copies the staging arena in: prepare only writes staging
    copy_steps: int = 0  # graphs that only copy inputs (FX split: its pieces capture themselves)
    piecewise_impl: str | None = None  # breakable | fx | "breakable (fx could not trace: ...)"
    warmed_up: bool = False  # an eager pass ran before its capture (the executor's first, fx, or a retry)
    warmed_after_failure: bool = False  # its cold capture failed, and it was warmed up and captured again
    # how a replay launches its steps (gmtool.kernels.native_loop): "stitched" (one graph launch per step),
    # "native" (one C call), "python: why", or "pending" until the first replay has compiled every runner's kernels
    launch_path: str = "pending"
    loop: object = field(default=None, repr=False)  # the native StepLoop once built
    native_tries: int = field(default=0, repr=False)
    inputs: PersistentInputs | None = field(default=None, repr=False)  # the arena its copy-in and views read

    @property
    def pieces(self) -> int:
        return len(self.steps) - self.runners - self.copy_steps

    @property
    def runners(self) -> int:
        return sum(getattr(s, "is_runner", False) for s in self.steps)

    def check_inputs(self) -> None:
        """Raises InputsNotLoaded unless the input arena holds this key's batch (a replay reads it at this key's
        offsets: another key's batch there gives wrong positions and lengths, or an illegal address)."""
        if self.inputs is not None and not self.inputs.holds(self.key):
            raise InputsNotLoaded(
                f"bucket {self.key} replayed while the input arena holds another bucket's batch: its graph would "
                "read that batch's fields at its own offsets; load the batch first (GraphExecutor.prepare)"
            )

    def replay(self, batch: Batch, refresh_metadata: bool = True) -> None:
        self.check_inputs()
        if refresh_metadata:
            self.ctx.prepare(batch.plan)
        if self.loop is not None:
            return self.loop()
        for step in self.steps:
            step.replay()
        if self.launch_path.startswith("pending") and self.native_tries < PENDING_RETRIES:
            # after a replay every runner's kernels have launched once (through Triton) and can go native
            self.native_tries += 1
            self.loop, self.launch_path = build_step_loop(self)

    def upload(self, batch: Batch) -> None:
        """Make the graphs ready to launch, as a first launch would (the driver copies each to the device, taking
        memory outside the pool). Whole graphs upload without running (CUDA: cuGraphUpload; the 35 default decode
        buckets' upload replays took 0.13 s on the H200); a step with runners, whose first replay builds the native
        step loop, or a graph that cannot upload alone, replays batch once."""
        alone = self.steps and all(getattr(s, "upload", None) is not None for s in self.steps)
        if not (alone and all(s.upload() for s in self.steps)):  # a refusal stops there: the replay uploads all
            self.replay(batch)

    def stale_metadata(self, batch: Batch) -> bool:
        """True when the graph froze a host plan that differs from this batch's: its replay is unsafe."""
        sig = self.ctx.plan_signature(batch.plan)
        return any(p != sig for p in self.baked_plans)


@contextlib.contextmanager
def _memory_of(entry: CapturedGraph, device: torch.device, upload=None, held=None):
    """CUDA: the capture's peak allocation (the shape's need), the pool memory it added, and what the driver
    took outside the pool around capture + instantiation and then around upload() (the graphs' copy to the device).
    held(): the pools' physical bytes, where the allocator's reserved bytes do not say them (it may return None;
    no held, or None: the reserved bytes). VMM maps every shape's virtual range onto shared chunks: its reserved
    bytes grow by the range, its physical ones by the excess. No upload: the allocator's figures only (capture_all
    reads the driver's bytes once its worker has instantiated and uploaded the graph: gmtool.core.overlap)."""
    if device.type != "cuda":
        yield
        return

    def allocator() -> tuple[int, int, int, int]:
        """allocated, peak allocated, pool bytes, reserved bytes: from one nested reading (torch.cuda.memory_allocated
        and its kind flatten all ~160 allocator statistics per call: 0.4 ms under cProfile on the H200's host)."""
        stats = torch.cuda.memory_stats_as_nested_dict(device)
        allocated = stats.get("allocated_bytes", {}).get("all", {})
        reserved = stats.get("reserved_bytes", {}).get("all", {}).get("current", 0)
        got = held() if held is not None else None
        return allocated.get("current", 0), allocated.get("peak", 0), reserved if got is None else got, reserved

    if upload is not None:
        torch.cuda.synchronize(device)
    mem0, _, res0, _ = allocator()
    free0 = None if upload is None else torch.cuda.mem_get_info(device)[0]
    torch.cuda.reset_peak_memory_stats(device)
    yield
    _, peak, res1, before_upload = allocator()
    entry.graph_mem_bytes = peak - mem0
    entry.pool_growth_bytes = res1 - res0
    if upload is None:
        return
    upload()  # the driver uploads a graph at its first launch: memory outside the pool too
    torch.cuda.synchronize(device)
    # what the driver gave beyond the pool's growth: graph instantiation, exec objects and the upload
    # (gmtool.memory.ledger). One reading after both: cudaMemGetInfo costs about 1.2 ms on the H200's host
    # (2026-12-02, 106 calls 0.126 s), a third of a bucket's readings. An upload that replays (piecewise) runs
    # its runners, whose temporaries (torch attention's gathers) torch's allocator may reserve: not the driver's.
    uploaded = allocator()[3] - before_upload
    entry.outside_pool_bytes = (free0 - torch.cuda.mem_get_info(device)[0]) - entry.pool_growth_bytes - uploaded


class GraphExecutor:
    def __init__(
        self,
        lm: LoadedModel,
        cache: PagedKVCache,
        policy: BucketPolicy,
        mode: str,
        max_num_seqs: int,
        device: torch.device,
        memory=None,
        attention=None,
        forward=None,
    ):
        """memory: a MemoryStrategy (gmtool.memory) choosing the pool of each capture; None: one shared pool.
        forward: how the forward runs and is cut into captured steps (gmtool.core.forwards); default: one whole
        graph, or the runtime split for piecewise."""
        mode = GraphMode(mode)
        if not mode.captures:
            raise GmtoolError(f"{mode} captures no graphs")
        self.lm, self.cache, self.policy, self.mode, self.device = lm, cache, policy, mode, device
        self.inputs = PersistentInputs(
            policy.max_tokens, max_num_seqs, cache.spec.blocks_per_seq, lm.vocab_size, lm.model.dtype, device
        )
        # piecewise: one attention-output buffer (V's head dim) and one query buffer (K's) for every layer and
        # bucket (each piece consumes the output before the next runner overwrites it; each runner reads q before
        # the next piece writes it); under --tp, this rank's heads
        self.attn_out = (
            torch.zeros(policy.max_tokens, lm.rank_heads, cache.spec.v_dim, dtype=lm.model.dtype, device=device)
            if mode.piecewise
            else None
        )
        self.attn_q = (
            torch.zeros(policy.max_tokens, lm.rank_heads, lm.head_dim, dtype=lm.model.dtype, device=device)
            if mode.piecewise
            else None
        )
        # piecewise fx: the last piece's hidden rows, read by the LM head's graph (gmtool.core.forwards.lm_head),
        # one buffer for every bucket
        self.last_hidden = (
            torch.zeros(self.inputs.logits.shape[0], lm.head_in_features, dtype=lm.model.dtype, device=device)
            if mode.piecewise
            else None
        )
        self.backend = make_backend(device)
        self.memory = memory
        self.attention = attention or TORCH_ATTENTION  # the attention backend object (gmtool.kernels)
        # piecewise Triton decode runners: their split partials, reserved before any capture
        reserve = getattr(self.attention, "reserve_scratch", None)
        self.decode_scratch = (
            reserve(
                device,
                policy.sizes,
                lm.rank_heads,
                cache.spec.num_kv_heads,
                cache.spec.v_dim,
                cache.spec.blocks_per_seq * cache.spec.block_size,
            )
            if mode.piecewise and reserve is not None
            else None
        )
        self.graphs: dict[BucketKey, CapturedGraph] = {}
        self.refresh_runner_metadata = True  # False only to demonstrate the stale-metadata bug
        self.warmup_every_capture = False  # True: an eager pass before every capture, as before 2026-12-01
        self.compile_ahead_s: float | None = None  # Triton kernels compiled before the first capture (CUDA)
        self.compile_ahead_note: str | None = None  # why they were not, or what the pass could not do as planned
        self.compile_ahead_forwards_s: float | None = None  # of compile_ahead_s: its forwards, before the last compiles
        self._overlap = None  # capture_all's worker, while it runs (gmtool.core.overlap)
        self.overlap_note: str | None = None  # capture_all: why its instantiations did not overlap, if they did not
        if forward is None:
            from gmtool.core.forwards import RuntimeSplit, WholeGraph

            forward = RuntimeSplit() if mode.piecewise else WholeGraph()
        self.forward_impl = forward

    def runner_buffers(self, key: BucketKey | None = None) -> list[torch.Tensor]:
        """Piecewise: the buffers every bucket's pieces and runners share (q in, attention out, the last hidden
        rows the LM head reads), or key's slices of them; none for whole graphs."""
        if not self.mode.piecewise:
            return []
        if key is None:
            return [self.attn_q, self.attn_out, self.last_hidden]
        t, rows = key.num_tokens, self.inputs.views(key).logits.shape[0]
        return [self.attn_q[:t], self.attn_out[:t], self.last_hidden[:rows]]

    def key_for(self, batch: Batch) -> BucketKey:
        return self.policy.key_for(batch.num_tokens, batch.num_seqs, batch.is_decode, batch.composition.bucket)

    def impl_for(self, key: BucketKey) -> str:
        if key.decode:
            return "decode"
        return "masked" if key.num_seqs is not None else "planned"

    def forward(self, views: StepViews) -> None:
        self.forward_impl.run(self, views)

    def _context(self, key: BucketKey, views: StepViews, batch: Batch) -> ForwardContext:
        return ForwardContext(
            self.cache,
            views,
            self.impl_for(key),
            batch.plan,
            key.num_seqs or 0,
            backend=self.attention,
            scratch=self.decode_scratch,
            # a piecewise capture writes K/V at the end of each piece: its warm-ups and compile-ahead's pass must
            # launch the kernels the capture will (not --fuse's QK kernel that writes the cache itself)
            layers_write_kv=not self.mode.piecewise,
        )

    def capture(self, key: BucketKey, batch: Batch) -> CapturedGraph:
        """Warm up on the capture stream, then capture; piecewise ends a graph at every attention call."""
        views = self.inputs.load(batch, key)
        ctx = self._context(key, views, batch)
        entry = CapturedGraph(
            key, self.mode, ctx.impl, [], ctx, captured_with=batch.composition.label, inputs=self.inputs
        )
        fn = lambda: self.forward(views)  # noqa: E731
        with gc_frozen(), forward_context(ctx), torch.no_grad():
            warm = self.warmup_every_capture or not self.backend.warmed or self.forward_impl.compiles
            if not self.backend.warmed and not self.forward_impl.compiles:
                compile_ahead.before_first_capture(self, key, batch, fn)
            if warm:
                self._warm_up(entry, fn)
            if self.mode.piecewise:
                entry.piecewise_impl = self.forward_impl.label
            if self.memory is not None:  # every piece of one bucket goes into the pool chosen for it
                self.backend.pool = self.memory.pool_for(key)
            try:
                planned = self._capture_measured(entry, batch, fn)
            except CaptureError:
                if warm:
                    raise
                # a shape whose first kernel launch could not be captured cold (a JIT compile the capture
                # refused): warm it up as every shape once was, and capture again
                self._warm_up(entry, fn)
                entry.steps.clear()
                planned = self._capture_measured(entry, batch, fn)
                entry.warmed_after_failure = True
            if self._overlap is not None:  # outside the retry: a failure of the worker's is not this capture's
                self._overlap.submit(entry)
        if self.memory is not None:
            self.memory.captured(key, entry)
        if not self.mode.piecewise:  # runners read the plan at replay; a whole graph bakes it in
            entry.baked_plans = planned
        ctx.planned_with.clear()
        self.graphs[key] = entry
        return entry

    def capture_all(self, batches: list[Batch]) -> list[CapturedGraph]:
        """Capture each batch's bucket in the order given, as an engine's start-up does (largest first): each
        graph is instantiated and uploaded in a worker thread while the next is captured (gmtool.core.overlap),
        where the graphs allow it (overlap_note says why not). Nothing is replayed: a bucket already captured is
        skipped. A failure stops the loop; the graphs captured before it stay."""
        from gmtool.core.overlap import OverlappedInstantiation, refusal

        todo: dict[BucketKey, Batch] = {}
        for batch in batches:
            if (key := self.key_for(batch)) not in self.graphs:
                todo.setdefault(key, batch)
        keys = list(todo)
        self.overlap_note = refusal(self)
        if self.overlap_note is not None:
            return [self.capture(key, todo[key]) for key in keys]
        entries = []
        if keys and not self.backend.warmed:  # the first capture warms the stream up (and compiles ahead) alone
            first = keys.pop(0)
            entries.append(self.capture(first, todo[first]))
        with OverlappedInstantiation(self.backend, self.device) as overlap:
            self._overlap, overlapped = overlap, []
            try:
                for key in keys:
                    overlapped.append(self.capture(key, todo[key]))
                overlap.finish()
            except BaseException:
                with contextlib.suppress(Exception):
                    overlap.finish()  # the worker's last graph, if it finished well, is kept with its driver bytes
                overlap.drain()  # a graph the worker did not finish is not kept: a replay would fail, or instantiate it
                for entry in overlapped:
                    if entry.instantiate_s is None:
                        self.graphs.pop(entry.key, None)
                raise
            finally:
                self._overlap = None
        if overlap.refused_uploads:
            self.overlap_note = (
                f"{overlap.refused_uploads} graphs could not upload alone (cuGraphUpload: no cuda-python bindings, "
                "or refused): each uploads at its first replay, outside their outside_pool_bytes"
            )
        return entries + overlapped

    def _warm_up(self, entry: CapturedGraph, fn) -> None:
        """An eager pass on the capture stream. The executor's first capture needs one: cuBLAS makes its workspace
        at the stream's first GEMM, and it must not land in a graph's pool (GPU-NOTES pitfall 1). A forward that
        traces per shape (fx, --compile) needs one per shape. Other shapes capture straight away: their kernels
        are the same, and a Triton variant not compiled yet compiles at its launch under capture; their first run is
        the first replay after capture. Warming up every shape, the 35 default decode
        buckets took 3.88 s with a warm Triton cache, 2.66 s with one (H200); warmup_every_capture restores it.

        Nor are the other shapes' GEMMs run ahead. Alone, cuBLAS's first call at a new shape cost about 2 ms under
        capture and 14-16 us after one eager call, whose own cost was 0.13-0.3 ms (2 ms where it loaded a kernel).
        Recording the first pass's GEMMs (a TorchDispatchMode) and running each at every bucket size before the
        captures did not shorten the 35 default decode buckets' --fuse capture: in the warm-up, 1.58 and 1.69 s
        against 1.16 without (one call); in compile-ahead's pass, while its workers compiled, 2.79-3.61 s cold
        against 2.71-3.18, three processes each, alternated (H200, 2026-12-01, .diag/coldab.py). What did shorten
        it: the same first uses made in a thread while the model is built (gmtool.model.gemm_warmup), which the
        build covers, not the captures."""
        t0 = time.perf_counter()
        self.forward_impl.warmup(self, fn)  # with fx: the trace and split of this shape happen here
        entry.warmup_s += time.perf_counter() - t0
        if self.forward_impl.compiles:
            entry.compile_s = time.perf_counter() - t0
        entry.warmed_up = True

    def _capture_measured(self, entry: CapturedGraph, batch: Batch, fn) -> list:
        """Capture under _memory_of; returns the host plans the capture used (a whole graph bakes them in)."""
        ctx = entry.ctx
        ctx.planned_with.clear()  # what a warm-up planned is not the capture's
        # the upload (or, where the graphs cannot upload alone, a replay of the capture's own batch)
        held = getattr(self.memory, "physical_bytes", None)  # an optional strategy hook (VMM's)
        overlap = self._overlap
        upload = None if overlap is not None else (lambda: entry.upload(batch))
        t_in = time.perf_counter()
        with _memory_of(entry, self.device, upload=upload, held=held):
            t0 = time.perf_counter()
            self._record(entry, fn)
            # taken before the upload: its replay prepares the context again, which forgets the plan
            planned = list(ctx.planned_with)
            if overlap is None:
                self.backend.synchronize()
            entry.capture_s = time.perf_counter() - t0
        entry.measure_s = time.perf_counter() - t_in - entry.capture_s
        return planned

    def _record(self, entry: CapturedGraph, fn) -> None:
        """Run fn under capture into entry.steps; a failure leaves the backend usable and says why."""
        try:
            # the copy-in joins the graph: one launch instead of a copy, an event record and a launch
            self.backend.begin()
            self.inputs.copy_in(entry.key)
            self.forward_impl.record(self, entry, fn)
            entry.copies_inputs = True
        except BaseException as e:
            self.backend.abort()  # whatever ended it (Ctrl-C too): the stream or the tape must not stay capturing
            if isinstance(e, torch.OutOfMemoryError):
                raise OutOfMemory(f"out of memory while capturing bucket {entry.key}") from None
            # capture_end's OutOfMemory stays one (the sweep stops the mode on it); Ctrl-C stays what it is
            if isinstance(e, (CaptureError, OutOfMemory)) or not isinstance(e, Exception):
                raise
            # torch's RuntimeErrors, and what a model or a Triton compile raises under capture
            why = first_line(e, typed=type(e) is not RuntimeError)
            raise CaptureError(f"capture of bucket {entry.key} failed: {why}") from None

    def prepare(self, batch: Batch) -> CapturedGraph:
        """Copy-in and graph selection: everything the host does before a replay."""
        key = self.key_for(batch)
        entry = self.graphs.get(key)
        if entry is None:
            return self.capture(key, batch)  # it loads the batch, and leaves it loaded
        self.inputs.load(batch, key, copy=not entry.copies_inputs)
        return entry

    def served_by(self, batch: Batch) -> str:
        """What serves batch, as a record's served_by says (an AutoExecutor decides per batch)."""
        return self.mode.served_by

    def eager_same_shape(self, batch: Batch) -> torch.Tensor:
        """The graph's own computation run eagerly: the padded bucket, the same kernels, this batch's
        metadata. A replay that differs from it by more than rounding replayed something stale."""
        key = self.key_for(batch)
        views = self.inputs.load(batch, key)
        with forward_context(self._context(key, views, batch)), torch.no_grad():
            self.forward(views)
        return views.logits[: batch.num_seqs]

    def step(self, batch: Batch) -> torch.Tensor:
        entry = self.prepare(batch)
        entry.replay(batch, self.refresh_runner_metadata)
        return self.output(entry, batch)

    def output(self, entry, batch: Batch) -> torch.Tensor:
        """The logits rows step() hands out for batch after entry's replay: what the judge reads."""
        return self.inputs.output(entry.key, batch.num_seqs)

    def drop_graphs(self) -> None:
        """Forget every captured graph. An entry a caller still holds (a loop's last `entry`) loses its steps
        too: it must not keep its graphs, and through them their pool, alive past release (a VMM pool that
        outlives release leaves its ranges mapped, and the process cannot start another)."""
        for entry in self.graphs.values():
            entry.steps.clear()
            entry.loop = None  # it holds the steps too
        self.graphs.clear()

    def release(self) -> None:
        """Graphs first, then their pools (a pool must outlive every graph captured into it)."""
        self.drop_graphs()
        self.forward_impl.release()
        self.backend.release()
        if self.memory is not None:
            self.memory.release()
