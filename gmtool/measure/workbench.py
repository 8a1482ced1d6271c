"""The workbench: what one run measures on, built once from its config.

The model (fused when asked), its paged KV cache filled with random prefixes, the input buffers of the eager
reference, and a factory for graph executors. The sweep, memreport, the hf-compiled peer, the benchmark and
the tests all build through it.
"""

from __future__ import annotations

import dataclasses
import gc
import os
from dataclasses import dataclass

import torch

from gmtool.model.attention import ForwardContext, forward_context
from gmtool.core.batch import Batch, make_batch, sibling_of
from gmtool.core.buckets import BucketKey
from gmtool.measure.check import EagerReference, eager_reference
from gmtool.core.compositions import Composition, parse_composition
from gmtool.config import SweepConfig
from gmtool.errors import GmtoolError, OutOfMemory
from gmtool.core.executor import GraphExecutor
from gmtool.core.inputs import PersistentInputs
from gmtool.core.kv_cache import KVCacheSpec, PagedKVCache
from gmtool.kernels import early_compile
from gmtool.model import families, probe
from gmtool.model.loading import LoadedModel, load_model
from gmtool.modes import GraphMode


CPU_THREADS_ENV = "GMTOOL_CPU_THREADS"
CPU_THREADS_MAX = 4  # more threads than this only fight each other (and other processes) on a shared CPU
CPU_THREADS_LIMIT = 1024  # what GMTOOL_CPU_THREADS may ask for (torch takes a C int; '²' is a digit to Python)


def cpu_threads(ranks: int = 1) -> int:
    """Torch threads on the CPU backend: GMTOOL_CPU_THREADS, else min(usable cores, 4) shared by the --tp ranks
    (ranks that ask for more threads than there are cores spin against each other at every collective: a
    --tp 2 compare on 2 cores took 42 s idle, 200 s beside other work, against 14 s with a thread a rank)."""
    env = os.environ.get(CPU_THREADS_ENV, "").strip()
    if env:
        if not (env.isascii() and env.isdigit()) or not 1 <= int(env) <= CPU_THREADS_LIMIT:
            raise GmtoolError(f"{CPU_THREADS_ENV}={env!r}: give a number of threads from 1 to {CPU_THREADS_LIMIT}")
        return int(env)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, CPU_THREADS_MAX) // max(1, ranks))


def _tp_rank(cfg: SweepConfig) -> int:
    """This process's rank; a config with --tp N is built only inside a group of N (gmtool.parallel.launch)."""
    from gmtool.parallel.comm import place

    if cfg.tp != place().world:
        raise GmtoolError(
            f"--tp {cfg.tp} in a process group of {place().world}: start it with gmtool.parallel.launch.run"
        )
    return place().rank


def _pdl_mode(cfg: SweepConfig, notes: list[str]) -> int:
    """--pdl as a gmtool.kernels.pdl.Pdl mode, EARLY (the element-wise kernels let the next kernel launch before
    their wait, so a GEMM prefetches its weight two kernels ahead): where PDL cannot run (no CUDA, the Triton
    interpreter, before Hopper, an old Triton) the fused kernels launch plainly and the run's notes say why."""
    if not cfg.pdl:
        return 0
    if cfg.attention_backend != "triton":
        notes.append("--pdl: off, the fused layers run torch ops here (no Triton kernels to launch with PDL)")
        return 0
    from gmtool.kernels import pdl

    why = pdl.problem(cfg.torch_device)
    if why:
        notes.append(f"--pdl: off, {why}")
        return 0
    return int(pdl.Pdl.EARLY)


