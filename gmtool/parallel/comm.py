"""This process's place in a tensor-parallel run, and the collectives the model and the sweep use.

A run without --tp has no group: rank 0 of 1, and nothing here communicates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Place:
    rank: int = 0
    world: int = 1
    local_rank: int = 0  # the CUDA device index of this rank


_place = Place()


def place() -> Place:
    return _place


def set_place(p: Place) -> None:
    global _place
    _place = p


def is_writer() -> bool:
    """Rank 0 writes the results; the other ranks measure and send their rows to it."""
    return _place.rank == 0


@torch.library.custom_op("gmtool::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the ranks, into a new tensor. A custom op so every capture sees it as one step: the CPU tape
    records it (and re-runs the gloo collective at each replay), CUDA graphs capture NCCL's kernel, and
    dynamo (the FX split) keeps it as one opaque node."""
    out = x.clone()
    dist.all_reduce(out)
    return out


@all_reduce.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def agree(why: str | None) -> str | None:
    """One verdict for every rank (the first rank's failure, named), so that all of them skip or time the same
    replays: a rank timing a replay alone would wait in its all-reduces for ranks that moved on."""
    if _place.world == 1:
        return why
    everyone = [None] * _place.world
    dist.all_gather_object(everyone, why)
    rank, first = next(((r, w) for r, w in enumerate(everyone) if w), (None, None))
    return first if rank in (None, _place.rank) else f"rank {rank}: {first}"


def gather_records(records: list) -> list | None:
    """Every rank's rows, each marked with its rank: on rank 0 all of them in rank order, on the others None."""
    if _place.world == 1:
        return records
    everyone = [None] * _place.world if is_writer() else None
    dist.gather_object(records, everyone, dst=0)
    if not is_writer():
        return None
    out = []
    for rank, recs in enumerate(everyone):
        for r in recs:
            r.rank = rank
        out += recs
    return out
