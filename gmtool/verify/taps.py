"""Per-layer outputs copied into persistent buffers, so a graph's intermediates can be compared with eager's.

Forward hooks on the embedding, each decoder layer's attention, MLP and output, and the final norm copy their
output into one row block of a buffer allocated before any capture. The copies are part of every graph
captured while the hooks are on (a kernel on CUDA, an op on the CPU tape), so a replay leaves its own
per-layer values behind; an eager run with the other buffer as target leaves eager's. The first tap, in
forward order, where they differ names the layer and the tensor where the replay went wrong.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from functools import partial

import torch

from gmtool.errors import GmtoolError
from gmtool.measure.timing import rel_err_per_seq
from gmtool.model import families


@dataclass
class Divergence:
    tensor: str  # "output of model.layers.1.mlp"
    module: str
    layer: int | None  # decoder layer index; None for the embedding and the final norm
    piece: int | None  # piecewise: the captured piece holding it (pieces are cut at each attention call)
    rel_err_same_shape: float  # vs the same padded computation run eagerly
    rel_err_unpadded: float  # vs the exact batch run eagerly
    token: int  # the first token row above tolerance
    sequence: int

    def to_dict(self) -> dict:
        return asdict(self)


class LayerTaps:
    def __init__(self, lm, max_tokens: int, device: torch.device):
        model = lm.model
        stack = families.decoder_layers(model, lm.num_layers)
        if stack is None:
            raise GmtoolError(
                f"verify's per-layer taps find no decoder layers in {type(model).__name__}: "
                "run capture or compare on this model, which check the logits"
            )
        names = {id(m): n for n, m in model.named_modules()}
        embed = model.get_input_embeddings()
        points: list[tuple[torch.nn.Module, int | None, bool]] = [(embed, None, False)]  # module, layer, attention
        for i, layer in enumerate(stack[: lm.num_layers]):
            attn, mlp = families.part(layer, families.ATTENTION_NAMES), families.part(layer, families.MLP_NAMES)
            points += [(m, i, m is attn) for m in (attn, mlp, layer) if m is not None]
        if (norm := families.part(families.base_model(model), families.FINAL_NORM_NAMES)) is not None:
            points.append((norm, None, False))
        self.modules = [names[id(m)] for m, *_ in points]
        self.layers = [i for _, i, _ in points]
        self.attention = [a for *_, a in points]
        width = getattr(families.text_config(lm.config), "hidden_size", None) or embed.weight.shape[-1]
        self.graph_buf = torch.zeros(len(points), max_tokens, width, dtype=model.dtype, device=device)
        self.eager_buf = torch.zeros_like(self.graph_buf)
        self.target = self.graph_buf
        self._hooks = [m.register_forward_hook(partial(self._tap, j)) for j, (m, *_) in enumerate(points)]

    @property
    def buffers(self) -> list[torch.Tensor]:
        return [self.graph_buf, self.eager_buf]

    def _tap(self, j: int, module, args, out) -> None:
        t = out[0] if isinstance(out, tuple) else out
        t = t.reshape(-1, t.shape[-1])
        self.target[j, : t.shape[0]].copy_(t)

    @contextlib.contextmanager
    def into_eager(self):
        self.target = self.eager_buf
        try:
            yield
        finally:
            self.target = self.graph_buf

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()

    def piece_of(self, j: int) -> int:
        """Breakable piecewise graphs end at each attention call: piece i+1 runs layer i from its attention's
        output projection until the next layer's attention."""
        before = sum(self.attention[:j])  # attention calls completed before tap j's module starts
        return before + (1 if self.attention[j] else 0)

    def first_divergence(
        self,
        graph: torch.Tensor,
        same: torch.Tensor,
        unpadded: torch.Tensor,
        token_seq,
        tols: tuple[float, float],
        piecewise: bool,
    ) -> Divergence | None:
        """graph/same/unpadded: [taps, n, width] for the batch's n real tokens."""
        tol_same, tol = tols
        for j in range(graph.shape[0]):
            e_same, e_unp = rel_err_per_seq(graph[j], same[j]), rel_err_per_seq(graph[j], unpadded[j])
            if e_same <= tol_same and e_unp <= tol:
                continue
            rows = _row_errors(graph[j], unpadded[j] if not e_unp <= tol else same[j])
            bad = rows > (tol if not e_unp <= tol else tol_same)
            token = int(bad.nonzero()[0]) if bad.any() else 0
            return Divergence(
                f"output of {self.modules[j]}",
                self.modules[j],
                self.layers[j],
                self.piece_of(j) if piecewise else None,
                e_same,
                e_unp,
                token,
                int(token_seq[token]),
            )
        return None


def _row_errors(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.double(), b.double()
    err = (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-30)
    return torch.where(torch.isfinite(err), err, torch.full_like(err, float("inf")))
