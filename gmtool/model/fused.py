"""--fuse: the model's decoder layers with fewer kernels, the way engines write their model code.

A Hugging Face Llama/Qwen layer launches about 50 kernels per decode step (RMSNorm alone is 6-7, RoPE about
10); inside a CUDA graph each still costs its launch latency, so at small batches the replay is the sum of
many tiny kernels. Fused, a layer is about 10: add+RMSNorm, one QKV GEMM, one QK-norm+RoPE kernel that also
writes the step's K/V into the cache (with Triton, where the layer attends in place: whole graphs and eager;
a piecewise capture writes them at the end of its piece), attention, o_proj, add+RMSNorm, one gate/up GEMM,
one SiLU-and-mul kernel, down_proj (where the small-M GEMM splits o_proj's and down_proj's K, the add+RMSNorm
after each sums the partials: no reduce kernel). Each residual add moves into the RMSNorm after it, as engines carry
(hidden, residual) pairs through their layers: for the architectures whose decoder layer is the plain
pre-norm block, the base model's forward is replaced by that loop (`_residual_stream_forward`).

The weights are not copied: q/k/v (and gate/up) become views of one concatenated weight, so the original
modules still hold their weights and `unfused()` gives the Hugging Face forwards back (the hf-compiled peer
copies the model that way). Under torch.compile the fused forwards run plain torch ops (gmtool.model.layers_ref),
which Inductor fuses itself; otherwise they run gmtool's Triton kernels on CUDA, torch ops elsewhere.
"""

from __future__ import annotations

import inspect

import contextlib
import functools
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from gmtool.kernels.common import NormedRow, Partials
from gmtool.model import attention

from gmtool.model import layers_ref, rotary_table
from gmtool.model.rotary_table import RopeRows, RotaryTable
from gmtool.model import families
from gmtool.model.families import FUSED_RESIDUAL

SILU = ("silu", "swish")


def _triton_runs(x: torch.Tensor) -> bool:
    """gmtool's Triton kernels take x: a CUDA tensor outside an Inductor trace (tests under the Triton
    interpreter replace this)."""
    return x.is_cuda and not torch.compiler.is_compiling()


