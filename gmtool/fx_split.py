"""Compiler-split piecewise graphs (the second seed's design): torch.compile traces the forward into one FX
graph, which is split at the registered attention op (original order kept); every non-attention submodule is
captured as a graph piece, attention submodules run between them at replay.

Shapes are static per bucket (dynamic=False), so each bucket is traced and split once; that trace/split time
is reported as compile_s, apart from capture_s.
"""
from __future__ import annotations

import torch
import torch.fx
from torch.fx.passes.split_module import split_module

from gmtool import attention
from gmtool.errors import CaptureError

ATTENTION_OPS = {"gmtool.attention", "gmtool.attention.default"}  # dynamo records the packet


@torch.library.custom_op("gmtool::attention", mutates_args=("out",))
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer: int,
                 scale: float) -> None:
    """Opaque to the compiler: it reads the live forward context (this batch's metadata) when it runs."""
    attention.current_context().attend(layer, q, k, v, scale, out=out)


@attention_op.register_fake
def _(q, k, v, out, layer, scale) -> None:
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
        self.fx, self.inner = fx, inner

    def forward(self, *args):
        steps = self.fx.recording
        if steps is None:
            return self.inner(*args)
        backend = self.fx.executor.backend
        backend.begin()
        out = self.inner(*args)
        steps.append(backend.end())
        return out


class FxAttentionRunner:
    """An attention submodule bound to the tensors the neighbouring pieces produce and read."""

    is_runner = True

    def __init__(self, inner, args, ctx):
        self.inner, self.args, self.ctx = inner, args, ctx

    def replay(self) -> None:
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
    def __init__(self, executor):
        self.executor = executor
        self.recording: list | None = None
        self.splits: list[tuple[int, int]] = []  # (pieces, attention submodules) per traced bucket
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
        self.compiled = torch.compile(self._forward, backend=self._backend, fullgraph=True, dynamic=False)

    def _forward(self, input_ids, positions, logits_indices, logits):
        logits.copy_(self.executor.lm.forward_logits(input_ids, positions, logits_indices))

    def _backend(self, gm: torch.fx.GraphModule, example_inputs):
        split, attn_names = split_at_attention(gm)
        for name, child in list(split.named_children()):
            wrap = _Attention if name in attn_names else _Piece
            setattr(split, name, wrap(self, child))
        self.splits.append((len(list(split.named_children())) - len(attn_names), len(attn_names)))
        return split

    def forward(self, views) -> None:
        with attention.opaque_attention():
            self.compiled(views.input_ids, views.positions, views.logits_indices, views.logits)

    def record(self, steps: list, fn) -> None:
        self.recording = steps
        try:
            fn()
        except torch._dynamo.exc.Unsupported as e:
            raise CaptureError(f"torch.compile could not trace the model: {str(e).splitlines()[0]}") from None
        finally:
            self.recording = None


def enable_fx_piecewise(executor) -> FxPiecewise:
    executor.fx = FxPiecewise(executor)
    return executor.fx
