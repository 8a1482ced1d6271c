"""The capture/replay contract every backend honours.

- `begin()` ... `end()` records the device work issued in between into a Graph; nothing recorded reads a host
  value at replay: host scalars, Python control flow and tensor addresses are frozen at capture.
- `Graph.replay()` re-runs exactly that work over the same tensors (persistent inputs, the graph's own
  intermediates, persistent outputs). An input not copied into its persistent buffer is not seen.
"""

from __future__ import annotations

from typing import Protocol


class Graph(Protocol):
    def replay(self) -> None: ...


class GraphBackend(Protocol):
    name: str
    warmed: bool  # an eager pass has run on the capture stream: the executor's later captures skip theirs

    def warmup(self, fn) -> None: ...

    def begin(self) -> None: ...

    def end(self) -> Graph: ...

    def synchronize(self) -> None: ...

    def abort(self) -> None:
        """End a capture that failed part-way."""

    # `pool`: the memory pool id the next begin() captures into (set by a MemoryStrategy)
