"""Attention over gmtool's paged KV cache, routed in through transformers' AttentionInterface.

Three implementations, chosen per captured graph:
- `decode`: one query token per sequence; block tables and kv lengths are read from device buffers, the
  launch shape depends only on the bucket: one graph serves any decode batch that fits it.
- `masked`: varlen prefill/chunked prefill whose launch shape depends on (num_tokens, num_seqs) only; every
  per-request value comes from device buffers. Safe under the wide key.
- `planned`: varlen attention split on the host by the batch's q/kv lengths (as FlashAttention's max_seqlen
  or FlashInfer's plan are). Correct when run eagerly (piecewise runners do); a full graph keyed only by
  num_tokens bakes the capture-time split in, and replaying it with another mix is wrong.

Each layer's options (`LayerOpts`: sliding window, logit soft-cap, learned sinks) are what the model passes to
its attention function; they are static per layer, so a graph bakes them in while positions stay data. K and V
may have different head dims (DeepSeek's MLA as transformers computes it): the output has V's.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from gmtool.core.inputs import StepViews
from gmtool.core.kv_cache import PagedKVCache

ATTN_NAME = "gmtool"


@dataclass(frozen=True, eq=False)
class LayerOpts:
    """One layer's attention options, as transformers passes them to an attention function."""

    window: int | None = None  # sliding window: a token sees the cache positions p with pos - window < p <= pos
    softcap: float | None = None  # logits become softcap * tanh(logits / softcap) (Gemma 2)
    sinks: torch.Tensor | None = None  # [H] learned per-head sink logits: one more softmax column, no value

    @property
    def plain(self) -> bool:
        return self.window is None and self.softcap is None and self.sinks is None

    @classmethod
    def from_kwargs(cls, kwargs: dict) -> "LayerOpts":
        window, softcap, sinks = kwargs.get("sliding_window"), kwargs.get("softcap"), kwargs.get("s_aux")
        if window is None and softcap is None and sinks is None:
            return PLAIN
        return cls(int(window) if window else None, float(softcap) if softcap else None, sinks)


PLAIN = LayerOpts()


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Scatter new K/V ([T, Hkv, D]) by slot; padding slots point into the null block."""
    kc = k_cache.view(-1, *k_cache.shape[2:])
    vc = v_cache.view(-1, *v_cache.shape[2:])
    kc.index_copy_(0, slots, k)
    vc.index_copy_(0, slots, v)


def decode_attention(q, k_cache, v_cache, block_tables, kv_lens, scale, opts: LayerOpts = PLAIN) -> torch.Tensor:
    """q [B, H, Dk] -> [B, H, Dv]; each sequence reads its kv_lens[b] tokens through block_tables[b] (device
    buffers). Reference: it gathers every block-table entry (the launch shape must not depend on kv_lens), so it
    reads max_kv_len tokens per sequence; the Triton kernel reads only the window's share of kv_lens[b]."""
    b, h, _ = q.shape
    k = _gather(k_cache, block_tables)  # [B, L, Hkv, Dk]
    v = _gather(v_cache, block_tables)
    qg = q.unflatten(1, (k.shape[2], h // k.shape[2]))  # [B, Hkv, G, Dk]
    scores = _logits(_row_scores(qg, k).float() * scale, opts)
    pos = torch.arange(k.shape[1], device=q.device)
    lens = kv_lens.clamp_min(1)[:, None]  # padded sequences read the null block
    valid = pos[None, :] < lens
    if opts.window is not None:
        valid &= pos[None, :] >= lens - opts.window
    p = _softmax(scores.masked_fill(~valid[:, None, None, :], float("-inf")), opts)
    return _row_weighted(p.to(v.dtype), v).reshape(b, h, v.shape[-1])


def _logits(scores: torch.Tensor, opts: LayerOpts) -> torch.Tensor:
    """Scaled scores as the model's softmax sees them (soft-capped when the layer caps)."""
    if opts.softcap is None:
        return scores
    return torch.tanh(scores / opts.softcap) * opts.softcap


def _softmax(scores: torch.Tensor, opts: LayerOpts) -> torch.Tensor:
    """softmax over the last dim of scores [N, Hkv, G, L]; with sinks, each head's sink logit joins the
    denominator (and has no value row). A row with nothing valid gives zeros, never NaN."""
    if opts.sinks is None:
        return torch.nan_to_num(scores.softmax(-1), nan=0.0)
    sink = opts.sinks.float().view(1, scores.shape[1], scores.shape[2], 1).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], -1).softmax(-1)[..., :-1]


