"""Compiled forwards with attention as one opaque registered op.

- split (piecewise, the second seed's design): torch.compile traces the forward into one FX graph, split at
  the attention op (original order kept); each non-attention submodule is captured as a graph piece, the
  attention submodules run between them at replay. With inductor, each piece is compiled first.
- no split (full graph --compile): Inductor compiles the whole forward, attention an extern call inside it,
  and the executor captures it as one graph.

Shapes are static per bucket (dynamic=False): each bucket is traced (and compiled) once; that time is
reported as compile_s, apart from capture_s.
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch.fx
from torch.fx.passes.split_module import split_module

from gmtool.model import attention
from gmtool.errors import CaptureError

ATTENTION_OPS = {"gmtool.attention", "gmtool.attention.default"}  # dynamo records the packet


@torch.library.custom_op("gmtool::attention", mutates_args=("out",))
def attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    layer: int,
    scale: float,
    window: int,
    softcap: float,
    sinks: torch.Tensor | None,
) -> None:
    """Opaque to the compiler: it reads the live forward context (this batch's metadata) when it runs. The
    layer's options travel as arguments (0: none), baked into the traced graph as the layer's own."""
    opts = attention.LayerOpts(window or None, softcap or None, sinks)
    attention.current_context().attend(layer, q, k, v, scale, out=out, opts=opts)


@attention_op.register_fake
def _(q, k, v, out, layer, scale, window, softcap, sinks) -> None:
    return None


def split_at_attention(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, set[str]]:
    """Each attention call gets a submodule of its own; the next node starts a new one."""
    ids, sid, attn_ids = {}, 0, set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and str(node.target) in ATTENTION_OPS:
            sid += 1
            ids[node] = sid
            attn_ids.add(sid)
            sid += 1
        else:
            ids[node] = sid
    split = split_module(gm, None, lambda n: ids[n], keep_original_order=True)
    return split, {f"submod_{i}" for i in attn_ids}


class _Piece(torch.nn.Module):
    """While recording, each call of a non-attention submodule becomes one captured graph."""

    def __init__(self, fx: "FxPiecewise", inner):
        super().__init__()
        self.fx = fx
        self.inner = torch.compile(inner, backend="inductor", fullgraph=True, dynamic=False) if fx.inductor else inner

    def forward(self, *args):
        steps = self.fx.recording
        if steps is None:
            return self.inner(*args)
        backend = self.fx.backend
        backend.begin()
        with self.fx.piece_mode or contextlib.nullcontext():
            out = self.inner(*args)
        steps.append(backend.end())
        return out


ATTENTION_PARAMS = ("q", "k", "v", "out", "layer", "scale", "window", "softcap", "sinks")  # attention_op's


def attention_call(inner: torch.fx.GraphModule, args) -> dict | None:
    """The attention op's arguments in an attention submodule called with args, by name (ATTENTION_PARAMS);
    None when the submodule holds anything else than that one call."""
    nodes = [n for n in inner.graph.nodes if n.op not in ("placeholder", "output")]
    holders = [n for n in inner.graph.nodes if n.op == "placeholder"]
    if len(nodes) != 1 or str(nodes[0].target) not in ATTENTION_OPS or len(holders) != len(args):
        return None
    env = dict(zip(holders, args))
    values = {**dict(zip(ATTENTION_PARAMS, nodes[0].args)), **nodes[0].kwargs}
    if set(values) != set(ATTENTION_PARAMS):
        return None
    if any(isinstance(a, torch.fx.Node) and a not in env for a in values.values()):
        return None  # read from elsewhere than its inputs (a get_attr): left to the submodule
    return {k: env[a] if isinstance(a, torch.fx.Node) else a for k, a in values.items()}


class FxAttentionRunner:
    """An attention submodule bound to the tensors the neighbouring pieces produce and read. Its op's call is
    bound once (ForwardContext.bind_attend: the K/V write, then the attention), so a replay launches the
    kernels without the submodule, the op dispatcher or Triton's argument binding; a submodule of another
    shape is called as it is."""

    is_runner = True

    def __init__(self, inner, args, ctx):
        self.inner, self.args, self.ctx = inner, args, ctx
        call = attention_call(inner, args)
        self.launch = None
        if call is not None:
            opts = attention.LayerOpts(call["window"] or None, call["softcap"] or None, call["sinks"])
            self.launch = ctx.bind_attend(
                call["layer"], call["q"], call["k"], call["v"], call["scale"], call["out"], opts
            )

    @property
    def launch_paths(self) -> tuple[str, ...]:
        return getattr(self.launch, "paths", ())

    def replay(self) -> None:
        if self.launch is not None:
            return self.launch()
        with attention.forward_context(self.ctx):
            self.inner(*self.args)


class _Attention(torch.nn.Module):
    def __init__(self, fx: "FxPiecewise", inner):
        super().__init__()
        self.fx, self.inner = fx, inner

    def forward(self, *args):
        if self.fx.recording is None:
            return self.inner(*args)
        # not run at capture (the seed's design): its inputs come from the piece just captured
        self.fx.recording.append(FxAttentionRunner(self.inner, args, attention.current_context()))
        return None


class FxPiecewise:
    def __init__(self, lm, split: bool = True, inductor: bool = False):
        self.lm, self.split, self.inductor = lm, split, inductor
        self.recording: list | None = None
        self.backend = None  # the graph backend of the capture under way
        self.splits: list[tuple[int, int]] = []  # (pieces, attention submodules) per traced bucket
        # entered around each piece's capture and the LM head's (verify's op recorder): torch.compile traces
        # nothing, and runs none of its compiled code, under a dispatch mode entered around the compiled call
        self.piece_mode = None
        for name in ("cache_size_limit", "recompile_limit"):  # one trace per bucket shape
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 256))
        # a code object of its own: dynamo keeps the compiled entries on the code object, each guarded on this
        # instance. Shared by every instance, they piled up to the accumulated limit (256, about 36 verify runs in
        # one process), after which every split fell back to the run-time one
        fn = FxPiecewise._forward
        self._code = fn.__code__.replace()
        forward = types.MethodType(types.FunctionType(self._code, fn.__globals__, fn.__name__), self)
        backend = self._backend if split else "inductor"
        self.compiled = torch.compile(forward, backend=backend, fullgraph=True, dynamic=False)

    def release(self) -> None:
        """Drop dynamo's compiled entries of this instance's code; a later call traces again. (The model stays
        reachable from dynamo's cache of compile wrappers, which holds this instance's backend.)"""
        reset = getattr(torch._dynamo, "reset_code", None)
        if reset is not None:
            reset(self._code)

    def _forward(self, input_ids, positions, logits_indices, out):
        """Split: out is the hidden rows the LM head reads after the pieces; whole: the logits."""
        if self.split:
            out.copy_(self.lm.forward_hidden(input_ids, positions, logits_indices))
        else:
            out.copy_(self.lm.forward_logits(input_ids, positions, logits_indices))

    def _backend(self, gm: torch.fx.GraphModule, example_inputs):
        split, attn_names = split_at_attention(gm)
        for name, child in list(split.named_children()):
            wrap = _Attention if name in attn_names else _Piece
            setattr(split, name, wrap(self, child))
        self.splits.append((len(list(split.named_children())) - len(attn_names), len(attn_names)))
        return split

    def forward(self, views, out) -> None:
        with attention.opaque_attention():
            self.compiled(views.input_ids, views.positions, views.logits_indices, out)

    def record(self, steps: list, fn, backend) -> None:
        self.recording, self.backend = steps, backend
        try:
            fn()
        except torch._dynamo.exc.Unsupported as e:
            raise CaptureError(f"torch.compile could not trace the model: {str(e).splitlines()[0]}") from None
        finally:
            self.recording, self.backend = None, None
