"""What one measured row says: its status, its fields, and the exit code a set of rows earns."""
from __future__ import annotations

from enum import StrEnum

from gmtool.modes import GraphMode


class Status(StrEnum):
    """Ordered by severity: a bucket's summary shows the worst status of its rows."""

    OK = "ok"
    SKIPPED = "skipped"  # not run: an earlier failure of the same mode, or a mode that does not apply
    ERROR = "error"
    OOM = "oom"
    UNSAFE = "UNSAFE"  # the replay differs from eager: it gets no latency and no speedup

    @property
    def severity(self) -> int:
        return list(Status).index(self)

    @property
    def failed(self) -> bool:
        """The run could not measure it (exit code 1)."""
        return self in (Status.ERROR, Status.OOM)

    @property
    def style(self) -> str:
        return _STYLE[self]


_STYLE = {Status.OK: "green", Status.SKIPPED: "yellow", Status.ERROR: "red", Status.OOM: "red",
          Status.UNSAFE: "bold red"}


def style_of(status: str) -> str:
    """Rich style of a status; yellow for one outside a sweep's (memreport's "unavailable")."""
    return _STYLE.get(status, "yellow")


def worst(statuses) -> Status:
    return max((Status(s) for s in statuses), key=lambda s: s.severity, default=Status.OK)


RECORD_FIELDS = ("mode", "bucket", "key", "composition", "num_tokens", "num_seqs", "status", "impl",
                 "piecewise_impl", "max_rel_err", "tolerance", "max_rel_err_same_shape", "tolerance_same_shape",
                 "kv_rel_err", "kv_rel_err_same_shape", "stale_metadata", "capture_s", "compile_s",
                 "graph_mem_bytes", "pool_growth_bytes", "outside_pool_bytes", "pieces", "runners", "latency_ms",
                 "eager_latency_ms", "speedup", "host_us", "host_copy_us", "host_steady_us", "captured_with", "error")


def record(base: dict, mode: str, status: Status, **kw) -> dict:
    rec = dict.fromkeys(RECORD_FIELDS)
    rec.update(base)
    rec.update(mode=mode, status=status, **kw)
    return rec


def unexpected_unsafe(records: list[dict]) -> list[dict]:
    """UNSAFE rows of modes that should be safe (full-narrow's are the finding it exists to show)."""
    return [r for r in records if r["status"] == Status.UNSAFE and not GraphMode(r["mode"]).expected_unsafe]


def exit_code(records: list[dict], errors: list[str]) -> int:
    """0 ok; 1 a mode failed or ran out of memory somewhere; 3 a replay that should be safe differed from eager."""
    if errors or any(Status(r["status"]).failed for r in records):
        return 1
    return 3 if unexpected_unsafe(records) else 0