def _visible(kv_pos: torch.Tensor, positions: torch.Tensor, opts: LayerOpts) -> torch.Tensor:
    """[T, L]: token t sees the cache positions up to its own (itself included), within its window if any."""
    seen = kv_pos[None, :] <= positions[:, None]
    if opts.window is not None:
        seen &= kv_pos[None, :] > positions[:, None] - opts.window
    return seen


def _gather(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """cache [blocks, bs, Hkv, D] read through tables [N, W]: [N, W * bs, Hkv, D] (index_select copies whole
    blocks; advanced indexing is an order of magnitude slower on the CPU)."""
    return cache.index_select(0, tables.flatten()).view(tables.shape[0], -1, *cache.shape[2:])


def _row_scores(qg: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """qg [N, Hkv, G, D] against each row's own k [N, L, Hkv, D]: [N, Hkv, G, L]. One batched matmul per KV head
    reads k in place (an einsum would first copy it transposed)."""
    return torch.stack([torch.bmm(qg[:, i], k[:, :, i].transpose(1, 2)) for i in range(k.shape[2])], 1)


def _row_weighted(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """p [N, Hkv, G, L] over each row's own v [N, L, Hkv, D]: [N, Hkv, G, D]."""
    return torch.stack([torch.bmm(p[:, i], v[:, :, i]) for i in range(v.shape[2])], 1)


MASKED_CHUNK_BYTES = 32 << 20  # per-token masked attention: fp32 K gathered this many bytes at a time


def masked_varlen_attention(
    q, k_cache, v_cache, views: StepViews, num_seqs: int, scale, opts: LayerOpts = PLAIN
) -> torch.Tensor:
    """Varlen causal attention with a launch shape fixed by (num_tokens, num_seqs); metadata from device.
    Two exact ways, picked from those two numbers alone: a pass per sequence over every token (num_seqs x
    num_tokens x heads x kv length), or each token reading its own sequence's blocks (num_tokens x kv length x
    kv heads x head_dim): the cheaper one, so many short sequences do not cost num_seqs passes."""
    t, h, d = q.shape
    length = views.block_tables.shape[1] * k_cache.shape[1]
    kv_pos = torch.arange(length, device=q.device)
    if num_seqs * h <= k_cache.shape[2] * d:
        return _masked_per_sequence(q, k_cache, v_cache, views, num_seqs, scale, kv_pos, opts)
    return _masked_per_token(q, k_cache, v_cache, views, num_seqs, scale, kv_pos, opts)


def _masked_per_sequence(
    q, k_cache, v_cache, views: StepViews, num_seqs: int, scale, kv_pos, opts: LayerOpts
) -> torch.Tensor:
    t, h, _ = q.shape
    dv = v_cache.shape[-1]
    out = torch.zeros(t, h, dv, dtype=torch.float32, device=q.device)
    for s in range(num_seqs):
        k = _gather(k_cache, views.block_tables[s : s + 1])[0]  # [L, Hkv, D]
        v = _gather(v_cache, views.block_tables[s : s + 1])[0]
        qg = q.unflatten(1, (k.shape[1], h // k.shape[1])).float()
        scores = _logits(torch.einsum("thgd,lhd->thgl", qg, k.float()) * scale, opts)  # [T, Hkv, G, L]
        mine = views.token_seq == s
        valid = mine[:, None] & _visible(kv_pos, views.positions, opts) & (kv_pos < views.kv_lens[s])
        p = _softmax(scores.masked_fill(~valid[:, None, None, :], float("-inf")), opts)
        out += torch.einsum("thgl,lhd->thgd", p, v.float()).reshape(t, h, dv)
    return out.to(q.dtype)


def _masked_per_token(
    q, k_cache, v_cache, views: StepViews, num_seqs: int, scale, kv_pos, opts: LayerOpts
) -> torch.Tensor:
    t, h, d = q.shape
    hkv, dv = k_cache.shape[2], v_cache.shape[-1]
    mine = (views.token_seq >= 0) & (views.token_seq < num_seqs)  # padding tokens belong to no sequence
    seq = views.token_seq.clamp(0, num_seqs - 1)
    valid = mine[:, None] & (kv_pos[None, :] < views.kv_lens[seq][:, None]) & _visible(kv_pos, views.positions, opts)
    tables = views.block_tables[seq]  # [T, W]: each token's own sequence's row
    out = torch.empty(t, h, dv, dtype=q.dtype, device=q.device)
    chunk = max(1, MASKED_CHUNK_BYTES // (kv_pos.numel() * hkv * max(d, dv) * 4))
    for a in range(0, t, chunk):
        b = min(t, a + chunk)
        k = _gather(k_cache, tables[a:b]).float()  # [C, L, Hkv, D]
        v = _gather(v_cache, tables[a:b]).float()
        qg = q[a:b].unflatten(1, (hkv, h // hkv)).float()
        scores = _logits(_row_scores(qg, k) * scale, opts)  # [C, Hkv, G, L]
        p = _softmax(scores.masked_fill(~valid[a:b, None, None, :], float("-inf")), opts)
        out[a:b] = _row_weighted(p, v).reshape(b - a, h, dv)
    return out


def planned_varlen_attention(
    q, k_cache, v_cache, views: StepViews, plan, scale, opts: LayerOpts = PLAIN
) -> torch.Tensor:
    """Varlen causal attention split on the host by `plan` = ((q_len, kv_len), ...)."""
    t, h, _ = q.shape
    bs = k_cache.shape[1]
    out = torch.zeros(t, h, v_cache.shape[-1], dtype=q.dtype, device=q.device)
    start = 0
    for i, (q_len, kv_len) in enumerate(plan):
        nb = math.ceil(kv_len / bs)
        k = k_cache[views.block_tables[i, :nb]].flatten(0, 1)[:kv_len]
        v = v_cache[views.block_tables[i, :nb]].flatten(0, 1)[:kv_len]
        rep = h // k.shape[1]
        qs = q[start : start + q_len].transpose(0, 1)  # [H, n, D]
        ks = k.repeat_interleave(rep, 1).transpose(0, 1)
        vs = v.repeat_interleave(rep, 1).transpose(0, 1)
        prefix = kv_len - q_len
        mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device).tril(prefix)
        if opts.window is not None:
            mask &= ~torch.ones_like(mask).tril(prefix - opts.window)
        if opts.softcap is None and opts.sinks is None:
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
        else:  # SDPA has neither: the scores written out, [H, n, L]
            scores = _logits(torch.matmul(qs.float(), ks.float().transpose(1, 2)) * scale, opts)
            scores = scores.masked_fill(~mask, float("-inf")).transpose(0, 1).unflatten(1, (k.shape[1], rep))
            p = _softmax(scores, opts).flatten(1, 2).transpose(0, 1)  # [n, Hkv, G, L] there, [H, n, L] back
            o = torch.matmul(p, vs.float()).to(q.dtype)
        out[start : start + q_len] = o.transpose(0, 1)
        start += q_len
    return out


class TorchAttention:
    """The reference attention backend: plain torch over the paged cache (any device, the CPU tape included)."""

    name = "torch"

    def write_kv(self, kc, vc, k, v, slots) -> None:
        write_kv(kc, vc, k, v, slots)

    def plan_signature(self, plan: tuple) -> tuple:
        """The part of a host plan the planned implementation turns into launch shapes: it slices per sequence."""
        return plan

    def step_grid(self, signature: tuple) -> None:
        """No launch grid: the reference slices on the host, from ctx.plan."""
        return None

    def bind(self, ctx, q, kc, vc, scale, out, opts: LayerOpts = PLAIN, views=None):
        """A piecewise runner's attention as one call with no arguments: it reads the step's plan and views from
        ctx when called, through ctx's backend (a wrapper there, as gmtool verify's faults, is kept)."""
        run = getattr(ctx.backend, ctx.impl)
        return lambda: run(ctx, q, kc, vc, scale, out, opts)

    def bind_write_kv(self, kc, vc, k, v, slots):
        return lambda: write_kv(kc, vc, k, v, slots)

    def decode(self, ctx, q, kc, vc, scale, out, opts: LayerOpts = PLAIN):
        return _into(decode_attention(q, kc, vc, ctx.views.block_tables, ctx.views.kv_lens, scale, opts), out)

    def masked(self, ctx, q, kc, vc, scale, out, opts: LayerOpts = PLAIN):
        return _into(masked_varlen_attention(q, kc, vc, ctx.views, ctx.num_seqs, scale, opts), out)

    def planned(self, ctx, q, kc, vc, scale, out, opts: LayerOpts = PLAIN):
        ctx.planned_with.append(ctx.signature)
        return _into(planned_varlen_attention(q, kc, vc, ctx.views, ctx.plan, scale, opts), out)


def _into(res: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return res
    out.copy_(res)
    return out


TORCH_ATTENTION = TorchAttention()


@dataclass
class ForwardContext:
    """What attention needs during one forward; set around each eager run, capture and replay."""

    cache: PagedKVCache
    views: StepViews
    impl: str  # decode | masked | planned: the backend's method that serves this batch shape
    plan: tuple = ()  # host plan of the current batch (planned impl)
    num_seqs: int = 0  # masked impl: sequences covered by the launch shape
    breaker: object = None  # piecewise capture: called at each attention instead of computing it
    backend: object = TORCH_ATTENTION  # TorchAttention, or gmtool.kernels.TritonAttention
    planned_with: list = field(default_factory=list)  # host plan parts consumed while this context was live
    scratch: object = None  # the executor's reserved decode split partials for bound runners (Triton)

    prepares: int = 0  # how many times a step's metadata was prepared (once per step, for all its runners)
    layers_write_kv: bool = True  # a fused layer may write this step's K/V itself (cache_writer); not piecewise

    def __post_init__(self) -> None:
        self._run = getattr(self.backend, self.impl)  # looked up once, not per layer
        self.signature = self.backend.plan_signature(self.plan)
        self.step_grid = self.backend.step_grid(self.signature)

    def prepare(self, plan: tuple) -> None:
        """A step's host metadata, once for every attention runner of the step: the plan, the part of it the
        backend turns into launch shapes and the grid it launches with. What a replay consumed is forgotten."""
        self.plan = plan
        self.signature = self.backend.plan_signature(plan)
        self.step_grid = self.backend.step_grid(self.signature)
        self.planned_with.clear()
        self.prepares += 1

    def plan_signature(self, plan: tuple) -> tuple:
        return self.backend.plan_signature(plan)

    def write_kv(self, layer: int, k, v) -> None:
        self.backend.write_kv(self.cache.k[layer], self.cache.v[layer], k, v, self.views.slot_mapping)

    def attend_cached(
        self, layer: int, q, scale, out: torch.Tensor | None = None, opts: LayerOpts = PLAIN
    ) -> torch.Tensor:
        """Attention of q over the cache, the step's new K/V already written."""
        return self._run(self, q, self.cache.k[layer], self.cache.v[layer], scale, out, opts)

    def bind(self, layer: int, q, scale, out: torch.Tensor, opts: LayerOpts = PLAIN):
        """A piecewise runner's attend_cached as one call with no arguments, bound once to its tensors (q, out,
        this layer's cache, the step's metadata buffers): per step it reads only what prepare() computed."""
        return self.backend.bind(self, q, self.cache.k[layer], self.cache.v[layer], scale, out, opts)

    def bind_attend(self, layer: int, q, k, v, scale, out: torch.Tensor, opts: LayerOpts = PLAIN):
        """attend() bound the same way, for a runner that writes the step's K/V itself (FX pieces do not)."""
        write = self.backend.bind_write_kv(self.cache.k[layer], self.cache.v[layer], k, v, self.views.slot_mapping)
        return WriteThenAttend(write, self.bind(layer, q, scale, out, opts))

    def attend(
        self, layer: int, q, k, v, scale, out: torch.Tensor | None = None, opts: LayerOpts = PLAIN
    ) -> torch.Tensor:
        self.write_kv(layer, k, v)
        return self.attend_cached(layer, q, scale, out, opts)


class WriteThenAttend:
    """Two bound calls in a row: the step's K/V into the cache, then the attention over it."""

    __slots__ = ("write", "attend")

    def __init__(self, write, attend):
        self.write, self.attend = write, attend

    @property
    def paths(self) -> tuple[str, ...]:
        return getattr(self.write, "paths", ()) + getattr(self.attend, "paths", ())

    def native_launches(self, ctx) -> list:
        """The write's launches, then the attention's (gmtool.kernels.native_loop); torch's have none."""
        from gmtool.kernels.launcher import NotNative

        parts = [getattr(x, "native_launches", None) for x in (self.write, self.attend)]
        if None in parts:
            raise NotNative("a runner whose K/V write or attention is torch's, not a bound Triton launch")
        return parts[0](ctx) + parts[1](ctx)

    def __call__(self) -> None:
        self.write()
        self.attend()


_current: ForwardContext | None = None


@contextlib.contextmanager
def forward_context(ctx: ForwardContext):
    global _current
    prev, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = prev


def current_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("gmtool attention called outside a forward context")
    return _current


_opaque = False  # FX piecewise: attention becomes one opaque op, the compiler's split point


@contextlib.contextmanager
def opaque_attention():
    global _opaque
    prev, _opaque = _opaque, True
    try:
        yield
    finally:
        _opaque = prev


_probe: list | None = None  # gmtool.model.probe: records each call instead of attending


def gmtool_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention signature: q/k/v [1, H, T, D] in, ([1, T, H, Dv], None) out."""
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    if _probe is not None:
        # the mask too: transformers builds none for an attention it has no mask function for, so a tensor here
        # is one the attention module made itself
        _probe.append((module, q.shape, k.shape, v.shape, scale, dict(kwargs, attention_mask=attention_mask)))
        return query.new_zeros(1, q.shape[0], q.shape[1], v.shape[-1]), None
    opts = LayerOpts.from_kwargs(kwargs)
    return attend_tokens(module.layer_idx, q, k.contiguous(), v.contiguous(), scale, opts).unsqueeze(0), None


@contextlib.contextmanager
def probing(calls: list):
    global _probe
    prev, _probe = _probe, calls
    try:
        yield calls
    finally:
        _probe = prev


def cache_writer() -> ForwardContext | None:
    """The forward's context when a layer may write this step's K/V into ctx.cache itself (at
    ctx.views.slot_mapping) and then call ctx.attend_cached: None while FX traces (the opaque op takes k and v)
    or a piecewise capture breaks at attention (the piece writes them), in a piecewise executor's warm-ups (they
    launch what its capture will), and outside a forward."""
    if _opaque or _current is None or _current.breaker is not None or not _current.layers_write_kv:
        return None
    return _current


def attend_tokens(layer: int, q, k, v, scale: float, opts: LayerOpts = PLAIN) -> torch.Tensor:
    """q [T, H, Dk], k [T, Hkv, Dk], v [T, Hkv, Dv] -> [T, H, Dv]: the opaque op (FX), a piecewise break, or the
    attention."""
    if _opaque:
        out = q.new_empty(*q.shape[:2], v.shape[-1])
        torch.ops.gmtool.attention(q, k, v, out, layer, float(scale), opts.window or 0, opts.softcap or 0.0, opts.sinks)
        return out
    ctx = current_context()
    if ctx.breaker is not None:
        return ctx.breaker(layer, q, k, v, scale, opts)
    return ctx.attend(layer, q, k, v, scale, opts=opts)


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, gmtool_attention)