class LayerOps:
    """The fused layers' kernels, chosen once per run: Triton on CUDA (their torch form while Inductor traces,
    which it fuses itself), the torch form elsewhere. small_m: the largest token count whose projections run
    gmtool's small-M GEMM (gmtool.kernels.small_m) instead of F.linear; 0 leaves them all to F.linear. A graph
    holds one token count, so each bucket's graph takes one side of the threshold for good."""

    def __init__(self, attention_backend: str, small_m: int = 0, pdl: int = 0):
        from gmtool.kernels.common import SMALL_M_MAX

        if not 0 <= small_m <= SMALL_M_MAX:
            raise ValueError(f"small_m {small_m}: the small-M GEMM takes 0 to {SMALL_M_MAX} tokens")
        self.triton = attention_backend == "triton"
        self.small_m = small_m
        # gmtool.kernels.pdl.Pdl (an int here: that module imports triton): the fused layers' Triton kernels
        # launched with Programmatic Dependent Launch, the small-M GEMM prefetching its weight before its wait.
        # The caller checked pdl.problem(); 0 launches them plainly. May be changed before capture, as small_m.
        self.pdl = int(pdl)
        # one-row steps compute the add+RMSNorm before QKV and gate/up inside those GEMMs instead of launching
        # its kernel (gmtool.kernels.folded); False launches it (A/B measurements)
        self.fold = True
        # those steps also compute SiLU-and-mul inside the down projection (folded.silu_linear), and the embedding
        # lookup and the first layer's RMSNorm inside its QKV GEMM; False launches them
        self.fold_silu = True
        self.fold_first = True
        # with RoPE tabled, the QK-norm+RoPE kernel reads each token's row of the table itself: no gather kernel
        # ahead of the first layer; False gathers them (A/B measurements)
        self.rope_rows = True

    def folds(self, x: torch.Tensor) -> bool:
        """Whether a step of x's rows folds its add+RMSNorms into the GEMMs after them: one row on the small-M
        GEMM, with Triton, a row the folded kernel holds in registers."""
        if not (self.fold and self.triton and self.small_m and x.shape[0] == 1 and _triton_runs(x)):
            return False
        from gmtool.kernels.folded import norm_folds

        return norm_folds(x.shape[-1])

    def silu_folds(self, rows, down: torch.nn.Module) -> bool:
        """Whether the MLP over rows computes SiLU-and-mul inside its down projection: a folded step's row
        (a NormedRow) and a plain Linear down (not --tp's row-parallel one)."""
        return self.fold_silu and isinstance(rows, NormedRow) and type(down) is torch.nn.Linear

    def silu_linear(self, gate_up, down: torch.nn.Linear, partial: bool):
        """down(silu(gate) * up) for a folded step's gate/up row, in one kernel (gmtool.kernels.folded.silu_linear)."""
        from gmtool.kernels import folded

        return folded.silu_linear(gate_up, down.weight, down.bias, pdl=self.pdl, partial=partial)

    def pdl_for(self, x: torch.Tensor) -> int:
        """The PDL mode for a step of x's tokens: self.pdl up to small_m tokens, else 0. What PDL buys is the
        small-M GEMM's weight prefetch; above small_m the GEMMs are cuBLAS's, which prefetch nothing, and the
        PDL launches only cost (H200, qwen3-0.6b, B=32 kv 1024: 2.34 ms with them against 2.19 without, in each
        of three calls)."""
        return self.pdl if x.numel() <= self.small_m * x.shape[-1] else 0

    def __call__(self, x: torch.Tensor) -> SimpleNamespace:
        if self.triton and _triton_runs(x):
            from gmtool.kernels import layers

            mode = self.pdl_for(x)
            return layers if not mode else _with_pdl(layers, mode)
        return _REF

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, partial=False):
        """x @ weight^T (+ bias). partial: the caller sums split-K partials itself (gmtool.kernels.common.Partials
        may come back, for add_rms_norm); a tensor otherwise. x may be a NormedRow (where folds()): the folded
        GEMM normalizes the row itself."""
        if isinstance(x, NormedRow):
            from gmtool.kernels import folded

            return folded.linear(x, weight, bias, pdl=self.pdl, partial=partial)
        if self.triton and x.shape[0] <= self.small_m and _triton_runs(x):
            from gmtool.kernels import small_m

            opts = ({"pdl": self.pdl} if self.pdl else {}) | ({"partial": True} if partial else {})
            return small_m.linear(x, weight, bias, **opts)
        return F.linear(x, weight, bias)

    def attention_launches(self, x: torch.Tensor):
        """The scope the attention kernels launch in: PDL ones when on (they are reached through the forward
        context and the attention backend, which take no launch options), else nothing changes."""
        mode = self.pdl_for(x)
        if mode and self.triton and _triton_runs(x):
            from gmtool.kernels import pdl

            return pdl.launches(mode)
        return contextlib.nullcontext()

    def project(self, m: torch.nn.Module, x: torch.Tensor, partial: bool = False):
        """m(x) for a row-parallel (--tp) or other Linear subclass, whose forward adds more than the product.
        partial: as linear's."""
        return self.linear(x, m.weight, m.bias, partial) if type(m) is torch.nn.Linear else m(x)


@functools.lru_cache(maxsize=None)
def _with_pdl(layers, mode: int) -> SimpleNamespace:
    """gmtool.kernels.layers' launchers with pdl=mode."""
    names = ("rms_norm", "add_rms_norm", "qk_norm_rope", "qk_norm_rope_write_kv", "silu_mul")
    return SimpleNamespace(**{n: functools.partial(getattr(layers, n), pdl=mode) for n in names})


_REF = SimpleNamespace(
    rms_norm=layers_ref.rms_norm_ref,
    add_rms_norm=layers_ref.add_rms_norm_ref,
    qk_norm_rope=layers_ref.qk_norm_rope_ref,
    silu_mul=layers_ref.silu_mul_ref,
)


