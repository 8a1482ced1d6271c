"""How an executor runs the model's forward: eagerly (warm-up, the same-shape check) and under capture.

One strategy per way of cutting the forward into captured steps, chosen when the executor is made:
- WholeGraph: the HF forward captured as one graph (full).
- RuntimeSplit: the HF forward, capture ended at each attention call; attention runs between the pieces at
  replay (piecewise, `--piecewise-impl breakable`).
- FxSplit: torch.compile traces the forward and splits it at the registered attention op; each piece captures
  itself (piecewise, `--piecewise-impl fx`; with inductor, each piece is compiled first: `--compile`).
- CompiledWhole: Inductor compiles the whole forward, captured as one graph (full `--compile`).
- Fallback(primary, secondary): the primary until its first warm-up fails (a model dynamo cannot trace), then
  the secondary, saying why.
"""

from __future__ import annotations

import contextlib

import torch

from gmtool.core.executor import AttentionRunner
from gmtool.errors import CaptureError, OutOfMemory, first_line
from gmtool.model.attention import current_context


def logits_rows(views):
    """What forward_hidden takes the logits' rows by: a decode step's are its first rows, one token a sequence in
    order (a padded sequence's row is its padding token's, unread), so no gather kernel; else logits_indices.
    qwen3-0.6b --fuse --small-m-gemm --pdl (H200, 2026-12-02, .diag/microab.py, alternated in one process): B=1
    kv 1,024 0.803-0.804 ms against 0.805-0.806 with the gather, B=8 1.144 against 1.151."""
    return views.logits.shape[0] if current_context().impl == "decode" else views.logits_indices


class WholeGraph:
    label = "whole"
    compiles = False  # True: the first warm-up of a shape traces (and compiles) it: reported as compile_s

    def run(self, ex, views) -> None:
        ex.lm.logits_into(ex.lm.forward_hidden(views.input_ids, views.positions, logits_rows(views)), views.logits)

    def warmup(self, ex, fn) -> None:
        ex.backend.warmup(fn)

    def record(self, ex, entry, fn) -> None:
        """Called with the capture begun and the copy-in recorded: everything up to the end of the forward."""
        fn()
        entry.steps.append(ex.backend.end())

    def release(self) -> None:
        """What the strategy holds beyond the executor's graphs (fx: dynamo's compiled code)."""


def lm_head(ex, views) -> None:
    """fx: the LM head over the hidden rows its pieces left in ex.last_hidden (outside the pool), written straight
    into the persistent logits: a num_tokens key pads its rows to every sequence the bucket can hold, and those
    padded logits in a piece's pool were most of the pieces' memory (H200, qwen3-0.6b, 128 tokens: 35 of
    38.5 MiB). Inside the last graph, a stitched step is one launch: run eagerly after it, the head cost
    more host time than the whole stitched graph's launch."""
    ex.lm.logits_into(ex.last_hidden[: views.logits.shape[0]], views.logits)


class RuntimeSplit(WholeGraph):
    """Pieces end at each attention call; the last one ends with the LM head."""

    label = "breakable"  # run: WholeGraph's; the head reads the forward's rows where they are, in the last piece

    def record(self, ex, entry, fn) -> None:
        def attention_break(layer, q, k, v, scale, opts):
            # the K/V write and a copy of q end the piece: the runner then holds no tensor of the piece
            # (holding them would keep every layer's q/k/v alive in the pool), and launches only the attention
            entry.ctx.write_kv(layer, k, v)
            q_in = ex.attn_q[: q.shape[0]]
            q_in.copy_(q)
            entry.steps.append(ex.backend.end())
            out = ex.attn_out[: q.shape[0], :, : v.shape[-1]]
            entry.steps.append(AttentionRunner(layer, q_in, out, scale, entry.ctx, opts))
            ex.backend.begin()
            return out

        entry.ctx.breaker = attention_break
        try:
            super().record(ex, entry, fn)
        finally:
            entry.ctx.breaker = None


class FxSplit(WholeGraph):
    label = "fx"
    compiles = True

    def __init__(self, lm, split: bool = True, inductor: bool = False):
        from gmtool.model.fx_split import FxPiecewise

        self.fx = FxPiecewise(lm, split=split, inductor=inductor)

    def run(self, ex, views) -> None:
        if not self.fx.split:
            return self.fx.forward(views, views.logits)
        self.fx.forward(views, ex.last_hidden[: views.logits.shape[0]])
        if self.fx.recording is None:  # eager; under capture, record() captures it after the pieces
            lm_head(ex, views)

    def release(self) -> None:
        self.fx.release()

    def record(self, ex, entry, fn) -> None:
        if not self.fx.split:
            return super().record(ex, entry, fn)
        entry.steps.append(ex.backend.end())  # the copy-in, alone: the pieces capture themselves
        entry.copy_steps = 1
        self.fx.record(entry.steps, fn, ex.backend)
        ex.backend.begin()  # the pieces captured themselves; the LM head is one more graph
        with self.fx.piece_mode or contextlib.nullcontext():  # verify's op recorder sees the head as a piece
            lm_head(ex, ex.inputs.views(entry.key))
        entry.steps.append(ex.backend.end())


def CompiledWhole(lm) -> FxSplit:  # noqa: N802 (a strategy, named as the others)
    return FxSplit(lm, split=False, inductor=True)


class Fallback:
    def __init__(self, primary, secondary):
        self.primary = primary
        self.active, self.secondary, self.reason = primary, secondary, None
        self.traced = False  # the primary has warmed a shape up: a later failure is that shape's, not the model's

    @property
    def label(self) -> str:
        return self.active.label if self.reason is None else f"{self.secondary.label} ({self.reason})"

    @property
    def compiles(self) -> bool:
        return self.active.compiles

    def run(self, ex, views) -> None:
        self.active.run(ex, views)

    def warmup(self, ex, fn) -> None:
        if self.reason is not None:
            return self.active.warmup(ex, fn)
        try:
            self.active.warmup(ex, fn)
        except (torch.OutOfMemoryError, OutOfMemory, CaptureError):  # the run's to handle, not a trace's
            raise
        except Exception as e:  # dynamo raises many types
            why = first_line(e)[:160]
            if self.traced:  # another shape traced: this failure is this shape's, and the run records it
                raise CaptureError(f"fx could not trace this shape: {why}") from None
            self.active, self.reason = self.secondary, f"fx could not trace: {why}"
            self.active.warmup(ex, fn)
        else:
            self.traced = True

    def record(self, ex, entry, fn) -> None:
        self.active.record(ex, entry, fn)

    def release(self) -> None:
        self.primary.release()
        self.secondary.release()


def forward_for(mode, lm, piecewise_impl: str, compile: bool):
    """The strategy a mode's executor runs, from the run's options."""
    if mode.piecewise:
        if piecewise_impl == "fx" or compile:  # --compile goes through the FX split
            return Fallback(FxSplit(lm, inductor=compile), RuntimeSplit())
        return RuntimeSplit()
    return Fallback(CompiledWhole(lm), WholeGraph()) if compile else WholeGraph()
