"""One sweep: every mode over every bucket and composition in one process, each replay checked against eager.

Buckets are taken largest first (graphs of a pool then reuse the largest capture's memory; a memory strategy
with order "ascending" reverses it). For every composition, eager runs the exact batch (no padding) as the
reference; each graph mode replays the padded bucket and is judged against it (gmtool.measure.check). Probes run once
every row is measured, while every graph is still alive: tracing, memreport's shuffled replays and metering.
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from gmtool.measure.check import checked_replay, dispatch_fault
from gmtool.measure.fused_check import judge_fused
from gmtool.config import SweepConfig
from gmtool.errors import CaptureError, GmtoolError, OutOfMemory
from gmtool.core.auto import parts_of
from gmtool.core.batch import sibling_of
from gmtool.core.executor import GraphExecutor
from gmtool.modes import GraphMode
from gmtool.memory.ledger import capture_ledger
from gmtool.parallel.comm import agree
from gmtool.records import Document, Record, Status
from gmtool.measure.timing import host_us, host_us_steady, summarize, time_ms, tolerances_for
from gmtool.measure.workbench import Workbench, decoy_note


@dataclass
class SweepResult:
    config: dict
    machine: dict
    model: dict
    records: list[Record] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    on_record: Callable[[SweepResult, Record], None] | None = None  # told of each row as it is measured

    def add(self, rec: Record) -> None:
        self.records.append(rec)
        if self.on_record:
            self.on_record(self, rec)

    def document(self, command: str) -> Document:
        return Document(
            command=command,
            wall_s=self.wall_s,
            machine=self.machine,
            model=self.model,
            config=self.config,
            notes=self.notes,
            errors=self.errors,
            records=self.records,
        )


def capture_cost_note(mode: GraphMode, ex: GraphExecutor) -> str | None:
    """What an executor's captures cost in time, split as `bench --stages capture` splits it: the captures
    themselves (their rows' capture_s), the eager warm-ups before them, and the Triton kernels compiled ahead of
    the first (gmtool.kernels.compile_ahead), or why they were not. None before any capture."""
    parts = parts_of(ex)  # auto: its full and piecewise parts, each with its own graphs (and maybe its own pass)
    entries = [e for p in parts for e in p.graphs.values()]
    if not entries:
        return None
    capture, warm = sum(e.capture_s for e in entries), sum(e.warmup_s for e in entries)
    traced = sum(e.compile_s or 0.0 for e in entries)  # fx, --compile: each shape's warm-up traces it
    graphs = f"{len(entries)} graph{'s' if len(entries) != 1 else ''}"
    note = f"capture cost, {mode.value}: {graphs} captured in {capture:.2f} s, {max(0.0, warm - traced):.2f} s of eager warm-up"
    if traced:
        note += f", {traced:.2f} s tracing (and compiling) the shapes (each row's compile_s)"
    ahead = [p.compile_ahead_s for p in parts if p.compile_ahead_s is not None]
    why = next((p.compile_ahead_note for p in parts if p.compile_ahead_note), None)
    if ahead:
        note += f"; Triton kernels compiled ahead of the first in {sum(ahead):.2f} s" + (f" ({why})" if why else "")
    elif ex.device.type == "cuda" and why:
        note += f"; compile-ahead {why}"
    if (early := ex.lm.early_compile) is not None:
        note += f"; {early.summary()}"
    return note


def planned_rows(cfg: SweepConfig) -> int:
    """The rows a sweep of cfg writes when nothing stops it: one per mode and composition."""
    return len(cfg.modes) * sum(len(cs) for cs in cfg.compositions_by_bucket.values())


class Probe(Protocol):
    def after_sweep(self, bench: Workbench, executors: dict[GraphMode, GraphExecutor], res: SweepResult) -> None:
        """Runs once every row is measured, before the executors are released."""


def machine_info(device: torch.device) -> dict:
    import transformers

    info = {
        "device": device.type,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "backend": "cpu-tape",
        "gpu": None,
        "driver": None,
        "cuda": None,
    }
    if device.type == "cuda":
        info.update(backend="cuda", gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda)
        try:
            import pynvml

            pynvml.nvmlInit()
            info["driver"] = pynvml.nvmlSystemGetDriverVersion()
        except Exception:  # NVML is optional: the report just lacks the driver version
            pass
    return info


class Sweep:
    def __init__(
        self, cfg: SweepConfig, progress=None, memory_factory=None, probes: tuple[Probe, ...] = (), on_record=None
    ):
        """memory_factory(mode) -> a MemoryStrategy for that mode's executor (None: one shared pool);
        on_record(result, record): told of each row the moment it is measured (the journal)."""
        self.cfg, self.progress, self.memory_factory, self.probes = cfg, progress, memory_factory, probes
        self.on_record = on_record
        self.device = cfg.torch_device
        self.bench: Workbench | None = None
        self.captured_from_batch: list[str] = []  # keys no sibling could be placed for (_capture_from_sibling)
        self.result: SweepResult | None = None  # set once the workbench is built: what a stopped run measured

    def run(self, bench: Workbench | None = None) -> SweepResult:
        cfg, t_start = self.cfg, time.perf_counter()
        self.bench = bench = bench or Workbench.build(cfg)
        skipped = bench.decoys_skipped  # a shared workbench counts over its runs
        if cfg.graph_modes and (why := bench.capture_refusal()):
            raise CaptureError(why)  # instead of the capture error each bucket would meet
        self.result = res = SweepResult(
            cfg.to_dict(),
            machine_info(self.device),
            bench.model_info(),
            notes=list(cfg.notes) + bench.lm.notes + ([bench.lm.fused.summary] if bench.lm.fused else []),
            on_record=self.on_record,
        )
        executors = {
            m: bench.executor(m, self.memory_factory(m) if self.memory_factory else None) for m in cfg.graph_modes
        }
        try:
            self._measure(bench, executors, res)
            for probe in self.probes:
                probe.after_sweep(bench, executors, res)
            judge_fused(bench, self.cfg, res.notes, res.errors)
            res.notes += [note for m, ex in executors.items() if (note := capture_cost_note(m, ex))]
            if bench.decoys_skipped > skipped:
                res.notes.append(decoy_note(bench.decoys_skipped - skipped))
            if self.captured_from_batch:
                n, more = len(self.captured_from_batch), len(self.captured_from_batch) - 4
                res.notes.append(
                    (
                        f"{n} graph keys were captured from the first batch they check, not a sibling (their "
                        if n > 1
                        else "1 graph key was captured from the first batch it checks, not a sibling (its "
                    )
                    + f"captured_with is that mix): {'; '.join(self.captured_from_batch[:4])}"
                    + (f"; and {more} more" if more > 0 else "")
                )
        except BaseException:
            res.wall_s = time.perf_counter() - t_start  # a partial run's document says how long it ran too
            _release(executors, quiet=True)  # the failure that got us here is what gets reported
            raise
        _release(executors)
        res.wall_s = time.perf_counter() - t_start
        return res

    def _measure(self, bench: Workbench, executors: dict, res: SweepResult) -> None:
        cfg = self.cfg
        tol_same, tol = tolerances_for(cfg.torch_dtype)
        dead: dict[str, str] = {}  # mode -> why its remaining buckets are skipped
        if self.progress:  # in rows, as results.json and a Ctrl-C count them: a composition makes one a mode
            self.progress.start(planned_rows(cfg))
        # a memory strategy may ask for smallest first (to show what the largest-first order saves)
        ascending = any(getattr(ex.memory, "order", None) == "ascending" for ex in executors.values())
        for bucket in sorted(cfg.compositions_by_bucket, reverse=not ascending):
            for comp in cfg.compositions_by_bucket[bucket]:
                base = {
                    "bucket": bucket,
                    "composition": comp.label,
                    "num_tokens": comp.num_tokens,
                    "num_seqs": comp.num_seqs,
                    "tolerance": tol,
                    "tolerance_same_shape": tol_same,
                }
                try:
                    batch = bench.batch(comp)
                    ref, eager_fn = bench.reference(batch)
                    decoy = bench.decoy(batch)
                except GmtoolError as e:
                    res.errors.append(str(e))
                    res.add(Record(**base, mode=GraphMode.EAGER, status=Status.ERROR, error=str(e)))
                    self._advance(f"bucket {bucket}: {comp.label} (error)")
                    continue
                eager_med = None
                if GraphMode.EAGER in cfg.modes:
                    eager_ms = summarize(time_ms(eager_fn, cfg.num_iters, cfg.num_iters_warmup, self.device))
                    eager_med = eager_ms.median
                    res.add(
                        Record(
                            **base,
                            mode=GraphMode.EAGER,
                            served_by=GraphMode.EAGER.served_by,
                            status=Status.OK,
                            max_rel_err=0.0,
                            max_rel_err_same_shape=0.0,
                            latency_ms=eager_ms,
                            eager_latency_ms=eager_med,
                            speedup=1.0,
                        )
                    )
                for mode, ex in executors.items():
                    if mode in dead:
                        res.add(Record(**base, mode=mode, status=Status.SKIPPED, error=dead[mode]))
                        continue
                    if bucket in cfg.eager_sizes and mode != GraphMode.AUTO:
                        why = f"above the largest bucket ({ex.policy.largest}): no {mode} graph (auto runs it eagerly)"
                        res.add(Record(**base, mode=mode, status=Status.SKIPPED, error=why))
                        continue
                    rec = self._graph_run(ex, mode, batch, (ref, decoy), eager_med, (tol_same, tol), base)
                    res.add(rec)
                    if rec.status == Status.UNSAFE:
                        ref = self._after_unsafe(bench, ex, batch, ref)
                    if rec.status == Status.OOM:
                        dead[mode] = f"skipped after out of memory at bucket {bucket}"
                        res.errors.append(rec.error)
                self._advance(f"bucket {bucket}: {comp.label}")

    @staticmethod
    def _after_unsafe(bench: Workbench, ex, batch, ref):
        """What an unsafe replay wrote must not fail what follows: the cache scrubbed of NaN (later mixes' contexts
        read it), then the mix's eager reference once more, over the context the replay may have overwritten,
        which the next mode's replay reads."""
        ex.cache.scrub()
        try:
            return bench.reference(batch)[0]
        except GmtoolError:
            return ref

    def _advance(self, label: str) -> None:
        if self.progress:
            self.progress.advance(label, len(self.cfg.modes))

    def _graph_run(self, ex: GraphExecutor, mode, batch, eager: tuple, eager_med, tols, base) -> Record:
        """eager: the batch's EagerReference and the decoy run just before its checked replay (Workbench.decoy)."""
        cfg = self.cfg
        tol_same, tol = tols
        ref, decoy = eager
        key = ex.key_for(batch)
        fresh = key not in ex.graphs
        try:
            if fresh:
                self._capture_from_sibling(ex, key, batch)
            entry, check, _ = checked_replay(ex, batch, ref, decoy)
        except (OutOfMemory, torch.OutOfMemoryError) as e:  # torch's: outside the capture (warm-up, say)
            ex.backend.abort()
            error = str(e) if isinstance(e, OutOfMemory) else f"out of memory at bucket {key}: {str(e).splitlines()[0]}"
            if ex.memory is not None and (detail := ex.memory.failure_detail()):
                error += f" ({detail})"
            return Record(**base, mode=mode, status=Status.OOM, key=str(key), error=error)
        except GmtoolError as e:
            return Record(**base, mode=mode, status=Status.ERROR, key=str(key), error=str(e))
        graphed = entry.mode != GraphMode.EAGER  # auto's eager step above the largest bucket: nothing captured
        fresh = fresh and graphed
        rec = Record(
            **base,
            mode=mode,
            status=Status.OK,
            key=str(entry.key),
            impl=entry.impl,
            max_rel_err=check.max_rel_err,
            max_rel_err_same_shape=check.max_rel_err_same_shape,
            kv_rel_err=check.kv_rel_err,
            kv_rel_err_same_shape=check.kv_rel_err_same_shape,
            capture_s=entry.capture_s if fresh else None,
            compile_s=entry.compile_s if fresh else None,
            graph_mem_bytes=entry.graph_mem_bytes if fresh else None,
            pool_growth_bytes=entry.pool_growth_bytes if fresh else None,
            outside_pool_bytes=entry.outside_pool_bytes if fresh else None,
            pieces=entry.pieces if graphed else None,
            runners=entry.runners if graphed else None,
            stale_metadata=check.stale_metadata,
            piecewise_impl=entry.piecewise_impl,
            captured_with=entry.captured_with if graphed else None,
            served_by=entry.mode.served_by,
            **(capture_ledger(ex, entry) if fresh else {}),
        )
        # the mix's eager figure, whatever the replay: a bucket's eager ms is the median over all its mixes
        rec.eager_latency_ms = eager_med
        # under --tp, every rank's verdict (its own K/V differ)
        why = agree(check.failure(tol_same, tol) or dispatch_fault(ex, batch, entry))
        if why:
            rec.status, rec.error = Status.UNSAFE, why
            return rec  # an unsafe replay gets no latency and no speedup
        lat = summarize(time_ms(lambda: entry.replay(batch), cfg.num_iters, cfg.num_iters_warmup, self.device))
        rec.latency_ms = lat
        rec.speedup = (eager_med / lat.median) if eager_med and lat.median > 0 else None
        n = max(5, cfg.num_iters // 2)
        rec.host_us = summarize(host_us(lambda: ex.step(batch), n, self.device))  # copy-in + dispatch
        rec.host_copy_us = summarize(host_us(lambda: ex.prepare(batch), n, self.device))  # copy-in alone
        # the same step issued while the device still runs the previous one: the host's own cost
        rec.host_steady_us = summarize(host_us_steady(lambda: ex.step(batch), ex.inputs.copied_in, n))
        ex.backend.synchronize()
        return rec

    def _capture_from_sibling(self, ex, key, batch) -> None:
        """Capture key from another mix of it (gmtool.core.batch.sibling_of), its new tokens in blocks other
        than batch's (its capture writes K/V there, not into the context batch's check reads). Not for full-narrow,
        whose graphs freeze their capture's plan by design (its first row per key shows the graph's speed), nor
        above the largest bucket (no graph). Where none can be placed, the key is captured from batch itself, and
        the run's notes say so."""
        if ex.mode.expected_unsafe or batch.num_tokens > ex.policy.largest:
            return
        held = batch.blocks
        why = f"no other batch of {key} fits the KV cache beside it"
        for fewer in (True, False):  # one sequence (or token) fewer where the key still takes it, else as many
            try:
                sibling = self.bench.batch(sibling_of(batch, fewer), keep=held)
            except GmtoolError as e:  # no room for its new tokens beside batch's blocks
                why = str(e).split(":")[0]
                continue
            if ex.key_for(sibling) == key:
                ex.prepare(sibling)
                return
        self.captured_from_batch.append(f"{ex.mode} {key} ({why})")


def _release(executors: dict, quiet: bool = False) -> None:
    """Graphs before their pools; quiet: best effort, after a failure."""
    for ex in executors.values():
        try:
            ex.release()
        except Exception:
            if not quiet:
                raise