def _concat_as_views(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several Linears; each Linear keeps a view of its rows, so no copy remains."""
    w = torch.cat([m.weight for m in linears])
    has_bias = [m.bias is not None for m in linears]
    if any(has_bias) and not all(has_bias):
        raise ValueError("some projections have a bias and some do not")
    b = torch.cat([m.bias for m in linears]) if all(has_bias) else None
    at = 0
    for m in linears:
        n = m.out_features
        m.weight = torch.nn.Parameter(w[at : at + n], requires_grad=False)
        if b is not None:
            m.bias = torch.nn.Parameter(b[at : at + n], requires_grad=False)
        at += n
    return w, b


def _is_rmsnorm(m) -> bool:
    return (
        type(m).__name__.endswith("RMSNorm")
        and isinstance(getattr(m, "weight", None), torch.Tensor)
        and hasattr(m, "variance_epsilon")
    )


def _rmsnorm_forward(m, ops: LayerOps):
    w, eps = m.weight, m.variance_epsilon

    def forward(hidden_states):
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        return ops(x).rms_norm(x, w, eps).view(hidden_states.shape)

    return forward


def _rows(hidden_states):
    """A forward's input as rows: a NormedRow (one row, folded into the GEMM that reads it) stays as it is."""
    return hidden_states if isinstance(hidden_states, NormedRow) else hidden_states.reshape(-1, hidden_states.shape[-1])


def _like(x) -> torch.Tensor:
    """A tensor of x's rows, shape, dtype and device, for choosing kernels."""
    return x.residual if isinstance(x, NormedRow) else x


def _attention_forward(m, ops: LayerOps, opts: attention.LayerOpts):
    dim = m.head_dim
    # from the weights, not the config: under --tp a rank holds 1/N of the heads (gmtool.parallel.shard)
    heads, kv_heads = m.q_proj.out_features // dim, m.k_proj.out_features // dim
    w, b = _concat_as_views([m.q_proj, m.k_proj, m.v_proj])
    qn, kn = getattr(m, "q_norm", None), getattr(m, "k_norm", None)
    qw, kw = (qn.weight, kn.weight) if qn is not None else (None, None)
    eps = qn.variance_epsilon if qn is not None else 1e-6
    v_at = (heads + kv_heads) * dim

    def forward(hidden_states, position_embeddings=None, attention_mask=None, partial_sums=False, **kwargs):
        """partial_sums: o_proj may return Partials (only _residual_stream_forward asks: its norm sums them).
        hidden_states may be a NormedRow (_residual_stream_forward, where ops.folds)."""
        x = _rows(hidden_states)
        like = _like(x)
        t = like.shape[0]
        kernels = ops(like)
        ctx = attention.cache_writer() if kernels is not _REF else None
        # with the cache written by the QK kernel, v is its to read too: it may sum the GEMM's split-K partials
        qkv = ops.linear(x, w, b, partial=ctx is not None)
        rows = position_embeddings if isinstance(position_embeddings, RopeRows) else None
        if rows is not None and ctx is not None:  # the QK kernel reads the table at each token's position
            cos, sin = rows.cos_sin
        else:
            cos, sin = (e.reshape(t, dim) for e in (rows.gathered() if rows is not None else position_embeddings))
        if ctx is not None:  # this step's K/V go straight into the cache: one kernel fewer a layer
            layer = m.layer_idx
            kc, vc = ctx.cache.k[layer], ctx.cache.v[layer]
            q = kernels.qk_norm_rope_write_kv(
                qkv,
                heads,
                kv_heads,
                dim,
                cos,
                sin,
                qw,
                kw,
                eps,
                kc,
                vc,
                ctx.views.slot_mapping,
                positions=None if rows is None else rows.positions,
            )
            with ops.attention_launches(like):
                out = ctx.attend_cached(layer, q, m.scaling, opts=opts)
        else:
            q, k = kernels.qk_norm_rope(qkv, heads, kv_heads, dim, cos, sin, qw, kw, eps)
            v = qkv[:, v_at:].view(t, kv_heads, dim)
            with ops.attention_launches(like):
                out = attention.attend_tokens(m.layer_idx, q, k, v, m.scaling, opts)  # the layer's window, cap, sinks
        o = ops.project(m.o_proj, out.reshape(t, heads * dim), partial_sums)
        return (o if isinstance(o, Partials) else o.view(*hidden_states.shape[:-1], o.shape[-1])), None

    return forward


def _mlp_forward(m, ops: LayerOps):
    w, _ = _concat_as_views([m.gate_proj, m.up_proj])
    down = m.down_proj

    def forward(x, partial_sums=False):  # as the attention forward's
        rows = _rows(x)
        gate_up = ops.linear(rows, w, partial=True)
        if ops.silu_folds(rows, down):
            y = ops.silu_linear(gate_up, down, partial_sums)
        else:
            y = ops.project(down, ops(_like(rows)).silu_mul(gate_up), partial_sums)
        return y if isinstance(y, Partials) else y.view(*x.shape[:-1], -1)

    return forward


def _residual_stream_forward(base, ops: LayerOps, fused_mlps: set[int]):
    """The base model's forward with each residual add fused into the RMSNorm after it:
    x, residual = add_rms_norm(block_output, residual), as engines write their layers. A block's last projection
    on the small-M GEMM with split K hands its partial sums to that norm, which adds them (no reduce kernel): a
    forward hook on self_attn or mlp then sees gmtool.kernels.common.Partials, not a tensor (gmtool's own hooks,
    in verify, run on models without --fuse)."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    layers = list(base.layers[: base.config.num_hidden_layers])
    norms = [(layer.input_layernorm, layer.post_attention_layernorm) for layer in layers]
    mlp_kw = [{"partial_sums": True} if id(layer.mlp) in fused_mlps else {} for layer in layers]
    final = base.norm
    # A one-row step folds the embedding lookup and the first layer's norm (no residual yet: this zero row, made
    # here, outside any capture, where it would live in that graph's pool) into the first QKV GEMM.
    emb = base.embed_tokens.weight
    zero_row = torch.zeros(1, base.config.hidden_size, dtype=emb.dtype, device=emb.device)
    # a plain lookup whose rows the GEMM can address (row i at i * hidden)
    embedding_folds = type(base.embed_tokens) is torch.nn.Embedding and emb.is_contiguous()

    def forward(*, input_ids, position_ids, use_cache=False, **kwargs):
        # gmtool's call only (LoadedModel.forward_logits): no HF cache, embeddings or hidden-state outputs
        extra = [k for k, v in kwargs.items() if v is not None and v is not False]
        if use_cache or extra:
            raise ValueError(
                f"--fuse's base forward takes input_ids and position_ids only, got use_cache={use_cache} {extra}"
            )
        depth = base.config.num_hidden_layers  # read per call: compile-ahead's pass runs the first few only
        # one token, folded: zero_row stands for its row (shape, dtype, device), which no embedding kernel makes
        embedded = (
            depth > 0
            and ops.fold_first
            and embedding_folds
            and input_ids.numel() == 1
            and zero_row.device == input_ids.device
            and ops.folds(zero_row)
        )
        h = zero_row if embedded else base.embed_tokens(input_ids)
        table = base.rotary_emb.__dict__.get("forward")  # a RotaryTable where --fuse tabled RoPE
        # each layer's QK kernel reads its tokens' rows of the table itself where it writes the cache (Triton's)
        reads_rows = ops.rope_rows and isinstance(table, RotaryTable) and ops(h) is not _REF
        rope_rows = table.rows(h, position_ids) if reads_rows and attention.cache_writer() is not None else None
        pos = rope_rows if rope_rows is not None else base.rotary_emb(h, position_ids)
        shape = (*input_ids.shape, h.shape[-1])
        h = h.reshape(-1, shape[-1])
        kern = ops(h)
        residual = None
        rows = h.shape

        def block_output(y):
            return y if isinstance(y, Partials) else y.reshape(rows)

        def norm(x, residual, m, fold: bool):
            """(the next block's input, the residual): a NormedRow the block's first GEMM computes, where folded"""
            if not fold:
                y, total = kern.add_rms_norm(x, residual, m.weight, m.variance_epsilon)
                return y.view(shape), total
            row = NormedRow.of(x, residual, m.weight, m.variance_epsilon)
            return row, row.total

        fold = ops.folds(h)  # one row: the norms run inside the GEMMs after them (gmtool.kernels.folded)
        for layer, (pre, post), kw in zip(layers[:depth], norms, mlp_kw):
            if residual is None and embedded:  # rms_norm(emb[id] + 0) in the QKV GEMM, which also stores emb[id]
                x = NormedRow.embedded(emb, input_ids, zero_row, pre.weight, pre.variance_epsilon)
                residual = x.total
            elif residual is None:
                residual, x = h, kern.rms_norm(h, pre.weight, pre.variance_epsilon).view(shape)
            else:
                x, residual = norm(h, residual, pre, fold)
            a, _ = layer.self_attn(hidden_states=x, position_embeddings=pos, partial_sums=True)
            x, residual = norm(block_output(a), residual, post, fold and bool(kw))  # an unfused MLP takes a tensor
            h = block_output(layer.mlp(x, **kw))
        h = (
            kern.add_rms_norm(h, residual, final.weight, final.variance_epsilon)[0]
            if residual is not None
            else kern.rms_norm(h, final.weight, final.variance_epsilon)
        )
        return BaseModelOutputWithPast(last_hidden_state=h.view(shape))

    return forward


def _residual_stream_blocker(base, fused_attention: set) -> str | None:
    """None when _residual_stream_forward computes what base.forward does; else why not."""
    layer_type = FUSED_RESIDUAL.get(type(base).__name__)
    if layer_type is None:
        return f"residual add not fused into RMSNorm for {type(base).__name__}"
    layers = list(getattr(base, "layers", []))[: base.config.num_hidden_layers]
    if not layers or not all(hasattr(base, n) for n in ("embed_tokens", "rotary_emb", "norm")):
        return "residual add not fused: the base model lacks embed_tokens/rotary_emb/norm"
    for layer in layers:
        if type(layer).__name__ != layer_type or id(layer.self_attn) not in fused_attention:
            return "residual add not fused: a decoder layer is not the plain pre-norm block"
        if not all(_is_rmsnorm(getattr(layer, n, None)) for n in ("input_layernorm", "post_attention_layernorm")):
            return "residual add not fused: a decoder layer's norms are not RMSNorms"
    return None if _is_rmsnorm(base.norm) else "residual add not fused: the final norm is not an RMSNorm"


def _fusable_attention(m, cfg) -> str | None:
    """None when the fused forward computes what m.forward does; else why not."""
    if not all(isinstance(getattr(m, n, None), torch.nn.Linear) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return "attention without q/k/v/o projections"
    if _partial_rotary_factor(cfg) != 1.0:
        return "partial rotary embedding"
    if not _rotate_half_rope(m):
        return f"a rotary embedding other than rotate-half over the whole head ({type(m).__name__})"
    if not getattr(m, "use_rope", True):  # SmolLM3's NoPE layers (use_rope 0)
        return "a layer without RoPE"
    if _rope_under_a_condition(m):  # Flint: RoPE on its sliding-window layers only
        return f"RoPE applied under a condition in {type(m).__name__}.forward"
    extra = _extra_parts(m, ATTENTION_PARTS)
    if extra:
        return f"attention with more than q/k/v/o, q/k norms and sinks ({type(m).__name__}: {', '.join(extra)})"
    if (getattr(m, "q_norm", None) is None) != (getattr(m, "k_norm", None) is None):
        return "a norm on q or k only"
    if getattr(m, "q_norm", None) is not None and not (_is_rmsnorm(m.q_norm) and m.q_norm.weight.numel() == m.head_dim):
        return "q/k norms other than a per-head RMSNorm"
    return None


# what the fused forwards compute from; a module holding anything else (a gate, a sub-norm, learned scales:
# AFMoE, BitNet, HunYuan's query_layernorm, Dory's suv_gate) computes more than they do
ATTENTION_PARTS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm", "rotary_emb", "sinks"})
MLP_PARTS = frozenset({"gate_proj", "up_proj", "down_proj", "act_fn"})


def _extra_parts(m, known: frozenset) -> list[str]:
    """m's child modules that hold parameters, and its own parameters, that are not in known. A child without
    parameters (a function the kernels hub attaches, an activation) is not counted: each part the fused forwards
    lacked held weights, and the run's fused check (gmtool.measure.fused_check) judges the rest."""
    children = [n for n, c in m.named_children() if next(c.parameters(), None) is not None]
    names = children + [n for n, _ in m.named_parameters(recurse=False)]
    return sorted(set(names) - known)


def _partial_rotary_factor(cfg) -> float:
    """The share of each head RoPE rotates (other than 1.0 if any layer's is): the config's own field, or
    (transformers 5) its rope_parameters', which may hold one set per layer type."""
    rope = getattr(cfg, "rope_parameters", None)
    sets = [rope, *rope.values()] if isinstance(rope, dict) else []
    factors = [getattr(cfg, "partial_rotary_factor", None)]
    factors += [r.get("partial_rotary_factor") for r in sets if isinstance(r, dict)]
    return next((float(f) for f in factors if f and float(f) != 1.0), 1.0)


def _rope_under_a_condition(m) -> bool:
    """m's forward applies RoPE inside an if or a loop: only some layers or some calls rotate, which the fused
    forward, rotating always, cannot follow. Read from the source's syntax tree."""
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(type(m).forward)))
    except (OSError, TypeError, SyntaxError):
        return False
    fn = next((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
    if fn is None:
        return False
    branches = (ast.If, ast.IfExp, ast.For, ast.While, ast.Match, ast.BoolOp)

    def conditional(node, inside: bool) -> bool:
        for child in ast.iter_child_nodes(node):
            called = isinstance(child, ast.Call) and getattr(child.func, "id", None) == "apply_rotary_pos_emb"
            if called and inside:
                return True
            if conditional(child, inside or isinstance(child, branches)):
                return True
        return False

    return any(conditional(stmt, isinstance(stmt, branches)) for stmt in fn.body)


def _rotate_half_rope(m) -> bool:
    """The module's family applies RoPE as Llama does (x * cos + rotate_half(x) * sin, cos over the whole head),
    which the fused QK-norm+RoPE kernel computes; gpt-oss, for one, rotates with half-width cos/sin."""
    import inspect
    import sys

    module = sys.modules.get(type(m).__module__)
    fn, half = getattr(module, "apply_rotary_pos_emb", None), getattr(module, "rotate_half", None)
    fn, half = _hub_function(fn), _hub_function(half)
    try:
        if fn is None or "rotate_half(" not in inspect.getsource(fn) or half is None:
            return False
        x = torch.arange(4.0)
        # Cohere, ERNIE 4.5, Helium: a rotate_half that pairs neighbours (interleaved), not the two halves
        return torch.equal(half(x), torch.tensor([-2.0, -3.0, 0.0, 1.0]))
    except (OSError, TypeError, RuntimeError):
        return False


def _hub_function(fn):
    """The function itself. With the `kernels` package (a dependency of transformers from 5.25), transformers'
    @use_kernel_forward_from_hub turns a module-level function into an nn.Module instance whose forward calls
    the original, held in its closure as `func`; without it, the function is left as it is."""
    if fn is None or inspect.isfunction(fn):
        return fn
    forward = getattr(type(fn), "forward", None)
    code, cells = getattr(forward, "__code__", None), getattr(forward, "__closure__", None) or ()
    names = code.co_freevars if code is not None else ()
    inner = dict(zip(names, (c.cell_contents for c in cells))).get("func")
    return inner if inspect.isfunction(inner) else fn


@dataclass
class FusedLayers:
    """What --fuse changed: each entry is (module, fused forward); apply/remove switch them in and out."""

    patched: list = field(default_factory=list)
    counts: dict = field(
        default_factory=lambda: {"attention": 0, "mlp": 0, "rmsnorm": 0, "residual_adds": 0, "rope_positions": 0}
    )
    skipped: list[str] = field(default_factory=list)
    ops: LayerOps | None = None  # the kernels the fused forwards call (ops.small_m may be changed before capture)

    def apply(self) -> None:
        for m, fwd in self.patched:
            m.forward = fwd  # an instance attribute shadows the class's forward

    def remove(self) -> None:
        for m, _ in self.patched:
            m.__dict__.pop("forward", None)

    @property
    def summary(self) -> str:
        c = self.counts
        if not (c["attention"] or c["mlp"] or c["rmsnorm"]):  # the patterns matched nothing: its own layers run
            why = f": {'; '.join(sorted(set(self.skipped)))}" if self.skipped else ""
            return f"--fuse: nothing fused, the model's own layers run as without it{why}"
        s = (
            f"--fuse: {c['attention']} attention blocks (one QKV GEMM, QK-norm+RoPE in one kernel, which with Triton "
            f"also writes the step's K/V into the cache where the graph holds the attention), {c['mlp']} MLPs "
            f"(one gate/up GEMM, SiLU-and-mul in one kernel), {c['rmsnorm']} RMSNorms in one kernel each, "
            f"{c['residual_adds']} residual adds inside the RMSNorm after them"
        )
        if c["rope_positions"]:
            s += f"; RoPE's cos/sin gathered from a table of {c['rope_positions']} positions"
            if self.ops is not None and self.ops.triton and self.ops.rope_rows:
                s += " (by the QK kernel itself where it writes the cache)"

        if self.ops is not None and self.ops.triton and self.ops.small_m:
            s += f"; projections of up to {self.ops.small_m} tokens on gmtool's small-M GEMM"
            if self.ops.fold and c["residual_adds"]:
                from gmtool.kernels.folded import MAX_K

                s += (
                    "; at one token the add+RMSNorms before QKV and gate/up run inside those GEMMs "
                    f"(rows up to {MAX_K:,})"
                )
                if self.ops.fold_first:
                    s += ", the first QKV GEMM reading its row from the embedding table"
                if self.ops.fold_silu:
                    s += ", and down_proj computes SiLU-and-mul"
        if self.ops is not None and self.ops.triton and self.ops.pdl:
            s += (
                f"; Triton kernels of steps of up to {self.ops.small_m} tokens launched with PDL (the small-M GEMM "
                "prefetches its weight into L2 first)"
            )
        return s + (f"; left as they are: {'; '.join(sorted(set(self.skipped)))}" if self.skipped else "")


def fuse_layers(
    model: torch.nn.Module,
    attention_backend: str,
    layout=None,
    small_m: int = 0,
    pdl: int = 0,
    rope_positions: int = 0,
) -> FusedLayers:
    """layout: the model's probed KVLayout (gmtool.model.probe), whose per-layer options the fused attention
    passes on as the model's own forward does. small_m, pdl: see LayerOps. rope_positions: the longest sequence
    the run holds; its RoPE cos/sin become a table gathered by position (gmtool.model.rotary_table); 0: none."""
    cfg, ops = families.text_config(model.config), LayerOps(attention_backend, small_m, pdl)
    fused = FusedLayers(ops=ops)
    fused_attention: set[int] = set()
    fused_mlps: set[int] = set()
    act = str(getattr(cfg, "hidden_act", None) or getattr(cfg, "hidden_activation", None) or "").lower()
    silu = act in SILU
    base = families.base_model(model)
    for name, m in (base or model).named_modules():  # the text decoder's: not a vision tower's beside it
        if name.endswith("self_attn"):
            why = _fusable_attention(m, cfg)
            if why:
                fused.skipped.append(why)
            else:
                opts = layout.layers[m.layer_idx] if layout is not None else attention.PLAIN
                fused.patched.append((m, _attention_forward(m, ops, opts)))
                fused.counts["attention"] += 1
                fused_attention.add(id(m))
        elif name.endswith("mlp") and all(
            isinstance(getattr(m, n, None), torch.nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")
        ):
            if extra := _extra_parts(m, MLP_PARTS):
                fused.skipped.append(f"MLP with more than gate/up/down ({type(m).__name__}: {', '.join(extra)})")
            elif silu:
                fused.patched.append((m, _mlp_forward(m, ops)))
                fused.counts["mlp"] += 1
                fused_mlps.add(id(m))
            else:
                fused.skipped.append(f"MLP activation {act}")
        elif _is_rmsnorm(m) and not name.endswith(("q_norm", "k_norm")):
            fused.patched.append((m, _rmsnorm_forward(m, ops)))
            fused.counts["rmsnorm"] += 1
    if base is not None:
        why = _residual_stream_blocker(base, fused_attention)
        if why:
            fused.skipped.append(why)
        else:
            fused.patched.append((base, _residual_stream_forward(base, ops, fused_mlps)))
            fused.counts["residual_adds"] = 2 * base.config.num_hidden_layers
    rotary = getattr(base, "rotary_emb", None)
    if rope_positions and isinstance(rotary, torch.nn.Module):
        device = next(model.parameters()).device
        table, why = rotary_table.build(rotary, rope_positions, getattr(model, "dtype", torch.float32), device)
        if table is None:
            fused.skipped.append(why)
        else:
            fused.patched.append((rotary, table))
            fused.counts["rope_positions"] = table.positions
    fused.apply()
    return fused


@contextlib.contextmanager
def unfused(fused: FusedLayers | None):
    """The Hugging Face forwards for the duration (the weights are the same either way)."""
    if fused is None:
        yield
        return
    fused.remove()
    try:
        yield
    finally:
        fused.apply()
