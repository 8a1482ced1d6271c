"""hf-compiled: the same model through Hugging Face's own StaticCache and torch.compile(mode="reduce-overhead")
(which captures CUDA graphs itself), timed on gmtool's decode work: the peer a user would otherwise reach for.

Per decode bucket B: B sequences, every one at context L = max_kv_len // 2 (a static cache writes one position
per step for the whole batch, so gmtool's random per-sequence contexts cannot be used), in a static cache of
max_kv_len tokens (the span gmtool's decode attention reads). The static cache is filled with the very K/V
gmtool's paged cache holds for those sequences, so the peer's logits for the same tokens are compared with
gmtool's eager ones, and gmtool's eager step on that batch is the speedup's reference.

Compile, two ways (`--peer-compile`):
- shared (default): one torch.compile for the whole sweep, as a user serving several batch sizes gets it.
  Dynamo compiles the first bucket for its shape, recompiles once with the batch dimension symbolic at the
  second, and reuses that graph for the rest; reduce-overhead records one CUDA graph per batch size.
- per-bucket: dynamo reset before each bucket and shapes static: each bucket gets kernels specialized to its
  shape (the peer at its fastest) and pays the full compile (~40 s per bucket for qwen3-0.6b on an H200).

transformers moved between versions: the cache argument is `past_key_values` (5.17) or `cache` (5.24), and the
write position is either a `cache_position` argument or a counter kept in each cache layer. Both are read off
the forward signature and the cache layers.
"""

from __future__ import annotations

import copy
import gc
import inspect
import time
from enum import StrEnum

import torch

from gmtool.core.compositions import parse_composition
from gmtool.errors import GmtoolError
from gmtool.model.fused import unfused
from gmtool.modes import GraphMode
from gmtool.records import Record, Status
from gmtool.measure.timing import rel_err_per_seq, summarize, time_ms, tolerances_for
from gmtool.measure.trace import profile_steps, trace_path

COMPILE_CALLS = 3  # reduce-overhead compiles on the 1st call, records its CUDA graph on the 2nd, replays after


class PeerCompile(StrEnum):
    SHARED = "shared"  # once for the whole sweep, as users get it
    PER_BUCKET = "per-bucket"  # each bucket for its own shape: the peer's fastest kernels


PEER_COMPILES = tuple(PeerCompile)
NEEDS_CUDA = (
    "hf-compiled needs CUDA: torch.compile(mode='reduce-overhead') is measured by the CUDA graphs it "
    "captures; not run on the {device} backend"
)


def sdpa_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A second copy of the weights with a standard attention: gmtool's attention needs its paged cache."""
    m = copy.deepcopy(model)
    if hasattr(m, "set_attn_implementation"):
        m.set_attn_implementation("sdpa")
    else:
        m.config._attn_implementation = "sdpa"
    return m


class HFDecode:
    """One decode step of a batch through an HF StaticCache whose first L positions hold gmtool's K/V."""

    def __init__(self, model, paged, batch, context: int, max_len: int):
        from transformers import StaticCache

        dev, self.model, self.context = paged.device, model, context
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        positions = {"cache_position": torch.arange(context, device=dev)}
        tables = [torch.as_tensor(t, device=dev) for t in batch.block_tables]
        for layer in range(paged.spec.num_layers):
            # [B, Hkv, L, D], the layout HF caches keep; update() allocates the static tensors on first use
            k, v = (
                torch.stack([c[layer][t].flatten(0, 1)[:context].transpose(0, 1) for t in tables])
                for c in (paged.k, paged.v)
            )
            self.cache.update(k, v, layer, positions)
        self.counters = [
            lay.cumulative_length
            for lay in getattr(self.cache, "layers", [])
            if isinstance(getattr(lay, "cumulative_length", None), torch.Tensor)
        ]
        params = inspect.signature(model.forward).parameters
        self.kwargs = {("cache" if "cache" in params else "past_key_values"): self.cache, "use_cache": True}
        if "cache_position" in params:
            self.kwargs["cache_position"] = torch.tensor([context], device=dev)
        b = batch.num_seqs
        self.ids = torch.as_tensor(batch.input_ids, device=dev).view(b, 1)
        self.pos = torch.full((b, 1), context, dtype=torch.long, device=dev)

    def rewind(self) -> None:
        """Counter-style caches advance on every step: put the write position back at L, so every timed step
        does the same work and the cache never overflows."""
        for c in self.counters:
            c.fill_(self.context)

    def forward(self, ids, pos) -> torch.Tensor:
        return hf_step(self.model, ids, pos, self.kwargs)