def build_need(cfg: SweepConfig) -> tuple:
    """What Workbench.build makes of a config: every option but the bucket list, and what the buckets decide
    there (the KV cache's size from the most sequences of a batch, the eager buffers' from the most tokens).
    Configs of one need get the same model, cache and buffers: memreport's sampled buckets and the whole list."""
    opts = tuple((f.name, getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if f.init and f.name != "buckets")
    return opts + (("most_seqs", cfg.most_seqs), ("max_tokens", cfg.policy().max_tokens))


def decoy_note(skipped: int) -> str:
    """What a run's notes say of the checks that ran without a decoy (Workbench.decoy)."""
    return (
        f"{skipped} checked replay{'s' if skipped != 1 else ''} ran without an eager step of another batch just "
        "before (no free KV block beside the batch): a graph reading state only eager passes refresh could pass "
        "there (a larger --kv-cache-gb leaves room)"
    )


def _positions_past_the_model(lm: LoadedModel, max_kv_len: int) -> None:
    """A learned position table shorter than --max-kv-len: the eager reference would index past it (a traceback
    deep in the model), and no graph could be checked. A rotary model's max_position_embeddings below it: the
    run goes on (graphs and eager agree there), and says the model was not made for such contexts."""
    table = families.learned_positions(lm.model)
    if table is not None and table[1] < max_kv_len:
        name, held = table
        raise GmtoolError(
            f"{lm.name}: its learned position embeddings ({name}) hold {held} positions, and --max-kv-len "
            f"{max_kv_len} reaches past them: give --max-kv-len {held} or less"
        )
    held = getattr(families.text_config(lm.config), "max_position_embeddings", None)
    if isinstance(held, int) and 0 < held < max_kv_len:
        lm.notes.append(
            f"--max-kv-len {max_kv_len} is past the model's max_position_embeddings ({held}): contexts it was "
            "not made for (engines refuse them)"
        )


def _shard_and_fuse(cfg: SweepConfig, lm: LoadedModel) -> int:
    """Workbench.build's steps between the load and the KV cache: the --tp split, --fuse; the rank."""
    rank = _tp_rank(cfg)
    if cfg.tp > 1:  # before fusing: the fused QKV and gate/up weights are made of the rank's shards
        from gmtool.parallel.shard import shard_model

        if any(o.sinks is not None for o in lm.layout.layers):  # [heads] parameters the split leaves whole
            raise GmtoolError(
                f"--tp {cfg.tp}: {lm.name} has learned per-head attention sinks, which gmtool's "
                "tensor-parallel split does not shard: run it with --tp 1"
            )

        lm.whole_params = lm.num_params
        lm.notes.append(shard_model(lm.model, rank, cfg.tp))
        lm.tp = cfg.tp
        if why := probe.split_refusal(lm, cfg.tp):
            raise GmtoolError(why)
    if cfg.fuse:
        from gmtool.kernels.common import SMALL_M_DEFAULT
        from gmtool.model.fused import fuse_layers

        small_m = SMALL_M_DEFAULT if cfg.small_m_gemm else 0
        if small_m and cfg.attention_backend != "triton":
            lm.notes.append("--small-m-gemm: off, the fused layers run torch ops here (the small-M GEMM is Triton's)")
        pdl = _pdl_mode(cfg, lm.notes)
        lm.fused = fuse_layers(lm.model, cfg.attention_backend, lm.layout, small_m, pdl, cfg.max_kv_len)
    return rank


@dataclass
class Workbench:
    cfg: SweepConfig
    lm: LoadedModel
    cache: PagedKVCache
    eager_inputs: PersistentInputs  # the unpadded reference runs' buffers, apart from every executor's
    decoys_skipped: int = 0  # checks that ran without an eager step of another batch before them (decoy)

    @classmethod
    def build(cls, cfg: SweepConfig, num_blocks: int | None = None) -> "Workbench":
        """num_blocks: a fixed KV cache size; default: what the config's compositions need, within budget."""
        from gmtool.memory.estimate import check_fits
        from gmtool.switches import check_switches

        check_switches()  # where they are read: a help page or a report reads none
        # the decode attention's Triton kernels compile beside transformers' import and the model's build
        early = early_compile.start(cfg)
        try:
            check_fits(cfg)  # before any weights are built: a run that cannot fit is refused in one line
            device = cfg.torch_device
            if device.type == "cpu":
                torch.set_num_threads(cpu_threads(cfg.tp))
            rows = tuple(cfg.bucket_sizes) if cfg.tp == 1 else ()  # under --tp the shapes change after the load
            head_rows = tuple(sorted({min(r, cfg.max_num_seqs) for r in rows}))  # a key's logits: a row a sequence
            lm = load_model(cfg.model, device, cfg.torch_dtype, cfg.seed, rows, head_rows)
            lm.early_compile = early
            try:
                _positions_past_the_model(lm, cfg.max_kv_len)
                rank = _shard_and_fuse(cfg, lm)
            finally:  # before the KV cache is sized by what is free; on an error, before it reaches a caller that
                if lm.gemm_warmup is not None:  # may go on to capture while the thread's GEMMs still run
                    lm.gemm_warmup.join()
        finally:  # its compiles must not run beside the first capture's, nor its window on Triton's globals
            if early is not None:  # outlive a refused build
                early.join()
        spec = KVCacheSpec(
            lm.num_layers,
            lm.rank_kv_heads,
            lm.head_dim,
            cfg.block_size,
            cfg.max_kv_len,
            cfg.torch_dtype,
            v_head_dim=lm.layout.v_head_dim,
        )
        if num_blocks is not None:
            cache = PagedKVCache(spec, num_blocks, device)
        else:
            worst = cfg.kv_blocks_needed - 1  # from_budget adds the null block
            if cfg.kv_cache_gb is not None:
                budget = int(cfg.kv_cache_gb * 2**30)
            elif device.type == "cuda":
                torch.cuda.empty_cache()  # blocks freed by the build (and the GEMM warm-up): free, whichever ran
                budget = int(torch.cuda.mem_get_info(device)[0] * 0.4)
            else:
                budget = 1 << 40
            cache = PagedKVCache.from_budget(spec, budget, worst, device)
        cache.fill_random(cfg.seed, rank, cfg.tp)
        # up to --max-tokens: auto runs a batch above the largest bucket eagerly, and checks it against this
        eager_inputs = PersistentInputs(
            cfg.policy().max_tokens, cfg.max_num_seqs, spec.blocks_per_seq, lm.vocab_size, lm.model.dtype, device
        )
        return cls(cfg, lm, cache, eager_inputs)

    def rebound(self, cfg: SweepConfig) -> "Workbench":
        """This workbench for a config of the same build need, as Workbench.build(cfg) would have made it: the
        same model and buffers, the KV cache filled afresh (what earlier runs wrote there is gone)."""
        if build_need(cfg) != build_need(self.cfg):
            raise ValueError("rebound: the config needs a workbench of its own (gmtool.measure.workbench.build_need)")
        self.cache.fill_random(cfg.seed, _tp_rank(cfg), cfg.tp)
        return dataclasses.replace(self, cfg=cfg)

    @property
    def attention(self):
        """The attention backend object the run's eager and graph forwards share."""
        from gmtool.kernels import attention_backend

        return attention_backend(self.cfg.attention_backend)

    @property
    def device(self) -> torch.device:
        return self.cfg.torch_device

    def model_info(self) -> dict:
        lm = self.lm
        return {
            "name": lm.name,
            "source": lm.source,
            "params": lm.num_params,
            "layers": lm.num_layers,
            "heads": lm.num_heads,
            "kv_heads": lm.num_kv_heads,
            "head_dim": lm.head_dim,
            "vocab": lm.vocab_size,
            "kv_cache_blocks": self.cache.num_blocks,
            "kv_cache_bytes": self.cache.nbytes,
            "kv_bytes_per_token": self.cache.spec.bytes_per_token,
        }

    def capture_refusal(self) -> str | None:
        """Why the model's forward cannot be captured faithfully (gmtool.verify.capturable), or None."""
        from gmtool.verify.capturable import model_hazards, refusal

        return refusal(self.lm.name, model_hazards(self))

    def batch(self, comp: Composition, keep=()) -> Batch:
        return make_batch(comp, self.cache, self.lm.vocab_size, self.cfg.max_num_seqs, keep, self.cfg.seed)

    def executor(self, mode: GraphMode, memory=None):
        """memory: a MemoryStrategy choosing each capture's pool (None: one shared pool)."""
        from gmtool.core.forwards import forward_for

        cfg, mode = self.cfg, GraphMode(mode)
        if mode.composed_of:  # auto: one executor per kind of batch, one memory strategy over them
            from gmtool.core.auto import AutoExecutor

            return AutoExecutor(mode, {kind: self.executor(m, memory) for kind, m in mode.composed_of.items()})
        return GraphExecutor(
            self.lm,
            self.cache,
            cfg.policy(wide_key=mode.wide_key),
            mode,
            cfg.max_num_seqs,
            self.device,
            memory,
            self.attention,
            forward_for(mode, self.lm, cfg.piecewise_impl, cfg.compile),
        )

    def decoy(self, batch: Batch, keep=None):
        """An eager step of another batch (batch's sibling, its new tokens outside batch's blocks, or outside
        keep), to run just before batch's checked replay, as an engine's eager step of some other request would
        run before a replay. State that an eager pass and a graph share (a backend's plan or lengths kept outside
        the graph's inputs) then holds another batch's: the reference of batch itself, run just before, would
        refresh it and hide a graph that never loads it. None where no sibling fits beside them."""
        held = batch.blocks if keep is None else keep
        # else one decode token, which needs a single free block: a batch unlike any of several sequences
        for comp in (sibling_of(batch), parse_composition("1*1", batch.composition.seed + 7919)):
            try:
                other = self.batch(comp, keep=held)
                break
            except GmtoolError:
                continue
        else:
            self.decoys_skipped += 1  # the caller's notes say how many checks ran without one
            return None

        def run() -> None:
            self.eager_fn(other)[0]()

        return run

    def eager_fn(self, batch: Batch):
        """gmtool's eager forward of the exact batch (no padding): the reference. Returns the callable and the
        logits view it writes."""
        key = BucketKey(batch.num_tokens, batch.num_seqs, batch.is_decode)
        views = self.eager_inputs.load(batch, key)
        ctx = ForwardContext(
            self.cache,
            views,
            "decode" if batch.is_decode else "planned",
            batch.plan,
            batch.num_seqs,
            backend=self.attention,
        )
        lm = self.lm

        def fn():
            with forward_context(ctx), torch.no_grad():
                views.logits.copy_(lm.forward_logits(views.input_ids, views.positions, views.logits_indices))

        return fn, views.logits[: batch.num_seqs]

    def reference(self, batch: Batch) -> tuple[EagerReference, object]:
        """The eager reference of batch, and the callable that recomputes it (for timing)."""
        fn, logits = self.eager_fn(batch)
        try:
            ref = eager_reference(fn, logits, self.cache, batch)
        except torch.OutOfMemoryError:
            raise OutOfMemory("out of memory in the eager reference run") from None
        # NaN in the reference would turn every graph row UNSAFE (or, were both NaN, hide a wrong replay): the
        # model is the problem, not its graphs, so say that once, as this batch's error
        bad = [name for name, t in (("logits", ref.logits), ("K/V", ref.kv)) if not bool(torch.isfinite(t).all())]
        if bad:
            raise GmtoolError(
                f"the eager forward's {' and '.join(bad)} hold NaN or inf: no replay can be checked against them "
                "(the model's config or weights give no usable output: a rope_theta of 0, an fp16 overflow?)"
            )
        return ref, fn


class SharedWorkbench:
    """One workbench for a command's runs of several configs (memreport: every strategy, over the sampled
    buckets and then the whole list), built on first use and rebound to each run's config. It is built from
    `widest` when that has the run's need (its check_fits covers the smaller runs), and again only for a
    config of another need, the old one dropped first (one model in memory at a time)."""

    def __init__(self, widest: SweepConfig):
        self.widest, self.bench = widest, None

    def for_config(self, cfg: SweepConfig) -> Workbench:
        need = build_need(cfg)
        if self.bench is None or build_need(self.bench.cfg) != need:
            self.bench = None
            gc.collect()
            if cfg.torch_device.type == "cuda":
                torch.cuda.empty_cache()
            self.bench = Workbench.build(self.widest if build_need(self.widest) == need else cfg)
        return self.bench.rebound(cfg)
