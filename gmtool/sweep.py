"""One sweep: every mode over every bucket and composition in one process, each replay checked against eager.

Buckets are taken largest first (graphs of a pool then reuse the largest capture's memory; a memory strategy
with order "ascending" reverses it). For every composition, eager runs the exact batch (no padding) as the
reference; each graph mode replays the padded bucket and is compared with it.
"""
from __future__ import annotations

import platform
import time
from dataclasses import dataclass, field

import torch

from gmtool.batch import Batch, make_batch
from gmtool.check import EagerReference, checked_replay, eager_reference
from gmtool.config import SweepConfig
from gmtool.errors import GmtoolError, OutOfMemory
from gmtool.executor import GraphExecutor
from gmtool.inputs import PersistentInputs
from gmtool.kv_cache import KVCacheSpec, PagedKVCache
from gmtool.model import LoadedModel, load_model
from gmtool.modes import GraphMode
from gmtool.records import Status, record
from gmtool.timing import (
    host_us,
    host_us_steady,
    summarize,
    time_ms,
    tolerances_for,
)



@dataclass
class SweepResult:
    config: dict
    machine: dict
    model: dict
    records: list[dict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    wall_s: float = 0.0


def machine_info(device: torch.device) -> dict:
    import transformers

    info = {"device": device.type, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "host": platform.node(), "backend": "cpu-tape",
            "gpu": None, "driver": None, "cuda": None}
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
    def __init__(self, cfg: SweepConfig, progress=None, memory_factory=None):
        """memory_factory(mode) -> a MemoryStrategy for that mode's executor (None: one shared pool)."""
        self.cfg, self.progress, self.memory_factory = cfg, progress, memory_factory
        self.device = cfg.torch_device

    # -- setup ---------------------------------------------------------------------------------------
    def _build(self) -> tuple[LoadedModel, PagedKVCache]:
        cfg = self.cfg
        lm = load_model(cfg.model, self.device, cfg.torch_dtype, cfg.seed)
        if lm.sliding_window is not None and cfg.max_kv_len > lm.sliding_window:
            # gmtool's attention reads the whole context: past the window, eager and graphs would agree on
            # something the model does not compute
            raise GmtoolError(f"{lm.name} has sliding-window attention ({lm.sliding_window} tokens), which gmtool "
                              f"does not implement: use --max-kv-len {lm.sliding_window} or less")
        if cfg.fuse:
            from gmtool.fused import fuse_layers

            lm.fused = fuse_layers(lm.model, cfg.kernels)
        spec = KVCacheSpec(lm.num_layers, lm.num_kv_heads, lm.head_dim, cfg.block_size, cfg.max_kv_len,
                           cfg.torch_dtype)
        worst = max(c.num_seqs for cs in cfg.plan.values() for c in cs) * spec.blocks_per_seq
        if cfg.kv_cache_gb is not None:
            budget = int(cfg.kv_cache_gb * 2**30)
        elif self.device.type == "cuda":
            budget = int(torch.cuda.mem_get_info(self.device)[0] * 0.4)
        else:
            budget = 1 << 40
        cache = PagedKVCache.from_budget(spec, budget, worst, self.device)
        cache.fill_random(cfg.seed)
        return lm, cache

    # -- the sweep -----------------------------------------------------------------------------------
    def run(self) -> SweepResult:
        cfg, t_start = self.cfg, time.perf_counter()
        lm, cache = self._build()
        self.lm, self.cache = lm, cache
        res = SweepResult(cfg.to_dict(), machine_info(self.device),
                          {"name": lm.name, "source": lm.source, "params": lm.num_params,
                           "layers": lm.num_layers, "heads": lm.num_heads, "kv_heads": lm.num_kv_heads,
                           "head_dim": lm.head_dim, "vocab": lm.vocab_size,
                           "kv_cache_blocks": cache.num_blocks, "kv_cache_bytes": cache.nbytes},
                          notes=list(cfg.notes) + ([lm.fused.summary] if lm.fused else []))
        executors = {m: self._executor(m, lm, cache) for m in cfg.graph_modes}
        eager_inputs = PersistentInputs(max(cfg.bucket_sizes), cfg.max_num_seqs, cache.spec.blocks_per_seq,
                                        lm.vocab_size, lm.model.dtype, self.device)
        tol_same, tol = tolerances_for(cfg.torch_dtype)
        dead: dict[str, str] = {}  # mode -> why its remaining buckets are skipped
        total = sum(len(cs) for cs in cfg.plan.values())
        if self.progress:
            self.progress.start(total)
        # a memory strategy may ask for smallest first (to show what the largest-first order saves)
        ascending = any(getattr(ex.memory, "order", None) == "ascending" for ex in executors.values())
        for bucket in sorted(cfg.plan, reverse=not ascending):
            for comp in cfg.plan[bucket]:
                base = {"bucket": bucket, "composition": comp.label, "num_tokens": comp.num_tokens,
                        "num_seqs": comp.num_seqs, "tolerance": tol, "tolerance_same_shape": tol_same}
                try:
                    batch = make_batch(comp, cache, lm.vocab_size, cfg.max_num_seqs)
                    ref, eager_ms = self._eager(lm, cache, eager_inputs, batch, GraphMode.EAGER in cfg.modes)
                except GmtoolError as e:
                    res.errors.append(str(e))
                    res.records.append(record(base, GraphMode.EAGER, Status.ERROR, error=str(e)))
                    if self.progress:
                        self.progress.advance(f"{bucket}: {comp.label} (error)")
                    continue
                eager_med = eager_ms["median"] if eager_ms else None
                if GraphMode.EAGER in cfg.modes:
                    res.records.append(record(base, GraphMode.EAGER, Status.OK, max_rel_err=0.0, max_rel_err_same_shape=0.0, latency_ms=eager_ms,
                                               eager_latency_ms=eager_med, speedup=1.0))
                for mode, ex in executors.items():
                    if mode in dead:
                        res.records.append(record(base, mode, Status.SKIPPED, error=dead[mode]))
                        continue
                    rec = self._graph_run(ex, mode, batch, ref, eager_med, (tol_same, tol), base)
                    res.records.append(rec)
                    if rec["status"] == Status.OOM:
                        dead[mode] = f"skipped after out of memory at bucket {bucket}"
                        res.errors.append(rec["error"])
                if self.progress:
                    self.progress.advance(f"bucket {bucket}: {comp.label}")
        self.after_sweep(res, executors, eager_inputs, tol)
        for ex in executors.values():
            ex.release()
        res.wall_s = time.perf_counter() - t_start
        return res

    def after_sweep(self, res: SweepResult, executors: dict, eager_inputs: PersistentInputs, tol: float) -> None:
        """Runs while every graph is still alive, before the executors are released (memreport uses it)."""

    def _executor(self, mode: str, lm, cache) -> GraphExecutor:
        cfg = self.cfg
        policy = cfg.policy(wide_key=mode.wide_key)
        ex = GraphExecutor(lm, cache, policy, mode, cfg.max_num_seqs, self.device,
                           self.memory_factory(mode) if self.memory_factory else None, cfg.kernels)
        from gmtool.fx_split import enable_compiled_full, enable_fx_piecewise

        if mode.piecewise and (cfg.piecewise_impl == "fx" or cfg.compile):
            enable_fx_piecewise(ex, inductor=cfg.compile)  # --compile goes through the FX split
        elif not mode.piecewise and cfg.compile:
            enable_compiled_full(ex)
        return ex

    def _eager(self, lm, cache, inputs: PersistentInputs, batch: Batch, timed: bool):
        from gmtool.trace import eager_fn

        fn, logits = eager_fn(lm, cache, inputs, batch, self.cfg.kernels)
        ref = eager_reference(fn, logits, cache, batch)
        ms = summarize(time_ms(fn, self.cfg.num_iters, self.cfg.num_iters_warmup, self.device)) if timed else None
        return ref, ms

    def _graph_run(self, ex: GraphExecutor, mode, batch, ref: EagerReference, eager_med, tols, base) -> dict:
        cfg = self.cfg
        tol_same, tol = tols
        key = ex.key_for(batch)
        fresh = key not in ex.graphs
        try:
            entry, check, _ = checked_replay(ex, batch, ref)
        except OutOfMemory as e:
            ex.backend.abort()
            return record(base, mode, Status.OOM, key=str(key), error=str(e))
        except GmtoolError as e:
            return record(base, mode, Status.ERROR, key=str(key), error=str(e))
        rec = record(base, mode, Status.OK, key=str(entry.key), impl=entry.impl, max_rel_err=check.max_rel_err,
                      max_rel_err_same_shape=check.max_rel_err_same_shape, kv_rel_err=check.kv_rel_err,
                      kv_rel_err_same_shape=check.kv_rel_err_same_shape,
                      capture_s=entry.capture_s if fresh else None,
                      compile_s=entry.compile_s if fresh else None,
                      graph_mem_bytes=entry.graph_mem_bytes if fresh else None,
                      pool_growth_bytes=entry.pool_growth_bytes if fresh else None,
                      pieces=entry.pieces, runners=entry.runners, stale_metadata=check.stale_metadata,
                      piecewise_impl=entry.piecewise_impl if mode.piecewise else None,
                      captured_with=entry.captured_with)
        why = check.failure(tol_same, tol)
        if why:
            rec.update(status=Status.UNSAFE, error=why)
            return rec  # an unsafe replay gets no latency and no speedup
        lat = summarize(time_ms(lambda: entry.replay(batch), cfg.num_iters, cfg.num_iters_warmup, self.device))
        rec["latency_ms"] = lat
        rec["eager_latency_ms"] = eager_med
        rec["speedup"] = (eager_med / lat["median"]) if eager_med and lat["median"] > 0 else None
        n = max(5, cfg.num_iters // 2)
        rec["host_us"] = summarize(host_us(lambda: ex.step(batch), n, self.device))  # copy-in + dispatch
        rec["host_copy_us"] = summarize(host_us(lambda: ex.prepare(batch), n, self.device))  # copy-in alone
        # the same step issued while the device still runs the previous one: the host's own cost
        rec["host_steady_us"] = summarize(host_us_steady(lambda: ex.step(batch), ex.inputs.copied_in, n))
        ex.backend.synchronize()
        return rec
