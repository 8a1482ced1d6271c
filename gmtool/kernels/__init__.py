"""Graph-safe attention kernels over gmtool's paged KV cache, and the switch between them and torch.

Both backends expose the same three ops (`AttentionOps`):
- write_kv(k_cache, v_cache, k, v, slot_mapping)
- decode(q, k_cache, v_cache, block_tables, kv_lens, scale)
- varlen(q, k_cache, v_cache, cu_q, kv_lens, block_tables, num_seqs, max_q_len, scale); max_q_len=None
  asks for a launch shape fixed by (num_tokens, num_seqs) only (safe under a wide graph key).
Nothing here imports triton until a triton op is asked for: CPU machines need not have it.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Callable, NamedTuple

import torch

from gmtool.errors import GmtoolError

VARLEN_BLOCK_M = 64  # query rows per program of the varlen kernel (gmtool.kernels.prefill_attention.BLOCK_M)

BACKENDS = ("torch", "triton")


class AttentionOps(NamedTuple):
    write_kv: Callable
    decode: Callable
    varlen: Callable


def available() -> bool:
    """Triton kernels can run: a CUDA device is present and triton imports."""
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _torch_varlen(q, k_cache, v_cache, cu_q, kv_lens, block_tables, num_seqs, max_q_len, scale):
    """The masked reference, fed the per-token metadata it needs, derived on device from cu_q/kv_lens."""
    from gmtool.model.attention import masked_varlen_attention

    t = torch.arange(q.shape[0], device=q.device)
    seq = torch.searchsorted(cu_q[1 : num_seqs + 1].contiguous(), t, right=True)
    mine = seq.clamp(max=max(num_seqs - 1, 0))
    q_len = cu_q[mine + 1] - cu_q[mine]
    positions = kv_lens[mine] - q_len + (t - cu_q[mine])
    token_seq = torch.where(seq < num_seqs, seq, -1)
    views = SimpleNamespace(block_tables=block_tables, kv_lens=kv_lens, positions=positions, token_seq=token_seq)
    return masked_varlen_attention(q, k_cache, v_cache, views, num_seqs, scale)


class TritonAttention:
    """gmtool's Triton kernels over the paged cache (CUDA): launch shapes fixed by the bucket key."""

    name = "triton"

    def __init__(self):
        from gmtool.kernels.decode_attention import decode_attention
        from gmtool.kernels.kv_write import write_kv
        from gmtool.kernels.prefill_attention import varlen_attention, varlen_attention_wide

        self.write_kv = write_kv
        self._decode, self._varlen, self._varlen_wide = decode_attention, varlen_attention, varlen_attention_wide
        self._scratch: dict = {}  # bound decode runners' split partials, one pair per shape

    def plan_signature(self, plan: tuple) -> tuple:
        """Grid (num_seqs, max_q_len); the lengths themselves are read from the device."""
        return (len(plan), max((q for q, _ in plan), default=0))

    def step_grid(self, signature: tuple) -> tuple:
        """The planned launch's batch-dependent grid (num_seqs, query tiles), once per step for every runner."""
        return (signature[0], max(1, -(-signature[1] // VARLEN_BLOCK_M)))

    def bind(self, ctx, q, kc, vc, scale, out, opts=None, views=None):
        """A piecewise runner's attention as one call with no arguments, its kernels bound to the runner's tensors
        (gmtool.kernels.launcher): per step it reads only what ctx.prepare computed (step_grid). views: the
        metadata buffers to bind, when not ctx's (gmtool verify's frozen-metadata faults)."""
        from gmtool.kernels.decode_attention import BoundDecode
        from gmtool.kernels.prefill_attention import bind_varlen

        v, kw = views or ctx.views, _kw(opts)
        if ctx.impl == "decode":
            scratch = ctx.scratch or self._scratch_for(q.device)
            return BoundDecode(q, kc, vc, v.block_tables, v.kv_lens, scale, out, scratch, **kw)
        heads = q.shape[1]
        if ctx.impl == "masked":  # the wide grid depends on the bucket only
            launch = bind_varlen(q, kc, vc, v.cu_q, v.kv_lens, v.block_tables, ctx.num_seqs, scale, out, **kw)
            return _WideStep(launch, (q.shape[0] // VARLEN_BLOCK_M + ctx.num_seqs, 1, heads))
        launch = bind_varlen(q, kc, vc, v.cu_q, v.kv_lens, v.block_tables, None, scale, out, **kw)
        return _PlannedStep(ctx, launch, heads, out)

    def bind_write_kv(self, kc, vc, k, v, slots):
        """A runner's K/V write as one call with no arguments (FX runners write K/V themselves)."""
        from gmtool.kernels.kv_write import BoundWrite

        return BoundWrite(kc, vc, k, v, slots)

    def reserve_scratch(self, device, batches, heads: int, kv_heads: int, dv: int, seen_tokens: int):
        """Split partials for an executor's bound decode runners, allocated now. Made at a runner's binding they
        would be allocated inside a capture: in that graph's pool, held past its release (a VMM range that
        cannot unmap), and only by the first capture of a shape (a node diff then sees two extra ops)."""
        from gmtool.kernels.common import num_sms
        from gmtool.kernels.decode_attention import split_scratch_numels

        sizes = split_scratch_numels(batches, heads, kv_heads, dv, seen_tokens, num_sms(device))
        bufs = {role: torch.empty(n, dtype=torch.float32, device=device) for role, n in zip(("part", "lse"), sizes)}

        def scratch(role: str, numel: int) -> torch.Tensor:
            if numel > bufs[role].numel():
                raise GmtoolError(f"decode split partials of {numel} elements exceed the {bufs[role].numel()} reserved")
            return bufs[role][:numel]

        return scratch

    def _scratch_for(self, device):
        def scratch(role: str, numel: int) -> torch.Tensor:
            key = (device, role, numel)
            if key not in self._scratch:
                self._scratch[key] = torch.empty(numel, dtype=torch.float32, device=device)
            return self._scratch[key]

        return scratch

    def decode(self, ctx, q, kc, vc, scale, out, opts=None):
        return self._decode(q, kc, vc, ctx.views.block_tables, ctx.views.kv_lens, scale, out=out, **_kw(opts))

    def masked(self, ctx, q, kc, vc, scale, out, opts=None):
        v = ctx.views
        return self._varlen_wide(
            q, kc, vc, v.cu_q, v.kv_lens, v.block_tables, ctx.num_seqs, scale, out=out, **_kw(opts)
        )

    def planned(self, ctx, q, kc, vc, scale, out, opts=None):
        sig = ctx.signature  # computed once per step (ForwardContext.prepare), not per layer
        ctx.planned_with.append(sig)
        v = ctx.views
        return self._varlen(q, kc, vc, v.cu_q, v.kv_lens, v.block_tables, sig[0], sig[1], scale, out=out, **_kw(opts))


class _WideStep:
    """A bound masked runner: its grid is the bucket's."""

    __slots__ = ("launch", "grid")

    def __init__(self, launch, grid: tuple):
        self.launch, self.grid = launch, grid

    @property
    def paths(self) -> tuple[str, ...]:
        return (self.launch.path,)

    def native_launches(self, ctx) -> list:
        from gmtool.kernels.launcher import KernelLaunch

        return [KernelLaunch(self.launch, self.grid)]

    def __call__(self) -> None:
        self.launch(self.grid)


class _PlannedStep:
    """A bound planned runner: the grid and num_seqs its step prepared (ctx.step_grid), read at each call."""

    __slots__ = ("ctx", "launch", "heads", "out")

    def __init__(self, ctx, launch, heads: int, out):
        self.ctx, self.launch, self.heads, self.out = ctx, launch, heads, out

    @property
    def paths(self) -> tuple[str, ...]:
        return (self.launch.path,)

    def native_launches(self, ctx) -> list:
        """The step's grid and num_seqs, read by the native loop per step; a step of no sequence (a grid of 0)
        is refused there and runs here, zeroing the output."""
        from gmtool.kernels.launcher import STEP_SEQS, STEP_TILES, KernelLaunch, NotNative

        if ctx is not self.ctx:
            raise NotNative("a planned runner bound to another step's context")
        return [KernelLaunch(self.launch, (STEP_SEQS, STEP_TILES, self.heads), (STEP_SEQS,), reads_plan=True)]

    def __call__(self) -> None:
        ctx = self.ctx
        ctx.planned_with.append(ctx.signature)
        n, tiles = ctx.step_grid
        if n:
            self.launch((n, tiles, self.heads), n)
        else:
            self.out.zero_()


def _kw(opts) -> dict:
    """A layer's LayerOpts as the kernels' keyword arguments."""
    if opts is None or opts.plain:
        return {}
    return {"window": opts.window, "softcap": opts.softcap, "sinks": opts.sinks}


@functools.cache
def attention_backend(name: str):
    """The attention backend object of a run (one per process and name)."""
    from gmtool.model.attention import TORCH_ATTENTION

    if name == "torch":
        return TORCH_ATTENTION
    if name == "triton":
        if not available():
            raise GmtoolError(
                "the triton attention backend needs a CUDA device and the triton package; use the torch backend"
            )
        return TritonAttention()
    raise GmtoolError(f"unknown attention backend {name!r}: choose one of {', '.join(BACKENDS)}")


@functools.lru_cache(maxsize=None)
def get_attention_ops(backend: str) -> AttentionOps:
    if backend == "torch":
        from gmtool.model.attention import decode_attention, write_kv

        return AttentionOps(write_kv, decode_attention, _torch_varlen)
    if backend == "triton":
        if not available():
            raise GmtoolError(
                "the triton attention backend needs a CUDA device and the triton package; use the torch backend"
            )
        from gmtool.kernels.decode_attention import decode_attention
        from gmtool.kernels.kv_write import write_kv
        from gmtool.kernels.prefill_attention import varlen_attention, varlen_attention_wide

        def varlen(q, k_cache, v_cache, cu_q, kv_lens, block_tables, num_seqs, max_q_len, scale):
            if max_q_len is None:
                return varlen_attention_wide(q, k_cache, v_cache, cu_q, kv_lens, block_tables, num_seqs, scale)
            return varlen_attention(q, k_cache, v_cache, cu_q, kv_lens, block_tables, num_seqs, max_q_len, scale)

        return AttentionOps(write_kv, decode_attention, varlen)
    raise GmtoolError(f"unknown attention backend {backend!r}: choose one of {', '.join(BACKENDS)}")
