"""Allocation traces of graph captures: what the caching allocator did for each capture's pool, as compact
JSON-able lists (the input of gmtool.memory.allocsim).

The recorder turns on torch's allocator history (torch.cuda.memory._record_memory_history, no stack context: an
entry costs little) and cuts it at each capture's boundaries (MemoryStrategy.pool_for and .captured): the
events between pool_for and captured are the capture's; those between captured and the next pool_for (the
upload (a replay where a step has runners), Python dropping the capture's leftovers, the next bucket's warm-up) are its `after` events.
Cutting takes a snapshot and clears the history, outside the timed capture (capture_s times begin..end only).

An event is [code, addr, size]: codes in CODES, size the bytes requested (alloc, free) or the segment's. Only
events in the strategy's pools are kept: a block's address lies in a pool segment (private-pool segments are
never cudaFree'd while their graphs live, so the segments listed after a capture hold every block it made).
"""

from __future__ import annotations

import torch

# torch's trace actions -> our codes; free_completed (not free_requested) is when a block is back in its pool
CODES = {"alloc": "a", "free_completed": "f", "segment_alloc": "S", "segment_free": "F"}
MAX_ENTRIES = 2_000_000  # per cut: a capture makes a few thousand


def history_available() -> tuple[bool, str]:
    """(can record, why not): CUDA and torch's private history API."""
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    mem = torch.cuda.memory
    if not (hasattr(mem, "_record_memory_history") and hasattr(mem, "_snapshot")):
        return False, f"torch {torch.__version__} has no torch.cuda.memory._record_memory_history/_snapshot"
    return True, ""


class TraceRecorder:
    """Allocator history on one device, cut into consecutive windows."""

    def __init__(self, device_index: int):
        self.index = device_index
        self.on = False

    def start(self) -> None:
        torch.cuda.memory._record_memory_history("all", context=None, stacks="python", max_entries=MAX_ENTRIES)
        self.on = True

    def cut(self) -> list[dict]:
        """The device's trace entries since the last cut (or start); the history is cleared for the next."""
        if not self.on:
            return []
        snap = torch.cuda.memory._snapshot()
        traces = snap.get("device_traces") or []
        got = list(traces[self.index]) if self.index < len(traces) else []
        torch.cuda.memory._record_memory_history(None)  # disabling clears torch's buffer
        self.start()
        return got

    def stop(self) -> None:
        if self.on:
            torch.cuda.memory._record_memory_history(None)
            self.on = False


def compact(entries: list[dict], spans: list[tuple[int, int, int]]) -> list[list]:
    """[code, addr, size, pool] of the entries whose address lies in one of spans (start, end, pool ordinal)."""
    out = []
    for e in entries:
        code = CODES.get(e.get("action"))
        if code is None or "addr" not in e:
            continue
        addr = int(e["addr"])
        pool = next((p for lo, hi, p in spans if lo <= addr < hi), None)
        if pool is not None:
            out.append([code, addr, int(e.get("size", 0)), pool])
    return out


class CaptureTraces:
    """A strategy's captures as traces: per capture its pool's ordinal (one per distinct pool id, in first use
    order), its events, its `after` events and the pool's segments once it was captured."""

    def __init__(self, device_index: int):
        self.recorder = TraceRecorder(device_index)
        self.captures: list[dict] = []
        self.pools: dict[tuple, int] = {}  # pool id -> ordinal
        self.spans: list[tuple[int, int, int]] = []  # every pool segment seen so far
        self.dropped = 0  # entries outside our pools (default pool: eager runs, warm-up)
        self.failed: list[str] = []  # captures that began and never ended (their events are left out)
        self._open = None

    def begin(self, key, pool_id) -> None:
        """Before a capture (MemoryStrategy.pool_for): what happened since the last capture ended is its tail;
        after a capture that failed, the failed capture's events, which are left out."""
        if not self.recorder.on:
            self.recorder.start()
        elif self._open is not None:
            self.failed.append(self._open)
            self.dropped += len(self.recorder.cut())
        else:
            self._tail(self.recorder.cut())
        self.pools.setdefault(tuple(pool_id), len(self.pools))
        self._open = str(key)

    def end(self, key, pool_id, segments: list[dict]) -> None:
        """After the capture (MemoryStrategy.captured): segments are its pool's, from torch.cuda.memory_snapshot."""
        entries = self.recorder.cut()
        self._open = None
        ordinal = self.pools[tuple(pool_id)]
        known = {lo for lo, _, _ in self.spans}
        self.spans += [
            (s["address"], s["address"] + s["total_size"], ordinal) for s in segments if s["address"] not in known
        ]
        events = compact(entries, self.spans)
        self.dropped += len(entries) - len(events)
        self.captures.append(
            {
                "key": str(key),
                "bucket": getattr(key, "num_tokens", None),
                "pool": ordinal,
                "events": events,
                "after": [],
                "segments": sorted([s["address"], s["total_size"]] for s in segments),
                "pool_bytes": sum(s["total_size"] for s in segments),
            }
        )

    def finish(self) -> None:
        """The last capture's tail, and recording off: call while the graphs still live."""
        if self.recorder.on and self._open is None:
            self._tail(self.recorder.cut())
        elif self._open is not None:
            self.failed.append(self._open)
            self._open = None
        self.recorder.stop()

    def _tail(self, entries: list[dict]) -> None:
        if self.captures:
            events = compact(entries, self.spans)
            self.dropped += len(entries) - len(events)
            self.captures[-1]["after"] += events

    def to_dict(self) -> dict:
        return {
            "captures": self.captures,
            "pools": len(self.pools),
            "dropped_entries": self.dropped,
            "failed_captures": self.failed,
        }