def hf_step(model, ids, pos, kwargs) -> torch.Tensor:
    """What is compiled: a plain function of its inputs, so one compiled callable serves every bucket."""
    return model(input_ids=ids, position_ids=pos, **kwargs).logits[:, -1]


def _device_ms(step, rewind, iters: int, warmup: int, device) -> list[float]:
    """CUDA events around each step alone; the rewind before it stays outside the timed span."""
    for _ in range(warmup):
        rewind()
        step()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        rewind()
        s.record()
        step()
        e.record()
    torch.cuda.synchronize(device)
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def _host_us(step, rewind, iters: int, device) -> list[float]:
    out = []
    for _ in range(iters):
        rewind()
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        step()
        out.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize(device)
    return out


def _note(context: int, max_len: int, how: str) -> str:
    return (
        f"hf-compiled: HF StaticCache + torch.compile(mode='reduce-overhead'), {how} compile, sdpa attention, "
        "on its own copy "
        f"of the weights; every sequence at context {context} (max_kv_len/2) in a {max_len}-token static cache "
        "holding gmtool's K/V, compared with gmtool eager on the same tokens; compile_s is the first calls of "
        "a bucket (compile, if that bucket caused one, and graph recording); host_us is the compiled call alone (its inputs already on the device)"
    )


