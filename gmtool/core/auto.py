"""A composite mode's executor (`auto`): one executor per kind of batch, chosen per batch, eager above them all.

As engines default to: uniform decode batches replay full graphs (one per decode bucket), prefill and mixed
batches replay piecewise graphs (attention runs between the pieces, so one graph per token count serves any
mix), and a batch above the largest bucket runs eagerly on its exact shape. The two executors share one input
arena and one graph backend; their keys never collide (decode keys are marked decode), so one memory strategy
holds both sets of graphs and its per-key figures sum over the two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gmtool.core.batch import Batch
from gmtool.core.buckets import BucketKey
from gmtool.core.executor import CapturedGraph, GraphExecutor
from gmtool.errors import GmtoolError
from gmtool.model.attention import ForwardContext, forward_context
from gmtool.modes import GraphMode


@dataclass
class EagerStep(CapturedGraph):
    """A batch above the largest bucket: the forward run eagerly on the exact batch (no graph, no padding)."""

    executor: GraphExecutor | None = None  # whose forward strategy runs it

    def replay(self, batch: Batch, refresh_metadata: bool = True) -> None:
        self.check_inputs()  # its views are the arena's at this key's offsets, as a graph's
        self.ctx.prepare(batch.plan)
        with forward_context(self.ctx), torch.no_grad():
            self.executor.forward(self.ctx.views)


def parts_of(ex) -> list[GraphExecutor]:
    """The graph executors behind ex: an AutoExecutor's parts, or ex itself (what patches an executor's
    capture, attention or forward, as verify's faults and dynamic-dimension records do, applies to each)."""
    parts = getattr(ex, "parts", None)
    return list(parts.values()) if parts else [ex]


def part_owning(ex, entry: CapturedGraph) -> GraphExecutor | None:
    """The executor among parts_of(ex) whose graphs hold entry; None: an eager step (no graph)."""
    return next((p for p in parts_of(ex) if p.graphs.get(entry.key) is entry), None)


class AutoExecutor:
    def __init__(self, mode: GraphMode, parts: dict[str, GraphExecutor]):
        """parts: the executor serving each kind of batch, as mode.composed_of names them."""
        self.mode = GraphMode(mode)
        self.parts = parts
        first, *rest = parts.values()
        for ex in rest:  # one arena: a step's inputs land where checks and outputs read them, whoever serves
            ex.inputs, ex.backend = first.inputs, first.backend
        self.inputs, self.backend, self.cache, self.device = first.inputs, first.backend, first.cache, first.device
        self.memory, self.policy, self.lm = first.memory, first.policy, first.lm
        self.eager: dict[BucketKey, EagerStep] = {}

    def part_for(self, batch: Batch) -> GraphExecutor | None:
        """The executor serving batch; None: above the largest bucket (eager)."""
        if batch.num_tokens > self.policy.largest and batch.composition.bucket is None:
            return None
        return self.parts["decode" if batch.is_decode else "mixed"]

    def served_by(self, batch: Batch) -> str:
        part = self.part_for(batch)
        return part.mode.served_by if part is not None else GraphMode.EAGER.served_by

    @property
    def graphs(self) -> dict[BucketKey, CapturedGraph]:
        return {k: g for ex in self.parts.values() for k, g in ex.graphs.items()}

    @property
    def refresh_runner_metadata(self) -> bool:
        return all(ex.refresh_runner_metadata for ex in self.parts.values())

    @refresh_runner_metadata.setter
    def refresh_runner_metadata(self, value: bool) -> None:
        for ex in self.parts.values():
            ex.refresh_runner_metadata = value

    def key_for(self, batch: Batch) -> BucketKey:
        part = self.part_for(batch)
        if part is None:
            return BucketKey(batch.num_tokens, batch.num_seqs, batch.is_decode)
        return part.key_for(batch)

    def prepare(self, batch: Batch) -> CapturedGraph:
        part = self.part_for(batch)
        if part is not None:
            return part.prepare(batch)
        if batch.num_tokens > self.inputs.max_tokens or batch.num_seqs > self.inputs.max_seqs:
            raise GmtoolError(
                f"a batch of {batch.num_tokens} tokens and {batch.num_seqs} sequences is above "
                f"--max-tokens {self.inputs.max_tokens} / --max-num-seqs {self.inputs.max_seqs}"
            )
        key = self.key_for(batch)
        views = self.inputs.load(batch, key)
        entry = self.eager.get(key)
        if entry is None:
            impl = "decode" if batch.is_decode else "planned"
            ctx = ForwardContext(
                self.cache, views, impl, batch.plan, batch.num_seqs, backend=self._decode_part.attention
            )
            entry = self.eager[key] = EagerStep(
                key,
                GraphMode.EAGER,
                impl,
                [],
                ctx,
                captured_with=batch.composition.label,
                inputs=self.inputs,
                executor=self._decode_part,
            )
        return entry

    @property
    def _decode_part(self) -> GraphExecutor:
        return self.parts["decode"]

    def eager_same_shape(self, batch: Batch) -> torch.Tensor:
        part = self.part_for(batch)
        if part is not None:
            return part.eager_same_shape(batch)
        self.prepare(batch).replay(batch)
        return self.inputs.logits[: batch.num_seqs]

    def step(self, batch: Batch) -> torch.Tensor:
        entry = self.prepare(batch)
        entry.replay(batch, self.refresh_runner_metadata)
        return self.output(entry, batch)

    def output(self, entry, batch: Batch) -> torch.Tensor:
        """The logits rows step() hands out for batch after entry's replay: what the judge reads."""
        return self.inputs.output(entry.key, batch.num_seqs)

    def release(self) -> None:
        """Every part's graphs first, then the shared backend and memory strategy: a pool must outlive every
        graph captured into it, the other part's included."""
        self.eager.clear()
        for ex in self.parts.values():
            ex.drop_graphs()
            ex.forward_impl.release()
        self.backend.release()
        if self.memory is not None:
            self.memory.release()