class HfCompiled:
    def __init__(self, bench, trace_dir=None, buckets: list[int] | None = None, compile_how: str = "shared"):
        """bench: the sweep's Workbench (its model and paged cache supply the weights, K/V and reference);
        buckets: the ones to compile and time (default: all of the sweep's); compile_how: shared|per-bucket."""
        if compile_how not in PEER_COMPILES:
            raise GmtoolError(f"unknown --peer-compile {compile_how!r}: use {' or '.join(PEER_COMPILES)}")
        self.compile_how, self._compiled = compile_how, None
        self.bench, self.cfg, self.lm, self.paged = bench, bench.cfg, bench.lm, bench.cache
        self.buckets = sorted(buckets or self.cfg.bucket_sizes)
        self.device, self.trace_dir, self.trace_files = bench.device, trace_dir, []
        self.context = self.cfg.max_kv_len // 2
        # other kernels than gmtool's: the tolerance for eager on another shape, not the same-kernel one
        self.tol = tolerances_for(self.cfg.torch_dtype)[1]

    def row(self, bucket: int, status: Status, **kw) -> Record:
        return Record(
            mode=GraphMode.HF_COMPILED,
            bucket=bucket,
            composition=f"1*{bucket}@{self.context}",
            num_tokens=bucket,
            num_seqs=bucket,
            status=status,
            served_by=GraphMode.HF_COMPILED.served_by,
            impl=f"hf-static-sdpa ({self.compile_how} compile)",
            tolerance=self.tol,
            notes=_note(self.context, self.cfg.max_kv_len, self.compile_how),
            **kw,
        )

    @property
    def runnable(self) -> bool:
        return self.device.type == "cuda" and self.cfg.scenario == "decode"

    def run(self, progress=None, add=None) -> list[Record]:
        """One row per bucket; without CUDA or outside decode, rows that say why instead of measurements.
        add(row): told of each row the moment it is measured (the journal)."""
        rows = []
        for row in self._rows(progress):
            rows.append(row)
            if add:
                add(row)
        return rows

    def _rows(self, progress):
        cfg, buckets = self.cfg, self.buckets
        if self.device.type != "cuda":
            yield from (self.row(b, Status.ERROR, error=NEEDS_CUDA.format(device=self.device.type)) for b in buckets)
            return
        if cfg.scenario != "decode":
            why = f"hf-compiled times decode steps only; this sweep's scenario is {cfg.scenario}"
            yield from (self.row(b, Status.SKIPPED, error=why) for b in buckets)
            return
        if self.context < 1:
            yield from (
                self.row(b, Status.ERROR, error="hf-compiled needs --max-kv-len of at least 2") for b in buckets
            )
            return
        try:
            with unfused(self.lm.fused):  # the peer runs the Hugging Face layers as users have them
                model = sdpa_copy(self.lm.model)
        except torch.OutOfMemoryError:
            yield from (
                self.row(b, Status.OOM, error="hf-compiled: no memory for its copy of the weights") for b in buckets
            )
            return
        if progress:
            progress.start(len(buckets))
        dead = None
        try:
            for b in buckets:
                if dead:
                    yield self.row(b, Status.SKIPPED, error=dead)
                else:
                    row = self._guarded(model, b, trace=(b == buckets[-1]))
                    if row.status == Status.OOM:
                        dead = f"skipped after out of memory at bucket {b}"
                    yield row
                if progress:
                    progress.advance(f"bucket {b}")
        finally:
            del model
            self._compiled = None
            torch._dynamo.reset()
            gc.collect()
            torch.cuda.empty_cache()

    def _guarded(self, model, bucket: int, trace: bool) -> Record:
        try:
            return self._bucket(model, bucket, trace)
        except torch.OutOfMemoryError:
            return self.row(bucket, Status.OOM, error=f"hf-compiled: out of memory at bucket {bucket}")
        except GmtoolError as e:
            return self.row(bucket, Status.ERROR, error=str(e))
        except Exception as e:  # torch.compile fails in many exception types: record it, go on with the next bucket
            first = (str(e).strip().splitlines() or [""])[0][:300]
            return self.row(bucket, Status.ERROR, error=f"hf-compiled failed: {type(e).__name__}: {first}")
        finally:
            if self.compile_how == "per-bucket":
                torch._dynamo.reset()  # each bucket compiles afresh: compile_s is what that bucket costs

    def _compiler(self):
        if self.compile_how == "per-bucket":
            return torch.compile(hf_step, mode="reduce-overhead", dynamic=False)
        if self._compiled is None:  # dynamo's default: static first, then one graph with the batch symbolic
            # one CUDA graph per batch size is the point here, not a mistake to warn about
            import torch._inductor.config as inductor_config

            if hasattr(inductor_config.triton, "cudagraph_dynamic_shape_warn_limit"):
                inductor_config.triton.cudagraph_dynamic_shape_warn_limit = None
            self._compiled = torch.compile(hf_step, mode="reduce-overhead")
        return self._compiled

    def _bucket(self, model, bucket: int, trace: bool) -> Record:
        cfg, dev = self.cfg, self.device
        batch = self.bench.batch(parse_composition(f"1*{bucket}@{self.context}"))
        hf = HFDecode(model, self.paged, batch, self.context, cfg.max_kv_len)
        eager, logits = self.bench.eager_fn(batch)
        eager()
        ref = logits.clone()
        eager_ms = summarize(time_ms(eager, cfg.num_iters, cfg.num_iters_warmup, dev))

        compiled = self._compiler()

        def step():
            torch.compiler.cudagraph_mark_step_begin()
            return compiled(model, hf.ids, hf.pos, hf.kwargs)

        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        with torch.no_grad():
            for _ in range(COMPILE_CALLS):
                hf.rewind()
                step()
            torch.cuda.synchronize(dev)
            compile_s = time.perf_counter() - t0
            hf.rewind()
            err = rel_err_per_seq(step().clone(), ref)
            if not err <= self.tol:  # NaN fails too
                return self.row(
                    bucket,
                    Status.UNSAFE,
                    max_rel_err=err,
                    compile_s=compile_s,
                    error=f"differs from gmtool eager: max relative error {err:.3g} (tolerance {self.tol:g})",
                )
            lat = summarize(_device_ms(step, hf.rewind, cfg.num_iters, cfg.num_iters_warmup, dev))
            host = summarize(_host_us(step, hf.rewind, max(5, cfg.num_iters // 2), dev))
            if trace and self.trace_dir is not None:
                self.trace_files.append(
                    profile_steps(
                        step,
                        trace_path(self.trace_dir, GraphMode.HF_COMPILED),
                        f"{GraphMode.HF_COMPILED} bucket {bucket}",
                        dev,
                        before=hf.rewind,
                    )
                )
        return self.row(
            bucket,
            Status.OK,
            max_rel_err=err,
            compile_s=compile_s,
            latency_ms=lat,
            eager_latency_ms=eager_ms.median,
            host_us=host,
            speedup=eager_ms.median / lat.median if lat.median > 0 else None,
        )
